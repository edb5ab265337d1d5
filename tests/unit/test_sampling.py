"""Tree-node sampling helpers: node paths, custom logit processors run per node, seeded draws."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import numpy as np
import pytest
import sglang.srt.layers.sampler as sglang_sampler
import torch
from sglang.srt.sampling.sampling_params import TOP_K_ALL

from sglang_dart.dart import sampling as dart_sampling
from sglang_dart.dart.sampling import (
    apply_custom_processors,
    needs_pinning,
    node_paths,
    pin_logits_to_samples,
    sample_tree_nodes,
)

# One request's tree: root 0; nodes 1 and 2 children of the root; node 3 a child of 1 (ancestors first).
TREE = np.array(
    [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ],
    dtype=bool,
)
VOCAB = 16


class BanHistory:
    """Bans every token the request has produced so far, as a history-reading processor would."""

    def __call__(self, logits: torch.Tensor, params: list[dict]) -> torch.Tensor:
        assert len(params) == logits.shape[0]  # one parameter set per row it is given
        for row, p in enumerate(params):
            req = p["__req__"]
            history = req.origin_input_ids + req.output_ids  # as SGLang's no-repeat processor reads it
            logits[row, list(history)] = float("-inf")
        return logits


def _batch(reqs: list, chosen: list[bool], greedy: bool = True) -> SimpleNamespace:
    bs = len(reqs)
    return SimpleNamespace(
        is_all_greedy=greedy,
        has_custom_logit_processor=True,
        custom_logit_processor={"ban": (BanHistory(), torch.tensor(chosen))},
        custom_params=[{"__req__": r} for r in reqs],
        acc_additive_penalties=None,
        acc_scaling_penalties=None,
        logit_bias=None,
        top_ks=torch.ones(bs, dtype=torch.int32),
        top_ps=torch.ones(bs),
        min_ps=torch.zeros(bs),
        need_min_p_sampling=False,
        temperatures=torch.ones(bs, 1),
        sampling_seed=None,  # set under --enable-deterministic-inference only
    )


def test_node_paths_follow_the_ancestors():
    tokens = np.array([[10, 11, 12, 13]])
    assert node_paths(TREE[None], tokens) == [[[], [11], [12], [11, 13]]]


def test_each_node_row_sees_its_own_path_as_history():
    # SGLang keeps output ids in an array("q"), which processors concatenate with the prompt's
    reqs = [
        SimpleNamespace(origin_input_ids=array("q", [15]), output_ids=array("q", [5]), rid="a"),
        SimpleNamespace(origin_input_ids=[15], output_ids=[6], rid="b"),
    ]
    tokens = np.array([[5, 1, 2, 3], [6, 7, 8, 9]])
    paths = node_paths(np.stack([TREE, TREE]), tokens)
    logits = torch.zeros(8, VOCAB)
    apply_custom_processors(_batch(reqs, [True, False]), logits, paths)
    banned = [set(torch.nonzero(torch.isinf(row)).flatten().tolist()) for row in logits]
    assert banned[:4] == [{15, 5}, {15, 5, 1}, {15, 5, 2}, {15, 5, 1, 3}]
    assert banned[4:] == [set()] * 4  # the request without the processor is untouched
    assert list(reqs[0].output_ids) == [5] and reqs[0].rid == "a"  # the request itself is not changed


def test_greedy_samples_respect_the_processor_at_every_node():
    reqs = [SimpleNamespace(origin_input_ids=[], output_ids=[0])]
    tokens = np.array([[0, 1, 2, 3]])
    logits = torch.zeros(4, VOCAB)
    logits[:, 1] = 3.0  # the unprocessed argmax everywhere
    logits[:, 2] = 2.0
    batch = _batch(reqs, [True])
    assert needs_pinning(batch)
    samples = sample_tree_nodes(batch, logits, 4, node_paths(TREE[None], tokens))
    # Node 1's and node 3's paths contain token 1, so their best allowed token is 2.
    assert samples.tolist() == [1, 2, 1, 2]


def test_greedy_rows_of_a_mixed_batch_take_the_first_maximal_token():
    """A batch mixing greedy and sampled requests: greedy rows take torch.argmax's index (the first of tied
    maxima), whatever the faster reduction computes it with."""
    reqs = [SimpleNamespace(origin_input_ids=[], output_ids=[]) for _ in range(2)]
    batch = _batch(reqs, [False, False], greedy=False)
    batch.has_custom_logit_processor = False
    batch.top_ks = torch.tensor([1, TOP_K_ALL], dtype=torch.int32)  # request 0 greedy, request 1 sampled
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (8, VOCAB), generator=generator).float()  # many ties
    logits[2, 5] = 9.0
    logits[3] = float("-inf")
    samples = sample_tree_nodes(batch, logits, 4)
    expected = logits[:4].argmax(dim=-1)
    expected[3] = 0  # an all -inf row is given finite logits first
    assert samples[:4].tolist() == expected.tolist()
    assert samples[:4].tolist()[2] == 5


# --- seeded sampling (--enable-deterministic-inference) ------------------------------------------------

DEPTHS = [0, 1, 1, 2]  # of TREE's nodes


def _stand_in_hash(seed: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """A 32-bit mix of (seed, position, column), [rows, columns], in plain torch integer ops."""
    h = seed.to(torch.int64).view(-1, 1) * 0x9E3779B1
    h = (
        h + positions.to(torch.int64).view(-1, 1) * 0x85EBCA77 + columns.view(1, -1) * 0xC2B2AE3D
    ) & 0xFFFFFFFF
    for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = ((h ^ (h >> shift)) * multiplier) & 0xFFFFFFFF
    return h ^ (h >> 16)


@pytest.fixture
def seeded_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's seeded draw (`multinomial_with_seed`, Gumbel noise keyed by seed, position and column)
    hashes with a Triton kernel, which needs a GPU. A torch hash stands in for that kernel only: both DART
    and the plain reference below call SGLang's own sampling functions, so what is tested is the key
    (seed, position) and the branch DART draws each node with. torch.compile is switched off so that the
    draw runs eagerly on CPU."""
    monkeypatch.setattr(sglang_sampler, "murmur_hash32", _stand_in_hash)
    monkeypatch.setattr(torch._dynamo.config, "disable", True)


