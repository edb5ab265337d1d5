"""DART's trees: the draft candidates each request keeps between steps, the one Rust pruner call that turns
them into this step's trees, and the TARGET_VERIFY input SGLang verifies them with.

Candidates cross to the host once per draft (top-k ids and probabilities of every request, in the same
transfer as the verify's results after a verify); the trees are built on the host and uploaded. That
round trip is the only host-device crossing DART adds to a step (README, "Host-device traffic").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative import ngram_worker as ngram
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

from sglang_dart.dart.phase_timer import PhaseTimer
from sglang_dart.dart.progress import Progress, RequestProgress, forget_all_but
from sglang_dart.dart.sampling import node_paths
from sglang_dart.dart.verify_mask import verify_inputs
from sglang_dart.drafter import DartDrafter
from sglang_dart.ngram import NgramStore
from sglang_dart.pruner import PrunedTrees, PrunerConfig, prune_batch


@dataclass(frozen=True)
class DraftCandidates:
    """One request's draft output, kept for the next step's pruner: the target ids and probabilities of the
    top-k per depth, and where the request stood (its root, the two tokens before it, the root's
    position)."""

    tokens: np.ndarray  # [D, k] int64
    probs: np.ndarray  # [D, k] float32
    at: Progress

    def current(self, now: Progress) -> bool:
        return self.at.committed == now.committed and self.at.root == now.root


def tree_links(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First child and next sibling ([bs, N] int64, -1: none) of every node of trees whose nodes come in
    depth-ascending order, root first (`parents` [bs, N], -1 at the root): the links SGLang's tree walk
    follows, children in node order."""
    bs, n = parents.shape
    first_child = np.full((bs, n), -1, dtype=np.int64)
    next_sibling = np.full((bs, n), -1, dtype=np.int64)
    rows = np.arange(bs)
    for node in range(n - 1, 0, -1):  # backwards: a node's first child is the last one recorded
        parent = parents[:, node]
        next_sibling[:, node] = first_child[rows, parent]
        first_child[rows, parent] = node
    return first_child, next_sibling


class HostTrees(NamedTuple):
    """This step's trees as they stay on the host, flat: what the grammar walk and per-node paths read."""

    mask: np.ndarray  # [bs * size * size] bool ancestor masks
    tokens: np.ndarray  # [bs * size] node tokens
    first_child: np.ndarray  # [bs, size] int64 (`tree_links`)
    next_sibling: np.ndarray  # [bs, size] int64


