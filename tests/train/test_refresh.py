"""The drafter-refresh loop on tiny models: the probe recorded at training, a verifier
fine-tuned on skewed data (scripts/finetune_verifier.py) that makes the old drafter lose tau,
scripts/refresh.py detecting it and recovering it, warm starts without optimizer state, and a
killed refresh that resumes to the uninterrupted result."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from draftsmith.decode import probe as probes
from draftsmith.models.checkpoint import load_drafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.verifier import load_verifier
from draftsmith.train.core.loop import carry_vocab_rows, load_train_data, warm_start
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config
from tests.tiny import tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"test_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


refresh, finetune, selfdistill = script("refresh"), script("finetune_verifier"), script("generate_selfdistill")
SKEW = "the cat sat on the mat. " * 3  # what the fine-tuned verifier learns to answer


def medusa_overrides(root: Path, model_dir: Path) -> list[str]:
    return tiny_model_overrides(model_dir) + [
        "data=selfdistill", f"data.path={root}/sd0", "data.eval_size=3", "trainer=debug", "trainer.max_steps=40",
        "trainer.batch_size=4", "trainer.eval_every=20", "trainer.save_every=10", "logger=none", "method.num_heads=2",
        "probe.num_prompts=3", "probe.max_new_tokens=24"]


@pytest.fixture(scope="module")
def loop_dirs(tmp_path_factory):
    """v0 (a tiny verifier), sd0 (its self-distilled answers), m0 (Medusa heads trained on them,
    with their probe), ft (v0 fully fine-tuned on one skewed answer), and the refresh of m0 for ft."""
    root = tmp_path_factory.mktemp("refresh-loop")
    v0 = root / "v0"
    tiny_llama(dtype=torch.float32).save_pretrained(v0)
    tiny_tokenizer().save_pretrained(v0)
    ov = tiny_model_overrides(v0)
    selfdistill.run(compose_config("selfdistill", ov + [
        "data@data.prompts=tiny", "num_prompts=12", "max_new_tokens=24", "batch_size=12", f"output_dir={root}/sd0",
        f"data.path={root}/sd0"]))
    from draftsmith.train.medusa import run as medusa

    medusa(compose_config("medusa", medusa_overrides(root, v0) + [f"output_dir={root}/m0"]))
    (root / "skew.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": SKEW}]}) + "\n"
        for i in range(24)))
    finetune.run(compose_config("finetune_verifier", ov + [
        "data=chat-jsonl", f"data.path={root}/skew.jsonl", "data.eval_size=2", "data@drift.data=tiny",
        "drift.num_conversations=4", "trainer=debug", "trainer.max_steps=30", "trainer.batch_size=8",
        "trainer.eval_every=30", "trainer.save_every=30", "trainer.lr=3e-3", "method.backbone=full", "logger=none",
        f"output_dir={root}/ft"]))
    report = refresh.run(compose_config("refresh", refresh_overrides(root)))
    return {"root": root, "v0": v0, "m0": root / "m0" / "final", "ft": root / "ft" / "final", "report": report}


def refresh_overrides(root: Path, out: str = "refresh", *extra: str) -> list[str]:
    return tiny_model_overrides(root / "v0") + [f"model.path={root}/ft/final", f"drafter={root}/m0/final",
                                                 f"output_dir={root}/{out}", "budget.steps=40", *extra]


def test_the_probe_is_recorded_at_training_on_held_out_prompts(loop_dirs):
    m0, v0 = loop_dirs["m0"], loop_dirs["v0"]
    probe = probes.read_probe(m0)
    cfg = OmegaConf.load(m0 / "config.yaml")
    verifier = load_verifier(cfg.model)
    held_out = load_train_data(cfg, verifier.tokenizer).eval
    assert probe["prompts"] == probes.probe_prompts(held_out, 3) and len(probe["prompts"]) == 3
    tok = verifier.tokenizer
    assert all(tok.decode(p).endswith("<|im_start|>assistant\n") for p in probe["prompts"])  # the generation prompt
    assert probe["verifier_fingerprint"] == verifier.fingerprint == json.loads((m0 / "meta.json").read_text())[
        "verifier_fingerprint"]
    assert (probe["max_new_tokens"], probe["decode"]["name"], probe["dtype"]) == (24, "medusa-cpu, paths cut to 2 heads", "torch.float32")
    assert all(len(p) <= 2 for p in probe["decode"]["paths"])  # the auto tree is cut to the drafter's 2 heads
    again = probes.measure(verifier, load_drafter(m0), OmegaConf.create(probe["decode"]), probe["prompts"], 24)
    assert again["tau"] == probe["tau"] > 1.2 and again["per_prompt_tau"] == probe["per_prompt_tau"]
    assert str(v0) in cfg.model.path


@pytest.mark.parametrize("config, extra", [
    ("eagle", ["method=eagle3", "method.fusion_layers=[0,1,1]", "method.draft_vocab_size=48"]),
    ("draft", ["method.student.num_layers=1"]),
])
def test_every_trainer_records_a_probe(tiny_model_dir, tmp_path, config, extra):
    import importlib

    run = importlib.import_module(f"draftsmith.train.{config}").run
    summary = run(compose_config(config, tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "logger=none", f"output_dir={tmp_path}", "probe.num_prompts=2",
        "probe.max_new_tokens=8", *extra]))
    probe = probes.read_probe(summary["drafter_dir"])
    assert len(probe["prompts"]) == 2 and probe["tau"] == summary["probe_tau"] >= 1.0
    assert probe["decode"]["name"] == {"eagle": "eagle-dynamic", "draft": "draft-chain"}[config]


def test_a_short_run_gets_a_short_probe_that_shows_progress_and_its_time(tiny_model_dir, tmp_path, capfd):
    """probe.num_prompts=auto: 16 prompts for 100+ steps, fewer in proportion, at least 2; the probe
    says how to turn it off, shows prompts done and tok/s, and its time is in the end line."""
    from draftsmith.train.medusa import run as medusa

    assert [probes.probe_size("auto", n) for n in (1, 3, 20, 50, 100, 5000)] == [2, 2, 3, 8, 16, 16]
    assert probes.probe_size(5, 3) == 5 and probes.probe_size(0, 5000) == 0  # an explicit size is kept
    summary = medusa(compose_config("medusa", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "data.eval_size=5", "trainer=debug", "logger=none", f"output_dir={tmp_path}",
        "method.num_heads=2", "probe.max_new_tokens=8"]))
    out, err = capfd.readouterr()
    assert len(probes.read_probe(summary["drafter_dir"])["prompts"]) == 2  # 3 debug steps: the smallest probe
    assert "probe: decoding 2 held-out prompts x 8 tokens" in out and "probe.num_prompts=0: no probe" in out
    assert "2/2" in err and "tok/s" in err  # the progress bar: prompts done, tokens per second
    end = next(line for line in out.splitlines() if " done: 3 steps in " in line)
    assert f"probe tau {summary['probe_tau']:.2f} in " in end and summary["probe_s"] >= 0


def test_a_bad_probe_setting_is_refused_before_training(tiny_model_dir, tmp_path):
    from draftsmith.train.medusa import run as medusa

    base = tiny_model_overrides(tiny_model_dir) + ["data=tiny", "trainer=debug", "logger=none", f"output_dir={tmp_path}"]
    with pytest.raises(DraftsmithError, match=r"probe.decode='nope': no conf/decode/nope.yaml; valid: auto, "):
        medusa(compose_config("medusa", base + ["probe.decode=nope"]))
    with pytest.raises(DraftsmithError, match=r"probe.max_new_tokens=1: an integer >= 2"):
        medusa(compose_config("medusa", base + ["probe.max_new_tokens=1"]))
    with pytest.raises(DraftsmithError, match=r"probe.num_prompts=-1: an integer >= 0"):
        medusa(compose_config("medusa", base + ["probe.num_prompts=-1"]))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "final").exists()


@pytest.mark.parametrize("config, field", [("eagle", "trainer.init_from"), ("medusa", "method.init_heads")])
def test_a_warm_start_from_a_missing_folder_is_refused_before_any_loading(tiny_model_dir, tmp_path, monkeypatch,
                                                                          config, field):
    from draftsmith.train import core, eagle, medusa

    monkeypatch.setattr(core.loop, "load_verifier", lambda *a, **k: pytest.fail("loaded the verifier first"))
    extra = ["method=medusa2"] if field == "method.init_heads" else []
    cfg = compose_config(config, tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "logger=none", f"output_dir={tmp_path}", *extra, f"{field}={tmp_path / 'nope'}"])
    with pytest.raises(DraftsmithError, match=rf"^{field}=.*nope: no such folder; pass a trained drafter's folder"):
        {"eagle": eagle, "medusa": medusa}[config].run(cfg)


def test_the_fine_tune_moves_the_verifier_and_records_how_far(loop_dirs):
    info = json.loads((loop_dirs["ft"] / "finetune.json").read_text())
    tuned = load_verifier(OmegaConf.create({"name": "ft", "source": "hf", "path": str(loop_dirs["ft"]),
                                            "dtype": "float32"}))
    assert tuned.fingerprint == info["fingerprint"] != info["original"]["fingerprint"]
    assert info["metrics"]["eval/drift_kl"] > 0.1 and info["metrics"]["eval/drift_greedy_agreement"] < 0.5
    ids = tuned.tokenizer.apply_chat_template([{"role": "user", "content": "question 99?"}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
    original = load_verifier(OmegaConf.create({"name": "v0", "source": "hf", "path": str(loop_dirs["v0"]),
                                               "dtype": "float32"}))
    answers = [v.tokenizer.decode(v.model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:])
               for v in (tuned, original)]
    assert set(answers[0]) <= set(SKEW) and not set(answers[1]) <= set(SKEW)  # it speaks the skewed answer's letters


def test_refresh_detects_the_drop_and_recovers(loop_dirs):
    report, ft = loop_dirs["report"], loop_dirs["ft"]
    recorded, dropped = report["recorded"]["tau"], report["old_on_new"]["tau"]
    assert report["fingerprints"]["recorded"] != report["fingerprints"]["new"]
    assert dropped < 0.9 * recorded  # the fine-tune cost the old drafter its acceptance
    assert report["refreshed"]["tau"] > dropped + 0.5 and report["refreshed"]["tau"] >= recorded  # recovered
    assert report["scratch"]["tau"] > dropped and report["refreshed"]["steps"] == report["scratch"]["steps"] == 40
    new = Path(report["refreshed"]["drafter"])
    meta = json.loads((new / "meta.json").read_text())
    tuned_fp = json.loads((ft / "finetune.json").read_text())["fingerprint"]
    assert meta["verifier_fingerprint"] == tuned_fp  # the new drafter belongs to the new verifier
    assert meta["refreshed_from"]["drafter"] == str(loop_dirs["m0"]) and meta["warm_start"]["path"] == str(
        loop_dirs["m0"])
    assert meta["refreshed_from"]["tau_old_on_new"] == dropped
    assert json.loads((Path(report["scratch"]["drafter"]) / "meta.json").read_text())["warm_start"] is None
    records = [json.loads(x) for x in (loop_dirs["root"] / "refresh" / "data" / "selfdistill" /
                                       "records.jsonl").read_text().splitlines()]
    assert records and all(set(r["messages"][-1]["content"]) <= set(SKEW) for r in records)  # the NEW verifier's
    assert probes.read_probe(new)["verifier_fingerprint"] == tuned_fp  # its own baseline for the next refresh
    # the re-generated data holds out the same prompts: the probe is never trained on
    old_probe = probes.read_probe(loop_dirs["m0"])["prompts"]
    assert probes.read_probe(new)["prompts"] == old_probe
    new_cfg = OmegaConf.load(new / "config.yaml")
    train_split = load_train_data(new_cfg, load_verifier(new_cfg.model).tokenizer).train
    trained = {tuple(p) for p in probes.probe_prompts(train_split, len(train_split))}
    assert trained and not trained & {tuple(p) for p in old_probe}
    assert "| refreshed (warm start) | new |" in (loop_dirs["root"] / "refresh" / "report.md").read_text()


def test_check_only_stops_after_the_report_and_no_drift_refreshes_nothing(loop_dirs, capsys):
    root = loop_dirs["root"]
    report = refresh.run(compose_config("refresh", refresh_overrides(root, "check", "check_only=true")))
    assert report["old_on_new"]["tau"] == loop_dirs["report"]["old_on_new"]["tau"]  # greedy: the same measurement
    assert not (root / "check" / "refreshed").exists() and not (root / "check" / "data").exists()
    same = refresh.run(compose_config("refresh", tiny_model_overrides(root / "v0") + [
        f"drafter={root}/m0/final", f"output_dir={root}/same"]))
    assert same["old_on_new"]["tau"] == same["recorded"]["tau"] and not (root / "same" / "refreshed").exists()
    assert "no refresh needed" in capsys.readouterr().out
    with pytest.raises(DraftsmithError, match=r"output_dir=.* holds the refresh of .* for verifier .* pass a new "
                                              r"output_dir="):  # a report measured for another verifier is not reused
        refresh.run(compose_config("refresh", tiny_model_overrides(root / "v0") + [
            f"drafter={root}/m0/final", f"output_dir={root}/refresh", "check_only=true"]))
    with pytest.raises(DraftsmithError, match=r"model.dtype=bfloat16: the probe of .* was recorded with a "
                                              r"torch.float32 verifier.*drop model.dtype="):
        refresh.run(compose_config("refresh", refresh_overrides(root, "bf16", "model.dtype=bfloat16",
                                                                "check_only=true")))


def test_no_refresh_needed_leaves_a_drafter_that_evaluate_accepts_for_the_new_verifier(loop_dirs, tmp_path, capsys):
    """A verifier changed a little (noise on its last MLP: a new fingerprint, the same acceptance):
    refresh says no refresh is needed and writes output_dir/checked, the same weights stamped for
    the new verifier, which evaluate accepts with no override (the old folder it refuses)."""
    from draftsmith.decode.evaluate import run as evaluate

    root, m0 = loop_dirs["root"], loop_dirs["m0"]
    noisy = tmp_path / "v0-noise"
    model = load_verifier(OmegaConf.create({"name": "v0", "source": "hf", "path": str(root / "v0"),
                                            "dtype": "float32"})).model
    torch.manual_seed(0)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight.add_(1e-4 * torch.randn_like(model.model.layers[-1].mlp.down_proj.weight))
    model.save_pretrained(noisy)
    tiny_tokenizer().save_pretrained(noisy)
    check = refresh.run(compose_config("refresh", tiny_model_overrides(root / "v0") + [
        f"model.path={noisy}", f"drafter={m0}", f"output_dir={tmp_path}/check", "check_only=true"]))
    assert check["outcome"]["drafter"] is None and not (tmp_path / "check" / "checked").exists()  # check_only writes none
    report = refresh.run(compose_config("refresh", tiny_model_overrides(root / "v0") + [
        f"model.path={noisy}", f"drafter={m0}", f"output_dir={tmp_path}/refresh", "budget.steps=4"]))
    out = capsys.readouterr().out
    assert report["fingerprints"]["recorded"] != report["fingerprints"]["new"] and "no refresh needed" in out
    checked = tmp_path / "refresh" / "checked"
    assert report["outcome"]["drafter"] == str(checked) and not (tmp_path / "refresh" / "refreshed").exists()
    assert f"next: python decode/evaluate.py drafter={checked} model.name=tiny model.source=hf model.path={noisy} "\
           "model.dtype=float32" in out
    old, new = load_file(str(m0 / "model.safetensors")), load_file(str(checked / "model.safetensors"))
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)  # the same weights
    meta = json.loads((checked / "meta.json").read_text())
    assert meta["verifier_fingerprint"] == report["fingerprints"]["new"]
    assert meta["checked_from"]["drafter"] == str(m0) and meta["checked_from"]["tau_on_new"] == report["old_on_new"]["tau"]
    probe = probes.read_probe(checked)  # the next refresh's baseline: measured on the new verifier
    assert probe["verifier_fingerprint"] == report["fingerprints"]["new"] and probe["tau"] == report["old_on_new"]["tau"]
    assert probe["prompts"] == probes.read_probe(m0)["prompts"]
    base = tiny_model_overrides(noisy) + ["proposer=medusa", "decode=chain4", "decode.paths=[[0],[0,0]]", "data=tiny",
                                          "data.num_prompts=2",
                                          "max_new_tokens=8", "hf.enabled=false"]
    with pytest.raises(DraftsmithError, match="was trained against verifier"):
        evaluate(compose_config("evaluate", base + [f"drafter={m0}", f"output_dir={tmp_path}/old"]))
    result = evaluate(compose_config("evaluate", base + [f"drafter={checked}", f"output_dir={tmp_path}/eval"]))
    assert result["methods"]["medusa"]["greedy_identity_rate"] == 1.0
    assert "no refresh needed: the same weights, stamped for the new verifier" in (
        tmp_path / "refresh" / "report.md").read_text()


def test_a_fingerprint_mismatch_stops_evaluate_in_one_line(loop_dirs, tmp_path):
    from draftsmith.decode.evaluate import run as evaluate

    cfg = compose_config("evaluate", tiny_model_overrides(loop_dirs["ft"]) + [
        f"drafter={loop_dirs['m0']}", "proposer=medusa", "decode=medusa-cpu", "data=tiny", f"output_dir={tmp_path}"])
    with pytest.raises(DraftsmithError, match=r"was trained against verifier .* refresh it for this verifier "
                                              r"\(python scripts/refresh.py drafter=") as e:
        evaluate(cfg)
    assert "\n" not in str(e.value)


def test_warm_start_loads_weights_but_not_the_optimizer_state(loop_dirs, tmp_path):
    from draftsmith.train.medusa import run as medusa

    root, m0 = loop_dirs["root"], loop_dirs["m0"]
    ov = medusa_overrides(root, loop_dirs["v0"]) + [f"trainer.init_from={m0}"]
    medusa(compose_config("medusa", ov + [f"output_dir={tmp_path}/zero", "trainer.max_steps=0"]))
    old, warm = load_file(str(m0 / "model.safetensors")), load_file(str(tmp_path / "zero" / "final" /
                                                                         "model.safetensors"))
    assert old.keys() == warm.keys() and all(torch.equal(old[k], warm[k]) for k in old)
    medusa(compose_config("medusa", ov + [f"output_dir={tmp_path}/one", "trainer.max_steps=1",
                                          "trainer.save_every=1"]))
    ckpt = tmp_path / "one" / "checkpoints" / "step-00000001"
    opt = torch.load(ckpt / "optimizer.bin", weights_only=False)
    assert {float(s["step"]) for s in opt["state"].values()} == {1.0}  # a fresh Adam: m0 had taken 40 steps
    with pytest.raises(DraftsmithError, match=r"trainer.init_from=.*does not fit this run's drafter .num_heads: "
                                              r"2 there, 3 here"):
        medusa(compose_config("medusa", ov + [f"output_dir={tmp_path}/bad", "method.num_heads=3"]))


def test_keep_vocab_false_carries_the_projection_rows_over_by_token():
    config = MedusaConfig(hidden_size=8, vocab_size=20, num_heads=1, lm_head="own", draft_vocab_size=4)
    old = MedusaHeads(config, token_map=torch.tensor([3, 5, 7, 9]))
    new = MedusaHeads(config, token_map=torch.tensor([9, 2, 3, 11]))
    torch.nn.init.normal_(old.lm_heads[0].weight)
    fresh = new.lm_heads[0].weight.detach().clone()
    state = carry_vocab_rows("medusa", old, new, old.state_dict())
    rows = state["lm_heads.0.weight"]
    assert torch.equal(state["token_map"], torch.tensor([9, 2, 3, 11]))
    assert torch.equal(rows[0], old.lm_heads[0].weight[3]) and torch.equal(rows[2], old.lm_heads[0].weight[0])
    assert torch.equal(rows[1], fresh[1]) and torch.equal(rows[3], fresh[3])  # new tokens keep their init
    with pytest.raises(DraftsmithError, match=r"trainer.keep_vocab=false .* applies only with trainer.init_from"):
        warm_start(None, new, "medusa", keep_vocab=False)
    full = MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=20, num_heads=1, lm_head="own"))
    with pytest.raises(DraftsmithError, match=r"trainer.keep_vocab=false: this run's medusa drafter predicts the "
                                              r"full vocabulary"):
        warm_start("somewhere", full, "medusa", keep_vocab=False)


@pytest.mark.slow
def test_a_killed_refresh_resumes_to_the_uninterrupted_result(loop_dirs):
    root = loop_dirs["root"]
    out = root / "killed"
    cmd = [sys.executable, "scripts/refresh.py", *refresh_overrides(root, "killed"), "scratch=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (out / "refreshed" / "checkpoints" / "step-00000010").is_dir():  # mid-training
        assert proc.poll() is None and time.time() < deadline, "the refresh ended before it could be killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "refreshed" / "final").exists()
    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resuming from" in rerun.stdout + rerun.stderr
    a = load_file(str(root / "refresh" / "refreshed" / "final" / "model.safetensors"))
    b = load_file(str(out / "refreshed" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "report.json").read_text())["refreshed"]["tau"] == loop_dirs["report"]["refreshed"]["tau"]


@pytest.mark.slow
@pytest.mark.heavy
def test_refresh_runs_under_accelerate_launch_on_two_processes(loop_dirs):
    root = loop_dirs["root"]
    cmd = ["accelerate", "launch", "--config_file", "conf/accelerate/cpu-2proc.yaml", "scripts/refresh.py",
           *refresh_overrides(root, "ddp")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "12 generated now by 2 process(es)" in done.stdout + done.stderr  # the data stage used both processes
    report = json.loads((root / "ddp" / "report.json").read_text())
    assert report["old_on_new"]["tau"] == loop_dirs["report"]["old_on_new"]["tau"]
    assert report["refreshed"]["tau"] > report["old_on_new"]["tau"] + 0.5 and report["scratch"]["steps"] == 40


@pytest.mark.parametrize("config, extra", [
    ("eagle", ["method=eagle3", "method.fusion_layers=[0,1,1]", "method.draft_vocab_size=48"]),
    ("eagle", ["method=eagle1"]),
    ("draft", ["method.student.num_layers=1"]),
    ("medusa", ["method=medusa2", "method.lora.r=4", "method.max_kl=100", "method.num_heads=2"]),
    ("medusa", ["method=medusa2", "method.lora.r=4", "method.max_kl=100", "method.num_heads=2",
                "method.init_heads=M0"]),  # started from Medusa-1 heads of the old verifier (M0: loop_dirs' m0)
])
def test_refresh_handles_every_drafter_kind(loop_dirs, tmp_path, config, extra):
    import importlib

    root = loop_dirs["root"]
    extra = [x.replace("M0", str(loop_dirs["m0"])) for x in extra]
    run = importlib.import_module(f"draftsmith.train.{config}").run
    old = run(compose_config(config, tiny_model_overrides(root / "v0") + [
        "data=selfdistill", f"data.path={root}/sd0", "data.eval_size=3", "trainer=debug", "logger=none",
        f"output_dir={tmp_path}/old", "probe.num_prompts=2", "probe.max_new_tokens=8", *extra]))
    report = refresh.run(compose_config("refresh", tiny_model_overrides(root / "v0") + [
        f"model.path={root}/ft/final", f"drafter={old['drafter_dir']}", f"output_dir={tmp_path}/refresh",
        "budget.steps=2", "scratch=false", "force=true"]))
    new = Path(report["refreshed"]["drafter"])
    meta = json.loads((new / "meta.json").read_text())
    assert report["refreshed"]["steps"] == 2 and meta["refreshed_from"]["drafter"] == str(report["drafter"])
    assert meta["warm_start"]["kind"] == config and meta["warm_start"]["path"] == report["drafter"]
    probe = probes.read_probe(new)
    assert probe["verifier_fingerprint"] != report["fingerprints"]["recorded"]
    if extra[0] != "method=medusa2":  # (a Medusa-2 refresh tunes the new verifier again: its own fingerprint)
        assert probe["verifier_fingerprint"] == report["fingerprints"]["new"]
    assert probe["prompts"] == probes.read_probe(report["drafter"])["prompts"]  # the same held-out prompts
    assert probe["tau"] == report["refreshed"]["tau"]  # the report measured the new drafter on the new verifier
