"""A tuned verifier backbone, shared by Medusa-2 (train/medusa.py) and the verifier fine-tune
(scripts/finetune_verifier.py): LoRA adapters via peft on the projections, or every weight,
and the tuned model back as a plain HF model (LoRA merged) for saving."""
from __future__ import annotations

import copy


def lora_config(lora, dropout: float):
    """A `lora:` config node ({r, alpha, dropout, target_modules}) as peft's LoraConfig; dropout
    apart (0 when only merging)."""
    from peft import LoraConfig

    return LoraConfig(r=int(lora.r), lora_alpha=float(lora.alpha), lora_dropout=dropout,
                      target_modules=list(lora.target_modules), bias="none")


def tunable(model, backbone: str, lora):
    """-> (trainable model, teacher): LoRA adapters (teacher None: the same model with its
    adapters switched off is the original) or the whole model (teacher = a frozen copy)."""
    model.requires_grad_(False)
    if backbone == "lora":
        from peft import get_peft_model

        return get_peft_model(model, lora_config(lora, float(lora.dropout))), None
    teacher = copy.deepcopy(model).eval()
    return model.requires_grad_(True), teacher


def merged(base, state: dict, backbone: str, lora):
    """The tuned model as a plain HF model built afresh on this process, from `state` (the
    trainable model's full state dict, gathered under ZeRO-3): LoRA merged into the weights.
    `base` gives the architecture and dtype (the peft model's base, or the model itself)."""
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_config(base.config, dtype=base.dtype)
    if backbone == "lora":
        from peft import get_peft_model

        fresh = get_peft_model(fresh, lora_config(lora, 0.0))
        fresh.load_state_dict(state, strict=True)
        return fresh.merge_and_unload().eval()
    fresh.load_state_dict(state, strict=True)
    return fresh.eval()