def _target_logits(sequence: list[int]) -> torch.Tensor:
    """A deterministic toy target: logits for the token after `sequence`."""
    key = 17
    for token in sequence:
        key = (key * 1_000_003 + token + 1) % (1 << 31)
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(key)) * 2.0


def _seeded_batch(seeds: list[int], top_k: int = TOP_K_ALL, top_p: float = 1.0, min_p: float = 0.0):
    bs = len(seeds)
    top_ks = torch.full((bs,), top_k, dtype=torch.int32)
    top_ps = torch.full((bs,), top_p)
    min_ps = torch.full((bs,), min_p)
    return SimpleNamespace(
        is_all_greedy=False,
        has_custom_logit_processor=False,
        acc_additive_penalties=None,
        acc_scaling_penalties=None,
        logit_bias=None,
        top_ks=top_ks,
        top_ps=top_ps,
        min_ps=min_ps,
        temperatures=torch.full((bs, 1), 0.8),
        sampling_seed=torch.tensor(seeds, dtype=torch.int64),
        # as SamplingBatchInfo derives them; they pick the branch SGLang's sampler takes for the batch
        need_top_k_sampling=bool((top_ks != TOP_K_ALL).any()),
        need_top_p_sampling=bool((top_ps != 1.0).any()),
        need_min_p_sampling=bool((min_ps > 0).any()),
    )


def _plain_seeded_decode(
    info: SimpleNamespace, row: int, sequence: list[int], steps: int, rl_on_policy: bool = False
) -> list[int]:
    """What SGLang's sampler emits for one request decoding alone: each step one draw from the target at
    the true prefix, keyed by the request's seed and the input token's position (len - 1), through the
    branch `Sampler.forward` takes."""
    sequence = list(sequence)
    one = slice(row, row + 1)
    simple = not (info.need_top_k_sampling or info.need_top_p_sampling or info.need_min_p_sampling)
    for _ in range(steps):
        logits = _target_logits(sequence).view(1, -1)
        position = torch.tensor([len(sequence) - 1])
        if simple and rl_on_policy:
            logprobs = torch.log_softmax(logits.bfloat16().div(info.temperatures[one]).bfloat16(), dim=-1)
            request = SimpleNamespace(sampling_seed=info.sampling_seed[one])
            token = sglang_sampler.Sampler._sample_from_logprobs(None, logprobs, request, position)
        elif simple:
            probs = torch.softmax(logits / info.temperatures[one], dim=-1)
            token = sglang_sampler.sampling_from_probs_torch(probs, info.sampling_seed[one], position)
        else:
            probs = torch.softmax(logits / info.temperatures[one], dim=-1)
            token = sglang_sampler.top_k_top_p_min_p_sampling_from_probs_torch(
                probs,
                info.top_ks[one],
                info.top_ps[one],
                info.min_ps[one],
                False,
                info.sampling_seed[one],
                position,
            )
        sequence.append(int(token))
    return sequence[-steps:]


