"""Shared timing for the overhead benchmarks: one block of steps for one arm, measured fairly."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence


def timed_block(step: Callable[[Any], None], batches: Sequence[Any], capture=None, store=None,
                sync: Callable[[], None] | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds per step of ``step(batch)`` over ``batches``.

    The arm's capture is resumed for the block and paused after it; its store is flushed inside
    the timing, so the writer thread's encoding, HDF5 and fsync work is charged to this arm and
    never spills into another arm's block. CPU time covers every thread of the process. ``sync``
    (e.g. ``torch.cuda.synchronize``) is called at both ends, so queued device work is counted.
    """
    if capture is not None:
        capture.resume()
    if sync is not None:
        sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for batch in batches:
        step(batch)
    if sync is not None:
        sync()
    if store is not None:
        store.flush()
    wall, cpu = (time.perf_counter() - t0) / len(batches), (time.process_time() - c0) / len(batches)
    if capture is not None:
        capture.pause()
    return wall, cpu


def summarize(names, times, cpu_times, bytes_per_arm, examples) -> list[dict]:
    """Per arm: medians of wall and CPU s/step, ratios to the ``plain`` arm, bytes per example."""
    import statistics

    plain = statistics.median(times["plain"])
    plain_cpu = statistics.median(cpu_times["plain"])
    rows = []
    for arm in names:
        med, med_cpu = statistics.median(times[arm]), statistics.median(cpu_times[arm])
        rows.append({"arm": arm, "median_s": med, "ratio": med / plain, "cpu_s": med_cpu,
                     "cpu_ratio": med_cpu / plain_cpu,
                     "bytes_per_example": bytes_per_arm[arm] / max(1, examples[arm])})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'arm':>6} {'wall s/step':>12} {'wall ratio':>10} {'CPU s/step':>11} {'CPU ratio':>10} {'bytes/example':>14}")
    for r in rows:
        print(f"{r['arm']:>6} {r['median_s']:>12.3f} {r['ratio']:>10.3f} {r['cpu_s']:>11.3f} {r['cpu_ratio']:>10.3f} "
              f"{r['bytes_per_example']:>14.0f}")
