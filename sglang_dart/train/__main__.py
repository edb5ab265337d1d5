"""Train a DART drafter for a target model on the target's own outputs.

    python -m sglang_dart.train --target DIR --data data.jsonl --out DRAFT_DIR
        [--draft-length 7] [--draft-vocab-size 8192] [--max-steps 2000] [--max-minutes M] ...

`data.jsonl` holds one row per line: {"input_ids": [...]}, {"text": ...}, an OpenAI chat
{"messages": [{"role", "content"}, ...]} or a ShareGPT {"conversations": [{"from", "value"}, ...]} (chat rows
through the target's chat template; see `conversations.py`). `python -m sglang_dart.train.generate`
makes one by letting the target answer synthetic chat prompts. The result is a
checkpoint in the published layout for `--speculative-draft-model-path`, with `train_report.json` beside it
(steps, time, and tau estimated on the `--holdout` share of the sequences, kept out of training).
`--feature-cache DIR` keeps the target's features on disk, so later runs over the same answers (any
`--format`) skip the feature pass (`feature_cache.py`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import torch

from sglang_dart.drafter import load_drafter
from sglang_dart.train import conversations, run_summary
from sglang_dart.train.checkpoint import draft_config_dict, new_drafter, save_drafter, with_grown_vocab
from sglang_dart.train.estimate import estimate_acceptance, split_holdout
from sglang_dart.train.feature_cache import FeatureCache
from sglang_dart.train.features import SOFT_LABELS, collect_features, load_target
from sglang_dart.train.stop_signal import stop_requested
from sglang_dart.train.trainer import bf16_autocast_pays, train
from sglang_dart.train.vocab import grown_vocab, most_frequent_vocab, vocab_from_d2t

# Padded tokens per feature forward on an accelerator: SmolLM2-135M's bf16 logits of 16k positions take
# 1.6 GB, the taps beside them a tenth of that.
ACCELERATOR_FEATURE_BATCH_TOKENS = 16384


def read_sequences(path: Path, tokenizer, max_len: int) -> conversations.Sequences:
    """The data file's sequences (any format of `conversations.py`) and where their answers start; a bad
    file stops the run at once, before the target is run over it."""
    try:
        sequences = conversations.read_sequences(path, tokenizer, max_len)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    except (OSError, EOFError) as exc:  # missing, unreadable, or a damaged .gz
        raise SystemExit(f"{path}: cannot be read ({exc or type(exc).__name__})") from exc
    if not sequences.ids:
        raise SystemExit(f"{path} holds no usable sequences ({sequences.report()})")
    print(f"{path}: {sequences.report()}", flush=True)
    return sequences


# Drafter formats other than DART's own: `sglang_dart.train.peer_<name>` trains and saves one in the layout
# SGLang's builtin worker for that algorithm loads. Each module has `add_arguments(parser)` (its own
# options, prefixed with its name) and `train_and_save(args, target, feats, held_out) -> dict` (the report).
PEER_FORMATS = ("eagle3", "dflash")
DEFAULT_DRAFT_VOCAB = 8192


def check_vocab_growth(args: argparse.Namespace) -> None:
    """Before any work: with --init, --draft-vocab-size may only keep or grow the checkpoint's vocabulary."""
    if args.init is None or args.draft_vocab_size is None or args.format != "dart":
        return
    try:
        current = json.loads((args.init / "config.json").read_text())["draft_vocab_size"]
    except (OSError, ValueError, KeyError):
        return  # loading the checkpoint reports what is wrong with it
    if args.draft_vocab_size < current:
        raise SystemExit(
            f"--draft-vocab-size {args.draft_vocab_size} is smaller than {args.init}'s vocabulary "
            f"({current}): a drafter's vocabulary can grow, not shrink"
        )


