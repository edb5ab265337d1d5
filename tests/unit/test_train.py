"""Drafter training: the block-masked training forward sees exactly what the serving forward sees (same
logits for every anchor), training on a learnable target lowers the loss, and the checkpoint it writes
loads through the serving loader with the same logits."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from sglang_dart.drafter import load_drafter
from sglang_dart.train.blocks import block_attention, block_attention_mask, block_logits
from sglang_dart.train.checkpoint import draft_config_dict, new_drafter, save_drafter, with_grown_vocab
from sglang_dart.train.estimate import AcceptTally, _leading_hits, estimate_acceptance, split_holdout
from sglang_dart.train.features import SequenceFeatures, sequence_features
from sglang_dart.train.trainer import (
    RowStats,
    TrainSettings,
    _step_backward,
    fit,
    noised_taps,
    progress_line,
    row_decay_at,
    sample_anchors,
    sequence_loss,
    soft_cross_entropy,
    top1_hits,
    train,
)
from sglang_dart.train.vocab import grown_vocab, most_frequent_vocab

TARGET = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "vocab_size": 50,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
D = 3


def _drafter(vocab_size: int = 50, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(TARGET["vocab_size"], 32, generator=gen)
    lm_head = torch.randn(TARGET["vocab_size"], 32, generator=gen)
    labels = [torch.randint(0, 50, (400,), generator=gen)]
    vocab = most_frequent_vocab(labels, TARGET["vocab_size"], vocab_size)
    config = draft_config_dict(TARGET, D, vocab.size)
    model = new_drafter(config, embed, lm_head, vocab, seed=seed)
    with torch.no_grad():  # non-trivial norms so that every piece of the layer matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model, config, vocab


def test_block_mask_shape_and_visibility():
    allowed = block_attention_mask(4, torch.tensor([1, 3]), 2)
    assert allowed.shape == (8, 8)
    # slot 2 of the anchor at 1 (row 5) sees real 0..1, and slots 1..2 of its own block only
    assert allowed[5].tolist() == [True, True, False, False, True, True, False, False]
    # real rows never see mask slots
    assert not allowed[:4, 4:].any()


@pytest.mark.parametrize("seed", [0, 1])
def test_training_forward_equals_serving_forward(seed):
    model, _, _ = _drafter(vocab_size=30, seed=seed)
    n = 11
    gen = torch.Generator().manual_seed(100 + seed)
    taps = torch.randn(n, 96, generator=gen)
    next_tokens = torch.randint(0, 50, (n,), generator=gen)
    anchors = torch.tensor([0, 4, 5, 10])
    with torch.no_grad():
        out = block_logits(model, taps, next_tokens, anchors)
        for a, p in enumerate(anchors.tolist()):
            serving = model(taps[: p + 1], next_tokens[: p + 1], start_pos=0).logits
            torch.testing.assert_close(out.real[p], serving[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out.masks[a], serving[1:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("n", "anchors", "real_rows", "heads", "kv_heads"),
    [
        (12, [0, 4, 5, 11], None, 4, 2),
        (12, [3, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11], 6, 2),
        (9, [8], [], 3, 3),
        (30, list(range(10, 30, 2)), list(range(9, 30)), 9, 3),
    ],
)
def test_block_attention_by_parts_equals_the_dense_masked_attention(n, anchors, real_rows, heads, kv_heads):
    """The training attention computed by parts gives what scaled_dot_product_attention gives over the
    dense block mask, for every wanted real row and every slot (GQA included)."""
    d, hd = 3, 8
    gen = torch.Generator().manual_seed(n + len(anchors))
    anchors_t = torch.tensor(anchors)
    rows = n + len(anchors) * d
    q = torch.randn(rows, heads, hd, generator=gen)
    k = torch.randn(rows, kv_heads, hd, generator=gen)
    v = torch.randn(rows, kv_heads, hd, generator=gen)
    wanted = torch.arange(n) if real_rows is None else torch.tensor(real_rows, dtype=torch.int64)
    queries = torch.cat([wanted, torch.arange(n, rows)])
    dense = torch.nn.functional.scaled_dot_product_attention(
        q[queries].transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=block_attention_mask(n, anchors_t, d)[queries],
        scale=0.3,
        enable_gqa=True,
    )
    dense = dense.transpose(0, 1).reshape(queries.shape[0], heads * hd)
    parts = block_attention(q[queries], k, v, wanted, anchors_t, d, 0.3)
    torch.testing.assert_close(parts, dense, rtol=1e-5, atol=1e-5)


def _per_row_loss(out, feats, vocab, anchors, row_decay, first):
    """The loss as the trainer first wrote it, one cross-entropy per draft row, for comparison."""
    d = out.masks.shape[1]
    num_real = feats.input_ids.shape[0] - 1
    labels = vocab.to_draft(feats.labels)
    label_index = anchors.unsqueeze(1) + 1 + torch.arange(1, d + 1)
    clamped = label_index.clamp(max=labels.shape[0] - 1)
    mask_labels = torch.where(label_index < labels.shape[0], labels[clamped], -100)
    rows = [(out.real, labels[1 + first : num_real + 1])] + [
        (out.masks[:, j], mask_labels[:, j]) for j in range(d)
    ]
    losses, weights, hits = [], [], []
    for row, (logits, target) in enumerate(rows):
        keep = target >= 0
        if not bool(keep.any()):
            hits.append(None)
            continue
        losses.append(torch.nn.functional.cross_entropy(logits[keep], target[keep]) * row_decay**row)
        weights.append(row_decay**row)
        hits.append((int((logits[keep].argmax(-1) == target[keep]).sum()), int(keep.sum())))
    return torch.stack(losses).sum() / sum(weights), hits


@pytest.mark.parametrize(("seed", "anchors"), [(0, [5, 9, 17, 21, 22]), (1, [5, 9, 17]), (2, [21, 22])])
def test_the_one_shot_loss_equals_a_cross_entropy_per_row(seed, anchors):
    """The loss over all logits rows at once gives the per-row formulation's loss and top-1 counts,
    with labels outside the draft vocabulary and anchors near the end (rows without labels)."""
    model, _, vocab = _drafter(vocab_size=30, seed=seed)  # a small draft vocabulary: some labels fall out
    feats = _with_answer_start(_copy_task(count=1, length=24, seed=seed)[0], 6)
    anchors = torch.tensor(anchors)  # [21, 22]: the last rows have no label at all
    with torch.no_grad():
        got = sequence_loss(model, feats, vocab, anchors, 0.8)
        taps = feats.taps[:23].to(model.fc.weight.dtype)
        out = block_logits(model, taps, feats.input_ids[1:], anchors, torch.arange(5, 23))
        want, hits = _per_row_loss(out, feats, vocab, anchors, 0.8, first=5)
    torch.testing.assert_close(got.loss, want)
    for row, counted in enumerate(hits):
        if counted is not None:
            assert (got.stats.correct[row], got.stats.total[row]) == counted


def test_top1_hits_is_argmax_agreement_where_there_are_no_ties():
    logits = torch.randn(40, 7, 33, generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, 33, (40, 7), generator=torch.Generator().manual_seed(6))
    labels[::3] = logits.argmax(-1)[::3]  # some hits for sure
    labels[1::5, 2] = -100
    want = (logits.argmax(-1) == labels) & (labels >= 0)
    assert torch.equal(top1_hits(logits, labels), want)
    assert want.any()


def test_wanted_real_rows_give_the_same_logits_as_all_rows():
    """Training skips the head at unsupervised real positions: the rows it keeps must not change."""
    model, _, _ = _drafter(vocab_size=30, seed=3)
    n = 13
    gen = torch.Generator().manual_seed(7)
    taps = torch.randn(n, 96, generator=gen)
    next_tokens = torch.randint(0, 50, (n,), generator=gen)
    anchors = torch.tensor([5, 6, 9, 12])
    with torch.no_grad():
        full = block_logits(model, taps, next_tokens, anchors)
        for wanted in (torch.arange(5, n), anchors, torch.tensor([], dtype=torch.int64)):
            part = block_logits(model, taps, next_tokens, anchors, real_rows=wanted)
            assert part.real.shape[0] == wanted.shape[0]
            torch.testing.assert_close(part.real, full.real[wanted], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(part.masks, full.masks, rtol=1e-5, atol=1e-5)


def _copy_task(
    count: int, length: int, seed: int, sequence_seed: int | None = None
) -> list[SequenceFeatures]:
    """A target whose next token is a fixed function of the current one, exposed in the taps: a drafter
    can learn every row of it, so the loss must fall. `seed` fixes the target; `sequence_seed`, when given,
    draws other sequences of the same target (held-out data)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(50, 96, generator=gen)
    successor = torch.randperm(50, generator=gen)
    if sequence_seed is not None:
        gen = torch.Generator().manual_seed(sequence_seed)
    feats = []
    for _ in range(count):
        ids = [int(torch.randint(0, 50, (1,), generator=gen))]
        for _ in range(length - 1):
            ids.append(int(successor[ids[-1]]))
        ids_t = torch.tensor(ids)
        feats.append(SequenceFeatures(ids_t, table[ids_t].to(torch.bfloat16), successor[ids_t]))
    return feats


