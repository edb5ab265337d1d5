"""Chat rows from documents and source code: reST cut into titled sections without its markup, sections
into chunks at paragraph boundaries, functions into code answers, each chunk once, seeded, excluded
questions kept out, and clear errors for missing or empty sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_dart.train.code_prompts import source_files
from sglang_dart.train.documents import collect_chunks, main, pick_rows, plain_rst, sections, word_chunks

WORDS = " ".join(f"word{i}" for i in range(30))
RST = f"""
.. _queues:

=======
Queues
=======

.. index:: single: queue
   pair: FIFO; queue

A queue holds items in order. :class:`collections.deque` is one, and ``put`` adds an item. {WORDS}

Example::

   q = Queue()
   q.put(1)

Stacks
------

.. versionadded:: 3.2
   Stacks got a method.

A stack gives back the last item first; see :meth:`~list.pop`. {WORDS}
"""


def test_rst_markup_is_taken_out_and_code_blocks_stay():
    text = plain_rst(RST)
    assert ".. " not in text and ":class:" not in text and "``" not in text
    assert "pair: FIFO" not in text and "Stacks got a method" not in text
    assert "`collections.deque`" in text and "`list.pop`" in text and "`put`" in text
    assert "Example:\n" in text and "   q.put(1)" in text


def test_sections_follow_the_titles():
    found = sections(plain_rst(RST))
    assert [title for title, _ in found] == ["Queues", "Stacks"]
    assert found[0][1].startswith("A queue holds") and "q.put(1)" in found[0][1]
    assert found[1][1].startswith("A stack gives back")
    markdown = sections(f"# Intro\n\nSome text. {WORDS}\n\n## Next\n\nMore. {WORDS}\n")
    assert [title for title, _ in markdown] == ["Intro", "Next"]


def test_listing_lines_and_fenced_comments_are_not_titles():
    asciidoc = (
        f"Merging\n-------\n\nTo merge a branch: {WORDS}\n\n------------\n$ git merge work\n"
        f"------------\n\nor, after a fetch:\n------------------\n$ git fetch\n$ git merge FETCH_HEAD\n"
        f"------------------\n\n------------\n100644 5be4a4a M file.c\n------------\n"
    )
    found = sections(asciidoc)
    assert [title for title, _ in found] == ["Merging"]
    assert "$ git merge work" in found[0][1] and "$ git merge FETCH_HEAD" in found[0][1]
    assert "100644 5be4a4a M file.c" in found[0][1]
    markdown = sections(f"# Setup\n\nInstall it. {WORDS}\n\n```sh\n\n# fetch the wheel\npip install x\n```\n")
    assert [title for title, _ in markdown] == ["Setup"] and "# fetch the wheel" in markdown[0][1]


def test_chunks_end_at_paragraphs_and_skip_scraps():
    paragraphs = [" ".join([f"p{i}"] * 30) for i in range(5)]
    chunks = word_chunks("\n\n".join(paragraphs), max_words=70)
    assert chunks == ["\n\n".join(paragraphs[0:2]), "\n\n".join(paragraphs[2:4]), paragraphs[4]]
    assert word_chunks("too short to teach anything", 70) == []


def _sources(tmp_path: Path) -> Path:
    (tmp_path / "queues.rst").write_text(RST)
    (tmp_path / "stack.py").write_text(
        "def push(items, item):\n    '''Add one.'''\n    items.append(item)\n    return len(items)\n"
    )
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    return tmp_path


def test_rows_are_chat_answers_each_chunk_once(tmp_path):
    chunks, skipped = collect_chunks([_sources(tmp_path)], max_words=260, seed=0)
    assert not skipped and len(chunks) == 3
    rows = pick_rows(chunks + chunks, count=10, seed=0, exclude=set())
    assert len(rows) == 3  # the repeated chunks are taken once
    for row in rows:
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant" and assistant["content"]
    code = [r for r in rows if r["messages"][1]["content"].startswith("```python\ndef push")]
    assert len(code) == 1 and "push" in code[0]["messages"][0]["content"]
    assert pick_rows(chunks, 10, 0, set()) == pick_rows(chunks, 10, 0, set())
    excluded = {r["messages"][0]["content"] for r in rows[:1]}
    assert all(r["messages"][0]["content"] not in excluded for r in pick_rows(chunks, 10, 0, excluded))


def test_the_command_writes_rows_the_trainer_reads(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    from sglang_dart.train.conversations import read_sequences

    (tmp_path / "src").mkdir()
    out = tmp_path / "docs.jsonl"
    main(["--source", str(_sources(tmp_path / "src")), "--out", str(out), "--count", "2"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    sequences = read_sequences(out, tokenizer, 1024)
    assert len(sequences.ids) == 2 and all(
        0 < s < len(i) for s, i in zip(sequences.answer_starts, sequences.ids, strict=True)
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [(lambda p: p / "missing", "no such source"), (lambda p: p, "no section or function")],
)
def test_bad_sources_stop_with_a_clear_error(tmp_path, capsys, make, message):
    with pytest.raises(SystemExit):
        main(["--source", str(make(tmp_path)), "--out", str(tmp_path / "o.jsonl")])
    assert message in capsys.readouterr().err


def test_linked_folders_are_followed_once(tmp_path):
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "guide.md").write_text(f"# Guide\n\nRead this. {WORDS}\n")
    body = "".join(f"    total += {i}\n" for i in range(8))
    (tree / "pkg" / "mod.py").write_text(f"def add(total):\n{body}    return total\n")
    picked = tmp_path / "picked"
    picked.mkdir()
    (picked / "tree").symlink_to(tree, target_is_directory=True)
    (tree / "pkg" / "loop").symlink_to(picked, target_is_directory=True)  # a link back up: walked once
    assert source_files(picked) == [picked / "tree" / "guide.md", picked / "tree" / "pkg" / "mod.py"]
    assert source_files(picked, ".py") == [picked / "tree" / "pkg" / "mod.py"]
    chunks, _ = collect_chunks([picked], 260, seed=0)
    assert len(chunks) == 2
