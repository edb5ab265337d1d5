"""scripts/offline_payload.py: files split over device calls come back byte for byte, bf16 weights
included; a missing or corrupt part is reported, never unpacked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "offline_payload.py"


def _payload_module():  # noqa: ANN202 - a script, loaded by path
    return load_script(SCRIPT)


def test_round_trip_rebuilds_bf16_weights_byte_for_byte(tmp_path: Path) -> None:
    payload = _payload_module()
    model = tmp_path / "src" / "model"
    model.mkdir(parents=True)
    torch.manual_seed(0)
    # 2 MiB of weights: the payload needs two 1 MiB parts, so a call holding one of them is tried too.
    save_file({"w": torch.randn(1024, 1024).to(torch.bfloat16), "b": torch.randn(11).to(torch.bfloat16)},
              model / "model.safetensors")  # fmt: skip
    (model / "config.json").write_text('{"a": 1}')
    # A drafter's weights: its vocabulary maps (int64, an odd count of bools) beside mostly bf16.
    drafter = tmp_path / "src" / "drafter"
    drafter.mkdir()
    save_file({"w": torch.randn(512, 512).to(torch.bfloat16), "d2t": torch.arange(64),
               "t2d": torch.rand(1001) > 0.5}, drafter / "model.safetensors")  # fmt: skip
    # And one whose int64 tensors outweigh its bf16: it travels whole.
    ids = tmp_path / "src" / "ids"
    ids.mkdir()
    save_file({"ids": torch.arange(100_000), "w": torch.randn(8).to(torch.bfloat16)},
              ids / "model.safetensors")  # fmt: skip
    store = tmp_path / "src" / "answers.store"
    store.write_bytes(bytes(range(256)) * 50)
    out = tmp_path / "payload"
    payload.pack([model, drafter, ids, store], out, part_mib=1, split_above_mib=0)
    spec = json.loads((out / "parts.json").read_text())
    # The bf16 weights travelled split, the drafter's too; the mostly int64 file whole.
    assert sorted(spec["rebuilt"]) == ["drafter/model.safetensors", "model/model.safetensors"]
    assert len(spec["parts"]) >= 2

    parts = tmp_path / "parts"
    parts.mkdir()
    # Only some parts here: nothing is unpacked.
    shutil.copy(out / spec["parts"][0]["name"], parts)
    assert payload.unpack(out / "parts.json", parts, tmp_path / "dest") == 1
    assert not (tmp_path / "dest").exists()
    for p in spec["parts"]:
        shutil.copy(out / p["name"], parts)
    assert payload.unpack(out / "parts.json", parts, tmp_path / "dest") == 0
    dest = tmp_path / "dest"
    assert (dest / "model" / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    for name in ("drafter", "ids"):
        source = tmp_path / "src" / name / "model.safetensors"
        assert (dest / name / "model.safetensors").read_bytes() == source.read_bytes()
    assert (dest / "model" / "config.json").read_text() == '{"a": 1}'
    assert (dest / "answers.store").read_bytes() == store.read_bytes()
    assert not (dest / "model" / "model.safetensors.bf16split").exists()


def _packed_blob(payload, tmp_path: Path) -> tuple[Path, Path, dict]:  # noqa: ANN001 - the script module
    """3 MiB of random bytes packed in 1 MiB parts: the source, the parts' folder and their manifest."""
    src = tmp_path / "blob.bin"
    src.write_bytes(torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes())
    out = tmp_path / "payload"
    payload.pack([src], out, part_mib=1)
    return src, out, json.loads((out / "parts.json").read_text())


def test_missing_and_corrupt_parts_are_reported(tmp_path: Path) -> None:
    payload = _payload_module()
    _, out, spec = _packed_blob(payload, tmp_path)
    assert len(spec["parts"]) >= 3 and spec["rebuilt"] == {}
    parts = tmp_path / "parts"
    shutil.copytree(out, parts)
    (parts / spec["parts"][1]["name"]).unlink()
    assert payload.unpack(out / "parts.json", parts, tmp_path / "dest") == 1
    shutil.copy(out / spec["parts"][1]["name"], parts)
    with (parts / spec["parts"][2]["name"]).open("r+b") as fh:
        fh.write(b"\xff\xfe")
    with pytest.raises(SystemExit, match="corrupt"):
        payload.unpack(out / "parts.json", parts, tmp_path / "dest")


def test_gather_keeps_each_calls_parts_and_rebuilds_once_all_are_there(tmp_path: Path) -> None:
    payload = _payload_module()
    src, out, spec = _packed_blob(payload, tmp_path)
    names = [p["name"] for p in spec["parts"]]
    store, dest = tmp_path / "store", tmp_path / "dest"
    for i, name in enumerate(names):  # one call per part, each carrying its part beside the manifest
        carried = tmp_path / f"call{i}"
        carried.mkdir()
        shutil.copy(out / "parts.json", carried)
        shutil.copy(out / name, carried)
        done = payload.gather(carried, store, dest)
        if i < len(names) - 1:
            assert (
                done == 1 and not dest.exists() and sorted(p.name for p in store.iterdir()) == names[: i + 1]
            )
    assert done == 0 and (dest / "blob.bin").read_bytes() == src.read_bytes() and not store.exists()
    assert payload.gather(tmp_path / "call0", store, dest) == 0  # a later call finds it rebuilt
    assert not store.exists()
