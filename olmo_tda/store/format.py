"""On-disk format of a gradient store: layout, dtype codec, atomic files, shard files.

A store is a directory::

    store.json                 self-describing metadata, written once (see :mod:`.meta`)
    manifest-r00000.json       per-rank index of that rank's shards + counters (rewritten atomically)
    index/r00000-00000000-*.json  sealed blocks of that index: 256 older shards each, written once
    shards/r00000-00000000.h5  one HDF5 file per rank per flush; written once, never changed
    shards/r00000-00000007.cut.json  a cut marker: rank 0's rows of steps after its ``step`` in the
                               shards before seq 7 are void (a resume from an earlier checkpoint)
    locks/r00000.lock          held (flock) by the live writer of rank 0; tells readers it is alive
    quarantine/                unreadable shards moved aside by ``repair=True``
    bases/<digest>.safetensors  eigenbasis versions a following basis projected rows with (immutable)

A *row* is one (example id, step) pair: the compact gradient of one example at one optimizer step.
Inside a shard (N rows, layer ``i`` of ``store.json["layers"]`` with shape ``[k_out, k_in]``)::

    attrs: format_version, rank, seq, num_rows, step_min, step_max, dtype, and basis (the digest of
           the eigenbasis version of its rows, when the run's basis follows training; its file is
           bases/<digest>.safetensors)
    ids          int64   [N]   global example (data) index
    steps        int64   [N]   optimizer step
    lr           float64 [N]   learning rate of that step
    loss_scale   float64 [N]   divisor the loop applied to the summed token loss (already undone)
    grads/L0000  [N, k_out, k_in]  float32 | float16 | uint16 (raw bfloat16 bits; HDF5 has no bf16)
                 or [N, k_out + k_in, c] for a layer stored as rank-c LoRIF factors (``"rank": c`` in
                 ``store.json``): rows of A [k_out, c] above rows of B [k_in, c], ``Ĝ = A Bᵀ``

Every dataset carries a ``crc32`` attribute: zlib's CRC-32 of its values' bytes in row order (as
uncompressed), which :func:`dataset_crc32` recomputes and ``GradientStore.verify`` compares (shards
written before it was added have none). Every read of a shard's rows compares it (a damaged row is
never scored); ``olmo-tda inspect --verify`` checks every shard at once.

HDF5 names never contain module names (they may contain ``/`` or ``.``): layer ``i`` is
``grads/L{i:04d}`` and its name lives only in ``store.json``.

Crash safety rests on one rule: every file appears under its final name only complete and fsynced
(write ``*.tmp`` → fsync → ``os.replace`` → fsync the directory; ``store.json``, which every rank
may race to create, is published with ``os.link`` instead, so the first rank's stays). Anything
named ``*.tmp`` is garbage.
"""

from __future__ import annotations

import errno
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from olmo_tda.config import StoreDType

from .errors import StoreCorruptError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ShardInfo",
    "stored_shape",
    "encode_grads",
    "words_as_torch",
    "decode_grads",
    "finite_words",
    "write_json_atomic",
    "publish_json_once",
    "fsync_dir",
    "shard_name",
    "parse_shard_name",
    "write_shard",
    "prepare_shard",
    "commit_shard",
    "read_shard_info",
    "dataset_crc32",
    "CRC_ATTR",
]

FORMAT_NAME = "olmo_tda.store"
FORMAT_VERSION = 1

STORE_JSON = "store.json"
SHARD_DIR = "shards"
LOCK_DIR = "locks"
SEGMENT_DIR = "index"
QUARANTINE_DIR = "quarantine"
BASES_DIR = "bases"
TMP_SUFFIX = ".tmp"
CRC_ATTR = "crc32"
_SHARD_RE = re.compile(r"^r(\d{5})-(\d{8})\.h5$")
_MANIFEST_RE = re.compile(r"^manifest-r(\d{5})\.json$")

# numpy dtype of the stored words for each store dtype
_DISK_DTYPE = {StoreDType.FLOAT32: np.float32, StoreDType.FLOAT16: np.float16,
               StoreDType.BFLOAT16: np.uint16}


def stored_shape(layer: dict[str, Any]) -> tuple[int, int]:
    """The on-disk row shape of a ``store.json`` layer: ``(k_out, k_in)`` dense, or
    ``(k_out + k_in, c)`` for rank-c factors."""
    k_out, k_in = layer["shape"]
    rank = int(layer.get("rank", 0))
    return (k_out + k_in, rank) if rank else (k_out, k_in)


