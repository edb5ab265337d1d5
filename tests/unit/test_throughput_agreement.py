from benchmarks.throughput import Measurement, agreement


def _run(*outputs: tuple[int, ...]) -> Measurement:
    return Measurement(1.0, 1.0, 1.0, tuple(outputs))


def test_agreement_counts_requests_equal_to_the_reference_prompt_by_prompt():
    reference = _run((1, 2, 3), (4, 5))
    runs = [_run((1, 2, 3), (4, 6)), _run((1, 2, 3), (4, 5))]
    assert agreement(reference, runs) == (3, 4)
    assert agreement(reference, [_run((4, 5), (1, 2, 3))]) == (0, 2)  # swapped prompts do not count
    assert agreement(reference, []) == (0, 0)
