"""The benchmark prompt sets: the `long` set is generated the same way every time, within its advertised
size, with the bug its review prompt asks about; every set's user turns reach the exclude file."""

from __future__ import annotations

from pathlib import Path

from benchmarks import bench_prompts, long_prompts


def test_long_prompts_are_the_same_on_every_build():
    assert long_prompts.server_log(2, 70) == long_prompts.server_log(2, 70)
    assert long_prompts.sales_table(4, 90) == long_prompts.sales_table(4, 90)
    assert long_prompts.server_log(1, 40) != long_prompts.server_log(2, 40)
    assert bench_prompts.SETS["long"] == long_prompts.LONG and len(long_prompts.LONG) == 8


def test_long_prompts_paste_a_few_thousand_characters():
    # 700-2,400 SmolLM2 tokens each; about 2.5-4 characters a token in this material
    sizes = [len(prompt) for prompt in long_prompts.LONG]
    assert min(sizes) > 1_800 and max(sizes) < 10_000, sizes


def test_the_module_to_review_holds_one_off_by_one_bug():
    for seed, functions in [(5, 14), (6, 28), (9, 3)]:
        module = long_prompts.python_module(seed, functions)
        assert module.count("values[:len(values) - 1]") == 1, module
        assert module.count("\ndef ") == functions


def test_every_user_turn_reaches_the_exclude_file(tmp_path: Path, monkeypatch):
    out = tmp_path / "bench_prompts.txt"
    monkeypatch.setattr("sys.argv", ["bench_prompts.py", "--exclude-file", str(out)])
    bench_prompts.main()
    lines = out.read_text().splitlines()
    turns = bench_prompts.user_turns()
    assert len(lines) == len(turns) > len(long_prompts.LONG)
    assert {turn.replace("\n", "\\n") for turn in long_prompts.LONG} <= set(lines)