# ---------------------------------------------------------------------------------------------
# dtype codec


def disk_dtype(dtype: StoreDType) -> type:
    return _DISK_DTYPE[StoreDType(dtype)]


def torch_dtype(dtype: StoreDType) -> torch.dtype:
    """The torch dtype whose values the store's words hold."""
    return {StoreDType.FLOAT32: torch.float32, StoreDType.FLOAT16: torch.float16,
            StoreDType.BFLOAT16: torch.bfloat16}[StoreDType(dtype)]


def encode_grads(grads_NOI: torch.Tensor, dtype: StoreDType) -> np.ndarray:
    """float tensor ``[N, k_out, k_in]`` (CPU) → numpy in the store's on-disk words (torch's rounding)."""
    words = np.empty(tuple(grads_NOI.shape), dtype=disk_dtype(dtype))
    words_as_torch(words, dtype).copy_(grads_NOI)
    return words


def words_as_torch(words: np.ndarray, dtype: StoreDType) -> torch.Tensor:
    """A torch view (no copy) of on-disk words, typed as the values they hold: copying a float tensor
    into it encodes in place (bfloat16: torch's rounding, as :func:`encode_grads`)."""
    if StoreDType(dtype) is StoreDType.BFLOAT16:
        return torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(words)


def decode_grads(words: np.ndarray, dtype: StoreDType) -> torch.Tensor:
    """On-disk words ``[n, k_out, k_in]`` → torch float32 (exact: every stored value is representable)."""
    dtype = StoreDType(dtype)
    if dtype is StoreDType.BFLOAT16:
        # the raw words as torch bf16, widened in one pass (numpy's uint32 shift took ~1.7x as long)
        return torch.from_numpy(np.ascontiguousarray(words).view(np.int16)).view(torch.bfloat16).float()
    return torch.from_numpy(np.ascontiguousarray(words, dtype=np.float32))


def finite_words(words: np.ndarray, dtype: StoreDType, out: np.ndarray | None = None) -> np.ndarray:
    """bool, elementwise: which *encoded* words hold a finite value (so a float16 overflow does not),
    into ``out`` if given."""
    if StoreDType(dtype) is StoreDType.BFLOAT16:
        return np.not_equal(words & 0x7F80, 0x7F80, out=out)   # exponent all ones = inf or NaN
    return np.isfinite(words, out=out)


# ---------------------------------------------------------------------------------------------
# atomic files


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in ``path`` durable (POSIX: the directory entry lives in the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict[str, Any], *, tmp_tag: str = "") -> None:
    """Write JSON to ``path`` via temp + fsync + rename + directory fsync; never a partial file."""
    write_text_atomic(path, _json_text(data), tmp_tag=tmp_tag)