def test_training_lowers_the_loss_and_checkpoint_round_trips(tmp_path):
    model, config, vocab = _drafter()
    data = _copy_task(count=16, length=24, seed=3)
    anchors = torch.tensor([2, 7, 12])
    with torch.no_grad():
        before = float(sequence_loss(model, data[0], vocab, anchors, 0.8).loss)
    settings = TrainSettings(
        anchors_per_sequence=8,
        sequences_per_step=2,
        max_steps=120,
        warmup_steps=10,
        learning_rate=3e-3,
        bf16_autocast=False,
        log_every=0,
    )
    losses = train(model, data, vocab, settings, log=lambda _: None)
    with torch.no_grad():
        after = sequence_loss(model, data[0], vocab, anchors, 0.8)
    assert float(after.loss) < 0.3 * before, (before, float(after.loss), losses[-5:])
    assert after.stats.accuracy()[0] > 0.9

    out = save_drafter(model, config, vocab, tmp_path / "draft")
    assert json.loads((out / "config.json").read_text())["draft_length"] == D
    loaded = load_drafter(out, model.embed_tokens, 32, 50, dtype=torch.float32)
    taps, nxt = data[1].taps[:10].float(), data[1].input_ids[1:11]
    with torch.no_grad():
        torch.testing.assert_close(loaded(taps, nxt, 0).logits, model(taps, nxt, 0).logits)
    assert torch.equal(loaded.draft_to_target(torch.arange(vocab.size)), vocab.target_ids)


