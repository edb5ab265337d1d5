"""Context chains: the Rust per-request n-gram index (`ContextIndex`) against a plain-Python reference, and
the pruner's grafting of a chain onto its trees (shape, order, what is displaced), plus input errors."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_dart.dart.progress import RequestProgress
from sglang_dart.dart.settings import (
    DEFAULT_CONTEXT_NODES,
    DEFAULT_TOPK,
    DartArgsError,
    candidates_per_depth,
    context_nodes,
    resolve_topk,
)
from sglang_dart.pruner import ContextIndex, PrunerConfig, prune_batch
from tests.unit.test_pruner import _assert_invariants, _softmax_rows


def reference_occurrence(seq: list[int]) -> tuple[int, int] | None:
    """The latest earlier occurrence of the longest suffix of 4, 3 or 2 tokens: its length and the position
    just past it."""
    for n in range(min(4, len(seq)), 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return n, start + n
    return None


def reference_chain(seq: list[int], width: int) -> list[int]:
    """What followed that occurrence."""
    found = reference_occurrence(seq)
    return [] if found is None else seq[found[1] : found[1] + width]


def test_index_matches_the_reference_on_random_sequences() -> None:
    rnd = random.Random(7)
    index = ContextIndex()
    for case in range(400):
        vocab = rnd.choice([2, 3, 5, 50])
        seq = [rnd.randrange(vocab) for _ in range(rnd.randint(0, 60))]
        rid = f"r{case}"
        cut = rnd.randint(0, len(seq))
        index.set(rid, seq[:cut])  # a prefill (chunk), then the decode steps' tokens in pieces
        at = cut
        while at < len(seq):
            step = rnd.randint(1, 4)
            index.extend(rid, seq[at : at + step])
            at += step
        width = rnd.randint(1, 9)
        got = index.chains([rid], width)[0].tolist()
        want = reference_chain(seq, width)
        assert got == want + [-1] * (width - len(want)), (seq, width)


def reference_match_len(seq: list[int], cap: int) -> int:
    """How far back that occurrence matches the sequence's end, at most `cap`."""
    found = reference_occurrence(seq)
    if found is None:
        return 0
    matched, end = found
    while matched < min(cap, end) and seq[end - 1 - matched] == seq[-1 - matched]:
        matched += 1
    return min(matched, cap)


def test_match_lens_match_the_reference_on_random_sequences() -> None:
    rnd = random.Random(11)
    index = ContextIndex()
    for case in range(400):
        vocab = rnd.choice([2, 3, 5, 50])
        seq = [rnd.randrange(vocab) for _ in range(rnd.randint(0, 60))]
        if seq and rnd.random() < 0.3:  # a passage copied: its end matches far back
            seq += seq[: rnd.randint(1, len(seq))]
        index.set(f"r{case}", seq)
        cap = rnd.randint(1, 20)
        assert index.match_lens([f"r{case}"], cap) == [reference_match_len(seq, cap)], (seq, cap)
    assert index.match_lens(["unknown"], 8) == [0]


def test_index_set_continues_or_restarts_and_forgets() -> None:
    index = ContextIndex()
    index.set("a", [1, 2, 3, 9, 1, 2])
    index.set("a", [1, 2, 3, 9, 1, 2, 3])  # a later chunk of the same prompt
    assert index.chains(["a"], 3).tolist() == [[9, 1, 2]]
    index.set("a", [4, 5])  # another sequence under the same id
    assert index.tokens("a") == [4, 5]
    assert index.chains(["a", "unknown"], 2).tolist() == [[-1, -1], [-1, -1]]
    index.keep_only([])
    assert len(index) == 0
    with pytest.raises(ValueError, match="outside"):
        index.extend("a", [1 << 24])
    with pytest.raises(ValueError, match="outside"):
        index.set("a", [-1])


