"""The EAGLE3 drafter in plain torch, for training: one Llama decoder layer whose first projection reads
[input_layernorm(embed(token)), hidden_norm(hidden)], where `hidden` is fc(three target taps) at the
positions the target has verified and the drafter's own pre-norm output at the positions it drafts.

The arithmetic follows what SGLang's `LlamaForCausalLMEagle3` computes at serving time (checked by
tests/unit/test_peer_eagle3.py against SGLang's own module): residual = hidden; attention; add; RMSNorm;
SiLU MLP; add; the sum is the hidden state fed back, its RMSNorm goes through lm_head over the draft
vocabulary.

Training-time test (`ttt_logits`): step 0 runs every position with the target's taps, as SGLang's draft
extend does; step k runs every position p again as the k-th drafted token after anchor p - k, with the
hidden state step k - 1 produced at p - 1. Its query sees step 0's keys up to the anchor and, of each
step i in 1..k, the one key of the same anchor (position p - k + i): what the draft KV cache holds when
SGLang's draft decode runs that step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Eagle3Shape:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    num_taps: int = 3


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32.to(x.dtype)) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (Llama's) of x [..., T, D] at positions [T]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    angles = positions.float().unsqueeze(-1) * inv_freq  # [T, D/2]
    cos, sin = angles.cos().repeat(1, 2).to(x.dtype), angles.sin().repeat(1, 2).to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def shift_rows(x: torch.Tensor, by: int) -> torch.Tensor:
    """out[..., p, :] = x[..., p - by, :] along dim -2 (zeros where p < by)."""
    if by == 0:
        return x
    pad = torch.zeros_like(x[..., :by, :])
    return torch.cat([pad, x[..., :-by, :]], dim=-2)


class Eagle3Drafter(nn.Module):
    # Checkpoint tensor names (the published EAGLE3 layout) come from `state_for_checkpoint`.
    def __init__(self, shape: Eagle3Shape, embed: torch.Tensor) -> None:
        super().__init__()
        self.shape = shape
        h, nh, nkv, hd = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
        # The target's embedding, frozen: SGLang's EAGLE3 worker hands the drafter the target's own.
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        self.fc = nn.Linear(shape.num_taps * h, h, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, shape.draft_vocab_size, bias=False)

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        """Tensors under the names SGLang's LlamaForCausalLMEagle3.load_weights reads."""
        layer = "midlayer."
        named = {
            "fc.weight": self.fc.weight,
            layer + "hidden_norm.weight": self.hidden_norm,
            layer + "input_layernorm.weight": self.input_layernorm,
            layer + "self_attn.q_proj.weight": self.q_proj.weight,
            layer + "self_attn.k_proj.weight": self.k_proj.weight,
            layer + "self_attn.v_proj.weight": self.v_proj.weight,
            layer + "self_attn.o_proj.weight": self.o_proj.weight,
            layer + "post_attention_layernorm.weight": self.post_attention_layernorm,
            layer + "mlp.gate_proj.weight": self.gate_proj.weight,
            layer + "mlp.up_proj.weight": self.up_proj.weight,
            layer + "mlp.down_proj.weight": self.down_proj.weight,
            "norm.weight": self.norm,
            "lm_head.weight": self.lm_head.weight,
        }
        return {k: v.detach() for k, v in named.items()}

    def load_checkpoint_state(self, tensors: dict[str, torch.Tensor]) -> None:
        own = self.state_for_checkpoint()
        for name, current in own.items():
            if name not in tensors:
                raise ValueError(f"EAGLE3 checkpoint lacks tensor {name}")
            if tuple(tensors[name].shape) != tuple(current.shape):
                raise ValueError(
                    f"EAGLE3 checkpoint tensor {name} has shape {tuple(tensors[name].shape)}, "
                    f"this target needs {tuple(current.shape)}"
                )
            current.copy_(tensors[name].to(current.dtype))

    # -- one pass -------------------------------------------------------------------------------------

    def _qkv(
        self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        embeds = rms_norm(self.embed[tokens].to(hidden.dtype), self.input_layernorm, s.rms_norm_eps)
        x = torch.cat([embeds, rms_norm(hidden, self.hidden_norm, s.rms_norm_eps)], dim=-1)
        t = x.shape[0]
        q = self.q_proj(x).view(t, s.num_heads, s.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(t, s.num_kv_heads, s.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(t, s.num_kv_heads, s.head_dim).transpose(0, 1)
        return rope(q, positions, s.rope_theta), rope(k, positions, s.rope_theta), v

    def _finish(
        self, hidden: torch.Tensor, attn: torch.Tensor, logits_from: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm output fed back, logits over the draft vocabulary of rows `logits_from` on)."""
        s = self.shape
        mid = self.o_proj(attn) + hidden
        mlp_in = rms_norm(mid, self.post_attention_layernorm, s.rms_norm_eps)
        out = self.down_proj(nn.functional.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in)) + mid
        return out, self.lm_head(rms_norm(out[logits_from:], self.norm, s.rms_norm_eps))

    def ttt_logits(
        self, taps: torch.Tensor, tokens: torch.Tensor, steps: int, supervised_from: int | None = None
    ) -> list[torch.Tensor]:
        """Logits [T, Vd] of steps 0..steps-1 at every position p (token tokens[p], position p). Row p of
        step k is meaningful for p >= k. With `supervised_from` = s, step k's logits start at row s + k
        ([T - s - k, Vd]): every position still feeds the next step, but the head, the largest product,
        skips the rows training never supervises (a window's prompt positions)."""
        s = self.shape
        t = tokens.shape[0]
        positions = torch.arange(t, device=taps.device)
        group = s.num_heads // s.num_kv_heads
        scale = 1.0 / math.sqrt(s.head_dim)
        hidden = self.fc(taps)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out_logits = []
        idx = positions
        for k in range(steps):
            q, key, value = self._qkv(hidden, tokens, positions)
            keys.append(key.repeat_interleave(group, dim=0))
            values.append(value.repeat_interleave(group, dim=0))
            # Step 0's keys up to the anchor p - k ...
            scores = [torch.matmul(q, keys[0].transpose(1, 2)) * scale]  # [H, T, T]
            visible = idx.unsqueeze(0) <= (idx.unsqueeze(1) - k)
            scores[0] = scores[0].masked_fill(~visible, float("-inf"))
            # ... and of each later step i, the key at p - k + i (same anchor).
            for i in range(1, k + 1):
                lag = k - i
                diag = (q * shift_rows(keys[i], lag)).sum(-1, keepdim=True) * scale  # [H, T, 1]
                scores.append(diag.masked_fill((idx < lag).view(1, t, 1), float("-inf")))
            probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
            attn = torch.matmul(probs[..., :t], values[0])
            for i in range(1, k + 1):
                attn = attn + probs[..., t + i - 1 : t + i] * shift_rows(values[i], k - i)
            logits_from = 0 if supervised_from is None else min(supervised_from + k, t)
            out, logits = self._finish(hidden, attn.transpose(0, 1).reshape(t, -1), logits_from)
            out_logits.append(logits)
            hidden = shift_rows(out, 1)  # position p of the next step continues from p - 1's output
        return out_logits
