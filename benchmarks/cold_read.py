"""A factor-store query read cold while the page cache is full: hinting, reading ahead, reading around.

At 1M rows the dense store is 65 GB: a query of it fills the page cache, and a factor store's query
after it reads its own 2 GB through a cache with no free page left. Every page it reads then costs
the kernel a reclaim and a copy, on the same cores the scoring runs on. This script builds a rank-2
bf16 factor store of N rows (4 Linears of an OLMo block at k=64, random factors: the timing does not
depend on the values; store_read.py's writer), and a filler file the size of this machine's RAM.
Before each cold query the store is evicted (``posix_fadvise(DONTNEED)``), the filler read (it fills
the page cache) and the store evicted again. Arms, in interleaved rounds, medians:

- ``hint``: the reader asks the kernel for the next shard (``WILLNEED``) and reads each dataset in
  its turn (``PREFETCH_BYTES = 0``: the reader before its read-ahead into memory);
- ``cache``: a helper thread reads the next shard's selected bytes into memory, through the page
  cache (``_direct_reads`` forced off);
- ``direct``: the same, the bytes not cached read with ``O_DIRECT`` (what the reader does on its
  own when the store does not fit in half of the free memory, as here; checked and printed);

and two references: ``warm`` (the store cached) and ``free`` (cold, with the filler evicted: free
memory, the reader's own choice). The headline is ``hint`` / ``direct``.

    python benchmarks/cold_read.py               # N=1M (2.1 GB) + a RAM-sized filler, 4 rounds (~13 min)
    python benchmarks/cold_read.py --quick       # N=200k, 2 rounds (the filler is still RAM-sized)

Linux only (``posix_fadvise``, ``O_DIRECT``); needs free disk for the filler and the store.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from olmo_tda.methods.base import attribute
from olmo_tda.store import reader
from store_read import LAYERS, K, PROJECTOR_HASH, write

ARMS = ("hint", "cache", "direct")


def evict(path: Path) -> None:
    for f in [path] if path.is_file() else sorted(path.rglob("*.h5")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_filler(path: Path, nbytes: int) -> None:
    chunk = bytes(64 << 20)
    with open(path, "wb") as f:
        for _ in range(0, nbytes, len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def read_file(path: Path) -> float:
    """Read ``path`` through the page cache; GB/s."""
    buf = bytearray(64 << 20)
    t0, n = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            n += got
    return n / (time.perf_counter() - t0) / 1e9


def free_gb() -> float:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000, help="rows of the factor store")
    p.add_argument("--quick", action="store_true", help="N=200k, 2 rounds")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--filler-gb", type=float, default=0.0, help="filler size (default: this machine's RAM)")
    p.add_argument("--work-dir", default=None, help="where the store and filler go (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.rounds = 200_000, 2
    if not (hasattr(os, "posix_fadvise") and hasattr(os, "O_DIRECT")):
        raise SystemExit("cold_read: needs Linux (posix_fadvise and O_DIRECT)")
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    filler_bytes = int(args.filler_gb * 1e9) if args.filler_gb else ram
    root = Path(tempfile.mkdtemp(prefix="cold_read-", dir=args.work_dir))
    need = filler_bytes + args.n * 2080 + (1 << 30)
    if shutil.disk_usage(root).free < need:
        shutil.rmtree(root, ignore_errors=True)
        raise SystemExit(f"cold_read: needs {need / 1e9:.1f} GB free under {root.parent} (a "
                         f"{filler_bytes / 1e9:.1f} GB filler and the store); pass --work-dir or --filler-gb")
    t_start = time.perf_counter()
    real = reader._direct_reads, reader.PREFETCH_BYTES
    try:
        store = write(root / "store", args.n, 1024, 4, args.seed)
        filler = root / "filler"
        write_filler(filler, filler_bytes)
        build_s = time.perf_counter() - t_start
        gen = torch.Generator().manual_seed(args.seed + 1)
        queries = {n: torch.randn(args.queries, K, K, generator=gen) for n in LAYERS}

        def query() -> float:
            t0 = time.perf_counter()
            attribute(store, queries, method="graddot", top_k=100, projector_hash=PROJECTOR_HASH)
            return time.perf_counter() - t0

        def arm(name: str) -> None:
            reader.PREFETCH_BYTES = 0 if name == "hint" else real[1]
            reader._direct_reads = {"cache": lambda nbytes: False, "direct": lambda nbytes: True}.get(name, real[0])

        times = {name: [] for name in (*ARMS, "free", "warm")}
        fill_gbs, free_after_fill, chose_direct = [], [], []
        for r in range(args.rounds):
            for name in (ARMS if r % 2 == 0 else ARMS[::-1]):
                evict(store.path)
                fill_gbs.append(read_file(filler))
                evict(store.path)
                free_after_fill.append(free_gb())
                chose_direct.append(real[0](store.nbytes))
                arm(name)
                times[name].append(query())
            arm("free")             # the reader's own choice, with the filler evicted
            evict(filler)
            evict(store.path)
            times["free"].append(query())
            times["warm"].append(query())
    finally:
        reader._direct_reads, reader.PREFETCH_BYTES = real
        shutil.rmtree(root, ignore_errors=True)

    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"cold_read: N={args.n} rows, rank 2 bf16 ({store.nbytes / 1e9:.2f} GB, {len(store.shards)} shards), "
          f"{args.queries} queries top-100; filler {filler_bytes / 1e9:.1f} GB read at "
          f"{statistics.median(fill_gbs):.2f} GB/s, free memory after it {min(free_after_fill):.2f}-"
          f"{max(free_after_fill):.2f} GB; the reader chose "
          f"direct reads in {sum(chose_direct)} of {len(chose_direct)} cold runs; {args.rounds} interleaved rounds")
    print(f"{'arm':>8} {'median s':>9}  runs")
    for name, v in times.items():
        print(f"{name:>8} {med[name]:>9.2f}  {', '.join(f'{x:.2f}' for x in v)}")
    print(f"full page cache: hint {med['hint']:.2f} s, read ahead through the cache {med['cache']:.2f} s, "
          f"direct {med['direct']:.2f} s ({med['hint'] / med['direct']:.2f}x faster than hint); "
          f"warm {med['warm']:.2f} s, cold with free memory {med['free']:.2f} s")
    result = {"benchmark": "cold_read", "n": args.n, "rounds": args.rounds, "store_gb": round(store.nbytes / 1e9, 3),
              "filler_gb": round(filler_bytes / 1e9, 1), "median_s": {k: round(v, 3) for k, v in med.items()},
              "runs_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
              "hint_over_direct": round(med["hint"] / med["direct"], 3),
              "cache_over_direct": round(med["cache"] / med["direct"], 3),
              "reader_chose_direct": f"{sum(chose_direct)}/{len(chose_direct)}",
              "build_s": round(build_s, 1), "total_s": round(time.perf_counter() - t_start, 1),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
