"""The DART speculative worker for SGLang's batched scheduler (V2 schema, synchronous).

Per decode step, for the whole running batch: the trees built at the end of the previous step go to one
target verify forward (tree mask, taps captured), greedy/target-only acceptance and KV bookkeeping by
SGLang's own helpers, then one batched draft forward over the accepted tokens + mask slots, one top-k +
softmax, and one Rust pruner call giving next step's trees. A prefill runs the target, then the draft
over the prompt, so every request enters decoding with a tree ready.

The tree handling on the scheduler side is SGLang's NGRAM path (DART reports `is_ngram()`): exactly
`--speculative-num-draft-tokens` tokens per request, root first, with an ancestor mask.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.eagle_utils import eagle_sample
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.ngram_worker import NGRAMWorker, _derive_tree_links
from sglang.srt.speculative.spec_utils import (
    GrammarTree,
    build_grammar_vocab_mask,
    move_accept_tokens_to_target_kvcache,
)

from sglang_dart.dart.draft_runner import DraftRunner
from sglang_dart.dart.phase_timer import PhaseTimer
from sglang_dart.dart.sampling import pin_logits_to_samples
from sglang_dart.dart.settings import DartArgsError, candidates_per_depth, pruner_config
from sglang_dart.drafter import load_drafter
from sglang_dart.ngram import NgramStore, tokenizer_fingerprint
from sglang_dart.pruner import prune_batch

logger = logging.getLogger(__name__)


def _last_tokens(req: Any, n: int) -> list[int]:
    """The last n tokens of prompt + output, without copying the whole sequence."""
    tail = list(req.output_ids[-n:])
    missing = n - len(tail)
    return (list(req.origin_input_ids[-missing:]) if missing else []) + tail


class DartWorker(NGRAMWorker):
    def __init__(self, server_args: Any, gpu_id: int, ps: Any, nccl_port: int, target_worker: Any) -> None:
        BaseSpecWorker.__init__(self)  # not NGRAMWorker's: DART has no suffix corpus
        self.server_args = server_args
        self.enable_overlap = False
        self.timer = PhaseTimer()  # SGLANG_DART_PROFILE=1: per-phase step times in the log
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.tp_rank = ps.tp_rank
        self.page_size = server_args.page_size
        self.device = server_args.device
        self.draft_token_num = server_args.speculative_num_draft_tokens
        self.speculative_num_draft_tokens = self.draft_token_num
        self.speculative_num_steps = server_args.speculative_num_steps
        self.topk = server_args.speculative_eagle_topk  # 1: see settings; the pruner's k is below
        self.candidates = candidates_per_depth()
        self.adaptive_controller = None
        self.grammar_tree_host = None

        model, model_config = self.model_runner.model, self.model_runner.model_config
        if not hasattr(model, "set_eagle3_layers_to_capture"):
            raise DartArgsError(f"target {type(model).__name__} cannot expose hidden states to the drafter")
        model.set_eagle3_layers_to_capture()  # taps entering layers 2, L//2, L-3: DART's
        vocab, hidden = model_config.vocab_size, model_config.hidden_size
        embed = model.model.embed_tokens.weight[:vocab]
        self.drafter = load_drafter(server_args.speculative_draft_model_path, embed, hidden, vocab)
        self.store = NgramStore(server_args.speculative_ngram_external_corpus_path)
        self._check_store(target_worker.tokenizer, vocab)
        self.pruner_config = pruner_config(server_args)
        eos = getattr(model_config, "hf_eos_token_id", None) or []
        self.eos_ids = sorted({int(t) for t in (eos if not isinstance(eos, int) else [eos])})
        self._trees: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.runner: DraftRunner | None = None

    def _check_store(self, tokenizer: Any, vocab: int) -> None:
        path = self.server_args.speculative_ngram_external_corpus_path
        if self.store.vocab_size > vocab:
            raise DartArgsError(
                f"3-gram store {path} has vocabulary {self.store.vocab_size} > target's {vocab}"
            )
        if tokenizer is None:
            return
        if self.store.tokenizer_fingerprint == 0:  # e.g. imported from a reference .trie without one
            logger.warning("3-gram store %s records no tokenizer fingerprint; not checked", path)
        elif self.store.tokenizer_fingerprint != tokenizer_fingerprint(tokenizer):
            raise DartArgsError(f"3-gram store {path} was built with another tokenizer than the target's")

    def alloc_memory_pool(self, **kwargs: Any) -> None:
        super().alloc_memory_pool(**kwargs)
        slots = self.token_to_kv_pool_allocator.get_kvcache().get_key_buffer(0).shape[0]
        self.runner = DraftRunner(self.drafter, self.req_to_token_pool.req_to_token, slots)

    def clear_cache_pool(self) -> None:
        self._trees.clear()

    def add_external_corpus(self, corpus_id: str, token_chunks: list[list[int]]) -> int:
        raise ValueError("DART reads its 3-gram store from --speculative-ngram-external-corpus-path only")

    def remove_external_corpus(self, corpus_id: str) -> None:
        raise ValueError("DART has no runtime corpora")

    def list_external_corpora(self) -> dict[str, int]:
        return {}

    # --- trees -----------------------------------------------------------------------------------------

    def _prepare_draft_tokens(self, batch: Any) -> tuple[np.ndarray, np.ndarray]:
        trees = [self._trees.get(req.rid) or self._fallback_tree(req) for req in batch.reqs]
        tokens = np.stack([t for t, _ in trees]).astype(np.int64).reshape(-1)
        masks = np.stack([m for _, m in trees]).reshape(-1)
        return tokens, masks

    def _fallback_tree(self, req: Any) -> tuple[np.ndarray, np.ndarray]:
        """Every request gets its tree at prefill, so this should not happen; if it does, verify a chain that
        repeats the root (still lossless, merely unlikely to be accepted) instead of failing the batch."""
        logger.warning("DART: no draft tree for request %s; verifying a placeholder chain", req.rid)
        n = self.draft_token_num
        root = _last_tokens(req, 1)[0]
        return np.full(n, root, dtype=np.int64), np.tril(np.ones((n, n), dtype=bool))

    def _grammar_mask(self, batch: Any) -> Any:
        """Per-node vocabulary mask of grammar-constrained requests, walked over this step's trees (set
        up by NGRAMWorker's preparation, which stages the host trees when the batch has a grammar)."""
        if not batch.has_grammar or self.grammar_tree_host is None:
            return None
        mask, req_drafts = self.grammar_tree_host
        bs = len(batch.reqs)
        next_token, next_sibling = _derive_tree_links(mask, bs, self.draft_token_num)
        drafts = torch.from_numpy(req_drafts).to(torch.int64).view(bs, -1)
        return build_grammar_vocab_mask(
            reqs=batch.reqs,
            tree=GrammarTree.from_host(next_token, next_sibling, drafts),
            sampling_info=batch.sampling_info,
            device=batch.seq_lens.device,
            barrier=None,
        )

    def _prepare_for_speculative_decoding(self, batch: Any) -> None:
        super()._prepare_for_speculative_decoding(batch)
        if batch.forward_mode.is_target_verify():
            batch.spec_info.capture_hidden_mode = CaptureHiddenMode.FULL  # the drafter reads the taps

    def _build_trees(
        self, batch: Any, logits: torch.Tensor, roots: list[int], contexts: list[list[int]]
    ) -> None:
        with self.timer.phase("topk"):
            top = torch.topk(logits.float(), self.candidates, dim=-1)
            probs = torch.softmax(top.values, dim=-1)  # the softmax over the top-k, as the reference
            tokens = self.drafter.draft_to_target(top.indices).cpu().numpy()
            probs = probs.cpu().numpy()
        with self.timer.phase("prune"):
            trees = prune_batch(
                tokens,
                probs,
                np.asarray(roots, dtype=np.int64),
                np.asarray(contexts, dtype=np.int64),
                self.eos_ids,
                config=self.pruner_config,
                store=self.store,
                vocab_size=self.model_runner.model_config.vocab_size,
            )
        for i, req in enumerate(batch.reqs):
            self._trees[req.rid] = (trees.tokens[i], trees.tree_mask[i])

    def _draft_after_extend(self, batch: Any, taps: torch.Tensor, sampled: torch.Tensor) -> None:
        runner = self.runner
        rpi = batch.req_pool_indices
        firsts, lasts, nexts, roots, contexts, slots = [], [], [], [], [], []
        sampled_ids = sampled.tolist()
        for i, req in enumerate(batch.reqs):
            prefix, extend = int(batch.prefix_lens[i]), int(batch.extend_lens[i])
            end = prefix + extend
            slots.append(runner.req_to_token[rpi[i], prefix:end])
            seq = list(req.origin_input_ids) + list(req.output_ids)
            after = seq[end] if end < len(seq) else sampled_ids[i]  # next prompt token, or the first output
            tail = seq[:end] + [after]
            first = max(prefix - 1, 0)
            firsts.append(first)
            lasts.append(end - 1)
            nexts.extend(tail[first + 1 : end + 1])
            roots.append(after)
            contexts.append(([-1, -1] + tail)[-3:-1])
        # The taps rows are the extend tokens of every request, in batch order: one fused write for all.
        slot_rows = torch.cat(slots).to(torch.int64)
        with self.timer.phase("draft"):
            runner.store_residuals(slot_rows, taps[: slot_rows.numel()])
            logits = runner.step(rpi, firsts, lasts, torch.tensor(nexts, dtype=torch.int64))
        self._build_trees(batch, logits, roots, contexts)

    def _draft_after_verify(
        self,
        batch: Any,
        taps: torch.Tensor,
        accept_index: torch.Tensor,
        accept_lens: torch.Tensor,
        predict: torch.Tensor,
    ) -> None:
        runner = self.runner
        rpi = batch.req_pool_indices
        drafts = batch.spec_info.draft_token.view(-1)
        firsts, lasts, nexts, roots, contexts, slots, paths = [], [], [], [], [], [], []
        seq_lens = batch.seq_lens.tolist()
        for i, req in enumerate(batch.reqs):
            count = int(accept_lens[i])
            path = accept_index[i, :count].to(torch.int64)  # root, then the accepted drafts
            committed = seq_lens[i]
            slots.append(runner.req_to_token[rpi[i], committed : committed + count])
            paths.append(path)
            new_tokens = drafts[path].tolist()
            bonus = int(predict[path[-1]])
            firsts.append(committed - 1)
            lasts.append(committed + count - 1)
            nexts.extend(new_tokens + [bonus])
            roots.append(bonus)
            history = _last_tokens(req, 2)
            contexts.append(([-1, -1] + history + new_tokens[1:] + [bonus])[-3:-1])
        with self.timer.phase("draft"):
            runner.store_residuals(torch.cat(slots).to(torch.int64), taps[torch.cat(paths)])  # one write
            logits = runner.step(rpi, firsts, lasts, torch.tensor(nexts, dtype=torch.int64))
        self._build_trees(batch, logits, roots, contexts)

    # --- one scheduler step ----------------------------------------------------------------------------

    def forward_batch_generation(self, batch: Any, on_publish: Any = None) -> GenerationBatchResult:
        bs = len(batch.reqs)
        with self.timer.phase("prepare"):
            self._prepare_for_speculative_decoding(batch)
        if batch.forward_mode.is_target_verify():
            with self.timer.phase("verify"):
                result = self.target_worker.forward_batch_generation(batch, is_verify=True)
            logits_output = result.logits_output
            verify_input = batch.spec_info
            taps = logits_output.hidden_states
            with self.timer.phase("accept"):
                grammar_mask = self._grammar_mask(batch)
                if grammar_mask is not None:  # before sampling: draws come from the constrained target
                    grammar_mask.apply(logits_output.next_token_logits)
                # Logprobs must describe the target's distribution, not the one-hot pinned rows.
                unpinned = (
                    logits_output.next_token_logits.clone()
                    if batch.return_logprob and not batch.sampling_info.is_all_greedy
                    else None
                )
                pin_logits_to_samples(
                    batch.sampling_info, logits_output.next_token_logits, self.draft_token_num
                )
                predict, accept_lens, accept_index = eagle_sample(verify_input, batch, logits_output, None)
                new_seq_lens = batch.seq_lens + accept_lens
                accept_tokens = predict[accept_index].flatten()
                move_accept_tokens_to_target_kvcache(
                    batch, accept_index, accept_lens - 1, self.token_to_kv_pool_allocator
                )
            if batch.return_logprob:
                if unpinned is not None:
                    logits_output.next_token_logits = unpinned
                compute_spec_v2_logprobs(
                    batch, logits_output, predict, accept_index, self.draft_token_num - 1
                )
            if on_publish is not None:
                on_publish(new_seq_lens)
            self._draft_after_verify(batch, taps, accept_index, accept_lens, predict)
            self._forget_departed(batch)
            batch.forward_mode = ForwardMode.DECODE
            next_token_ids = accept_tokens
            self.timer.step_done(bs)
        else:
            result = self.target_worker.forward_batch_generation(
                batch, capture_hidden_mode=CaptureHiddenMode.FULL
            )
            logits_output = result.logits_output
            next_token_ids = result.next_token_ids
            new_seq_lens = batch.seq_lens.clone()
            accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
            accept_tokens = torch.zeros(bs, self.draft_token_num, dtype=torch.int32, device=self.device)
            accept_tokens[:, 0] = next_token_ids
            accept_tokens = accept_tokens.flatten()
            if on_publish is not None:
                on_publish(new_seq_lens)
            if bs:
                self._draft_after_extend(batch, logits_output.hidden_states, next_token_ids)

        return GenerationBatchResult(
            logits_output=logits_output,
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
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
        )

    def _forget_departed(self, batch: Any) -> None:
        # A decode batch holds every running request (DART runs without mixed or overlapped batches), so
        # a tree of any other request belongs to one that finished, was aborted or was retracted.
        current = {req.rid for req in batch.reqs}
        for rid in [rid for rid in self._trees if rid not in current]:
            del self._trees[rid]
