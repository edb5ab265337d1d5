"""DART speculative decoding inside SGLang: settings, the batched draft runner and the worker."""
