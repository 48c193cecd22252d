"""Source weights learned online from the rows the training step already captured: the ``sources``
selection policy (ADO/DoReMi's per-source mixing, driven by the store's gradients).

Legend: S data sources, D the concatenated width of the run's captured rows, H the examples trained
before the next round (``every_n`` × global batch).

Every optimizer step hands :meth:`SourceMixer.observe` its captured rows — each example's projected
summed-token-loss gradient, the rows the store keeps — and each row's source; :meth:`sync` adds them
(summed over ranks) to a per-source running sum. A round then costs no backward pass over the data:

1. the target gradient ``T [D]`` (the target's mean-token-loss gradient through the same capture) is
   refreshed every ``target_every`` rounds — a round's only backward passes, over ``target_examples``;
2. each source gets ``c_s = cos(m_s − m̄, T / √v)``: ``m_s`` its mean captured row, ``m̄`` the data's
   mean (sources weighted by their share ``π_s`` of the data), ``v`` the captured rows' mean square per
   coordinate (Adam's second moment taken in the projected basis, a diagonal approximation; off with
   ``precondition: false``). Subtracting ``m̄`` leaves what tells sources apart: every text shares a
   large common gradient (byte/unigram statistics) that aligns with any target;
3. each source's evidence accumulates over rounds, ``z_s ← source_memory·z_s + c_s`` (one round's
   cosines are noisy, and a source that helps the target helps it round after round: multiplicative
   weights, as DoReMi updates its domain weights), and the weights are
   ``w_s ∝ π_s·exp(z_s / source_temperature)``, mixed with the natural shares as
   ``(1 − source_floor)·w + source_floor·π`` so that every source keeps being trained on and measured;
4. :func:`pull_forward`: the next H positions of the epoch's order get, per source, ``≈ w_s·H`` of its
   next unseen examples (their order kept), shuffled together; every other example keeps its relative
   order behind them. Nothing is dropped: a down-weighted source's examples come later in the epoch.

The running sums decay by ``source_decay`` per round, so a source's mean follows the weights as they
move. The mixer's state (sums, target) is in the trainer's checkpoint: a resume continues it exactly.

Example::

    import numpy as np, torch
    from olmo_tda.training.mixture import SourceMixer, pull_forward
    mixer = SourceMixer(["code", "prose"], shares=[0.5, 0.5])
    mixer.observe(np.array([0, 1, 1]), torch.randn(3, 8))
    mixer.sync()
    print(pull_forward(np.arange(8), start=2, ids=np.array([6, 3])))    # [0 1 6 3 2 4 5 7]
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..config import ConfigError

__all__ = ["SourceMixer", "pull_forward", "quotas"]


def pull_forward(order: np.ndarray, start: int, ids: np.ndarray) -> np.ndarray:
    """The epoch order with ``ids`` (each unconsumed, i.e. at a position ``>= start``) moved to
    positions ``[start, start + len(ids))`` in the given order; everything else keeps its relative
    order. ``order[:start]`` never changes."""
    order = np.asarray(order, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    rest = order[start:]
    moved = np.isin(rest, ids)
    if int(moved.sum()) != len(ids) or len(np.unique(ids)) != len(ids):
        from .selection import SelectionError

        raise SelectionError(f"pull_forward: the {len(ids)} ids to move are not distinct ids found at positions "
                             f">= {start} of the order")
    return np.concatenate([order[:start], ids, rest[~moved]])


def quotas(weights: np.ndarray, available: np.ndarray, total: int) -> np.ndarray:
    """``[S]`` integer counts summing to ``min(total, available.sum())``, each ``<= available``,
    as close to ``weights·total`` as the caps allow (largest remainders; what a capped source cannot
    take goes to the others in proportion to their weights)."""
    weights = np.clip(np.asarray(weights, dtype=np.float64), 0.0, None)
    available = np.asarray(available, dtype=np.int64)
    total = int(min(total, available.sum()))
    # real-valued shares first: a source that cannot take its share is fixed at what it has, and
    # the rest is spread again over the others (by weight; evenly if only zero weights are left)
    want = np.zeros(len(weights))
    fixed = available <= 0
    while True:
        free = ~fixed
        w = np.where(free, weights, 0.0)
        if w.sum() <= 0:
            w = free.astype(np.float64)
        want[free] = w[free] / w.sum() * (total - want[fixed].sum())
        over = free & (want > available)
        if not over.any():
            break
        want[over] = available[over]
        fixed |= over
    counts = np.minimum(np.floor(want + 1e-9).astype(np.int64), available)
    spare = np.where(counts < available, want - counts, -np.inf)        # largest remainders first
    for s in np.argsort(-spare, kind="stable")[:total - int(counts.sum())]:
        counts[s] += 1
    return counts


class SourceMixer:
    """Per-source running sums of captured rows, the target gradient, and the weights they give
    (see the module docstring). Every rank holds the same state once :meth:`sync` has run."""

    def __init__(self, names: list[str], *, shares: list[float] | np.ndarray, temperature: float = 0.1,
                 memory: float = 0.9, floor: float = 0.1, decay: float = 0.5, precondition: bool = True,
                 damping: float = 0.01, min_rows: int = 8):
        if len(names) != len(shares) or not names:
            raise ConfigError(f"{len(names)} source names for {len(shares)} shares")
        shares = np.asarray(shares, dtype=np.float64)
        if (shares < 0).any() or shares.sum() <= 0:
            raise ConfigError(f"source shares must be >= 0 and not all 0, got {shares.tolist()}")
        self.names = list(names)
        self.shares = shares / shares.sum()
        self.temperature, self.memory = float(temperature), float(memory)
        self.floor, self.decay = float(floor), float(decay)
        self.precondition, self.damping, self.min_rows = bool(precondition), float(damping), int(min_rows)
        self.sums: torch.Tensor | None = None        # [S, D] float64, decayed per round
        self.counts = torch.zeros(len(names), dtype=torch.float64)
        self.sq: torch.Tensor | None = None          # [D] decayed sum of squares of every row
        self.sq_count = torch.zeros((), dtype=torch.float64)
        self.target: torch.Tensor | None = None      # [D] float64
        self.target_round = -1                        # the round index the target was measured at
        self.rounds = 0
        self.evidence = np.zeros(len(names))          # z_s: the rounds' cosines, accumulated with memory
        self._pending: list[torch.Tensor] | None = None

    # -- rows in -----------------------------------------------------------------------------------

    def _zeros(self, width: int) -> list[torch.Tensor]:
        s = len(self.names)
        return [torch.zeros(s, width, dtype=torch.float64), torch.zeros(s, dtype=torch.float64),
                torch.zeros(width, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]

    def observe(self, source: np.ndarray, rows: torch.Tensor) -> None:
        """Add this rank's rows ``[B, D]`` of one step, ``source [B]`` their source indices."""
        rows = rows.detach().to("cpu", torch.float64)
        if self._pending is None:
            self._pending = self._zeros(rows.shape[1])
        sums, counts, sq, n = self._pending
        if rows.shape[1] != sums.shape[1]:
            raise ConfigError(f"rows of width {rows.shape[1]}; the mixer holds width {sums.shape[1]}")
        idx = torch.as_tensor(np.asarray(source, dtype=np.int64))
        finite = torch.isfinite(rows).all(dim=1)          # a NaN row would poison its source for good
        idx, rows = idx[finite], rows[finite]
        sums.index_add_(0, idx, rows)
        counts += torch.bincount(idx, minlength=len(self.names)).double()
        sq += (rows * rows).sum(dim=0)
        n += len(rows)

    def sync(self, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, width: int | None = None) -> None:
        """Fold the pending rows into the running sums; ``all_reduce`` (sum over ranks, in place or
        returned) makes them the run's. Collective when given: every rank calls it each step, with
        ``width`` (D) so that a rank that saw no rows still joins."""
        if self._pending is None:
            if width is None and self.sums is None:
                return
            self._pending = self._zeros(width if width is not None else self.sums.shape[1])
        parts = self._pending
        flat = torch.cat([p.reshape(-1) for p in parts])
        if all_reduce is not None:
            out = all_reduce(flat)
            flat = flat if out is None else out
        sizes = [p.numel() for p in parts]
        sums, counts, sq, n = [t.reshape(p.shape) for t, p in zip(torch.split(flat, sizes), parts)]
        if self.sums is None:
            self.sums, self.sq = sums.clone(), sq.clone()
        else:
            self.sums += sums
            self.sq += sq
        self.counts += counts
        self.sq_count += n[0]
        self._pending = None

    # -- a round -----------------------------------------------------------------------------------

    def needs_target(self, every: int) -> bool:
        return self.target is None or self.rounds - self.target_round >= every

    def set_target(self, target: torch.Tensor) -> None:
        if not bool(torch.isfinite(target).all()):
            raise ConfigError("the target gradient is not finite")
        self.target = target.detach().to("cpu", torch.float64).reshape(-1)
        self.target_round = self.rounds

    def scores(self) -> np.ndarray:
        """``[S]`` ``c_s`` (0 for a source with fewer than ``min_rows`` rows seen)."""
        out = np.zeros(len(self.names))
        if self.sums is None or self.target is None:
            return out
        if self.target.shape[0] != self.sums.shape[1]:
            raise ConfigError(f"target gradient of width {self.target.shape[0]}, captured rows of {self.sums.shape[1]}")
        seen = self.counts >= self.min_rows
        if int(seen.sum()) < 2:
            return out
        means = self.sums[seen] / self.counts[seen, None]
        pi = torch.as_tensor(self.shares)[seen]
        common = (pi[:, None] * means).sum(dim=0) / pi.sum()
        direction = self.target
        if self.precondition and float(self.sq_count) > 0:
            v = self.sq / self.sq_count
            v = v.clamp_min(self.damping * float(v.mean()) + 1e-300)
            direction = direction / v.sqrt()
        diff = means - common
        cos = (diff @ direction) / (diff.norm(dim=1) * direction.norm()).clamp_min(1e-300)
        out[seen.numpy()] = cos.numpy()
        return out

    def accumulate(self, scores: np.ndarray) -> np.ndarray:
        """``z ← memory·z + scores``; returns the new ``z`` (once per round)."""
        self.evidence = self.memory * self.evidence + np.asarray(scores, dtype=np.float64)
        return self.evidence

    def weights(self, evidence: np.ndarray | None = None) -> np.ndarray:
        """``[S]`` the weights the accumulated evidence ``z`` (default: the mixer's) gives."""
        z = self.evidence if evidence is None else np.asarray(evidence, dtype=np.float64)
        logits = np.log(np.maximum(self.shares, 1e-300)) + z / self.temperature
        logits[self.shares <= 0] = -np.inf
        w = np.exp(logits - logits[np.isfinite(logits)].max())
        w = w / w.sum()
        return (1.0 - self.floor) * w + self.floor * self.shares

    def end_round(self) -> None:
        """Decay the running sums (called once per round, after its weights are taken)."""
        self.rounds += 1
        if self.sums is not None:
            self.sums *= self.decay
            self.counts *= self.decay
            self.sq *= self.decay
            self.sq_count *= self.decay

    def pick(self, order: np.ndarray, start: int, source_of: Callable[[np.ndarray], np.ndarray], horizon: int,
             weights: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [≤ H], counts [S])``: the ids the next ``horizon`` positions get, and how many of
        each source. Per source its next unseen examples in the current order, then shuffled together."""
        rest = np.asarray(order[start:], dtype=np.int64)
        src = np.asarray(source_of(rest), dtype=np.int64)
        available = np.bincount(src, minlength=len(self.names))
        counts = quotas(weights, available, horizon)
        positions = np.concatenate([np.flatnonzero(src == s)[:counts[s]] for s in range(len(self.names))])
        rng = np.random.default_rng(seed)
        return rest[positions[rng.permutation(len(positions))]], counts

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The mixer's state after :meth:`sync` (tensors and plain values: ``torch.load(weights_only=True)``)."""
        return {"names": list(self.names), "rounds": self.rounds, "target_round": self.target_round,
                "evidence": torch.as_tensor(self.evidence, dtype=torch.float64).clone(),
                "counts": self.counts.clone(), "sq_count": self.sq_count.clone(),
                "sums": None if self.sums is None else self.sums.clone(),
                "sq": None if self.sq is None else self.sq.clone(),
                "target": None if self.target is None else self.target.clone()}

    def load_state_dict(self, state: dict) -> None:
        if list(state["names"]) != self.names:
            raise ConfigError(f"the checkpoint's selection sources {list(state['names'])} are not this run's "
                              f"{self.names}: keep data.paths (and their order) as they were to resume")
        self.rounds, self.target_round = int(state["rounds"]), int(state["target_round"])
        self.evidence = state["evidence"].double().numpy().copy()
        self.counts = state["counts"].double().clone()
        self.sq_count = state["sq_count"].double().clone()
        for key in ("sums", "sq", "target"):
            setattr(self, key, None if state[key] is None else state[key].double().clone())
        self._pending = None
