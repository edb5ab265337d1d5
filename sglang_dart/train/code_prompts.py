"""Code-assistant prompts built from real source files: a function or class of a code base, with a task
around it (complete it, explain it, fix it, document it, test it, port it...).

    python -m sglang_dart.train.code_prompts --source DIR [--source DIR ...] --out prompts.jsonl \
        [--count 600] [--seed 0] [--exclude-file PROMPTS.txt]

A server for a code assistant sees code pasted into most prompts, and the answers repeat, continue and
rework it. Prompts the target writes itself (Magpie) rarely hold any. So these prompts take their code from
the sources given (your own repository, or Python's standard library: `python -c "import sysconfig;
print(sysconfig.get_paths()['stdlib'])"`), and `python -m sglang_dart.train.generate --prompts
prompts.jsonl` has the target answer them. Python files are parsed and cut at function and class
boundaries; a file that does not parse is skipped and counted. The output is one {"prompt": text} per
line, seeded, de-duplicated and without any prompt of `--exclude-file`.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# (task, where the code goes): "{code}" is the snippet, "{head}" its first lines (to be completed).
_TASKS = [
    "Complete this Python function:\n\n{head}",
    "Finish the implementation:\n\n{head}",
    "What does this function do?\n\n{code}",
    "Explain this code step by step:\n\n{code}",
    "Can you explain what this Python code is doing? I found it in a project I inherited.\n\n{code}",
    "Add type hints and a docstring to this function:\n\n{code}",
    "Is there a bug in this code? If so, how do I fix it?\n\n{code}",
    "Rewrite this function so that it is easier to read:\n\n{code}",
    "Write pytest unit tests for this function:\n\n{code}",
    "Translate this Python code to JavaScript:\n\n{code}",
    "How could this code be made faster?\n\n{code}",
    "Review this code and suggest improvements:\n\n{code}",
    "Summarize in two sentences what this code is for:\n\n{code}",
    "{code}\n\nWhat would be a better name for this function, and why?",
    "{code}\n\nWhat are the edge cases this code does not handle?",
]
MIN_LINES, MAX_LINES = 4, 40


@dataclass(frozen=True)
class Snippet:
    path: str
    code: str  # dedented source of one function or class
    name: str = ""  # the function's or class's name
    kind: str = "function"  # "function" or "class"


def python_snippets(path: Path, text: str) -> list[Snippet]:
    """Every function and class of a Python file of MIN_LINES..MAX_LINES lines, nested ones included."""
    tree = ast.parse(text)
    lines = text.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        end = node.end_lineno or node.lineno
        if MIN_LINES <= end - start <= MAX_LINES:
            code = textwrap.dedent("\n".join(lines[start:end])).strip("\n")
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            found.append(Snippet(str(path), code, node.name, kind))
    return found


def collect_snippets(sources: list[Path]) -> tuple[list[Snippet], Counter]:
    """Snippets of every .py file under the sources (sorted, so a seed picks the same ones), and the files
    skipped by reason."""
    snippets: list[Snippet] = []
    skipped: Counter = Counter()
    for source in sources:
        files = source_files(source, ".py")
        for path in files:
            try:
                snippets += python_snippets(path, path.read_text(encoding="utf-8"))
            except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
                skipped["unreadable or not Python 3"] += 1
    return snippets, skipped


def _head(code: str, rng: random.Random) -> str:
    """The signature and the first part of a body: what a user asks to have completed."""
    lines = code.splitlines()
    keep = rng.randint(2, max(2, len(lines) // 2))
    return "\n".join(lines[:keep]) + "\n"


def _fenced(code: str, rng: random.Random) -> str:
    return f"```python\n{code}\n```" if rng.random() < 0.5 else code


def make_prompts(snippets: list[Snippet], count: int, seed: int, exclude: set[str]) -> list[str]:
    """`count` distinct prompts (fewer if the snippets run out), each a task around a snippet no other
    prompt uses."""
    rng = random.Random(seed)
    order = list(range(len(snippets)))
    rng.shuffle(order)
    prompts: list[str] = []
    seen = set(exclude)
    codes_used: set[str] = set()
    for i in order:
        if len(prompts) >= count:
            break
        code = snippets[i].code
        if code in codes_used:
            continue
        task = rng.choice(_TASKS)
        prompt = task.format(code=_fenced(code, rng), head=_head(code, rng))
        if prompt in seen:
            continue
        seen.add(prompt)
        codes_used.add(code)
        prompts.append(prompt)
    return prompts


def source_files(source: Path, suffix: str | None = None) -> list[Path]:
    """The source itself if it is a file, else every file under it (ending in `suffix` where given), in
    sorted order. Linked folders are followed (a folder of links to the trees one wants is a common way to
    pick them), each real folder once, so a link loop ends."""
    if source.is_file():
        return [source]
    found, seen = [], set()
    for folder, subfolders, names in os.walk(source, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders.clear()
            continue
        seen.add(real)
        found += [Path(folder) / n for n in names if suffix is None or n.endswith(suffix)]
    return sorted(p for p in found if p.is_file())


def checked_sources_and_exclude(parser: argparse.ArgumentParser, args: argparse.Namespace) -> set[str]:
    """The lines of --exclude-file (none without one), after every --source was found to exist (a
    parser error naming the missing ones otherwise); shared by the commands that read sources."""
    missing = [str(s) for s in args.source if not s.exists()]
    if missing:
        parser.error(f"no such source: {', '.join(missing)}")
    return set(args.exclude_file.read_text().splitlines()) if args.exclude_file else set()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m sglang_dart.train.code_prompts", description=__doc__.split("\n")[0]
    )
    p.add_argument("--source", type=Path, action="append", required=True, help="a file or folder of sources")
    p.add_argument("--out", type=Path, required=True, help=".jsonl of {prompt} rows for `generate --prompts`")
    p.add_argument("--count", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude-file", type=Path, default=None, help="prompts (one per line) to keep out")
    args = p.parse_args(argv)
    exclude = checked_sources_and_exclude(p, args)
    if args.count < 1:
        p.error("--count must be >= 1")
    snippets, skipped = collect_snippets(args.source)
    if not snippets:
        p.error(f"no function or class of {MIN_LINES}-{MAX_LINES} lines in the sources")
    prompts = make_prompts(snippets, args.count, args.seed, exclude)
    args.out.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in prompts))
    skipped_text = f"; skipped {dict(skipped)}" if skipped else ""
    print(f"{len(prompts)} prompts from {len(snippets)} snippets{skipped_text}: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
