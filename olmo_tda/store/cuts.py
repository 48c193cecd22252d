"""Cut markers: how a rank's rows are cut back without rewriting a shard.

``truncate_after(step)`` (a resume from an earlier checkpoint) writes ``shards/r{rank}-{seq}.cut.json``
at the rank's next seq: every row of the rank with a step after ``step``, in a shard before that seq,
is void. Markers are never removed. Whoever lists the store applies them (:func:`cuts_after`,
:func:`apply_cut`): a shard wholly after the cut is dropped (its writer removes the file), one the cut
runs through keeps its file and its live rows are those with ``steps <= cut`` (``ShardInfo.cut``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from bisect import bisect_right
from dataclasses import replace
from pathlib import Path

from .errors import StoreCorruptError, describe_os_error
from .format import FORMAT_NAME, SHARD_DIR, ShardInfo, open_h5, write_json_atomic

__all__ = ["apply_cut", "cut_name", "cuts_after", "parse_cut_name", "read_cut", "remove_void", "write_cut"]

logger = logging.getLogger(__name__)

_CUT_RE = re.compile(r"^r(\d{5})-(\d{8})\.cut\.json$")


def apply_cut(root: Path, info: ShardInfo, step: int) -> ShardInfo | None:
    """``info`` with its rows of steps after ``step`` void (a cut marker after it), or None when none
    is left. Only a shard the cut runs through is read (its ``steps``); the file is never changed."""
    if info.step_min > step:
        return None
    if info.step_max <= step:
        return info
    path = root / info.file
    try:
        with open_h5(path) as f:
            steps = f["steps"][:]
    except FileNotFoundError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        raise StoreCorruptError(f"gradient store shard {path} is unreadable ({type(e).__name__}: {e}); open the "
                                "store with GradientStore.open(path, repair=True) to move it to quarantine/") from e
    live = steps <= step
    return replace(info, num_rows=int(live.sum()), step_max=int(steps[live].max()), cut=step,
                   stored_rows=info.file_rows)


def cut_name(rank: int, seq: int) -> str:
    return f"{SHARD_DIR}/r{rank:05d}-{seq:08d}.cut.json"


def parse_cut_name(name: str) -> tuple[int, int] | None:
    """``(rank, seq)`` of a cut marker's file name (basename), or None for anything else."""
    m = _CUT_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def write_cut(root: Path, rank: int, seq: int, step: int) -> None:
    """Cut rank ``rank`` back to ``step``: its rows of later steps in shards before ``seq`` are void.
    The marker takes the place of shard ``seq`` in the rank's sequence and is durable on return."""
    write_json_atomic(root / cut_name(rank, seq), {"format": FORMAT_NAME + ".cut", "format_version": 1,
                                                   "rank": rank, "seq": seq, "step": int(step)})


def read_cut(root: Path, rel: str) -> int:
    """The step of cut marker ``rel``; :class:`StoreCorruptError` naming it if it is not what
    :func:`write_cut` writes."""
    path = root / rel
    parsed = parse_cut_name(path.name)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        data, problem = None, f"{type(e).__name__}: {e}"
    else:
        problem = "not a cut marker of its rank and seq"
    if not (isinstance(data, dict) and data.get("format") == FORMAT_NAME + ".cut" and parsed is not None
            and (data.get("rank"), data.get("seq")) == parsed and type(data.get("step")) is int
            and data["step"] >= 0):
        raise StoreCorruptError(f"gradient store cut marker {path} is damaged ({problem}); it voids the rank's "
                                "rows after a step a resume went back to: restore it from a copy (deleting it "
                                "would bring an abandoned run's rows back)")
    return data["step"]


def cuts_after(cuts: dict[int, int]):
    """``seq -> the lowest step of a cut marker after seq`` (None: no cut after it)."""
    seqs = sorted(cuts)
    floor, low = [], None
    for seq in reversed(seqs):      # suffix minima: the earliest step any later marker cut back to
        low = cuts[seq] if low is None else min(low, cuts[seq])
        floor.append(low)
    floor.reverse()

    def after(seq: int) -> int | None:
        at = bisect_right(seqs, seq)
        return floor[at] if at < len(seqs) else None
    return after


def remove_void(root: Path, rel: str) -> None:
    """Remove shard ``rel``, whose every row a cut voids, once no manifest names it. A failure is only
    logged: the cut voids its rows for every reader, and the rank's next writer removes it."""
    try:
        os.unlink(root / rel)
        logger.info("gradient store %s: removed %s, whose rows a cut marker voids", root, rel)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("gradient store %s: could not remove %s, whose rows the cut voids (%s); the rank's next "
                       "writer removes it", root, rel, describe_os_error(e))
