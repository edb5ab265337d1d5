"""sglang-dart: DART speculative decoding for SGLang."""

__version__ = "0.1.0"
