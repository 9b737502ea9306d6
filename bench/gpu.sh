#!/usr/bin/env bash
# GPU check of this project, in one run: tokens/s and MFU of a 1.3B GPT first (default and cuDNN
# attention, a top-25 kernel table in OUT/kernels.txt), then the GPU tests, bf16 training with
# save/resume, telemetry, and with 2+ GPUs TP=2/DP=2/PP=2/CP=2 (each --cp-comm-type) over NCCL and a
# 2-GPU --async-save resume
# (see bench/gpu_check.py).
#
#   bash bench/gpu.sh [--out DIR] [--peak-tflops N] [--time-budget S] [--stages a,b]   # on a GPU machine
#   bash bench/gpu.sh --dry-run [--out DIR]                                            # CPU, gloo, tiny
#
# It runs from this source tree on the machine's own python3 and PyTorch (PYTHONPATH = repo root) and
# installs nothing from a registry: if OpenTelemetry is missing it is installed from the wheels in
# .whl/ (made by bench/fetch_gpu_wheels.sh) into a private folder. Exit status 1 if any stage failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" bench/gpu_check.py "$@"
