"""What the DART server tests share: the stock DART flags with a tree shape, greedy runs of many prompts
against one server, and the check that sampled first tokens follow the same distribution on two servers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sglang_dart.server_process import SglangServer, dart_flags

NEW_TOKENS = 24
SEED = ["--random-seed", "0"]


def dart_server_args(draft: Path, store: Path, tokens: int = 8, topk: int = 4) -> list[str]:
    return [
        "--dtype",
        "float32",
        *dart_flags(draft, store),
        "--speculative-num-draft-tokens",
        str(tokens),
        "--speculative-eagle-topk",
        str(topk),
    ]


def run_all(server: SglangServer, prompts: list[str], concurrency: int, n: int = NEW_TOKENS) -> list[dict]:
    payload = lambda p: {"text": p, "sampling_params": {"max_new_tokens": n, "temperature": 0.0}}  # noqa: E731
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda p: server.generate(payload(p)), prompts))


LOW_TEMPERATURE = {"temperature": 0.1}


def first_tokens(
    server: SglangServer, prompt: str, samples: int, length: int, params: dict
) -> list[list[int]]:
    out = server.generate(
        {
            "text": [prompt] * samples,
            "sampling_params": {"max_new_tokens": length, "ignore_eos": True, **params},
        },
        timeout=900,
    )
    return [o["output_ids"] for o in out]


def assert_same_first_tokens(plain: SglangServer, spec: SglangServer, params: dict = LOW_TEMPERATURE) -> None:
    """Two-sample chi-square homogeneity test on each of the first 3 sampled tokens. Each test at
    alpha = 1e-3; family-wise false-alarm rate <= 0.3%."""
    from scipy.stats import chi2_contingency

    samples, length, prompt = 600, 3, "def parse(line):"
    plain_out = first_tokens(plain, prompt, samples, length, params)
    spec_out = first_tokens(spec, prompt, samples, length, params)
    for pos in range(length):
        a = [o[pos] for o in plain_out]
        b = [o[pos] for o in spec_out]
        tokens = sorted(set(a) | set(b))
        table = [[a.count(t) for t in tokens], [b.count(t) for t in tokens]]
        # Merge rare tokens so every expected count is >= 5 (the test's validity condition).
        common = [i for i, t in enumerate(tokens) if table[0][i] + table[1][i] >= 10]
        rare = [i for i in range(len(tokens)) if i not in common]
        merged = [[row[i] for i in common] + [sum(row[i] for i in rare)] for row in table]
        merged = [
            [x for x, keep in zip(row, [*(True for _ in common), bool(rare)], strict=True) if keep]
            for row in merged
        ]
        assert len(merged[0]) >= 2, f"position {pos}: distribution too peaked to test"
        p_value = chi2_contingency(merged).pvalue
        assert p_value > 1e-3, f"position {pos}: p = {p_value:.2e}, tables {merged}"
