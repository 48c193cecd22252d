"""The curvatures of influence: how a damped projected Fisher is estimated, stored and applied.

One small protocol, :class:`Curvature`, one class per ``hessian=`` name, registered by name in
:data:`CURVATURES` (the math of each is in :mod:`olmo_tda.methods.influence`'s docstring):

- ``raw`` (:class:`RawFisher`): each layer's explicit F_l, applied by a Cholesky solve.
- ``lorif`` (:class:`LowRankFisher`): each layer's top-r eigenpairs, applied by Woodbury.
- ``ekfac`` (:class:`EkfacFisher`): each layer's Kronecker eigenbases and eigenvalue correction.
- ``joint`` (:class:`JointFisher`): one explicit F over every layer together; with ``rank=r``
  (or too wide to hold), :class:`LowRankJointFisher`, its top-r eigenpairs.

A curvature's factors are keyed by *group*: one group per layer, or one for the whole model. The
influence method owns what every curvature shares (the damping, the layers left out, the cache):
it calls ``estimate`` (the passes over the store), damps each group, ``finalize``s, and later
``precondition``s the queries. Every estimator accumulates in float64.

Example::

    curvature = CURVATURES["ekfac"].build(CurvatureOptions())
    factors, trace, num = curvature.estimate(store, layers, block_size=None)
    fitted = {"factors": curvature.finalize(factors, {n: 0.1 for n in layers}),
              "damping": {n: 0.1 for n in layers}, "layers": layers, "dead": []}
    preconditioned = curvature.precondition(queries, fitted)      # {layer: (F + λI)⁻¹ q}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import torch

from ..ops import flat
from .base import AttributionError

__all__ = ["CURVATURES", "Curvature", "CurvatureOptions", "EkfacFisher", "JointFisher", "LowRankFisher",
           "LowRankJointFisher", "RawFisher", "ekfac_apply", "ekfac_fisher", "fisher_stats", "joint_fisher",
           "layer_dims", "lowrank_fisher", "woodbury_apply"]

_JOINT = "__joint__"
"""The key of the one whole-model factor of ``hessian="joint"``."""
DEFAULT_RANK = 64
"""The rank of ``hessian="lorif"`` when none is given."""
JOINT_DAMPING_RATIO = 0.01
"""The default ``damping_ratio`` of ``hessian="joint"``: λ = 0.01·tr(F)/D found the source of a fact best
in ``benchmarks/fact_tracing.py`` (0.1, the per-layer default, ranked it lower)."""
_NO_ROWS = "influence needs training rows in the store to estimate the Fisher"


def _flat(g: Any) -> torch.Tensor:
    """``[N, D]`` float64 rows; LoRIF factors are materialized one streamed block at a time."""
    return flat(g).double()


def _joint_rows(block: Any, layers: Sequence[str]) -> torch.Tensor:
    """``[N, Σ D_l]`` float64: each row's layers concatenated in ``layers`` order."""
    return torch.cat([_flat(block.grads[name]) for name in layers], dim=1)


def layer_dims(shapes: dict[str, tuple[int, int]], layers: Sequence[str]) -> dict[str, int]:
    """``{layer: D_l = k_out·k_in}``, the flattened width of each layer."""
    return {n: shapes[n][0] * shapes[n][1] for n in layers}


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
        raise AttributionError(_NO_ROWS)
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
    dims = layer_dims(store.layer_shapes, layers)
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
            raise AttributionError(_NO_ROWS)
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
        raise AttributionError(_NO_ROWS)
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


def joint_fisher(store: Any, layers: Sequence[str], *, block_size: int | None = None
                 ) -> tuple[torch.Tensor, float, int]:
    """One pass: ``(F [D, D], tr(F), N)`` over the rows' layers concatenated in ``layers`` order."""
    fisher, num = None, 0
    for block in store.iter_blocks(layers=list(layers), block_size=block_size):
        num += len(block.ids)
        g = _joint_rows(block, layers)
        fisher = g.T @ g if fisher is None else fisher.addmm_(g.T, g)
    if num == 0:
        raise AttributionError(_NO_ROWS)
    fisher.div_(num)
    return fisher, float(torch.trace(fisher)), num


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


# ---------------------------------------------------------------------------------------------- protocol


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurvatureOptions:
    """What a curvature is built from (the influence method's options; each uses those it needs)."""

    rank: int | None = None
    """The rank asked for: None is the curvature's own choice (64 for ``lorif``, explicit ``joint``)."""
    oversample: int = 8
    """Extra columns of the subspace iteration of the low-rank curvatures."""
    iterations: int = 3
    """Passes of the subspace iteration of the low-rank curvatures."""
    seed: int = 0
    """The seed of the subspace iteration's random start."""


