"""Trajectory checkpoints: the weights TracIn needs, kept on their own schedule and retention.

Layout (one directory per kept checkpoint, written to ``*.tmp`` and renamed when complete)::

    <path>/step00000040/model.safetensors   full weights (dtype from the config), names as in the model
    <path>/step00000040/meta.json           step, ordinal, tokens_seen, lrs (per parameter group),
                                            next_lrs, next_lrs_step, data_order_version, projector_hash,
                                            dtype, bytes, write_id

Only folders named exactly ``step`` + 8 digits whose meta.json agrees on the step are checkpoints;
anything else there (a copy such as ``step00000040.bak``) is ignored.

A checkpoint "at step s" holds the weights *after* optimizer step s (θ_s); step 0 is the initial
weights. The gradient the store keeps for step s was taken at θ_{s-1}. ``lrs`` are the learning
rates of step s (for θ_0, which no step made: step 1's); ``next_lrs`` those of the next step taken
after s (s+1, or later when steps in between were skipped, like DeepSpeed's fp16 overflow steps),
the step that used gradients at θ_s, written when that step (``next_lrs_step``) is taken (null while
it has not been): the η TracIn-CP weights θ_s by (:attr:`TrajectoryCheckpoint.tracin_lr`).
``ordinal`` counts the run's saves (0, 1, 2, ... in the order they were made, over resumes);
retention ``thinned`` keeps by it. ``write_id`` is new at every write, so a rewritten checkpoint
never passes for the old one (:meth:`TrajectoryCheckpoint.content_id`).

Resume: checkpoints past the step a run resumes from belong to the abandoned timeline and are
removed, and the ``lr`` schedule's running sums and the save count come back from
:meth:`Trajectory.state_dict` saved with the training checkpoint, so a resumed run keeps exactly the
steps an uninterrupted one keeps (``thinned``: once it has passed the step where the old run stopped,
since a checkpoint thinning drops is never one it would keep later).

Example::

    traj = Trajectory(TrajectoryConfig(enabled=True, every=10), "run/tda/trajectory", projector_hash="ab12")
    traj.maybe_save(0, model.state_dict(), lrs=[1e-3], tokens_seen=0)
    for step in ...:
        traj.maybe_save(step, lambda: model.state_dict(), lrs=[lr], tokens_seen=tokens)
    state = traj.state_dict()                      # into the training checkpoint
    ...                                            # a new process, training restored to step r:
    traj = Trajectory(TrajectoryConfig(enabled=True, every=10), "run/tda/trajectory")
    traj.resume(r, state)
    for ckpt in Trajectory.list("run/tda/trajectory"):
        weights = ckpt.load()
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..config import StoreDType, TrajectoryConfig, TrajectoryRetention, TrajectorySchedule
from ..errors import TDAError
from ..store.errors import describe_os_error
from ..store.format import torch_dtype

__all__ = ["Trajectory", "TrajectoryCheckpoint", "TrajectoryError"]

log = logging.getLogger(__name__)

_ID_BYTES = 1 << 16
"""Bytes read from each end of model.safetensors for :meth:`TrajectoryCheckpoint.content_id`."""


def _file_crc32(path: Path, chunk: int = 1 << 24) -> int:
    """zlib's CRC-32 of a file's bytes, read ``chunk`` bytes at a time."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


class TrajectoryError(TDAError, RuntimeError):
    """A trajectory directory is missing, incomplete or inconsistent; the message names it."""


