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
the factorized one (inner dimension Ki). So few queries against small ranks go factorized
(Q·c ≤ 4 always; Q=4, c=2 too), everything larger materialized. Other machines have other constants; ``route=`` overrides the choice. Every route gives
the same numbers up to rounding (tests/test_lorif_store.py). The ghost route for raw token
factors is :func:`olmo_tda.capture.factors.cross_gram`, the same rule with c = tokens.

Example::

    from olmo_tda.ops import inner
    scores = inner(queries["blocks.0.ff_out"], block.grads["blocks.0.ff_out"])   # [Q, n]
"""

from __future__ import annotations


import torch

from .capture.factors import dot_dense_factor, dot_dense_tiles, dot_factor_factor, truncate_dense
from .store.record import LowRank

__all__ = ["ROUTES", "flat", "sq_norms", "inner_route", "inner", "lowrank_queries"]

ROUTES = ("auto", "factorized", "materialized")

Rep = "torch.Tensor | LowRank"

# dense·factors, materialized route: cost per row in units of one factorized Ko·Ki multiply-add
# (benchmarks/routing.py; the module docstring)
_MATERIALIZE = 6.5            # forming the row in a cache-resident tile
_GEMM_PER_QUERY = 0.5         # the GEMM over Ko·Ki, per query
_MATERIALIZE_PER_C = 0.1      # per factor column of the tile's bmm


def flat(x: Rep) -> torch.Tensor:
    """``[N, Ko·Ki]`` dense rows (factors are materialized)."""
    dense = x.dense() if isinstance(x, LowRank) else x
    return dense.reshape(dense.shape[0], -1)


def sq_norms(x: Rep) -> torch.Tensor:
    """``[N]`` squared Frobenius norms; for factors ``sum((AᵀA) ∘ (BᵀB))`` without forming Ĝ."""
    if isinstance(x, LowRank):
        return ((x.A.transpose(1, 2) @ x.A) * (x.B.transpose(1, 2) @ x.B)).sum(dim=(1, 2))
    return (x.reshape(x.shape[0], -1) ** 2).sum(dim=1)


def _rank(x: Rep) -> int:
    return x.rank if isinstance(x, LowRank) else 0


def inner_route(num_q: int, num_n: int, k_out: int, k_in: int, rank_q: int, rank_n: int) -> str:
    """``"factorized"`` or ``"materialized"`` for a Q×N inner-product block (rank 0 = dense side)."""
    dense_width = k_out * k_in
    if not rank_q and not rank_n:
        return "materialized"
    if rank_q and rank_n:
        factorized = num_q * num_n * rank_q * rank_n * (k_out + k_in)
    else:                                 # measured per-row costs (see the module docstring)
        num_dense, c = (num_q if rank_n else num_n), max(rank_q, rank_n)
        factorized_row = num_dense * c
        materialized_row = _MATERIALIZE + _GEMM_PER_QUERY * num_dense + _MATERIALIZE_PER_C * c
        return "factorized" if factorized_row < materialized_row else "materialized"
    materialized = (num_q * rank_q + num_n * rank_n) * dense_width + num_q * num_n * dense_width
    return "factorized" if factorized < materialized else "materialized"


def inner(x: Rep, y: Rep, route: str = "auto") -> torch.Tensor:
    """``[Q, N]`` inner products of ``x`` (Q rows) with ``y`` (N rows), dense or factors, by the
    cheaper route (``route="auto"``) or the one forced."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    if tuple(x.shape[1:]) != tuple(y.shape[1:]):
        raise ValueError(f"inner: gradient shapes differ: {tuple(x.shape[1:])} vs {tuple(y.shape[1:])}")
    if route == "auto":
        route = inner_route(len(x), len(y), y.shape[1], y.shape[2], _rank(x), _rank(y))
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
        raise ValueError(f"query_rank must be >= 0, got {rank}")
    return {n: LowRank(*truncate_dense(q, rank)) if rank and rank * (q.shape[1] + q.shape[2]) < q.shape[1] * q.shape[2]
            else q for n, q in queries.items()}
