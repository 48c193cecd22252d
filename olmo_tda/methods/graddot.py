"""Gradient similarity: GradDot ``⟨ĝ_q, ĝ_i⟩`` and GradCos ``⟨ĝ_q, ĝ_i⟩ / (‖ĝ_q‖‖ĝ_i‖)``.

Inner products sum over the chosen layers (block-diagonal: each layer's flattened ``Ko·Ki`` block).
"""

from __future__ import annotations

import torch

from .base import register_method

__all__ = ["GradDot", "GradCos"]


def _flat(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: g.reshape(g.shape[0], -1).to(torch.float32) for n, g in grads.items()}


@register_method
class GradDot:
    """Raw gradient inner product summed over layers."""

    name = "graddot"

    def prepare(self, queries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _flat(queries)

    def score_block(self, state: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> torch.Tensor:
        flat = _flat(grads)
        return sum(state[n] @ flat[n].T for n in state)


@register_method
class GradCos(GradDot):
    """Cosine similarity of the whole (all chosen layers) gradient vectors; scale-free, so it does not
    favour high-loss examples the way GradDot does."""

    name = "gradcos"

    def prepare(self, queries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        flat = _flat(queries)
        norm = torch.sqrt(sum((q * q).sum(dim=1) for q in flat.values())).clamp_min(1e-30)
        return {n: q / norm[:, None] for n, q in flat.items()}

    def score_block(self, state: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> torch.Tensor:
        flat = _flat(grads)
        norm = torch.sqrt(sum((g * g).sum(dim=1) for g in flat.values())).clamp_min(1e-30)
        return sum(state[n] @ flat[n].T for n in state) / norm[None, :]
