#!/usr/bin/env bash
# The GPU device check (docs/gpu.md): on one GPU (H100/H200) in under 8 minutes, JSON + markdown into OUT.
#   bash scripts/device_check.sh                     # a GPU node: OUT=outputs/device-check
#   DEVICE=cpu bash scripts/device_check.sh          # the same stages end to end at toy sizes on the CPU
#   OUT=/tmp/dc bash scripts/device_check.sh stages='[verifier,decode_graph]'   # some stages only
# In order: the device tests; Medusa-1, EAGLE-3 and a draft model trained a fixed number of steps
# on SmolLM2 in bf16; train/medusa.py under a one-process `accelerate launch` and under DeepSpeed
# ZeRO-3 with one process; MT-bench through the engine's CUDA-graph path with each drafter, against
# plain decoding on the same path and HF's static cache + compile; the batched engine at N = 1, 8,
# 32. Each stage runs under its own time limit; a failed stage is recorded with its one-line reason
# and the next one runs; the exit status is 1 when any stage failed.
# It installs nothing and needs no network: the verifier is the packaged GGUF (model=smollm2-135m).
# Extra arguments are Hydra overrides for scripts/device_check.py (conf/device_check.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-auto}
OUT=${OUT:-outputs/device-check}
export WANDB_MODE=offline HF_HUB_OFFLINE=1

cpu_tests=tests/decode/test_device.py::test_evaluate_decodes_on_the_auto_device   # the device tests quick on a CPU
cpu_tests+=,tests/decode/test_device.py::test_the_cpu_law_helpers_agree_with_the_device
cpu_tests+=,tests/decode/test_evaluate.py::test_vanilla_method_needs_no_drafter_and_unknown_proposer_is_refused

case $DEVICE in
    cpu) # toy sizes: the tests' tiny random verifier (2 layers; its 128-token vocabulary takes no 8,192-token
         # draft vocabulary), a few steps and tokens; decode_graph's step traced whole (engine.compile=count:
         # the graph a GPU compiles, run eagerly), HF's static path traced (backend eager)
        sizes=(device=cpu toy_verifier=true budget_s=900 timeout_scale=2 train.data=tiny train.max_length=128
               train.steps=4 train.batch_size=2 train.eval_size=2
               "train.methods.medusa=['method=medusa1']"
               "train.methods.eagle3=['method=eagle3','method.draft_vocab_size=64']"
               "train.methods.draft=['method=draft-fkl','method.student.num_layers=1']"
               data.num_prompts=2 decode.max_new_tokens=8 decode.compile=count decode.hf_backend=eager
               batched.max_new_tokens=4 launch.zero3_config=conf/accelerate/cpu-2proc-zero3.yaml
               "device_tests=[$cpu_tests]") ;;
    auto|cuda|cuda:[0-9]*) sizes=(device="$DEVICE") ;;
    *) echo "device_check.sh: DEVICE=$DEVICE; valid: auto, cuda, cuda:N (a GPU) or cpu (toy sizes)" >&2; exit 2 ;;
esac
python scripts/device_check.py "${sizes[@]}" output_dir="$OUT" "$@"