@pytest.mark.parametrize("bf16", [False, True])
def test_one_backward_per_step_gives_the_per_sequence_gradients(bf16):
    """A step's sequences are differentiated together (one autocast region, one backward of the mean):
    the gradients, loss and stats equal those of one backward per sequence, each of loss / n."""
    model, _, vocab = _drafter()
    batch = _copy_task(count=3, length=20, seed=5)
    settings = TrainSettings(anchors_per_sequence=5, sequences_per_step=3, bf16_autocast=bf16)
    anchor_sets = [sample_anchors(19, 5, random.Random(i)) for i in range(3)]

    def sequence_step(feats, rng, row_decay):
        anchors = anchor_sets[[id(f) for f in batch].index(id(feats))]
        result = sequence_loss(model, feats, vocab, anchors, row_decay)
        return result.loss, result.stats

    expected_loss, expected_stats = 0.0, RowStats()
    for feats in batch:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, stats = sequence_step(feats, None, 0.8)
        (loss / 3).backward()
        expected_loss += loss.item() / 3
        for row, (c, t) in enumerate(zip(stats.correct, stats.total, strict=True)):
            expected_stats.add(row, int(c), int(t))
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    stats = RowStats()
    loss = _step_backward(batch, settings, torch.device("cpu"), sequence_step, random.Random(0), stats)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() and len(got) > 5
    tolerance = 2e-2 if bf16 else 1e-5  # bf16: the casts' gradients are summed before, not after, the cast
    for name, grad in got.items():
        scale = expected[name].abs().max().item() + 1e-12
        assert (grad - expected[name]).abs().max().item() <= tolerance * scale, name
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert stats == expected_stats


@pytest.mark.parametrize(("soft_weight", "greedy_chains_only"), [(0.0, False), (0.0, True), (0.5, False)])
def test_packed_forwards_give_each_sequences_own_loss_and_gradients(soft_weight, greedy_chains_only):
    """A step's sequences through one packed forward (`packed_sequence_losses`, what training runs): each
    sequence's loss and stats, and the gradients of their mean, are those of its forward alone."""
    from sglang_dart.train.trainer import packed_sequence_losses

    model, _, vocab = _drafter()
    batch = [
        *_copy_task(count=1, length=20, seed=5),
        *_copy_task(count=1, length=9, seed=5, sequence_seed=1),
        *_copy_task(count=1, length=33, seed=5, sequence_seed=2),
    ]
    batch[1].answer_start, batch[2].answer_start = 3, 11
    gen = torch.Generator().manual_seed(9)
    for feats in batch:  # soft labels: the hard label first, then three others
        n = feats.labels.shape[0]
        others = torch.randint(0, 50, (n, 3), generator=gen)
        feats.soft_ids = torch.cat([feats.labels.unsqueeze(1), others], 1).to(torch.int32)
        feats.soft_probs = torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(n, 4).to(torch.bfloat16)
        if greedy_chains_only:  # a departure from the greedy chain in the middle
            feats.input_ids = feats.input_ids.clone()
            feats.input_ids[n // 2] = (feats.input_ids[n // 2] + 1) % 50
    anchors = [
        sample_anchors(f.input_ids.shape[0] - 1, 5, random.Random(i), f.first_anchor())
        for i, f in enumerate(batch)
    ]
    options = (0.8, soft_weight, greedy_chains_only)

    alone = [sequence_loss(model, feats, vocab, a, *options) for feats, a in zip(batch, anchors, strict=True)]
    (torch.stack([r.loss for r in alone]).sum() / 3).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    packed = packed_sequence_losses(model, list(zip(batch, anchors, strict=True)), vocab, *options)
    (torch.stack([r.loss for r in packed]).sum() / 3).backward()
    for one, other in zip(alone, packed, strict=True):
        assert other.loss.item() == pytest.approx(one.loss.item(), rel=1e-5)
        assert other.stats == one.stats
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() and len(got) > 5
    for name, grad in got.items():
        torch.testing.assert_close(
            grad, expected[name], rtol=1e-4, atol=1e-6 * expected[name].abs().max().item()
        )


@pytest.mark.parametrize(("soft_weight", "greedy_chains_only"), [(0.0, False), (0.0, True), (0.5, False)])
def test_a_packed_steps_losses_read_nothing_back_to_the_host(soft_weight, greedy_chains_only):
    """On a GPU a value read on the host waits for the device: a packed step reads its sequences' tallies
    once (`dart_steps`), and their losses need no read at all. On torch's meta device, where reading any
    value raises, every sequence's loss and tally still come out."""
    from sglang_dart.train.trainer import packed_sequence_losses

    model, _, vocab = _drafter(vocab_size=30)
    batch = [*_copy_task(count=1, length=14, seed=3), *_copy_task(count=1, length=9, seed=3, sequence_seed=1)]
    for feats in batch:
        n = feats.labels.shape[0]
        feats.soft_ids = feats.labels.unsqueeze(1).repeat(1, 2).to(torch.int32)
        feats.soft_probs = torch.full((n, 2), 0.5, dtype=torch.bfloat16)
    on_meta = [(feats.to("meta"), torch.tensor([1, 4]).to("meta")) for feats in batch]
    model.to("meta")
    model.embed_tokens = model.embed_tokens.to("meta")  # as the trainer moves it (not a parameter)
    results = packed_sequence_losses(model, on_meta, vocab.to("meta"), 0.8, soft_weight, greedy_chains_only)
    assert [r.loss.device.type for r in results] == ["meta", "meta"]
    assert [tuple(r.tally.shape) for r in results] == [(2, model.cfg.draft_length + 1)] * 2


def test_draft_vocab_keeps_most_frequent_labels():
    labels = [torch.tensor([5] * 10 + [7] * 5 + [1] * 2 + [3])]
    vocab = most_frequent_vocab(labels, 10, 3)
    assert vocab.target_ids.tolist() == [1, 5, 7]
    assert vocab.to_draft(torch.tensor([5, 3, 1])).tolist() == [1, -100, 0]
    assert (vocab.d2t + torch.arange(3)).tolist() == [1, 5, 7]


def test_features_and_vocab_move_whole_to_a_device():
    """What the trainer moves per step to the drafter's device: every tensor, none left behind."""
    feats = SequenceFeatures(
        torch.tensor([1, 2, 3]), torch.zeros(3, 96, dtype=torch.bfloat16), torch.tensor([2, 3, 4]),
        torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, 4, dtype=torch.bfloat16), answer_start=2,
    )  # fmt: skip
    moved = feats.to("meta")
    tensors = [moved.input_ids, moved.taps, moved.labels, moved.soft_ids, moved.soft_probs]
    assert all(t.device.type == "meta" for t in tensors) and moved.answer_start == 2
    assert [t.dtype for t in tensors] == [
        torch.int64,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.bfloat16,
    ]
    assert (
        feats.to("meta").soft_ids is not None and SequenceFeatures(*tensors[:3]).to("meta").soft_ids is None
    )
    vocab = most_frequent_vocab([torch.tensor([5, 5, 7])], 10, 2).to("meta")
    assert vocab.target_ids.device.type == vocab.t2d.device.type == "meta"


