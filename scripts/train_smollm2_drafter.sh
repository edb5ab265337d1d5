#!/usr/bin/env bash
# Rebuild, from nothing but the installed packages, the SmolLM2-135M-Instruct drafter and 3-gram store the
# benchmarks measure: the target answers every training prompt (none of them a benchmark or warm-up prompt),
# a drafter is trained on those answers, and the store is built from the same answers.
#
#   bash scripts/train_smollm2_drafter.sh OUT_DIR      # writes OUT_DIR/draft and OUT_DIR/answers.store
#
# DTYPE (default bfloat16) is the target dtype of generation and training; use the dtype you will serve in
# (float32 on CPUs without bf16 matrix instructions, where it is several times faster). TRAIN_MINUTES
# (default 60) and MAX_STEPS (default 3000) bound training, whichever ends first; CONCURRENCY (default 32)
# is the generation batch. MAGPIE (default 4200) adds that many user prompts written by the target itself
# (`generate --magpie`) to the ~860 of the built-in pool: about 5,000 answers, some 3 hours on a 2-core VM.
# A step whose output is already in OUT_DIR is skipped and an interrupted generation resumes, so the run
# picks up where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/train_smollm2_drafter.sh OUT_DIR}
DTYPE=${DTYPE:-bfloat16}
TRAIN_MINUTES=${TRAIN_MINUTES:-60}
MAX_STEPS=${MAX_STEPS:-3000}
CONCURRENCY=${CONCURRENCY:-32}
MAGPIE=${MAGPIE:-4200}
PY=.venv/bin/python
mkdir -p "$OUT"

target=$($PY -m sglang_dart.assets smollm2 2>/dev/null | tail -n 1)
$PY - "$OUT/bench_prompts.txt" <<'EOF'
import sys
sys.path.insert(0, "benchmarks")
from throughput import PROMPTS, WARMUP_PROMPTS
open(sys.argv[1], "w").write("\n".join(PROMPTS + WARMUP_PROMPTS) + "\n")
EOF

if [ ! -s "$OUT/answers.jsonl" ]; then
  $PY -m sglang_dart.train.generate --target "$target" --out "$OUT/answers.jsonl" --dtype "$DTYPE" \
    --concurrency "$CONCURRENCY" --exclude-file "$OUT/bench_prompts.txt" --magpie "$MAGPIE"
fi
if [ ! -s "$OUT/draft/model.safetensors" ]; then
  train_dtype_args=()
  [ "$DTYPE" = bfloat16 ] || train_dtype_args=(--no-bf16)
  $PY -m sglang_dart.train --target "$target" --data "$OUT/answers.jsonl" --out "$OUT/draft" \
    --target-dtype "$DTYPE" --max-minutes "$TRAIN_MINUTES" --max-steps "$MAX_STEPS" "${train_dtype_args[@]}"
fi
if [ ! -s "$OUT/answers.store" ]; then
  $PY -m sglang_dart.ngram build --tokenizer "$target" -o "$OUT/answers.store" "$OUT/answers.jsonl"
fi
echo "drafter: $OUT/draft  store: $OUT/answers.store  target: $target"
