"""The few-row CPU linear layer: same values as F.linear in every form, a choice made once per shape,
dtype and row bucket, the Rust form's row independence, and a clear error for a bad setting."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from sglang_dart.cpu import skinny_gemm


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "_choices", {})
    monkeypatch.setattr(skinny_gemm, "_mode", None)


@pytest.fixture
def one_torch_thread():
    # As in a small forward (small_step_threads); restored after the test.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _choice(n: int, k: int, dtype: torch.dtype, bucket: int, threads: int | None = None):
    """The one choice made for a weight shape, dtype, row bucket and thread count (keys also hold the
    forms that applied)."""
    threads = torch.get_num_threads() if threads is None else threads
    (choice,) = [c for key, c in skinny_gemm._choices.items() if key[:5] == (n, k, dtype, bucket, threads)]
    return choice


@pytest.mark.parametrize("form", ["transposed", "torch", "rust", "auto"])
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 65, 96, 97])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_match_f_linear(monkeypatch, form, rows, with_bias):
    monkeypatch.setenv(skinny_gemm.ENV, form)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=generator)
    weight = torch.randn(48, 64, generator=generator)
    bias = torch.randn(48, generator=generator) if with_bias else None
    out = skinny_gemm.linear(x, weight, bias)
    assert out.shape == (rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_batched_input_keeps_its_shape(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "transposed")
    x = torch.randn(3, 5, 32)
    weight = torch.randn(40, 32)
    out = skinny_gemm.linear(x, weight)
    assert out.shape == (3, 5, 40)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_auto_times_each_bucket_then_keeps_the_fastest_form(monkeypatch, caplog):
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    wide, square = torch.randn(3072, 576), torch.randn(576, 576)
    x = torch.randn(8, 576)
    forms = ("torch", "transposed", "rust")
    with caplog.at_level(logging.INFO, logger=skinny_gemm.__name__):
        for _ in range(len(forms) * skinny_gemm.SAMPLES_PER_FORM - 1):
            skinny_gemm.linear(x, wide)
        assert _choice(3072, 576, torch.float32, 4).chosen is None
        skinny_gemm.linear(x, wide)
        skinny_gemm.linear(x, square)  # another shape starts its own timing
        skinny_gemm.linear(x[:3], wide)  # and so does another row bucket
    choice = _choice(3072, 576, torch.float32, 4)  # rows 8-15
    assert choice.forms == forms
    assert [len(choice.seconds[f]) for f in forms] == [skinny_gemm.SAMPLES_PER_FORM] * 3
    assert choice.chosen in forms
    assert _choice(576, 576, torch.float32, 4).chosen is None
    assert _choice(3072, 576, torch.float32, 2).chosen is None
    line = f"sglang_dart: CPU linear 576->3072 (float32, 8-15 rows, {torch.get_num_threads()} threads) uses"
    assert caplog.text.count(line) == 1
    # Decided: later calls are not timed.
    skinny_gemm.linear(x, wide)
    assert [len(choice.seconds[f]) for f in forms] == [skinny_gemm.SAMPLES_PER_FORM] * 3


def test_one_row_chooses_between_torch_and_rust_and_many_rows_stay_with_torch(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    weight = torch.randn(64, 32)
    skinny_gemm.linear(torch.randn(1, 32), weight)
    assert _choice(64, 32, torch.float32, 1).forms == ("torch", "rust")
    skinny_gemm.linear(torch.randn(skinny_gemm.MAX_ROWS + 1, 32), weight)
    assert len(skinny_gemm._choices) == 1


def test_a_bucket_straddling_a_forms_reach_times_each_set_of_forms(monkeypatch):
    # Rows 64-127 share a bucket, but the Rust product takes at most 64 rows: whichever count comes
    # first, the other is timed and decided too, not left to F.linear for good.
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    weight = torch.randn(64, 32)
    for _ in range(4 * skinny_gemm.SAMPLES_PER_FORM):
        for rows in (65, 64):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(skinny_gemm.linear(x, weight), F.linear(x, weight))
    bucket = [c for key, c in skinny_gemm._choices.items() if key[:4] == (64, 32, torch.float32, 7)]
    assert sorted(c.forms for c in bucket) == [("torch", "transposed"), ("torch", "transposed", "rust")]
    assert all(c.chosen in c.forms for c in bucket)


def test_rust_form_gives_a_row_the_same_bits_whatever_the_other_rows(monkeypatch):
    # What makes a token's verify logits equal its decode logits, when both calls take this form.
    monkeypatch.setenv(skinny_gemm.ENV, "rust")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 576, generator=generator)
    weight = torch.randn(1000, 576, generator=generator)
    together = skinny_gemm.linear(x, weight)
    for row in range(16):
        assert torch.equal(skinny_gemm.linear(x[row : row + 1], weight), together[row : row + 1])


@pytest.mark.parametrize(
    "dtype, tolerance",
    [(torch.float32, 1e-4), (torch.bfloat16, 2**-7), (torch.float16, 2**-10)],
)
def test_the_rust_setting_takes_every_product_whatever_its_rows(monkeypatch, dtype, tolerance):
    """`SGLANG_DART_CPU_SKINNY_GEMM=rust` is the row-invariant setting: prefills too (600 rows, in blocks of
    64) go to the Rust product, so a prompt token gets the bits it gets decoded alone, in every dtype."""
    monkeypatch.setenv(skinny_gemm.ENV, "rust")
    assert skinny_gemm.rust_only(dtype)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(600, 100, generator=generator).to(dtype)
    weight = torch.randn(130, 100, generator=generator).to(dtype)
    _assert_untimed_blocks_keep_rows_apart(x, weight, rtol=tolerance, atol=10 * tolerance)


def test_rust_form_leaves_training_and_other_dtypes_to_torch(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "rust")
    layer = skinny_gemm.Linear(32, 16, bias=False)
    x = torch.randn(4, 32, requires_grad=True)
    layer(x).sum().backward()  # the Rust product has no backward: torch must have computed this
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(4, 32).detach())
    half = torch.randn(4, 32, dtype=torch.float16)
    weight = torch.randn(16, 32, dtype=torch.float16)
    assert torch.equal(skinny_gemm.linear(half, weight), F.linear(half, weight))


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 64])
@pytest.mark.parametrize("k", [576, 100])  # 100: a tail past the last whole 32-value vector
def test_bf16_rust_form_matches_f_linear_within_one_rounding(monkeypatch, rows, k):
    monkeypatch.setenv(skinny_gemm.ENV, "rust")
    generator = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = torch.randn(300, k, generator=generator).bfloat16()
    bias = torch.randn(300, generator=generator).bfloat16()
    out = skinny_gemm.linear(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 300)
    exact = F.linear(x.double(), weight.double(), bias.double())
    # float32 sums rounded once to bf16 (relative 2^-8), then the bias added in bf16 (another rounding).
    torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=1e-2)
    assert torch.equal(out, skinny_gemm._rust(x, weight) + bias)  # the Rust product, not torch's


def test_bf16_rust_form_gives_a_row_the_same_bits_whatever_the_other_rows(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "rust")
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 576, generator=generator).bfloat16()
    weight = torch.randn(700, 576, generator=generator).bfloat16()
    together = skinny_gemm.linear(x, weight)
    for row in range(16):
        assert torch.equal(skinny_gemm.linear(x[row : row + 1], weight), together[row : row + 1])


@pytest.mark.parametrize("pays", [True, False])
def test_auto_offers_the_bf16_rust_form_only_where_it_pays(monkeypatch, one_torch_thread, pays):
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    monkeypatch.setattr(skinny_gemm, "bf16_rust_untimed", lambda rows: False)  # the timed choice's case
    monkeypatch.setattr(skinny_gemm, "bf16_kernel_pays", lambda: pays)
    weight = torch.randn(64, 32).bfloat16()
    # The forms offered, not a timed choice: where only torch's applies (no Rust bf16, and no oneDNN
    # packing on a CPU without AVX-512) `linear` calls F.linear and records no choice.
    one_row = skinny_gemm.forms_for(1, torch.randn(1, 32).bfloat16(), weight)
    eight_rows = skinny_gemm.forms_for(8, torch.randn(8, 32).bfloat16(), weight)
    assert ("rust" in one_row, "rust" in eight_rows) == (pays, pays)
    assert (torch.bfloat16 in skinny_gemm.rust_dtypes()) == pays


def test_bf16_rust_form_is_offered_only_while_torch_runs_on_one_thread(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    monkeypatch.setattr(skinny_gemm, "bf16_rust_untimed", lambda rows: False)  # the timed choice's case
    monkeypatch.setattr(skinny_gemm, "bf16_kernel_pays", lambda: True)
    weight, x = torch.randn(64, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    threads = torch.get_num_threads()
    try:
        for count in (2, 1):
            torch.set_num_threads(count)
            skinny_gemm.linear(x, weight)
        beside_the_pool = _choice(64, 32, torch.bfloat16, 4, 2).forms
        alone = _choice(64, 32, torch.bfloat16, 4, 1).forms
    finally:
        torch.set_num_threads(threads)
    assert "rust" not in beside_the_pool and "rust" in alone
    # float32 keeps the Rust form beside torch's pool (its launcher stops OpenMP spinning).
    torch.set_num_threads(2)
    try:
        skinny_gemm.linear(x.float(), weight.float())
        assert "rust" in _choice(64, 32, torch.float32, 4, 2).forms
    finally:
        torch.set_num_threads(threads)


def test_bf16_kernel_is_offered_by_auto_where_the_cpu_has_a_vector_kernel_and_no_amx():
    from sglang_dart._core import SKINNY_BF16_KERNEL, SKINNY_BF16_NATIVE

    flags = open("/proc/cpuinfo").read().split()
    assert SKINNY_BF16_NATIVE == ("avx512_bf16" in flags and "avx512f" in flags)
    if SKINNY_BF16_NATIVE:
        expected = "avx512-bf16"
    elif "avx2" in flags and "fma" in flags:
        expected = "avx2"
    else:
        expected = "portable"
    assert SKINNY_BF16_KERNEL == expected
    # AMX by torch's own check (it also asks the kernel for the tile state), as the product does.
    has_amx = skinny_gemm._cpu_has_amx()
    assert skinny_gemm.bf16_kernel_pays() == (expected != "portable" and not has_amx)
    assert skinny_gemm.bf16_rust_only() == (expected == "avx2" and not has_amx)
    if "amx_tile" not in flags:
        assert not has_amx


def _assert_untimed_blocks_keep_rows_apart(
    x: torch.Tensor, weight: torch.Tensor, rtol: float, atol: float
) -> None:
    """`linear` of 600 rows (past the Rust product's 64, so in blocks): x's dtype, close to the float32
    product, no timed choice recorded, and each row (across the blocks' edges too) the bits it gets alone."""
    together = skinny_gemm.linear(x, weight)
    assert together.dtype == x.dtype
    exact = F.linear(x.float(), weight.float())
    torch.testing.assert_close(together.float(), exact, rtol=rtol, atol=atol)
    assert not skinny_gemm._choices  # untimed: no choice recorded
    for row in (0, 1, 63, 64, 65, 300, 599):
        assert torch.equal(skinny_gemm.linear(x[row : row + 1], weight), together[row : row + 1])
    assert torch.equal(skinny_gemm.linear(x[:9], weight), together[:9])


def _auto_with_bf16_kernel(monkeypatch, kernel: str) -> torch.Tensor:
    """`auto`, with the Rust bf16 kernel `kernel` taken as paying; a bf16 weight to multiply."""
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    monkeypatch.setattr(skinny_gemm, "SKINNY_BF16_KERNEL", kernel)
    monkeypatch.setattr(skinny_gemm, "bf16_kernel_pays", lambda: True)
    return torch.randn(64, 32).bfloat16()


@pytest.mark.parametrize("threads", [1, 2])
def test_where_the_bf16_kernel_is_avx2_every_few_row_bf16_product_is_rust_s(monkeypatch, threads):
    """Timed choices between torch and the widened AVX2 kernel split by row count (one row ties, eight
    do not), so a token verified in a tree got other bits than decoded alone: there the Rust product is
    the only form, whatever the rows (in blocks past its limit) and torch's thread count."""
    weight = _auto_with_bf16_kernel(monkeypatch, "avx2")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 8, skinny_gemm.SKINNY_MATMUL_MAX_ROWS, 65, 600):
            assert skinny_gemm.forms_for(rows, torch.randn(rows, 32).bfloat16(), weight) == ("rust",)
        # float32 keeps its timed choice
        assert len(skinny_gemm.forms_for(8, torch.randn(8, 32), weight.float())) > 1
        # 600 rows: past the product's 64-row limit and past the few-row forms' reach, in blocks of 64
        _assert_untimed_blocks_keep_rows_apart(torch.randn(600, 32).bfloat16(), weight, rtol=2**-7, atol=1e-2)
    finally:
        torch.set_num_threads(previous)
    # Another kernel, or a form set by hand, leaves the choice to timing / the setting.
    monkeypatch.setattr(skinny_gemm, "SKINNY_BF16_KERNEL", "avx512-bf16")
    assert not skinny_gemm.bf16_rust_only()


@pytest.mark.parametrize("threads", [1, 2])
def test_where_the_bf16_kernel_is_avx512_bf16_up_to_16_rows_are_rust_s_untimed(monkeypatch, threads):
    """Timed choices mixed the Rust, torch and packed products across row buckets, which round
    differently, so greedy bf16 DART parted from plain decoding: up to EXACT_BF16_ROWS rows (trees of 8
    and 16 at batch 1) the Rust product is the only form while torch runs on one thread; past them, or
    beside torch's pool, the choice stays timed."""
    weight = _auto_with_bf16_kernel(monkeypatch, "avx512-bf16")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 8, skinny_gemm.EXACT_BF16_ROWS):
            forms = skinny_gemm.forms_for(rows, torch.randn(rows, 32).bfloat16(), weight)
            assert (forms == ("rust",)) == (threads == 1), (rows, forms)
        for rows in (skinny_gemm.EXACT_BF16_ROWS + 1, skinny_gemm.SKINNY_MATMUL_MAX_ROWS):
            assert len(skinny_gemm.forms_for(rows, torch.randn(rows, 32).bfloat16(), weight)) > 1
        assert len(skinny_gemm.forms_for(8, torch.randn(8, 32), weight.float())) > 1  # float32: timed
        if threads == 1:
            x = torch.randn(skinny_gemm.EXACT_BF16_ROWS, 32).bfloat16()
            together = skinny_gemm.linear(x, weight)
            assert not skinny_gemm._choices  # untimed: no choice recorded
            for row in range(x.shape[0]):
                assert torch.equal(skinny_gemm.linear(x[row : row + 1], weight), together[row : row + 1])
            assert torch.equal(skinny_gemm.linear(x[:8], weight), together[:8])
    finally:
        torch.set_num_threads(previous)
    assert not skinny_gemm.bf16_rust_only()
    # A form set by hand leaves it to the setting.
    monkeypatch.setenv(skinny_gemm.ENV, "torch")
    monkeypatch.setattr(skinny_gemm, "_mode", None)
    assert not skinny_gemm.bf16_rust_untimed(1)


