"""What appending costs the store's writer, as a training run appends and as a post-hoc capture does.

A training run appends one record a step, and a window closes every ``store.flush_every`` steps. A
post-hoc capture (every training example's gradient at one checkpoint, the peers benchmark's
``attr`` pass) appends every record at the same step: there windows close by ``store.flush_mb``,
one step spans many shards, and every row must still be checked against the ids already held at
that step (duplicate keys are skipped). The same rows (the peers workload's layout: 9 layers at
k = 8 by default, float32, 16 rows a record) are appended both ways, at N and at 4N rows, in
interleaved rounds (medians, rows/s from the first append to a closed store, and the process's CPU
time per row, which a busy disk moves less):

- ``per_step``: record r at step r, ``flush_every`` 32;
- ``one_step``: every record at step 0, ``flush_mb`` sized so that both layouts write the same
  number of shards at N.

Last, in a fresh process, the peak resident memory that writing one post-hoc window of
``--peak-mb`` MB adds, over the window's size (``peak_rss_over_window``; 2.1 before the writer
encoded into reused window buffers and wrote rows without an in-memory image, 2026-12-02).

The headline is how the one-step rate holds up from N to 4N (``one_step_scaling``; the per-step
layout's own scaling is the reference), and the one-step rate over the per-step rate at 4N. Before
``StepKeys`` and ``flush_mb``, an ``isin`` against every earlier id of the step made one-step
appends quadratic, in a single window held in memory: scaling 0.22, 0.15 of the per-step rate at
256k rows (2026-12-02).

    python benchmarks/store_append.py                     # N = 64k rows (~1 min)
    python benchmarks/store_append.py --quick             # N = 16k, 1 round
    python benchmarks/store_append.py --k 32 --n 4096     # wide rows: 36 KiB each
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from olmo_tda.config import StoreConfig
from olmo_tda.store import GradientRecord, GradientStore

LAYERS, ROWS = 9, 16
FLUSH_EVERY = 32


def meta(k: int) -> dict:
    return {"capture": {"proj_dim": k}, "projector_hash": "store_append",
            "layers": [{"name": f"layer{i}", "shape": [k, k], "projector": {"seed": 0}} for i in range(LAYERS)]}


def append_rate(layout: str, n_rows: int, grads: dict, work: Path) -> tuple[float, int, float]:
    """(rows/s, shards written, process CPU µs a row) of appending ``n_rows`` in ``layout`` to a
    fresh store under ``work``."""
    path = Path(tempfile.mkdtemp(dir=work)) / "s"
    k = next(iter(grads.values())).shape[-1]
    window_mb = FLUSH_EVERY * ROWS * LAYERS * k * k * 4 / 2 ** 20
    cfg = StoreConfig(flush_every=FLUSH_EVERY) if layout == "per_step" \
        else StoreConfig(flush_every=FLUSH_EVERY, flush_mb=window_mb)
    t0, c0 = time.perf_counter(), time.process_time()
    with GradientStore.create(path, meta(k), cfg) as w:
        for r in range(n_rows // ROWS):
            w.append(GradientRecord(ids=torch.arange(r * ROWS, (r + 1) * ROWS), step=r if layout == "per_step" else 0,
                                    lr=1e-3, loss_scale=1.0, grads=grads))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    store = GradientStore.open(path)
    if store.num_rows != n_rows:
        raise RuntimeError(f"{layout}: {store.num_rows} rows stored of {n_rows} appended")
    shards = len(store.shards)
    shutil.rmtree(path.parent)
    return n_rows / seconds, shards, cpu / n_rows * 1e6


_PEAK_CHILD = """
import resource, sys
import numpy as np, torch
from olmo_tda.config import StoreConfig
from olmo_tda.store import GradientRecord, GradientStore
k, records = int(sys.argv[2]), int(sys.argv[3])
layers = [{"name": f"layer{i}", "shape": [k, k], "projector": {"seed": 0}} for i in range(9)]
grads = {layer["name"]: torch.randn(16, k, k) for layer in layers}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with GradientStore.create(sys.argv[1], {"capture": {}, "projector_hash": "peak", "layers": layers},
                          StoreConfig(flush_mb=1e6)) as w:
    for r in range(records):
        w.append(GradientRecord(ids=np.arange(r * 16, (r + 1) * 16), step=0, lr=0.1, loss_scale=1.0, grads=grads))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def window_peak(k: int, records: int, path: Path) -> float:
    """Peak RSS a fresh process adds while one one-step window of ``records`` records (16 rows, 9
    layers at ``k``) is encoded and written to a store at ``path``, over the window's bytes."""
    out = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(path), str(k), str(records)],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / (records * ROWS * LAYERS * k * k * 4)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=65536, help="rows of the smaller size (the larger is 4x)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument("--quick", action="store_true", help="--n 16384 --rounds 1")
    p.add_argument("--k", type=int, default=8, help="projected width per side of each of the 9 layers")
    p.add_argument("--peak-mb", type=float, default=256.0, help="size of the window whose peak memory is measured")
    p.add_argument("--work-dir", type=Path, default=None, help="where the stores are written (default: a temp dir)")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.rounds = 16384, 1
    if args.n < ROWS or args.n % ROWS:
        p.error(f"--n must be a positive multiple of {ROWS}, got {args.n}")
    if not args.peak_mb > 0:
        p.error(f"--peak-mb must be > 0, got {args.peak_mb}")
    if args.k < 1:
        p.error(f"--k must be >= 1, got {args.k}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    grads = {f"layer{i}": torch.randn(ROWS, args.k, args.k, generator=gen) for i in range(LAYERS)}
    row_bytes = LAYERS * args.k * args.k * 4
    work = Path(tempfile.mkdtemp(dir=args.work_dir))
    cases = [(layout, n) for n in (args.n, 4 * args.n) for layout in ("per_step", "one_step")]
    rates: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    shards: dict[tuple[str, int], int] = {}
    cpu: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    try:
        append_rate("one_step", 64 * ROWS, grads, work)                 # warm-up: imports, first file
        for r in range(args.rounds):       # interleaved, the order rotated each round (no case always first)
            for layout, n in cases[r % len(cases):] + cases[:r % len(cases)]:
                rate, shards[(layout, n)], us = append_rate(layout, n, grads, work)
                rates[(layout, n)].append(rate)
                cpu[(layout, n)].append(us)
        peak = window_peak(args.k, max(1, int(args.peak_mb * 2 ** 20 // (ROWS * row_bytes))),
                           Path(tempfile.mkdtemp(dir=work)) / "s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {c: statistics.median(v) for c, v in rates.items()}
    big = 4 * args.n
    cpu_med = {c: statistics.median(v) for c, v in cpu.items()}
    out = {"benchmark": "store_append", "rows": [args.n, big], "rounds": args.rounds, "k": args.k,
           "row_bytes": row_bytes,
           "rows_per_s": {f"{layout}@{n}": round(med[(layout, n)]) for layout, n in cases},
           "cpu_us_per_row": {f"{layout}@{n}": round(cpu_med[(layout, n)], 2) for layout, n in cases},
           "shards": {f"{layout}@{n}": shards[(layout, n)] for layout, n in cases},
           "one_step_scaling": round(med[("one_step", big)] / med[("one_step", args.n)], 3),
           "per_step_scaling": round(med[("per_step", big)] / med[("per_step", args.n)], 3),
           "one_step_over_per_step": round(med[("one_step", big)] / med[("per_step", big)], 3),
           "peak_mb": args.peak_mb, "peak_rss_over_window": round(peak, 3),
           "machine": f"{platform.machine()} {torch.get_num_threads()} torch thread(s)"}
    print(f"store append: {ROWS} rows a record, {LAYERS} layers at k = {args.k} float32 ({row_bytes} B a row), "
          f"medians of {args.rounds} round(s)")
    print(f"{'layout':10s} {'rows':>8s} {'rows/s':>9s} {'CPU µs/row':>11s} {'shards':>7s}")
    for layout, n in cases:
        print(f"{layout:10s} {n:8d} {med[(layout, n)]:9.0f} {cpu_med[(layout, n)]:11.2f} {shards[(layout, n)]:7d}")
    print(f"one-step rate at {big} over at {args.n}: {out['one_step_scaling']:.2f} (per-step: "
          f"{out['per_step_scaling']:.2f}); one-step over per-step at {big}: {out['one_step_over_per_step']:.2f}")
    print(f"peak memory writing one {args.peak_mb:g} MB window: {peak:.2f}x the window")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
