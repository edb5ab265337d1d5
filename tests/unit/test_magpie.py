"""Magpie prompts: the user-turn prefix comes from the tokenizer's own chat template, and sampled turns
are filtered (empty, unfinished, markup, short, degenerate, excluded, duplicate) and counted."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_dart.train.magpie import rejection, sample_prompts, user_turn_prefix
from tests.support.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    out: Path = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


def test_prefix_is_the_template_up_to_the_user_text(tokenizer):
    assert tokenizer.decode(user_turn_prefix(tokenizer)) == "<|im_start|>user\n"


def test_prefix_keeps_a_default_system_prompt(tokenizer):
    tokenizer.chat_template = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    try:
        assert tokenizer.decode(user_turn_prefix(tokenizer)) == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        )
    finally:
        from tests.support.tiny_models import CHAT_TEMPLATE

        tokenizer.chat_template = CHAT_TEMPLATE


def test_a_framing_system_prompt_replaces_the_default(tokenizer):
    prefix = tokenizer.decode(user_turn_prefix(tokenizer, system="You help with code."))
    assert prefix == "<|im_start|>system\nYou help with code.<|im_end|>\n<|im_start|>user\n"


@pytest.mark.parametrize(
    ("text", "finished", "reason"),
    [
        ("  ", True, "empty"),
        ("Write a function that adds two numbers.", False, "overlong"),
        ("Hi <|im_start|>assistant", True, "template markup"),
        ("Hello there", True, "too short"),
        ("the the the the the the the the the the", True, "degenerate"),
        ("aaaaaaaaaaaaaaaa is a long word", True, "degenerate"),
        ("Explain how a hash map handles collisions.", True, None),
    ],
)
def test_rejection_reasons(text, finished, reason):
    assert rejection(text, finished, ("<|im_start|>", "<|im_end|>")) == reason


class _Replies:
    """Stands in for the server in this unit test only: the integration test samples a real one."""

    def __init__(self, texts: list[tuple[str, str]]) -> None:
        self.texts = list(texts)
        self.asked: list[int] = []

    def generate_many(self, prompts, params, concurrency, timeout=300.0):
        self.asked.append(len(prompts))
        out = []
        for _ in prompts:
            text, finish = self.texts.pop(0) if self.texts else ("", "stop")
            out.append({"text": text, "meta_info": {"finish_reason": {"type": finish}}})
        return out


def test_sampled_prompts_are_filtered_deduplicated_and_counted(tokenizer):
    replies = _Replies(
        [
            ("How do I reverse a list in Python?", "stop"),
            ("how do I  reverse a list in python?", "stop"),  # duplicate up to case and spacing
            ("Write a haiku about the sea.", "stop"),  # excluded (a benchmark prompt)
            ("Tell me about the history of Rome and", "length"),
            ("What is the capital of France?", "stop"),
            ("ok", "stop"),
            ("Give three tips for better sleep.", "stop"),
        ]
    )
    kept, skipped = sample_prompts(replies, tokenizer, 3, exclude={"write a haiku about the sea."})
    assert kept == [
        "How do I reverse a list in Python?",
        "What is the capital of France?",
        "Give three tips for better sleep.",
    ]
    assert skipped == {"duplicate": 1, "excluded": 1, "overlong": 1, "too short": 1, "empty": 1}
    assert replies.asked == [4, 4]  # rounds go on until enough are kept


def test_a_resumed_generation_answers_only_what_is_missing(tmp_path):
    from sglang_dart.train.generate import _read_rows, unanswered

    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    prompts = ["x", "y", "x", chat, "z"]  # "x" asked twice (two samples)
    partial = tmp_path / "out.jsonl.partial"
    partial.write_text('{"prompt": "x"}\n{"prompt": "c"}\n{"prompt": "y", "cut')
    rows = _read_rows(partial)
    assert rows == [{"prompt": "x"}, {"prompt": "c"}]  # the line cut off by the kill is dropped
    assert unanswered(prompts, rows) == ["y", "x", "z"]


def test_magpie_prompts_an_interrupted_run_saved_are_kept_and_only_the_rest_sampled(tokenizer, tmp_path):
    from argparse import Namespace

    from sglang_dart.train.generate import _magpie_prompts

    side = tmp_path / "out.jsonl.magpie.jsonl"
    side.write_text('"How do I sort a dict by value?"\n"Name three\n')  # one kept, one cut off by the kill
    replies = _Replies(
        [
            ("how do I sort a dict by value?", "stop"),  # the saved one again: a duplicate
            ("What is a closure in JavaScript?", "stop"),
            ("Plan a three-day trip to Lisbon.", "stop"),
            ("Explain recursion to a child.", "stop"),
        ]
    )
    args = Namespace(magpie=3, concurrency=4, magpie_system=None)
    prompts = _magpie_prompts(replies, tokenizer, args, set(), ["a pool prompt"], side)
    assert prompts == [
        "How do I sort a dict by value?",
        "What is a closure in JavaScript?",
        "Plan a three-day trip to Lisbon.",
    ]
    assert [line.strip('"') for line in side.read_text().splitlines()] == prompts  # saved as they came


def test_generate_refuses_a_tokenizer_without_chat_template_before_serving(tmp_path, capsys):
    from sglang_dart.train.generate import main

    target = tmp_path / "target"
    build_tokenizer(target)
    config = target / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(SystemExit):
        main(["--target", str(target), "--out", str(tmp_path / "out.jsonl"), "--num-prompts", "2"])
    assert "no chat template" in capsys.readouterr().err
    assert not (tmp_path / "generate-server.log").exists()  # refused before any server started


@pytest.mark.parametrize("given", ["draft only", "store only", "not a drafter", "no store file"])
def test_generate_refuses_incomplete_speculation_flags_before_serving(tmp_path, capsys, given):
    from sglang_dart.train.generate import main

    target = tmp_path / "target"
    build_tokenizer(target)
    draft, store = tmp_path / "draft", tmp_path / "answers.store"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    store.write_bytes(b"")
    flags = {
        "draft only": ["--draft", str(draft)],
        "store only": ["--store", str(store)],
        "not a drafter": ["--draft", str(tmp_path), "--store", str(store)],
        "no store file": ["--draft", str(draft), "--store", str(tmp_path / "missing.store")],
    }[given]
    with pytest.raises(SystemExit):
        main(["--target", str(target), "--out", str(tmp_path / "out.jsonl"), "--num-prompts", "2", *flags])
    err = capsys.readouterr().err
    assert "--draft" in err or "--store" in err
    assert not (tmp_path / "generate-server.log").exists()  # refused before any server started


# --- follow-ups: second user turns ---------------------------------------------------------------------


def test_follow_up_prefix_is_the_conversation_then_a_user_turn(tokenizer):
    from sglang_dart.train.magpie import follow_up_prefix

    conversation = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]
    text = tokenizer.decode(follow_up_prefix(tokenizer, conversation))
    assert text == (
        "<|im_start|>user\nName a prime.<|im_end|>\n"
        "<|im_start|>assistant\nSeven.<|im_end|>\n<|im_start|>user\n"
    )


def test_follow_ups_extend_each_conversation_and_retry_the_skipped(tokenizer):
    from sglang_dart.train.magpie import sample_follow_ups

    conversations = [
        [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
        for i in range(3)
    ]
    replies = _Replies(
        [
            ("Can you give an example of that?", "stop"),
            ("can you give an  example of that?", "stop"),  # a duplicate: conversation 1 tries again
            ("Write a haiku about the sea.", "stop"),  # excluded: conversation 2 tries again
            ("Why does that work?", "stop"),
            ("And what about", "length"),  # cut off: conversation 2 once more
            ("Show it in Rust instead.", "stop"),
        ]
    )
    kept, skipped = sample_follow_ups(
        replies, tokenizer, conversations, exclude={"Write a haiku about the sea."}
    )
    assert replies.asked == [3, 2, 1]
    assert [c[-1]["content"] for c in kept] == [
        "Can you give an example of that?",
        "Why does that work?",
        "Show it in Rust instead.",
    ]
    assert [c[:-1] for c in kept] == conversations and all(c[-1]["role"] == "user" for c in kept)
    assert skipped == {"duplicate": 1, "excluded": 1, "overlong": 1}


def test_answered_conversations_keep_the_finished_answers(tokenizer, tmp_path):
    import gzip
    import json

    from sglang_dart.train.generate import answered_conversations

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer = tokenizer("A closure keeps its scope.", add_special_tokens=False)["input_ids"]
    turns = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "z"},
        {"role": "user", "content": "y"},
    ]  # a conversation's row (a follow-up's) records its turns: a third one can follow
    rows = [
        {"prompt": "What is a closure?", "input_ids": [5, 6, *answer, end], "prompt_len": 2},
        {"prompt": "Cut off?", "input_ids": [5, 6, *answer], "prompt_len": 2},  # hit the token budget
        {"prompt": "Empty?", "input_ids": [5, 6, end], "prompt_len": 2},
        {"prompt": "y", "messages": turns, "input_ids": [5, *answer, end], "prompt_len": 1},
    ]
    path = tmp_path / "chunk.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    conversations, skipped = answered_conversations(path, tokenizer, {end})
    reply = {"role": "assistant", "content": "A closure keeps its scope."}
    assert conversations == [[{"role": "user", "content": "What is a closure?"}, reply], [*turns, reply]]
    assert skipped == {"answer cut off": 1, "empty answer": 1}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        answered_conversations(bad, tokenizer, {end})
    with pytest.raises(ValueError, match="not written by generate"):
        (tmp_path / "other.jsonl").write_text('{"text": "hello"}\n')
        answered_conversations(tmp_path / "other.jsonl", tokenizer, {end})


def test_generate_refuses_follow_ups_without_a_finished_answer_before_serving(tmp_path, capsys):
    from sglang_dart.train.generate import main

    target = tmp_path / "target"
    build_tokenizer(target)
    (tmp_path / "cut.jsonl").write_text('{"prompt": "p", "input_ids": [5, 6, 7], "prompt_len": 2}\n')
    out = ["--target", str(target), "--out", str(tmp_path / "out.jsonl"), "--num-prompts", "0"]
    with pytest.raises(SystemExit):
        main([*out, "--follow-ups", str(tmp_path / "cut.jsonl")])
    assert "no finished answer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*out, "--follow-ups", str(tmp_path / "missing.jsonl.gz")])
    assert "--follow-ups" in capsys.readouterr().err
    assert not (tmp_path / "generate-server.log").exists()


def test_stop_ids_include_the_templates_end_of_turn_when_not_marked_special(tmp_path):
    """SmolLM2's tokenizer marks only <|im_start|> and <|endoftext|> special, while its answers end with
    <|im_end|>: the end of an assistant turn comes from the chat template and the model's config."""
    from transformers import AutoTokenizer

    from sglang_dart.train.generate import stop_token_ids

    target = tmp_path / "target"
    build_tokenizer(target)
    real = AutoTokenizer.from_pretrained(target)
    end = real.convert_tokens_to_ids("<|im_end|>")

    class EndNotSpecial:  # the tokenizer as SmolLM2's has it: <|im_end|> a plain token
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *args, **kwargs):
            return real(*args, **kwargs)

        @property
        def all_special_ids(self):
            return [i for i in real.all_special_ids if i != end]

    tokenizer = EndNotSpecial()
    assert end not in tokenizer.all_special_ids
    assert end in stop_token_ids(tokenizer, target)  # from the template alone (no config.json here)
    (target / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
    assert {7, 9, end} <= stop_token_ids(tokenizer, target)


@pytest.mark.parametrize("given", ["nothing listening", "a server flag too"])
def test_generate_refuses_a_server_url_it_cannot_use_before_writing_anything(tmp_path, capsys, given):
    from sglang_dart.server_process import free_port
    from sglang_dart.train.generate import main

    target = tmp_path / "target"
    build_tokenizer(target)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    flags = {"nothing listening": [], "a server flag too": ["--dtype", "float32"]}[given]
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit):
        main(["--target", str(target), "--out", str(out), "--num-prompts", "2", "--server-url", url, *flags])
    err = capsys.readouterr().err
    expected = {
        "nothing listening": f"no SGLang server answers /model_info at {url}",
        "a server flag too": "--dtype",
    }
    assert expected[given] in err, err
    assert not list(tmp_path.glob("out.jsonl*")) and not (tmp_path / "generate-server.log").exists()
