"""Tiny offline stand-ins for tests: a character tokenizer with a ChatML template and tiny
random Llama verifiers built from config. Nothing here touches the network."""
from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# Same shape of template as SmolLM2-Instruct (ChatML with a default system turn).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (~100 tokens) with the ChatML chat template."""
    chars = sorted(set(string.printable))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int = 128, **overrides) -> LlamaConfig:
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=3,
        pad_token_id=1,
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def tiny_llama(vocab_size: int = 128, dtype: torch.dtype = torch.float64, seed: int = 0,
               attn_implementation: str = "sdpa", **overrides) -> LlamaForCausalLM:
    """A 2-layer random Llama; fp64 by default so exactness tests compare to 1e-12."""
    torch.manual_seed(seed)
    cfg = tiny_llama_config(vocab_size, **overrides)
    cfg._attn_implementation = attn_implementation
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


def save_tiny_medusa(folder, num_heads: int = 4):
    """Medusa heads over tiny_llama's fp32 weights (the same seed as the tiny_model_dir fixture),
    their first layers randomised so the heads disagree with the verifier now and then; saved as a
    drafter checkpoint folder."""
    from draftsmith.models.checkpoint import save_drafter
    from draftsmith.models.medusa import MedusaConfig, MedusaHeads
    from draftsmith.models.verifier import fingerprint

    model = tiny_llama(dtype=torch.float32)
    cfg = MedusaConfig(hidden_size=32, vocab_size=128, num_heads=num_heads)
    heads = MedusaHeads(cfg, model.get_output_embeddings())
    torch.manual_seed(1)
    for block in heads.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.05)
    return save_drafter(folder, "medusa", heads, cfg, verifier_fingerprint=fingerprint(model), verifier_name="tiny")
