"""Inner products between stored gradient representations, routed by a FLOP cost model.

A layer's per-example gradients are either dense ``[N, Ko, Ki]`` tensors or
:class:`~olmo_tda.store.record.LowRank` factors (``A [N, Ko, c]``, ``B [N, Ki, c]``, ``Ĝ = A Bᵀ``).
:func:`inner` returns the ``[Q, N]`` matrix ``⟨x_q, y_n⟩`` for any pair, choosing per call between

- ``"factorized"``: never form a Ko×Ki matrix. Dense·factors: ``sum(A ∘ (q B))``
  (cost Q·N·c·Ko·Ki); factors·factors: ``sum((A₁ᵀA₂) ∘ (B₁ᵀB₂))`` (Q·N·c₁·c₂·(Ko+Ki));
- ``"materialized"``: form the dense rows of each factor side (c·Ko·Ki per row), then one GEMM
  (Q·N·Ko·Ki); against dense queries the rows are formed one cache-sized tile at a time
  (:func:`~olmo_tda.capture.factors.dot_dense_tiles`), so they never travel to memory;

by the smaller cost, or as forced with ``route=``. Dense·factors costs per row are measured, in
units of the factorized route's Ko·Ki multiply-adds (benchmarks/routing.py, k=64, 2-core CPU):
factorized ``Q·c``; materialized ``6.5 + 0.5·Q + 0.1·c`` — forming a tile is a fixed cost per row
of about 6.5 units, and its GEMM (inner dimension Ko·Ki) runs twice as fast per multiply-add as
the factorized one (inner dimension Ki). So few queries against small ranks go factorized (one
query up to c = 7, two or three up to c = 3 and 2, four at c = 2, up to 13 at c = 1), everything
larger materialized.

Those constants are one machine's, and near their crossover the faster route flips with the
machine's state (benchmarks/routing.py saw Q=1, c=8 go either way by 1.2–1.6× between runs). So
``route="auto"`` measures where the model cannot tell: when the two modelled costs are within
:data:`TIE_BAND` of each other (and the call is big enough to time), the first call of that shape
times both routes (:func:`_time_routes`), keeps the faster one for the process
(:func:`measured_routes`), and later calls of the shape take it without timing.
``route="model"`` is the cost model alone (no timing: the same choice on every run). Every route
gives the same numbers up to rounding (tests/test_lorif_store.py). The ghost route for raw token factors is
:func:`olmo_tda.capture.factors.cross_gram`, the same rule with c = tokens.

Example::

    from olmo_tda.ops import inner
    scores = inner(queries["blocks.0.ff_out"], block.grads["blocks.0.ff_out"])   # [Q, n]
"""

from __future__ import annotations

import logging
import math
import time

import torch

from .capture.factors import dot_dense_factor, dot_dense_tiles, dot_factor_factor, truncate_dense
from .config import ConfigError
from .store.record import LowRank

__all__ = ["ROUTES", "TIE_BAND", "flat", "sq_norms", "inner_route", "auto_route", "inner", "measured_routes",
           "clear_measured_routes", "lowrank_queries"]

logger = logging.getLogger(__name__)

ROUTES = ("auto", "model", "factorized", "materialized")

Rep = "torch.Tensor | LowRank"

# dense·factors, materialized route: cost per row in units of one factorized Ko·Ki multiply-add
# (benchmarks/routing.py; the module docstring)
_MATERIALIZE = 6.5            # forming the row in a cache-resident tile
_GEMM_PER_QUERY = 0.5         # the GEMM over Ko·Ki, per query
_MATERIALIZE_PER_C = 0.1      # per factor column of the tile's bmm

TIE_BAND = 2.0
"""Dense·factors products whose two modelled costs are within this factor are timed once per shape
(the misses benchmarks/routing.py recorded were 1.2–1.6× from a modelled ratio of 1.03)."""
_MIN_TIMED_MACS = 1 << 22     # smaller calls take the model's route: too short to time, too cheap to matter
_TIMED_SAMPLE_S = 0.003        # a timing sample repeats a short call up to this long (at most 16 calls)
_TIMED_ROUNDS = 3
_measured: dict[tuple, str] = {}    # shape key -> the faster route, measured in this process


