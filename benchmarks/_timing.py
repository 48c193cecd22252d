"""Shared timing for the overhead benchmarks: one block of steps for one arm, measured fairly."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence


def timed_block(step: Callable[[Any], None], batches: Sequence[Any], capture=None, store=None) -> tuple[float, float]:
    """(wall, CPU) seconds per step of ``step(batch)`` over ``batches``.

    The arm's capture is resumed for the block and paused after it; its store is flushed inside
    the timing, so the writer thread's encoding, HDF5 and fsync work is charged to this arm and
    never spills into another arm's block. CPU time covers every thread of the process.
    """
    if capture is not None:
        capture.resume()
    t0, c0 = time.perf_counter(), time.process_time()
    for batch in batches:
        step(batch)
    if store is not None:
        store.flush()
    wall, cpu = (time.perf_counter() - t0) / len(batches), (time.process_time() - c0) / len(batches)
    if capture is not None:
        capture.pause()
    return wall, cpu
