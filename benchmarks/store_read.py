"""What a shard costs to read: the store reader against plain h5py, on large and on small shards.

A training run's shards are as large as its records times ``store.flush_every``: a rank that
captures 8 sequences a step writes shards of 256 rows at the default ``flush_every=32``, and a query
over a million rows opens ~4000 of them. So the reader's cost per shard, not per row, can decide how
fast a factor store answers. Two rank-2 bf16 stores of the same N rows (4 Linears of an OLMo block
at k=64, random factors: timing does not depend on the values) are written by the library's writer,
one in records of 1024 rows × 4 per shard (store_query.py's layout), one in records of 8 rows × 32
per shard; then, warm (page cache filled), in interleaved rounds, medians:

- ``reader``: ``GradientStore.iter_blocks()`` (the library; every layer decoded to float32 factors);
- ``h5py``: the same bytes through h5py's high-level API, shard by shard (ids, steps, lr,
  loss_scale, each layer's rows, decoded the same way): what one writes without our reader;
- ``query``: ``attribute(..., method="graddot")`` of 16 dense queries, top-100 (reading and scoring),
  on an opened store whose checksums were checked in an earlier pass (each dataset is checked once
  per opened store);
- ``checked``: the same query on a store opened afresh, so every dataset's CRC-32 is checked again
  (reads check them before a row is scored); ``checked − query − open`` is what the checks cost.

The headline is the cost per shard, ``(small-shard time − large-shard time) / (extra shards)``, of
the reader and of plain h5py, and how much slower the query is on small shards.

    python benchmarks/store_read.py               # N=100k
    python benchmarks/store_read.py --quick       # N=20k, 3 rounds
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

import h5py
import numpy as np
import torch

from olmo_tda.config import StoreConfig, StoreDType
from olmo_tda.methods.base import attribute
from olmo_tda.store import GradientStore
from olmo_tda.store.format import decode_grads
from olmo_tda.store.record import GradientRecord, LowRank

K, RANK = 64, 2
LAYERS = ("att_proj", "attn_out", "ff_proj", "ff_out")
PROJECTOR_HASH = "synthetic-store-read-v1"


def write(path: Path, num_rows: int, record_rows: int, flush_every: int, seed: int) -> GradientStore:
    meta = {"capture": {"proj_dim": K, "rank": RANK, "synthetic": "benchmarks/store_read.py"},
            "layers": [{"name": n, "shape": [K, K], "projector": {"kind": "synthetic"}, "rank": RANK}
                       for n in LAYERS],
            "projector_hash": PROJECTOR_HASH}
    gen = torch.Generator().manual_seed(seed)
    pool = {n: (torch.randn(record_rows, K, RANK, generator=gen), torch.randn(record_rows, K, RANK, generator=gen))
            for n in LAYERS}
    config = StoreConfig(dtype=StoreDType.BFLOAT16, flush_every=flush_every)
    with GradientStore.create(path, meta, config) as writer:
        for step, start in enumerate(range(0, num_rows, record_rows)):
            n = min(record_rows, num_rows - start)
            writer.append(GradientRecord(ids=np.arange(start, start + n), step=step, lr=1e-3, loss_scale=1.0,
                                         grads={name: LowRank(a[:n] * (1 + step % 5), b[:n])
                                                for name, (a, b) in pool.items()}))
    return GradientStore.open(path)


def read_reader(store: GradientStore) -> int:
    return sum(len(block.ids) for block in store.iter_blocks())


def read_h5py(store: GradientStore) -> int:
    rows = 0
    for info in store.shards:
        with h5py.File(store.path / info.file, "r", locking=False) as f:
            ids, _, _, _ = f["ids"][:], f["steps"][:], f["lr"][:], f["loss_scale"][:]
            for i in range(len(LAYERS)):
                packed = decode_grads(f[f"grads/L{i:04d}"][:], StoreDType.BFLOAT16)
                LowRank.from_packed(packed, K)
            rows += len(ids)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000, help="rows per store")
    p.add_argument("--quick", action="store_true", help="N=20k, 3 rounds")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--large", default="1024x4", help="records of R rows x F records per shard (RxF)")
    p.add_argument("--small", default="8x32", help="the small-shard layout (RxF)")
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--work-dir", default=None, help="where the stores go (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.rounds = 20_000, 3
    layouts = {}
    for name in ("large", "small"):
        try:
            rows, flush = (int(v) for v in getattr(args, name).split("x"))
        except ValueError:
            raise SystemExit(f"store_read: --{name} must be RxF (rows per record x records per shard), "
                             f"got {getattr(args, name)!r}") from None
        if rows < 1 or flush < 1:
            raise SystemExit(f"store_read: --{name} needs R, F >= 1, got {getattr(args, name)!r}")
        layouts[name] = (rows, flush)
    root = Path(tempfile.mkdtemp(prefix="store_read-", dir=args.work_dir))
    t_start = time.perf_counter()
    try:
        stores = {name: write(root / name, args.n, rows, flush, args.seed) for name, (rows, flush) in layouts.items()}
        gen = torch.Generator().manual_seed(args.seed + 1)
        queries = {n: torch.randn(args.queries, K, K, generator=gen) for n in LAYERS}
        arms = {"reader": read_reader, "h5py": read_h5py,
                "query": lambda s: len(attribute(s, queries, method="graddot", top_k=100,
                                                 projector_hash=PROJECTOR_HASH).ids),
                "checked": lambda s: len(attribute(GradientStore.open(s.path), queries, method="graddot", top_k=100,
                                                   projector_hash=PROJECTOR_HASH).ids),
                "open": lambda s: len(GradientStore.open(s.path).shards)}
        for store in stores.values():                      # warm: fill the page cache, check the rows
            assert read_reader(store) == read_h5py(store) == args.n
        times = {(s, a): [] for s in stores for a in arms}
        keys = list(times)
        for r in range(args.rounds):
            shift = r % len(keys)
            for s, a in keys[shift:] + keys[:shift]:
                t0 = time.perf_counter()
                arms[a](stores[s])
                times[(s, a)].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        shards = {s: len(store.shards) for s, store in stores.items()}
        extra = shards["small"] - shards["large"]
        per_shard_ms = {a: (med[("small", a)] - med[("large", a)]) / max(1, extra) * 1e3 for a in arms}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"store_read: N={args.n} rows of 4 Linears at k={K}, rank {RANK}, bf16; warm; "
          f"{args.rounds} interleaved rounds, medians; threads={torch.get_num_threads()}")
    print(f"{'layout':>8} {'rows x recs':>11} {'shards':>7} {'reader s':>9} {'h5py s':>8} {'query s':>8} "
          f"{'checked s':>9} {'open s':>7} {'checks':>7}")
    checks = {s: (med[(s, "checked")] - med[(s, "query")] - med[(s, "open")]) / med[(s, "query")] for s in layouts}
    for s, (rows, flush) in layouts.items():
        print(f"{s:>8} {f'{rows}x{flush}':>11} {shards[s]:>7} {med[(s, 'reader')]:>9.3f} {med[(s, 'h5py')]:>8.3f} "
              f"{med[(s, 'query')]:>8.3f} {med[(s, 'checked')]:>9.3f} {med[(s, 'open')]:>7.3f} {checks[s]:>+7.1%}")
    print(f"per extra shard: reader {per_shard_ms['reader']:.2f} ms, plain h5py {per_shard_ms['h5py']:.2f} ms, "
          f"query {per_shard_ms['query']:.2f} ms; the query on small shards takes "
          f"{med[('small', 'query')] / med[('large', 'query')]:.2f}x its time on large ones")
    result = {"benchmark": "store_read", "n": args.n, "rounds": args.rounds, "shards": shards,
              "layouts": {s: f"{r}x{f}" for s, (r, f) in layouts.items()},
              "median_s": {f"{s}.{a}": round(v, 4) for (s, a), v in med.items()},
              "per_shard_ms": {a: round(v, 3) for a, v in per_shard_ms.items()},
              "reader_vs_h5py_per_shard": round(per_shard_ms["h5py"] / max(per_shard_ms["reader"], 1e-9), 3),
              "query_small_over_large": round(med[("small", "query")] / med[("large", "query")], 3),
              "checksum_cost_frac": {s: round(v, 3) for s, v in checks.items()},
              "total_s": round(time.perf_counter() - t_start, 1),
              "torch": torch.__version__, "python": platform.python_version()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
