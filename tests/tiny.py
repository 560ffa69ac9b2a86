"""Tiny offline stand-ins for tests: a character tokenizer with a ChatML template and tiny
random Llama verifiers built from config. Nothing here touches the network."""
from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, PreTrainedTokenizerFast,
                          Qwen2Config)

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


def save_tiny_verifier(folder, **overrides):
    """A tiny fp32 Llama (tiny_llama's overrides) and the char tokenizer saved as an HF folder -> folder."""
    tiny_llama(dtype=torch.float32, **overrides).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


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


# tiny models of every preset's architecture family (tests/decode/test_architectures.py)
FAMILY_SHAPE = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)

# preset -> (config class, the checkpoint's shape-independent settings, where they come from)
FAMILIES = {
    "llama2-7b": (LlamaConfig, dict(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
                                    attention_bias=False, tie_word_embeddings=False),
                  "meta-llama/Llama-2-7b-chat-hf config.json"),
    "vicuna-7b-v1.3": (LlamaConfig, dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                                         tie_word_embeddings=False), "lmsys/vicuna-7b-v1.3 config.json"),
    "llama3.1-8b-instruct": (LlamaConfig, dict(
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
        "meta-llama/Llama-3.1-8B-Instruct config.json"),
    "qwen2.5-7b-instruct": (Qwen2Config, dict(rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                                              use_sliding_window=False, sliding_window=131072, max_window_layers=28,
                                              tie_word_embeddings=False),
                            "Qwen/Qwen2.5-7B-Instruct config.json (q/k/v projections with bias)"),
    "mistral-7b-instruct": (MistralConfig, dict(rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=32768,
                                                sliding_window=None, tie_word_embeddings=False),
                            "mistralai/Mistral-7B-Instruct-v0.3 config.json"),
    "smollm2-135m": (LlamaConfig, dict(rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                                       tie_word_embeddings=True), "HuggingFaceTB/SmolLM2-135M-Instruct config.json"),
}


def tiny_family(preset: str, seed: int = 0, **extra):
    """A tiny fp64 model of a preset's family with its checkpoint's shape-independent settings."""
    config_cls, settings, _ = FAMILIES[preset]
    config = config_cls(**FAMILY_SHAPE, **{**settings, **extra})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    model.lm_head.weight.data *= 8 if not config.tie_word_embeddings else 1  # a peaked law: long greedy runs agree
    return model.requires_grad_(False)