def write_text_atomic(path: Path, text: str, *, tmp_tag: str = "") -> None:
    """Write ``text`` to ``path`` via temp + fsync + rename + directory fsync; never a partial file."""
    tmp = path.with_name(f"{path.name}{tmp_tag}{TMP_SUFFIX}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_dir(path.parent)


# errnos of link(2) on a filesystem without hard links (FAT, some FUSE mounts)
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


def publish_json_once(path: Path, data: dict[str, Any], *, tmp_tag: str = "") -> bool:
    """Create ``path`` holding ``data`` unless it exists; return whether this call created it.

    For a file that several processes may race to create (``store.json``, by every rank of a run):
    the first one wins and the others leave it as it is, to read and check what won
    (:func:`write_json_atomic`'s ``os.replace`` would let the last one win, each believing it had).
    The temp file is complete and fsynced before ``os.link`` gives it the final name, which fails
    if that name is taken, so a reader never sees a partial file. On a filesystem without hard
    links this falls back to exists-then-rename (racy, as that is all such a filesystem offers).
    Raises ``OSError`` with the temp file removed.
    """
    tmp = path.with_name(f"{path.name}{tmp_tag}{TMP_SUFFIX}")
    try:
        _write_json_file(tmp, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
            if path.exists():
                return False
            os.replace(tmp, path)
    finally:
        _remove_quietly(tmp)
    fsync_dir(path.parent)
    return True


def _write_json_file(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` and fsync it (no rename: the callers choose how to publish)."""
    with open(path, "w") as f:
        f.write(_json_text(data))
        f.flush()
        os.fsync(f.fileno())


def _json_text(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, sort_keys=False, allow_nan=False) + "\n"


def _remove_quietly(path: Path) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError:  # best effort: a leftover *.tmp is deleted at the next open anyway
        pass


# ---------------------------------------------------------------------------------------------
# shards


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records about one shard (a row = one (id, step) pair)."""

    file: str
    """Path relative to the store root, e.g. ``shards/r00000-00000003.h5``."""
    rank: int
    seq: int
    num_rows: int
    step_min: int
    step_max: int
    bytes: int
    basis: str | None = None
    """Digest of the eigenbasis version its rows were projected with (a basis that follows the run),
    or None (the store's one projection)."""
    cut: int | None = None
    """Rows of steps after this one are void: a later cut marker of its rank (:func:`write_cut`)
    cut the rank back to it. ``num_rows`` and ``step_max`` count the live rows only; the file,
    never rewritten, holds ``stored_rows``."""
    stored_rows: int | None = None
    """Rows in the file when a cut voids some of them (None: ``num_rows``)."""

    @property
    def file_rows(self) -> int:
        """Rows in the shard's file, live or void."""
        return self.num_rows if self.stored_rows is None else self.stored_rows

    def live(self, steps: np.ndarray) -> np.ndarray | None:
        """The mask of live rows among the file's ``steps``, or None when all are."""
        return None if self.cut is None else steps <= self.cut

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None or k not in _OPTIONAL_FIELDS}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ShardInfo":
        basis = data.get("basis")
        if basis is not None and not isinstance(basis, str):
            raise ValueError(f"shard {data.get('file')}: basis must be a digest string, got {basis!r}")
        return cls(data["file"], data["rank"], data["seq"], data["num_rows"], data["step_min"], data["step_max"],
                   data["bytes"], basis, data.get("cut"), data.get("stored_rows"))


_OPTIONAL_FIELDS = ("basis", "cut", "stored_rows")


def shard_name(rank: int, seq: int) -> str:
    return f"{SHARD_DIR}/r{rank:05d}-{seq:08d}.h5"


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """``(rank, seq)`` of a final shard file name (basename), or None for anything else."""
    m = _SHARD_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_manifest_name(name: str) -> int | None:
    m = _MANIFEST_RE.match(name)
    return int(m.group(1)) if m else None


def open_h5(path: str | os.PathLike, mode: str = "r") -> h5py.File:
    # HDF5's own file locking is redundant with our rename protocol and fails on some parallel
    # filesystems (Lustre without flock); turn it off.
    return h5py.File(path, mode, locking=False)


def write_shard(root: Path, rank: int, seq: int, chunks: list[dict[str, Any]], num_layers: int,
                dtype: StoreDType, compression: str | None, basis: str | None = None) -> ShardInfo:
    """Write ``chunks`` as shard ``(rank, seq)`` atomically and durably; return its :class:`ShardInfo`.

    See :func:`prepare_shard` for ``chunks``. On failure no file of that name is created or changed.
    """
    tmp, info = prepare_shard(root, rank, seq, chunks, num_layers, dtype, compression, basis)
    commit_shard(root, tmp, info)
    return info


def commit_shard(root: Path, tmp: Path, info: ShardInfo) -> None:
    """Atomically move a prepared temp shard to its final name and make the rename durable."""
    final = root / info.file
    try:
        os.replace(tmp, final)
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_dir(final.parent)


def prepare_shard(root: Path, rank: int, seq: int, chunks: list[dict[str, Any]], num_layers: int,
                  dtype: StoreDType, compression: str | None, basis: str | None = None) -> tuple[Path, ShardInfo]:
    """Write and fsync shard ``(rank, seq)`` under its temp name; return ``(tmp_path, info)``.

    Each chunk is ``{"ids": int64[n], "steps": int64[n], "lr": float64[n], "loss_scale": float64[n],
    "grads": [words [n, k_out, k_in] per layer in store order]}``; the shard holds their rows in
    order (the writer passes its window's segments). :func:`commit_shard` makes it visible.

    libhdf5 never writes to disk: it does not survive a failed write (a full disk makes a later
    ``close`` or garbage collection segfault the process), so it must never see one. It builds the
    file in memory (:class:`_StructureFile`): its structure (KBs) and the per-row fields (32 B a
    row), with every uncompressed layer's rows allocated as one contiguous extent it leaves
    unwritten. We then ``pwrite`` all of that, each chunk's rows straight from ``chunks`` at their
    place in their layer's extent. So a window is copied once on its way to disk (into the page
    cache), not three times (join, in-memory image, write). A compressed layer is joined and its
    filtered chunks go through memory instead. A failed write removes the temp file and raises its
    ``OSError``.
    """
    final = root / shard_name(rank, seq)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    ids = np.concatenate([c["ids"] for c in chunks]).astype(np.int64, copy=False)
    steps = np.concatenate([c["steps"] for c in chunks]).astype(np.int64, copy=False)
    n = len(ids)
    if n == 0:
        raise ValueError("prepare_shard: no rows")
    structure = _StructureFile()
    extents: list[tuple[int, np.ndarray]] = []      # (file offset, rows) libhdf5 left for us to write
    with h5py.File(structure, "w") as f:
        f.attrs.update({"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "rank": rank,
                        "seq": seq, "num_rows": n, "step_min": int(steps.min()),
                        "step_max": int(steps.max()), "dtype": StoreDType(dtype).value,
                        "num_layers": num_layers, **({"basis": basis} if basis else {})})
        for name, values in (("ids", ids), ("steps", steps),
                             ("lr", np.concatenate([c["lr"] for c in chunks]).astype(np.float64)),
                             ("loss_scale", np.concatenate([c["loss_scale"] for c in chunks]).astype(np.float64))):
            f.create_dataset(name, data=values).attrs[CRC_ATTR] = _crc32([values])
        group = f.create_group("grads")
        for i in range(num_layers):
            parts = [np.ascontiguousarray(c["grads"][i], dtype=disk_dtype(dtype)) for c in chunks]
            row_shape = parts[0].shape[1:]
            if [len(part) for part in parts] != [len(c["ids"]) for c in chunks] \
                    or any(part.shape[1:] != row_shape for part in parts):
                raise ValueError(f"prepare_shard: grads[{i}] rows {[part.shape for part in parts]} do not match "
                                 f"the chunks' {[len(c['ids']) for c in chunks]} ids")
            if compression:
                # chunks of whole rows, ~1 MiB, so a block read decompresses little beyond the block
                rows_per_chunk = max(1, min(n, (1 << 20) // max(1, int(np.prod(row_shape)) * 4)))
                group.create_dataset(f"L{i:04d}", data=parts[0] if len(parts) == 1 else np.concatenate(parts),
                                     compression=compression, chunks=(rows_per_chunk, *row_shape)
                                     ).attrs[CRC_ATTR] = _crc32(parts)
                continue
            ds = group.create_dataset(f"L{i:04d}", shape=(n, *row_shape), dtype=parts[0].dtype, dcpl=_raw_dcpl())
            ds.attrs[CRC_ATTR] = _crc32(parts)
            offset = ds.id.get_offset()
            if offset is None:  # cannot happen with early allocation; never write rows to nowhere
                raise RuntimeError(f"prepare_shard: libhdf5 allocated no extent for grads/L{i:04d}")
            for part in parts:
                extents.append((offset, part))
                offset += part.nbytes
    end = max((offset + part.nbytes for offset, part in extents), default=0)
    if end > structure.size:   # libhdf5 sets the size to its end of allocation when it closes
        raise RuntimeError(f"prepare_shard: rows end at byte {end}, past the file's {structure.size}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # the structure in libhdf5's order (a later write of the same bytes wins), then the rows
            for offset, piece in [*structure.pieces, *extents]:
                _pwrite_all(fd, piece, offset)
            os.ftruncate(fd, structure.size)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        _remove_quietly(tmp)
        raise
    return tmp, ShardInfo(file=shard_name(rank, seq), rank=rank, seq=seq, num_rows=n,
                          step_min=int(steps.min()), step_max=int(steps.max()), bytes=structure.size, basis=basis)


def _crc32(parts: list[np.ndarray]) -> np.uint32:
    """CRC-32 of the concatenated bytes of C-contiguous ``parts`` (zlib releases the GIL on them)."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(memoryview(np.ascontiguousarray(part)).cast("B"), crc)
    return np.uint32(crc)


def dataset_crc32(blocks: Any) -> int:
    """CRC-32 of a dataset read back as consecutive row ``blocks`` (arrays), to compare with its
    ``crc32`` attribute."""
    crc = 0
    for block in blocks:
        crc = zlib.crc32(memoryview(np.ascontiguousarray(block)).cast("B"), crc)
    return crc


def _raw_dcpl() -> h5py.h5p.PropDCID:
    """Contiguous layout, file space allocated when the dataset is created (so its offset is known
    before any row is written), no fill values written. A fresh list each time: h5py edits it."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` (bytes or a C-contiguous array) at ``offset``: ``pwrite`` may write less
    than asked (Linux caps one call below 2 GiB)."""
    view = memoryview(data).cast("B")
    try:
        done = 0
        while done < len(view):
            wrote = os.pwrite(fd, view[done:done + (1 << 30)], offset + done)
            if wrote <= 0:
                raise OSError(errno.EIO, f"pwrite wrote nothing at byte {offset + done}")
            done += wrote
    finally:
        view.release()


class _StructureFile:
    """The file object libhdf5 builds a shard in (h5py's ``fileobj`` driver): every write is kept in
    memory as an ``(offset, bytes)`` piece, in order; a read sees the pieces, later over earlier, and
    zeros between them (where the rows will go). Nothing here can fail, so libhdf5 never sees a
    failed write."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, bytes]] = []
        self.size = 0
        self._pos = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self.size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        piece = bytes(data)
        self.pieces.append((self._pos, piece))
        self._pos += len(piece)
        self.size = max(self.size, self._pos)
        return len(piece)

    def read(self, size: int = -1) -> bytes:
        end = self.size if size < 0 else self._pos + size
        out = bytearray(max(0, end - self._pos))
        for offset, piece in self.pieces:
            lo, hi = max(offset, self._pos), min(offset + len(piece), end)
            if lo < hi:
                out[lo - self._pos:hi - self._pos] = piece[lo - offset:hi - offset]
        self._pos = max(self._pos, end)
        return bytes(out)

    def truncate(self, size: int | None = None) -> int:
        self.size = self._pos if size is None else int(size)
        # bytes past a shrink are gone (a later growth reads zeros there, as a file does)
        self.pieces = [(offset, piece[:self.size - offset]) for offset, piece in self.pieces if offset < self.size]
        return self.size

    def flush(self) -> None:
        pass


def read_shard_info(root: Path, rel: str, layer_shapes: list[tuple[int, int]], dtype: StoreDType) -> ShardInfo:
    """Open and fully validate a shard's structure; raise :class:`StoreCorruptError` naming the file.

    Checks attributes, dataset shapes and dtypes against ``store.json``, and reads the last row of
    every dataset so a file cut short is caught here rather than half-way through a query.
    """
    path = root / rel
    parsed = parse_shard_name(path.name)
    try:
        with open_h5(path) as f:
            n = int(f.attrs["num_rows"])
            problems = []
            if int(f.attrs.get("format_version", -1)) != FORMAT_VERSION:
                problems.append(f"format_version {f.attrs.get('format_version')!r} != {FORMAT_VERSION}")
            if parsed and (int(f.attrs["rank"]), int(f.attrs["seq"])) != parsed:
                problems.append(f"attrs rank/seq {int(f.attrs['rank'])}/{int(f.attrs['seq'])} do not match its name")
            if str(f.attrs.get("dtype")) != StoreDType(dtype).value:
                problems.append(f"dtype {f.attrs.get('dtype')!r} != store dtype {StoreDType(dtype).value!r}")
            for key in ("ids", "steps", "lr", "loss_scale"):
                if f[key].shape != (n,):
                    problems.append(f"{key} has shape {f[key].shape}, expected ({n},)")
            for i, shape in enumerate(layer_shapes):
                ds = f[f"grads/L{i:04d}"]
                if ds.shape != (n, *shape) or ds.dtype != disk_dtype(dtype):
                    problems.append(f"grads/L{i:04d} is {ds.shape} {ds.dtype}, expected {(n, *shape)} "
                                    f"{np.dtype(disk_dtype(dtype))}")
            if problems:
                raise StoreCorruptError(f"gradient store shard {path} is inconsistent: " + "; ".join(problems))
            steps = f["steps"][:]
            _ = [f[key][n - 1] for key in ("ids", "lr", "loss_scale")]
            _ = [f[f"grads/L{i:04d}"][n - 1] for i in range(len(layer_shapes))]
            basis = f.attrs.get("basis")
            info = ShardInfo(file=rel, rank=int(f.attrs["rank"]), seq=int(f.attrs["seq"]), num_rows=n,
                             step_min=int(steps.min()), step_max=int(steps.max()), bytes=path.stat().st_size,
                             basis=None if basis is None else str(basis))
    except StoreCorruptError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        raise StoreCorruptError(
            f"gradient store shard {path} is unreadable ({type(e).__name__}: {e}); open the store with "
            "GradientStore.open(path, repair=True) to move it to quarantine/ (its rows are lost)") from e
    return info
