"""P-EAGLE exports (models/layouts.py, scripts/export.py): the layout vLLM 0.32 loads with parallel
drafting (vLLM format and speculators "peagle"), checked against the loader's facts written as
data; mask_hidden permuted with fc's input blocks; export -> import round trips decode the same
drafts; formats whose engines have no P-EAGLE loader are refused in one line."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.decode.build import proposer_for
from draftsmith.models.checkpoint import load_drafter, save_drafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.verifier import fingerprint
from tests.drafters import PEAGLE_MASK as MASK
from tests.drafters import fitted_peagle
from tests.models.exports import EAGLE3_LAYER, EAGLE3_REST, EAGLE3_WEIGHTS, FUSION, H, V, VerifierView, decode_lossless
from tests.models.exports import export_drafter

K = 4
VLLM_SOURCE = ("vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM: mask_hidden buffer of "
               "fc_input_size under parallel_drafting, loaded by name, required); vllm/v1/spec_decode/"
               "llm_base_proposer.py (_init_parallel_drafting_params: mask_token_id, then pard_token, ptd_token_id; "
               "the placeholder hidden state = combine_hidden_states(mask_hidden)); vllm/config/speculative.py "
               "(parallel_drafting: a speculative_config flag); vllm/transformers_utils/configs/eagle.py (method "
               "eagle3 keeps architectures ending in Eagle3, prefixes others with Eagle3)")
SPEC_SOURCE = ("vllm/transformers_utils/configs/speculators/algos.py (update_peagle: mask_token_id -> pard_token, "
               "PeagleLlamaForCausalLM) and base.py (peagle -> method eagle3 + parallel_drafting); speculators "
               "models/peagle/config.py (PEagleSpeculatorConfig: mask_token_id)")
EXPECTED = {
    "vllm": {"config": {"architectures": ["LlamaForCausalLMEagle3"], "mask_token_id": MASK, "parallel_tokens": K,
                        "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "draft_vocab_size": 48},
             "weights": {**EAGLE3_WEIGHTS, "mask_hidden": (3 * H,)}},
    "speculators": {"config": {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
                               "mask_token_id": MASK, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
                    "weights": {**EAGLE3_REST, **{f"layers.0.{k}": v for k, v in EAGLE3_LAYER.items()},
                                "mask_hidden": (3 * H,)}},
}


@pytest.fixture(scope="module")
def peagle_dir(verifier, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        drafter = fitted_peagle(verifier, steps=60, draft_vocab_size=48, layers=tuple(FUSION))
    finally:
        torch.set_num_threads(threads)
    return save_drafter(tmp_path_factory.mktemp("peagle") / "peagle", "eagle", drafter, drafter.config,
                        verifier_fingerprint=fingerprint(verifier), verifier_name="tiny")


@pytest.mark.parametrize("fmt", list(EXPECTED))
def test_export_matches_vllms_peagle_loader(fmt, peagle_dir, verifier_dir, tmp_path):
    summary = export_drafter(verifier_dir, peagle_dir, fmt, tmp_path / fmt)
    spec = json.loads((tmp_path / fmt / "config.json").read_text())
    for key, value in EXPECTED[fmt]["config"].items():
        assert spec[key] == value, (fmt, key, VLLM_SOURCE if fmt == "vllm" else SPEC_SOURCE)
    state = load_file(str(tmp_path / fmt / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == EXPECTED[fmt]["weights"]
    if fmt == "speculators":
        method = spec["speculators_config"]["proposal_methods"][0]
        assert spec["speculators_config"]["algorithm"] == "peagle" and method["speculative_tokens"] == K
        assert summary["serve"] == f"python -m vllm.entrypoints.openai.api_server --model {tmp_path / fmt}"
    else:
        command = json.loads(summary["serve"].split("--speculative-config ", 1)[1].strip("'"))
        assert command == {"method": "eagle3", "model": str(tmp_path / fmt), "num_speculative_tokens": K,
                           "parallel_drafting": True}
    # fc's input blocks AND mask_hidden's chunks follow the engines' ascending capture order
    native = load_file(str(peagle_dir / "model.safetensors"))
    mine, theirs = native["mask_hidden"].chunk(3), state["mask_hidden"].chunk(3)
    for b, layer in enumerate(sorted(FUSION)):
        assert torch.equal(theirs[b].float(), mine[FUSION.index(layer)].float())


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_export_import_round_trip_drafts_identically(fmt, peagle_dir, verifier, verifier_dir, tmp_path):
    from omegaconf import OmegaConf

    export_drafter(verifier_dir, peagle_dir, fmt, tmp_path / fmt)
    original = load_drafter(peagle_dir, verifier_fingerprint=fingerprint(verifier))
    imported = load_drafter(tmp_path / fmt, verifier_fingerprint=fingerprint(verifier), verifier_dims=(H, V))
    assert imported.config.parallel_tokens == K and imported.config.mask_token_id == MASK
    assert imported.config.fusion_layers == sorted(FUSION)
    torch.testing.assert_close(imported.module.double().placeholder_features(),
                               original.module.double().placeholder_features(), rtol=0, atol=1e-12)
    v = VerifierView(verifier)
    steps = []
    for decode in ({"name": "t", "depth": K, "top_k": 3, "total_tokens": 8}, {"name": "t", "paths": [[0], [0, 0]]}):
        decode = OmegaConf.create(decode)
        assert type(proposer_for(original, v, decode)).__name__ == "PEagleProposer"
        for seed in (1, 2):
            a = decode_lossless(verifier, proposer_for(original, v, decode), seed)
            b = decode_lossless(verifier, proposer_for(imported, v, decode), seed)
            assert a == b, fmt
            steps += a[1]
    assert max(steps) >= 2 and min(steps) == 0


@pytest.mark.parametrize("fmt, engine", [("sglang", "SGLang"), ("gguf", "llama.cpp"), ("hf", "HF transformers")])
def test_formats_without_a_peagle_loader_are_refused(fmt, engine, peagle_dir, verifier_dir, tmp_path):
    with pytest.raises(DraftsmithError, match=f"format={fmt}: {engine} has no P-EAGLE .parallel drafting. loader; "
                                              f"use format=vllm or format=speculators") as info:
        export_drafter(verifier_dir, peagle_dir, fmt, tmp_path / "x")
    assert "\n" not in str(info.value) and not (tmp_path / "x").exists()


def test_a_peagle_folder_without_its_keys_is_refused_on_import(peagle_dir, verifier_dir, tmp_path):
    export_drafter(verifier_dir, peagle_dir, "vllm", tmp_path / "v")
    spec = json.loads((tmp_path / "v" / "config.json").read_text())
    del spec["parallel_tokens"]
    (tmp_path / "v" / "config.json").write_text(json.dumps(spec))
    (tmp_path / "v" / "export.json").unlink()
    with pytest.raises(DraftsmithError, match="P-EAGLE drafter .mask_hidden. whose config.json lacks mask_token_id "
                                              "or parallel_tokens"):
        load_drafter(tmp_path / "v", verifier_dims=(H, V))
    export_drafter(verifier_dir, peagle_dir, "speculators", tmp_path / "s")
    state = load_file(str(tmp_path / "s" / "model.safetensors"))
    state["embed_tokens.weight"] = torch.zeros(V, H)
    save_file(state, str(tmp_path / "s" / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="speculators P-EAGLE with its own embed_tokens"):
        load_drafter(tmp_path / "s", verifier_dims=(H, V))
