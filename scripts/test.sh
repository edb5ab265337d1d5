#!/usr/bin/env bash
# Every check the project has: lint/format, Rust tests, Python unit tests and the real-server tests.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check sglang_dart tests benchmarks
.venv/bin/ruff format --check sglang_dart tests benchmarks
cargo fmt --all --check
cargo clippy --workspace --all-targets --release -- -D warnings
cargo test --workspace --release
# The slowest tests are listed at the end: CI time is budgeted (60 min), and this shows where it goes.
# Two workers: the server tests (in file order, on one) keep about one core busy, so the unit tests run on the
# other (tests/conftest.py groups them).
.venv/bin/python -m pytest -q --durations=15 -n 2 --dist loadgroup tests "$@"
