"""A user's own chat JSONL, passed exactly as the README and conf/data/chat-jsonl.yaml say:
`python train/medusa.py data=chat-jsonl data.path=my_chats.jsonl`, then the evaluator on a
prompts file the same way, run as processes from the user's own folder (tiny verifier)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_model_overrides

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def write_chats(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            if i % 2:  # both schemas the loader detects
                record = {"conversations": [{"from": "human", "value": f"Say {i}."}, {"from": "gpt", "value": f"{i}!"}]}
            else:
                record = {"messages": [{"role": "user", "content": f"Count to {i % 7}."},
                                       {"role": "assistant", "content": " ".join(str(k) for k in range(i % 7 + 1))}]}
            f.write(json.dumps(record) + "\n")


def run(args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_train_and_evaluate_on_my_own_chat_jsonl(tiny_model_dir, tmp_path):
    write_chats(tmp_path / "my_chats.jsonl", 80)
    write_chats(tmp_path / "prompts.jsonl", 3)
    model = tiny_model_overrides(tiny_model_dir)
    train = run([str(ROOT / "train/medusa.py"), "data=chat-jsonl", "data.path=my_chats.jsonl", *model,
                 "trainer=debug", "logger=none", "output_dir=heads"], tmp_path)
    assert train.returncode == 0, train.stderr[-2000:]
    assert "72 train / 8 held-out conversations" in train.stdout + train.stderr  # data.eval_size=auto: a tenth
    evaluate = run([str(ROOT / "decode/evaluate.py"), "data=chat-jsonl", "data.path=prompts.jsonl", *model,
                    "proposer=medusa", "drafter=heads/final", "decode=chain4", "max_new_tokens=8", "hf.enabled=false",
                    "output_dir=eval"], tmp_path)
    assert evaluate.returncode == 0, evaluate.stderr[-2000:]
    report = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert report["data"] == "chat-jsonl" and report["num_prompts"] == 3
    assert report["methods"]["medusa"]["greedy_identity_rate"] == 1.0


def test_a_path_the_source_ignores_is_refused_in_one_line(tmp_path):
    proc = run([str(ROOT / "decode/evaluate.py"), "data=mtbench", "data.path=x.jsonl"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "data.path='x.jsonl' is ignored by data.source='mtbench'" in proc.stderr


def test_a_small_file_of_my_own_trains_with_the_default_held_out_size(tiny_model_dir, tmp_path):
    """40 conversations: the default data.eval_size=auto holds out 4 and says so; an explicit
    size that cannot fit is still refused in one line."""
    write_chats(tmp_path / "my_chats.jsonl", 40)
    model = tiny_model_overrides(tiny_model_dir)
    args = [str(ROOT / "train/medusa.py"), "data=chat-jsonl", "data.path=my_chats.jsonl", *model, "trainer=debug",
            "trainer.max_steps=1", "logger=none", "probe.num_prompts=0"]
    train = run([*args, "output_dir=heads"], tmp_path)
    assert train.returncode == 0, train.stderr[-2000:]
    out = train.stdout + train.stderr
    assert "data.eval_size=auto: 4 of the 40 conversations of data=chat-jsonl held out" in out
    assert "36 train / 4 held-out conversations" in out
    refused = run([*args, "data.eval_size=64", "output_dir=refused"], tmp_path)
    assert refused.returncode == 2, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]  # after the verifier's loading bar: one line
    assert last.startswith("draftsmith: error: data.eval_size=64 must be in [0, 40)"), refused.stderr
    assert not (tmp_path / "refused").exists()  # refused before any work: nothing left behind


def test_a_run_refused_before_any_work_leaves_no_output_folder(tmp_path):
    """`python train/medusa.py model=llama2-7b` (no local weights, no hub): one line, and no
    outputs/medusa-llama2-7b/hydra left in the user's folder."""
    proc = run([str(ROOT / "train/medusa.py"), "model=llama2-7b"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "model.path=/path/to/local/hf/folder" in proc.stderr
    assert not (tmp_path / "outputs").exists(), sorted(str(p) for p in (tmp_path / "outputs").rglob("*"))
