"""Count the tensor reads back to the host that DART's own step code makes (each one a host-device sync on
a GPU), so that a budget per step can be checked on any machine.

A read is a call, from a module of `sglang_dart.dart`, of `Tensor.tolist/item/cpu` or a conversion of a
tensor to a Python bool/int/float/index. On a CPU every tensor is a host tensor, so the count is what
the same code would sync on a GPU as long as DART's step code keeps host values in Python lists and
numpy arrays (which it does: request state, the pruner's trees) and reads tensors only to bring device
results over. SGLang's own calls inside the step (the verify forward, its tree walk, KV bookkeeping) are
not counted: they are what any SGLang speculative worker pays.

The budget (README, "Host-device traffic"): a verify step or a root-only step reads nothing itself; its
accepted tokens and, when the next step drafts a tree, the draft candidates for the pruner cross in one
transfer that the next step's start waits for ("settle", once). A prefill reads twice (the sampled
tokens; the draft candidates).
"""

from __future__ import annotations

import sys
from typing import Any

from torch.overrides import TorchFunctionMode

READ_METHODS = frozenset({"tolist", "item", "cpu", "__bool__", "__int__", "__float__", "__index__"})
COUNTED_PREFIX = "sglang_dart.dart."
BUDGET = {"settle": 1, "verify": 0, "root-only": 0, "prefill": 2}


class HostReadCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in READ_METHODS:
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith(COUNTED_PREFIX) and module != __name__:
                self.reads.append(f"{name} at {module}:{caller.f_lineno}")
        return func(*args, **(kwargs or {}))


class HostReadBudgetError(AssertionError):
    pass


def check_budget(kind: str, reads: list[str]) -> None:
    if len(reads) > BUDGET[kind]:
        raise HostReadBudgetError(
            f"DART: a {kind} step read {len(reads)} tensors back to the host (budget {BUDGET[kind]}): "
            + "; ".join(reads)
        )
