"""Engine layouts (models/layouts.py, scripts/export.py): what each export writes is checked
against the engines' loaders, written here as data with the file each fact comes from; export ->
import round trips decode token-identically with the same logits (tiny fp64 models); public
checkpoints built by hand in their published layouts import and reproduce a reference forward
written from the published formulas, independently of models/eagle.py and models/medusa.py."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from draftsmith.decode.build import proposer_for
from draftsmith.models.checkpoint import load_drafter, save_drafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.verifier import fingerprint
from draftsmith.models.vocab import draft_vocab
from scripts.export import run as export
from tests.conftest import tiny_model_overrides
from tests.drafters import fitted_drafter, greedy_corpus
from tests.models.exports import (ATTN_H, EAGLE3_LAYER, EAGLE3_REST, EAGLE3_WEIGHTS, FUSION, HD, HEADS, INTER, KV, MLP,
                                  LAYERS, N, H, V, VerifierView, decode_lossless, export_drafter)
from tests.hub import compose_config

ENGINES = {
    "vllm-eagle3": {
        "source": "vllm/model_executor/models/llama_eagle3.py (weights, fc 3*target_hidden_size, midlayer. -> "
                  "layers.0., d2t -> draft_id_to_target_id, t2d skipped); vllm/v1/worker/gpu_model_runner.py "
                  "(_get_eagle3_aux_layers_from_config: top-level eagle_aux_hidden_state_layer_ids, id j = "
                  "hidden_states[j]); vllm/model_executor/models/interfaces.py (sorted(set(ids)))",
        "config": {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                   "draft_vocab_size": N, "vocab_size": V, "hidden_size": H, "target_hidden_size": H,
                   "num_attention_heads": HEADS, "num_key_value_heads": KV, "intermediate_size": INTER,
                   "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "rms_norm_eps": None, "rope_theta": None},
        "weights": EAGLE3_WEIGHTS},
    "speculators-eagle3": {
        "source": "speculators src/speculators/config.py (SpeculatorModelConfig, SpeculatorsConfig, VerifierConfig), "
                  "models/eagle3/config.py (Eagle3SpeculatorConfig), convert/eagle/eagle3_converter.py (midlayer. -> "
                  "layers.0., GreedyTokenProposalConfig); vllm/transformers_utils/configs/speculators/ (detection by "
                  "speculators_config, update_eagle3: norm_before_residual read as true when missing)",
        "config": {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                   "speculators_version": None, "draft_vocab_size": N, "norm_before_residual": False,
                   "target_hidden_size": H, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
                   "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                       {"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1,
                        "accept_tolerance": 0.0}], "default_proposal_method": "greedy",
                       "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}},
        "layer_config": {"model_type": "llama", "vocab_size": V, "hidden_size": H, "num_hidden_layers": 1,
                         "num_attention_heads": HEADS, "num_key_value_heads": KV, "intermediate_size": INTER},
        "absent_config": ["eagle_config"],
        "weights": {**EAGLE3_REST, **{f"layers.0.{k}": v for k, v in EAGLE3_LAYER.items()}}},
    "sglang-eagle3": {
        "source": "python/sglang/srt/models/llama_eagle3.py (midlayer, fc, norm, lm_head, d2t offsets: "
                  "hot_token_id = d2t + arange); python/sglang/srt/models/llama.py (set_eagle3_layers_to_capture: "
                  "layers_to_capture = [id + 1 for id in layer_ids], from eagle_config; captured in layer order)",
        "config": {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                   "draft_vocab_size": N, "vocab_size": V, "hidden_size": H,
                   "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}},
        "absent_config": ["eagle_aux_hidden_state_layer_ids"],
        "weights": EAGLE3_WEIGHTS},
    "vllm-eagle1": {
        "source": "vllm/model_executor/models/llama_eagle.py (fc 2H->H bias=False; layer 0 input_layernorm is "
                  "Identity; no final norm; embed_tokens and lm_head shared with the target)",
        "config": {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
                   "vocab_size": V, "hidden_size": H},
        "weights": {"fc.weight": (H, 2 * H), **{f"layers.0.{k}": v for k, v in {**ATTN_H, **MLP}.items()}}},
    "vllm-medusa": {
        "source": "vllm/model_executor/models/medusa.py (ResidualBlock layers, bias if medusa_fc_bias; "
                  "original_lm_head -> one lm_head; a reduced vocabulary does not load in 0.32: refused); "
                  "vllm/transformers_utils/configs/medusa.py (num_heads, num_hidden_layers, truncated_vocab_size)",
        "config": {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": 3, "num_hidden_layers": 2,
                   "hidden_size": H, "vocab_size": V, "truncated_vocab_size": V, "medusa_fc_bias": True,
                   "original_lm_head": True},
        "weights": {**{f"blocks.{k}.layers.{l}.{p}": (H, H) if p == "weight" else (H,)
                       for k in range(3) for l in range(2) for p in ("weight", "bias")},
                    "lm_head.weight": (V, H)}},
}


def fitted_eagle3(model, layers, steps: int = 40, ttt: int = 2, draft_vocab_size: int | None = N, **config):
    """An EAGLE-3 drafter fitted to the model's greedy continuations on `layers` (the trainer's loss),
    so that decoding accepts and rejects."""
    from types import SimpleNamespace

    from draftsmith.models.eagle import EagleConfig, EagleDrafter
    from draftsmith.train.eagle import eagle_loss

    seqs = greedy_corpus(model)
    extra = dict(draft_vocab_size=draft_vocab_size, lm_head="own") if draft_vocab_size else {}
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig(H, V, model.config.to_dict(), variant="eagle3", fusion_layers=layers,
                                       **extra, **config)).to(model.dtype)
    with torch.no_grad():
        out = model.model(seqs, output_hidden_states=True)
        inputs = {"hidden": out.last_hidden_state, "labels": seqs.clone(), "attention_mask": torch.ones_like(seqs),
                  "embeds": model.get_input_embeddings()(seqs),
                  "layer_hidden": torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)}
    if draft_vocab_size:
        drafter.set_draft_vocab(draft_vocab(torch.bincount(seqs.flatten(), minlength=V), draft_vocab_size),
                                model.lm_head)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _ = eagle_loss(drafter, inputs, model.lm_head, SimpleNamespace(decay=0.8, w_feat=1.0, w_cls=1.0), ttt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval().requires_grad_(False)


def _medusa(verifier, draft_vocab_size=None, heads=3):
    cfg = MedusaConfig(hidden_size=H, vocab_size=V, num_heads=heads, num_layers=2, lm_head="shared",
                       draft_vocab_size=draft_vocab_size)
    counts = torch.bincount(greedy_corpus(verifier).flatten(), minlength=V)  # the tokens the verifier writes
    module = MedusaHeads(cfg, token_map=draft_vocab(counts, draft_vocab_size) if draft_vocab_size else None)
    torch.manual_seed(1)
    for block in module.blocks:
        for layer in block.layers:
            torch.nn.init.normal_(layer.weight, std=0.02)
    return module.double(), cfg


@pytest.fixture(scope="module")
def drafters(verifier, tmp_path_factory):
    """Native drafter folders of each kind, fitted/perturbed so that decoding accepts and rejects."""
    root = tmp_path_factory.mktemp("drafters")
    fp = fingerprint(verifier)
    out = {}
    e3 = fitted_eagle3(verifier, FUSION)
    out["eagle3"] = save_drafter(root / "eagle3", "eagle", e3, e3.config, verifier_fingerprint=fp, verifier_name="tiny")
    e3 = fitted_eagle3(verifier, [0, 1, 2], draft_vocab_size=None, steps=10, norm_before_residual=True)
    out["eagle3-shared"] = save_drafter(root / "eagle3-shared", "eagle", e3, e3.config, verifier_fingerprint=fp,
                                        verifier_name="tiny")
    e3 = fitted_eagle3(verifier, [0, 1, 1], steps=1)
    out["eagle3-repeated"] = save_drafter(root / "eagle3-repeated", "eagle", e3, e3.config, verifier_fingerprint=fp,
                                          verifier_name="tiny")
    e1 = fitted_drafter(verifier, "eagle1", steps=40)
    out["eagle1"] = save_drafter(root / "eagle1", "eagle", e1, e1.config, verifier_fingerprint=fp, verifier_name="tiny")
    for name, vocab in (("medusa", None), ("medusa-reduced", N)):
        heads, cfg = _medusa(verifier, vocab)
        out[name] = save_drafter(root / name, "medusa", heads, cfg, verifier_fingerprint=fp, verifier_name="tiny")
    return out


SERVE = {"vllm": "python -m vllm.entrypoints.openai.api_server --model tiny --speculative-config '{\"method\": ",
         "sglang": "python -m sglang.launch_server --model-path tiny --speculative-algorithm EAGLE3"}


@pytest.mark.parametrize("case", list(ENGINES))
def test_export_matches_the_engines_loader(case, drafters, verifier_dir, tmp_path):
    fmt, kind = case.split("-")
    summary = export_drafter(verifier_dir, drafters[kind], fmt, tmp_path / case)
    expected = ENGINES[case]
    spec = json.loads((tmp_path / case / "config.json").read_text())
    for key, value in expected["config"].items():
        assert key in spec, (case, key, expected["source"])
        if value is not None:
            assert spec[key] == value, (case, key, expected["source"])
    for key, value in expected.get("layer_config", {}).items():
        assert spec["transformer_layer_config"][key] == value, (case, key, expected["source"])
    assert not set(expected.get("absent_config", [])) & set(spec), case
    state = load_file(str(tmp_path / case / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == expected["weights"], expected["source"]
    for name in ("d2t", "token_map"):
        if name in state:
            assert state[name].dtype == torch.int64
    if "t2d" in state:
        assert state["t2d"].dtype == torch.bool
    assert summary["serve"] in (tmp_path / case / "README.md").read_text()
    head = f"python -m vllm.entrypoints.openai.api_server --model {tmp_path / case}" if fmt == "speculators" else \
        SERVE[fmt]
    assert summary["serve"].startswith(head)


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_fusion_layers_are_written_ascending_with_fc_permuted_to_match(fmt, drafters, verifier_dir, tmp_path):
    """FUSION = [2, 0, 1]: the engines concatenate the states of layers 0, 1, 2 in that order, so
    fc's input block b must be the native block for layer b."""
    export_drafter(verifier_dir, drafters["eagle3"], fmt, tmp_path / fmt)
    native = load_file(str(drafters["eagle3"] / "model.safetensors"))["fc.weight"].chunk(3, dim=1)
    exported = load_file(str(tmp_path / fmt / "model.safetensors"))["fc.weight"].chunk(3, dim=1)
    for b, layer in enumerate(sorted(FUSION)):
        assert torch.equal(exported[b].float(), native[FUSION.index(layer)].float())
    assert not torch.equal(exported[0].float(), native[0].float())


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_repeated_fusion_layers_are_refused(fmt, drafters, verifier_dir, tmp_path):
    with pytest.raises(DraftsmithError, match=r"fuses verifier layers \[0, 1, 1\], one of them twice; vLLM and "
                                              r"SGLang capture each layer once") as info:
        export_drafter(verifier_dir, drafters["eagle3-repeated"], fmt, tmp_path / "x")
    assert "\n" not in str(info.value) and not (tmp_path / "x").exists()


