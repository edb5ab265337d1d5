"""Running stock SGLang on a machine with no GPU.

`bootstrap` (loaded at interpreter start by the installed `sglang_dart_cpu.pth`) turns on SGLang's CPU
engine when no accelerator is present and stands in for the CUDA-only `sgl_kernel` package; `ops` holds the
kernel ops the CPU path reaches, written natively; `attention` is an attention backend that also handles
speculative target-verify with a tree mask; `skinny_gemm` computes linear layers of a few rows (small
batches, tree verify) in whichever form this CPU runs faster; `rust_attention` runs decode and verify
attention in one Rust call a layer. Nothing here is active on a machine with a GPU.
"""
