"""Which (example id, step) keys a store already holds: duplicate detection for appends.

A resumed run replays steps that may already be stored; those rows must be skipped, not stored
twice. Keeping every key in memory would cost 8 bytes a row forever, so keys are looked up lazily
per step from the shards whose step range covers it (cheap columns: ``ids``, ``steps``). The
writer holds the keys of the step it is appending to in a :class:`StepKeys`, whatever the number of
shards and records that step spans (a post-hoc capture appends every example at one step).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from .format import ShardInfo, open_h5

__all__ = ["KeyIndex", "StepKeys"]

_EMPTY_IDS = np.zeros(0, dtype=np.int64)


class KeyIndex:
    """The (id, step) keys already durable in the store, for duplicate detection on append.

    Looked up lazily: a step beyond every stored step (the normal case while training) costs
    nothing; an older step (a replay after resume) reads the ``ids``/``steps`` columns of the few
    shards whose step range covers it, caching the last few shards' keys.
    """

    def __init__(self, root: Path, shards: list[ShardInfo], cache_shards: int = 8):
        self._root = root
        self._shards = list(shards)
        self._max_step = max((s.step_max for s in self._shards), default=None)
        self._cache: OrderedDict[str, dict[int, np.ndarray]] = OrderedDict()
        self._cache_shards = cache_shards

    def add(self, info: ShardInfo, keys: dict[int, np.ndarray]) -> None:
        self._shards.append(info)
        self._max_step = info.step_max if self._max_step is None else max(self._max_step, info.step_max)
        self._remember(info.file, keys)

    def ids_at(self, step: int) -> np.ndarray:
        """Sorted unique ids stored at ``step``."""
        if self._max_step is None or step > self._max_step:
            return _EMPTY_IDS
        parts = []
        for info in self._shards:
            if info.step_min <= step <= info.step_max:
                keys = self._keys(info)
                if step in keys:
                    parts.append(keys[step])
        return np.unique(np.concatenate(parts)) if parts else _EMPTY_IDS

    def _keys(self, info: ShardInfo) -> dict[int, np.ndarray]:
        if info.file in self._cache:
            self._cache.move_to_end(info.file)
            return self._cache[info.file]
        try:
            with open_h5(self._root / info.file) as f:
                keys = _group_by_step(f["ids"][:], f["steps"][:])
        except FileNotFoundError:  # another rank truncated it since we scanned
            keys = {}
        self._remember(info.file, keys)
        return keys

    def _remember(self, file: str, keys: dict[int, np.ndarray]) -> None:
        self._cache[file] = keys
        self._cache.move_to_end(file)
        while len(self._cache) > self._cache_shards:
            self._cache.popitem(last=False)


def _group_by_step(ids: np.ndarray, steps: np.ndarray) -> dict[int, np.ndarray]:
    order = np.lexsort((ids, steps))
    ids, steps = ids[order], steps[order]
    cuts = np.flatnonzero(np.diff(steps)) + 1
    return {int(s[0]): i for s, i in zip(np.split(steps, cuts), np.split(ids, cuts)) if len(s)}


class StepKeys:
    """The ids already held at one step, for duplicate checks while appending to it: a set of recent
    additions and a few sorted, disjoint runs. A full set (``merge_at`` ids) becomes a run; a run
    merges with the one before it while that one is at most twice its size, so there are O(log n)
    runs and each id is re-merged O(log n) times. A lookup of b ids costs O(b log² n); appending a
    whole step of n ids costs O(n log n) (an ``isin`` against every earlier id was quadratic).
    Memory: 8 bytes per held id, plus the set."""

    def __init__(self, step: int, ids: np.ndarray = _EMPTY_IDS, merge_at: int = 1 << 16):
        self.step = step
        held = np.unique(np.asarray(ids, dtype=np.int64))
        self._runs: list[np.ndarray] = [held] if len(held) else []
        self._recent: set[int] = set()
        self._merge_at = merge_at

    def __len__(self) -> int:
        return sum(len(run) for run in self._runs) + len(self._recent)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``ids`` are held."""
        ids = np.asarray(ids, dtype=np.int64)
        hit = np.zeros(len(ids), dtype=bool)
        for run in self._runs:
            hit |= run[np.minimum(np.searchsorted(run, ids), len(run) - 1)] == ids
        if self._recent:
            hit |= np.fromiter((i in self._recent for i in ids.tolist()), dtype=bool, count=len(ids))
        return hit

    def add(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        self._recent.update(ids[~self.contains(ids)].tolist())
        if len(self._recent) < self._merge_at:
            return
        self._runs.append(np.sort(np.fromiter(self._recent, dtype=np.int64, count=len(self._recent))))
        self._recent = set()
        while len(self._runs) > 1 and len(self._runs[-2]) <= 2 * len(self._runs[-1]):
            last = self._runs.pop()
            # two sorted runs: numpy's stable sort (timsort/radix) merges them in linear time
            self._runs[-1] = np.sort(np.concatenate([self._runs[-1], last]), kind="stable")
