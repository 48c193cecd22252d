"""Training-time callbacks: what runs after every optimizer step of a run with tda on, the same under
OLMo's trainer and DeepSpeed's engine.

A callback subclasses :class:`Callback` and overrides what it needs (every method is a no-op by
default). After each optimizer step, on every rank, :meth:`Callback.on_step_end` receives a
:class:`StepEnd`: the step, the model, this rank's example ids of the step, the record captured for
them (``None`` when capture is off) and the step's metrics (run-wide: reduced over the ranks; keys a
callback adds go to ``tda/metrics.jsonl`` and W&B with the rest). What :meth:`Callback.state_dict`
returns is saved in the run's checkpoints, per rank, and handed back to
:meth:`Callback.load_state_dict` when the run resumes from one.

A run names its callbacks in the ``tda:`` section of its YAML (``module:Class``, built with no
arguments; the module must be importable)::

    tda:
      enabled: true
      callbacks: ["my_pkg.monitors:RowNorms"]

or passes instances from Python (``olmo_train.train(cfg, tda, step_callbacks=[RowNorms()])``,
``attach(engine, callbacks=[RowNorms()])``). docs/CALLBACKS.md has a complete example.

Example::

    import numpy as np
    from olmo_tda.training.callbacks import Callback, Callbacks, StepEnd

    class Steps(Callback):
        def __init__(self):
            self.seen = 0
        def on_step_end(self, event):
            self.seen += len(event.ids)
        def state_dict(self):
            return {"seen": self.seen}
        def load_state_dict(self, state):
            self.seen = state["seen"]

    run = Callbacks([Steps()])
    run.step_end(StepEnd(step=1, model=None, ids=np.arange(4), record=None, metrics={}))
    print(run.state_dict())     # {'Steps': {'seen': 4}}
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ConfigError

__all__ = ["Callback", "Callbacks", "StepEnd", "load_callback"]

log = logging.getLogger(__name__)


@dataclass
class StepEnd:
    """What a callback sees after an optimizer step (on every rank)."""

    step: int
    """The optimizer step just taken (1-based: the first update is step 1)."""
    model: Any
    """The model as the framework holds it (OLMo's ``dist_model``, DeepSpeed's ``engine.module``)."""
    ids: np.ndarray
    """``[n]`` this rank's global example ids of the step."""
    record: Any
    """The :class:`~olmo_tda.store.GradientRecord` captured for ``ids`` (as stored: projected rows,
    ``loss_scale`` and ``lr``), or ``None`` when ``tda.store.enabled`` is false. Read-only: the store
    writes these very tensors in the background; copy before changing them."""
    metrics: dict[str, float]
    """The step's metrics, run-wide; a callback may add its own keys (``tda/...`` by convention)."""
    rank: int = 0
    world_size: int = 1


class Callback:
    """A training-time callback: override what you need; every method defaults to doing nothing."""

    def on_step_end(self, event: StepEnd) -> None:
        """After each optimizer step, on every rank (collectives are allowed: every rank calls it)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, saved in every checkpoint (plain types and tensors: no pickled objects)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, on resuming from a checkpoint that holds it."""

    def close(self) -> None:
        """At the end of the run (also after an error)."""


