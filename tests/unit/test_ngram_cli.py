"""CLI round trips (build → info → query, import → equality) and the tokenizer fingerprint."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sglang_dart._core")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from sglang_dart.ngram import NgramStore, tokenizer_fingerprint  # noqa: E402

try:
    from conftest_ngram import (
        count_windows,
        random_text,
        reference_prob,
        run_cli,
        tiny_tokenizer_dir,  # noqa: F401  (fixture)
        train_tokenizer,
        write_reference_trie,
    )
except ImportError:  # pragma: no cover - when tests/unit is a package
    from tests.unit.conftest_ngram import (  # noqa: F401
        count_windows,
        random_text,
        reference_prob,
        run_cli,
        tiny_tokenizer_dir,
        train_tokenizer,
        write_reference_trie,
    )

HEADER_LEN = 280


def make_corpus(root: Path, seed: int = 0) -> list[str]:
    """A folder with plain-text files (one document each) and a JSONL file (one document per line)."""
    rng = random.Random(seed)
    docs: list[str] = []
    (root / "sub").mkdir(parents=True)
    for i in range(3):
        text = random_text(rng, 60)
        (root / "sub" / f"doc{i}.txt").write_text(text)
        docs.append(text)
    lines = [random_text(rng, rng.randrange(1, 40)) for _ in range(20)]
    with open(root / "data.jsonl", "w") as f:
        for t in lines:
            f.write(json.dumps({"text": t, "meta": 1}) + "\n")
        f.write("\n")
        f.write(json.dumps({"no_text": "skipped"}) + "\n")
    # Sorted file order: data.jsonl, then sub/doc*.txt.
    return lines + docs


def encode_docs(tok_dir: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    return [list(ids) + [tok.eos_token_id] for ids in tok(texts, add_special_tokens=True)["input_ids"]]


def test_build_info_query_round_trip(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    texts = make_corpus(tmp_path / "corpus")
    out = tmp_path / "store.ngs"
    p = run_cli(
        "build", "--tokenizer", str(tiny_tokenizer_dir), "--output", str(out), "--memory-budget", "1M", "-q",
        str(tmp_path / "corpus"),
    )  # fmt: skip
    stats = json.loads(p.stdout)
    docs = encode_docs(tiny_tokenizer_dir, texts)
    assert docs[0][0] == 1  # BOS added by add_special_tokens=True
    assert stats["documents"] == len(docs) and stats["tokens"] == sum(map(len, docs))

    info = json.loads(run_cli("info", str(out), "--json", "--verify").stdout)
    c = count_windows(docs)
    assert info["nodes_per_level"] == [sum(1 for k in c if len(k) == n) for n in (1, 2, 3)]
    assert info["file_bytes"] == out.stat().st_size and info["verified"]
    assert "tokens counted" in run_cli("info", str(out)).stdout

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    assert info["tokenizer_fingerprint"] == tokenizer_fingerprint(tok)
    st = NgramStore(str(out))
    assert st.vocab_size == len(tok)
    toks = np.arange(st.vocab_size)
    for d in docs[:5]:
        for i in range(2, len(d)):
            ctx = d[i - 2 : i]
            exp = np.array([reference_prob(c, ctx, t) for t in toks], dtype=np.float32)
            np.testing.assert_array_equal(st.next_probs(ctx, toks), exp)

    q = json.loads(
        run_cli(
            "query", str(out), "--context", "the quick", "--tokenizer", str(tiny_tokenizer_dir), "--json"
        ).stdout
    )
    ctx = tok("the quick", add_special_tokens=False)["input_ids"][-2:]
    assert q["context_ids"] == ctx
    probs = st.next_probs(ctx, toks)
    assert [r["prob"] for r in q["top"]] == [
        round(float(x), 6) for x in sorted(probs[probs > 0], reverse=True)[:10]
    ]
    ids_q = run_cli("query", str(out), "--context", " ".join(map(str, ctx)), "--top", "3")
    assert len([ln for ln in ids_q.stdout.splitlines()[1:] if ln.strip()]) == min(3, int((probs > 0).sum()))


def test_import_cli_equals_direct_build(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    texts = make_corpus(tmp_path / "corpus", seed=1)
    direct = tmp_path / "direct.ngs"
    run_cli(
        "build", "--tokenizer", str(tiny_tokenizer_dir), "-o", str(direct), "-q", str(tmp_path / "corpus")
    )
    docs = encode_docs(tiny_tokenizer_dir, texts)
    write_reference_trie(tmp_path / "ref.trie", docs, shuffle_seed=5)
    imported = tmp_path / "imported.ngs"
    run_cli("import", str(tmp_path / "ref.trie"), "-o", str(imported), "--tokenizer", str(tiny_tokenizer_dir))
    a, b = direct.read_bytes(), imported.read_bytes()
    assert a[HEADER_LEN:] == b[HEADER_LEN:]
    ia = json.loads(run_cli("info", str(direct), "--json").stdout)
    ib = json.loads(run_cli("info", str(imported), "--json").stdout)
    for k in ("nodes_per_level", "vocab_size", "tokenizer_fingerprint", "total_tokens"):
        assert ia[k] == ib[k]
    # --vocab-size alone works too (fingerprint 0 = unknown).
    run_cli(
        "import",
        str(tmp_path / "ref.trie"),
        "-o",
        str(tmp_path / "v.ngs"),
        "--vocab-size",
        str(ia["vocab_size"]),
    )
    assert (tmp_path / "v.ngs").read_bytes()[HEADER_LEN:] == a[HEADER_LEN:]


def test_cli_errors(tmp_path: Path) -> None:
    (tmp_path / "junk.ngs").write_bytes(b"hello world" * 10)
    p = run_cli("info", str(tmp_path / "junk.ngs"), check=False)
    assert p.returncode == 2 and "NgramFormatError" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("info", str(tmp_path / "missing.ngs"), check=False)
    assert p.returncode == 2 and "FileNotFoundError" in p.stderr
    write_reference_trie(tmp_path / "r.trie", [[1, 2, 3, 4]])
    p = run_cli("import", str(tmp_path / "r.trie"), "-o", str(tmp_path / "o.ngs"), check=False)
    assert p.returncode == 2 and "--vocab-size" in p.stderr
    p = run_cli(
        "import", str(tmp_path / "r.trie"), "-o", str(tmp_path / "o.ngs"), "--vocab-size", "3", check=False
    )
    assert p.returncode == 2 and "out of range" in p.stderr


def test_fingerprint_stable_and_discriminating(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    raw = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    fp = tokenizer_fingerprint(fast)
    assert 0 <= fp < 2**64
    assert (
        fp
        == tokenizer_fingerprint(raw)
        == tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)))
    )
    other = train_tokenizer(tmp_path / "other", vocab_size=330, seed=1)
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(other))) != fp
    # Same value in a fresh process (no dependence on hash randomization).
    import subprocess
    import sys

    code = (
        "from transformers import AutoTokenizer; from sglang_dart.ngram import tokenizer_fingerprint; "
        f"print(tokenizer_fingerprint(AutoTokenizer.from_pretrained({str(tiny_tokenizer_dir)!r})))"
    )
    env_path = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PYTHONHASHSEED": "7"},
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip().splitlines()[-1]) == fp
