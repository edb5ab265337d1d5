"""Train a DFLASH drafter in the layout SGLang's builtin DFLASH worker loads (`--format dflash`).

The checkpoint is `config.json` + `model.safetensors` for `--speculative-algorithm DFLASH
--speculative-draft-model-path DIR`: architecture `DFlashDraftModel` (srt/models/dflash.py), a Qwen3-style
decoder config, and `dflash_config` with the keys SGLang's `parse_dflash_draft_config` reads (block_size,
target_layer_ids, mask_token, mask_token_id, num_target_layers). The target layers are the ones DART's
features already capture (hidden states entering layers 2, L//2, L-3, i.e. the outputs of layers 1, L//2-1,
L-4: SGLang captures `id + 1` for a DFLASH layer id), so one feature pass serves both formats.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sglang_dart.train import run_summary
from sglang_dart.train.dflash_model import DFlashDrafter, DFlashShape
from sglang_dart.train.dflash_train import FrozenTarget, estimate_acceptance, train
from sglang_dart.train.features import tap_layers
from sglang_dart.train.stop_signal import stop_requested

ARCHITECTURE = "DFlashDraftModel"


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Options of this format only, each named --dflash-..."""
    group.add_argument(
        "--dflash-block-size",
        type=int,
        default=None,
        help="tokens per verify block, the anchor token included (default: --draft-length + 1, DART's width)",
    )
    group.add_argument("--dflash-num-layers", type=int, default=1, help="draft decoder layers")
    group.add_argument(
        "--dflash-mask-token-id",
        type=int,
        default=None,
        help="vocabulary id that fills the block's unknown positions (default: the last special token of the "
        "target's tokenizer that the data never uses; the vocabulary cannot grow)",
    )


def target_layer_ids(num_layers: int) -> list[int]:
    """DFLASH layer ids (layer outputs) whose capture is exactly `features.tap_layers` (layer inputs)."""
    return [layer - 1 for layer in tap_layers(num_layers)]


def choose_mask_token(
    tokenizer: Any, vocab_size: int, sequences: list[torch.Tensor], wanted: int | None
) -> int:
    """The mask id: the one asked for (checked), else an unused special token of the tokenizer."""
    if wanted is not None:
        if not 0 <= wanted < vocab_size:
            raise SystemExit(
                f"--dflash-mask-token-id {wanted} is outside the target's vocabulary (0..{vocab_size - 1}): "
                "SGLang's DFLASH worker embeds the mask with the target's own embedding, which cannot grow; "
                "pick an existing, unused (e.g. reserved special) token"
            )
        return wanted
    used: set[int] = set()
    for ids in sequences:
        used.update(ids.tolist())
    special = sorted(
        i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i < vocab_size and i not in used
    )
    if not special:
        raise SystemExit(
            "the target's tokenizer has no special token the data leaves unused: pass --dflash-mask-token-id "
            "with an existing vocabulary id that never occurs in the text"
        )
    return special[-1]


