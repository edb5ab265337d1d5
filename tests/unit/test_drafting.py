"""The batched draft forward through SGLang's KV pool and attention backend gives the single-request
drafter's logits, step after step."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from sglang_dart.cpu.attention import TreeVerifyCpuAttnBackend
from sglang_dart.dart import drafting as drafting_module
from sglang_dart.dart.device_graphs import DeviceGraphs
from sglang_dart.dart.drafting import FLUSH_GAP, Drafting, VerifiedStep, shapes_to_capture
from sglang_dart.dart.phase_timer import PhaseTimer
from sglang_dart.dart.progress import RequestProgress
from sglang_dart.dart.tree_sizes import TreeSizeSchedule
from sglang_dart.drafter import DraftConfigError, load_drafter
from sglang_dart.drafter.model import read_weights
from sglang_dart.drafter.sglang_model import LlamaForCausalLMDart
from tests.support.draft_pools import draft_forward_over_pools
from tests.unit.test_drafter import H, V, _embedding, _write_checkpoint


def _draft_model(path: Any, embed: torch.Tensor) -> LlamaForCausalLMDart:
    """The drafter as SGLang's loader builds it: the class from config.json, weights through load_weights."""
    config = LlamaConfig(**json.loads((path / "config.json").read_text()))
    with torch.device(embed.device):
        model = LlamaForCausalLMDart(config).float()
    model.load_weights(read_weights(path).items())
    model.attach_target(embed, H, V)
    return model


