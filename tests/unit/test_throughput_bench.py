import pytest

from benchmarks.throughput import Measurement, agreement, output_lengths


def _run(*outputs: tuple[int, ...]) -> Measurement:
    return Measurement(1.0, 1.0, 1.0, tuple(outputs))


def test_agreement_counts_requests_equal_to_the_reference_prompt_by_prompt():
    reference = _run((1, 2, 3), (4, 5))
    runs = [_run((1, 2, 3), (4, 6)), _run((1, 2, 3), (4, 5))]
    assert agreement(reference, runs) == (3, 4)
    assert agreement(reference, [_run((4, 5), (1, 2, 3))]) == (0, 2)  # swapped prompts do not count
    assert agreement(reference, []) == (0, 0)


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