def flat(x: Rep) -> torch.Tensor:
    """``[N, Ko·Ki]`` dense rows (factors are materialized)."""
    dense = x.dense() if isinstance(x, LowRank) else x
    return dense.reshape(dense.shape[0], math.prod(dense.shape[1:]))      # not -1: N may be 0


def sq_norms(x: Rep) -> torch.Tensor:
    """``[N]`` squared Frobenius norms; for factors ``sum((AᵀA) ∘ (BᵀB))`` without forming Ĝ."""
    if isinstance(x, LowRank):
        return ((x.A.transpose(1, 2) @ x.A) * (x.B.transpose(1, 2) @ x.B)).sum(dim=(1, 2))
    return (x.reshape(x.shape[0], math.prod(x.shape[1:])) ** 2).sum(dim=1)


def _rank(x: Rep) -> int:
    return x.rank if isinstance(x, LowRank) else 0


def inner_route(num_q: int, num_n: int, k_out: int, k_in: int, rank_q: int, rank_n: int) -> str:
    """``"factorized"`` or ``"materialized"`` for a Q×N inner-product block (rank 0 = dense side)."""
    dense_width = k_out * k_in
    if not rank_q and not rank_n:
        return "materialized"
    if rank_q and rank_n:
        factorized = num_q * num_n * rank_q * rank_n * (k_out + k_in)
        materialized = (num_q * rank_q + num_n * rank_n) * dense_width + num_q * num_n * dense_width
    else:
        factorized, materialized = _dense_factor_costs(num_q, num_n, rank_q, rank_n)
    return "factorized" if factorized < materialized else "materialized"


def _dense_factor_costs(num_q: int, num_n: int, rank_q: int, rank_n: int) -> tuple[float, float]:
    """Measured per-row costs (factorized, materialized) of dense·factors (the module docstring)."""
    num_dense, c = (num_q if rank_n else num_n), max(rank_q, rank_n)
    return num_dense * c, _MATERIALIZE + _GEMM_PER_QUERY * num_dense + _MATERIALIZE_PER_C * c


def _timing_key(num_q: int, num_n: int, k_out: int, k_in: int, rank_q: int, rank_n: int,
                dtype: torch.dtype, device: torch.device) -> tuple | None:
    """The key under which ``auto`` times a dense·factors product, or None where the model decides
    (two dense or two factor sides, costs apart by more than TIE_BAND, or too small to time)."""
    if bool(rank_q) == bool(rank_n):
        return None
    factorized, materialized = _dense_factor_costs(num_q, num_n, rank_q, rank_n)
    if max(factorized, materialized) > TIE_BAND * min(factorized, materialized):
        return None
    if num_q * num_n * max(rank_q, rank_n) * k_out * k_in < _MIN_TIMED_MACS:
        return None
    # rows rounded up to a power of two: blocks of one store share a key, its short last block too
    num_q, num_n = (num_q, 1 << math.ceil(math.log2(num_n))) if rank_n else (1 << math.ceil(math.log2(num_q)), num_n)
    return (num_q, num_n, k_out, k_in, rank_q, rank_n, str(dtype), str(device), torch.get_num_threads())


def _dtype(x: Rep) -> torch.dtype:
    return x.A.dtype if isinstance(x, LowRank) else x.dtype


def _to(x: Rep, dtype: torch.dtype) -> Rep:
    return LowRank(x.A.to(dtype), x.B.to(dtype)) if isinstance(x, LowRank) else x.to(dtype)


def _rep_key(x: Rep, y: Rep) -> tuple | None:
    dtype = torch.promote_types(_dtype(x), _dtype(y))
    device = x.A.device if isinstance(x, LowRank) else x.device
    return _timing_key(len(x), len(y), y.shape[1], y.shape[2], _rank(x), _rank(y), dtype, device)


def auto_route(x: Rep, y: Rep) -> str | None:
    """The route ``inner(x, y, "auto")`` takes now: the measured one where this shape was timed, the
    cost model's where it is not timed; None where the next call will time both routes."""
    key = _rep_key(x, y)
    if key is None:
        return inner_route(len(x), len(y), y.shape[1], y.shape[2], _rank(x), _rank(y))
    return _measured.get(key)


def measured_routes() -> dict[tuple, str]:
    """The routes ``auto`` measured in this process: ``(Q, N, Ko, Ki, rank_q, rank_n, dtype, device,
    threads) -> route``, the factor side's row count rounded up to a power of two."""
    return dict(_measured)


