"""The training mix: every row of a whole part, N distinct rows of a sampled one, the rows' bytes kept, the
same bytes for the same seed, and a clear error for a glob that matches nothing, a bad count or bad JSON."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from sglang_dart.train.mix import main


def _write(path, rows, gz=False):
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text + "\n")  # a blank line at the end: skipped
    else:
        path.write_text(text)


@pytest.fixture
def files(tmp_path):
    _write(tmp_path / "a-1.jsonl.gz", [{"text": f"a1 {i}"} for i in range(10)], gz=True)
    _write(tmp_path / "a-2.jsonl.gz", [{"text": f"a2 {i}"} for i in range(10)], gz=True)
    _write(tmp_path / "docs.jsonl", [{"messages": [{"role": "user", "content": f"d {i}"}]} for i in range(5)])
    return tmp_path


def _mix(tmp_path, *parts, seed=7, name="out.jsonl"):
    out = tmp_path / name
    main(["--out", str(out), "--seed", str(seed), *parts])
    return out.read_text().splitlines()


def test_whole_and_sampled_parts_shuffled(files):
    rows = _mix(files, str(files / "docs.jsonl"), f"{files}/a-*.jsonl.gz=6")
    docs = [r for r in rows if r.startswith('{"messages"')]
    sampled = [r for r in rows if r.startswith('{"text"')]
    assert len(docs) == 5 and len(sampled) == 6 and len(set(sampled)) == 6
    # the rows' bytes as written, both files of the glob drawn from (one generator, sorted paths)
    compact = {"separators": (",", ":")}
    pool = [json.dumps({"text": f"a{k} {i}"}, **compact) for k in (1, 2) for i in range(10)]
    rng = random.Random(7)
    expected = [
        json.dumps({"messages": [{"role": "user", "content": f"d {i}"}]}, **compact) for i in range(5)
    ]
    expected += rng.sample(pool, 6)
    rng.shuffle(expected)
    assert rows == expected


def test_same_seed_same_bytes_other_seed_other_order(files):
    parts = (f"{files}/a-1.jsonl.gz,{files}/docs.jsonl", f"{files}/a-2.jsonl.gz=4")
    first = _mix(files, *parts, name="1.jsonl")
    assert _mix(files, *parts, name="2.jsonl") == first
    assert _mix(files, *parts, seed=8, name="3.jsonl") != first


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ("missing-*.jsonl", "matches no file"),
        ("{d}/docs.jsonl=0", "positive integer"),
        ("{d}/docs.jsonl=x", "positive integer"),
        ("{d}/docs.jsonl=6", "6 rows asked for, 5 there"),
        ("{d}/bad.jsonl", "bad.jsonl:2: invalid JSON"),
    ],
)
def test_bad_parts_stop_with_a_clear_error(files, capsys, part, message):
    (files / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(SystemExit):
        main(["--out", str(files / "o.jsonl"), part.format(d=files)])
    assert message in capsys.readouterr().err
    assert not (files / "o.jsonl").exists()


def test_undecodable_text_stops_rather_than_being_replaced(files, capsys):
    (files / "latin1.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(SystemExit):
        main(["--out", str(files / "o.jsonl"), str(files / "latin1.jsonl")])
    assert "utf-8" in capsys.readouterr().err and not (files / "o.jsonl").exists()
