"""The model's linear layers at a few rows, as a CPU server runs them: each product preceded by the small
torch ops that separate linears in a forward (an RMSNorm, a K/V concat, a tiny SDPA), so that thread
wake-ups and idle cores count as they do in serving. Times the whole loop (linears and ops between)
for SGLang's product (`F.linear`), for `sglang_dart._core.skinny_matmul` (`skinny_matmul_bf16` for
bf16) and, for bf16 where torch's oneDNN takes them, for weights packed once (`packed`), interleaved,
and prints the medians and their ratio to F.linear.

    .venv/bin/python benchmarks/cpu_linears.py [--rows 1 8 16] [--repeats 7] [--layers 30] [--dtype bfloat16]

Shapes are SmolLM2-135M's (qkv 576->960, o 576->576, gate/up 576->3072, down 1536->576), one weight copy
per layer so that weights stream from memory. As in a server: for bf16 the Rust form's loop runs torch on
one thread (`small_step_threads`; the Rust helpers take the other cores) and torch's loop on all of them.
The knobs the Rust form reads at its first product (SGLANG_DART_GEMM_THREADS, SGLANG_DART_GEMM_SPIN_US)
and GOMP_SPINCOUNT (read when torch loads) come from the environment; GOMP_SPINCOUNT defaults to 0 for
float32, as in a float32 server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    return parser.parse_args()


ARGS = parse_args()
if ARGS.dtype == "float32":  # before torch loads libgomp, as the launcher does for float32
    os.environ.setdefault("GOMP_SPINCOUNT", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sglang_dart.cpu.skinny_gemm import PRODUCTS, packed_weights, packing_available  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


class _OpsBetween:
    """What a decoder layer does between two products at small batch: norm, K/V concat, attention."""

    def __init__(self, rows: int, dtype: torch.dtype) -> None:
        self.hidden = torch.randn(rows, 576, dtype=dtype)
        self.query = torch.randn(1, 9, rows, 64, dtype=dtype)
        self.cache = torch.randn(1, 3, 200, 64, dtype=dtype)

    def __call__(self) -> None:
        F.rms_norm(self.hidden, (576,))
        keys = torch.cat([self.cache, self.cache], 2).repeat_interleave(3, 1)
        F.scaled_dot_product_attention(self.query, keys, keys)


def main() -> None:
    args = ARGS
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k, dtype=dtype) for n, k in SHAPES] for _ in range(args.layers)]
    # The very products the server's chooser picks between, with the torch threads each runs beside.
    all_threads = torch.get_num_threads()
    rust_threads = 1 if dtype == torch.bfloat16 else all_threads
    forms = {"torch": (PRODUCTS["torch"], all_threads), "rust": (PRODUCTS["rust"], rust_threads)}
    if dtype == torch.bfloat16 and packing_available():
        forms["packed"] = (PRODUCTS["packed"], all_threads)
        for layer in weights:  # packed once, as a server packs each weight at its first product
            for weight in layer:
                packed_weights.get(weight)
    spin = os.environ.get("GOMP_SPINCOUNT", "unset")
    print(f"{args.dtype}; torch threads {all_threads} (beside Rust {rust_threads}), GOMP_SPINCOUNT={spin}")
    others = [name for name in forms if name != "torch"]
    print(
        "| rows | F.linear ms | "
        + " | ".join(f"{name} ms | F.linear / {name}" for name in others)
        + " |\n|---|---|"
        + "---|---|" * len(others)
    )
    for rows in args.rows:
        inputs = [torch.randn(rows, k, dtype=dtype) for _, k in SHAPES]
        between = _OpsBetween(rows, dtype)
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.repeats):
            for name, (product, threads) in forms.items():
                torch.set_num_threads(threads)
                start = time.perf_counter()
                for layer in weights:
                    for x, weight in zip(inputs, layer, strict=True):
                        between()
                        product(x, weight)
                times[name].append(time.perf_counter() - start)
        torch.set_num_threads(all_threads)
        ms = {name: statistics.median(times[name]) * 1e3 for name in forms}
        cells = " | ".join(f"{ms[name]:.1f} | {ms['torch'] / ms[name]:.2f}x" for name in others)
        print(f"| {rows} | {ms['torch']:.1f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
