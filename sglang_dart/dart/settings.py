"""DART's server settings: stock SGLang flags where their meaning fits, the drafter's config and
environment variables for the pruner knobs. Validated at start-up, in the launcher, before any model loads.

- draft checkpoint: `--speculative-draft-model-path` (config.json + model.safetensors);
- 3-gram store: `--speculative-ngram-external-corpus-path` (built by `python -m sglang_dart.ngram build`);
- tree size N, root included: `--speculative-num-draft-tokens` (default 16), the largest tree a step
  verifies; the tree shrinks as the batch grows (`tree_sizes.py`) by `SGLANG_DART_TREE_SIZES`, else the
  drafter config's `dart_tree_sizes`, else a default for the device (and on a CPU, for AMX or
  AVX512-BF16 with a bf16 target) (`fixed`: always N; `auto`: chosen from measured step times,
  `adaptive_sizes.py`; `guarded:SCHEDULE`: that schedule with the CPU default's guard);
- candidates per depth k: `--speculative-eagle-topk` (default 16, at most the draft vocabulary). SGLang
  reserves KV per request and step for `num_steps × topk` tokens, while a DART step writes exactly N, so
  at start-up k moves to the environment variable `SGLANG_DART_TOPK` (inherited by the scheduler
  processes) and the flag becomes 1;
- tree depth: the drafter's `draft_length` + 1 (`--speculative-num-steps` becomes min(depth, N - 1), the
  longest path a step can accept);
- beam width, β, λ exponent, α base, n-gram term at the first level: `SGLANG_DART_BEAM_WIDTH`,
  `SGLANG_DART_NGRAM_WEIGHT`, `SGLANG_DART_LEVEL_EXPONENT`, `SGLANG_DART_LOGIT_BASE`,
  `SGLANG_DART_NGRAM_AT_LEVEL0`, else the `dart_beam_width`, `dart_ngram_weight`,
  `dart_level_weight_exponent`, `dart_logit_weight_base`, `dart_ngram_at_level0` keys of the drafter's
  config.json, else the reference's 20 / 0.5 / 0.7 / 0.9 / false;
- context chains: `SGLANG_DART_CONTEXT_NODES`, else the drafter config's `dart_context_nodes`, else
  `DEFAULT_CONTEXT_NODES`: at most this many nodes of each tree may come from the request's own context (the
  tokens that followed the latest earlier occurrence of its current suffix, `pruner.ContextIndex`); 0 turns
  them off.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sglang_dart.dart import gpu_contracts
from sglang_dart.dart.adaptive_sizes import AUTO, AdaptiveTreeSizes, GuardedTreeSizes
from sglang_dart.dart.tree_sizes import (
    TreeSizeSchedule,
    TreeSizesError,
    default_schedule,
    default_schedule_key,
)
from sglang_dart.drafter import DraftConfig, DraftConfigError
from sglang_dart.drafter.config import DART_ARCHITECTURE
from sglang_dart.pruner import PrunerConfig

logger = logging.getLogger(__name__)

DEFAULT_NUM_DRAFT_TOKENS = 16
# Candidates per depth. 16 over 8: +0.9-2.7% tokens per step with trees of 16, level (-1.1 to +1.1%) with
# trees of 8, for about 0.02 ms more pruning a batch-1 step (acceptance.md, run 31).
DEFAULT_TOPK = 16
TOPK_ENV = "SGLANG_DART_TOPK"
TREE_SIZES_ENV = "SGLANG_DART_TREE_SIZES"
# On a CPU DART runs without overlap scheduling unless this is 1 (the tests set it, to cover the path a GPU
# server takes by default): there both run on the same cores, and overlap cost DART 4-7% more CPU time per
# token (run 31), as SGLang also turns it off for its own speculative workers on CPU.
CPU_OVERLAP_ENV = "SGLANG_DART_CPU_OVERLAP"
TREE_SIZES_KEY = "dart_tree_sizes"
GUARDED_PREFIX = "guarded:"
CONTEXT_NODES_ENV = "SGLANG_DART_CONTEXT_NODES"
CONTEXT_NODES_KEY = "dart_context_nodes"
# Measured on SmolLM2-135M with a drafter trained on 943 answers, 24 varied held-out prompts (acceptance.md,
# run 7): +16% tokens per step with 4 nodes in trees of 16 (+18% with 8), +18% in trees of 8, +12% in trees
# of 4 (3 nodes).
DEFAULT_CONTEXT_NODES = 4

_KNOBS = {  # PrunerConfig field: (environment variable, drafter config key, type)
    "beam_width": ("SGLANG_DART_BEAM_WIDTH", "dart_beam_width", int),
    "ngram_weight": ("SGLANG_DART_NGRAM_WEIGHT", "dart_ngram_weight", float),
    "level_weight_exponent": ("SGLANG_DART_LEVEL_EXPONENT", "dart_level_weight_exponent", float),
    "logit_weight_base": ("SGLANG_DART_LOGIT_BASE", "dart_logit_weight_base", float),
    "ngram_at_level0": (
        "SGLANG_DART_NGRAM_AT_LEVEL0",
        "dart_ngram_at_level0",
        lambda v: str(v).lower() in ("1", "true"),
    ),
}


class DartArgsError(ValueError):
    """A server argument DART cannot run with."""


def _draft_config_json(server_args: Any) -> dict[str, Any]:
    return json.loads((Path(server_args.speculative_draft_model_path) / "config.json").read_text())


def _torch_cpu_check(name: str) -> bool:
    import torch

    try:
        return bool(getattr(torch.cpu, name)())
    except AttributeError:  # a private torch function: another torch version may lack it
        return False


def cpu_has_amx_bf16() -> bool:
    """Whether the CPU has AMX tiles (Xeon Sapphire Rapids on; all of them do bf16), by torch's own check,
    the one SGLang's `cpu_has_amx_support` calls."""
    return _torch_cpu_check("_is_amx_tile_supported")


