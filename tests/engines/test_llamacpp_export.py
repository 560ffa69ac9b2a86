"""scripts/export.py format=gguf without running llama.cpp: our EAGLE-3 writer against llama.cpp's own
converter (fed our vLLM export of the same drafter), the kinds llama.cpp cannot run refused in one
line, and the facts models/gguf.py copies from the pinned source (its --spec-type names).
The engine itself is exercised in test_llamacpp_engine.py."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.models.checkpoint import save_drafter
from draftsmith.models.draft import save_draft_model
from draftsmith.models.eagle import EagleConfig, EagleDrafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.gguf import SPEC_TYPES, ensure_llamacpp_source, rope_permute
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.verifier import fingerprint
from scripts.export import run as export
from tests.engines.conftest import model_overrides
from tests.hub import compose_config


def _export(verifier_dir, drafter_dir, out, fmt, dtype, *extra):
    return export(compose_config("export", model_overrides(verifier_dir) + [
        f"drafter={drafter_dir}", f"format={fmt}", f"dtype={dtype}", f"output_dir={out}", *extra]))


def _eagle3(verifier_dir, folder, *, lm_head="own", draft_vocab=64, layers=(1, 3, 4), nbr=False, seed=1):
    """A random EAGLE-3 drafter for the words verifier, saved as draftsmith saves a trained one."""
    model = AutoModelForCausalLM.from_pretrained(verifier_dir)
    cfg = EagleConfig(hidden_size=64, vocab_size=model.config.vocab_size, decoder_config=model.config.to_dict(),
                      variant="eagle3", fusion_layers=list(layers), lm_head=lm_head,
                      draft_vocab_size=draft_vocab if lm_head != "shared" else None, norm_before_residual=nbr)
    torch.manual_seed(seed)
    drafter = EagleDrafter(cfg, model.lm_head)
    if draft_vocab and lm_head != "shared":  # a scattered draft vocabulary: offsets of every size
        ids = torch.sort(torch.randperm(model.config.vocab_size)[:draft_vocab]).values
        drafter.set_draft_vocab(ids, model.lm_head)
    return save_drafter(folder, "eagle", drafter, cfg, verifier_fingerprint=fingerprint(model), verifier_name="words")


def _fields(path):
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {k: (f.types, f.contents()) for k, f in reader.fields.items() if not k.startswith(("GGUF.", "general."))}
    tensors = {t.name: (t.tensor_type.name, [int(n) for n in t.shape], np.asarray(t.data)) for t in reader.tensors}
    return fields, tensors


@pytest.fixture(scope="module")
def verifier_ggufs(llamacpp_verifier, tmp_path_factory):
    """outtype -> the words verifier converted by llama.cpp's converter (what format=gguf writes beside the drafter)."""
    from draftsmith.models.gguf import convert_lm

    folder = tmp_path_factory.mktemp("verifier-gguf")
    return {t: convert_lm(llamacpp_verifier, folder / f"verifier-{t}.gguf", t) for t in ("f32", "bf16")}


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("lm_head,dtype,nbr", [("own", "float32", False), ("gathered", "bfloat16", True)])
def test_eagle3_gguf_is_what_llamacpp_converter_writes(llamacpp_verifier, verifier_ggufs, tmp_path, lm_head, dtype,
                                                       nbr):
    """The same drafter two ways: our writer (what format=gguf runs) and llama.cpp's convert_hf_to_gguf.py
    on our vLLM export: every eagle3.* / tokenizer.* key and every tensor (q/k permutation, d2t as
    absolute ids, bf16 rounding) must be identical."""
    from draftsmith.models.checkpoint import load_drafter
    from draftsmith.models.gguf import OUTTYPES, write_eagle3

    drafter = _eagle3(llamacpp_verifier, tmp_path / "drafter", lm_head=lm_head, nbr=nbr)
    outtype = OUTTYPES[dtype]
    _, module, config, _ = load_drafter(drafter)
    lm = AutoModelForCausalLM.from_pretrained(llamacpp_verifier).lm_head.weight.detach() if lm_head == "gathered" \
        else None
    ours = write_eagle3(tmp_path / "drafter.gguf", module.float(), config, verifier_ggufs[outtype], outtype, lm)
    _export(llamacpp_verifier, drafter, tmp_path / "vllm", "vllm", dtype)
    theirs = tmp_path / "converted.gguf"
    converter = ensure_llamacpp_source() / "convert_hf_to_gguf.py"
    proc = subprocess.run([sys.executable, str(converter), str(tmp_path / "vllm"), "--target-model-dir",
                           str(llamacpp_verifier), "--outtype", outtype, "--outfile", str(theirs)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    f_ours, t_ours = _fields(ours)
    f_theirs, t_theirs = _fields(theirs)
    assert f_ours.keys() == f_theirs.keys()
    for key in f_ours:
        assert f_ours[key] == f_theirs[key], key
    assert f_ours["eagle3.target_layers"][1] == [2, 4, 5]  # llama.cpp captures layer INPUTS: ours + 1
    assert f_ours["eagle3.norm_before_residual"][1] is nbr
    assert t_ours.keys() == t_theirs.keys() and "d2t" in t_ours and "output.weight" in t_ours
    for name, (kind, shape, data) in t_ours.items():
        assert (kind, shape) == t_theirs[name][:2], name
        assert np.array_equal(data, t_theirs[name][2]), name
    assert t_ours["d2t"][0] == "I64"


def test_rope_permute_pairs_rotate_half_values():
    """HF rotates value i with i + d/2 (rotate_half); GGML's normal rope rotates 2i with 2i + 1."""
    d, heads = 8, 2
    w = torch.arange(heads * d, dtype=torch.float32)[:, None]  # row r holds r
    out = rope_permute(w, heads)[:, 0].long().tolist()
    assert out[:d] == [0, 4, 1, 5, 2, 6, 3, 7] and out[d:] == [8, 12, 9, 13, 10, 14, 11, 15]


def test_spec_types_are_the_pinned_llamacpps():
    source = (ensure_llamacpp_source() / "common" / "speculative.cpp").read_text()
    table = source[source.index("common_speculative_type_from_name_map"):]
    names = re.findall(r'\{"([a-z0-9-]+)",\s+COMMON_SPECULATIVE_TYPE_', table[:table.index("};")])
    assert tuple(n for n in names if n != "none") == SPEC_TYPES


def _medusa(verifier_dir, folder):
    model = AutoModelForCausalLM.from_pretrained(verifier_dir)
    cfg = MedusaConfig(hidden_size=64, vocab_size=model.config.vocab_size, num_heads=2)
    return save_drafter(folder, "medusa", MedusaHeads(cfg, model.lm_head), cfg,
                        verifier_fingerprint=fingerprint(model), verifier_name="words")


def _eagle1(verifier_dir, folder):
    model = AutoModelForCausalLM.from_pretrained(verifier_dir)
    cfg = EagleConfig(hidden_size=64, vocab_size=model.config.vocab_size, decoder_config=model.config.to_dict())
    return save_drafter(folder, "eagle", EagleDrafter(cfg), cfg, verifier_fingerprint=fingerprint(model),
                        verifier_name="words")


def _draft_reduced(verifier_dir, folder):
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(verifier_dir)
    return save_draft_model(folder, model, AutoTokenizer.from_pretrained(verifier_dir),
                            verifier_fingerprint=fingerprint(model), verifier_name="words",
                            draft_vocab=torch.arange(64))


@pytest.mark.heavy
@pytest.mark.parametrize("make,dtype,why", [
    (_medusa, "float32", "Medusa heads"),
    (_eagle1, "float32", "EAGLE-1"),
    (lambda v, f: _eagle3(v, f, layers=(1, 3, 7)), "float32", "fusing the verifier's last layer"),
    (_draft_reduced, "float32", "reduced vocabulary"),
    (_eagle3, "float64", "dtype"),
])
def test_what_llamacpp_cannot_run_is_refused_in_one_line(llamacpp_verifier, tmp_path, make, dtype, why):
    drafter = make(llamacpp_verifier, tmp_path / "drafter")
    with pytest.raises(DraftsmithError) as e:
        _export(llamacpp_verifier, drafter, tmp_path / "gguf", "gguf", dtype)
    message = str(e.value)
    assert why in message and "\n" not in message
    if dtype == "float32":
        assert "draft-eagle3" in message and "draft-simple" in message and "ngram-mod" in message
    else:
        assert "float32" in message and "bfloat16" in message
    assert not (tmp_path / "gguf").exists()


@pytest.mark.heavy
def test_a_verifier_folder_without_architectures_converts(llamacpp_verifier, verifier_ggufs, tmp_path):
    """transformers saves a model loaded from a GGUF (draftsmith's converted SmolLM2) with no
    `architectures` in config.json, by which alone llama.cpp's converter picks its model class."""
    import json
    import shutil

    from draftsmith.models.gguf import convert_lm

    folder = tmp_path / "verifier"
    shutil.copytree(llamacpp_verifier, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    out = convert_lm(folder, tmp_path / "verifier.gguf", "f32")
    assert not (tmp_path / ".verifier.gguf.hf").exists()  # the staged copy is gone
    (f_new, t_new), (f_ref, t_ref) = _fields(out), _fields(verifier_ggufs["f32"])
    assert f_new == f_ref and t_new.keys() == t_ref.keys()  # what the folder with architectures gives
    assert all(np.array_equal(t_new[k][2], t_ref[k][2]) for k in t_new)
