"""DeepSpeed integration: per-example gradient capture through a ``DeepSpeedEngine`` (ZeRO 0-3),
with the user's loop unchanged.

One line after ``deepspeed.initialize``::

    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
    tda = olmo_tda.integrations.deepspeed.attach(engine)       # reads ds_config["tda"]
    for batch in loader:                                        # batch: {"input_ids", "labels", "index"}
        loss = engine(batch)
        engine.backward(loss)                                   # or loss.backward()
        engine.step()
    tda.close()

With ``capture.proj_type: eigen``, :func:`estimate_basis` (every rank, before the first step) writes
the eigenbasis file ``attach`` then projects onto.

What happens, per micro-batch and per optimizer step:

- a forward pre-hook on ``engine.module`` reads the micro-batch's global example ids
  (``batch[tda.batch.ids_key]``) and the divisor of its loss (``tda.batch.reduction``: counted labels,
  examples, or 1), and opens a capture record for it, scaled by that divisor times the engine's
  gradient-accumulation division (and the fp16 loss scale when ``engine.backward`` applies one);
- the capture hooks (:class:`~olmo_tda.capture.GradientCapture`) see only activations and output
  gradients, which every ZeRO stage leaves whole, so partitioned parameters (``zero.Init``, stage 3)
  need nothing special;
- ``engine.step()`` at the accumulation boundary commits the micro-batch records as one store record
  with the step number and the lr the optimizer used; a step the engine skipped (overflow) is dropped;
- ``engine.save_checkpoint`` flushes the store and adds the TDA state to ``client_state``;
  ``engine.load_checkpoint`` takes it back out and truncates the store after the checkpoint's step, so
  a resumed run neither duplicates nor misses an (id, step).

DeepSpeed has no callback API, so ``step``, ``backward``, ``scale``, ``save_checkpoint`` and
``load_checkpoint`` are wrapped on this engine instance (never on the class);
:meth:`DeepSpeedTDA.remove` restores them.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import math
import time
import weakref
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from ..capture import GradientCapture, activation_grads_only, estimate_eigenbasis
from ..capture.hooks import Recording, _in_backward
from ..config import ConfigError, LossReduction, ProjectionType, TDAConfig
from ..store import GradientRecord
from ..store.record import cat_rows
from ..training.callbacks import Callback, Callbacks, StepEnd
from ..training.metrics import MetricsLogger
from . import closed_on_error, decided_on_rank0, sum_and_max_over_ranks, sum_over_ranks
from .capture_store import CaptureStore
from .deepspeed_selection import DeepSpeedSelection, check_selection_log, rounds_up_to  # noqa: F401 - re-exported

__all__ = ["attach", "close_open_sessions", "estimate_basis", "DeepSpeedTDA", "DeepSpeedSelection", "STATE_KEY"]

log = logging.getLogger(__name__)

_OPEN_SESSIONS: "weakref.WeakSet[DeepSpeedTDA]" = weakref.WeakSet()


def close_open_sessions() -> None:
    """Close every session of this process still open, as the interpreter's exit would: for a failed
    rank about to end with ``os._exit`` (:func:`olmo_tda.integrations.end_failed_rank`), which skips it."""
    for session in list(_OPEN_SESSIONS):
        try:
            session.close(exit_code=1)
        except Exception:  # noqa: BLE001 - the failure being reported is the error that matters
            log.exception("tda: closing the session of a failed rank failed")

STATE_KEY = "olmo_tda"
"""Key of the TDA state in DeepSpeed checkpoints' ``client_state``."""

_WRAPPED = ("step", "backward", "scale", "save_checkpoint", "load_checkpoint")

BatchInfo = Callable[[tuple, dict], "tuple[Any, float]"]
"""``fn(forward_args, forward_kwargs) -> (ids, divisor)`` for batches our config cannot read."""


