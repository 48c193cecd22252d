"""Framework integrations: the only package that knows a training framework.

Example (OLMo; the same as ``olmo-tda train configs/demo_tiny.yaml``)::

    from olmo_tda.integrations.olmo import load_configs
    from olmo_tda.integrations.olmo_train import train
    train(*load_configs("configs/demo_tiny.yaml", ["--max_duration=20"]))
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, Callable, Iterator, NoReturn

__all__ = ["closed_on_error", "decided_on_rank0", "done_on_every_rank", "end_failed_rank", "one_of_several_ranks",
           "quiet_olmo_warnings", "sum_and_max_over_ranks", "sum_over_ranks", "torchrun_restart_warning"]


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


@contextlib.contextmanager
def closed_on_error(close: Callable[[], Any]) -> Iterator[None]:
    """Starting a TDA session: if the block raises (a refusal), ``close()`` what it opened so far (the
    store's writer lock above all) and re-raise the block's error; a failure of ``close`` itself is
    logged, never raised over the error that says what was wrong."""
    try:
        yield
    except BaseException:
        try:
            close()
        except Exception:  # noqa: BLE001 - the block's error is the one to report
            logging.getLogger(__name__).exception("tda: closing what was opened before the error below failed")
        raise


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


def done_on_every_rank(act: Callable[[], Any], catch: type[BaseException] | tuple = Exception) -> Any:
    """``act()`` on every rank, then one all-gather of the outcomes: no rank returns before every rank
    has finished (a barrier carrying the errors; a broadcast from rank 0 would not wait for the
    others), and if any rank's ``act`` raised one of the ``catch`` types, every rank raises: that rank
    its error, the others a :class:`~olmo_tda.errors.TDAError` naming it. Returns ``act()``'s result."""
    from ..errors import TDAError

    group, _, world = _group()
    result, error = None, None
    try:
        result = act()
    except catch as e:
        error = e
    if group and world > 1:
        import torch.distributed as dist

        outcomes: list[Any] = [None] * world
        dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
        failed = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
        if failed and error is None:
            raise TDAError("; ".join(f"rank {rank} failed: {text}" for rank, text in failed))
    if error is not None:
        raise error
    return result


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
