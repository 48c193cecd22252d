"""The read side of a gradient store: ``GradientStore.open`` and bounded-memory block streaming.

Opening reads ``store.json`` and the manifests and reconciles them with the shard files (see
:mod:`.manifest`); it only sees durable shards, so it is safe while writers are still appending
(:meth:`GradientStore.refresh` picks up shards written since). Nothing is unpickled: HDF5 + JSON.

Rows come in *blocks* of at most ``block_size`` rows, read as HDF5 slices shard by shard; a block
may span shards. Memory is bounded by ``block_size`` rows of the selected layers plus the
per-shard key columns (ids/steps/lr/loss_scale, 32 bytes a row). By default (``block_size=None``)
a block is as many rows as fit in :data:`BLOCK_BYTES` of decoded float32 values of the selected
layers, at most :data:`MAX_BLOCK_ROWS`: a fixed 1024 rows would hold 1 GiB per block for a dense
OLMo-1B store (64 Linears at k=64) and, for LoRIF rows of a few KB, pay per-block costs (HDF5 reads,
kernel calls, top-k merges) every few MB.

Cold stores are read while they are scored: on opening a shard the reader asks the kernel
(``posix_fadvise(WILLNEED)``, from a helper thread so a busy disk never stalls the scoring) to
read the selected layers' bytes and the metadata of the *next* shard, and the metadata of the one
after it, so disk reads overlap this shard's arithmetic and opening a shard does not wait on them.
It is a hint only (the page cache, not our memory, holds what it reads; a failure is ignored) and
is off for sparse id selections and where the OS has no ``posix_fadvise``.

Each shard's datasets are opened once through HDF5's low-level API, and the contiguous ones (every
uncompressed store) are read straight from the file at their byte offsets (:class:`_ShardReader`):
h5py's per-call overhead made a small shard cost more to open and read than to score. Each dataset is
checked when it is first opened: its rows against the index (a file put under a shard's name since
the open: :class:`StoreError`, call :meth:`GradientStore.refresh`), a gradient dataset's row shape and
dtype against ``store.json`` (:class:`StoreCorruptError`). Shards are never rewritten: a cut marker
voids the rows after its step (``ShardInfo.cut``), and readers leave them out.

Every read checks checksums: before a shard's rows are handed out, each dataset the read needs (the
key columns and the selected layers) is read whole once and compared with the CRC-32 its writer
stored, at most once per dataset per opened store (an influence fit's several passes pay once). A
damaged shard is refused (:class:`StoreCorruptError` naming the shard and the layer), or, for a store
opened with ``skip_damaged=True``, left out whole and counted in :attr:`GradientStore.skipped`: a
damaged row is never scored. :meth:`GradientStore.verify` checks every dataset of every shard.
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import h5py
import numpy as np
import torch

from olmo_tda.config import ConfigError, StoreConfig, StoreDType

from .errors import StoreCorruptError, StoreError
from .format import (BASES_DIR, CRC_ATTR, STORE_JSON, ShardInfo, dataset_crc32, decode_grads, disk_dtype, open_h5,
                     stored_shape)
from .record import LowRank, cat_rows
from .manifest import COUNTERS, RankState, manifest_path, scan_store
from .meta import load_store_json

if TYPE_CHECKING:
    from .writer import StoreWriter

__all__ = ["GradientBlock", "GradientStore"]

log = logging.getLogger(__name__)


@dataclass
class GradientBlock:
    """Up to ``block_size`` stored rows; row ``i`` is example ``ids[i]`` at step ``steps[i]``."""

    ids: np.ndarray
    """int64 ``[n]``: global example (data) indices."""
    steps: np.ndarray
    """int64 ``[n]``: optimizer step of each row."""
    lr: np.ndarray
    """float64 ``[n]``: learning rate of that step."""
    loss_scale: np.ndarray
    """float64 ``[n]``: the loop's loss divisor at that step (already undone in ``grads``)."""
    grads: dict[str, "torch.Tensor | LowRank"] = field(default_factory=dict)
    """layer name -> float32 ``[n, k_out, k_in]`` (decoded from the store dtype), or
    :class:`~olmo_tda.store.record.LowRank` factors for a layer stored with a rank (see
    :attr:`GradientStore.layer_ranks`)."""
    basis: str | None = None
    """Digest of the eigenbasis version every row of the block was projected with (a basis that
    follows the run; a block never mixes versions), or None (the store's one projection)."""

    def __len__(self) -> int:
        return len(self.ids)


