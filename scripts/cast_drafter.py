"""Copy a drafter directory (any format: DART, EAGLE3, DFLASH) with its floating-point tensors cast to
another dtype (default bf16, as the shipped drafter is): half the bytes, for shipping or for carrying
back from a GPU host. Integer tensors (d2t, t2d) are kept as they are; SGLang's loaders cast the weights
to the serving dtype.

    python scripts/cast_drafter.py SRC_DIR DST_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def cast_drafter(src: Path, dst: Path, dtype: torch.dtype) -> dict[str, str]:
    """Write DST (config and every other file copied, model.safetensors cast); returns {name: dtype}."""
    weights = src / "model.safetensors"
    if not weights.is_file() or not (src / "config.json").is_file():
        raise SystemExit(f"{src} is not a drafter directory (config.json and model.safetensors)")
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.name != "model.safetensors":
            shutil.copy(path, dst / path.name)
    tensors = load_file(str(weights))
    cast = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    save_file(cast, str(dst / "model.safetensors"))
    return {k: str(v.dtype).removeprefix("torch.") for k, v in cast.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    kinds = cast_drafter(args.src, args.dst, getattr(torch, args.dtype))
    print(json.dumps(sorted(set(kinds.values()))))


if __name__ == "__main__":
    main()
