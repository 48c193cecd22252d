"""Influence with a damped projected Fisher: per layer (explicit, low-rank or EK-FAC) or joint.

``score(q, i) = Σ_l ĝ_q,lᵀ (F_l + λ_l I)⁻¹ ĝ_i,l`` with ``F_l = (1/N) Σ_i vec(ĝ_i,l) vec(ĝ_i,l)ᵀ``
over the store's N rows, D_l = k_out·k_in the flattened width of layer l.

- ``hessian="raw"``: F_l accumulated explicitly (D_l × D_l, float64) in one streaming pass, then
  the damped inverse applied to the queries by a Cholesky solve. Memory O(D²) per layer.
- ``hessian="lorif"``: the top-r eigenpairs of F_l by streaming subspace (randomized power)
  iteration — every pass multiplies ``F V = (1/N) Σ_blocks Gᵀ (G V)`` block by block, so memory is
  O(D·r) — then Woodbury: ``(F + λI)⁻¹ ≈ (1/λ)[I − V diag(s/(s+λ)) Vᵀ]`` with s the eigenvalues.
  Exact when r ≥ rank(F) (up to the iteration's convergence).
- ``hessian="ekfac"``: EK-FAC in the projected space. Each layer's Kronecker factors come from the
  stored per-example gradients, ``S = (1/N) Σ Ĝ Ĝᵀ`` (k_out²) and ``A = (1/N) Σ Ĝᵀ Ĝ`` (k_in²); in
  their eigenbases ``U_S, U_A`` a second pass takes the exact second moments of the rotated
  gradients, ``Λ = (1/N) Σ (U_Sᵀ Ĝ U_A)²`` (the eigenvalue correction), so
  ``F ≈ (U_S ⊗ U_A) diag(Λ) (U_S ⊗ U_A)ᵀ``: the part of F that is diagonal in that basis, with the
  same trace. ``(F+λI)⁻¹q = U_S [(U_Sᵀ q U_A) / (Λ + λ)] U_Aᵀ``. Two passes, memory
  O(k_out² + k_in² + D) per layer (k=64 per side: 96 KiB a layer, where raw holds 128 MiB). Exact
  when F is diagonal in a Kronecker basis; otherwise an approximation of ``raw``. It predicts
  retraining best (``benchmarks/lds.py``), though it agrees less with the exact inverse.

- ``hessian="joint"``: one explicit Fisher over every layer's stored coordinates together,
  ``F = (1/N) Σ_i ĝ_i ĝ_iᵀ`` with ``ĝ_i`` the concatenation of the example's layers (D = Σ_l D_l;
  TRAK's estimator, cross-layer blocks included), one λ = ``damping_ratio · tr(F)/D``, applied by
  a Cholesky solve. **The default**, with ``damping_ratio`` 0.01: it finds the training document
  that taught a fact far better than the per-layer Fishers (``benchmarks/fact_tracing.py``: the
  cross-layer blocks whiten away the directions every example shares, early training's above all),
  and agrees with exact damped-Fisher influence better than the per-layer ``raw`` on eigenbasis
  stores (``benchmarks/peers/influence_levers.py``), but it predicts retraining worse than ``raw``
  and far worse than ``ekfac`` (``benchmarks/lds.py``). Memory O(D²) for the whole model, so it is
  explicit up to D = 16384 (2 GiB); ``rank=r`` (taken as 1024 above that width when not given) keeps
  the cross-layer blocks at any width: the top-r eigenpairs of the same whole-model F by ``lorif``'s
  streaming subspace iteration (memory O(D·r)), then Woodbury with the one λ. Exact when r ≥
  rank(F); below, the tail of F's spectrum counts as 0.

Damping ``λ_l`` defaults to ``damping_ratio · tr(F_l)/D_l`` (0.1 per layer: the usual LoGRA choice;
0.01 for ``joint``, measured); a number
passed as ``damping`` is used for every layer. It dominates quality, so the values used are in
``result.info["damping"]``. Only the query side is preconditioned, once, then cached by ``prepare``.

Example::

    result = attribute(store, queries, method="influence")                          # joint Fisher
    result = attribute(store, queries, method="influence", hessian="ekfac")         # EK-FAC
    result = attribute(store, queries, method="influence", hessian="lorif", rank=64)
    result = attribute(store, queries, method="influence", hessian="joint", rank=1024)  # any width
    result.info["damping"]        # {layer: λ_l}
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from ..ops import ROUTES, flat, inner, lowrank_queries
from .base import register_method

__all__ = ["Influence", "ekfac_fisher", "ekfac_apply", "fisher_stats", "joint_fisher", "lowrank_fisher",
           "woodbury_apply"]

log = logging.getLogger(__name__)

_JOINT = "__joint__"
"""The key of the one whole-model factor of ``hessian="joint"``."""


def _flat(g: Any) -> torch.Tensor:
    """``[N, D]`` float64 rows; LoRIF factors are materialized one streamed block at a time."""
    return flat(g).double()


def _joint_rows(block: Any, layers: Sequence[str]) -> torch.Tensor:
    """``[N, Σ D_l]`` float64: each row's layers concatenated in ``layers`` order."""
    return torch.cat([_flat(block.grads[name]) for name in layers], dim=1)


