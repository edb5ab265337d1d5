"""Training rows in the formats people have: token ids, plain text, OpenAI `messages` and ShareGPT
`conversations`, each turned into the token ids of one sequence.

    {"input_ids": [1, 2, 3]}
    {"text": "plain text"}
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}

Chat rows go through the target tokenizer's own chat template (a tokenizer without one is an error,
raised once, before any training). Each sequence also records where its answer starts: the drafter is
only ever asked to draft answers, so training and the held-out estimate look at answer positions alone.
That is `prompt_len` for a row of ids that has it (what `generate` writes), the templated length of the
turns before the first assistant turn for a chat row, and 0 (every position) where nothing says. Rows with
no usable content (an empty conversation, empty text) are skipped and counted; a row in no known format
stops the run, naming the file and line.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_dart.jsonl import JSONL_SUFFIXES, iter_jsonl

# ShareGPT speaker names, by the chat-template role they take.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
_ROLES = {"system", "user", "assistant"}


class DataFormatError(ValueError):
    """A training row that is in no known format, or that a chat format cannot express."""


@dataclass
class Sequences:
    ids: list[list[int]] = field(default_factory=list)
    answer_starts: list[int] = field(default_factory=list)  # index of each sequence's first answer token
    skipped: Counter = field(default_factory=Counter)  # reason -> rows

    def report(self) -> str:
        if not self.skipped:
            return f"{len(self.ids)} sequences"
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return f"{len(self.ids)} sequences ({sum(self.skipped.values())} rows skipped: {reasons})"


def chat_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """The row's turns as chat-template messages (role, content); [] for an empty conversation."""
    if "messages" in row:
        turns = row["messages"]
        if not isinstance(turns, list):
            raise DataFormatError("'messages' must be a list of {role, content}")
        messages = []
        for turn in turns:
            if not isinstance(turn, dict) or turn.get("role") not in _ROLES:
                raise DataFormatError(f"a message needs a role in {sorted(_ROLES)}: {turn!r:.80}")
            content = turn.get("content")
            if not isinstance(content, str):
                raise DataFormatError(f"a message's content must be text: {turn!r:.80}")
            messages.append({"role": turn["role"], "content": content})
        return messages
    turns = row["conversations"]
    if not isinstance(turns, list):
        raise DataFormatError("'conversations' must be a list of {from, value}")
    messages = []
    for turn in turns:
        speaker = str(turn.get("from", "")).lower() if isinstance(turn, dict) else ""
        if speaker not in _SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
            raise DataFormatError(
                f"a ShareGPT turn needs 'from' in {sorted(_SHAREGPT_ROLES)} and a text 'value'"
            )
        messages.append({"role": _SHAREGPT_ROLES[speaker], "content": turn["value"]})
    return messages


def templated_ids(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of messages through the tokenizer's chat template (transformers 5 returns a BatchEncoding,
    older versions a list)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _answer_start(tokenizer: Any, messages: list[dict[str, str]], ids: list[int]) -> int:
    """Templated length of the turns before the first assistant turn, with the assistant header the template
    adds, as far as the whole conversation's ids share it (tokens can merge across the header's end); 0
    where there is no assistant turn."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if not first:
        return 0
    prefix = templated_ids(tokenizer, messages[:first], add_generation_prompt=True)
    shared = 0
    for a, b in zip(prefix, ids, strict=False):
        if a != b:
            break
        shared += 1
    return shared


def row_sequence(row: Any, tokenizer: Any) -> tuple[list[int], int] | None:
    """(token ids, index of the first answer token) of one row, or None for a row with nothing in it."""
    if not isinstance(row, dict):
        raise DataFormatError("each line must be a JSON object")
    if "input_ids" in row:
        ids = [int(i) for i in row["input_ids"]]
        start = row.get("prompt_len", 0)
        if not isinstance(start, int) or start < 0:
            raise DataFormatError(f"'prompt_len' must be a non-negative integer, not {start!r:.40}")
        return (ids, start) if ids else None
    if "text" in row:
        return (tokenizer(row["text"])["input_ids"], 0) if str(row["text"]).strip() else None
    if "messages" in row or "conversations" in row:
        messages = chat_messages(row)
        if not any(m["content"].strip() for m in messages):
            return None
        ids = templated_ids(tokenizer, messages)
        return ids, _answer_start(tokenizer, messages, ids)
    raise DataFormatError(
        "unknown row format: expected 'input_ids', 'text', 'messages' (OpenAI) or 'conversations' (ShareGPT)"
    )


def read_sequences(path: Path, tokenizer: Any, max_len: int) -> Sequences:
    """Every row of a .jsonl file (or .jsonl.gz: the committed answer chunks) as token ids truncated to
    max_len; DataFormatError naming file and line."""
    out = Sequences()
    has_template = bool(getattr(tokenizer, "chat_template", None))
    for line_no, row in iter_jsonl(path):
        # A row with input_ids is read from them (a generated conversation records its turns too).
        chat = isinstance(row, dict) and "input_ids" not in row
        chat = chat and ("messages" in row or "conversations" in row)
        if chat and not has_template:
            raise DataFormatError(
                f"{path}:{line_no}: a chat row, but the target's tokenizer has no chat template"
            )
        try:
            parsed = row_sequence(row, tokenizer)
        except DataFormatError as exc:
            raise DataFormatError(f"{path}:{line_no}: {exc}") from None
        if parsed is None:
            out.skipped["empty"] += 1
            continue
        ids, start = parsed[0][:max_len], parsed[1]
        if len(ids) < 3:
            out.skipped["shorter than 3 tokens"] += 1
        elif start >= len(ids):  # the answer lies beyond --max-len: nothing the drafter is asked for
            out.skipped["no answer within --max-len"] += 1
        else:
            out.ids.append(ids)
            out.answer_starts.append(start)
    return out


def prompt_turns(row: Any) -> list[dict[str, str]] | None:
    """A generation prompt from one row: the conversation up to and including its last user turn (the
    target writes the answer), or a {"prompt": text} / plain string as one user turn; None when the row
    has no user turn with content."""
    if isinstance(row, str):
        row = {"prompt": row}
    if not isinstance(row, dict):
        raise DataFormatError("each line must be a JSON object or string")
    if "prompt" in row:
        text = row["prompt"]
        return [{"role": "user", "content": text}] if isinstance(text, str) and text.strip() else None
    if "messages" not in row and "conversations" not in row:
        raise DataFormatError("unknown prompt format: expected 'prompt', 'messages' or 'conversations'")
    messages = chat_messages(row)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None or not messages[last_user]["content"].strip():
        return None
    return messages[: last_user + 1]


def read_prompts(path: Path) -> tuple[list[list[dict[str, str]]], Counter]:
    """Prompts from a .txt (one per line) or .jsonl file (rows of `prompt_turns`), and the skipped rows
    by reason; DataFormatError naming file and line."""
    prompts: list[list[dict[str, str]]] = []
    skipped: Counter = Counter()
    if path.suffix.lower() not in JSONL_SUFFIXES:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                prompts.append([{"role": "user", "content": line}])
        return prompts, skipped
    for line_no, row in iter_jsonl(path):
        try:
            turns = prompt_turns(row)
        except DataFormatError as exc:
            raise DataFormatError(f"{path}:{line_no}: {exc}") from None
        if turns is None:
            skipped["no user turn"] += 1
        else:
            prompts.append(turns)
    return prompts, skipped
