"""Online data selection in a DeepSpeed loop: :class:`DeepSpeedSelection`, a callback of a loop that
reads its example ids from a :class:`~olmo_tda.training.selection.DataOrder`, and the check that a
resume's round log can replay its checkpoint's order."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from ..config import ConfigError
from . import decided_on_rank0

__all__ = ["DeepSpeedSelection", "check_selection_log", "rounds_up_to"]

log = logging.getLogger(__name__)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class DeepSpeedSelection:
    """Online data selection as a callback of a DeepSpeed loop that reads its example ids from a
    :class:`~olmo_tda.training.selection.DataOrder`: call :meth:`on_step_end` after each optimizer
    step, put :meth:`state_dict` in ``engine.save_checkpoint``'s ``client_state``, and call :meth:`resume`
    with it after ``engine.load_checkpoint``. Rounds run through ``engine.module``
    (gradients w.r.t. layer outputs only, so ZeRO's gradient hooks and buffers are never touched),
    rank 0 decides and every rank's ``order`` gets the same rewrite; rounds persist under
    ``log_folder`` and are replayed by ``order`` on resume.

    Example (see ``examples/deepspeed_pretrain.py``)::

        order = DataOrder(len(data), lambda epoch: permutation(seed, epoch))
        selection = DeepSpeedSelection(engine, tda.selection, order=order, fetch=tokens_of,
                                       forward=lambda m, ids: m.olmo(ids).logits, seq_len=T,
                                       log_folder=run_dir / "tda" / "selection")
        _, client_state = engine.load_checkpoint(ckpt)            # a resume
        selection.resume(engine.global_steps, (client_state or {}).get("tda_selection"))
        for step in ...:
            ids = order.ids(position, micro_bs); ...; engine.step()
            selection.on_step_end(step)
            engine.save_checkpoint(ckpt, client_state={"tda_selection": selection.state_dict(step)})
    """

    def __init__(self, engine: Any, config: Any, *, order: Any, fetch: Callable, forward: Callable, seq_len: int,
                 log_folder: str | Path, target_tokens: torch.Tensor | None = None, pause: tuple = (),
                 sources: Callable[[np.ndarray], list[str]] | None = None):
        from ..config import SelectionPolicy
        from ..training.selector import OnlineSelector

        if getattr(config, "policy", None) is SelectionPolicy.SOURCES:
            raise ConfigError("tda.selection.policy sources runs in OLMo runs (olmo-tda train) only: the DeepSpeed "
                              "callback does not hand it the step's captured rows. Use greats, alignment, loss, "
                              "gradnorm or random here")
        self.engine = engine
        self.order = order
        self.fetch = fetch
        self.seq_len = seq_len
        self.sources = sources          # ids -> data-source names: per-source stats, and what `measure` fills in by
        self.selector = OnlineSelector(config, engine.module, forward=forward, log_folder=log_folder,
                                       target_tokens=target_tokens, micro_batch=engine.train_micro_batch_size_per_gpu(),
                                       device=engine.device, pause=pause)
        order.log = self.selector.log
        order.reset()
        self.per_step = engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps() * _world_size()

    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint at ``step`` carries so that a resume can tell whether its log still holds
        the rounds that made the order: their count and the log's folder (JSON-able)."""
        epoch = (step * self.per_step) // self.order.num
        return {"log": str(self.selector.log.folder.resolve()),
                "rounds": rounds_up_to(self.selector.log.rounds(), epoch, step)}

    def resume(self, step: int, saved: Mapping[str, Any] | None = None) -> int:
        """Forget rounds after ``step`` (they re-run); the order replays the rest. Returns how many
        were dropped. ``saved``, the checkpoint's :meth:`state_dict`, is checked first
        (:func:`check_selection_log`)."""
        epoch = (step * self.per_step) // self.order.num
        check_selection_log(self.selector.log.folder, epoch, step, saved)
        dropped = self.selector.log.truncate_after(epoch, step)
        if _world_size() > 1:
            dist.barrier()
        self.order.reset()
        return dropped

    def on_step_end(self, step: int) -> dict | None:
        """Run a round if one is due after optimizer step ``step``; returns its stats."""
        if not self.selector.due(step):
            return None
        epoch, start = divmod(step * self.per_step, self.order.num)
        new_order, stats = self.selector.run(step=step, epoch=epoch, order=self.order.epoch_order(epoch), start=start,
                                             fetch=self.fetch, lr=float(self.engine.get_lr()[0]),
                                             tokens_per_batch=self.per_step * self.seq_len, batch_size=self.per_step,
                                             sources=self.sources)
        if new_order is not None:
            self.order.set_epoch_order(epoch, new_order)
        return stats

    def close(self) -> None:
        self.selector.close()


def rounds_up_to(rounds: Iterable[Mapping[str, Any]], epoch: int, step: int) -> int:
    """How many of a log's rounds a resume at (``epoch``, ``step``) keeps: the rule of
    :meth:`~olmo_tda.training.selection.SelectionLog.truncate_after`."""
    return sum(1 for r in rounds if (r["epoch"], r["step"]) <= (epoch, step))


def check_selection_log(folder: str | Path, epoch: int, step: int, saved: Mapping[str, Any] | None) -> None:
    """Refuse (on every rank alike; rank 0 reads the log) a resume whose round log in ``folder`` keeps
    fewer rounds at (``epoch``, ``step``) than ``saved``, the checkpoint's
    :meth:`DeepSpeedSelection.state_dict`, says its run had applied: a resume beside another run's log,
    or a log lost or cut. The order could not be replayed, and training would go on in the plain order
    without a word. A checkpoint without that state (``None``) is not checked."""
    from ..training.selection import SelectionError, SelectionLog

    if not saved:
        return

    def check() -> None:
        held = rounds_up_to(SelectionLog(folder, writer=False).rounds(), epoch, step)
        want = int(saved.get("rounds", 0))
        if held < want:
            raise ConfigError(f"tda.selection: the checkpoint's run had applied {want} selection rounds by step {step} "
                              f"(logged in {saved.get('log')}), but this run's log {folder} holds {held}: the data "
                              "order cannot be replayed. Resume in that run's run_dir, or copy its tda/selection "
                              "folder here first")

    decided_on_rank0(check, catch=(ConfigError, SelectionError))
