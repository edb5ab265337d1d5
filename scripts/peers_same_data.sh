#!/usr/bin/env bash
# DART against EAGLE3 (and DFLASH) with drafters trained from scratch on the same data, with the same
# budget, on this machine, then served side by side (issue 29):
#
#   bash scripts/peers_same_data.sh OUT_DIR
#
# Data: every answer committed in data/smollm2-answers/ (none is a benchmark prompt). The target's features
# are computed once and shared by every format (`--feature-cache`), so each further format costs its
# training time only. Knobs (environment): MINUTES (training budget per drafter, default 30), FORMATS
# (default "dart eagle3"; add dflash), DTYPE (the target's dtype for the features and the serving; default
# bfloat16 on a GPU, on a CPU the one it multiplies fastest: bf16 with AMX or AVX512-BF16, else float32,
# where a bf16 feature pass crawls), BATCH_SIZES (default "1"), REPEATS
# (default 3), EAGLE3_SETTINGS (default "3,4,8 2,4,6", one server each: the best EAGLE3 settings tried
# on an AMX Xeon and on an AVX512-BF16 EPYC, peers runs 3 and 26), DEVICE (where the features and
# training run: cpu, the default, or cuda), SERVE (0: train only, no store and no serving; for a GPU
# host, whose drafters are served back here), DATA (a jsonl of answers instead of every committed one),
# PY and TARGET (the Python and the target's directory; default: the set-up's .venv and the SmolLM2 it
# installs), TRAIN_ARGS (more trainer options for every format, e.g. "--sequences-per-step 16" on a GPU).
# A step whose output exists is skipped, so an interrupted run goes on where it stopped.
set -euo pipefail
OUT=${1:?usage: scripts/peers_same_data.sh OUT_DIR}
MINUTES=${MINUTES:-30}
FORMATS=${FORMATS:-dart eagle3}
BATCH_SIZES=${BATCH_SIZES:-1}
REPEATS=${REPEATS:-3}
EAGLE3_SETTINGS=${EAGLE3_SETTINGS:-3,4,8 2,4,6}
DEVICE=${DEVICE:-cpu}
SERVE=${SERVE:-1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
TARGET=${TARGET:-$($PY -m sglang_dart.assets smollm2 2>/dev/null | tail -n 1)}
if [ -z "${DTYPE:-}" ]; then
  if [ "${DEVICE%%:*}" = cuda ]; then DTYPE=bfloat16
  else DTYPE=$($PY -c "from sglang_dart.dart.settings import fast_dtype_here; print(fast_dtype_here('cpu'))"); fi
fi

if [ ! -s "$OUT/answers.jsonl" ]; then
  if [ -n "${DATA:-}" ]; then cp "$DATA" "$OUT/answers.jsonl.tmp"
  else zcat data/smollm2-answers/*.jsonl.gz > "$OUT/answers.jsonl.tmp"; fi
  mv "$OUT/answers.jsonl.tmp" "$OUT/answers.jsonl"
fi
echo "data: $(wc -l < "$OUT/answers.jsonl") answers; training on $DEVICE, target in $DTYPE"
for format in $FORMATS; do
  [ -f "$OUT/$format/config.json" ] && continue
  echo "training $format for $MINUTES minutes ($(date +%T))"
  $PY -m sglang_dart.train --format "$format" --target "$TARGET" --data "$OUT/answers.jsonl" \
    --out "$OUT/$format" --target-dtype "$DTYPE" --max-minutes "$MINUTES" --max-steps 100000 \
    --device "$DEVICE" --feature-cache "$OUT/features" ${TRAIN_ARGS:-} > "$OUT/train-$format.log" 2>&1 \
    || { tail -n 20 "$OUT/train-$format.log"; exit 1; }
  grep "estimated tau" "$OUT/train-$format.log" || true
done
[ "$SERVE" = 0 ] && exit 0
if [ ! -s "$OUT/answers.store" ]; then
  $PY -m sglang_dart.ngram build --tokenizer "$TARGET" -o "$OUT/answers.store" "$OUT/answers.jsonl"
fi

peers=(--skip-ngram --dtype "$DTYPE" --batch-sizes $BATCH_SIZES --repeats "$REPEATS" --png "$OUT/peers.png")
# Without dart in FORMATS, DART is the shipped drafter (peers.py's default).
[[ " $FORMATS " == *" dart "* ]] && peers+=(--draft "$OUT/dart" --store "$OUT/answers.store")
[[ " $FORMATS " == *" eagle3 "* ]] && peers+=(--eagle3 "$OUT/eagle3" --eagle3-settings $EAGLE3_SETTINGS)
[[ " $FORMATS " == *" dflash "* ]] && peers+=(--dflash "$OUT/dflash")
$PY -u benchmarks/peers.py "${peers[@]}" 2>&1 | tee "$OUT/peers.log"
