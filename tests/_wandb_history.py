"""Read the history rows of an offline W&B run (``run-*.wandb``), independently of W&B's own code:
the file is W&B's record log (a 7-byte header, then 32 KiB blocks of records, each a 7-byte
``crc32 | length | type`` header and a chunk; types 1 = whole, 2/3/4 = first/middle/last part) of
``wandb_internal_pb2.Record`` protobufs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:                    # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            parts = b""
            yield rec


def history(path: Path) -> dict[int, dict]:
    """``{step: {key: value}}`` of every logged row (rows logged twice at one step merged)."""
    out: dict[int, dict] = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            out.setdefault(int(row["_step"]), {}).update(row)
    return out


def run_history(folder: Path) -> dict[int, dict]:
    """The history of every offline W&B run under ``folder`` (a resumed run's runs in time order)."""
    files = sorted(Path(folder).rglob("*.wandb"), key=lambda p: p.stat().st_mtime)
    assert files, f"no offline W&B run under {folder}"
    out: dict[int, dict] = {}
    for f in files:
        for step, row in history(f).items():
            out.setdefault(step, {}).update(row)
    return out