def attach(engine: Any, config: TDAConfig | Mapping | str | Path | None = None, *,
           capture: GradientCapture | None = None, batch_info: BatchInfo | None = None,
           callbacks: Iterable[Callback] = ()) -> "DeepSpeedTDA":
    """Capture every example of every optimizer step of ``engine`` into a gradient store.

    Args:
        engine: the ``DeepSpeedEngine`` from ``deepspeed.initialize``.
        config: a :class:`~olmo_tda.config.TDAConfig`, the ``tda`` mapping, or a YAML file with a
            ``tda:`` section. ``None`` reads the ``"tda"`` entry of the engine's DeepSpeed config.
        capture: a :class:`GradientCapture` already attached to the model (e.g. before
            ``deepspeed.initialize``); by default one is built on ``engine.module``.
        batch_info: custom ``(ids, divisor)`` extraction for batches that are not dicts.
        callbacks: :class:`~olmo_tda.training.callbacks.Callback` instances, run after those the
            config's ``callbacks`` names at the end of every optimizer step.

    After each optimizer step the run's ``tda/*`` metrics go to ``<store>/../metrics.jsonl``, to W&B
    (a run of this process, or one ``tda.wandb.enabled`` starts) and to DeepSpeed's monitor.
    """
    _refuse_pipeline(engine)
    return DeepSpeedTDA(engine, _resolve_config(engine, config), capture=capture, batch_info=batch_info,
                        callbacks=callbacks)


def _refuse_start(engine: Any, config: TDAConfig, capture: GradientCapture | None) -> None:
    """Refuse, before anything is opened, an engine already wrapped, a store without a path, or an
    eigen projection without its basis file."""
    wrapped = [name for name in _WRAPPED if name in engine.__dict__]
    if wrapped:         # another session's (or the user's) instance methods: ours would bypass them
        raise ConfigError(f"attach: engine.{', engine.'.join(wrapped)} are already replaced on this engine (an "
                          "earlier attach() still attached?): close() that session first")
    if config.store.path is None:
        raise ConfigError("tda.store.path: a DeepSpeed run has no save folder to default to; set the "
                          "store directory (e.g. \"tda\": {\"store\": {\"path\": \"runs/x/tda/store\"}})")
    eigen = config.capture.proj_type is ProjectionType.EIGEN and not config.capture.exact
    if capture is None and eigen and not (config.capture.basis and Path(config.capture.basis).is_file()):
        what = f"{config.capture.basis} does not exist: estimate it" if config.capture.basis else \
            "none is set: set tda.capture.basis to a path, then estimate the file"
        raise ConfigError(f"tda.capture.basis: proj_type 'eigen' projects onto an eigenbasis file, and {what} on "
                          "every rank, before the first step, with "
                          "olmo_tda.integrations.deepspeed.estimate_basis(engine, batches, loss_fn, config)")


def _refuse_pipeline(engine: Any) -> None:
    """A pipeline-parallel engine steps inside ``train_batch`` without calling ``engine.step``, so
    nothing would ever be committed (and every forward's record would pile up): refused, not silent."""
    try:
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except ImportError:         # a DeepSpeed without pipeline parallelism: nothing to refuse
        return
    if isinstance(engine, PipelineEngine):
        raise ConfigError("attach: pipeline-parallel DeepSpeed engines (PipelineModule, train_batch) are not "
                          "supported: they step without engine.step(), so no example would be captured. Use "
                          "ZeRO data parallelism (stages 1-3) for the run olmo_tda captures")


def _resolve_config(engine: Any, config: Any) -> TDAConfig:
    if isinstance(config, TDAConfig):
        config.validate()
        return config
    if isinstance(config, (str, Path)):
        return TDAConfig.from_yaml(config)
    if isinstance(config, Mapping):
        return TDAConfig.from_dict(dict(config))
    if config is not None:
        raise ConfigError(f"tda: expected a TDAConfig, a mapping or a YAML path, got {type(config).__name__}")
    ds_config = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if ds_config is None and isinstance(getattr(engine, "config", None), Mapping):
        ds_config = engine.config
    section = (ds_config or {}).get("tda")
    if section is None:
        raise ConfigError("tda: no config given and the DeepSpeed config has no 'tda' entry; pass "
                          "attach(engine, config=...) or add \"tda\": {\"enabled\": true, ...} to the DeepSpeed config")
    if not isinstance(section, Mapping):
        raise ConfigError(f"tda: the DeepSpeed config's 'tda' entry must be a mapping, got {type(section).__name__}")
    return TDAConfig.from_dict(dict(section))


