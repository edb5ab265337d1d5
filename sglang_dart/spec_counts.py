"""Exact drafted counts in a DART request's `meta_info`.

SGLang's tokenizer manager counts `speculative_num_draft_tokens - 1` proposed drafts per verify step, which
is DART's only when every step verifies the largest tree. DART's trees shrink as the batch grows (down to
the root alone), so the worker reports the tokens each request verified per step in SGLang's `cap_lens`
(summed per request into `spec_num_cap_tokens`); the drafts proposed to a request are those tokens less one
root per step. This hook puts that count, and the acceptance rate over it, in place of SGLang's estimate.
"""

from __future__ import annotations

from typing import Any

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._calculate_spec_decoding_metrics"


def correct_proposed_drafts(
    _result: Any, manager: Any, meta_info: dict[str, Any], recv_obj: Any, i: int, *_args: Any, **_kwargs: Any
) -> None:
    """AFTER hook of `TokenizerManager._calculate_spec_decoding_metrics`: rewrites the drafted counts of
    request `i` of a DART server's output batch in place."""
    if str(manager.server_args.speculative_algorithm).upper() != "DART":
        return
    if "spec_num_proposed_drafts" not in meta_info:
        return  # SGLang wrote no counts for this output (no verify step yet)
    cap_tokens = getattr(recv_obj, "spec_num_cap_tokens", None)
    if cap_tokens is None or len(cap_tokens) <= i:
        return
    proposed = int(cap_tokens[i]) - int(recv_obj.spec_verify_ct[i])
    correct = meta_info["spec_num_correct_drafts"]
    meta_info["spec_num_proposed_drafts"] = proposed
    meta_info["spec_proposed_drafts"] = proposed  # SGLang's older name, still filled in
    meta_info["spec_accept_rate"] = correct / proposed if proposed > 0 else 0.0


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, correct_proposed_drafts, HookType.AFTER)