def _tree_rows(prefixes: list[list[int]], drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits and positions of TREE's nodes for each request: node tokens [root, d1, d2, d3]
    (node 3 under node 1), the root being the prefix's last token."""
    logits, positions = [], []
    for prefix, (d1, d2, d3) in zip(prefixes, drafts, strict=True):
        for path in ([], [d1], [d2], [d1, d3]):
            logits.append(_target_logits(prefix + path))
        positions += [len(prefix) - 1 + depth for depth in DEPTHS]
    return torch.stack(logits), torch.tensor(positions)


PREFIXES = [[3, 1, 4], [1, 5, 9, 2, 6], [5, 3], [5, 8, 9, 7]]
SEEDS = [11, 12, 2**40 + 3, 11]  # two requests share a seed: their keys differ by position


@pytest.mark.parametrize(
    ("truncation", "rl_on_policy"),
    [({}, False), ({"top_k": 8, "top_p": 0.9}, False), ({}, True), ({"top_p": 0.9}, True)],
    ids=["multinomial", "top-k-top-p", "rl-on-policy", "rl-on-policy-top-p"],
)
def test_seeded_tree_walk_emits_what_plain_seeded_decoding_emits(
    seeded_draws: None, truncation: dict, rl_on_policy: bool
):
    info = _seeded_batch(SEEDS, **truncation)
    plain = [_plain_seeded_decode(info, b, prefix, 3, rl_on_policy) for b, prefix in enumerate(PREFIXES)]
    # Node 1 and node 3 are plain's first two tokens, node 2 a token plain does not emit first.
    drafts = [(p[0], (p[0] + 1) % VOCAB, p[1]) for p in plain]
    logits, positions = _tree_rows(PREFIXES, drafts)
    samples = sample_tree_nodes(info, logits, 4, positions=positions, rl_on_policy=rl_on_policy)
    samples = samples.view(len(PREFIXES), 4)
    # The walk: the root's draw picks node 1, node 1's picks node 3, node 3's is the bonus token.
    assert [[row[0], row[1], row[3]] for row in samples.tolist()] == plain


def test_rl_on_policy_draws_from_the_bf16_log_softmax(seeded_draws: None):
    # Logits closer than bf16 resolves: a float32 softmax would draw some of these rows differently.
    draws = 2000
    logits = (1.0 + 0.003 * torch.arange(VOCAB, dtype=torch.float32)).repeat(draws, 1)
    info = _seeded_batch(list(range(draws)))
    info.temperatures = torch.full((draws, 1), 0.7)
    positions = torch.full((draws,), 5)
    samples = sample_tree_nodes(info, logits, 1, positions=positions, rl_on_policy=True)
    logprobs = torch.log_softmax(logits.bfloat16().div(info.temperatures).bfloat16(), dim=-1)
    expected = sglang_sampler.Sampler._sample_from_logprobs(None, logprobs, info, positions)
    assert samples.tolist() == expected.tolist()


def test_seeded_pinning_makes_the_argmax_walk_take_the_seeded_draws(seeded_draws: None):
    info = _seeded_batch(SEEDS, top_k=8)
    plain = [_plain_seeded_decode(info, b, prefix, 3) for b, prefix in enumerate(PREFIXES)]
    logits, positions = _tree_rows(PREFIXES, [(p[0], (p[0] + 1) % VOCAB, p[1]) for p in plain])
    pin_logits_to_samples(info, logits, 4, positions=positions)
    choices = logits.argmax(dim=-1).view(len(PREFIXES), 4)
    assert [[row[0], row[1], row[3]] for row in choices.tolist()] == plain


def test_a_request_draws_the_same_whatever_the_batch_beside_it(seeded_draws: None):
    logits, positions = _tree_rows(PREFIXES, [(1, 2, 3)] * len(PREFIXES))
    together = sample_tree_nodes(_seeded_batch(SEEDS, top_p=0.95), logits, 4, positions=positions)
    for b in range(len(PREFIXES)):
        rows = slice(4 * b, 4 * b + 4)
        alone = sample_tree_nodes(
            _seeded_batch(SEEDS[b : b + 1], top_p=0.95), logits[rows], 4, positions=positions[rows]
        )
        assert alone.tolist() == together[rows].tolist()


def test_seeded_min_p_keeps_the_min_p_distribution(seeded_draws: None):
    # SGLang's own seeded sampler refuses min-p; DART filters first, then draws as with top-k/top-p.
    draws = 4000
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0] + [-3.0] * (VOCAB - 6))
    info = _seeded_batch(list(range(draws)), min_p=0.2)
    info.temperatures = torch.ones(draws, 1)
    samples = sample_tree_nodes(info, logits.repeat(draws, 1), 1, positions=torch.full((draws,), 7))
    probs = torch.softmax(logits, dim=-1)
    kept = torch.where(probs >= probs.max() * 0.2, probs, torch.zeros_like(probs))
    expected = kept / kept.sum()
    frequencies = torch.bincount(samples, minlength=VOCAB).double() / draws
    assert frequencies[kept == 0].sum() == 0  # nothing below min_p x the top probability
    # 4 standard deviations of a frequency near 1/2 over 4000 draws
    assert torch.allclose(frequencies, expected.double(), atol=0.032)


