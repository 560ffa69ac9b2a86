"""Draft-model students: construction from the verifier, and the saved folder."""
import pytest
import torch
from omegaconf import OmegaConf

from draftsmith.decode.build import proposer_for
from draftsmith.models.draft import build_student, load_draft_model, save_draft_model
from draftsmith.models.errors import DraftsmithError
from tests.tiny import tiny_llama, tiny_tokenizer


def test_truncated_student_reproduces_the_verifiers_first_layers():
    verifier = tiny_llama(num_hidden_layers=4)
    student = build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "truncate", "num_layers": 2}))
    assert student.config.num_hidden_layers == 2 and student.training
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        v = verifier.model(ids, output_hidden_states=True)
        s = student.model(ids, output_hidden_states=True)
    for i in range(2):  # the embedding output and layer 0's output
        torch.testing.assert_close(s.hidden_states[i], v.hidden_states[i], rtol=0, atol=0)
    # the student's final state is the verifier's final norm applied to ITS layer-1 output
    torch.testing.assert_close(s.last_hidden_state, verifier.model.norm(v.hidden_states[2]), rtol=0, atol=0)
    torch.testing.assert_close(student.lm_head.weight, verifier.lm_head.weight, rtol=0, atol=0)
    with pytest.raises(DraftsmithError, match="method.student.num_layers=4: must be 1..3"):
        build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "truncate", "num_layers": 4}))


def test_fresh_and_pretrained_students(tmp_path):
    verifier = tiny_llama(num_hidden_layers=4)
    cfg = OmegaConf.create({"init": "config", "num_layers": 1, "hidden_size": 32, "intermediate_size": 48,
                            "num_attention_heads": 4, "num_key_value_heads": 2})
    fresh = build_student(verifier, tiny_tokenizer(), cfg)
    assert (fresh.config.num_hidden_layers, fresh.config.intermediate_size) == (1, 48)
    torch.testing.assert_close(fresh.get_input_embeddings().weight, verifier.get_input_embeddings().weight)

    other = tiny_llama(vocab_size=96)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(DraftsmithError, match="vocabulary of 96 tokens, the verifier has 128"):
        build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "pretrained", "path": str(tmp_path / "other")}))
    fresh.save_pretrained(tmp_path / "same")
    tiny_tokenizer().save_pretrained(tmp_path / "same")
    loaded = build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "pretrained",
                                                                        "path": str(tmp_path / "same")}))
    assert loaded.config.num_hidden_layers == 1
    with pytest.raises(DraftsmithError, match="method.student.init='big' is not known"):
        build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "big"}))


@pytest.mark.parametrize("tied", [False, True])
def test_body_only_student_keeps_the_verifiers_embeddings_and_lm_head_frozen(tied):
    """method.student.trainable=body: only the decoder layers and the final norm learn."""
    verifier = tiny_llama(num_hidden_layers=4, tie_word_embeddings=tied)
    student = build_student(verifier, tiny_tokenizer(), OmegaConf.create(
        {"init": "truncate", "num_layers": 2, "trainable": "body"}))
    frozen = {n for n, p in student.named_parameters() if not p.requires_grad}
    assert frozen == ({"model.embed_tokens.weight"} if tied else {"model.embed_tokens.weight", "lm_head.weight"})
    assert all(p.requires_grad for n, p in student.named_parameters() if n.startswith(("model.layers.", "model.norm")))
    everything = build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "truncate", "num_layers": 2}))
    assert all(p.requires_grad for p in everything.parameters())  # the default: trainable=all
    with pytest.raises(DraftsmithError, match="method.student.trainable='head' is not known; valid: all, body"):
        build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "truncate", "num_layers": 2,
                                                                    "trainable": "head"}))
    narrow = OmegaConf.create({"init": "config", "num_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                               "num_attention_heads": 2, "num_key_value_heads": 1, "trainable": "body"})
    with pytest.raises(DraftsmithError, match="hidden_size=16 student has fresh random ones; use "
                                              "method.student.trainable=all"):
        build_student(verifier, tiny_tokenizer(), narrow)


def test_saved_draft_is_an_hf_folder_with_the_verifier_fingerprint(tmp_path):
    verifier = tiny_llama(num_hidden_layers=3)
    student = build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "truncate", "num_layers": 1}))
    out = save_draft_model(tmp_path / "final", student, tiny_tokenizer(), verifier_fingerprint="abc",
                           verifier_name="tiny")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    model, meta = load_draft_model(out, verifier_fingerprint="abc", vocab_size=128)
    assert model.use_kernels is False  # no layers swapped for Hub kernels (models/verifier.NO_HUB_KERNELS)
    assert meta["kind"] == "draft" and not model.training
    with pytest.raises(DraftsmithError, match="trained against verifier abc"):
        load_draft_model(out, verifier_fingerprint="xyz")
    with pytest.raises(DraftsmithError, match="vocabulary of 128 tokens, the verifier has 64"):
        load_draft_model(out, vocab_size=64)


