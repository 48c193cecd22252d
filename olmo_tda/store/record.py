"""The unit the store appends: one optimizer step's per-example gradients, dense or as LoRIF factors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import ConfigError

__all__ = ["GradientRecord", "LowRank", "cat_rows"]


@dataclass(frozen=True)
class LowRank:
    """Per-example rank-c factors of projected gradients: ``Ĝ_i = A_i B_iᵀ``.

    ``A [N, Ko, c]``, ``B [N, Ki, c]``. On disk a row is packed as ``[Ko + Ki, c]`` (A above B), so
    the store's codecs, shard checks and truncation treat it like any other ``[N, ., .]`` array.
    """

    A: torch.Tensor
    B: torch.Tensor

    def __post_init__(self) -> None:
        if self.A.ndim != 3 or self.B.ndim != 3 or self.A.shape[0] != self.B.shape[0] \
                or self.A.shape[2] != self.B.shape[2]:
            raise ConfigError(f"LowRank needs A [N, Ko, c] and B [N, Ki, c], got {tuple(self.A.shape)} "
                              f"and {tuple(self.B.shape)}")

    def __len__(self) -> int:
        return self.A.shape[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(N, Ko, Ki)``: the shape of the gradients these factors represent."""
        return (self.A.shape[0], self.A.shape[1], self.B.shape[1])

    @property
    def rank(self) -> int:
        return self.A.shape[2]

    def __getitem__(self, rows) -> "LowRank":
        return LowRank(self.A[rows], self.B[rows])

    def dense(self) -> torch.Tensor:
        """``[N, Ko, Ki]`` = ``A Bᵀ`` (materialized; memory N·Ko·Ki)."""
        from ..capture.factors import materialize
        return materialize(self.A, self.B)

    def packed(self) -> torch.Tensor:
        """``[N, Ko + Ki, c]``: the on-disk row layout."""
        return torch.cat([self.A, self.B], dim=1)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, k_out: int) -> "LowRank":
        return cls(packed[:, :k_out], packed[:, k_out:])

    def to(self, *args, **kwargs) -> "LowRank":
        return LowRank(self.A.to(*args, **kwargs), self.B.to(*args, **kwargs))

    def detach(self) -> "LowRank":
        return LowRank(self.A.detach(), self.B.detach())

    def is_floating_point(self) -> bool:
        return self.A.is_floating_point() and self.B.is_floating_point()


def cat_rows(parts: list) -> "torch.Tensor | LowRank":
    """Concatenate dense tensors or :class:`LowRank` factors along the example dimension."""
    if isinstance(parts[0], LowRank):
        return LowRank(torch.cat([p.A for p in parts]), torch.cat([p.B for p in parts]))
    return torch.cat(parts)


@dataclass
class GradientRecord:
    """Per-example compact gradients of one training step (or one query batch).

    ``grads[name]`` is ``[N, k_out, k_in]`` float32 (any device; the writer copies it off the step),
    or :class:`LowRank` factors of it for a layer captured with ``capture.rank``; row ``i`` belongs
    to example ``ids[i]``. Gradients follow the store's convention: the gradient
    of the example's *summed token loss*, the training loop's normalization already undone.
    """

    ids: np.ndarray
    """int64 ``[N]``: global example (data) indices."""
    step: int
    """Optimizer step at which these gradients were used (the step being taken)."""
    lr: float
    """Learning rate of that step (first parameter group): finite and >= 0 (0 for a post-hoc capture
    that took no step). TracIn weights each row by it, so a NaN here would make every score NaN."""
    loss_scale: float | np.ndarray
    """The divisor between the example's summed-token-loss gradient (``grads``, the loop's own
    normalization undone) and its share of the gradient the step applied; TracIn weights rows by
    ``lr / loss_scale``. Under data parallelism that includes the number of ranks averaged over
    (OLMo: tokens of the rank's batch × world size). One number for the whole record, or float64
    ``[N]`` per row when micro-batches were normalized differently (e.g. a token mean per DeepSpeed
    micro-batch)."""
    grads: dict[str, "torch.Tensor | LowRank"] = field(default_factory=dict)
    basis: str | None = None
    """Digest of the eigenbasis version the rows were projected with, when the run's basis follows
    training (``capture.basis_every``); the store keeps it per shard. None: one projection for the
    whole store (named in ``store.json``)."""

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int64).reshape(-1)
        n = len(self.ids)
        scale = np.asarray(self.loss_scale, dtype=np.float64)
        if scale.ndim not in (0, 1) or (scale.ndim == 1 and len(scale) != n):
            raise ConfigError(f"GradientRecord: loss_scale must be a number or one per row ({n}), "
                              f"got shape {scale.shape}")
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise ConfigError(f"GradientRecord: loss_scale must be positive and finite, got {self.loss_scale!r}")
        self.loss_scale = float(scale) if scale.ndim == 0 else scale
        try:
            lr = float(self.lr)
        except (TypeError, ValueError, RuntimeError):   # not one number (RuntimeError: a tensor of many)
            lr = math.nan
        if not (math.isfinite(lr) and lr >= 0):
            raise ConfigError(f"GradientRecord: lr of step {self.step} must be a finite number >= 0, got "
                              f"{self.lr!r}; pass the learning rate the optimizer used at that step")
        self.lr = lr
        for name, g in self.grads.items():
            if len(g.shape) != 3 or g.shape[0] != n:
                raise ConfigError(f"GradientRecord: grads[{name!r}] has shape {tuple(g.shape)}, "
                                  f"expected [{n}, k_out, k_in] for {n} ids")

    def __len__(self) -> int:
        return len(self.ids)
