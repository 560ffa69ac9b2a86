"""models/eagle.py: shapes, the verifier-family layer, checkpoints, and the training loss
(train/eagle.py) on tiny models, including that the unrolled training-time test computes exactly
what autoregressive drafting computes."""
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from draftsmith.models.checkpoint import load_drafter, save_drafter
from draftsmith.models.eagle import EagleConfig, EagleDrafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.vocab import draft_vocab
from draftsmith.train.eagle import eagle_loss, unroll, unroll_mask
from tests.tiny import tiny_llama

H, V = 32, 128


def drafter_for(model, **kwargs) -> EagleDrafter:
    torch.manual_seed(0)
    return EagleDrafter(EagleConfig(H, V, model.config.to_dict(), **kwargs), model.lm_head).to(model.dtype)


def test_eagle1_shapes_and_nothing_of_the_verifier_stored():
    model = tiny_llama()
    drafter = drafter_for(model)
    embeds, feats = torch.randn(2, 5, H, dtype=torch.float64), torch.randn(2, 5, H, dtype=torch.float64)
    out = drafter(embeds, feats)
    assert out.shape == (2, 5, H)
    assert drafter.logits(out, model.lm_head).shape == (2, 5, V)
    keys = drafter.state_dict().keys()
    assert not any("embed" in k or k.startswith("lm_head") for k in keys)
    assert drafter.fc.weight.shape == (H, 2 * H) and drafter.fc.bias is None  # vLLM's EAGLE-1: no fc bias
    assert not any("input_layernorm" in k or k.startswith("norm") for k in keys)  # no layer-0 input norm, no final norm


def test_eagle3_fusion_and_reduced_vocab():
    model = tiny_llama()
    drafter = drafter_for(model, variant="eagle3", fusion_layers=[0, 1, 1], draft_vocab_size=16, lm_head="own")
    counts = torch.zeros(V)
    counts[torch.arange(40, 60)] = torch.arange(20, 0, -1).float()  # ids 40..55 are the 16 most frequent
    d2t = draft_vocab(counts, 16)
    assert d2t.tolist() == list(range(40, 56))
    drafter.set_draft_vocab(d2t, model.lm_head)
    torch.testing.assert_close(drafter.lm_head.weight, model.lm_head.weight[40:56])
    fused = drafter.input_features(None, torch.randn(3, 3 * H, dtype=torch.float64))
    assert fused.shape == (3, H)
    logits = drafter.logits(drafter(torch.randn(1, 3, H, dtype=torch.float64), fused[None]), model.lm_head)
    assert logits.shape == (1, 3, 16)
    assert drafter.to_target_ids(torch.tensor([0, 15])).tolist() == [40, 55]
    assert drafter.fc.weight.shape == (H, 3 * H) and drafter.midlayer.self_attn.q_proj.weight.shape[1] == 2 * H
    gathered = drafter_for(model, variant="eagle3", fusion_layers=[1], draft_vocab_size=16, lm_head="gathered")
    gathered.set_draft_vocab(d2t)
    x = torch.randn(4, H, dtype=torch.float64)
    torch.testing.assert_close(gathered.logits(x, model.lm_head), model.lm_head(gathered.norm(x))[:, 40:56])  # norm, then the rows
    with pytest.raises(DraftsmithError, match="needs the verifier's fusion-layer states"):
        drafter.input_features(torch.randn(3, H), None)


def test_config_errors_are_one_line():
    cfg = tiny_llama().config.to_dict()
    with pytest.raises(DraftsmithError, match="method.variant='eagle2'"):
        EagleConfig(H, V, cfg, variant="eagle2")
    with pytest.raises(DraftsmithError, match="eagle3 needs method.fusion_layers"):
        EagleConfig(H, V, cfg, variant="eagle3")
    with pytest.raises(DraftsmithError, match="needs method.draft_vocab_size"):
        EagleConfig(H, V, cfg, lm_head="own")
    with pytest.raises(DraftsmithError, match=r"must be in \[1, 128\]"):
        EagleConfig(H, V, cfg, draft_vocab_size=500, lm_head="own")


