"""One batched draft forward (through SGLang's KV pool and the CPU attention backend), by batch size and by
the depth it drafts to. A step drafts only as deep as the next tree can reach (a tree of N nodes past its
root is at most N deep), so trees of 4 need 3 of the d + 1 rows; this prints each depth's time and its
ratio to the full depth, measured interleaved in one process.

    .venv/bin/python benchmarks/draft_forward.py [--batch-sizes 1 4 16] [--depths 3 7 8] [--dtype bfloat16] \\
        [--after verify|prefill] [--tree-size 8]

Shapes are SmolLM2-135M's with the trained drafter's settings (d = 7, draft vocabulary 8192); the weights
are random, which does not change the time. Every request has a `--prefix`-token history in the draft's
K/V and commits `--accepted` tokens per step.

`--after verify` (the default) times what a decode step runs after its verify: the accepted path's
residual store and `DraftForward.block_step` over a `--tree-size` tree (laid out on the device, `size + 1
+ masks` rows per request). `--after prefill` times `DraftForward.step` over the `--accepted` entries
(every entry attending); `--after prefill-newest` times `DraftForward.step_from_newest`, what a prefill
runs (the entries before the newest stored as K/V alone, then the newest and the mask slots drafted):
`--prefix 1 --accepted P` is a prompt of P + 1 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig

from sglang_dart.drafter.sglang_model import LlamaForCausalLMDart
from sglang_dart.train.checkpoint import draft_config_dict
from tests.support.draft_pools import draft_forward_over_pools

SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
}


def _drafter(dtype: torch.dtype, draft_length: int, draft_vocab: int) -> LlamaForCausalLMDart:
    config = draft_config_dict(SMOLLM2_135M, draft_length, draft_vocab)
    embed = torch.randn(SMOLLM2_135M["vocab_size"], SMOLLM2_135M["hidden_size"], dtype=dtype)
    model = LlamaForCausalLMDart(LlamaConfig(**config)).to(dtype).eval()
    model.attach_target(embed, SMOLLM2_135M["hidden_size"], SMOLLM2_135M["vocab_size"])
    with torch.no_grad():
        model.drafter.midlayer.mask_rep.normal_()
    model.drafter.join_projections()  # as `load_weights` leaves a served drafter: q/k/v and gate/up joined
    return model


def _time_steps(
    args: argparse.Namespace, model: LlamaForCausalLMDart, bs: int, depths: list[int | None]
) -> dict:
    """Median ms of a step per depth, the depths interleaved repeat by repeat."""
    hidden = SMOLLM2_135M["hidden_size"]
    # Room for the prefix, a tree and its mask slots (`block_step` writes columns up to root + size + d).
    max_len = args.prefix + max(args.accepted, args.tree_size) + model.cfg.draft_length + 2
    req_to_token = (torch.arange(bs * max_len, dtype=torch.int32) + 1).view(bs, max_len)
    runner = draft_forward_over_pools(model, req_to_token, bs * max_len + 1)
    rpi = list(range(bs))
    slots = req_to_token[:, : args.prefix + args.accepted].reshape(-1).long()
    runner.store_residuals(slots, torch.randn(slots.numel(), 3 * hidden, dtype=model.drafter.fc.weight.dtype))
    first = [args.prefix - 1] * bs
    last = [args.prefix + args.accepted - 1] * bs
    vocab = SMOLLM2_135M["vocab_size"]
    next_tokens = torch.randint(0, vocab, (bs * (args.accepted + 1),)).tolist()
    full = model.cfg.draft_length + 1

    def after_prefill(depth: int | None) -> None:
        runner.step(rpi, first, last, next_tokens, depth)

    def after_prefill_from_newest(_depth: int | None) -> None:
        runner.step_from_newest(rpi, first, last, next_tokens)

    # After a verify: request r's root sits at position `prefix` (its entries before are stored), its tree
    # nodes are verify rows r * size .. r * size + size - 1, and the first `accepted` of them are its path.
    size = args.tree_size
    rows_t = torch.arange(bs, dtype=torch.int64)
    committed = torch.full((bs,), args.prefix, dtype=torch.int64)
    path_nodes = (rows_t.unsqueeze(1) * size + torch.arange(size)).to(torch.int32)
    accept_lens = torch.full((bs,), min(args.accepted, size), dtype=torch.int32)
    taps = torch.randn(bs * size, 3 * hidden, dtype=model.drafter.fc.weight.dtype)
    predict = torch.randint(0, vocab, (bs * size,))
    roots = torch.randint(0, vocab, (bs,))
    committed_list = [args.prefix] * bs

    def after_verify(depth: int | None) -> None:
        runner.store_path_residuals(rows_t, committed, path_nodes, accept_lens, taps)
        runner.block_step(
            rows_t, committed_list, committed, path_nodes, accept_lens, predict, roots, depth or full
        )

    draft = {"verify": after_verify, "prefill": after_prefill, "prefill-newest": after_prefill_from_newest}[
        args.after
    ]
    with torch.no_grad():
        for depth in depths:  # warm-up
            draft(depth)
        times: dict = {depth: [] for depth in depths}
        for _ in range(args.repeats):
            for depth in depths:
                start = time.perf_counter()
                for _ in range(args.steps):
                    draft(depth)
                times[depth].append((time.perf_counter() - start) * 1000 / args.steps)
    return {depth: statistics.median(ms) for depth, ms in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--depths", type=int, nargs="+", default=[3, 7], help="besides the full d + 1")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--draft-length", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--accepted", type=int, default=2, help="tokens each request commits per step")
    parser.add_argument(
        "--after", choices=["verify", "prefill", "prefill-newest"], default="verify", help="which draft path"
    )
    parser.add_argument("--tree-size", type=int, default=8, help="the verified tree's nodes (--after verify)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    drafter = _drafter(getattr(torch, args.dtype), args.draft_length, args.draft_vocab)
    full = args.draft_length + 1
    depths = [None] + sorted({d for d in args.depths if 0 < d < full and args.after != "prefill-newest"})
    print(
        f"draft step after a {args.after}, {args.dtype}, d = {args.draft_length}, prefix {args.prefix}, "
        f"{args.accepted} committed" + (f", trees of {args.tree_size}" if args.after == "verify" else "")
    )
    print("| batch | depth | ms per step | / full depth |")
    print("|---|---|---|---|")
    for bs in args.batch_sizes:
        ms = _time_steps(args, drafter, bs, depths)
        for depth in depths:
            label = f"{full} (full)" if depth is None else str(depth)
            print(f"| {bs} | {label} | {ms[depth]:.2f} | {ms[depth] / ms[None]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