def fisher_stats(store: Any, layers: Sequence[str], *, block_size: int | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, float], int]:
    """One pass: ``({layer: F [D, D]}, {layer: tr(F)}, N)``."""
    fisher: dict[str, torch.Tensor] = {}
    trace = dict.fromkeys(layers, 0.0)
    num = 0
    for block in store.iter_blocks(layers=list(layers), block_size=block_size):
        num += len(block.ids)
        for name in layers:
            g = _flat(block.grads[name])
            trace[name] += float((g * g).sum())
            if name in fisher:
                fisher[name].addmm_(g.T, g)          # in place: no second D×D matrix per block
            else:
                fisher[name] = g.T @ g
    if num == 0:
        raise ValueError("influence needs training rows in the store to estimate the Fisher")
    return {n: f.div_(num) for n, f in fisher.items()}, {n: t / num for n, t in trace.items()}, num


def lowrank_fisher(store: Any, layers: Sequence[str], rank: int, *, oversample: int = 8, iterations: int = 3,
                   block_size: int | None = None, seed: int = 0, joint: bool = False
                   ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float], int]:
    """``({layer: (V [D, r], eigenvalues [r])}, {layer: tr(F)}, N)`` of F by streaming subspace
    iteration (memory O(D·r)).

    ``iterations`` passes over the store after the random start, each orthonormalized; a final
    Rayleigh-Ritz step on the (r+oversample)-dim subspace gives the eigenpairs. The first pass also
    takes tr(F), so the damping needs no pass of its own. With ``joint``, the one whole-model F over
    the layers' rows concatenated in ``layers`` order, under the key ``"__joint__"``.
    """
    shapes = store.layer_shapes
    dims = {n: shapes[n][0] * shapes[n][1] for n in layers}
    if joint:
        dims = {_JOINT: sum(dims.values())}
    gen = torch.Generator().manual_seed(seed)
    basis = {key: torch.linalg.qr(torch.randn(dim, min(dim, rank + oversample), generator=gen,
                                              dtype=torch.float64))[0] for key, dim in dims.items()}

    def rows(block: Any) -> dict[str, torch.Tensor]:
        if joint:
            return {_JOINT: _joint_rows(block, layers)}
        return {name: _flat(block.grads[name]) for name in layers}

    trace = dict.fromkeys(basis, 0.0)

    def apply_fisher(first: bool) -> tuple[dict[str, torch.Tensor], int]:
        out = {n: torch.zeros_like(v) for n, v in basis.items()}
        num = 0
        for block in store.iter_blocks(layers=list(layers), block_size=block_size):
            num += len(block.ids)
            for key, g in rows(block).items():
                out[key] += g.T @ (g @ basis[key])
                if first:
                    trace[key] += float((g * g).sum())
        if num == 0:
            raise ValueError("influence needs training rows in the store to estimate the Fisher")
        return {n: v / num for n, v in out.items()}, num

    for i in range(iterations):
        product, _ = apply_fisher(first=i == 0)
        basis = {n: torch.linalg.qr(p)[0] for n, p in product.items()}
    product, num = apply_fisher(first=iterations == 0)
    out = {}
    for name in basis:
        small = basis[name].T @ product[name]                       # Vᵀ F V, symmetric (r+p)×(r+p)
        evals, evecs = torch.linalg.eigh((small + small.T) / 2)
        order = torch.argsort(evals, descending=True)[: min(rank, len(evals))]
        out[name] = (basis[name] @ evecs[:, order], evals[order].clamp_min(0))
    return out, {n: t / num for n, t in trace.items()}, num


