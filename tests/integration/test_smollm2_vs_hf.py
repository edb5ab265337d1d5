"""A real pretrained model served on CPU gives exactly the greedy tokens of HF transformers (float32)."""

from __future__ import annotations

import pytest

from tests.support.prompts import ALL_PROMPTS, chat_ids

pytestmark = pytest.mark.server

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(smollm2_f32_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_f32_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_f32_dir, dtype=torch.float32).eval()
    return tokenizer, model


def _hf_greedy(model, tokenizer, ids: list[int]) -> list[int]:
    import torch

    inputs = torch.tensor([ids])
    with torch.no_grad():
        # An explicit mask: the prompt contains <|im_end|>, which is also the pad id, and generate() would
        # otherwise infer those positions as padding and mask them out.
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    return out[0, len(ids) :].tolist()


def _strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def test_greedy_matches_transformers(smollm2_chat_prompts, smollm2_plain_answers, hf_model):
    """The served answers: the plain SmolLM2 server's to the shared chat prompts, which begin with
    ALL_PROMPTS (tests/conftest.py)."""
    tokenizer, model = hf_model
    configured = model.generation_config.eos_token_id
    eos = {tokenizer.eos_token_id, *([configured] if isinstance(configured, int) else configured or [])}
    assert 10 <= len(ALL_PROMPTS) <= len(smollm2_chat_prompts)
    for prompt, ids, answer in zip(ALL_PROMPTS, smollm2_chat_prompts, smollm2_plain_answers, strict=False):
        assert ids == chat_ids(tokenizer, prompt)
        served = _strip_eos(answer[:NEW_TOKENS], eos)
        reference = _strip_eos(_hf_greedy(model, tokenizer, ids), eos)
        assert served == reference, f"{prompt!r}:\n served {served}\n    hf {reference}"