def test_full_vocabulary_eagle3_has_no_d2t_for_vllm(drafters, verifier_dir, tmp_path):
    """vLLM 0.32 has no draft_id_to_target_id parameter when draft_vocab_size = the vocabulary and
    refuses a d2t tensor then (tests/engines/test_vllm.py: eagle3-nbr)."""
    for fmt in ("vllm", "speculators"):
        export_drafter(verifier_dir, drafters["eagle3-shared"], fmt, tmp_path / fmt)
        state = load_file(str(tmp_path / fmt / "model.safetensors"))
        spec = json.loads((tmp_path / fmt / "config.json").read_text())
        assert spec["draft_vocab_size"] == V and state["lm_head.weight"].shape == (V, H)
        assert "d2t" not in state and "t2d" not in state
        assert spec["norm_before_residual"] is True


def test_the_serve_command_names_the_verifier_the_drafter_was_trained_with(drafters, verifier_dir, tmp_path):
    import shutil

    trained = tmp_path / "trained"
    shutil.copytree(drafters["eagle3"], trained)
    (trained / "config.yaml").write_text("model:\n  name: tiny\n  path: org/tiny-verifier\n")
    summary = export(compose_config("export", tiny_model_overrides(verifier_dir) + [
        f"drafter={trained}", "format=vllm", f"output_dir={tmp_path / 'out'}"]))
    assert summary["serve"].startswith(
        "python -m vllm.entrypoints.openai.api_server --model org/tiny-verifier --speculative-config")
    assert export_drafter(verifier_dir, trained, "vllm", tmp_path / "out2", "verifier_name=mine")["serve"].startswith(
        "python -m vllm.entrypoints.openai.api_server --model mine ")


