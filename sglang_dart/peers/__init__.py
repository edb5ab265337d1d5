"""CPU support for SGLang's builtin EAGLE3 and DFLASH workers, the speculative decoders DART is compared
with (`benchmarks/peers.py`). Installed by the plugin only where SGLang's CPU engine runs."""

from __future__ import annotations


def install_cpu_support() -> None:
    from sglang_dart.peers import dflash_cpu, eagle3_cpu

    eagle3_cpu.install()
    dflash_cpu.install()
