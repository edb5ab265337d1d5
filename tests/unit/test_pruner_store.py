"""The pruner with the real memory-mapped `NgramStore`: parity with the Python reference (which asks the
store for q through its own `next_probs`) and with `DictNgramModel` built from the same documents."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from sglang_dart import _core
from sglang_dart.pruner import DictNgramModel, PrunerConfig, prune_batch
from tests.unit.reference_pruner import RefConfig, reference_prune_batch

pytestmark = pytest.mark.skipif(not hasattr(_core, "NgramStore"), reason="NgramStore binding not built")


class StoreNgram:
    """Reference-side adapter: q from the store's own Python `next_probs`."""

    def __init__(self, store: object) -> None:
        self.store = store

    def prob(self, context: list[int], token: int) -> float:
        return float(self.store.next_probs(np.array(context), np.array([token]))[0])  # type: ignore[attr-defined]


def _store(tmp_path: Path, docs: list[list[int]], vocab: int) -> object:
    b = _core.NgramBuilder(vocab)
    for d in docs:
        b.add_document(np.array(d, np.int64))
    path = tmp_path / "store.dng"
    b.finish(path)
    return _core.NgramStore(path)


def test_store_matches_reference_and_dict_model(tmp_path: Path) -> None:
    rnd = random.Random(7)
    rng = np.random.default_rng(7)
    vocab = 12
    docs = [[rnd.randrange(vocab) for _ in range(rnd.randint(1, 60))] for _ in range(30)]
    store = _store(tmp_path, docs, vocab)
    dict_model = DictNgramModel.from_documents([np.array(d, np.int64) for d in docs], vocab_size=vocab)
    for case in range(300):
        bs, d, k = rnd.randint(1, 3), rnd.randint(1, 5), rnd.randint(1, 6)
        w = rnd.randint(1, 5)
        cfg = PrunerConfig(beam_width=w, num_nodes=0, ngram_at_level0=rnd.random() < 0.3)
        m = rnd.randint(0, min(cfg.candidate_count(d, k), 40))
        cfg = PrunerConfig(beam_width=w, num_nodes=m, ngram_at_level0=cfg.ngram_at_level0)
        token_ids = rng.integers(0, vocab, size=(bs, d, k))
        probs = rng.dirichlet(np.ones(k), size=(bs, d)).astype(np.float32)
        if case % 3 == 0:
            probs[:] = np.float32(1.0)
        roots = rng.integers(0, vocab, size=bs)
        context = rng.integers(-1, vocab, size=(bs, 2))
        eos = [rnd.randrange(vocab)]
        got = prune_batch(token_ids, probs, roots, context, eos, config=cfg, store=store)
        via_dict = prune_batch(token_ids, probs, roots, context, eos, config=cfg, store=dict_model)
        ref_cfg = RefConfig(beam_width=w, num_nodes=m, ngram_at_level0=cfg.ngram_at_level0)
        want = reference_prune_batch(token_ids, probs, roots, context, eos, ref_cfg, StoreNgram(store))
        for g, v, r in zip(got, via_dict, want, strict=True):
            np.testing.assert_array_equal(g, r, err_msg=f"case {case}")
            np.testing.assert_array_equal(g, v, err_msg=f"case {case}")


def test_store_vocab_bounds_token_ids(tmp_path: Path) -> None:
    store = _store(tmp_path, [[1, 2, 3]], 5)
    with pytest.raises(ValueError, match=r"outside \[0, 5\)"):
        prune_batch(
            np.full((1, 1, 2), 7),
            np.full((1, 1, 2), 0.5, np.float32),
            [1],
            None,
            [],
            store=store,
            config=PrunerConfig(num_nodes=2),
        )


def _mappings_of(path: Path) -> int:
    """Distinct memory maps of `path` in this process (one mmap may show as several lines)."""
    inode = path.stat().st_ino
    starts = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[4] == str(inode) and fields[5] == str(path):
            starts.add(fields[0].split("-")[0])
    return len(starts)


def test_the_pruner_reads_the_stores_own_mapping(tmp_path: Path) -> None:
    """One map of the file per store object: the pruner borrows the object's reader instead of mapping
    the file again by path, so it keeps reading the bytes the object opened even after the file on disk
    is replaced (store files are replaced by rename, never rewritten)."""
    store = _store(tmp_path, [[1, 2, 3, 1, 2, 4]], 5)
    path = tmp_path / "store.dng"
    rng = np.random.default_rng(0)
    args = (rng.integers(0, 5, size=(2, 3, 2)), np.full((2, 3, 2), 0.5, np.float32), np.array([1, 2]))
    ctx, cfg = np.array([[-1, 1], [1, 2]]), PrunerConfig(beam_width=2, num_nodes=4)
    before = prune_batch(*args, ctx, [], config=cfg, store=store)
    assert _mappings_of(path) == 1
    replacement = tmp_path / "other.dng"
    b = _core.NgramBuilder(5)
    b.add_document(np.array([4, 4, 4], np.int64))
    b.finish(replacement)
    replacement.replace(path)
    after = prune_batch(*args, ctx, [], config=cfg, store=store)
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)
