"""The on-disk feature cache: a second run reads exactly what the first computed, without the target; a
different target, dtype or sequence is another entry; a damaged entry is computed again, never trusted."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from sglang_dart.train.feature_cache import FeatureCache, target_fingerprint
from sglang_dart.train.features import collect_features, load_target


def _sequences(count: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(10, 400, (8 + 3 * i,), generator=gen).tolist() for i in range(count)]


def _cache(root: Path, target_dir: Path, dtype: torch.dtype = torch.float32) -> FeatureCache:
    return FeatureCache(root, target_dir, dtype, num_layers=8)


def _assert_same(a, b) -> None:
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.taps, b.taps) and a.taps.dtype == b.taps.dtype
    assert torch.equal(a.labels, b.labels)
    for x, y in ((a.soft_ids, b.soft_ids), (a.soft_probs, b.soft_probs)):
        assert (x is None and y is None) or torch.equal(x, y)


def test_a_second_run_reads_every_sequence_without_the_target(tiny_llama_dir, tmp_path):
    target = load_target(tiny_llama_dir, torch.float32)
    seqs = _sequences()
    first_cache = _cache(tmp_path, tiny_llama_dir)
    first = collect_features(target, seqs, progress=False, soft_labels=4, cache=first_cache)
    assert (first_cache.counts.hits, first_cache.counts.computed) == (0, 3)
    again = _cache(tmp_path, tiny_llama_dir)
    # No target at all: any sequence not read from the cache would fail here.
    second = collect_features(None, seqs, progress=False, soft_labels=4, cache=again)
    assert (again.counts.hits, again.counts.computed) == (3, 0)
    for a, b in zip(first, second, strict=True):
        _assert_same(a, b)
    # Fewer soft labels (or none) are read from an entry holding more: the top-k prefix.
    fewer = collect_features(None, seqs, progress=False, soft_labels=2, cache=again)
    assert torch.equal(fewer[0].soft_ids, first[0].soft_ids[:, :2])
    assert collect_features(None, seqs, progress=False, cache=again)[0].soft_ids is None


def test_more_soft_labels_than_cached_are_computed(tiny_llama_dir, tmp_path):
    target = load_target(tiny_llama_dir, torch.float32)
    seqs = _sequences(1)
    collect_features(target, seqs, progress=False, cache=_cache(tmp_path, tiny_llama_dir))
    cache = _cache(tmp_path, tiny_llama_dir)
    feats = collect_features(target, seqs, progress=False, soft_labels=4, cache=cache)
    assert (cache.counts.hits, cache.counts.computed) == (0, 1)
    assert feats[0].soft_ids.shape == (len(seqs[0]), 4)


def test_another_dtype_or_target_is_another_entry(tiny_llama_dir, tmp_path):
    base = target_fingerprint(tiny_llama_dir, torch.float32, 8)
    assert target_fingerprint(tiny_llama_dir, torch.bfloat16, 8) != base
    other = tmp_path / "other-target"
    shutil.copytree(tiny_llama_dir, other)  # times kept: the same target
    assert target_fingerprint(other, torch.float32, 8) == base
    weights = next(other.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert target_fingerprint(other, torch.float32, 8) != base  # weights rewritten
    config = other / "config.json"
    changed = target_fingerprint(other, torch.float32, 8)
    config.write_text(config.read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ', 1))
    assert target_fingerprint(other, torch.float32, 8) != changed


@pytest.mark.parametrize("damage", ["truncated", "another sequence"])
def test_a_damaged_entry_is_computed_again(tiny_llama_dir, tmp_path, damage):
    target = load_target(tiny_llama_dir, torch.float32)
    seqs = _sequences(2)
    fresh = collect_features(target, seqs, progress=False, cache=_cache(tmp_path, tiny_llama_dir))
    entries = sorted(tmp_path.rglob("*.safetensors"))
    assert len(entries) == 2
    if damage == "truncated":
        entries[0].write_bytes(entries[0].read_bytes()[:100])
    else:
        entries[0].write_bytes(entries[1].read_bytes())
    cache = _cache(tmp_path, tiny_llama_dir)
    again = collect_features(target, seqs, progress=False, cache=cache)
    assert (cache.counts.hits, cache.counts.computed, cache.counts.unreadable) == (1, 1, 1)
    for a, b in zip(fresh, again, strict=True):
        _assert_same(a, b)
    assert "1 unreadable" in cache.counts.describe()
    assert not list(tmp_path.rglob("*.tmp"))


def test_one_feature_pass_serves_every_format(tiny_llama_dir, tmp_path, capsys):
    """`--feature-cache`: an EAGLE3 run reads the features a DART run over the same data wrote."""
    from sglang_dart.train.__main__ import main as train_main
    from tests.unit.test_peer_eagle3 import _train as train_eagle3
    from tests.unit.test_peer_eagle3 import _write_data

    data = _write_data(tmp_path / "data.jsonl", rows=6)
    cache = ["--feature-cache", str(tmp_path / "cache")]
    common = ["--target", str(tiny_llama_dir), "--data", str(data), "--max-len", "96", "--holdout", "0"]
    train_main(
        [*common, "--out", str(tmp_path / "dart"), "--draft-vocab-size", "300", "--max-steps", "2", *cache]
    )
    assert "feature cache: 0 read, 6 computed" in capsys.readouterr().out
    train_eagle3(tiny_llama_dir, tmp_path / "eagle3", data, "--holdout", "0", "--max-steps", "2", *cache)
    assert "feature cache: 6 read, 0 computed" in capsys.readouterr().out
    assert (tmp_path / "eagle3" / "config.json").is_file()


def test_a_cache_that_cannot_be_written_does_not_stop_the_run(tiny_llama_dir, tmp_path, capsys):
    target = load_target(tiny_llama_dir, torch.float32)
    seqs = _sequences(2)
    cache = _cache(tmp_path, tiny_llama_dir)
    cache._path(seqs[0]).parent.write_text("a file where the entry's folder should be")
    feats = collect_features(target, seqs, progress=False, cache=cache)
    assert len(feats) == 2 and cache.counts.computed == 2
    assert "going on without caching" in capsys.readouterr().out
    assert not list(tmp_path.rglob("*.safetensors"))  # nothing more written once writing failed