def test_reduced_draft_vocab_is_saved_beside_the_hf_files_and_drafted_from(tmp_path):
    """draft_vocab= writes draft_vocab.safetensors; loading makes it a non-persistent buffer
    (HF's own loader and the weights are untouched); decode.draft_vocab=saved drafts from it,
    full from every row; a bad or unknown value is refused in one line."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from draftsmith.models.checkpoint import load_drafter

    verifier = tiny_llama(num_hidden_layers=3)
    student = build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "truncate", "num_layers": 1}))
    d2t = torch.tensor([0, 5, 9, 77])
    out = save_draft_model(tmp_path / "final", student, tiny_tokenizer(), verifier_fingerprint="abc",
                           verifier_name="tiny", draft_vocab=d2t)
    assert (out / "draft_vocab.safetensors").is_file()
    hf = AutoModelForCausalLM.from_pretrained(out)  # a plain HF causal LM: the whole lm_head
    assert hf.lm_head.weight.shape[0] == 128 and not hasattr(hf, "draft_vocab")
    drafter = load_drafter(out, verifier_fingerprint="abc")
    assert torch.equal(drafter.module.draft_vocab, d2t) and "draft_vocab" not in drafter.module.state_dict()
    target = SimpleNamespace(model=verifier, lm_head=verifier.lm_head)
    preset = {"name": "draft-chain", "proposer": "draft", "num_tokens": 2, "tree_topk": [], "length_schedule": "fixed",
              "min_tokens": 1, "max_tokens": 4, "confidence": 0.0}
    saved = proposer_for(drafter, target, OmegaConf.create({**preset, "draft_vocab": "saved"}))
    assert torch.equal(saved.rows, d2t)
    assert proposer_for(drafter, target, OmegaConf.create({**preset, "draft_vocab": "full"})).rows is None
    int8 = proposer_for(drafter, target, OmegaConf.create({**preset, "draft_vocab": "saved", "draft_quant": "int8"}))
    assert int8.quant == "int8" and torch.equal(int8.rows, d2t)  # decode.draft_quant reaches the proposer
    assert saved.quant == "none"  # the presets' default; the drafter's own module keeps its float weights
    assert isinstance(drafter.module.lm_head, torch.nn.Linear)
    with pytest.raises(DraftsmithError, match="decode.draft_quant='fp4'.*valid: int8, none"):
        proposer_for(drafter, target, OmegaConf.create({**preset, "draft_quant": "fp4"}))
    with pytest.raises(DraftsmithError, match="decode.draft_vocab='some'.*valid: full, saved"):
        proposer_for(drafter, target, OmegaConf.create({**preset, "draft_vocab": "some"}))
    plain = save_draft_model(tmp_path / "plain", student, tiny_tokenizer(), verifier_fingerprint="abc",
                             verifier_name="tiny")
    assert proposer_for(load_drafter(plain), target, OmegaConf.create({**preset, "draft_vocab": "saved"})).rows is None
    (out / "draft_vocab.safetensors").write_bytes(b"torn")
    with pytest.raises(DraftsmithError, match="draft_vocab.safetensors is corrupt.*delete it") as info:
        load_draft_model(out)
    assert "\n" not in str(info.value)
    from safetensors.torch import save_file

    save_file({"d2t": torch.tensor([4, 2])}, str(out / "draft_vocab.safetensors"))
    with pytest.raises(DraftsmithError, match="not an increasing list of token ids below 128"):
        load_draft_model(out)


def test_a_student_key_its_init_would_ignore_is_refused():
    verifier = tiny_llama(num_hidden_layers=2)
    for student, key in [({"init": "truncate", "num_layers": 1, "num_attention_heads": 2}, "num_attention_heads=2"),
                         ({"init": "pretrained", "path": "/x", "intermediate_size": 48}, "intermediate_size=48"),
                         ({"init": "truncate", "num_layers": 1, "path": "/x"}, "path=/x")]:
        init = student["init"]
        with pytest.raises(DraftsmithError, match=rf"^method.student.{key} would be ignored: it is read by "
                                                  rf"method.student.init=(config|pretrained) only \(init={init}\)"):
            build_student(verifier, tiny_tokenizer(), OmegaConf.create(student))
