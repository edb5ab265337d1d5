"""The drafter and store shipped for SmolLM2-135M-Instruct: present, within the size budget, as the
manifest records them, and fitting the target (shapes, vocabulary, tokenizer)."""

from __future__ import annotations

import hashlib
import re

import torch

from sglang_dart.assets import SHIPPED_SMOLLM2, shipped_smollm2_drafter
from sglang_dart.drafter import DraftConfig, load_drafter
from sglang_dart.ngram import NgramStore

SMOLLM2_HIDDEN, SMOLLM2_VOCAB = 576, 49152


def test_shipped_files_are_the_manifests_and_fit_the_budget():
    manifest = (SHIPPED_SMOLLM2 / "MANIFEST.md").read_text()
    rows = re.findall(r"\| `([^`]+)` \| ([\d,]+) \| `([0-9a-f]{64})` \|", manifest)
    assert {name for name, _, _ in rows} == {"draft/config.json", "draft/model.safetensors", "answers.store"}
    total = 0
    for name, size, digest in rows:
        data = (SHIPPED_SMOLLM2 / name).read_bytes()
        assert len(data) == int(size.replace(",", "")), name
        assert hashlib.sha256(data).hexdigest() == digest, name
        total += len(data)
    assert total <= 40 * 1024 * 1024


def test_shipped_drafter_and_store_fit_smollm2():
    draft, store_path = shipped_smollm2_drafter()
    cfg = DraftConfig.from_dir(draft)
    cfg.check_fits_target(SMOLLM2_HIDDEN, SMOLLM2_VOCAB)
    embed = torch.zeros(SMOLLM2_VOCAB, SMOLLM2_HIDDEN, dtype=torch.bfloat16)
    drafter = load_drafter(draft, embed, SMOLLM2_HIDDEN, SMOLLM2_VOCAB)
    assert drafter.cfg.draft_length == 7
    store = NgramStore(store_path)
    assert store.vocab_size <= SMOLLM2_VOCAB and store.tokenizer_fingerprint != 0