def test_a_draft_vocab_grows_by_the_most_frequent_missing_labels():
    vocab = most_frequent_vocab([torch.tensor([5] * 10 + [7] * 5)], 10, 2)  # {5, 7}
    labels = [torch.tensor([5] * 9 + [3] * 4 + [8] * 2 + [7] + [2] * 2)]
    # 3 (4 times) first, then 2 and 8 (twice each) by ascending id, then the unused ones by id.
    assert grown_vocab(vocab, labels, 4).target_ids.tolist() == [2, 3, 5, 7]
    assert grown_vocab(vocab, labels, 5).target_ids.tolist() == [2, 3, 5, 7, 8]
    assert grown_vocab(vocab, labels, 7).target_ids.tolist() == [0, 1, 2, 3, 5, 7, 8]
    assert grown_vocab(vocab, labels, 2).target_ids.tolist() == [5, 7]
    for size in (1, 11):
        with pytest.raises(ValueError, match="grow"):
            grown_vocab(vocab, labels, size)


def test_a_grown_drafter_keeps_its_trained_rows_and_maps_the_new_ones():
    model, config, vocab = _drafter(vocab_size=40)  # more rows than the hidden size: the map is determined
    target_head = torch.randn(TARGET["vocab_size"], 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():  # a trained head: the target's rows through a fixed linear map
        mapping = torch.randn(32, 32, generator=torch.Generator().manual_seed(8))
        model.lm_head.weight.copy_(target_head[vocab.target_ids] @ mapping)
    wider = grown_vocab(vocab, [torch.arange(50)], 48)
    grown, grown_config = with_grown_vocab(model, config, vocab, wider, target_head)
    assert grown_config["draft_vocab_size"] == 48 and config["draft_vocab_size"] == 40
    assert torch.equal(grown.draft_to_target(torch.arange(48)), wider.target_ids)
    taps, nxt = torch.randn(6, 96), torch.randint(0, 50, (6,))
    with torch.no_grad():
        before, after = model(taps, nxt, 0).logits, grown(taps, nxt, 0).logits
    # Every old token keeps its logit; an added token's row is the target's through the fitted map.
    old_in_new = wider.t2d[vocab.target_ids]
    torch.testing.assert_close(after[:, old_in_new], before, atol=1e-4, rtol=1e-4)
    added = wider.t2d[wider.target_ids[~torch.isin(wider.target_ids, vocab.target_ids)]]
    expected_rows = target_head[wider.target_ids[added]] @ mapping
    torch.testing.assert_close(grown.lm_head.weight[added], expected_rows, atol=1e-3, rtol=1e-3)


def test_degenerate_data_fails_clearly_or_contributes_nothing():
    model, _, vocab = _drafter(vocab_size=30)
    short = SequenceFeatures(
        torch.tensor([1, 2]), torch.zeros(2, 96, dtype=torch.bfloat16), torch.tensor([2, 3])
    )
    with pytest.raises(ValueError, match="3 tokens"):
        train(model, [short], vocab, TrainSettings(max_steps=1, log_every=0), log=lambda _: None)
    outside = int(torch.nonzero(vocab.t2d < 0)[0])  # a token the draft vocabulary does not have
    feats = SequenceFeatures(torch.tensor([1, 2, 3, 4]), torch.zeros(4, 96), torch.full((4,), outside))
    result = sequence_loss(model, feats, vocab, torch.tensor([0, 1]), 0.8)
    assert float(result.loss.detach()) == 0.0 and result.stats.total == []
    # In a step beside learnable sequences, under bf16 autocast (its zero is then a bf16 one), it adds
    # nothing and breaks nothing.
    learnable = _copy_task(count=2, length=12, seed=1)
    settings = TrainSettings(anchors_per_sequence=4, sequences_per_step=3, max_steps=2, warmup_steps=1,
                             bf16_autocast=True, log_every=0, progress_bar=False)  # fmt: skip
    losses = train(model, [*learnable, feats], vocab, settings, log=lambda _: None)
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)