def cpu_has_avx512_bf16() -> bool:
    """Whether the CPU has AVX512-BF16 dot products (e.g. AMD Zen 4), by torch's own check."""
    return _torch_cpu_check("_is_avx512_bf16_supported")


def fast_dtype(device: str, cpu_has_amx: bool, cpu_has_avx512_bf16: bool) -> str:
    """The dtype DART serves a SmolLM2-sized target fastest in: bfloat16 on a GPU or on a CPU with bf16
    matrix instructions (AMX or AVX512-BF16); float32 on any other CPU, where torch's many-row bf16
    products are emulated (AVX2-only EPYC, the demo's 128 tokens: DART 23.0 tok/s in float32, 9.5 in
    bfloat16, where the guard kept it on root-only steps). Since the Rust bf16 product runs on AVX2 the
    two are close there (run 119, 7 prompts at batch 1: bf16 DART 1.42x bf16 plain, float32 DART 1.33x,
    one run); float32 stays, the dtype the demo was measured in."""
    if device != "cpu" or cpu_has_amx or cpu_has_avx512_bf16:
        return "bfloat16"
    return "float32"


def slow_half_precision_hint(
    device: str,
    target_dtype: str,
    cpu_has_amx: bool,
    cpu_has_avx512_bf16: bool,
    rust_half_products: bool = False,
) -> str | None:
    """What to tell a user serving a bfloat16 or float16 target on a CPU without bf16 matrix instructions
    (None elsewhere): there torch's half-precision linear layer costs in proportion to its rows (AVX2-only
    EPYC, 576 -> 1536: 80 us a row for 1 to 300 rows in float16, 120 in bfloat16; float32 3.8 ms for 300),
    so a tree's verify costs several decode steps and the guard keeps DART on root-only steps, no faster
    than plain. Not where the Rust product takes the target's linears (`rust_half_products`:
    `skinny_gemm.rust_dtypes` has its dtype): its AVX2 kernels read each weight once for all rows (run 119:
    guarded bf16 DART 1.34x plain at batch 1). SGLang's `--dtype auto` also serves a float32 checkpoint in
    float16 on a CPU."""
    dtype = target_dtype.removeprefix("torch.")
    if (
        dtype not in ("bfloat16", "float16")
        or fast_dtype(device, cpu_has_amx, cpu_has_avx512_bf16) != "float32"
        or rust_half_products
    ):
        return None
    return (
        f"DART: the target runs in {dtype} on a CPU without AMX or AVX512-BF16, where a {dtype} linear "
        "layer costs in proportion to its rows: trees seldom pay and DART falls back to root-only steps, "
        "no faster than plain decoding; --dtype float32 is where DART speeds decoding up on this CPU"
    )


def fast_dtype_here(device: str = "cpu") -> str:
    """`fast_dtype` for this machine's CPU."""
    return fast_dtype(device, cpu_has_amx_bf16(), cpu_has_avx512_bf16())


def resolve_dtype(choice: str) -> str:
    """A `--dtype` choice for the demo and the benchmarks: `auto` is the dtype this machine decodes fastest
    in (`fast_dtype`, on its GPU if it has one); any other is kept as given."""
    if choice != "auto":
        return choice
    import torch

    return fast_dtype_here("cuda" if torch.cuda.is_available() else "cpu")


