"""Prefill batches SGLang 0.5.17 builds but cannot run, kept apart.

A request given as `input_embeds` and one given as tokens can be admitted into the same prefill batch.
`ScheduleBatch.prepare_for_extend` then gathers embeddings from the `input_embeds` requests only, the model
gets fewer embedding rows than positions, and the scheduler dies, with every request it was running (a
shape error in the first attention layer). SGLang already keeps `input_embeds` prefills from mixing with
running decodes (`mix_with_running`); this keeps them from mixing with token prompts. A prefill batch
takes requests of one kind; a request of the other kind waits for the next batch, in queue order. The
same holds for plain serving, so it is installed in every process the plugin loads in, not for DART alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"


def same_input_kind(first: Any, req: Any) -> bool:
    """Whether two requests both give `input_embeds` or both give tokens."""
    return (first.input_embeds is None) == (req.input_embeds is None)


def one_input_kind_per_batch(
    add_one_req: Callable[..., Any], adder: Any, req: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook on PrefillAdder.add_one_req: stop filling the batch at the first request of the other
    kind (a chunked request carried over from the last batch is `can_run_list[0]`, so it counts too)."""
    if adder.can_run_list and not same_input_kind(adder.can_run_list[0], req):
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.OTHER
    return add_one_req(adder, req, *args, **kwargs)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, one_input_kind_per_batch, HookType.AROUND)