def test_seeded_sampling_without_positions_is_an_error(seeded_draws: None):
    with pytest.raises(ValueError, match="position"):
        sample_tree_nodes(_seeded_batch([1]), torch.zeros(4, VOCAB), 4)


# --- memory: rows are drawn in blocks ------------------------------------------------------------------


def _rows_per_block(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    monkeypatch.setattr(dart_sampling, "DRAW_BLOCK_BYTES", rows * VOCAB * dart_sampling.DRAW_BYTES_PER_ENTRY)


@pytest.mark.parametrize(
    ("truncation", "rl_on_policy"),
    [({}, False), ({"top_k": 8, "top_p": 0.9}, False), ({"min_p": 0.1}, False), ({}, True)],
    ids=["multinomial", "top-k-top-p", "min-p", "rl-on-policy"],
)
def test_seeded_draws_in_blocks_are_the_same_draws(
    seeded_draws: None, monkeypatch: pytest.MonkeyPatch, truncation: dict, rl_on_policy: bool
):
    logits, positions = _tree_rows(PREFIXES, [(1, 2, 3)] * len(PREFIXES))
    info = _seeded_batch(SEEDS, **truncation)
    whole = sample_tree_nodes(info, logits, 4, positions=positions, rl_on_policy=rl_on_policy)
    _rows_per_block(monkeypatch, 3)  # 16 rows: blocks of 3, the last of 1
    assert dart_sampling.draw_block_rows(VOCAB) == 3
    blocked = sample_tree_nodes(info, logits, 4, positions=positions, rl_on_policy=rl_on_policy)
    assert blocked.tolist() == whole.tolist()


def test_unseeded_draws_in_blocks_keep_the_distribution(monkeypatch: pytest.MonkeyPatch):
    draws = 3000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0] + [-4.0] * (VOCAB - 4))
    info = _seeded_batch([0] * draws, top_p=0.9)
    info.sampling_seed = None
    info.temperatures = torch.ones(draws, 1)
    _rows_per_block(monkeypatch, 7)
    samples = sample_tree_nodes(info, logits.repeat(draws, 1), 1)
    probs = torch.softmax(logits, dim=-1)
    kept = torch.where(torch.cumsum(probs, 0) - probs <= 0.9, probs, torch.zeros_like(probs))
    frequencies = torch.bincount(samples, minlength=VOCAB).double() / draws
    assert frequencies[kept == 0].sum() == 0
    assert torch.allclose(frequencies, (kept / kept.sum()).double(), atol=0.04)  # > 4 sd at n = 3000


def test_no_draw_takes_more_than_its_block(seeded_draws: None, monkeypatch: pytest.MonkeyPatch):
    """Sorting, cumulative sums and float64 logs of whole [bs * N, V] rows would take ~48 bytes per entry;
    nothing but the logits' own float32 copy is that large when rows are drawn in blocks."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    LargestTensor.largest = max(LargestTensor.largest, t.numel() * t.element_size())
            return out

    logits, positions = _tree_rows(PREFIXES * 4, [(1, 2, 3)] * len(PREFIXES) * 4)  # 64 rows
    info = _seeded_batch(SEEDS * 4, top_k=8, top_p=0.9)
    logits_copy = logits.numel() * 4
    _rows_per_block(monkeypatch, 4)
    with LargestTensor():
        sample_tree_nodes(info, logits, 4, positions=positions)
    assert LargestTensor.largest <= logits_copy
    _rows_per_block(monkeypatch, 64)  # one block: the whole rows' sort indices and float64 logs
    LargestTensor.largest = 0
    with LargestTensor():
        sample_tree_nodes(info, logits, 4, positions=positions)
    assert LargestTensor.largest > logits_copy
