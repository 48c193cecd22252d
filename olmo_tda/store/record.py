"""The unit the store appends: one optimizer step's per-example gradients."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["GradientRecord"]


@dataclass
class GradientRecord:
    """Per-example compact gradients of one training step (or one query batch).

    ``grads[name]`` is ``[N, k_out, k_in]`` float32 (any device; the writer copies it off the step),
    row ``i`` belonging to example ``ids[i]``. Gradients follow the store's convention: the gradient
    of the example's *summed token loss*, the training loop's normalization already undone.
    """

    ids: np.ndarray
    """int64 ``[N]``: global example (data) indices."""
    step: int
    """Optimizer step at which these gradients were used (the step being taken)."""
    lr: float
    """Learning rate of that step (first parameter group)."""
    loss_scale: float | np.ndarray
    """The divisor the loop applied to the summed token loss (undone in ``grads``); kept for TracIn.
    One number for the whole record, or float64 ``[N]`` per row when micro-batches were normalized
    differently (e.g. a token mean per DeepSpeed micro-batch)."""
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int64).reshape(-1)
        n = len(self.ids)
        scale = np.asarray(self.loss_scale, dtype=np.float64)
        if scale.ndim not in (0, 1) or (scale.ndim == 1 and len(scale) != n):
            raise ValueError(f"GradientRecord: loss_scale must be a number or one per row ({n}), "
                             f"got shape {scale.shape}")
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"GradientRecord: loss_scale must be positive and finite, got {self.loss_scale!r}")
        self.loss_scale = float(scale) if scale.ndim == 0 else scale
        for name, g in self.grads.items():
            if g.ndim != 3 or g.shape[0] != n:
                raise ValueError(f"GradientRecord: grads[{name!r}] has shape {tuple(g.shape)}, "
                                 f"expected [{n}, k_out, k_in] for {n} ids")

    def __len__(self) -> int:
        return len(self.ids)
