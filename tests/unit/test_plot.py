"""The benchmarks' throughput plot: a real PNG file with one line per server."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from plot import throughput_png  # noqa: E402


def test_throughput_png_is_a_png_of_every_server(tmp_path):
    measured = {
        "plain": {1: 17.4, 4: 60.0, 16: 163.7},
        "NGRAM": {1: 18.0, 4: 55.0, 16: 150.0},
        "DART": {1: 26.8, 4: 73.2, 16: 181.7},
    }
    out = throughput_png(measured, tmp_path / "plots" / "throughput.png", "test")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.shape[0] > 300 and image.shape[1] > 500
