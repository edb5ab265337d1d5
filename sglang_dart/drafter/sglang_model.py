"""The DART draft layer as an SGLang model class (`LlamaForCausalLMDart`, the published drafters'
architecture name), so SGLang's own draft worker machinery loads it: `build_draft_tp_worker` reads the
checkpoint's config.json, SGLang's loader streams model.safetensors into `load_weights`, and the draft
model runner gives it a one-layer KV pool sized from SGLang's memory plan and an attention backend.

The layer's math stays in `DartDrafter` (shared with training); this class adds what serving needs: a
`RadixAttention` so the draft attention runs through whichever backend the draft model runner built
(FlashInfer or triton on CUDA, the tree-mask backend on CPU), and the checks that the checkpoint fits the
target, whose embedding table the worker hands over after loading (`attach_target`).

The draft step has inputs no token id can carry (fused target taps, learned mask rows), so the worker
drives it through `draft` with a prepared `ForwardBatch` rather than through `ModelRunner.forward`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from torch import nn

from sglang_dart.drafter.config import DraftConfig
from sglang_dart.drafter.model import DartDrafter, check_embedding, checked_state


class LlamaForCausalLMDart(nn.Module):
    def __init__(self, config: Any, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError("DART's draft layer does not support quantization")
        self.config = config
        self.cfg = DraftConfig.from_dict(config.to_dict())
        self.drafter = DartDrafter(self.cfg, embed_tokens=None)
        self.attn = RadixAttention(
            num_heads=self.cfg.num_attention_heads,
            head_dim=self.cfg.head_dim,
            scaling=1.0 / math.sqrt(self.cfg.head_dim),
            num_kv_heads=self.cfg.num_key_value_heads,
            layer_id=0,
            prefix=f"{prefix}attn",
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """SGLang's loader streams the checkpoint here; names are the published ones."""
        tensors = dict(weights)
        state = checked_state(self.cfg, tensors, self.drafter.state_dict(), "checkpoint")
        for name, tensor in state.items():
            target = self.drafter.get_buffer(name) if name == "d2t" else self.drafter.get_parameter(name)
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
        # Once the weights are in place; a later load writes through the views into the stacked weights.
        self.drafter.join_projections()

    def attach_target(
        self, embed_tokens: torch.Tensor, target_hidden_size: int, target_vocab_size: int
    ) -> None:
        """Share the target's embedding table, once the checkpoint is known to fit the target."""
        self.cfg.check_fits_target(target_hidden_size, target_vocab_size)
        check_embedding(embed_tokens, target_hidden_size, target_vocab_size)
        self.drafter.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any, **_: Any) -> Any:
        raise RuntimeError("DART's draft layer runs through DartWorker (LlamaForCausalLMDart.draft)")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        """Attention of the batch's new rows over their cached prefix and themselves, through SGLang's
        backend (which stores the new rows' K/V at `forward_batch.out_cache_loc`); [T, heads * hd]."""
        n = q.shape[0]
        return self.attn(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1), forward_batch)
