"""Reading JSON Lines files: one value per non-blank line, errors located by file and line."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# File names read as JSON Lines (anything else is plain text where a command takes both).
JSONL_SUFFIXES = frozenset({".jsonl", ".json", ".ndjson"})


def iter_jsonl_lines(
    path: Path, gzipped: bool | None = None, errors: str = "replace"
) -> Iterator[tuple[int, str, Any]]:
    """(line number, the line as read, parsed value) for every non-blank line; ValueError naming the line
    on bad JSON. `gzipped`: the file is gzip-compressed (a damaged one raises OSError or EOFError); by
    default, where its name ends in `.gz`. `errors`: how undecodable UTF-8 is read ("strict" raises
    UnicodeDecodeError, a ValueError)."""
    if gzipped is None:
        gzipped = Path(path).suffix == ".gz"
    opener = gzip.open if gzipped else open
    with opener(path, "rt", encoding="utf-8", errors=errors) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            yield lineno, line, value


def iter_jsonl(path: Path, gzipped: bool | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for every non-blank line (`iter_jsonl_lines`)."""
    for lineno, _, value in iter_jsonl_lines(path, gzipped):
        yield lineno, value
