"""Which (example id, step) keys a store already holds: duplicate detection for appends.

A resumed run replays steps that may already be stored; those rows must be skipped, not stored
twice. Keeping every key in memory would cost 8 bytes a row forever, so keys are looked up lazily
per step from the shards whose step range covers it (cheap columns: ``ids``, ``steps``). The
writer holds the keys of the step it is appending to in a :class:`StepKeys`, whatever the number of
shards and records that step spans (a post-hoc capture appends every example at one step).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .errors import StoreCorruptError
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
        self._ranges: np.ndarray | None = None    # [2, len(_shards)] step_min, step_max; built when needed
        self._cache: OrderedDict[str, dict[int, np.ndarray]] = OrderedDict()
        self._cache_shards = cache_shards

    def add(self, info: ShardInfo, keys: dict[int, np.ndarray]) -> None:
        self._shards.append(info)
        if self._ranges is not None:
            self._ranges = np.concatenate([self._ranges, [[info.step_min], [info.step_max]]], axis=1)
        self._max_step = info.step_max if self._max_step is None else max(self._max_step, info.step_max)
        self._remember(info.file, keys)

    def ids_at(self, step: int) -> np.ndarray:
        """Sorted unique ids stored at ``step``."""
        if self._max_step is None or step > self._max_step:
            return _EMPTY_IDS
        if self._ranges is None:
            # a resumed run's replayed steps look here once each, over every rank's shards (tens of
            # thousands in a long multi-rank run): one vector compare, not a Python loop over them
            self._ranges = np.array([[s.step_min for s in self._shards], [s.step_max for s in self._shards]],
                                    dtype=np.int64).reshape(2, -1)
        parts, gone = [], []
        for k in np.flatnonzero((self._ranges[0] <= step) & (step <= self._ranges[1])).tolist():
            keys = self._keys(self._shards[k])
            if keys is None:
                gone.append(k)
            elif step in keys:
                parts.append(keys[step])
        if gone:
            # shard names are never reused and a truncation replaces a file in one rename: a shard
            # that is not there is gone for good (another rank's writer, resuming too, cut it after
            # this writer read its index), and its step range must not send every later lookup to it
            self._ranges[:, gone] = [[1], [0]]         # an empty range
        return np.unique(np.concatenate(parts)) if parts else _EMPTY_IDS

    def _keys(self, info: ShardInfo) -> dict[int, np.ndarray] | None:
        """The shard's ids by step; None if its file is gone."""
        name = info.file if info.cut is None else f"{info.file}@{info.cut}"     # cut: its live rows
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        path = os.path.join(self._root, info.file)
        try:
            if not os.path.exists(path):    # HDF5 takes ~30x a stat to fail on a missing file
                return None
            with open_h5(path) as f:
                ids, steps = f["ids"][:], f["steps"][:]
            if (live := info.live(steps)) is not None:
                ids, steps = ids[live], steps[live]
            keys = _group_by_step(ids, steps)
        except FileNotFoundError:  # another rank truncated it since we scanned
            return None
        except (OSError, KeyError, ValueError, RuntimeError) as e:   # damaged since it was indexed?
            raise StoreCorruptError(
                f"gradient store shard {path} cannot be read for the duplicate check of step(s) "
                f"{info.step_min}..{info.step_max} ({type(e).__name__}: {e}); if the file is damaged, restore "
                "it, or open the store with GradientStore.open(path, repair=True) to quarantine it") from e
        self._remember(name, keys)
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
