"""Where each running request stands, as the worker itself left it after its last step: its committed KV
length (the root's position) and its newest tokens, root last.

The worker keeps this instead of reading `req.output_ids` because with overlap scheduling SGLang processes a
step's results one step late: when step n+1 runs, the tokens step n accepted (or the first token a prefill
sampled) are not in `req.output_ids` yet. The worker knows them, having produced them, so every decode-path
read of a request's tokens comes from here; `unseen` gives the tail SGLang has not appended yet (empty
without overlap), for the per-node penalties and logit processors that see a request's whole output.

It also indexes each request's whole sequence (prompt and output, root last) for context chains
(`context`, a Rust `ContextIndex`: the tokens that followed the latest earlier occurrence of the current
suffix), kept in step with the same start/advance/keep_only calls.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sglang_dart.pruner import ContextIndex

# Tokens kept per request: the root and the two before it (the pruner's 3-gram context), plus every token of
# the last step (however large the tree), so the one step SGLang may lag behind is always covered.
KEPT_TOKENS = 64


@dataclass(frozen=True)
class Progress:
    committed: int  # the KV length before the next step: every token but the root
    recent: tuple[int, ...]  # the newest tokens, the root last

    @property
    def root(self) -> int:
        return self.recent[-1]

    @property
    def context(self) -> tuple[int, int]:
        """The two tokens before the root (-1 where the sequence is shorter)."""
        padded = (-1, -1, *self.recent)
        return padded[-3], padded[-2]


def forget_all_but(by_rid: dict[str, Any], current: Collection[str]) -> None:
    """Drop the entries of requests not in `current` (per-request state of requests that left the batch)."""
    for rid in [rid for rid in by_rid if rid not in current]:
        del by_rid[rid]


def _tokens_of(req: Any) -> int:
    return len(req.origin_input_ids) + len(req.output_ids)


class RequestProgress:
    def __init__(self, index_context: bool = False) -> None:
        self._by_rid: dict[str, Progress] = {}
        self.context = ContextIndex() if index_context else None

    def start(self, req: Any, committed: int, tokens: list[int]) -> None:
        """After a prefill (or a prefill chunk): `tokens`, the request's sequence, ends with the token at
        position `committed`."""
        self._by_rid[req.rid] = Progress(committed, tuple(tokens[-KEPT_TOKENS:]))
        if self.context is not None:
            self.context.set(req.rid, tokens)

    def advance(self, req: Any, new_tokens: list[int]) -> None:
        """After a verify: the accepted drafts and the bonus token follow the root; the bonus is the new
        root. The root itself becomes committed along with the accepted drafts."""
        now = self.of(req)
        keep = max(KEPT_TOKENS, len(new_tokens) + 3)
        recent = (now.recent + tuple(new_tokens))[-keep:]
        self._by_rid[req.rid] = Progress(now.committed + len(new_tokens), recent)
        if self.context is not None:
            self.context.extend(req.rid, new_tokens)

    def of(self, req: Any) -> Progress:
        """A request's progress. One the worker has not seen (it cannot happen: every request enters by a
        prefill the worker ran) is read from the request, which is exact without overlap."""
        now = self._by_rid.get(req.rid)
        if now is not None:
            return now
        tail = list(req.output_ids[-3:])
        missing = 3 - len(tail)
        recent = (list(req.origin_input_ids[-missing:]) if missing else []) + tail
        return Progress(_tokens_of(req) - 1, tuple(recent))

    def committed_lens(self, reqs: list[Any]) -> list[int]:
        return [self.of(req).committed for req in reqs]

    def roots(self, reqs: list[Any]) -> list[int]:
        return [self.of(req).root for req in reqs]

    def unseen(self, req: Any) -> list[int]:
        """The request's tokens that SGLang has not appended to it yet (overlap scheduling's lag)."""
        now = self.of(req)
        missing = now.committed + 1 - _tokens_of(req)
        if missing <= 0:
            return []
        if missing > len(now.recent):
            raise AssertionError(f"DART: request {req.rid} lags {missing} tokens behind the worker")
        return list(now.recent[-missing:])

    def keep_only(self, reqs: list[Any]) -> None:
        """Forget every request but these (the running batch: any other one finished, was aborted or was
        retracted; a retracted one starts afresh at its next prefill)."""
        current = {req.rid for req in reqs}
        forget_all_but(self._by_rid, current)
        if self.context is not None:
            self.context.keep_only(list(current))
