"""Framework integrations: the only package that knows a training framework.

Example (OLMo; the same as ``olmo-tda train configs/demo_tiny.yaml``)::

    from olmo_tda.integrations.olmo import load_configs
    from olmo_tda.integrations.olmo_train import train
    train(*load_configs("configs/demo_tiny.yaml", ["--max_duration=20"]))
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, NoReturn

__all__ = ["check_rows_continue", "cut_departed_ranks", "decided_on_rank0", "end_failed_rank",
           "one_of_several_ranks", "quiet_olmo_warnings", "resume_state", "sum_and_max_over_ranks",
           "sum_over_ranks", "torchrun_restart_warning"]


def one_of_several_ranks() -> bool:
    """True in a process that holds a process group of several ranks."""
    if "torch.distributed" not in sys.modules:     # never imported: no group (and no torch import for it)
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def end_failed_rank(status: int) -> NoReturn:
    """End this failed rank of a multi-rank run now, with ``status``: flush what it printed and logged,
    then ``os._exit``, skipping the interpreter's teardown. Call it once the error is reported and what
    must be closed is closed (OLMo's trainer closes the store's last window, the metrics file and W&B
    as the ``with build_trainer(...)`` block of ``olmo_train.train`` exits).

    The teardown is where a failed rank could hang: finalizing the process group that DDP still holds
    closes connections to peers, and a peer that failed at the same moment is doing the same towards
    this rank (a 2-rank refusal in CI sat there 300 s, one rank's error printed, neither rank gone, so
    torchrun never learned of a failure). A rank that is gone lets the launcher end the others."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed or broken pipe: nothing more to say on it
            pass
    logging.shutdown()
    os._exit(status)


def quiet_olmo_warnings() -> None:
    """Silence the warnings every OLMo 0.6.0 run prints that no user can act on, so a run's own output is
    not buried under them: omegaconf >= 2.4 deprecating ``register_new_resolver`` (three, when
    ``olmo.config`` is imported) and torch noting that OLMo's ``autocast("cuda")`` is off on a machine
    without CUDA. Our entry points call this before they import OLMo."""
    import warnings

    warnings.filterwarnings("ignore", message=r"register_new_resolver\(\) is deprecated", category=UserWarning)
    warnings.filterwarnings("ignore", message="CUDA is not available or torch_xla is imported. Disabling autocast",
                            category=UserWarning)


def _group() -> tuple[bool, int, int]:
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized()
    return (group, dist.get_rank(), dist.get_world_size()) if group else (False, 0, 1)


def decided_on_rank0(decide: Callable[[], Any], catch: type[BaseException] | tuple = Exception) -> Any:
    """``decide()`` run on rank 0 alone (it reads or changes what every rank shares), its result or
    the error of the ``catch`` types it raised handed to every rank: all return it, or all raise it
    alike, so no rank is left waiting for one that failed."""
    import torch.distributed as dist

    group, rank, world = _group()
    outcome: list[Any] = [None, None]
    if rank == 0:
        try:
            outcome[0] = decide()
        except catch as e:      # every rank raises it below; one that cannot travel, by its text
            outcome[1] = e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")
    if group and world > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def _picklable(value: Any) -> bool:
    import pickle

    try:
        pickle.dumps(value)     # in memory, to broadcast it: nothing is read from disk
    except Exception:  # noqa: BLE001 - any failure means it cannot be sent as it is
        return False
    return True


def sum_over_ranks(values: list[float], device: Any) -> list[float]:
    """``values`` summed over the ranks (one all-reduce; collective: every rank calls it alike)."""
    import torch
    import torch.distributed as dist

    if not values or _group()[2] == 1:
        return list(values)
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    return summed.tolist()


def sum_and_max_over_ranks(sums: list[float], maxima: list[float], device: Any) -> tuple[list[float], list[float]]:
    """``sums`` summed and ``maxima`` maximized over the ranks, in one collective (an all-gather of
    both: one call per training step, not an all-reduce for each); every rank calls it alike."""
    import torch
    import torch.distributed as dist

    world = _group()[2]
    if world == 1 or not (sums or maxima):
        return list(sums), list(maxima)
    mine = torch.tensor([*sums, *maxima], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    stacked = torch.stack(every)
    return stacked[:, :len(sums)].sum(dim=0).tolist(), stacked[:, len(sums):].amax(dim=0).tolist()


def torchrun_restart_warning() -> str | None:
    """What to tell a run whose torchrun may restart its workers (``--max_restarts`` > 0) while it
    shares its rendezvous store with them (``TORCHELASTIC_USE_AGENT_STORE``, torch's default since
    2.4), or None. torch then keeps the workers' keys in the agent's store from one attempt to the
    next without a per-attempt prefix (its comment assumes a new store per restart), so a restarted
    rank can read a dead rank's address and fail to connect (``Gloo connectFullMesh ... Connection
    refused``). Measured with torch 2.13 on CPU (gloo, 2 ranks, one killed in attempt 0): a bare
    init-and-barrier script's restart failed 5 times in 5, ``olmo-tda train``'s 5 in 11 (timing); with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` set for torchrun, none of 7 (pytorch/pytorch#135712 and
    #167288 report the same for NCCL)."""
    env = os.environ
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "").strip()
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not (restarts.isascii() and restarts.isdigit()) \
            or int(restarts) == 0:
        return None
    said = (f"torchrun may restart the workers (--max_restarts={restarts}) but shares its rendezvous store with "
            "them: a restart's process group can then read the failed attempt's addresses and fail to connect "
            "(\"Gloo connectFullMesh failed\", NCCL \"Connection refused\"). ")
    if env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        # the static rendezvous (--master_addr/--master_port without --rdzv_backend) always shares it
        return said + ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set but this rendezvous shares it anyway (the "
                       "static one, --master_addr/--master_port): use --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT "
                       "(or --standalone on one node) so that restarts work")
    return said + "Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment so that restarts work"


def cut_departed_ranks(store: Any, step: int) -> None:
    """On resume, after each rank's own ``truncate_after(step)``: drop the rows after ``step`` that
    ranks this run does not have wrote (a run resumed on fewer ranks), then have every rank re-read
    the others' shards. Rank 0 cuts; every rank gets its outcome, so all raise or all go on."""
    from ..store import StoreError

    world = _group()[2]
    if not store.departed_after(step, world):       # the same answer on every rank: nothing to do
        return
    try:
        decided_on_rank0(lambda: store.truncate_departed(step, world))
    except Exception as e:  # noqa: BLE001 - named in the error every rank raises
        raise StoreError(f"resuming on {world} ranks: cutting back the rows of the ranks this run does not have "
                         f"failed: {type(e).__name__}: {e}") from e
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
    from ..config import ConfigError

    def decide() -> None:
        if not saved or saved.get("store_id") != store.store_id:
            return
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
            raise ConfigError(f"tda: the checkpoint of step {step} belongs to an abandoned run: {why} (a resume from "
                              f"an earlier checkpoint), so the store {store.path} holds another run's rows before "
                              f"step {step}, or none. Resume from a checkpoint of the run the store continues "
                              "(OLMo: --load_path=...; DeepSpeed: load_checkpoint(dir, tag=...)), or remove this one")

    decided_on_rank0(decide, catch=ConfigError)