def woodbury_apply(q: torch.Tensor, vecs: torch.Tensor, evals: torch.Tensor, damping: float) -> torch.Tensor:
    """``(V diag(s) Vᵀ + λI)⁻¹ q`` for rows of ``q`` [Q, D]: ``(1/λ)[q − ((qV) ∘ s/(s+λ)) Vᵀ]``."""
    coeff = (q @ vecs) * (evals / (evals + damping))
    return (q - coeff @ vecs.T) / damping


def ekfac_fisher(store: Any, layers: Sequence[str], *, block_size: int | None = None
                 ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict[str, float], int]:
    """Two passes: ``({layer: (U_S [Ko, Ko], U_A [Ki, Ki], Λ [Ko, Ki])}, {layer: tr(F)}, N)``.

    Pass one accumulates the Kronecker factors ``Σ Ĝ Ĝᵀ`` and ``Σ Ĝᵀ Ĝ`` (and tr F); pass two the
    eigenvalue correction ``Σ (U_Sᵀ Ĝ U_A)²`` in their eigenbases. float64 throughout.
    """
    shapes = store.layer_shapes
    out_f = {n: torch.zeros(shapes[n][0], shapes[n][0], dtype=torch.float64) for n in layers}
    in_f = {n: torch.zeros(shapes[n][1], shapes[n][1], dtype=torch.float64) for n in layers}
    num = 0
    for block in store.iter_blocks(layers=list(layers), block_size=block_size):
        num += len(block.ids)
        for name in layers:
            k_out, k_in = shapes[name]
            g = _flat(block.grads[name]).reshape(-1, k_out, k_in)
            by_out = g.transpose(0, 1).reshape(k_out, -1)              # Σ_i Ĝ_i Ĝ_iᵀ as one GEMM
            by_in = g.reshape(-1, k_in)                                # Σ_i Ĝ_iᵀ Ĝ_i as one GEMM
            out_f[name] += by_out @ by_out.T
            in_f[name] += by_in.T @ by_in
    if num == 0:
        raise ValueError("influence needs training rows in the store to estimate the Fisher")
    # contiguous, so a fit read back from the cache multiplies in the same layout (the same bits)
    bases = {n: (torch.linalg.eigh(out_f[n] / num)[1].contiguous(), torch.linalg.eigh(in_f[n] / num)[1].contiguous())
             for n in layers}
    moments = {n: torch.zeros(*shapes[n], dtype=torch.float64) for n in layers}
    for block in store.iter_blocks(layers=list(layers), block_size=block_size):
        for name in layers:
            u_out, u_in = bases[name]
            rotated = u_out.T @ _flat(block.grads[name]).reshape(-1, *shapes[name]) @ u_in
            moments[name] += (rotated * rotated).sum(dim=0)
    fitted = {n: (*bases[n], moments[n] / num) for n in layers}
    return fitted, {n: float(fitted[n][2].sum()) for n in layers}, num


def ekfac_apply(q: torch.Tensor, u_out: torch.Tensor, u_in: torch.Tensor, evals: torch.Tensor,
                damping: float) -> torch.Tensor:
    """``(F_ekfac + λI)⁻¹ q`` for ``q`` [Q, Ko, Ki]: ``U_S [(U_Sᵀ q U_A) / (Λ + λ)] U_Aᵀ``."""
    return u_out @ ((u_out.T @ q @ u_in) / (evals + damping)) @ u_in.T


HESSIANS = ("raw", "lorif", "ekfac", "joint")
JOINT_AUTO_RANK = 1024
"""The rank the default ``hessian="joint"`` takes above :data:`JOINT_MAX_DIM` when none is given."""
JOINT_DAMPING_RATIO = 0.01
"""The default ``damping_ratio`` of ``hessian="joint"``: λ = 0.01·tr(F)/D found the source of a fact best
in ``benchmarks/fact_tracing.py`` (0.1, the per-layer default, ranked it lower)."""
JOINT_MAX_DIM = 16384
"""The widest store explicit ``hessian="joint"`` accepts: its D×D float64 Fisher is 2 GiB there
(``rank=r`` lifts the limit)."""


