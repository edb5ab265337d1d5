"""Reading JSON Lines files: one value per non-blank line, errors located by file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# File names read as JSON Lines (anything else is plain text where a command takes both).
JSONL_SUFFIXES = frozenset({".jsonl", ".json", ".ndjson"})


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for every non-blank line; ValueError naming the line on bad JSON."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
