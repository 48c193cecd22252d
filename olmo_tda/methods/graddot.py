"""Gradient similarity: GradDot ``⟨ĝ_q, ĝ_i⟩`` and GradCos ``⟨ĝ_q, ĝ_i⟩ / (‖ĝ_q‖‖ĝ_i‖)``.

Inner products sum over the chosen layers (block-diagonal: each layer's flattened ``Ko·Ki`` block).
Training rows may be dense or LoRIF factors; :func:`olmo_tda.ops.inner` routes each layer's product
(``route="auto"`` by cost, timed at near-ties; ``"model"`` the cost model alone; or forced
``"factorized"`` / ``"materialized"``). ``query_rank=r`` trades
exact queries for their best rank-r factors (faster against factor stores; see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch

from ..config import ConfigError
from ..ops import ROUTES, inner, lowrank_queries, sq_norms
from .base import register_method

__all__ = ["GradDot", "GradCos"]


@register_method
class GradDot:
    """Raw gradient inner product summed over layers."""

    name = "graddot"

    def __init__(self, route: str = "auto", query_rank: int = 0):
        if route not in ROUTES:
            raise ConfigError(f"{self.name}: route must be one of {ROUTES}, got {route!r}")
        if query_rank < 0:
            raise ConfigError(f"{self.name}: query_rank must be >= 0 (0 = exact queries), got {query_rank}")
        self.route, self.query_rank = route, query_rank
        self.info: dict = {"route": route, "query_rank": query_rank}

    def prepare(self, queries: dict[str, torch.Tensor]) -> dict:
        return lowrank_queries({n: q.to(torch.float32) for n, q in queries.items()}, self.query_rank)

    def score_block(self, state: dict[str, torch.Tensor], grads: dict) -> torch.Tensor:
        return sum(inner(state[n], grads[n], self.route) for n in state)


@register_method
class GradCos(GradDot):
    """Cosine similarity of the whole (all chosen layers) gradient vectors; scale-free, so it does not
    favour high-loss examples the way GradDot does."""

    name = "gradcos"

    def prepare(self, queries: dict[str, torch.Tensor]) -> dict:
        queries = {n: q.to(torch.float32) for n, q in queries.items()}
        norm = torch.sqrt(sum(sq_norms(q) for q in queries.values())).clamp_min(1e-30)
        return lowrank_queries({n: q / norm[:, None, None] for n, q in queries.items()}, self.query_rank)

    def score_block(self, state: dict[str, torch.Tensor], grads: dict) -> torch.Tensor:
        norm = torch.sqrt(sum(sq_norms(grads[n]) for n in state)).clamp_min(1e-30)
        return super().score_block(state, grads) / norm[None, :]
