"""User prompts written by the target itself (the "Magpie" recipe): its chat template up to where a user's
message begins, sampled at a high temperature, is a user turn the model finds likely. With no dataset on
the machine, this gives the variety of prompts a drafter meets in service better than any fixed list.

Every prompt is cleaned and filtered before use: empty, too short, overlong (cut by the token budget),
degenerate (one token or word repeated), holding template markup, excluded (benchmark prompts) or a
duplicate of an earlier one (case and spacing aside) is skipped and counted.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from sglang_dart.train.conversations import templated_ids

SENTINEL = "\u2063MAGPIE\u2063"  # no chat template produces this text itself
MIN_WORDS = 3


def user_turn_prefix(tokenizer: Any, system: str | None = None) -> list[int]:
    """The token ids a chat starts with, up to where the first user message's text goes (a default system
    prompt included, or `system` instead: a framing such as a coding assistant's makes the target write
    the user turns such an assistant gets). Raises ValueError for a template that does not place the
    message after a prefix."""
    framing = [{"role": "system", "content": system}] if system else []
    return _prefix_of_next_user_turn(tokenizer, framing)


def follow_up_prefix(tokenizer: Any, conversation: list[dict[str, str]]) -> list[int]:
    """The token ids of a conversation (ending with the assistant's answer) up to where the next user
    message's text goes: sampled from, it is the follow-up question the target finds likely."""
    return _prefix_of_next_user_turn(tokenizer, conversation)


def _prefix_of_next_user_turn(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = templated_ids(tokenizer, [*messages, {"role": "user", "content": SENTINEL}])
    text = tokenizer.decode(ids)
    at = text.rfind(SENTINEL)
    if at <= 0:
        raise ValueError("the tokenizer's chat template does not start a user turn with fixed text")
    prefix = tokenizer(text[:at], add_special_tokens=False)["input_ids"]
    if not prefix:
        raise ValueError("the tokenizer's chat template has an empty user-turn prefix")
    return [int(i) for i in prefix]


def normalized(prompt: str) -> str:
    return " ".join(prompt.lower().split())


def rejection(prompt: str, finished: bool, markers: tuple[str, ...]) -> str | None:
    """Why a sampled user turn is not kept as a prompt (a reason for the counts), or None to keep it."""
    text = prompt.strip()
    if not text:
        return "empty"
    if not finished:
        return "overlong"
    if any(marker in text for marker in markers):
        return "template markup"
    words = text.split()
    if len(words) < MIN_WORDS:
        return "too short"
    if len(words) >= 8 and len({w.lower() for w in words}) < 0.4 * len(words):
        return "degenerate"
    if re.search(r"(.)\1{9,}", text) or re.search(r"(\b\S+\b)(\s+\1\b){4,}", text):
        return "degenerate"
    return None


class Screen:
    """Sampled user turns checked one by one: `rejection`'s reasons, then excluded and duplicate texts
    (case and spacing aside); every skip is counted by reason."""

    def __init__(self, tokenizer: Any, exclude: set[str] | None) -> None:
        self.tokenizer = tokenizer
        self.markers = tuple(t for t in tokenizer.all_special_tokens if t and len(t) > 1)
        self.excluded = {normalized(p) for p in exclude or ()}
        self.seen: set[str] = set()
        self.skipped: Counter = Counter()

    def keep(self, out: dict[str, Any]) -> str | None:
        """The server output's text, stripped, if it is kept as a user turn; None (and counted) if not."""
        text = (
            out["text"]
            if "text" in out
            else self.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
        )
        finished = (out.get("meta_info", {}).get("finish_reason") or {}).get("type") == "stop"
        reason = rejection(text, finished, self.markers)
        key = normalized(text)
        if reason is None and key in self.excluded:
            reason = "excluded"
        if reason is None and key in self.seen:
            reason = "duplicate"
        if reason is not None:
            self.skipped[reason] += 1
            return None
        self.seen.add(key)
        return text.strip()


def sample_prompts(
    server: Any,
    tokenizer: Any,
    count: int,
    exclude: set[str] | None = None,
    temperature: float = 1.0,
    top_p: float = 0.99,
    max_new_tokens: int = 96,
    concurrency: int = 16,
    max_rounds: int = 8,
    on_kept: Callable[[str], None] | None = None,
    system: str | None = None,
) -> tuple[list[str], Counter]:
    """Up to `count` distinct prompts sampled from the target through `server` (a running SGLang server);
    rounds of requests continue until there are enough or `max_rounds` rounds have run. Returns the
    prompts and the counts of what was skipped, by reason; `on_kept` is called with each prompt as it is
    kept (the caller saves it, so an interrupted run keeps what it sampled). `system` frames the sampled
    turns only (see `user_turn_prefix`); the answers are generated without it."""
    prefix = user_turn_prefix(tokenizer, system)
    screen = Screen(tokenizer, exclude)
    kept: list[str] = []
    for _ in range(max_rounds):
        wanted = count - len(kept)
        if wanted <= 0:
            break
        batch = max(wanted + wanted // 2, 4)  # extra: some are filtered out
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        # A loaded machine (a niced run beside tests) can hold a request for many minutes; an hour's
        # timeout keeps such a run slow instead of losing its round.
        for out in server.generate_many([prefix] * batch, params, concurrency, timeout=3600):
            text = screen.keep(out)
            if text is None:
                continue
            if len(kept) < count:
                kept.append(text)
                if on_kept is not None:
                    on_kept(kept[-1])
    return kept, screen.skipped


def sample_follow_ups(
    server: Any,
    tokenizer: Any,
    conversations: list[list[dict[str, str]]],
    exclude: set[str] | None = None,
    temperature: float = 1.0,
    top_p: float = 0.99,
    max_new_tokens: int = 96,
    concurrency: int = 16,
    max_rounds: int = 3,
    on_kept: Callable[[list[dict[str, str]]], None] | None = None,
) -> tuple[list[list[dict[str, str]]], Counter]:
    """Second user turns written by the target: for each conversation (ending with an assistant answer),
    one sampled follow-up question, filtered as first turns are (`rejection`; a follow-up equal to an
    excluded prompt or to an earlier kept one is skipped). A conversation whose sample is skipped is tried
    again in the next round, up to `max_rounds`. Returns the conversations extended by their follow-up
    (ready to be answered), in the order given, and the skip counts by reason."""
    screen = Screen(tokenizer, exclude)
    kept: dict[int, list[dict[str, str]]] = {}
    todo = list(range(len(conversations)))
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
    for _ in range(max_rounds):
        if not todo:
            break
        prefixes = [follow_up_prefix(tokenizer, conversations[i]) for i in todo]
        outs = server.generate_many(prefixes, params, concurrency, timeout=3600)
        retry = []
        for i, out in zip(todo, outs, strict=True):
            text = screen.keep(out)
            if text is None:
                retry.append(i)
                continue
            kept[i] = [*conversations[i], {"role": "user", "content": text}]
            if on_kept is not None:
                on_kept(kept[i])
        todo = retry
    return [kept[i] for i in sorted(kept)], screen.skipped