def test_the_layer_is_a_llama_layer_with_the_verifiers_dimensions():
    """The engines' EAGLE drafters are Llama layers whatever the verifier's family (SpecForge
    trains Llama drafters for Qwen): the verifier gives the dimensions and rotary settings."""
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=16, rope_theta=12345.0))
    drafter = EagleDrafter(EagleConfig(H, V, qwen.config.to_dict()))
    attn = drafter.layers[0].self_attn
    assert attn.q_proj.bias is None and attn.k_proj.weight.shape == (2 * H // 4, H)  # 2 kv heads of 8
    assert drafter.layer_config.rope_parameters["rope_theta"] == 12345.0
    assert drafter.layer_config.intermediate_size == 64
    cache = drafter.new_cache()  # full attention: a compactable/croppable cache
    drafter(torch.randn(1, 4, H), torch.randn(1, 4, H), cache=cache)
    cache.crop(-2)
    assert cache.get_seq_length() == 2


def test_checkpoint_round_trip_keeps_d2t(tmp_path):
    model = tiny_llama()
    drafter = drafter_for(model, variant="eagle3", fusion_layers=[0, 1, 1], draft_vocab_size=16, lm_head="own")
    drafter.set_draft_vocab(torch.arange(100, 116), model.lm_head)
    save_drafter(tmp_path / "d", "eagle", drafter, drafter.config, verifier_fingerprint="x", verifier_name="tiny")
    kind, loaded, config, _ = load_drafter(tmp_path / "d")
    assert kind == "eagle" and config == drafter.config
    assert loaded.target_ids.tolist() == list(range(100, 116))
    assert loaded.d2t.tolist() == [100] * 16  # stored as the engines' offsets: target = i + d2t[i]
    assert loaded.t2d.sum() == 16 and loaded.t2d[100:116].all()
    # the engines read the weights' dtype from config.json, not the int64 vocabulary maps'
    assert json.loads((tmp_path / "d" / "config.json").read_text())["torch_dtype"] == "float64"
    x, f = torch.randn(1, 3, H), torch.randn(1, 3, 3 * H)
    loaded_out = loaded(x, loaded.input_features(None, f))
    drafter = drafter.float()
    torch.testing.assert_close(loaded_out, drafter(x, drafter.input_features(None, f)))


def test_unroll_mask_is_the_decode_time_tree():
    pad_ok = torch.tensor([[True, True, True, False]])
    allowed = unroll_mask(pad_ok, 2, torch.float32)[0, 0] == 0  # (4, 12)
    assert allowed.shape == (4, 12)
    real, step1, step2 = allowed[:, :4], allowed[:, 4:8], allowed[:, 8:]
    assert real.tolist() == [[True, False, False, False], [True, True, False, False],
                             [True, True, True, False], [True, True, True, True]]  # padded key: only itself
    assert step1.equal(torch.eye(4, dtype=torch.bool)) and step2.equal(torch.eye(4, dtype=torch.bool))


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
def test_unrolled_steps_equal_autoregressive_drafting(variant):
    """Step s at index t == drafting s+1 tokens after position t with no cache at all."""
    model = tiny_llama()
    kwargs = dict(variant="eagle3", fusion_layers=[0, 1]) if variant == "eagle3" else {}
    drafter = drafter_for(model, **kwargs)
    g = torch.Generator().manual_seed(0)
    T = 9
    embeds = torch.randn(1, T, H, dtype=torch.float64, generator=g)
    feats = torch.randn(1, T, H, dtype=torch.float64, generator=g)
    with torch.no_grad():
        steps = list(unroll(drafter, embeds, feats, torch.ones(1, T, dtype=torch.bool), 3))
        for t in range(T - 4):
            pair_embeds, pair_feats = embeds[:, 1 : t + 2], feats[:, : t + 1]  # pairs (x_{j+1}, f_j), j <= t
            for s in range(3):
                pred = drafter(pair_embeds, pair_feats)[:, -1]  # (1, H): prediction of f_{t+s+1}
                torch.testing.assert_close(steps[s][:, t], pred, rtol=1e-10, atol=1e-10)
                pair_embeds = torch.cat([pair_embeds, embeds[:, t + s + 2][:, None]], dim=1)
                pair_feats = torch.cat([pair_feats, pred[:, None]], dim=1)


def test_loss_is_smoothl1_plus_weighted_soft_ce():
    model = tiny_llama().requires_grad_(False)
    drafter = drafter_for(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 100, (2, 8), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0
    labels[1, 6:] = -100
    hidden = model.model(ids, attention_mask=attn).last_hidden_state
    inputs = {"hidden": hidden, "labels": labels, "attention_mask": attn, "embeds": model.model.embed_tokens(ids)}
    mcfg = SimpleNamespace(decay=0.8, w_feat=1.0, w_cls=0.1)
    loss, stats = eagle_loss(drafter, inputs, model.lm_head, mcfg, steps=1)
    # by hand: index t predicts f_{t+1} (token t+2) where labels[t+2] is supervised
    pred = drafter(inputs["embeds"][:, 1:], hidden[:, :-1], attention_mask=attn[:, 1:])  # (2, 7, H)
    rows = [(b, t) for b in range(2) for t in range(6) if labels[b, t + 2] != -100]
    p_hat = torch.stack([pred[b, t] for b, t in rows])
    f = torch.stack([hidden[b, t + 1] for b, t in rows])
    target = torch.softmax(model.lm_head(f), -1)
    soft_ce = -(target * torch.log_softmax(model.lm_head(p_hat), -1)).sum(-1).mean()
    expected = F.smooth_l1_loss(p_hat, f) + 0.1 * soft_ce
    torch.testing.assert_close(loss, expected)
    assert stats["step0/count"] == len(rows)
    loss3, stats3 = eagle_loss(drafter, inputs, model.lm_head, mcfg, steps=3)
    assert set(stats3) >= {"step2/loss", "step2/count"} and stats3["step2/count"] < stats3["step0/count"]
    assert loss3 > loss
