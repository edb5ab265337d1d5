"""What SGLang's builtin EAGLE3 worker needs to serve on a CPU-only machine.

SGLang 0.5.17 runs EAGLE on CPU only with the intel_amx attention backend, whose ops live in the real
sgl_kernel's CPU build. With our stand-in, the CPU engine's attention is `torch_native` (our tree-verify
backend, `cpu/attention.py`), for which SGLang's `DraftBackendFactory` has no draft backend. The two
EAGLE ops the worker calls on CPU come from `cpu/eagle_ops.py` through the stand-in. Installed only where
the stand-in is active (`plugin.register`).
"""

from __future__ import annotations

from typing import Any

OUR_BACKEND = "torch_native"


def _backend_type(factory: Any, name: str) -> str | None:
    """The backend SGLang's factory would pick for `name` (its own resolution order)."""
    args = factory.server_args
    return factory.draft_attn_backend or getattr(args, name, None) or args.attention_backend


def install() -> None:
    """Patch SGLang (in this process) so that --speculative-algorithm EAGLE3 serves on the CPU engine."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    if getattr(DraftBackendFactory, "_sglang_dart_cpu", False):
        return
    original_decode = DraftBackendFactory.create_decode_backend
    original_extend = DraftBackendFactory.create_draft_extend_backend

    def create_decode_backend(self: Any) -> Any:
        if self.speculative_num_steps > 1 and _backend_type(self, "decode_attention_backend") == OUR_BACKEND:
            from sglang_dart.peers.eagle3_draft_attention import create_decode_backend as ours

            return ours(self)
        return original_decode(self)

    def create_draft_extend_backend(self: Any) -> Any:
        from sglang.srt.runtime_context import get_spec

        name = (
            "decode_attention_backend"
            if get_spec().speculative_attention_mode == "decode"
            else "prefill_attention_backend"
        )
        if _backend_type(self, name) == OUR_BACKEND:
            from sglang.srt.layers.attention.attention_registry import attn_backend_wrapper_for_draft_extend

            from sglang_dart.peers.eagle3_draft_attention import create_extend_backend as ours

            return attn_backend_wrapper_for_draft_extend(self.draft_model_runner, ours(self))
        return original_extend(self)

    DraftBackendFactory.create_decode_backend = create_decode_backend
    DraftBackendFactory.create_draft_extend_backend = create_draft_extend_backend
    DraftBackendFactory._sglang_dart_cpu = True
