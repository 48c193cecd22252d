"""Per-rank manifests, writer locks, and the open-time reconciliation of manifests with shard files.

Each rank's writer keeps ``manifest-r{rank:05d}.json``: its shards (:class:`ShardInfo`), counters and
the next shard sequence number. A flush rewrites it; to keep that small however long the run, it
lists only the newest shards itself: each time :data:`SEAL_SHARDS` more have collected there, the
oldest block of them is *sealed* into a segment file ``index/r{rank:05d}-{first seq:08d}-{token}.json``,
written once and named by the manifest (a truncation or repair that changes a sealed shard writes
its block again under a new name). Segments no manifest names (the debris of a crash, or blocks
replaced) are deleted by the rank's writer when it opens and closes, never while it runs, so a
writer never loses a block its index names; a reader that finds a named block gone (removed by an
open or close after it read the manifest) reads the manifest again. The manifest is an index for
speed; **the shard files are the truth**. :func:`scan_store` reconciles the two:

- a shard on disk but not in the manifest (crash between rename and manifest write) is validated
  and adopted;
- a manifest entry whose file size differs (a file put in its place; or an older olmo_tda's crash
  while it rewrote a shard on a cut) is re-read from the file;
- the rank's cut markers, listed with the shards, are applied to every shard before them (a crash
  after a marker, before the manifest said so, leaves the cut in force);
- a listed shard that is missing, or any shard that cannot be read, raises :class:`StoreCorruptError`
  naming the file — or, with ``repair=True``, is moved to ``quarantine/`` and dropped from the index;
- a manifest that is not what a writer writes (a field missing or of the wrong type) raises
  :class:`StoreCorruptError` naming the file and the field (``repair=True`` rebuilds it from the shards);
- leftover ``*.tmp`` files are deleted, but only for ranks whose writer is provably gone (its
  ``locks/r{rank}.lock`` flock can be taken), so opening a store never disturbs a live writer.

Opening is safe while writers append or truncate. ``shards/`` is listed before the manifests are read,
so for a rank that is not the opener's own (its writer may be live) a shard that its manifest lists
but the listing missed is looked up again (renamed into place after the listing); one that is not
there is dropped if the manifest, read again, no longer lists it (``truncate_after`` updates the
manifest before it deletes files); and a listed file that is gone by the time it is read is simply
gone. A shard that the manifest still lists and that is not on disk is an error, live writer or not.
Another rank's lock is taken only to delete its dead writer's debris, never held through the
reconcile (unless repairing): a resuming run's ranks all open at once, and each one's writer waits
for its own lock (``LOCK_WAIT_S``) while other ranks' opens would hold it for a long scan each.
Cuts: ``truncate_after`` never rewrites a shard. It writes a *cut marker*
``shards/r{rank:05d}-{seq:08d}.cut.json`` (the rank's next seq), which voids the rank's rows of
later steps in every shard before it, then the manifest (``cuts``, and each cut shard's live
``num_rows``/``step_max`` with ``cut`` and ``stored_rows``), then removes the shards left with no
live row. The listed markers are applied at every open, so a crash after the marker leaves the cut
in force and a shard it voided (not yet removed) is dropped, and removed by the rank's writer.

A writer stats another rank's shards only when that rank's manifest has ``truncating`` set (an
older olmo_tda, which rewrote shards on a cut, set it while it did) or lacks the flag; a rank's own
open reconciles all of its shards and clears it. For a writer, then, another rank's manifest stands
for its files unless flagged; readers check every shard as above.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
import warnings
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from olmo_tda.config import StoreDType
from olmo_tda.errors import TDAError

from .cuts import apply_cut, cuts_after, parse_cut_name, read_cut, remove_void
from .locks import RankLock
from .errors import StoreCorruptError, StoreError, describe_os_error
from .format import (
    FORMAT_NAME,
    QUARANTINE_DIR,
    SEGMENT_DIR,
    SHARD_DIR,
    STORE_JSON,
    TMP_SUFFIX,
    ShardInfo,
    fsync_dir,
    parse_manifest_name,
    parse_shard_name,
    read_shard_info,
    shard_name,
    write_json_atomic,
)

__all__ = ["COUNTERS", "SEAL_SHARDS", "RankState", "Segment", "manifest_path", "read_manifest",
           "write_manifest", "remove_unlisted_segments", "scan_store"]

logger = logging.getLogger(__name__)

COUNTERS = ("records_appended", "rows_written", "rows_skipped_nonfinite", "rows_skipped_duplicate",
            "rows_truncated")
_SHARD_TMP_RE = re.compile(r"^r(\d{5})-\d{8}\.(?:h5|cut\.json)" + re.escape(TMP_SUFFIX) + "$")
_MANIFEST_TMP_RE = re.compile(r"^manifest-r(\d{5})\.json" + re.escape(TMP_SUFFIX) + "$")
_SEGMENT_RE = re.compile(r"r([0-9]{5})-([0-9]{8})-[0-9a-f]{8}\.json")                     # fullmatch only
_SEGMENT_ANY_RE = re.compile(r"r([0-9]{5})-[0-9]{8}-[0-9a-f]{8}\.json(" + re.escape(TMP_SUFFIX) + ")?")
_STALE_STORE_JSON_TMP_S = 600.0  # store.json is written once, in milliseconds; older temps are debris


LEGACY_LOG_ID = "legacy"
"""The truncation log id of a manifest written before logs had ids."""

SEAL_SHARDS = 256
"""Shards per sealed segment: a rank's manifest lists fewer than this many shards past its last
segment (~40 KB) plus one line per segment, so a flush's rewrite stays that size at any run length."""

