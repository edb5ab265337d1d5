"""One training file from several row files: every row of some, a seeded sample of others, shuffled.

    python -m sglang_dart.train.mix --out mix.jsonl --seed 73 \\
        'data/smollm2-answers/s55-*.jsonl.gz' 'data/smollm2-answers/s3*.jsonl.gz=700' docs.jsonl

A part is one or more comma-separated globs (plain or gzipped JSON Lines): the rows of every file they
match, in sorted path order, all of them or, after `=N`, N drawn without replacement. One random
generator seeded by `--seed` draws the parts in order and then shuffles the whole, so the same command
writes the same bytes. Rows are copied as they are (each a JSON value, checked), never re-encoded.
"""

from __future__ import annotations

import argparse
import glob
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from sglang_dart.jsonl import iter_jsonl_lines


@dataclass(frozen=True)
class Part:
    paths: list[Path]
    count: int | None  # None: every row


def parse_part(spec: str) -> Part:
    """`GLOB[,GLOB...][=N]` -> the files it names and how many rows to draw; ValueError when a glob matches
    nothing or N is not a positive integer."""
    patterns, _, count_text = spec.partition("=")
    count = None
    if count_text:
        if not count_text.isdigit() or int(count_text) < 1:
            raise ValueError(f"{spec!r}: the count after '=' must be a positive integer")
        count = int(count_text)
    paths = set()
    for pattern in patterns.split(","):
        matched = glob.glob(pattern)
        if not matched:
            raise ValueError(f"{pattern!r} matches no file")
        paths.update(Path(m) for m in matched)
    return Part(sorted(paths), count)


def row_lines(path: Path) -> list[str]:
    """The file's non-blank lines, each ending in a newline; ValueError naming a line that is not JSON or
    not UTF-8 (rows are copied, so nothing is replaced)."""
    rows = iter_jsonl_lines(path, errors="strict")
    return [line if line.endswith("\n") else line + "\n" for _, line, _ in rows]


def mixed_rows(parts: list[Part], seed: int) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    for part in parts:
        rows = [line for path in part.paths for line in row_lines(path)]
        if part.count is None:
            out += rows
        elif part.count > len(rows):
            names = ", ".join(str(p) for p in part.paths)
            raise ValueError(f"{names}: {part.count} rows asked for, {len(rows)} there")
        else:
            out += rng.sample(rows, part.count)
    rng.shuffle(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sglang_dart.train.mix", description=__doc__.split("\n")[0])
    p.add_argument("parts", nargs="+", help="GLOB[,GLOB...][=N]: every row of the files, or N drawn")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        rows = mixed_rows([parse_part(spec) for spec in args.parts], args.seed)
    except (ValueError, OSError, EOFError) as exc:
        p.error(str(exc))
    args.out.write_text("".join(rows), encoding="utf-8")
    print(f"{len(rows)} rows: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