class Trees:
    def __init__(
        self,
        drafter: DartDrafter,
        store: NgramStore,
        config: PrunerConfig,
        eos_ids: list[int],
        vocab_size: int,
        candidates_per_depth: int,
        device: Any,
        progress: RequestProgress,
        timer: PhaseTimer,
        context_nodes: int = 0,
        context_len: int | None = None,
    ) -> None:
        self.drafter = drafter
        self.store = store
        self.config = config
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.candidates_per_depth = candidates_per_depth
        self.device = device
        self.progress = progress
        self.timer = timer
        self.context_nodes = context_nodes if progress.context is not None else 0
        # The target's positions: its RoPE table (and a request's row of KV slots) ends there.
        self.context_len = context_len
        self.candidates: dict[str, DraftCandidates] = {}
        self.host: HostTrees | None = None  # this step's trees

    def size_for_step(self, batch: Any, planned: int) -> int:
        """The planned tree size, or 1 (the root alone) when some request has no current candidates, e.g.
        the step after one that drafted nothing, or when a request's tree could reach past the target's
        context: a tree of N is at most N - 1 deep past its root, and SGLang ends a request before the
        context does, so those nodes could never be kept, while their positions would fall outside the
        target's RoPE table (a CPU scheduler raises there). Only a request's last few tokens lose trees."""
        if planned > 1:
            for req in batch.reqs:
                now = self.progress.of(req)
                cand = self.candidates.get(req.rid)
                if cand is None or not cand.current(now):
                    return 1
                if self.context_len is not None and now.committed + planned > self.context_len:
                    return 1
        return planned

    def build(self, batch: Any, size: int) -> PrunedTrees:
        """This step's trees ([bs, size] nodes): the pruned draft candidates, with each request's context
        chain grafted on (`pruner`)."""
        if size == 1:
            roots = np.asarray(self.progress.roots(batch.reqs), dtype=np.int64).reshape(-1, 1)
            alone = np.zeros_like(roots, dtype=np.int32)
            return PrunedTrees(roots, alone - 1, alone, np.ones((len(roots), 1, 1), dtype=bool))
        cands = [self.candidates[req.rid] for req in batch.reqs]
        # Requests drafted at different steps may have been drafted to different depths.
        depths = min(c.tokens.shape[0] for c in cands)
        chains = None
        if self.context_nodes:  # at most size - 1 deep: a chain may fill the whole tree
            chains = self.progress.context.chains([req.rid for req in batch.reqs], size - 1)
        trees = prune_batch(
            np.stack([c.tokens[:depths] for c in cands]),
            np.stack([c.probs[:depths] for c in cands]),
            np.asarray([c.at.root for c in cands], dtype=np.int64),
            np.asarray([c.at.context for c in cands], dtype=np.int64),
            self.eos_ids,
            config=replace(self.config, num_nodes=size - 1),
            store=self.store,
            vocab_size=self.vocab_size,
            chains=chains,
            chain_nodes=self.context_nodes,
        )
        return trees

    def to_verify(self, batch: Any, size: int) -> None:
        """Turn a decode batch into a TARGET_VERIFY batch over this step's trees (NGRAM's verify layout,
        sized per step instead of per server)."""
        bs = len(batch.reqs)
        with self.timer.phase("prune"):
            trees = self.build(batch, size)
        tokens, mask = trees.tokens.reshape(-1), trees.tree_mask.reshape(-1)
        # SGLang's tree walk reads each node's first child and next sibling; the pruner's parents give them
        # on the host (not re-derived from the ancestor masks on the device, as NGRAM, which has no parents,
        # must). They travel with the tokens, depths and masks in one upload (verify_mask.py).
        first_child, next_sibling = tree_links(trees.parents)
        index = np.arange(bs * size, dtype=np.int64).reshape(bs, size)
        links = np.stack([trees.tokens, trees.depth.astype(np.int64), index, first_child, next_sibling])
        self.host = HostTrees(mask, tokens, first_child, next_sibling)
        # CUDA's attention backends read NGRAM's flat mask, the CPU one the tree masks as they are.
        full = ngram.USE_FULL_MASK and not ngram._is_cpu
        prefix_lens = batch.seq_lens_cpu.numpy() if full else None
        on_device = verify_inputs(links, trees.tree_mask, prefix_lens, self.device)
        draft_tokens, depth, *retrieve = on_device.links.unbind(0)
        draft_tokens = draft_tokens.reshape(-1)
        positions = (batch.seq_lens.to(torch.int64).unsqueeze(1) + depth).reshape(-1)
        custom_mask = on_device.custom_mask

        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = draft_tokens
        batch.out_cache_loc = ngram.assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=batch.seq_lens,
            end_offset=batch.seq_lens + size,
            batch_size=bs,
            draft_token_num=size,
            device=self.device,
        )
        ngram.prepare_mamba_track_for_verify(batch)
        batch.spec_info = NgramVerifyInput(
            draft_token=draft_tokens,
            custom_mask=custom_mask,
            positions=positions,
            retrieve_index=retrieve[0],
            retrieve_next_token=retrieve[1],
            retrieve_next_sibling=retrieve[2],
            draft_token_num=size,
        )
        batch.spec_info.capture_hidden_mode = CaptureHiddenMode.FULL  # the drafter reads the taps

    def grammar_mask(self, batch: Any) -> Any:
        """Per-node vocabulary mask of grammar-constrained requests, walked over this step's trees."""
        if not batch.has_grammar or self.host is None:
            return None
        host = self.host
        drafts = torch.from_numpy(host.tokens).to(torch.int64).view(len(batch.reqs), -1)
        links = torch.from_numpy(host.first_child), torch.from_numpy(host.next_sibling)
        return build_grammar_vocab_mask(
            reqs=batch.reqs,
            tree=GrammarTree.from_host(*links, drafts),
            sampling_info=batch.sampling_info,
            device=batch.seq_lens.device,
            barrier=None,
        )

    def node_paths(self, reqs: list[Any], size: int) -> list[list[list[int]]]:
        """The tokens a request's output lacks at every node of this step's trees: the drafts on the path
        to the node (see `sampling.node_paths`), after any tokens SGLang has not appended to the request yet
        (overlap scheduling), so per-node penalties and processors see the request's whole output."""
        mask, tokens = self.host.mask, self.host.tokens
        bs = len(reqs)
        paths = node_paths(mask.reshape(bs, size, size), tokens.reshape(bs, size))
        for req, request_paths in zip(reqs, paths, strict=True):
            unseen = self.progress.unseen(req)
            if unseen:
                request_paths[:] = [unseen + path for path in request_paths]
        return paths

    def keep(self, reqs: list[Any], logits: torch.Tensor, at: list[Progress]) -> None:
        """Keep the top-k of every draft row as the next step's candidates (draft logits [bs, D, V']),
        read back on their own (a prefill's drafts)."""
        candidates = self.candidates_on_device(logits)
        with self.timer.phase("topk"):
            both = candidates.cpu().numpy()  # the pruner's inputs cross to the host in one transfer
        self.keep_host(reqs, both[0], both[1].astype(np.int64), at)

    def candidates_on_device(self, logits: torch.Tensor) -> torch.Tensor:
        """`candidates_of`, timed as the step's top-k phase."""
        with self.timer.phase("topk"):
            return self.candidates_of(logits)

    def candidates_of(self, logits: torch.Tensor) -> torch.Tensor:
        """[2, bs, D, k] float32: the probabilities (softmax over the top-k, as the reference) and target
        ids of the top-k of every draft row, ready to cross to the host in one transfer. Device work
        alone: a block step's captured head ends with it (`device_graphs`)."""
        # top-k in the draft's dtype: upcasting every row of the draft vocabulary first cost more than the
        # top-k itself; only the k kept values need float32.
        top = torch.topk(logits, self.candidates_per_depth, dim=-1)
        probs = torch.softmax(top.values.float(), dim=-1)
        ids = self.drafter.draft_to_target(top.indices).float()  # exact: vocabularies < 2**24
        return torch.stack([probs, ids])

    def keep_host(self, reqs: list[Any], probs: np.ndarray, tokens: np.ndarray, at: list[Progress]) -> None:
        """Keep candidates read back to the host ([bs, D, k] each) for the next step's pruner."""
        for i, req in enumerate(reqs):
            self.candidates[req.rid] = DraftCandidates(tokens[i], probs[i], at[i])

    def drop(self, reqs: list[Any]) -> None:
        """Forget the candidates of these requests (a step that drafted nothing for them)."""
        for req in reqs:
            self.candidates.pop(req.rid, None)

    def keep_only(self, reqs: list[Any]) -> None:
        """Forget every request but these: a decode batch holds every running request (DART runs without
        mixed batches), so any other one finished, was aborted or was retracted."""
        forget_all_but(self.candidates, {req.rid for req in reqs})
        self.progress.keep_only(reqs)
