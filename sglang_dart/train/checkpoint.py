"""A fresh drafter shaped for a target, and saving it in the published layout (config.json +
model.safetensors, no embedding table) that `sglang_dart.drafter.load_drafter` and the server read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from sglang_dart.drafter.config import DraftConfig
from sglang_dart.drafter.model import DartDrafter
from sglang_dart.train.vocab import DraftVocab


def draft_config_dict(target_config: dict[str, Any], draft_length: int, draft_vocab_size: int) -> dict:
    hidden, heads = target_config["hidden_size"], target_config["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLMDart"],
        "model_type": "llama",  # as the published drafters; SGLang reads the draft config with AutoConfig
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "intermediate_size": target_config["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": target_config.get("num_key_value_heads") or heads,
        "head_dim": target_config.get("head_dim") or hidden // heads,
        "num_hidden_layers": 1,
        "vocab_size": target_config["vocab_size"],
        "draft_vocab_size": draft_vocab_size,
        "draft_length": draft_length,
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6),
        "rope_theta": target_config.get("rope_theta", 10000.0),
        "max_position_embeddings": target_config.get("max_position_embeddings", 4096),
        "hidden_act": "silu",
    }


def new_drafter(
    config: dict, embed_tokens: torch.Tensor, lm_head: torch.Tensor, vocab: DraftVocab, seed: int = 0
) -> DartDrafter:
    """Random layer weights; the head starts from the target's own output rows for the draft vocabulary,
    which is where a drafter predicting the target's next tokens should end up anyway."""
    torch.manual_seed(seed)
    model = DartDrafter(DraftConfig.from_dict(config), embed_tokens)
    with torch.no_grad():
        model.midlayer.mask_rep.normal_()
        model.lm_head.weight.copy_(lm_head[vocab.target_ids].float())
        model.d2t.copy_(vocab.d2t)
    return model


@torch.no_grad()
def with_grown_vocab(
    model: DartDrafter, config: dict, old: DraftVocab, new: DraftVocab, target_head: torch.Tensor
) -> tuple[DartDrafter, dict]:
    """The drafter over `new`, a superset of its vocabulary `old`, and its config. Trained head rows are
    kept; each added token's row is the target's own row carried by the linear map that best takes the
    target's rows of `old` onto the trained ones (least squares): where training has moved the head on
    average, rather than back at the untrained start."""
    kept = old.t2d[new.target_ids]  # each new draft id's old draft id, -1 where the token is added
    if int((kept >= 0).sum()) != old.size:
        raise ValueError("the new draft vocabulary must hold every token of the old one")
    trained = model.lm_head.weight.detach().float()
    mapping = torch.linalg.lstsq(target_head[old.target_ids].float(), trained).solution
    rows = target_head[new.target_ids].float() @ mapping
    rows[kept >= 0] = trained[kept[kept >= 0]]
    config = {**config, "draft_vocab_size": new.size}
    grown = DartDrafter(DraftConfig.from_dict(config), model.embed_tokens)
    state = {name: t for name, t in model.state_dict().items() if name not in ("lm_head.weight", "d2t")}
    grown.load_state_dict({**state, "lm_head.weight": rows, "d2t": new.d2t})
    grown.to(model.lm_head.weight.dtype).train(model.training)
    return grown, config


def save_drafter(model: DartDrafter, config: dict, vocab: DraftVocab, out_dir: Path | str) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: t.detach().to(device="cpu", dtype=torch.float32).contiguous()
        for name, t in model.state_dict().items()
        if name != "d2t"
    }
    tensors["d2t"] = vocab.d2t.clone()
    tensors["t2d"] = vocab.t2d >= 0  # the published checkpoints carry this mask too
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir
