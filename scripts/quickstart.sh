#!/usr/bin/env bash
# The offline default, end to end, on SmolLM2-135M-Instruct (about 12 minutes on 2 CPU cores with
# AVX-512 / AMX, about 19-25 on an AVX2-only CPU):
#   1. convert the packaged GGUF verifier once (cached under ~/.cache/draftsmith),
#   2. self-distill: the verifier answers chit-chat prompts itself (continuous batching, greedy;
#      resumable),
#   3. train 4 Medusa-1 heads on those answers plus 400 ShareGPT conversations as fixed text
#      (data=selfdistill-mix), on the verifier's own tokens (method.targets=verifier), over an
#      8,192-token draft vocabulary; per-head held-out accuracy is printed,
#   4. build a datastore of ShareGPT's answers (~40 s; decode/datastore.py, REST),
#   5. evaluate the heads on MT-bench against plain decoding and HF generate, with prompt lookup
#      and the datastore grafted onto their tree (decode.lookup_tokens, decode.datastore: the heads'
#      tokens, the continuation of the latest n-gram match in the context and the most frequent
#      continuations of the context's longest suffix in the datastore, verified in one forward,
#      lossless); print the table.
# CPU-sized choices (see README "Results", the learning curves): the reduced draft vocabulary
# makes each head's projection 6x cheaper to train and to decode with; the verifier runs in
# DTYPE everywhere (default: bf16 where the CPU computes it natively, AVX-512 / AMX, else fp32:
# models.verifier.fast_dtype; the fingerprint does not depend on dtype); the evaluation verifies
# the heads' tree PATHS under both grafts: in bf16 head 0's top-2 and head 1's top-1 under the
# first (an AVX-512 Zen 4 box, one-row bf16 step 13 ms, a 16-token verify 1.45 of it:
# scripts/bench/tune_decode.py measured 1.19x for it, 1.08x for head 0's top-4 and four deeper
# nodes, medusa-cpu's whole tree 0.94x), in fp32 head 0's top-1 alone (an AVX2-only CPU, where
# each node a verify holds costs: 1.06x against 0.84x for medusa-cpu's 8 paths;
# docs/results/main-job.md).
# PATHS=default keeps medusa-cpu's tree (root + 8 drafted nodes) in any dtype.
# Scale up: NUM_PROMPTS=2000 STEPS=2000 bash scripts/quickstart.sh
# (extra arguments are Hydra overrides for train/medusa.py).
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_PROMPTS="${NUM_PROMPTS:-200}"
STEPS="${STEPS:-100}"
EVAL_PROMPTS="${EVAL_PROMPTS:-8}"
DTYPE="${DTYPE:-$(python -c 'from draftsmith.models.verifier import fast_dtype; print(fast_dtype())')}"
PRECISION="$(case "$DTYPE" in float32) echo fp32;; float16) echo fp16;; *) echo bf16;; esac)"  # the heads', as the verifier
# the heads' tree (decode.paths)
PATHS="${PATHS:-$(case "$DTYPE" in float32) echo '[[0]]';; *) echo '[[0],[1],[0,0]]';; esac)}"
TREE=()
if [ "$PATHS" != default ]; then TREE=("decode.paths=$PATHS"); fi
export WANDB_MODE="${WANDB_MODE:-offline}"

python scripts/generate_selfdistill.py num_prompts="$NUM_PROMPTS" max_new_tokens=128 model.dtype="$DTYPE"
python train/medusa.py data=selfdistill-mix method.targets=verifier method.draft_vocab_size=8192 \
    trainer.max_steps="$STEPS" trainer.eval_every=50 trainer.save_every=50 model.dtype="$DTYPE" \
    trainer.precision="$PRECISION" "$@"
python scripts/build_datastore.py data=sharegpt-pypi
python decode/evaluate.py model.dtype="$DTYPE" decode=medusa-cpu ${TREE[@]+"${TREE[@]}"} decode.lookup_tokens=10 decode.lookup_min_ngram=2 \
    decode.datastore=outputs/datastore/sharegpt-pypi-smollm2-135m decode.datastore_tokens=4 \
    data=mtbench data.num_prompts="$EVAL_PROMPTS" max_new_tokens=64
