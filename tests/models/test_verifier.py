import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from draftsmith.models.errors import DraftsmithError
from draftsmith.models.verifier import cpu_prepacks, fast_dtype, fingerprint, load_verifier, resolve_device
from tests.tiny import tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def tiny_folder(tmp_path):
    model = tiny_llama(dtype=torch.float32)
    model.save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def _cfg(path, **kw):
    return OmegaConf.create({"name": "tiny", "source": "hf", "path": str(path), "dtype": "float32",
                             "attn_implementation": "sdpa", "chat_template": None, "cache_dir": None, **kw})


def test_load_local_folder_hidden_states_and_lm_head(tiny_folder):
    v = load_verifier(_cfg(tiny_folder))
    ids = torch.tensor([[5, 6, 7]])
    hidden = v.hidden_states(ids)
    assert hidden.shape == (1, 3, 32)
    torch.testing.assert_close(v.lm_head(hidden), v.model(input_ids=ids).logits)
    assert not any(p.requires_grad for p in v.model.parameters())


def test_loads_without_hub_kernels(tiny_folder):
    """transformers 5 would kernelize with kernels fetched from the Hub (its default): an offline GPU
    node then cannot load the verifier at all, and online it would run other code than the model."""
    assert AutoModelForCausalLM.from_pretrained(tiny_folder).use_kernels  # the default this guards against
    assert load_verifier(_cfg(tiny_folder)).model.use_kernels is False


def test_fingerprint_ignores_dtype_but_sees_weights(tiny_folder):
    fp32 = load_verifier(_cfg(tiny_folder)).fingerprint
    bf16 = load_verifier(_cfg(tiny_folder, dtype="bfloat16")).fingerprint
    assert fp32 == bf16
    model = tiny_llama(dtype=torch.float32)
    before = fingerprint(model)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # a "fine-tune"
    assert fingerprint(model) != before


def test_bad_dtype_and_template_keys(tiny_folder):
    with pytest.raises(DraftsmithError, match="model.dtype='fp8'.*valid: bfloat16"):
        load_verifier(_cfg(tiny_folder, dtype="fp8"))
    with pytest.raises(DraftsmithError, match="model.chat_template='nope'"):
        load_verifier(_cfg(tiny_folder, chat_template="nope"))


def test_named_chat_template(tiny_folder):
    v = load_verifier(_cfg(tiny_folder, chat_template="vicuna"))
    text = v.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert text.endswith("USER: hi ASSISTANT:")


def test_missing_hub_model_fails_fast_with_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = OmegaConf.load(ROOT / "conf/model/llama2-7b.yaml")
    with pytest.raises(DraftsmithError, match="not available.*model.path="):
        load_verifier(cfg)


def test_entry_script_big_preset_fails_in_seconds(tmp_path):
    t0 = time.time()
    proc = subprocess.run([sys.executable, "train/medusa.py", "model=llama2-7b", "data=tiny",
                           f"output_dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.startswith("draftsmith: error")]
    assert len(lines) == 1 and "model.path=" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert time.time() - t0 < 60


def test_resolve_device_picks_cuda_only_when_torch_sees_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device(None) == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DraftsmithError, match=r"^device=cuda: torch .* sees no CUDA device; pass device=cpu"):
        resolve_device("cuda")
    with pytest.raises(DraftsmithError, match=r"^device='gpu' is not known; valid: auto, cpu, cuda, cuda:N$"):
        resolve_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == resolve_device("cuda") == resolve_device("CUDA:0") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DraftsmithError, match=r"^device=cuda:2: torch sees 2 CUDA device\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:2")


def test_fast_dtype_is_bf16_only_where_the_device_computes_it(monkeypatch):
    """The quickstart's dtype: bf16 on a CPU with oneDNN's bf16 kernels (whose probe agrees with
    the kernel itself) and on a bf16 GPU, fp32 on an AVX2-only CPU, fp16 on an older GPU."""
    import draftsmith.models.verifier as verifier

    cpu = torch.device("cpu")
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
        native = True
    except RuntimeError:
        native = False
    if torch.backends.mkldnn.is_available():
        assert cpu_prepacks(torch.bfloat16) == native
    assert fast_dtype(cpu) == ("bfloat16" if cpu_prepacks(torch.bfloat16) else "float32")
    monkeypatch.setattr(verifier, "cpu_prepacks", lambda dtype: False)
    assert fast_dtype(cpu) == "float32"
    monkeypatch.setattr(verifier, "cpu_prepacks", lambda dtype: True)
    assert fast_dtype(cpu) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert fast_dtype(torch.device("cuda", 0)) == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert fast_dtype(torch.device("cuda", 0)) == "bfloat16"


@pytest.mark.parametrize("script", ["decode/evaluate.py", "decode/serve.py", "scripts/bench/tune_decode.py",
                                    "scripts/bench/compare.py", "scripts/bench/learning_curve.py"])
