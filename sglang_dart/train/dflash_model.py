"""A DFLASH block drafter in plain torch, for training: the same computation as SGLang's `DFlashDraftModel`
(srt/models/dflash.py) serving it, with the same parameter names, so its state dict is the checkpoint.

What it computes for one anchor block (SGLang's draft forward in TARGET_VERIFY mode):
- context: every position p before the block contributes keys and values made from the target's captured
  hidden states there, `ctx = hidden_norm(fc(taps_p))`, projected by each layer's k/v projections (k
  normalised per head, RoPE at p). The context is not layer-normed, and it is the same input to every layer.
- block: the anchor token (the last accepted token) followed by mask tokens, embedded with the target's
  embedding, at positions s .. s+B-1; a Qwen3-style pre-norm decoder (q/k RMSNorm per head) where every
  block token sees the whole context and the whole block (non-causal).
- the final-normed hidden state of block position j >= 1, times the target's LM head, drafts the token at
  s+j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention, silu


@dataclass(frozen=True)
class DFlashShape:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    num_context_features: int  # target layers whose hidden states are concatenated per position
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def from_config(cls, config: dict) -> DFlashShape:
        heads = int(config["num_attention_heads"])
        rope = config.get("rope_parameters") or {}
        layer_ids = config["dflash_config"]["target_layer_ids"]
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            num_layers=int(config["num_hidden_layers"]),
            num_context_features=len(layer_ids),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (halves rotated), as SGLang's default `get_rope`. x: [..., N, heads, D],
    positions: [..., N]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim)
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., N, D/2]
    cos, sin = freqs.cos().unsqueeze(-2), freqs.sin().unsqueeze(-2)  # [..., N, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, shape: DFlashShape) -> None:
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.shape = shape
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps)
        self.k_norm = RMSNorm(d, shape.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., N, H] -> K, V [..., N, kv_heads, D] (K normalised per head and rotated)."""
        s = self.shape
        k = self.k_norm(self.k_proj(x).unflatten(-1, (s.num_kv_heads, s.head_dim)))
        v = self.v_proj(x).unflatten(-1, (s.num_kv_heads, s.head_dim))
        return rope(k, positions, s.rope_theta), v

    def forward(
        self,
        x: torch.Tensor,  # [A, B, H] block hidden states (normed)
        positions: torch.Tensor,  # [A, B]
        ctx: torch.Tensor,  # [T, H] projected context
        ctx_positions: torch.Tensor,  # [T]
        ctx_visible: torch.Tensor,  # [A, T] bool: context position t is before block a
    ) -> torch.Tensor:
        s = self.shape
        num_blocks, block = x.shape[:2]
        q = rope(
            self.q_norm(self.q_proj(x).unflatten(-1, (s.num_heads, s.head_dim))), positions, s.rope_theta
        )
        k_blk, v_blk = self.keys_values(x, positions)
        k_ctx, v_ctx = self.keys_values(ctx, ctx_positions)
        num_ctx = ctx.shape[0]
        k = torch.cat([k_ctx.unsqueeze(0).expand(num_blocks, -1, -1, -1), k_blk], dim=1)
        v = torch.cat([v_ctx.unsqueeze(0).expand(num_blocks, -1, -1, -1), v_blk], dim=1)
        visible = torch.cat([ctx_visible, ctx_visible.new_ones(num_blocks, block)], dim=1)  # [A, T + B]
        mask = visible[:, None, None, :].expand(num_blocks, 1, block, num_ctx + block)
        out = scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2).to(q.dtype),
            v.transpose(1, 2).to(q.dtype),
            attn_mask=mask,
            scale=s.head_dim**-0.5,
            enable_gqa=s.num_heads != s.num_kv_heads,
        )  # [A, heads, B, D]
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class DFlashMLP(nn.Module):
    def __init__(self, shape: DFlashShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, shape: DFlashShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = DFlashAttention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = DFlashMLP(shape)

    def forward(self, x: torch.Tensor, *context: torch.Tensor) -> torch.Tensor:
        positions, ctx, ctx_positions, ctx_visible = context
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx, ctx_positions, ctx_visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Parameters named as SGLang's DFlashDraftModel loads them (`layers.*`, `norm`, `fc`, `hidden_norm`);
    the embedding and LM head are the target's, held outside (frozen) and never saved."""

    def __init__(self, shape: DFlashShape) -> None:
        super().__init__()
        self.shape = shape
        self.layers = nn.ModuleList(DFlashLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.fc = nn.Linear(shape.num_context_features * shape.hidden_size, shape.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def project_context(self, taps: torch.Tensor) -> torch.Tensor:
        """[T, K*H] concatenated target hidden states -> [T, H] context input of every layer."""
        return self.hidden_norm(self.fc(taps))

    def forward(
        self,
        block_embeds: torch.Tensor,  # [A, B, H] target embedding of [anchor token, mask, ..., mask]
        block_start: torch.Tensor,  # [A] position of each block's anchor token
        taps: torch.Tensor,  # [T, K*H] target hidden states of positions 0..T-1
    ) -> torch.Tensor:
        """Final-normed hidden states [A, B, H]; block a sees the context at positions < block_start[a]."""
        num_ctx = taps.shape[0]
        ctx = self.project_context(taps)
        ctx_positions = torch.arange(num_ctx, device=taps.device)
        ctx_visible = ctx_positions.unsqueeze(0) < block_start.unsqueeze(1)
        positions = block_start.unsqueeze(1) + torch.arange(block_embeds.shape[1], device=taps.device)
        x = block_embeds.to(ctx.dtype)
        for layer in self.layers:
            x = layer(x, positions, ctx, ctx_positions, ctx_visible)
        return self.norm(x)
