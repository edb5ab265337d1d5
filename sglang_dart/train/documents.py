"""Chat rows from text the target did not write: documentation sections and source code, each as the
assistant's answer to a question about it.

    python -m sglang_dart.train.documents --source DIR_OR_FILE [--source ...] --out docs.jsonl \
        [--count 3000] [--max-words 260] [--seed 0] [--exclude-file PROMPTS.txt]

Answers the target writes cost a generation each (a 2-core CPU answers a few thousand a session); the
target reads a document in one forward pass, so documents bring far more positions per CPU minute. Their
tokens are not the target's own, though: train on them with `python -m sglang_dart.train
--greedy-chains-only`, which supervises a draft row only where the text keeps to the target's greedy
chain, the only continuation a verify step accepts. Sources: reStructuredText / Markdown / plain text files
(`.rst`, `.txt`, `.md`; Debian's `python3.11-doc` puts Python's documentation sources under
`/usr/share/doc/python3.11/html/_sources`), cut into sections at their titles and into chunks of at most
`--max-words`; and Python files, cut at function and class boundaries (`code_prompts.python_snippets`).
A section's title or a snippet's name makes the user's question. Output: one {"messages": [...]} row per
line, seeded, each chunk once, no user turn equal to a line of `--exclude-file`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from sglang_dart.train.code_prompts import checked_sources_and_exclude, collect_snippets, source_files

TEXT_SUFFIXES = (".rst", ".txt", ".md")
_QUESTIONS = [
    "Explain {title}.",
    "Can you tell me about {title}?",
    "What should I know about {title}?",
    "Give me an overview of {title}.",
    "I'm reading about {title}. Can you explain it?",
    "{title}: how does it work?",
]
_CODE_QUESTIONS = [
    "Write the Python {kind} `{name}`.",
    "Show me how to implement `{name}` in Python.",
    "Can you write a Python {kind} called {name}?",
    "Implement `{name}` in Python.",
]
# reST: a title is a line followed by a line of one repeated punctuation character at least as long.
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}\s*$")
_DIRECTIVE = re.compile(r"^\s*\.\. [\w:-]+::.*$|^\s*\.\. _[^:]+:\s*$|^\s*\.\. \[\w+\]|^\s*:[\w-]+:.*$")
# A shell prompt, or a hash or number opening the line: a listing's line, not a title.
_CODE_LINE = re.compile(r"^(?:[$%>] |(?=[0-9a-f]*\d)[0-9a-f]{5,}\b|\d+$)")
_ROLE = re.compile(r":[\w:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")


@dataclass(frozen=True)
class Chunk:
    question: str
    answer: str


def plain_rst(text: str) -> str:
    """reST markup a reader would not write in a chat answer taken out: directives with the lines right
    under them (options, index entries, version notes; a code block's code, after a blank line, stays),
    label lines, roles (:func:`x` -> `x`), double backquotes and a paragraph's closing '::'."""
    lines: list[str] = []
    in_directive = False
    for line in text.splitlines():
        if _DIRECTIVE.match(line):
            in_directive = True
            continue
        if in_directive and line.strip():
            continue
        in_directive = False
        lines.append(line)
    text = _ROLE.sub(lambda m: f"`{m.group(1).strip().lstrip('!~')}`", "\n".join(lines))
    text = text.replace("``", "`")
    return re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE)


def sections(text: str) -> list[tuple[str, str]]:
    """(title, body) of every titled section of a reST, AsciiDoc or Markdown text; text before the first
    title is dropped (with no title there is no question to ask about it).

    A title stands at the file's start or after a blank line or an overline, never inside a fenced code
    block, and neither looks like a command or its output nor ends in a colon: the last line of an
    AsciiDoc listing above its closing `----`, or a `# comment` in a Markdown code fence, is body text."""
    lines = text.splitlines()
    found: list[tuple[str, list[str]]] = []
    title, body = "", []
    fenced = False
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        opens = i == 0 or not lines[i - 1].strip() or bool(_UNDERLINE.match(lines[i - 1]))
        heading = None
        if line.lstrip().startswith("```"):
            fenced = not fenced
            body.append(line)
            i += 1
        elif fenced:
            body.append(line)
            i += 1
        elif (
            opens
            and line.strip()
            and _UNDERLINE.match(nxt)
            and len(nxt.strip()) >= len(line.strip())
            and not _CODE_LINE.match(line.strip())
            and not line.rstrip().endswith(":")  # a line that opens a listing below it
        ):
            heading, i = line.strip(), i + 2
        elif opens and line.startswith("#") and line.lstrip("#").startswith(" "):
            heading, i = line.lstrip("#").strip(), i + 1
        elif _UNDERLINE.match(line):  # an overline above a title
            i += 1
            continue
        else:
            body.append(line)
            i += 1
        if heading is not None:
            found.append((title, body))
            title, body = heading, []
    found.append((title, body))
    joined = [(t, "\n".join(b).strip()) for t, b in found]
    return [(t, b) for t, b in joined if t and b]


