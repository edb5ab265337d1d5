"""DART against its peers, side by side in one run: plain decoding, SGLang's NGRAM, SGLang's EAGLE3 and
DFLASH workers, and DART, at batch 1, 4, 16 and 64 (tokens/s ratio to plain, tokens per verify step, CPU
time per token; a table on stdout and a PNG).

    .venv/bin/python benchmarks/peers.py --eagle3 EAGLE3_DIR --dflash DFLASH_DIR
        [--draft DART_DIR --store STORE] [any benchmarks/throughput.py option]

Train the drafters on the same data with the same budget (`python -m sglang_dart.train --format
dart|eagle3|dflash --data D --max-minutes M`). Without --draft/--store, DART uses the drafter and store
shipped in the package. Every option of benchmarks/throughput.py applies and overrides the defaults here
(e.g. `--eagle3-settings 3,4,8 5,1,6` for one EAGLE3 server per setting, `--dflash-block-sizes 4 8`,
`--tree-sizes default 1:16,4:8,8:4,32:1`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import throughput  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def default_args() -> list[str]:
    from sglang_dart.assets import shipped_smollm2_drafter

    draft, store = shipped_smollm2_drafter()
    return [
        "--draft", str(draft), "--store", str(store),
        "--batch-sizes", "1", "4", "16", "64",
        "--new-tokens", "64", "--length-spread", "0.5", "--repeats", "2",
        "--png", str(RESULTS / "peers.png"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if "--eagle3" not in args and "--dflash" not in args:
        raise SystemExit("peers.py needs --eagle3 DIR and/or --dflash DIR (see --help of throughput.py)")
    throughput.main([*default_args(), *args])  # later options override the defaults


if __name__ == "__main__":
    main()
