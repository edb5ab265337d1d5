"""Requests SGLang 0.5.17 admits but cannot serve, refused at the door with a clear error.

A token id outside the target's vocabulary (`input_ids` from another model's tokenizer, say) reaches the
embedding and kills the scheduler, and every request it was running with it: an IndexError on a CPU, a
device-side assert on a GPU. SGLang has a check for it (`TokenizerManager._validate_input_ids_in_vocab`)
that nothing calls; it is not called here either, since it lets negative ids through (they crash the
embedding too) and quotes the whole prompt in its error. The same holds for plain serving, so this check
is installed in every process the plugin loads in, not for DART alone.
"""

from __future__ import annotations

from typing import Any

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def refuse_ids_outside_the_vocabulary(input_ids: list[int] | None, vocab_size: int) -> None:
    """ValueError (SGLang answers it with HTTP 400) when an id is negative or not below `vocab_size`."""
    if not input_ids:
        return
    low, high = min(input_ids), max(input_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids hold token id {bad}, outside the model's vocabulary [0, {vocab_size})")


def _check_request(
    _result: Any, manager: Any, _obj: Any, input_ids: Any, *_args: Any, **_kwargs: Any
) -> None:
    """AFTER hook on TokenizerManager._validate_one_request (text or ids, single or batched requests)."""
    config = manager.model_config
    if getattr(config, "is_multimodal", False):
        return  # placeholder ids of images and audio are not the text vocabulary's
    refuse_ids_outside_the_vocabulary(input_ids, config.vocab_size)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _check_request, HookType.AFTER)
