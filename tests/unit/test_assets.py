"""The SmolLM2 conversion's tokenizer mend (`assets._byte_level_decoder`)."""

from __future__ import annotations

import json
from pathlib import Path

from sglang_dart.assets import _byte_level_decoder

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
GGUF_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        BYTE_LEVEL,
    ],
}


def _write(path: Path, pre_tokenizer: dict, decoder: dict) -> Path:
    path.write_text(json.dumps({"pre_tokenizer": pre_tokenizer, "decoder": decoder, "model": {"vocab": {}}}))
    return path


def test_a_byte_level_bpe_keeps_its_byte_level_decoder_alone(tmp_path):
    path = _write(tmp_path / "tokenizer.json", {"type": "ByteLevel"}, GGUF_DECODER)
    _byte_level_decoder(path)
    spec = json.loads(path.read_text())
    assert spec["decoder"] == BYTE_LEVEL
    assert spec["model"] == {"vocab": {}} and spec["pre_tokenizer"] == {"type": "ByteLevel"}


def test_other_tokenizers_are_left_as_they_are(tmp_path):
    sentencepiece_like = _write(tmp_path / "a.json", {"type": "Metaspace"}, GGUF_DECODER)
    plain = _write(tmp_path / "b.json", {"type": "ByteLevel"}, BYTE_LEVEL)
    before = {p: p.read_text() for p in (sentencepiece_like, plain)}
    for path in before:
        _byte_level_decoder(path)
    assert {p: p.read_text() for p in before} == before
