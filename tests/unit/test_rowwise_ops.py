"""SGLang's RMSNorm, SiLU-and-mul and rotary embedding through the Rust row-wise ops (`cpu/rowwise_ops.py`):
the same values as SGLang's own `forward_native` (bf16 bit for bit; float32 up to the order of a sum),
its fallback wherever an option is not the plain case, and clear errors for what does not fit."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_dart import _core
from sglang_dart.cpu import rowwise_ops, skinny_gemm

HIDDEN, HEAD, Q_HEADS, KV_HEADS = 576, 64, 9, 3


@pytest.fixture
def layers() -> Iterator[SimpleNamespace]:
    """SGLang's three layer classes with the wrappers installed, and their own forward_native; the
    classes are left as they were found."""
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    classes = (RMSNorm, SiluAndMul, RotaryEmbedding)
    found = [cls.forward_native for cls in classes]
    rowwise_ops.install()
    try:
        yield SimpleNamespace(
            rms_norm=RMSNorm.forward_native,
            silu=SiluAndMul.forward_native,
            rotary=RotaryEmbedding.forward_native,
            native_rms_norm=RMSNorm.forward_native.__wrapped__,
            native_silu=SiluAndMul.forward_native.__wrapped__,
            native_rotary=RotaryEmbedding.forward_native.__wrapped__,
        )
    finally:
        for cls, method in zip(classes, found, strict=True):
            cls.forward_native = method


def norm_layer(dtype: torch.dtype, **options: object) -> SimpleNamespace:
    """The attributes RMSNorm.forward_native reads, defaults as RMSNorm(HIDDEN) sets them."""
    weight = torch.nn.Parameter(
        (torch.rand(HIDDEN, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    )
    layer = dict(
        fp32_residual=False,
        cast_x_before_out_mul=False,
        override_orig_dtype=None,
        variance_size_override=None,
        hidden_size=HIDDEN,
        variance_epsilon=1e-5,
        weight=weight,
    )
    layer.update(options)
    return SimpleNamespace(**layer)


def rotary_layer(dtype: torch.dtype, neox: bool, rotary_dim: int = HEAD) -> SimpleNamespace:
    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb

    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.outer(torch.arange(512).float(), inv_freq)
    return SimpleNamespace(
        cos_sin_cache=torch.cat([angles.cos(), angles.sin()], -1).to(dtype),
        head_size=HEAD,
        rotary_dim=rotary_dim,
        is_neox_style=neox,
        _apply_rotary_emb_wrapped=apply_rotary_emb,
    )


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("rows", [1, 3, 16, 65])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_gives_sglang_s_values(layers: SimpleNamespace, dtype: torch.dtype, rows: int) -> None:
    layer = norm_layer(dtype)
    x, residual = randn(rows, HIDDEN, dtype=dtype, seed=rows), randn(rows, HIDDEN, dtype=dtype, seed=99)
    with torch.no_grad():
        want = layers.native_rms_norm(layer, x)
        want_x, want_residual = layers.native_rms_norm(layer, x, residual)
        got = layers.rms_norm(layer, x)
        x_in, residual_in = x.clone(), residual.clone()
        got_x, got_residual = layers.rms_norm(layer, x_in, residual_in)
    # The fused add works in place, as SGLang's fused kernels do.
    assert got_x.data_ptr() == x_in.data_ptr() and got_residual.data_ptr() == residual_in.data_ptr()
    assert torch.equal(got_residual, want_residual)  # the sum is rounded once either way
    # The sum of squares is added in another order: float32 rounding apart, which bf16's rounding hides
    # and float16's finer one may not (one unit in the last place).
    for got_, want_ in ((got, want), (got_x, want_x)):
        if dtype == torch.bfloat16:
            assert torch.equal(got_, want_)
        elif dtype == torch.float16:
            torch.testing.assert_close(got_, want_, rtol=2**-10, atol=2**-24)
        else:
            torch.testing.assert_close(got_, want_, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 16, 70])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_and_mul_gives_sglang_s_values(layers: SimpleNamespace, dtype: torch.dtype, rows: int) -> None:
    x = randn(rows, 2 * 1536, dtype=dtype, seed=rows, scale=4.0)
    x[0, :8] = torch.tensor([-100.0, -88.0, -20.0, -0.0, 0.0, 20.0, 88.0, 100.0], dtype=dtype)
    want = layers.native_silu(None, x)
    # The layer's path (Rust below torch's parallel size, torch's own above) and the kernel itself.
    for got in (layers.silu(None, x), rowwise_ops.silu_and_mul(x)):
        if dtype != torch.float32:  # half precision: rounded where torch rounds
            assert torch.equal(got, want)
        else:  # exp to about an ulp
            torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [HEAD, HEAD // 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotary_gives_sglang_s_values_in_place(
    layers: SimpleNamespace, dtype: torch.dtype, neox: bool, rotary_dim: int
) -> None:
    layer = rotary_layer(dtype, neox, rotary_dim)
    tokens = 17
    qkv = randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD, dtype=dtype, seed=5)
    q, k, v = qkv.split([Q_HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)  # strided, as in llama
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(2))
    want_q, want_k = layers.native_rotary(layer, positions, q, k)
    v_before = v.clone()
    got_q, got_k = layers.rotary(layer, positions, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # rotated in place
    assert torch.equal(v, v_before)  # the rest of the fused projection is untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_drafter_s_norm_and_mlp_keep_their_values(layers: SimpleNamespace, dtype: torch.dtype) -> None:
    """The DART drafter rounds its normalised row before the weight multiplies it, and its MLP stacks
    gate and up: on the CPU engine both take the Rust path with torch's values."""
    from sglang_dart.drafter import model

    x = randn(24, HIDDEN, dtype=dtype, seed=11)
    weight = torch.nn.Parameter(randn(HIDDEN, dtype=dtype, seed=12, scale=0.3))
    with torch.no_grad():
        assert rowwise_ops.applies(x, weight)
    xf = x.float()
    want = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    with torch.no_grad():
        got = model.rms_norm(x, weight, 1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want.detach())
    elif dtype == torch.float16:  # the sum of squares' order may move the last place (see above)
        torch.testing.assert_close(got, want.detach(), rtol=2**-10, atol=2**-24)
    else:
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
    mlp = model._Mlp(SimpleNamespace(hidden_size=HIDDEN, intermediate_size=64)).to(dtype)
    stacked = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
    with torch.no_grad():
        both = model.linear(x, stacked)
        want_mlp = mlp.down_proj(torch.nn.functional.silu(both[:, :64]) * both[:, 64:])
        got_mlp = mlp.forward_joined(x, stacked)
    if dtype != torch.float32:  # half precision: rounded where torch rounds
        assert torch.equal(got_mlp, want_mlp)
    else:
        torch.testing.assert_close(got_mlp, want_mlp, rtol=1e-5, atol=1e-6)