Factors = dict[str, Any]
"""``{group: factor}``: a tensor (a Cholesky factor) or a tuple of tensors (eigenpairs, EK-FAC)."""


class Curvature(Protocol):
    """A damped Fisher the influence method fits from a store and applies to queries.

    ``fitted``, as ``precondition`` reads it: ``{"factors": Factors, "damping": {layer: λ},
    "layers": [...], "dead": [group, ...]}``."""

    name: str
    """The ``hessian=`` name it is registered under."""
    rank: int | None
    """The rank of its eigenpairs (``info["rank"]``); None for an explicit or Kronecker Fisher."""
    joint_rank: int | None
    """A field of the cache key: the rank of a whole-model low-rank fit, else None."""
    tensor_names: tuple[str, ...]
    """The tensors of one factor, in the cache file's order (``{i}.{name}``)."""

    def sized(self, store: Any, layers: Sequence[str], *, max_dim: int, auto_rank: int) -> Curvature:
        """The curvature to fit: itself, or where its explicit matrix would be wider than ``max_dim``,
        its top-``auto_rank`` eigenpairs."""

    def groups(self, layers: Sequence[str]) -> dict[str, list[str]]:
        """``{group: its layers}``: one factor per group, in the cache file's order."""

    def label(self, group: str) -> str:
        """A group as messages name it."""

    def estimate(self, store: Any, layers: Sequence[str], *, block_size: int | None
                 ) -> tuple[Factors, dict[str, float], int]:
        """The passes over the store: ``(undamped factors, {group: tr(F)}, N)``."""

    def finalize(self, factors: Factors, damping: dict[str, float]) -> Factors:
        """The factors to apply, given ``{group: λ}`` (may reuse, and consume, ``factors``)."""

    def precondition(self, queries: dict[str, torch.Tensor], fitted: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``{layer: (F + λI)⁻¹ q}`` float64, the shapes of ``queries``; left-out layers dropped."""


class _Curvature:
    """What most curvatures share: their options and no change of form for a wide store."""

    name = ""
    takes_rank = False
    """Whether ``rank=`` is one of its options."""
    damping_ratio = 0.1
    """Its default λ / (tr(F)/D)."""
    whole_model = False
    """One factor over every layer together (else one per layer)."""
    rank: int | None = None

    def __init__(self, options: CurvatureOptions):
        self.options = options

    @property
    def joint_rank(self) -> int | None:
        return self.rank if self.whole_model else None

    @classmethod
    def build(cls, options: CurvatureOptions) -> Curvature:
        return cls(options)

    def sized(self, store: Any, layers: Sequence[str], *, max_dim: int, auto_rank: int) -> Curvature:
        return self

    def label(self, group: str) -> str:
        return group

    def finalize(self, factors: Factors, damping: dict[str, float]) -> Factors:
        return factors                                  # what was fitted is what is applied

    def apply(self, rows: torch.Tensor, shape: torch.Size, factor: Any, damping: float) -> torch.Tensor:
        """``(F + λI)⁻¹`` of one group applied to ``rows`` [Q, D] (``shape``: the group's queries')."""
        raise NotImplementedError


class _PerLayer(_Curvature):
    """One factor per layer; a left-out layer's queries are dropped (0 in every score)."""

    def groups(self, layers: Sequence[str]) -> dict[str, list[str]]:
        return {n: [n] for n in layers}

    def precondition(self, queries: dict[str, torch.Tensor], fitted: dict[str, Any]) -> dict[str, torch.Tensor]:
        out = {}
        for name, q in queries.items():
            if name in fitted["dead"]:
                continue                 # zero in every training row: its term of every score is 0
            rows = _flat(q)
            damping, factor = fitted["damping"][name], fitted["factors"][name]
            out[name] = self.apply(rows, q.shape, factor, damping).reshape(q.shape)
        return out


class _Joint(_Curvature):
    """One factor over every layer's coordinates concatenated in the fitted layers' order."""

    damping_ratio = JOINT_DAMPING_RATIO
    whole_model = True

    def groups(self, layers: Sequence[str]) -> dict[str, list[str]]:
        return {_JOINT: list(layers)}

    def label(self, group: str) -> str:
        return "all layers (joint)"

    def precondition(self, queries: dict[str, torch.Tensor], fitted: dict[str, Any]) -> dict[str, torch.Tensor]:
        layers = fitted["layers"]
        if set(queries) != set(layers):
            raise AttributionError(f"influence: hessian={self.name!r} was fitted on layers {layers}; the queries have "
                                   f"{sorted(queries)}")
        flats = [_flat(queries[name]) for name in layers]
        rows = torch.cat(flats, dim=1)
        pre = self.apply(rows, rows.shape, fitted["factors"][_JOINT], fitted["damping"][layers[0]])
        out, lo = {}, 0
        for name, f in zip(layers, flats):
            out[name] = pre[:, lo:lo + f.shape[1]].reshape(queries[name].shape)
            lo += f.shape[1]
        return out


class _Cholesky:
    """Factors: the lower Cholesky factor of the explicit F + λI, written over F."""

    tensor_names = ("chol",)

    def finalize(self, factors: Factors, damping: dict[str, float]) -> Factors:
        out = {}
        for key in list(factors):      # F + λI in place, then its Cholesky factor; F is freed group by group
            f = factors.pop(key)
            f.diagonal().add_(damping[key])
            out[key] = _cholesky_in_place(f, self.label(key))
        return out

    @staticmethod
    def apply(rows: torch.Tensor, shape: torch.Size, factor: torch.Tensor, damping: float) -> torch.Tensor:
        return torch.cholesky_solve(rows.T, factor).T


class _Eigenpairs:
    """Factors: the top-r eigenpairs ``(V, s)`` of F, applied by Woodbury."""

    tensor_names = ("vecs", "evals")
    takes_rank = True

    def __init__(self, options: CurvatureOptions):
        super().__init__(options)
        self.rank = DEFAULT_RANK if options.rank is None else options.rank

    def estimate(self, store: Any, layers: Sequence[str], *, block_size: int | None
                 ) -> tuple[Factors, dict[str, float], int]:
        o = self.options
        return lowrank_fisher(store, layers, self.rank, oversample=o.oversample, iterations=o.iterations,
                              block_size=block_size, seed=o.seed, joint=self.whole_model)

    @staticmethod
    def apply(rows: torch.Tensor, shape: torch.Size, factor: tuple, damping: float) -> torch.Tensor:
        return woodbury_apply(rows, *factor, damping)


class RawFisher(_Cholesky, _PerLayer):
    """``hessian="raw"``: each layer's explicit D_l × D_l Fisher (k=64: 128 MiB a layer)."""

    name = "raw"

    def estimate(self, store: Any, layers: Sequence[str], *, block_size: int | None
                 ) -> tuple[Factors, dict[str, float], int]:
        return fisher_stats(store, layers, block_size=block_size)


class LowRankFisher(_Eigenpairs, _PerLayer):
    """``hessian="lorif"``: each layer's top-r eigenpairs (memory O(D·r))."""

    name = "lorif"


class EkfacFisher(_PerLayer):
    """``hessian="ekfac"``: each layer's Kronecker eigenbases and k_out×k_in eigenvalue correction."""

    name = "ekfac"
    tensor_names = ("u_out", "u_in", "evals")

    def estimate(self, store: Any, layers: Sequence[str], *, block_size: int | None
                 ) -> tuple[Factors, dict[str, float], int]:
        return ekfac_fisher(store, layers, block_size=block_size)

    @staticmethod
    def apply(rows: torch.Tensor, shape: torch.Size, factor: tuple, damping: float) -> torch.Tensor:
        return ekfac_apply(rows.reshape(shape), *factor, damping)


class LowRankJointFisher(_Eigenpairs, _Joint):
    """``hessian="joint", rank=r``: the top-r eigenpairs of the whole-model Fisher (any width)."""

    name = "joint"


class JointFisher(_Cholesky, _Joint):
    """``hessian="joint"``: one explicit D × D Fisher over every layer, cross-layer blocks included;
    its top-r eigenpairs (:class:`LowRankJointFisher`) with ``rank=r`` or when too wide to hold."""

    name = "joint"
    takes_rank = True

    @classmethod
    def build(cls, options: CurvatureOptions) -> Curvature:
        return cls(options) if options.rank is None else LowRankJointFisher(options)

    def sized(self, store: Any, layers: Sequence[str], *, max_dim: int, auto_rank: int) -> Curvature:
        if sum(layer_dims(store.layer_shapes, layers).values()) > max_dim:   # explicit would need dim² floats
            return LowRankJointFisher(dataclasses.replace(self.options, rank=auto_rank))
        return self

    def estimate(self, store: Any, layers: Sequence[str], *, block_size: int | None
                 ) -> tuple[Factors, dict[str, float], int]:
        fisher, trace, num = joint_fisher(store, layers, block_size=block_size)
        return {_JOINT: fisher}, {_JOINT: trace}, num


CURVATURES: dict[str, type[_Curvature]] = {cls.name: cls for cls in (RawFisher, LowRankFisher, EkfacFisher,
                                                                     JointFisher)}
"""``hessian=`` name → its curvature class (``build(options)`` makes one)."""