def word_chunks(body: str, max_words: int) -> list[str]:
    """The body cut at paragraph boundaries into chunks of at most about max_words words (a longer
    paragraph is a chunk of its own)."""
    chunks, current, words = [], [], 0
    for para in re.split(r"\n\s*\n", body):
        n = len(para.split())
        if current and words + n > max_words:
            chunks.append("\n\n".join(current))
            current, words = [], 0
        current.append(para.strip("\n"))
        words += n
    if current:
        chunks.append("\n\n".join(current))
    return [c for c in chunks if len(c.split()) >= 20]


def document_chunks(path: Path, max_words: int, rng: random.Random) -> list[Chunk]:
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".md":
        text = plain_rst(text)
    out = []
    for title, body in sections(text):
        title = title.strip("`*: ")
        for chunk in word_chunks(body, max_words):
            out.append(Chunk(rng.choice(_QUESTIONS).format(title=title), textwrap.dedent(chunk)))
    return out


def code_chunks(sources: list[Path], rng: random.Random) -> tuple[list[Chunk], Counter]:
    snippets, skipped = collect_snippets(sources)
    out = []
    for snippet in snippets:
        question = rng.choice(_CODE_QUESTIONS).format(kind=snippet.kind, name=snippet.name)
        out.append(Chunk(question, f"```python\n{snippet.code}\n```"))
    return out, skipped


def collect_chunks(sources: list[Path], max_words: int, seed: int) -> tuple[list[Chunk], Counter]:
    """Every chunk of the sources, files in sorted order (so a seed picks the same ones)."""
    rng = random.Random(seed)
    chunks: list[Chunk] = []
    skipped: Counter = Counter()
    python: list[Path] = []
    for source in sources:
        for path in source_files(source):
            if path.suffix == ".py":
                python.append(path)
            elif path.suffix in TEXT_SUFFIXES:
                try:
                    chunks += document_chunks(path, max_words, rng)
                except (UnicodeDecodeError, OSError):
                    skipped["unreadable text file"] += 1
    code, code_skipped = code_chunks(python, rng)
    return chunks + code, skipped + code_skipped


def pick_rows(chunks: list[Chunk], count: int, seed: int, exclude: set[str]) -> list[dict]:
    rng = random.Random(seed)
    order = list(range(len(chunks)))
    rng.shuffle(order)
    rows, seen = [], set()
    for i in order:
        if len(rows) >= count:
            break
        chunk = chunks[i]
        if chunk.answer in seen or chunk.question in exclude:
            continue
        seen.add(chunk.answer)
        messages = [
            {"role": "user", "content": chunk.question},
            {"role": "assistant", "content": chunk.answer},
        ]
        rows.append({"messages": messages})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m sglang_dart.train.documents", description=__doc__.split("\n")[0]
    )
    p.add_argument("--source", type=Path, action="append", required=True, help="a file or folder")
    p.add_argument(
        "--out", type=Path, required=True, help=".jsonl of chat rows for `python -m sglang_dart.train`"
    )
    p.add_argument("--count", type=int, default=3000)
    p.add_argument("--max-words", type=int, default=260, help="words per answer chunk, at most (about)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude-file", type=Path, default=None, help="prompts (one per line) to keep out")
    args = p.parse_args(argv)
    exclude = checked_sources_and_exclude(p, args)
    if args.count < 1 or args.max_words < 20:
        p.error("--count must be >= 1 and --max-words >= 20")
    chunks, skipped = collect_chunks(args.source, args.max_words, args.seed)
    if not chunks:
        p.error("no section or function in the sources")
    rows = pick_rows(chunks, args.count, args.seed, exclude)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    skipped_text = f"; skipped {dict(skipped)}" if skipped else ""
    print(f"{len(rows)} rows from {len(chunks)} chunks{skipped_text}: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