def tree_size_schedule(server_args: Any, target_dtype: Any = None) -> TreeSizeSchedule | AdaptiveTreeSizes:
    """Tree size by batch size, capped at --speculative-num-draft-tokens. The default depends on the
    device and, on a CPU, on the target's dtype (`target_dtype`, the loaded model's; None: --dtype)."""
    largest = server_args.speculative_num_draft_tokens
    text = os.environ.get(TREE_SIZES_ENV, _draft_config_json(server_args).get(TREE_SIZES_KEY))
    if text is None:
        dtype = str(target_dtype if target_dtype is not None else getattr(server_args, "dtype", "auto"))
        key = default_schedule_key(server_args.device, dtype, cpu_has_amx_bf16(), cpu_has_avx512_bf16())
        schedule = default_schedule(key, largest)
        # On a CPU the default is guarded: root-only steps wherever trees measure slower. On CUDA it stays
        # fixed, the one width SGLang captures verify graphs for (a root-only step would run eagerly).
        return GuardedTreeSizes(schedule) if server_args.device == "cpu" else schedule
    text = str(text).strip()
    if text.lower() == AUTO:
        return AdaptiveTreeSizes(largest)
    # `guarded:1:8,4:4,8:4`: a schedule of one's own with the default's guard (root-only steps wherever
    # its trees measure slower), e.g. to measure a candidate default as it would serve.
    guarded = text.lower().startswith(GUARDED_PREFIX)
    try:
        schedule = TreeSizeSchedule.parse(text[len(GUARDED_PREFIX) :] if guarded else text, largest)
    except TreeSizesError as exc:
        raise DartArgsError(f"{TREE_SIZES_ENV} / {TREE_SIZES_KEY}: {exc}") from exc
    return GuardedTreeSizes(schedule) if guarded else schedule


def pruner_config(server_args: Any) -> PrunerConfig:
    raw = _draft_config_json(server_args)
    knobs: dict[str, Any] = {}
    for field, (env, key, kind) in _KNOBS.items():
        value = os.environ.get(env, raw.get(key))
        if value is not None:
            try:
                knobs[field] = kind(value)
            except ValueError as exc:
                raise DartArgsError(f"{env} / {key} = {value!r} is not valid for {field}") from exc
    return PrunerConfig(
        topk=candidates_per_depth(), num_nodes=server_args.speculative_num_draft_tokens - 1, **knobs
    )


def context_nodes(server_args: Any) -> int:
    """How many nodes of a tree its context chain may take (0: no chains)."""
    value = os.environ.get(CONTEXT_NODES_ENV, _draft_config_json(server_args).get(CONTEXT_NODES_KEY))
    if value is None:
        return DEFAULT_CONTEXT_NODES
    nodes = _whole_count(value)
    if nodes is None:
        raise DartArgsError(f"{CONTEXT_NODES_ENV} / {CONTEXT_NODES_KEY} = {value!r}: need an integer >= 0")
    return nodes


DRAFT_GRAPHS_ENV = "SGLANG_DART_DRAFT_GRAPHS"
DRAFT_GRAPHS_CHOICES = ("1", "0", "emulate")


def draft_graphs_choice() -> str:
    """How the draft step runs where SGLang runs CUDA graphs (`device_graphs`): "1" (default) replays
    graphs, "0" keeps it eager, "emulate" replays the graphs' buffer contract without CUDA (tests)."""
    value = os.environ.get(DRAFT_GRAPHS_ENV, "1").strip().lower()
    if value not in DRAFT_GRAPHS_CHOICES:
        raise DartArgsError(f"{DRAFT_GRAPHS_ENV} = {value!r}: need one of {', '.join(DRAFT_GRAPHS_CHOICES)}")
    return value


def candidates_per_depth() -> int:
    value = os.environ.get(TOPK_ENV, DEFAULT_TOPK)
    topk = _whole_count(value)
    if topk is None:
        raise DartArgsError(f"{TOPK_ENV} = {value!r}: need an integer >= 1")
    return topk


def resolve_topk(given: int | None, draft_vocab_size: int) -> int:
    """k, the candidates per depth: --speculative-eagle-topk, else `SGLANG_DART_TOPK` (also where an earlier
    process of this server translated the flag to it and left 1), else DEFAULT_TOPK capped at the draft
    vocabulary."""
    translated = given == 1 and TOPK_ENV in os.environ  # validated before in this process tree
    if given is not None and not translated:
        topk = given
    elif TOPK_ENV in os.environ:
        topk = candidates_per_depth()
    else:
        topk = min(DEFAULT_TOPK, draft_vocab_size)
    if not 1 <= topk <= draft_vocab_size:
        raise DartArgsError(f"--speculative-eagle-topk must be in [1, {draft_vocab_size}] (draft vocabulary)")
    return topk


