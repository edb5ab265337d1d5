"""What SGLang's builtin DFLASH worker needs to serve on a CPU-only machine.

SGLang 0.5.17's DFLASH has CPU code paths for its own steps (eager block preparation, accept/bonus, the
per-layer context-KV append, prefix-valid KV writes), but three things stop it before or at its first step:
- argument handling (`arg_groups/speculative_hook._handle_dflash`) refuses every device but CUDA and NPU, and
  turns a draft attention backend outside its GPU list (our `torch_native`) into `flashinfer`;
- the draft worker builder (`speculative/draft_worker_common`) does the same with its own list;
- each decode step calls `Tensor.record_stream` on `seq_lens`, which has no meaning for (and raises on) a CPU
  tensor;
- the model runner hands a forward's `input_embeds` (DFLASH's draft block: the target's embeddings of the
  anchor and mask tokens) to the model cast to bfloat16 whatever the model's dtype, which a float32 draft's
  linear layers reject; they are given in the runner's own dtype instead.
The draft's non-causal block attention (ENCODER_ONLY layers in TARGET_VERIFY mode) is planned by our CPU
attention backend (`sglang_dart/cpu/attention.py`). Nothing here changes what the target computes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

CPU_DRAFT_BACKEND = "torch_native"  # the name our CPU attention backend is registered under


def _keep_cpu_draft_backend(server_args: Any) -> None:
    """In place of SGLang's draft-backend resolution (a GPU list, falling back to flashinfer) on CPU."""
    server_args.speculative_draft_attention_backend = CPU_DRAFT_BACKEND


def _handle_dflash_on_cpu(original: Any, server_args: Any) -> None:
    """SGLang's own DFLASH argument handling, run for CPU: its checks and defaults (block size from the
    draft config, num_steps / topk forced to 1, ...) apply as on a GPU, but the device check is passed as
    for CUDA, the draft keeps the CPU attention backend, and overlap scheduling is off, as SGLang's other
    speculative algorithms have it on CPU."""
    if server_args.device != "cpu":
        return original(server_args)
    from sglang.srt.arg_groups import speculative_hook

    resolve_backend = speculative_hook._resolve_dflash_draft_attention_backend
    try:
        server_args.device = "cuda"  # only for the device check inside; restored before anything reads it
        speculative_hook._resolve_dflash_draft_attention_backend = _keep_cpu_draft_backend
        original(server_args)
    finally:
        server_args.device = "cpu"
        speculative_hook._resolve_dflash_draft_attention_backend = resolve_backend
    speculative_hook._disable_overlap_schedule_for_cpu(server_args)


def _install_argument_handling() -> None:
    from sglang.srt.arg_groups import speculative_hook

    original = speculative_hook._handle_dflash
    if getattr(original, "_sglang_dart_cpu", False):
        return
    patched = functools.partial(_handle_dflash_on_cpu, original)
    patched._sglang_dart_cpu = True  # type: ignore[attr-defined]
    # spec_info.SpeculativeAlgorithm.handle_server_args imports the name from the module at each call.
    speculative_hook._handle_dflash = patched


def _allow_cpu_draft_backend() -> None:
    from sglang.srt.speculative import draft_worker_common

    if CPU_DRAFT_BACKEND not in draft_worker_common._SUPPORTED_DRAFT_BACKENDS:
        draft_worker_common._SUPPORTED_DRAFT_BACKENDS = (
            *draft_worker_common._SUPPORTED_DRAFT_BACKENDS,
            CPU_DRAFT_BACKEND,
        )


def _record_stream_skipping_cpu() -> None:
    """A CPU tensor is never used on an asynchronous stream, so recording one is a no-op there; other devices
    keep torch's own method."""
    original = torch.Tensor.record_stream
    if getattr(original, "_sglang_dart_cpu", False):
        return

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.device.type == "cpu":
            return None
        return original(self, stream)

    record_stream._sglang_dart_cpu = True  # type: ignore[attr-defined]
    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]


def _embeds_in_model_dtype(original: Any, runner: Any, forward_batch: Any, *args: Any) -> dict:
    kwargs = original(runner, forward_batch, *args)
    embeds = forward_batch.input_embeds
    if embeds is not None and runner.dtype != torch.bfloat16 and "input_embeds" in kwargs:
        # From the batch's own tensor, not the bf16 copy: a float32 draft sees float32 embeddings.
        kwargs["input_embeds"] = embeds.to(runner.dtype)
    return kwargs


def _keep_input_embeds_dtype() -> None:
    from sglang.srt.model_executor.model_runner import ModelRunner

    original = ModelRunner._extend_forward_kwargs
    if getattr(original, "_sglang_dart_cpu", False):
        return

    @functools.wraps(original)
    def patched(self: Any, forward_batch: Any, *args: Any) -> dict:
        return _embeds_in_model_dtype(original, self, forward_batch, *args)

    patched._sglang_dart_cpu = True  # type: ignore[attr-defined]
    ModelRunner._extend_forward_kwargs = patched


def check_draft_fits_target(draft_config: Any, target_config: Any) -> None:
    """A DFLASH drafter embeds with the target's embedding and reads the target's layers: one made for
    another target fails at its first step deep in a matmul, or drafts from the wrong layers (SGLang only
    warns). Refuse it at start, saying why."""
    wrong = []
    if int(draft_config.hidden_size) != int(target_config.hidden_size):
        wrong.append(f"hidden_size {draft_config.hidden_size} (target: {target_config.hidden_size})")
    dflash = getattr(draft_config, "dflash_config", None) or {}
    trained_for = dflash.get("num_target_layers", getattr(draft_config, "num_target_layers", None))
    layers = int(target_config.num_hidden_layers)
    if trained_for is not None and int(trained_for) != layers:
        wrong.append(f"num_target_layers {trained_for} (target: {layers})")
    if wrong:
        raise ValueError("the DFLASH draft checkpoint was made for another target model: " + "; ".join(wrong))


def _check_draft_at_start() -> None:
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    original = DFlashWorkerV2.__init__
    if getattr(original, "_sglang_dart_cpu", False):
        return

    @functools.wraps(original)
    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        check_draft_fits_target(
            self.draft_model_runner.model_config.hf_config, self.model_runner.model_config.hf_text_config
        )

    patched._sglang_dart_cpu = True  # type: ignore[attr-defined]
    DFlashWorkerV2.__init__ = patched


def install() -> None:
    """Patch SGLang (in this process) so that --speculative-algorithm DFLASH serves on the CPU engine."""
    _install_argument_handling()
    _allow_cpu_draft_backend()
    _record_stream_skipping_cpu()
    _keep_input_embeds_dtype()
    _check_draft_at_start()