def clear_measured_routes() -> None:
    """Forget the measured routes (the next near-tie call of each shape times both again)."""
    _measured.clear()


def _time_routes(x: Rep, y: Rep, key: tuple) -> torch.Tensor:
    """Time both routes and keep the faster under ``key``; returns its result. One call of each
    warms it up and sizes the samples (repeats up to ~:data:`_TIMED_SAMPLE_S`), then
    :data:`_TIMED_ROUNDS` interleaved rounds in rotating order; the faster minimum wins (noise on a
    shared machine only ever adds time)."""
    sync = torch.cuda.synchronize if key[7].startswith("cuda") else (lambda: None)

    def run(route: str, reps: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            results[route] = _inner(x, y, route)
        sync()
        return (time.perf_counter() - t0) / reps

    routes, results = ["factorized", "materialized"], {}
    reps = {route: max(1, min(16, math.ceil(_TIMED_SAMPLE_S / max(run(route, 1), 1e-6)))) for route in routes}
    best = {route: math.inf for route in routes}
    for r in range(_TIMED_ROUNDS):
        for route in routes[r % 2:] + routes[:r % 2]:
            best[route] = min(best[route], run(route, reps[route]))
    winner = min(best, key=best.get)
    _measured[key] = winner
    logger.debug("inner: timed %s: factorized %.3g ms, materialized %.3g ms -> %s", key,
                 best["factorized"] * 1e3, best["materialized"] * 1e3, winner)
    return results[winner]


def inner(x: Rep, y: Rep, route: str = "auto") -> torch.Tensor:
    """``[Q, N]`` inner products of ``x`` (Q rows) with ``y`` (N rows), dense or factors, by the
    faster route (``"auto"``: the cost model, timed at near-ties), the cost model alone (``"model"``)
    or the route forced (``"factorized"``, ``"materialized"``)."""
    if route not in ROUTES:
        raise ConfigError(f"route must be one of {ROUTES}, got {route!r}")
    if tuple(x.shape[1:]) != tuple(y.shape[1:]):
        raise ConfigError(f"inner: gradient shapes differ: {tuple(x.shape[1:])} vs {tuple(y.shape[1:])}")
    dtype = torch.promote_types(_dtype(x), _dtype(y))       # every route computes in the same dtype
    x, y = _to(x, dtype), _to(y, dtype)
    if route == "auto":
        key = _rep_key(x, y)
        if key is not None and key not in _measured:
            return _time_routes(x, y, key)
        route = _measured[key] if key is not None else "model"
    if route == "model":
        route = inner_route(len(x), len(y), y.shape[1], y.shape[2], _rank(x), _rank(y))
    return _inner(x, y, route)


def _inner(x: Rep, y: Rep, route: str) -> torch.Tensor:
    """``inner`` by a fixed route (``"factorized"`` or ``"materialized"``)."""
    if route == "factorized":
        if isinstance(x, LowRank) and isinstance(y, LowRank):
            return dot_factor_factor(x.A, x.B, y.A, y.B)
        if isinstance(y, LowRank):
            return dot_dense_factor(x, y.A, y.B)
        if isinstance(x, LowRank):
            return dot_dense_factor(y, x.A, x.B).T
    elif isinstance(x, LowRank) != isinstance(y, LowRank):      # materialize the factor side tile by tile
        return dot_dense_tiles(x, y.A, y.B) if isinstance(y, LowRank) else dot_dense_tiles(y, x.A, x.B).T
    return flat(x) @ flat(y).T


def lowrank_queries(queries: dict[str, torch.Tensor], rank: int) -> dict[str, "torch.Tensor | LowRank"]:
    """Each dense query gradient ``[Q, Ko, Ki]`` as its best rank-``rank`` factors (``rank=0``: as
    is). An approximation of the query side, traded for speed against factor stores (factors·factors
    costs Q·N·r·c·(Ko+Ki) instead of Q·N·Ko·Ki); layers where rank-r factors are not smaller stay dense."""
    if rank < 0:
        raise ConfigError(f"query_rank must be >= 0, got {rank}")
    return {n: LowRank(*truncate_dense(q, rank)) if rank and rank * (q.shape[1] + q.shape[2]) < q.shape[1] * q.shape[2]
            else q for n, q in queries.items()}
