"""Moments: per-feature sums of squares of each captured layer's inputs and output gradients, the
two factors of a diagonal K-FAC estimate of the gradient's second moment
(``E[g_ij²] ≈ E[δ_i²]·E[a_j²]``), from which a diagonal preconditioner for
``GradientCapture.scaled`` is built (the selection round's Adam-like scales).

:meth:`GradientCapture.moments <olmo_tda.capture.hooks.GradientCapture.moments>` creates one
:class:`LayerMoments` per layer; the hot path (:mod:`.hot_path`, :mod:`.tied_head`) fills them;
:func:`reduce_moments` sums them over ranks.

Example::

    with cap.moments() as moments, cap.record(ids, loss_scale=n):    # cap: a GradientCapture
        loss.backward()
    reduce_moments(moments)
    R, C = moments["fc1"].second_moment(damping=1e-3)                # [O], [I(+1)]
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

__all__ = ["LayerMoments", "reduce_moments"]


class LayerMoments:
    """Per-feature sums of squares of one layer's inputs (``in_sq [I(+1)]``, bias column last; a
    token table: per-id counts) and output gradients (``out_sq [O]``), over ``tokens`` positions.
    Filled by :meth:`GradientCapture.moments`: the input side is measured at the forward and added
    when that forward's gradient arrives (``measure_*`` return the addition), so a forward that is
    never backpropagated, or recomputed by non-reentrant activation checkpointing, counts once or
    not at all, like the output side."""

    def __init__(self, n_out: int, n_in: int, *, bias: bool = False):
        self.out_sq = torch.zeros(n_out, dtype=torch.float64)
        self.in_sq = torch.zeros(n_in + bias, dtype=torch.float64)
        self.tokens = 0
        self.bias = bias

    def measure_in(self, a_BTI: torch.Tensor) -> Callable[[], None]:
        sq = a_BTI.square().sum(dim=(0, 1)).double()
        return partial(self._add_in, sq, a_BTI.shape[0] * a_BTI.shape[1], self.bias)

    def measure_ids(self, ids_BT: torch.Tensor, padding_idx: int | None) -> Callable[[], None]:
        flat = ids_BT.reshape(-1)
        if padding_idx is not None:
            flat = flat[flat != padding_idx]
        return partial(self._add_in, torch.bincount(flat, minlength=self.in_sq.numel()).double(),
                       ids_BT.numel(), False)

    def _add_in(self, sq: torch.Tensor, tokens: int, bias: bool) -> None:
        self.in_sq[:sq.numel()] += sq.cpu()
        if bias:
            self.in_sq[-1] += tokens
        self.tokens += tokens

    def add_out(self, g_BTO: torch.Tensor, loss_scale: float) -> None:
        self.out_sq += g_BTO.square().sum(dim=(0, 1)).double().cpu() * loss_scale ** 2

    # a tied output head: the table's rows are [d out, V in]; the head sees x (d) and ∂L/∂logits (V)
    def measure_head_in(self, x_BTD: torch.Tensor) -> Callable[[], None]:
        return partial(self._add_head_in, x_BTD.square().sum(dim=(0, 1)).double(), x_BTD.shape[0] * x_BTD.shape[1])

    def _add_head_in(self, sq: torch.Tensor, tokens: int) -> None:
        self.out_sq += sq.cpu()
        self.tokens += tokens

    def add_head_out(self, g_BTV: torch.Tensor, loss_scale: float) -> None:
        self.in_sq += g_BTV.square().sum(dim=(0, 1)).double().cpu() * loss_scale ** 2

    def second_moment(self, damping: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(R [O], C [I])`` with ``E[g_ij²] ≈ R_i·C_j`` for ``g`` the gradient of one token's loss:
        ``R = out_sq / tokens``, ``C = in_sq / tokens``, each floored at ``damping`` times its mean
        (a feature never seen would otherwise get an unbounded preconditioner)."""
        n = max(self.tokens, 1)
        r, c = self.out_sq / n, self.in_sq / n
        return r.clamp_min(damping * float(r.mean())), c.clamp_min(damping * float(c.mean()))


def reduce_moments(moments: dict[str, LayerMoments], device: torch.device | str = "cpu") -> None:
    """Sum every layer's moments over the ranks of the default process group, in one all-reduce
    (``device``: where the collective runs — the rank's GPU under NCCL). No-op without one."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or not moments:
        return
    parts = [t for m in moments.values() for t in (m.out_sq, m.in_sq, torch.tensor([float(m.tokens)]).double())]
    buf = torch.cat(parts).to(device)
    dist.all_reduce(buf)
    buf = buf.cpu()
    at = 0
    for m in moments.values():
        n_out, n_in = m.out_sq.numel(), m.in_sq.numel()
        m.out_sq, m.in_sq = buf[at:at + n_out].clone(), buf[at + n_out:at + n_out + n_in].clone()
        m.tokens = int(round(float(buf[at + n_out + n_in])))
        at += n_out + n_in + 1