def test_d2t_is_stored_as_offsets(drafters):
    native = load_file(str(drafters["eagle3"] / "model.safetensors"))
    drafter = load_drafter(drafters["eagle3"]).module
    ids = torch.arange(N)
    assert torch.equal(drafter.to_target_ids(ids), ids + native["d2t"])  # target = i + d2t[i]
    assert not torch.equal(native["d2t"], drafter.to_target_ids(ids))  # offsets, not absolute ids
    assert torch.equal(native["t2d"].nonzero().flatten(), drafter.to_target_ids(ids).sort().values)


@pytest.mark.parametrize("case", ["vllm-eagle3", "speculators-eagle3", "sglang-eagle3", "vllm-eagle3-shared",
                                  "vllm-eagle1", "vllm-medusa"])
def test_export_import_round_trip_decodes_identically(case, drafters, verifier, verifier_dir, tmp_path):
    from omegaconf import OmegaConf

    fmt, kind = case.split("-", 1)
    export_drafter(verifier_dir, drafters[kind], fmt, tmp_path / case)
    original = load_drafter(drafters[kind], verifier_fingerprint=fingerprint(verifier))
    imported = load_drafter(tmp_path / case, verifier_fingerprint=fingerprint(verifier), verifier_dims=(H, V))
    assert imported.kind == original.kind and imported.meta["format"] == fmt
    if kind.startswith("eagle3"):
        assert imported.config.fusion_layers == sorted(original.config.fusion_layers)
        assert imported.config.norm_before_residual == original.config.norm_before_residual
    decode = OmegaConf.create({"name": "t", "depth": 3, "top_k": 3, "total_tokens": 8} if kind != "medusa" else
                              {"name": "t", "paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]})
    v = VerifierView(verifier)
    steps = []
    for seed in (1, 2):
        a = decode_lossless(verifier, proposer_for(original, v, decode), seed)
        b = decode_lossless(verifier, proposer_for(imported, v, decode), seed)
        assert a == b, case  # the same proposals: the same accepted counts step by step
        steps += a[1]
    if kind in ("eagle3", "eagle1"):  # (untrained heads propose what is rarely accepted: the logits below decide)
        assert max(steps) >= 1 and min(steps) == 0  # drafts accepted and rejected
    # the same logits, from the same verifier states
    hidden = torch.randn(5, H, dtype=torch.float64)
    with torch.no_grad():
        if kind == "medusa":
            torch.testing.assert_close(imported.module.double()(hidden, verifier.lm_head),
                                       original.module.double()(hidden, verifier.lm_head), rtol=0, atol=1e-12)
        else:
            a, b = original.module.double(), imported.module.double()
            states = torch.randn(LAYERS + 1, 5, H, dtype=torch.float64)  # hidden_states[i + 1] = output of layer i
            src_a = torch.cat([states[i + 1] for i in a.config.fusion_layers], -1) if a.config.fusion_layers else None
            src_b = torch.cat([states[i + 1] for i in b.config.fusion_layers], -1) if b.config.fusion_layers else None
            emb = torch.randn(1, 5, H, dtype=torch.float64)
            fa = a(emb, a.input_features(hidden, src_a)[None])
            fb = b(emb, b.input_features(hidden, src_b)[None])
            torch.testing.assert_close(b.logits(fb, verifier.lm_head), a.logits(fa, verifier.lm_head), rtol=0,
                                       atol=1e-12)


def test_draft_model_exports_as_a_plain_hf_folder(verifier_dir, verifier, tmp_path):
    from draftsmith.models.draft import build_student, save_draft_model
    from omegaconf import OmegaConf
    from tests.tiny import tiny_tokenizer

    student = build_student(verifier.float(), tiny_tokenizer(), OmegaConf.create({"init": "truncate", "num_layers": 1}))
    verifier.double()
    src = save_draft_model(tmp_path / "draft", student, tiny_tokenizer(), verifier_fingerprint=fingerprint(verifier),
                           verifier_name="tiny", draft_vocab=torch.arange(N))
    summary = export_drafter(verifier_dir, src, "hf", tmp_path / "hf")
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["num_assistant_tokens"] == 4 and gen["num_assistant_tokens_schedule"] == "heuristic"
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and "assistant_model=" in summary["serve"]
    # the engines draft from the whole vocabulary: the reduced one is left out, and said so
    assert not (tmp_path / "hf" / "draft_vocab.safetensors").exists() and "decode.draft_vocab=full" in summary["note"]
    assert "decode.draft_vocab=full" in (tmp_path / "hf" / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # loads as it stands
    ids = torch.randint(4, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, student(ids).logits)
    assert load_drafter(tmp_path / "hf").kind == "draft"


@pytest.mark.parametrize("kind,fmt,needle", [
    ("medusa", "sglang", "format=sglang cannot express Medusa"),
    ("medusa", "hf", "format=hf cannot express a medusa drafter"),
    ("eagle3", "hf", "format=hf cannot express a eagle drafter"),
    ("medusa", "speculators", "format=speculators expresses EAGLE-3 drafters only .*not Medusa heads; use format=vllm"),
    ("eagle1", "speculators", "format=speculators expresses EAGLE-3 drafters only .*not an EAGLE-1 drafter"),
    ("medusa-reduced", "vllm", r"format=vllm: vLLM 0\.32\.0's Medusa loader cannot load a reduced draft vocabulary "
                               r"\(method\.draft_vocab_size=48\).*token_map.*method\.draft_vocab_size=null"),
])
def test_formats_that_cannot_express_a_drafter_are_refused(kind, fmt, needle, drafters, verifier_dir, tmp_path):
    with pytest.raises(DraftsmithError, match=needle) as info:
        export_drafter(verifier_dir, drafters[kind], fmt, tmp_path / "x")
    assert "\n" not in str(info.value) and not (tmp_path / "x").exists()


@pytest.mark.parametrize("edit,needle", [
    (lambda s: s.pop("norm_before_residual"), "no norm_before_residual: vLLM reads it as true, speculators as false"),
    (lambda s: s.update(speculators_model_type="dflash"), "is a speculators 'dflash' model; draftsmith imports "
                                                          "speculators eagle3 and peagle folders only"),
    (lambda s: s.update(norm_before_fc=True), "sets norm_before_fc=true; draftsmith's EAGLE-3 has no such variant"),
])
def test_speculators_folders_draftsmith_cannot_read_are_refused(edit, needle, drafters, verifier_dir, tmp_path):
    export_drafter(verifier_dir, drafters["eagle3"], "speculators", tmp_path / "s")
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    edit(spec)
    (tmp_path / "s" / "config.json").write_text(json.dumps(spec))
    with pytest.raises(DraftsmithError, match=needle) as info:
        load_drafter(tmp_path / "s", verifier_dims=(H, V))
    assert "\n" not in str(info.value)


def test_old_eagle_layout_is_refused_with_how_to_convert(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps({"kind": "eagle", "config": {}}))
    save_file({"fuse.weight": torch.zeros(2, 2)}, str(tmp_path / "old" / "model.safetensors"))
    (tmp_path / "old" / "meta.json").write_text("{}")
    with pytest.raises(DraftsmithError, match="0.1 EAGLE layout.*retrain it with python train/eagle.py"):
        load_drafter(tmp_path / "old")


def test_old_medusa_names_load(tmp_path):
    cfg = MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2, num_layers=1, draft_vocab_size=N)
    heads = MedusaHeads(cfg)
    torch.nn.init.normal_(heads.blocks[1].layers[0].weight)
    folder = save_drafter(tmp_path / "m", "medusa", heads, cfg, verifier_fingerprint="x", verifier_name="tiny")
    state = {k.replace(".layers.0.", ".0.linear.").replace("token_map", "d2t"): v
             for k, v in load_file(str(folder / "model.safetensors")).items()}  # the 0.1 names
    save_file(state, str(folder / "model.safetensors"))
    from dataclasses import asdict

    (folder / "config.json").write_text(json.dumps({"kind": "medusa", "config": asdict(cfg)}))
    with pytest.warns(UserWarning, match="0.1 Medusa"):
        loaded = load_drafter(folder).module
    x = torch.randn(3, H)
    torch.testing.assert_close(loaded.blocks[1](x), heads.blocks[1](x))


# ------------------------------------------------------------------ public layouts, reference forwards


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta=10000.0):
    """x (heads, T, d) at positions 0..T-1: the rotate-half rotary embedding."""
    d, t = x.shape[-1], x.shape[-2]
    angle = torch.arange(t, dtype=torch.float64)[:, None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def attention(w, prefix, a):
    """Causal GQA self-attention of one sequence a (T, in)."""
    t = a.shape[0]
    q = rope((a @ w[prefix + "q_proj.weight"].T).view(t, HEADS, HD).transpose(0, 1))
    k = rope((a @ w[prefix + "k_proj.weight"].T).view(t, KV, HD).transpose(0, 1)).repeat_interleave(HEADS // KV, 0)
    v = (a @ w[prefix + "v_proj.weight"].T).view(t, KV, HD).transpose(0, 1).repeat_interleave(HEADS // KV, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(HD) + torch.full((t, t), float("-inf")).triu(1)
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, HEADS * HD) @ w[prefix + "o_proj.weight"].T


def mlp(w, prefix, x):
    return (F.silu(x @ w[prefix + "gate_proj.weight"].T) * (x @ w[prefix + "up_proj.weight"].T)) @ \
        w[prefix + "down_proj.weight"].T


def random_state(shapes: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(s, generator=g, dtype=torch.float64) * 0.2 if not k.endswith("norm.weight")
                else 1 + 0.1 * torch.randn(s, generator=g, dtype=torch.float64)) for k, s in shapes.items()}


LLAMA_CONFIG = {"hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV,
                "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": V, "rope_theta": 10000.0,
                "max_position_embeddings": 512, "hidden_act": "silu", "model_type": "llama"}


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_specforge_eagle3_folder_imports_and_matches_the_published_forward(tmp_path, norm_before_residual):
    """SpecForge / official EAGLE-3: no capture ids in config.json (the engines' default),
    d2t offsets, embed_tokens saved beside (dropped: the verifier's is used); and the
    norm_before_residual variant vLLM reads from config.json (speculators' default)."""
    shapes = {k: v for k, v in EAGLE3_WEIGHTS.items() if k not in ("d2t", "t2d")}
    w = random_state(shapes, 0)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:N].sort().values
    d2t = ids - torch.arange(N)
    save_file({**{k: v.float() for k, v in w.items()}, "d2t": d2t, "embed_tokens.weight": torch.zeros(V, H)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "architectures": ["LlamaForCausalLMEagle3"],
                                                      "draft_vocab_size": N,
                                                      "norm_before_residual": norm_before_residual}))
    drafter = load_drafter(tmp_path, verifier_dims=(H, V), verifier_num_layers=30)
    assert drafter.kind == "eagle" and drafter.config.fusion_layers == [1, 14, 26]  # hidden_states[2, 15, 27]
    module = drafter.module.double()
    w = {k: v.float().double() for k, v in w.items()}
    states, emb = torch.randn(6, 3 * H, dtype=torch.float64), torch.randn(6, H, dtype=torch.float64)
    g = states @ w["fc.weight"].T
    normed = rms(g, w["midlayer.hidden_norm.weight"])
    a = torch.cat([rms(emb, w["midlayer.input_layernorm.weight"]), normed], -1)
    h = (normed if norm_before_residual else g) + attention(w, "midlayer.self_attn.", a)
    p = h + mlp(w, "midlayer.mlp.", rms(h, w["midlayer.post_attention_layernorm.weight"]))
    logits = rms(p, w["norm.weight"]) @ w["lm_head.weight"].T  # (6, N)
    with torch.no_grad():
        ours = module(emb[None], module.input_features(None, states)[None])[0]
        # (HF computes the rotary tables in fp32: agreement to ~1e-6, not to fp64 rounding)
        torch.testing.assert_close(ours, p, rtol=0, atol=1e-5)  # the pre-norm state is what is fed back
        torch.testing.assert_close(module.logits(ours, None), logits, rtol=0, atol=1e-5)
    assert torch.equal(module.to_target_ids(torch.arange(N)), ids)  # target = i + d2t[i]


