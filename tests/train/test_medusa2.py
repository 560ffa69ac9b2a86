"""Medusa-2 (train/medusa.py method=medusa2): the loss and schedules against hand-computed values,
the teacher is exactly the untouched verifier, a 3-step run whose heads learn while the KL
stays small, the drift gate, the merged verifier folder, and lossless decoding (greedy identity
and the sampling law) against the TUNED verifier."""
import copy
import csv
import math

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from draftsmith.decode.proposers import make_proposer
from draftsmith.models.checkpoint import load_drafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.medusa import MedusaConfig, MedusaHeads, MedusaJoint
from draftsmith.models.verifier import fingerprint
from draftsmith.train.medusa import (
    build_backbone,
    head_ramp,
    medusa2_loss,
    merged_verifier,
    next_token_positions,
    run,
    teacher_logits,
)
from tests.conftest import tiny_model_overrides
from tests.drafters import random_heads
from tests.laws import engine_counts, exact_law, law_model, law_test, tree_paths
from tests.hub import compose_config
from tests.tiny import tiny_llama

MCFG = compose_config("medusa", ["method=medusa2"]).method


def _cfg(tiny_model_dir, out, *extra):
    return compose_config("medusa", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "trainer.batch_size=16", "logger=csv", f"output_dir={out}", "method=medusa2",
        "method.num_heads=2", "trainer.lr=1e-3", "method.heads_ramp_steps=0", *extra])


def test_head_schedules_are_the_formulas():
    m = OmegaConf.merge(MCFG, {"heads_coefficient": 0.8, "heads_ramp_steps": 10})
    for schedule, expected in [("constant", [0.8, 0.8, 0.8]), ("linear", [0.0, 0.4, 0.8]),
                               ("sine", [0.0, 0.8 * math.sin(math.pi / 4), 0.8])]:
        m.heads_schedule = schedule
        assert [head_ramp(s, m) for s in (0, 5, 20)] == pytest.approx(expected, abs=1e-12), schedule
    m.heads_schedule = "cosine"
    with pytest.raises(DraftsmithError, match="method.heads_schedule='cosine'"):
        head_ramp(0, m)


def perturbed_joint(model, scale: float = 0.3, seed: int = 0):
    """A LoRA joint module over `model` with random (non-zero) adapters: tuned != original."""
    backbone, teacher = build_backbone(model, MCFG)
    torch.manual_seed(seed)
    for name, p in backbone.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=scale)
    heads = MedusaHeads(MedusaConfig(32, model.config.vocab_size, num_heads=2), model.lm_head).to(model.dtype)
    return MedusaJoint(backbone, heads), teacher


def _batch(vocab: int = 128):
    ids = torch.randint(4, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100  # the prompt
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def test_the_teacher_is_the_untouched_verifier_and_the_kl_is_the_formula():
    untouched = tiny_llama()
    joint, teacher = perturbed_joint(copy.deepcopy(untouched))
    batch = _batch()
    pos = next_token_positions(batch["labels"])
    with torch.no_grad():
        ref = untouched(batch["input_ids"]).logits[pos]  # (N, V) the original verifier
        tuned = joint.backbone(input_ids=batch["input_ids"]).logits[pos]
    got = teacher_logits(joint, teacher, batch, pos)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)  # adapters off == the untouched model, exactly
    assert (tuned - ref).abs().max() > 1e-3  # ... and the adapters do change the model
    m = OmegaConf.merge(MCFG, {"heads_coefficient": 0.0, "lambda_lm": 1.0})
    loss, stats = medusa2_loss(joint, teacher, batch, m, step=0, num_heads=2)
    p, log_q = ref.softmax(-1), tuned.log_softmax(-1)
    kl = (p * (p.log() - log_q)).sum(-1)  # KL(original || tuned) per position
    torch.testing.assert_close(loss, kl.mean(), rtol=1e-10, atol=1e-12)
    assert stats["lm/count"] == int(pos.sum()) == 2 * 8  # positions 3..10 predict the supervised tokens 4..11
    assert stats["lm/agree"] == int((tuned.argmax(-1) == ref.argmax(-1)).sum())


