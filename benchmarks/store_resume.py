"""What a multi-rank resume costs each rank's writer when every rank opens the store at once.

A resumed run's ranks all open their writers on one store at the same moment. Each writer reads the
other ranks' index too (its duplicate check covers their rows), so the cost grows with ranks x shards,
and every rank's own writer must take its rank's lock, which another rank's open may be holding. This
script grows a store of ``--ranks`` ranks with ``--shards`` shards each (``store_open.py``'s tiny
shards: one step of 2 rows, 2 layers at k=4, so the shard count is what is measured), then
per round:

- ``alone``: one rank's writer opened and closed with no other process on the store;
- ``together``: every rank's writer opened at once, one process a rank (released by a barrier; rank
  r then sleeps r x ``--stagger-ms``, as ranks that finish building their model at different times),
  and closed; per rank the seconds its ``create`` took and the seconds it waited for its own rank's
  lock (``lock_wait``: time another process held it). A rank refused its lock within the store's
  ``LOCK_WAIT_S`` (5 s) counts as a failure and its error is printed.

Medians over rounds (and, for ``together``, over ranks; the worst rank is reported too). The machine's
core count bounds how "at once" the ranks run: on 2 cores 8 processes share them.

Then the replay after a resume, on a copy of the store: every rank is cut back to half its steps, as a
resume from a checkpoint there does, with rank 0's writer opened before the other ranks cut theirs (its
index of their shards is the one from before), and rank 0 appends the steps again (``flush_every=32``):
``replay`` is ms per step, against ``replay_fresh``, the same with a writer opened after the cuts.

    python benchmarks/store_resume.py                          # 8 ranks x 1500 shards (~2.5 min)
    python benchmarks/store_resume.py --stagger-ms 20             # ranks arriving 20 ms apart
    python benchmarks/store_resume.py --ranks 4 --shards 300 --rounds 2
    python benchmarks/store_resume.py --store /tmp/s8x1500        # grown once, kept, reused
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from olmo_tda.config import StoreConfig
from olmo_tda.store import GradientStore
from olmo_tda.store.record import GradientRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
import store_open  # noqa: E402  - the same tiny shards as the single-rank benchmark

META, ROWS = store_open.META, store_open.ROWS


def grow(path: Path, rank: int, shards: int) -> None:
    """Rank ``rank`` writes steps ``0..shards-1``, one shard each; its ids are its own (as data parallel)."""
    with GradientStore.create(path, META, StoreConfig(flush_every=1), rank=rank) as writer:
        for step in range(shards):
            writer.append(record(rank, step))


def open_writer(path: Path, rank: int) -> tuple[float, float]:
    """Seconds to open (and close) rank's writer, and of those the seconds spent waiting for its lock."""
    from olmo_tda.store import manifest

    waited = [0.0]
    acquire = manifest.RankLock.acquire_for_writing.__func__

    def timed(cls, root, r):
        t0 = time.perf_counter()
        try:
            return acquire(cls, root, r)
        finally:
            waited[0] += time.perf_counter() - t0

    manifest.RankLock.acquire_for_writing = classmethod(timed)
    try:
        t0 = time.perf_counter()
        GradientStore.create(path, META, StoreConfig(flush_every=10 ** 6), rank=rank).close()
        return time.perf_counter() - t0, waited[0]
    finally:
        manifest.RankLock.acquire_for_writing = classmethod(acquire)


def record(rank: int, step: int) -> GradientRecord:
    """``store_open``'s record of ``step``, with rank ``rank``'s own ids."""
    r = store_open.record(step)
    r.ids = r.ids + rank * ROWS
    return r


def replay(path: Path, ranks: int, shards: int) -> tuple[float, float]:
    """ms per replayed step of rank 0, opened before / after the other ranks cut their rows."""
    half, config = shards // 2, StoreConfig(flush_every=32)
    writer = GradientStore.create(path, META, config, rank=0)
    writer.truncate_after(half)
    for rank in range(1, ranks):
        with GradientStore.create(path, META, StoreConfig(), rank=rank) as other:
            other.truncate_after(half)
    per_step = []
    for _ in range(2):
        t0 = time.perf_counter()
        for step in range(half + 1, shards):
            writer.append(record(0, step))
        writer.flush()
        per_step.append(1e3 * (time.perf_counter() - t0) / max(1, shards - half - 1))
        writer.truncate_after(half)
        writer.close()
        writer = GradientStore.create(path, META, config, rank=0)
    writer.close()
    return per_step[0], per_step[1]


