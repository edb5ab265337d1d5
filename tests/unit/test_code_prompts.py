"""Code-assistant prompts from real sources: functions and classes cut at their boundaries (decorators
included, nested ones too, too short or too long left out), tasks around them that are seeded, distinct and
free of excluded prompts, and clear errors for sources that are missing or hold nothing usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_dart.train.code_prompts import collect_snippets, main, make_prompts, python_snippets

SOURCE = '''
import functools


@functools.cache
def fib(n):
    if n < 2:
        return n
    return fib(n - 1) + fib(n - 2)


def tiny():
    return 1


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        """Add an item on top; return the new size."""
        self.items.append(item)
        return len(self.items)
'''


def test_snippets_are_whole_functions_and_classes():
    codes = {s.code.splitlines()[0]: s.code for s in python_snippets(Path("m.py"), SOURCE)}
    assert set(codes) == {"@functools.cache", "class Stack:", "def push(self, item):"}  # tiny: 2 lines
    assert codes["@functools.cache"].endswith("return fib(n - 1) + fib(n - 2)")
    assert codes["def push(self, item):"].startswith("def push")  # dedented out of its class
    assert "__init__" not in "".join(c.splitlines()[0] for c in codes.values())  # 2 lines: too short


def test_prompts_are_seeded_distinct_and_exclude_what_they_are_told(tmp_path):
    for i in range(30):
        (tmp_path / f"m{i}.py").write_text(SOURCE.replace("fib", f"fib{i}").replace("Stack", f"Stack{i}"))
    (tmp_path / "old.py").write_text("print 'python 2'\n")
    snippets, skipped = collect_snippets([tmp_path])
    assert len(snippets) == 90 and skipped["unreadable or not Python 3"] == 1
    first = make_prompts(snippets, 40, seed=1, exclude=set())
    assert first == make_prompts(snippets, 40, seed=1, exclude=set()) != make_prompts(snippets, 40, 2, set())
    assert len(set(first)) == 40
    assert all(any(s.code.splitlines()[0] in p for s in snippets) for p in first)  # each holds a snippet
    fewer = make_prompts(snippets, 40, seed=1, exclude={first[0]})
    assert first[0] not in fewer
    # One prompt per distinct snippet at most: the 30 files' `push` methods are one and the same code.
    assert len(make_prompts(snippets, 500, seed=1, exclude=set())) == 30 + 30 + 1


def test_command_writes_prompt_rows_and_refuses_bad_sources(tmp_path, capsys):
    (tmp_path / "m.py").write_text(SOURCE)
    out = tmp_path / "prompts.jsonl"
    main(["--source", str(tmp_path / "m.py"), "--out", str(out), "--count", "2"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(set(r) == {"prompt"} for r in rows)
    for argv, message in (
        (["--source", str(tmp_path / "nowhere")], "no such source"),
        (["--source", str(tmp_path / "empty.py")], "no function or class"),
    ):
        (tmp_path / "empty.py").write_text("x = 1\n")
        with pytest.raises(SystemExit):
            main([*argv, "--out", str(out)])
        assert message in capsys.readouterr().err