def _whole_count(value: Any) -> int | None:
    """An integer >= 0 from an environment string or a JSON value, else None. A JSON 2.5 or true is
    refused rather than truncated to 2 or read as 1."""
    if isinstance(value, bool) or isinstance(value, float):
        return None
    try:
        count = int(str(value).strip())
    except ValueError:
        return None
    return count if count >= 0 else None


def check_draft_architecture(draft_dir: str | Path) -> None:
    """SGLang picks the draft's model class by config.json's `architectures`: it must name DART's layer."""
    architectures = json.loads((Path(draft_dir) / "config.json").read_text()).get("architectures") or []
    if DART_ARCHITECTURE not in architectures:
        raise DartArgsError(
            f"draft checkpoint {draft_dir} names architectures {architectures}; SGLang loads DART's draft "
            f'layer for "architectures": ["{DART_ARCHITECTURE}"] in config.json (the published name)'
        )


def refuse_what_does_not_fit_the_target(
    model_path: str, draft: DraftConfig, store_vocab_size: int, store_path: str
) -> None:
    """The drafter's and the store's sizes against a local target's config.json, in the launcher: a misfit
    is named before any weight loads (the scheduler checks the loaded target again, for any target)."""
    try:
        target = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):  # a hub id or an unreadable file: left to the scheduler's check
        return
    hidden, vocab = target.get("hidden_size"), target.get("vocab_size")
    if not isinstance(hidden, int) or not isinstance(vocab, int):  # e.g. nested in a text_config
        return
    try:
        draft.check_fits_target(hidden, vocab)
    except DraftConfigError as exc:
        raise DartArgsError(f"DART draft checkpoint: {exc}") from exc
    refuse_larger_store_vocabulary(store_vocab_size, vocab, store_path)


def refuse_larger_store_vocabulary(store_vocab_size: int, target_vocab_size: int, store_path: str) -> None:
    """A store's ids must be the target's: one with more ids was built with another tokenizer."""
    if store_vocab_size > target_vocab_size:
        raise DartArgsError(
            f"3-gram store {store_path} has vocabulary {store_vocab_size} > target's {target_vocab_size}"
        )


def draft_server_args(server_args: Any, target_dtype: Any) -> Any:
    """A copy of the server arguments to build the drafter with: its --dtype is the target's, as loaded.
    A drafter checkpoint whose config names no dtype (the shipped one, the trainer's) counts as float32,
    and SGLang's `--dtype auto` serves a float32 config in float16: beside a bf16 target the drafter ran in
    float16, which no CPU of ours computes natively (torch widens it per row; its 7-row head took 6.9 ms
    against 1.1 for the Rust bf16 product on the AVX2 EPYC) and whose range is not the bf16 weights'."""
    args = copy.deepcopy(server_args)
    args.override(__name__, dtype=str(target_dtype).removeprefix("torch."))
    return args


def keep_the_drafter_unquantized(server_args: Any) -> None:
    """SGLang gives the draft model the target's --quantization unless told otherwise; DART's one-layer
    drafter runs unquantized (in the target's activation dtype), so a quantized target serves with it as is.
    A quantization asked for the drafter alone is refused by name."""
    asked = server_args.speculative_draft_model_quantization
    if asked is None:
        return
    if asked != server_args.quantization:
        raise DartArgsError(
            f"DART's draft layer runs unquantized: drop --speculative-draft-model-quantization {asked}"
        )
    server_args.speculative_draft_model_quantization = None
    logger.info("DART: the drafter runs unquantized beside the %s target", asked)