def test_rust_product_rejects_mismatched_arrays():
    from sglang_dart._core import skinny_matmul

    x, w = torch.randn(2, 8).numpy(), torch.randn(3, 8).numpy()
    with pytest.raises(ValueError, match="do not fit"):
        skinny_matmul(x, w, torch.empty(2, 4).numpy())
    with pytest.raises(ValueError, match="not C-contiguous"):
        skinny_matmul(torch.randn(8, 2).numpy().T, w, torch.empty(2, 3).numpy())
    with pytest.raises(ValueError, match="at most"):
        skinny_matmul(torch.randn(65, 8).numpy(), w, torch.empty(65, 3).numpy())


def test_bf16_rust_product_rejects_mismatched_arrays():
    import numpy as np
    from sglang_dart._core import skinny_matmul_bf16

    x, w = np.zeros((2, 8), np.uint16), np.zeros((3, 8), np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        skinny_matmul_bf16(x, w, np.zeros((2, 4), np.uint16))
    with pytest.raises(ValueError, match="not C-contiguous"):
        skinny_matmul_bf16(np.zeros((8, 2), np.uint16).T, w, np.zeros((2, 3), np.uint16))
    with pytest.raises(ValueError, match="at most"):
        skinny_matmul_bf16(np.zeros((65, 8), np.uint16), w, np.zeros((65, 3), np.uint16))
    with pytest.raises(TypeError):
        skinny_matmul_bf16(x.astype(np.float32), w, np.zeros((2, 3), np.uint16))


def test_rust_product_is_right_when_python_threads_call_it_at_once():
    # The GIL is released: callers overlap, and all but one run without the helper team.
    from sglang_dart._core import skinny_matmul

    torch.manual_seed(0)
    weights = [torch.randn(300, 96) for _ in range(4)]
    inputs = [torch.randn(1 + 3 * i, 96) for i in range(4)]

    def products(i: int) -> list[torch.Tensor]:
        outs = []
        for _ in range(50):
            out = torch.empty(inputs[i].shape[0], 300)
            skinny_matmul(inputs[i].numpy(), weights[i].numpy(), out.numpy())
            outs.append(out)
        return outs

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(products, range(4)))
    for i, outs in enumerate(results):
        torch.testing.assert_close(outs[0], F.linear(inputs[i], weights[i]), rtol=1e-4, atol=1e-4)
        assert all(torch.equal(out, outs[0]) for out in outs)


