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

from ..config import ConfigError
from ..ops import ROUTES, inner, lowrank_queries
from .base import AttributionError, register_method
from .curvature import CURVATURES, DEFAULT_RANK, Curvature, CurvatureOptions, layer_dims
from .curvature import JOINT_DAMPING_RATIO as JOINT_DAMPING_RATIO  # re-exported: joint's default lives there
from .curvature import ekfac_apply, ekfac_fisher, fisher_stats, joint_fisher, lowrank_fisher, woodbury_apply

__all__ = ["Influence", "ekfac_fisher", "ekfac_apply", "fisher_stats", "joint_fisher", "lowrank_fisher",
           "woodbury_apply"]

log = logging.getLogger(__name__)

HESSIANS = tuple(CURVATURES)
"""The ``hessian=`` names: ``("raw", "lorif", "ekfac", "joint")``, each a class in :mod:`.curvature`."""
# The explicit-width limit is the influence method's policy, read here at fit time (so setting these
# module attributes still takes effect); each curvature only answers ``sized(max_dim=, auto_rank=)``.
JOINT_AUTO_RANK = 1024
"""The rank the default ``hessian="joint"`` takes above :data:`JOINT_MAX_DIM` when none is given."""
JOINT_MAX_DIM = 16384
"""The widest store explicit ``hessian="joint"`` accepts: its D×D float64 Fisher is 2 GiB there
(``rank=r`` lifts the limit)."""