def test_a_row_does_not_depend_on_the_batch(layers: SimpleNamespace) -> None:
    """A token gets the same bits decoded alone as verified among 31 others."""
    layer = norm_layer(torch.float32)
    x, residual = (
        randn(32, HIDDEN, dtype=torch.float32, seed=7),
        randn(32, HIDDEN, dtype=torch.float32, seed=8),
    )
    with torch.no_grad():
        batch, _ = layers.rms_norm(layer, x.clone(), residual.clone())
        alone, _ = layers.rms_norm(layer, x[5:6].clone(), residual[5:6].clone())
    assert torch.equal(batch[5:6], alone)


def test_under_the_row_invariant_setting_silu_is_rust_s_at_any_size(
    layers: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every product Rust's (`SGLANG_DART_CPU_SKINNY_GEMM=rust`), a prefill-sized SiLU-and-mul, which
    torch would share out over its threads, stays Rust's too: torch's float32 exp rounds apart from the
    kernel's, and a row must get the bits it gets decoded alone."""
    monkeypatch.setenv(skinny_gemm.ENV, "rust")
    monkeypatch.setattr(skinny_gemm, "_mode", None)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = randn(70, 2 * 1536, dtype=torch.float32, seed=9, scale=4.0)
        batch = layers.silu(None, x)
        for row in (0, 33, 69):
            assert torch.equal(layers.silu(None, x[row : row + 1]), batch[row : row + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "options",
    [
        dict(cast_x_before_out_mul=True),
        dict(fp32_residual=True),
        dict(variance_size_override=64),
        dict(override_orig_dtype=torch.float32),
    ],
)
def test_other_rms_norm_options_run_sglang_s_own(layers: SimpleNamespace, options: dict) -> None:
    layer = norm_layer(torch.bfloat16, **options)
    x, residual = (
        randn(4, HIDDEN, dtype=torch.bfloat16, seed=1),
        randn(4, HIDDEN, dtype=torch.bfloat16, seed=2),
    )
    with torch.no_grad():
        got = layers.rms_norm(layer, x.clone(), residual.clone())
        want = layers.native_rms_norm(layer, x.clone(), residual.clone())
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_what_the_kernels_do_not_take_runs_sglang_s_own(layers: SimpleNamespace) -> None:
    # float16, a weight of another type, a gradient to record, a post-residual addition, aliased inputs
    x16 = randn(2, HIDDEN, dtype=torch.float16, seed=1)
    assert torch.equal(
        layers.rms_norm(norm_layer(torch.float16), x16),
        layers.native_rms_norm(norm_layer(torch.float16), x16),
    )
    mixed = norm_layer(torch.float32)
    xb = randn(2, HIDDEN, dtype=torch.bfloat16, seed=3)
    assert torch.equal(layers.rms_norm(mixed, xb), layers.native_rms_norm(mixed, xb))
    layer = norm_layer(torch.float32)
    x = randn(2, HIDDEN, dtype=torch.float32, seed=4).requires_grad_()
    out = layers.rms_norm(layer, x)
    out.sum().backward()  # torch's path recorded the graph
    assert x.grad is not None
    with torch.no_grad():
        y, r, extra = (randn(2, HIDDEN, dtype=torch.float32, seed=s) for s in (5, 6, 7))
        got = layers.rms_norm(layer, y.clone(), r.clone(), extra)
        want = layers.native_rms_norm(layer, y.clone(), r.clone(), extra)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        same = y.clone()
        got = layers.rms_norm(layer, same, same)
        want = layers.native_rms_norm(layer, y.clone(), y.clone())
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    odd = randn(2, 7, dtype=torch.float32, seed=8)
    assert torch.equal(layers.silu(None, odd[:, :6]), layers.native_silu(None, odd[:, :6]))


def test_rotary_offsets_run_sglang_s_own(layers: SimpleNamespace) -> None:
    layer = rotary_layer(torch.float32, True)
    q, k = (
        randn(3, Q_HEADS * HEAD, dtype=torch.float32, seed=1),
        randn(3, KV_HEADS * HEAD, dtype=torch.float32, seed=2),
    )
    positions, offsets = torch.tensor([1, 2, 3]), torch.tensor([10, 10, 10])
    want = layers.native_rotary(layer, positions, q.clone(), k.clone(), offsets)
    got = layers.rotary(layer, positions, q.clone(), k.clone(), offsets)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_bad_calls_are_errors_not_crashes() -> None:
    bits = np.zeros((2, 8), dtype=np.int16)
    with pytest.raises(ValueError, match="outside the table"):
        _core.rotary_bf16(np.array([0, 99]), np.zeros((4, 8), np.int16), bits.copy(), bits.copy(), 8, True)
    with pytest.raises(ValueError, match="outside the table"):
        _core.rotary_f32(
            np.array([-1, 0]),
            np.zeros((4, 8), np.float32),
            np.zeros((2, 8), np.float32),
            np.zeros((2, 8), np.float32),
            8,
            True,
        )
    with pytest.raises(ValueError, match="do not fit"):
        _core.rotary_f32(
            np.array([0, 1]),
            np.zeros((4, 8), np.float32),
            np.zeros((2, 12), np.float32),
            np.zeros((2, 8), np.float32),
            8,
            True,
        )
    with pytest.raises(ValueError, match="weight"):
        _core.rms_norm_f32(
            np.zeros((2, 8), np.float32), np.zeros(7, np.float32), np.zeros((2, 8), np.float32), 1e-5, False
        )
    with pytest.raises(ValueError, match="twice as wide"):
        _core.silu_and_mul_bf16(bits, np.zeros((2, 8), np.int16))
    with pytest.raises(ValueError, match="not contiguous"):
        _core.rms_norm_f32(
            np.zeros((2, 16), np.float32)[:, ::2],
            np.zeros(8, np.float32),
            np.zeros((2, 8), np.float32),
            1e-5,
            False,
        )
    shared = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="cannot be written"):  # one array as two arguments
        _core.add_rms_norm_f32(shared, shared, np.zeros(8, np.float32), 1e-5)
    frozen = np.zeros((2, 8), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="cannot be written"):
        _core.silu_and_mul_f32(np.zeros((2, 16), np.float32), frozen)


def test_the_setting_is_checked_and_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.layers.layernorm import RMSNorm

    monkeypatch.setenv(rowwise_ops.ENV, "yes")
    with pytest.raises(ValueError, match=rowwise_ops.ENV):
        rowwise_ops.enabled()
    monkeypatch.setenv(rowwise_ops.ENV, "0")
    found = RMSNorm.forward_native
    rowwise_ops.install()
    assert RMSNorm.forward_native is found
