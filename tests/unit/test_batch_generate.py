"""Batched generation without SGLang (`sglang_dart.train.batch_generate`): a left-padded batch continues each
prompt as the prompt alone would, stops at the first stop token, and answers become generate.py's rows."""

from __future__ import annotations

import json
import time

import pytest
import torch

from sglang_dart.train.batch_generate import answer_rows, continue_batch, main


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_llama_dir)


def _prompts(lengths, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 300, (n,), generator=gen).tolist() for n in lengths]


def test_a_padded_batch_continues_each_prompt_as_it_alone_would(target):
    model, _ = target
    prompts = _prompts((3, 11, 6, 1))
    # no reachable stop token: every continuation runs its full length
    batched = continue_batch(model, prompts, {10**6}, max_new_tokens=12, pad_id=0)
    for prompt, (tokens, stopped) in zip(prompts, batched, strict=True):
        alone, alone_stopped = continue_batch(model, [prompt], {10**6}, max_new_tokens=12, pad_id=0)[0]
        assert tokens == alone and len(tokens) == 12 and not stopped and not alone_stopped


def test_a_continuation_ends_at_its_first_stop_token(target):
    model, _ = target
    prompt = _prompts((5,))[0]
    free, _ = continue_batch(model, [prompt], {10**6}, max_new_tokens=12, pad_id=0)[0]
    stop = free[4]  # a token the greedy continuation reaches: the continuation must end there
    first = free.index(stop)
    tokens, stopped = continue_batch(model, [prompt], {stop}, max_new_tokens=12)[0]
    assert stopped and tokens == free[: first + 1]


def test_answers_are_generate_rows_for_every_prompt(target):
    model, tokenizer = target
    prompts = ["a much longer question about many things at once", "short one", "a middle question"]
    stops = {tokenizer.eos_token_id}
    rows = list(answer_rows(model, tokenizer, prompts, stops, 2, 5, deadline=float("inf")))
    assert sorted(row["prompt"] for row in rows) == sorted(prompts)
    for row in rows:
        head = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=True
        )
        head = head["input_ids"] if hasattr(head, "keys") else head
        assert row["input_ids"][: row["prompt_len"]] == list(head)
        answer = row["input_ids"][row["prompt_len"] :]
        assert len(answer) == 5 or (0 < len(answer) < 5 and answer[-1] in stops)
        assert row["text"] == tokenizer.decode(row["input_ids"])
    assert not list(answer_rows(model, tokenizer, prompts, stops, 2, 5, deadline=time.monotonic()))


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--magpie", "0"], "must be >= 1"),
        (["--magpie", "3", "--batch-size", "0"], "must be >= 1"),
        (["--magpie", "3"], "no tokenizer to load"),  # the target directory is empty
    ],
)
def test_bad_input_is_refused_with_a_reason(tmp_path, capsys, option, message):
    with pytest.raises(SystemExit):
        main(["--target", str(tmp_path), "--out", str(tmp_path / "o.jsonl"), *option])
    assert message in capsys.readouterr().err


def test_a_missing_exclude_file_is_refused_with_its_name(tiny_llama_dir, tmp_path, capsys):
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(SystemExit):
        main(["--target", str(tiny_llama_dir), "--out", str(tmp_path / "o.jsonl"), "--magpie", "2"]
             + ["--exclude-file", str(missing), "--device", "cpu"])  # fmt: skip
    assert str(missing) in capsys.readouterr().err


def test_a_second_run_answers_what_the_first_sampled_and_left(tiny_llama_dir, tmp_path):
    out = tmp_path / "gen.jsonl"
    side = tmp_path / "gen.jsonl.magpie.jsonl"
    first, second = "what is the first saved question", "what is the second saved question"
    # the first run sampled two prompts and answered one before it was stopped mid-line
    side.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n" + '"what is a cut')
    out.write_text(json.dumps({"prompt": first, "input_ids": [1, 2], "prompt_len": 1, "text": "x"}) + "\n")
    options = ["--device", "cpu", "--batch-size", "2", "--max-new-tokens", "3"]
    main(["--target", str(tiny_llama_dir), "--out", str(out), "--magpie", "1", *options])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["prompt"] for row in rows] == [first, second]  # no new sample: --magpie 1 is met
    assert not side.exists()  # every prompt it held is answered


def test_a_target_whose_turns_all_fail_the_screen_stops_sampling(target, monkeypatch):
    import sglang_dart.train.batch_generate as batch_generate

    model, tokenizer = target
    calls = []

    def never_stopping(model, prompts, *args, **kwargs):  # every sampled turn runs past its budget
        calls.append(len(prompts))
        return [([5, 6, 7], False)] * len(prompts)

    monkeypatch.setattr(batch_generate, "continue_batch", never_stopping)
    kept, skipped = batch_generate.sample_prompts(model, tokenizer, 5, {0}, set(), 2, deadline=float("inf"))
    assert kept == [] and skipped["overlong"] == 2 * batch_generate.BARREN_BATCHES
    assert calls == [2] * batch_generate.BARREN_BATCHES
