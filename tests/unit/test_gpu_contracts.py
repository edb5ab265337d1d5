"""CUDA contracts of a DART server, checked on a CPU with SGLang's real classes: the attention backend SGLang
resolves for DART on a Hopper GPU, the hidden states its CUDA graphs capture, and the bytes per KV slot its
memory planner counts. No GPU runs here: what SGLang decides from the device is patched (Hopper, 80 GB),
everything downstream is SGLang's own code."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from sglang_dart.dart import gpu_contracts
from sglang_dart.dart.settings import DartArgsError
from tests.support.dart_assets import build_random_drafter, build_store_for
from tests.support.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("gpu-contracts")
    model = build_tiny_model(root / "model", arch="llama")
    return SimpleNamespace(
        model=model,
        draft=build_random_drafter(root / "draft", model),
        store=build_store_for(model, root / "answers.store"),
    )


@pytest.fixture(scope="module", autouse=True)
def hooks_installed() -> None:
    """What SGLang's `load_plugins()` does with the plugin in every process: register, then patch."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_dart.plugin import register_dart

    register_dart()
    HookRegistry.apply_hooks()


def _dart_server_args(assets: SimpleNamespace, device: str, **extra: object):  # noqa: ANN202
    """ServerArgs as `launch_server --device DEVICE --speculative-algorithm DART` resolves them here."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=str(assets.model),
        device=device,
        speculative_algorithm="DART",
        speculative_draft_model_path=str(assets.draft),
        speculative_ngram_external_corpus_path=str(assets.store),
        **extra,
    )


def _cuda_server_args(assets: SimpleNamespace, **extra: object):  # noqa: ANN202
    """ServerArgs as `launch_server --device cuda --speculative-algorithm DART` resolves them on an H100."""
    import sglang.srt.server_args as server_args_module

    with (
        mock.patch.object(server_args_module, "is_hopper_with_cuda_12_3", return_value=True),
        mock.patch.object(server_args_module, "get_device_memory_capacity", return_value=80 * 1024),
        mock.patch.object(server_args_module, "is_flashinfer_available", return_value=True),
    ):
        return _dart_server_args(assets, "cuda", **extra)


def test_a_hopper_gpu_gets_a_backend_that_verifies_trees(assets):
    """SGLang picks fa3 on Hopper for top-k-1 speculation; fa3's verify ignores the tree mask."""
    args = _cuda_server_args(assets)
    assert args.attention_backend in gpu_contracts.TREE_MASK_BACKENDS
    for backend in (args.decode_attention_backend, args.prefill_attention_backend):
        assert backend in (None, *gpu_contracts.TREE_MASK_BACKENDS)


def test_a_plain_server_on_hopper_keeps_sglangs_choice(assets):
    import sglang.srt.server_args as server_args_module

    with (
        mock.patch.object(server_args_module, "is_hopper_with_cuda_12_3", return_value=True),
        mock.patch.object(server_args_module, "get_device_memory_capacity", return_value=80 * 1024),
    ):
        args = server_args_module.ServerArgs(model_path=str(assets.model), device="cuda")
    assert args.attention_backend == "fa3"


@pytest.mark.parametrize("flag", ["attention_backend", "decode_attention_backend"])
def test_a_backend_that_cannot_verify_trees_is_refused_by_name(assets, flag):
    with pytest.raises(DartArgsError, match="--" + flag.replace("_", "-") + " fa3"):
        _cuda_server_args(assets, **{flag: "fa3"})


def test_a_tree_backend_given_by_flag_is_kept(assets):
    assert _cuda_server_args(assets, attention_backend="triton").attention_backend == "triton"


def test_deterministic_inference_on_hopper_names_the_backend_to_use(assets):
    """--enable-deterministic-inference picks fa3 on Hopper by itself, after the default-backend choice DART
    hooks: the server stops at start-up saying which flag to give (gpu_check.py passes one)."""
    with pytest.raises(DartArgsError, match="--attention-backend fa3 .* use --attention-backend flashinfer"):
        _cuda_server_args(assets, enable_deterministic_inference=True)
    args = _cuda_server_args(assets, enable_deterministic_inference=True, attention_backend="triton")
    assert args.attention_backend == "triton"


def test_rejection_sampling_is_refused_by_name(assets):
    with pytest.raises(DartArgsError, match="--speculative-use-rejection-sampling"):
        _cuda_server_args(assets, speculative_use_rejection_sampling=True)


def test_a_quantized_target_serves_with_an_unquantized_drafter(assets):
    """SGLang hands the draft model the target's --quantization; DART's draft layer refused any, so a fp8
    target stopped the server at the draft load, after the target had loaded."""
    args = _cuda_server_args(assets, quantization="fp8")
    assert args.quantization == "fp8" and args.speculative_draft_model_quantization is None
    with pytest.raises(DartArgsError, match="drop --speculative-draft-model-quantization fp8"):
        _cuda_server_args(assets, speculative_draft_model_quantization="fp8")


