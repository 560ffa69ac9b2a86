"""The engine check: drafters trained here, exported with `scripts/export.py format=gguf`, served by
the pinned llama.cpp's llama-server with the command the export prints, and compared with
draftsmith's own decoding of the same verifier in fp32:

- llama.cpp's greedy output, with and without each drafter, equals draftsmith's plain decoding,
  token for token, on every prompt;
- llama.cpp's drafted and accepted counts (timings.draft_n / draft_n_accepted) equal what
  draftsmith's decoder drafts and accepts with the same drafter and a chain of the same length,
  per prompt, once the drafts llama.cpp shortens at the length limit are counted as it does
  (it drafts min(n_max, tokens left - 1));
- deliberately wrong EAGLE-3 exports (capture layers off by one; d2t as offsets where llama.cpp
  reads absolute target ids) fail that comparison.

Kinds: EAGLE-3 with the default capture layers, its own reduced head and a d2t map; EAGLE-3 with
other layers, norm_before_residual=true and the verifier's head; a draft model (draft-simple).
The drafters are trained for a few steps on the verifier's own greedy answers to the prompts
(self-distillation, as after a verifier fine-tune), so that they get drafts accepted.

llama.cpp is built (or a finished build reused) by scripts/engines/llamacpp_build.py, as
scripts/install.sh does; a failed build fails these tests with its reason.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import draftsmith.models.gguf as gguf_export
from draftsmith.decode.build import proposer_for
from draftsmith.decode.engine import generate
from draftsmith.decode.harness import prompt_ids
from draftsmith.models.checkpoint import load_drafter
from draftsmith.models.sources import load_prompts
from draftsmith.models.verifier import load_verifier
from scripts.engines.llamacpp import LlamaServer
from scripts.engines.llamacpp_build import ensure_built
from scripts.export import run as export
from tests.engines.conftest import model_overrides
from tests.hub import compose_config

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

N_DRAFT = 3  # llama-server --spec-draft-n-max, and draftsmith's chain length
NEW_TOKENS = 32
CHAIN = {"eagle": {"name": "chain3", "paths": [[0] * d for d in range(1, N_DRAFT + 1)], "draft_quant": "none"},
         "draft": {"name": "chain3", "proposer": "draft", "num_tokens": N_DRAFT, "tree_topk": [],
                   "length_schedule": "fixed", "min_tokens": N_DRAFT, "max_tokens": N_DRAFT, "confidence": 0.0,
                   "draft_vocab": "full", "draft_quant": "none"}}
KINDS = {  # name -> (trainer, overrides): each trained a few steps on the verifier's own answers
    "eagle3": ("eagle", ["method=eagle3", "method.draft_vocab_size=64", "trainer.max_steps=40"]),
    "eagle3-nbr": ("eagle", ["method=eagle3", "method.fusion_layers=[0,3,6]", "method.norm_before_residual=true",
                             "method.lm_head=gathered", "method.draft_vocab_size=64", "trainer.max_steps=40"]),
    "eagle3-shared": ("eagle", ["method=eagle3", "method.lm_head=shared", "method.draft_vocab_size=null",
                                "method.fc_init=passthrough", "trainer.max_steps=2"]),
    "draft": ("draft", ["method=draft-fkl", "method.student.num_layers=6", "trainer.max_steps=2"]),
}
MIN_ACCEPTED = {"eagle3-shared": 0.05}  # accepted / drafted below which a comparison would mean little (else 0.2)


@pytest.fixture(scope="module")
def server_binary() -> Path:
    return ensure_built()  # reuses a finished build; else builds (~10 min), failing with the reason


@pytest.fixture(scope="module")
def setup(llamacpp_verifier, tmp_path_factory):
    """The verifier, the prompts (as ids), its greedy answers written as training data."""
    root = tmp_path_factory.mktemp("llamacpp")
    verifier = load_verifier(compose_config("eagle", model_overrides(llamacpp_verifier)).model)
    prompts = load_prompts(OmegaConf.merge(compose_config("eagle", ["data=tiny"]).data, {"eval_size": 0}))
    ids = [prompt_ids(verifier.tokenizer, p["messages"]) for p in prompts]
    plain = [generate(verifier.model, x, max_new_tokens=NEW_TOKENS, eos_token_id=()).tokens for x in ids]
    (root / "data").mkdir()
    with open(root / "data" / "records.jsonl", "w") as f:
        for p, out in zip(prompts, plain):
            answer = verifier.tokenizer.decode(out)
            assert verifier.tokenizer.encode(answer) == out  # words only: the text round-trips
            f.write(json.dumps({"id": p["id"], "messages": p["messages"] + [
                {"role": "assistant", "content": answer}]}) + "\n")
    return {"root": root, "verifier": verifier, "dir": llamacpp_verifier, "ids": ids, "plain": plain}


def train_and_export(setup, name: str) -> tuple[Path, dict]:
    from draftsmith.train.draft import run as train_draft
    from draftsmith.train.eagle import run as train_eagle

    trainer, overrides = KINDS[name]
    root = setup["root"]
    cfg = compose_config(trainer, model_overrides(setup["dir"]) + [
        "data=chat-jsonl", f"data.path={root / 'data'}", "data.eval_size=1", "trainer=debug", "trainer.batch_size=12",
        "trainer.eval_every=1000", "trainer.save_every=1000", "logger=csv", "probe.num_prompts=0",
        f"output_dir={root / name}", *overrides])
    summary = (train_eagle if trainer == "eagle" else train_draft)(cfg)
    out = export(compose_config("export", model_overrides(setup["dir"]) + [
        f"drafter={summary['drafter_dir']}", "format=gguf", "dtype=float32", f"output_dir={root / (name + '-gguf')}"]))
    return Path(summary["drafter_dir"]), out


def draftsmith_counts(setup, drafter_dir: Path) -> list[dict]:
    """Per prompt: draftsmith's tokens with a chain of N_DRAFT, and what llama.cpp, which drafts
    min(N_DRAFT, left - 1) tokens with `left` tokens still to generate, drafts and accepts."""
    verifier = setup["verifier"]
    drafter = load_drafter(drafter_dir)
    rows = []
    for x in setup["ids"]:
        proposer = proposer_for(drafter, verifier, OmegaConf.create(CHAIN[drafter.kind]))
        out = generate(verifier.model, x, proposer=proposer, max_new_tokens=NEW_TOKENS, eos_token_id=())
        emitted, drafted, accepted = 1, 0, 0  # the prefill's token
        for step in out.steps:
            assert step.num_nodes == N_DRAFT + 1, "draftsmith drafted a chain of another length"
            n = min(N_DRAFT, NEW_TOKENS - emitted - 1)
            if n > 0:
                drafted, accepted = drafted + n, accepted + min(step.accepted, n)
            emitted += step.emitted
        rows.append({"tokens": out.tokens, "draft_n": drafted, "draft_n_accepted": accepted})
    return rows


def serve(command: str, log: Path) -> LlamaServer:
    """A LlamaServer running `command` as the export prints it, on a free port instead of 8080, with one
    thread that sleeps while it waits (--poll 0: spinning threads crawl on a box the other test worker
    shares)."""
    words = shlex.split(command)
    for flag in ("--host", "--port"):
        i = words.index(flag)
        del words[i:i + 2]
    return LlamaServer(words + ["-t", "1", "--poll", "0"] + (["--poll-draft", "0"] if "-md" in words else []),
                       log=log)


def llamacpp_rows(server: LlamaServer, setup) -> list[dict]:
    with server:
        result = server.run([x[0].tolist() for x in setup["ids"]], NEW_TOKENS)
    return [{"tokens": c.tokens, "draft_n": c.draft_n, "draft_n_accepted": c.draft_n_accepted}
            for c in result.completions]


@pytest.fixture(scope="module")
def exported(setup, server_binary):
    """name -> (drafter folder, the export's result, draftsmith's rows: draftsmith_counts)."""
    out = {}
    for name in KINDS:
        drafter_dir, result = train_and_export(setup, name)
        out[name] = (drafter_dir, result, draftsmith_counts(setup, drafter_dir))
    return out


def test_plain_llamacpp_equals_draftsmith_plain(setup, exported, tmp_path):
    words = shlex.split(exported["eagle3"][1]["serve"])  # the export's command without its drafter
    for flag in ("-md", "--spec-type", "--spec-draft-n-max", "-ctkd", "-ctvd"):
        i = words.index(flag)
        del words[i:i + 2]
    rows = llamacpp_rows(serve(shlex.join(words), tmp_path / "server.log"), setup)
    assert [r["tokens"] for r in rows] == setup["plain"]
    assert all(r["draft_n"] == 0 for r in rows)


@pytest.mark.parametrize("name", list(KINDS))
def test_llamacpp_speculates_as_draftsmith_does(setup, exported, tmp_path, name):
    _, out, ours = exported[name]
    assert [r["tokens"] for r in ours] == setup["plain"]  # draftsmith's own decoding is lossless
    accepted, drafted = sum(r["draft_n_accepted"] for r in ours), sum(r["draft_n"] for r in ours)
    assert accepted >= MIN_ACCEPTED.get(name, 0.2) * drafted, (
        f"{accepted} of {drafted} drafts accepted: too few for the comparison to mean anything")
    if name == "eagle3-shared":  # no head of its own: llama.cpp projects with the verifier's lm_head
        from gguf import GGUFReader

        tensors = {t.name for t in GGUFReader(str(Path(out["output_dir"]) / "drafter.gguf")).tensors}
        assert "output.weight" not in tensors and "d2t" not in tensors and "fc.weight" in tensors
    theirs = llamacpp_rows(serve(out["serve"], tmp_path / "server.log"), setup)
    assert [r["tokens"] for r in theirs] == setup["plain"]
    assert [(r["draft_n"], r["draft_n_accepted"]) for r in theirs] == \
        [(r["draft_n"], r["draft_n_accepted"]) for r in ours]


@pytest.mark.parametrize("mistake", ["layers-1", "layers+1", "d2t-offsets"])
def test_a_wrong_eagle3_export_fails_the_check(setup, exported, tmp_path, monkeypatch, mistake):
    """The same drafter written wrongly: the comparison above must see it."""
    import dataclasses

    drafter_dir, out, ours = exported["eagle3"]
    _, module, config, _ = load_drafter(drafter_dir)
    if mistake.startswith("layers"):
        shift = -1 if mistake == "layers-1" else 1  # -1: our own output indices, without llama.cpp's + 1
        config = dataclasses.replace(config, fusion_layers=[i + shift for i in config.fusion_layers])
    else:
        right = gguf_export.eagle3_tensors

        def offsets(module, config, lm_head):
            t = right(module, config, lm_head)
            t["d2t"] = module.d2t.clone()  # draftsmith's offsets, where llama.cpp reads absolute ids
            return t

        monkeypatch.setattr(gguf_export, "eagle3_tensors", offsets)
    gguf = Path(out["output_dir"])
    wrong = tmp_path / "drafter.gguf"
    gguf_export.write_eagle3(wrong, module.float(), config, gguf / "verifier.gguf", "f32")
    command = out["serve"].replace(str(gguf / "drafter.gguf"), str(wrong))
    theirs = llamacpp_rows(serve(command, tmp_path / "server.log"), setup)
    assert [r["tokens"] for r in theirs] == setup["plain"]  # still lossless: only the drafts are wrong
    assert [r["draft_n_accepted"] for r in theirs] != [r["draft_n_accepted"] for r in ours]


ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "serve-llamacpp.md"


def page_commands() -> list[str]:
    import re

    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.S)
    return [c for b in blocks for c in b.splitlines() if c.strip() and not c.lstrip().startswith("#")]


def test_the_pages_commands_run(setup, server_binary, tmp_path, monkeypatch):
    """Every command of docs/serve-llamacpp.md, in order, as typed, on the tiny verifier: the
    entry scripts with the overrides that point them at it (model.path, its self-distilled data,
    trainer=debug), llama-server on a free port, curl at that port; outputs/ in a scratch folder."""
    import importlib
    import os
    import subprocess
    import sys

    from tests.commands import entry_config

    monkeypatch.chdir(tmp_path)
    tiny = [f"model.path={setup['dir']}", "model.source=hf", "model.dtype=float32"]
    train = tiny + ["data=chat-jsonl", f"data.path={setup['root'] / 'data'}", "data.eval_size=1", "trainer=debug",
                    "trainer.max_steps=1", "trainer.eval_every=1000", "trainer.save_every=1000", "logger=csv",
                    "probe.num_prompts=0"]
    extra = {"train/eagle.py": train + ["method.draft_vocab_size=64"], "train/draft.py": train,
             "scripts/export.py": tiny}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server, ran = None, []
    try:
        for command in page_commands():
            words = [os.path.expanduser(w) for w in shlex.split(command)]
            if words[:3] == ["python", "-m", "pytest"]:
                assert words[3:] == ["-q", "-m", "", "tests/engines"]  # this very test's folder, heavy tests included
                continue
            if words[:2] == ["python", "-m"]:
                proc = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, env=env)
                assert proc.returncode == 0, f"{command}: {proc.stderr[-1500:]}"
            elif words[0] == "python":
                name = entry_config(words[1])
                script = words[1].removesuffix(".py").replace("/", ".")  # train.eagle -> draftsmith.train.eagle
                module = importlib.import_module(script if script.startswith("scripts.") else "draftsmith." + script)
                module.run(compose_config(name, words[2:] + extra[words[1]]))
            elif words[0].endswith("llama-server"):
                assert words[0] == str(server_binary)
                server = serve(shlex.join(words), tmp_path / "server.log").__enter__()
            elif words[0] == "curl":
                assert server is not None, "the page runs curl before starting llama-server"
                url = words.index("http://127.0.0.1:8080/completion")
                words[url] = f"{server.url}/completion"
                proc = subprocess.run(words, capture_output=True, text=True, timeout=120)
                res = json.loads(proc.stdout)
                assert res["tokens_predicted"] == 32 and res["timings"]["draft_n"] > 0, res
            else:
                raise AssertionError(f"{PAGE.name}: no rule to run {command!r}")
            ran.append(words[0] if words[0] != "python" else " ".join(words[:2]))
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    assert (tmp_path / "outputs" / "export" / "eagle3-gguf" / "drafter.gguf").is_file()
    assert (tmp_path / "outputs" / "export" / "draft-gguf" / "drafter.gguf").is_file()
    assert "curl" in ran and any(r.endswith("llama-server") for r in ran), ran


def test_bench_peers_times_llamacpp_beside_draftsmith(setup, exported, tmp_path):
    """scripts/bench/bench_peers.py with llama.cpp's rows (vLLM off): plain in f32, the EAGLE-3 and the draft
    model exported to GGUF, its n-gram proposer, at one and two concurrent requests; each text equals
    llama.cpp's plain text, the EAGLE-3 row's acceptance equals what draftsmith's chain accepts, speedups
    are quoted against the fastest plain decoding, and a Medusa the export refuses is a row saying why."""
    from draftsmith.models.checkpoint import save_drafter
    from draftsmith.models.medusa import MedusaConfig, MedusaHeads
    from draftsmith.models.verifier import fingerprint
    from scripts.bench.bench_peers import run as bench

    model = setup["verifier"].model
    heads_cfg = MedusaConfig(hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size, num_heads=4)
    medusa = save_drafter(tmp_path / "medusa", "medusa", MedusaHeads(heads_cfg, model.get_output_embeddings()),
                          heads_cfg, verifier_fingerprint=fingerprint(model), verifier_name="words")
    drafters = {"eagle3": exported["eagle3"][0], "draft": exported["draft"][0], "medusa": medusa}
    report = bench(compose_config("bench_peers", model_overrides(setup["dir"]) + [
        "data=tiny", "data.num_prompts=2", f"max_new_tokens={NEW_TOKENS}", "threads=1", "vllm=false",
        "draftsmith_batch=false", f"k={N_DRAFT}", "llamacpp.dtypes=[float32]", "llamacpp.clients=[1,2]",
        "llamacpp.threads=1", "llamacpp.poll=0", "drafters={" + ", ".join(f"{k}: {v}" for k, v in drafters.items()) + "}",
        f"output_dir={tmp_path / 'bench'}"]))
    rows = {(r["engine"], r["row"], r["batch"]): r for r in report["rows"]}
    ours = {(r["engine"], r["row"]) for r in report["rows"] if r["engine"] == "draftsmith"}
    assert ("draftsmith", "plain") in ours
    lc = {k: r for k, r in rows.items() if k[0].startswith("llama.cpp")}
    assert {(k[1], k[2]) for k in lc} == {(row, n) for row in ("plain", "+ eagle3", "+ draft", "ngram-simple")
                                          for n in (1, 2)} | {("+ medusa", 1)}
    assert "export refused" in lc[("llama.cpp (f32)", "+ medusa", 1)]["error"]
    for k, r in lc.items():
        if "error" not in r:
            assert r["same_text"], k  # every llama.cpp row writes llama.cpp's plain text
    ref = exported["eagle3"][2]
    assert lc[("llama.cpp (f32)", "+ eagle3", 1)]["draft_n_accepted"] == sum(r["draft_n_accepted"] for r in ref[:2])
    best = max((r for r in report["rows"] if r["row"] == "plain" and r["batch"] == 1), key=lambda r: r["tokens_per_s"])
    assert best["speedup"] == 1.0
    assert all(r["vs"] == f"{best['engine']} plain" for r in report["rows"] if r["batch"] == 1 and "speedup" in r)
    assert "llama.cpp (f32)" in (tmp_path / "bench" / "bench_peers.md").read_text()


@pytest.mark.parametrize("override, message", [
    ("llamacpp.dtypes=[int4]", r"llamacpp.dtypes=\['int4'\]: give float32, bfloat16"),
    ("llamacpp.clients=[0]", r"llamacpp.clients=\[0\]: give concurrencies >= 1"),
    ("+llamacpp.spin=1", r"llamacpp.spin: not a key of llamacpp"),
])
def test_bench_peers_refuses_bad_llamacpp_settings(llamacpp_verifier, tmp_path, override, message):
    from draftsmith.models.errors import DraftsmithError
    from scripts.bench.bench_peers import run as bench

    with pytest.raises(DraftsmithError, match=message):
        bench(compose_config("bench_peers", model_overrides(llamacpp_verifier) + [override, f"output_dir={tmp_path}"]))
