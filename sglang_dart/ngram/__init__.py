"""Memory-mapped 3-gram store for DART tree pruning.

The store itself lives in Rust (``sglang_dart._core``); this package adds corpus reading, tokenization,
the tokenizer fingerprint and the ``python -m sglang_dart.ngram`` CLI.
Format: ``rust/dart-core/STORE_FORMAT.md``.
"""

from sglang_dart._core import NgramBuilder, NgramFormatError, NgramStore, import_reference_trie
from sglang_dart.ngram.build import build_store, iter_documents, iter_input_files, parse_size
from sglang_dart.ngram.fingerprint import tokenizer_fingerprint

__all__ = [
    "NgramBuilder",
    "NgramFormatError",
    "NgramStore",
    "build_store",
    "import_reference_trie",
    "iter_documents",
    "iter_input_files",
    "parse_size",
    "tokenizer_fingerprint",
]