def test_official_eagle1_folder_imports_with_its_fc_bias(tmp_path):
    shapes = {"fc.weight": (H, 2 * H), "fc.bias": (H,), **{f"layers.0.{k}": v for k, v in {**ATTN_H, **MLP}.items()}}
    w = random_state(shapes, 2)
    torch.save({k: v.float() for k, v in w.items()}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "architectures": ["LlamaForCausalLM"]}))
    drafter = load_drafter(tmp_path, verifier_dims=(H, V))
    assert drafter.kind == "eagle" and drafter.config.variant == "eagle1" and drafter.config.fc_bias
    module = drafter.module.double()
    w = {k: v.float().double() for k, v in w.items()}
    feats, emb = torch.randn(6, H, dtype=torch.float64), torch.randn(6, H, dtype=torch.float64)
    x = torch.cat([emb, feats], -1) @ w["fc.weight"].T + w["fc.bias"]
    h = x + attention(w, "layers.0.self_attn.", x)  # no input norm on layer 0
    out = h + mlp(w, "layers.0.mlp.", rms(h, w["layers.0.post_attention_layernorm.weight"]))  # no final norm
    with torch.no_grad():
        torch.testing.assert_close(module(emb[None], feats[None])[0], out, rtol=0, atol=1e-5)  # fp32 rotary tables
    with pytest.raises(DraftsmithError, match=r"hidden size 32 and a 128-token vocabulary; the verifier has 64 and "
                                              r"128") as info:
        load_drafter(tmp_path, verifier_dims=(64, V))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("layout", ["fasterdecoding", "vllm"])