def estimate_basis(engine: Any, batches: Iterable[Any], loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                   config: TDAConfig | Mapping | str | Path | None = None) -> Path | None:
    """Estimate the KFAC eigenbasis that ``capture.proj_type: eigen`` projects onto, through ``engine``
    (any ZeRO stage; before its first step, as a run estimates it at its initial weights), and save it
    to ``capture.basis``; returns that path. Call it on every rank, each with its own micro-batches,
    then :func:`attach` with the same config. An existing file is kept (a resumed run reuses it).
    With tda or its store off (``attach`` builds no capture) it does nothing and returns None.

    ``loss_fn(engine.module, batch)`` returns the batch's **summed** token loss. It runs through the
    engine's module as its training steps do (under ZeRO-3 its hooks gather each layer's weights in
    turn) with every weight frozen, the embeddings' outputs carrying the backward: no parameter gets
    a gradient, so the engine's reduction hooks see nothing and training is as without the estimate.
    The covariances are summed over the ranks; rank 0 writes the file (a failure is every rank's)."""
    config = _resolve_config(engine, config)
    if not (config.enabled and config.store.enabled):
        return None
    capture = config.capture
    if capture.exact:
        raise ConfigError("estimate_basis: tda.capture.proj_dim is 0 (exact rows): there is no projection to "
                          "estimate a basis for")
    if capture.proj_type is not ProjectionType.EIGEN:
        raise ConfigError(f"estimate_basis: tda.capture.proj_type is {capture.proj_type.value!r}: only 'eigen' "
                          "projects onto a basis")
    if not capture.basis:
        raise ConfigError("estimate_basis: tda.capture.basis names no file to write the eigenbasis to")
    path = Path(capture.basis)
    if decided_on_rank0(path.is_file):       # rank 0 decides, so that no rank estimates alone
        return path
    world = _world_size()
    log.info("tda: estimating the eigenbasis through the engine (ZeRO stage %d, %d rank%s) -> %s",
             engine.zero_optimization_stage(), world, "s" if world > 1 else "", path)
    try:
        with activation_grads_only(engine.module, embedding_grads=False):
            basis = estimate_eigenbasis(engine.module, batches, loss_fn, capture, distributed=world > 1)
    except (RuntimeError, ValueError) as e:
        if "does not require grad" not in str(e) and "no nn.Embedding" not in str(e):
            raise
        raise ConfigError("estimate_basis: the loss does not depend on the output of any nn.Embedding module. With "
                          "every weight frozen (so that no parameter gets a gradient) the backward starts from the "
                          "embeddings' outputs; for a model that looks its tokens up otherwise, estimate the basis "
                          "on a plain copy with olmo_tda.capture.eigenbasis.estimate_eigenbasis(...).save(PATH)") \
            from None

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            basis.save(path)
        except OSError as e:
            raise ConfigError(f"tda.capture.basis: cannot write the eigenbasis to {path}: "
                              f"{e.strerror or e}") from None

    decided_on_rank0(save)
    return path