# --- answers only ---------------------------------------------------------------------------------------


def _with_answer_start(feats: SequenceFeatures, start: int, prompt_labels: torch.Tensor | None = None):
    labels = feats.labels.clone()
    if prompt_labels is not None:
        labels[:start] = prompt_labels[:start]
    return SequenceFeatures(feats.input_ids, feats.taps, labels, answer_start=start)


def test_the_loss_never_looks_at_the_prompts_labels():
    """Row 0 learns at real positions from the one predicting the answer's first token on: labels inside the
    prompt (what the target would say there) change nothing once the answer start is known, and change
    the loss when it is not (so the check can fail)."""
    model, _, vocab = _drafter()
    feats = _copy_task(count=1, length=24, seed=3)[0]
    noise = torch.randint(0, 50, (24,), generator=torch.Generator().manual_seed(7))
    start = 9
    anchors = torch.tensor([8, 12, 20])  # from first_anchor() = start - 1 on
    with torch.no_grad():
        clean = sequence_loss(model, _with_answer_start(feats, start), vocab, anchors, 0.8)
        noisy = sequence_loss(model, _with_answer_start(feats, start, noise), vocab, anchors, 0.8)
        unmarked = sequence_loss(model, _with_answer_start(feats, 0, noise), vocab, anchors, 0.8)
    torch.testing.assert_close(noisy.loss, clean.loss)
    assert noisy.stats.total[0] == 24 - 1 - (start - 1)  # row 0 at real positions 8..22
    assert not torch.allclose(unmarked.loss, clean.loss)


def test_anchors_are_drawn_from_the_answer():
    rng = __import__("random").Random(0)
    drawn = sample_anchors(20, 64, rng, first=15)
    assert drawn.tolist() == [15, 16, 17, 18, 19]
    assert sample_anchors(20, 3, rng, first=4).min() >= 4
    feats = SequenceFeatures(torch.arange(10), torch.zeros(10, 96), torch.arange(10), answer_start=30)
    assert feats.first_anchor() == 8  # an answer start past the end leaves the last real position
    answer = SequenceFeatures(torch.arange(10), torch.zeros(10, 96), torch.arange(10) * 2, answer_start=6)
    # row 0 at anchor 5 learns labels[6]: the answer's labels, the ones a draft vocabulary should hold
    assert answer.answer_labels().tolist() == [12, 14, 16, 18]


def test_acceptance_estimate_counts_answer_anchors_only():
    held_out = [_with_answer_start(f, 10) for f in _copy_task(count=3, length=24, seed=3, sequence_seed=9)]
    model, _, vocab = _drafter()
    estimate = estimate_acceptance(model, held_out, vocab, k=4, bf16_autocast=False)
    assert estimate.anchors == 3 * (24 - (D + 1) - 9)  # anchors 9 .. 19 of each


def test_acceptance_estimate_skips_text_the_target_did_not_write():
    """A held-out document (its tokens not the target's greedy choices) is skipped and counted; the
    estimate over the target's own sequences is the same with or without it beside them. A slice of
    documents alone is read whole, flagged as a proxy."""
    own = _copy_task(count=3, length=24, seed=3, sequence_seed=9)
    gen = torch.Generator().manual_seed(5)
    document = SequenceFeatures(
        torch.randint(0, 50, (24,), generator=gen), own[0].taps, own[0].labels
    )  # the copy task's labels beside other text: it keeps to them at about 1 in 50
    model, _, vocab = _drafter()
    alone = estimate_acceptance(model, own, vocab, k=4, bf16_autocast=False)
    mixed = estimate_acceptance(model, [own[0], document, *own[1:]], vocab, k=4, bf16_autocast=False)
    assert (mixed.sequences, mixed.not_target_written) == (3, 1)
    assert mixed.anchors == alone.anchors and mixed.tau_chain == alone.tau_chain
    assert "did not write skipped" in mixed.describe() and "skipped" not in alone.describe()
    assert alone.target_text_only and mixed.target_text_only
    # a slice of foreign text only is read whole, as a proxy, and says so
    proxy = estimate_acceptance(model, [document], vocab, k=4, bf16_autocast=False)
    assert proxy.sequences == 1 and not proxy.target_text_only and "as a proxy" in proxy.describe()


# --- soft labels -----------------------------------------------------------------------------------------


def test_soft_cross_entropy_of_a_one_hot_distribution_is_the_hard_one():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([3, 0, 29, 7, 7])
    ids = torch.stack([labels, (labels + 1) % 30, (labels + 2) % 30], dim=1)
    probs = torch.tensor([[1.0, 0.0, 0.0]] * 5)
    hard = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(soft_cross_entropy(logits, ids, probs), hard)


def test_soft_cross_entropy_renormalizes_over_the_draft_vocabulary():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(1))
    log_q = torch.log_softmax(logits, -1)[0]
    # 0.5 of the mass on a token the draft vocabulary lacks (-1): the rest counts as the whole
    got = soft_cross_entropy(logits, torch.tensor([[4, -1, 9]]), torch.tensor([[0.3, 0.5, 0.2]]))
    torch.testing.assert_close(got, -(0.6 * log_q[4] + 0.4 * log_q[9]).unsqueeze(0))