def test_a_long_request_keeps_only_its_latest_tokens_indexed() -> None:
    """Host memory per request is bounded: past 16,384 tokens only the latest 8,192 or more stay indexed."""
    index = ContextIndex()
    seq = list(range(20_000))  # nothing repeats
    index.set("a", seq)
    kept = index.tokens("a")
    assert 8192 <= len(kept) < 16384 and kept == seq[-len(kept) :]
    index.extend("a", [5, 6])  # occurred, but before the window
    assert index.chains(["a"], 3).tolist() == [[-1, -1, -1]]
    index.extend("a", kept[:2])  # occurred inside the window
    assert index.chains(["a"], 3).tolist() == [kept[2:5]]
    # the whole sequence again, one token longer: a continuation, not a restart
    index.set("a", seq + [5, 6, *kept[:2], 7])
    assert index.tokens("a")[-3:] == [*kept[:2], 7]
    assert len(index.tokens("a")) == len(kept) + 5


class _Req:
    def __init__(self, rid: str, prompt: list[int]) -> None:
        self.rid, self.origin_input_ids, self.output_ids = rid, prompt, []


def test_progress_keeps_the_index_in_step() -> None:
    progress = RequestProgress(index_context=True)
    a, b = _Req("a", [5, 6, 7, 8, 5, 6]), _Req("b", [1])
    progress.start(a, committed=6, tokens=[5, 6, 7, 8, 5, 6, 7])
    progress.start(b, committed=1, tokens=[1, 2])
    assert progress.context.chains(["a"], 4).tolist() == [[8, 5, 6, 7]]
    progress.advance(a, [8, 5])  # accepted 8, bonus 5: "... 7 8 5" recurs
    assert progress.context.chains(["a"], 2).tolist() == [[6, 7]]
    progress.keep_only([b])
    assert len(progress.context) == 1
    assert RequestProgress().context is None


def _case(seed: int, bs: int = 3, depth: int = 4, k: int = 4) -> dict:
    rng = np.random.default_rng(seed)
    probs = _softmax_rows(rng, (bs, depth, k))
    order = np.argsort(-probs, axis=-1)
    return {
        # distinct ids per row, as a top-k gives them
        "token_ids": np.array(
            [[10 + rng.choice(20, k, replace=False) for _ in range(depth)] for _ in range(bs)], np.int64
        ),
        "probs": np.take_along_axis(probs, order, axis=-1),
        "roots": np.arange(bs, dtype=np.int64),
        "context": np.full((bs, 2), -1, np.int64),
        "eos_ids": [],
        "config": PrunerConfig(topk=k, beam_width=4, num_nodes=7),
    }


