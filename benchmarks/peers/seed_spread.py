"""How much does one random projector draw decide the peers table's "Spearman vs exact"?

    python benchmarks/peers/seed_spread.py                      # the GPU check's workload at N=512 (~9 min on 2 cores)
    python benchmarks/peers/seed_spread.py --d-model 64 --n-layers 2 --seq-len 64 --n-train 1024   # the CPU table's

On the peers workload (``workload.prepare``: data, briefly trained checkpoint, exact GradDot scores
from ``torch.func``), every scored layer's exact per-example gradient ``G`` is projected to
``P_out G P_inᵀ`` (k×k) with the library's own random projectors (``RandomProjector``: orthogonal and
Gaussian, both with ``E[PᵀP] = I``), for each of ``--seeds`` seeds, and the projected GradDot scores'
Spearman with the exact ones is computed as the peers table does (``spearman_rows``). This is what a
system's random k-per-side row computes, without its capture: only the draw changes between seeds.
Also printed: each layer's share of the exact score mass ``Σ_q,i |⟨q_l, g_l⟩|``. Table, then a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from workload import Workload, build_model, exact_gradients, linear_names, prepare, spearman_rows  # noqa: E402

from olmo_tda.capture.projection import ProjectionType, RandomProjector  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--n-train", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the prepared workload here and reuse it when its workload.json matches (any k)")
    args = p.parse_args(argv)
    w = Workload(d_model=args.d_model, n_layers=args.n_layers, seq_len=args.seq_len, n_train=args.n_train,
                 batch=args.batch, k=args.k)
    workdir = args.workdir or Path(f"/tmp/olmo_tda_seed_spread_d{w.d_model}_l{w.n_layers}_t{w.seq_len}_n{w.n_train}")
    t0 = time.perf_counter()
    # k does not enter the prepared data, checkpoint or exact scores: a workload prepared at another k is reused
    if not ((workdir / "workload.json").exists() and replace(Workload.load(workdir / "workload.json"), k=w.k) == w):
        prepare(workdir, w)
    model = build_model(w)
    model.load_state_dict(torch.load(workdir / "model.pt", weights_only=True))
    model.eval()
    data = torch.load(workdir / "data.pt", weights_only=True)
    g_train, g_query = exact_gradients(model, data["train"]), exact_gradients(model, data["query"])
    exact = np.load(workdir / "exact.npy")
    modules = dict(model.named_modules())
    layers, lo = [], 0
    for name in linear_names(model):
        n_out, n_in = modules[name].weight.shape
        layers.append((name, n_out, n_in, slice(lo, lo + n_out * n_in)))
        lo += n_out * n_in

    mass = {name: float((g_query[:, s].double() @ g_train[:, s].double().T).abs().sum()) for name, _, _, s in layers}
    total = sum(mass.values())
    share = {name: m / total for name, m in mass.items()}

    spread = {}
    for kind in (ProjectionType.ORTHOGONAL, ProjectionType.GAUSSIAN):
        values = []
        for seed in range(args.seeds):
            scores = torch.zeros(g_query.shape[0], g_train.shape[0], dtype=torch.float64)
            for name, n_out, n_in, s in layers:
                p_out, p_in = RandomProjector(name, n_out, n_in, w.k, w.k, kind, seed).matrices()
                def proj(g):
                    return (p_out @ g[:, s].view(-1, n_out, n_in) @ p_in.T).flatten(1).double()
                scores += proj(g_query) @ proj(g_train).T
            values.append(spearman_rows(scores.numpy(), exact))
        spread[kind.value] = values

    print(f"seed spread: plain LM d_model {w.d_model}, {w.n_layers} blocks, {len(layers)} layers, T = {w.seq_len}, "
          f"N = {w.n_train}, k = {w.k} per side, {args.seeds} seeds ({time.perf_counter() - t0:.0f} s)")
    print(f"{'projector':>10} {'min':>6} {'median':>6} {'mean':>6} {'max':>6}  per seed")
    for kind, values in spread.items():
        print(f"{kind:>10} {min(values):6.3f} {statistics.median(values):6.3f} {statistics.mean(values):6.3f} "
              f"{max(values):6.3f}  {' '.join(f'{v:.3f}' for v in values)}")
    top = sorted(share.items(), key=lambda kv: -kv[1])[:3]
    print("share of the exact score mass: " + ", ".join(f"{n} {v:.1%}" for n, v in top))
    result = {"benchmark": "seed_spread", "workload": {"d_model": w.d_model, "n_layers": w.n_layers,
              "seq_len": w.seq_len, "n_train": w.n_train, "k": w.k}, "seeds": args.seeds, "spearman": spread,
              "score_mass_share": share}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
