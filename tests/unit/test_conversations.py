"""Training data in the common chat formats: each row becomes the target's chat-templated token ids, as if
the conversation had been written by hand through the tokenizer; empty rows are counted, bad rows named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sglang_dart.train.conversations import DataFormatError, read_sequences
from tests.support.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _templated(tokenizer, messages: list[dict]) -> list[int]:  # noqa: ANN001
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return tokenizer(text)["input_ids"]


def test_openai_and_sharegpt_rows_become_the_same_templated_ids(tokenizer, tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
    ]
    sharegpt = [
        {"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
        for m in chat
    ]
    rows = [
        {"messages": chat},
        {"conversations": sharegpt},
        {"input_ids": [5, 6, 7, 8]},
        {"text": "import os\n"},
    ]
    got = read_sequences(_write(tmp_path / "d.jsonl", rows), tokenizer, max_len=1000)
    expected = _templated(tokenizer, chat)
    assert got.ids[0] == expected and got.ids[1] == expected
    assert got.ids[2] == [5, 6, 7, 8] and got.ids[3] == tokenizer("import os\n")["input_ids"]
    assert not got.skipped and got.report() == "4 sequences"


def test_each_sequence_records_where_its_answer_starts(tokenizer, tmp_path):
    """Chat rows: the templated turns before the first assistant turn, with the assistant header; rows of
    ids: their `prompt_len` (what `generate` writes); text: 0. An answer cut off by --max-len is a counted
    skip, and a malformed prompt_len names its line."""
    chat = [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
        {"role": "user", "content": "and sub?"},
        {"role": "assistant", "content": "    return a - b"},
    ]
    rows = [
        {"messages": chat},
        {"input_ids": [5, 6, 7, 8, 9], "prompt_len": 3},
        {"text": "import os\n"},
        {"messages": chat[:1]},  # no assistant turn: every position
        # with --max-len 3, this row, the first and the second lose their answers
        {"input_ids": [5, 6, 7, 8], "prompt_len": 4},
    ]
    got = read_sequences(_write(tmp_path / "d.jsonl", rows), tokenizer, max_len=1000)
    header = tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True)
    header = header["input_ids"] if hasattr(header, "keys") else header
    start = got.answer_starts[0]
    assert len(header) - 2 <= start <= len(header) and got.ids[0][:start] == list(header)[:start]
    assert got.answer_starts[1:4] == [3, 0, 0]
    short = read_sequences(_write(tmp_path / "s.jsonl", rows), tokenizer, max_len=3)
    assert short.skipped["no answer within --max-len"] == 3 and len(short.ids) == len(short.answer_starts)
    with pytest.raises(DataFormatError, match=r"b.jsonl:1: 'prompt_len'"):
        bad = [{"input_ids": [1, 2, 3], "prompt_len": "x"}]
        read_sequences(_write(tmp_path / "b.jsonl", bad), tokenizer, 9)


def test_empty_rows_are_counted_not_fatal(tokenizer, tmp_path):
    rows = [
        {"messages": []},
        {"conversations": [{"from": "human", "value": "   "}]},
        {"text": ""},
        {"input_ids": [1, 2]},
        {"messages": [{"role": "user", "content": "hello there, how are you"}]},
    ]
    got = read_sequences(_write(tmp_path / "d.jsonl", rows), tokenizer, max_len=1000)
    assert len(got.ids) == 1
    assert got.skipped == {"empty": 3, "shorter than 3 tokens": 1}
    assert "4 rows skipped" in got.report()


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "x", "completion": "y"}, "unknown row format"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "needs a role"),
        ({"messages": [{"role": "user", "content": ["image"]}]}, "content must be text"),
        ({"conversations": [{"from": "narrator", "value": "x"}]}, "ShareGPT turn"),
        ({"conversations": "hi"}, "must be a list"),
        (["not", "an", "object"], "JSON object"),
    ],
)
def test_a_row_in_no_known_format_is_named_by_file_and_line(tokenizer, tmp_path, row, message):
    path = _write(tmp_path / "d.jsonl", [{"text": "fine"}, row])
    with pytest.raises(DataFormatError, match=rf"d\.jsonl:2: .*{message}"):
        read_sequences(path, tokenizer, max_len=1000)


def test_chat_rows_need_a_chat_template(tokenizer, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = None
    path = _write(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataFormatError, match="no chat template"):
        read_sequences(path, tokenizer, max_len=1000)
    # A generated conversation's row records its turns beside its ids: the ids are what is read.
    messages = [{"role": "user", "content": "hi"}]
    path = _write(tmp_path / "g.jsonl", [{"prompt": "hi", "messages": messages, "input_ids": [5, 6, 7]}])
    assert read_sequences(path, tokenizer, max_len=1000).ids == [[5, 6, 7]]


def test_generation_prompts_end_at_the_last_user_turn(tmp_path):
    from sglang_dart.train.conversations import read_prompts

    rows = [
        {"prompt": "Write a haiku."},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "Sort a list"}, {"role": "assistant", "content": "x"}]},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"}]},
        {"conversations": [{"from": "gpt", "value": "no user here"}]},
        {"prompt": "  "},
    ]  # fmt: skip
    prompts, skipped = read_prompts(_write(tmp_path / "p.jsonl", rows))
    assert prompts == [
        [{"role": "user", "content": "Write a haiku."}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Sort a list"},
        ],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    ]
    assert skipped == {"no user turn": 2}
    (tmp_path / "p.txt").write_text("Explain DNS.\n\nWhat is a monad?\n")
    text, _ = read_prompts(tmp_path / "p.txt")
    assert text == [
        [{"role": "user", "content": "Explain DNS."}],
        [{"role": "user", "content": "What is a monad?"}],
    ]
    with pytest.raises(DataFormatError, match=r"p\.jsonl:1: unknown prompt format"):
        read_prompts(_write(tmp_path / "p.jsonl", [{"question": "x"}]))


def test_gzipped_rows_read_as_the_plain_file(tokenizer, tmp_path):
    import gzip

    rows = [{"input_ids": [5, 6, 7, 8], "prompt_len": 1}, {"text": "hello there, general reader"}]
    plain = read_sequences(_write(tmp_path / "d.jsonl", rows), tokenizer, max_len=1000)
    packed = tmp_path / "d.jsonl.gz"
    packed.write_bytes(gzip.compress((tmp_path / "d.jsonl").read_bytes()))
    got = read_sequences(packed, tokenizer, max_len=1000)
    assert got.ids == plain.ids and got.answer_starts == plain.answer_starts and len(got.ids) == 2


@pytest.mark.parametrize("damage", ["missing", "truncated gzip"])
def test_an_unreadable_data_file_stops_training_with_its_name(tmp_path, damage):
    import gzip

    from sglang_dart.train.__main__ import read_sequences as training_sequences

    path = tmp_path / "answers.jsonl.gz"
    if damage == "truncated gzip":
        path.write_bytes(gzip.compress(b'{"input_ids": [1, 2, 3]}\n' * 200)[:40])
    with pytest.raises(SystemExit, match="answers.jsonl.gz"):
        training_sequences(path, None, 100)
