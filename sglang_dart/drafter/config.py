"""The draft checkpoint's config.json (keys of the published `fvliang/qwen*-dart` drafters) and the checks
that it fits a target model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The model class name a DART checkpoint's config.json gives in "architectures" (the published one).
DART_ARCHITECTURE = "LlamaForCausalLMDart"


class DraftConfigError(ValueError):
    """The draft checkpoint is missing, malformed, or does not fit the target model."""


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target vocabulary the draft was trained for
    draft_vocab_size: int  # rows of the draft's own lm_head
    draft_length: int  # d: number of mask slots; the draft gives d + 1 rows of logits
    target_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    hidden_act: str

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DraftConfig:
        required = ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "draft_length"]
        missing = [k for k in required if k not in raw]
        if missing:
            raise DraftConfigError(f"draft config.json lacks required keys: {', '.join(missing)}")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            draft_length=int(raw["draft_length"]),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            hidden_act=str(raw.get("hidden_act", "silu")),
        )
        if cfg.hidden_act != "silu":
            raise DraftConfigError(f"draft hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
        if cfg.draft_length < 1:
            raise DraftConfigError(f"draft_length must be >= 1, got {cfg.draft_length}")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise DraftConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if cfg.draft_vocab_size > cfg.vocab_size:
            raise DraftConfigError("draft_vocab_size cannot exceed vocab_size")
        return cfg

    @classmethod
    def from_dir(cls, path: Path | str) -> DraftConfig:
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError as exc:
            raise DraftConfigError(f"draft checkpoint {path} has no config.json") from exc
        except json.JSONDecodeError as exc:
            raise DraftConfigError(f"draft config {file} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    def check_fits_target(self, target_hidden_size: int, target_vocab_size: int) -> None:
        """The draft shares the target's embedding table and reads 3 of its hidden states."""
        if self.hidden_size != target_hidden_size:
            raise DraftConfigError(
                f"draft hidden_size {self.hidden_size} != target hidden_size {target_hidden_size} "
                "(the draft uses the target's embedding table)"
            )
        if self.target_hidden_size != target_hidden_size:
            raise DraftConfigError(
                f"draft was trained on a target with hidden size {self.target_hidden_size}, "
                f"this target has {target_hidden_size}"
            )
        if self.vocab_size != target_vocab_size:
            raise DraftConfigError(
                f"draft vocab_size {self.vocab_size} != target vocab size {target_vocab_size}"
            )
