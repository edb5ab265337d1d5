"""A stable 64-bit fingerprint of a tokenizer's vocabulary, stored in the n-gram store header so that a
server can refuse a store built for another tokenizer."""

from __future__ import annotations

import hashlib
import json
from typing import Any

_DOMAIN = b"sglang-dart/tokenizer-fingerprint/v1\n"


def _vocab_and_specials(tokenizer: Any) -> tuple[dict[str, int], list[int]]:
    """Token string -> id map (added tokens included) and the ids of special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "get_added_tokens_decoder") and hasattr(tokenizer, "get_vocab"):
        backend = tokenizer  # a raw `tokenizers.Tokenizer`
    if backend is not None:
        vocab = dict(backend.get_vocab(with_added_tokens=True))
        specials = [i for i, t in backend.get_added_tokens_decoder().items() if getattr(t, "special", False)]
    else:  # slow (Python) tokenizer
        vocab = dict(tokenizer.get_vocab())
        specials = list(getattr(tokenizer, "all_special_ids", []))
    return vocab, sorted(set(int(i) for i in specials))


def tokenizer_fingerprint(tokenizer: Any) -> int:
    """u64 hash of (token string -> id) for every token plus the set of special token ids.

    Deterministic across processes and machines (BLAKE2b over a canonical, id-sorted JSON encoding; no
    use of Python's randomized ``hash``). Accepts a ``transformers`` tokenizer (fast or slow) or a
    ``tokenizers.Tokenizer``; both forms of the same tokenizer give the same value.
    """
    vocab, specials = _vocab_and_specials(tokenizer)
    items = sorted((int(i), str(t)) for t, i in vocab.items())
    h = hashlib.blake2b(digest_size=8)
    h.update(_DOMAIN)
    h.update(json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    h.update(b"\nspecial:")
    h.update(json.dumps(specials, separators=(",", ":")).encode("utf-8"))
    return int.from_bytes(h.digest(), "little")