@dataclass(frozen=True)
class TrajectoryCheckpoint:
    """One kept checkpoint (read from its ``meta.json``)."""

    path: Path
    step: int
    tokens_seen: int
    lrs: list[float]
    data_order_version: int
    projector_hash: str | None
    dtype: str
    bytes: int
    next_lrs: list[float] | None = None
    write_id: str | None = None
    crc32: int | None = None
    """CRC-32 of model.safetensors as written (None: written before it was kept); :meth:`load` checks it."""
    ordinal: int | None = None
    """The run's save count before this save (None: written before ordinals were kept)."""
    next_lrs_step: int | None = None
    """The step whose lrs are ``next_lrs`` (None: not yet taken, or written before this was kept)."""

    @property
    def lr(self) -> float:
        """Learning rate of the first parameter group at step ``step`` (θ_0: step 1's)."""
        return float(self.lrs[0]) if self.lrs else 0.0

    @property
    def tracin_lr(self) -> float:
        """The η TracIn-CP weights θ_s by: the first group's lr of step s+1, the step that used
        gradients at θ_s; step s's when no step s+1 was taken (the run's last checkpoint)."""
        return float(self.next_lrs[0]) if self.next_lrs else self.lr

    def content_id(self) -> str:
        """A string that changes whenever the weights may have, in O(1) of their size (no hash of a
        multi-GB file): the write id :meth:`Trajectory.save` puts in meta.json, new at every write,
        and model.safetensors' size, mtime_ns and a digest of its first and last 64 KiB (which also
        catch a file replaced by other means, and checkpoints written before write ids)."""
        weights = self.path / "model.safetensors"
        try:
            stat = weights.stat()
            with open(weights, "rb") as f:
                ends = f.read(_ID_BYTES)
                f.seek(max(stat.st_size - _ID_BYTES, 0))
                ends += f.read(_ID_BYTES)
        except OSError as e:
            raise TrajectoryError(f"trajectory checkpoint {self.path}: cannot read model.safetensors ({e})") from None
        return f"{self.write_id}:{stat.st_size}:{stat.st_mtime_ns}:{hashlib.sha256(ends).hexdigest()[:32]}"

    def load(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The weights as a state dict (no pickle: safetensors), cast to ``dtype``. Raises
        :class:`TrajectoryError` for an unreadable file or NaN weights (which would turn every TracIn
        score NaN: a silent wrong ranking; ±inf, which a mask buffer may hold, is left to TracIn's check
        of its scores)."""
        from safetensors.torch import load_file

        if self.crc32 is not None:
            try:
                got = _file_crc32(self.path / "model.safetensors")
            except OSError as e:
                raise TrajectoryError(f"trajectory checkpoint {self.path}: cannot read model.safetensors "
                                      f"({e})") from None
            if got != self.crc32:
                raise TrajectoryError(f"trajectory checkpoint {self.path}: model.safetensors is damaged (checksum "
                                      f"{got:#010x} != {self.crc32:#010x} in its meta.json: its bytes changed after "
                                      "it was written); restore or remove this checkpoint")
        try:
            weights = load_file(str(self.path / "model.safetensors"), device="cpu")
        except Exception as e:   # safetensors raises its own error types for truncated/corrupt files
            raise TrajectoryError(f"trajectory checkpoint {self.path}: cannot read model.safetensors ({e})") from None
        for name, tensor in weights.items():   # ±inf may be a buffer's (a -inf mask): TracIn refuses its scores
            if tensor.is_floating_point() and bool(torch.isnan(tensor).any()):
                bad = int(torch.isnan(tensor).sum())
                raise TrajectoryError(f"trajectory checkpoint {self.path}: tensor {name!r} of model.safetensors holds "
                                      f"{bad} NaN values: the weights are damaged or the run diverged; restore or "
                                      "remove this checkpoint")
        return {k: v.to(dtype) for k, v in weights.items()}

    @classmethod
    def read(cls, path: Path) -> "TrajectoryCheckpoint":
        try:
            meta = json.loads((path / "meta.json").read_text())
            next_lrs, ordinal, next_lrs_step = meta.get("next_lrs"), meta.get("ordinal"), meta.get("next_lrs_step")
            return cls(path=path, step=int(meta["step"]), tokens_seen=int(meta["tokens_seen"]),
                       lrs=[float(x) for x in meta["lrs"]], data_order_version=int(meta["data_order_version"]),
                       projector_hash=meta.get("projector_hash"), dtype=str(meta["dtype"]), bytes=int(meta["bytes"]),
                       next_lrs=None if next_lrs is None else [float(x) for x in next_lrs],
                       write_id=meta.get("write_id"), ordinal=None if ordinal is None else int(ordinal),
                       crc32=None if meta.get("crc32") is None else int(meta["crc32"]),
                       next_lrs_step=None if next_lrs_step is None else int(next_lrs_step))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TrajectoryError(f"trajectory checkpoint {path}: unreadable meta.json ({e})") from None


class Trajectory:
    """Writes checkpoints per the config's schedule and applies its retention. Only rank 0 writes;
    the state dict is gathered by the caller (it is a callable, so other steps cost nothing).

    On resume from a training checkpoint at step r, call :meth:`resume` (every rank) with the
    :meth:`state_dict` saved in that checkpoint. Without it, the first :meth:`maybe_save` of the
    process (step r+1; 0 for a fresh run) still removes the checkpoints at its step and later, but
    the ``lr`` schedule restarts its sums (warned)."""

    def __init__(self, config: TrajectoryConfig, path: str | os.PathLike, *, projector_hash: str | None = None,
                 data_order_version: int = 0, rank: int = 0):
        config.validate()
        self.config = config
        self.path = Path(path)
        self.projector_hash = projector_hash
        self.data_order_version = data_order_version
        self.rank = rank
        self._lr_since = 0.0
        self._lr_peak = 0.0
        self._last_step: int | None = None    # the last step due() saw: the state's step
        self._saves: int | None = None        # saves so far (the next ordinal); None: count from the folder
        self._awaiting: int | None = None     # rank 0: the newest checkpoint while no later step was taken
        self._started = False                 # maybe_save or resume has run in this process
        if rank == 0:
            self.path.mkdir(parents=True, exist_ok=True)
            for debris in self.path.glob("*.tmp"):      # a crash mid-write: never a kept checkpoint
                shutil.rmtree(debris, ignore_errors=True)

    # -- schedule --------------------------------------------------------------------------------

    def due(self, step: int, lr: float = 0.0) -> bool:
        """Whether step ``step`` (just taken, with learning rate ``lr``) is kept. Call once per step."""
        cfg = self.config
        self._last_step = step
        if step == 0:
            return True
        if cfg.schedule == TrajectorySchedule.EVERY:
            return step % cfg.every == 0
        if cfg.schedule == TrajectorySchedule.LOG:
            return step % cfg.every == 0 and ((step // cfg.every) & (step // cfg.every - 1)) == 0
        self._lr_peak = max(self._lr_peak, abs(lr))
        self._lr_since += abs(lr)
        if self._lr_peak > 0 and self._lr_since >= cfg.every * self._lr_peak * (1 - 1e-9):
            self._lr_since = 0.0
            return True
        return False

    def maybe_save(self, step: int, state: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]],
                   *, lrs: list[float], tokens_seen: int) -> TrajectoryCheckpoint | None:
        """Save if ``step`` is due (step ``step`` just taken with learning rates ``lrs``); call once per
        step. ``state`` may be a callable (gathering FSDP/ZeRO weights is collective: every rank must
        call this with the same step; only rank 0 writes). Unless :meth:`resume` ran, the process's
        first call removes the checkpoints at ``step`` and later (another timeline's); a checkpoint
        found at a due step is overwritten, never kept. Also records ``lrs`` as the ``next_lrs`` of the
        newest earlier checkpoint if no step since it has (step ``step - 1``'s, or an older one's when
        the steps between were skipped)."""
        if not self._started:
            self._start(step)
        if self.rank == 0 and step > 0 and self._awaiting is not None and self._awaiting < step:
            self._record_next_lrs(self._awaiting, lrs, step)
            self._awaiting = None
        if not self.due(step, lrs[0] if lrs else 0.0):
            return None
        weights = state() if callable(state) else state
        if self.rank != 0:
            self._saves = self._save_count() + 1     # counted on every rank, so every rank's state agrees
            return None
        return self.save(step, weights, lrs=lrs, tokens_seen=tokens_seen)

    # -- resume ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state after the last step seen (plain types): save it with every training
        checkpoint and pass it to :meth:`resume` when restoring that checkpoint. ``saves`` is the number
        of checkpoints saved so far (``thinned`` keeps by it)."""
        return {"step": self._last_step, "lr_since": self._lr_since, "lr_peak": self._lr_peak, "saves": self._saves}

    def resume(self, step: int, state: Mapping[str, Any] | None = None) -> None:
        """After restoring a training checkpoint at ``step``, before the next :meth:`maybe_save`
        (every rank): restore the schedule's ``state`` (this object's :meth:`state_dict` saved with
        that checkpoint) and remove the checkpoints past ``step`` (rank 0), which the resumed run
        redoes. The state may come from an earlier step than ``step`` (a loop that skips
        :meth:`maybe_save` on steps it did not apply, like DeepSpeed's fp16 overflow steps, which still
        count); raises :class:`TrajectoryError` if it comes from a later one."""
        if state is not None:
            saved = state.get("step")
            if saved is not None and int(saved) > step:
                raise TrajectoryError(f"trajectory state was saved at step {saved} but the run resumes at step "
                                      f"{step}: pass the state saved with the checkpoint being restored")
            self._lr_since, self._lr_peak = float(state["lr_since"]), float(state["lr_peak"])
            self._last_step = None if saved is None else int(saved)
        elif self.config.schedule == TrajectorySchedule.LR and step > 0:
            log.warning("tda.trajectory: resuming at step %d without the schedule's saved state: schedule 'lr' "
                        "restarts its sums, so later checkpoints may fall on other steps than an uninterrupted "
                        "run's", step)
        saves = None if state is None else state.get("saves")   # states from before save counts: None
        if saves is None and self.config.retention == TrajectoryRetention.THINNED and step > 0:
            log.warning("tda.trajectory: resuming at step %d without the saved count of checkpoints: retention "
                        "'thinned' counts on from the newest kept one, so it may keep other checkpoints than an "
                        "uninterrupted run", step)
        self._started = True
        self._saves = None if saves is None else int(saves)
        if self.rank == 0:
            self._drop_after(step)
            self._awaiting = self._awaiting_after(step)

    def _start(self, step: int) -> None:
        """First maybe_save without :meth:`resume`: the run is at ``step`` (a fresh run at 0, a resumed
        one past its checkpoint), so checkpoints at ``step`` and later are another timeline's."""
        self._started = True
        self._saves = None
        if self.rank == 0:
            self._drop_after(step - 1)
            self._awaiting = self._awaiting_after(step - 1)
        if step > 1 and self.config.schedule == TrajectorySchedule.LR:
            log.warning("tda.trajectory: first step %d without Trajectory.resume(step, state): schedule 'lr' "
                        "starts its sums from zero, so checkpoints may fall on other steps than an "
                        "uninterrupted run's", step)

    def _drop_after(self, step: int) -> None:
        """Remove the checkpoints past ``step`` (an abandoned timeline; never listed half-removed)."""
        dropped = sorted(s for p in self.path.iterdir() if p.is_dir()
                         and (s := _dir_step(p.name)) is not None and s > step)
        for s in dropped:
            trash = self.path / (_dirname(s) + ".tmp")
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(self.path / _dirname(s), trash)
            shutil.rmtree(trash, ignore_errors=True)
        if dropped:
            _fsync(self.path)
            log.info("tda.trajectory: removed checkpoints %s past step %d (the resumed run redoes them)", dropped, step)

    def _awaiting_after(self, step: int) -> int | None:
        """The checkpoint whose ``next_lrs`` the next step taken after ``step`` sets: the newest at or
        before ``step``, unless a step up to ``step`` set them (one past it is the abandoned timeline's)."""
        kept = [c for c in self.list(self.path) if c.step <= step]
        if not kept:
            return None
        newest = kept[-1]
        by = newest.next_lrs_step if newest.next_lrs_step is not None else newest.step + 1   # older meta: s+1
        return newest.step if newest.next_lrs is None or by > step else None

    def _save_count(self) -> int:
        """Saves made so far: the state's count, or else one past the newest kept ordinal (rank 0)."""
        if self._saves is None:
            ordinals = [c.ordinal for c in self.list(self.path) if c.ordinal is not None] if self.rank == 0 else []
            self._saves = max(ordinals) + 1 if ordinals else 0
        return self._saves

    def _record_next_lrs(self, step: int, lrs: list[float], by_step: int) -> None:
        """Checkpoint ``step``'s next_lrs are ``lrs``, those of step ``by_step``, the next step taken."""
        meta_file = self.path / _dirname(step) / "meta.json"
        if not meta_file.exists():
            return
        fields = {"next_lrs": [float(x) for x in lrs], "next_lrs_step": int(by_step)}
        meta = json.loads(meta_file.read_text())
        if any(meta.get(k) != v for k, v in fields.items()):
            self._rewrite_meta(step, **fields)

    # -- writing -----------------------------------------------------------------------------------

    def save(self, step: int, weights: Mapping[str, torch.Tensor], *, lrs: list[float],
             tokens_seen: int) -> TrajectoryCheckpoint:
        """Write one checkpoint atomically (tmp dir, fsync, rename), then apply the retention. Raises
        :class:`TrajectoryError` naming the checkpoint and the cause (a full disk, say) if the write fails;
        the half-written folder is removed and the checkpoints saved before are left as they were."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        dtype = torch_dtype(self.config.dtype)
        final = self.path / _dirname(step)
        tmp = self.path / (_dirname(step) + ".tmp")
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in weights.items()}
        ordinal = self._save_count()
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file(tensors, str(tmp / "model.safetensors"))
            nbytes = (tmp / "model.safetensors").stat().st_size
            crc = _file_crc32(tmp / "model.safetensors")        # read back from the page cache
            meta = {"step": int(step), "ordinal": ordinal, "tokens_seen": int(tokens_seen),
                    "lrs": [float(x) for x in lrs], "next_lrs": None, "next_lrs_step": None,
                    "data_order_version": int(self.data_order_version), "projector_hash": self.projector_hash,
                    "dtype": StoreDType(self.config.dtype).value, "bytes": nbytes, "write_id": uuid.uuid4().hex,
                    "crc32": crc, "format_version": 3}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            for f in tmp.iterdir():
                _fsync(f)
            _fsync(tmp)
            old = self.path / (_dirname(step) + ".old.tmp")
            if final.exists():      # an abandoned timeline's checkpoint at this step: out of the listing first
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync(self.path)
        except (OSError, SafetensorError) as e:
            # SafetensorError is no OSError: without this a full disk is a raw Rust-error traceback
            shutil.rmtree(tmp, ignore_errors=True)
            raise TrajectoryError(f"cannot write trajectory checkpoint {final}: {_describe_write_error(e, tmp)}; "
                                  f"the checkpoints saved before step {step} are intact. Checkpoints go to "
                                  f"tda.trajectory.path (another disk is fine), or keep fewer "
                                  f"(tda.trajectory.every, retention)") from e
        shutil.rmtree(old, ignore_errors=True)
        self._saves = ordinal + 1
        self._awaiting = int(step)
        self._retain(ordinal)
        return TrajectoryCheckpoint.read(final)

    def set_lrs(self, step: int, lrs: list[float]) -> None:
        """Rewrite a kept checkpoint's learning rates (rank 0; atomically). Used for step 0, whose lr
        is only known once the first step has set it."""
        if self.rank == 0 and (self.path / _dirname(step) / "meta.json").exists():
            self._rewrite_meta(step, lrs=[float(x) for x in lrs])

    def _rewrite_meta(self, step: int, **fields: Any) -> None:
        meta_file = self.path / _dirname(step) / "meta.json"
        meta = json.loads(meta_file.read_text()) | fields
        tmp = meta_file.with_name("meta.json.tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        _fsync(tmp)
        os.replace(tmp, meta_file)
        _fsync(meta_file.parent)

    def _retain(self, newest: int) -> None:
        """Apply the retention after the save with ordinal ``newest``."""
        cfg = self.config
        if cfg.retention == TrajectoryRetention.ALL:
            return
        kept = self.list(self.path)
        if cfg.retention == TrajectoryRetention.LAST:
            drops = kept[:max(len(kept) - cfg.keep, 0)]
        else:
            legacy = [c.step for c in kept if c.ordinal is None]
            if legacy:
                _warn_once(f"tda.trajectory: checkpoints {legacy} in {self.path} were written before save ordinals "
                           f"were kept: retention 'thinned' leaves them alone")
            stride = _thinned_stride(newest, cfg.keep)
            drops = [c for c in kept if c.ordinal is not None and c.ordinal % stride and c.ordinal != newest]
        for drop in drops:
            trash = drop.path.with_name(drop.path.name + ".tmp")
            os.replace(drop.path, trash)      # gone from listings at once, even if the delete is cut off
            shutil.rmtree(trash, ignore_errors=True)

    # -- reading -----------------------------------------------------------------------------------

    @staticmethod
    def list(path: str | os.PathLike) -> list[TrajectoryCheckpoint]:
        """Kept checkpoints, oldest first: the folders named exactly ``step`` + 8 digits whose meta.json
        has that step. Others (a copy like ``step00000004.bak``, a folder renamed by hand) are ignored,
        with a warning. Raises :class:`TrajectoryError` if ``path`` is not a folder."""
        path = Path(path)
        if not path.is_dir():
            raise TrajectoryError(f"no trajectory at {path}: enable tda.trajectory in the run to keep checkpoints")
        kept = []
        for p in path.iterdir():
            step = _dir_step(p.name)
            if step is None or not p.is_dir():
                if p.name.startswith("step") and not p.name.endswith(".tmp"):
                    _warn_once(f"tda.trajectory: {p} is not a checkpoint folder (named step + 8 digits): ignored")
                continue
            ckpt = TrajectoryCheckpoint.read(p)
            if ckpt.step != step:
                _warn_once(f"tda.trajectory: {p} holds meta.json of step {ckpt.step}, not {step}: ignored "
                           f"(a folder renamed or copied by hand?)")
                continue
            kept.append(ckpt)
        return sorted(kept, key=lambda c: c.step)

    @staticmethod
    def summary(path: str | os.PathLike) -> dict[str, Any]:
        kept = Trajectory.list(path)
        return {"path": str(path), "checkpoints": len(kept), "steps": [c.step for c in kept],
                "bytes": sum(c.bytes for c in kept), "dtype": kept[0].dtype if kept else None,
                "lrs": [c.lr for c in kept]}


def _describe_write_error(exc: BaseException, tmp: Path) -> str:
    """An OSError in plain words; safetensors' error too when it wraps one (``... (os error 28)``)."""
    if not isinstance(exc, OSError) and (code := re.search(r"\(os error (\d+)\)", str(exc))):
        exc = OSError(int(code[1]), os.strerror(int(code[1])), str(tmp / "model.safetensors"))
    return describe_os_error(exc, "Free space") if isinstance(exc, OSError) \
        else f"safetensors could not write it ({exc})"


def _dirname(step: int) -> str:
    return f"step{step:08d}"


def _dir_step(name: str) -> int | None:
    """The step of a checkpoint folder name, or None unless ``name`` is exactly ``_dirname(step)``."""
    digits = name[4:]
    if name[:4] != "step" or not (digits.isascii() and digits.isdigit()):
        return None
    return int(digits) if _dirname(int(digits)) == name else None


def _thinned_stride(newest: int, keep: int) -> int:
    """Retention ``thinned`` after the save with ordinal ``newest``: keep the ordinals that are multiples
    of the returned 2^j (j the smallest leaving at most ``keep - 1`` of them in 0..newest) and ``newest``.
    j only grows with ``newest``, so a checkpoint dropped is never one a later save would keep."""
    stride = 1
    while newest // stride + 1 > keep - 1:
        stride *= 2
    return stride


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
