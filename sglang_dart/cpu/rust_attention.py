"""Attention on a CPU in one Rust call a layer (`_core.attend_f32`/`attend_bf16`/`attend_f16`,
rust/dart-core/src/attention.rs): decode, tree verify and prefill.

`tree_attention.attend` gathers every key and value row into new tensors and calls torch's SDPA, whose
CPU kernel in bf16 costs about 20 us per (request, query head) task: at one request a bf16 SmolLM2
layer's attention took 0.1-0.3 ms for microseconds of arithmetic. The Rust kernel reads the KV pool where
it lies, in tasks of (request, KV head, query rows) shared among the GEMM team's threads. It computes a
query's result from its own row alone, so a token attends bit-identically decoded alone, verified in a
tree or prefilled with its prompt. That last one matters beyond speculation: with the radix cache a
prompt's K/V may come from an earlier request's prefill or from its decode steps, and SDPA's bits depend
on the query count, so a server's greedy answer to a prompt could depend on what it served before (a
float16 SmolLM2 request parted from plain, and plain from its own repeats, that way: throughput.md,
run 124). A prefill chunk's tasks stop at their last row's keys (a causal prefill skips the later half):
one SmolLM2 layer, 2,048-token prompt, the 2-core EPYC, bf16: 34 ms against SDPA's 61; 128 new tokens over
1,000 cached about level (throughput.md, run 125).

It takes forwards whose new keys are already in the pool, in float32, bf16 or float16, without a logit
cap; everything else stays with torch. An fp8 KV pool (`--kv-cache-dtype fp8_e5m2/fp8_e4m3`) is read
through a copy of the rows the plan names, widened to the queries' dtype (exactly: every fp8 value is a
bf16 value): torch's SDPA would give a token another result decoded alone than verified in a tree or
batched with others. Half precision is read as it lies and computed in float32 inside, the output rounded
once.
Active on the CPU engine once `install()` ran (the plugin does);
`SGLANG_DART_CPU_ATTENTION=torch` keeps torch's SDPA.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from sglang_dart import _core
from sglang_dart.cpu.rowwise_ops import numpy_view

if TYPE_CHECKING:
    from sglang_dart.attention.tree_attention import AttentionPlan

ENV = "SGLANG_DART_CPU_ATTENTION"
CHOICES = ("rust", "torch")

_KERNELS = {
    torch.float32: _core.attend_f32,
    torch.bfloat16: _core.attend_bf16,
    torch.float16: _core.attend_f16,
}
# KV pool dtypes read through a widened copy of the rows a plan names (`_widened_rows`).
_FP8 = (torch.float8_e5m2, torch.float8_e4m3fn)
# Query dtypes the kernels do not take, computed in the one that holds them exactly (the pool's rows are
# widened likewise) and rounded back once at the end: none since the float16 kernel (before it, float16
# went through float32 copies of every row a plan names, each layer and step).
_WIDER: dict[torch.dtype, torch.dtype] = {}
_active = False


def setting() -> str:
    value = os.environ.get(ENV, "rust").strip().lower()
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected rust (the default) or torch")
    return value


def install() -> None:
    """Turn the Rust attention on in this process (a bad setting raises ValueError)."""
    global _active
    _active = setting() == "rust"


def uninstall() -> None:
    global _active
    _active = False


def active() -> bool:
    return _active


def applies(
    plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, logit_cap: float
) -> bool:
    """Whether this layer's attention goes to Rust: installed, CPU tensors of one dtype the kernel takes
    (or a pool in fp8), the pool's contiguous, new keys in the pool (the plan has key_loc), no logit cap,
    no gradient."""
    return (
        _active
        and q.is_cpu
        and _kernel_dtype(q.dtype) in _KERNELS
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in (q.dtype, *_FP8)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and plan.key_loc is not None
        and not (logit_cap and logit_cap > 0)
        and not (torch.is_grad_enabled() and q.requires_grad)
    )


def attend(
    plan: AttentionPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scaling: float,
    sliding_window: int = -1,
) -> torch.Tensor:
    """`tree_attention.attend` for a plan and inputs `applies` accepted: q [T, H, D], the pool's
    k_cache/v_cache [slots, Hkv, D/Dv]. Returns [T, H, Dv] in q's dtype."""
    key_loc, mask, query_row, query_valid = plan.host_arrays
    if sliding_window is not None and sliding_window > -1:
        mask = plan.windowed_mask(sliding_window).numpy()
    dtype = _kernel_dtype(q.dtype)
    if k_cache.dtype != dtype:
        key_loc, k_cache, v_cache = _widened_rows(key_loc, k_cache, v_cache, dtype)
    rows, heads = q.shape[0], q.shape[1]
    # Rows no query slot names (a plan whose requests have fewer queries than rows) stay zero.
    covered = plan.dense and rows == query_row.size
    out = (torch.empty if covered else torch.zeros)((rows, heads, v_cache.shape[-1]), dtype=dtype)
    _KERNELS[dtype](
        numpy_view(q.to(dtype).contiguous()),
        numpy_view(k_cache),
        numpy_view(v_cache),
        key_loc,
        mask,
        query_row,
        query_valid,
        scaling,
        numpy_view(out),
    )
    return out.to(q.dtype)


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel computes queries of `dtype` in: their own, or the one `_WIDER` names."""
    return _WIDER.get(dtype, dtype)


def _widened_rows(
    key_loc: np.ndarray, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """The pool rows `key_loc` names, in `dtype`, as a pool of their own, and the key_loc that reads it."""
    slots = torch.from_numpy(key_loc).reshape(-1)
    own_loc = np.arange(slots.numel(), dtype=np.int64).reshape(key_loc.shape)
    return own_loc, k_cache[slots].to(dtype), v_cache[slots].to(dtype)
