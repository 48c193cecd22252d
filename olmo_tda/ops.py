"""Inner products between stored gradient representations, routed by a FLOP cost model.

A layer's per-example gradients are either dense ``[N, Ko, Ki]`` tensors or
:class:`~olmo_tda.store.record.LowRank` factors (``A [N, Ko, c]``, ``B [N, Ki, c]``, ``Ĝ = A Bᵀ``).
:func:`inner` returns the ``[Q, N]`` matrix ``⟨x_q, y_n⟩`` for any pair, choosing per call between

- ``"factorized"``: never form a Ko×Ki matrix. Dense·factors: ``sum(A ∘ (q B))``
  (cost Q·N·c·Ko·Ki); factors·factors: ``sum((A₁ᵀA₂) ∘ (B₁ᵀB₂))`` (Q·N·c₁·c₂·(Ko+Ki));
- ``"materialized"``: form the dense rows of each factor side (c·Ko·Ki per row), then one GEMM
  (Q·N·Ko·Ki);

by the smaller FLOP count, or as forced with ``route=``. Every route gives the same numbers up to
rounding (tests/test_ops.py). The ghost route for raw token factors is
:func:`olmo_tda.capture.factors.cross_gram`, the same rule with c = tokens.

Example::

    from olmo_tda.ops import inner
    scores = inner(queries["blocks.0.ff_out"], block.grads["blocks.0.ff_out"])   # [Q, n]
"""

from __future__ import annotations

import torch

from .capture.factors import dot_dense_factor, dot_factor_factor
from .store.record import LowRank

__all__ = ["ROUTES", "flat", "sq_norms", "inner_route", "inner"]

ROUTES = ("auto", "factorized", "materialized")

Rep = "torch.Tensor | LowRank"


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
    else:
        factorized = num_q * num_n * max(rank_q, rank_n) * dense_width
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
    return flat(x) @ flat(y).T
