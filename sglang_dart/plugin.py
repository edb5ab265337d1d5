"""SGLang plugin entry point (`sglang.srt.plugins` group): run once in every SGLang process.

It registers `--speculative-algorithm DART`, the hook that makes its drafted counts exact
(`spec_counts`), the check that refuses token ids outside the vocabulary (`request_checks`) and the rule that
keeps `input_embeds` prompts and token prompts in separate prefill batches (`prefill_batches`), and on a
machine with no GPU it installs the CPU attention backend that supports speculative verify and routes
few-row linear layers through `cpu.skinny_gemm`.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import types

from sglang_dart import prefill_batches, request_checks, spec_counts
from sglang_dart.dart import gpu_contracts

logger = logging.getLogger(__name__)


def cpu_stand_in_active() -> bool:
    """True when this process runs SGLang's CPU engine with sglang_dart's stand-in for sgl_kernel."""
    from sglang_dart.cpu import detect
    from sglang_dart.cpu.kernel_shim import is_stand_in

    if not detect.cpu_engine_active():
        return False
    import sgl_kernel  # served by the bootstrap: the real package when it loads, else the stand-in

    return is_stand_in(sys.modules.get("sgl_kernel", sgl_kernel))


def install_cpu_attention() -> None:
    from sglang.srt.layers.attention import attention_registry

    from sglang_dart.cpu.attention import create_backend

    attention_registry.ATTENTION_BACKENDS["torch_native"] = create_backend


def patch_jit_cflags() -> None:
    """SGLang's JIT-built n-gram corpus (NGRAM speculation) uses size_t without including <cstddef>;
    GCC 12's libstdc++ does not pull it in transitively, so the build fails. Force-include the header."""
    from sglang.kernels.jit.utils import compile as jit_compile

    flags = ["-include", "cstddef"]
    if flags[1] not in jit_compile.DEFAULT_CFLAGS:
        jit_compile.DEFAULT_CFLAGS.extend(flags)


def put_ninja_on_path() -> None:
    """SGLang's JIT kernels (the NGRAM corpus among them) run `ninja` by name. The pinned `ninja` wheel
    puts it in the virtualenv's bin directory, which is not on PATH when the server is started as
    `.venv/bin/python -m sglang.launch_server` without activating the environment."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # SGLang reports the missing tool when a JIT build needs it
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def register_draft_model() -> None:
    """Make SGLang's model registry know the drafters' architecture, so its draft worker loads them.
    Done where a DART worker is built: importing the registry imports every SGLang model."""
    from sglang.srt.models.registry import ModelRegistry

    from sglang_dart.drafter.config import DART_ARCHITECTURE
    from sglang_dart.drafter.sglang_model import LlamaForCausalLMDart

    ModelRegistry.models[DART_ARCHITECTURE] = LlamaForCausalLMDart


def register_dart() -> None:
    """`--speculative-algorithm DART`: validated in the launcher, built in every scheduler process."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    from sglang_dart.dart import settings

    class DartAlgorithm(CustomSpecAlgo):
        def is_ngram(self) -> bool:  # scheduler side: NGRAM's tree verify input handling
            return True

        def __getattr__(self, name: str):  # noqa: ANN204
            # SGLang 0.5.17 asks every algorithm for methods CustomSpecAlgo lacks (create_future_map,
            # carries_draft_hidden_states, need_topk, ...): use the builtin enum's, which only call
            # the is_*() answers above.
            method = getattr(SpeculativeAlgorithm, name, None)
            if name.startswith("_") or not callable(method):
                raise AttributeError(name)
            return types.MethodType(method, self)

        def handle_server_args(self, server_args) -> None:  # noqa: ANN001
            settings.handle_server_args(server_args)

    def worker_class(_server_args):  # noqa: ANN001, ANN202
        from sglang_dart.dart.worker import DartWorker

        register_draft_model()
        return DartWorker

    SpeculativeAlgorithm.register(
        "DART",
        supports_overlap=True,
        validate_server_args=settings.validate_server_args,
        spec_class=DartAlgorithm,
    )(worker_class)
    gpu_contracts.install()  # what SGLang's own machinery must do for DART (backend, graphs, memory)


def _cpu_policies_from_server_args(_result, server_args, *_args, **_kwargs) -> None:  # noqa: ANN001
    from sglang_dart.cpu import idle_sleep, skinny_gemm

    skinny_gemm.keep_openmp_from_spinning(server_args.dtype)
    idle_sleep.apply(server_args)


def set_cpu_policies_once_args_are_known() -> None:
    """Whether torch's OpenMP workers may spin depends on the target's dtype, and the idle sleeper is a
    server argument: both are known only once the server arguments are parsed. Hook
    ServerArgs.__post_init__, which runs in the launching process (server and Engine alike) before the
    scheduler processes are spawned."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_dart.cpu import idle_sleep

    idle_sleep.wanted()  # a bad value stops the launcher here, not inside ServerArgs
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.__post_init__", _cpu_policies_from_server_args, HookType.AFTER
    )


def register() -> None:
    register_dart()
    spec_counts.install()
    request_checks.install()
    prefill_batches.install()
    put_ninja_on_path()
    from sglang_dart.cpu import detect

    if detect.cpu_engine_active():
        from sglang_dart.cpu import gemm_tuning, rowwise_ops, rust_attention, skinny_gemm, small_step_threads
        from sglang_dart.cpu.grammar import allow_grammar_without_cuda

        allow_grammar_without_cuda()
        try:
            skinny_gemm.install()
            rowwise_ops.install()
            rust_attention.install()
            set_cpu_policies_once_args_are_known()
            small_step_threads.install()
            gemm_tuning.install()
        except ValueError as err:
            # SGLang logs and skips a plugin that raises; a bad setting must stop the server instead.
            raise SystemExit(f"sglang_dart: {err}") from err
    if cpu_stand_in_active():
        install_cpu_attention()
        patch_jit_cflags()
        from sglang_dart.peers import install_cpu_support

        install_cpu_support()
        logger.info("sglang_dart: CPU engine, sgl_kernel stand-in; torch_native attention can verify trees")
