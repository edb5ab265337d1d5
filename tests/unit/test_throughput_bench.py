import pytest
import torch

from benchmarks.throughput import (
    Measurement,
    _synchronous_already,
    agreement,
    dart_configs,
    eagle3_setting,
    output_lengths,
    peer_configs,
    reference_server,
    round_order,
    round_ratios,
    server_env,
)
from sglang_dart.dart.settings import CPU_OVERLAP_ENV
from sglang_dart.server_process import dart_flags


def _run(*outputs: tuple[int, ...]) -> Measurement:
    return Measurement(1.0, 1.0, 1.0, tuple(outputs))


def test_agreement_counts_requests_equal_to_the_reference_prompt_by_prompt():
    reference = _run((1, 2, 3), (4, 5))
    runs = [_run((1, 2, 3), (4, 6)), _run((1, 2, 3), (4, 5))]
    assert agreement(reference, runs) == (3, 4)
    assert agreement(reference, [_run((4, 5), (1, 2, 3))]) == (0, 2)  # swapped prompts do not count
    assert agreement(reference, []) == (0, 0)


def test_a_copy_s_outputs_are_held_against_its_own_plain():
    names = ["plain", "DART", "plain [rust gemm]", "DART [rust gemm]", "NGRAM"]
    assert reference_server("DART [rust gemm]", names) == "plain [rust gemm]"
    assert reference_server("plain [rust gemm]", names) == "plain [rust gemm]"
    assert reference_server("DART", names) == "plain"
    assert reference_server("DART [sync]", names) == "plain"  # a copy without a plain of its own


def test_every_other_round_measures_the_servers_in_reverse():
    names = ["plain", "DART", "DART [twin]"]
    assert round_order(names, 0) == names
    assert round_order(names, 1) == ["DART [twin]", "DART", "plain"]
    assert round_order(names, 2) == names
    assert names == ["plain", "DART", "DART [twin]"]  # the caller's list is left alone


def test_ratios_pair_each_round_with_the_baselines_same_round():
    plain = [Measurement(100.0, 1.0, 20.0), Measurement(50.0, 1.0, 40.0), Measurement(80.0, 1.0, 25.0)]
    dart = [Measurement(120.0, 2.0, 17.0), Measurement(60.0, 2.0, 34.0), Measurement(100.0, 2.0, 20.0)]
    # A machine twice as slow in round 2 moves both servers: each round's ratio stays near 1.2.
    assert round_ratios(dart, plain, "tokens_per_second") == pytest.approx([1.2, 1.2, 1.25])
    assert round_ratios(dart, plain, "cpu_ms_per_token") == pytest.approx([0.85, 0.85, 0.8])
    # Measured once (NGRAM, a fresh server per batch size): against the baseline's median.
    assert round_ratios([Measurement(160.0, 1.5, 10.0)], plain, "tokens_per_second") == [2.0]


def test_server_env_takes_several_variables_for_one_copy():
    assert server_env("SGLANG_DART_GEMM_SPIN_US=0") == {"SGLANG_DART_GEMM_SPIN_US": "0"}
    both = server_env("SGLANG_DART_CPU_OVERLAP=1  SGLANG_DART_TREE_SIZES=1:8,4:2")
    assert both == {"SGLANG_DART_CPU_OVERLAP": "1", "SGLANG_DART_TREE_SIZES": "1:8,4:2"}
    assert server_env("A=") == {"A": ""}
    for bad in ["", "A", "A=1 B", "=1"]:
        with pytest.raises(ValueError, match="expected NAME=VALUE"):
            server_env(bad)


def test_fixed_lengths_without_spread():
    assert output_lengths(64, 0.0, 5) == [64] * 5


def test_spread_lengths_cover_the_range_with_the_mean_kept():
    lengths = output_lengths(64, 0.5, 64)
    assert min(lengths) >= 32 and max(lengths) <= 96
    assert max(lengths) - min(lengths) > 50  # spread out, not bunched
    assert abs(sum(lengths) / len(lengths) - 64) < 2
    assert output_lengths(64, 0.5, 64) == lengths  # the same for every server
    assert output_lengths(64, 0.5, 16) == lengths[:16]  # a prompt keeps its length at any count


def test_spread_outside_its_range_is_refused():
    for spread in (-0.1, 1.0):
        with pytest.raises(ValueError, match="length spread"):
            output_lengths(64, spread, 4)


def test_eagle3_settings_parse_and_bad_ones_are_refused():
    assert eagle3_setting("3,4,8") == (3, 4, 8)
    assert eagle3_setting("5,1,6") == (5, 1, 6)
    for bad in ("3,4", "a,b,c", "0,4,8", "5,1,8"):
        with pytest.raises(ValueError, match="EAGLE3 setting"):
            eagle3_setting(bad)


def test_peer_servers_get_sglangs_own_flags(tmp_path):
    eagle3, dflash = tmp_path / "e3", tmp_path / "df"
    configs = peer_configs(eagle3, ["3,4,8", "5,1,6"], dflash, [])
    assert list(configs) == ["EAGLE3 3,4,8", "EAGLE3 5,1,6", "DFLASH"]
    flags, env = configs["EAGLE3 5,1,6"]
    assert flags == [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(eagle3),
        "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "6",
    ]  # fmt: skip
    assert env == {}
    assert configs["DFLASH"][0] == [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(dflash),
    ]
    blocks = peer_configs(None, ["3,4,8"], dflash, [4, 8])
    assert list(blocks) == ["DFLASH block 4", "DFLASH block 8"]
    assert blocks["DFLASH block 8"][0][-2:] == ["--speculative-dflash-block-size", "8"]


def test_dart_servers_one_per_tree_schedule_and_k_with_the_default_k_left_to_the_server():
    one = dart_configs("d", "s", [16], ["default"], [None])
    assert list(one) == ["DART"]
    flags, env = one["DART"]
    assert flags == [*dart_flags("d", "s"), "--speculative-num-draft-tokens", "16"] and env == {}
    several = dart_configs("d", "s", [16], ["default", "1:8"], [8, 16])
    assert list(several) == ["DART [default] k8", "DART [default] k16", "DART [1:8] k8", "DART [1:8] k16"]
    flags, env = several["DART [1:8] k8"]
    assert flags[-4:] == ["--speculative-eagle-topk", "8", "--speculative-num-draft-tokens", "16"]
    assert env == {"SGLANG_DART_TREE_SIZES": "1:8"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU DART keeps overlap scheduling")
def test_sync_copies_skip_dart_on_a_cpu_unless_it_overlaps_there(monkeypatch):
    monkeypatch.delenv(CPU_OVERLAP_ENV, raising=False)
    dart = dart_flags("draft", "store")
    assert _synchronous_already(dart, {})  # DART on a CPU: no overlap scheduling to turn off
    assert not _synchronous_already(dart, {CPU_OVERLAP_ENV: "1"})
    assert not _synchronous_already([], {})  # plain decoding overlaps by default
    assert not _synchronous_already(["--speculative-algorithm", "EAGLE3"], {})
    monkeypatch.setenv(CPU_OVERLAP_ENV, "1")
    assert not _synchronous_already(dart, {})
