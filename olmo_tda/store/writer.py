"""The write side of a gradient store: an append-only writer with one background I/O thread.

The training thread only validates a record's layer names/shapes and enqueues it (a bounded queue:
when the writer falls behind, ``append`` blocks instead of memory growing). The writer thread
encodes each record in the store dtype straight into the window's buffers (moving it off the GPU
first), drops non-finite and duplicate rows, and once the window holds ``flush_every`` distinct steps
(or ``flush_mb`` of rows, whichever comes first: one step may span shards) writes it as one shard
from those buffers (see :mod:`.format`). Dropped non-finite rows are warned about
(:class:`NonFiniteGradientWarning`) when their window is written, shard or not: a step whose every
row was dropped counts towards ``flush_every`` too.

Failures in the thread are raised in the caller at its next ``append``/``flush``/``close`` as
:class:`StoreWriteError`. A failed shard write removes its temp file and keeps the window in memory,
so the next flush retries it; shards already durable are never touched by a failing write.

Memory held: at most ``queue_size`` records in the queue + the window's buffers (about the largest
window so far, at most ``flush_every`` steps or about ``flush_mb`` MB of encoded rows, kept between
windows; more while a failing disk holds a window, and up to about twice ``flush_mb`` after it is
written) + 8 bytes per id stored at the step being appended.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from olmo_tda.config import ConfigError, StoreConfig, StoreDType

from .errors import StoreError, StoreMismatchError, StoreWriteError, describe_os_error
from .format import (
    SHARD_DIR,
    STORE_JSON,
    ShardInfo,
    disk_dtype,
    finite_words,
    fsync_dir,
    stored_shape,
    torch_dtype,
    publish_json_once,
    shard_name,
    words_as_torch,
    write_shard,
)
from .cuts import apply_cut, remove_void, write_cut
from .keys import KeyIndex, StepKeys
from .locks import RankLock
from .manifest import RankState, remove_unlisted_segments, scan_store, write_manifest
from .meta import build_store_meta, check_meta_compatible, load_store_json
from .record import GradientRecord, LowRank
from .window import Window, WindowSegment

__all__ = ["StoreWriter", "NonFiniteGradientWarning"]

logger = logging.getLogger(__name__)

_POLL_S = 0.5  # how often a blocked caller re-checks that the writer thread is still alive
_NUMPY_FLOATS = (torch.float32, torch.float16)  # record dtypes the writer casts with numpy


class NonFiniteGradientWarning(RuntimeWarning):
    """Rows with NaN/inf gradients were skipped (not stored); the ids are in the message."""


class StoreWriter:
    """Append-only writer of one rank's shards. Make one with :meth:`GradientStore.create`.

    Example::

        with GradientStore.create("run/tda/store", meta, StoreConfig(flush_every=8), rank=0) as w:
            for record in records:          # GradientRecord per optimizer step
                w.append(record)            # returns once queued
        # closed: every appended row is durable

    Only this rank's files are written. ``meta`` is the capture engine's description (see
    :func:`~olmo_tda.store.meta.build_store_meta`); reopening an existing store checks it.
    """

    def __init__(self, root: Path, store_meta: dict[str, Any], config: StoreConfig, rank: int,
                 lock: RankLock, states: dict[int, RankState]):
        self.path = root
        self.rank = rank
        self.meta = store_meta
        self.dtype = StoreDType(store_meta["dtype"])
        self._torch_dtype = torch_dtype(self.dtype)
        self.layers = [layer["name"] for layer in store_meta["layers"]]
        self.layer_shapes = {layer["name"]: tuple(layer["shape"]) for layer in store_meta["layers"]}
        self.layer_ranks = {layer["name"]: int(layer.get("rank", 0)) for layer in store_meta["layers"]}
        self._config = config
        self._lock = lock
        self._state = states.get(rank) or RankState(rank=rank)
        self._other_shards = [s for r, st in states.items() if r != rank for s in st.shards.values()]
        self._index = KeyIndex(root, [*self._state.shards.values(), *self._other_shards])
        # the window's rows (owned by the writer thread) and the ids they hold per step
        self._window = Window([stored_shape(layer) for layer in store_meta["layers"]], disk_dtype(self.dtype),
                               keep_bytes=config.flush_mb * 2 ** 20)
        self._window_keys: dict[int, list[np.ndarray]] = {}
        self._window_basis: str | None = None     # the eigenbasis version of the window's rows
        self._finite: np.ndarray | None = None     # per-record scratch of _encode_into
        self._step_keys: StepKeys | None = None   # ids held at the step last appended to
        self._window_nonfinite: list[tuple[int, np.ndarray]] = []
        self._manifest_dirty = False
        self._warned_duplicates = False
        self._check_underflow = self.dtype is StoreDType.FLOAT16    # checked on a window's first record
        self._mutex = threading.Lock()  # guards counters/shards (read by stats) and the pending error
        self._error: StoreWriteError | None = None  # raised at the caller's next call
        self._error_retryable = False  # a failed window write: cleared once a later write succeeds
        self._closed = False
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue_size)
        self._thread = threading.Thread(target=self._run, name=f"olmo_tda-store-writer-r{rank}", daemon=True)
        self._thread.start()
        # a run that ends without close() (an exception escaping the loop) still gets its last
        # window written; close() unregisters this
        atexit.register(self._close_at_exit)

    # -- creation ---------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike, meta: dict[str, Any], config: StoreConfig, rank: int = 0,
               *, repair: bool = False) -> "StoreWriter":
        """Create the store at ``path``, or reopen it for appending if ``store.json`` exists.

        Raises :class:`StoreError` if the location cannot be created or written,
        :class:`StoreMismatchError` if an existing store was written with other settings (also when
        ranks create it at once with different settings: the first rank's ``store.json`` stays).
        """
        config.validate()
        if rank < 0:
            raise ConfigError(f"rank must be >= 0, got {rank}")
        root = Path(path)
        requested = build_store_meta(meta, config.dtype)
        _make_writable_dir(root, rank)
        store_json = root / STORE_JSON
        if not store_json.exists():
            if any((root / SHARD_DIR).glob("*.h5")):
                raise StoreError(f"{root} has shards but no {STORE_JSON}; refusing to create a store over "
                                 "them. Restore store.json or choose an empty store.path")
            # ranks may race here: the first to publish wins, and every rank (a loser too) then checks
            # what won as a reopen does, so ranks started with different settings are refused
            try:
                publish_json_once(store_json, requested, tmp_tag=f".{os.getpid()}-r{rank}")
            except OSError as e:
                raise StoreError(f"cannot create a gradient store at {root}: writing {store_json} failed: "
                                 f"{describe_os_error(e)}. Nothing was created; fix that, or set store.path "
                                 "to a writable filesystem with free space") from e
        stored = load_store_json(root)
        check_meta_compatible(stored, requested, str(root))
        lock = RankLock.acquire_for_writing(root, rank)
        try:
            shapes = [stored_shape(layer) for layer in stored["layers"]]
            states = scan_store(root, layer_shapes=shapes, dtype=StoreDType(stored["dtype"]),
                                repair=repair, own_rank=rank)
            remove_unlisted_segments(root, rank)     # blocks a crash or a truncation left behind
        except BaseException:
            lock.release()
            raise
        writer = cls(root, stored, config, rank, lock, states)
        logger.info("gradient store %s: writing rank %d (dtype %s, %d existing shards of this rank, "
                    "next seq %d)", root, rank, writer.dtype.value, len(writer._state.shards),
                    writer._state.next_seq)
        return writer

    # -- caller-thread API ------------------------------------------------------------------------

    def append(self, record: GradientRecord) -> None:
        """Queue one step's per-example gradients; blocks only while the queue is full.

        The store takes the record's tensors over: do not modify them afterwards. GPU tensors are
        copied to CPU in the writer thread, so they must be ready on the current CUDA stream.

        An error of an earlier background write is raised *after* this record is queued, so a loop
        that catches :class:`StoreWriteError` and carries on loses no record (the failed window is
        retried at the next flush).
        """
        self._check_open()
        names = set(record.grads)
        if names != set(self.layers):
            missing, extra = sorted(set(self.layers) - names), sorted(names - set(self.layers))
            raise StoreMismatchError(f"gradient store {self.path}: record for step {record.step} has layers "
                                     f"missing={missing} extra={extra} relative to the store's layers")
        for name, g in record.grads.items():
            rank = self.layer_ranks[name]
            got = f"rank-{g.rank} factors" if isinstance(g, LowRank) else "a dense tensor"
            if (rank == 0) == isinstance(g, LowRank) or (rank and g.rank != rank):
                raise StoreMismatchError(f"gradient store {self.path}: grads[{name!r}] is {got}, the store holds this "
                                         f"layer {'as rank-%d factors' % rank if rank else 'dense'}: capture with the "
                                         "store's capture.rank")
            if tuple(g.shape[1:]) != self.layer_shapes[name] or not g.is_floating_point():
                raise StoreMismatchError(f"gradient store {self.path}: grads[{name!r}] is {tuple(g.shape)} "
                                         f"{getattr(g, 'dtype', '')}, expected [N, "
                                         f"{', '.join(map(str, self.layer_shapes[name]))}] float")
        if record.basis is not None and not (isinstance(record.basis, str) and record.basis):
            raise ConfigError(f"gradient store {self.path}: record for step {record.step} has basis "
                              f"{record.basis!r}; expected an eigenbasis digest (str) or None")
        item = GradientRecord(ids=np.array(record.ids, dtype=np.int64), step=int(record.step),
                              lr=float(record.lr), loss_scale=record.loss_scale,
                              grads={name: g.detach() for name, g in record.grads.items()}, basis=record.basis)
        self._put(item)
        self._raise_pending()

    def flush(self) -> ShardInfo | None:
        """Write the buffered window as a shard now and wait until it is durable.

        Returns the new shard's info, or None if nothing was buffered. Raises
        :class:`StoreWriteError` if the write failed (the window stays buffered: call again to retry).
        """
        self._check_open()
        info = self._command("flush")
        self._raise_pending()
        return info

    def truncate_after(self, step: int) -> int:
        """Drop this rank's rows with step > ``step`` (buffered and on disk); return how many.

        For resuming from an older checkpoint. No shard is rewritten: a durable cut marker voids
        the rows, all at once (a process killed before it changed nothing; after it, the cut holds).
        If it raises :class:`StoreWriteError` (a full disk) before the marker, nothing changed;
        after, the cut holds and the manifest is written at the next flush: either way call it
        again before appending. It returns the rows it dropped itself (a failed call's are counted
        in ``stats["rows_truncated"]`` only).
        """
        self._check_open()
        dropped = self._command("truncate", int(step))
        self._raise_pending()
        return dropped

    def close(self) -> None:
        """Flush, stop the writer thread and release the rank lock. Idempotent.

        If the final write fails, :class:`StoreWriteError` is raised and the writer stays open
        (thread alive, window buffered), so ``close()`` can be retried after freeing space.
        """
        if self._closed:
            return
        self._command("stop")
        self._thread.join()
        self._closed = True
        self._window.release()      # written: a closed writer kept alive by its owner holds no rows
        self._finite = None
        atexit.unregister(self._close_at_exit)
        with contextlib.suppress(OSError):      # a reader that read an older manifest reads it again
            remove_unlisted_segments(self.path, self.rank)
        self._lock.release()
        logger.info("gradient store %s: rank %d closed (%s)", self.path, self.rank, self.stats)
        self._raise_pending()

    def _close_at_exit(self) -> None:
        if not self._closed:
            logger.warning("gradient store %s: rank %d writer was not closed; closing it at exit",
                           self.path, self.rank)
            try:
                self.close()
            except StoreError as e:
                logger.error("gradient store %s: closing at exit failed: %s", self.path, e)

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def bases(self) -> list[str]:
        """Digests of the eigenbasis versions of this rank's shards (see ``GradientStore.bases``)."""
        return self.bases_up_to(None)

    def bases_up_to(self, step: int | None) -> list[str]:
        """The eigenbasis versions of this rank's rows of steps ``<= step`` (None: all), those a cut
        back to ``step`` keeps (of a shard the cut runs through, its one version)."""
        with self._mutex:
            infos = sorted(self._state.shards.values(), key=lambda info: info.seq)
        return list(dict.fromkeys(info.basis for info in infos
                                  if info.basis is not None and (step is None or info.step_min <= step)))

    @property
    def store_id(self) -> str | None:
        """The id ``store.json`` was created with (None for a store made before ids existed)."""
        return self.meta.get("store_id")

    def held_rows(self, up_to: int | None = None) -> int:
        """Rows in the store's shards, every rank's (other ranks' as of this writer's open); with
        ``up_to``, of the shards holding a step ``<= up_to`` (all of such a shard's rows)."""
        with self._mutex:
            shards = [*self._state.shards.values(), *self._other_shards]
        return sum(info.num_rows for info in shards if up_to is None or info.step_min <= up_to)

    def reached(self, step: int | None = None) -> int | None:
        """The last step of this rank's durable rows (with ``step``: the last one ``<= step``), or None
        when it has none there. A checkpoint records it, so a resume can tell whether the rows its run
        wrote up to its step are still here."""
        with self._mutex:
            shards = list(self._state.shards.values())
        if step is None:
            return max((info.step_max for info in shards), default=None)
        return max((min(info.step_max, step) for info in shards if info.step_min <= step), default=None)

    def timeline(self) -> tuple[str, int]:
        """``(log id, truncations so far)`` of this rank's rows: a checkpoint records it (see
        :meth:`rolled_back_below`)."""
        with self._mutex:
            return self._state.log_id, len(self._state.truncations)

    @property
    def next_seq(self) -> int:
        """The seq this rank's next shard or cut marker takes: a checkpoint records it, so a later
        resume can tell the cuts made since (:meth:`rolled_back_below`)."""
        with self._mutex:
            return self._state.next_seq

    def rolled_back_below(self, timeline: tuple[str, int] | int, step: int, since_seq: int | None = None
                          ) -> int | None:
        """The first step this rank's rows were truncated after, below ``step``, since the checkpoint
        that recorded ``since_seq`` (:attr:`next_seq`) or, before cut markers, ``timeline``
        (:meth:`timeline`) was saved: it then belongs to a run a later resume from an earlier
        checkpoint abandoned. None when there was no such truncation. By ``since_seq`` the cut
        markers after it are read, which a rebuilt manifest keeps; by ``timeline``, a log rebuilt
        since (``repair``: another id) is taken to hold only truncations after the checkpoint."""
        with self._mutex:
            log, current, cuts = list(self._state.truncations), self._state.log_id, dict(self._state.cuts)
        if since_seq is not None:
            since = [cut for seq, cut in sorted(cuts.items()) if seq >= since_seq]
        else:
            log_id, count = timeline if isinstance(timeline, (tuple, list)) else (None, timeline)
            since = log if log_id is not None and log_id != current else log[count:]
        return next((cut for cut in since if cut < step), None)

    def departed_after(self, step: int, world_size: int) -> list[int]:
        """Ranks ``>= world_size`` (of an earlier run with more ranks) holding rows after ``step``."""
        return sorted({info.rank for info in self._other_shards if info.rank >= world_size and info.step_max > step})

    def truncate_departed(self, step: int, world_size: int) -> int:
        """Drop the rows after ``step`` of ranks ``>= world_size``: a run resumed on fewer ranks has
        no writer of theirs to cut them back, and its own rows at those (id, step) would be skipped as
        duplicates of the abandoned run's. Each such rank is truncated under its own lock, as its
        writer would (one process calls this, e.g. rank 0; every rank then calls
        :meth:`rescan_others`). Returns the rows dropped."""
        self._check_open()
        ranks = self.departed_after(step, world_size)
        meta = {key: self.meta[key] for key in ("capture", "layers", "projector_hash", "extra") if key in self.meta}
        dropped = 0
        for rank in ranks:
            with StoreWriter.create(self.path, meta, self._config, rank=rank) as departed:
                dropped += departed.truncate_after(step)
        if dropped:
            logger.info("gradient store %s: dropped %d rows after step %d of ranks %s (not in this run)",
                        self.path, dropped, step, ranks)
        return dropped

    def rescan_others(self) -> None:
        """Read the other ranks' shards again (after :meth:`truncate_departed` changed them), so the
        duplicate check sees what they hold now."""
        self._check_open()
        self._command("rescan")

    def _rescan_others(self) -> None:
        shapes = [stored_shape(layer) for layer in self.meta["layers"]]
        states = scan_store(self.path, layer_shapes=shapes, dtype=self.dtype, own_rank=self.rank)
        self._other_shards = [info for rank, st in states.items() if rank != self.rank for info in st.shards.values()]
        self._rebuild_index()

    def check_resume(self, saved: dict[str, Any] | None, step: int) -> None:
        """Before a resume from a checkpoint at ``step`` cuts this store back: refuse one whose run
        wrote another store (``saved``: the checkpoint's ``{"store": path, "store_id": id}``) while
        this one holds rows up to ``step``, since continuing would mix two runs' rows here (rows after
        it, of this run's own earlier try, are cut by the resume). A store moved since
        (same id) or a new, empty one continues; without ids (older stores) paths are compared and a
        difference is only warned about."""
        saved = saved or {}
        theirs, theirs_id = saved.get("store"), saved.get("store_id")
        same_path = bool(theirs) and Path(theirs).resolve() == self.path.resolve()
        if theirs_id and self.store_id:
            if theirs_id == self.store_id:
                return
            rows = self.held_rows(up_to=step)    # rows after the step are cut by the resume anyway
            if rows:
                raise StoreMismatchError(
                    f"resuming a checkpoint of step {step} whose run wrote the gradient store {theirs_id} (at "
                    f"{theirs}), but tda.store.path {self.path} holds the store {self.store_id} with {rows} rows "
                    "of another run: continuing would mix the two runs' rows. Point tda.store.path at the "
                    "checkpoint's store to continue it, or at a new path to start a store at this step")
        elif not theirs or same_path:
            return
        logger.warning("tda: resuming a checkpoint whose run stored its gradients in %s, while this run's store "
                       "is %s: its rows up to step %d stay as they are, from whichever run wrote them (point "
                       "tda.store.path at the checkpoint's store to continue that run's)", theirs, self.path, step)

    @property
    def stats(self) -> dict[str, int]:
        """Cumulative counters of this rank (across sessions) plus the current window."""
        with self._mutex:
            out = dict(self._state.counters)
        out["shards"] = len(self._state.shards)
        out["buffered_rows"] = self._window.rows
        out["buffered_steps"] = len(self._window_keys)
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"gradient store writer {self.path} (rank {self.rank}) is closed")

    def _raise_pending(self) -> None:
        with self._mutex:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _put(self, item: Any) -> None:
        while True:
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                self._check_thread()

    def _check_thread(self) -> None:
        if not self._thread.is_alive():
            raise StoreWriteError(f"gradient store {self.path}: the writer thread of rank {self.rank} "
                                  "has died; rows appended since the last durable shard are lost")

    def _command(self, kind: str, arg: Any = None) -> Any:
        future: Future = Future()
        self._put((kind, arg, future))
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except TimeoutError:
                self._check_thread()

    # -- writer thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, GradientRecord):
                try:
                    if self._window.rows and item.basis != self._window_basis:
                        self._write_window()        # a shard holds the rows of one basis version
                    self._window_basis = item.basis
                    self._ingest(item)
                except Exception as e:  # noqa: BLE001 - surfaced in the caller thread
                    self._fail(e, f"ingesting the record of step {item.step}", retryable=False)
                    continue
                if self._window_steps() >= self._config.flush_every \
                        or self._window.nbytes >= self._config.flush_mb * 2 ** 20:
                    try:
                        self._write_window()
                    except Exception as e:  # noqa: BLE001
                        self._fail(e, "writing a shard", retryable=True)
                continue
            kind, arg, future = item
            try:
                if kind == "truncate":
                    result = self._truncate(arg)
                elif kind == "rescan":
                    result = self._rescan_others()
                else:
                    result = self._write_window()
            except Exception as e:  # noqa: BLE001
                with self._mutex:
                    if self._error_retryable:  # superseded by the error this command reports
                        self._error = None
                what = (f"truncate_after({arg}) failed (the store is consistent; call it again to finish "
                        "the truncation)") if kind == "truncate" else f"{kind} failed"
                future.set_exception(self._wrap(e, what))
                continue
            future.set_result(result)
            if kind == "stop":
                return

    def _fail(self, exc: Exception, what: str, *, retryable: bool) -> None:
        wrapped = self._wrap(exc, what)
        logger.error("%s", wrapped)
        with self._mutex:
            if self._error is None or not retryable:
                self._error, self._error_retryable = wrapped, retryable

    def _wrap(self, exc: Exception, what: str) -> StoreWriteError:
        if isinstance(exc, StoreWriteError):
            return exc
        rows = self._window.rows
        kept = (f"; {rows} buffered rows of {len(self._window_keys)} steps are kept in memory and the "
                "next flush retries them") if rows else ""
        error = StoreWriteError(f"gradient store {self.path} (rank {self.rank}): {what}: "
                                f"{describe_os_error(exc)}{kept}")
        error.__cause__ = exc
        return error

    def _ingest(self, record: GradientRecord) -> None:
        """Encode one record into the window, then drop its duplicate and non-finite rows there."""
        step, ids = record.step, record.ids
        window = self._window
        seg, lo = window.reserve(len(ids))
        bad = self._encode_into(record, seg, lo)
        # duplicates: repeats inside the record, then keys already stored or already in the window
        first = np.zeros(len(ids), dtype=bool)
        first[np.unique(ids, return_index=True)[1]] = True
        duplicate = ~first | self._keys_at(step).contains(ids)
        bad &= ~duplicate
        keep = ~duplicate & ~bad
        with self._mutex:
            counters = self._state.counters
            counters["records_appended"] += 1
            counters["rows_skipped_duplicate"] += int(duplicate.sum())
            counters["rows_skipped_nonfinite"] += int(bad.sum())
        self._manifest_dirty = True
        if duplicate.any() and not self._warned_duplicates:
            self._warned_duplicates = True
            logger.warning("gradient store %s: skipping rows whose (id, step) is already stored, e.g. "
                           "step %d ids %s (counted in stats; logged once)", self.path, step,
                           ids[duplicate][:8].tolist())
        if bad.any():
            self._window_nonfinite.append((step, ids[bad]))
        if not keep.any():
            return
        ids = ids[keep] if not keep.all() else ids
        window.commit(seg, lo, keep, ids, step, record.lr, record.loss_scale)
        self._window_keys.setdefault(step, []).append(ids)
        self._step_keys.add(ids)

    def _encode_into(self, record: GradientRecord, seg: WindowSegment, lo: int) -> np.ndarray:
        """Write each layer's rows, in the store's words, into ``seg`` from row ``lo`` (one copy
        that also casts); return which rows hold a NaN/inf once encoded (float16 overflow counts).
        A record on a GPU is cast there and joined into one ``[N, Σ]`` tensor first, so it costs one
        device-to-host copy, not one per layer."""
        n = len(record.ids)
        rows = [_rows(record.grads[name]) for name in self.layers]
        if any(r.device.type != "cpu" for r in rows):
            flat = [r.reshape(n, -1).to(self._torch_dtype) for r in rows]
            if len({f.device for f in flat}) > 1:
                flat = [f.to("cpu") for f in flat]
            parts = torch.split(torch.cat(flat, dim=1).to("cpu"), [f.shape[1] for f in flat], dim=1)
            rows = [part.reshape(r.shape) for part, r in zip(parts, rows)]
        # numpy casts float32/float16 to float32/float16 words (rounding as torch does) in half the time
        # of torch's copy_ at these sizes. Each layer's finiteness goes into its columns of one [N, Σ]
        # mask, so a record costs one row reduction (one per layer took as long as the copies).
        numpy_cast = self.dtype is not StoreDType.BFLOAT16
        finite = self._finite_scratch(n)
        col = 0
        with np.errstate(over="ignore"):        # a float16 overflow is counted as non-finite, not warned
            for r, buf in zip(rows, seg.grads):
                words = buf[lo:lo + n]
                if numpy_cast and r.dtype in _NUMPY_FLOATS:
                    np.copyto(words, r.numpy())
                else:                                 # to bfloat16, or from bfloat16/float64: torch casts
                    words_as_torch(words, self.dtype).copy_(r)
                if self._check_underflow and self._window.rows == 0 and r.device.type == "cpu":
                    self._warn_underflow(r, words)
                flat = words.reshape(n, -1)                           # a view: the window is C-ordered
                finite_words(flat, self.dtype, out=finite[:, col:col + flat.shape[1]])
                col += flat.shape[1]
        return ~finite.all(axis=1)

    def _warn_underflow(self, values: torch.Tensor, words: np.ndarray) -> None:
        """Warn once when float16 stored more than 1% of a layer's nonzero values as 0 (below its
        smallest subnormal, ~6e-8): those gradients are gone, where bfloat16 keeps float32's range."""
        nonzero = values.reshape(-1) != 0
        zeroed = int((torch.from_numpy(words.reshape(-1) == 0) & nonzero).sum())
        total = int(nonzero.sum())
        if total and zeroed > 0.01 * total:
            self._check_underflow = False
            logger.warning("gradient store %s: float16 stored %d of %d nonzero gradient values as 0 (%.1f%%: "
                           "smaller than float16's ~6e-8); store.dtype=bfloat16 keeps float32's range (logged "
                           "once)", self.path, zeroed, total, 100 * zeroed / total)

    def _finite_scratch(self, n: int) -> np.ndarray:
        """A bool ``[n, Σ]`` scratch mask (Σ: the words of one row over all layers), reused."""
        if self._finite is None or len(self._finite) < n:
            self._finite = np.empty((n, self._window.row_bytes // np.dtype(disk_dtype(self.dtype)).itemsize), bool)
        return self._finite[:n]

    def _keys_at(self, step: int) -> StepKeys:
        """The ids held at ``step`` (durable or in the window), rebuilt only when the step changes."""
        if self._step_keys is None or self._step_keys.step != step:
            self._step_keys = StepKeys(step, np.concatenate([self._index.ids_at(step),
                                                             *self._window_keys.get(step, [])]))
        return self._step_keys

    def _window_steps(self) -> int:
        """Steps in the window: those with rows buffered and those whose every row was dropped as
        non-finite (so a diverged run is written, i.e. warned about, every ``flush_every`` steps)."""
        if not self._window_nonfinite:
            return len(self._window_keys)
        return len(self._window_keys.keys() | {s for s, _ in self._window_nonfinite})

    def _write_window(self) -> ShardInfo | None:
        info = None
        if self._window.rows:
            seq = self._state.next_seq
            info = write_shard(self.path, self.rank, seq, self._window.chunks(), len(self.layers), self.dtype,
                               self._config.compression, self._window_basis)
            with self._mutex:
                self._state.shards[seq] = info
                self._state.next_seq = seq + 1
                self._state.counters["rows_written"] += info.num_rows
            self._index.add(info, {s: np.unique(np.concatenate(v)) for s, v in self._window_keys.items()})
            self._window.clear()
            self._window_keys = {}
            self._manifest_dirty = True
        # also when no shard was written: a window whose every row was NaN/inf is worth a warning most
        self._warn_nonfinite(info)
        if self._manifest_dirty:
            write_manifest(self.path, self._state)
            self._manifest_dirty = False
        with self._mutex:
            if self._error is not None and self._error_retryable:
                self._error = None  # the window that failed before is durable now
        return info

    def _warn_nonfinite(self, info: ShardInfo | None) -> None:
        """Warn of the window's rows dropped as non-finite (``info``: the shard just written, if any)."""
        if not self._window_nonfinite:
            return
        steps = sorted({s for s, _ in self._window_nonfinite})
        ids = np.concatenate([i for _, i in self._window_nonfinite])
        self._window_nonfinite = []
        shown = ids[:16].tolist()
        hint = " (values beyond ±65504 overflow float16; store.dtype=bfloat16 avoids that)" \
            if self.dtype is StoreDType.FLOAT16 else ""
        where = f"before {info.file}" if info is not None else "(no rows of this window were left to store)"
        warnings.warn(f"gradient store {self.path}: skipped {len(ids)} rows with NaN/inf gradients at "
                      f"steps {steps[0]}..{steps[-1]} (ids {shown}{' ...' if len(ids) > 16 else ''}) "
                      f"{where}{hint}", NonFiniteGradientWarning, stacklevel=2)

    def _truncate(self, step: int) -> int:
        """Drop the rows of steps after ``step`` (window and this rank's shards); return how many.

        No shard is rewritten: a cut marker (:func:`~.cuts.write_cut`, the next seq of the rank) is
        made durable first, and from then on every reader voids the rows after ``step`` of the rank's
        earlier shards, whatever happens next. Then the manifest says so (the cut shards' live rows,
        the voided ones gone), and the shards holding no live row are removed. A failure before the
        marker changes nothing; a crash after it leaves the cut in force (the next open of the rank
        finishes it); calling this again cuts at the same step again, which changes nothing more.
        """
        state = self._state
        # a failed flush whose shard was renamed into place before the failure (its folder's fsync)
        # left that file at next_seq, unindexed; its rows are still in the window, which is retried
        # under another name: remove it, or the next open would adopt its rows after this cut
        stray = self.path / shard_name(self.rank, state.next_seq)
        if stray.exists():
            stray.unlink()
            fsync_dir(stray.parent)
        cut = state.copy()
        gone: list[ShardInfo] = []
        dropped = self._window.rows_after(step)
        for info in state.shards.values():
            if info.step_max > step:
                live = apply_cut(self.path, info, step)   # reads only a shard the cut runs through
                dropped += info.num_rows - (live.num_rows if live is not None else 0)
                if live is None:
                    gone.append(info)
                    del cut.shards[info.seq]
                else:
                    cut.shards[info.seq] = live
        seq = state.next_seq
        with self._mutex:   # taken first: a marker renamed into place before a failure keeps its seq
            state.next_seq = seq + 1
        write_cut(self.path, self.rank, seq, step)     # from here on the cut holds
        cut.next_seq, cut.cuts[seq] = seq + 1, int(step)
        cut.truncations.append(int(step))
        cut.counters["rows_truncated"] += dropped
        self._window.drop_steps_after(step)
        self._window_keys = {s: v for s, v in self._window_keys.items() if s <= step}
        self._window_nonfinite = [(s, i) for s, i in self._window_nonfinite if s <= step]
        with self._mutex:
            self._state = cut
        self._rebuild_index()
        self._manifest_dirty = True
        write_manifest(self.path, cut)     # a failure here: the next flush or open writes it
        self._manifest_dirty = False
        for info in gone:                   # after the manifest that no longer names them
            remove_void(self.path, info.file)
        if dropped:
            logger.info("gradient store %s: rank %d cut back after step %d: %d rows dropped",
                        self.path, self.rank, step, dropped)
        return dropped

    def _rebuild_index(self) -> None:
        self._index = KeyIndex(self.path, [*self._state.shards.values(), *self._other_shards])
        self._step_keys = None


def _rows(grads: "torch.Tensor | LowRank") -> "torch.Tensor":
    """The on-disk row layout of a layer's gradients (LoRIF factors packed as ``[N, Ko + Ki, c]``)."""
    return grads.packed() if isinstance(grads, LowRank) else grads


def _make_writable_dir(root: Path, rank: int) -> None:
    """Create ``root`` (and ``shards/``) and prove it writable with a probe file, or raise StoreError."""
    try:
        (root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-r{rank:05d}-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"olmo_tda")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise StoreError(f"cannot create a gradient store at {root}: {describe_os_error(e)}. Set "
                         "store.path to a directory on a writable filesystem (not below a file, "
                         "not read-only)") from e