def _with_soft_labels(feats: SequenceFeatures, probs: list[float], others: torch.Tensor) -> SequenceFeatures:
    """The features with soft labels whose most likely token is the argmax label, then `others`."""
    ids = torch.cat([feats.labels.unsqueeze(1), others[: feats.labels.shape[0]]], dim=1).to(torch.int32)
    soft = torch.tensor(probs).expand(ids.shape[0], -1).to(torch.bfloat16)
    return SequenceFeatures(feats.input_ids, feats.taps, feats.labels, ids, soft)


def test_soft_labels_line_up_with_every_rows_hard_label():
    """One-hot soft labels give exactly the hard loss: each row reads the soft labels of the position its
    hard label comes from (a shifted position would read another token and change the loss)."""
    model, _, vocab = _drafter()
    feats = _copy_task(count=1, length=24, seed=3)[0]
    others = torch.randint(0, 50, (24, 2), generator=torch.Generator().manual_seed(4))
    one_hot = _with_soft_labels(feats, [1.0, 0.0, 0.0], others)
    anchors = torch.tensor([0, 5, 20])
    with torch.no_grad():
        hard = sequence_loss(model, feats, vocab, anchors, 0.8).loss
        soft = sequence_loss(model, one_hot, vocab, anchors, 0.8, soft_weight=1.0).loss
        spread = sequence_loss(
            model, _with_soft_labels(feats, [0.5, 0.3, 0.2], others), vocab, anchors, 0.8, soft_weight=1.0
        ).loss
        ignored = sequence_loss(model, one_hot, vocab, anchors, 0.8, soft_weight=0.0).loss
    torch.testing.assert_close(soft, hard)
    torch.testing.assert_close(ignored, hard)
    assert not torch.allclose(spread, hard)


