"""Trajectory checkpoints: the weights TracIn needs, kept on their own schedule and retention.

Layout (one directory per kept checkpoint, written to ``*.tmp`` and renamed when complete)::

    <path>/step00000040/model.safetensors   full weights (dtype from the config), names as in the model
    <path>/step00000040/meta.json           step, tokens_seen, lr per parameter group, data_order_version,
                                            projector_hash, dtype, bytes

A checkpoint "at step s" holds the weights *after* optimizer step s (θ_s); step 0 is the initial
weights. The gradient the store keeps for step s was taken at θ_{s-1}.

Example::

    traj = Trajectory(TrajectoryConfig(enabled=True, every=10), "run/tda/trajectory", projector_hash="ab12")
    traj.maybe_save(0, model.state_dict(), lrs=[1e-3], tokens_seen=0)
    for step in ...:
        traj.maybe_save(step, lambda: model.state_dict(), lrs=[lr], tokens_seen=tokens)
    for ckpt in Trajectory.list("run/tda/trajectory"):
        weights = ckpt.load()
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..config import StoreDType, TrajectoryConfig, TrajectoryRetention, TrajectorySchedule
from ..store.format import torch_dtype

__all__ = ["Trajectory", "TrajectoryCheckpoint", "TrajectoryError"]

log = logging.getLogger(__name__)


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

    @property
    def lr(self) -> float:
        """Learning rate of the first parameter group (what TracIn weights by)."""
        return float(self.lrs[0]) if self.lrs else 0.0

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
            return cls(path=path, step=int(meta["step"]), tokens_seen=int(meta["tokens_seen"]),
                       lrs=[float(x) for x in meta["lrs"]], data_order_version=int(meta["data_order_version"]),
                       projector_hash=meta.get("projector_hash"), dtype=str(meta["dtype"]), bytes=int(meta["bytes"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TrajectoryError(f"trajectory checkpoint {path}: unreadable meta.json ({e})") from None


class Trajectory:
    """Writes checkpoints per the config's schedule and applies its retention. Only rank 0 writes;
    the state dict is gathered by the caller (it is a callable, so other steps cost nothing)."""

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
        if rank == 0:
            self.path.mkdir(parents=True, exist_ok=True)
            for debris in self.path.glob("*.tmp"):      # a crash mid-write: never a kept checkpoint
                shutil.rmtree(debris, ignore_errors=True)

    # -- schedule --------------------------------------------------------------------------------

    def due(self, step: int, lr: float = 0.0) -> bool:
        """Whether step ``step`` (just taken, with learning rate ``lr``) is kept. Call once per step."""
        cfg = self.config
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
        """Save if ``step`` is due. ``state`` may be a callable (gathering FSDP/ZeRO weights is
        collective: every rank must call this with the same step; only rank 0 writes)."""
        if not self.due(step, lrs[0] if lrs else 0.0) or (self.path / _dirname(step)).exists():
            return None
        weights = state() if callable(state) else state
        if self.rank != 0:
            return None
        return self.save(step, weights, lrs=lrs, tokens_seen=tokens_seen)

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
                "data_order_version": int(self.data_order_version), "projector_hash": self.projector_hash,
                "dtype": StoreDType(self.config.dtype).value, "bytes": nbytes, "format_version": 1}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in tmp.iterdir():
            _fsync(f)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(self.path)
        self._retain()
        return TrajectoryCheckpoint.read(final)

    def set_lrs(self, step: int, lrs: list[float]) -> None:
        """Rewrite a kept checkpoint's learning rates (rank 0; atomically). Used for step 0, whose lr
        is only known once the first step has set it."""
        meta_file = self.path / _dirname(step) / "meta.json"
        if self.rank != 0 or not meta_file.exists():
            return
        meta = json.loads(meta_file.read_text())
        meta["lrs"] = [float(x) for x in lrs]
        tmp = meta_file.with_name("meta.json.tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        _fsync(tmp)
        os.replace(tmp, meta_file)

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
