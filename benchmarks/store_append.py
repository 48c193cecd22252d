"""What appending costs the store's writer, as a training run appends and as a post-hoc capture does.

A training run appends one record a step, and a window closes every ``store.flush_every`` steps. A
post-hoc capture (every training example's gradient at one checkpoint, the peers benchmark's
``attr`` pass) appends every record at the same step: there windows close by ``store.flush_mb``,
one step spans many shards, and every row must still be checked against the ids already held at
that step (duplicate keys are skipped). The same rows (the peers workload's layout: 9 layers at
k = 8, float32, 16 rows a record) are appended both ways, at N and at 4N rows, in interleaved
rounds (medians, rows/s from the first append to a closed store):

- ``per_step``: record r at step r, ``flush_every`` 32;
- ``one_step``: every record at step 0, ``flush_mb`` sized so that both layouts write the same
  number of shards at N.

The headline is how the one-step rate holds up from N to 4N (``one_step_scaling``; the per-step
layout's own scaling is the reference), and the one-step rate over the per-step rate at 4N. Before
``StepKeys`` and ``flush_mb``, an ``isin`` against every earlier id of the step made one-step
appends quadratic, in a single window held in memory: scaling 0.22, 0.15 of the per-step rate at
256k rows (2026-12-02).

    python benchmarks/store_append.py             # N = 64k rows (~1 min)
    python benchmarks/store_append.py --quick     # N = 16k, 1 round
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from olmo_tda.config import StoreConfig
from olmo_tda.store import GradientRecord, GradientStore

LAYERS, K, ROWS = 9, 8, 16
META = {"capture": {"proj_dim": K}, "projector_hash": "store_append",
        "layers": [{"name": f"layer{i}", "shape": [K, K], "projector": {"seed": 0}} for i in range(LAYERS)]}
ROW_BYTES = LAYERS * K * K * 4
FLUSH_EVERY = 32


def append_rate(layout: str, n_rows: int, grads: dict, work: Path) -> tuple[float, int]:
    """(rows/s, shards written) of appending ``n_rows`` in ``layout`` to a fresh store under ``work``."""
    path = Path(tempfile.mkdtemp(dir=work)) / "s"
    window_mb = FLUSH_EVERY * ROWS * ROW_BYTES / 2 ** 20
    cfg = StoreConfig(flush_every=FLUSH_EVERY) if layout == "per_step" \
        else StoreConfig(flush_every=FLUSH_EVERY, flush_mb=window_mb)
    t0 = time.perf_counter()
    with GradientStore.create(path, META, cfg) as w:
        for r in range(n_rows // ROWS):
            w.append(GradientRecord(ids=torch.arange(r * ROWS, (r + 1) * ROWS), step=r if layout == "per_step" else 0,
                                    lr=1e-3, loss_scale=1.0, grads=grads))
    seconds = time.perf_counter() - t0
    store = GradientStore.open(path)
    if store.num_rows != n_rows:
        raise RuntimeError(f"{layout}: {store.num_rows} rows stored of {n_rows} appended")
    shards = len(store.shards)
    shutil.rmtree(path.parent)
    return n_rows / seconds, shards


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=65536, help="rows of the smaller size (the larger is 4x)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument("--quick", action="store_true", help="--n 16384 --rounds 1")
    p.add_argument("--work-dir", type=Path, default=None, help="where the stores are written (default: a temp dir)")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.rounds = 16384, 1
    if args.n < ROWS or args.n % ROWS:
        p.error(f"--n must be a positive multiple of {ROWS}, got {args.n}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    grads = {f"layer{i}": torch.randn(ROWS, K, K, generator=gen) for i in range(LAYERS)}
    work = Path(tempfile.mkdtemp(dir=args.work_dir))
    cases = [(layout, n) for n in (args.n, 4 * args.n) for layout in ("per_step", "one_step")]
    rates: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    shards: dict[tuple[str, int], int] = {}
    try:
        append_rate("one_step", 64 * ROWS, grads, work)                 # warm-up: imports, first file
        for _ in range(args.rounds):
            for layout, n in cases:
                rate, shards[(layout, n)] = append_rate(layout, n, grads, work)
                rates[(layout, n)].append(rate)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {c: statistics.median(v) for c, v in rates.items()}
    big = 4 * args.n
    out = {"benchmark": "store_append", "rows": [args.n, big], "rounds": args.rounds, "row_bytes": ROW_BYTES,
           "rows_per_s": {f"{layout}@{n}": round(med[(layout, n)]) for layout, n in cases},
           "shards": {f"{layout}@{n}": shards[(layout, n)] for layout, n in cases},
           "one_step_scaling": round(med[("one_step", big)] / med[("one_step", args.n)], 3),
           "per_step_scaling": round(med[("per_step", big)] / med[("per_step", args.n)], 3),
           "one_step_over_per_step": round(med[("one_step", big)] / med[("per_step", big)], 3),
           "machine": f"{platform.machine()} {torch.get_num_threads()} torch thread(s)"}
    print(f"store append: {ROWS} rows a record, {LAYERS} layers at k = {K} float32 ({ROW_BYTES} B a row), "
          f"medians of {args.rounds} round(s)")
    print(f"{'layout':10s} {'rows':>8s} {'rows/s':>9s} {'shards':>7s}")
    for layout, n in cases:
        print(f"{layout:10s} {n:8d} {med[(layout, n)]:9.0f} {shards[(layout, n)]:7d}")
    print(f"one-step rate at {big} over at {args.n}: {out['one_step_scaling']:.2f} (per-step: "
          f"{out['per_step_scaling']:.2f}); one-step over per-step at {big}: {out['one_step_over_per_step']:.2f}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
