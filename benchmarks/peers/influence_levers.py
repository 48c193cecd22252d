"""Which lever would close the influence gap? Candidate ways to approximate exact damped influence at
the peers benchmark's budget, all on the peers workload's exact gradients (no peer installed).

The peers table (``python -m benchmarks.run_all``) has olmo_tda's projected per-layer Fisher at
0.39–0.41 Spearman against exact per-layer damped empirical-Fisher influence, TRAK at 0.456 and
Kronfluence's unprojected EK-FAC at 0.576. This script computes, from the workload's exact
per-example gradients (``torch.func``) and its exact influence (``workload.exact_influence``):

- ``ekfac_full`` / ``kfac_full``: EK-FAC / K-FAC in the full, unprojected space (our own, from the
  layers' token covariances; EK-FAC's eigenvalues are the per-example gradients' second moments in
  the K-FAC eigenbasis). Not a store: the ceiling a Kronecker curvature model reaches here;
- ``fisher_kron``: what our store does: each layer's gradient projected by the library's
  orthogonal projectors at the workload's k per side (k=8: 64 floats a layer, 832 in all), with
  the damped Fisher of the projected gradients (three projector seeds);
- ``fisher_eigen``: the same in the top-k K-FAC eigenbasis;
- ``ekfac_kron`` / ``ekfac_eigen``: ``hessian="ekfac"`` on those same stored rows: EK-FAC in the
  projected space (Kronecker factors and eigenvalue correction from the stored per-example
  gradients, the library's ``ekfac_apply``), at the projected Fisher's λ;
- ``split_count`` / ``split_deff`` / ``split_size`` / ``split_even``: the same total floats through
  the top K-FAC eigenvectors, split across layers by a rule, each layer keeping the top rectangle of
  most effective dimension within its share (``olmo_tda.capture.eigenbasis.best_rectangle``): by the
  count of directions with curvature above λ (``capture.budget``'s rule, ``allocate_budget``), by
  the soft effective dimension ``Σ κ/(κ+λ)``, by layer size, and evenly. Projected Fisher on the
  kept coordinates;
- ``fisher_layer_jl`` / ``fisher_layer_jl2x``: a dense Gaussian projection of each layer's full
  gradient (k² or 2k² per layer) with its projected Fisher (forming these needs every per-example
  gradient in full: what capture avoids);
- ``fisher_global_jl``: one dense projection of the concatenated gradient to the same total
  (832) with one Fisher over it (TRAK's construction);
- ``fisher_global_kron``: our Kronecker coordinates with one Fisher across layers;
- ``fisher_eigen_joint`` / ``split_count_joint``: ``fisher_eigen``'s and ``split_count``'s rows with
  one Fisher across layers — ``hessian="joint"`` on those stores;
- ``split_count_joint_r32`` / ``_r128`` / ``_r256``: ``split_count``'s rows through the library's
  ``hessian="joint", rank=r`` (top-r eigenpairs of the whole-model Fisher by streaming subspace
  iteration at its default 3 iterations, then Woodbury): what a store too wide for the explicit
  joint Fisher gets;
- ``precond_then_kron`` / ``exact_precond_then_kron`` / ``precond_then_eigen``: curvature
  applied in the full space to the query first (EK-FAC, or the exact damped inverse), then the
  projected inner product with the stored gradient.

Every λ is 0.1 × the mean eigenvalue of what is inverted (the peers benchmark's convention).

    python -m benchmarks.peers.influence_levers --workdir /tmp/pw    # after a peers run (~2 min)
    python -m benchmarks.peers.influence_levers                      # prepares a fresh workload first
    python -m benchmarks.peers.influence_levers --arch olmo          # ... on ai2-olmo's OLMo model
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from olmo_tda.capture.eigenbasis import BUDGET_DAMPING, allocate_budget, best_rectangle, split_budget
from olmo_tda.capture.projection import make_projector
from olmo_tda.methods.influence import Influence, ekfac_apply

from .workload import (ARCHS, RELATIVE_DAMPING, Workload, exact_gradients, example_losses, linear_names, load,
                       prepare, spearman_rows)

PEERS = {"linear": {"Kronfluence (EK-FAC, unprojected)": 0.576, "TRAK (832)": 0.456},
         "olmo": {"Kronfluence (EK-FAC, unprojected)": 0.483, "TRAK (576)": 0.511}}
"""The peers' influence Spearman in the recorded peers runs (docs/benchmarks/peers.md), per workload model,
for the table."""


def token_covariances(model, train: torch.Tensor, names: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(A = E[a aᵀ], S = E[g gᵀ])`` over the training tokens (summed token loss)."""
    modules = dict(model.named_modules())
    sums = {n: [0.0, 0.0, 0] for n in names}
    handles = []
    for name in names:
        def hook(module, inputs, output, name=name):
            a = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            sums[name][0] = sums[name][0] + a.T @ a
            sums[name][2] += len(a)

            def grad_hook(g):
                g = g.detach().reshape(-1, g.shape[-1]).double()
                sums[name][1] = sums[name][1] + g.T @ g
            output.register_hook(grad_hook)
        handles.append(modules[name].register_forward_hook(hook))
    try:
        for lo in range(0, len(train), 64):
            x = train[lo:lo + 64]
            model.zero_grad(set_to_none=True)
            example_losses(model(x), x).sum().backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return {n: (a / count, s / count) for n, (a, s, count) in sums.items()}


