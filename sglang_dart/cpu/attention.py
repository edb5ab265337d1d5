"""An SGLang attention backend for CPU that also runs speculative target-verify with a tree mask.

SGLang's own `torch_native` backend handles extend and decode only, and `intel_amx` needs the sgl_kernel
CPU attention ops. This backend keeps torch_native for what only it covers (cross-attention, encoder-only
models, sliding-window KV pools) and runs every other forward, verify included, through
`tree_attention`; encoder-only layers in a target-verify forward (DFLASH's draft block) attend without a
causal mask among the new tokens. The plugin installs it under the `torch_native` name when the sgl_kernel
stand-in is on.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_dart.attention.tree_attention import AttentionPlan, attend, make_plan


class TreeVerifyCpuAttnBackend(TorchNativeAttnBackend):
    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        self._plan: AttentionPlan | None = None
        # Target-verify only: what a non-causal plan of the same forward is made from, and that plan once
        # made (DFLASH's draft runs its ENCODER_ONLY block layers in TARGET_VERIFY mode).
        self._verify_args: tuple | None = None
        self._block_plan: AttentionPlan | None = None

    def init_forward_metadata(self, forward_batch: Any) -> None:
        super().init_forward_metadata(forward_batch)
        self._verify_args = self._block_plan = None
        self._plan = self._make_plan(forward_batch)

    def _make_plan(self, fb: Any) -> AttentionPlan | None:
        mode = fb.forward_mode
        if mode.is_idle() or fb.encoder_lens is not None:
            return None
        if mode.is_target_verify():
            if self.use_sliding_window_kv_pool:
                raise NotImplementedError("target-verify on CPU does not support sliding-window KV pools")
            spec = fb.spec_info
            num_draft = int(spec.draft_token_num)
            query_lens = torch.full((fb.batch_size,), num_draft, dtype=torch.int64)
            self._verify_args = (
                self.req_to_token_pool.req_to_token,
                fb.req_pool_indices,
                fb.seq_lens,
                query_lens,
                fb.out_cache_loc,
            )
            return make_plan(
                self.req_to_token_pool.req_to_token,
                fb.req_pool_indices,
                fb.seq_lens,
                query_lens,
                getattr(spec, "custom_mask", None),
                fb.out_cache_loc,
            )
        if self.use_sliding_window_kv_pool:
            return None  # torch_native translates the SWA slots itself
        if mode.is_decode():
            prefix_lens = fb.seq_lens.to(torch.int64) - 1
            query_lens = torch.ones_like(prefix_lens)
        else:
            prefix_lens, query_lens = fb.extend_prefix_lens, fb.extend_seq_lens
        custom_mask = getattr(fb.spec_info, "custom_mask", None) if fb.spec_info is not None else None
        return make_plan(
            self.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            prefix_lens,
            query_lens,
            custom_mask,
            fb.out_cache_loc,
        )

    def _non_causal_verify_plan(self) -> AttentionPlan:
        """Every new token of a request sees its whole prefix and all of its new tokens: a tree mask of all
        True in the new-tokens-only layout (what `make_plan` reads when the prefix is fully visible)."""
        if self._block_plan is None:
            req_to_token, req_pool_indices, seq_lens, query_lens, out_cache_loc = self._verify_args
            everything = torch.ones(int((query_lens * query_lens).sum()), dtype=torch.bool)
            self._block_plan = make_plan(
                req_to_token, req_pool_indices, seq_lens, query_lens, everything, out_cache_loc
            )
        return self._block_plan

    def _plan_for(self, layer: Any) -> AttentionPlan | None:
        """The plan this layer attends with; None leaves the layer to torch_native (cross-attention, and
        encoder-only layers outside target-verify: encoder models)."""
        if self._plan is None or layer.is_cross_attention:
            return None
        if layer.attn_type == AttentionType.ENCODER_ONLY:
            return self._non_causal_verify_plan() if self._verify_args is not None else None
        return self._plan

    def _forward(
        self, q: torch.Tensor, k: Any, v: Any, layer: Any, fb: Any, save_kv_cache: bool, plan: AttentionPlan
    ) -> torch.Tensor:
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if k is None or v is None:  # the new tokens' KV was written elsewhere: the pool has it
            k = v = None
        elif save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(fb.out_cache_loc, None), k, v)
            k = v = None  # now in the pool, where the plan's key_loc reads it with the prefix in one gather
        else:  # not stored: attend to it as given
            k = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim).to(k_cache.dtype)
            v = v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim).to(v_cache.dtype)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = attend(
            plan,
            q3,
            k,
            v,
            k_cache,
            v_cache,
            scaling=layer.scaling,
            logit_cap=layer.logit_cap,
            sliding_window=layer.sliding_window_size if layer.sliding_window_size is not None else -1,
        )
        return out.reshape(q3.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001
        plan = self._plan_for(layer)
        if plan is None:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, plan)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001
        plan = self._plan_for(layer)
        if plan is None:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, plan)


def create_backend(model_runner: Any) -> TreeVerifyCpuAttnBackend:
    return TreeVerifyCpuAttnBackend(model_runner)