def test_rust_team_is_sized_like_torchs_pool_unless_set():
    code = (
        "import os, torch; torch.set_num_threads(1); from sglang_dart.cpu import skinny_gemm; "
        "skinny_gemm._rust(torch.randn(2, 8), torch.randn(4, 8)); print(os.environ[skinny_gemm.THREADS_ENV])"
    )
    env = {k: v for k, v in os.environ.items() if k != skinny_gemm.THREADS_ENV}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "1"
    env[skinny_gemm.THREADS_ENV] = "3"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "3"


def test_rust_product_works_in_a_forked_child():
    # The child has none of the parent's helper threads; it must compute alone, not wait for them.
    code = """
import os, torch, torch.nn.functional as F
from sglang_dart._core import skinny_matmul
x, w = torch.randn(8, 64), torch.randn(700, 64)
def product():
    out = torch.empty(8, 700)
    skinny_matmul(x.numpy(), w.numpy(), out.numpy())
    return out
product()
pid = os.fork()
if pid == 0:
    ok = all(torch.allclose(product(), F.linear(x, w), atol=1e-4) for _ in range(20))
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert run.stdout.strip() == "0"


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(skinny_gemm.ENV, "fastest")
    with pytest.raises(ValueError, match=f"{skinny_gemm.ENV}='fastest'"):
        skinny_gemm.linear(torch.randn(4, 8), torch.randn(8, 8))


def test_module_keeps_nn_linear_state_dict():
    layer = skinny_gemm.Linear(16, 8, bias=False)
    assert list(layer.state_dict()) == ["weight"]
    torch.nn.Linear(16, 8, bias=False).load_state_dict(layer.state_dict())


@pytest.mark.parametrize(
    ("form", "dtype", "preset", "expected"),
    [
        ("auto", "float32", None, "0"),
        ("rust", "float", None, "0"),
        ("auto", "Float32", None, "0"),
        ("torch", "float32", None, None),
        ("auto", "float32", "300000", "300000"),
        ("auto", "bfloat16", None, None),
        ("rust", "auto", None, None),
        ("auto", "float16", None, None),
    ],
)
def test_openmp_spinning_is_turned_off_only_where_rust_may_run(monkeypatch, form, dtype, preset, expected):
    monkeypatch.setenv(skinny_gemm.ENV, form)
    # setenv first: monkeypatch records nothing for a delenv of an absent name, so the value set
    # below would outlive the test.
    monkeypatch.setenv(skinny_gemm.SPIN_ENV, preset or "")
    if preset is None:
        monkeypatch.delenv(skinny_gemm.SPIN_ENV)
    skinny_gemm.keep_openmp_from_spinning(dtype)
    assert os.environ.get(skinny_gemm.SPIN_ENV) == expected


def test_float16_kernel_is_the_widest_the_cpu_has():
    from sglang_dart._core import SKINNY_F16_KERNEL

    flags = set(open("/proc/cpuinfo").read().split())
    if "avx512f" in flags:
        expected = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        expected = "avx2-f16c"
    else:
        expected = "portable"
    assert SKINNY_F16_KERNEL == expected
    assert skinny_gemm.f16_kernel_pays() == (expected != "portable" and not skinny_gemm._cpu_has_amx())
    assert (torch.float16 in skinny_gemm.rust_dtypes()) == skinny_gemm.f16_kernel_pays()


@pytest.mark.parametrize("threads", [1, 2])
def test_where_the_float16_kernel_pays_every_float16_product_is_rust_s(monkeypatch, threads):
    """torch's float16 product costs in proportion to its rows while one row ties with the Rust one, so a
    timed choice would split by row count and a token verified in a tree would get other bits than decoded
    alone: the Rust product is the only form, whatever the rows (in blocks past its limit)."""
    monkeypatch.setenv(skinny_gemm.ENV, "auto")
    monkeypatch.setattr(skinny_gemm, "f16_kernel_pays", lambda: True)
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(130, 100, generator=generator) * 0.1).half()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 8, skinny_gemm.SKINNY_MATMUL_MAX_ROWS, 65, 600):
            assert skinny_gemm.forms_for(rows, torch.randn(rows, 100).half(), weight) == ("rust",)
        x = torch.randn(600, 100, generator=generator).half()
        _assert_untimed_blocks_keep_rows_apart(x, weight, rtol=2**-10, atol=1e-3)
        # with a bias, and through the layer SGLang's linears become
        layer = skinny_gemm.Linear(100, 130).half()
        torch.testing.assert_close(
            layer(x[:8]).float(),
            F.linear(x[:8].float(), layer.weight.float(), layer.bias.float()),
            rtol=2**-9,
            atol=2e-3,
        )
    finally:
        torch.set_num_threads(previous)
    # Where it does not pay (AMX, no F16C), float16 stays with torch's product.
    monkeypatch.setattr(skinny_gemm, "f16_kernel_pays", lambda: False)
    assert skinny_gemm.forms_for(8, torch.randn(8, 100).half(), weight) == ("torch", "transposed")
    assert torch.float16 not in skinny_gemm.rust_dtypes()
