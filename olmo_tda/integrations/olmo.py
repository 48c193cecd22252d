"""ai2-olmo integration: a ``Trainer`` subclass that captures every example of every step, the config
loader for a training YAML with a ``tda:`` section, and our own training entry point.

OLMo's ``Trainer`` has no callbacks, so the subclass wraps a few of its methods and adds nothing to
the step otherwise:

- ``train_batch``: the whole micro-batch loop runs inside one ``capture.record(batch["index"],
  loss_scale=tokens in the device batch)`` (OLMo divides each micro-batch's CE sum by that number);
- ``train_step``: after OLMo's optimizer step, the record is handed to the async store with the
  step and the learning rate OLMo actually used, and ``loss_scale`` times the world size (DDP and
  FSDP average the ranks' gradients: the row's weight in the update is 1 / global batch tokens);
- ``trainer_state_dict`` / ``load_trainer_state_dict``: the store position travels in OLMo's own
  checkpoints; on resume the store drops rows past the checkpoint's step (they will be re-run), so
  the store has neither duplicates nor gaps. Checkpoints flush the store first.

With ``capture.proj_type: eigen`` the trainer first makes sure the eigenbasis file exists
(``capture.basis``, default ``<save_folder>/tda/basis.safetensors``): if it does not, it is estimated
over the first ``capture.basis_batches`` training batches of every rank at the initial weights (no
optimizer step; covariances summed over ranks, rank 0's matrices broadcast) and saved before the
first step. A resumed run loads the file, never re-estimates it.

With ``tda.selection.enabled`` the step also ends, every ``every_n`` steps, with a selection round
(:class:`~olmo_tda.training.selector.OnlineSelector`): the upcoming window of OLMo's order is
rescored at the current weights, ``global_indices.npy`` is rewritten from the first unconsumed
position on, and the loader (wrapped in :class:`RestartableLoader`) restarts there; a restore
replays the logged rounds onto the order OLMo rebuilds (``docs/ARCHITECTURE.md``, Online data
selection); all of it in :mod:`.olmo_selection`. ``tda.store.enabled: false`` runs selection without
per-step capture.

With ``tda.enabled: false`` none of this happens: no capture object, no hooks, no store, no thread;
the methods call straight through to OLMo's.

Example (what ``olmo-tda train run.yaml --tda.capture.proj_dim=32`` does)::

    from olmo_tda.integrations.olmo import load_configs
    from olmo_tda.integrations.olmo_train import train
    cfg, tda = load_configs("configs/demo_tiny.yaml", ["--tda.capture.proj_dim=32", "--max_duration=50"])
    train(cfg, tda)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from ..capture import GradientCapture
from ..capture.eigenbasis import estimate_eigenbasis
from ..config import CaptureConfig, ConfigError, ProjectionType, TDAConfig
from ..training.callbacks import Callback, Callbacks, StepEnd
from ..training.metrics import MetricsLogger
from . import closed_on_error, sum_and_max_over_ranks
from .capture_store import CaptureStore
from .olmo_selection import OLMoSelection, RestartableLoader

try:
    from olmo.config import CheckpointType, TrainConfig
    from olmo.torch_util import move_to_device
    from olmo.train import Trainer
except ImportError as e:  # pragma: no cover - ai2-olmo is a hard dependency, but say so clearly
    raise ImportError("olmo_tda.integrations.olmo needs ai2-olmo==0.6.0 (pip install ai2-olmo==0.6.0)") from e

__all__ = ["TDATrainer", "RestartableLoader", "load_configs", "basis_path", "TDA_YAML", "BASIS_FILE"]

log = logging.getLogger(__name__)

_LOSS_KEYS = ("train/CrossEntropyLoss", "train/ZLoss")     # OLMo's rank-local losses on steps it does not log

TDA_YAML = "tda.yaml"
"""Saved beside OLMo's ``config.yaml`` (which stays loadable by plain OLMo tools)."""
BASIS_FILE = "basis.safetensors"
"""The eigenbasis of a run (``proj_type: eigen``) unless ``capture.basis`` names another file."""


