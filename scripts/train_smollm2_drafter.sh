#!/usr/bin/env bash
# Rebuild, from nothing but the installed packages, the SmolLM2-135M-Instruct drafter and 3-gram store the
# project ships: the target answers every training prompt (none of them a benchmark or warm-up prompt), a
# drafter is trained on those answers, and the store is built from the same answers.
#
#   bash scripts/train_smollm2_drafter.sh OUT_DIR      # writes OUT_DIR/draft and OUT_DIR/answers.store
#
# The prompts: the built-in synthetic pool (~860), MAGPIE (default 2800) user turns the target writes itself
# under its default system prompt (chat), and MAGPIE_CODE (default 1400) written under a coding assistant's
# system prompt (code questions), and CODE_PROMPTS (default 700) code-assistant tasks around functions and
# classes of Python's own library (`sglang_dart.train.code_prompts`: code pasted into the prompt, which
# Magpie's prompts rarely hold): about 5,700 answers, some 2 hours of generation on a 2-core VM.
# The answers committed in COMMITTED (default data/smollm2-answers, *.jsonl.gz: made by the same tools,
# see its README) join them, one answer per prompt; MAGPIE=0 MAGPIE_CODE=0 CODE_PROMPTS=0 trains on those alone.
# DTYPE is the target dtype of generation and training; use the dtype you will serve in. Its default is
# this CPU's fast one (`fast_dtype_here`): bfloat16 with AMX or AVX512-BF16, float32 elsewhere, where
# bfloat16 runs several times slower. TRAIN_MINUTES
# (default 60) and MAX_STEPS (default 3000) bound training, whichever ends first; CONCURRENCY (default 32)
# is the generation batch. INIT (a drafter directory, e.g. the shipped one) continues training that drafter
# instead of starting a new one, at learning rate LR (default 1e-3; the shipped drafter's second stage used
# INIT=sglang_dart/shipped/smollm2-135m-instruct/draft LR=5e-4, see its MANIFEST.md).
# A step whose output is already in OUT_DIR is skipped and an interrupted
# generation resumes, so the run picks up where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/train_smollm2_drafter.sh OUT_DIR}
PY=.venv/bin/python
if [ -z "${DTYPE:-}" ]; then
  DTYPE=$($PY -c "from sglang_dart.dart.settings import fast_dtype_here; print(fast_dtype_here('cpu'))")
fi
TRAIN_MINUTES=${TRAIN_MINUTES:-60}
MAX_STEPS=${MAX_STEPS:-3000}
CONCURRENCY=${CONCURRENCY:-32}
MAGPIE=${MAGPIE:-2800}
MAGPIE_CODE=${MAGPIE_CODE:-1400}
CODE_PROMPTS=${CODE_PROMPTS:-700}
COMMITTED=${COMMITTED:-data/smollm2-answers}
INIT=${INIT:-}
LR=${LR:-1e-3}
CODE_SYSTEM="You are an expert programming assistant. Users ask you to write, complete, fix, explain and \
review code in Python, JavaScript, TypeScript, C, C++, Rust, Go, Java, SQL and shell scripts."
mkdir -p "$OUT"

target=$($PY -m sglang_dart.assets smollm2 2>/dev/null | tail -n 1)
$PY benchmarks/bench_prompts.py --exclude-file "$OUT/bench_prompts.txt"
generate=($PY -m sglang_dart.train.generate --target "$target" --dtype "$DTYPE" --concurrency "$CONCURRENCY"
  --exclude-file "$OUT/bench_prompts.txt")

if [ ! -s "$OUT/answers.jsonl" ]; then
  "${generate[@]}" --out "$OUT/answers-chat.jsonl" --magpie "$MAGPIE"
  if [ "$MAGPIE_CODE" -gt 0 ]; then
    "${generate[@]}" --out "$OUT/answers-code.jsonl" --num-prompts 0 --magpie "$MAGPIE_CODE" \
      --magpie-system "$CODE_SYSTEM"
  fi
  if [ "$CODE_PROMPTS" -gt 0 ]; then
    stdlib=$($PY -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
    $PY -m sglang_dart.train.code_prompts --source "$stdlib" --out "$OUT/code-prompts.jsonl" \
      --count "$CODE_PROMPTS" --exclude-file "$OUT/bench_prompts.txt"
    "${generate[@]}" --out "$OUT/answers-code-in-prompt.jsonl" --prompts "$OUT/code-prompts.jsonl" \
      --num-prompts "$CODE_PROMPTS"
  fi
  shopt -s nullglob
  # One answer per prompt: a user turn two runs happened to write is kept once. Committed answers are
  # checked against today's benchmark prompts too (the set may have grown since they were made).
  $PY - "$OUT/answers.jsonl" "$OUT/bench_prompts.txt" "$COMMITTED"/*.jsonl.gz "$OUT/answers-chat.jsonl" \
    "$OUT/answers-code.jsonl" "$OUT/answers-code-in-prompt.jsonl" <<'PYEOF'
import gzip, json, os, sys
seen, kept = set(open(sys.argv[2]).read().splitlines()), []
for path in filter(os.path.exists, sys.argv[3:]):
    for line in (gzip.open(path, "rt") if path.endswith(".gz") else open(path)):
        prompt = json.loads(line)["prompt"]
        if prompt not in seen:
            seen.add(prompt)
            kept.append(line)
open(sys.argv[1], "w").writelines(kept)
print(f"{len(kept)} answers")
PYEOF
fi
if [ ! -s "$OUT/draft/model.safetensors" ]; then
  train_args=()
  [ "$DTYPE" = bfloat16 ] || train_args=(--no-bf16)
  [ -z "$INIT" ] || train_args+=(--init "$INIT")
  $PY -m sglang_dart.train --target "$target" --data "$OUT/answers.jsonl" --out "$OUT/draft" \
    --target-dtype "$DTYPE" --max-minutes "$TRAIN_MINUTES" --max-steps "$MAX_STEPS" --lr "$LR" "${train_args[@]}"
fi
if [ ! -s "$OUT/answers.store" ]; then
  $PY -m sglang_dart.ngram build --tokenizer "$target" -o "$OUT/answers.store" "$OUT/answers.jsonl"
fi
echo "drafter: $OUT/draft  store: $OUT/answers.store  target: $target"
