"""Trajectory checkpoints: the weights TracIn needs, kept on their own schedule and retention.

Layout (one directory per kept checkpoint, written to ``*.tmp`` and renamed when complete)::

    <path>/step00000040/model.safetensors   full weights (dtype from the config), names as in the model
    <path>/step00000040/meta.json           step, tokens_seen, lrs (per parameter group), next_lrs,
                                            data_order_version, projector_hash, dtype, bytes, write_id

A checkpoint "at step s" holds the weights *after* optimizer step s (θ_s); step 0 is the initial
weights. The gradient the store keeps for step s was taken at θ_{s-1}. ``lrs`` are the learning
rates of step s (for θ_0, which no step made: step 1's); ``next_lrs`` those of step s+1, the step
that used gradients at θ_s, written when that step is taken (null while it has not been): the η
TracIn-CP weights θ_s by (:attr:`TrajectoryCheckpoint.tracin_lr`). ``write_id`` is new at every
write, so a rewritten checkpoint never passes for the old one (:meth:`TrajectoryCheckpoint.content_id`).

Resume: checkpoints past the step a run resumes from belong to the abandoned timeline and are
removed, and the ``lr`` schedule's running sums come back from :meth:`Trajectory.state_dict` saved
with the training checkpoint, so a resumed run keeps exactly the steps an uninterrupted one keeps.

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

import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..config import StoreDType, TrajectoryConfig, TrajectoryRetention, TrajectorySchedule
from ..store.format import torch_dtype

__all__ = ["Trajectory", "TrajectoryCheckpoint", "TrajectoryError"]

log = logging.getLogger(__name__)

_ID_BYTES = 1 << 16
"""Bytes read from each end of model.safetensors for :meth:`TrajectoryCheckpoint.content_id`."""


class TrajectoryError(RuntimeError):
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
        """The weights as a state dict (no pickle: safetensors), cast to ``dtype``."""
        from safetensors.torch import load_file

        try:
            weights = load_file(str(self.path / "model.safetensors"), device="cpu")
        except Exception as e:   # safetensors raises its own error types for truncated/corrupt files
            raise TrajectoryError(f"trajectory checkpoint {self.path}: cannot read model.safetensors ({e})") from None
        return {k: v.to(dtype) for k, v in weights.items()}

    @classmethod
    def read(cls, path: Path) -> "TrajectoryCheckpoint":
        try:
            meta = json.loads((path / "meta.json").read_text())
            next_lrs = meta.get("next_lrs")
            return cls(path=path, step=int(meta["step"]), tokens_seen=int(meta["tokens_seen"]),
                       lrs=[float(x) for x in meta["lrs"]], data_order_version=int(meta["data_order_version"]),
                       projector_hash=meta.get("projector_hash"), dtype=str(meta["dtype"]), bytes=int(meta["bytes"]),
                       next_lrs=None if next_lrs is None else [float(x) for x in next_lrs],
                       write_id=meta.get("write_id"))
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
        found at a due step is overwritten, never kept. Also records ``lrs`` as the ``next_lrs`` of a
        checkpoint at ``step - 1``."""
        if not self._started:
            self._start(step)
        if self.rank == 0 and step > 0:
            self._record_next_lrs(step - 1, lrs)
        if not self.due(step, lrs[0] if lrs else 0.0):
            return None
        weights = state() if callable(state) else state
        if self.rank != 0:
            return None
        return self.save(step, weights, lrs=lrs, tokens_seen=tokens_seen)

    # -- resume ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state after the last step seen (plain types): save it with every training
        checkpoint and pass it to :meth:`resume` when restoring that checkpoint."""
        return {"step": self._last_step, "lr_since": self._lr_since, "lr_peak": self._lr_peak}

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
        self._started = True
        if self.rank == 0:
            self._drop_after(step)

    def _start(self, step: int) -> None:
        """First maybe_save without :meth:`resume`: the run is at ``step`` (a fresh run at 0, a resumed
        one past its checkpoint), so checkpoints at ``step`` and later are another timeline's."""
        self._started = True
        if self.rank == 0:
            self._drop_after(step - 1)
        if step > 1 and self.config.schedule == TrajectorySchedule.LR:
            log.warning("tda.trajectory: first step %d without Trajectory.resume(step, state): schedule 'lr' "
                        "starts its sums from zero, so checkpoints may fall on other steps than an "
                        "uninterrupted run's", step)

    def _drop_after(self, step: int) -> None:
        """Remove the checkpoints past ``step`` (an abandoned timeline; never listed half-removed)."""
        dropped = sorted(int(p.name[4:]) for p in self.path.iterdir()
                         if p.is_dir() and p.name[:4] == "step" and p.name[4:].isdigit() and int(p.name[4:]) > step)
        for s in dropped:
            trash = self.path / (_dirname(s) + ".tmp")
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(self.path / _dirname(s), trash)
            shutil.rmtree(trash, ignore_errors=True)
        if dropped:
            _fsync(self.path)
            log.info("tda.trajectory: removed checkpoints %s past step %d (the resumed run redoes them)", dropped, step)

    def _record_next_lrs(self, step: int, lrs: list[float]) -> None:
        meta_file = self.path / _dirname(step) / "meta.json"
        if not meta_file.exists():
            return
        lrs = [float(x) for x in lrs]
        if json.loads(meta_file.read_text()).get("next_lrs") != lrs:
            self._rewrite_meta(step, next_lrs=lrs)

    # -- writing -----------------------------------------------------------------------------------

    def save(self, step: int, weights: Mapping[str, torch.Tensor], *, lrs: list[float],
             tokens_seen: int) -> TrajectoryCheckpoint:
        """Write one checkpoint atomically (tmp dir, fsync, rename), then apply the retention."""
        from safetensors.torch import save_file

        dtype = torch_dtype(self.config.dtype)
        final = self.path / _dirname(step)
        tmp = self.path / (_dirname(step) + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in weights.items()}
        save_file(tensors, str(tmp / "model.safetensors"))
        nbytes = (tmp / "model.safetensors").stat().st_size
        meta = {"step": int(step), "tokens_seen": int(tokens_seen), "lrs": [float(x) for x in lrs],
                "next_lrs": None, "data_order_version": int(self.data_order_version),
                "projector_hash": self.projector_hash, "dtype": StoreDType(self.config.dtype).value,
                "bytes": nbytes, "write_id": uuid.uuid4().hex, "format_version": 2}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        old = self.path / (_dirname(step) + ".old.tmp")
        if final.exists():          # an abandoned timeline's checkpoint at this step: out of the listing first
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(self.path)
        shutil.rmtree(old, ignore_errors=True)
        self._retain()
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

    def _retain(self) -> None:
        cfg = self.config
        kept = self.list(self.path)
        if cfg.retention == TrajectoryRetention.ALL or len(kept) <= cfg.keep:
            return
        while len(kept) > cfg.keep:
            if cfg.retention == TrajectoryRetention.LAST:
                drop = kept[0]
            else:   # thinned: the one whose removal leaves the shortest gap; never the first or the newest
                gaps = [(kept[i + 1].step - kept[i - 1].step, i) for i in range(1, len(kept) - 1)]
                drop = kept[min(gaps)[1]]
            trash = drop.path.with_name(drop.path.name + ".tmp")
            os.replace(drop.path, trash)      # gone from listings at once, even if the delete is cut off
            shutil.rmtree(trash, ignore_errors=True)
            kept = [c for c in kept if c.path != drop.path]

    # -- reading -----------------------------------------------------------------------------------

    @staticmethod
    def list(path: str | os.PathLike) -> list[TrajectoryCheckpoint]:
        """Kept checkpoints, oldest first. Raises :class:`TrajectoryError` if ``path`` has none."""
        path = Path(path)
        if not path.is_dir():
            raise TrajectoryError(f"no trajectory at {path}: enable tda.trajectory in the run to keep checkpoints")
        return sorted((TrajectoryCheckpoint.read(p) for p in path.iterdir()
                       if p.is_dir() and p.name.startswith("step") and not p.name.endswith(".tmp")),
                      key=lambda c: c.step)

    @staticmethod
    def summary(path: str | os.PathLike) -> dict[str, Any]:
        kept = Trajectory.list(path)
        return {"path": str(path), "checkpoints": len(kept), "steps": [c.step for c in kept],
                "bytes": sum(c.bytes for c in kept), "dtype": kept[0].dtype if kept else None,
                "lrs": [c.lr for c in kept]}


def _dirname(step: int) -> str:
    return f"step{step:08d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
