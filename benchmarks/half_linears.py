"""The bare half-precision products at a few rows: torch's `F.linear` against the Rust product, in float16
and bf16, on one weight of each SmolLM2-135M shape (qkv 576->960 as q 576->576 and k/v 192->576, gate/up
576->3072, down 1536->576) and its lm_head (576->49152), all threads of the process for both. No ops
between the products (`cpu_linears.py` times a layer's loop with them, in float32 and bf16).

    .venv/bin/python benchmarks/half_linears.py [--rows 1 2 4 8 16 32 64] [--repeats 20]

Prints a markdown table of milliseconds for one pass over the shapes (the mean of --repeats calls each).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from sglang_dart._core import SKINNY_BF16_KERNEL, SKINNY_F16_KERNEL, skinny_matmul_bf16, skinny_matmul_f16

SHAPES = [(576, 576), (192, 576), (3072, 576), (576, 1536), (49152, 576)]
RUST = {torch.float16: skinny_matmul_f16, torch.bfloat16: skinny_matmul_bf16}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _rust(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], weight.shape[0])
    RUST[x.dtype](_bits(x), _bits(weight), _bits(out))
    return out


def _milliseconds(product, x: torch.Tensor, weight: torch.Tensor, repeats: int) -> float:  # noqa: ANN001
    for _ in range(3):
        product(x, weight)
    start = time.perf_counter()
    for _ in range(repeats):
        product(x, weight)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator) * 0.05 for n, k in SHAPES]
    print(
        f"torch threads {torch.get_num_threads()}; "
        f"Rust kernels: float16 {SKINNY_F16_KERNEL}, bf16 {SKINNY_BF16_KERNEL}"
    )
    columns = [(dtype, name) for dtype in (torch.float16, torch.bfloat16) for name in ("torch", "rust")]
    print("| rows | " + " | ".join(f"{name} {str(dtype)[6:]} ms" for dtype, name in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for rows in args.rows:
        cells = []
        for dtype, name in columns:
            product = F.linear if name == "torch" else _rust
            total = 0.0
            for weight in weights:
                w = weight.to(dtype).contiguous()
                x = torch.randn(rows, w.shape[1], generator=generator).to(dtype)
                total += _milliseconds(product, x, w, args.repeats)
            cells.append(f"{total:.2f}")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