class Callbacks:
    """An ordered list of callbacks, dispatched together; their states keyed by class name (a second
    callback of the same class gets ``Name#2``)."""

    def __init__(self, callbacks: Iterable[Callback | str] = ()):
        self.callbacks = [load_callback(c) if isinstance(c, str) else c for c in callbacks]
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise ConfigError(f"tda.callbacks: {cb!r} is not an olmo_tda.training.callbacks.Callback: subclass it")
        self.keys: list[str] = []
        for cb in self.callbacks:
            name, n = type(cb).__name__, 1
            while (name if n == 1 else f"{name}#{n}") in self.keys:
                n += 1
            self.keys.append(name if n == 1 else f"{name}#{n}")

    def __len__(self) -> int:
        return len(self.callbacks)

    def step_end(self, event: StepEnd) -> None:
        for cb in self.callbacks:
            cb.on_step_end(event)

    def state_dict(self) -> dict[str, Any]:
        """Every callback's state, checked to be what a checkpoint can hold and a resume can read back
        without pickle (``torch.load(weights_only=True)``): plain types, lists, dicts, tensors."""
        states = {key: cb.state_dict() for key, cb in zip(self.keys, self.callbacks)}
        for key, state in states.items():
            _check_plain(state, f"{key}.state_dict()")
        return _on_cpu(states)

    def load_state_dict(self, states: Mapping[str, Any] | None) -> None:
        """Give each callback its saved state. A callback the checkpoint has no state for starts afresh
        (said once: it was added since, or the checkpoint predates it)."""
        states = dict(states or {})
        for key, cb in zip(self.keys, self.callbacks):
            if key in states:
                cb.load_state_dict(states.pop(key))
            else:
                log.warning("tda: the checkpoint holds no state for callback %s: it starts afresh", key)
        if states:
            log.warning("tda: the checkpoint holds state for callbacks this run does not have: %s", sorted(states))

    def gathered_state(self) -> list[dict[str, Any]]:
        """Every rank's :meth:`state_dict`, by rank (collective: every rank calls it). Checkpoints keep
        the list: OLMo's unsharded checkpoints and DeepSpeed's client state are written by rank 0 alone."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [self.state_dict()]
        try:
            mine: tuple[Any, str | None] = (self.state_dict(), None)
        except ConfigError as e:    # every rank raises it, after the gather: none is left waiting in it
            mine = (None, str(e))
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        for rank, (_, error) in enumerate(every):
            if error is not None:
                raise ConfigError(f"rank {rank}: {error}")
        return [state for state, _ in every]

    def load_gathered(self, states: list[dict[str, Any]] | None, rank: int) -> None:
        """Restore this rank's entry of :meth:`gathered_state`'s list. Resumed on more ranks than saved
        it, a rank without an entry starts its callbacks afresh."""
        if states is None:
            if self.callbacks:
                log.warning("tda: the checkpoint holds no callback state: callbacks %s start afresh", self.keys)
            return
        if rank >= len(states):
            log.warning("tda: the checkpoint holds callback state of %d ranks: rank %d's callbacks start afresh",
                        len(states), rank)
            return
        self.load_state_dict(states[rank])

    def close(self) -> None:
        """Close every callback once (a second call does nothing)."""
        callbacks, self.callbacks = self.callbacks, []
        errors = []
        for cb in callbacks:
            try:
                cb.close()
            except Exception as e:  # noqa: BLE001 - every callback gets closed; the first error is raised
                errors.append(e)
        if errors:
            raise errors[0]


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor detached and moved to CPU (rank 0 gathers and saves every rank's)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value


def _check_plain(value: Any, where: str) -> None:
    import torch

    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, (str, int)):
                raise ConfigError(f"tda.callbacks: {where} has a key {k!r} of type {type(k).__name__}: use str or "
                                  "int keys")
            _check_plain(item, f"{where}[{k!r}]")
        return
    raise ConfigError(f"tda.callbacks: {where} holds a {type(value).__module__}.{type(value).__name__}; a checkpoint "
                      "keeps plain types (None, bool, int, float, str), lists, dicts and torch tensors only "
                      "(it is read back without pickle): convert it, e.g. a numpy array with torch.from_numpy")


def load_callback(spec: str) -> Callback:
    """The callback ``"package.module:Class"`` names, built with no arguments."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"tda.callbacks: {spec!r}: expected 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"tda.callbacks: {spec!r}: cannot import {module_name} ({e}); is it on PYTHONPATH "
                          "(installed, or in the working directory)?") from None
    cls = module
    for part in attr.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            raise ConfigError(f"tda.callbacks: {spec!r}: {module_name} has no {attr}")
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise ConfigError(f"tda.callbacks: {spec!r} is not a subclass of olmo_tda.training.callbacks.Callback")
    return cls()