class _RecordingBackend:
    """Stands in for FlashInfer on the meta device (no kernel runs there): keeps the batch it was given
    and answers with zeros of the right shape on the queries' device."""

    def __init__(self, runner: Any) -> None:
        self.req_to_token_pool, self.token_to_kv_pool = runner.req_to_token_pool, runner.token_to_kv_pool
        self.batch = None

    def init_forward_metadata(self, batch: Any) -> None:
        self.batch = batch

    def forward(self, q, k, v, layer, batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
        return torch.zeros_like(q)


def _draft_forward(
    path: Any, req_to_token: torch.Tensor, num_slots: int, backend: Any = TreeVerifyCpuAttnBackend
):
    return draft_forward_over_pools(
        _draft_model(path, _embedding().to(req_to_token.device)), req_to_token, num_slots, backend
    )


@pytest.mark.parametrize("draft_step", ["step", "step_from_newest"])
def test_batched_steps_match_single_request_forward(tmp_path, draft_step):
    """Both ways of drafting from several entries (every entry attending, or the entries before the
    newest stored as K/V alone, as a prefill does) give the single-request drafter's logits."""
    path = _write_checkpoint(tmp_path / "draft")
    drafter = load_drafter(path, _embedding(), H, V, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    num_slots, max_len = 200, 40
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    req_to_token = torch.zeros(4, max_len, dtype=torch.int32)
    req_to_token[1] = perm[:max_len].to(torch.int32)
    req_to_token[3] = perm[max_len : 2 * max_len].to(torch.int32)
    runner = _draft_forward(path, req_to_token, num_slots)
    step = getattr(runner, draft_step)
    rpi = torch.tensor([1, 3])
    lengths = [7, 4]  # prompt lengths
    total = [14, 12]  # tokens known by the end of the test
    tokens = [torch.randint(0, V, (n + 1,), generator=gen) for n in total]
    aux = [torch.randn(n, 3 * H, generator=gen) for n in total]

    def reference(r, upto):  # single-request drafter over entries 0..upto-1 (last paired with token upto)
        with torch.no_grad():
            return drafter(aux[r][:upto], tokens[r][1 : upto + 1], start_pos=0).logits

    # Prefill: residuals of the prompt tokens, entries 0..n-1.
    for r in range(2):
        runner.store_residuals(req_to_token[rpi[r], : lengths[r]].long(), aux[r][: lengths[r]])
    nxt = torch.cat([tokens[r][1 : lengths[r] + 1] for r in range(2)])
    logits = step(rpi.tolist(), [0, 0], [lengths[0] - 1, lengths[1] - 1], nxt.tolist())
    for r in range(2):
        torch.testing.assert_close(logits[r], reference(r, lengths[r]), atol=1e-4, rtol=1e-4)

    # Decode steps accepting different numbers of tokens per request.
    committed = list(lengths)
    for accepted in ([3, 1], [0, 4], [3, 2]):
        new = [min(a + 1, total[r] - committed[r]) for r, a in enumerate(accepted)]
        for r in range(2):
            slots = req_to_token[rpi[r], committed[r] : committed[r] + new[r]].long()
            runner.store_residuals(slots, aux[r][committed[r] : committed[r] + new[r]])
        first = [c - 1 for c in committed]
        committed = [c + n for c, n in zip(committed, new, strict=True)]
        last = [c - 1 for c in committed]
        nxt = torch.cat([tokens[r][first[r] + 1 : last[r] + 2] for r in range(2)])
        logits = step(rpi.tolist(), first, last, nxt.tolist())
        for r in range(2):
            torch.testing.assert_close(logits[r], reference(r, committed[r]), atol=1e-4, rtol=1e-4)


def test_steps_that_only_store_entries_keep_later_drafts_exact(tmp_path):
    """Steps that draft nothing (tree size 1 at large batch sizes) store their entries' K/V only; a later
    full step must still see every entry of the prefix, as the single-request drafter does."""
    path = _write_checkpoint(tmp_path / "draft")
    drafter = load_drafter(path, _embedding(), H, V, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    num_slots, max_len = 120, 30
    req_to_token = torch.zeros(2, max_len, dtype=torch.int32)
    req_to_token[0] = (torch.randperm(num_slots - 1, generator=gen)[:max_len] + 1).to(torch.int32)
    runner = _draft_forward(path, req_to_token, num_slots)
    rpi = torch.tensor([0])
    tokens = torch.randint(0, V, (max_len + 1,), generator=gen)
    aux = torch.randn(max_len, 3 * H, generator=gen)
    prompt = 5
    runner.store_residuals(req_to_token[0, :prompt].long(), aux[:prompt])
    runner.step(rpi.tolist(), [0], [prompt - 1], tokens[1 : prompt + 1].tolist())
    committed = prompt
    for accepted, draft in ((1, False), (1, False), (3, False), (1, True), (2, False), (1, True)):
        runner.store_residuals(
            req_to_token[0, committed : committed + accepted].long(), aux[committed:][:accepted]
        )
        first, committed = committed - 1, committed + accepted
        nxt = tokens[first + 1 : committed + 1]
        if not draft:
            runner.store_entries(rpi.tolist(), [first], [committed - 1], nxt.tolist())
            continue
        logits = runner.step(rpi.tolist(), [first], [committed - 1], nxt.tolist())
        with torch.no_grad():
            expected = drafter(aux[:committed], tokens[1 : committed + 1], start_pos=0).logits
        torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


def test_a_shallower_step_gives_the_first_rows_of_the_full_step(tmp_path):
    """Drafting for a small tree computes fewer mask slots; the rows it returns are the full step's, and
    the K/V it stores are the same (mask slots are never stored), up to the rounding of a
    matrix product over fewer rows."""
    path = _write_checkpoint(tmp_path / "draft")
    drafter = load_drafter(path, _embedding(), H, V, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    num_slots, max_len, prompt = 100, 20, 6
    req_to_token = torch.zeros(2, max_len, dtype=torch.int32)
    req_to_token[0] = (torch.randperm(num_slots - 1, generator=gen)[:max_len] + 1).to(torch.int32)
    tokens = torch.randint(0, V, (prompt + 1,), generator=gen)
    aux = torch.randn(prompt, 3 * H, generator=gen)
    rpi = torch.tensor([0])
    full_depth = drafter.cfg.draft_length + 1
    results = {}
    for depths in (None, 1, 3, full_depth, full_depth + 5):
        runner = _draft_forward(path, req_to_token, num_slots)
        runner.store_residuals(req_to_token[0, :prompt].long(), aux)
        results[depths] = (
            runner.step(rpi.tolist(), [0], [prompt - 1], tokens[1:].tolist(), depths),
            runner.draft_runner.token_to_kv_pool.get_key_buffer(0)[:num_slots].clone(),
        )
    full, full_keys = results[None]
    assert full.shape[1] == full_depth
    for depths in (1, 3, full_depth, full_depth + 5):
        logits, keys = results[depths]
        assert logits.shape[1] == min(depths, full_depth)
        torch.testing.assert_close(logits, full[:, : logits.shape[1]], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(keys, full_keys, atol=1e-5, rtol=1e-5)  # GEMM blocking may differ


def test_deferred_residuals_land_in_step_order_before_any_other_access(tmp_path):
    """Residuals a root-only step on a CPU defers are fused before anything else reads or writes the
    residual store, in step order: a slot handed out again between two steps ends with the later token's
    residual, and a store after them is not overwritten. FLUSH_GAP deferred steps fuse by themselves."""
    runner = _draft_forward(_write_checkpoint(tmp_path / "draft"), torch.zeros(2, 8, dtype=torch.int32), 16)
    gen = torch.Generator().manual_seed(3)
    old, new, stored = (torch.randn(1, 3 * H, generator=gen) for _ in range(3))
    runner.defer_residuals(torch.tensor([5]), old)
    runner.defer_residuals(torch.tensor([5, 6]), torch.cat([new, old]))
    assert not runner.residual[5].any()  # nothing fused yet
    runner.store_residuals(torch.tensor([6]), stored)
    with torch.no_grad():
        expected = runner.drafter.fuse(torch.cat([new, stored]))
    torch.testing.assert_close(runner.residual[[5, 6]], expected)
    taps = torch.randn(FLUSH_GAP, 3 * H, generator=gen)
    for i in range(FLUSH_GAP):
        assert not runner.residual[7].any()
        runner.defer_residuals(torch.tensor([7]), taps[i : i + 1])
    with torch.no_grad():
        torch.testing.assert_close(runner.residual[7], runner.drafter.fuse(taps[-1:])[0])


def test_a_step_on_an_accelerator_reads_nothing_back_and_mixes_no_devices(tmp_path):
    """The draft model, SGLang's pools and req_to_token on the meta device (a device with no data: reading
    a value back raises, and so does an op mixing a meta tensor with a host one), the request layout in
    host lists as the worker passes it: prefill drafts (every entry attending, or the newest alone), a draft
    after a verify and a store-only step all run, give logits of the right shape on that device, and hand
    the attention backend an extend batch whose tensors all live there."""
    req_to_token = torch.zeros(4, 40, dtype=torch.int32, device="meta")
    runner = _draft_forward(_write_checkpoint(tmp_path / "draft"), req_to_token, 200, _RecordingBackend)
    assert runner.residual.device.type == "meta"
    rows = [1, 3]
    runner.store_residuals(
        torch.zeros(11, dtype=torch.int64, device="meta"), torch.zeros(11, 3 * H, device="meta")
    )
    cfg = runner.model.cfg
    full = (2, cfg.draft_length + 1, cfg.draft_vocab_size)
    logits = runner.step(rows, [0, 0], [6, 3], list(range(11)))
    assert logits.device.type == "meta" and logits.shape == full
    logits = runner.step_from_newest(rows, [0, 0], [6, 3], list(range(11)))  # a prefill's
    assert logits.device.type == "meta" and logits.shape == full
    assert runner.draft_runner.attn_backend.batch.extend_prefix_lens_cpu == [6, 3]
    logits = runner.step(rows, [6, 3], [9, 3], [1, 2, 3, 4, 5], depths=3)
    assert logits.shape[:2] == (2, 3)
    batch = runner.draft_runner.attn_backend.batch
    assert batch.extend_prefix_lens_cpu == [6, 3] and batch.extend_seq_lens_cpu == [4 + 2, 1 + 2]
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "positions", "extend_prefix_lens"):
        assert getattr(batch, name).device.type == "meta", name
    for name in ("extend_seq_lens", "extend_start_loc", "input_ids"):  # what FlashInfer/triton plan from
        assert getattr(batch, name).device.type == "meta", name
    # Host-side lengths the GPU backends plan with, so planning reads nothing back either.
    assert batch.seq_lens_cpu.device.type == "cpu" and batch.seq_lens_cpu.tolist() == [6 + 6, 3 + 3]
    assert batch.seq_lens_sum == 18 and batch.extend_num_tokens == 9
    assert batch.forward_mode.is_extend() and batch.spec_info is None
    runner.store_entries(rows, [9, 3], [10, 5], [1, 2, 3, 4, 5])


def test_sglang_model_loads_the_published_layout_and_refuses_what_does_not_fit(tmp_path):
    """The model class SGLang's loader builds takes the checkpoint's tensors as published (t2d ignored),
    gives the training drafter's logits, and names what does not fit: a tensor of the wrong shape, a
    target of another hidden size or vocabulary."""
    path = _write_checkpoint(tmp_path / "draft")
    model = _draft_model(path, _embedding())
    reference = load_drafter(path, _embedding(), H, V, dtype=torch.float32)
    aux, tokens = torch.randn(5, 3 * H), torch.randint(0, V, (5,))
    with torch.no_grad():
        torch.testing.assert_close(
            model.drafter(aux, tokens, start_pos=0).logits, reference(aux, tokens, start_pos=0).logits
        )
    tensors = read_weights(path)
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1]
    with pytest.raises(DraftConfigError, match="fc.weight"):
        model.load_weights(tensors.items())
    with pytest.raises(DraftConfigError, match="hidden_size"):
        model.attach_target(torch.zeros(V, H + 1), H + 1, V)
    with pytest.raises(DraftConfigError, match="vocab"):
        model.attach_target(torch.zeros(V + 1, H), H, V + 1)


class _KeptTrees:
    """Records what drafting hands the trees (the candidates' logits), in place of `Trees`."""

    def __init__(self) -> None:
        self.logits: torch.Tensor | None = None

    def keep(self, reqs: Any, logits: torch.Tensor, progress: Any) -> None:
        self.logits = logits

    def candidates_on_device(self, logits: torch.Tensor) -> torch.Tensor:
        return self.candidates_of(logits)

    def candidates_of(self, logits: torch.Tensor) -> torch.Tensor:
        self.logits = logits.clone()
        bs, depths = logits.shape[:2]
        return torch.zeros(2, bs, depths, 1, device=logits.device)

    def keep_host(self, reqs: Any, probs: Any, tokens: Any, at: Any) -> None:
        pass

    def drop(self, reqs: Any) -> None:
        self.logits = None


def _drafting_over_one_row(tmp_path, max_len: int, seed: int):
    path = _write_checkpoint(tmp_path / "draft")
    drafter = load_drafter(path, _embedding(), H, V, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    num_slots = 2 * max_len + 10
    req_to_token = torch.zeros(3, max_len, dtype=torch.int32)
    req_to_token[0] = (torch.randperm(num_slots - 1, generator=gen)[:max_len] + 1).to(torch.int32)
    runner = _draft_forward(path, req_to_token, num_slots)
    trees = _KeptTrees()
    drafting = Drafting(runner, trees, RequestProgress(), PhaseTimer(enabled=False))
    tokens = torch.randint(0, V, (max_len + 1,), generator=gen).tolist()
    aux = torch.randn(max_len, 3 * H, generator=gen)
    return drafter, drafting, trees, req_to_token, tokens, aux


def _prefill(drafting, req, row: int, tokens, aux, prefix: int, end: int) -> None:
    """Drafting's prefill of tokens prefix..end-1 (the first `prefix` cached), as a batch of one."""
    req.origin_input_ids, req.output_ids = tokens[:end], []
    batch = SimpleNamespace(
        reqs=[req], req_pool_indices_cpu=torch.tensor([row]), prefix_lens=[prefix], extend_lens=[end - prefix]
    )
    drafting.after_extend(batch, aux[prefix:end], torch.tensor([tokens[end]]))


def _verify_step(drafting, req, row: int, tokens, aux, committed: int, accepted: int, depths):
    """One verify of a batch of one whose root and `accepted` drafts all match `tokens` (a chain)."""
    batch = SimpleNamespace(reqs=[req], req_pool_indices_cpu=torch.tensor([row]))
    size = accepted + 1
    step = VerifiedStep(
        committed=torch.tensor([committed]),
        roots=torch.tensor([tokens[committed]]),
        predict=torch.tensor(tokens[committed + 1 : committed + size + 1]),
        accept_lens=torch.tensor([size], dtype=torch.int32),
        accept_index=torch.arange(size, dtype=torch.int32).view(1, size),
    )
    drafting.settle(drafting.after_verify(batch, aux[committed : committed + size], step, depths))
    return committed + size


def test_root_only_steps_defer_entries_and_the_next_draft_is_exact(tmp_path):
    """Root-only steps store residuals and defer their entries' K/V; a flush stores them once a request
    has FLUSH_GAP of them, and the next drafting step computes the rest: its drafts are the single-request
    drafter's, as if every entry had been stored when its step ran."""
    max_len = FLUSH_GAP + 30
    drafter, drafting, trees, _, tokens, aux = _drafting_over_one_row(tmp_path, max_len, seed=21)
    req = SimpleNamespace(rid="a")
    prompt = 6
    _prefill(drafting, req, 0, tokens, aux, 0, prompt)
    committed = prompt
    for step in range(FLUSH_GAP + 5):
        committed = _verify_step(drafting, req, 0, tokens, aux, committed, 0, None)
        stored_from = drafting.pending.get("a")
        if step + 1 < FLUSH_GAP:
            assert stored_from == prompt - 1  # deferred since the prefill's newest entry
        elif step + 1 == FLUSH_GAP:
            assert stored_from is None  # flushed
    assert drafting.pending == {"a": prompt - 1 + FLUSH_GAP}
    committed = _verify_step(drafting, req, 0, tokens, aux, committed, 2, depths=3)
    assert drafting.pending == {}
    with torch.no_grad():
        expected = drafter(aux[:committed], torch.tensor(tokens[1 : committed + 1]), start_pos=0).logits
    torch.testing.assert_close(trees.logits[0], expected[:3], atol=1e-4, rtol=1e-4)


def test_a_prefill_over_a_prefix_left_with_deferred_entries_drafts_exactly(tmp_path):
    """A request that finishes with entries still deferred leaves stale K/V in slots the radix cache
    keeps; a later request whose cached prefix ends there recomputes them at its prefill."""
    drafter, drafting, trees, req_to_token, tokens, aux = _drafting_over_one_row(tmp_path, 40, seed=4)
    first = SimpleNamespace(rid="first")
    _prefill(drafting, first, 0, tokens, aux, 0, 8)
    committed = 8
    for _ in range(9):
        committed = _verify_step(drafting, first, 0, tokens, aux, committed, 0, None)
    assert drafting.pending == {"first": 7}  # finished with 9 entries deferred
    # Poison the deferred entries' K/V, as a freed slot's reuse would: the recompute must overwrite them.
    pool = drafting.forward.draft_runner.token_to_kv_pool
    stale = req_to_token[0, 8 : committed + 1].long()
    pool.k_buffer[0][stale] = 7.0
    pool.v_buffer[0][stale] = -7.0
    req_to_token[1] = req_to_token[0]  # the second request's prefix shares the first's slots
    second = SimpleNamespace(rid="second")
    end = committed + 4
    _prefill(drafting, second, 1, tokens, aux, committed, end)
    with torch.no_grad():
        expected = drafter(aux[:end], torch.tensor(tokens[1 : end + 1]), start_pos=0).logits
    torch.testing.assert_close(trees.logits[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("accelerator_width", "graphs"),
    [(False, False), (True, False), (True, True)],
    ids=["cpu", "acc", "graphs"],
)
def test_block_steps_after_tree_verifies_draft_exactly_for_every_request(
    tmp_path, monkeypatch, accelerator_width, graphs
):
    """Drafting after verifies of branching trees, laid out on the device (`draft_block`): requests in
    scattered table rows accept different numbers of nodes at different places of their trees (the other
    nodes carry junk taps and tokens), some steps draft nothing; after every drafting step each request's
    drafts are the single-request drafter's over its whole sequence. Blocks as wide as the longest path
    (a CPU's) or as the whole tree (an accelerator's, padded), and the accelerator's pieces replayed from
    their graphs' buffers (`device_graphs`, emulated: each shape's buffers reused by later steps)."""
    if accelerator_width:
        monkeypatch.setattr(drafting_module, "_longest_paths_on_cpu", lambda nodes, lens: nodes)
    path = _write_checkpoint(tmp_path / "draft")
    drafter = load_drafter(path, _embedding(), H, V, dtype=torch.float32)
    gen = torch.Generator().manual_seed(8)
    max_len, num_slots = 60, 400
    req_to_token = torch.zeros(6, max_len, dtype=torch.int32)
    perm = (torch.randperm(num_slots - 1, generator=gen) + 1).to(torch.int32)
    rows = [4, 1, 2]
    for i, row in enumerate(rows):
        req_to_token[row] = perm[i * max_len : (i + 1) * max_len]
    runner = _draft_forward(path, req_to_token, num_slots)
    if graphs:
        runner.graphs = DeviceGraphs(torch.device("cpu"), True, emulate=True)
    trees = _KeptTrees()
    drafting = Drafting(runner, trees, RequestProgress(), PhaseTimer(enabled=False))
    reqs = [SimpleNamespace(rid=f"r{i}") for i in range(3)]
    tokens = [torch.randint(0, V, (max_len + 1,), generator=gen).tolist() for _ in reqs]
    aux = [torch.randn(max_len, 3 * H, generator=gen) for _ in reqs]
    prompts = [5, 9, 3]
    for req, toks, n in zip(reqs, tokens, prompts, strict=True):
        req.origin_input_ids, req.output_ids = toks[:n], []
    batch = SimpleNamespace(
        reqs=reqs, req_pool_indices_cpu=torch.tensor(rows), prefix_lens=[0, 0, 0], extend_lens=prompts
    )
    sampled = torch.tensor([toks[n] for toks, n in zip(tokens, prompts, strict=True)])
    drafting.after_extend(batch, torch.cat([a[:n] for a, n in zip(aux, prompts, strict=True)]), sampled)
    committed = list(prompts)
    batch = SimpleNamespace(reqs=reqs, req_pool_indices_cpu=torch.tensor(rows))
    # (tree size, accepted tokens per request root included, depths drafted for the next step or None)
    for size, accepted, depths in (
        (6, [3, 1, 6], 4),
        (4, [1, 2, 1], None),
        (4, [2, 1, 1], None),
        (5, [1, 4, 2], 9),
        (3, [3, 3, 1], 3),
        (6, [2, 5, 1], 4),
        (4, [4, 1, 3], 9),
    ):
        bs = len(reqs)
        predict = torch.randint(0, V, (bs * size,), generator=gen)
        taps = torch.randn(bs * size, 3 * H, generator=gen)
        accept_index = torch.full((bs, size), -1, dtype=torch.int32)
        for i, n in enumerate(accepted):
            # the root (node 0) then n - 1 other nodes of the tree, in tree order
            nodes = [0, *sorted(torch.randperm(size - 1, generator=gen)[: n - 1].add(1).tolist())]
            flat = [i * size + j for j in nodes]
            accept_index[i, :n] = torch.tensor(flat, dtype=torch.int32)
            for k, node in enumerate(flat):
                predict[node] = tokens[i][committed[i] + k + 1]  # the accepted token after the node
                taps[node] = aux[i][committed[i] + k]
        step = VerifiedStep(
            committed=torch.tensor(committed),
            roots=torch.tensor([tokens[i][committed[i]] for i in range(bs)]),
            predict=predict,
            accept_lens=torch.tensor(accepted, dtype=torch.int32),
            accept_index=accept_index,
        )
        host = drafting.settle(drafting.after_verify(batch, taps, step, depths))
        assert host.lens == accepted
        for i, n in enumerate(accepted):
            assert host.new_tokens(i) == tokens[i][committed[i] + 1 : committed[i] + n + 1]
        committed = [c + n for c, n in zip(committed, accepted, strict=True)]
        if depths is None:
            assert trees.logits is None
            continue
        for i in range(bs):
            with torch.no_grad():
                expected = drafter(
                    aux[i][: committed[i]], torch.tensor(tokens[i][1 : committed[i] + 1]), start_pos=0
                ).logits
            rows_drafted = min(depths, expected.shape[0])
            assert trees.logits.shape[1] == rows_drafted
            torch.testing.assert_close(trees.logits[i], expected[:rows_drafted], atol=1e-4, rtol=1e-4)
        trees.logits = None
    if graphs:  # later steps of a shape replayed the first one's graph
        names = {key[0] for key in runner.graphs.graphs}
        assert "path-residuals" in names and any(name.startswith("block-head") for name in names)


def test_a_block_step_on_an_accelerator_reads_nothing_back_and_mixes_no_devices(tmp_path):
    """The block step after a verify on the meta device: the residual store and the draft forward run from
    the verify's results there, and hand the attention backend an extend batch of equal blocks."""
    req_to_token = torch.zeros(4, 40, dtype=torch.int32, device="meta")
    runner = _draft_forward(_write_checkpoint(tmp_path / "draft"), req_to_token, 200, _RecordingBackend)
    cfg = runner.model.cfg
    meta = {"device": "meta"}
    rows = torch.zeros(2, dtype=torch.int64, **meta)
    committed = torch.zeros(2, dtype=torch.int64, **meta)
    path_nodes = torch.zeros(2, 4, dtype=torch.int32, **meta)
    accept_lens = torch.zeros(2, dtype=torch.int32, **meta)
    runner.store_path_residuals(rows, committed, path_nodes, accept_lens, torch.zeros(8, 3 * H, **meta))
    predict = torch.zeros(8, dtype=torch.int64, **meta)
    roots = torch.zeros(2, dtype=torch.int64, **meta)
    logits = runner.block_step(rows, [7, 12], committed, path_nodes, accept_lens, predict, roots, depths=3)
    assert logits.device.type == "meta" and logits.shape == (2, 3, cfg.draft_vocab_size)
    batch = runner.draft_runner.attn_backend.batch
    width = 4 + 1 + 2
    assert batch.extend_prefix_lens_cpu == [6, 11] and batch.extend_seq_lens_cpu == [width, width]
    assert batch.seq_lens_cpu.tolist() == [6 + width, 11 + width] and batch.extend_num_tokens == 2 * width
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "positions", "extend_seq_lens"):
        assert getattr(batch, name).device.type == "meta", name


def test_drafting_after_a_verify_on_an_accelerator_reads_nothing_back(tmp_path):
    """The whole drafting phase after a verify (the residual store, a flush of deferred entries, the
    block step, the candidates) on the meta device, where any read back raises: everything stays on the
    device until the next step settles it."""
    req_to_token = torch.zeros(4, 40, dtype=torch.int32, device="meta")
    runner = _draft_forward(_write_checkpoint(tmp_path / "draft"), req_to_token, 200, _RecordingBackend)
    drafting = Drafting(runner, _KeptTrees(), RequestProgress(), PhaseTimer(enabled=False))
    reqs = [SimpleNamespace(rid="a"), SimpleNamespace(rid="b")]
    for req, committed in zip(reqs, (9, 14), strict=True):
        drafting.progress.start(req, committed, list(range(committed + 1)))
    drafting.pending = {"a": 3}  # entries 3..7 of "a" deferred by earlier root-only steps
    batch = SimpleNamespace(reqs=reqs, req_pool_indices_cpu=torch.tensor([1, 3]))
    meta = {"device": "meta"}
    step = VerifiedStep(
        committed=torch.zeros(2, dtype=torch.int64, **meta),
        roots=torch.zeros(2, dtype=torch.int64, **meta),
        predict=torch.zeros(8, dtype=torch.int32, **meta),
        accept_lens=torch.zeros(2, dtype=torch.int32, **meta),
        accept_index=torch.zeros(2, 4, dtype=torch.int32, **meta),
    )
    unsettled = drafting.after_verify(batch, torch.zeros(8, 3 * H, **meta), step, depths=3)
    assert unsettled.depths == 3 and unsettled.path_width == 4  # an accelerator's blocks: whole trees
    assert unsettled.candidates_shape == (2, 2, 3, 1)


def test_shapes_to_capture_cover_what_a_schedule_can_run():
    """Verifying the planned size comes first, for every batch size; then a size planned for a larger
    batch (requests left since) and the root alone; a batch whose plan is the root drafts nothing."""
    schedule = TreeSizeSchedule.parse("1:8,3:4,5:1", 8)
    shapes = shapes_to_capture(schedule.possible_sizes, 6)
    assert shapes[:6] == [(1, 8, 7), (2, 8, 7), (3, 4, 3), (4, 4, 3), (5, 1, None), (6, 1, None)]
    assert set(shapes[6:]) == {(1, 4, 7), (1, 1, 7), (2, 4, 7), (2, 1, 7), (3, 1, 3), (4, 1, 3)}
    fixed = shapes_to_capture(TreeSizeSchedule.fixed(16).possible_sizes, 3)
    assert fixed == [(1, 16, 15), (2, 16, 15), (3, 16, 15), (1, 1, 15), (2, 1, 15), (3, 1, 15)]


def test_graphs_captured_before_serving_are_the_ones_serving_replays(tmp_path):
    """Drafting rehearsed on made-up inputs before any request (`capture_ahead`) captures the graphs that
    verifies of the planned tree size then replay: steps typed as SGLang's verify results capture nothing
    more, and their drafts are the single-request drafter's (the rehearsals wrote only where nothing
    lives)."""
    path = _write_checkpoint(tmp_path / "draft")
    drafter = load_drafter(path, _embedding(), H, V, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    max_len, num_slots, size = 50, 400, 4
    req_to_token = torch.zeros(4, max_len, dtype=torch.int32)
    perm = (torch.randperm(num_slots - 1, generator=gen) + 1).to(torch.int32)
    rows = [3, 1]
    for i, row in enumerate(rows):
        req_to_token[row] = perm[i * max_len : (i + 1) * max_len]
    runner = _draft_forward(path, req_to_token, num_slots)
    runner.graphs = DeviceGraphs(torch.device("cpu"), True, emulate=True)
    trees = _KeptTrees()
    drafting = Drafting(runner, trees, RequestProgress(), PhaseTimer(enabled=False))
    count = drafting.capture_ahead(TreeSizeSchedule.fixed(size).possible_sizes, 2, (3 * H, torch.float32))
    assert count == 2 * 3 + 2 * 3  # per batch size: residuals, inputs and head, verifying 4 nodes or 1

    reqs = [SimpleNamespace(rid=f"r{i}") for i in range(2)]
    tokens = [torch.randint(0, V, (max_len + 1,), generator=gen).tolist() for _ in reqs]
    aux = [torch.randn(max_len, 3 * H, generator=gen) for _ in reqs]
    prompts = [6, 4]
    for req, toks, n in zip(reqs, tokens, prompts, strict=True):
        req.origin_input_ids, req.output_ids = toks[:n], []
    batch = SimpleNamespace(
        reqs=reqs, req_pool_indices_cpu=torch.tensor(rows), prefix_lens=[0, 0], extend_lens=prompts
    )
    sampled = torch.tensor([toks[n] for toks, n in zip(tokens, prompts, strict=True)])
    drafting.after_extend(batch, torch.cat([a[:n] for a, n in zip(aux, prompts, strict=True)]), sampled)
    committed = list(prompts)
    batch = SimpleNamespace(reqs=reqs, req_pool_indices_cpu=torch.tensor(rows))
    for accepted in ([2, 1], [4, 3], [1, 1], [3, 4]):
        predict = torch.randint(0, V, (2 * size,), generator=gen, dtype=torch.int32)
        taps = torch.randn(2 * size, 3 * H, generator=gen)
        accept_index = torch.full((2, size), -1, dtype=torch.int32)
        for i, n in enumerate(accepted):  # a chain: nodes 0 .. n - 1
            accept_index[i, :n] = torch.arange(i * size, i * size + n, dtype=torch.int32)
            for k in range(n):
                predict[i * size + k] = tokens[i][committed[i] + k + 1]
                taps[i * size + k] = aux[i][committed[i] + k]
        step = VerifiedStep(
            committed=torch.tensor(committed),
            roots=torch.tensor([tokens[i][committed[i]] for i in range(2)]),
            predict=predict,
            accept_lens=torch.tensor(accepted, dtype=torch.int32),
            accept_index=accept_index,
        )
        drafting.settle(drafting.after_verify(batch, taps, step, size - 1))
        committed = [c + n for c, n in zip(committed, accepted, strict=True)]
        for i in range(2):
            with torch.no_grad():
                expected = drafter(
                    aux[i][: committed[i]], torch.tensor(tokens[i][1 : committed[i] + 1]), start_pos=0
                ).logits
            torch.testing.assert_close(trees.logits[i], expected[: size - 1], atol=1e-4, rtol=1e-4)
    assert len(runner.graphs.graphs) == count
