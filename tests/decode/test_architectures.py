"""Every preset's architecture decodes greedy-identically to HF generate, or is refused.

For each family a preset promises, a tiny fp64 model is built from that family's own config
class with the real checkpoint's shape-independent settings (rope type and scaling, rope
theta, biases, sliding-window fields, tied or untied embeddings), copied from the checkpoint's
config.json named beside it. Each decodes through the engine with a chain (a draft model that
is the verifier with noise on its lm_head: long accepted runs) and a tree (the same draft
drafting top-2 at the first two depths, so non-first siblings are accepted and the tree mask
and depth positions meet the family's rotary code), token for token equal to the family's
own `generate`. A setting the engine cannot decode exactly is refused before any work, in one
line naming it.
"""
from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.decode import sampling
from draftsmith.decode.engine import generate
from draftsmith.decode.proposers import make_proposer
from draftsmith.models.errors import DraftsmithError
from tests.laws import RecordingRule
from tests.tiny import FAMILIES, tiny_family


def noisy_draft(model, noise: float = 0.02):
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head = draft.lm_head.weight if not draft.config.tie_word_embeddings else draft.get_input_embeddings().weight
        head.add_(noise * head.abs().mean() * torch.randn(head.shape, generator=g, dtype=head.dtype))
    return draft


def test_the_presets_are_all_covered():
    from pathlib import Path

    presets = {p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "model").glob("*.yaml")}
    assert presets - {"vicuna-13b-v1.3"} == set(FAMILIES)  # 13B: the same family and settings as 7B


@pytest.mark.parametrize("preset", sorted(FAMILIES))
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_family_decodes_like_its_own_generate(preset, shape, monkeypatch):
    model = tiny_family(preset)
    if preset == "qwen2.5-7b-instruct":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    if preset == "llama3.1-8b-instruct":
        assert model.config.rope_parameters["rope_type"] == "llama3"
    draft = noisy_draft(model, 0.02 if shape == "chain" else 0.08)  # a tree's second guesses must win sometimes
    kwargs = dict(num_tokens=4) if shape == "chain" else dict(num_tokens=3, tree_topk=[2, 2])
    recorder = RecordingRule(sampling.ACCEPTANCE_RULES["greedy"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "greedy", recorder)
    accepted = 0
    for seed in range(4):
        ids = torch.randint(0, 160, (1, 7), generator=torch.Generator().manual_seed(seed))
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40)[0, 7:]
        proposer = make_proposer("draft", model=draft, vocab_size=160, **kwargs)
        out = generate(model, ids, proposer=proposer, max_new_tokens=40, eos_token_id=())
        assert out.tokens == ref.tolist(), (preset, shape, seed)
        accepted += sum(s.accepted for s in out.steps)
    assert accepted >= 20, (preset, accepted)  # drafts really were accepted through this family's code
    if shape == "tree":  # a second sibling was accepted: the tree mask and positions were right off the chain
        assert any(len(path) > 1 and path[1] != 1 for path in recorder.paths), preset


@pytest.mark.parametrize("preset, setting, match", [
    ("mistral-7b-instruct", dict(sliding_window=8), "sliding_window"),
    ("qwen2.5-7b-instruct", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), "sliding_window"),
])
def test_an_active_sliding_window_is_refused_before_any_work(preset, setting, match, monkeypatch):
    model = tiny_family(preset, **setting)
    calls = []
    monkeypatch.setattr(model.model, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(DraftsmithError, match=match) as err:
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    assert "\n" not in str(err.value) and not calls


def test_post_processed_logits_are_refused():
    model = tiny_family("llama2-7b")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(DraftsmithError, match="final_logit_softcapping=30.0"):
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=4)
