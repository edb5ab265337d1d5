"""The Rust batched pruner against the plain-Python reference on thousands of generated cases (ties,
p = 1.0, EOS among the candidates, with and without an n-gram model), plus invariants and input errors."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sglang_dart.pruner import DictNgramModel, PrunerConfig, prune_batch
from tests.unit.reference_pruner import RefConfig, RefNgram, reference_prune_batch


def _softmax_rows(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.normal(size=shape) * rng.uniform(0.5, 4.0)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def _probs(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    if kind == "softmax":
        return _softmax_rows(rng, shape)
    if kind == "ties":  # few distinct values, many exact ties
        vals = np.array([1.0, 0.5, 0.25, 0.125, 0.0], np.float32)
        return vals[rng.integers(0, len(vals), size=shape)]
    if kind == "ones":  # p = 1.0 everywhere: all draft increments are 0
        return np.ones(shape, np.float32)
    # one-hot-ish rows: first column 1.0, rest 0
    p = np.zeros(shape, np.float32)
    p[..., 0] = 1.0
    return p


def _assert_invariants(tokens: np.ndarray, parents: np.ndarray, depth: np.ndarray, mask: np.ndarray) -> None:
    bs, n = tokens.shape
    assert parents.shape == depth.shape == (bs, n) and mask.shape == (bs, n, n)
    assert tokens.dtype == np.int64 and parents.dtype == np.int32 and depth.dtype == np.int32
    assert mask.dtype == np.bool_
    for r in range(bs):
        assert parents[r, 0] == -1 and depth[r, 0] == 0
        for i in range(1, n):
            p = parents[r, i]
            assert 0 <= p < i
            assert depth[r, i] == depth[r, p] + 1
            assert depth[r, i] >= depth[r, i - 1]
        expect = np.zeros((n, n), bool)
        for i in range(n):
            j = i
            while j != -1:
                expect[i, j] = True
                j = parents[r, j]
        np.testing.assert_array_equal(mask[r], expect)


def _random_case(rnd: random.Random, rng: np.random.Generator, with_model: bool) -> dict:
    vocab = rnd.choice([4, 8, 16, 64])
    bs = rnd.randint(0, 4) if rnd.random() < 0.1 else rnd.randint(1, 4)
    d = rnd.randint(1, 6)
    k = rnd.randint(1, 7)
    topk = rnd.choice([None, None, rnd.randint(1, k)])
    w = rnd.randint(1, 6)
    cfg = PrunerConfig(
        topk=topk,
        beam_width=w,
        num_nodes=0,
        ngram_weight=rnd.choice([0.5, 0.5, 0.0, 1.3]),
        level_weight_exponent=rnd.choice([0.7, 0.7, 0.0, 1.5]),
        logit_weight_base=rnd.choice([0.9, 0.9, 1.0, 0.5]),
        eps=rnd.choice([1e-10, 1e-10, 1e-3, 0.5]),
        ngram_at_level0=rnd.random() < 0.3,
        level_weights=tuple(rnd.choice([0.0, 0.3, 1.0]) for _ in range(d)) if rnd.random() < 0.1 else None,
        logit_weights=tuple(rnd.choice([0.0, 0.7, 1.0]) for _ in range(d)) if rnd.random() < 0.1 else None,
    )
    cands = cfg.candidate_count(d, k)
    m = rnd.choice([0, 1, cands, rnd.randint(0, cands), rnd.randint(0, min(cands, 60))])
    cfg = PrunerConfig(**{**cfg.__dict__, "num_nodes": m})
    token_ids = rng.integers(0, vocab, size=(bs, d, k)).astype(rnd.choice([np.int64, np.int32]))
    kind = rnd.choice(["softmax", "softmax", "ties", "ones", "onehot"])
    probs = _probs(rng, (bs, d, k), kind)
    roots = rng.integers(0, vocab, size=bs).astype(np.int64)
    context = rng.integers(-1, vocab, size=(bs, 2)).astype(np.int64)
    eos = rnd.sample(range(vocab), rnd.randint(0, min(3, vocab)))
    counts = None
    if with_model:
        docs = [[rnd.randrange(vocab) for _ in range(rnd.randint(1, 40))] for _ in range(rnd.randint(1, 8))]
        counts = RefNgram.count_documents(docs)
    return dict(
        cfg=cfg,
        token_ids=token_ids,
        probs=probs,
        roots=roots,
        context=context,
        eos=eos,
        counts=counts,
        vocab=vocab,
    )


def _ref_cfg(cfg: PrunerConfig) -> RefConfig:
    return RefConfig(
        topk=cfg.topk,
        beam_width=cfg.beam_width,
        num_nodes=cfg.num_nodes,
        ngram_weight=cfg.ngram_weight,
        level_weight_exponent=cfg.level_weight_exponent,
        logit_weight_base=cfg.logit_weight_base,
        eps=cfg.eps,
        ngram_at_level0=cfg.ngram_at_level0,
        level_weights=list(cfg.level_weights) if cfg.level_weights else None,
        logit_weights=list(cfg.logit_weights) if cfg.logit_weights else None,
    )


@pytest.mark.parametrize("with_model", [False, True])
def test_matches_reference_on_random_cases(with_model: bool) -> None:
    rnd = random.Random(1234 + with_model)
    rng = np.random.default_rng(99 + with_model)
    cases = 3000
    for case in range(cases):
        c = _random_case(rnd, rng, with_model)
        store = DictNgramModel(c["counts"], vocab_size=c["vocab"]) if with_model else None
        got = prune_batch(
            c["token_ids"], c["probs"], c["roots"], c["context"], c["eos"], config=c["cfg"], store=store
        )
        model = RefNgram(c["counts"]) if with_model else None
        want = reference_prune_batch(
            c["token_ids"].astype(np.int64),
            c["probs"],
            c["roots"],
            c["context"],
            c["eos"],
            _ref_cfg(c["cfg"]),
            model,
        )
        for name, g, w in zip(("tokens", "parents", "depth", "tree_mask"), got, want, strict=True):
            assert g.shape == w.shape, (case, name)
            if not np.array_equal(g, w):
                pytest.fail(
                    f"case {case} ({name}) differs: cfg={c['cfg']} eos={c['eos']}\n"
                    f"tokens={c['token_ids'].tolist()}\nprobs={c['probs'].tolist()}\n"
                    f"got={g.tolist()}\nwant={w.tolist()}"
                )
        _assert_invariants(*got)


def test_reference_defaults_shape_and_invariants() -> None:
    rng = np.random.default_rng(0)
    bs, d, k, vocab = 8, 8, 25, 1000
    token_ids = rng.integers(0, vocab, size=(bs, d, k))
    probs = _softmax_rows(rng, (bs, d, k))
    roots = rng.integers(0, vocab, size=bs)
    context = rng.integers(0, vocab, size=(bs, 2))
    docs = [rng.integers(0, vocab, size=5000).tolist()]
    store = DictNgramModel.from_documents([np.asarray(x, np.int64) for x in docs], vocab_size=vocab)
    got = prune_batch(token_ids, probs, roots, context, [2], store=store)
    assert got.tokens.shape == (bs, 61) and got.tree_mask.shape == (bs, 61, 61)
    np.testing.assert_array_equal(got.tokens[:, 0], roots)
    _assert_invariants(*got)
    want = reference_prune_batch(
        token_ids, probs, roots, context, [2], RefConfig(), RefNgram(RefNgram.count_documents(docs))
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_all_ties_are_prefix_closed_and_deterministic() -> None:
    # p = 1.0 and q = 1.0 everywhere: every score is 0; the order falls back to (depth, creation).
    bs, d, k = 2, 4, 5
    token_ids = np.tile(np.arange(k), (bs, d, 1))
    probs = np.ones((bs, d, k), np.float32)
    counts = {(t,): 10 for t in range(k)}
    counts.update({(a, b): 10 for a in range(k) for b in range(k)})
    counts.update({(a, b, c): 10 for a in range(k) for b in range(k) for c in range(k)})
    store = DictNgramModel(counts)
    cfg = PrunerConfig(beam_width=3, num_nodes=12)
    got = prune_batch(
        token_ids, probs, np.zeros(bs, np.int64), np.zeros((bs, 2), np.int64), [], config=cfg, store=store
    )
    _assert_invariants(*got)
    # 5 children of the root, then the 15 depth-2 children of the first 3 (in creation order): 7 of them.
    assert got.depth[0].tolist() == [0] + [1] * 5 + [2] * 7
    assert got.parents[0].tolist() == [-1] + [0] * 5 + [1] * 5 + [2] * 2
    again = prune_batch(
        token_ids, probs, np.zeros(bs, np.int64), np.zeros((bs, 2), np.int64), [], config=cfg, store=store
    )
    for a, b in zip(got, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_eos_children_are_leaves_unless_needed() -> None:
    # Level 0: token 7 (EOS) has the best probability but is not extended while non-EOS children remain.
    token_ids = np.array([[[7, 1, 2], [3, 4, 5]]])
    probs = np.array([[[0.8, 0.15, 0.05], [0.5, 0.3, 0.2]]], np.float32)
    got = prune_batch(token_ids, probs, [0], None, [7], config=PrunerConfig(beam_width=1, num_nodes=4))
    # Scores: 7: ln .8, 1: ln .15, then 1's children 3, 4 (ln .15 + λ1·α1·ln .5 / ln .3) beat 2 (ln .05).
    assert got.tokens[0].tolist() == [0, 7, 1, 3, 4]
    assert got.parents[0].tolist() == [-1, 0, 0, 2, 2]
    # Only EOS children at level 0: the beam takes them anyway.
    token_ids = np.array([[[7, 7], [3, 4]]])
    probs = np.array([[[0.6, 0.4], [0.9, 0.1]]], np.float32)
    got = prune_batch(token_ids, probs, [0], None, [7], config=PrunerConfig(beam_width=1, num_nodes=3))
    assert got.parents[0].tolist() == [-1, 0, 0, 1]


def test_empty_batch() -> None:
    got = prune_batch(np.zeros((0, 3, 25), np.int64), np.zeros((0, 3, 25), np.float32), np.zeros(0), None, [])
    assert got.tokens.shape == (0, 61) and got.tree_mask.shape == (0, 61, 61)


def _valid() -> dict:
    rng = np.random.default_rng(5)
    return dict(
        token_ids=rng.integers(0, 100, size=(2, 3, 25)),
        probs=_softmax_rows(rng, (2, 3, 25)),
        roots=np.array([1, 2]),
        context=np.array([[-1, 3], [4, 5]]),
        eos_ids=[2],
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a["probs"].__setitem__((0, 1, 2), np.nan), r"probs\[0, 1, 2\] = NaN"),
        (lambda a: a["probs"].__setitem__((1, 0, 0), 1.5), "not a probability"),
        (lambda a: a["probs"].__setitem__((1, 0, 0), -0.1), "not a probability"),
        (lambda a: a["token_ids"].__setitem__((1, 2, 3), -4), r"token_ids\[1, 2, 3\] = -4"),
        (lambda a: a["token_ids"].__setitem__((0, 0, 0), 100), r"outside \[0, 100\)"),
        (lambda a: a.__setitem__("roots", np.array([1, 200])), r"roots\[1\] = 200"),
        (lambda a: a.__setitem__("roots", np.array([1])), "roots shape"),
        (lambda a: a.__setitem__("context", np.array([[1, -2], [0, 0]])), "neither -1"),
        (lambda a: a.__setitem__("context", np.array([1, 2])), "context"),
        (lambda a: a.__setitem__("probs", a["probs"][:, :2]), "shape"),
        (lambda a: a.__setitem__("eos_ids", [-3]), "eos id -3"),
    ],
)
def test_invalid_inputs_raise_value_error(change, message: str) -> None:  # type: ignore[no-untyped-def]
    a = _valid()
    change(a)
    with pytest.raises(ValueError, match=message):
        prune_batch(a["token_ids"], a["probs"], a["roots"], a["context"], a["eos_ids"], vocab_size=100)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (PrunerConfig(beam_width=0), "beam_width"),
        (PrunerConfig(topk=30), "topk = 30 exceeds"),
        (PrunerConfig(eps=0.0), "eps"),
        (PrunerConfig(ngram_weight=-1.0), "ngram_weight"),
        (PrunerConfig(ngram_weight=float("nan")), "ngram_weight"),
        (PrunerConfig(level_weights=(1.0, 1.0)), "level_weights has 2 entries"),
        (PrunerConfig(logit_weights=(1.0, -1.0, 1.0)), r"logit_weights\[1\]"),
    ],
)
def test_invalid_config_raises_value_error(cfg: PrunerConfig, message: str) -> None:
    a = _valid()
    with pytest.raises(ValueError, match=message):
        prune_batch(a["token_ids"], a["probs"], a["roots"], a["context"], a["eos_ids"], config=cfg)


def test_too_few_candidates_raise_value_error() -> None:
    a = _valid()
    # D = 3, k = 25, W = 20: 25 + 2 * 20 * 25 = 1025 candidates; D = 1: 25.
    assert PrunerConfig().candidate_count(3, 25) == 1025
    prune_batch(
        a["token_ids"],
        a["probs"],
        a["roots"],
        a["context"],
        a["eos_ids"],
        config=PrunerConfig(num_nodes=1025),
    )
    with pytest.raises(ValueError, match="num_nodes = 26 exceeds the 25 candidates"):
        prune_batch(
            a["token_ids"][:, :1],
            a["probs"][:, :1],
            a["roots"],
            a["context"],
            a["eos_ids"],
            config=PrunerConfig(num_nodes=26),
        )


def test_store_type_is_checked() -> None:
    a = _valid()
    with pytest.raises(TypeError, match="store must be"):
        prune_batch(a["token_ids"], a["probs"], a["roots"], a["context"], a["eos_ids"], store=object())


def test_dict_model_semantics() -> None:
    m = DictNgramModel.from_documents([np.array([1, 2, 3, 1, 2, 4])])
    assert m.next_probs(1, 2, [3, 4, 5]) == [0.5, 0.5, 0.0]
    assert m.next_probs(None, 4, [1]) == [0.0]
    ref = RefNgram(RefNgram.count_documents([[1, 2, 3, 1, 2, 4]]))
    assert [ref.prob([1, 2], t) for t in (3, 4, 5)] == [0.5, 0.5, 0.0]
    with pytest.raises(ValueError, match="prefix"):
        DictNgramModel({(1, 2): 3})
