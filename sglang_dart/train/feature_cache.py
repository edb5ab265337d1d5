"""The target's features kept on disk between training runs.

A feature pass is the slow part of a run on a CPU (about 0.4 s a sequence for SmolLM2 in bf16 on 2 cores:
half an hour for 5,000 answers), and every run over the same answers computes the same features: a DART
drafter continued on more data, a drafter from scratch, EAGLE3 and DFLASH trained for a comparison (they
read the same taps). With `--feature-cache DIR` each sequence's features are written once and read back by
later runs.

An entry is keyed by the target (its config and the name, size and modification time of each weight file),
the dtype it ran in, the tap layers and the sequence's token ids; anything else is another entry. Entries
are written to a temporary name and renamed, so a killed run leaves whole entries or none. An entry that
cannot be read (a disk error, a file damaged by hand) is computed again and rewritten, and counted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sglang_dart.train.features import SequenceFeatures, tap_layers

# Bump when what an entry holds, or how it is computed, changes: old entries then no longer match.
LAYOUT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def target_fingerprint(target_dir: Path | str, dtype: torch.dtype, num_layers: int) -> str:
    """What distinguishes one target's features from another's, without reading the weights."""
    target_dir = Path(target_dir)
    digest = hashlib.sha256(f"v{LAYOUT_VERSION} {dtype} taps {tap_layers(num_layers)}\n".encode())
    config = target_dir / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"no config")
    for path in sorted(target_dir.iterdir()):
        if path.suffix in _WEIGHT_SUFFIXES and path.is_file():
            stat = path.stat()
            digest.update(f"{path.name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


@dataclass
class CacheCounts:
    hits: int = 0
    computed: int = 0
    unreadable: int = 0

    def describe(self) -> str:
        text = f"feature cache: {self.hits} read, {self.computed} computed"
        return text + (f" ({self.unreadable} unreadable entries computed again)" if self.unreadable else "")


class FeatureCache:
    def __init__(self, root: Path | str, target_dir: Path | str, dtype: torch.dtype, num_layers: int) -> None:
        self.dir = Path(root) / target_fingerprint(target_dir, dtype, num_layers)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.counts = CacheCounts()
        self.write_error: Exception | None = None

    def _path(self, input_ids: list[int]) -> Path:
        key = hashlib.sha256(json.dumps(input_ids, separators=(",", ":")).encode()).hexdigest()
        return self.dir / key[:2] / f"{key}.safetensors"

    def get(self, input_ids: list[int], soft_labels: int) -> SequenceFeatures | None:
        """The cached features of this sequence, or None (absent, unreadable, or without the soft labels
        asked for)."""
        path = self._path(input_ids)
        if not path.is_file():
            return None
        try:
            tensors = load_file(str(path))
            feats = SequenceFeatures(
                tensors["input_ids"], tensors["taps"], tensors["labels"],
                tensors.get("soft_ids"), tensors.get("soft_probs"),
            )  # fmt: skip
            if feats.input_ids.tolist() != input_ids or feats.taps.shape[0] != len(input_ids):
                raise ValueError("entry holds another sequence")
        except (OSError, SafetensorError, KeyError, ValueError):
            self.counts.unreadable += 1
            return None
        have = 0 if feats.soft_ids is None else feats.soft_ids.shape[1]
        if have < soft_labels:
            return None
        if soft_labels == 0:
            feats.soft_ids = feats.soft_probs = None
        elif have > soft_labels:
            feats.soft_ids = feats.soft_ids[:, :soft_labels]
            feats.soft_probs = feats.soft_probs[:, :soft_labels]
        self.counts.hits += 1
        return feats

    def put(self, feats: SequenceFeatures) -> None:
        path = self._path(feats.input_ids.tolist())
        tensors = {"input_ids": feats.input_ids, "taps": feats.taps, "labels": feats.labels}
        if feats.soft_ids is not None:
            tensors |= {"soft_ids": feats.soft_ids, "soft_probs": feats.soft_probs}
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        self.counts.computed += 1
        if self.write_error is not None:
            return
        try:
            path.parent.mkdir(exist_ok=True)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial))
            partial.replace(path)  # atomic: readers see a whole entry or none
        except (OSError, SafetensorError) as exc:  # a full disk must not end a run: go on uncached
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            self.write_error = exc
            print(f"feature cache: cannot write to {self.dir} ({exc}); going on without caching", flush=True)
