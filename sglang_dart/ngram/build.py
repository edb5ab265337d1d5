"""Building a store from text corpora: file discovery, document reading, batch tokenization."""

from __future__ import annotations

import itertools
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sglang_dart._core import NgramBuilder
from sglang_dart.jsonl import JSONL_SUFFIXES, iter_jsonl

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'2G', '512M', '1.5GiB', '1000000' -> bytes (powers of 1024)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse size {text!r} (examples: 512M, 2G, 1000000)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def iter_input_files(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files named directly, plus every file under named folders (recursively, sorted, hidden skipped)."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                files.extend(Path(root) / n for n in sorted(names) if not n.startswith("."))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"input not found: {p}")
    return files


def iter_documents(path: Path) -> Iterator[str]:
    """JSONL files (.jsonl/.json/.ndjson): one document per line, its ``text`` field (like the reference).
    Any other file: the whole file is one plain-text document (UTF-8, undecodable bytes replaced)."""
    if path.suffix.lower() in JSONL_SUFFIXES:
        for _, obj in iter_jsonl(path):
            text = obj.get("text") if isinstance(obj, dict) else None
            if isinstance(text, str):
                yield text
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def _batches(files: Iterable[Path], max_chars: int, max_docs: int) -> Iterator[tuple[list[str], int]]:
    """Groups documents into batches; yields (texts, bytes of input consumed since the last batch)."""
    batch: list[str] = []
    chars = 0
    consumed = 0
    for f in files:
        for doc in iter_documents(f):
            batch.append(doc)
            chars += len(doc)
            if chars >= max_chars or len(batch) >= max_docs:
                yield batch, consumed
                batch, chars, consumed = [], 0, 0
        consumed += f.stat().st_size
    if batch or consumed:
        yield batch, consumed


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
    return max(len(tokenizer), int(getattr(tokenizer, "vocab_size", 0) or 0))


def build_store(
    tokenizer: Any,
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    min_count: int = 1,
    memory_budget: int | str = "1G",
    tmp_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    batch_chars: int = 4 << 20,
    batch_docs: int = 2048,
) -> dict[str, Any]:
    """Tokenizes every document (``add_special_tokens=True``, then the EOS id appended, like the reference)
    and counts its 1-/2-/3-gram windows into a store at ``output``. Returns build statistics."""
    from sglang_dart.ngram.fingerprint import tokenizer_fingerprint

    files = iter_input_files(inputs)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        print("warning: tokenizer has no eos_token_id; documents get no EOS appended", file=sys.stderr)
    vocab = tokenizer_vocab_size(tokenizer)
    tmp = Path(tmp_dir) if tmp_dir else Path(tempfile.gettempdir())
    builder = NgramBuilder(
        vocab,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        min_count=min_count,
        memory_budget=parse_size(memory_budget),
        tmp_dir=str(tmp),
    )
    total_bytes = sum(f.stat().st_size for f in files)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize+count", file=sys.stderr)
    for texts, consumed in _batches(files, batch_chars, batch_docs):
        if texts:
            ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
            if eos is not None:
                ids = [list(x) + [eos] for x in ids]
            lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
            offsets = np.concatenate(([0], np.cumsum(lengths)))
            flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(offsets[-1]))
            builder.add_documents(flat, offsets)
        if bar is not None:
            bar.update(consumed)
            bar.set_postfix(tokens=builder.tokens, runs=builder.spilled_runs, refresh=False)
    if bar is not None:
        bar.close()
    tokens, documents = builder.tokens, builder.documents
    stats = dict(builder.finish(str(output)))
    stats.update(tokens=tokens, documents=documents, files=len(files), input_bytes=total_bytes)
    stats["vocab_size"] = vocab
    return stats
