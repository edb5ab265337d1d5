#!/usr/bin/env bash
# benchmarks/gpu_check.py on a GPU host that has Python 3.12 and torch but no SGLang and no network (the
# device machines this project is lent). Carried beside the checkout, in .gpu/ (git-ignored):
#   .gpu/bundle.tar.xz  scripts/offline_bundle.py's output (SGLang and what the host lacks);
#   .gpu/smol.tar.xz    a model directory without weights (config, tokenizer): the target gets random weights;
#   sglang_dart/_core.abi3.so  the Rust extension built here (abi3: any Python >= 3.10);
#   or, in place of the first two, .gpu/payload/ (scripts/offline_payload.py pack: the bundle, a model
#   directory with its real weights, a drafter `draft/`, a `*.store`, an EAGLE3 drafter `eagle3/`), its parts
#   spread over calls.
# Building the bundle here (network to PyPI; ~8 minutes), with the host's package names in HOST_PKGS.txt:
#   python3.12 -m venv /tmp/py312 && /tmp/py312/bin/pip install -c constraints.txt -e ".[test]"
#   /tmp/py312/bin/python scripts/offline_bundle.py --site /tmp/py312/lib/python3.12/site-packages \
#       --out .gpu/bundle.tar.xz --host-packages HOST_PKGS.txt
# The payload (run 3: five calls of about 6 s, then the checks), from a directory named eagle3/ for the
# EAGLE3 drafter; a part may be as large as 64 MiB less the working tree every call carries and the .so:
#   python scripts/offline_payload.py pack --out .gpu/payload --part-mib 59 .gpu/bundle.tar.xz \
#       MODEL_DIR DRAFT_DIR STORE [eagle3]
#   then one call per part, each carrying .gpu/payload/parts.json and its part (the last one the .so too):
#   OUT=$OUT DEADLINE=<the call's timeout_s> bash scripts/offline_gpu_check.sh [gpu_check.py arguments]
# FlashInfer builds its norm and sampling modules on the host at first use (nvcc): allow minutes for it.
# Output: $OUT/gpu_check.json and $OUT/logs.tar.gz (every server's log). Environment knobs: ATTN (attention
# backend, default triton: no JIT build), SERVER_ARGS, DEADLINE or GC_TIMEOUT, START_TIMEOUT, SKIP_SMOKE=1,
# PREWARM, MODEL, DRAFT, STORE, EAGLE3 (=off: no EAGLE3 server); extra arguments go to gpu_check.py.
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
mkdir -p "$OUT"
# A payload (scripts/offline_payload.py pack: the bundle, a model directory with real weights, a drafter,
# a store) travels as parts over several calls on a warm machine: each call leaves its parts in
# /tmp/payload-parts; the call that completes them rebuilds the files in /tmp/payload and runs the checks.
if [ -f .gpu/payload/parts.json ]; then
    $PY scripts/offline_payload.py gather --carried .gpu/payload --store /tmp/payload-parts \
        --dest /tmp/payload || exit 0  # parts still missing: this call only carried some
    [ -f /tmp/payload/bundle.tar.xz ] && ln -sf /tmp/payload/bundle.tar.xz .gpu/bundle.tar.xz
fi
# A bundle larger than one call carries travels as `split` parts: earlier calls leave theirs in
# /tmp/bundle-parts (run `mkdir -p /tmp/bundle-parts && cp .gpu/bundle.part-* /tmp/bundle-parts/`), the
# last call carries the rest in .gpu/.
if [ ! -f .gpu/bundle.tar.xz ] && ls .gpu/bundle.part-* >/dev/null 2>&1; then
    mkdir -p /tmp/bundle-parts && cp .gpu/bundle.part-* /tmp/bundle-parts/ && cat /tmp/bundle-parts/bundle.part-* > .gpu/bundle.tar.xz
