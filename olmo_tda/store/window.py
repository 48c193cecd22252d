"""The writer's window: the rows of the steps since the last shard, encoded in the store's words.

Buffers come in segments (:class:`WindowSegment`): the window grows by a segment as large as all
before it, never by copying, and a written window keeps the segments it reached, so steady windows
allocate nothing (touching fresh pages costs about as much as the copy into them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Window", "WindowSegment"]


class WindowSegment:
    """One block of window rows: a buffer per layer in the store's words and one per row field."""

    def __init__(self, capacity: int, row_shapes: list[tuple[int, int]], words: type):
        self.capacity = capacity
        self.used = 0
        self.grads = [np.empty((capacity, *shape), dtype=words) for shape in row_shapes]
        self.ids = np.empty(capacity, dtype=np.int64)
        self.steps = np.empty(capacity, dtype=np.int64)
        self.lr = np.empty(capacity, dtype=np.float64)
        self.loss_scale = np.empty(capacity, dtype=np.float64)

    def fields(self) -> list[np.ndarray]:
        return [*self.grads, self.ids, self.steps, self.lr, self.loss_scale]


class Window:
    """The rows of the window being filled, in segments that records are encoded into directly and
    that are reused from window to window: a flush joins nothing (each segment's rows are written at
    their place in the shard), the pages stay mapped (on the 2-core CPU of ``docs/BENCHMARKS.md``
    touching fresh pages cost about what the copy into them did), and the window grows by adding a
    segment as large as all before it, never by copying. Rows keep their append order.

    Memory held: about the largest window since the last shrink (untouched capacity is not
    resident). :meth:`clear` keeps the segments a window of up to ``keep_bytes`` plus one record
    reached, so steady windows reuse them all; the rest of a window that grew past that (a disk
    that failed for a while) is released once it is written, down to the fewest leading segments
    that hold ``keep_bytes`` (segments double, so up to about twice that)."""

    def __init__(self, row_shapes: list[tuple[int, int]], words: type, keep_bytes: float):
        self.row_shapes, self.words, self.keep_bytes = row_shapes, words, keep_bytes
        self.row_bytes = sum(int(np.prod(shape)) for shape in row_shapes) * np.dtype(words).itemsize
        self.segments: list[WindowSegment] = []
        self.rows = 0
        self._at = 0                           # index of the segment being filled
        self._largest_record = 0               # rows of the largest record reserved so far

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def capacity(self) -> int:
        return sum(seg.capacity for seg in self.segments)

    def reserve(self, n: int) -> tuple[WindowSegment, int]:
        """``(segment, lo)``: where the next ``n`` rows go (rows ``lo:lo + n`` of the segment)."""
        self._largest_record = max(self._largest_record, n)
        while self._at < len(self.segments):
            seg = self.segments[self._at]
            if seg.capacity - seg.used >= n:
                return seg, seg.used
            self._at += 1                      # full, or too small for this record: left as it is
        seg = WindowSegment(max(n, self.capacity, 64), self.row_shapes, self.words)
        self.segments.append(seg)
        return seg, 0

    def commit(self, seg: WindowSegment, lo: int, keep: np.ndarray, ids: np.ndarray, step: int, lr: float,
               loss_scale: float | np.ndarray) -> None:
        """Make the rows encoded at ``seg[lo:]`` part of the window, keeping those in ``keep`` (in
        order); ``ids`` are the kept rows' ids. Must follow :meth:`reserve` and the encoding."""
        n = int(keep.sum())
        if n != len(keep):
            for buf in seg.grads:
                buf[lo:lo + n] = buf[lo:lo + len(keep)][keep]
        scale = np.broadcast_to(np.asarray(loss_scale, dtype=np.float64), keep.shape)
        seg.ids[lo:lo + n] = ids
        seg.steps[lo:lo + n] = step
        seg.lr[lo:lo + n] = lr
        seg.loss_scale[lo:lo + n] = scale[keep]
        seg.used = lo + n
        self.rows += n

    def chunks(self) -> list[dict[str, Any]]:
        """The window as chunks of :func:`~.format.prepare_shard`, in row order (views, valid until
        the next change)."""
        return [{"ids": seg.ids[:seg.used], "steps": seg.steps[:seg.used], "lr": seg.lr[:seg.used],
                 "loss_scale": seg.loss_scale[:seg.used], "grads": [g[:seg.used] for g in seg.grads]}
                for seg in self.segments if seg.used]

    def rows_after(self, step: int) -> int:
        """How many rows are of steps after ``step``."""
        return sum(int((seg.steps[:seg.used] > step).sum()) for seg in self.segments)

    def drop_steps_after(self, step: int) -> int:
        """Remove the rows of steps after ``step``; return how many."""
        dropped = 0
        for seg in self.segments:
            keep = seg.steps[:seg.used] <= step
            n = int(keep.sum())
            if n != seg.used:
                for buf in seg.fields():
                    buf[:n] = buf[:seg.used][keep]
                dropped, seg.used = dropped + seg.used - n, n
        self.rows -= dropped
        # appends go on after the last rows still held (segments after it are empty: order holds)
        self._at = max((i for i, seg in enumerate(self.segments) if seg.used), default=0)
        return dropped

    def release(self) -> None:
        """Empty the window and free every segment."""
        self.segments, self.rows, self._at = [], 0, 0

    def clear(self) -> None:
        """Empty the window. A window within ``keep_bytes`` plus one record keeps every segment it
        reached; a larger one keeps the fewest leading segments that hold ``keep_bytes``."""
        if self.nbytes <= self.keep_bytes + self._largest_record * self.row_bytes:
            kept = self._at + 1
        else:
            held, kept = 0, 0
            while kept < len(self.segments) and held < self.keep_bytes:
                held, kept = held + self.segments[kept].capacity * self.row_bytes, kept + 1
        del self.segments[kept:]
        for seg in self.segments:
            seg.used = 0
        self.rows, self._at = 0, 0
