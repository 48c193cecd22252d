"""What a store's shard count costs: opening it, resuming a writer on it, and each flush's manifest.

A long run writes many shards: at the default ``flush_every=32``, 100k steps make ~3,100 per rank.
Every open lists ``shards/`` and stats each shard against its rank's manifest; a writer's open does
that too and builds its duplicate index; and every flush rewrites the rank's manifest (fsynced),
which lists only the shards past the last sealed block of 256 (older ones are in segment files under
``index/``, written once), so a flush's cost should not grow with the shards already written. This
script grows one single-rank store to each size in ``--sizes`` (tiny shards: one step of 2 rows, 2
layers at k=4, so the shard count, not the bytes, is what is measured) and at each size times,
warm, medians of ``--rounds``:

- ``open``: ``GradientStore.open(path)`` (a reader: scan, manifests, reconcile);
- ``writer``: ``GradientStore.create(path, ...)`` on the existing store, then ``close()`` (what a
  resumed rank does before its first step);
- ``flush``: one more record appended and flushed (a shard written and the manifest rewritten);
- ``manifest``: the manifest's size on disk, and ``index``: its segment files' (``index/``);
- ``grow``: seconds per shard of growing the store to that size (appending and flushing one step at
  a time from the previous size).

The headline is the cost per 1,000 shards of each, from the largest and smallest sizes.

    python benchmarks/store_open.py                       # 500, 2000, 8000 shards
    python benchmarks/store_open.py --sizes 200,800 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from olmo_tda.config import StoreConfig
from olmo_tda.store import GradientStore
from olmo_tda.store.record import GradientRecord

K, ROWS = 4, 2
LAYERS = ("a", "b")
META = {"capture": {"proj_dim": K, "synthetic": "benchmarks/store_open.py"},
        "layers": [{"name": n, "shape": [K, K], "projector": {"kind": "synthetic"}} for n in LAYERS],
        "projector_hash": "synthetic-store-open-v1"}


def record(step: int) -> GradientRecord:
    grads = {n: torch.full((ROWS, K, K), float(step)) for n in LAYERS}
    return GradientRecord(ids=torch.arange(ROWS), step=step, lr=1e-3, loss_scale=1.0, grads=grads)


def grow(path: Path, start: int, stop: int) -> None:
    """Append steps ``start..stop-1``, one shard each."""
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as writer:
        for step in range(start, stop):
            writer.append(record(step))


def measure(path: Path, step: int, rounds: int) -> tuple[dict[str, float], int]:
    """Median seconds of open / writer / flush at the store's current size; the next free step."""
    times: dict[str, list[float]] = {"open": [], "writer": [], "flush": []}
    GradientStore.open(path)                               # warm the page cache
    for _ in range(rounds):
        t0 = time.perf_counter()
        GradientStore.open(path)
        times["open"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        writer = GradientStore.create(path, META, StoreConfig(flush_every=10 ** 6))
        writer.close()
        times["writer"].append(time.perf_counter() - t0)
        writer = GradientStore.create(path, META, StoreConfig(flush_every=10 ** 6))
        writer.append(record(step))
        t0 = time.perf_counter()
        writer.flush()
        times["flush"].append(time.perf_counter() - t0)
        writer.close()
        step += 1
    return {k: statistics.median(v) for k, v in times.items()}, step


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="500,2000,8000", help="shard counts to measure at, ascending")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if not sizes or sizes[0] < 1 or args.rounds < 1:
        p.error("--sizes must be positive shard counts and --rounds >= 1")
    if sizes[-1] - sizes[0] <= args.rounds:      # each size's measuring adds `rounds` shards
        p.error(f"--sizes needs two counts more than --rounds ({args.rounds}) apart: the cost per 1000 shards is "
                "the slope between the smallest and the largest")
    rows = []
    with tempfile.TemporaryDirectory(prefix="store_open_") as tmp:
        path, step, t_start = Path(tmp) / "store", 0, time.perf_counter()
        for size in sizes:
            have = len(GradientStore.open(path).shards) if path.exists() else 0
            grow_s = None                                      # already that size: not grown here
            if size > have:
                t0 = time.perf_counter()
                grow(path, step, step + size - have)
                grow_s = (time.perf_counter() - t0) / (size - have)
                step += size - have
            med, step = measure(path, step, args.rounds)      # adds a shard a round
            shards = len(GradientStore.open(path).shards)
            manifest = (path / "manifest-r00000.json").stat().st_size
            index = sum(f.stat().st_size for f in (path / "index").glob("*.json")) if (path / "index").is_dir() else 0
            rows.append({"shards": shards, **{f"{k}_ms": 1e3 * v for k, v in med.items()},
                         "manifest_kb": manifest / 1024, "index_kb": index / 1024,
                         "grow_ms_per_shard": None if grow_s is None else 1e3 * grow_s})
            print(f"[store_open] {shards} shards: open {1e3 * med['open']:.1f} ms, writer {1e3 * med['writer']:.1f} ms,"
                  f" flush {1e3 * med['flush']:.1f} ms, manifest {manifest / 1024:.0f} KB, index {index / 1024:.0f} KB,"
                  f" grown at {rows[-1]['grow_ms_per_shard'] or 0:.1f} ms a shard", file=sys.stderr)
        elapsed = time.perf_counter() - t_start
    lo, hi = rows[0], rows[-1]
    span = (hi["shards"] - lo["shards"]) / 1000          # > 0: checked on the sizes above
    per_k = {k: (hi[f"{k}_ms"] - lo[f"{k}_ms"]) / span for k in ("open", "writer", "flush")}
    print(f"{'shards':>7} {'open ms':>8} {'writer ms':>10} {'flush ms':>9} {'manifest KB':>12} {'index KB':>9} "
          f"{'grow ms/shard':>14}")
    for r in rows:
        print(f"{r['shards']:7d} {r['open_ms']:8.1f} {r['writer_ms']:10.1f} {r['flush_ms']:9.1f} "
              f"{r['manifest_kb']:12.0f} {r['index_kb']:9.0f} "
              f"{'-' if r['grow_ms_per_shard'] is None else format(r['grow_ms_per_shard'], '.1f'):>14}")
    print(f"per 1000 shards: open {per_k['open']:+.1f} ms, writer {per_k['writer']:+.1f} ms, "
          f"flush {per_k['flush']:+.2f} ms")
    result = {"benchmark": "store_open", "rows": rows, "open_ms_per_1000_shards": per_k["open"],
              "writer_ms_per_1000_shards": per_k["writer"], "flush_ms_per_1000_shards": per_k["flush"],
              "rounds": args.rounds, "seconds": elapsed, "python": platform.python_version(),
              "torch": torch.__version__}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