def _either(names: Sequence[str]) -> str:
    """``'a', 'b' or 'c'``."""
    quoted = [repr(n) for n in names]
    return ", ".join(quoted[:-1]) + f" or {quoted[-1]}" if len(quoted) > 1 else quoted[0]


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
    matrix per layer (k=64: 128 MiB each). Each is a :class:`~olmo_tda.methods.curvature.Curvature`
    looked up by name once, here; this class owns the damping, the left-out layers and the cache."""

    name = "influence"

    def __init__(self, *, hessian: str = "joint", damping: float | None = None, damping_ratio: float | None = None,
                 rank: int | None = None, oversample: int = 8, iterations: int = 3, seed: int = 0,
                 route: str = "auto", query_rank: int = 0):
        if hessian not in CURVATURES:
            raise ConfigError(f"influence: hessian must be {_either(HESSIANS)}, got {hessian!r}")
        kind = CURVATURES[hessian]
        if damping is not None and not 0 < damping < float("inf"):
            raise ConfigError(f"influence: damping must be finite and > 0, got {damping!r}")
        if damping_ratio is None:
            damping_ratio = kind.damping_ratio
        if not 0 < damping_ratio < float("inf"):
            raise ConfigError(f"influence: damping_ratio must be finite and > 0, got {damping_ratio!r}")
        if rank is not None and not kind.takes_rank:
            ranked = [n for n, c in CURVATURES.items() if c.takes_rank]
            raise ConfigError(f"influence: rank is the rank of hessian={_either(ranked)}, not of hessian={hessian!r}")
        if rank is not None and rank < 1:
            raise ConfigError(f"influence: rank must be >= 1, got {rank}")
        if oversample < 0:
            raise ConfigError(f"influence: oversample must be >= 0 (extra subspace columns), got {oversample}")
        if iterations < 1:
            raise ConfigError(f"influence: iterations must be >= 1 (passes of subspace iteration), got {iterations}")
        if route not in ROUTES:
            raise ConfigError(f"influence: route must be one of {ROUTES}, got {route!r}")
        if query_rank < 0:
            raise ConfigError(f"influence: query_rank must be >= 0 (0 = exact queries), got {query_rank}")
        self._curvature: Curvature = kind.build(CurvatureOptions(rank=rank, oversample=oversample,
                                                                 iterations=iterations, seed=seed))
        rank = DEFAULT_RANK if rank is None else rank
        self.route, self.query_rank = route, query_rank
        self.hessian, self.damping, self.damping_ratio = hessian, damping, damping_ratio
        self.rank, self.oversample, self.iterations, self.seed = rank, oversample, iterations, seed
        self.info: dict[str, Any] = {}
        self._fitted: dict[str, Any] | None = None

    @property
    def joint_rank(self) -> int | None:
        """``hessian="joint"``: None = the explicit Fisher; r = its top-r eigenpairs (Woodbury)."""
        return self._curvature.joint_rank

    def fit(self, store: Any, layers: Sequence[str], *, block_size: int | None = None) -> None:
        """Estimate each layer's Fisher (explicit or low-rank) and its damping from the store.

        The result is cached beside the store (``<store>/cache/influence-<key>.safetensors``, keyed by
        the store's shards and these options), so the next question skips the passes over the store.
        """
        sized = self._curvature.sized(store, layers, max_dim=JOINT_MAX_DIM, auto_rank=JOINT_AUTO_RANK)
        if sized is not self._curvature:     # explicit would need dim² floats: its top eigenpairs instead
            log.warning("influence: the %s Fisher over %d layers is %d wide, above the explicit limit %d: "
                        "using its top-%d eigenpairs (pass rank= / --rank to choose)", self.hessian, len(layers),
                        sum(layer_dims(store.layer_shapes, layers).values()), JOINT_MAX_DIM, sized.rank)
            self._curvature = sized
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


    def _save(self, path, layers: Sequence[str]) -> None:
        import json
        import os
        import threading

        from safetensors.torch import save_file

        tensors = {}
        for i, group in enumerate(self._curvature.groups(layers)):
            factor = self._fitted["factors"][group]
            parts = factor if isinstance(factor, tuple) else (factor,)
            tensors.update({f"{i}.{key}": t.contiguous()
                            for key, t in zip(self._curvature.tensor_names, parts, strict=True)})
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
                for i, group in enumerate(self._curvature.groups(layers)):
                    parts = tuple(f.get_tensor(f"{i}.{key}") for key in self._curvature.tensor_names)
                    factors[group] = parts if len(parts) > 1 else parts[0]
                info = json.loads(meta["info"])
        except Exception as e:   # noqa: BLE001 - a damaged cache is recomputed, never trusted
            log.warning("influence: ignoring unreadable cache %s (%s)", path, e)
            return False
        self._fitted = {"factors": factors, "damping": info["damping"], "layers": list(layers),
                        "dead": info.get("dead_layers", [])}
        self.info = {**info, "cached": True}
        return True

    def _fit(self, store: Any, layers: Sequence[str], block_size: int | None) -> None:
        curvature = self._curvature
        groups = curvature.groups(layers)
        factors, trace, num = curvature.estimate(store, layers, block_size=block_size)
        damping, dead = self._damping(layers, groups, trace, num, layer_dims(store.layer_shapes, layers))
        factors = curvature.finalize(factors, damping)
        by_layer = {n: damping[g] for g, members in groups.items() for n in members}
        self._fitted = {"factors": factors, "damping": by_layer, "layers": list(layers), "dead": dead}
        self.info = {"hessian": self.hessian,
                     "damping": {n: damping[g] for g, members in groups.items() if g not in dead for n in members},
                     "num_rows": num, **({"rank": curvature.rank} if curvature.rank is not None else {}),
                     **({"dead_layers": dead} if dead else {})}

    def _damping(self, layers: Sequence[str], groups: dict[str, list[str]], trace: dict[str, float], num: int,
                 dims: dict[str, int]) -> tuple[dict[str, float], list[str]]:
        """``({group: λ}, [left-out group])`` from each group's ``tr(F)`` over ``num`` rows."""
        # a layer whose every stored row is zero adds exactly 0 to every score, whatever its curvature:
        # it is left out (warned), not allowed to refuse the question (its relative λ would be 0)
        dead = [g for g in groups if not trace[g] > 0]
        if len(dead) == len(groups):
            raise AttributionError(f"influence: every scored layer has zero gradients in the store ({len(layers)} "
                                   "layers): there is nothing to attribute with")
        if dead:
            log.warning("influence: %d layer(s) have zero gradients in every stored row and add nothing to any "
                        "score; they are left out: %s", len(dead), dead)
        width = {g: sum(dims[n] for n in members) for g, members in groups.items()}
        damping = {g: (self.damping if self.damping is not None
                       else self.damping_ratio * trace[g] / width[g] if g not in dead
                       else 1.0) for g in groups}   # a left-out group's λ is never used (info drops it)
        label = self._curvature.label
        _warn_tiny_damping({label(g): d for g, d in damping.items()},
                           {label(g): trace[g] / width[g] for g in groups if num < width[g]})
        return damping, dead

    def prepare(self, queries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._fitted is None:
            raise RuntimeError("influence: fit(store, layers) must run before prepare (attribute() does it)")
        out = self._curvature.precondition(queries, self._fitted)
        if self.query_rank:
            self.info = {**self.info, "query_rank": self.query_rank}
        return lowrank_queries(out, self.query_rank)

    def score_block(self, state: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> torch.Tensor:
        total = None
        for name, pre in state.items():
            s = inner(pre, _double(grads[name]), self.route)
            total = s if total is None else total + s
        return total


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
