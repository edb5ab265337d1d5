"""Tiny random HF models (Llama, Qwen3) with a BPE tokenizer trained on the fly, for fast structural tests."""

from __future__ import annotations

import sysconfig
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def training_corpus(max_files: int = 60) -> list[str]:
    """Plain text every machine has: the Python standard library's own sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(stdlib.glob("*.py"))[:max_files]:
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> None:
    """Train a byte-level BPE and save it as a `PreTrainedTokenizerFast` with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0, num_layers: int = 8) -> Path:
    """A random model small enough to serve in seconds on CPU. `arch`: "llama" or "qwen3"."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    # Larger-than-default init so greedy decoding is not a constant token and exercises branching.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    model.to(torch.float32).save_pretrained(out_dir, safe_serialization=True)
    return out_dir