def draft_config(target_config: dict, num_layers: int, block: int, mask_id: int, mask_token: str) -> dict:
    """config.json of the checkpoint: the target's attention shape, DFLASH's keys, the target's RoPE."""
    heads = int(target_config["num_attention_heads"])
    rope = dict(target_config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", float(target_config.get("rope_theta", 10000.0)))
    rope.setdefault("rope_type", "default")
    target_layers = int(target_config["num_hidden_layers"])
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",  # as published DFLASH drafters; SGLang reads the config with AutoConfig
        "hidden_size": int(target_config["hidden_size"]),
        "intermediate_size": int(target_config["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(target_config.get("num_key_value_heads", heads)),
        "head_dim": int(target_config.get("head_dim") or target_config["hidden_size"] // heads),
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": float(target_config.get("rms_norm_eps", 1e-6)),
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "max_position_embeddings": int(target_config.get("max_position_embeddings", 32768)),
        "vocab_size": int(target_config["vocab_size"]),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "block_size": block,
        "num_target_layers": target_layers,
        "dflash_config": {
            "block_size": block,
            "target_layer_ids": target_layer_ids(target_layers),
            "mask_token": mask_token,
            "mask_token_id": mask_id,
            "num_target_layers": target_layers,
        },
    }


def check_matches_target(config: dict, target_config: dict, where: Path) -> None:
    """A checkpoint made for another target would draft garbage or fail deep inside SGLang: say so."""
    expected = {
        "hidden_size": int(target_config["hidden_size"]),
        "num_target_layers": int(target_config["num_hidden_layers"]),
        "vocab_size": int(target_config["vocab_size"]),
    }
    dflash = config.get("dflash_config") or {}
    found = {
        "hidden_size": config.get("hidden_size"),
        "num_target_layers": dflash.get("num_target_layers", config.get("num_target_layers")),
        "vocab_size": config.get("vocab_size"),
    }
    wrong = [f"{k} {found[k]} (target: {v})" for k, v in expected.items() if found[k] != v]
    if config.get("architectures") != [ARCHITECTURE]:
        wrong.append(f"architectures {config.get('architectures')} (expected [{ARCHITECTURE!r}])")
    if dflash.get("target_layer_ids") != target_layer_ids(expected["num_target_layers"]):
        wrong.append(
            f"target_layer_ids {dflash.get('target_layer_ids')} (this trainer's features: "
            f"{target_layer_ids(expected['num_target_layers'])})"
        )
    mask_id = dflash.get("mask_token_id")
    if not isinstance(mask_id, int) or not 0 <= mask_id < expected["vocab_size"]:
        wrong.append(f"mask_token_id {mask_id} (must be an id of the target's vocabulary)")
    if wrong:
        raise SystemExit(f"{where} is not a DFLASH drafter for this target: " + "; ".join(wrong))


def save(model: DFlashDrafter, config: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load(directory: Path) -> tuple[DFlashDrafter, dict]:
    config = json.loads((directory / "config.json").read_text())
    model = DFlashDrafter(DFlashShape.from_config(config))
    model.load_state_dict(load_file(str(directory / "model.safetensors")))
    return model, config


def new_drafter(
    args: argparse.Namespace, target_config: dict, block: int, mask_id: int, tokenizer: Any
) -> tuple[DFlashDrafter, dict]:
    if block < 2:
        raise SystemExit(
            f"--dflash-block-size {block}: a block needs the anchor token and at least one draft"
        )
    if args.dflash_num_layers < 1:
        raise SystemExit(f"--dflash-num-layers {args.dflash_num_layers}: at least one layer")
    mask_token = tokenizer.convert_ids_to_tokens(mask_id)
    config = draft_config(target_config, args.dflash_num_layers, block, mask_id, mask_token)
    torch.manual_seed(args.seed)
    return DFlashDrafter(DFlashShape.from_config(config)), config


def train_and_save(
    args: argparse.Namespace, target: Any, feats: list, held_out: list, device: torch.device
) -> dict:
    """Build the drafter from the (host) target, train it on `device`, save it from the host."""
    from transformers import AutoTokenizer

    target_config = target.config.to_dict()
    vocab_size = int(target.config.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if args.init is not None:  # continue training: the checkpoint's shape, block and mask win
        check_matches_target(json.loads((args.init / "config.json").read_text()), target_config, args.init)
        model, config = load(args.init)
        block, mask_id = (
            int(config["dflash_config"]["block_size"]),
            int(config["dflash_config"]["mask_token_id"]),
        )
    else:
        block = args.dflash_block_size or args.draft_length + 1
        mask_id = choose_mask_token(
            tokenizer, vocab_size, [f.input_ids for f in feats + held_out], args.dflash_mask_token_id
        )
        model, config = new_drafter(args, target_config, block, mask_id, tokenizer)
        final_norm = getattr(getattr(target, "model", None), "norm", None)
        if final_norm is not None:  # start at the scale the LM head was trained for
            model.norm.weight.data.copy_(final_norm.weight.detach().float())
    model.to(device)  # the features move per step
    frozen = FrozenTarget(
        embed=target.get_input_embeddings().weight.detach().float().to(device),
        lm_head=target.get_output_embeddings().weight.detach().float().to(device),
    )
    print(
        f"DFLASH drafter: {config['num_hidden_layers']} layer(s), block {block}, mask token "
        f"{config['dflash_config']['mask_token']!r} (id {mask_id}), target layers "
        f"{config['dflash_config']['target_layer_ids']}",
        flush=True,
    )
    # Short runs (tests) must leave the warm-up.
    settings = run_summary.settings_from_args(args, warmup_steps=min(50, max(1, args.max_steps // 10)))
    started = time.monotonic()
    losses = train(model, frozen, feats, settings, block, mask_id, log=lambda s: print(s, flush=True))
    seconds = time.monotonic() - started
    save(model, config, args.out)
    run_summary.announce_saved(losses, seconds, args.out)
    estimate = None  # a run stopped by a signal saves and goes, before a second signal ends it
    if not stop_requested():
        estimate = estimate_acceptance(
            model, frozen, held_out, block, mask_id, bf16_autocast=args.bf16, seed=args.seed
        )
    if estimate is not None:
        print(estimate.describe(), flush=True)
    return run_summary.report(
        args,
        losses,
        seconds,
        feats,
        held_out,
        estimate,
        format="dflash",
        block_size=block,
        mask_token_id=mask_id,
        target_layer_ids=config["dflash_config"]["target_layer_ids"],
    )
