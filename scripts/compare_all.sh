#!/usr/bin/env bash
# Train every drafter on the same self-distilled data and budget, then compare all methods:
#   bash scripts/compare_all.sh                  # STEPS=300 DRAFT_STEPS=100 (a few hours on 2 CPU cores)
#   STEPS=2000 DRAFT_STEPS=1000 bash scripts/compare_all.sh model=vicuna-7b-v1.3   # on a GPU node
# Needs the self-distilled data of the main job (scripts/quickstart.sh, or generate_selfdistill.py).
# Every trainer reads the same offline features (written once): Medusa-1 and EAGLE-1 the last
# hidden state, EAGLE-3 three layers, the draft models the verifier's top-64 logits (draft-rkl
# needs the full teacher law and runs online). Extra Hydra overrides apply to every command.
set -euo pipefail
STEPS=${STEPS:-300}
DRAFT_STEPS=${DRAFT_STEPS:-100}
OUT=${OUT:-outputs/cmp}
FEATURES=$OUT/features
python scripts/prepare_features.py model.dtype=bfloat16 layers='[2,15,27]' topk=64 output_dir="$FEATURES" "$@"
run="model.dtype=bfloat16 trainer.eval_every=100 trainer.save_every=100 logger=csv"
python train/medusa.py $run data.features="$FEATURES" trainer.max_steps="$STEPS" method.lm_head=shared \
    output_dir="$OUT/medusa1" "$@"
python train/eagle.py $run data.features="$FEATURES" trainer.max_steps="$STEPS" method=eagle1 output_dir="$OUT/eagle1" "$@"
python train/eagle.py $run data.features="$FEATURES" trainer.max_steps="$STEPS" method=eagle3 \
    method.fusion_layers='[2,15,27]' output_dir="$OUT/eagle3" "$@"
draft="$run trainer.max_steps=$DRAFT_STEPS trainer.lr=3e-4 method.student.num_layers=4"
for d in fkl jsd tvd; do
    python train/draft.py $draft data.features="$FEATURES" method=draft-$d output_dir="$OUT/draft-$d" "$@"
done
python train/draft.py $draft method=draft-rkl output_dir="$OUT/draft-rkl" "$@"
# the same student before any distillation: the baseline that distillation must beat
python train/draft.py $draft trainer.max_steps=0 output_dir="$OUT/draft-untrained" "$@"
python scripts/compare.py cmp_dir="$OUT" "$@"