def test_the_merged_folder_gives_the_adapter_models_logits(tmp_path):
    joint, _ = perturbed_joint(tiny_llama())
    merged = merged_verifier(joint, joint.state_dict(), MCFG)
    merged.save_pretrained(tmp_path / "v")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "v", dtype=torch.float64)  # a plain HF folder
    ids = _batch()["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, joint.backbone(input_ids=ids).logits, rtol=0, atol=1e-10)


def test_three_steps_heads_learn_kl_stays_small_and_final_is_servable(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    summary = run(_cfg(tiny_model_dir, out, "trainer.max_steps=6", "trainer.eval_every=3"))
    logs = list(csv.DictReader(open(out / "metrics.csv")))
    head0 = [float(r["value"]) for r in logs if r["key"] == "train/head0/loss"]
    assert len(head0) >= 2 and head0[-1] < head0[0], head0  # the heads learn
    kl = [float(r["value"]) for r in logs if r["key"] == "eval/kl"]
    assert kl and max(kl) < 0.05 and summary["eval/kl"] < 0.05  # the backbone stays near the original
    for key in ("eval/greedy_agreement", "eval/ppl_tuned", "eval/ppl_original", "eval/head0_top1",
                "eval/simulated_tau"):
        assert key in summary
    final = out / "final"
    verifier = AutoModelForCausalLM.from_pretrained(final / "verifier")  # LoRA merged: a plain HF folder
    drafter = load_drafter(final / "heads", verifier_fingerprint=fingerprint(verifier))
    original = drafter.meta["original_verifier"]
    assert drafter.kind == "medusa" and original["fingerprint"] == fingerprint(tiny_llama(dtype=torch.float32))
    assert (final / "verifier" / "tokenizer.json").is_file()
    with pytest.raises(DraftsmithError, match="is a Medusa-2 output: pass drafter=.*/heads and model.path=.*/verifier"):
        load_drafter(final)

    # decode/evaluate.py against the TUNED verifier: greedy token-identical, and the drift reported
    from draftsmith.decode.evaluate import run as evaluate

    report = evaluate(compose_config("evaluate", tiny_model_overrides(final / "verifier") + [
        f"drafter={final / 'heads'}", "data=tiny", "data.num_prompts=2", "max_new_tokens=10", "decode=chain4",
        "decode.paths=[[0],[0,0]]", "hf.enabled=false", f"output_dir={tmp_path / 'eval'}"]))
    assert report["methods"]["medusa"]["greedy_identity_rate"] == 1.0
    assert report["tuned_vs_original"]["prompts"] == 2 and 0 <= report["tuned_vs_original"]["token_agreement"] <= 1


def test_drift_beyond_max_kl_refuses_final_or_warns(tiny_model_dir, tmp_path):
    args = ["trainer.lr=0.05", "method.max_kl=1e-9"]
    with pytest.raises(DraftsmithError, match=r"drifted: KL\(original \|\| tuned\) = .* > method.max_kl") as info:
        run(_cfg(tiny_model_dir, tmp_path / "a", *args))
    assert "\n" not in str(info.value) and not (tmp_path / "a" / "final").exists()
    with pytest.warns(UserWarning, match="written anyway"):
        run(_cfg(tiny_model_dir, tmp_path / "b", *args, "method.allow_drift=true"))
    assert (tmp_path / "b" / "final" / "heads" / "model.safetensors").is_file()


def test_warm_start_from_medusa1_heads(tiny_model_dir, tmp_path):
    m1 = compose_config("medusa", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "logger=none", "method.num_heads=2", f"output_dir={tmp_path / 'm1'}"])
    run(m1)
    summary = run(_cfg(tiny_model_dir, tmp_path / "m2", f"method.init_heads={tmp_path / 'm1' / 'final'}",
                       "trainer.max_steps=0"))
    warm = load_drafter(tmp_path / "m2" / "final" / "heads", allow_mismatch=True).module.state_dict()
    init = load_drafter(tmp_path / "m1" / "final").module.state_dict()
    assert all(torch.equal(warm[k], init[k]) for k in init) and summary["steps"] == 0
    with pytest.raises(DraftsmithError, match="method.init_heads=.*does not fit this run's drafter .num_heads: 2 there, 3 here"):
        run(_cfg(tiny_model_dir, tmp_path / "m3", f"method.init_heads={tmp_path / 'm1' / 'final'}",
                 "method.num_heads=3"))


@pytest.mark.slow
def test_sampling_law_against_the_tuned_verifier():
    """The decoder's law at T > 0 is the TUNED verifier's (exact, enumerated), not the original's."""
    tree, scale, temperature, top_k, top_p = "medusa-small", 10.0, 0.7, 0, 0.9
    joint, _ = perturbed_joint(law_model(scale), scale=0.5)
    tuned = merged_verifier(joint, joint.state_dict(), MCFG).double()
    law = exact_law(tuned, temperature, top_k, top_p)
    original = exact_law(law_model(scale), temperature, top_k, top_p)
    assert 0.5 * float((law - original).abs().sum()) > 0.05  # the two laws differ: the test can tell them apart
    proposer = make_proposer("medusa", heads=random_heads(tuned), paths=tree_paths(tree))
    counts = engine_counts(tuned, proposer, 3000, temperature, top_k, top_p, seed=1)  # the chi-square decides
    pvalue, tv, impossible = law_test(counts, law)
    assert impossible == 0.0 and pvalue > 1e-3 and tv < 0.08, (pvalue, tv)
    assert law_test(counts, original)[0] < 1e-6  # ... and clearly not the original's


def test_resume_gives_the_uninterrupted_weights(tiny_model_dir, tmp_path):
    """2 steps, then a rerun to 4, ends with the backbone and heads of 4 steps in one go."""
    from safetensors.torch import load_file

    args = ["trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=2", "method.allow_drift=true"]
    run(_cfg(tiny_model_dir, tmp_path / "straight", *args))
    run(_cfg(tiny_model_dir, tmp_path / "resumed", *args, "trainer.max_steps=2"))
    summary = run(_cfg(tiny_model_dir, tmp_path / "resumed", *args))
    assert summary["steps"] == 4
    for part in ("verifier", "heads"):
        a = load_file(tmp_path / "straight" / "final" / part / "model.safetensors")
        b = load_file(tmp_path / "resumed" / "final" / part / "model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=f"{part}: {key}")
    with pytest.raises(DraftsmithError, match="another config"):
        run(_cfg(tiny_model_dir, tmp_path / "resumed", *args, "method.lambda_lm=3.0"))
