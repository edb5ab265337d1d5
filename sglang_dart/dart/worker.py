"""The DART speculative worker for SGLang's batched scheduler (spec V2, with or without overlap scheduling:
each request's tokens are read from the worker's own record, `progress.py`, never from the request, which
overlap scheduling updates one step late).

Per decode step, for the whole running batch: one Rust pruner call turns the draft candidates kept from
the previous step into trees of this step's size, one target verify forward (tree mask, taps captured),
greedy/target-only acceptance and KV bookkeeping by SGLang's own helpers, then one batched draft forward
over the accepted tokens + mask slots (laid out on the device) and one top-k + softmax. Nothing is read
back during the step: its results and candidates reach the host at the next step's start (`_settle`),
which then prunes. A prefill runs the target, then the draft over the prompt, so every request enters
decoding with candidates.

The tree size follows the batch size (`tree_sizes.py`) or measured throughput (`adaptive_sizes.py`); the
next step's size is chosen at the end of a step, which runs the draft forward only for a tree. All requests
of a step verify the same number of tokens, at most `--speculative-num-draft-tokens`, root first, with an
ancestor mask, on SGLang's NGRAM verify path (DART reports `is_ngram()`), whose result processing reads
the stride from each step's result.
At size 1 a step verifies the root alone: it runs as SGLang's own decode forward and sampler (or as a
size-1 verify with decode graphs, logprobs or a grammar) and skips the draft forward; the residuals of the
accepted tokens are still stored (their draft K/V is deferred, `drafting.py`), so drafting can resume at
any later step.

The step's phases live apart: `trees.py` (candidates, the pruner call, the verify input), `drafting.py`
(the draft forward through SGLang's draft model runner); this module orchestrates them, verifies and
accepts.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

import torch
from sglang.srt.environ import envs
from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.draft_worker_common import build_draft_tp_worker
from sglang.srt.speculative.eagle_utils import eagle_sample
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.ngram_worker import NGRAMWorker
from sglang.srt.speculative.spec_utils import (
    move_accept_tokens_to_target_kvcache,
    record_stream_for_v2_verify,
)
from sglang.srt.utils.async_probe import sanitize_nan_logits

from sglang_dart.attention.tree_attention import upload
from sglang_dart.cpu import small_step_threads
from sglang_dart.cpu.greedy_walk import greedy_walk, walks_on_host
from sglang_dart.dart import host_reads
from sglang_dart.dart.adaptive_sizes import GuardedTreeSizes, StepClock
from sglang_dart.dart.device_graphs import DeviceGraphs
from sglang_dart.dart.drafting import DraftForward, Drafting, UnsettledStep, VerifiedStep
from sglang_dart.dart.penalties import apply_node_penalties, penalized
from sglang_dart.dart.phase_timer import PhaseTimer
from sglang_dart.dart.progress import RequestProgress
from sglang_dart.dart.request_acceptance import COPYING_MATCH
from sglang_dart.dart.sampling import (
    apply_custom_processors,
    needs_pinning,
    pin_logits_to_samples,
)
from sglang_dart.dart.settings import (
    DartArgsError,
    candidates_per_depth,
    check_draft_architecture,
    context_nodes,
    cpu_has_amx_bf16,
    cpu_has_avx512_bf16,
    draft_graphs_choice,
    draft_server_args,
    pruner_config,
    refuse_larger_store_vocabulary,
    slow_half_precision_hint,
    tree_size_schedule,
)
from sglang_dart.dart.tree_sizes import PlannedSize
from sglang_dart.dart.trees import Trees
from sglang_dart.drafter import DraftConfig
from sglang_dart.drafter.sglang_model import LlamaForCausalLMDart
from sglang_dart.ngram import NgramStore, tokenizer_fingerprint

logger = logging.getLogger(__name__)

# SGLANG_DART_CHECKS=1 (the tests set it): assert bookkeeping invariants every step; a broken one ends the
# server instead of quietly degrading the drafts (which would cost speed, never correctness).
CHECKS_ENV = "SGLANG_DART_CHECKS"
TARGET_WEIGHTS_UPDATED = (
    "Succeeded to update model weights (the target's; the DART drafter keeps its own checkpoint)."
)


def _rids(reqs: list[Any]) -> list[str]:
    return [req.rid for req in reqs]


def _check_roots_follow_the_cache(
    reqs: list[Any], progress: RequestProgress, seq_lens_cpu: Any, overlap: bool
) -> None:
    """The scheduler's KV lengths (a host tensor, read with numpy: no device read) are the committed
    lengths the worker tracks, where the draft state of this step's tokens starts; the requests' own
    tokens lag those only with overlap scheduling, by at most the last step."""
    for req, kv_len in zip(reqs, seq_lens_cpu.numpy(), strict=True):
        committed = progress.of(req).committed
        if committed != int(kv_len):
            raise AssertionError(
                f"DART: request {req.rid} has {committed + 1} tokens but a committed KV length of {kv_len}"
            )
        unseen = progress.unseen(req)  # raises past the one step the worker keeps
        if unseen and not overlap:
            raise AssertionError(f"DART: request {req.rid} lacks {len(unseen)} tokens without overlap")


class DartWorker(NGRAMWorker):
    def __init__(self, server_args: Any, gpu_id: int, ps: Any, nccl_port: int, target_worker: Any) -> None:
        BaseSpecWorker.__init__(self)  # not NGRAMWorker's: DART has no suffix corpus
        self.server_args = server_args
        self.enable_overlap = not server_args.disable_overlap_schedule
        self.timer = PhaseTimer()  # SGLANG_DART_PROFILE=1: per-phase step times in the log
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.tp_rank = ps.tp_rank
        self.page_size = server_args.page_size
        self._rl_on_policy = server_args.rl_on_policy_target is not None  # changes seeded draws
        self.device = server_args.device
        self.draft_token_num = server_args.speculative_num_draft_tokens
        self.speculative_num_draft_tokens = self.draft_token_num
        self.speculative_num_steps = server_args.speculative_num_steps
        self.topk = server_args.speculative_eagle_topk  # 1: see settings; the pruner's k is below
        self.adaptive_controller = None
        self.grammar_tree_host = None  # NGRAM's; DART keeps every step's trees in `trees.host` instead

        model, model_config = self.model_runner.model, self.model_runner.model_config
        if not hasattr(model, "set_eagle3_layers_to_capture"):
            raise DartArgsError(f"target {type(model).__name__} cannot expose hidden states to the drafter")
        model.set_eagle3_layers_to_capture()  # taps entering layers 2, L//2, L-3: DART's
        vocab, hidden = model_config.vocab_size, model_config.hidden_size
        if vocab >= 1 << 24:  # draft candidates cross to the host as float32 ids (`Trees.keep`)
            raise DartArgsError(f"DART supports vocabularies below 2**24 tokens, not {vocab}")
        embed = model.model.embed_tokens.weight[:vocab]
        self.draft_model = self._load_draft_model(server_args, gpu_id, ps, nccl_port, embed, hidden, vocab)
        self.drafter = self.draft_model.drafter
        self.store = NgramStore(server_args.speculative_ngram_external_corpus_path)
        self._check_store(target_worker.tokenizer, vocab)
        self.tree_sizes = tree_size_schedule(server_args, self.model_runner.dtype)
        logger.info("DART tree size by batch size: %s", self.tree_sizes.describe())
        hint = slow_half_precision_hint(
            self.device,
            str(self.model_runner.dtype),
            cpu_has_amx_bf16(),
            cpu_has_avx512_bf16(),
            small_step_threads.rust_takes_the_linears(self.model_runner),
        )
        if hint:
            logger.warning(hint)
        self.step_clock = StepClock()  # step times for an adaptive schedule
        self._planned: PlannedSize | None = None  # chosen when the step before drafted (or did not)
        self._step_probe = False  # whether the running step is a probe its schedule planned
        chain_nodes = context_nodes(server_args)
        # the requests' tokens as the worker left them (overlap lags), and their context index
        self.progress = RequestProgress(index_context=chain_nodes > 0)
        eos = getattr(model_config, "hf_eos_token_id", None) or []
        self.trees = Trees(
            self.drafter,
            self.store,
            pruner_config(server_args),
            sorted({int(t) for t in (eos if not isinstance(eos, int) else [eos])}),
            vocab,
            candidates_per_depth(),
            self.device,
            self.progress,
            self.timer,
            chain_nodes,
            model_config.context_len,
        )
        self.drafting: Drafting | None = None  # once SGLang has allocated the pools
        self.checks = os.environ.get(CHECKS_ENV) == "1"
        self._draft_graphs = draft_graphs_choice()  # checked at start-up, used once graphs are set up
        self._unsettled: tuple[UnsettledStep, float, int, bool] | None = None  # see `_settle`
        self._step_kind = "prefill"  # what the last step was, for the host-read budget

    def _check_store(self, tokenizer: Any, vocab: int) -> None:
        path = self.server_args.speculative_ngram_external_corpus_path
        refuse_larger_store_vocabulary(self.store.vocab_size, vocab, path)
        if tokenizer is None:
            return
        if self.store.tokenizer_fingerprint == 0:  # e.g. imported from a reference .trie without one
            logger.warning("3-gram store %s records no tokenizer fingerprint; not checked", path)
        elif self.store.tokenizer_fingerprint != tokenizer_fingerprint(tokenizer):
            raise DartArgsError(f"3-gram store {path} was built with another tokenizer than the target's")

    def _load_draft_model(
        self,
        server_args: Any,
        gpu_id: int,
        ps: Any,
        nccl_port: int,
        embed: torch.Tensor,
        hidden: int,
        vocab: int,
    ) -> LlamaForCausalLMDart:
        """The drafter, loaded by SGLang's draft worker machinery into a draft `TpModelWorker` whose
        attention backend is the target's (one that verifies trees: `gpu_contracts`)."""
        path = server_args.speculative_draft_model_path
        # Checked before SGLang reads the directory, for an error that names what does not fit.
        cfg = DraftConfig.from_dir(path)
        cfg.check_fits_target(hidden, vocab)
        check_draft_architecture(path)
        prefill_backend, _ = server_args.get_attention_backends()
        # The draft follows the target's context length: its RoPE is computed for any position, so the
        # checkpoint's max_position_embeddings (often below the target's) is no limit.
        with envs.SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN.override(True):
            bundle = build_draft_tp_worker(
                server_args=draft_server_args(server_args, self.model_runner.dtype),
                gpu_id=gpu_id,
                ps=ps,
                nccl_port=nccl_port,
                target_model_config=self.model_runner.model_config,
                algo_label="DART",
                attention_backend_override=server_args.attention_backend or prefill_backend,
            )
        if not isinstance(bundle.draft_model, LlamaForCausalLMDart):  # the registry must have been set up
            raise DartArgsError(f"draft checkpoint {path} loaded as {type(bundle.draft_model).__name__}")
        self._draft_worker = bundle.draft_worker
        self.draft_model_runner = bundle.draft_model_runner
        bundle.draft_model.attach_target(embed, hidden, vocab)
        return bundle.draft_model

    @property
    def draft_worker(self) -> Any:
        return self._draft_worker

    def alloc_memory_pool(
        self,
        memory_pool_config: Any = None,
        req_to_token_pool: Any = None,
        token_to_kv_pool_allocator: Any = None,
    ) -> None:
        """The draft pools, once SGLang has sized the target's: a one-layer KV pool over the same slots
        (plus scratch slots past them, `drafting`) and a request table of the draft's own."""
        target_pool, allocator = self._target_worker.get_memory_pool()
        self.req_to_token_pool, self.token_to_kv_pool_allocator = target_pool, allocator
        self.max_batch_size = self.model_runner.max_running_requests
        target_kv = allocator.get_kvcache()
        num_slots = target_kv.get_key_buffer(0).shape[0]
        config = memory_pool_config or self.model_runner.memory_pool_config
        max_batch = target_pool.req_to_token.shape[0]
        scratch = DraftForward.scratch_slots(max_batch, self.drafter.cfg.draft_length)
        draft_table = ReqToTokenPool(
            size=target_pool.size,
            max_context_len=target_pool.req_to_token.shape[1] + self.drafter.cfg.draft_length + 1,
            device=target_pool.device,
            enable_memory_saver=False,
        )
        self._draft_worker.alloc_memory_pool(
            memory_pool_config=replace(config, max_total_num_tokens=config.max_total_num_tokens + scratch),
            req_to_token_pool=draft_table,
            token_to_kv_pool_allocator=allocator,
        )
        draft_kv = self.draft_model_runner.token_to_kv_pool
        if draft_kv.get_key_buffer(0).shape[0] < num_slots + scratch:
            raise AssertionError("DART: the draft KV pool has no room for its scratch slots")
        forward = DraftForward(
            self.draft_model,
            self.draft_model_runner,
            target_pool.req_to_token,
            scratch_base=num_slots,  # the first slot past the target's
            num_slots=num_slots,
        )
        self.drafting = Drafting(forward, self.trees, self.progress, self.timer)

    def init_attention_backends(self) -> None:
        self._draft_worker.init_attention_backends()

    def init_cuda_graphs(self) -> None:
        """The target's verify graphs are SGLang's own (`gpu_contracts`), captured before this. The draft
        step after a verify has a shape fixed by the batch and tree sizes alone (`draft_block`): where
        SGLang runs graphs, its pieces are captured per shape up to SGLang's largest graph batch
        (`device_graphs`), unless `draft_graphs_choice` says otherwise: the shapes the tree schedule makes
        likely now, before serving, any other at first use."""
        if self.drafting is None:
            return
        runner = getattr(self.model_runner, "decode_cuda_graph_runner", None)
        choice = self._draft_graphs
        emulate = choice == "emulate"
        enabled = (runner is not None or emulate) and choice != "0"
        max_batch = getattr(runner, "max_bs", None)
        graphs = DeviceGraphs(torch.device(self.device), enabled, max_batch=max_batch, emulate=emulate)
        self.drafting.forward.graphs = graphs
        if not enabled:
            logger.info("DART: draft step graphs off")
            return
        started = time.perf_counter()
        rows = self.drafting.forward.req_to_token.shape[0]  # request-table rows: no batch is larger
        largest = min(max_batch or self.server_args.max_running_requests or rows, rows)
        taps = (self.drafter.fc.weight.shape[1], self.model_runner.dtype)
        try:
            count = self.drafting.capture_ahead(self.tree_sizes.possible_sizes, largest, taps)
        except Exception:  # noqa: BLE001 - a rehearsal that fails leaves the shapes to first use
            logger.exception("DART: capturing the draft step's graphs before serving failed")
            count = len(graphs.graphs)
        graphs.serving = True
        logger.info(
            "DART: draft step graphs %s, batch <= %d: %d before serving (%.1f s), others at first use",
            "emulated" if emulate else "captured",
            largest,
            count,
            time.perf_counter() - started,
        )

    def _init_preallocated_tensors(self) -> None:
        """NGRAM's verify buffers are sized for a fixed tree; DART's tree size changes per step, so its
        verify tensors are made per step instead (`_prepare_for_speculative_decoding`)."""

    def clear_cache_pool(self) -> None:
        self._settle()
        self._keep_only([])

    def _keep_only(self, reqs: list[Any]) -> None:
        """Forget every request but these in the per-request state: a decode batch holds every running
        request (DART runs without mixed batches), so any other one finished, was aborted or retracted."""
        self.trees.keep_only(reqs)
        self.tree_sizes.keep_requests(_rids(reqs))

    # SGLang updates the target first, then asks the speculative worker to load the same weights into its
    # draft runners, which DART's drafter cannot take: it is another checkpoint, and the target's
    # embedding table it reads is a view of the target's, updated in place. Its drafts may fit the new
    # target less well; verification keeps the output the new target's.
    def update_weights_from_disk(self, _recv_req: Any) -> tuple[bool, str]:
        return True, TARGET_WEIGHTS_UPDATED

    def update_weights_from_ipc(self, _recv_req: Any) -> tuple[bool, str]:
        return True, TARGET_WEIGHTS_UPDATED

    def add_external_corpus(self, corpus_id: str, token_chunks: list[list[int]]) -> int:
        raise ValueError("DART reads its 3-gram store from --speculative-ngram-external-corpus-path only")

    def remove_external_corpus(self, corpus_id: str) -> None:
        raise ValueError("DART has no runtime corpora")

    def list_external_corpora(self) -> dict[str, int]:
        return {}

    # --- trees ----------------------------------------------------------------------------------------

    def _step_size(self, batch: Any) -> int:
        """This step's tree size: the schedule's for the batch size (or the size the step before planned),
        or 1 when some request has no current candidates. The step is a probe only if it runs the size
        its schedule planned as one."""
        planned = self._planned or self.tree_sizes.plan(len(batch.reqs), _rids(batch.reqs))
        size = self.trees.size_for_step(batch, planned.size)
        self._step_probe = planned.probe and size == planned.size
        return size

    def _prepare_for_speculative_decoding(self, batch: Any, size: int | None = None) -> None:
        if batch.forward_mode.is_decode():
            self.trees.to_verify(batch, self._step_size(batch) if size is None else size)

    def _draft_after_verify(
        self, batch: Any, taps: torch.Tensor, step: VerifiedStep, started: float, size: int
    ) -> None:
        """The drafting phase after a verify: the next step's size is chosen now, and a root-only step
        needs no draft forward (a tree of N nodes past its root is at most N deep). The step's results and
        candidates reach the host at the next step's start (`_settle`)."""
        rids = _rids(batch.reqs)
        self._planned = self.tree_sizes.plan(len(batch.reqs), rids, self._copying(rids))
        depths = self._planned.size - 1 if self._planned.size > 1 else None
        drafted = self.drafting.after_verify(batch, taps, step, depths)
        self._unsettled = (drafted, started, size, self._step_probe)

    def _copying(self, rids: list[str]) -> frozenset[str]:
        """The requests whose latest tokens repeat an earlier passage of their own (the guard runs their
        trees whatever their drafts so far: `request_acceptance.COPYING_MATCH`). None without context
        chains, nor for a schedule that does not weigh requests."""
        context = self.progress.context
        if context is None or not isinstance(self.tree_sizes, GuardedTreeSizes):
            return frozenset()
        lens = context.match_lens(rids, COPYING_MATCH)
        return frozenset(rid for rid, n in zip(rids, lens, strict=True) if n >= COPYING_MATCH)

    def _settle(self) -> None:
        """The last decode step's one read: its results and candidates on the host, and the host's state
        (progress, candidates, step times) updated from them. Done when the next step starts, so that with
        overlap scheduling the scheduler processes the last step's results while the device still runs it,
        as it does for plain decoding; nothing between two steps reads DART's host state."""
        if self._unsettled is None:
            return
        step, started, size, probe = self._unsettled
        self._unsettled = None
        host = self.drafting.settle(step)
        self.step_clock.finish(started, len(step.rows), size, sum(host.lens), step.drafting_seconds, probe)
        self.tree_sizes.record_requests(len(step.rows), size, _rids(step.reqs), host.lens)

    def _verify_trees(
        self, batch: Any, logits_output: Any, verify_input: Any, size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The target's choice at every node, then SGLang's tree walk: (predict, accept_lens, accept_index,
        the logits logprobs must be computed from or None for the verify logits). Everything plain
        decoding applies to a token's logits is applied per node: the grammar, exact penalties, logit
        bias and custom processors; sampled and processed nodes are pinned to their choice."""
        logits = logits_output.next_token_logits
        grammar_mask = self.trees.grammar_mask(batch)
        if grammar_mask is not None:  # before sampling: draws come from the constrained target
            grammar_mask.apply(logits)
        sampling_info = batch.sampling_info
        exact_penalties = penalized(batch.reqs)
        paths = None
        if exact_penalties or sampling_info.has_custom_logit_processor:
            paths = self.trees.node_paths(batch.reqs, size)
        if exact_penalties:  # in place of the relaxed per-request ones SGLang keeps for speculation
            apply_node_penalties(logits, batch.reqs, paths)
            sampling_info = replace(sampling_info, acc_additive_penalties=None, acc_scaling_penalties=None)
        # Logprobs must describe the target's distribution, not the one-hot pinned rows.
        unpinned = None
        if batch.return_logprob and needs_pinning(sampling_info):
            unpinned = logits.clone()
            if paths is not None:
                apply_custom_processors(sampling_info, unpinned, paths)
        pin_logits_to_samples(sampling_info, logits, size, paths, verify_input.positions, self._rl_on_policy)
        if walks_on_host(self.device, sampling_info):
            sanitize_nan_logits(logits, "verify: target model logits")
            bs = len(batch.seq_lens)
            predict, accept_lens, accept_index = greedy_walk(
                logits,
                verify_input.draft_token.reshape(bs, verify_input.draft_token_num),
                verify_input.retrieve_index,
                verify_input.retrieve_next_token,
                verify_input.retrieve_next_sibling,
                verify_input.max_tree_depth,
            )
            return predict, accept_lens, accept_index, unpinned
        scheduler_info, batch.sampling_info = batch.sampling_info, sampling_info
        try:
            predict, accept_lens, accept_index = eagle_sample(verify_input, batch, logits_output, None)
        finally:
            batch.sampling_info = scheduler_info
        return predict, accept_lens, accept_index, unpinned

    # --- one scheduler step ----------------------------------------------------------------------------

    def forward_batch_generation(self, batch: Any, on_publish: Any = None) -> GenerationBatchResult:
        if not self.checks:
            return self._forward(batch, on_publish)
        # Checked runs count DART's own reads of device tensors against the per-step budget
        # (host_reads.py); batches with grammars, penalties, processors or logprobs walk more per node.
        extra = batch.has_grammar or batch.return_logprob or penalized(batch.reqs)
        extra = extra or batch.sampling_info.has_custom_logit_processor
        with host_reads.HostReadCounter() as counter:
            self._settle()
        host_reads.check_budget("settle", counter.reads)
        with host_reads.HostReadCounter() as counter:
            result = self._forward(batch, on_publish)
        if not extra:
            host_reads.check_budget(self._step_kind, counter.reads)
        return result

    def _forward(self, batch: Any, on_publish: Any) -> GenerationBatchResult:
        started = time.perf_counter()
        # With overlap the step runs on SGLang's forward stream while the batch's tensors came from the
        # schedule stream: keep their memory from being recycled before the step's kernels are done.
        record_stream_for_v2_verify(batch, None, torch.get_device_module(self.device).current_stream())
        bs = len(batch.reqs)
        size = self.draft_token_num  # the result stride: this step's tree size after a verify
        if batch.forward_mode.is_decode():
            self.timer.step_start()
            self._settle()
            finished = self.step_clock.start(started)
            if finished is not None:
                self.tree_sizes.record(*finished)
            if self.checks and batch.seq_lens_cpu is not None:
                _check_roots_follow_the_cache(
                    batch.reqs, self.progress, batch.seq_lens_cpu, self.enable_overlap
                )
            step_size = self._step_size(batch)
            if step_size == 1 and self._plain_decode_fits(batch):
                return self._root_only_step(batch, on_publish, started)
            with self.timer.phase("prepare"):
                self._prepare_for_speculative_decoding(batch, step_size)
        else:  # a prefill: the interval to the next decode step is not a decode step's
            self._settle()
            self._step_kind = "prefill"
            self.step_clock.interrupt()
            self.timer.interrupt()
            self._planned = None
        if batch.forward_mode.is_target_verify():
            self._step_kind = "verify"
            size = batch.spec_info.draft_token_num
            committed = batch.seq_lens  # the roots' positions
            with self.timer.phase("verify"):
                result = self.target_worker.forward_batch_generation(batch, is_verify=True)
            logits_output = result.logits_output
            verify_input = batch.spec_info
            taps = logits_output.hidden_states
            with self.timer.phase("accept"):
                predict, accept_lens, accept_index, unpinned = self._verify_trees(
                    batch, logits_output, verify_input, size
                )
                new_seq_lens = batch.seq_lens + accept_lens
                accept_tokens = predict[accept_index].flatten()
                move_accept_tokens_to_target_kvcache(
                    batch, accept_index, accept_lens - 1, self.token_to_kv_pool_allocator
                )
            if batch.return_logprob:
                if unpinned is not None:
                    logits_output.next_token_logits = unpinned
                compute_spec_v2_logprobs(batch, logits_output, predict, accept_index, size - 1)
            if on_publish is not None:
                on_publish(new_seq_lens)
            # Drafting reads the step's results on the device; they cross to the host with the next
            # candidates, in one transfer.
            verified_step = VerifiedStep(
                committed=committed,
                roots=verify_input.draft_token.view(bs, size)[:, 0],
                predict=predict,
                accept_lens=accept_lens,
                accept_index=accept_index,
            )
            self._draft_after_verify(batch, taps, verified_step, started, size)
            self._keep_only(batch.reqs)
            batch.forward_mode = ForwardMode.DECODE
            next_token_ids = accept_tokens
            verified = size
            # The batch keeps its spec input across filters and merges with freshly prefilled requests,
            # which reshape it by its own draft_token_num: keep that at the server's N.
            accept_tokens = self._widen(accept_tokens.view(bs, size)).flatten()
            self.timer.step_done(bs)
        else:
            result = self.target_worker.forward_batch_generation(
                batch, capture_hidden_mode=CaptureHiddenMode.FULL
            )
            logits_output = result.logits_output
            next_token_ids = result.next_token_ids
            new_seq_lens = batch.seq_lens.clone()
            accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
            accept_tokens = self._widen(next_token_ids.view(bs, 1).to(torch.int32)).flatten()
            verified = None  # a prefill verifies nothing
            if on_publish is not None:
                on_publish(new_seq_lens)
            if bs:
                self.drafting.after_extend(batch, logits_output.hidden_states, next_token_ids)
            self.timer.prefill_done(time.perf_counter() - started)

        return self._step_result(
            result, next_token_ids, accept_tokens, accept_lens, new_seq_lens, size, verified
        )

    def _step_result(
        self,
        result: GenerationBatchResult,
        next_token_ids: torch.Tensor,
        accept_tokens: torch.Tensor,
        accept_lens: torch.Tensor,
        new_seq_lens: torch.Tensor,
        size: int,
        verified: int | None,
    ) -> GenerationBatchResult:
        """What the scheduler's spec-v2 result processing reads: accept_tokens padded to the server's
        stride N, and this step's tree size as the stride it walks them with. `verified` (the tokens each
        request verified, None after a prefill) goes in SGLang's `cap_lens`, its per-request count for
        verifies of varying size: it feeds `spec_cap_length` and the exact drafted counts (`spec_counts`)."""
        cap_lens = None if verified is None else torch.full_like(accept_lens, verified)
        return GenerationBatchResult(
            logits_output=result.logits_output,
            next_token_ids=next_token_ids,
            can_run_cuda_graph=result.can_run_cuda_graph,
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=NgramVerifyInput(
                draft_token_num=self.draft_token_num,
                new_seq_lens=new_seq_lens,
                accept_tokens=accept_tokens,
                accept_lens=accept_lens,
            ),
            speculative_num_draft_tokens=size,
            cap_lens=cap_lens,
        )

    def _plain_decode_fits(self, batch: Any) -> bool:
        """Whether a root-only step can run as a plain decode forward. Not with decode graphs: a spec
        server captures them for verify batches, and a decode batch of the same size would replay one.
        Not with a grammar or logprobs, which the verify path handles, nor with penalties: SGLang's
        penalizers count one token per speculative step, the verify path counts every output token."""
        graphs = getattr(self.model_runner, "decode_cuda_graph_runner", None)
        verify_only = batch.has_grammar or batch.return_logprob or penalized(batch.reqs)
        return graphs is None and not verify_only

    def _root_only_step(self, batch: Any, on_publish: Any, started: float) -> GenerationBatchResult:
        """A step that verifies the roots alone is a plain decode step: run it as SGLang's own DECODE
        forward and sampler (no tree plumbing, no acceptance walk, no KV moves: the root's KV lands in its
        final slot), capturing the taps so the draft state stays complete. Grammar-constrained and
        logprob batches take the size-1 verify path instead, where the worker applies the grammar mask and
        computes logprobs in the layout spec decoding reports them in."""
        self._step_kind = "root-only"
        bs = len(batch.reqs)
        committed = batch.seq_lens
        roots = self.progress.roots(batch.reqs)
        with self.timer.phase("prepare"):
            roots_d = upload(torch.tensor(roots, dtype=torch.int64), self.device)
            batch.input_ids = roots_d
            req_to_token = batch.req_to_token_pool.req_to_token
            root_slots = req_to_token[batch.req_pool_indices, committed].to(torch.int64)
            batch.out_cache_loc = root_slots
            # Decode counts the new token in seq_lens; the scheduler restores the batch after the step.
            new_seq_lens = committed + 1
            batch.seq_lens = new_seq_lens
            if batch.seq_lens_cpu is not None:
                batch.seq_lens_cpu = batch.seq_lens_cpu + 1
                batch.seq_lens_sum = int(batch.seq_lens_cpu.numpy().sum())  # a host tensor
            if getattr(batch, "orig_seq_lens", None) is not None:
                batch.orig_seq_lens = batch.orig_seq_lens + 1
            batch.spec_info = None  # a plain forward: no tree mask, no draft positions
        with self.timer.phase("verify"):
            result = self.target_worker.forward_batch_generation(
                batch, capture_hidden_mode=CaptureHiddenMode.FULL
            )
        next_token_ids = result.next_token_ids
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        if on_publish is not None:
            on_publish(new_seq_lens)
        # Typed as a verify's results: the draft step's graphs are captured per input shape and dtype.
        tokens = next_token_ids.to(torch.int32)
        index = torch.arange(bs, dtype=torch.int32, device=self.device)
        verified_step = VerifiedStep(
            committed=committed,
            roots=roots_d,
            predict=tokens,
            accept_lens=accept_lens,
            accept_index=index.view(bs, 1),
            root_slots=root_slots,
        )
        self._draft_after_verify(batch, result.logits_output.hidden_states, verified_step, started, 1)
        self._keep_only(batch.reqs)
        self.timer.step_done(bs)
        accept_tokens = self._widen(tokens.view(bs, 1)).flatten()
        return self._step_result(result, next_token_ids, accept_tokens, accept_lens, new_seq_lens, 1, 1)

    def _widen(self, rows: torch.Tensor) -> torch.Tensor:
        """Accepted tokens [bs, size] padded with zeros to the server's stride [bs, N]."""
        if rows.shape[1] == self.draft_token_num:
            return rows
        wide = rows.new_zeros(rows.shape[0], self.draft_token_num)
        wide[:, : rows.shape[1]] = rows
        return wide
