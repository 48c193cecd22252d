"""Online data selection: order an upcoming window of the data by a policy and rewrite that part of
the epoch's order, persisting every round so a resumed run reproduces it.

Legend: W examples in the window, D the concatenated projected-gradient width, GB the global batch.

- Policies (registered by name in :data:`POLICIES`) turn what a round measured into an order of the
  window, best first, and one score per example. ``greats`` is greedy per global batch: a batch
  slot is filled one pick at a time by the largest ``η⟨g_i, ḡ⟩ − c Σ_{j picked in this slot}
  ⟨g_i, g_j⟩`` (η = lr / tokens per global batch, the weight an example's summed-token gradient has
  in one update; ``g`` per-example gradients — preconditioned by the round when
  ``selection.precondition`` — ``ḡ`` the target's mean-token gradient; ``c`` the curvature, η² for
  plain gradients).
- :func:`rewrite_order` applies a round to the epoch's global order: positions before ``start``
  (already consumed) never change; ``reorder`` permutes the window in place; ``filter`` keeps the top
  ``keep_fraction`` there and moves the rest to the end of the epoch.
- :class:`SelectionLog` persists rounds (``rounds.jsonl`` + the window's new id order and its scores
  per round in ``.npy``) before they take effect; :meth:`SelectionLog.replay` rebuilds an epoch's order from the
  framework's base order, :meth:`SelectionLog.truncate_after` forgets rounds a resume will re-run.

Example::

    import numpy as np
    from olmo_tda.training.selection import rewrite_order, order_window
    order, scores = order_window("alignment", align=np.array([0.1, 0.9, 0.5]))
    print(order)                                       # [1 2 0]
    print(rewrite_order(np.arange(10), start=4, window_order=np.array([6, 5, 4]), keep=3))
    # [0 1 2 3 6 5 4 7 8 9]
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from olmo_tda.config import ConfigError
from olmo_tda.errors import TDAError
from olmo_tda.store.format import fsync_dir

__all__ = ["POLICIES", "RoundInputs", "order_window", "greats_order", "rewrite_order", "SelectionLog",
           "SelectionError", "round_stats", "DataOrder"]


class SelectionError(TDAError, RuntimeError):
    """A selection round or its persisted state is inconsistent; the message says what and where."""


@dataclass
class RoundInputs:
    """What a round measured for its W window examples (fields a policy does not need may be None)."""

    grads: torch.Tensor | None = None       # [W, D] projected per-example gradients (summed token loss)
    target: torch.Tensor | None = None      # [D] the target's mean-token-loss gradient
    losses: np.ndarray | None = None        # [W] mean token loss per example
    lr_eff: float = 1.0                     # η: lr / tokens per global batch
    curvature: float | None = None          # greats' redundancy coefficient (None: η², SGD with H = I)
    batch_size: int = 1                     # GB: examples per optimizer step (greats' redundancy scope)
    seed: int = 0                           # for the random policy (already mixed with the round)
    num: int = 0                            # W (the random policy measures nothing)


def _alignment(x: RoundInputs) -> tuple[np.ndarray, np.ndarray]:
    align = (x.grads.double() @ x.target.double()).numpy()
    return np.argsort(-align, kind="stable"), align


def _loss(x: RoundInputs) -> tuple[np.ndarray, np.ndarray]:
    return np.argsort(-x.losses, kind="stable"), np.asarray(x.losses, dtype=np.float64)


def _gradnorm(x: RoundInputs) -> tuple[np.ndarray, np.ndarray]:
    norms = x.grads.double().norm(dim=1).numpy()
    return np.argsort(-norms, kind="stable"), norms


def _random(x: RoundInputs) -> tuple[np.ndarray, np.ndarray]:
    n = x.num
    order = np.random.default_rng(x.seed).permutation(n)
    scores = np.empty(n)
    scores[order] = -np.arange(n, dtype=np.float64)       # earlier = higher
    return order, scores


GRAM_BYTES = 256 << 20
"""Largest float64 Gram matrix (W² · 8 bytes) GREATS forms at once: windows up to ~5,800 examples."""


def greats_order(grads: torch.Tensor, target: torch.Tensor, lr_eff: float, batch_size: int,
                 curvature: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """GREATS greedy order of ``grads [W, D]`` and each example's marginal gain when picked.

    Slots of ``batch_size`` are filled in turn; within a slot the gain of a candidate is
    ``η⟨g_i, ḡ⟩ − c Σ_{j already in the slot} ⟨g_i, g_j⟩`` (two examples of one update interact
    through the update; examples of different updates are treated as independent). ``c``
    (``curvature``) defaults to η², GREATS' SGD step with an identity Hessian."""
    if batch_size < 1:
        raise SelectionError(f"greats: batch_size must be >= 1 (examples per update), got {batch_size}")
    c = lr_eff ** 2 if curvature is None else float(curvature)
    g = grads.double()
    align = lr_eff * (g @ target.double())
    # the W×W Gram matrix in one GEMM when it fits in GRAM_BYTES (the same W²·D flops as one
    # matrix-vector product per pick, ~5-10x faster on CPU at D of a few thousand); else per pick
    gram = g @ g.T if len(g) ** 2 * 8 <= GRAM_BYTES else None
    remaining = torch.ones(len(g), dtype=torch.bool)
    order, gains = [], np.empty(len(g))
    while remaining.any():
        penalty = torch.zeros(len(g), dtype=torch.float64)
        for _ in range(min(batch_size, int(remaining.sum()))):
            gain = torch.where(remaining, torch.nan_to_num(align - c * penalty, nan=-torch.inf), -torch.inf)
            candidates = remaining.nonzero()[:, 0]      # only among the unplaced, whatever the gains are
            pick = int(candidates[torch.argmax(gain[candidates])])
            order.append(pick)
            gains[pick] = float(gain[pick])
            remaining[pick] = False
            penalty += gram[pick] if gram is not None else g @ g[pick]
    return np.asarray(order, dtype=np.int64), gains