class GradientStore:
    """A gradient store opened for reading. Create one for writing with :meth:`create`.

    Example::

        store = GradientStore.open("run/tda/store")
        for block in store.iter_blocks(layers=["blocks.0.att_proj"], block_size=512):
            scores = torch.einsum("noi,oi->n", block.grads["blocks.0.att_proj"], query_grad)
    """

    def __init__(self, root: Path, meta: dict[str, Any], states: dict[int, RankState], *,
                 skip_damaged: bool = False):
        """Use :meth:`open`."""
        self.path = root
        self.meta = meta
        self._states = states
        self._key_summary: tuple[int, np.ndarray] | None = None
        self.skip_damaged = skip_damaged
        self.skipped: dict[str, dict[str, Any]] = {}
        """Shards left out of reads because a checksum failed (``skip_damaged=True``): file ->
        ``{"rows", "dataset", "layer", "problem"}``."""
        self._summed: dict[tuple[str, int, str], str | None] = {}     # (file, bytes, dataset) -> problem

    @functools.cached_property
    def _datasets(self) -> tuple[dict[str, tuple[str, tuple[int, ...]]], np.dtype]:
        """What ``store.json`` says every shard holds (see :class:`_Expected`), built once, not per shard."""
        grads = {f"grads/L{i:04d}": (layer["name"], stored_shape(layer)) for i, layer in enumerate(self.meta["layers"])}
        return grads, np.dtype(disk_dtype(self.dtype))

    # -- constructors -----------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike, *, repair: bool = False, skip_damaged: bool = False) -> "GradientStore":
        """Open an existing store read-only.

        ``repair=True`` moves unreadable shards to ``quarantine/`` (their rows are lost) and drops
        missing ones from the index instead of raising :class:`StoreCorruptError`.
        ``skip_damaged=True``: reads leave out a shard whose checksums fail (logged, and listed in
        :attr:`skipped`) instead of raising :class:`StoreCorruptError` naming it.
        """
        root = Path(path)
        meta = load_store_json(root)
        return cls(root, meta, cls._scan(root, meta, repair), skip_damaged=skip_damaged)

    @staticmethod
    def create(path: str | os.PathLike, meta: dict[str, Any], config: StoreConfig, rank: int = 0,
               *, repair: bool = False) -> "StoreWriter":
        """Create (or reopen for append) the store at ``path``: see :meth:`StoreWriter.create`."""
        from .writer import StoreWriter

        return StoreWriter.create(path, meta, config, rank, repair=repair)

    @staticmethod
    def _scan(root: Path, meta: dict[str, Any], repair: bool) -> dict[int, RankState]:
        shapes = [stored_shape(layer) for layer in meta["layers"]]
        return scan_store(root, layer_shapes=shapes, dtype=StoreDType(meta["dtype"]), repair=repair)

    def refresh(self) -> None:
        """Re-read manifests and shard listing, to see shards made durable since :meth:`open`."""
        self._states = self._scan(self.path, self.meta, False)
        self._key_summary = None

    # -- description ------------------------------------------------------------------------------

    @property
    def dtype(self) -> StoreDType:
        return StoreDType(self.meta["dtype"])

    @property
    def layers(self) -> list[str]:
        """Layer names in store order (layer ``i`` is ``grads/L{i:04d}`` in every shard)."""
        return [layer["name"] for layer in self.meta["layers"]]

    @property
    def layer_shapes(self) -> dict[str, tuple[int, int]]:
        """name -> ``(k_out, k_in)``."""
        return {layer["name"]: tuple(layer["shape"]) for layer in self.meta["layers"]}

    @property
    def layer_ranks(self) -> dict[str, int]:
        """name -> LoRIF factor rank c (0 = stored dense)."""
        return {layer["name"]: int(layer.get("rank", 0)) for layer in self.meta["layers"]}

    @property
    def shards(self) -> list[ShardInfo]:
        """All durable shards, in reading order (by first step, then rank, then seq)."""
        infos = [info for state in self._states.values() for info in state.shards.values()]
        return sorted(infos, key=lambda s: (s.step_min, s.rank, s.seq))

    @property
    def num_rows(self) -> int:
        """Stored rows: (example, step) pairs. An example seen at two steps is two rows."""
        return sum(info.num_rows for info in self.shards)

    @property
    def num_examples(self) -> int:
        """Distinct example ids (reads the ids column of every shard once)."""
        return self._keys()[0]

    @property
    def steps(self) -> np.ndarray:
        """Sorted unique steps present (int64; reads the steps column of every shard once)."""
        return self._keys()[1]

    @property
    def nbytes(self) -> int:
        """Bytes of all shard files on disk."""
        return sum(info.bytes for info in self.shards)

    @property
    def stats(self) -> dict[str, int]:
        """Writer counters summed over ranks (rows written, skipped as non-finite/duplicate, ...)."""
        out = dict.fromkeys(COUNTERS, 0)
        for state in self._states.values():
            for key in COUNTERS:
                out[key] += state.counters.get(key, 0)
        return out

    def summary(self) -> dict[str, Any]:
        """Everything ``olmo-tda inspect`` shows, as plain JSON-able values."""
        steps = self.steps
        shapes, ranks = self.layer_shapes, self.layer_ranks
        num_rows = self.num_rows
        return {
            "path": str(self.path),
            "store_id": self.meta.get("store_id"),
            "format_version": self.meta["format_version"],
            "library_version": self.meta.get("library_version"),
            "gradient_convention": self.meta["gradient_convention"],
            "representation": self.meta["representation"],
            "dtype": self.dtype.value,
            "num_rows": num_rows,
            "num_examples": self.num_examples,
            "steps": {"count": int(len(steps)), "min": int(steps[0]) if len(steps) else None,
                      "max": int(steps[-1]) if len(steps) else None},
            "layers": [{"name": n, "shape": list(shapes[n]), "rank": ranks[n]} for n in self.layers],
            "floats_per_row": int(sum(o * i for o, i in (stored_shape(layer) for layer in self.meta["layers"]))),
            "bytes": self.nbytes,
            "bytes_per_row": round(self.nbytes / num_rows, 1) if num_rows else None,
            "shards": len(self.shards),
            "ranks": sorted(self._states),
            "capture": self.meta["capture"],
            "projector_hash": self.meta["projector_hash"],
            "extra": self.meta.get("extra", {}),
            "stats": self.stats,
            **({"bases": self._bases_summary()} if self.bases else {}),
        }

    def _bases_summary(self) -> list[dict[str, Any]]:
        """Per eigenbasis version: its digest, the steps and rows of its shards, and whether its file is here."""
        out = []
        for digest in self.bases:
            infos = [info for info in self.shards if info.basis == digest]
            out.append({"digest": digest[:16],
                        "steps": [min(i.step_min for i in infos), max(i.step_max for i in infos)],
                        "rows": sum(i.num_rows for i in infos), "file": self.basis_path(digest).is_file()})
        return out

    def verify(self, progress: Any = None) -> dict[str, Any]:
        """Read every dataset of every shard and compare it with the CRC-32 its writer stored.

        The eigenbasis versions the shards name (``bases/``) are loaded and checked against their
        digests too. Returns ``{"shards", "datasets", "bytes_read", "damaged": [{"file", "dataset", "problem"}],
        "unchecked": [files without checksums (written before they were kept)], "changed": [files a
        live writer's truncate rewrote or removed while they were read: not checked]}``; nothing raises
        for a damaged shard, every one is listed. ``progress(done, total)`` is called per shard.
        Reads ~:data:`BLOCK_BYTES` at a time, whatever the shard's size.
        """
        names = ["ids", "steps", "lr", "loss_scale", *(f"grads/L{i:04d}" for i in range(len(self.layers)))]
        damaged: list[dict[str, Any]] = []
        unchecked: list[str] = []
        changed: list[str] = []
        datasets = nbytes = 0
        shards = self.shards
        for done, info in enumerate(shards):
            try:
                with self._reader(info) as shard:
                    missing = False
                    for name in names:
                        want = shard.attr(name, CRC_ATTR)
                        if want is None:
                            missing = True
                            continue
                        got = dataset_crc32(shard.blocks(name, BLOCK_BYTES))
                        datasets += 1
                        nbytes += shard.nbytes(name)
                        if got != int(want):
                            damaged.append({"file": info.file, "dataset": name,
                                            "problem": f"checksum {got:#010x} != stored {int(want):#010x}: its "
                                                       "bytes changed after it was written"})
                    if missing:
                        unchecked.append(info.file)
            except StoreCorruptError as e:
                damaged.append({"file": info.file, "dataset": None, "problem": str(e)})
            except StoreError as e:   # a writer's truncate_after rewrote or removed it meanwhile: not damage
                changed.append(info.file)
                log.info("verify: %s changed while it was read (%s); refresh() and verify again to check it",
                         info.file, e)
            if progress is not None:
                progress(done + 1, len(shards))
        from ..capture.eigenbasis import EigenBasisError

        for digest in self.bases:       # each version's file: present, readable, and hashing to its name
            try:
                self.load_basis(digest)
            except EigenBasisError as e:
                damaged.append({"file": str(self.basis_path(digest).relative_to(self.path)), "dataset": None,
                                "problem": str(e)})
        return {"shards": len(shards), "datasets": datasets, "bytes_read": nbytes, "damaged": damaged,
                "unchecked": unchecked, "changed": changed}

    def _sums_match(self, info: ShardInfo, shard: "_ShardReader", names: list[str]) -> bool:
        """Whether datasets ``names`` of the open ``shard`` match their stored CRC-32 (each read whole
        once per opened store). A mismatch raises :class:`StoreCorruptError` naming the shard and
        layer, or with :attr:`skip_damaged` returns False (the caller leaves the shard out) and is
        listed in :attr:`skipped`. Shards written before checksums were kept pass unchecked."""
        for name in names:
            key = (info.file, info.bytes, name)
            if key not in self._summed:
                try:
                    want = shard.attr(name, CRC_ATTR)
                    got = None if want is None else dataset_crc32(shard.blocks(name, BLOCK_BYTES))
                    self._summed[key] = (None if want is None or got == int(want) else
                                         f"checksum {got:#010x} != stored {int(want):#010x}")
                except StoreCorruptError as e:          # e.g. a compressed chunk that no longer inflates
                    if not self.skip_damaged:
                        raise
                    self._summed[key] = f"unreadable: {e}"
            problem = self._summed[key]
            if problem is None:
                continue
            layer = self.layers[int(name[len("grads/L"):])] if name.startswith("grads/L") else None
            what = f"layer {layer!r} ({name})" if layer else f"dataset {name}"
            if not self.skip_damaged:
                raise StoreCorruptError(
                    f"gradient store shard {self.path / info.file}: {what} is damaged ({problem}: its bytes "
                    f"changed after it was written); refusing to score its {info.num_rows} rows. `olmo-tda "
                    "inspect --verify` lists every damaged shard; restore it from a copy, or read without it "
                    "(GradientStore.open(..., skip_damaged=True), `olmo-tda attribute --skip-damaged`)")
            if info.file not in self.skipped:
                log.warning("gradient store shard %s: %s is damaged (%s): its %d rows are left out",
                            self.path / info.file, what, problem, info.num_rows)
                self.skipped[info.file] = {"rows": info.num_rows, "dataset": name, "layer": layer,
                                           "problem": problem}
            return False
        return True

    def _keys(self) -> tuple[int, np.ndarray]:
        if self._key_summary is None:
            ids, steps = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
            for info in self.shards:
                with self._reader(info) as shard:
                    shard_ids, shard_steps = shard.read("ids"), shard.read("steps")
                if (live := info.live(shard_steps)) is not None:
                    shard_ids, shard_steps = shard_ids[live], shard_steps[live]
                ids.append(np.unique(shard_ids))
                steps.append(np.unique(shard_steps))
            self._key_summary = (int(len(np.unique(np.concatenate(ids)))), np.unique(np.concatenate(steps)))
        return self._key_summary

    # -- reading ----------------------------------------------------------------------------------

    def block_rows(self, layers: Iterable[str] | None = None) -> int:
        """Rows of a default block: :data:`BLOCK_BYTES` of decoded float32 values of ``layers`` (all
        by default), between 1 and :data:`MAX_BLOCK_ROWS`."""
        return self._block_rows(self._layer_indices(layers))

    def _block_rows(self, indices: list[tuple[str, int]]) -> int:
        row_bytes = 4 * sum(int(np.prod(stored_shape(self.meta["layers"][i]))) for _, i in indices)
        return int(min(MAX_BLOCK_ROWS, max(1, BLOCK_BYTES // max(1, row_bytes))))

    @property
    def bases(self) -> list[str]:
        """Digests of the eigenbasis versions the rows were projected with, in store order of first
        use (empty: the store has one projection, named in ``store.json``)."""
        return list(dict.fromkeys(info.basis for info in self.shards if info.basis is not None))

    def basis_path(self, digest: str) -> Path:
        """The file of eigenbasis version ``digest``: ``bases/<digest>.safetensors``."""
        return self.path / BASES_DIR / f"{digest}.safetensors"

    def load_basis(self, digest: str) -> Any:
        """Eigenbasis version ``digest`` (verified against its digest); a missing file is an error
        that names it."""
        from ..capture.eigenbasis import EigenBasis, EigenBasisError

        path = self.basis_path(digest)
        if not path.is_file():
            raise EigenBasisError(f"gradient store {self.path}: rows were projected with eigenbasis version "
                                  f"{digest[:16]}, whose file {path} is missing (restore it from a copy of the store)")
        basis = EigenBasis.open(path)
        if basis.digest != digest:
            raise EigenBasisError(f"gradient store {self.path}: {path} holds eigenbasis {basis.digest[:16]}, not the "
                                  f"version {digest[:16]} its name says (the file was replaced)")
        return basis

    def iter_blocks(self, layers: Iterable[str] | None = None, block_size: int | None = None,
                    steps: Iterable[int] | None = None, ids: Iterable[int] | None = None,
                    readahead: bool = True, basis: str | None = None) -> Iterator[GradientBlock]:
        """Stream rows in blocks of at most ``block_size`` rows (the last may be smaller; None:
        :meth:`block_rows`, sized by bytes). A block holds the rows of one eigenbasis version
        (``block.basis``); ``basis``: only that version's rows.

        ``layers``: names to decode (default all); ``steps`` / ``ids``: keep only rows whose step /
        example id is in the given collection. Row order is shard order (see :attr:`shards`),
        append order within a shard; it does not depend on ``block_size``. ``readahead``: ask the
        kernel for the next shard's bytes while this one is scored (see the module docstring;
        off when ``ids`` is given).
        """
        indices = self._layer_indices(layers)      # (``layers`` may be a one-shot iterable)
        if block_size is None:
            block_size = self._block_rows(indices)
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        step_set = None if steps is None else np.unique(np.asarray(list(steps), dtype=np.int64))
        id_set = None if ids is None else np.unique(np.asarray(list(ids), dtype=np.int64))
        pending: list[GradientBlock] = []
        n_pending = 0
        visit = [info for info in self.shards
                 if (step_set is None or _range_hits(step_set, info.step_min, info.step_max))
                 and (basis is None or info.basis == basis)]
        needed = [*_KEY_COLUMNS, *(f"grads/L{i:04d}" for _, i in indices)]
        for info, shard in self._opened(visit, [i for _, i in indices], readahead and id_set is None):
            with shard:
                if not self._sums_match(info, shard, needed):
                    continue
                shard_steps = shard.read("steps")     # checked to hold the index's info.file_rows rows
                shard_ids = shard.read("ids")
                mask = info.live(shard_steps)         # a cut marker after the shard voids its later rows
                if mask is None:
                    mask = np.ones(len(shard_steps), dtype=bool)
                if step_set is not None:
                    mask &= np.isin(shard_steps, step_set)
                if id_set is not None:
                    mask &= np.isin(shard_ids, id_set)
                rows = np.flatnonzero(mask)
                if len(rows) == 0:
                    continue
                lr, loss_scale = shard.read("lr"), shard.read("loss_scale")
                if pending and pending[-1].basis != info.basis:     # a block holds one basis version
                    yield _concat(pending, indices)
                    pending, n_pending = [], 0
                pos = 0
                while pos < len(rows):
                    take = rows[pos:pos + block_size - n_pending]
                    pos += len(take)
                    grads = {name: self._wrap(name, decode_grads(shard.read(f"grads/L{i:04d}", take), self.dtype))
                             for name, i in indices}
                    pending.append(GradientBlock(ids=shard_ids[take], steps=shard_steps[take], lr=lr[take],
                                                 loss_scale=loss_scale[take], grads=grads, basis=info.basis))
                    n_pending += len(take)
                    if n_pending == block_size:
                        yield _concat(pending, indices)
                        pending, n_pending = [], 0
        if pending:
            yield _concat(pending, indices)

    def read_all(self, layers: Iterable[str] | None = None, steps: Iterable[int] | None = None,
                 ids: Iterable[int] | None = None, basis: str | None = None) -> GradientBlock:
        """Every selected row as one block (for small stores and tests; memory = whole selection).
        A store of several eigenbasis versions needs ``basis`` (rows of two versions are not one block)."""
        blocks = list(self.iter_blocks(layers, block_size=max(1, self.num_rows), steps=steps, ids=ids, basis=basis))
        if len(blocks) > 1:
            raise ConfigError(f"gradient store {self.path} holds rows of {len(self.bases)} eigenbasis versions "
                              f"({', '.join(d[:12] for d in self.bases)}): read one with read_all(..., basis=digest), "
                              "or stream them with iter_blocks")
        if blocks:
            return blocks[0]
        empty = {name: self._wrap(name, torch.zeros((0, *stored_shape(self.meta["layers"][i]))))
                 for name, i in self._layer_indices(layers)}
        return GradientBlock(ids=np.zeros(0, np.int64), steps=np.zeros(0, np.int64), lr=np.zeros(0),
                             loss_scale=np.zeros(0), grads=empty)

    def _wrap(self, name: str, rows: torch.Tensor) -> "torch.Tensor | LowRank":
        """Decoded on-disk rows of a layer as what they represent: dense, or LoRIF factors."""
        if self.layer_ranks[name]:
            return LowRank.from_packed(rows, self.layer_shapes[name][0])
        return rows

    def _layer_indices(self, layers: Iterable[str] | None) -> list[tuple[str, int]]:
        names = self.layers
        if layers is None:
            return list(zip(names, range(len(names))))
        if isinstance(layers, str):
            layers = [layers]
        position = {n: i for i, n in enumerate(names)}
        out = []
        for name in layers:
            if name not in position:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise KeyError(f"gradient store {self.path} has no layer {name!r}{hint} "
                               f"(it has {len(names)} layers: see GradientStore.layers)")
            out.append((name, position[name]))
        return out

    def _opened(self, infos: list[ShardInfo], layer_indices: list[int], readahead: bool):
        """``(info, _ShardReader)`` for each shard in turn (the caller closes each); with
        ``readahead`` the next shard is opened one ahead and its head and selected layers' bytes
        requested, and the head of the shard after it."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="olmo_tda-readahead") \
            if readahead and hasattr(os, "posix_fadvise") and len(infos) > 1 else None
        ahead = None
        try:
            for j, info in enumerate(infos):
                shard, ahead = (ahead or self._reader(info)), None
                if pool is not None and j == 0:
                    try:
                        pool.submit(_willneed, shard.path, shard.byte_ranges(layer_indices))
                    except BaseException:
                        shard.close()
                        raise
                if pool is not None and j + 1 < len(infos):
                    try:
                        ahead = self._reader(infos[j + 1])
                        head = ahead.head_length()
                        pool.submit(_willneed, ahead.path, [(0, head)] * bool(head) + ahead.byte_ranges(layer_indices))
                        if head and j + 2 < len(infos):
                            # the one after: its metadata, so that opening it (on this thread, next
                            # turn) reads the page cache; a few KB more than it needs do no harm
                            pool.submit(_willneed, self.path / infos[j + 2].file, [(0, head + (head >> 1))])
                    except (StoreCorruptError, OSError, KeyError, ValueError, RuntimeError):
                        if ahead is not None:       # opened but unreadable: reopened (and raised) in its turn
                            ahead.close()
                        ahead = None            # raised in its turn, after this shard's rows
                yield info, shard
        finally:
            if ahead is not None:
                ahead.close()
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def _reader(self, info: ShardInfo) -> "_ShardReader":
        """The shard open for reading, its datasets checked against ``info`` and ``store.json``."""
        return _ShardReader(self._open_shard(info), self.path / info.file, _Expected.of(self, info))

    def _open_shard(self, info: ShardInfo):
        path = self.path / info.file
        try:
            return open_h5(path)
        except FileNotFoundError as e:
            raise StoreError(f"gradient store shard {path} is gone since the store was opened: a writer's "
                             "truncate_after removed it (call refresh() on the store and read again), or it "
                             "was deleted (open the store with repair=True to drop it from the index)") from e
        except (OSError, ValueError) as e:
            raise StoreCorruptError(f"gradient store shard {path} cannot be opened ({e}); if a writer "
                                    "truncated the store meanwhile call refresh(), else open with "
                                    "repair=True") from e


_KEY_COLUMNS = ("ids", "steps", "lr", "loss_scale")

BLOCK_BYTES = 64 << 20
"""Decoded (float32) bytes of the selected layers per block when ``block_size`` is None: 1024 rows
of 4 dense 64×64 layers."""
MAX_BLOCK_ROWS = 4096
"""Cap on the rows of a default block (for factor rows of c=2 at k=64, 4096 rows are 16 MB: larger
blocks were no faster, and two of them are alive at once while the next is read)."""


@dataclass(frozen=True)
class _Expected:
    """What the store's index (the manifest, as read at open/refresh) and ``store.json`` say a shard
    holds; :class:`_ShardReader` checks each dataset against it when it first opens it."""

    info: ShardInfo
    manifest: Path
    store_json: Path
    grads: dict[str, tuple[str, tuple[int, ...]]]
    """dataset name (``grads/L0000``) -> (layer name, on-disk row shape)."""
    words: np.dtype
    """numpy dtype of the stored gradient words (see :func:`~olmo_tda.store.format.disk_dtype`)."""

    @staticmethod
    def of(store: GradientStore, info: ShardInfo) -> "_Expected":
        grads, words = store._datasets
        return _Expected(info, manifest_path(store.path, info.rank), store.path / STORE_JSON, grads, words)


class _ShardReader:
    """One open shard (an h5py file it closes). Each dataset is opened once, through HDF5's low-level
    API: a high-level lookup or read costs ~0.15 ms, and a shard of a few hundred rows took ~4 ms,
    more than scoring it. A contiguous dataset (uncompressed, the writer's default) is read straight
    from the file at its byte offset; a chunked (compressed) one, a non-native byte order, or a
    sparse selection through HDF5. With ``expected``, each dataset is checked against it when first
    opened (without, as in tests of the reading itself, nothing is checked)."""

    def __init__(self, f, path: Path, expected: _Expected | None = None):
        self.f, self.path, self._file = f, path, None
        self.expected = expected
        self._layouts: dict[str, tuple] = {}

    def __enter__(self) -> "_ShardReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self.f.close()

    def _layout(self, name: str) -> tuple:
        """``(dataset id, shape, dtype, byte offset or None when not one contiguous range)``."""
        layout = self._layouts.get(name)
        if layout is None:
            try:
                dsid = h5py.h5d.open(self.f.id, name.encode())
            except (KeyError, OSError, ValueError) as e:
                raise self._damaged(name, f"cannot be opened ({type(e).__name__}: {e})") from e
            shape, dtype, offset = dsid.shape, dsid.dtype, dsid.get_offset()
            if self.expected is not None:
                self._check(name, shape, dtype)
            if offset is not None and dsid.get_storage_size() != math.prod(shape) * dtype.itemsize:
                offset = None
            layout = self._layouts[name] = (dsid, shape, dtype, offset)
        return layout

    def _check(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        """``name`` holds the index's rows and, for a gradient dataset, ``store.json``'s row shape and dtype."""
        exp = self.expected
        layer, row_shape = exp.grads.get(name, (None, ()))
        if not shape or shape[0] != exp.info.file_rows:
            rows = shape[0] if shape else "no"
            if self._size() != exp.info.bytes:
                raise self._changed(f"dataset {name} has {rows} rows where the index says {exp.info.file_rows}")
            raise StoreCorruptError(
                f"gradient store shard {self.path}: dataset {name} has {rows} rows but {exp.manifest.name} "
                f"lists the shard with {exp.info.file_rows}; the shard or the manifest is damaged. Move "
                f"{exp.manifest} aside and open the store with GradientStore.open(path, repair=True) to "
                "rebuild the manifest from the shard files (and quarantine the shard if it is unreadable)")
        if layer is not None and (shape[1:] != row_shape or dtype != exp.words):
            raise StoreCorruptError(
                f"gradient store shard {self.path}: dataset {name} holds rows of {shape[1:]} {dtype}, but "
                f"{exp.store_json} says layer {layer!r} is stored as {row_shape} {exp.words}; one of the two "
                f"is damaged or was edited: restore it from a copy")
        if layer is None and len(shape) != 1:
            raise self._damaged(name, f"has shape {shape}, expected ({exp.info.file_rows},)")

    def _size(self) -> int:
        """Bytes of the file this reader has open (not of whatever now has its name)."""
        try:
            return os.fstat(self.f.id.get_vfd_handle()).st_size
        except (OSError, ValueError, TypeError):        # not a plain POSIX file driver: by name
            try:
                return os.stat(self.path).st_size
            except OSError:
                return -1                               # gone: it changed

    def _changed(self, what: str) -> StoreError:
        return StoreError(f"gradient store shard {self.path} changed since the store was opened ({what}): "
                          "a writer's truncate_after rewrote or removed it. Call refresh() on the store "
                          "(or open it again) and read again")

    def _damaged(self, name: str, what: str) -> StoreCorruptError:
        # repair=True alone does not help: it quarantines only shards whose structure or last row
        # fails (or whose size disagrees with the manifest), not damage inside a complete file
        return StoreCorruptError(
            f"gradient store shard {self.path}: dataset {name} {what}; the file is damaged. Restore it "
            f"from a copy, or move it out of its directory and open the store with "
            "GradientStore.open(path, repair=True) to drop it from the index (its rows are lost)")

    def read(self, name: str, rows: np.ndarray | None = None) -> np.ndarray:
        """Dataset ``name``: every row, or the sorted ``rows``."""
        dsid, shape, dtype, offset = self._layout(name)
        lo, hi = (0, shape[0]) if rows is None else (int(rows[0]), int(rows[-1]) + 1)
        if lo < 0 or hi > shape[0]:
            raise self._changed(f"rows {lo}..{hi - 1} of dataset {name} were asked for; it has {shape[0]}")
        if offset is None or not dtype.isnative or (rows is not None and hi - lo > 2 * len(rows)):
            dataset = h5py.Dataset(dsid)
            try:
                return dataset[:] if rows is None else _read_rows(dataset, rows)
            except OSError as e:     # e.g. a compressed chunk whose bytes were damaged in place
                raise self._damaged(name, f"cannot be read ({e})") from e
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        out = np.empty((hi - lo, *shape[1:]), dtype=dtype)
        try:
            if self._file is None:
                self._file = self._open_raw()
            self._file.seek(offset + lo * row_bytes)
            got = _readinto_all(self._file, memoryview(out).cast("B"))
        except OSError as e:
            raise self._damaged(name, f"cannot be read ({type(e).__name__}: {e})") from e
        if got != out.nbytes:
            raise StoreCorruptError(f"gradient store shard {self.path}: dataset {name} ends after {got} of its "
                                    f"{out.nbytes} bytes from row {lo} (truncated); open the store with repair=True")
        return out if rows is None or hi - lo == len(rows) else out[rows - lo]

    def attr(self, name: str, key: str) -> Any:
        """Attribute ``key`` of dataset ``name`` (None when it has none)."""
        dsid = self._layout(name)[0]
        try:
            return h5py.Dataset(dsid).attrs.get(key)
        except (OSError, KeyError, ValueError) as e:
            raise self._damaged(name, f"has an unreadable attribute {key!r} ({type(e).__name__}: {e})") from e

    def nbytes(self, name: str) -> int:
        _, shape, dtype, _ = self._layout(name)
        return math.prod(shape) * dtype.itemsize

    def blocks(self, name: str, max_bytes: int) -> Iterator[np.ndarray]:
        """Dataset ``name``'s rows, in order, in blocks of at most ``max_bytes`` (at least one row)."""
        _, shape, dtype, _ = self._layout(name)
        step = max(1, max_bytes // max(1, dtype.itemsize * math.prod(shape[1:])))
        for lo in range(0, shape[0], step):
            yield self.read(name, np.arange(lo, min(shape[0], lo + step)))

    def _open_raw(self):
        """The shard's bytes, unbuffered: the file HDF5 has open, not a newer one under its name (a
        writer's truncate_after replaces a shard by rename), whose offsets would differ."""
        try:
            raw = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            raise self._changed("it is gone") from None
        try:
            same = os.path.sameopenfile(raw.fileno(), self.f.id.get_vfd_handle())
        except (OSError, ValueError, TypeError):        # not a plain POSIX file driver: trust the name
            same = True
        if not same:
            raw.close()
            raise self._changed("another file has its name now")
        return raw

    def byte_ranges(self, layer_indices: list[int]) -> list[tuple[int, int]]:
        """``(offset, length)`` in the file of each selected layer's rows; ``[(0, 0)]`` (the whole
        file) when a dataset is chunked (compressed stores), whose bytes are not one range."""
        ranges = []
        for i in layer_indices:
            _, shape, dtype, offset = self._layout(f"grads/L{i:04d}")
            if offset is None:
                return [(0, 0)]
            ranges.append((int(offset), math.prod(shape) * dtype.itemsize))
        return ranges

    def head_length(self) -> int:
        """Bytes before the first gradient dataset: the file's metadata and its small datasets (ids,
        steps, lr, loss_scale), which the writer creates first; 0 when it is chunked."""
        return int(self._layout("grads/L0000")[3] or 0)


def _readinto_all(file, view: memoryview) -> int:
    """Fill ``view`` from ``file``'s position; returns the bytes read (fewer only at end of file). One
    ``read`` returns at most 0x7ffff000 bytes on Linux, so a read of more than 2 GiB takes several."""
    got = 0
    while got < len(view):
        n = file.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _willneed(path: Path, ranges: list[tuple[int, int]]) -> None:
    """(helper thread) Ask the kernel to read ``ranges`` of ``path`` into the page cache.

    Linux serves at most the device's readahead window per ``WILLNEED`` call (8 MiB on some disks,
    128 KiB by default): one call for a whole range reads only its start. So the range goes in
    window-sized calls (each returns once its reads are queued)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            step = _readahead_window(st.st_dev)
            for offset, length in ranges:
                end = offset + length if length else st.st_size
                for pos in range(offset, end, step):
                    os.posix_fadvise(fd, pos, min(step, end - pos), os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    except OSError as e:        # a hint only: the reads that follow still work (or raise) as usual
        log.debug("readahead of %s skipped: %s", path, e)


@functools.lru_cache(maxsize=None)
def _readahead_window(dev: int) -> int:
    """Bytes the kernel reads per readahead request on the device ``dev`` (128 KiB if unknown)."""
    try:
        kib = int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text())
    except (OSError, ValueError):
        kib = 128
    return max(128, kib) << 10


def _range_hits(sorted_values: np.ndarray, lo: int, hi: int) -> bool:
    """Whether any of ``sorted_values`` lies in ``[lo, hi]``."""
    i = np.searchsorted(sorted_values, lo)
    return bool(i < len(sorted_values) and sorted_values[i] <= hi)


def _read_rows(dataset, rows: np.ndarray) -> np.ndarray:
    """``dataset[rows]`` for sorted ``rows``, as one contiguous slice read whenever that is not wasteful."""
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    if hi - lo == len(rows):
        return dataset[lo:hi]
    if hi - lo <= 2 * len(rows):
        return dataset[lo:hi][rows - lo]
    return dataset[rows]  # sparse selection: HDF5 point selection, memory stays ~len(rows)


def _concat(pieces: list[GradientBlock], indices: list[tuple[str, int]]) -> GradientBlock:
    if len(pieces) == 1:
        return pieces[0]
    return GradientBlock(
        ids=np.concatenate([p.ids for p in pieces]), steps=np.concatenate([p.steps for p in pieces]),
        lr=np.concatenate([p.lr for p in pieces]), loss_scale=np.concatenate([p.loss_scale for p in pieces]),
        grads={name: cat_rows([p.grads[name] for p in pieces]) for name, _ in indices}, basis=pieces[0].basis)
