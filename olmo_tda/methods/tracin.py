"""TracIn over a training trajectory: checkpoint (TracIn-CP) and in-run variants.

Scores are per training *example* (summed over the steps or checkpoints it contributes to), not per
row. Shapes: Q queries, n examples in a batch, D_l the flattened width of layer l.

- **TracIn-CP**: ``score(q, z) = Σ_k η_k ⟨ĝ(θ_k, q), ĝ(θ_k, z)⟩`` over kept checkpoints k, with
  ``η_k`` the learning rate of step k+1, the step that used gradients at θ_k
  (:attr:`~olmo_tda.training.trajectory.TrajectoryCheckpoint.tracin_lr`). Gradients are recomputed
  at every checkpoint through the run's own projectors; the per-checkpoint ``[Q, N]`` scores are
  written atomically under a work directory named by everything they depend on, one file per
  checkpoint named by its step and content id, so an interrupted pass resumes where it stopped and a
  rewritten checkpoint is scored again. A damaged file there is recomputed; non-finite scores are
  refused, naming the checkpoint, rather than ranked.
- **In-run TracIn**: ``score(q, z) = Σ_{s: z used at s} (η_s / loss_scale_s) ⟨ĝ(θ_c(s), q), ĝ_z,s⟩``,
  with ``ĝ_z,s`` the gradient captured while training (at θ_{s-1}) and ``c(s)`` the kept checkpoint
  nearest to θ_{s-1}. With a checkpoint at every step it is exactly the first-order TracIn-ideal of
  plain SGD: the loss change of q that step s's update attributes to z, ``η_s ⟨∇L_q, ∇ℓ_z⟩ / loss_scale_s``.
  Under Adam the update is not ``η·g``, so like TracIn-CP it is the usual gradient-similarity
  approximation; with sparser checkpoints the query gradient is also taken at a nearby θ.

Example (the OLMo run wrapper supplies the callables; see ``OLMoRun.attribute``)::

    scores, ids = tracin_cp(checkpoints, query_grads_at, train_grads_at, work_dir="run/tda/tracin")
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from ..config import ConfigError
from ..ops import inner
from .base import AttributionError, AttributionResult, BasisQueries, _top_unique

__all__ = ["tracin_cp", "tracin_inrun", "top_examples", "nearest_checkpoint"]

log = logging.getLogger(__name__)

Grads = dict[str, torch.Tensor]
_SCORE_FORMAT = 2
"""Part of the resume key: bumped when how per-checkpoint scores are computed changes (2: float64 dots)."""


def _flat_dot(queries: Grads, grads: Grads, layers: Sequence[str]) -> torch.Tensor:
    """``[Q, n]`` = Σ_l ⟨q_l, g_l⟩ in float64: TracIn sums many dot products that largely cancel
    (scores ~100x smaller than |q|·|g| on a trained model), so fp32 accumulation would cost ~1e-4
    relative accuracy; Q is small, so the float64 matmul is cheap."""
    out = None
    for name in layers:
        s = inner(queries[name].double(), grads[name].to(torch.float64))
        out = s if out is None else out + s
    return out


def nearest_checkpoint(steps: np.ndarray, checkpoint_steps: Sequence[int]) -> np.ndarray:
    """Index into ``checkpoint_steps`` of the checkpoint nearest to θ_{s-1} for each row step ``s``
    (ties go to the earlier checkpoint)."""
    ck = np.asarray(sorted(checkpoint_steps), dtype=np.int64)
    if not len(ck):
        raise AttributionError("in-run TracIn needs at least one trajectory checkpoint")
    at = np.asarray(steps, dtype=np.int64) - 1                    # the weights the gradient was taken at
    right = np.clip(np.searchsorted(ck, at, side="left"), 0, len(ck) - 1)
    left = np.clip(right - 1, 0, len(ck) - 1)
    return np.where(np.abs(ck[left] - at) <= np.abs(ck[right] - at), left, right)


def _where(ckpt: Any) -> str:
    """A checkpoint named for an error message: its step, and its folder when it has one."""
    path = getattr(ckpt, "path", None)
    return f"checkpoint step {ckpt.step}" + (f" ({path})" if path is not None else "")


def _check_finite(values: torch.Tensor, what: str) -> None:
    """Refuse NaN/inf ``values`` (``what``: whose, for the message): ranked, they give a silent wrong answer."""
    if not bool(torch.isfinite(values).all()):
        bad = int((~torch.isfinite(values)).sum())
        raise AttributionError(f"tracin: {what}: {bad} of {values.numel()} values are NaN/inf (weights or gradients "
                               f"overflowed or are damaged); refusing to rank them")


def _read_scores(part_file: Path) -> tuple[torch.Tensor, np.ndarray] | None:
    """Cached ``(scores [Q, N], ids [N])``, or None for a file that is missing or damaged (warned and
    removed: it is recomputed)."""
    try:
        with np.load(part_file, allow_pickle=False) as saved:
            scores, ids = saved["scores"], saved["ids"]
        if scores.ndim != 2 or ids.ndim != 1 or scores.shape[1] != len(ids):
            raise ValueError(f"scores {scores.shape} and ids {ids.shape} do not match")
        if not np.isfinite(scores).all():       # cached before non-finite scores were refused
            raise ValueError("non-finite scores")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        log.warning("tracin: cached scores %s are damaged (%s: %s): recomputing them", part_file, type(e).__name__, e)
        part_file.unlink(missing_ok=True)
        return None
    return torch.from_numpy(scores), ids


def _write_scores(part_file: Path, scores: torch.Tensor, ids: np.ndarray) -> None:
    """Atomically, under a temporary name of this writer's own (two identical queries may run at once)."""
    tmp = part_file.with_name(f".{part_file.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, scores=scores.numpy(), ids=ids)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, part_file)
    finally:
        tmp.unlink(missing_ok=True)


def tracin_inrun(store: Any, query_grads_at: Callable[[int], Grads], checkpoint_steps: Sequence[int], *,
                 layers: Iterable[str] | None = None, block_size: int | None = None,
                 progress: Callable[[int], None] | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """In-run TracIn scores ``([Q, E] float64, example ids [E])`` from a store's captured rows.

    ``query_grads_at(step)`` gives the query gradients at the kept checkpoint of that step (called
    once per checkpoint that some row needs). Rows are weighted by their stored ``lr / loss_scale``.
    """
    chosen = list(layers) if layers is not None else list(store.layers)
    ck = sorted(int(s) for s in checkpoint_steps)
    cache: dict[int, Grads] = {}
    acc: torch.Tensor | None = None
    for block in store.iter_blocks(layers=chosen, block_size=block_size):
        which = nearest_checkpoint(block.steps, ck)
        weight = torch.from_numpy(np.asarray(block.lr, dtype=np.float64)
                                  / np.asarray(block.loss_scale, dtype=np.float64))
        scores = None
        for c in np.unique(which):
            if ck[c] not in cache:
                cache[ck[c]] = query_grads_at(ck[c])
                versions = cache[ck[c]].values() if isinstance(cache[ck[c]], BasisQueries) else [cache[ck[c]]]
                for name in chosen:
                    for grads in versions:
                        _check_finite(grads[name], f"query gradients of layer {name} at checkpoint step {ck[c]}")
            rows = np.flatnonzero(which == c)
            queries = cache[ck[c]]
            if isinstance(queries, BasisQueries):       # a basis that follows the run: the block's version
                queries = queries.version(block.basis)
            elif getattr(block, "basis", None) is not None:
                raise AttributionError(f"the store's rows were projected with eigenbasis versions; query_grads_at "
                                       f"must return BasisQueries (one projection per version), got "
                                       f"{type(queries).__name__}")
            part = _flat_dot(queries, {n: block.grads[n][rows] for n in chosen}, chosen)
            if scores is None:
                scores = torch.zeros(part.shape[0], len(block.ids), dtype=torch.float64)
            scores[:, rows] = part
        scores *= weight
        ids = np.asarray(block.ids, dtype=np.int64)
        need = int(ids.max()) + 1
        if acc is None:
            acc = torch.zeros(scores.shape[0], need, dtype=torch.float64)
            seen = np.zeros(need, dtype=bool)
        elif acc.shape[1] < need:
            acc = torch.cat([acc, torch.zeros(acc.shape[0], need - acc.shape[1], dtype=torch.float64)], dim=1)
            seen = np.concatenate([seen, np.zeros(need - len(seen), dtype=bool)])
        acc.index_add_(1, torch.from_numpy(ids), scores)
        seen[ids] = True
        if progress is not None:
            progress(len(ids))
    if acc is None:
        raise AttributionError("the store has no rows to score")
    example_ids = np.flatnonzero(seen)
    return acc[:, example_ids], example_ids


def tracin_cp(checkpoints: Sequence[Any], query_grads_at: Callable[[Any], Grads],
              train_grads_at: Callable[[Any], Iterator[tuple[np.ndarray, Grads]]], *,
              layers: Sequence[str], work_dir: str | os.PathLike | None = None, fingerprint: dict | None = None,
              progress: Callable[[str], None] | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """TracIn-CP scores ``([Q, N] float64, example ids [N])``.

    Args:
        checkpoints: :class:`TrajectoryCheckpoint`-like: ``step``, ``tracin_lr`` (the weight η_k) and,
            with ``work_dir``, ``content_id()`` (a string that changes whenever the weights may have).
        query_grads_at: ``ckpt -> {layer: [Q, Ko, Ki]}`` at that checkpoint's weights.
        train_grads_at: ``ckpt -> iterator of (ids [n], {layer: [n, Ko, Ki]})`` at that checkpoint.
        layers: the layers scored.
        work_dir: where per-checkpoint scores are kept so an interrupted pass resumes: a subdirectory
            named by a hash of ``fingerprint`` (queries, ids, projectors...), the layers and the score
            format, holding one file per checkpoint named by its step and a hash of its content id (the
            scores are unweighted, so η is applied after reading and not part of the name).
        progress: called with a message after each checkpoint.
    """
    state_dir = None
    if work_dir is not None:
        key = json.dumps({"fingerprint": fingerprint or {}, "layers": list(layers), "format": _SCORE_FORMAT},
                         sort_keys=True)
        state_dir = Path(work_dir) / hashlib.sha256(key.encode()).hexdigest()[:16]
        state_dir.mkdir(parents=True, exist_ok=True)
        (state_dir / "key.json").write_text(key)
    total, ids_ref = None, None
    for ckpt in checkpoints:
        part_file = None
        if state_dir is not None:
            content = hashlib.sha256(ckpt.content_id().encode()).hexdigest()[:16]
            part_file = state_dir / f"step{int(ckpt.step):08d}-{content}.npz"
            for stale in state_dir.glob(f"step{int(ckpt.step):08d}-*.npz"):   # scores of a rewritten checkpoint
                if stale != part_file:
                    stale.unlink(missing_ok=True)
        cached = _read_scores(part_file) if part_file is not None else None
        if cached is not None:
            scores, ids = cached
            log.info("tracin: checkpoint step %d already scored (%s)", ckpt.step, part_file)
        else:
            queries = query_grads_at(ckpt)
            parts, id_parts = [], []
            for ids_n, grads in train_grads_at(ckpt):
                parts.append(_flat_dot(queries, grads, layers))
                id_parts.append(np.asarray(ids_n, dtype=np.int64))
            scores, ids = torch.cat(parts, dim=1), np.concatenate(id_parts)
        _check_finite(scores, f"scores at {_where(ckpt)}")      # never cached, never ranked
        if cached is None and part_file is not None:
            _write_scores(part_file, scores, ids)
        if not np.isfinite(float(ckpt.tracin_lr)):
            raise AttributionError(f"tracin: {_where(ckpt)} has a non-finite learning rate {ckpt.tracin_lr} in its "
                                   "meta.json")
        if ids_ref is None:
            ids_ref = ids
        elif not np.array_equal(ids, ids_ref):
            raise AttributionError(f"tracin: checkpoint step {ckpt.step} scored other examples than the first one")
        contribution = float(ckpt.tracin_lr) * scores
        total = contribution if total is None else total + contribution
        if progress is not None:
            progress(f"checkpoint step {ckpt.step}")
    if total is None:
        raise AttributionError("TracIn-CP needs at least one trajectory checkpoint")
    return total, ids_ref


def top_examples(method: str, scores: torch.Tensor, ids: np.ndarray, top_k: int, layers: list[str],
                 info: dict | None = None) -> AttributionResult:
    """Top ``top_k`` examples per query as an :class:`AttributionResult` (``step = -1``: all steps);
    ties go to the example earlier in ``ids``, and an id listed twice in ``ids`` is shown once."""
    if top_k < 1:
        raise ConfigError(f"top_k must be >= 1, got {top_k}")
    ids = np.broadcast_to(np.asarray(ids, dtype=np.int64), scores.shape)
    best, best_ids, _ = _top_unique(scores.to(torch.float64), ids, np.zeros_like(ids), top_k)
    return AttributionResult(method=method, layers=layers, scores=best, ids=best_ids,
                             steps=np.full_like(best_ids, -1), num_scored=scores.shape[1], info=info or {})