def peer_format(name: str):  # noqa: ANN201
    return importlib.import_module(f"sglang_dart.train.peer_{name}")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_dart.train", description=__doc__.split("\n")[0])
    p.add_argument(
        "--format",
        choices=("dart", *PEER_FORMATS),
        default="dart",
        help="drafter to train: DART's (default), or EAGLE3's / DFLASH's for SGLang's own workers",
    )
    p.add_argument("--target", required=True, type=Path, help="target model directory (HF layout)")
    p.add_argument(
        "--data",
        required=True,
        type=Path,
        help=".jsonl (or .jsonl.gz) of input_ids, text, messages or conversations",
    )
    p.add_argument("--out", required=True, type=Path, help="draft checkpoint directory to write")
    p.add_argument("--draft-length", type=int, default=7, help="mask slots d (tree depth d + 1)")
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help=f"tokens the drafter may propose (default {DEFAULT_DRAFT_VOCAB}; with --init, the checkpoint's, "
        "and a larger value grows it by the data's most frequent missing tokens)",
    )
    p.add_argument("--max-len", type=int, default=1024, help="truncate sequences to this many tokens")
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this long")
    p.add_argument(
        "--anchors", type=int, default=None, help="anchor blocks per sequence (default: dart 32, dflash 64)"
    )
    p.add_argument("--sequences-per-step", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--row-decay",
        type=float,
        default=None,
        help="loss weight gamma^row (default: dart 0.5, eagle3 and dflash 0.8)",
    )
    p.add_argument(
        "--row-decay-final",
        type=float,
        default=None,
        help="gamma at the end of the run: gamma moves linearly from --row-decay to it over the step or "
        "time budget (default: fixed)",
    )
    p.add_argument(
        "--soft-weight",
        type=float,
        default=0.0,
        help="share of DART's loss against the target's top-16 distribution instead of its argmax alone "
        "(0.5 and 1.0 did not beat 0 in a short A/B: benchmarks/results/acceptance.md)",
    )
    p.add_argument(
        "--feature-noise",
        type=float,
        default=0.0,
        help="DART only: Gaussian noise added to the target's taps while training, as a share of each "
        "tap's mean absolute value (a regulariser; 0: none)",
    )
    p.add_argument(
        "--greedy-chains-only",
        action="store_true",
        help="DART only: a draft row learns only where the data keeps to the target's greedy chain from "
        "the anchor on (for text the target did not write: documents, other models' answers)",
    )
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast on CPU (default: where the CPU multiplies bf16 natively, AMX or AVX512-BF16; "
        "elsewhere it is emulated and several times slower than float32)",
    )
    p.add_argument(
        "--target-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="dtype the target computes taps and labels in (auto: its config's; float32 is several times "
        "faster on CPUs without bf16 instructions, at the price of rare argmax ties going the other way)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where the target computes the features and the drafter (any --format) trains: cpu (default) "
        "or cuda[:N] "
        "(features stay in host memory; each step moves its sequences over)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--holdout",
        type=float,
        default=0.05,
        help="share of the sequences kept out of training to estimate tau on at the end (0: none)",
    )
    p.add_argument("--init", type=Path, default=None, help="draft checkpoint to continue training from")
    p.add_argument(
        "--feature-cache",
        type=Path,
        default=None,
        help="directory keeping the target's features between runs (any format reads them)",
    )
    p.add_argument(
        "--feature-batch-tokens",
        type=int,
        default=None,
        help="compute the target's features in length-sorted batches of at most this many padded tokens "
        f"(default: {ACCELERATOR_FEATURE_BATCH_TOKENS} on a GPU, which one sequence a forward leaves "
        "idle; 0, one sequence a forward, on a CPU)",
    )
    for name in PEER_FORMATS:
        peer_format(name).add_arguments(p.add_argument_group(f"--format {name}"))
    return p


def training_device(args: argparse.Namespace) -> torch.device:
    """--device, checked before any work: the CPU or a CUDA device that exists."""
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise SystemExit(f"--device {args.device!r}: {exc}") from exc
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {args.device!r}: the trainer runs on 'cpu' or 'cuda[:N]'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: this machine has no CUDA device torch can use")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SystemExit(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    device = training_device(args)
    if args.bf16 is None:  # a GPU multiplies bf16 natively; a CPU only with AMX or AVX512-BF16
        args.bf16 = device.type == "cuda" or bf16_autocast_pays()
    print(f"training with bf16 autocast {'on' if args.bf16 else 'off'} (--bf16 / --no-bf16)")
    args.row_decay = run_summary.row_decay_of(args)  # resolved here so that the report names it
    if not 0.0 <= args.soft_weight <= 1.0:
        raise SystemExit(f"--soft-weight is a share of the loss, between 0 and 1, not {args.soft_weight}")
    for name, gamma in (("--row-decay", args.row_decay), ("--row-decay-final", args.row_decay_final)):
        if gamma is not None and not gamma > 0:
            raise SystemExit(
                f"{name} is the loss weight's ratio from one row to the next, above 0, not {gamma}"
            )
    if args.feature_noise < 0:
        raise SystemExit(f"--feature-noise is a standard deviation, not {args.feature_noise}")
    if args.anchors is not None and args.anchors < 1:
        raise SystemExit(
            f"--anchors is a count of anchor blocks per sequence, at least 1, not {args.anchors}"
        )
    if args.feature_batch_tokens is not None and args.feature_batch_tokens < 0:
        raise SystemExit(
            f"--feature-batch-tokens is a count of padded tokens (0: one sequence a forward), "
            f"not {args.feature_batch_tokens}"
        )
    if args.feature_noise and args.format != "dart":
        raise SystemExit(f"--feature-noise applies to DART's training only, not to --format {args.format}")
    if args.greedy_chains_only and args.format != "dart":
        raise SystemExit(
            f"--greedy-chains-only applies to DART's training only, not to --format {args.format}"
        )
    if args.soft_weight and args.format != "dart":
        raise SystemExit(f"--soft-weight applies to DART's loss only, not to --format {args.format}")
    check_vocab_growth(args)
    if args.format != "dart" and args.draft_vocab_size is None:
        args.draft_vocab_size = DEFAULT_DRAFT_VOCAB
    from transformers import AutoTokenizer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    data = read_sequences(args.data, tokenizer, args.max_len)
    sequences = data.ids
    dtype = None if args.target_dtype == "auto" else getattr(torch, args.target_dtype)
    target = load_target(args.target, dtype).to(device)
    largest = max(max(seq, default=0) for seq in sequences)
    if largest >= target.config.vocab_size:
        raise SystemExit(
            f"{args.data} holds token id {largest}, outside the target's vocabulary "
            f"({target.config.vocab_size}): was it tokenized for another model?"
        )
    started = time.monotonic()
    soft_labels = SOFT_LABELS if args.soft_weight > 0 else 0
    cache = None
    if args.feature_cache is not None:
        cache = FeatureCache(args.feature_cache, args.target, target.dtype, target.config.num_hidden_layers)
    batch_tokens = args.feature_batch_tokens
    if batch_tokens is None:
        batch_tokens = ACCELERATOR_FEATURE_BATCH_TOKENS if device.type != "cpu" else 0
    every = collect_features(
        target,
        sequences,
        soft_labels=soft_labels,
        cache=cache,
        answer_starts=data.answer_starts,
        batch_tokens=batch_tokens,
    )
    feats, held_out = split_holdout(every, args.holdout, args.seed)
    print(
        f"features of {len(feats) + len(held_out)} sequences in {time.monotonic() - started:.0f}s "
        f"({len(held_out)} held out)",
        flush=True,
    )
    target = target.cpu()  # a drafter is built on the host, then moved with the target tensors it reads
    if args.format != "dart":
        report = peer_format(args.format).train_and_save(args, target, feats, held_out, device)
        (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
        return
    target_config = target.config.to_dict()
    vocab_size = target.config.vocab_size
    embed = target.get_input_embeddings().weight.detach()
    if args.init:  # continue training an existing drafter (its shape and vocabulary win)
        model = load_drafter(args.init, embed, target.config.hidden_size, vocab_size, dtype=torch.float32)
        model.train()
        vocab = vocab_from_d2t(model.d2t, vocab_size)
        config = json.loads((args.init / "config.json").read_text())
        if args.draft_vocab_size is not None and args.draft_vocab_size != vocab.size:
            try:
                wider = grown_vocab(vocab, [f.answer_labels() for f in feats], args.draft_vocab_size)
            except ValueError as exc:
                raise SystemExit(f"--draft-vocab-size: {exc}") from exc
            lm_head = target.get_output_embeddings().weight.detach()
            model, config = with_grown_vocab(model, config, vocab, wider, lm_head)
            print(f"draft vocabulary grown from {vocab.size} to {wider.size} tokens", flush=True)
            vocab = wider
    else:
        size = args.draft_vocab_size or DEFAULT_DRAFT_VOCAB
        vocab = most_frequent_vocab([f.answer_labels() for f in feats], vocab_size, size)
        config = draft_config_dict(target_config, args.draft_length, vocab.size)
        lm_head = target.get_output_embeddings().weight.detach()
        model = new_drafter(config, embed, lm_head, vocab, seed=args.seed)
    del target
    model.to(device)
    model.embed_tokens = model.embed_tokens.to(device)
    settings = run_summary.settings_from_args(args)
    trained_from = time.monotonic()
    losses = train(model, feats, vocab, settings, log=lambda s: print(s, flush=True))
    seconds = time.monotonic() - trained_from
    save_drafter(model, config, vocab, args.out)
    run_summary.announce_saved(losses, seconds, args.out)
    estimate = None  # a run stopped by a signal saves and goes, before a second signal ends it
    if not stop_requested():
        estimate = estimate_acceptance(model, held_out, vocab, bf16_autocast=args.bf16, seed=args.seed)
    if estimate is not None:
        print(estimate.describe(), flush=True)
    report = run_summary.report(args, losses, seconds, feats, held_out, estimate)
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
