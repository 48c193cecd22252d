"""Framework integrations: the only package that knows a training framework.

Example (OLMo; the same as ``olmo-tda train configs/demo_tiny.yaml``)::

    from olmo_tda.integrations.olmo import load_configs
    from olmo_tda.integrations.olmo_train import train
    train(*load_configs("configs/demo_tiny.yaml", ["--max_duration=20"]))
"""

from __future__ import annotations

from typing import Any

__all__ = ["cut_departed_ranks"]


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
