#!/usr/bin/env bash
# Issue 28's drafter compute on a lent GPU host (torch and transformers, no SGLang, no network), in one
# device call once the target's weights are there:
#   0. (BENCH=1, the default) benchmarks/train_step.py on the GPU: a packed step against one sequence at a
#      time on the same features (bench.log), before anything else shares the GPU;
#   1. more answers: Magpie prompts the target samples itself under four framings (chat, explanations,
#      general knowledge, code; data/smollm2-answers/README.md) and its greedy float32 answers
#      (python -m sglang_dart.train.batch_generate), none a benchmark prompt or a committed answer's; the
#      prompts committed in data/smollm2-answers/unanswered/ (sampled by an earlier run) are answered first;
#   2. DART drafters trained side by side on the one GPU: `committed` on every committed answer (from the
#      start), `more` on those and the new answers (once they are written), both with TRAIN_ARGS (from
#      scratch unless it holds an --init); with SCRATCH=1 also `scratch`, from scratch at lr 1e-3 on the
#      committed answers (from the start);
#   3. back in $OUT: the drafters cast to bf16, the new answers (gzip), the prompts sampled but not answered
#      and the logs, packed by `scripts/offline_payload.py pack` (bf16 weights split, so three drafters
#      fit the 64 MiB a call returns) as part-* and parts.json:
#      `python scripts/offline_payload.py unpack --manifest DIR/parts.json --parts DIR --dest back`.
# Carried: .gpu/payload (`scripts/offline_payload.py pack --part-mib 56 MODEL_DIR`: the target with its
# real weights; parts may come in earlier calls on the same warm machine, each left in /tmp/payload-parts),
# .whl (this machine's transformers and tokenizers wheels, so that the host runs the versions the tests here
# check) and .gpu/bench_prompts.txt (`python benchmarks/bench_prompts.py --exclude-file ...`).
#   OUT=$OUT DEADLINE=<the call's timeout_s> bash scripts/gpu_train_drafter.sh
# Knobs: MAGPIE (prompts to sample, default 12000), GEN_SECONDS (generation's budget, default 150),
# BATCH (sequences per generate call, default 1024), NEW_TOKENS (an answer's most, default 256),
# SEED (Magpie's sampling, default 83; give each run a new one: a seed used before samples many of the same
# prompts again, which are then dropped as already answered), TRAIN_ARGS (more options for `committed` and
# `more`), SCRATCH (1: the third arm), BENCH (0: no benchmark), BENCH_SEQUENCES (its answers, default 256),
# DEVICE (default cuda; cpu, with PY and a small data/, runs the whole script as a smoke test here).
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
DEADLINE=${DEADLINE:-590}
DEVICE=${DEVICE:-cuda}
W=/tmp/train
mkdir -p "$OUT" "$W"
since() { echo $(( $(date +%s) - T0 )); }

# The target: this call's parts join earlier calls'; until all are here, the call only leaves its own.
$PY scripts/offline_payload.py gather --carried .gpu/payload --store /tmp/payload-parts --dest /tmp/payload \
  || exit 0
TARGET=$(dirname "$(ls -d /tmp/payload/*/tokenizer.json | head -1)")
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 3
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
echo "target $TARGET ready after $(since)s; $(nproc) cores"

