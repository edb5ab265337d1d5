"""NgramStore / NgramBuilder / import through the Python bindings, against a pure-Python counter."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sglang_dart._core")

from sglang_dart._core import NgramBuilder, NgramFormatError, NgramStore, import_reference_trie  # noqa: E402

try:
    from conftest_ngram import count_windows, random_docs, reference_prob, write_reference_trie
except ImportError:  # pragma: no cover - when tests/unit is a package
    from tests.unit.conftest_ngram import count_windows, random_docs, reference_prob, write_reference_trie

HEADER_LEN = 280


def build(tmp: Path, docs: list[list[int]], vocab: int, name: str = "s.ngs", **kw: object) -> NgramStore:
    b = NgramBuilder(vocab, tmp_dir=str(tmp), **kw)
    for d in docs:
        b.add_document(np.asarray(d, dtype=np.int64))
    b.finish(str(tmp / name))
    return NgramStore(str(tmp / name))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_probabilities_match_python_counter(tmp_path: Path, seed: int) -> None:
    vocab = 40
    docs = random_docs(seed, 120, vocab, 50)
    c = count_windows(docs)
    st = build(tmp_path, docs, vocab, memory_budget=0)  # tiny budget: spills + merge
    st.verify()
    assert st.order == 3 and st.vocab_size == vocab
    assert st.total_tokens == sum(len(d) for d in docs)
    n1, n2, n3 = st.node_counts
    assert (n1, n2, n3) == tuple(sum(1 for k in c if len(k) == n) for n in (1, 2, 3))
    assert st.file_bytes == (tmp_path / "s.ngs").stat().st_size
    for k, v in random.Random(seed).sample(sorted(c.items()), 200):
        assert st.count(list(k)) == v
    toks = np.arange(vocab)
    ctxs, rows, want = [], [], []
    for a in range(0, vocab, 3):
        for b in range(vocab):
            got = st.next_probs([a, b], toks)
            exp = np.array([reference_prob(c, [a, b], t) for t in toks], dtype=np.float32)
            np.testing.assert_array_equal(got, exp)
            ctxs.append([a, b])
            rows.append(toks)
            want.append(exp)
        np.testing.assert_array_equal(
            st.next_probs([a], toks), np.array([reference_prob(c, [a], t) for t in toks], dtype=np.float32)
        )
    np.testing.assert_array_equal(st.batch_next_probs(np.array(ctxs), np.array(rows)), np.array(want))
    # prev2 = -1 → bigram only.
    bb = st.batch_next_probs(np.array([[-1, 5], [7, 5]]), np.array([toks, toks]))
    np.testing.assert_array_equal(bb[0], st.next_probs([5], toks))
    np.testing.assert_array_equal(bb[1], st.next_probs([7, 5], toks))
    # Empty context → zeros. Each probability ≤ 1 (the back-off mix itself may sum past 1: no discounting,
    # exactly like the reference).
    assert not st.next_probs([], toks).any()
    assert (st.next_probs([1, 2], toks) <= 1.0).all()
    top = st.top_next([3, 4], 5)
    probs = st.next_probs([3, 4], toks)
    assert [p for _, p in top] == sorted(probs[probs > 0], reverse=True)[: len(top)]
    for t, p in top:
        assert p == probs[t]


def test_min_count(tmp_path: Path) -> None:
    docs = random_docs(5, 100, 30, 40)
    c = count_windows(docs)
    st = build(tmp_path, docs, 30, min_count=3)
    st.verify()
    assert st.min_count == 3
    for k, v in c.items():
        assert st.count(list(k)) == (v if len(k) == 1 or v >= 3 else 0)
    for a in range(30):
        p = st.next_probs([a, a], np.arange(30))
        assert ((p >= 0) & (p <= 1)).all()


def test_import_equals_direct_build(tmp_path: Path) -> None:
    docs = random_docs(9, 80, 25, 40)
    direct = build(tmp_path, docs, 25, name="direct.ngs")
    n = write_reference_trie(tmp_path / "ref.trie", docs, shuffle_seed=3)
    stats = import_reference_trie(str(tmp_path / "ref.trie"), str(tmp_path / "imp.ngs"), 25, memory_budget=0)
    assert stats["reference_nodes"] == n
    imp = NgramStore(str(tmp_path / "imp.ngs"))
    imp.verify()
    assert imp.imported and not direct.imported
    a = (tmp_path / "direct.ngs").read_bytes()
    b = (tmp_path / "imp.ngs").read_bytes()
    assert a[HEADER_LEN:] == b[HEADER_LEN:]
    assert imp.node_counts == direct.node_counts


def test_bad_files(tmp_path: Path) -> None:
    st = build(tmp_path, random_docs(1, 20, 16, 30), 16)
    good = (tmp_path / "s.ngs").read_bytes()
    del st

    def write(name: str, data: bytes) -> str:
        (tmp_path / name).write_bytes(data)
        return str(tmp_path / name)

    with pytest.raises(NgramFormatError, match="truncated"):
        NgramStore(write("trunc", good[:-3]))
    with pytest.raises(NgramFormatError):
        NgramStore(write("short", good[:50]))
    with pytest.raises(NgramFormatError, match="bad magic"):
        NgramStore(write("foreign", b"\x7fELF" + b"\0" * 400))
    write_reference_trie(tmp_path / "r.trie", [[1, 2, 3]])
    with pytest.raises(NgramFormatError, match="bad magic"):
        NgramStore(str(tmp_path / "r.trie"))
    v = bytearray(good)
    v[8] = 7
    with pytest.raises(NgramFormatError, match="version 7"):
        NgramStore(write("ver", bytes(v)))
    v = bytearray(good)
    v[40] ^= 0x10
    with pytest.raises(NgramFormatError, match="checksum"):
        NgramStore(write("hdr", bytes(v)))
    v = bytearray(good)
    v[-2] ^= 0x01
    bad_body = NgramStore(write("body", bytes(v)))  # opens (O(1) open) ...
    with pytest.raises(NgramFormatError, match="checksum"):
        bad_body.verify()  # ... but verify() catches it
    bad_body.next_probs([1, 2], [1, 2, 3])  # and queries never crash
    with pytest.raises(FileNotFoundError):
        NgramStore(str(tmp_path / "missing.ngs"))
    with pytest.raises(OSError):
        NgramStore(str(tmp_path))
    assert issubclass(NgramFormatError, ValueError)


def test_bad_arguments(tmp_path: Path) -> None:
    st = build(tmp_path, random_docs(2, 20, 16, 30), 16)
    with pytest.raises(ValueError, match="out of range"):
        st.next_probs([1, 2], [16])
    with pytest.raises(ValueError, match="out of range"):
        st.next_probs([-3, 2], [1])
    with pytest.raises(ValueError, match="out of range"):
        st.top_next([99], 3)
    with pytest.raises(ValueError):
        st.batch_next_probs(np.zeros((3, 2), dtype=np.int64), np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(ValueError):
        st.batch_next_probs(np.zeros((3, 3), dtype=np.int64), np.zeros((3, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="1 to 3"):
        st.count([1, 2, 3, 4])
    empty = st.batch_next_probs(np.zeros((0, 2), dtype=np.int64), np.zeros((0, 5), dtype=np.int64))
    assert empty.shape == (0, 5)
    b = NgramBuilder(10, tmp_dir=str(tmp_path))
    with pytest.raises(ValueError, match="out of range"):
        b.add_document([1, 10])
    with pytest.raises(ValueError, match="offsets"):
        b.add_documents([1, 2, 3], [0, 5])
    with pytest.raises(ValueError):
        NgramBuilder(0)
    with pytest.raises(ValueError):
        NgramBuilder(10, min_count=0)
    b.finish(str(tmp_path / "x.ngs"))
    with pytest.raises(ValueError, match="finished"):
        b.finish(str(tmp_path / "y.ngs"))
    write_reference_trie(tmp_path / "r.trie", [[1, 2, 30]])
    with pytest.raises(ValueError, match="vocab"):
        import_reference_trie(str(tmp_path / "r.trie"), str(tmp_path / "z.ngs"), 10)
    data = (tmp_path / "r.trie").read_bytes()
    (tmp_path / "t.trie").write_bytes(data[:-5])
    with pytest.raises(NgramFormatError, match="truncated|end of the file"):
        import_reference_trie(str(tmp_path / "t.trie"), str(tmp_path / "z.ngs"), 40)


def test_add_documents_flat_equals_one_by_one(tmp_path: Path) -> None:
    docs = random_docs(4, 50, 20, 30)
    build(tmp_path, docs, 20, name="a.ngs")
    b = NgramBuilder(20, tmp_dir=str(tmp_path))
    offsets = np.concatenate(([0], np.cumsum([len(d) for d in docs])))
    b.add_documents(np.concatenate([np.asarray(d, dtype=np.int64) for d in docs]), offsets)
    assert b.documents == len(docs)
    b.finish(str(tmp_path / "b.ngs"))
    assert (tmp_path / "a.ngs").read_bytes() == (tmp_path / "b.ngs").read_bytes()