def eig_desc(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    vals, vecs = torch.linalg.eigh(m)
    return vals.flip(0), vecs.flip(1)


def projected_fisher_scores(train: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``[Q, N]`` ``q (F + λI)⁻¹ gᵀ`` with ``F`` the Fisher of the projected train rows ``[N, d]``."""
    fisher = train.T @ train / len(train)
    lam = RELATIVE_DAMPING * torch.trace(fisher) / fisher.shape[0]
    eye = torch.eye(fisher.shape[0], dtype=fisher.dtype)
    return query @ torch.linalg.solve(fisher + lam * eye, train.T)


def projected_ekfac_scores(train: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``[Q, N]`` as :func:`projected_fisher_scores`, with EK-FAC in place of the explicit Fisher
    (rows ``[N, Ko, Ki]``); the same λ (EK-FAC keeps the Fisher's trace)."""
    n, k_out, k_in = train.shape
    u_out = torch.linalg.eigh(torch.einsum("noi,npi->op", train, train) / n)[1]
    u_in = torch.linalg.eigh(torch.einsum("noi,nop->ip", train, train) / n)[1]
    evals = (u_out.T @ train @ u_in).pow(2).mean(0)
    lam = RELATIVE_DAMPING * float(evals.sum()) / (k_out * k_in)
    pre = ekfac_apply(query, u_out, u_in, evals, lam)
    return pre.reshape(len(query), -1) @ train.reshape(n, -1).T


class _RowStore:
    """Stored rows held in memory, shaped like a store for :class:`~olmo_tda.methods.influence.Influence`
    (``layer_shapes`` and ``iter_blocks``): layer ``i`` is ``[N, 1, D_i]``."""

    def __init__(self, rows: list[torch.Tensor], block: int = 256):
        self.grads = {f"L{i}": r.unsqueeze(1) for i, r in enumerate(rows)}
        self.layer_shapes = {n: tuple(g.shape[1:]) for n, g in self.grads.items()}
        self.block = block

    def iter_blocks(self, layers, block_size=None):
        num, size = len(next(iter(self.grads.values()))), block_size or self.block
        for lo in range(0, num, size):
            yield SimpleNamespace(ids=range(lo, min(num, lo + size)),
                                  grads={n: g[lo:lo + size] for n, g in self.grads.items()})


def library_joint_scores(train: list[torch.Tensor], query: list[torch.Tensor], rank: int) -> torch.Tensor:
    """``[Q, N]`` influence from the library's ``hessian="joint", rank=rank`` on per-layer rows."""
    store = _RowStore(train)
    method = Influence(hessian="joint", rank=rank, damping_ratio=RELATIVE_DAMPING)
    method.fit(store, list(store.grads))
    pre = method.prepare({f"L{i}": q.unsqueeze(1) for i, q in enumerate(query)})
    return sum(pre[n].reshape(len(query[0]), -1) @ g.reshape(len(g), -1).T for n, g in store.grads.items())


def run(workdir: Path, seeds: int) -> dict:
    w, model, train_ids, query_ids = load(workdir)
    exact = np.load(workdir / "exact_influence.npy")
    names = linear_names(model)
    modules = dict(model.named_modules())
    g_all = exact_gradients(model, train_ids).double()
    q_all = exact_gradients(model, query_ids).double()
    n = len(g_all)
    covs = token_covariances(model, train_ids, names)
    gen = torch.Generator().manual_seed(0)
    scores: dict[str, list[torch.Tensor]] = {}

    def add(key: str, rep: int, value: torch.Tensor) -> None:
        runs = scores.setdefault(key, [])
        if len(runs) <= rep:
            runs.append(torch.zeros_like(value))
        runs[rep] += value

    coords: dict[int, tuple[list, list]] = {rep: ([], []) for rep in range(seeds)}
    eigen_coords: tuple[list, list] = ([], [])          # fisher_eigen's rows, for one Fisher across layers
    count_coords: tuple[list, list] = ([], [])          # split_count's rows, likewise
    global_jl = {rep: torch.randn(len(names) * w.k * w.k, g_all.shape[1], generator=gen, dtype=torch.float64)
                 for rep in range(seeds)}
    def per_layer():
        """``(name, train [N, n_out, n_in], query [Q, n_out, n_in])`` of each scored layer."""
        lo = 0
        for name in names:
            n_out, n_in = modules[name].weight.shape
            yield (name, g_all[:, lo:lo + n_out * n_in].reshape(n, n_out, n_in),
                   q_all[:, lo:lo + n_out * n_in].reshape(len(q_all), n_out, n_in))
            lo += n_out * n_in

    for name, g, q in per_layer():
        n_out, n_in = g.shape[1:]
        size = n_out * n_in
        gf, qf = g.reshape(n, -1), q.reshape(len(q), -1)
        lam = RELATIVE_DAMPING * float(gf.pow(2).sum(1).mean()) / size          # exact's λ: 0.1·tr(F)/D
        a_cov, s_cov = covs[name]
        ev_in, u_in = eig_desc(a_cov)
        ev_out, u_out = eig_desc(s_cov)
        g_rot, q_rot = u_out.T @ g @ u_in, u_out.T @ q @ u_in
        ekfac = g_rot.pow(2).mean(0)                                             # EK-FAC eigenvalues
        kfac = torch.outer(ev_out, ev_in)
        kfac = kfac * (ekfac.sum() / kfac.sum())                                  # the same trace
        add("ekfac_full", 0, torch.einsum("qoi,noi->qn", q_rot / (ekfac + lam), g_rot))
        add("kfac_full", 0, torch.einsum("qoi,noi->qn", q_rot / (kfac + lam), g_rot))
        q_ekfac = u_out @ (q_rot / (ekfac + lam)) @ u_in.T                      # EK-FAC⁻¹ q, full space
        gram = gf @ gf.T
        q_exact = ((qf - (qf @ gf.T) @ torch.linalg.solve(n * lam * torch.eye(n, dtype=torch.float64) + gram, gf))
                   / lam).reshape(q.shape)                                       # (F + λI)⁻¹ q, exact
        k_out, k_in = min(w.k, n_out), min(w.k, n_in)
        e_out, e_in = u_out[:, :k_out].T, u_in[:, :k_in].T
        g_eig = e_out @ g @ e_in.T
        add("fisher_eigen", 0, projected_fisher_scores(g_eig.reshape(n, -1), (e_out @ q @ e_in.T).reshape(len(q), -1)))
        eigen_coords[0].append(g_eig.reshape(n, -1))
        eigen_coords[1].append((e_out @ q @ e_in.T).reshape(len(q), -1))
        add("ekfac_eigen", 0, projected_ekfac_scores(g_eig, e_out @ q @ e_in.T))
        add("precond_then_eigen", 0, torch.einsum("qoi,noi->qn", e_out @ q_ekfac @ e_in.T, g_eig))
        for rep in range(seeds):
            p_out, p_in = (m.double() for m in
                           make_projector(name, n_out, n_in, (k_out, k_in), "orthogonal", rep).matrices())
            scale = size / (k_out * k_in)           # orthonormal rows: E⟨Px, Py⟩ = (k/n)⟨x, y⟩ per side
            g_p = p_out @ g @ p_in.T
            q_p = p_out @ q @ p_in.T
            add("fisher_kron", rep, projected_fisher_scores(g_p.reshape(n, -1), q_p.reshape(len(q), -1)))
            add("ekfac_kron", rep, projected_ekfac_scores(g_p, q_p))
            add("precond_then_kron", rep, scale * torch.einsum("qoi,noi->qn", p_out @ q_ekfac @ p_in.T, g_p))
            add("exact_precond_then_kron", rep, scale * torch.einsum("qoi,noi->qn", p_out @ q_exact @ p_in.T, g_p))
            coords[rep][0].append(math.sqrt(scale) * g_p.reshape(n, -1))
            coords[rep][1].append(math.sqrt(scale) * q_p.reshape(len(q), -1))
            for key, width in (("fisher_layer_jl", w.k * w.k), ("fisher_layer_jl2x", 2 * w.k * w.k)):
                r = torch.randn(width, size, generator=gen, dtype=torch.float64)
                add(key, rep, projected_fisher_scores(gf @ r.T, qf @ r.T))
    budget = len(names) * w.k * w.k
    spectra = {name: (eig_desc(covs[name][1])[0].clamp(min=0), eig_desc(covs[name][0])[0].clamp(min=0))
               for name in names}
    rules = {"split_count": None, "split_even": {n: 1.0 for n in names},
             "split_size": {n: float(len(s) * len(a)) for n, (s, a) in spectra.items()},
             "split_deff": {n: float((k / (k + BUDGET_DAMPING * k.mean())).sum())
                            for n, k in ((n, torch.outer(s, a)) for n, (s, a) in spectra.items())}}
    for key, weights in rules.items():
        if weights is None:
            dims = allocate_budget(spectra, budget, (w.k * w.k, w.k * w.k))
        else:
            shares = split_budget(weights, budget)
            dims = {n: best_rectangle(*spectra[n], shares[n], (w.k * w.k, w.k * w.k)) for n in names}
        total = 0
        for name, g, q in per_layer():
            (a, b), total = dims[name], total + dims[name][0] * dims[name][1]
            e_out, e_in = eig_desc(covs[name][1])[1][:, :a].T, eig_desc(covs[name][0])[1][:, :b].T
            g_k, q_k = (e_out @ g @ e_in.T).reshape(n, -1), (e_out @ q @ e_in.T).reshape(len(q), -1)
            add(key, 0, projected_fisher_scores(g_k, q_k))
            if key == "split_count":
                count_coords[0].append(g_k)
                count_coords[1].append(q_k)
        assert total <= budget, (key, total, budget)
    # hessian="joint": the same stored rows, one damped Fisher across all layers (cross-layer blocks kept)
    add("fisher_eigen_joint", 0, projected_fisher_scores(torch.cat(eigen_coords[0], 1), torch.cat(eigen_coords[1], 1)))
    add("split_count_joint", 0, projected_fisher_scores(torch.cat(count_coords[0], 1), torch.cat(count_coords[1], 1)))
    for rank in (32, 128, 256):
        add(f"split_count_joint_r{rank}", 0, library_joint_scores(*count_coords, rank))
    for rep in range(seeds):
        add("fisher_global_kron", rep, projected_fisher_scores(torch.cat(coords[rep][0], 1), torch.cat(coords[rep][1], 1)))
        r = global_jl[rep]
        add("fisher_global_jl", rep, projected_fisher_scores(g_all @ r.T, q_all @ r.T))
    rho = {key: [spearman_rows(exact, s.numpy()) for s in runs] for key, runs in scores.items()}
    budget = len(names) * w.k * w.k
    floats = {key: ("all" if key.endswith("_full") else 2 * budget if key.endswith("2x") else budget) for key in rho}
    return {key: {"spearman": round(float(np.mean(v)), 4), "runs": [round(x, 4) for x in v], "floats": floats[key]}
            for key, v in rho.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None, help="a peers run's workdir (default: a fresh one under /tmp)")
    p.add_argument("--seeds", type=int, default=3, help="projection seeds for the random rows")
    p.add_argument("--arch", choices=ARCHS, default="linear", help="the model of a fresh workload (no --workdir)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.perf_counter()
    workdir = Path(args.workdir or f"/tmp/olmo_tda_influence_levers_{args.arch}")
    if not (workdir / "exact_influence.npy").exists():
        prepare(workdir, Workload(arch=args.arch))
    result = run(workdir, args.seeds)
    peers = PEERS.get(Workload.load(workdir / "workload.json").arch, {})
    print(f"influence levers: peers workload ({workdir}), Spearman vs exact per-layer damped empirical-Fisher "
          f"influence, mean over {args.seeds} projection seed(s)")
    print(f"{'approximation':28s} {'floats/example':>16s} {'Spearman':>9s}  runs")
    for key, r in sorted(result.items(), key=lambda kv: -kv[1]["spearman"]):
        print(f"{key:28s} {r['floats']:>16} {r['spearman']:9.3f}  {r['runs']}")
    for peer, value in peers.items():
        print(f"{'(peer) ' + peer:45s} {value:9.3f}")
    out = {"benchmark": "influence_levers", "workdir": str(workdir), "seeds": args.seeds, "results": result,
           "peers_recorded": peers, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