def test_a_device_this_torch_cannot_use_stops_the_decoder_in_one_line(script, tmp_path):
    out = [] if script == "decode/serve.py" else [f"output_dir={tmp_path}"]  # a server writes nothing
    own = ["proposer=vanilla", "drafter=null"] if script.startswith("decode/") or "tune" in script else []
    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, on any machine
    proc = subprocess.run([sys.executable, script, "device=cuda", *own, *out],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=hidden)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("draftsmith: error: device=cuda: torch "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ a drafter folder given as model.path


@pytest.fixture(scope="module")
def drafter_folders(tmp_path_factory):
    """Each kind of folder draftsmith writes, as its writers write it, against one tiny verifier."""
    from draftsmith.models.checkpoint import MEDUSA2_PARTS, save_drafter
    from draftsmith.models.draft import build_student, save_draft_model
    from draftsmith.models.eagle import EagleConfig, EagleDrafter
    from draftsmith.models.layouts import engine_config
    from draftsmith.models.medusa import MedusaConfig, MedusaHeads

    root = tmp_path_factory.mktemp("drafters")
    model, tok = tiny_llama(dtype=torch.float32), tiny_tokenizer()
    fp, mcfg = fingerprint(model), MedusaConfig(hidden_size=32, vocab_size=128, num_heads=2)
    heads = MedusaHeads(mcfg, model.get_output_embeddings())
    save_drafter(root / "medusa", "medusa", heads, mcfg, verifier_fingerprint=fp, verifier_name="tiny")
    ecfg = EagleConfig(hidden_size=32, vocab_size=128, decoder_config=model.config.to_dict(), variant="eagle3",
                       fusion_layers=[0, 1, 1], draft_vocab_size=64, lm_head="own")
    save_drafter(root / "eagle3", "eagle", EagleDrafter(ecfg), ecfg, verifier_fingerprint=fp, verifier_name="tiny")
    final = root / "medusa2" / "final"  # train/medusa.py's Medusa-2 output: heads/, verifier/, meta.json
    save_drafter(final / MEDUSA2_PARTS[0], "medusa", heads, mcfg, verifier_fingerprint=fp, verifier_name="tiny-medusa2")
    model.save_pretrained(final / MEDUSA2_PARTS[1])
    tok.save_pretrained(final / MEDUSA2_PARTS[1])
    (final / "meta.json").write_text(json.dumps({"kind": "medusa2", "tuned_fingerprint": fp}))
    export = root / "export"  # scripts/export.py format=vllm: the engine's config.json (no draftsmith block) and
    export.mkdir()            # export.json
    (export / "config.json").write_text(json.dumps(engine_config("medusa", mcfg)))
    (export / "export.json").write_text(json.dumps({"format": "vllm", "kind": "medusa", "exported_from": "x",
                                                    "verifier_fingerprint": fp, "verifier_name": "tiny"}))
    student = build_student(model, tok, OmegaConf.create({"init": "truncate", "num_layers": 1}))
    save_draft_model(root / "draft", student, tok, verifier_fingerprint=fp, verifier_name="tiny")
    return root


WHAT_IT_IS = {  # folder -> the one line load_verifier gives for it as model.path
    "medusa": lambda p: f"model.path={p} is a Medusa heads folder (trained by draftsmith), not a verifier: pass it "
                        f"as drafter={p} proposer=medusa, and point model.path at its verifier (tiny)",
    "eagle3": lambda p: f"model.path={p} is an EAGLE-3 drafter (trained by draftsmith), not a verifier: pass it as "
                        f"drafter={p} proposer=eagle, and point model.path at its verifier (tiny)",
    "medusa2/final": lambda p: f"model.path={p} is a Medusa-2 output (heads/ and the tuned verifier/), not a "
                               f"verifier: pass model.path={p}/verifier drafter={p}/heads proposer=medusa",
    "medusa2/final/heads": lambda p: f"model.path={p} is the heads of the Medusa-2 output {p.parent}, not a "
                                     f"verifier: pass drafter={p} proposer=medusa model.path={p.parent}/verifier",
    "export": lambda p: f"model.path={p} is a Medusa heads folder (exported by scripts/export.py, format=vllm), "
                        f"not a verifier: pass it as drafter={p} proposer=medusa, and point model.path at its verifier "
                        f"(tiny)",
}


@pytest.mark.parametrize("name", WHAT_IT_IS)
def test_a_drafter_folder_as_model_path_says_what_it_is_and_which_key_takes_it(drafter_folders, name):
    from draftsmith.models.verifier import read_verifier_tensor

    path = drafter_folders / name
    with pytest.raises(DraftsmithError) as refused:
        load_verifier(_cfg(path))
    assert str(refused.value) == WHAT_IT_IS[name](path)
    with pytest.raises(DraftsmithError, match="not a verifier"):  # every reader of model.path: one home
        read_verifier_tensor(_cfg(path), ("lm_head.weight",), (128, 32))


def test_a_draft_model_folder_still_loads_as_a_verifier(drafter_folders):
    """A draft model IS a causal LM with the verifier's tokenizer: HF assisted generation loads it
    through load_verifier (decode/evaluate.py hf.assistant), and its own plain decoding is a fair
    measurement. So it loads; so does the tuned verifier of a Medusa-2 output."""
    draft = load_verifier(_cfg(drafter_folders / "draft"))
    assert draft.config.num_hidden_layers == 1
    tuned = load_verifier(_cfg(drafter_folders / "medusa2" / "final" / "verifier"))
    assert tuned.fingerprint == fingerprint(tiny_llama(dtype=torch.float32))


def test_evaluate_with_a_medusa_folder_as_model_path_stops_in_one_line(drafter_folders, tmp_path):
    """The slip as users make it: the preset, and model.path at the heads (it was a transformers
    ValueError under a Hydra traceback)."""
    proc = subprocess.run([sys.executable, "decode/evaluate.py", "model=smollm2-135m",
                           f"model.path={drafter_folders / 'medusa2' / 'final' / 'heads'}", "proposer=vanilla",
                           "drafter=null", "data=tiny", f"output_dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("draftsmith: error: model.path="), proc.stderr[-2000:]
    assert f"drafter={drafter_folders / 'medusa2' / 'final' / 'heads'}" in lines[0]