def validate_server_args(server_args: Any) -> None:
    """Fill DART's defaults into the stock flags and refuse what DART cannot run with, naming it."""
    from sglang_dart.ngram import NgramFormatError, NgramStore

    if not server_args.speculative_draft_model_path:
        raise DartArgsError("DART needs a draft checkpoint: --speculative-draft-model-path DIR")
    try:
        draft = DraftConfig.from_dir(server_args.speculative_draft_model_path)
    except DraftConfigError as exc:
        raise DartArgsError(f"DART draft checkpoint: {exc}") from exc
    store_path = server_args.speculative_ngram_external_corpus_path
    if not store_path:
        raise DartArgsError("DART needs a 3-gram store: --speculative-ngram-external-corpus-path FILE")
    if not Path(store_path).is_file():
        raise DartArgsError(f"DART 3-gram store {store_path} does not exist")
    try:
        store = NgramStore(store_path)
    except (NgramFormatError, OSError, ValueError) as exc:
        raise DartArgsError(f"DART 3-gram store {store_path} is unusable: {exc}") from exc
    check_draft_architecture(server_args.speculative_draft_model_path)
    refuse_what_does_not_fit_the_target(server_args.model_path, draft, store.vocab_size, store_path)
    if server_args.device not in ("cpu", "cuda"):
        raise DartArgsError(f"DART runs on cpu or cuda, not {server_args.device}")
    draft_graphs_choice()  # a bad value stops the launcher, before any model loads
    gpu_contracts.refuse_chain_only_backends(server_args)
    refuse_split_kv_pools(server_args)
    if server_args.speculative_use_rejection_sampling:
        raise DartArgsError(
            "DART verifies its trees itself (greedy, or one target draw per node, which keeps the target's "
            "distribution): drop --speculative-use-rejection-sampling"
        )
    keep_the_drafter_unquantized(server_args)
    for flag, given, why in (
        ("--speculative-token-map", server_args.speculative_token_map, "its checkpoint maps its vocabulary"),
        ("--enable-multi-layer-eagle", server_args.enable_multi_layer_eagle, "its drafter is one layer"),
    ):
        if given:
            raise DartArgsError(f"DART has no use for {flag} ({why}): drop it")
    for name, ok in (
        ("--tp-size > 1", server_args.tp_size == 1),
        ("--pp-size > 1", server_args.pp_size == 1),
        ("--page-size > 1", (server_args.page_size or 1) == 1),
        ("--enable-dp-attention", not server_args.enable_dp_attention),
        # its target forward returns the drafter's taps, not the hidden states a request asks for
        ("--enable-return-hidden-states", not server_args.enable_return_hidden_states),
        # SGLang starts the extra tokenizer processes without loading plugins: they cannot resolve DART
        ("--tokenizer-worker-num > 1", server_args.tokenizer_worker_num <= 1),
    ):
        if not ok:
            raise DartArgsError(f"DART does not support {name} yet")

    if server_args.speculative_num_draft_tokens is None:
        server_args.speculative_num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS
    if server_args.speculative_num_draft_tokens < 2:
        raise DartArgsError("--speculative-num-draft-tokens must be >= 2 (the root and at least one draft)")
    topk = resolve_topk(server_args.speculative_eagle_topk, draft.draft_vocab_size)
    os.environ[TOPK_ENV] = str(topk)
    depth = draft.draft_length + 1
    server_args.speculative_eagle_topk = 1
    server_args.speculative_num_steps = min(depth, server_args.speculative_num_draft_tokens - 1)
    tree_size_schedule(server_args)  # refuse a malformed schedule now, not at the first decode step
    context_nodes(server_args)
    cfg = pruner_config(server_args)
    possible = cfg.candidate_count(depth, topk)
    if cfg.num_nodes > possible:
        raise DartArgsError(
            f"--speculative-num-draft-tokens {server_args.speculative_num_draft_tokens} exceeds the "
            f"{possible + 1} tree nodes that depth {depth}, top-k {topk} and beam width {cfg.beam_width} "
            "can give"
        )


def refuse_split_kv_pools(server_args: Any) -> None:
    """The drafter keeps its state per slot of one full-attention KV pool; a target whose KV is split into
    sliding-window and full pools (or hybrid mamba / linear-attention pools) has no such single pool."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    model_config = server_args.get_model_config()
    if model_config.is_hybrid_swa:
        raise DartArgsError(
            "DART does not support a target with a hybrid sliding-window KV pool yet: "
            "use --disable-hybrid-swa-memory (one full pool)"
        )
    if mambaish_config(model_config) is not None:
        raise DartArgsError("DART does not support targets with mamba / linear-attention layers yet")


def overlap_turned_off(device: str, environ: Mapping[str, str]) -> bool:
    """Whether DART turns overlap scheduling off: on a CPU, unless SGLANG_DART_CPU_OVERLAP=1."""
    return device == "cpu" and environ.get(CPU_OVERLAP_ENV) != "1"


def handle_server_args(server_args: Any) -> None:
    """Scheduling DART needs: no mixed prefill/decode batches. Overlap scheduling stays as SGLang sets it
    on a GPU (on unless `--disable-overlap-schedule`): the worker tracks each request's tokens itself, so
    SGLang's one-step-late result processing does not affect it (`progress.py`). On a CPU it is off unless
    SGLANG_DART_CPU_OVERLAP=1."""
    if overlap_turned_off(server_args.device, os.environ):
        server_args.disable_overlap_schedule = True
    server_args.enable_mixed_chunk = False
    if server_args.max_running_requests is None:
        server_args.max_running_requests = 64