def _rank_process(path: str, rank: int, stagger_s: float, barrier, results) -> None:
    GradientStore.open(path)                 # imports done and the page cache warm before the barrier
    barrier.wait()
    time.sleep(rank * stagger_s)
    try:
        results.put((rank, *open_writer(Path(path), rank), None))
    except Exception:                         # noqa: BLE001 - reported per rank
        results.put((rank, None, None, traceback.format_exc(limit=3)))


def together(path: Path, ranks: int, stagger_s: float) -> list[tuple[int, float | None, float | None, str | None]]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_rank_process, args=(str(path), r, stagger_s, barrier, results))
             for r in range(ranks)]
    for p in procs:
        p.start()
    out = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return sorted(out)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--shards", type=int, default=1500, help="shards per rank")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stagger-ms", type=float, default=0.0, help="rank r starts r x this after the barrier")
    p.add_argument("--work-dir", default=None, help="where the store is grown (default: the system temp folder)")
    p.add_argument("--store", default=None, help="grow the store here and keep it; reused if it exists (it must be "
                   "of --ranks x --shards)")
    args = p.parse_args(argv)
    if args.ranks < 2 or args.shards < 1 or args.rounds < 1 or args.stagger_ms < 0:
        p.error("--ranks must be >= 2, --shards >= 1, --rounds >= 1 and --stagger-ms >= 0")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="store_resume_", dir=args.work_dir) as tmp:
        path = Path(args.store) if args.store else Path(tmp) / "store"
        if not path.exists():
            for rank in range(args.ranks):
                grow(path, rank, args.shards)
        grown_s = time.perf_counter() - t_start
        have = GradientStore.open(path).summary()
        if have["ranks"] != list(range(args.ranks)) or have["shards"] != args.ranks * args.shards:
            p.error(f"--store {path} holds ranks {have['ranks']} and {have['shards']} shards, "
                    f"not {args.ranks} x {args.shards}")
        alone, opens, waits, failures = [], [], [], []
        for _ in range(args.rounds):
            alone.append(open_writer(path, args.ranks - 1)[0])
            for rank, opened, waited, error in together(path, args.ranks, args.stagger_ms / 1e3):
                if error is not None:
                    failures.append(rank)
                    print(f"[store_resume] rank {rank} failed:\n{error}", file=sys.stderr)
                else:
                    opens.append(opened)
                    waits.append(waited)
        copy = Path(tmp) / "replay"
        shutil.copytree(path, copy, ignore=shutil.ignore_patterns("locks"))
        replay_ms, replay_fresh_ms = replay(copy, args.ranks, args.shards)
    elapsed = time.perf_counter() - t_start
    ms = lambda xs, f: None if not xs else 1e3 * f(xs)          # noqa: E731
    result = {"benchmark": "store_resume", "ranks": args.ranks, "shards_per_rank": args.shards,
              "rounds": args.rounds, "stagger_ms": args.stagger_ms, "alone_ms": ms(alone, statistics.median),
              "together_ms_median": ms(opens, statistics.median), "together_ms_max": ms(opens, max),
              "lock_wait_ms_median": ms(waits, statistics.median), "lock_wait_ms_max": ms(waits, max),
              "failures": len(failures), "replay_ms_per_step": replay_ms,
              "replay_fresh_ms_per_step": replay_fresh_ms, "grow_s": grown_s, "seconds": elapsed,
              "cpus": os.cpu_count(),
              "python": platform.python_version(), "torch": torch.__version__}
    fmt = lambda v: "-" if v is None else f"{v:.1f}"           # noqa: E731
    print(f"{'ranks':>5} {'shards/rank':>11} {'alone ms':>9} {'together ms':>12} {'worst ms':>9} "
          f"{'lock wait ms':>13} {'worst wait ms':>14} {'failures':>9} {'replay ms/step':>15} {'fresh ms/step':>14}")
    print(f"{args.ranks:5d} {args.shards:11d} {fmt(result['alone_ms']):>9} {fmt(result['together_ms_median']):>12} "
          f"{fmt(result['together_ms_max']):>9} {fmt(result['lock_wait_ms_median']):>13} "
          f"{fmt(result['lock_wait_ms_max']):>14} {len(failures):9d} {replay_ms:15.2f} {replay_fresh_ms:14.2f}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
