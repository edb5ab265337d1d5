"""What SGLang's own machinery must do for a DART server, installed as hooks on SGLang (no fork).

Each hook answers one question SGLang asks of every speculative algorithm, where SGLang's builtin answer
for an unknown (plugin) algorithm would be wrong for DART:

- which attention backend (`choose_tree_backend`): SGLang picks it before DART's validation runs, and on
  Hopper it picks `fa3` for "top-k 1" speculation, whose verify treats the drafts as a causal chain and
  ignores the tree mask. DART's trees need a backend that reads `custom_mask`: flashinfer or triton.
- which target hidden states to capture (`capture_dart_taps`): the taps must be switched on before the
  target's CUDA graphs are captured, as SGLang does for EAGLE3; set later, a replayed graph returns none.
- what a captured verify graph must return (`verify_graph_returns_taps`): SGLang captures NGRAM-shaped
  verify graphs with no hidden states; DART reads the taps of every verify.
- how many bytes a KV slot costs (`count_draft_state_in_pool`): the drafter keeps per-slot state beside
  the target's KV; SGLang's memory planner must size the pool with it, not find it missing afterwards.
- how wide a request's row of KV slots is (`row_holds_the_decode_reserve`): each speculative decode step
  reserves twice the largest tree past a request's committed tokens, but with one token a page SGLang
  widens the row past the context length by only the tree plus 4. A request that runs to the context
  limit with trees of more than 4 nodes then writes past its row: an IndexError that kills a CPU
  scheduler, and on a GPU a write into the next request's row (SGLang's kernel masks by the request's
  end, not the row's). Not DART's alone: every speculative algorithm gets the wider row.

The functions are pure where they can be, so the tests check them with SGLang's real classes on a CPU.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_dart.drafter import DraftConfig

logger = logging.getLogger(__name__)

ALGORITHM = "DART"
# Attention backends whose TARGET_VERIFY honours a per-request tree mask (spec_info.custom_mask) on CUDA.
TREE_MASK_BACKENDS = ("flashinfer", "triton")


def is_dart(server_args: Any) -> bool:
    return str(getattr(server_args, "speculative_algorithm", None) or "").upper() == ALGORITHM


def on_accelerator(server_args: Any) -> bool:
    return str(getattr(server_args, "device", None) or "cuda").startswith("cuda")


def tree_backend_for(default: str, flashinfer_available: bool) -> str:
    """The backend DART uses on CUDA when none is given: SGLang's default if it verifies trees,
    else flashinfer (triton where flashinfer is not installed)."""
    if default in TREE_MASK_BACKENDS:
        return default
    return "flashinfer" if flashinfer_available else "triton"


def _choose_tree_backend(result: str, server_args: Any, *_args: Any, **_kwargs: Any) -> str:
    """AFTER hook on ServerArgs._get_default_attn_backend (runs only when --attention-backend is unset)."""
    if not (is_dart(server_args) and on_accelerator(server_args)):
        return result
    from sglang.srt.utils import is_flashinfer_available

    chosen = tree_backend_for(result, is_flashinfer_available())
    if chosen != result:
        logger.info("DART verifies trees: attention backend %s, not SGLang's default %s", chosen, result)
    return chosen


def refuse_chain_only_backends(server_args: Any) -> None:
    """A backend given by flag that cannot verify trees stops the server, naming the flag. Called from
    DART's validation, when SGLang has resolved its defaults (read through the resolving view)."""
    if not on_accelerator(server_args):
        return  # CPU: the plugin's tree-mask backend replaces torch_native (sglang_dart/cpu/attention.py)
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(server_args)
    for flag, field in (
        ("--attention-backend", "attention_backend"),
        ("--decode-attention-backend", "decode_attention_backend"),
        ("--prefill-attention-backend", "prefill_attention_backend"),
    ):
        backend = getattr(view, field, None)
        if backend is not None and backend not in TREE_MASK_BACKENDS:
            from sglang_dart.dart.settings import DartArgsError

            raise DartArgsError(
                f"DART verifies token trees, which {flag} {backend} cannot (it ignores the tree mask): "
                f"use {flag} flashinfer or triton"
            )


def _capture_dart_taps(config: Any, *_args: Any, **kwargs: Any) -> Any:
    """AFTER hook on resolve_spec_aux_hidden_state_config: a DART target captures EAGLE3's aux hidden
    states (entering layers 2, L/2, L-3: DART's taps) from the start, so its CUDA graphs include them."""
    if is_dart(kwargs.get("server_args")) and not kwargs.get("is_draft_worker", False):
        config.eagle_use_aux_hidden_state = True
        config.eagle_aux_hidden_state_layer_ids = None  # the default layers are DART's
    return config


def _verify_graph_returns_taps(spec_info: Any, runner: Any, *_args: Any, **_kwargs: Any) -> Any:
    """AFTER hook on DecodeCudaGraphRunner.get_spec_info: a DART verify graph captures every row's hidden
    states (SGLang captures NGRAM's with none, and a replay of such a graph cannot return the taps)."""
    if spec_info is not None and is_dart(runner.model_runner.server_args):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        spec_info.capture_hidden_mode = CaptureHiddenMode.FULL
    return spec_info


def draft_bytes_per_slot(cfg: DraftConfig, dtype_bytes: int) -> int:
    """Bytes the drafter keeps per target KV slot: the fused residual (hidden) and the one layer's key
    and value (kv heads x head dim each), in the target's dtype (`DraftForward.residual` and the draft
    model runner's KV pool)."""
    return (cfg.hidden_size + 2 * cfg.num_key_value_heads * cfg.head_dim) * dtype_bytes


def _count_draft_state_in_pool(_result: Any, configurator: Any, kvc: Any, *_args: Any, **_kw: Any) -> None:
    """AFTER hook on DefaultPoolConfigurator.__init__: SGLang sizes the KV pool by bytes per token
    (`_cell_size`); a DART target's tokens also carry the drafter's per-slot state."""
    if kvc.is_draft_worker or not is_dart(kvc.server_args):
        return
    import torch

    cfg = DraftConfig.from_dir(kvc.server_args.speculative_draft_model_path)
    extra = draft_bytes_per_slot(cfg, torch._utils._element_size(kvc.model_dtype))
    configurator._cell_size += extra
    logger.info("DART: KV pool sized with %d drafter bytes per slot", extra)


def _row_holds_the_decode_reserve(result: int, server_args: Any, *_args: Any, **_kwargs: Any) -> int:
    """AFTER hook on allocation_sizing.get_req_to_token_extra_context_len: a row's headroom past the
    context length holds what `eagle_prepare_for_decode` allocates past the committed tokens."""
    if getattr(server_args, "speculative_algorithm", None) is None:
        return result
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode

    return max(result, get_alloc_reserve_per_decode(server_args) + server_args.page_size - 1)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in (
        ("sglang.srt.server_args.ServerArgs._get_default_attn_backend", _choose_tree_backend),
        (
            "sglang.srt.model_executor.model_runner.resolve_spec_aux_hidden_state_config",
            _capture_dart_taps,
        ),
        (
            "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info",
            _verify_graph_returns_taps,
        ),
        (
            "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__",
            _count_draft_state_in_pool,
        ),
        (
            "sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len",
            _row_holds_the_decode_reserve,
        ),
    ):
        HookRegistry.register(target, hook, HookType.AFTER)