MANIFEST_VERSION = 3
"""1: every shard in the manifest (``shards``); 2: the newest in ``recent_shards``, older ones in the
segments it names, and ``shards`` a string an olmo_tda that reads only version 1 (and does not check
the version) refuses with it, instead of adopting every sealed shard as unlisted; 3: as 2, with cut
markers (``cuts``, and entries whose ``num_rows`` count live rows only, fewer than the file holds),
which an olmo_tda that reads version 2 refuses instead of reading voided rows (or a repair by it
bringing them back). Versions 1 and 2 are still read, and written while a rank has no cut (and no
segment, for 1)."""

_V2_SHARDS = ("this manifest's shards are in recent_shards and the index/ segments it names (format_version 2 "
              "or later): upgrade olmo_tda to open this store")


@dataclass(frozen=True)
class Segment:
    """A sealed block of a rank's index: the shards with seqs ``first_seq..last_seq``, in ``file``
    (relative to the store root) as they were when it was written (``shards``, compared by identity
    first, so telling an unchanged block costs a pointer per shard)."""

    file: str
    first_seq: int
    last_seq: int
    shards: tuple[ShardInfo, ...] = field(compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "first_seq": self.first_seq, "last_seq": self.last_seq,
                "num_shards": len(self.shards)}


@dataclass
class RankState:
    """One rank's index: shards by seq, cumulative counters, the next shard seq to use, and the
    steps its rows were truncated after, in order (each resume adds one; a checkpoint records how
    many there were, so a later resume can tell a rollback below its step happened since), under an
    id of its own: a log rebuilt from the shard files (``repair``) starts empty under a new id."""

    rank: int
    shards: dict[int, ShardInfo] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    next_seq: int = 0
    truncations: list[int] = field(default_factory=list)
    log_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    segments: list[Segment] = field(default_factory=list)
    """The sealed blocks as last written or read, by seq; shards outside them are listed in the manifest."""
    truncating: bool | None = False
    """True in a manifest of an olmo_tda that rewrote shards on a cut, written while it did (a crash
    then left files longer than their entries); None: read from a manifest written before the flag.
    Shards are never rewritten now, so it is written False."""
    cuts: dict[int, int] = field(default_factory=dict)
    """The rank's cut markers: seq -> the step its earlier shards' rows were cut back to."""

    def copy(self) -> "RankState":
        return RankState(rank=self.rank, shards=dict(self.shards), counters=dict(self.counters),
                         next_seq=self.next_seq, truncations=list(self.truncations), log_id=self.log_id,
                         segments=list(self.segments), truncating=self.truncating, cuts=dict(self.cuts))

    def to_json(self, listed: list[int] | None = None) -> dict[str, Any]:
        """The manifest: ``listed`` shards (default all) and the segments, which hold the others."""
        listed = sorted(self.shards) if listed is None else listed
        version = 3 if self.cuts else 2 if self.segments else 1
        out = {"format": FORMAT_NAME + ".manifest", "format_version": version,
               "rank": self.rank, "next_seq": self.next_seq, "counters": dict(self.counters),
               "truncations": list(self.truncations), "log_id": self.log_id,
               "truncating": bool(self.truncating), "cuts": {str(seq): step for seq, step in sorted(self.cuts.items())}}
        entries = [self.shards[s].to_json() for s in listed]
        if version >= 2:
            out.update(shards=_V2_SHARDS, recent_shards=entries,
                       segments=[segment.to_json() for segment in self.segments])
        else:
            out["shards"] = entries
        return out


def manifest_path(root: Path, rank: int) -> Path:
    return root / f"manifest-r{rank:05d}.json"


_SEGMENT_READ_TRIES = 5