# Trainings end by END, then their held-out estimates, the casts and the packing fit before DEADLINE.
END=$(( DEADLINE - 75 ))
if [ "${BENCH:-1}" = 1 ]; then  # the packed step's gain where training runs, before anything shares the GPU
  zcat data/smollm2-answers/*.jsonl.gz | head -n 512 > "$W/bench.jsonl"
  timeout -k 5 90 $PY benchmarks/train_step.py --target "$TARGET" --data "$W/bench.jsonl" --device "$DEVICE" \
    --sequences "${BENCH_SEQUENCES:-256}" --sequences-per-step 32 --steps 5 --rounds 3 > "$W/bench.log" 2>&1
  echo "benchmark rc=$? after $(since)s"; tail -n 5 "$W/bench.log"
fi

train() {  # ARM DATA FEATURE_SECONDS ARGS...: until END, its feature pass allowed FEATURE_SECONDS
  local minutes arm=$1 data=$2
  minutes=$($PY -c "print(round(max(0.5, ($END - $(since) - $3) / 60), 2))")
  shift 3
  echo "training $arm on $(wc -l < "$data") answers for $minutes minutes, from $(since)s: $*"
  exec $PY -m sglang_dart.train --target "$TARGET" --data "$data" --out "$W/$arm" --target-dtype bfloat16 \
    --device "$DEVICE" --max-minutes "$minutes" --max-steps 1000000 --sequences-per-step 32 \
    "$@" > "$W/train-$arm.log" 2>&1
}
zcat data/smollm2-answers/*.jsonl.gz > "$W/committed.jsonl"
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of options
train committed "$W/committed.jsonl" 40 ${TRAIN_ARGS:-} &
COMMITTED=$!
SCRATCH_PID=
if [ "${SCRATCH:-0}" = 1 ]; then train scratch "$W/committed.jsonl" 40 --lr 1e-3 & SCRATCH_PID=$!; fi

CODE="You are an expert programming assistant. Users ask you to write, complete, fix, explain and review code in \
Python, JavaScript, TypeScript, C, C++, Rust, Go, Java, SQL and shell scripts."
EXPLAIN="You are a patient, knowledgeable assistant. People ask you everyday questions: why something happens, \
how something works, what the difference between two things is, what a word or idea means, and practical \
advice for home, work, travel, food, health and money."
KNOW="You are a friendly, well-read assistant. People ask you short questions about history, science, nature, \
geography, language, culture, sports, technology and daily life, ask for summaries and comparisons, and ask for \
quick how-to steps."
CHAT="You are a helpful, friendly assistant. People come to you for all kinds of everyday help: advice and \
recommendations, explanations of ideas, plans and schedules, emails and letters, short stories and poems, \
summaries, comparisons, opinions, and step-by-step instructions."
GEN_SECONDS=${GEN_SECONDS:-150}
# Prompts an earlier run sampled but did not answer (committed in data/smollm2-answers/unanswered/) are
# answered first; those answered since are skipped by batch_generate.
if ls data/smollm2-answers/unanswered/*.jsonl.gz > /dev/null 2>&1; then
  zcat data/smollm2-answers/unanswered/*.jsonl.gz > "$W/gpu-magpie.jsonl.magpie.jsonl"
fi
timeout -k 10 $(( GEN_SECONDS + 60 )) $PY -m sglang_dart.train.batch_generate --target "$TARGET" \
  --out "$W/gpu-magpie.jsonl" --magpie "${MAGPIE:-12000}" --magpie-system "$CHAT" --magpie-system "$EXPLAIN" \
  --magpie-system "$KNOW" --magpie-system "$CODE" --exclude-file .gpu/bench_prompts.txt \
  --exclude-data data/smollm2-answers/*.jsonl.gz --device "$DEVICE" --dtype float32 --batch-size "${BATCH:-1024}" --max-new-tokens "${NEW_TOKENS:-256}" \
  --max-seconds "$GEN_SECONDS" --seed "${SEED:-83}" > "$W/generate.log" 2>&1
echo "generation rc=$? after $(since)s: $(wc -l < "$W/gpu-magpie.jsonl" 2>/dev/null) answers"; tail -n 3 "$W/generate.log"
cat "$W/committed.jsonl" "$W/gpu-magpie.jsonl" > "$W/more.jsonl" 2>/dev/null
MORE=
# shellcheck disable=SC2086
if [ -s "$W/gpu-magpie.jsonl" ]; then train more "$W/more.jsonl" 60 ${TRAIN_ARGS:-} & MORE=$!; fi

# A first SIGTERM makes a trainer save after its step (and skip its estimate): a late one still comes back.
# (Its output goes nowhere: a sleeper holding this script's stdout could hold the call open.)
( sleep $(( END + 30 - $(since) )); kill -TERM $COMMITTED $MORE $SCRATCH_PID ) > /dev/null 2>&1 &
STOPPER=$!
wait $COMMITTED; echo "committed rc=$? after $(since)s"
[ -n "$MORE" ] && { wait "$MORE"; echo "more rc=$? after $(since)s"; }
[ -n "$SCRATCH_PID" ] && { wait "$SCRATCH_PID"; echo "scratch rc=$? after $(since)s"; }
kill $STOPPER 2>/dev/null
for log in "$W"/train-*.log; do
  echo "== $log"; grep -E "features of|time budget|stopped by|saved|estimated|top-1 chain" "$log" | tail -n 6
  grep -E "^step " "$log" | tail -n 2
done

mkdir -p /tmp/back
for arm in committed more scratch; do
  [ -f "$W/$arm/config.json" ] && $PY scripts/cast_drafter.py "$W/$arm" "/tmp/back/$arm"
done
[ -s "$W/gpu-magpie.jsonl" ] && gzip -c "$W/gpu-magpie.jsonl" > /tmp/back/gpu-magpie.jsonl.gz
# batch_generate's side file: while any prompt waits unanswered, every prompt sampled (the answered ones
# are in gpu-magpie.jsonl: drop them before committing the rest to data/smollm2-answers/unanswered/).
[ -s "$W/gpu-magpie.jsonl.magpie.jsonl" ] && gzip -c "$W/gpu-magpie.jsonl.magpie.jsonl" > /tmp/back/sampled.magpie.jsonl.gz
cp "$W"/*.log /tmp/back/
$PY scripts/offline_payload.py pack --out "$OUT" --part-mib 15 --split-above-mib 8 /tmp/back
echo "done after $(since)s"; ls -l "$OUT"
