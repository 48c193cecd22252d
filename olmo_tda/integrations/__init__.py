"""Framework integrations: the only package that knows a training framework.

Example (OLMo; the same as ``olmo-tda train configs/demo_tiny.yaml``)::

    from olmo_tda.integrations.olmo import load_configs
    from olmo_tda.integrations.olmo_train import train
    train(*load_configs("configs/demo_tiny.yaml", ["--max_duration=20"]))
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_rows_continue", "cut_departed_ranks", "resume_state"]


def cut_departed_ranks(store: Any, step: int) -> None:
    """On resume, after each rank's own ``truncate_after(step)``: drop the rows after ``step`` that
    ranks this run does not have wrote (a run resumed on fewer ranks), then have every rank re-read
    the others' shards. Rank 0 cuts; every rank gets its outcome, so all raise or all go on."""
    import torch.distributed as dist

    from ..store import StoreError

    group = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
    if not store.departed_after(step, world):       # the same answer on every rank: nothing to do
        return
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            store.truncate_departed(step, world)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            outcome = [f"{type(e).__name__}: {e}"]
    if group and world > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise StoreError(f"resuming on {world} ranks: cutting back the rows of the ranks this run does not have "
                         f"failed: {outcome[0]}")
    store.rescan_others()


def resume_state(store: Any) -> dict[str, Any]:
    """What a checkpoint records of the store's position, beside its path, id and step: this rank's
    last durable step (flushed first) and how many truncations its rows have been through."""
    log_id, count = store.timeline()
    return {"reached": store.reached(), "timeline": count, "timeline_id": log_id}


def check_rows_continue(store: Any, saved: dict[str, Any] | None, step: int) -> None:
    """Before a resume from the checkpoint of ``step`` (``saved``: its :func:`resume_state` and
    store id) cuts the store back: refuse a checkpoint of an abandoned run. That is one saved before
    a later resume from an earlier checkpoint cut the store below its step (e.g.
    ``try_load_latest_save`` or DeepSpeed's ``latest`` picking it while the rollback run has no
    newer checkpoint), or one whose rows up to its step are no longer held. Its model is of the
    abandoned run while the store holds the new run's rows before its step, or none. Rank 0 decides
    (the checkpoint's state and its own shards); every rank raises alike."""
    import torch.distributed as dist

    from ..config import ConfigError

    group = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
    outcome: list[Any] = [None]
    if rank == 0 and saved and saved.get("store_id") == store.store_id:
        why = None
        if saved.get("timeline") is not None:
            cut = store.rolled_back_below((saved.get("timeline_id"), int(saved["timeline"])), step)
            if cut is not None:
                why = f"a later resume cut the store back to step {cut}"
        if why is None and saved.get("reached") is not None:
            want, have = min(int(saved["reached"]), step), store.reached(step)
            if have is None or have < want:
                why = (f"it was saved when the store held this run's rows up to step {want}, but it now holds "
                       f"them only up to step {have}")
        if why is not None:
            outcome = [f"tda: the checkpoint of step {step} belongs to an abandoned run: {why} (a resume from an "
                       f"earlier checkpoint), so the store {store.path} holds another run's rows before step "
                       f"{step}, or none. Resume from a checkpoint of the run the store continues "
                       "(OLMo: --load_path=...; DeepSpeed: load_checkpoint(dir, tag=...)), or remove this one"]
    if group and world > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise ConfigError(outcome[0])