@pytest.mark.parametrize(
    ("flag", "value"), [("speculative_token_map", "hot_tokens.pt"), ("enable_multi_layer_eagle", True)]
)
def test_other_drafters_flags_are_refused_not_ignored(assets, flag, value):
    with pytest.raises(DartArgsError, match="DART has no use for --" + flag.replace("_", "-")):
        _cuda_server_args(assets, **{flag: value})


def test_the_target_captures_the_taps_before_its_graphs(assets):
    """The model runner resolves which hidden states to capture before it captures CUDA graphs (and calls
    set_eagle3_layers_to_capture from it); DART's taps must be on by then."""
    from sglang.srt.model_executor import model_runner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    args = _cuda_server_args(assets)
    algorithm = SpeculativeAlgorithm.from_string("DART")
    target = model_runner.resolve_spec_aux_hidden_state_config(
        server_args=args, model_config=None, spec_algorithm=algorithm, is_draft_worker=False
    )
    assert target.eagle_use_aux_hidden_state and target.eagle_aux_hidden_state_layer_ids is None


def test_a_captured_verify_graph_returns_the_taps(assets):
    """SGLang captures its decode graphs with the hidden-state mode of the spec info it builds for the
    algorithm; a replay of a graph captured with less raises (or returns no taps)."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        get_required_capture_hidden_mode,
    )
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    args = _cuda_server_args(assets)
    runner = SimpleNamespace(
        model_runner=SimpleNamespace(
            spec_algorithm=SpeculativeAlgorithm.from_string("DART"), is_draft_worker=False, server_args=args
        ),
        buffers=SimpleNamespace(custom_mask=torch.ones(64, dtype=torch.bool)),
        captured_req_width=args.speculative_num_draft_tokens,
    )
    spec_info = DecodeCudaGraphRunner.get_spec_info(runner, num_tokens=4 * args.speculative_num_draft_tokens)
    assert get_required_capture_hidden_mode(CaptureHiddenMode.NULL, spec_info) == CaptureHiddenMode.FULL


def test_every_tree_size_the_cuda_default_picks_has_a_graph(assets):
    """Decode graphs are captured for verify batches of exactly N tokens per request; the CUDA default
    schedule verifies N at every batch size (other schedules run other sizes eagerly, as documented)."""
    import torch

    from sglang_dart.dart.settings import tree_size_schedule

    args = _cuda_server_args(assets)
    schedule = tree_size_schedule(args, torch.bfloat16)
    captured = set(args.cuda_graph_config.decode.bs)
    assert {schedule.size_for(bs) for bs in captured} == {args.speculative_num_draft_tokens}


def test_the_drafter_state_is_counted_in_the_kv_pool_budget(assets):
    """SGLang sizes the KV pool from bytes per token (DefaultPoolConfigurator._cell_size); the drafter's
    per-slot residual and K/V must be part of it. The target's own bytes per token are pinned to 1000
    (their computation needs SGLang's parallel state); the rest of the constructor is SGLang's."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    args = _cuda_server_args(assets)
    model_config = ModelConfig.from_server_args(args)
    layers = model_config.num_hidden_layers
    kvc = SimpleNamespace(
        model_config=model_config,
        layer_info=SimpleNamespace(num_effective_layers=layers, start_layer=0, end_layer=layers),
        spec_algorithm=SpeculativeAlgorithm.from_string("DART"),
        is_draft_worker=False,
        server_args=args,
        model_dtype=torch.bfloat16,
        kv_cache_dtype_str=None,
        ps=SimpleNamespace(pp_size=1),
    )
    with mock.patch.object(DefaultPoolConfigurator, "_compute_cell_size", return_value=1000):
        target = DefaultPoolConfigurator(kvc)
        draft_worker = DefaultPoolConfigurator(SimpleNamespace(**{**vars(kvc), "is_draft_worker": True}))
    config = json.loads((Path(assets.draft) / "config.json").read_text())
    per_slot = (config["hidden_size"] + 2 * config["num_key_value_heads"] * config["head_dim"]) * 2
    assert target._cell_size == 1000 + per_slot
    assert draft_worker._cell_size == 1000


def test_a_target_with_a_split_kv_pool_is_refused_by_name(assets, tmp_path):
    """A hybrid sliding-window target (here a Llama whose config opts into SGLang's hybrid-SWA pools)
    has no single full pool for the drafter's per-slot state."""
    import shutil

    hybrid = tmp_path / "hybrid"
    shutil.copytree(assets.model, hybrid)
    config = json.loads((hybrid / "config.json").read_text())
    (hybrid / "config.json").write_text(json.dumps({**config, "is_hybrid_swa": True, "sliding_window": 16}))
    with pytest.raises(DartArgsError, match="--disable-hybrid-swa-memory"):
        _cuda_server_args(SimpleNamespace(**{**vars(assets), "model": hybrid}))


def test_a_draft_step_over_a_full_prefill_chunk_fits_sglangs_reserve(assets):
    """SGLang keeps (1 - mem_fraction_static) of the GPU for activations. The draft step after a prefill
    chunk attends chunk + mask rows over the whole prefix: by formula, its largest temporaries (one score
    block, the boolean masks of the plan, q/k/v/attention input rows) for a Llama-8B-shaped drafter
    (32 heads of 128, 8 KV heads, hidden 4096) at SGLang's chunked_prefill_size must fit that reserve."""
    from sglang_dart.attention.tree_attention import SCORE_BLOCK_BYTES, query_block

    args = _cuda_server_args(assets)
    gpu_bytes = 80 * 1024**3
    reserve = (1 - args.mem_fraction_static) * gpu_bytes
    heads, kv_heads, head_dim, hidden, masks = 32, 8, 128, 4096, 7
    rows = args.chunked_prefill_size + masks
    keys = 4 * args.chunked_prefill_size + rows  # a chunk deep into a long prompt
    block = query_block(1, heads, rows, keys)
    score_block = heads * block * keys * 4
    plan_masks = 2 * rows * keys  # mask and its SDPA copy, bool
    activations = rows * (2 * hidden + (heads + 2 * kv_heads) * head_dim + hidden) * 2 * 2  # bf16, x2 slack
    assert score_block <= SCORE_BLOCK_BYTES
    assert score_block + plan_masks + activations < reserve / 4, (score_block, plan_masks, reserve)


def test_the_draft_memory_outside_the_kv_plan_is_a_sliver_of_sglangs_reserve(assets):
    """Two draft allocations are not per-slot state, so the KV plan does not size them: the scratch slots
    (the newest entry and the mask slots of every request row, past the target's slots) and the draft's
    request table (the target's, shifted by one, with room for the mask columns). For a Llama-8B-shaped
    drafter, the most running requests the table holds and a 128K context, both together must stay under
    1% of the activation reserve SGLang keeps beside its pools."""
    from sglang_dart.dart.drafting import DraftForward
    from sglang_dart.dart.gpu_contracts import draft_bytes_per_slot
    from sglang_dart.drafter import DraftConfig

    args = _cuda_server_args(assets)
    reserve = (1 - args.mem_fraction_static) * 80 * 1024**3
    cfg = DraftConfig.from_dir(assets.draft)
    llama8b = replace(cfg, hidden_size=4096, num_key_value_heads=8, head_dim=128)
    rows, context = args.max_running_requests + 1, 128 * 1024  # SGLang's table has one spare row
    scratch = DraftForward.scratch_slots(rows, llama8b.draft_length) * draft_bytes_per_slot(llama8b, 2)
    table = rows * (context + llama8b.draft_length + 1) * 4  # int32 slot ids
    assert scratch + table < reserve / 100, (scratch, table, reserve)


def test_overlap_scheduling_stays_on_for_cuda_and_is_opt_in_on_a_cpu(assets, monkeypatch):
    """A GPU server keeps SGLang's overlap scheduling; on a CPU (same cores for both) DART turns it off
    unless SGLANG_DART_CPU_OVERLAP=1, which the test servers set."""
    from sglang_dart.dart.settings import CPU_OVERLAP_ENV

    monkeypatch.delenv(CPU_OVERLAP_ENV, raising=False)
    assert _cuda_server_args(assets).disable_overlap_schedule is False
    assert _dart_server_args(assets, "cpu").disable_overlap_schedule is True
    monkeypatch.setenv(CPU_OVERLAP_ENV, "1")
    assert _dart_server_args(assets, "cpu").disable_overlap_schedule is False


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_requests_row_holds_the_decode_reserve(assets, device):
    """Each speculative decode step allocates KV slots up to twice the largest tree past a request's
    committed tokens (`eagle_prepare_for_decode`); near the context limit those slots must still fit the
    request's row of `req_to_token`, whose width SGLang sets from the context length plus this headroom
    (read through the name the KV-cache configurator imported)."""
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode
    from sglang.srt.server_args import ServerArgs

    args = _cuda_server_args(assets) if device == "cuda" else _dart_server_args(assets, "cpu")
    assert args.speculative_num_draft_tokens == 16
    headroom = kv_cache_configurator.get_req_to_token_extra_context_len(args)
    assert headroom >= get_alloc_reserve_per_decode(args) == 32
    plain = ServerArgs(model_path=str(assets.model), device="cpu")
    assert kv_cache_configurator.get_req_to_token_extra_context_len(plain) == 4


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_drafter_is_built_in_the_targets_dtype(assets, device):
    """A drafter config naming no dtype counts as float32, which `--dtype auto` serves in float16: beside a
    bf16 target the drafter ran in float16 (emulated on every CPU of ours). It is built in the target's."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_dart.dart.settings import draft_server_args

    args = _cuda_server_args(assets) if device == "cuda" else _dart_server_args(assets, "cpu")
    assert args.dtype == "auto"
    as_sglang_would = ModelConfig.from_server_args(args, model_path=str(assets.draft), is_draft_model=True)
    for target in (torch.bfloat16, torch.float32):
        draft_args = draft_server_args(args, target)
        config = ModelConfig.from_server_args(draft_args, model_path=str(assets.draft), is_draft_model=True)
        assert config.dtype == target, (as_sglang_would.dtype, config.dtype)
    assert args.dtype == "auto"  # the target's own arguments are untouched
