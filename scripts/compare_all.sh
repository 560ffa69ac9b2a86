#!/usr/bin/env bash
# The long recipes behind README "Results", on the offline default (SmolLM2-135M, 2 CPU cores):
#   bash scripts/compare_all.sh                           # EAGLE-3, as in the README table
#   METHODS="eagle3 medusa1 draft-fkl" STEPS=600 bash scripts/compare_all.sh
#   NUM_PROMPTS=20000 STEPS=20000 bash scripts/compare_all.sh model=vicuna-7b-v1.3   # a GPU node
# 1. self-distil ShareGPT first turns (data=selfdistill-sharegpt; resumes where it stopped),
# 2. train each method on data=sharegpt-mix (those answers + ShareGPT text) with trainer=cpu-long,
#    a drafter snapshot every SNAPSHOT steps,
# 3. learning curves from the snapshots (scripts/learning_curve.py),
# 4. one comparison on MT-bench and HumanEval, greedy, 128 new tokens, with prompt lookup and
#    lookahead (scripts/compare.py; speedups against plain decoding interleaved in the same run).
# Extra arguments are Hydra overrides for every training command.
set -euo pipefail
NUM_PROMPTS=${NUM_PROMPTS:-1024}
STEPS=${STEPS:-200}
SNAPSHOT=${SNAPSHOT:-50}
METHODS=${METHODS:-eagle3}
EVAL_PROMPTS=${EVAL_PROMPTS:-10}
OUT=${OUT:-outputs/cmp}
export WANDB_MODE="${WANDB_MODE:-offline}"

python scripts/generate_selfdistill.py data=selfdistill-sharegpt num_prompts="$NUM_PROMPTS" max_new_tokens=256
run="data=sharegpt-mix trainer=cpu-long model.dtype=bfloat16 trainer.max_steps=$STEPS trainer.eval_every=$SNAPSHOT
     trainer.save_every=$SNAPSHOT trainer.snapshot_every=$SNAPSHOT"
curves=()
for m in $METHODS; do
    case $m in
        eagle1|eagle3) python train/eagle.py $run method="$m" output_dir="$OUT/$m" "$@" ;;
        medusa1) python train/medusa.py $run method.draft_vocab_size=8192 method.targets=verifier output_dir="$OUT/$m" "$@" ;;
        draft-fkl) python train/draft.py $run method=draft-fkl method.student.num_layers=4 trainer.lr=3e-4 \
                       output_dir="$OUT/$m" "$@" ;;
        *) echo "compare_all.sh: METHODS has '$m'; valid: eagle1 eagle3 medusa1 draft-fkl" >&2; exit 2 ;;
    esac
    case $m in eagle1) ;; draft-fkl) curves+=("runs.draft=$OUT/$m") ;; *) curves+=("runs.$m=$OUT/$m") ;; esac
done
if [ ${#curves[@]} -gt 0 ]; then
    python scripts/learning_curve.py "${curves[@]}" num_prompts=8 output_dir="$OUT/learning-curve"
fi
only=$(echo "$METHODS prompt-lookup lookahead" | tr ' ' ',')
python scripts/compare.py cmp_dir="$OUT" only="[$only]" datasets='[mtbench,humaneval]' temperatures='[0.0]' \
    num_prompts="$EVAL_PROMPTS" max_new_tokens=128 hf_with=none output_dir="$OUT/compare"