def _paths(tokens: np.ndarray, parents: np.ndarray) -> list[tuple[int, ...]]:
    """Each node's tokens from below the root down to it."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + (int(tokens[i]),))
    return paths


@pytest.mark.parametrize("seed", range(40))
def test_grafted_trees_keep_their_size_order_and_nodes(seed: int) -> None:
    c = _case(seed)
    rnd = random.Random(seed)
    plain = prune_batch(**c)
    chains = np.full((3, 6), -1, np.int64)
    for r in range(3):
        own = list(_paths(plain.tokens[r], plain.parents[r])[rnd.randrange(8)])  # a path of the tree...
        own += [rnd.randrange(100, 110) for _ in range(rnd.randint(0, 4))]  # ...then new tokens
        chains[r, : min(6, len(own))] = own[:6]
    for nodes in (0, 1, 3, 6):
        got = prune_batch(**c, chains=chains, chain_nodes=nodes)
        _assert_invariants(*got[:4])
        for r in range(3):
            before = _paths(plain.tokens[r], plain.parents[r])
            after = _paths(got.tokens[r], got.parents[r])
            chain = [int(t) for t in chains[r] if t >= 0]
            matched = max(len(p) for p in before if tuple(chain[: len(p)]) == p)
            grafted = chain[: matched + min(nodes, 7 - matched)]  # 7 nodes below the root to displace
            assert tuple(grafted) in after, (nodes, chain, after)
            new = [p for p in after if p not in before]
            assert len(new) == len(grafted) - matched
            assert all(tuple(grafted[: len(p)]) == p for p in new)  # only the chain is new
            # nothing on the chain's path is displaced
            assert all(p in after for p in before if tuple(chain[: len(p)]) == p)


def test_the_lowest_ranked_nodes_make_room() -> None:
    # One level, children in descending probability: a new chain of two tokens displaces the last two.
    probs = np.array([[[0.4, 0.3, 0.2, 0.1]]], np.float32)
    args = {
        "token_ids": np.array([[[11, 12, 13, 14]]], np.int64),
        "probs": probs,
        "roots": np.array([0], np.int64),
        "config": PrunerConfig(topk=4, beam_width=4, num_nodes=4),
    }
    assert prune_batch(**args).tokens.tolist() == [[0, 11, 12, 13, 14]]
    got = prune_batch(**args, chains=np.array([[99, 98]], np.int64), chain_nodes=2)
    assert got.tokens.tolist() == [[0, 11, 12, 99, 98]]
    assert got.parents.tolist() == [[-1, 0, 0, 0, 3]]
    # a chain already in the tree changes nothing
    same = prune_batch(**args, chains=np.array([[12, -1]], np.int64), chain_nodes=2)
    assert same.tokens.tolist() == [[0, 11, 12, 13, 14]]


def test_bad_chains_are_refused() -> None:
    c = _case(0)
    with pytest.raises(ValueError, match="chains"):
        prune_batch(**c, chains=np.zeros((2, 3), np.int64), chain_nodes=2)  # bs is 3
    with pytest.raises(ValueError, match="chains"):
        prune_batch(**c, chains=np.full((3, 2), 1 << 40, np.int64), chain_nodes=2, vocab_size=100)
    with pytest.raises(ValueError, match="chain_nodes"):
        prune_batch(**c, chains=np.zeros((3, 2), np.int64), chain_nodes=-1)
    with pytest.raises(ValueError, match="2-D"):
        prune_batch(**c, chains=np.zeros(3, np.int64), chain_nodes=1)


def test_chain_nodes_come_from_the_environment_or_the_drafter_config(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"dart_context_nodes": 2}))
    args = SimpleNamespace(speculative_draft_model_path=str(tmp_path))
    monkeypatch.delenv("SGLANG_DART_CONTEXT_NODES", raising=False)
    assert context_nodes(args) == 2
    monkeypatch.setenv("SGLANG_DART_CONTEXT_NODES", "0")  # off
    assert context_nodes(args) == 0
    for bad in ("-1", "four", "2.5"):
        monkeypatch.setenv("SGLANG_DART_CONTEXT_NODES", bad)
        with pytest.raises(DartArgsError, match="SGLANG_DART_CONTEXT_NODES"):
            context_nodes(args)
    monkeypatch.delenv("SGLANG_DART_CONTEXT_NODES")
    for bad_json in ("2.5", "true", '"x"', "-3"):  # never truncated or coerced
        (tmp_path / "config.json").write_text(f'{{"dart_context_nodes": {bad_json}}}')
        with pytest.raises(DartArgsError, match="dart_context_nodes"):
            context_nodes(args)
    (tmp_path / "config.json").write_text("{}")
    assert context_nodes(args) == DEFAULT_CONTEXT_NODES


def test_a_malformed_candidates_per_depth_is_named_not_a_traceback(monkeypatch):
    monkeypatch.setenv("SGLANG_DART_TOPK", "6")
    assert candidates_per_depth() == 6
    for bad in ("six", "2.5", "-1"):
        monkeypatch.setenv("SGLANG_DART_TOPK", bad)
        with pytest.raises(DartArgsError, match="SGLANG_DART_TOPK"):
            candidates_per_depth()


def test_candidates_per_depth_come_from_the_flag_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv("SGLANG_DART_TOPK", raising=False)
    assert resolve_topk(None, 8192) == DEFAULT_TOPK == 16
    assert resolve_topk(None, 10) == 10  # the default is capped at a small draft vocabulary
    assert resolve_topk(4, 8192) == 4  # the flag, as given
    monkeypatch.setenv("SGLANG_DART_TOPK", "6")
    assert resolve_topk(None, 8192) == 6
    assert resolve_topk(1, 8192) == 6  # the flag an earlier process of this server translated
    assert resolve_topk(3, 8192) == 3  # a flag other than 1 wins over the environment
    for given in (0, 11):
        with pytest.raises(DartArgsError, match=r"must be in \[1, 10\]"):
            resolve_topk(given, 10)
    monkeypatch.setenv("SGLANG_DART_TOPK", "12")  # asked for, not capped: refused
    with pytest.raises(DartArgsError, match=r"must be in \[1, 10\]"):
        resolve_topk(None, 10)
