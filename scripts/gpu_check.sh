#!/usr/bin/env bash
# The GPU checks in one go, on a machine with one NVIDIA GPU after `bash scripts/setup.sh`:
# greedy parity with FlashInfer tree verify and CUDA graphs, seeded sampling under deterministic inference,
# DART / plain (/ EAGLE3 with --eagle3-draft DIR) timings at batch sizes 1-64. Output: gpu-check/ (server logs,
# gpu_check.json). Extra arguments go to benchmarks/gpu_check.py (--draft DIR --store FILE for a trained drafter).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
.venv/bin/python benchmarks/gpu_check.py --out gpu-check "$@"
