"""The DART draft layer: a checkpoint in the published layout loads, and its logits equal an independent
float64 implementation written here from the method description; mismatched checkpoints fail clearly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_dart.drafter import DraftConfigError, load_drafter
from sglang_dart.drafter.model import apply_rope, rope_tables

H, HEADS, KV_HEADS, HEAD_DIM, INTER, V, VD, D = 32, 4, 2, 8, 48, 100, 60, 4
EPS, THETA = 1e-6, 10000.0


def _write_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen) * scale

    config = {
        "architectures": ["LlamaForCausalLMDart"],
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "draft_length": D,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "hidden_act": "silu",
        **overrides.pop("config", {}),
    }
    d2t = torch.randint(0, V - VD, (VD,), generator=gen).sort().values  # draft id i -> target id i + d2t[i]
    tensors = {
        "fc.weight": rnd(H, 3 * H),
        "midlayer.hidden_norm.weight": 1 + rnd(H),
        "midlayer.input_layernorm.weight": 1 + rnd(H),
        "midlayer.post_attention_layernorm.weight": 1 + rnd(H),
        "midlayer.mask_rep": rnd(2 * H, scale=1.0),
        "midlayer.self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.o_proj.weight": rnd(H, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": rnd(INTER, H),
        "midlayer.mlp.up_proj.weight": rnd(INTER, H),
        "midlayer.mlp.down_proj.weight": rnd(H, INTER),
        "norm.weight": 1 + rnd(H),  # not all ones, so applying the final norm twice is visible
        "lm_head.weight": rnd(VD, H),
        "d2t": d2t,
        "t2d": torch.zeros(V, dtype=torch.bool),
    }
    tensors.update(overrides.pop("tensors", {}))
    for name in overrides.pop("drop", []):
        tensors.pop(name)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _embedding(seed: int = 1) -> torch.Tensor:
    return torch.randn(V, H, generator=torch.Generator().manual_seed(seed))


# ---- independent reference (float64, row by row, RoPE as complex rotation) --------------------------


def _ref_norm(x, w):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)


def _ref_rope(x, pos):
    half = HEAD_DIM // 2
    freqs = torch.tensor([THETA ** (-i / half) for i in range(half)], dtype=torch.float64)
    rot = torch.polar(torch.ones(half, dtype=torch.float64), pos * freqs)
    z = torch.complex(x[..., :half], x[..., half:]) * rot
    return torch.cat([z.real, z.imag], dim=-1)


def _reference(weights, embed, aux, next_tokens, start_pos, past_k=None, past_v=None):
    w = {k: v.double() for k, v in weights.items() if v.is_floating_point()}
    embed = embed.double()
    m = aux.shape[0]
    rows_in, rows_res = [], []
    for t in range(m):
        r = w["fc.weight"] @ aux[t].double()
        e = embed[next_tokens[t]]
        a = torch.cat(
            [
                _ref_norm(e, w["midlayer.input_layernorm.weight"]),
                _ref_norm(r, w["midlayer.hidden_norm.weight"]),
            ]
        )
        rows_in.append(a)
        rows_res.append(r)
    for _ in range(D):
        rows_in.append(w["midlayer.mask_rep"])
        rows_res.append(w["midlayer.mask_rep"][:H])
    ks, vs, qs = [], [], []
    for i, a in enumerate(rows_in):
        pos = start_pos + i
        qs.append(_ref_rope((w["midlayer.self_attn.q_proj.weight"] @ a).view(HEADS, HEAD_DIM), pos))
        ks.append(_ref_rope((w["midlayer.self_attn.k_proj.weight"] @ a).view(KV_HEADS, HEAD_DIM), pos))
        vs.append((w["midlayer.self_attn.v_proj.weight"] @ a).view(KV_HEADS, HEAD_DIM))
    all_k = ([*past_k.double()] if past_k is not None else []) + ks
    all_v = ([*past_v.double()] if past_v is not None else []) + vs
    outs = []
    for i in range(len(rows_in)):
        visible = start_pos + i + 1
        heads = []
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)
            scores = torch.stack([qs[i][h] @ all_k[j][g] for j in range(visible)]) / math.sqrt(HEAD_DIM)
            p = torch.softmax(scores, 0)
            heads.append(sum(p[j] * all_v[j][g] for j in range(visible)))
        hidden = rows_res[i] + w["midlayer.self_attn.o_proj.weight"] @ torch.cat(heads)
        outs.append(hidden)
    logits = []
    for hidden in outs[m - 1 :]:
        x = _ref_norm(hidden, w["midlayer.post_attention_layernorm.weight"])
        gate = w["midlayer.mlp.gate_proj.weight"] @ x
        hidden = hidden + w["midlayer.mlp.down_proj.weight"] @ (
            torch.nn.functional.silu(gate) * (w["midlayer.mlp.up_proj.weight"] @ x)
        )
        once = _ref_norm(hidden, w["norm.weight"])
        logits.append(w["lm_head.weight"] @ _ref_norm(once, w["norm.weight"]))
    return torch.stack(logits), torch.stack(ks[:m]), torch.stack(vs[:m])


def test_published_layout_matches_independent_reference(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "draft")
    embed = _embedding()
    drafter = load_drafter(ckpt, embed, H, V, dtype=torch.float32)
    weights = load_file(str(ckpt / "model.safetensors"))
    gen = torch.Generator().manual_seed(2)

    # Prefill: 5 real positions, no cache.
    aux = torch.randn(5, 3 * H, generator=gen)
    nxt = torch.randint(0, V, (5,), generator=gen)
    with torch.no_grad():
        out = drafter(aux, nxt, start_pos=0)
    ref_logits, ref_k, ref_v = _reference(weights, embed, aux, nxt, 0)
    assert out.logits.shape == (D + 1, VD)
    torch.testing.assert_close(out.logits.double(), ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.real_keys.double(), ref_k, atol=1e-5, rtol=1e-5)

    # A decode step: 3 newly accepted positions on top of the cached 5.
    aux2 = torch.randn(3, 3 * H, generator=gen)
    nxt2 = torch.randint(0, V, (3,), generator=gen)
    with torch.no_grad():
        step = drafter(aux2, nxt2, start_pos=5, past_keys=out.real_keys, past_values=out.real_values)
    ref2, _, _ = _reference(weights, embed, aux2, nxt2, 5, ref_k, ref_v)
    torch.testing.assert_close(step.logits.double(), ref2, atol=1e-4, rtol=1e-4)


def test_key_value_projection_alone_matches_the_full_one(tmp_path):
    """Entries that are only stored skip the query projection; their K/V must be the full one's."""
    drafter = load_drafter(_write_checkpoint(tmp_path), _embedding(), H, V, dtype=torch.float32)
    attn_in = torch.randn(5, 2 * H, generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([0, 3, 4, 17, 300])
    _, k_full, v_full = drafter.project_qkv(attn_in, positions)
    k, v = drafter.project_kv(attn_in, positions)
    torch.testing.assert_close(k, k_full, rtol=0, atol=0)
    torch.testing.assert_close(v, v_full, rtol=0, atol=0)


def test_d2t_maps_draft_ids_to_target_ids(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "draft")
    drafter = load_drafter(ckpt, _embedding(), H, V)
    d2t = load_file(str(ckpt / "model.safetensors"))["d2t"]
    ids = torch.arange(VD)
    assert torch.equal(drafter.draft_to_target(ids), ids + d2t)


@pytest.mark.parametrize(
    "kwargs, target, message",
    [
        ({}, (H + 8, V), "hidden_size"),
        ({}, (H, V + 1), "vocab_size"),
        ({"drop": ["midlayer.mask_rep"]}, (H, V), "missing ['midlayer.mask_rep']"),
        ({"tensors": {"fc.weight": torch.zeros(H, 2 * H)}}, (H, V), "fc.weight"),
        ({"tensors": {"extra.weight": torch.zeros(1)}}, (H, V), "unexpected ['extra.weight']"),
        ({"tensors": {"d2t": torch.full((VD,), V, dtype=torch.int64)}}, (H, V), "outside the target"),
        ({"drop": ["d2t"]}, (H, V), "no d2t"),
        ({"config": {"target_hidden_size": 2 * H}}, (H, V), "trained on a target"),
        ({"config": {"hidden_act": "gelu"}}, (H, V), "hidden_act"),
    ],
)
def test_mismatched_checkpoints_fail_clearly(tmp_path, kwargs, target, message):
    ckpt = _write_checkpoint(tmp_path / "draft", **kwargs)
    with pytest.raises(DraftConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_drafter(ckpt, torch.zeros(target[1], target[0]), target[0], target[1])


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_quantized_target_embedding_is_refused_by_name(tmp_path, dtype):
    """The drafter embeds its inputs with the target's table as is: a quantized one would give garbage."""
    ckpt = _write_checkpoint(tmp_path / "draft")
    with pytest.raises(DraftConfigError, match=f"target embedding table is {dtype}"):
        load_drafter(ckpt, torch.zeros(V, H).to(dtype), H, V)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(DraftConfigError, match="no config.json"):
        load_drafter(tmp_path, _embedding(), H, V)
    ckpt = _write_checkpoint(tmp_path / "draft")
    (ckpt / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(DraftConfigError, match="not a valid safetensors"):
        load_drafter(ckpt, _embedding(), H, V)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(DraftConfigError, match="not valid JSON"):
        load_drafter(ckpt, _embedding(), H, V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_looked_up_in_cached_tables_is_the_computed_rope(dtype):
    """A serving drafter looks RoPE up in tables of every position (`cache_rope`); the values are the
    computed ones, bit for bit, at any positions below the table's length."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 3, 64, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 7, 8, 300, 301, 4095, 2, 299])
    tables = rope_tables(torch.arange(4096), 64, 10000.0, dtype)
    assert torch.equal(apply_rope(x, positions, 10000.0, tables), apply_rope(x, positions, 10000.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_projections_compute_what_the_separate_ones_do(tmp_path, dtype):
    """A serving drafter runs q/k/v and gate/up as one product each (`join_projections`); its logits and
    K/V are the separate products', and the five weights become views of the two stacked ones."""
    ckpt = _write_checkpoint(tmp_path / "draft")
    embed = _embedding().to(dtype)
    separate = load_drafter(ckpt, embed, H, V, dtype=dtype)
    joined = load_drafter(ckpt, embed, H, V, dtype=dtype)
    joined.join_projections()
    attn, mlp = joined.midlayer.self_attn, joined.midlayer.mlp
    for layer, stacked in [(attn.v_proj, joined.qkv_weight), (mlp.up_proj, joined.gate_up_weight)]:
        assert layer.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    gen = torch.Generator().manual_seed(4)
    aux = torch.randn(3, 3 * H, generator=gen).to(dtype)
    nxt = torch.randint(0, V, (3,), generator=gen)
    with torch.no_grad():
        want, got = separate(aux, nxt, start_pos=6), joined(aux, nxt, start_pos=6)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.logits, want.logits, **tolerance)
    torch.testing.assert_close(got.real_keys, want.real_keys, **tolerance)
    torch.testing.assert_close(got.real_values, want.real_values, **tolerance)


def test_loading_weights_again_writes_through_the_joined_projections(tmp_path):
    """SGLang's loader may load a served drafter's weights again (a weight update): the stacked weights
    the draft step reads must be the new ones."""
    from transformers import LlamaConfig

    from sglang_dart.drafter.model import read_weights
    from sglang_dart.drafter.sglang_model import LlamaForCausalLMDart

    first, second = _write_checkpoint(tmp_path / "a", seed=0), _write_checkpoint(tmp_path / "b", seed=1)
    model = LlamaForCausalLMDart(LlamaConfig(**json.loads((first / "config.json").read_text()))).float()
    model.load_weights(read_weights(first).items())
    joined = model.drafter.qkv_weight
    model.load_weights(read_weights(second).items())
    assert model.drafter.qkv_weight is joined
    new = read_weights(second)
    want = torch.cat([new[f"midlayer.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(joined, want)
    up = new["midlayer.mlp.up_proj.weight"]
    assert torch.equal(model.drafter.gate_up_weight[-up.shape[0] :], up)
