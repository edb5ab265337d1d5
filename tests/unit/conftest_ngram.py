"""Shared helpers for the n-gram store tests (imported by test_ngram_*.py; not a pytest conftest).

Builds tiny BPE tokenizers on the fly (no hub downloads), a pure-Python reference counter with the exact
window semantics of the DART reference, and a writer of the reference `.trie` format."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

WORDS = (
    "the quick brown fox jumps over the lazy dog while a small cat sleeps near the warm fire and "
    "def return import class self value print for in range if else none true false"
).split()


def random_text(rng: random.Random, n_words: int) -> str:
    # Zipf-ish: low word indices much more frequent, so n-grams repeat.
    return " ".join(WORDS[min(int(rng.paretovariate(1.2)) - 1, len(WORDS) - 1)] for _ in range(n_words))


def train_tokenizer(out_dir: Path, vocab_size: int = 300, seed: int = 0) -> Path:
    """Trains a byte-level BPE on random text and saves it as a PreTrainedTokenizerFast directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([random_text(rng, 30) for _ in range(300)], trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tiny-bpe")


def count_windows(docs: Sequence[Sequence[int]]) -> Counter[tuple[int, ...]]:
    """C(u) for every u of length 1..3: one window per start position, shorter at the document end."""
    c: Counter[tuple[int, ...]] = Counter()
    for d in docs:
        for s in range(len(d)):
            for n in range(1, min(3, len(d) - s) + 1):
                c[tuple(d[s : s + n])] += 1
    return c


def reference_prob(c: Counter[tuple[int, ...]], ctx: Sequence[int], t: int) -> np.float32:
    """dart-method §5.2: trigram MLE, else bigram MLE, else 0; empty context -> 0."""
    if len(ctx) >= 2 and c.get((ctx[-2], ctx[-1]), 0) > 0 and (ctx[-2], ctx[-1], t) in c:
        return np.float32(c[(ctx[-2], ctx[-1], t)] / c[(ctx[-2], ctx[-1])])
    if len(ctx) >= 1 and (ctx[-1], t) in c:
        return np.float32(c[(ctx[-1], t)] / c[(ctx[-1],)])
    return np.float32(0.0)


def random_docs(seed: int, n_docs: int, vocab: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [min(int(rng.paretovariate(1.0)) - 1, vocab - 1) for _ in range(rng.randrange(max_len))]
        for _ in range(n_docs)
    ]


def write_reference_trie(path: Path, docs: Sequence[Sequence[int]], shuffle_seed: int | None = None) -> int:
    """Writes the reference `.trie` (dart-method §5.4) of `docs`; optionally permutes node indices (root
    stays 0) and child order, so parents can come after children. Returns the node count."""
    tokens, parents, counts = [-1], [0], [0]
    children: list[dict[int, int]] = [{}]
    for d in docs:
        for s in range(len(d)):
            cur = 0
            counts[0] += 1
            for t in d[s : s + 3]:
                nxt = children[cur].get(t)
                if nxt is None:
                    nxt = len(tokens)
                    tokens.append(t)
                    parents.append(cur)
                    counts.append(0)
                    children.append({})
                    children[cur][t] = nxt
                counts[nxt] += 1
                cur = nxt
    n = len(tokens)
    perm = list(range(n))
    if shuffle_seed is not None:
        rest = perm[1:]
        random.Random(shuffle_seed).shuffle(rest)
        perm = [0, *rest]  # perm[new] = old
    new_of = {old: new for new, old in enumerate(perm)}
    with open(path, "wb") as f:
        f.write(struct.pack("<QQ", 3, n))
        for old in perm:
            kids = list(children[old].items())
            if shuffle_seed is not None:
                kids.reverse()
            f.write(struct.pack("<iQiQ", tokens[old], new_of[parents[old]], counts[old], len(kids)))
            for t, k in kids:
                f.write(struct.pack("<iQ", t, new_of[k]))
    return n


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    p = subprocess.run(
        [sys.executable, "-m", "sglang_dart.ngram", *args], capture_output=True, text=True, env=env, cwd=REPO
    )
    if check and p.returncode != 0:
        raise AssertionError(f"CLI failed ({p.returncode}): {args}\nstdout:{p.stdout}\nstderr:{p.stderr}")
    return p
