"""Draft-model students: construction from the verifier, and the saved folder."""
import pytest
import torch
from omegaconf import OmegaConf

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
    assert meta["kind"] == "draft" and not model.training
    with pytest.raises(DraftsmithError, match="trained against verifier abc"):
        load_draft_model(out, verifier_fingerprint="xyz")
    with pytest.raises(DraftsmithError, match="vocabulary of 128 tokens, the verifier has 64"):
        load_draft_model(out, vocab_size=64)