def test_medusa_folders_import_and_match_the_published_forward(layout, tmp_path):
    k_heads, layers = 3, 2
    w = random_state({**{f"{k}.{l}.linear.{p}": (H, H) if p == "weight" else (H,) for k in range(k_heads)
                         for l in range(layers) for p in ("weight", "bias")},
                      **{f"{k}.{layers}.weight": (V, H) for k in range(k_heads)}}, 3)
    w = {k: v.float() for k, v in w.items()}
    if layout == "fasterdecoding":  # medusa_head = ModuleList(Sequential(*ResBlocks, Linear))
        save_file(w, str(tmp_path / "medusa_lm_head.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": k_heads, "medusa_num_layers": layers,
                                                          "base_model_name_or_path": "tiny"}))
    else:
        state = {}
        for name, v in w.items():
            k, l, *rest = name.split(".")
            state[f"blocks.{k}.layers.{l}.{rest[-1]}" if rest[0] == "linear" else f"lm_heads.{k}.weight"] = v
        save_file(state, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"], "model_type": "medusa",
                                                          "num_heads": k_heads, "num_hidden_layers": layers,
                                                          "hidden_size": H, "vocab_size": V, "medusa_fc_bias": True}))
    heads = load_drafter(tmp_path, verifier_dims=(H, V)).module.double()
    hidden = torch.randn(4, H, dtype=torch.float64)
    with torch.no_grad():
        ours = heads(hidden)  # (K, 4, V)
    w = {k: v.double() for k, v in w.items()}
    for k in range(k_heads):
        x = hidden
        for l in range(layers):
            x = x + F.silu(x @ w[f"{k}.{l}.linear.weight"].T + w[f"{k}.{l}.linear.bias"])
        torch.testing.assert_close(ours[k], x @ w[f"{k}.{layers}.weight"].T, rtol=0, atol=1e-10)
