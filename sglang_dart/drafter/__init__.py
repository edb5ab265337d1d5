"""The DART draft model: one Llama-style layer over fused target features, mask slots, shifted logits."""

from sglang_dart.drafter.config import DraftConfig, DraftConfigError
from sglang_dart.drafter.model import DartDrafter, DraftOutput, load_drafter

__all__ = ["DartDrafter", "DraftConfig", "DraftConfigError", "DraftOutput", "load_drafter"]