class DeepSpeedTDA:
    """The TDA session of one engine: capture, store, and the engine-method wrappers."""

    def __init__(self, engine: Any, config: TDAConfig, *, capture: GradientCapture | None = None,
                 batch_info: BatchInfo | None = None, callbacks: Iterable[Callback] = ()):
        self.engine = engine
        self.config = config
        self.capture: GradientCapture | None = None
        self.capture_store: CaptureStore | None = None     # the store (and a basis that follows the run)
        self.steps_committed = 0
        self.steps_dropped = 0
        self.rows_captured = 0
        self._batch_info = batch_info
        self._explicit: tuple[Any, float] | None = None
        self._open: contextlib.ExitStack | None = None
        self._open_rec: Recording | None = None
        # record -> what measures the factor DeepSpeed put on its loss (a record dropped unstepped
        # leaves with its entry)
        self._loss_factors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._pending: list[Recording] = []
        self._handles: list[Any] = []
        self._owns_capture = capture is None
        self._warned_unused = False
        self.run_callbacks = Callbacks()
        self.metrics_log: MetricsLogger | None = None
        self._step_clock = 0.0
        self.trajectory = None
        self._tokens_seen = 0
        if not config.enabled:
            return
        if not config.store.enabled:        # e.g. a run that only selects data: no capture session
            if config.trajectory.enabled:
                log.warning("tda.trajectory is kept by the capture session, which tda.store.enabled: false turns off")
            if config.callbacks or list(callbacks):
                raise ConfigError("tda.callbacks: under DeepSpeed the callbacks run in the capture session, which "
                                  "tda.store.enabled: false turns off; turn the store on, or call yours after "
                                  "engine.step()")
            return
        _refuse_start(engine, config, capture)
        self.capture = capture if capture is not None else GradientCapture(engine.module, config.capture)
        with closed_on_error(self.close):     # a refusal while starting: nothing opened stays open
            self._open_outputs(config)
            self.run_callbacks = Callbacks([*config.callbacks, *callbacks])
            # DeepSpeed's own W&B monitor logs the tda/* events at its samples step (below): a second
            # writer at the optimizer step would be behind W&B's step and dropped
            monitor_wandb = getattr(getattr(engine, "monitor", None), "wandb_monitor", None) is not None
            self.metrics_log = MetricsLogger(Path(config.store.path).parent, config.wandb, rank=_rank(),
                                             config={"tda": config.to_dict()}, wandb=not monitor_wandb)
            self._handles.append(engine.module.register_forward_pre_hook(self._on_forward, with_kwargs=True))
            for name in _WRAPPED:
                if hasattr(type(engine), name):      # `scale` (manual backward) is DeepSpeed >= 0.18
                    setattr(engine, name, getattr(self, f"_{name}"))
        self._step_clock = time.perf_counter()
        self._atexit = partial(_close_at_exit, weakref.WeakMethod(self.close))
        atexit.register(self._atexit)
        _OPEN_SESSIONS.add(self)

    def _open_outputs(self, config: TDAConfig) -> None:
        """This rank's store, the following basis (``capture.basis_every``) and the trajectory."""
        engine = self.engine
        extra = {"framework": "deepspeed", "zero_stage": int(engine.zero_optimization_stage()),
                 "gradient_accumulation_steps": self._gas()}
        self.capture_store = CaptureStore(engine.module, self.capture, config.store, config.store.path,
                                          {"extra": extra}, rank=_rank(), world_size=_world_size(),
                                          barrier=dist.barrier if _world_size() > 1 else None)
        if config.trajectory.enabled:
            from ..training.trajectory import Trajectory

            self.trajectory = Trajectory(config.trajectory,
                                         config.trajectory.path or default_trajectory_path(config.store.path),
                                         projector_hash=self.capture.projector_hash, rank=_rank())

    # -- per micro-batch ---------------------------------------------------------------------------

    def set_batch(self, ids: Any, divisor: float) -> None:
        """Declare the ids and loss divisor of the next forward (for loops whose model input does not
        carry the ids); overrides the config for that one forward."""
        self._explicit = (ids, float(divisor))

    def _on_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or _in_backward() or self.capture.paused:
            return                          # evaluation, or an activation-checkpoint recompute
        self._close_open()
        self.capture_store.before_step(int(self.engine.global_steps) + 1)
        ids, divisor = self._read_batch(args, kwargs)
        stack = contextlib.ExitStack()
        self._open_rec = stack.enter_context(self.capture.record(ids, loss_scale=divisor * self._gas()))
        self._open = stack

    def _read_batch(self, args: tuple, kwargs: dict) -> tuple[Any, float]:
        if self._explicit is not None:
            info, self._explicit = self._explicit, None
            return info
        if self._batch_info is not None:
            return self._batch_info(args, kwargs)
        cfg = self.config.batch
        batch = next((a for a in args if isinstance(a, Mapping)), kwargs)
        if cfg.ids_key not in batch:
            raise ConfigError(
                f"tda.batch.ids_key: the model's input has no {cfg.ids_key!r} entry (keys: {sorted(batch)}); "
                "pass a dict batch holding the global example ids, set tda.batch.ids_key, call "
                "tda.set_batch(ids, divisor) before the forward, or attach(..., batch_info=fn)")
        ids = batch[cfg.ids_key]
        num = len(ids)
        tokens = batch.get(cfg.labels_key, batch.get("input_ids"))
        self._tokens_seen += int(tokens.numel()) * _world_size() if hasattr(tokens, "numel") else 0
        if cfg.reduction is LossReduction.SUM:
            return ids, 1.0
        if cfg.reduction is LossReduction.EXAMPLE_MEAN:
            return ids, float(num)
        labels = batch.get(cfg.labels_key)
        if labels is None:
            raise ConfigError(f"tda.batch.reduction: token_mean counts batch[{cfg.labels_key!r}], which the "
                              f"model's input lacks (keys: {sorted(batch)}); set tda.batch.labels_key or the reduction")
        if cfg.shift_labels:
            labels = labels[..., 1:]
        counted = int((labels != cfg.ignore_index).sum())
        return ids, float(max(counted, 1))   # all-masked: the loss is 0/0, its rows are non-finite anyway

    def _close_open(self) -> None:
        if self._open is None:
            return
        self._open.close()
        rec, self._open, self._open_rec = self._open_rec, None, None
        if rec.num_backward_rows == 0:
            if not self._warned_unused:
                self._warned_unused = True
                log.warning("tda: a training-mode forward was never backpropagated before the next forward or "
                            "step; its examples are not recorded (run evaluation under torch.no_grad())")
            return
        self._pending.append(rec)

    # -- engine method wrappers --------------------------------------------------------------------

    def _backward(self, *args: Any, **kwargs: Any) -> Any:
        rec = self._open_rec
        loss = args[0] if args else kwargs.get("loss")   # engine.backward(loss, retain_graph, scale_wrt_gas)
        if rec is not None and isinstance(loss, torch.Tensor) and loss.requires_grad:
            # engine.backward backpropagates loss·g·S: g = 1/gas (unless scale_wrt_gas=False), S the
            # loss scale of whichever scaler is on. The gradient reaching `loss` is g·S, measured by a
            # hook (no device sync before the step): it follows each DeepSpeed version's own branches
            wrt_gas = args[2] if len(args) > 2 else kwargs.get("scale_wrt_gas", True)
            gas_part = 1.0 / self._gas() if wrt_gas else 1.0

            def keep(grad: torch.Tensor) -> None:
                self._loss_factors[rec] = (grad.detach(), None, gas_part)
            loss.register_hook(keep)
        return type(self.engine).backward(self.engine, *args, **kwargs)

    def _scale(self, loss: Any) -> Any:
        """``engine.scale(loss).backward()``: the manual-backward form of fp16 loss scaling. DeepSpeed
        divides by gas through hooks on the module's outputs (wherever the loss is computed from them);
        the scale S is read off the scaled loss."""
        scaled = type(self.engine).scale(self.engine, loss)
        if self._open_rec is not None and isinstance(loss, torch.Tensor):
            self._loss_factors[self._open_rec] = (scaled.detach(), loss.detach(), 1.0 / self._gas())
        return scaled

    def _undo_loss_factors(self, records: list[Recording]) -> list[float]:
        """Undo what DeepSpeed multiplied each record's loss by, at the step: the rows are de-scaled by
        ``divisor / (g·S)`` (``rec.loss_scale``, opened as ``divisor × gas``), and the returned
        ``divisor / g × dp`` is what the store keeps as the row's ``loss_scale`` (TracIn weights rows by
        ``lr / loss_scale``: the optimizer unscales S before its step, so S is not part of it, and the
        data-parallel ranks' gradients are averaged, so their number dp is). A
        direct ``loss.backward()`` has nothing to measure: DeepSpeed divides by gas (and refuses fp16).
        Every measured value of the step is read in one device transfer."""
        measured = [self._loss_factors.pop(rec, None) for rec in records]
        tensors = [t for m in measured if m is not None for t in m[:2] if t is not None]
        values = iter(torch.stack([t.float().reshape(-1)[0] for t in tensors]).tolist() if tensors else [])
        kept = []
        dp = int(getattr(self.engine, "dp_world_size", None) or _world_size())   # DeepSpeed averages over them
        for rec, m in zip(records, measured):
            divisor_gas = rec.loss_scale
            if m is None:
                kept.append(divisor_gas * dp)
                continue
            first, second, gas_part = m
            value = next(values)
            if second is None:                  # the gradient that reached the loss: g·S
                scale = value / gas_part
            else:                               # scaled loss / loss: S
                base = next(values)
                scale = value / base if base != 0 else 1.0
            if not (math.isfinite(scale) and scale > 0):
                scale = 1.0                     # an overflowed step: the engine skips it anyway
            stored = divisor_gas / self._gas() / gas_part
            rec.loss_scale = stored / scale
            kept.append(stored * dp)
        return kept

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        boundary = engine.is_gradient_accumulation_boundary() or not _managed_accumulation(engine)
        if not boundary:
            return type(engine).step(engine, *args, **kwargs)
        lrs = [float(x) for x in engine.get_lr()]   # the scheduler moves them inside step(), after the update
        lr = lrs[0]
        self._close_open()
        if self.trajectory is not None and engine.global_steps == 0:
            self.trajectory.maybe_save(0, self._full_weights, lrs=lrs, tokens_seen=0)   # θ_0, before the update
        out = type(engine).step(engine, *args, **kwargs)
        records, self._pending = self._pending, []
        record, append_ms = None, 0.0
        if engine.was_step_applied():
            record = self._commit(records, step=int(engine.global_steps), lr=lr)
            append_ms = self.capture_store.commit(record, int(engine.global_steps))
            if self.trajectory is not None:
                self.trajectory.maybe_save(int(engine.global_steps), self._full_weights, lrs=lrs,
                                           tokens_seen=self._tokens_seen)
        else:
            self.steps_dropped += 1
            log.info("tda: step %d was skipped by the engine (overflow); its %d examples are not recorded",
                     engine.global_steps, sum(len(r.ids) for r in records))
        self._step_end(int(engine.global_steps), record, append_ms)
        return out

    def _step_end(self, step: int, record: GradientRecord | None, append_ms: float) -> None:
        """The step's run-wide ``tda/*`` metrics (one collective), then the callbacks, the metrics
        log and DeepSpeed's monitor. Every rank comes here at every optimizer step."""
        now = time.perf_counter()
        sums, maxima, metrics = self.capture_store.numbers(rows=len(record.ids) if record else 0, append_ms=append_ms,
                                                           seconds=now - self._step_clock)
        self._step_clock = now
        summed, slowest = sum_and_max_over_ranks(list(sums.values()), list(maxima.values()), self.engine.device)
        metrics.update(zip(sums, summed))
        metrics.update(zip(maxima, slowest))
        self.capture_store.count_run_rows(metrics)
        ids = record.ids if record is not None else np.zeros(0, dtype=np.int64)
        self.run_callbacks.step_end(StepEnd(step=step, model=self.engine.module, ids=ids, record=record,
                                            metrics=metrics, rank=_rank(), world_size=_world_size()))
        self.metrics_log.log(step, metrics)
        monitor = getattr(self.engine, "monitor", None)
        if monitor is not None and monitor.enabled and _rank() == 0:
            samples = int(getattr(self.engine, "global_samples", step))
            monitor.write_events([(k, float(v), samples) for k, v in metrics.items()])

    def _commit(self, records: list[Recording], step: int, lr: float) -> GradientRecord | None:
        if not records:
            return None
        kept = self._undo_loss_factors(records)      # before the rows are de-scaled
        ids = np.concatenate([r.ids for r in records])
        scales = np.concatenate([np.full(len(r.ids), scale) for r, scale in zip(records, kept)])
        parts = [r.stored() for r in records]          # dense, or LoRIF factors with capture.rank
        grads = {name: cat_rows([p[name] for p in parts]) if len(parts) > 1 else parts[0][name]
                 for name in parts[0]}
        record = GradientRecord(ids=ids, step=step, lr=lr, loss_scale=scales, grads=grads,
                                basis=records[0].basis_version)
        self.steps_committed += 1
        self.rows_captured += len(ids)
        return record

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        orig = type(self.engine).save_checkpoint
        bound = _signature(orig).bind(self.engine, *args, **kwargs)
        bound.apply_defaults()
        user_state = bound.arguments["client_state"] or {}
        if STATE_KEY in user_state:
            raise ConfigError(f"save_checkpoint: client_state key {STATE_KEY!r} is olmo_tda's (its store position "
                              "goes there); rename yours")
        self.capture_store.flush()              # every committed step is durable before the checkpoint exists
        state = {**self.state_dict(), "callbacks": self.run_callbacks.gathered_state()}     # collective
        bound.arguments["client_state"] = {**user_state, STATE_KEY: state}
        return orig(*bound.args, **bound.kwargs)

    def _load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        orig = type(self.engine).load_checkpoint
        module_only = bool(_signature(orig).bind(self.engine, *args, **kwargs).arguments.get("load_module_only"))
        out = orig(self.engine, *args, **kwargs)
        load_path, client_state = out
        if load_path is None:
            return out
        saved = client_state.pop(STATE_KEY, None) if isinstance(client_state, dict) else None
        if not module_only:     # a warm start (weights only, global_steps stays 0) is not a resume of that run
            self.load_state_dict(saved)
        return out

    # -- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume the store: plain types only."""
        return {**self.capture_store.state_dict(int(self.engine.global_steps)), "tokens_seen": self._tokens_seen,
                "trajectory": self.trajectory.state_dict() if self.trajectory is not None else None}

    def load_state_dict(self, state: Mapping | None) -> None:
        """Resume after ``engine.load_checkpoint``: refuse other projectors, drop rows past the
        checkpoint's step (they will be re-run) and any half-accumulated micro-batches."""
        step = int(self.engine.global_steps)
        self.capture_store.check_resume(state, step)    # refused before anything is cut
        if self._open is not None:
            self._open.close()
        self._open, self._open_rec, self._pending = None, None, []
        if self.trajectory is not None:     # the schedule as of the checkpoint (refused before the store is
            self.trajectory.resume(step, (state or {}).get("trajectory"))    # cut); its later checkpoints go
        self.capture_store.resume(state, step)
        self._tokens_seen = int((state or {}).get("tokens_seen", 0))    # what trajectory checkpoints record
        self.metrics_log.cut_after(step)        # its later steps will be run again
        if state is not None:
            self.run_callbacks.load_gathered(state.get("callbacks"), _rank())
        self.rows_captured = self.steps_committed = self.steps_dropped = 0      # this rank's, since the resume

    def start_over(self) -> None:
        """Start the run over from step 0 over the rows it stored before it stopped without a
        checkpoint (its job was requeued): every rank drops them, as a resume from step 0 would.
        Collective: every rank calls it, before the first step. Trajectory checkpoints of the old
        attempt go at the first step, as on any fresh start."""
        self.capture_store.start_over()
        self.metrics_log.cut_after(0)

    def metrics(self) -> dict[str, float]:
        """This rank's ``tda/*`` numbers: rows and steps since :func:`attach` (or the last resume),
        rows skipped for NaN/inf gradients over the store's life. :meth:`run_metrics` has the run's."""
        stats = self.store.stats if self.store is not None else {}
        return {"rows_captured": self.rows_captured, "steps_committed": self.steps_committed,
                "steps_dropped_overflow": self.steps_dropped,
                "rows_skipped_nonfinite": stats.get("rows_skipped_nonfinite", 0)}

    def run_metrics(self) -> dict[str, float]:
        """The run's ``tda/*`` numbers (what DeepSpeed's monitor gets after every step, on rank 0):
        rows summed over the ranks and, through checkpoints, over the run's sessions. Collective:
        every rank calls it."""
        numbers = self.metrics()
        skipped = sum_over_ranks([numbers["rows_skipped_nonfinite"]], self.engine.device)[0]
        return {**numbers, "rows_captured": self.capture_store.run_rows, "rows_skipped_nonfinite": int(skipped)}

    # -- lifetime ----------------------------------------------------------------------------------

    @property
    def store(self):
        """This rank's gradient store writer, or None when the session stores nothing."""
        return self.capture_store.store if self.capture_store is not None else None

    @property
    def follower(self):
        """The eigenbasis that follows training (``capture.basis_every``), or None."""
        return self.capture_store.follower if self.capture_store is not None else None

    def flush(self) -> None:
        """Make every committed step durable now."""
        if self.store is not None:
            self.store.flush()

    def remove(self) -> None:
        """Restore the engine's methods and remove every hook; the store stays open (see :meth:`close`)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for name in _WRAPPED:
            self.engine.__dict__.pop(name, None)
        if self._open is not None:
            self._open.close()
            self._open = self._open_rec = None
        if self.follower is not None:
            self.follower.remove()
        if self.capture is not None and self._owns_capture:
            self.capture.remove()

    def close(self, exit_code: int = 0) -> None:
        """Flush and close the store, then :meth:`remove`. Idempotent; also runs at interpreter exit.
        Micro-batches of an unfinished accumulation window are not recorded. ``exit_code``: the run's,
        for a W&B run the session started."""
        try:
            if self.capture_store is not None:
                self.capture_store.close()
        finally:
            try:
                self.run_callbacks.close()
            finally:
                if self.metrics_log is not None:
                    self.metrics_log.close(exit_code)
                self.remove()
            if getattr(self, "_atexit", None) is not None:
                atexit.unregister(self._atexit)
                self._atexit = None
            _OPEN_SESSIONS.discard(self)

    def __enter__(self) -> "DeepSpeedTDA":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- engine facts ------------------------------------------------------------------------------

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """Full weights of every parameter and buffer; ZeRO-3 partitions are gathered (collective: every
        rank gathers). Only rank 0, which writes the trajectory, copies them to host memory; the other
        ranks get an empty dict (a model-sized CPU copy per rank could exhaust a node's memory)."""
        import deepspeed

        module = self.engine.module
        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=int(self.engine.zero_optimization_stage()) == 3):
            if _rank() != 0:
                return {}
            return {name: t.detach().to("cpu", copy=True) for name, t in module.state_dict().items()}

    def _gas(self) -> int:
        return int(self.engine.gradient_accumulation_steps())


_signature = functools.lru_cache(maxsize=8)(inspect.signature)
"""The engine methods' signatures, computed once (``backward`` is bound every micro-batch)."""


def _close_at_exit(ref: weakref.WeakMethod) -> None:
    close = ref()
    if close is not None:
        close()


def _managed_accumulation(engine: Any) -> bool:
    managed = getattr(engine, "managed_gradient_accumulation", None)
    return True if managed is None else bool(managed())


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def default_trajectory_path(store_path: str | Path) -> Path:
    """Where :func:`attach` keeps the trajectory when ``tda.trajectory.path`` is unset: beside the store."""
    return Path(store_path).parent / "trajectory"


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
