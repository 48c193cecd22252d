"""Shared timing for the overhead benchmarks: one block of steps for one arm, measured fairly."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence


def timed_block(step: Callable[[Any], None], batches: Sequence[Any], capture=None, store=None,
                sync: Callable[[], None] | None = None, phases: dict | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds per step of ``step(batch)`` over ``batches``.

    The arm's capture is resumed for the block and paused after it; its store is flushed inside
    the timing, so the writer thread's encoding, HDF5 and fsync work is charged to this arm and
    never spills into another arm's block. CPU time covers every thread of the process. ``sync``
    (e.g. ``torch.cuda.synchronize``) is called at both ends, so queued device work is counted.
    With ``phases`` (a dict), ``phases["flush"]`` is set to the drain's share: wall seconds per step
    spent in that final ``store.flush()``.
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
    t_flush = time.perf_counter()
    if store is not None:
        store.flush()
    if phases is not None:
        phases["flush"] = (time.perf_counter() - t_flush) / len(batches)
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
    """The arms' table; a ``flush_s`` column (the store's drain, part of wall s/step) where rows have it."""
    flush = any("flush_s" in r for r in rows)
    print(f"{'arm':>8} {'wall s/step':>12} {'wall ratio':>10} {'CPU s/step':>11} {'CPU ratio':>10} "
          f"{'bytes/example':>14}" + (f" {'of it flush s':>13}" if flush else ""))
    for r in rows:
        print(f"{r['arm']:>8} {r['median_s']:>12.3f} {r['ratio']:>10.3f} {r['cpu_s']:>11.3f} {r['cpu_ratio']:>10.3f} "
              f"{r['bytes_per_example']:>14.0f}"
              + (f" {r['flush_s']:>13.3f}" if "flush_s" in r else (f" {'—':>13}" if flush else "")))