fi
if [ ! -d /tmp/site/sglang ]; then mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/bundle.tar.xz || exit 3; fi
# The target: a carried model directory with its weights (MODEL), else .gpu/smol.tar.xz's config and
# tokenizer with random weights. The drafter and store: carried ones (DRAFT, STORE), else random ones.
MODEL=${MODEL:-$(ls -d /tmp/payload/*/tokenizer.json 2>/dev/null | head -1 | xargs -r dirname)}  # drafters have none
if [ -n "$MODEL" ]; then TARGET=(--model "$MODEL"); else
    tar -C .gpu -xJf .gpu/smol.tar.xz || exit 3; TARGET=(--random-target-like .gpu/smol); fi
DRAFT=${DRAFT:-$(ls -d /tmp/payload/draft 2>/dev/null)}
STORE=${STORE:-$(ls /tmp/payload/*.store 2>/dev/null | head -1)}
ASSETS=(); [ -n "$DRAFT" ] && [ -n "$STORE" ] && ASSETS=(--draft "$DRAFT" --store "$STORE")
EAGLE3=${EAGLE3:-$(ls -d /tmp/payload/eagle3 2>/dev/null)}  # an EAGLE3 drafter: timed beside DART
[ -n "$EAGLE3" ] && [ "$EAGLE3" != off ] && ASSETS+=(--eagle3-draft "$EAGLE3")
echo "target ${TARGET[*]}; drafter ${ASSETS[*]:-random}"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
# TRAIN_MINUTES=M: train instead of checking. The formats in FORMATS (default all three) each train from
# scratch for M minutes on this GPU on the answers in data/ (scripts/peers_same_data.sh, SERVE=0), and
# come back cast to bf16 in 15 MiB parts (a call returns files of at most 16 MiB, 64 MiB in all):
#   cat OUT/drafters.tar.part-* | tar -x    then serve or measure them on the CPU (benchmarks/peers.py).
# DEADLINE (the call's limit, seconds from this script's start) stops the training 60 s before it (SIGTERM:
# the format training then saves what it has), so that the formats done by then (in FORMATS' order) still
# come back; the later ones do not start.
# TRAIN_DEVICE=cpu (with MODEL, PY and a small DATA set) runs this mode as a smoke test on a CPU machine.
if [ -n "${TRAIN_MINUTES:-}" ]; then
    [ -n "$MODEL" ] || { echo "TRAIN_MINUTES needs the target's real weights in the payload"; exit 3; }
    LEFT=$(( ${DEADLINE:-600} - ($(date +%s) - T0) - 60 ))
    MINUTES=$TRAIN_MINUTES FORMATS=${FORMATS:-dart eagle3 dflash} DEVICE=${TRAIN_DEVICE:-cuda} SERVE=0 PY=$PY TARGET=$MODEL \
        timeout -k 10 "$LEFT" bash scripts/peers_same_data.sh /tmp/train; rc=$?
    # timeout's SIGTERM ends the script at once; the trainer it reached stops after its step and saves
    for _ in $(seq 40); do pgrep -f "sglang_dart.train " >/dev/null || break; sleep 1; done
    mkdir -p /tmp/back && (cd /tmp/train && tar -czf "$OUT/train-logs.tar.gz" ./*.log)
    for format in ${FORMATS:-dart eagle3 dflash}; do
        [ -f "/tmp/train/$format/config.json" ] && $PY scripts/cast_drafter.py "/tmp/train/$format" "/tmp/back/$format"
    done
    (cd /tmp/back && tar -cf - .) | split -b 15M - "$OUT/drafters.tar.part-"
    echo "training rc=$rc after $(( $(date +%s)-T0 ))s"; ls -l "$OUT"
    exit "$rc"
fi
echo "python $($PY --version 2>&1), $(nproc) cores, nvcc $(command -v nvcc), unpacked after $(( $(date +%s)-T0 ))s"
[ -n "${SKIP_SMOKE:-}" ] || $PY - <<'PYEOF' 2>&1 | grep -v "^\[" | tail -20
import importlib, time
t = time.time()
for m in ["torch", "sgl_kernel", "flashinfer", "sglang", "sglang.srt.managers.scheduler",
          "sglang.srt.layers.attention.triton_backend", "sglang_dart.plugin", "sglang_dart._core"]:
    try:
        importlib.import_module(m); print("ok", m)
    except BaseException as e:
        print("FAIL", m, type(e).__name__, str(e)[:300])
print(f"imports {time.time() - t:.1f}s")
PYEOF
# FlashInfer JIT-builds its norm and sampling modules at first use (SGLang's RMSNorm and sampled verify
# reach them); build them now, side by side, so that no server start spends its timeout on nvcc
# (PREWARM lists the modules; PREWARM= builds none).
for module in ${PREWARM-norm sampling}; do
  ( timeout "${PREWARM_TIMEOUT:-300}" $PY - "$module" <<'PYEOF' 2>&1 | grep -v "^\[" | tail -5 ) &
import sys, time
import torch, flashinfer
t = time.time()
x = torch.randn(4, 576, device="cuda", dtype=torch.bfloat16)
if sys.argv[1] == "norm":
    flashinfer.norm.rmsnorm(x, torch.ones(576, device="cuda", dtype=torch.bfloat16), 1e-5)
    flashinfer.norm.fused_add_rmsnorm(x, x.clone(), torch.ones(576, device="cuda", dtype=torch.bfloat16), 1e-5)
else:
    probs = torch.softmax(torch.randn(4, 49152, device="cuda"), -1)
    flashinfer.sampling.top_p_renorm_probs(probs, 0.9)
    flashinfer.sampling.top_k_renorm_probs(probs, 20)
    flashinfer.sampling.top_k_top_p_sampling_from_probs(probs, 20, 0.9)
torch.cuda.synchronize()
print(f"flashinfer {sys.argv[1]} JIT ready in {time.time() - t:.0f}s")
PYEOF
done; wait
echo "prewarm done after $(( $(date +%s)-T0 ))s"
ATTN=${ATTN:-triton}
# The checks stop in time for their results to come back: DEADLINE is the device call's limit (seconds from
# this script's start); 30 s stay for stopping the servers (SIGTERM, then SIGKILL after 10 s) and the copy
# below. (A call that ran past its limit returned nothing.)
GC_TIMEOUT=${GC_TIMEOUT:-$(( ${DEADLINE:-540} - ($(date +%s) - T0) - 30 ))}
echo "checks get ${GC_TIMEOUT}s"
timeout -k 10 "$GC_TIMEOUT" $PY benchmarks/gpu_check.py "${TARGET[@]}" "${ASSETS[@]}" \
    ${ATTN:+--attention-backend "$ATTN"} \
    --server-args "${SERVER_ARGS:---mem-fraction-static 0.2 --max-total-tokens 300000 --cuda-graph-max-bs 64}" \
    --start-timeout "${START_TIMEOUT:-180}" --out /tmp/gc "$@"
rc=$?
cp /tmp/gc/gpu_check.json "$OUT/" 2>/dev/null
# Every server's log, and the pstats of SGLANG_DART_CPROFILE=/tmp/gc/NAME.prof where one was asked for.
(cd /tmp/gc && tar -czf "$OUT/logs.tar.gz" ./*.log $(ls ./*.prof 2>/dev/null)) 2>/dev/null
echo "gpu_check rc=$rc after $(( $(date +%s)-T0 ))s"