def _greats(x: RoundInputs) -> tuple[np.ndarray, np.ndarray]:
    return greats_order(x.grads, x.target, x.lr_eff, x.batch_size, x.curvature)


POLICIES: dict[str, tuple[Callable[[RoundInputs], tuple[np.ndarray, np.ndarray]], frozenset[str]]] = {
    "greats": (_greats, frozenset({"grads", "target"})),
    "alignment": (_alignment, frozenset({"grads", "target"})),
    "loss": (_loss, frozenset({"losses"})),
    "gradnorm": (_gradnorm, frozenset({"grads"})),
    "random": (_random, frozenset()),
}
"""name -> (order function, what it needs measured: a subset of {"grads", "target", "losses"})."""


def order_window(policy: str, *, grads: torch.Tensor | None = None, target: torch.Tensor | None = None,
                 losses: np.ndarray | None = None, align: np.ndarray | None = None, lr_eff: float = 1.0,
                 batch_size: int = 1, seed: int = 0, num: int | None = None, curvature: float | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(order [W], scores [W])``: window positions best first, and each example's score.
    ``align`` (precomputed ⟨g_i, ḡ⟩) stands in for grads/target with ``alignment``."""
    if policy not in POLICIES:
        raise SelectionError(f"unknown selection policy {policy!r}; known: {sorted(POLICIES)}")
    if align is not None and policy == "alignment":
        align = np.asarray(align, dtype=np.float64)
        return np.argsort(-align, kind="stable"), align
    fn, needs = POLICIES[policy]
    if num is None:
        num = next((len(x) for x in (grads, losses) if x is not None), 0)
    inputs = RoundInputs(grads=grads, target=target, losses=losses, lr_eff=lr_eff, batch_size=batch_size,
                         seed=seed, num=num, curvature=curvature)
    missing = [k for k in needs if getattr(inputs, k) is None]
    if missing:
        raise SelectionError(f"policy {policy!r} needs {missing} measured for the window")
    return fn(inputs)


def rewrite_order(order: np.ndarray, start: int, window_order: np.ndarray, keep: int) -> np.ndarray:
    """The epoch order after a round: ``order[:start]`` unchanged, then the first ``keep`` ids of
    ``window_order`` (the window's ids, best first), the rest of the order after the window, and
    finally the window's remaining ids (``keep == len(window_order)``: a pure reorder in place)."""
    window = len(window_order)
    current = order[start:start + window]
    if window != len(current) or not np.array_equal(np.sort(current), np.sort(window_order)):
        raise SelectionError(f"the window's new order is not a permutation of positions [{start}, {start + window}) "
                             "of the current order")
    if not 0 < keep <= window:
        raise SelectionError(f"keep must be in [1, {window}], got {keep}")
    out = np.empty_like(order)
    out[:start] = order[:start]
    out[start:start + keep] = window_order[:keep]
    rest = order[start + window:]
    out[start + keep:start + keep + len(rest)] = rest
    out[start + keep + len(rest):] = window_order[keep:]
    return out


def _finite_mean(x: np.ndarray) -> float | None:
    x = x[np.isfinite(x)]
    return float(x.mean()) if len(x) else None


def round_stats(ids: np.ndarray, order: np.ndarray, scores: np.ndarray, keep: int,
                previous: dict[int, float] | None, sources: list[str] | None, bins: int = 20) -> dict:
    """Per-round statistics: score histogram, promoted vs demoted mean score, Spearman with the
    previous round's scores of the same examples, fraction per data source (window vs front)."""
    from scipy.stats import spearmanr

    window = len(ids)
    new_pos = np.empty(window, dtype=np.int64)
    new_pos[order] = np.arange(window)
    moved_up = new_pos < np.arange(window) if keep == window else np.isin(np.arange(window), order[:keep])
    moved_down = new_pos > np.arange(window) if keep == window else ~moved_up
    finite = scores[np.isfinite(scores)]
    counts, edges = np.histogram(finite, bins=bins) if len(finite) else (np.zeros(0, int), np.zeros(0))
    stats = {"examples_rescored": int(window),
             "score_mean": float(finite.mean()) if len(finite) else None,
             "score_hist": {"counts": counts.tolist(), "edges": edges.tolist()},
             "promoted_mean_score": _finite_mean(scores[moved_up]),
             "demoted_mean_score": _finite_mean(scores[moved_down]),    # an unscored (-inf) example left out
             "rank_corr_prev": None}
    if previous:
        common = [i for i, x in enumerate(ids) if int(x) in previous]
        if len(common) >= 3:
            rho = spearmanr([scores[i] for i in common], [previous[int(ids[i])] for i in common]).statistic
            stats["rank_corr_prev"] = None if np.isnan(rho) else float(rho)
            stats["rank_corr_common"] = len(common)
    if sources is not None:
        front = set(order[:keep if keep < window else window // 2].tolist())
        names = sorted(set(sources))
        stats["source_frac_window"] = {s: sum(x == s for x in sources) / window for s in names}
        stats["source_frac_front"] = {s: sum(sources[i] == s for i in front) / max(len(front), 1) for s in names}
    return stats


class SelectionLog:
    """The rounds of a run, on disk under ``folder``: ``rounds.jsonl`` (one line per round, appended
    and fsync'd) and ``round-e{epoch}-s{step}.npy`` (the window's new id order). A round is logged
    before the order it makes takes effect, so a crash never leaves an applied round unlogged."""

    def __init__(self, folder: str | Path, *, writer: bool = True):
        self.folder = Path(folder)
        self.writer = writer
        if writer:
            self.folder.mkdir(parents=True, exist_ok=True)

    @property
    def index_file(self) -> Path:
        return self.folder / "rounds.jsonl"

    def rounds(self) -> list[dict]:
        if not self.index_file.is_file():
            return []
        lines = self.index_file.read_text().split("\n")
        out = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if n == len(lines):   # a torn last line (no newline after it): the round never applied
                    break
                raise SelectionError(f"{self.index_file}:{n}: corrupt line (not JSON)") from None
        return out

    def _mend_tail(self) -> None:
        """Make the log end in a newline before it grows: a crash while a line was written leaves a
        fragment without one. A fragment that is whole JSON (only the newline was lost) gets its
        newline; anything else is cut off, since that round never took effect."""
        if not self.index_file.is_file():
            return
        with open(self.index_file, "r+b") as f:
            data = f.read()
            if not data or data.endswith(b"\n"):
                return
            cut = data.rfind(b"\n") + 1
            try:
                json.loads(data[cut:])
                f.write(b"\n")
            except ValueError:
                f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())

    def _order_file(self, epoch: int, step: int) -> Path:
        return self.folder / f"round-e{epoch:04d}-s{step:010d}.npy"

    def _scores_file(self, epoch: int, step: int) -> Path:
        return self.folder / f"round-e{epoch:04d}-s{step:010d}.scores.npy"

    @staticmethod
    def _save_npy(path: Path, array: np.ndarray) -> None:
        tmp = path.with_name(path.name[:-len(".npy")] + ".tmp.npy")
        with open(tmp, "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def append(self, *, epoch: int, step: int, start: int, keep: int, window_ids: np.ndarray, stats: dict,
               scores: np.ndarray | None = None, rule: str = "window") -> None:
        """Log one round: ``window_ids`` the window's new order; ``scores`` (optional, aligned with
        ``window_ids``) what the round scored them, read back by :meth:`previous_scores` after a resume.
        ``rule``: ``"window"`` (:func:`rewrite_order` with ``keep``) or ``"pull"`` (``window_ids`` pulled
        forward to ``start`` from anywhere later in the epoch: :func:`~olmo_tda.training.mixture.pull_forward`)."""
        if rule not in ("window", "pull"):
            raise ConfigError(f"unknown round rule {rule!r}")
        if not self.writer:
            return
        path = self._order_file(epoch, step)
        self._save_npy(path, np.asarray(window_ids, dtype=np.int64))
        record = {"epoch": epoch, "step": step, "start": int(start), "keep": int(keep),
                  "window": int(len(window_ids)), "file": path.name}
        if rule != "window":
            record["rule"] = rule
        if scores is not None:
            if len(scores) != len(window_ids):
                raise ConfigError(f"{len(scores)} scores for a window of {len(window_ids)}")
            scores_path = self._scores_file(epoch, step)
            self._save_npy(scores_path, np.asarray(scores, dtype=np.float64))
            record["scores_file"] = scores_path.name
        fsync_dir(self.folder)        # the round's files are on disk before the line that points at them
        self._mend_tail()
        line = json.dumps({**record, **stats})
        with open(self.index_file, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def previous_scores(self, epoch: int, step: int) -> dict[int, float] | None:
        """``{id: score}`` of the last logged round before (epoch, step), or None when there is none or
        it kept no scores (a log from before scores were kept, or a damaged scores file: only the
        ``rank_corr_prev`` statistic needs them)."""
        earlier = [r for r in self.rounds() if (r["epoch"], r["step"]) < (epoch, step)]
        if not earlier or "scores_file" not in earlier[-1]:
            return None
        last = earlier[-1]
        try:
            ids = np.load(self.folder / last["file"], allow_pickle=False)
            scores = np.load(self.folder / last["scores_file"], allow_pickle=False)
        except (OSError, ValueError):
            return None
        if ids.shape != scores.shape or ids.ndim != 1:
            return None
        return dict(zip(ids.tolist(), scores.astype(np.float64).tolist()))

    def replay(self, base_order: np.ndarray, epoch: int, upto_step: int) -> tuple[np.ndarray, int]:
        """``(order, rounds applied)``: ``base_order`` with the logged rounds of ``epoch`` up to
        ``upto_step`` applied in order."""
        order = np.array(base_order, dtype=np.int64)
        applied = 0
        for r in self.rounds():
            if r["epoch"] != epoch or r["step"] > upto_step:
                continue
            path = self.folder / r["file"]
            try:
                window_ids = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as e:
                raise SelectionError(f"selection round file {path} cannot be read ({e}): the run's data "
                                     "order cannot be reproduced") from None
            if r.get("rule", "window") == "pull":
                from .mixture import pull_forward

                order = pull_forward(order, r["start"], window_ids)
            else:
                order = rewrite_order(order, r["start"], window_ids, r["keep"])
            applied += 1
        return order, applied

    def truncate_after(self, epoch: int, step: int) -> int:
        """Forget rounds after (epoch, step) — a resume from that checkpoint re-runs them. Returns
        how many were dropped."""
        rounds = self.rounds()
        keep = [r for r in rounds if (r["epoch"], r["step"]) <= (epoch, step)]
        if not self.writer:
            return len(rounds) - len(keep)
        if len(keep) == len(rounds):
            self._mend_tail()       # a torn last line must not glue itself to the next round
            return 0
        tmp = self.index_file.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in keep))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.index_file)
        fsync_dir(self.folder)
        for r in rounds:
            if (r["epoch"], r["step"]) > (epoch, step):
                (self.folder / r["file"]).unlink(missing_ok=True)
                if "scores_file" in r:
                    (self.folder / r["scores_file"]).unlink(missing_ok=True)
        return len(rounds) - len(keep)


class DataOrder:
    """The data order of a loop that consumes a base permutation per epoch (``base(epoch)``), position
    by position, with the selection rounds of ``log`` applied: what a loop without OLMo's order file
    (the DeepSpeed example) reads its example ids from. Global position p is example
    ``epoch_order(p // num)[p % num]``."""

    def __init__(self, num: int, base: Callable[[int], np.ndarray], log: SelectionLog | None = None):
        self.num = num
        self.base = base
        self.log = log
        self._orders: dict[int, np.ndarray] = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            order = np.asarray(self.base(epoch), dtype=np.int64)
            if self.log is not None:
                order, _ = self.log.replay(order, epoch, np.iinfo(np.int64).max)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return self._orders[epoch]

    def set_epoch_order(self, epoch: int, order: np.ndarray) -> None:
        self._orders[epoch] = np.asarray(order, dtype=np.int64)

    def reset(self) -> None:
        """Forget cached orders (after the log was truncated on resume)."""
        self._orders.clear()

    def ids(self, start: int, count: int) -> np.ndarray:
        """Example ids at global positions ``[start, start + count)``."""
        pos = np.arange(start, start + count)
        return np.asarray([self.epoch_order(int(p) // self.num)[int(p) % self.num] for p in pos], dtype=np.int64)
