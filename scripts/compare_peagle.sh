#!/usr/bin/env bash
# EAGLE-3 against P-EAGLE, each with the soft cross-entropy and with the LK loss, at the same budget
# (docs/peagle.md), on the offline default verifier (SmolLM2-135M, bf16) and the 2-core CPUs:
#   bash scripts/compare_peagle.sh                  # 4 runs x 130 steps (585k tokens each) + curves + comparison: hours
#   STEPS=4 EVAL=2 EVAL_PROMPTS='{mtbench: 2, humaneval: 2}' CURVE_PROMPTS=1 NEW_TOKENS=16 OUT=outputs/peagle-smoke bash scripts/compare_peagle.sh
# 1. train eagle3, eagle3-lk (method.loss=lk), peagle, peagle-lk on data=sharegpt-text with
#    trainer=cpu-long: the same data, seed, batches (8 conversations a step), STEPS steps, lr schedule;
#    the 14-minute EAGLE-3 recipe of docs/results/draft-int8.md (method.noise=0), a held-out
#    evaluation (simulated tau) and a drafter snapshot every EVAL steps; each run resumes if stopped;
# 2. learning curves: held-out simulated tau against training tokens, each snapshot also decoded on
#    CURVE_PROMPTS MT-bench prompts, NEW_TOKENS new tokens (scripts/bench/learning_curve.py -> OUT/curves);
# 3. one comparison (scripts/bench/compare.py -> OUT/compare): EVAL_PROMPTS (all 80 MT-bench, 40 HumanEval),
#    greedy, NEW_TOKENS new tokens, the bf16 verifier; EAGLE-3 with its CPU tree (decode=eagle-dynamic:
#    depth 2, 8 nodes, 2 drafter forwards a step) and P-EAGLE with decode=peagle-dynamic (depth 4, 8
#    nodes, 1 drafter forward); plain decoding interleaved in every cell and timed alone in fp32 and
#    bf16 (the fastest plain decoding);
# 4. the table (scripts/bench/peagle_summary.py -> OUT/peagle.md): tau, drafter / verifier ms per step,
#    speedups, the curves, and the two targets checked.
# Extra arguments are Hydra overrides for every training command.
set -euo pipefail
STEPS=${STEPS:-130}
EVAL=${EVAL:-26}
EVAL_PROMPTS=${EVAL_PROMPTS:-'{mtbench: 80, humaneval: 40}'}
CURVE_PROMPTS=${CURVE_PROMPTS:-5}
NEW_TOKENS=${NEW_TOKENS:-128}
OUT=${OUT:-outputs/peagle-cmp}
export WANDB_MODE="${WANDB_MODE:-offline}"

for run in eagle3:eagle3:ce eagle3-lk:eagle3:lk peagle:peagle:ce peagle-lk:peagle:lk; do
    IFS=: read -r name method loss <<< "$run"
    python train/eagle.py data=sharegpt-text trainer=cpu-long model.dtype=bfloat16 trainer.max_steps="$STEPS" \
        trainer.eval_every="$EVAL" trainer.save_every="$EVAL" trainer.snapshot_every="$EVAL" \
        method="$method" method.loss="$loss" method.noise=0 probe.num_prompts=0 output_dir="$OUT/$name" "$@"
done

python scripts/bench/learning_curve.py runs.eagle3="$OUT/eagle3" +runs.eagle3-lk="$OUT/eagle3-lk" \
    +runs.peagle="$OUT/peagle" +runs.peagle-lk="$OUT/peagle-lk" \
    "+decode.eagle3-lk='method=eagle decode=eagle-dynamic'" "+decode.peagle='method=eagle decode=peagle-dynamic'" \
    "+decode.peagle-lk='method=eagle decode=peagle-dynamic'" num_prompts="$CURVE_PROMPTS" max_new_tokens="$NEW_TOKENS" \
    output_dir="$OUT/curves"

python scripts/bench/compare.py cmp_dir="$OUT" only='[eagle3,eagle3-lk,peagle,peagle-lk]' datasets='[mtbench,humaneval]' \
    temperatures='[0.0]' num_prompts="$EVAL_PROMPTS" max_new_tokens="$NEW_TOKENS" hf_with=none \
    "+methods.eagle3-lk=['method=eagle','drafter=$OUT/eagle3-lk/final','decode=eagle-dynamic']" \
    "+methods.peagle=['method=eagle','drafter=$OUT/peagle/final','decode=peagle-dynamic']" \
    "+methods.peagle-lk=['method=eagle','drafter=$OUT/peagle-lk/final','decode=peagle-dynamic']" \
    output_dir="$OUT/compare"

python scripts/bench/peagle_summary.py cmp_dir="$OUT"
