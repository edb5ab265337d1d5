"""CLI: ``python -m sglang_dart.ngram {build,info,query,import} ...``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _cmd_build(args: argparse.Namespace) -> int:
    from sglang_dart.ngram.build import build_store

    tok = _load_tokenizer(args.tokenizer)
    t0 = time.perf_counter()
    stats = build_store(
        tok,
        args.inputs,
        args.output,
        min_count=args.min_count,
        memory_budget=args.memory_budget,
        tmp_dir=args.tmp_dir,
        progress=not args.quiet,
    )
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    stats["tokens_per_second"] = round(stats["tokens"] / max(stats["seconds"], 1e-9))
    print(json.dumps(stats, indent=2))
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from sglang_dart._core import NgramStore

    store = NgramStore(args.file)
    if args.verify:
        store.verify()
    info = dict(store.info())
    info["bytes_per_node"] = round(info["file_bytes"] / max(info["nodes"], 1), 3)
    info["tokenizer_fingerprint_hex"] = f"{info['tokenizer_fingerprint']:016x}"
    if args.verify:
        info["verified"] = True
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        n1, n2, n3 = info["nodes_per_level"]
        print(f"file:                  {info['path']}")
        print(f"format version:        {info['format_version']}")
        print(f"order:                 {info['order']}")
        print(f"vocab size:            {info['vocab_size']}")
        print(f"tokenizer fingerprint: {info['tokenizer_fingerprint_hex']}")
        print(f"tokens counted:        {info['total_tokens']}")
        print(f"nodes (1/2/3-grams):   {n1} / {n2} / {n3}  (total {info['nodes']})")
        print(f"bytes on disk:         {info['file_bytes']}  ({info['bytes_per_node']} B/node)")
        print(f"min count:             {info['min_count']}")
        print(f"imported from .trie:   {info['imported']}")
        if args.verify:
            print("verify:                OK")
    return 0


def _cmd_query(args: argparse.Namespace) -> int:
    from sglang_dart._core import NgramStore

    store = NgramStore(args.file)
    tok = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    if tok is not None:
        from sglang_dart.ngram.fingerprint import tokenizer_fingerprint

        fp = tokenizer_fingerprint(tok)
        if store.tokenizer_fingerprint not in (0, fp):
            print(
                "warning: store was built for another tokenizer (fingerprint "
                f"{store.tokenizer_fingerprint:016x} != {fp:016x})",
                file=sys.stderr,
            )
        ctx = tok(args.context, add_special_tokens=False)["input_ids"]
    else:
        try:
            ctx = [int(x) for x in args.context.replace(",", " ").split()]
        except ValueError:
            print("error: without --tokenizer, --context must be token ids (e.g. '12 345')", file=sys.stderr)
            return 2
    top = store.top_next(ctx[-2:], args.top)
    rows = []
    for t, p in top:
        row: dict[str, Any] = {"token": t, "prob": round(float(p), 6)}
        if tok is not None:
            row["text"] = tok.decode([t])
        rows.append(row)
    if args.json:
        print(json.dumps({"context_ids": ctx[-2:], "top": rows}, ensure_ascii=False, indent=2))
    else:
        print(f"context ids: {ctx[-2:]}")
        for r in rows:
            text = f"  {r['text']!r}" if "text" in r else ""
            print(f"{r['token']:>8}  {r['prob']:.6f}{text}")
        if not rows:
            print("(no continuation seen in the corpus)")
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    from sglang_dart._core import import_reference_trie
    from sglang_dart.ngram.build import parse_size, tokenizer_vocab_size

    fp = 0
    vocab = args.vocab_size
    if args.tokenizer:
        from sglang_dart.ngram.fingerprint import tokenizer_fingerprint

        tok = _load_tokenizer(args.tokenizer)
        fp = tokenizer_fingerprint(tok)
        vocab = vocab or tokenizer_vocab_size(tok)
    if not vocab:
        print("error: --vocab-size is required (or give --tokenizer)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    stats = dict(
        import_reference_trie(
            args.reference,
            args.output,
            vocab,
            tokenizer_fingerprint=fp,
            min_count=args.min_count,
            memory_budget=parse_size(args.memory_budget),
            tmp_dir=args.tmp_dir,
        )
    )
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(stats, indent=2))
    return 0


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_dart.ngram", description="DART 3-gram store tools")
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="count 1/2/3-grams of text corpora into a store")
    b.add_argument("--tokenizer", required=True, help="HF tokenizer directory")
    b.add_argument("--output", "-o", required=True)
    b.add_argument("--min-count", type=int, default=1, help="drop 2/3-grams seen fewer times (default 1)")
    b.add_argument("--memory-budget", default="1G", help="record buffer size, e.g. 512M, 2G (default 1G)")
    b.add_argument("--tmp-dir", default=None, help="where sorted runs spill (default: system temp)")
    b.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    b.add_argument("inputs", nargs="+", help="files or folders (recursive); .jsonl = one {'text'} per line")
    b.set_defaults(func=_cmd_build)

    i = sub.add_parser("info", help="print a store's header")
    i.add_argument("file")
    i.add_argument("--json", action="store_true")
    i.add_argument("--verify", action="store_true", help="also check every checksum (reads the whole file)")
    i.set_defaults(func=_cmd_info)

    q = sub.add_parser("query", help="most likely next tokens after a context")
    q.add_argument("file")
    q.add_argument("--context", required=True, help="text (with --tokenizer) or token ids")
    q.add_argument("--top", type=int, default=10)
    q.add_argument("--tokenizer", default=None)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_cmd_query)

    m = sub.add_parser("import", help="convert a reference DART .trie file")
    m.add_argument("reference", help="reference .trie file")
    m.add_argument("--output", "-o", required=True)
    m.add_argument("--vocab-size", type=int, default=None)
    m.add_argument("--tokenizer", default=None, help="records its fingerprint (and vocab size if not given)")
    m.add_argument("--min-count", type=int, default=1)
    m.add_argument("--memory-budget", default="1G")
    m.add_argument("--tmp-dir", default=None)
    m.set_defaults(func=_cmd_import)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (OSError, ValueError) as e:  # NgramFormatError is a ValueError
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
