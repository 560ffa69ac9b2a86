"""Run by tests/train/test_distributed.py under `torchrun --nproc_per_node 2`: shard a frozen
verifier with train.core.accel.shard_fsdp and check it computes what the whole model does."""
import gc
import json
import sys

import torch
import torch.distributed as dist

from draftsmith.models.verifier import Verifier
from draftsmith.train.core.accel import full_copy, shard_fsdp
from tests.tiny import tiny_llama


def main(out_path: str, tied: bool) -> None:
    dist.init_process_group("gloo")
    # the same seed on every rank; tied = lm_head shares the embedding matrix (SmolLM2, Llama-3.2)
    model = tiny_llama(dtype=torch.float32, num_hidden_layers=3, tie_word_embeddings=tied)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = Verifier(model, None, "", "", "").hidden_states(ids)
    lm_head = full_copy(model.get_output_embeddings())
    total = sum(p.numel() for p in model.parameters())
    how = shard_fsdp(model.requires_grad_(False).eval())
    local = sum(p.to_local().numel() for p in model.parameters())
    with torch.no_grad():
        sharded = Verifier(model, None, "", "", "").hidden_states(ids)
    result = {"how": how, "local": local, "total": total, "max_diff": (sharded - whole).abs().max().item(),
              "lm_head_is_plain": type(lm_head.weight.data) is torch.Tensor}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    # Both ranks done with the sharded model, and its DTensors (which hold the device mesh and so
    # the gloo group) freed, before the group goes away: destroying the group under live DTensors
    # aborted a rank at exit about 1 run in 12 ("terminate called without an active exception").
    del model, lm_head, sharded
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "tied")
