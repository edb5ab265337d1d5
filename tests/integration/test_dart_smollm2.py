"""DART on SmolLM2-135M-Instruct (float32, random drafter, a store of the standard library): greedy output
equals the plain server's on 50 chat prompts at concurrency 16 (1 and 4 nightly)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sglang_dart.server_process import SglangServer
from tests.support.dart_assets import build_random_drafter, build_store_for
from tests.support.dart_serving import dart_server_args

pytestmark = pytest.mark.server


SMOL_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_plain_answers) -> list[list[int]]:
    return [answer[:SMOL_TOKENS] for answer in smollm2_plain_answers]


@pytest.fixture(scope="module")
def smollm2_dart(smollm2_f32_dir, tmp_path_factory, server_logs) -> Iterator[SglangServer]:
    root = tmp_path_factory.mktemp("dart-smollm2")
    draft = build_random_drafter(root / "draft", smollm2_f32_dir)
    store = build_store_for(smollm2_f32_dir, root / "smol.store")
    server = SglangServer(
        smollm2_f32_dir, dart_server_args(draft, store), server_logs / "smollm2-dart.log"
    ).start()
    yield server
    server.stop()


# Concurrency 1 and 4 are nightly (-m slow): CI time is budgeted, and the tiny Qwen3's server tests check
# concurrency 4 with and without overlap scheduling.
@pytest.mark.parametrize("concurrency", [pytest.param(c, marks=pytest.mark.slow) for c in (1, 4)] + [16])
def test_smollm2_greedy_equals_plain(smollm2_dart, smollm2_chat_prompts, smollm2_reference, concurrency):
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        spec = list(pool.map(lambda x: smollm2_dart.greedy_ids(x, SMOL_TOKENS), smollm2_chat_prompts))
    for i, (got, want) in enumerate(zip(spec, smollm2_reference, strict=True)):
        assert got == want, f"prompt {i}"
    assert smollm2_dart.healthy()


def test_the_converted_smollm2_tokenizer_reads_as_byte_level_to_xgrammar(smollm2_f32_dir):
    """What SGLang's grammar backend builds from the served model's tokenizer."""
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_f32_dir)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    assert info.vocab_type == xgrammar.VocabType.BYTE_LEVEL
    assert tokenizer.decode(tokenizer(" a\nb  c")["input_ids"]) == " a\nb  c"
    assert tokenizer.model_max_length == 8192  # the context length, not transformers' 1e30 (see /tokenize)


def test_tokenize_answers_with_the_context_length(smollm2_dart):
    """SGLang's /tokenize returns the tokenizer's model_max_length; the GGUF conversion left transformers'
    1e30 there, which the JSON encoder refused (HTTP 500). The converted tokenizer says 8,192."""
    resp = requests.post(f"{smollm2_dart.url}/tokenize", json={"prompt": "Hello world"}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["max_model_len"] == 8192 and resp.json()["count"] == len(resp.json()["tokens"]) > 0


@pytest.mark.parametrize("pattern", [r"(yes|no), [a-z]{3,10}\.", r"(yes|no)\n[a-z]{3,10}"])
def test_grammars_with_whitespace_complete(smollm2_dart, pattern):
    """The converted tokenizer keeps SmolLM2's byte-level decoder alone (`assets._byte_level_decoder`):
    with the GGUF conversion's decoder sequence xgrammar took the vocabulary for byte-fallback, no token
    could make a space or a newline, and every such request ended in an abort after "no"."""
    body = {
        "text": "Is 9 a prime number? Answer yes or no, then one word.",
        "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, "regex": pattern},
    }
    out = smollm2_dart.generate(body)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]["finish_reason"]
    assert re.fullmatch(pattern, out["text"]), out["text"]
