"""Process set-up the plugin does in every SGLang process."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest

from sglang_dart.plugin import put_ninja_on_path


def test_ninja_is_found_without_an_activated_virtualenv(monkeypatch):
    """SGLang's JIT builds (NGRAM's corpus) run `ninja` by name; a server started as .venv/bin/python
    without `activate` must still find the pinned one."""
    monkeypatch.setenv("PATH", "/usr/bin/nonexistent")
    assert shutil.which("ninja") is None
    put_ninja_on_path()
    found = shutil.which("ninja")
    assert found is not None and os.access(found, os.X_OK)
    put_ninja_on_path()  # idempotent: already found, PATH unchanged
    assert os.environ["PATH"].count(os.path.dirname(found)) == 1


def _spec_meta_info(algorithm: str, verify_ct: int, cap_tokens: int, correct: int) -> dict:
    """The meta_info SGLang's tokenizer manager writes for one request, then passed through the hook
    the plugin installs on it."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sglang_dart.spec_counts import correct_proposed_drafts

    manager = SimpleNamespace(
        server_args=SimpleNamespace(speculative_algorithm=algorithm, speculative_num_draft_tokens=8)
    )
    out = SimpleNamespace(
        spec_verify_ct=[verify_ct],
        spec_num_correct_drafts=[correct],
        completion_tokens=[verify_ct + correct],
        spec_num_cap_tokens=[cap_tokens],
        spec_num_block_accept_tokens=None,
        spec_correct_drafts_histogram=None,
        spec_cap_lens_histogram=None,
    )
    meta: dict = {}
    result = TokenizerManager._calculate_spec_decoding_metrics(manager, meta, out, 0)
    correct_proposed_drafts(result, manager, meta, out, 0)
    return meta


def test_drafted_counts_are_the_trees_verified():
    """10 steps verifying 46 tokens in all (say 4 trees of 8 and 6 roots alone) proposed 36 drafts, not
    SGLang's 10 x (N - 1) = 70; the accept rate is over those 36."""
    meta = _spec_meta_info("DART", verify_ct=10, cap_tokens=46, correct=18)
    assert meta["spec_num_proposed_drafts"] == meta["spec_proposed_drafts"] == 36
    assert meta["spec_accept_rate"] == 0.5
    assert meta["spec_accept_length"] == 2.8 and meta["spec_cap_length"] == 4.6
    roots_only = _spec_meta_info("DART", verify_ct=5, cap_tokens=5, correct=0)
    assert roots_only["spec_num_proposed_drafts"] == 0 and roots_only["spec_accept_rate"] == 0.0
    other = _spec_meta_info("NGRAM", verify_ct=10, cap_tokens=46, correct=18)
    assert other["spec_num_proposed_drafts"] == 70  # other algorithms keep SGLang's count


def _assert_targets_a_method_of(target: str, cls: type) -> None:
    module, name, method = target.rsplit(".", 2)
    assert module == cls.__module__ and name == cls.__name__
    assert callable(getattr(cls, method))


def test_the_hooks_target_sglangs_methods():
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sglang_dart import prefill_batches, request_checks, spec_counts

    _assert_targets_a_method_of(spec_counts.TARGET, TokenizerManager)
    _assert_targets_a_method_of(request_checks.TARGET, TokenizerManager)
    _assert_targets_a_method_of(prefill_batches.TARGET, PrefillAdder)


def test_token_ids_outside_the_vocabulary_are_refused_by_name():
    from sglang_dart.request_checks import refuse_ids_outside_the_vocabulary

    refuse_ids_outside_the_vocabulary([0, 5, 99], 100)
    refuse_ids_outside_the_vocabulary(None, 100)  # text or embeddings: nothing to check here
    for ids, bad in (([0, 100], 100), ([-1, 5], -1), ([3, 7, 12345], 12345)):
        with pytest.raises(ValueError, match=rf"token id {bad}, outside the model's vocabulary \[0, 100\)"):
            refuse_ids_outside_the_vocabulary(ids, 100)


def test_a_prefill_batch_takes_prompts_of_one_input_kind():
    """Once a batch holds a token prompt, an input_embeds prompt waits for the next batch (and the other
    way round); a prompt of the batch's kind goes to SGLang's own admission."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sglang_dart.prefill_batches import one_input_kind_per_batch

    admitted = []

    def add_one_req(adder, req, *_args, **_kwargs):  # stands in for SGLang's admission
        adder.can_run_list.append(req)
        admitted.append(req)
        return AddReqResult.CONTINUE

    tokens, embeds = SimpleNamespace(input_embeds=None), SimpleNamespace(input_embeds=[[0.5, 0.25]])
    for first, other in ((tokens, embeds), (embeds, tokens)):
        adder = SimpleNamespace(can_run_list=[])
        admitted.clear()
        assert one_input_kind_per_batch(add_one_req, adder, first, True, None) is AddReqResult.CONTINUE
        assert one_input_kind_per_batch(add_one_req, adder, first, True, None) is AddReqResult.CONTINUE
        assert one_input_kind_per_batch(add_one_req, adder, other, True, None) is AddReqResult.OTHER
        assert admitted == [first, first]
