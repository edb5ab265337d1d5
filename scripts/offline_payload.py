"""Carry files larger than one device call to a GPU host without network, in parts over several calls.

`pack` puts files and directories (the SGLang bundle, a model directory with its real weights, a drafter,
a store) into one tar, split into parts of at most --part-mib, and writes a manifest of the parts with
their checksums. A bf16 `model.safetensors` travels as its high bytes (sign and exponent: they compress
to a third) xz-compressed beside its low bytes (mantissa: incompressible), which saves a call for a
135M-parameter model (and brings three drafters back in one call's 64 MiB). `unpack` runs on the host:
it reports which parts of the manifest it holds and, once it holds all of them, rebuilds the files (the
weights byte for byte, checked against their sha256).

    python scripts/offline_payload.py pack --out .gpu/payload --part-mib 60 bundle.tar.xz MODEL_DIR ...
    python scripts/offline_payload.py unpack --manifest .gpu/payload/parts.json --parts DIR --dest DIR
    python scripts/offline_payload.py gather --carried .gpu/payload --store DIR --dest DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import struct
import sys
import tarfile
import tempfile
from pathlib import Path

SPLIT_SUFFIX = ".bf16split"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _mostly_bf16_safetensors(path: Path) -> bool:
    """Whether bf16 tensors hold at least 90% of the file's tensor bytes (a drafter's int64 and bool
    vocabulary maps beside them too): the split itself is lossless for any bytes, and it only pays where
    most of them are bf16."""
    with path.open("rb") as fh:
        size = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(size))
    sizes = [
        (v["dtype"], v["data_offsets"][1] - v["data_offsets"][0])
        for k, v in header.items()
        if k != "__metadata__"
    ]
    total = sum(size for _, size in sizes)
    bf16 = sum(size for dtype, size in sizes if dtype == "BF16")
    return total > 0 and bf16 >= 0.9 * total


def split_bf16(path: Path, out_dir: Path) -> dict:
    """header | xz(high bytes) | low bytes of a bf16 safetensors file, and its sha256."""
    import numpy as np

    raw = path.read_bytes()
    head = 8 + struct.unpack("<Q", raw[:8])[0]
    body = np.frombuffer(raw, dtype=np.uint8, offset=head)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "header.bin").write_bytes(raw[:head])
    (out_dir / "low.bin").write_bytes(body[0::2].tobytes())
    with lzma.open(out_dir / "high.xz", "wb", preset=6) as fh:
        fh.write(body[1::2].tobytes())
    return {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}


def join_bf16(split_dir: Path, target: Path, expected_sha256: str) -> None:
    import numpy as np

    header = (split_dir / "header.bin").read_bytes()
    low = np.frombuffer((split_dir / "low.bin").read_bytes(), dtype=np.uint8)
    with lzma.open(split_dir / "high.xz", "rb") as fh:
        high = np.frombuffer(fh.read(), dtype=np.uint8)
    if low.size - high.size not in (0, 1):  # an odd body's last byte is a low one
        raise SystemExit(f"{split_dir}: {low.size} low bytes against {high.size} high bytes")
    body = np.empty(low.size + high.size, dtype=np.uint8)
    body[0::2], body[1::2] = low, high
    rebuilt = header + body.tobytes()
    if hashlib.sha256(rebuilt).hexdigest() != expected_sha256:
        raise SystemExit(f"{target}: rebuilt weights do not match their sha256")
    target.write_bytes(rebuilt)


def pack(inputs: list[Path], out: Path, part_mib: int, split_above_mib: int = 64) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rebuilt: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tar_path = Path(tmp) / "payload.tar"
        with tarfile.open(tar_path, "w") as tar:
            for item in inputs:
                files = sorted(p for p in item.rglob("*") if p.is_file()) if item.is_dir() else [item]
                for f in files:
                    name = f.relative_to(item.parent).as_posix()
                    big = f.stat().st_size > split_above_mib << 20
                    if f.name.endswith(".safetensors") and big and _mostly_bf16_safetensors(f):
                        split_dir = Path(tmp) / (name + SPLIT_SUFFIX)
                        rebuilt[name] = split_bf16(f, split_dir)
                        tar.add(split_dir, arcname=name + SPLIT_SUFFIX)
                    else:
                        tar.add(f, arcname=name)
        parts, size = [], part_mib << 20
        with tar_path.open("rb") as fh:
            for i, block in enumerate(iter(lambda: fh.read(size), b"")):
                part = out / f"part-{i:02d}"
                part.write_bytes(block)
                parts.append({"name": part.name, "sha256": hashlib.sha256(block).hexdigest()})
    (out / "parts.json").write_text(json.dumps({"parts": parts, "rebuilt": rebuilt}, indent=1))
    print(f"{len(parts)} parts of <= {part_mib} MiB in {out}; weights split: {sorted(rebuilt)}")


def unpack(manifest: Path, parts_dir: Path, dest: Path) -> int:
    """0 once the files are rebuilt in `dest`; 1 while parts are missing (it says which)."""
    spec = json.loads(manifest.read_text())
    held = [p for p in spec["parts"] if (parts_dir / p["name"]).is_file()]
    missing = [p["name"] for p in spec["parts"] if p not in held]
    if missing:
        print(f"payload: {len(held)} of {len(spec['parts'])} parts here, missing {missing}")
        return 1
    for p in spec["parts"]:
        if _sha256(parts_dir / p["name"]) != p["sha256"]:
            raise SystemExit(f"payload: {p['name']} is corrupt (sha256)")
    dest.mkdir(parents=True, exist_ok=True)
    joined = dest / "payload.tar"
    with joined.open("wb") as out:
        for p in spec["parts"]:
            with (parts_dir / p["name"]).open("rb") as fh:
                shutil.copyfileobj(fh, out)
    with tarfile.open(joined) as tar:
        tar.extractall(dest, filter="data")
    joined.unlink()
    for name, facts in spec["rebuilt"].items():
        split_dir = dest / (name + SPLIT_SUFFIX)
        join_bf16(split_dir, dest / name, facts["sha256"])
        shutil.rmtree(split_dir)
    print(f"payload: rebuilt in {dest}: {sorted(p.name for p in dest.iterdir())}")
    return 0


def gather(carried: Path, store: Path, dest: Path) -> int:
    """On the host, once a call: the parts this call carried (in `carried`, beside its parts.json) join
    those earlier calls left in `store`; once all are there, the files are rebuilt in `dest` and the parts
    dropped. 0 when `dest` holds the payload (rebuilt now or by an earlier call), 1 while parts are
    missing."""
    if dest.is_dir():
        return 0
    store.mkdir(parents=True, exist_ok=True)
    for part in carried.glob("part-*"):
        shutil.copy(part, store / part.name)
    staging = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)  # a call cut short while rebuilding
    if unpack(carried / "parts.json", store, staging):
        return 1
    staging.rename(dest)
    shutil.rmtree(store)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("inputs", type=Path, nargs="+")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part-mib", type=int, default=60)
    p.add_argument("--split-above-mib", type=int, default=64, help="bf16 weights larger than this split")
    u = sub.add_parser("unpack")
    u.add_argument("--manifest", type=Path, required=True)
    u.add_argument("--parts", type=Path, required=True)
    u.add_argument("--dest", type=Path, required=True)
    g = sub.add_parser("gather", help="keep this call's parts; rebuild once all are here")
    g.add_argument("--carried", type=Path, required=True, help="this call's parts and parts.json")
    g.add_argument("--store", type=Path, required=True, help="where parts wait between calls")
    g.add_argument("--dest", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "pack":
        pack(args.inputs, args.out, args.part_mib, args.split_above_mib)
        return 0
    if args.cmd == "gather":
        return gather(args.carried, args.store, args.dest)
    return unpack(args.manifest, args.parts, args.dest)


if __name__ == "__main__":
    sys.exit(main())
