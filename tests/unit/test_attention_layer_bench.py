"""benchmarks/attention_layer.py times torch's SDPA and the Rust kernel on the same plans: every shape it
lists (trees and prefill chunks) must go to the Rust kernel, and its trees must be trees (each query sees the
cache, itself and its ancestors only)."""

import random
import subprocess
import sys
from pathlib import Path

import torch

from sglang_dart.cpu import rust_attention
from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_layer.py"


def _module():  # noqa: ANN202 - a script, loaded by path
    return load_script(SCRIPT)


def test_trees_are_chains_to_the_root():
    bench = _module()
    mask = bench.tree_layout(random.Random(3), queries=12, cached=5)
    assert mask[:, :5].all()
    tree = mask[:, 5:]
    assert tree.diagonal().all() and not tree.triu(1).any()  # itself, and only earlier nodes
    for i in range(12):
        ancestors = tree[i, :i].nonzero().squeeze(1).tolist()
        if ancestors:  # its nearest ancestor sees exactly the others
            parent = ancestors[-1]
            assert tree[parent, :parent].nonzero().squeeze(1).tolist() == ancestors[:-1]


def test_every_listed_shape_goes_to_the_rust_kernel():
    bench = _module()
    was_active = rust_attention.active()
    rust_attention.install()
    try:
        for shapes, causal in ((bench.SHAPES, False), (bench.PREFILL_SHAPES, True)):
            for requests, queries, cached in shapes:
                plan = bench.plan_for(requests, queries, cached, random.Random(0), causal)
                q = torch.zeros(requests * queries, bench.HEADS, bench.HEAD_DIM)
                k = torch.zeros(bench.SLOTS, bench.KV_HEADS, bench.HEAD_DIM)
                assert rust_attention.applies(plan, q, k, k, 0.0), (requests, queries, cached, causal)
    finally:
        if not was_active:
            rust_attention.uninstall()


def test_the_benchmark_prints_a_row_per_shape():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dtype", "float32", "--calls", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "request" in line]
    assert len(rows) == len(_module().SHAPES)