def joint_fisher(store: Any, layers: Sequence[str], *, block_size: int | None = None
                 ) -> tuple[torch.Tensor, float, int]:
    """One pass: ``(F [D, D], tr(F), N)`` over the rows' layers concatenated in ``layers`` order."""
    fisher, num = None, 0
    for block in store.iter_blocks(layers=list(layers), block_size=block_size):
        num += len(block.ids)
        g = _joint_rows(block, layers)
        fisher = g.T @ g if fisher is None else fisher.addmm_(g.T, g)
    if num == 0:
        raise ValueError("influence needs training rows in the store to estimate the Fisher")
    fisher.div_(num)
    return fisher, float(torch.trace(fisher)), num


def _double(g: Any) -> Any:
    return g.to(torch.float64)


@register_method
class Influence:
    """Damped Fisher-inverse influence; see the module docstring. ``fit(store, layers)`` runs first.
    The default is ``joint`` with λ = 0.01·tr(F)/D (one D×D matrix over all layers; above
    :data:`JOINT_MAX_DIM` its top :data:`JOINT_AUTO_RANK` eigenpairs): it finds the document that
    taught a fact best (``benchmarks/fact_tracing.py``). ``ekfac`` (two Kronecker eigenbases and a
    k_out×k_in eigenvalue matrix a layer) has the best linear datamodeling score at every damping in
    ``benchmarks/lds.py``: the choice for predicting retraining. ``lorif`` holds O(D·r), ``raw`` a D×D
    matrix per layer (k=64: 128 MiB each)."""

    name = "influence"

    def __init__(self, *, hessian: str = "joint", damping: float | None = None, damping_ratio: float | None = None,
                 rank: int | None = None, oversample: int = 8, iterations: int = 3, seed: int = 0,
                 route: str = "auto", query_rank: int = 0):
        if hessian not in HESSIANS:
            raise ValueError(f"influence: hessian must be 'raw', 'lorif', 'ekfac' or 'joint', got {hessian!r}")
        if damping is not None and not 0 < damping < float("inf"):
            raise ValueError(f"influence: damping must be finite and > 0, got {damping!r}")
        if damping_ratio is None:
            damping_ratio = JOINT_DAMPING_RATIO if hessian == "joint" else 0.1
        if not 0 < damping_ratio < float("inf"):
            raise ValueError(f"influence: damping_ratio must be finite and > 0, got {damping_ratio!r}")
        if rank is not None and hessian not in ("lorif", "joint"):
            raise ValueError(f"influence: rank is the rank of hessian='lorif' or 'joint', not of hessian={hessian!r}")
        if rank is not None and rank < 1:
            raise ValueError(f"influence: rank must be >= 1, got {rank}")
        if oversample < 0:
            raise ValueError(f"influence: oversample must be >= 0 (extra subspace columns), got {oversample}")
        if iterations < 1:
            raise ValueError(f"influence: iterations must be >= 1 (passes of subspace iteration), got {iterations}")
        self.joint_rank = rank if hessian == "joint" else None
        """``hessian="joint"``: None = the explicit Fisher; r = its top-r eigenpairs (Woodbury)."""
        rank = 64 if rank is None else rank
        if route not in ROUTES:
            raise ValueError(f"influence: route must be one of {ROUTES}, got {route!r}")
        if query_rank < 0:
            raise ValueError(f"influence: query_rank must be >= 0 (0 = exact queries), got {query_rank}")
        self.route, self.query_rank = route, query_rank
        self.hessian, self.damping, self.damping_ratio = hessian, damping, damping_ratio
        self.rank, self.oversample, self.iterations, self.seed = rank, oversample, iterations, seed
        self.info: dict[str, Any] = {}
        self._fitted: dict[str, Any] | None = None

    def fit(self, store: Any, layers: Sequence[str], *, block_size: int | None = None) -> None:
        """Estimate each layer's Fisher (explicit or low-rank) and its damping from the store.

        The result is cached beside the store (``<store>/cache/influence-<key>.safetensors``, keyed by
        the store's shards and these options), so the next question skips the passes over the store.
        """
        if self.hessian == "joint" and self.joint_rank is None:
            shapes = store.layer_shapes
            dim = sum(shapes[n][0] * shapes[n][1] for n in layers)
            if dim > JOINT_MAX_DIM:          # explicit would need dim² floats: its top eigenpairs instead
                log.warning("influence: the joint Fisher over %d layers is %d wide, above the explicit limit %d: "
                            "using its top-%d eigenpairs (pass rank= / --rank to choose)", len(layers), dim,
                            JOINT_MAX_DIM, JOINT_AUTO_RANK)
                self.joint_rank = JOINT_AUTO_RANK
        cache = self._cache_file(store, layers)
        if cache is not None and cache.exists() and self._load(cache, layers):
            return
        self._fit(store, layers, block_size)
        if cache is not None:
            self._save(cache, layers)

    def _cache_file(self, store: Any, layers: Sequence[str]):
        import hashlib
        import json
        from pathlib import Path

        root, shards = getattr(store, "path", None), getattr(store, "shards", None)
        if root is None or shards is None:
            return None
        options = json.dumps({"layers": list(layers), "hessian": self.hessian, "damping": self.damping,
                              "ratio": self.damping_ratio, "rank": self.rank, "oversample": self.oversample,
                              "iterations": self.iterations, "seed": self.seed, "joint_rank": self.joint_rank,
                              "format": 3}, sort_keys=True)
        meta = getattr(store, "meta", {})
        state = json.dumps([meta.get("store_id"), meta.get("projector_hash"),
                            sorted((s.rank, s.seq, s.num_rows, s.bytes) for s in shards)])
        # influence-<options>-<store state>: a newer state of the store replaces the file of an older one
        return Path(root) / "cache" / (f"influence-{hashlib.sha256(options.encode()).hexdigest()[:16]}-"
                                       f"{hashlib.sha256(state.encode()).hexdigest()[:16]}.safetensors")

    @property
    def _explicit(self) -> bool:
        """The fitted factor is a Cholesky factor of an explicit damped Fisher (else eigenpairs)."""
        return self.hessian == "raw" or (self.hessian == "joint" and self.joint_rank is None)

    def _factor_names(self, layers: Sequence[str]) -> list[str]:
        """The keys of the fitted factors: one per layer, or the one joint factor."""
        return [_JOINT] if self.hessian == "joint" else list(layers)

    def _save(self, path, layers: Sequence[str]) -> None:
        import json
        import os
        import threading

        from safetensors.torch import save_file

        tensors = {}
        for i, name in enumerate(self._factor_names(layers)):
            factor = self._fitted["factors"][name]
            if self._explicit:
                tensors[f"{i}.chol"] = factor.contiguous()
            elif self.hessian == "ekfac":
                tensors[f"{i}.u_out"], tensors[f"{i}.u_in"], tensors[f"{i}.evals"] = (t.contiguous() for t in factor)
            else:
                tensors[f"{i}.vecs"], tensors[f"{i}.evals"] = factor[0].contiguous(), factor[1].contiguous()
        meta = {"info": json.dumps(self.info), "layers": json.dumps(list(layers))}
        try:
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")   # racing fits
            try:
                save_file(tensors, str(tmp), metadata=meta)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            # the same options fitted on an older state of the store (it grew, or was truncated):
            # never read again, and up to GiBs each (a D×D float64 factor per layer)
            options = path.name.rsplit("-", 1)[0]
            for old in path.parent.glob("influence-*.safetensors"):
                # older states of these options, and files named before options and state were split
                # (influence-<16 hex>.safetensors, whose options cannot be told: recomputed if needed)
                if old != path and (old.name.startswith(options + "-") or old.name.count("-") == 1):
                    old.unlink(missing_ok=True)
        except OSError as e:          # a read-only store: answer without caching
            log.info("influence: not caching the fitted Fisher in %s (%s)", path.parent, e)

    def _load(self, path, layers: Sequence[str]) -> bool:
        import json

        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata()
                if json.loads(meta["layers"]) != list(layers):
                    return False
                factors = {}
                keys = ["chol"] if self._explicit else ["u_out", "u_in", "evals"] if self.hessian == "ekfac" \
                    else ["vecs", "evals"]
                for i, name in enumerate(self._factor_names(layers)):
                    parts = [f.get_tensor(f"{i}.{key}") for key in keys]
                    factors[name] = parts[0] if self._explicit else tuple(parts)
                info = json.loads(meta["info"])
        except Exception as e:   # noqa: BLE001 - a damaged cache is recomputed, never trusted
            log.warning("influence: ignoring unreadable cache %s (%s)", path, e)
            return False
        self._fitted = {"factors": factors, "damping": info["damping"], "layers": list(layers),
                        "dead": info.get("dead_layers", [])}
        self.info = {**info, "cached": True}
        return True

    def _fit(self, store: Any, layers: Sequence[str], block_size: int | None) -> None:
        if self.hessian == "joint":
            return self._fit_joint(store, layers, block_size)
        if self.hessian == "ekfac":
            fisher, trace, num = ekfac_fisher(store, layers, block_size=block_size)
        elif self.hessian == "raw":
            fisher, trace, num = fisher_stats(store, layers, block_size=block_size)
        else:
            fisher, trace, num = lowrank_fisher(store, layers, self.rank, oversample=self.oversample,
                                                iterations=self.iterations, block_size=block_size, seed=self.seed)
        shapes = store.layer_shapes
        # a layer whose every stored row is zero adds exactly 0 to every score, whatever its curvature:
        # it is left out (warned), not allowed to refuse the question (its relative λ would be 0)
        dead = [n for n in layers if not trace[n] > 0]
        if len(dead) == len(layers):
            raise ValueError(f"influence: every scored layer has zero gradients in the store ({len(layers)} "
                             "layers): there is nothing to attribute with")
        if dead:
            log.warning("influence: %d layer(s) have zero gradients in every stored row and add nothing to any "
                        "score; they are left out: %s", len(dead), dead)
        damping = {n: (self.damping if self.damping is not None
                       else self.damping_ratio * trace[n] / (shapes[n][0] * shapes[n][1]) if n not in dead
                       else 1.0) for n in layers}   # a left-out layer's λ is never used (info drops it)
        dims = {n: shapes[n][0] * shapes[n][1] for n in layers}
        _warn_tiny_damping(damping, {n: trace[n] / dims[n] for n in layers if num < dims[n]})
        if self.hessian == "raw":
            factors = {}
            for n in layers:             # F + λI in place, then its Cholesky factor; F is freed layer by layer
                f = fisher.pop(n)
                f.diagonal().add_(damping[n])
                factors[n] = _cholesky_in_place(f, n)
        else:                        # ekfac and lorif: the factors are what was fitted
            factors = fisher
        self._fitted = {"factors": factors, "damping": damping, "layers": list(layers), "dead": dead}
        self.info = {"hessian": self.hessian, "damping": {n: d for n, d in damping.items() if n not in dead},
                     "num_rows": num, **({"rank": self.rank} if self.hessian == "lorif" else {}),
                     **({"dead_layers": dead} if dead else {})}

    def _fit_joint(self, store: Any, layers: Sequence[str], block_size: int | None) -> None:
        shapes = store.layer_shapes
        dim = sum(shapes[n][0] * shapes[n][1] for n in layers)      # (too wide for explicit: fit() took a rank)
        if self._explicit:
            fisher, trace, num = joint_fisher(store, layers, block_size=block_size)
        else:
            factors, traces, num = lowrank_fisher(store, layers, self.joint_rank, oversample=self.oversample,
                                                  iterations=self.iterations, block_size=block_size, seed=self.seed,
                                                  joint=True)
            factor, trace = factors[_JOINT], traces[_JOINT]
        if not trace > 0:
            raise ValueError(f"influence: every scored layer has zero gradients in the store ({len(layers)} "
                             "layers): there is nothing to attribute with")
        lam = self.damping if self.damping is not None else self.damping_ratio * trace / dim
        if num < dim:
            _warn_tiny_damping({"all layers (joint)": lam}, {"all layers (joint)": trace / dim})
        if self._explicit:
            fisher.diagonal().add_(lam)                    # in place: no second D×D matrix
            factor = _cholesky_in_place(fisher, "all layers (joint)")
        damping = dict.fromkeys(layers, lam)          # one λ, reported per layer like the other modes
        self._fitted = {"factors": {_JOINT: factor}, "damping": damping, "layers": list(layers), "dead": []}
        self.info = {"hessian": "joint", "damping": damping, "num_rows": num,
                     **({"rank": self.joint_rank} if self.joint_rank is not None else {})}

    def prepare(self, queries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._fitted is None:
            raise RuntimeError("influence: fit(store, layers) must run before prepare (attribute() does it)")
        out = (self._precondition_joint if self.hessian == "joint" else self._precondition_layers)(queries)
        if self.query_rank:
            self.info = {**self.info, "query_rank": self.query_rank}
        return lowrank_queries(out, self.query_rank)

    def _precondition_layers(self, queries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, q in queries.items():
            if name in self._fitted["dead"]:
                continue                 # zero in every training row: its term of every score is 0
            flat = _flat(q)
            damping, factor = self._fitted["damping"][name], self._fitted["factors"][name]
            if self.hessian == "raw":
                pre = torch.cholesky_solve(flat.T, factor).T
            elif self.hessian == "ekfac":
                pre = ekfac_apply(flat.reshape(q.shape), *factor, damping)
            else:
                pre = woodbury_apply(flat, *factor, damping)
            out[name] = pre.reshape(q.shape)
        return out

    def _precondition_joint(self, queries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        layers = self._fitted["layers"]
        if set(queries) != set(layers):
            raise ValueError(f"influence: hessian='joint' was fitted on layers {layers}; the queries have "
                             f"{sorted(queries)}")
        flats = [_flat(queries[name]) for name in layers]
        flat, factor = torch.cat(flats, dim=1), self._fitted["factors"][_JOINT]
        if self._explicit:
            pre = torch.cholesky_solve(flat.T, factor).T
        else:
            pre = woodbury_apply(flat, *factor, self._fitted["damping"][layers[0]])
        out, lo = {}, 0
        for name, f in zip(layers, flats):
            out[name] = pre[:, lo:lo + f.shape[1]].reshape(queries[name].shape)
            lo += f.shape[1]
        return out

    def score_block(self, state: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> torch.Tensor:
        total = None
        for name, pre in state.items():
            s = inner(pre, _double(grads[name]), self.route)
            total = s if total is None else total + s
        return total


def _cholesky_in_place(matrix: torch.Tensor, what: str) -> torch.Tensor:
    """The lower Cholesky factor of the damped Fisher ``matrix``, written over it (its memory is the
    factor's: fitting holds one D×D matrix, not two)."""
    # LAPACK works on column-major memory: a row-major ``out`` costs a D×D copy, the transposed view
    # none. ``matrix`` is symmetric, so that view holds F too; its upper factor Lᵀ is our L row-major
    info, column_major = torch.empty((), dtype=torch.int32), matrix.mT
    upper, info = torch.linalg.cholesky_ex(column_major, upper=True, out=(column_major, info))
    factor = upper.mT
    if int(info) != 0:
        raise torch.linalg.LinAlgError(f"influence: the damped Fisher of {what} is not positive definite (minor "
                                       f"{int(info)} failed): raise the damping")
    return factor


TINY_DAMPING = 1e-10
"""Below this fraction of a Fisher's mean eigenvalue, a float64 solve of F + λI with fewer rows than
dimensions (F singular) loses most of its digits: the error grows like λ_max / λ · 1e-16."""


def _warn_tiny_damping(damping: dict[str, float], mean_eig: dict[str, float]) -> None:
    """Warn about the layers of ``mean_eig`` (those with fewer rows than dimensions) damped below
    :data:`TINY_DAMPING` of their mean eigenvalue."""
    tiny = {n: damping[n] / e for n, e in mean_eig.items() if e > 0 and damping[n] < TINY_DAMPING * e}
    if tiny:
        worst = min(tiny, key=tiny.get)
        log.warning("influence: damping is %.1e of the mean Fisher eigenvalue at %s (%d layer(s) below %.0e): "
                    "F + λI is then nearly singular and float64 solves lose most digits. Use damping_ratio "
                    "(relative, default 0.1) or a larger damping", tiny[worst], worst, len(tiny), TINY_DAMPING)