def read_manifest(root: Path, rank: int) -> RankState | None:
    """The rank's manifest and its segments, or None if it has none; :class:`StoreCorruptError` if
    either is unreadable. A segment gone since the manifest was read (its writer, opening or closing,
    removed it as no longer named) sends it back to read the manifest again."""
    path = manifest_path(root, rank)
    for _ in range(_SEGMENT_READ_TRIES):
        data = _read_json(path, "manifest")
        if data is None:
            return None
        try:
            return _parse_manifest(data, rank, path, root)
        except _SegmentGone as gone:
            if _read_json(path, "manifest") != data:
                continue            # rewritten meanwhile: read the new one
            error = StoreCorruptError(
                f"gradient store segment {gone.path} is named by {path.name} but missing; restore it, or "
                "open with GradientStore.open(path, repair=True) to rebuild the index from the shard files")
            error.partial = gone.partial
            raise error from None
    raise StoreCorruptError(f"gradient store manifest {path}: its segments kept changing while being read "
                            f"({_SEGMENT_READ_TRIES} tries); open the store again")


class _SegmentGone(TDAError):
    def __init__(self, path: Path):
        super().__init__(str(path))
        self.path = path
        self.partial: RankState | None = None


def _read_json(path: Path, what: str) -> Any:
    """``path``'s JSON, None if it does not exist; :class:`StoreCorruptError` if it cannot be read."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StoreCorruptError(
            f"gradient store {what} {path} is unreadable ({type(e).__name__}: {e}); "
            "GradientStore.open(path, repair=True) rebuilds the index from the shard files") from e


_SHARD_FIELDS = ("file", "rank", "seq", "num_rows", "step_min", "step_max", "bytes")


def _parse_manifest(data: Any, rank: int, path: Path, root: Path) -> RankState:
    """The :class:`RankState` in a parsed manifest and its segments, every field checked to be what a
    writer writes."""
    def damaged(where: str, problem: str) -> StoreCorruptError:
        return StoreCorruptError(f"gradient store manifest {path} is damaged: {where} {problem}; "
                                 "GradientStore.open(path, repair=True) rebuilds it from the shard files")

    if not isinstance(data, dict):
        raise damaged("the file", f"must be a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT_NAME + ".manifest":
        raise damaged("format", f"must be {FORMAT_NAME + '.manifest'!r}, got {data.get('format', '<absent>')!r}")
    version = data.get("format_version", 1)
    if not _is_count(version) or version > MANIFEST_VERSION:
        raise StoreError(f"gradient store manifest {path} has format_version {version!r}, newer than this "
                         f"olmo_tda reads ({MANIFEST_VERSION}); upgrade olmo_tda to read this store")
    if data.get("rank") != rank or not _is_count(data.get("rank")):
        raise damaged("rank", f"must be {rank} (the rank in its name), got {data.get('rank', '<absent>')!r}")
    if not _is_count(data.get("next_seq")):
        raise damaged("next_seq", f"must be an int >= 0, got {data.get('next_seq', '<absent>')!r}")
    state = RankState(rank=rank, next_seq=data["next_seq"])
    counters = data.get("counters")
    if not isinstance(counters, dict):
        raise damaged("counters", f"must be a JSON object, got {counters if 'counters' in data else '<absent>'!r}")
    for key in COUNTERS:
        if key in counters:
            if not _is_count(counters[key]):
                raise damaged(f"counters.{key}", f"must be an int >= 0, got {counters[key]!r}")
            state.counters[key] = counters[key]
    truncations = data.get("truncations", [])      # absent: a manifest from before the log was kept
    if not isinstance(truncations, list) or not all(_is_count(t) for t in truncations):
        raise damaged("truncations", f"must be a list of ints >= 0, got {truncations!r}")
    state.truncations = list(truncations)
    # absent: a manifest from before the id, whose log keeps one fixed id (a new random one on every
    # open would make a checkpoint's recorded id unknown at the next open)
    state.log_id = data.get("log_id", LEGACY_LOG_ID)
    if not isinstance(state.log_id, str) or not state.log_id:
        raise damaged("log_id", f"must be a non-empty string, got {state.log_id!r}")
    state.truncating = data.get("truncating")      # absent: written before the flag, so unknown
    if state.truncating is not None and not isinstance(state.truncating, bool):
        raise damaged("truncating", f"must be true or false, got {state.truncating!r}")
    cuts = data.get("cuts", {})     # absent: a manifest from before cut markers
    if not isinstance(cuts, dict) or not all(k.isdigit() and _is_count(v) for k, v in cuts.items()):
        raise damaged("cuts", f"must map seqs to steps (ints >= 0), got {cuts!r}")
    state.cuts = {int(k): v for k, v in cuts.items()}
    list_key = "recent_shards" if version >= 2 else "shards"
    shards = data.get(list_key)
    if not isinstance(shards, list):
        raise damaged(list_key, f"must be a list, got {shards if list_key in data else '<absent>'!r}")
    _parse_shards(shards, list_key, state, damaged, None)
    if version < 2 and "segments" in data:
        raise damaged("segments", f"must be absent from a format_version {version} manifest")
    segments = data.get("segments", [])
    if not isinstance(segments, list) or (version == 2 and not segments):
        raise damaged("segments", f"must be a {'non-empty ' if version == 2 else ''}list in format_version "
                      f"{version}, got {segments!r}")
    last, listed = -1, sorted(state.shards)
    for i, ref in enumerate(segments):
        where = f"segments[{i}]"
        if not isinstance(ref, dict):
            raise damaged(where, f"must be a JSON object, got {ref!r}")
        for key in ("first_seq", "last_seq", "num_shards"):
            if not _is_count(ref.get(key)):
                raise damaged(f"{where}.{key}", f"must be an int >= 0, got {ref.get(key, '<absent>')!r}")
        name = ref.get("file")
        m = _SEGMENT_RE.fullmatch(name[len(SEGMENT_DIR) + 1:]) if isinstance(name, str) \
            and name.startswith(SEGMENT_DIR + "/") else None
        if m is None or int(m.group(1)) != rank or int(m.group(2)) != ref["first_seq"]:
            # also keeps a damaged entry from pointing outside the store
            raise damaged(f"{where}.file", f"must be {SEGMENT_DIR}/r{rank:05d}-{ref['first_seq']:08d}-<token>.json "
                          f"(from its rank and first seq), got {name!r}")
        if not last < ref["first_seq"] <= ref["last_seq"] or ref["num_shards"] < 1:
            raise damaged(where, f"must cover seqs after the previous segment's (last {last}) with "
                          f"first_seq <= last_seq and num_shards >= 1, got {ref!r}")
        last = ref["last_seq"]
        at = bisect_left(listed, ref["first_seq"])
        if at < len(listed) and listed[at] <= ref["last_seq"]:
            raise damaged(where, f"covers a shard {list_key} lists (seqs {ref['first_seq']}..{ref['last_seq']})")
    for ref in segments:
        try:
            state.segments.append(_read_segment(root, ref["file"], rank, ref, state, path))
        except (StoreCorruptError, _SegmentGone) as e:
            e.partial = state       # what the manifest itself holds, for a repair to keep
            raise
    return state


def _read_segment(root: Path, name: str, rank: int, ref: dict[str, Any], state: RankState,
                  manifest: Path) -> Segment:
    """Segment ``name`` as the manifest's entry ``ref`` describes it; its shards go into ``state``."""
    path = root / name

    def damaged(where: str, problem: str) -> StoreCorruptError:
        return StoreCorruptError(f"gradient store segment {path} (named by {manifest.name}) is damaged: {where} "
                                 f"{problem}; GradientStore.open(path, repair=True) rebuilds the index from the "
                                 "shard files")

    data = _read_json(path, "segment")
    if data is None:
        raise _SegmentGone(path)
    if not isinstance(data, dict):
        raise damaged("the file", f"must be a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT_NAME + ".manifest_segment":
        raise damaged("format", f"must be {FORMAT_NAME + '.manifest_segment'!r}, got "
                      f"{data.get('format', '<absent>')!r}")
    if data.get("format_version") != 1:
        raise damaged("format_version", f"must be 1, got {data.get('format_version', '<absent>')!r}")
    for key in ("rank", "first_seq", "last_seq"):
        want = rank if key == "rank" else ref[key]
        if data.get(key) != want:
            raise damaged(key, f"must be {want} (as the manifest says), got {data.get(key, '<absent>')!r}")
    shards = data.get("shards")
    if not isinstance(shards, list) or len(shards) != ref["num_shards"]:
        raise damaged("shards", f"must be a list of the {ref['num_shards']} shards the manifest counts, got "
                      f"{len(shards) if isinstance(shards, list) else shards!r}")
    members = _parse_shards(shards, "shards", state, damaged, (ref["first_seq"], ref["last_seq"]))
    return Segment(name, ref["first_seq"], ref["last_seq"], tuple(members))


def _parse_shards(entries: list[Any], what: str, state: RankState, damaged, seq_range) -> list[ShardInfo]:
    """Check a list of shard entries and add them to ``state.shards`` (seqs within ``seq_range``)."""
    rank = state.rank
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise damaged(f"{what}[{i}]", f"must be a JSON object, got {entry!r}")
        for key in _SHARD_FIELDS[1:]:
            value = entry.get(key)
            if type(value) is not int or value < 0:      # _is_count, inline: opening a long run's store
                raise damaged(f"{what}[{i}].{key}", f"must be an int >= 0, got {entry.get(key, '<absent>')!r}")
        if entry["rank"] != rank:
            raise damaged(f"{what}[{i}].rank", f"must be {rank} (the manifest's rank), got {entry['rank']!r}")
        if entry.get("file") != shard_name(rank, entry["seq"]):
            # also keeps a damaged entry from pointing outside the store
            raise damaged(f"{what}[{i}].file", f"must be {shard_name(rank, entry['seq'])!r} (from its rank "
                          f"and seq), got {entry.get('file', '<absent>')!r}")
        if entry["num_rows"] < 1 or entry["step_min"] > entry["step_max"]:
            raise damaged(f"{what}[{i}]", f"must have num_rows >= 1 and step_min <= step_max, got "
                          f"num_rows={entry['num_rows']}, steps {entry['step_min']}..{entry['step_max']}")
        if seq_range is not None and not seq_range[0] <= entry["seq"] <= seq_range[1]:
            raise damaged(f"{what}[{i}].seq", f"must be in {seq_range[0]}..{seq_range[1]} (the segment's), "
                          f"got {entry['seq']}")
        for key in ("cut", "stored_rows"):
            if entry.get(key) is not None and (type(entry[key]) is not int or entry[key] < 0):
                raise damaged(f"{what}[{i}].{key}", f"must be an int >= 0, got {entry[key]!r}")
        if entry["seq"] in state.shards:
            raise damaged(f"{what}[{i}].seq", f"{entry['seq']} is listed twice")
        info = state.shards[entry["seq"]] = ShardInfo.from_json(entry)
        out.append(info)
    return out


def _is_count(value: Any) -> bool:
    """An int >= 0 as JSON holds it (not a bool, a float or a string of digits)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def write_manifest(root: Path, state: RankState) -> None:
    """Write the rank's manifest (atomically, after any segment it names): sealed blocks whose shards
    are unchanged are kept as they are, changed ones written again under new names, and each
    :data:`SEAL_SHARDS` shards past the last block sealed into a new one. ``state.segments`` is
    updated once the manifest is on disk."""
    seqs = sorted(state.shards)
    listed: list[int] = []
    segments: list[Segment] = []
    pos = 0
    for segment in state.segments:
        lo = bisect_left(seqs, segment.first_seq, pos)
        hi = bisect_right(seqs, segment.last_seq, lo)
        listed.extend(seqs[pos:lo])
        pos = hi
        members = tuple(state.shards[s] for s in seqs[lo:hi])
        if members == segment.shards:
            segments.append(segment)
        elif members:        # empty: every shard of it was truncated away
            segments.append(_write_segment(root, state.rank, segment.first_seq, segment.last_seq, members))
    tail = seqs[pos:]
    while len(tail) >= SEAL_SHARDS:
        block, tail = tail[:SEAL_SHARDS], tail[SEAL_SHARDS:]
        segments.append(_write_segment(root, state.rank, block[0], block[-1], tuple(state.shards[s] for s in block)))
    listed.extend(tail)
    before, state.segments = state.segments, segments
    try:
        write_json_atomic(manifest_path(root, state.rank), state.to_json(listed))
    except BaseException:
        state.segments = before
        raise


def _write_segment(root: Path, rank: int, first_seq: int, last_seq: int, members: tuple[ShardInfo, ...]) -> Segment:
    name = f"{SEGMENT_DIR}/r{rank:05d}-{first_seq:08d}-{uuid.uuid4().hex[:8]}.json"
    while (root / name).exists():   # never over a block a manifest may name (a rewritten one keeps its first seq)
        name = f"{SEGMENT_DIR}/r{rank:05d}-{first_seq:08d}-{uuid.uuid4().hex[:8]}.json"
    folder = root / SEGMENT_DIR
    if not folder.is_dir():
        folder.mkdir(exist_ok=True)
        fsync_dir(root)
    write_json_atomic(root / name, {"format": FORMAT_NAME + ".manifest_segment", "format_version": 1, "rank": rank,
                                    "first_seq": first_seq, "last_seq": last_seq,
                                    "shards": [info.to_json() for info in members]})
    return Segment(name, first_seq, last_seq, members)


def remove_unlisted_segments(root: Path, rank: int) -> None:
    """Delete the rank's segment files (and their temps) that its manifest on disk does not name. For
    the rank's writer only, at open and close (a reader that read an older manifest, naming one of
    them, reads the manifest again)."""
    folder = root / SEGMENT_DIR
    if not folder.is_dir():
        return
    try:
        data = _read_json(manifest_path(root, rank), "manifest")
    except StoreCorruptError:
        return              # what it names is unknown: keep everything for a repair
    named = {ref.get("file") for ref in data.get("segments", []) if isinstance(ref, dict)} \
        if isinstance(data, dict) and isinstance(data.get("segments", []), list) else None
    if named is None:
        return
    try:
        stray = [Path(entry.path) for entry in os.scandir(folder)
                 if (m := _SEGMENT_ANY_RE.fullmatch(entry.name)) is not None and int(m.group(1)) == rank
                 and f"{SEGMENT_DIR}/{entry.name}" not in named]
        if stray:
            fsync_dir(root)     # the manifest that no longer names them is durable before they go
    except OSError as e:        # cleanup only: what stays is removed at the next open or close
        logger.debug("gradient store %s: could not remove stray segments of rank %d: %s", root, rank, e)
        return
    for path in stray:
        try:
            os.remove(path)
            logger.info("gradient store %s: removed %s, which the manifest of rank %d no longer names",
                        root, path.name, rank)
        except FileNotFoundError:
            pass
        except OSError as e:    # e.g. a read-only mount: harmless, nothing reads an unnamed block
            logger.debug("gradient store %s: could not remove %s: %s", root, path, e)


def _remove_debris(path: Path) -> None:
    try:
        os.remove(path)
        logger.info("gradient store: removed leftover temp file %s", path)
    except FileNotFoundError:
        pass
    except OSError as e:  # e.g. a read-only mount: harmless, readers ignore *.tmp
        logger.debug("gradient store: could not remove %s: %s", path, e)


def _quarantine(root: Path, rel: str, reason: str) -> None:
    src = root / rel
    qdir = root / QUARANTINE_DIR
    dst = qdir / src.name
    try:
        qdir.mkdir(exist_ok=True)
        k = 1
        while dst.exists():
            dst, k = qdir / f"{src.name}.{k}", k + 1
        os.replace(src, dst)
    except OSError as e:
        raise StoreError(f"gradient store {root}: cannot move unreadable shard {src} to {dst} "
                         f"({reason}): {describe_os_error(e)}; move it out of {SHARD_DIR}/ by hand, or "
                         "restore it") from e
    warnings.warn(f"gradient store {root}: moved unreadable shard {rel} to {dst} ({reason}); its rows are lost",
                  RuntimeWarning, stacklevel=3)


def _reconcile_rank(root: Path, state: RankState, on_disk: dict[int, str], *, layer_shapes, dtype,
                    repair: bool, may_modify: bool, check_sizes: bool = True,
                    cut_files: dict[int, str] | None = None, void: list[str] | None = None) -> bool:
    """Make ``state`` agree with the files in ``on_disk`` (seq -> rel path) and the cut markers in
    ``cut_files`` (seq -> rel path). Returns True if changed. ``check_sizes=False``: a listed shard
    found on disk is taken as listed, without a stat. ``void`` collects the files of shards a cut
    voided wholly, for the caller to remove once the manifest that drops them is written."""
    changed = False
    on_disk = dict(on_disk)
    for seq, rel in sorted((cut_files or {}).items()):
        if seq not in state.cuts:   # written before a crash kept its manifest from saying so
            state.cuts[seq] = read_cut(root, rel)
            state.truncations.append(state.cuts[seq])
            changed = True
    cut_of = cuts_after(state.cuts)

    def cut(info: ShardInfo) -> ShardInfo | None:
        """``info`` as the cut markers after it leave it (None: void; its file goes under ``may_modify``)."""
        step = cut_of(info.seq)
        if step is None or info.step_max <= step:
            return info
        live = apply_cut(root, info, step)
        if live is None and may_modify and void is not None:
            void.append(info.file)
        return live

    def unreadable(rel: str, exc: StoreCorruptError) -> None:
        """A shard that failed validation: raise, or quarantine it under ``repair`` — unless a live
        writer removed it meanwhile (its ``truncate_after``): then it is simply gone."""
        if not may_modify and not (root / rel).exists():
            logger.debug("gradient store %s: %s vanished while scanning (removed by its live writer)", root, rel)
            return
        if not repair:
            raise exc
        if not may_modify:
            raise StoreError(f"cannot repair {root / rel}: rank {state.rank}'s writer is still running; "
                             "stop it first") from exc
        _quarantine(root, rel, str(exc.__cause__ or exc))

    root_text = os.fspath(root)
    for seq, info in sorted(state.shards.items()):
        path = os.path.join(root_text, info.file)     # a str: Path arithmetic was a third of a long open
        step = cut_of(seq)
        if step is not None and info.step_min > step:   # void whole: dropped, whether its file is still there
            del state.shards[seq]
            if on_disk.pop(seq, None) is not None and may_modify and void is not None:
                void.append(info.file)
            changed = True
            continue
        if seq not in on_disk and os.path.exists(path):
            on_disk[seq] = info.file    # renamed into place after shards/ was listed (a live writer)
        if seq not in on_disk and not may_modify and _unlisted_now(root, state.rank, seq):
            del state.shards[seq]       # its live writer's truncate_after removed it after we read the manifest
            changed = True
            continue
        if seq not in on_disk:
            exc = StoreCorruptError(
                f"gradient store shard {path} is listed in {manifest_path(root, state.rank).name} but missing; "
                "restore it, or open with GradientStore.open(path, repair=True) to drop it from the index")
            if not repair:
                raise exc
            warnings.warn(f"gradient store {root}: dropping missing shard {info.file} from the index",
                          RuntimeWarning, stacklevel=3)
            del state.shards[seq]
            changed = True
            continue
        try:
            live = cut(info)
        except FileNotFoundError:   # a void shard its live writer removed after the listing
            live = None
        except StoreCorruptError as exc:
            unreadable(info.file, exc)
            del state.shards[seq], on_disk[seq]
            changed = True
            continue
        if live is not info:
            changed = True
            if live is None:
                del state.shards[seq], on_disk[seq]
                continue
            state.shards[seq] = info = live
        if not check_sizes:
            continue
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:  # vanished under us (a concurrent truncate of a live rank)
            del state.shards[seq]
            changed = True
            continue
        if size != info.bytes:
            try:
                fresh = cut(read_shard_info(root, info.file, layer_shapes, dtype))
            except (StoreCorruptError, FileNotFoundError) as exc:
                if isinstance(exc, StoreCorruptError):
                    unreadable(info.file, exc)
                fresh = None
            else:
                logger.info("gradient store %s: %s changed size since the manifest was written; "
                            "re-indexed from the file", root, info.file)
            if fresh is None:
                del state.shards[seq], on_disk[seq]
            else:
                state.shards[seq] = fresh
            changed = True
    for seq, rel in sorted(on_disk.items()):
        if seq in state.shards:
            continue
        try:
            info = cut(read_shard_info(root, rel, layer_shapes, dtype))
        except StoreCorruptError as exc:
            unreadable(rel, exc)
            continue
        except FileNotFoundError:
            continue
        if info is None:            # void: a cut after it (its writer stopped before removing it)
            changed = True
            continue
        logger.info("gradient store %s: adopted shard %s missing from the manifest "
                    "(its writer stopped between rename and manifest update)", root, rel)
        state.shards[seq] = info
        state.counters["rows_written"] += info.num_rows
        changed = True
    # seqs only grow, so a shard name is never reused while a reader may still hold the old file
    next_seq = max([state.next_seq - 1, *on_disk, *(cut_files or {}), *state.cuts]) + 1
    if state.next_seq != next_seq:
        state.next_seq = next_seq
        changed = True
    return changed


def _unlisted_now(root: Path, rank: int, seq: int) -> bool:
    """Whether rank's manifest, read again now, no longer lists shard ``seq`` (a writer removes a
    shard from its manifest before it deletes the file)."""
    try:
        now = read_manifest(root, rank)
    except StoreCorruptError:
        return False
    return now is not None and seq not in now.shards


_ByRank = dict[int, dict[int, str]]


def _listing(root: Path) -> tuple[_ByRank, _ByRank, dict[int, list[Path]], set[int]]:
    """What the store's folders hold, by rank: shard files and cut markers (seq -> path relative to
    the root), temp files (the debris of a writer that died), and the ranks with a manifest. Stale
    temp files of ``store.json`` are removed on the way."""
    shard_dir = root / SHARD_DIR
    files: dict[int, dict[int, str]] = {}
    cut_files: dict[int, dict[int, str]] = {}
    tmps: dict[int, list[Path]] = {}
    for entry in os.scandir(shard_dir) if shard_dir.is_dir() else []:
        parsed = parse_shard_name(entry.name)
        if parsed is not None:
            files.setdefault(parsed[0], {})[parsed[1]] = f"{SHARD_DIR}/{entry.name}"
        elif (parsed := parse_cut_name(entry.name)) is not None:
            cut_files.setdefault(parsed[0], {})[parsed[1]] = f"{SHARD_DIR}/{entry.name}"
        elif (m := _SHARD_TMP_RE.match(entry.name)) is not None:
            tmps.setdefault(int(m.group(1)), []).append(Path(entry.path))
    segment_dir = root / SEGMENT_DIR
    for entry in os.scandir(segment_dir) if segment_dir.is_dir() else []:
        if (m := _SEGMENT_ANY_RE.fullmatch(entry.name)) is not None and m.group(2):
            tmps.setdefault(int(m.group(1)), []).append(Path(entry.path))
    manifests: set[int] = set()
    for entry in os.scandir(root):
        if (rank := parse_manifest_name(entry.name)) is not None:
            manifests.add(rank)
        elif (m := _MANIFEST_TMP_RE.match(entry.name)) is not None:
            tmps.setdefault(int(m.group(1)), []).append(Path(entry.path))
        elif entry.name.startswith(STORE_JSON + ".") and entry.name.endswith(TMP_SUFFIX):
            try:
                if time.time() - entry.stat().st_mtime > _STALE_STORE_JSON_TMP_S:
                    _remove_debris(Path(entry.path))
            except FileNotFoundError:
                pass
    return files, cut_files, tmps, manifests


def scan_store(root: Path, *, layer_shapes: list[tuple[int, int]], dtype: StoreDType, repair: bool = False,
               own_rank: int | None = None) -> dict[int, RankState]:
    """Read every rank's manifest and reconcile it with the shard files (see the module docstring).

    ``own_rank``: the caller is that rank's writer and already holds its lock; its manifest is
    rewritten if reconciliation changed it. Other ranks' manifests are rewritten only under ``repair=True``
    (and only if their writer is gone); without it, their locks are held only while a dead writer's
    temp files are removed. Returns rank -> :class:`RankState`.
    """
    files, cut_files, tmps, manifests = _listing(root)
    states: dict[int, RankState] = {}
    for rank in sorted(set(files) | manifests | set(tmps) | set(cut_files)):
        if rank != own_rank and not repair:
            # Another rank, read only: its lock is taken just to remove a dead writer's debris, never
            # held through the reconcile (that rank's own writer, resuming now, waits for the lock:
            # with every rank of a large run opening at once it would wait out LOCK_WAIT_S), and the
            # reconcile is the one that tolerates a live writer (a truncation racing this scan).
            if tmps.get(rank) and (lock := RankLock.try_acquire(root, rank)) is not None:
                try:
                    for tmp in tmps[rank]:
                        _remove_debris(tmp)
                finally:
                    lock.release()
            state = read_manifest(root, rank) or RankState(rank=rank)
            # A writer stats another rank's shards only if that rank's manifest says an older
            # olmo_tda was rewriting its shards (or predates the flag): then a crash can have left
            # files longer than their entries, which no writer of a departed rank would ever
            # reconcile. Otherwise the entries are what the files hold (never rewritten): a resume
            # of R ranks need not make R x (every rank's shards) stats at once on a parallel
            # filesystem. A reader stats them all (it reads their rows).
            _reconcile_rank(root, state, files.get(rank, {}), layer_shapes=layer_shapes, dtype=dtype,
                            repair=False, may_modify=False, cut_files=cut_files.get(rank),
                            check_sizes=own_rank is None or state.truncating is not False)
            if state.shards or rank in manifests:
                states[rank] = state
            continue
        lock = None if rank == own_rank else RankLock.try_acquire(root, rank)
        may_modify = rank == own_rank or lock is not None
        try:
            if may_modify:
                for tmp in tmps.get(rank, []):
                    _remove_debris(tmp)
            kept = None
            try:
                state = read_manifest(root, rank)
            except StoreCorruptError as e:
                if not repair:
                    raise
                if (kept := getattr(e, "partial", None)) is not None:
                    # the manifest itself is sound: keep its counters, truncation log and id (a checkpoint's
                    # rollback check reads them); only the shards of its unreadable segment are re-found
                    warnings.warn(f"gradient store {root}: rebuilding the index of rank {rank} from its shard "
                                  f"files ({e}); its counters and truncation log are kept", RuntimeWarning,
                                  stacklevel=2)
                else:
                    warnings.warn(f"gradient store {root}: rebuilding unreadable manifest of rank {rank} "
                                  "from its shard files (counters restart)", RuntimeWarning, stacklevel=2)
                state = kept
            state = state or RankState(rank=rank)
            written = state.counters["rows_written"]
            void: list[str] = []
            changed = _reconcile_rank(root, state, files.get(rank, {}), layer_shapes=layer_shapes,
                                      dtype=dtype, repair=repair, may_modify=may_modify,
                                      cut_files=cut_files.get(rank), void=void)
            if kept is not None:
                # its count holds the re-found shards' rows already (so not one written after it, if any)
                state.counters["rows_written"] = written
                changed = True
            if state.truncating is not False and (rank == own_rank or (repair and may_modify)):
                # reconciled in full just now (every shard stat'ed, a changed one re-read): the index
                # is the files', so other ranks' writers need not stat them again (a crash inside
                # truncate_after left it set; None: a manifest from before the flag)
                state.truncating = False
                changed = True
            if changed and may_modify and (rank == own_rank or repair):
                try:
                    write_manifest(root, state)
                except OSError as e:
                    raise StoreError(f"gradient store {root}: cannot rewrite {manifest_path(root, rank)} "
                                     f"after reconciling it with the shard files: {describe_os_error(e)}. "
                                     "The manifest on disk is unchanged; the next open reconciles it "
                                     "again") from e
                for rel in void:        # after the manifest that no longer names them
                    remove_void(root, rel)
            if state.shards or rank == own_rank or rank in manifests:
                states[rank] = state
        finally:
            if lock is not None:
                lock.release()
    return states