def test_features_carry_the_targets_top_tokens(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.randint(10, 400, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    feats = sequence_features(target, ids, soft_labels=4)
    assert feats.soft_ids.shape == (12, 4) and feats.soft_probs.shape == (12, 4)
    assert feats.soft_ids[:, 0].tolist() == feats.labels.tolist()
    with torch.no_grad():
        probs = torch.softmax(target(torch.tensor([ids])).logits[0], -1)
    expected = probs.gather(1, feats.soft_ids.long())
    torch.testing.assert_close(feats.soft_probs.float(), expected, rtol=1e-2, atol=1e-3)
    assert (feats.soft_probs[:, :-1] >= feats.soft_probs[:, 1:]).all()
    assert sequence_features(target, ids, soft_labels=0).soft_ids is None


def test_batched_features_equal_one_sequence_at_a_time(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from sglang_dart.train.features import collect_features

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    sequences = [torch.randint(10, 400, (n,), generator=gen).tolist() for n in (5, 17, 9, 9, 30, 2, 12)]
    starts = [1, 3, 0, 4, 10, 1, 2]
    alone = collect_features(target, sequences, progress=False, soft_labels=3, answer_starts=starts)
    # 40 padded tokens: several groups, some of one sequence, and the padding of every length
    batched = collect_features(
        target, sequences, progress=False, soft_labels=3, answer_starts=starts, batch_tokens=40
    )
    for one, other, start in zip(alone, batched, starts, strict=True):
        assert other.input_ids.tolist() == one.input_ids.tolist() and other.answer_start == start
        assert other.labels.tolist() == one.labels.tolist()
        assert other.soft_ids.tolist() == one.soft_ids.tolist()
        torch.testing.assert_close(other.taps.float(), one.taps.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(other.soft_probs.float(), one.soft_probs.float(), rtol=1e-2, atol=1e-3)


def test_length_batches_keep_each_padded_batch_within_its_budget():
    from sglang_dart.train.features import _length_batches

    sequences = [[0] * n for n in (5, 17, 9, 9, 30, 2, 12)]
    groups = _length_batches(list(range(7)), sequences, 40)
    assert sorted(i for g in groups for i in g) == list(range(7))
    assert all(len(g) * max(len(sequences[i]) for i in g) <= 40 or len(g) == 1 for g in groups)
    assert _length_batches([3, 1], sequences, 0) == [[3], [1]]


# --- held-out estimate and progress --------------------------------------------------------------------


def test_holdout_split_is_seeded_and_spares_tiny_data():
    data = _copy_task(count=40, length=8, seed=1)
    train_a, held_a = split_holdout(data, 0.1, seed=5)
    train_b, held_b = split_holdout(data, 0.1, seed=5)
    assert len(held_a) == 4 and len(train_a) == 36
    assert [id(f) for f in held_a] == [id(f) for f in held_b] and {id(f) for f in train_a}.isdisjoint(
        id(f) for f in held_a
    )
    assert split_holdout(data[:9], 0.5) == (data[:9], [])  # fewer than 10 sequences: all train
    assert split_holdout(data, 0.0) == (data, [])


def test_leading_hits_count_the_accepted_prefix():
    hits = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    assert _leading_hits(hits).tolist() == [2, 0, 4]


def test_accept_tally_counts_chains_bounds_and_unlabelled_rows():
    """Two anchors of three rows over a vocabulary of 4: the chain stops at the first wrong top-1 guess, the
    bound at the first label outside the k best, and a row without a label (-100) is a miss for both."""
    tally = AcceptTally(rows=3, k=2)
    assert tally.estimate(0, True) is None  # nothing added yet
    logits = torch.tensor(
        [
            [[0.0, 3, 2, 1], [5.0, 0, 0, 4], [0.0, 0, 9, 0]],  # best two: {1, 2}, {0, 3}, {2, ...}
            [[1.0, 0, 0, 0], [0.0, 2, 1, 0], [0.0, 0, 0, 1]],  # best: 0, then {1, 2}, then 3
        ]
    )
    labels = torch.tensor([[1, 3, 2], [0, 1, -100]])
    tally.add(logits, labels)
    est = tally.estimate(skipped=2, target_text_only=True)
    assert est is not None and (est.sequences, est.anchors, est.k) == (1, 2, 2)
    assert est.top1_by_row == [1.0, 0.5, 0.5]  # row 1 of anchor 0 guesses 0, not 3; the -100 row misses
    assert est.tau_chain == ((1 + 1) + (1 + 2)) / 2  # anchor 0 stops at row 1, anchor 1 at its unlabelled row
    assert est.tau_topk_bound == ((1 + 3) + (1 + 2)) / 2  # 3 is among anchor 0's row-1 best two
    assert est.not_target_written == 2


def test_acceptance_estimate_of_a_trained_and_an_untrained_drafter():
    """A drafter trained on the copy task predicts most rows of unseen sequences: tau near its d + 2
    (d + 1 rows and the target's own token); an untrained one's chain stops at once (tau near 1)."""
    held_out = _copy_task(count=6, length=24, seed=3, sequence_seed=9)
    model, _, vocab = _drafter()
    untrained = estimate_acceptance(model, held_out, vocab, k=4, bf16_autocast=False)
    settings = TrainSettings(
        anchors_per_sequence=8, sequences_per_step=2, max_steps=150, warmup_steps=10,
        learning_rate=3e-3, bf16_autocast=False, log_every=0, progress_bar=False,
    )  # fmt: skip
    train(model, _copy_task(count=16, length=24, seed=3), vocab, settings, log=lambda _: None)
    trained = estimate_acceptance(model, held_out, vocab, k=4, bf16_autocast=False)
    assert trained.sequences == 6 and trained.anchors == 6 * (24 - (D + 1))
    assert trained.tau_chain > D + 0.5 and min(trained.top1_by_row) > 0.7, trained
    assert untrained.tau_chain < 1.5 < trained.tau_chain
    for estimate in (trained, untrained):
        assert 1.0 <= estimate.tau_chain <= estimate.tau_topk_bound <= D + 2
    assert "estimated tau" in trained.describe()
    assert estimate_acceptance(model, _copy_task(count=2, length=D + 1, seed=4), vocab) is None


def test_progress_line_eta_is_the_budget_that_ends_first():
    by_steps = TrainSettings(max_steps=1000)
    line = progress_line(100, by_steps, elapsed=50.0, loss=2.5, accuracy=[0.5, 0.25])
    assert line == "step 100/1000 loss 2.500 top-1 by row [0.50 0.25] 50s, ETA 7m30s"
    by_time = TrainSettings(max_steps=1000, max_seconds=120.0)
    assert progress_line(100, by_time, elapsed=50.0, loss=2.5, accuracy=[]).endswith("50s, ETA 1m10s")


def test_training_logs_progress_lines(capsys):
    model, _, vocab = _drafter()
    lines: list[str] = []
    settings = TrainSettings(
        anchors_per_sequence=4, sequences_per_step=1, max_steps=6, warmup_steps=1, bf16_autocast=False,
        log_every=3, progress_bar=True,
    )  # fmt: skip
    train(model, _copy_task(count=4, length=12, seed=2), vocab, settings, log=lines.append)
    assert [line.split(" loss")[0] for line in lines] == ["step 3/6", "step 6/6"]
    assert all("ETA" in line and "top-1 by row" in line for line in lines)
    assert "step 6/6" in capsys.readouterr().err  # the live line, on stderr


def test_feature_noise_scales_with_each_tap_and_training_still_learns():
    generator = torch.Generator().manual_seed(0)
    loud, quiet = torch.full((4000, 16), 10.0), torch.full((4000, 16), -0.1)
    taps = torch.cat([loud, quiet], dim=1).to(torch.bfloat16)
    noised = noised_taps(taps, 2, 0.2, generator)
    assert noised.shape == taps.shape and noised.dtype == torch.float32
    noise = noised - taps.float()
    assert noise[:, :16].std().item() == pytest.approx(2.0, rel=0.05)  # 0.2 x 10
    assert noise[:, 16:].std().item() == pytest.approx(0.02, rel=0.05)  # 0.2 x 0.1
    # With noise on, training a learnable task still gets there (the noise regularises, it does not blind).
    model, _, vocab = _drafter()
    data = _copy_task(count=16, length=24, seed=3)
    settings = TrainSettings(
        anchors_per_sequence=8, sequences_per_step=2, max_steps=120, warmup_steps=10, learning_rate=3e-3,
        bf16_autocast=False, log_every=0, feature_noise=0.1,
    )  # fmt: skip
    train(model, data, vocab, settings, log=lambda _: None)
    with torch.no_grad():
        after = sequence_loss(model, data[0], vocab, torch.tensor([2, 7, 12]), 0.8)
    assert after.stats.accuracy()[0] > 0.9


def test_row_decay_moves_linearly_over_whichever_budget_runs_out_first():
    fixed = TrainSettings(row_decay=0.5, max_steps=100)
    assert row_decay_at(fixed, 0, 0.0) == row_decay_at(fixed, 99, 1e9) == 0.5
    by_steps = TrainSettings(row_decay=0.4, row_decay_final=1.0, max_steps=100)
    assert [row_decay_at(by_steps, s, 0.0) for s in (0, 50, 100)] == pytest.approx([0.4, 0.7, 1.0])
    by_time = TrainSettings(row_decay=1.0, row_decay_final=0.5, max_steps=10_000, max_seconds=60.0)
    assert row_decay_at(by_time, 10, 15.0) == pytest.approx(0.875)  # a quarter of the time, 0.1% of the steps
    assert row_decay_at(by_time, 10, 600.0) == pytest.approx(0.5)  # never past the final value


def test_fit_hands_each_step_its_scheduled_row_decay():
    """The loop gives every sequence of a step the step's γ, so an annealed run's loss changes weight as it
    goes (a fixed γ reaches every step unchanged)."""
    model, _, vocab = _drafter()
    data = _copy_task(count=4, length=12, seed=5)
    seen: dict[str, list[float]] = {}
    for name, final in (("fixed", None), ("annealed", 1.0)):
        settings = TrainSettings(
            anchors_per_sequence=3, sequences_per_step=2, max_steps=5, warmup_steps=1, bf16_autocast=False,
            log_every=0, row_decay=0.5, row_decay_final=final,
        )  # fmt: skip
        gammas = seen.setdefault(name, [])

        def step(feats, rng, row_decay, gammas=gammas):
            gammas.append(row_decay)
            result = sequence_loss(model, feats, vocab, torch.tensor([2, 5]), row_decay)
            return result.loss, result.stats

        fit(model, data, settings, step, log=lambda _: None)
    assert seen["fixed"] == [0.5] * 10
    assert seen["annealed"] == pytest.approx([g for g in (0.5, 0.6, 0.7, 0.8, 0.9) for _ in range(2)])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--soft-weight", "1.5"], "between 0 and 1"),
        (["--format", "eagle3", "--soft-weight", "0.5"], "DART's loss only"),
        (["--feature-noise", "-0.1"], "standard deviation"),
        (["--row-decay", "0"], "above 0"),
        (["--row-decay-final", "-0.5"], "above 0"),
        (["--anchors", "0"], "at least 1"),
        (["--feature-batch-tokens", "-1"], "count of padded tokens"),
        (["--format", "dflash", "--feature-noise", "0.1"], "DART's training only"),
        (["--format", "eagle3", "--greedy-chains-only"], "DART's training only"),
        (["--init", "CHECKPOINT", "--draft-vocab-size", "4096"], "grow, not shrink"),
        (["--device", "banana"], "--device 'banana'"),
        (["--device", "meta"], "'cpu' or 'cuda"),
        *(
            pytest.param(
                ["--device", "cuda", "--format", name],
                "no CUDA device",
                marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
            )
            for name in ("dart", "eagle3", "dflash")
        ),
    ],
)
def test_a_bad_training_option_is_refused_before_any_work(tmp_path, options, message):
    from sglang_dart.train.__main__ import main

    paths = ["--target", str(tmp_path), "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "o")]
    (tmp_path / "config.json").write_text(json.dumps({"draft_vocab_size": 8192}))
    options = [str(tmp_path) if option == "CHECKPOINT" else option for option in options]
    with pytest.raises(SystemExit, match=message):
        main([*paths, *options])


@pytest.mark.parametrize(
    ("options", "anchors", "gamma"),
    [
        ([], 32, 0.5),
        (["--format", "dflash"], 64, 0.8),
        (["--format", "eagle3"], 64, 0.8),  # anchors unused: EAGLE3 trains on whole windows
        (["--anchors", "48", "--row-decay", "0.65"], 48, 0.65),
        (["--format", "dflash", "--anchors", "8"], 8, 0.8),
        (["--format", "eagle3", "--row-decay", "0.5"], 64, 0.5),
    ],
)
def test_anchor_blocks_and_row_decay_default_by_format(options, anchors, gamma):
    from sglang_dart.train import run_summary
    from sglang_dart.train.__main__ import make_parser

    args = make_parser().parse_args(["--target", "T", "--data", "D", "--out", "O", *options])
    settings = run_summary.settings_from_args(args)
    assert (settings.anchors_per_sequence, settings.row_decay) == (anchors, gamma)


def test_bf16_autocast_is_on_by_default_only_where_the_cpu_multiplies_bf16(monkeypatch):
    from sglang_dart.dart import settings
    from sglang_dart.train.__main__ import make_parser
    from sglang_dart.train.trainer import bf16_autocast_pays

    for amx, avx512_bf16, expected in [(False, False, False), (False, True, True), (True, False, True)]:
        monkeypatch.setattr(settings, "cpu_has_amx_bf16", lambda amx=amx: amx)
        monkeypatch.setattr(settings, "cpu_has_avx512_bf16", lambda flag=avx512_bf16: flag)
        assert bf16_autocast_pays() is expected
    paths = ["--target", "t", "--data", "d.jsonl", "--out", "o"]
    parser = make_parser()
    assert parser.parse_args(paths).bf16 is None  # main() resolves it with bf16_autocast_pays()
    assert parser.parse_args([*paths, "--bf16"]).bf16 is True
    assert parser.parse_args([*paths, "--no-bf16"]).bf16 is False
