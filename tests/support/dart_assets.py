"""Draft checkpoints and 3-gram stores for a given target model, built on the fly for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.support.tiny_models import training_corpus


def build_random_drafter(
    out_dir: Path, target_dir: Path, draft_length: int = 3, seed: int = 0, **extra_config: object
) -> Path:
    """A DART draft checkpoint in the published layout whose shapes fit the target (random weights:
    they change how many drafts get accepted, never the output)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, heads = target["hidden_size"], target["num_attention_heads"]
    kv_heads = target.get("num_key_value_heads", heads)
    head_dim = target.get("head_dim") or hidden // heads
    inter, vocab = target["intermediate_size"], target["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    tensors = {
        "fc.weight": rnd(hidden, 3 * hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.mask_rep": rnd(2 * hidden, scale=1.0),
        "midlayer.self_attn.q_proj.weight": rnd(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rnd(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rnd(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rnd(inter, hidden),
        "midlayer.mlp.up_proj.weight": rnd(inter, hidden),
        "midlayer.mlp.down_proj.weight": rnd(hidden, inter),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rnd(vocab, hidden),
        "d2t": torch.zeros(vocab, dtype=torch.int64),
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMDart"],
        "model_type": "llama",  # as the published drafters; SGLang reads the draft config with AutoConfig
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": vocab,
        "draft_length": draft_length,
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": target.get("rope_theta", 10000.0),
        "hidden_act": "silu",
        **extra_config,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def build_store_for(target_dir: Path, out_file: Path, texts: list[str] | None = None) -> Path:
    """A 3-gram store over `texts` (default: Python standard library sources), tokenized with the target's
    tokenizer."""
    from transformers import AutoTokenizer

    from sglang_dart.ngram import build_store

    corpus = Path(out_file).with_suffix(".corpus.jsonl")
    documents = texts if texts is not None else training_corpus(40)
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in documents))
    build_store(AutoTokenizer.from_pretrained(target_dir), [corpus], out_file, progress=False)
    return Path(out_file)


def build_store_from_ids(target_dir: Path, out_file: Path, documents: list[list[int]]) -> Path:
    """A 3-gram store over token-id documents, stamped with the target tokenizer's fingerprint."""
    from transformers import AutoTokenizer

    from sglang_dart.ngram import NgramBuilder, tokenizer_fingerprint

    vocab = json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"]
    builder = NgramBuilder(vocab, tokenizer_fingerprint(AutoTokenizer.from_pretrained(target_dir)))
    for doc in documents:
        builder.add_document(doc)
    builder.finish(Path(out_file))
    return Path(out_file)
