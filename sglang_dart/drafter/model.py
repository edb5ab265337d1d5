"""The DART draft layer in plain torch, with the parameter names of the published checkpoints.

One forward per request step: the m newest real positions (fused target hidden state + embedding of the
next token) followed by d mask slots, causal attention over the draft's cached prefix, and d + 1 rows of
"shifted" logits: row 0 predicts the child of the root, row j the node at depth j + 1.
Only the real positions' keys/values are returned for caching; mask slots are never committed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sglang_dart.cpu import rowwise_ops
from sglang_dart.cpu.skinny_gemm import Linear, linear
from sglang_dart.drafter.config import DraftConfig, DraftConfigError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if rowwise_ops.applies(x, weight):  # serving on the CPU engine: one Rust call, the same bits
        return rowwise_ops.rms_norm(x, weight, eps, cast_before_weight=True)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin [positions, head_dim]


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> RopeTables:
    """cos and sin [T, head_dim] of rotate-half RoPE at positions [T], in `dtype`."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float32, device=positions.device) / half))
    angles = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [T, half]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, theta: float, cached: RopeTables | None = None
) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, head_dim]; positions: [T]. `cached`: the tables of positions
    0..n-1 in x's dtype (`rope_tables(arange(n))`, every position below n): rows are looked up instead of
    computed, with the same values (the angles of integer positions are computed alike)."""
    half = x.shape[-1] // 2
    if cached is None:
        cos, sin = rope_tables(positions, x.shape[-1], theta, x.dtype)
    else:
        cos, sin = cached[0][positions], cached[1][positions]
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class _Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class _Attention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        width = 2 * cfg.hidden_size
        self.q_proj = Linear(width, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = Linear(width, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = Linear(width, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)


class _Mlp(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_joined(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """The same MLP with gate and up as one product (`gate_up`: their weights, stacked)."""
        both = linear(x, gate_up)
        size = self.gate_proj.weight.shape[0]
        if rowwise_ops.silu_pays(both) and both.shape[-1] == 2 * size:
            return self.down_proj(rowwise_ops.silu_and_mul(both))
        return self.down_proj(nn.functional.silu(both[..., :size]) * both[..., size:])


class _MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.hidden_norm = _Norm(cfg.hidden_size)
        self.input_layernorm = _Norm(cfg.hidden_size)
        self.post_attention_layernorm = _Norm(cfg.hidden_size)
        self.mask_rep = nn.Parameter(torch.zeros(2 * cfg.hidden_size))
        self.self_attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)


@dataclass(frozen=True)
class DraftOutput:
    logits: torch.Tensor  # [d + 1, draft_vocab_size]
    real_keys: torch.Tensor  # [m, kv_heads, head_dim], after RoPE: to append to the draft KV cache
    real_values: torch.Tensor  # [m, kv_heads, head_dim]


class DartDrafter(nn.Module):
    def __init__(self, cfg: DraftConfig, embed_tokens: torch.Tensor | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = _Norm(cfg.hidden_size)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        # The target's table, shared, never copied or saved (None until a serving worker hands it over).
        self.embed_tokens = embed_tokens
        self.rope: RopeTables | None = None  # `cache_rope`: tables a serving worker looks positions up in
        # `join_projections`: q/k/v and gate/up weights stacked, each one product (serving only).
        self.qkv_weight: torch.Tensor | None = None
        self.gate_up_weight: torch.Tensor | None = None

    def cache_rope(self, positions: int) -> None:
        """Keep the RoPE tables of positions 0..positions-1 in the layer's dtype and device: a serving
        worker whose positions all stay below that looks them up (a few ops per projection, not a dozen)."""
        weight = self.fc.weight
        index = torch.arange(positions, device=weight.device)
        self.rope = rope_tables(index, self.cfg.head_dim, self.cfg.rope_theta, weight.dtype)

    @torch.no_grad()
    def join_projections(self) -> None:
        """Stack the q/k/v weights into one tensor and gate/up into another, and make the five parameters
        views of them: a draft step then runs two products (and one RoPE) where it ran five (and two),
        fewer calls into the CPU products and fewer kernel launches on a GPU, with no extra weight
        memory. The parameters keep their names and shapes, so loading weights again writes through.
        For serving: a view's storage is shared, which a checkpoint writer would refuse."""
        if self.qkv_weight is not None:
            return
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        self.qkv_weight = _stack_into_views([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up_weight = _stack_into_views([mlp.gate_proj, mlp.up_proj])

    def served_linear_weights(self) -> list[torch.Tensor]:
        """The weights a serving draft step multiplies by (`cpu.gemm_tuning` times their products)."""
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        kv = [attn.k_proj.weight, attn.v_proj.weight]  # `project_kv` takes them one by one
        if self.qkv_weight is None or self.gate_up_weight is None:
            joined = [attn.q_proj.weight, *kv, mlp.gate_proj.weight, mlp.up_proj.weight]
        else:
            joined = [self.qkv_weight, *kv, self.gate_up_weight]
        return [self.fc.weight, *joined, attn.o_proj.weight, mlp.down_proj.weight, self.lm_head.weight]

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # The layer in pieces, shared by the single-request forward below and the batched serving path
    # (`sglang_dart.dart.drafting`), which runs attention through SGLang's backend instead.

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Residual stream of real positions: fc over the 3 concatenated target taps."""
        return self.fc(aux_hidden)

    def real_inputs(self, residual_real: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Attention input [m, 2H] of real rows: normed embedding of the next token, then normed residual."""
        layer, eps = self.midlayer, self.cfg.rms_norm_eps
        embeds = self.embed_tokens[next_tokens].to(residual_real.dtype)
        return torch.cat(
            [
                rms_norm(embeds, layer.input_layernorm.weight, eps),
                rms_norm(residual_real, layer.hidden_norm.weight, eps),
            ],
            dim=-1,
        )

    def mask_row(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [2H], residual [H]) of every mask slot: the learned mask_rep, never normalised."""
        rep = self.midlayer.mask_rep.to(dtype)
        return rep, rep[: self.cfg.hidden_size]

    def project_qkv(
        self, attn_in: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE'd q [T, heads, hd], k and v [T, kv_heads, hd]."""
        cfg, n = self.cfg, attn_in.shape[0]
        if self.qkv_weight is not None:
            heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
            qkv = linear(attn_in, self.qkv_weight).view(n, heads + 2 * kv_heads, cfg.head_dim)
            qk = apply_rope(qkv[:, : heads + kv_heads], positions, cfg.rope_theta, self.rope)
            return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        q = self.midlayer.self_attn.q_proj(attn_in).view(n, cfg.num_attention_heads, cfg.head_dim)
        return (apply_rope(q, positions, cfg.rope_theta, self.rope), *self.project_kv(attn_in, positions))

    def project_kv(self, attn_in: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE'd k and v [T, kv_heads, hd] alone: entries that are stored, never attended from."""
        cfg, attn = self.cfg, self.midlayer.self_attn
        n = attn_in.shape[0]
        k = attn.k_proj(attn_in).view(n, cfg.num_key_value_heads, cfg.head_dim)
        v = attn.v_proj(attn_in).view(n, cfg.num_key_value_heads, cfg.head_dim)
        return apply_rope(k, positions, cfg.rope_theta, self.rope), v

    def head(self, residual: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Logits of the rows that need them: o_proj + residual, MLP, final norm (twice), lm_head."""
        layer, eps = self.midlayer, self.cfg.rms_norm_eps
        hidden = residual + layer.self_attn.o_proj(context)
        normed = rms_norm(hidden, layer.post_attention_layernorm.weight, eps)
        if self.gate_up_weight is None:
            hidden = hidden + layer.mlp(normed)
        else:
            hidden = hidden + layer.mlp.forward_joined(normed, self.gate_up_weight)
        out = rms_norm(hidden, self.norm.weight, eps)
        # The reference applies the final norm a second time before the head; the checkpoints expect it.
        return self.lm_head(rms_norm(out, self.norm.weight, eps))

    def forward(
        self,
        aux_hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        start_pos: int,
        past_keys: torch.Tensor | None = None,
        past_values: torch.Tensor | None = None,
    ) -> DraftOutput:
        """One request. aux_hidden: [m, 3·H_target] target taps of the m new real positions; next_tokens:
        [m] the token following each (the last one is the root); start_pos: absolute position of the
        first of them (= cached draft length); past_keys/values: [start_pos, kv_heads, head_dim]."""
        cfg = self.cfg
        m, d = aux_hidden.shape[0], cfg.draft_length
        if m < 1:
            raise ValueError("the draft forward needs at least one real position")
        residual_real = self.fuse(aux_hidden)
        mask_in, mask_residual = self.mask_row(residual_real.dtype)
        attn_in = torch.cat([self.real_inputs(residual_real, next_tokens), mask_in.expand(d, -1)])
        residual = torch.cat([residual_real, mask_residual.expand(d, -1)])
        n = m + d
        positions = torch.arange(start_pos, start_pos + n, device=aux_hidden.device)
        q, k, v = self.project_qkv(attn_in, positions)
        keys = k if past_keys is None else torch.cat([past_keys.to(k.dtype), k])
        values = v if past_values is None else torch.cat([past_values.to(v.dtype), v])
        past = keys.shape[0] - n
        allowed = torch.arange(keys.shape[0], device=q.device).unsqueeze(0) <= (
            past + torch.arange(n, device=q.device).unsqueeze(1)
        )
        context = nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).float(),
            keys.transpose(0, 1).float(),
            values.transpose(0, 1).float(),
            attn_mask=allowed,
            scale=1.0 / math.sqrt(cfg.head_dim),
            enable_gqa=cfg.num_attention_heads != cfg.num_key_value_heads,
        )
        context = context.transpose(0, 1).reshape(n, -1).to(attn_in.dtype)
        logits = self.head(residual[m - 1 :], context[m - 1 :])  # last real position + d mask slots
        return DraftOutput(logits, k[:m], v[:m])


def _stack_into_views(layers: list[nn.Linear]) -> torch.Tensor:
    """The layers' weights stacked by rows into one tensor, each layer's weight then a view of its rows."""
    stacked = torch.cat([layer.weight.detach() for layer in layers])
    first = 0
    for layer in layers:
        rows = layer.weight.shape[0]
        layer.weight.data = stacked[first : first + rows]
        first += rows
    return stacked


_IGNORED_TENSORS = {"t2d"}  # target→draft presence mask: unused at inference


def checked_state(
    cfg: DraftConfig, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], source: str
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as a state dict for a `DartDrafter` whose own state is `expected`, or a
    `DraftConfigError` naming what does not match its config (missing, unexpected, wrong shapes, a d2t
    that maps outside the target vocabulary)."""
    tensors = dict(tensors)
    if "d2t" not in tensors and cfg.draft_vocab_size != cfg.vocab_size:
        raise DraftConfigError("draft vocabulary is smaller than the target's but the checkpoint has no d2t")
    tensors.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - _IGNORED_TENSORS)
    wrong = sorted(
        f"{name}: {tuple(tensors[name].shape)} != {tuple(expected[name].shape)}"
        for name in set(expected) & set(tensors)
        if tensors[name].shape != expected[name].shape
    )
    if missing or unexpected or wrong:
        raise DraftConfigError(
            f"draft weights {source} do not match its config: missing {missing}, "
            f"unexpected {unexpected}, wrong shapes {wrong}"
        )
    d2t = tensors["d2t"].to(device="cpu", dtype=torch.int64)
    targets = torch.arange(cfg.draft_vocab_size) + d2t
    if int(targets.max()) >= cfg.vocab_size or int(targets.min()) < 0:
        raise DraftConfigError("draft d2t maps draft ids outside the target vocabulary")
    return {name: t for name, t in {**tensors, "d2t": d2t}.items() if name in expected}


def read_weights(path: Path | str) -> dict[str, torch.Tensor]:
    """`model.safetensors` of a draft checkpoint directory, with a clear error when absent or corrupt."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_file = Path(path) / "model.safetensors"
    try:
        return load_file(str(weights_file))
    except FileNotFoundError as exc:
        raise DraftConfigError(f"draft checkpoint {path} has no model.safetensors") from exc
    except SafetensorError as exc:
        raise DraftConfigError(
            f"draft weights {weights_file} are not a valid safetensors file: {exc}"
        ) from exc


def check_embedding(embed_tokens: torch.Tensor, target_hidden_size: int, target_vocab_size: int) -> None:
    if embed_tokens.shape != (target_vocab_size, target_hidden_size):
        raise DraftConfigError(f"target embedding table has shape {tuple(embed_tokens.shape)}")
    # The drafter embeds its inputs with the target's table: a quantized one would need its dequantizer.
    if embed_tokens.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DraftConfigError(
            f"target embedding table is {embed_tokens.dtype}; DART reads it as is, in 16 or 32 bits"
        )


def load_drafter(
    path: Path | str,
    embed_tokens: torch.Tensor,
    target_hidden_size: int,
    target_vocab_size: int,
    dtype: torch.dtype | None = None,
) -> DartDrafter:
    """Load `config.json` + `model.safetensors` (published layout) and check that it fits the target
    (training and tests; serving loads the same files through SGLang, `drafter.sglang_model`)."""
    path = Path(path)
    cfg = DraftConfig.from_dir(path)
    cfg.check_fits_target(target_hidden_size, target_vocab_size)
    check_embedding(embed_tokens, target_hidden_size, target_vocab_size)
    tensors = read_weights(path)
    model = DartDrafter(cfg, embed_tokens)
    model.load_state_dict(checked_state(cfg, tensors, model.state_dict(), str(path / "model.safetensors")))
    target_dtype = dtype or embed_tokens.dtype
    return model.to(dtype=target_dtype, device=embed_tokens.device).eval()
