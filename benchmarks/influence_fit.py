"""What each influence curvature model costs to fit and to apply: raw, lorif and ekfac on one store.

A store of N synthetic per-example gradients for L layers at k × k (k=64: the projected width of a
real capture), each row ``Ĝ = Σ_t g_t a_tᵀ`` over T tokens whose factors have decaying spectra, so
the Fisher is far from isotropic, as a trained model's is. For each ``hessian`` the same
``Influence`` object the library uses (``attribute(method="influence")``) is timed on:

- ``fit``: its passes over the store (each a full read) and its factorization, cache disabled;
- ``prepare``: preconditioning Q query gradients (the scoring after it is the same GEMM for all);
- ``state``: the bytes of the fitted factors it keeps (what its cache file holds);
- ``vs raw``: the mean per-query Spearman of its preconditioned queries' scores against raw's over
  the store's rows (raw is the exact damped inverse of the projected Fisher).

Interleaved rounds with a rotating order; medians. The default damping (0.1·tr(F)/D) for all.

    python benchmarks/influence_fit.py              # N = 20,000, 4 layers at k = 64 (~3 min)
    python benchmarks/influence_fit.py --quick      # N = 4,000 (~30 s)

Prints a table, then one JSON line (last line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lds import spearman_rows          # per-query Spearman, shared with the LDS benchmark
from olmo_tda.config import StoreConfig
from olmo_tda.methods import get_method
from olmo_tda.store import GradientRecord, GradientStore

HESSIANS = ("raw", "lorif", "ekfac")


def synthetic_rows(n: int, k: int, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, k, k]`` rows ``gᵀa`` of T tokens, each side's directions weighted by a decaying spectrum."""
    spectrum = torch.logspace(0, -1.5, k)
    g = torch.randn(n, tokens, k, generator=gen) * spectrum
    a = torch.randn(n, tokens, k, generator=gen) * spectrum.flip(0).roll(k // 3)
    return g.transpose(1, 2) @ a


def build_store(path: Path, n: int, layers: int, k: int, tokens: int, seed: int) -> tuple[GradientStore, dict]:
    gen = torch.Generator().manual_seed(seed)
    names = [f"layer{i}" for i in range(layers)]
    meta = {"capture": {}, "projector_hash": "synthetic",
            "layers": [{"name": n_, "shape": [k, k], "projector": {}} for n_ in names]}
    with GradientStore.create(path, meta, StoreConfig()) as writer:
        for start in range(0, n, 1000):
            stop = min(n, start + 1000)
            writer.append(GradientRecord(ids=np.arange(start, stop), step=0, lr=1.0, loss_scale=1.0,
                                         grads={name: synthetic_rows(stop - start, k, tokens, gen) for name in names}))
    queries = {name: synthetic_rows(16, k, tokens, gen) for name in names}
    return GradientStore.open(path), queries


def state_bytes(method) -> int:
    total = 0
    for factor in method._fitted["factors"].values():
        for t in (factor if isinstance(factor, tuple) else (factor,)):
            total += t.numel() * t.element_size()
    return total


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N = 4,000, 2 rounds")
    p.add_argument("--num-rows", type=int, default=None, help="N (default 20,000; --quick 4,000)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--k", type=int, default=64, help="projected width per side (D = k²)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 2)")
    p.add_argument("--rank", type=int, default=64, help="lorif rank r")
    args = p.parse_args(argv)
    n = args.num_rows or (4000 if args.quick else 20000)
    rounds = args.rounds or (2 if args.quick else 3)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="olmo_tda_influence_fit_") as tmp:
        store, queries = build_store(Path(tmp) / "store", n, args.layers, args.k, args.tokens, seed=0)
        layers = list(queries)
        fit_s = {h: [] for h in HESSIANS}
        prep_s = {h: [] for h in HESSIANS}
        fitted = {}
        for r in range(rounds):
            order = HESSIANS[r % 3:] + HESSIANS[:r % 3]
            for hessian in order:
                method = get_method("influence", hessian=hessian, **({"rank": args.rank} if hessian == "lorif" else {}))
                t0 = time.perf_counter()
                method._fit(store, layers, None)          # the passes and factorization, no cache
                fit_s[hessian].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                pre = method.prepare(queries)
                prep_s[hessian].append(time.perf_counter() - t0)
                fitted[hessian] = (method, pre)
        rows = store.read_all().grads
        scores = {h: sum(pre[name].double().reshape(16, -1) @ rows[name].double().reshape(n, -1).T for name in layers)
                  for h, (_, pre) in fitted.items()}
    d = args.k * args.k
    result = {}
    print(f"influence fit: N = {n:,} rows, {args.layers} layers of {args.k}x{args.k} (D = {d}), {args.tokens} "
          f"tokens a row, 16 queries, lorif rank {args.rank}, medians of {rounds} interleaved rounds")
    print(f"{'hessian':<8} {'fit s':>8} {'prepare ms':>11} {'state MiB':>10} {'vs raw':>7}")
    for h in HESSIANS:
        result[h] = {"fit_s": round(statistics.median(fit_s[h]), 3),
                     "prepare_ms": round(1e3 * statistics.median(prep_s[h]), 2),
                     "state_bytes": state_bytes(fitted[h][0]),
                     "spearman_vs_raw": round(float(np.mean(spearman_rows(scores[h].numpy().T,
                                                                            scores["raw"].numpy().T))), 4)}
        r = result[h]
        print(f"{h:<8} {r['fit_s']:>8.2f} {r['prepare_ms']:>11.2f} {r['state_bytes'] / 2**20:>10.2f} "
              f"{r['spearman_vs_raw']:>7.3f}")
    out = {"benchmark": "influence_fit", "num_rows": n, "layers": args.layers, "k": args.k, "rank": args.rank,
           "results": result, "ekfac_fit_speedup_vs_raw": round(result["raw"]["fit_s"] / result["ekfac"]["fit_s"], 2),
           "ekfac_fit_speedup_vs_lorif": round(result["lorif"]["fit_s"] / result["ekfac"]["fit_s"], 2),
           "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
