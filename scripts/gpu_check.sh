#!/usr/bin/env bash
# The GPU check (issue 11): the engine stays lossless on CUDA, and the cost of a decode step per
# tree with the EntMTP throughput it predicts. Needs only torch, transformers and safetensors.
# Prints ONE JSON line (progress on stderr); exit 0 ok, 1 an output differed, 2 an error,
# 124 past the 6-minute limit.
#   scripts/gpu_check.sh                       # CUDA, full sizes (about 1-2 minutes on one GPU)
#   scripts/gpu_check.sh --device cpu --quick  # small sizes in seconds, to test the script
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 360 "${PYTHON:-python3}" scripts/gpu_check.py "$@"
