"""Grammar-constrained requests on a machine without CUDA.

SGLang's xgrammar backend allocates its token bitmask in pinned memory (which needs a CUDA driver) and
applies it only with GPU kernels: on the CPU engine the first regex/JSON request kills the scheduler.
On the host, plain memory and xgrammar's own CPU kernel do the same job.
"""

from __future__ import annotations

import torch


def allow_grammar_without_cuda() -> None:
    import xgrammar
    from sglang.srt.constrained import xgrammar_backend

    if getattr(xgrammar_backend._allocate_token_bitmask, "unpinned", False):
        return

    def allocate_unpinned(vocab_size: int, batch_size: int) -> torch.Tensor:
        shape = xgrammar_backend.get_bitmask_shape(batch_size, vocab_size)
        return torch.full(shape, -1, dtype=xgrammar_backend.bitmask_dtype)

    allocate_unpinned.unpinned = True  # type: ignore[attr-defined]
    xgrammar_backend._allocate_token_bitmask = allocate_unpinned

    grammar_apply = xgrammar_backend.XGrammarGrammar.apply_vocab_mask
    backend_apply = xgrammar_backend.XGrammarGrammarBackend.apply_vocab_mask

    def grammar_apply_on_host(self, logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:  # noqa: ANN001
        if logits.device.type == "cpu":
            xgrammar.apply_token_bitmask_inplace(logits, vocab_mask)
        else:
            grammar_apply(self, logits, vocab_mask)

    def backend_apply_on_host(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        if logits.device.type == "cpu":
            xgrammar.apply_token_bitmask_inplace(logits, vocab_mask)
        else:
            backend_apply(logits, vocab_mask)

    xgrammar_backend.XGrammarGrammar.apply_vocab_mask = grammar_apply_on_host
    xgrammar_backend.XGrammarGrammarBackend.apply_vocab_mask = staticmethod(backend_apply_on_host)