def basis_path(capture: CaptureConfig, run_dir: str | Path) -> Path:
    """Where a run's eigenbasis is: ``capture.basis`` if set (a relative path is taken from the
    current directory, like every path of the config, else from ``run_dir``), otherwise
    ``<run_dir>/tda/basis.safetensors``."""
    if not capture.basis:
        return Path(run_dir) / "tda" / BASIS_FILE
    path = Path(capture.basis)
    return path if path.is_absolute() or path.exists() or not (Path(run_dir) / path).exists() else Path(run_dir) / path


def load_configs(path: str | Path, overrides: list[str] | None = None) -> tuple[TrainConfig, TDAConfig]:
    """Split an OLMo training YAML with a ``tda:`` section into (TrainConfig, TDAConfig).

    Overrides use OLMo's dotted style: ``--tda.capture.proj_dim=32`` goes to the TDA config,
    everything else (``--max_duration=50``) to OLMo's. Errors name the key path.
    """
    overrides = list(overrides or [])
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at top level")
    tda_section = raw.pop("tda", None)
    if tda_section is not None and not isinstance(tda_section, dict):
        raise ConfigError(f"{path}: tda: expected a section (a mapping such as `tda: {{enabled: true}}`), "
                          f"got {tda_section!r}")
    tda_overrides = [o for o in overrides if o.lstrip("-").startswith("tda.")]
    olmo_overrides = [_clean_opt(o) for o in overrides if o not in tda_overrides]
    from ..config import apply_overrides
    tda_data = apply_overrides(tda_section if tda_section is not None else {}, tda_overrides, path="tda")
    TDAConfig.from_dict(tda_data)          # its errors first, before OLMo's loader runs
    # OLMo's loader takes a file: hand it the YAML without our section (interpolations kept as text).
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as tmp:
        yaml.safe_dump(raw, tmp, sort_keys=False)
    try:
        from olmo.exceptions import OLMoConfigurationError
        try:
            cfg = TrainConfig.load(tmp.name, olmo_overrides)
        except OLMoConfigurationError as e:
            raise ConfigError(f"{path}: OLMo rejected the config: {e}") from None
    finally:
        os.unlink(tmp.name)
    return cfg, TDAConfig.from_dict(_interpolated(tda_data, cfg, path))


