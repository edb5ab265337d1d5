"""scripts/cast_drafter.py: a drafter directory copied with its float tensors in bf16 (how trained
drafters ship and come back from a GPU host), its integer tensors and other files unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cast_drafter.py"


def _module():  # noqa: ANN202 - a script, loaded by path
    return load_script(SCRIPT)


def test_float_tensors_are_cast_and_the_rest_kept(tmp_path: Path):
    src = tmp_path / "draft"
    src.mkdir()
    weights = {"fc.weight": torch.randn(4, 6), "d2t": torch.arange(5) * 3, "t2d": torch.rand(9) > 0.5}
    save_file(weights, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (src / "train_report.json").write_text("{}")
    kinds = _module().cast_drafter(src, tmp_path / "bf16", torch.bfloat16)
    back = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert kinds == {"fc.weight": "bfloat16", "d2t": "int64", "t2d": "bool"}
    torch.testing.assert_close(back["fc.weight"], weights["fc.weight"].bfloat16())
    assert torch.equal(back["d2t"], weights["d2t"]) and torch.equal(back["t2d"], weights["t2d"])
    assert (tmp_path / "bf16" / "config.json").read_text() == (src / "config.json").read_text()
    assert (tmp_path / "bf16" / "train_report.json").is_file()


def test_a_directory_without_a_drafter_is_refused(tmp_path: Path):
    with pytest.raises(SystemExit, match="not a drafter directory"):
        _module().cast_drafter(tmp_path, tmp_path / "out", torch.bfloat16)
