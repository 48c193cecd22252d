"""Online data selection inside OLMo's trainer: the selector, the rewrite of OLMo's order file, the
loader that restarts at the first unconsumed position, and the selection state in checkpoints.

Every ``every_n`` steps a round (:class:`~olmo_tda.training.selector.OnlineSelector`) rescores the
upcoming window of OLMo's order at the current weights; ``global_indices.npy`` is rewritten from the
first unconsumed position on and the loader (:class:`RestartableLoader`) restarts there. A restore
replays the logged rounds onto the order OLMo rebuilds (docs/ARCHITECTURE.md, Online data selection).
:class:`OLMoSelection` is held by :class:`~olmo_tda.integrations.olmo.TDATrainer`, which calls it from
its step and its checkpoint methods.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config import ConfigError, SelectionPolicy

__all__ = ["OLMoSelection", "RestartableLoader"]

log = logging.getLogger(__name__)


class OLMoSelection:
    """Online selection of one :class:`~olmo_tda.integrations.olmo.TDATrainer` (``self.t``)."""

    def __init__(self, trainer: Any, folder: Path):
        """The selector, and a loader that can restart at the first unconsumed position once a
        round has rewritten the order (OLMo's iterator reads the order file only when it starts)."""
        from ..training.selector import OnlineSelector, load_target

        self.t = trainer

        data = self.t.cfg.data
        masked = [key for key in ("label_mask_paths", "generate_attention_mask", "generate_doc_lengths",
                                  "instance_filter") if getattr(data, key, None)]
        if masked:      # a round scores the plain next-token loss of every position: not this run's loss
            raise ConfigError(f"tda.selection does not apply data.{', data.'.join(masked)} (label or attention "
                              "masks, document lengths, the instance filter): its scores would be of another "
                              "loss than training's. Turn those off, or selection")
        if data.num_workers > 0 and data.persistent_workers:
            raise ConfigError("tda.selection needs data.persistent_workers: false (persistent workers keep "
                              "the old data order after a round rewrites it)")
        if data.num_workers == 0 and self.t.dataset.num_threads is None:
            # OLMo's in-process prefetch threads cannot be stopped when the iterator restarts
            self.t.dataset.num_threads = 0
        sel = self.t.tda.selection
        target = None
        if sel.target:
            target = load_target(sel.target, self.t.cfg.model.max_sequence_length, self._encode,
                                 num=sel.target_examples, eos_token_id=self.t.cfg.model.eos_token_id,
                                 memmap_dtype=np.dtype(getattr(data, "effective_memmap_dtype", np.uint16)),
                                 vocab_size=self.t.cfg.model.embedding_size or self.t.cfg.model.vocab_size)
        names, shares = self._source_table()
        if sel.policy is SelectionPolicy.SOURCES:
            if self.t.capture is None:
                raise ConfigError("tda.selection.policy sources learns from the rows the training step captures: it "
                                  "needs tda.store.enabled: true")
            if names is None:
                raise ConfigError("tda.selection.policy sources needs the data's sources: data.paths (or "
                                  "data.datasets) with OLMo's memmap dataset")
        ddp = hasattr(self.t.dist_model, "module") and not isinstance(self.t.dist_model, _fsdp_class())
        self.selector = OnlineSelector(
            sel, self.t.dist_model.module if ddp else self.t.dist_model, forward=self._logits, log_folder=folder,
            target_tokens=target, micro_batch=self.t.cfg.device_train_microbatch_size, device=self.t.device,
            pause=(self.t.capture,) if self.t.capture is not None else (), capture=self.t.capture,
            sources=names, source_shares=shares)
        self.t.train_loader = RestartableLoader(self.t.train_loader)

    def _encode(self, text: str) -> list[int]:
        from ..demo.data import BYTE_TOKENIZER_ID

        if self.t.cfg.tokenizer.identifier == BYTE_TOKENIZER_ID:
            from ..demo.corpus import ByteTokenizer
            return ByteTokenizer().encode(text)
        if not hasattr(self, "_tokenizer"):
            from olmo.tokenizer import Tokenizer
            self._tokenizer = Tokenizer.from_train_config(self.t.cfg)
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _logits(self, model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", enabled=self.t.device.type == "cuda", dtype=self.t.cfg.autocast_precision):
            return model(input_ids=input_ids).logits

    def _example_tokens(self, ids: np.ndarray) -> torch.Tensor:
        return torch.stack([torch.as_tensor(self.t.dataset.dataset[int(i)]["input_ids"]).long() for i in ids])

    def _source_table(self) -> tuple[list[str] | None, list[float] | None]:
        """The data's sources (a ``data.datasets`` label, else the memmap file's stem; one per path, in
        order) and their instance counts, or ``(None, None)`` when the dataset does not say."""
        inner = self.t.dataset.dataset
        offsets, metadata = getattr(inner, "offsets", None), getattr(inner, "_metadata", None)
        if not offsets or not metadata or len(metadata) != len(offsets):
            return None, None
        return ([m.get("label") or Path(str(m.get("path", "?"))).stem for m in metadata],
                [float(hi - lo) for lo, hi in offsets])

    def _source_index(self, ids: np.ndarray) -> np.ndarray:
        """``[n]`` each instance id's path index into :meth:`_source_table` (vectorized)."""
        starts = np.array([lo for lo, _ in self.t.dataset.dataset.offsets])
        return np.searchsorted(starts, np.asarray(ids, dtype=np.int64), side="right") - 1

    def _sources(self, ids: np.ndarray) -> list[str] | None:
        names, _ = self._source_table()
        if names is None:
            return None
        return [names[i] for i in self._source_index(ids)]

    def round(self, metrics: dict[str, float]) -> None:
        start = int(self.t.global_train_examples_seen_this_epoch)
        order = np.asarray(self.t.dataset.get_global_indices(), dtype=np.int64)
        new_order, stats = self.selector.run(
            step=self.t.global_step, epoch=int(self.t.epoch or 0), order=order, start=start, fetch=self._example_tokens,
            lr=float(self.t.optim.param_groups[0]["lr"]), batch_size=self.t.cfg.global_train_batch_size,
            tokens_per_batch=self.t.cfg.global_train_batch_size * self.t.cfg.model.max_sequence_length,
            sources=self._sources, source_index=self._source_index)
        if new_order is None:
            return
        self._write_order(new_order)
        self.t.dataset.start_index = start
        self.t.train_loader.restart()
        logged = {f"tda/selection_{key}": float(stats[key])
                  for key in ("seconds", "examples_rescored", "examples_measured", "score_mean", "promoted_mean_score",
                              "demoted_mean_score", "rank_corr_prev", "mean_loss_window") if stats.get(key) is not None}
        for key in ("front_frac", "weight", "score"):     # per source: the front's mix, the weights and scores
            for name, value in (stats.get(f"source_{key}" if key != "front_frac" else "source_frac_front")
                                or {}).items():
                logged[f"tda/selection_{key}/{name}"] = value
        if "target_refreshed" in stats:
            logged["tda/selection_target_refreshed"] = float(stats["target_refreshed"])
        metrics.update(logged)      # tda/metrics.jsonl and OLMo's own logging of this step
        import wandb

        if wandb.run is not None:   # and W&B at the round's step itself: OLMo logs only every log_interval
            hist = stats.get("score_hist") or {"counts": []}
            if hist["counts"]:
                logged["tda/selection_scores"] = wandb.Histogram(np_histogram=(hist["counts"], hist["edges"]))
            wandb.log(logged, step=self.t.global_step)

    def _write_order(self, order: np.ndarray) -> None:
        """Write the epoch's order into OLMo's ``global_indices.npy`` (one writer per filesystem)."""
        from olmo.torch_util import get_fs_local_rank

        path = self.t.dataset.global_indices_file
        if path is None:
            raise RuntimeError("tda.selection needs OLMo's data order file (the loader's work_dir)")
        if get_fs_local_rank() == 0:
            mm = np.memmap(path, dtype=np.uint32, mode="r+")
            if len(mm) != len(order):
                raise RuntimeError(f"{path} holds {len(mm)} positions, the rewritten order {len(order)}")
            mm[:] = order.astype(np.uint32)
            mm.flush()
            del mm
        if _world_size() > 1:
            dist.barrier()

    def _rounds_up_to(self, epoch: int, step: int) -> list[dict]:
        return [r for r in self.selector.log.rounds() if (r["epoch"], r["step"]) <= (epoch, step)]

    def _check_log(self, saved: dict[str, Any] | None) -> None:
        """Refuse a resume whose checkpoint's run had applied more selection rounds by its step than
        this run's log holds (a resume into another save_folder): its order could not be replayed,
        and training would silently go on in the plain order."""
        if not saved:
            return
        held = len(self._rounds_up_to(int(self.t.epoch or 0), self.t.global_step))
        if held < int(saved.get("rounds", 0)):
            raise ConfigError(f"tda.selection: the checkpoint's run had applied {saved['rounds']} selection rounds by "
                              f"step {self.t.global_step} (logged in {saved.get('log')}), but this run's log "
                              f"{self.selector.log.folder} holds {held}: the data order cannot be replayed. Resume "
                              "in that run's save_folder, or copy its tda/selection folder here first")

    def reapply(self) -> None:
        """After a restore: forget rounds past the checkpoint and replay this epoch's rounds onto the
        order OLMo rebuilt from its seed, so the resumed run trains on the rewritten order."""
        epoch, step = int(self.t.epoch or 0), int(self.t.global_step)
        dropped = self.selector.log.truncate_after(epoch, step)
        if _world_size() > 1:
            dist.barrier()          # rank 0 truncated before anyone replays
        base = self.t.dataset._build_global_indices()
        order, applied = self.selector.log.replay(base, epoch, step)
        if applied:
            self._write_order(order)
        log.info("tda: selection resumed at epoch %d step %d: %d rounds replayed, %d later rounds dropped",
                 epoch, step, applied, dropped)

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resume's log must hold to replay this step's order (collective with the sources
        policy: every rank saves alike)."""
        state = {"log": str(self.selector.log.folder.resolve()),
                 "rounds": len(self._rounds_up_to(int(self.t.epoch or 0), self.t.global_step))}
        if self.selector.mixer is not None:     # the sources policy's running sums and target
            self.selector.sync(self._source_index)
            state["mixer"] = self.selector.mixer.state_dict()
        return state

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Refuse a log that cannot replay the checkpoint's order; restore the sources policy."""
        self._check_log(saved)
        mixer_state = (saved or {}).get("mixer")
        if self.selector.mixer is not None and mixer_state is not None:
            try:
                self.selector.mixer.load_state_dict(mixer_state)
            except ValueError as e:
                raise ConfigError(f"tda.selection: {e}") from None
        elif self.selector.mixer is not None and (saved or {}).get("rounds"):
            log.warning("tda: the checkpoint holds no source weights (another policy's run): the sources "
                        "policy starts learning them afresh at step %d", self.t.global_step)

    def close(self) -> None:
        self.selector.close()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _fsdp_class():
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


class RestartableLoader:
    """OLMo's train loader, restartable mid-epoch: after :meth:`restart` the next batch comes from a
    fresh iterator (which rereads the order file and ``dataset.start_index``); the old iterator and
    whatever it had prefetched are dropped. Everything else is the wrapped loader's."""

    def __init__(self, loader):
        self.loader = loader
        self._restart = False

    def restart(self) -> None:
        self._restart = True

    def __iter__(self):
        self._restart = False
        it = iter(self.loader)
        while True:
            if self._restart:
                self._restart = False
                del it
                it = iter(self.loader)
            try:
                batch = next(it)
            except StopIteration:
                return
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)