def _interpolated(tda_data: dict, cfg: TrainConfig, path: Path) -> dict:
    """The TDA section with ``${...}`` filled in as OLMo fills its own keys: ``${save_folder}`` and
    the like name OLMo's (overridden) values, ``${tda.store.path}`` the section's own."""
    if "${" not in yaml.safe_dump(tda_data):
        return tda_data
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        root = OmegaConf.create({**OmegaConf.to_container(OmegaConf.structured(cfg)), "tda": tda_data})
        return OmegaConf.to_container(root.tda, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: tda: cannot fill in an interpolation: {str(e).splitlines()[0]}") from None


def _clean_opt(arg: str) -> str:
    arg = arg[2:] if arg.startswith("--") else arg
    return arg if "=" in arg else f"{arg}=True"


@dataclass
class TDATrainer(Trainer):
    """OLMo's Trainer plus per-example gradient capture beside the optimizer step."""

    tda: TDAConfig = field(default_factory=TDAConfig)
    step_callbacks: list = field(default_factory=list)
    """Called after every optimizer step, after the run's ``tda.callbacks``: each a
    :class:`~olmo_tda.training.callbacks.Callback`, or a function ``fn(step, metrics)`` (progress bars)."""

    def __post_init__(self):
        super().__post_init__()
        self.capture: GradientCapture | None = None
        self.capture_store: CaptureStore | None = None     # the store (and a basis that follows the run)
        self.trajectory = None
        self._record = None
        self.metrics_log = None
        self.run_callbacks = Callbacks()
        self.selection = None
        self._carried_selection = None      # a checkpoint's selection state, kept on while selection is off
        given = [c for c in self.step_callbacks if isinstance(c, Callback)]
        self.step_callbacks = [c for c in self.step_callbacks if not isinstance(c, Callback)]
        if not self.tda.enabled:
            if given:
                log.warning("tda: tda.enabled is false, so the callbacks %s do not run", given)
            return
        tda_dir = Path(self.cfg.save_folder) / "tda"
        with closed_on_error(self._release_tda):    # a refusal while starting: nothing opened stays open
            self.run_callbacks = Callbacks([*self.tda.callbacks, *given])
            if self.tda.store.enabled:
                self.capture = GradientCapture(self.dist_model, self._with_basis(self.tda.capture))
                extra = {"run_name": self.cfg.run_name, "data_paths": list(self.cfg.data.paths or [])}
                self.capture_store = CaptureStore(self.dist_model, self.capture, self.tda.store,
                                                  self.tda.store.path or tda_dir / "store", {"extra": extra},
                                                  rank=_rank(), world_size=_world_size(),
                                                  barrier=dist.barrier if _world_size() > 1 else None)
            # here wherever the store is: reports look here
            self.metrics_log = MetricsLogger(tda_dir, self.tda.wandb, rank=_rank(),
                                             config={"tda": self.tda.to_dict(), "run_name": self.cfg.run_name})
            if self.tda.selection.enabled:
                self.selection = OLMoSelection(self, tda_dir / "selection")
            if self.tda.trajectory.enabled:
                from ..training.trajectory import Trajectory

                self.trajectory = Trajectory(self.tda.trajectory, self.tda.trajectory.path or tda_dir / "trajectory",
                                             projector_hash=self.capture.projector_hash if self.capture else None,
                                             rank=_rank())

    @property
    def store(self):
        """This rank's gradient store writer, or None when nothing is stored."""
        return self.capture_store.store if self.capture_store is not None else None

    def _release_tda(self, exit_code: int = 0) -> None:
        """Close the store (its last window written), remove the hooks, close the selector, the
        callbacks and the metrics log: whatever of them was opened, each even if another fails."""
        with contextlib.ExitStack() as stack:       # closed last to first: the store first
            if self.metrics_log is not None:
                stack.callback(self.metrics_log.close, exit_code)
            stack.callback(self.run_callbacks.close)
            if self.selection is not None:
                stack.callback(self.selection.close)
            if self.capture is not None:
                stack.callback(self.capture.remove)
            if self.capture_store is not None:
                stack.callback(self.capture_store.close)

    def _with_basis(self, capture: CaptureConfig) -> CaptureConfig:
        """``capture`` with ``basis`` set to the run's eigenbasis file, estimated first if missing."""
        if capture.proj_type is not ProjectionType.EIGEN or capture.exact:
            return capture
        path = basis_path(capture, self.cfg.save_folder)
        exists = torch.tensor([float(path.is_file())], device=self.device)   # nccl: a device tensor
        if _world_size() > 1:           # rank 0 decides, so that no rank estimates alone
            dist.broadcast(exists, src=0)
        if not exists.item():
            if self.cfg.load_path is not None:
                log.warning("tda: %s does not exist: estimating the eigenbasis at the freshly built weights, "
                            "not at load_path's (estimate it yourself and set tda.capture.basis to use others)", path)
            log.info("tda: estimating the eigenbasis over %d training batches per rank -> %s",
                     capture.basis_batches, path)
            # forked RNG: iterating the loader draws a seed; training must go on as it would without this
            with torch.random.fork_rng(devices=[self.device.index or 0] if self.device.type == "cuda" else []):
                basis = estimate_eigenbasis(self.dist_model, self._first_micro_batches(capture.basis_batches),
                                            self._summed_loss, capture, distributed=_world_size() > 1)
            if _rank() == 0:
                basis.save(path)
            if _world_size() > 1:
                dist.barrier()
                if not path.is_file():  # a node-local save_folder: each node keeps its (identical) copy
                    basis.save(path)
        return dataclasses.replace(capture, basis=str(path))

    def _first_micro_batches(self, num_batches: int):
        """The micro-batches of this rank's first ``num_batches`` training batches (the loader is
        iterated afresh, so ``fit`` still starts from the first batch)."""
        it = iter(self.train_loader)
        batches = [b for _, b in zip(range(num_batches), it)]
        del it
        for batch in batches:
            yield from self.split_batch(move_to_device(batch, self.device))

    def _summed_loss(self, model: torch.nn.Module, micro_batch: dict[str, Any]) -> torch.Tensor:
        with torch.autocast("cuda", enabled=True, dtype=self.cfg.autocast_precision):   # as OLMo trains
            ce_loss, _, _ = self.model_forward(micro_batch, loss_reduction="sum")        # runs self.dist_model
        return ce_loss

    # -- the step --------------------------------------------------------------------------------

    def train_batch(self, batch: dict[str, Any]):
        if self.capture is None:
            return super().train_batch(batch)
        if "index" not in batch:
            raise RuntimeError("tda capture needs batch['index'] (global instance ids); OLMo's IterableDataset "
                               "provides it — a custom loader must too")
        self.capture_store.before_step(self.global_step)
        with self.capture.record(batch["index"], loss_scale=batch["input_ids"].numel()) as rec:
            out = super().train_batch(batch)
        self._record = rec
        return out

    def train_step(self, batch: dict[str, Any], reduce_global_loss: bool = True) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.trajectory is not None and self.global_step == 1:    # θ_0, before the first update
            self._keep_trajectory(0)
        metrics = super().train_step(batch, reduce_global_loss=reduce_global_loss)
        if self.trajectory is not None:
            if self.global_step == 1:       # θ_0's lr: the one its gradient was used with (warmup's first)
                self.trajectory.set_lrs(0, [float(g["lr"]) for g in self.optim.param_groups])
            self._keep_trajectory(self.global_step)
        record, sums, maxima = self._store_step(metrics, t0)
        # tda/metrics.jsonl keeps every step's loss: OLMo averages it over the ranks only on the steps
        # it logs, and rank 0's own loss is not the run's. Averaged here in the returned metrics, so OLMo's own state
        # (cur_train_loss, early stopping) is what OLMo made it
        losses = [k for k in _LOSS_KEYS if k in metrics] if self.tda.enabled and not reduce_global_loss else []
        self._sum_over_ranks(metrics, losses, sums, maxima)
        if self.selection is not None and self.selection.selector.due(self.global_step):
            self.selection.round(metrics)
        if self.tda.enabled:
            ids = np.asarray(batch["index"].cpu() if "index" in batch else [], dtype=np.int64)
            self.run_callbacks.step_end(StepEnd(step=self.global_step, model=self.dist_model, ids=ids, record=record,
                                                metrics=metrics, rank=_rank(), world_size=_world_size()))
        if self.metrics_log is not None:
            self.metrics_log.log(self.global_step, metrics)
        for callback in self.step_callbacks:
            callback(self.global_step, metrics)
        return metrics

    def _store_step(self, metrics: dict[str, float], t0: float):
        """Hand the step's record to the store (and the selector's sources policy): the record, and
        this rank's capture numbers to sum and to maximize over the ranks (empty without a store)."""
        if self.capture_store is None:
            return None, {}, {}
        record = None
        if self._record is not None:
            lr = float(self.optim.param_groups[0]["lr"])           # what OLMo's step just used
            # the row's weight in the step's update: OLMo divides by this rank's tokens and DDP/FSDP
            # average over the ranks, so TracIn's lr / loss_scale needs the global batch's tokens
            record = self._record.to_record(step=self.global_step, lr=lr)
            record.loss_scale = record.loss_scale * _world_size()
            if self.selection is not None:      # the sources policy learns from these very rows
                self.selection.selector.observe(self._record)
            self._record = None
        append_ms = self.capture_store.commit(record, self.global_step)
        sums, maxima, same = self.capture_store.numbers(rows=len(record.ids) if record else 0, append_ms=append_ms,
                                                        seconds=time.perf_counter() - t0)
        metrics.update(same)
        return record, sums, maxima

    def _sum_over_ranks(self, metrics: dict[str, float], losses: list[str], counts: dict[str, float],
                        maxima: dict[str, float]) -> None:
        """Into ``metrics``: the rank-local ``losses`` (keys of it) as their mean over the ranks,
        ``counts`` as their sum, the run's, and ``maxima`` as the slowest rank's, with one collective;
        ``tda/rows_captured`` as the run's total so far (carried over a resume by the checkpoint)."""
        values, slowest = sum_and_max_over_ranks([metrics[k] for k in losses] + list(counts.values()),
                                                 list(maxima.values()), self.device)
        metrics.update(zip(maxima, slowest))
        for key, value in zip(losses, values):
            metrics[key] = value / _world_size()
        if losses and "train/CrossEntropyLoss" in metrics and "train/Perplexity" in metrics:
            metrics["train/Perplexity"] = math.exp(metrics["train/CrossEntropyLoss"])
        for key, value in zip(counts, values[len(losses):]):
            metrics[key] = float(value)
        if counts:
            self.capture_store.count_run_rows(metrics)

    def _keep_trajectory(self, step: int) -> None:
        self.trajectory.maybe_save(step, self._full_weights, lrs=[float(g["lr"]) for g in self.optim.param_groups],
                                   tokens_seen=0 if step == 0 else int(self.global_train_tokens_seen))

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """The model's full state dict (FSDP: gathered; collective, every rank calls it). On GPUs it is
        gathered into rank 0's CPU memory only (the others get an empty dict), so no rank holds a full
        copy on its device; a CPU-only torch crashes in that offload (as in OLMo's own full-state-dict
        save), so there every rank gets the full dict."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if isinstance(self.dist_model, FSDP):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            offload = self.device.type == "cuda"
            return get_model_state_dict(self.dist_model, options=StateDictOptions(full_state_dict=True,
                                                                                 cpu_offload=offload))
        return getattr(self.dist_model, "module", self.dist_model).state_dict()

    # -- checkpoints -------------------------------------------------------------------------------

    def trainer_state_dict(self) -> dict[str, Any]:
        if torch.cuda.is_available():
            state = super().trainer_state_dict()
        else:   # OLMo asks for the CUDA RNG unconditionally, which a CPU-only torch cannot give
            state = {"epoch": self.epoch or 0, "global_step": self.global_step,
                     "global_train_examples_seen_this_epoch": self.global_train_examples_seen_this_epoch,
                     "global_train_tokens_seen": self.global_train_tokens_seen, "world_size": _world_size(),
                     "checkpoints": self.checkpoints, "unsharded_checkpoints": self.unsharded_checkpoints,
                     "ephemeral_checkpoints": self.ephemeral_checkpoints,
                     "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.random.get_rng_state()}}
        if self.capture_store is not None:      # flushed: this rank's rows up to here
            state["tda"] = self.capture_store.state_dict(self.global_step)
        if self.tda.enabled:                # collective: every rank's callback state, kept by rank 0
            state["tda_callbacks"] = self.run_callbacks.gathered_state()
        if self.trajectory is not None:     # the schedule as of this step (a resume restores it)
            state["tda_trajectory"] = self.trajectory.state_dict()
        if self.selection is not None:      # what a resume's log must hold to replay this step's order
            state["tda_selection"] = self.selection.state_dict()
        elif self._carried_selection:       # switched off: switching it back on is still checked against them
            state["tda_selection"] = dict(self._carried_selection)
        return _weights_only_safe(state)

    def restore_rng_state(self, rng_state: dict[str, Any]) -> None:
        random.setstate(rng_state["python"])
        np.random.set_state(rng_state["numpy"])
        torch.set_rng_state(rng_state["torch"])
        if torch.cuda.is_available() and "cuda" in rng_state:
            torch.cuda.set_rng_state(rng_state["cuda"])

    def load_trainer_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_trainer_state_dict(_from_weights_only_safe(state_dict))
        saved = state_dict.get("tda")
        if saved is not None and "tda_basis" in state_dict:     # a checkpoint that kept the basis beside it
            saved = {**saved, "basis": state_dict["tda_basis"]}
        # restore_dataloader: false: OLMo restarts the step count and the data at 0 (the weights only, to
        # train on): a new timeline, as a fresh run's. No selection round of the checkpoint's run applies
        # (OLMoSelection.reapply cuts this run's log to none), the trajectory starts at its first save
        # (dropping any step-0 checkpoint of another timeline), and the row count starts at 0
        new_timeline = not self.cfg.restore_dataloader
        if self.capture_store is not None:      # refused before anything on disk is cut back
            self.capture_store.check_resume(saved, self.global_step, new_timeline=new_timeline)
        if self.selection is not None and not new_timeline:
            self.selection.load_state_dict(state_dict.get("tda_selection"))
        elif not new_timeline and (state_dict.get("tda_selection") or {}).get("rounds"):
            self._carried_selection = dict(state_dict["tda_selection"])
            log.warning("tda: the checkpoint's run had applied %d selection rounds by step %d, and tda.selection is "
                        "off now: this run trains on the plain data order from here",
                        state_dict["tda_selection"]["rounds"], self.global_step)
        if self.trajectory is not None and not new_timeline:     # drops the abandoned run's later checkpoints
            self.trajectory.resume(self.global_step, state_dict.get("tda_trajectory"))
        if self.metrics_log is not None:    # and its later steps' metrics, which will be re-run
            self.metrics_log.cut_after(self.global_step)
        if not new_timeline:                # the run's own callbacks, as they were at the checkpoint
            self.run_callbacks.load_gathered(state_dict.get("tda_callbacks"), _rank())
        if self.selection is not None:
            self.selection.reapply()
        if self.capture_store is not None:
            self.capture_store.resume(saved, self.global_step, new_timeline=new_timeline)

    def save_checkpoint(self, checkpoint_type: CheckpointType = CheckpointType.sharded):
        if self.capture_store is not None:
            self.capture_store.flush()      # every step up to this checkpoint is durable before it exists
        return super().save_checkpoint(checkpoint_type)

    def close(self, exit_code: int = 0) -> None:
        import wandb

        try:        # the store's last window is written whatever W&B does
            self._release_tda(exit_code)
        finally:
            if wandb.run is not None:   # OLMo 0.6.0 calls finish(quiet=True), which wandb >= 0.19 rejects
                wandb.finish(exit_code=exit_code)
            super().close(exit_code)


_PATH_LISTS = ("checkpoints", "unsharded_checkpoints", "ephemeral_checkpoints")


def _weights_only_safe(state: dict[str, Any]) -> dict[str, Any]:
    """OLMo's trainer state holds Paths and numpy's RNG tuple, which ``torch.load(weights_only=True)``
    (torch's default since 2.6, and our rule for anything read from disk) refuses: store plain
    strings and lists instead; :func:`_from_weights_only_safe` turns them back."""
    state = dict(state)
    for key in _PATH_LISTS:
        if key in state:
            state[key] = [str(p) for p in state[key]]
    rng = dict(state.get("rng", {}))
    if "numpy" in rng:
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        rng["numpy"] = [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(gauss)]
        state["rng"] = rng
    return state


def _from_weights_only_safe(state: dict[str, Any]) -> dict[str, Any]:
    state = dict(state)
    for key in _PATH_LISTS:
        if key in state:
            state[key] = [Path(p) for p in state[key]]
    rng = dict(state.get("rng", {}))
    if isinstance(rng.get("numpy"), list):
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        rng["numpy"] = (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss)
        state["rng"] = rng
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
