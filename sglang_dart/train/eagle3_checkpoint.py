"""EAGLE3 draft checkpoints in the layout SGLang's `LlamaForCausalLMEagle3` loads: config.json
(architectures ["LlamaForCausalLMEagle3"], one hidden layer, draft_vocab_size, the target's tap layers in
eagle_config) and model.safetensors (the `midlayer.*` layer, fc, norm, lm_head over the draft vocabulary,
d2t offsets with target id = draft id + d2t[draft id], t2d mask over the target vocabulary). No embedding
table: SGLang's EAGLE3 worker gives the drafter the target's own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sglang_dart.train.eagle3_model import Eagle3Drafter, Eagle3Shape
from sglang_dart.train.features import tap_layers
from sglang_dart.train.vocab import DraftVocab, vocab_from_d2t

ARCHITECTURE = "LlamaForCausalLMEagle3"


def rope_theta_of(target_config: dict[str, Any]) -> float:
    params = target_config.get("rope_parameters") or target_config.get("rope_scaling") or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise SystemExit(f"EAGLE3 training supports default RoPE only, the target has {params}")
    return float(params.get("rope_theta") or target_config.get("rope_theta") or 10000.0)


def shape_for(target_config: dict[str, Any], draft_vocab_size: int) -> Eagle3Shape:
    hidden, heads = target_config["hidden_size"], target_config["num_attention_heads"]
    return Eagle3Shape(
        hidden_size=hidden,
        intermediate_size=target_config["intermediate_size"],
        num_heads=heads,
        num_kv_heads=target_config.get("num_key_value_heads") or heads,
        head_dim=target_config.get("head_dim") or hidden // heads,
        rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(target_config),
        vocab_size=target_config["vocab_size"],
        draft_vocab_size=draft_vocab_size,
    )


def config_dict(target_config: dict[str, Any], shape: Eagle3Shape) -> dict[str, Any]:
    layers = target_config["num_hidden_layers"]
    theta = shape.rope_theta
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "target_hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "max_position_embeddings": target_config.get("max_position_embeddings", 4096),
        "vocab_size": shape.vocab_size,
        "draft_vocab_size": shape.draft_vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
        "eagle_config": {
            "use_aux_hidden_state": True,
            # SGLang captures the input of layer id + 1 (ids name layer outputs): the layers below give
            # exactly the taps the drafter was trained on (`features.tap_layers`).
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in tap_layers(layers)],
        },
        "target_num_hidden_layers": layers,
        "torch_dtype": "float32",
    }


def new_drafter(target, vocab: DraftVocab, seed: int = 0) -> tuple[Eagle3Drafter, dict[str, Any]]:
    """A fresh drafter for this (HF) target: random layer, head started from the target's own output rows
    of the draft vocabulary."""
    target_config = target.config.to_dict()
    shape = shape_for(target_config, vocab.size)
    torch.manual_seed(seed)
    model = Eagle3Drafter(shape, target.get_input_embeddings().weight.detach().float())
    with torch.no_grad():
        model.lm_head.weight.copy_(target.get_output_embeddings().weight.detach()[vocab.target_ids].float())
    return model, config_dict(target_config, shape)


def save(model: Eagle3Drafter, config: dict[str, Any], vocab: DraftVocab, out_dir: Path | str) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to("cpu", torch.float32).contiguous() for k, v in model.state_for_checkpoint().items()}
    tensors["d2t"] = vocab.d2t.to("cpu", torch.int64).contiguous()
    tensors["t2d"] = (vocab.t2d >= 0).cpu().contiguous()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def check_fits(config: dict[str, Any], target_config: dict[str, Any], where: Path) -> None:
    """A clear stop when a checkpoint was made for another target."""
    if ARCHITECTURE not in config.get("architectures", []):
        raise SystemExit(f"{where} is not an EAGLE3 checkpoint (architectures {config.get('architectures')})")
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size"):
        mine, theirs = config.get(key), target_config.get(key)
        if mine != theirs:
            raise SystemExit(
                f"{where} was made for another target: its {key} is {mine}, the target's {theirs}"
            )
    layers = config.get("target_num_hidden_layers")
    if layers is not None and layers != target_config["num_hidden_layers"]:
        raise SystemExit(
            f"{where} was made for a target of {layers} layers, "
            f"this one has {target_config['num_hidden_layers']}"
        )


def load(checkpoint: Path | str, target) -> tuple[Eagle3Drafter, dict[str, Any], DraftVocab]:
    """An EAGLE3 checkpoint to continue training, checked against this target."""
    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    target_config = target.config.to_dict()
    check_fits(config, target_config, checkpoint)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    vocab = vocab_from_d2t(tensors["d2t"], target_config["vocab_size"])
    model = Eagle3Drafter(
        shape_for(target_config, vocab.size), target.get_input_embeddings().weight.detach().float()
    )
    with torch.no_grad():
        model.load_checkpoint_state(tensors)
    return model, config, vocab
