"""``olmo-tda train``: our own OLMo training entry point (OLMo's ``scripts/train.py`` is not in the
wheel and hard-codes CUDA + NCCL). Same steps, device-agnostic: gloo on CPU, nccl on GPU; DDP or
FSDP; a single process works without ``torchrun`` (a one-rank gloo group is made for it).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import pickle
import re
import shutil
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from ..config import ConfigError, TDAConfig
from ..store.format import STORE_JSON, write_text_atomic
from . import decided_on_rank0, torchrun_restart_warning
from .olmo import BASIS_FILE, TDA_YAML, TDATrainer
from .run_folder import Flags, Folder, Refuse, Resume, plan_start

__all__ = ["train", "init_distributed", "release_distributed"]

log = logging.getLogger(__name__)


def init_distributed() -> torch.device:
    """Join (or make) the process group; return this rank's device."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend=backend)
        else:                                   # plain `python`, not torchrun: a group of one
            _ONE_PROCESS_ENV.update({k: os.environ.get(k) for k in _ONE_PROCESS_KEYS})
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            for attempt in range(5):            # the free port we saw can be taken before the store binds it
                os.environ["MASTER_PORT"] = str(_free_port())
                try:
                    dist.init_process_group(backend=backend)
                    break
                except (RuntimeError, OSError) as e:
                    if "EADDRINUSE" not in str(e) and "address already in use" not in str(e) or attempt == 4:
                        raise
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


_ONE_PROCESS_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_ONE_PROCESS_ENV: dict[str, str | None] = {}
"""What the environment held before :func:`init_distributed` made a group of one (restored by
:func:`release_distributed`, so processes started later do not inherit this process's port)."""


def release_distributed() -> None:
    """Destroy the process group; if :func:`init_distributed` made it for a plain process, also
    restore the environment variables it set."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in _ONE_PROCESS_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _ONE_PROCESS_ENV.clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wrap(cfg, model, device):
    from olmo.config import DistributedStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    if cfg.distributed_strategy == DistributedStrategy.ddp:
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.distributed_strategy == DistributedStrategy.fsdp:
        # init_device: meta (OLMo's large-model setting): FSDP materializes each wrapped module
        # empty on the device, then OLMo's own init runs once on the sharded model.
        on_meta = any(p.is_meta for p in model.parameters())
        wrapped = FSDP(model, sharding_strategy=cfg.fsdp.sharding_strategy,
                    mixed_precision=cfg.fsdp_precision if device.type == "cuda" else None,
                    auto_wrap_policy=model.get_fsdp_wrap_policy(cfg.fsdp.wrapping_strategy),
                    use_orig_params=cfg.fsdp.use_orig_params, limit_all_gathers=True,
                    device_id=device.index if device.type == "cuda" else device,   # CPU FSDP needs the device named
                    param_init_fn=(lambda module: module.to_empty(device=device, recurse=False)) if on_meta else None)
        if on_meta:
            model.reset_parameters()
        return wrapped
    raise ValueError(f"distributed_strategy={cfg.distributed_strategy!r}: use ddp or fsdp")


def build_trainer(cfg, tda_cfg: TDAConfig, device: torch.device, trainer_cls: type | None = None,
                  step_callbacks=(), *, continues: bool = False) -> TDATrainer:
    """Model, wrapping, optimizer, scheduler, data loader and the trainer — OLMo's recipe.
    ``trainer_cls=olmo.train.Trainer`` builds OLMo's own trainer from the same pieces (parity tests).
    ``continues``: the start continues the run in ``save_folder``, resumed from its latest checkpoint
    or started over by a later attempt of its launch (see :func:`_choose_start`), so its ``train_data`` folder is
    its own and is reused."""
    from olmo.config import DistributedStrategy
    from olmo.data import build_train_dataloader
    from olmo.eval import build_evaluators
    from olmo.model import OLMo
    from olmo.optim import build_optimizer, build_scheduler
    from olmo.torch_util import seed_all

    world = dist.get_world_size()
    cfg.model.precision = cfg.precision
    cfg.device_train_batch_size = cfg.global_train_batch_size // world
    cfg.device_train_grad_accum = cfg.device_train_batch_size // cfg.device_train_microbatch_size
    if device.type == "cpu" and cfg.model.init_device == "cuda":
        cfg.model.init_device = "cpu"                      # a CUDA-initialized config, run on CPU
    if cfg.model.init_device == "meta" and cfg.distributed_strategy != DistributedStrategy.fsdp:
        raise ValueError("model.init_device=meta needs distributed_strategy=fsdp (DDP needs real weights)")
    seed_all(cfg.seed)
    # OLMo's loader refuses an existing train_data folder without save_overwrite. A continued run's is
    # its own (the order rebuilt there is the same), and the start rules allowed the continuation: only
    # the loader is told so; the run's save_overwrite (for its checkpoints) stays as configured.
    loader_cfg = copy.copy(cfg) if continues else cfg
    if continues:
        loader_cfg.save_overwrite = True
    train_loader = build_train_dataloader(loader_cfg)
    evaluators = build_evaluators(cfg, device) if cfg.evaluators else []
    model = OLMo(cfg.model)
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    dist_model = _wrap(cfg, model, device)
    optim = build_optimizer(cfg, dist_model)
    scheduler = build_scheduler(cfg)
    trainer_cls = trainer_cls or TDATrainer
    extra = {"tda": tda_cfg, "step_callbacks": list(step_callbacks)} if issubclass(trainer_cls, TDATrainer) else {}
    return trainer_cls(cfg=cfg, epoch=cfg.epoch, model=model, dist_model=dist_model, optim=optim,
                       scheduler=scheduler, train_loader=train_loader, device=device, evaluators=evaluators, **extra)


def _save_configs(cfg, tda_cfg: TDAConfig, store_id: str | None = None) -> None:
    folder = Path(cfg.save_folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save(folder / "config.yaml")                         # plain OLMo: loadable by OLMo's tools
    # store_id: which store is this run's, so a later fresh start here removes that store only
    saved: dict = {"tda": tda_cfg.to_dict()}
    if store_id:
        saved["store_id"] = store_id
    (folder / TDA_YAML).write_text(yaml.safe_dump(saved, sort_keys=False))


def _start_wandb(cfg) -> None:
    import wandb

    if cfg.wandb is None or (dist.get_rank() != 0 and cfg.wandb.rank_zero_only):
        return
    os.environ.setdefault("WANDB_MODE", "offline")            # online only when the user says so
    wandb_dir = Path(cfg.save_folder) / "wandb"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    wandb.init(dir=wandb_dir, project=cfg.wandb.project, entity=cfg.wandb.entity, group=cfg.wandb.group,
               name=cfg.wandb.name, tags=cfg.wandb.tags, config=cfg.asdict(exclude=["wandb"]))


def train(cfg, tda_cfg: TDAConfig, step_callbacks=(), trainer_cls: type | None = None) -> None:
    """Run OLMo pretraining with TDA as configured (call under torchrun, or plainly for one process).
    ``step_callbacks``: :class:`~olmo_tda.training.callbacks.Callback` instances (they run after those
    ``tda.callbacks`` names) or functions ``fn(step, metrics)``, called after every optimizer step; ``trainer_cls``: a
    :class:`~olmo_tda.integrations.olmo.TDATrainer` subclass to train with.

    As OLMo's own script, ``try_load_latest_save`` resumes from the save folder's latest checkpoint
    (a requeued job: the same command continues the run; with nothing saved yet it starts fresh, and
    a requeue of the job whose run stopped before its first checkpoint starts that run over). A
    save folder that already holds a run (its ``config.yaml``) otherwise needs ``save_overwrite``. A fresh
    start with ``save_overwrite`` removes the old run's checkpoints and TDA outputs first, so the new
    run's store, trajectory and latest checkpoint are never mixed with the old run's. The configs are
    written once the checkpoint (if any) is restored: a refused resume leaves the folder as it was.

    A failure in a group of several ranks leaves the group as it is (destroying it can wait on a peer
    that failed at the same moment): a caller of its own should end the process as ``olmo-tda train``
    does, with :func:`olmo_tda.integrations.end_failed_rank` once the error is reported."""
    from olmo.config import CheckpointType

    if cfg.compile is not None:
        raise ConfigError("compile: olmo-tda train does not run torch.compile (capture hooks need eager "
                          "modules); remove the compile section")
    if (warning := torchrun_restart_warning()) and os.environ.get("RANK") == "0":
        log.warning("%s", warning)          # before the process group, which a restart may fail to form
    if cfg.dry_run and tda_cfg.enabled:
        # a dry run builds and restores, then stops: restoring a checkpoint would cut the run's store,
        # trajectory and logs back to its step, which nothing is written after. Its tda section was
        # checked when it was loaded
        log.info("dry_run: tda is off (no store, trajectory or log is opened, cut or written)")
        tda_cfg = dataclasses.replace(tda_cfg, enabled=False)
    device = init_distributed()
    ok = False
    try:
        if cfg.run_name is None:
            cfg.run_name = Path(cfg.save_folder).name
        absolute_paths(cfg, tda_cfg)
        _check_sharded_checkpointers(cfg)
        continues = _choose_start(cfg, tda_cfg)
        _check_sharded_checkpointers(cfg)          # the checkpoint try_load_latest_save chose, if any
        _start_wandb(cfg)
        with build_trainer(cfg, tda_cfg, device, trainer_cls, step_callbacks=step_callbacks,
                           continues=continues) as trainer:
            if cfg.load_path is not None:
                log.info("loading checkpoint %s", cfg.load_path)
                _restore_checkpoint(trainer, cfg)
            if dist.get_rank() == 0 and not cfg.dry_run:
                _save_configs(cfg, tda_cfg, trainer.store.store_id if trainer.store is not None else None)
            if cfg.load_path is not None and cfg.eval_on_load and trainer.evaluators:
                log.info("evaluating the loaded checkpoint: %s", trainer.eval())
            elif cfg.load_path is None and not cfg.dry_run and not cfg.no_pre_train_checkpoint:
                kind = CheckpointType.sharded if cfg.save_num_checkpoints_to_keep != 0 else CheckpointType.unsharded
                trainer.save_checkpoint(kind)
            if not cfg.dry_run and _reached_the_end(trainer, cfg):
                log.warning("the run is at step %d, its end (stop_at): nothing to train", trainer.global_step)
            elif not cfg.dry_run:
                trainer.fit()
            end_step = trainer.global_step
        dist.barrier()       # only on success: a rank that failed never reaches it, and the others must
        ok = True            # not wait here for it while its real error goes unreported
        if dist.get_rank() == 0 and not cfg.dry_run:
            _record_the_end(Path(cfg.save_folder), end_step)
    finally:
        import wandb
        if wandb.run is not None:
            wandb.finish(exit_code=0 if ok else 1)
        if ok or not (dist.is_initialized() and dist.get_world_size() > 1):
            release_distributed()   # a failed rank of several leaves its group alone: destroying it waits on
            # peers that may have failed with it or sit in a collective (see integrations.end_failed_rank)


def _record_the_end(folder: Path, step: int) -> None:
    """``finished: {step}`` in the run's tda.yaml (atomically): a later start over the folder must not take
    the run, checkpointed or not, for one stopped before its first checkpoint (which it would start over:
    see :mod:`.run_folder`). A later start of the run (a resume) writes tda.yaml afresh."""
    path = folder / TDA_YAML
    try:
        saved = yaml.safe_load(path.read_text()) or {}
        saved["finished"] = {"step": int(step)}
        write_text_atomic(path, yaml.safe_dump(saved, sort_keys=False))
    except (OSError, yaml.YAMLError, TypeError) as e:     # the run itself is done and saved: say so, go on
        log.warning("could not record the run's end in %s (%s): a later start here would take the run for one "
                    "stopped before its first checkpoint", path, e)


def _reached_the_end(trainer, cfg) -> bool:
    """Whether a resumed run is already at the step ``fit`` would stop at (OLMo's rule: ``stop_at``,
    else ``max_steps`` + 10; ``stop_after`` counts from the resume). OLMo's ``fit`` checks only after
    a step, so it would train (and store) one step past the end: a requeue of a finished job would."""
    if cfg.stop_after is not None:
        return False
    stop_at = cfg.stop_at if cfg.stop_at is not None else trainer.max_steps + 10
    return trainer.global_step >= stop_at


def _restore_checkpoint(trainer, cfg) -> None:
    """``trainer.restore_checkpoint(cfg.load_path)`` as OLMo's script calls it, with torch's
    ``weights_only`` loads kept on: only the classes OLMo's sharded FSDP checkpoints pickle are added
    to torch's allowlist, and only while the checkpoint is read."""
    with torch.serialization.safe_globals(_sharded_checkpoint_globals()):
        trainer.restore_checkpoint(cfg.load_path, load_optimizer_state=not cfg.reset_optimizer_state,
                                   load_trainer_state=not cfg.reset_trainer_state,
                                   sharded_checkpointer=cfg.load_path_sharded_checkpointer)


def _check_sharded_checkpointers(cfg) -> None:
    """Refuse, before anything is trained or removed, an OLMo sharded checkpointer that cannot work
    with the installed OLMo and torch: the one that reads a sharded ``load_path``
    (``load_path_sharded_checkpointer``, else ``sharded_checkpointer``) and, for an FSDP run that saves
    sharded checkpoints, ``sharded_checkpointer`` (checkpoints that could not be resumed are no use)."""
    from olmo.config import DistributedStrategy

    broken = _broken_checkpointers()
    working = "torch_legacy (OLMo's default)" + (" or olmo_core" if _has_olmo_core() else "")
    if cfg.load_path is not None and not str(cfg.load_path).rstrip("/").endswith("-unsharded"):
        key = "load_path_sharded_checkpointer" if cfg.load_path_sharded_checkpointer else "sharded_checkpointer"
        kind = str(getattr(cfg, key))
        if kind in broken:
            raise ConfigError(f"{key}={kind} reads the sharded checkpoint {cfg.load_path}, but {broken[kind]}: "
                              "resume from an unsharded checkpoint of that run (stepN-unsharded) instead, and "
                              f"save sharded checkpoints with sharded_checkpointer={working}")
    saves = cfg.distributed_strategy == DistributedStrategy.fsdp and (
        cfg.save_interval is not None or cfg.save_interval_ephemeral is not None
        or cfg.save_num_checkpoints_to_keep != 0)
    if saves and str(cfg.sharded_checkpointer) in broken:
        raise ConfigError(f"sharded_checkpointer={cfg.sharded_checkpointer} would save this FSDP run's sharded "
                          f"checkpoints, but {broken[str(cfg.sharded_checkpointer)]}: use sharded_checkpointer="
                          f"{working}")


def _broken_checkpointers() -> dict[str, str]:
    """OLMo's sharded checkpointers that fail with the installed OLMo and torch, and why."""
    import inspect

    from olmo import checkpoint

    broken = {}
    if inspect.isabstract(checkpoint.RemoteFileSystemReader):
        broken["torch_new"] = (f"OLMo's reader of those checkpoints does not implement torch {torch.__version__}'s "
                               "torch.distributed.checkpoint StorageReader, so they cannot be loaded")
    if torch.__version__ >= "2.3":             # TorchVersion compares as a version
        broken["local"] = (f"OLMo's local checkpointer supports the FSDP of torch < 2.3 only (here "
                           f"{torch.__version__}): it raises NotImplementedError on save and on load")
    return broken


def _has_olmo_core() -> bool:
    import importlib.util

    return importlib.util.find_spec("olmo_core") is not None


def _sharded_checkpoint_globals() -> list:
    """What a sharded FSDP state dict pickles besides plain tensors (OLMo's ``torch_legacy``
    checkpointer saves one per rank with ``torch.save``): ``ShardedTensor``, its shards and their
    metadata. Python pickles the nested ``ShardedTensor.ProcessGroupState`` as
    ``getattr(ShardedTensor, "ProcessGroupState")``: ``builtins.getattr`` is mapped to a lookup of
    that one attribute, never to ``getattr`` itself."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (MEM_FORMAT_ENCODING, ShardedTensorMetadata,
                                                                  TensorProperties)
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed._shard.sharding_spec.chunk_sharding_spec import ChunkShardingSpec
    from torch.distributed.remote_device import _remote_device

    nested = {(ShardedTensor, "ProcessGroupState"): ShardedTensor.ProcessGroupState}

    def nested_class(owner, name):
        if (owner, name) not in nested:
            raise pickle.UnpicklingError(f"checkpoint asks for getattr({owner!r}, {name!r}): only "
                                         "ShardedTensor.ProcessGroupState is allowed")
        return nested[owner, name]

    return [ShardedTensor, ShardedTensor.ProcessGroupState, Shard, ShardMetadata, ShardedTensorMetadata,
            TensorProperties, MEM_FORMAT_ENCODING, ChunkShardingSpec, _remote_device,
            (nested_class, "builtins.getattr")]


def absolute_paths(cfg, tda_cfg: TDAConfig) -> None:
    """Make the run's local relative paths absolute (from the current directory, where they mean what
    they say now), so the configs saved with the run work from any directory: OLMo's data paths
    (``paths``, ``datasets``, ``label_mask_paths``) and the TDA files a user named. Unset TDA paths
    stay unset: they follow the run folder."""
    data = cfg.data
    data.paths = [_absolute(p) for p in data.paths] if data.paths else data.paths
    if data.datasets:
        data.datasets = {name: [_absolute(p) for p in paths] for name, paths in data.datasets.items()}
    if data.label_mask_paths:
        data.label_mask_paths = [_absolute(p) for p in data.label_mask_paths]
    for section, key in (("store", "path"), ("trajectory", "path"), ("capture", "basis"), ("selection", "target")):
        part = getattr(tda_cfg, section)
        value = getattr(part, key)
        if value:
            setattr(part, key, _absolute(value))


def _absolute(path) -> str:
    text = str(path)
    return text if "://" in text or os.path.isabs(text) else os.path.abspath(text)


def _choose_start(cfg, tda_cfg: TDAConfig) -> bool:
    """Carry out the run-folder plan (:func:`~olmo_tda.integrations.run_folder.plan_start`) for OLMo's
    flags: ``try_load_latest_save`` sets ``load_path`` to the latest checkpoint of the save folder (else
    of ``remote_save_folder``) and clears the reset flags, as OLMo's script does; a refusal raises
    :class:`ConfigError` naming the folder; a start that clears the old run removes its checkpoints
    (``stepN[-unsharded]``, ``latest[-unsharded]``) and the TDA outputs its ``tda.yaml`` names, each only
    if it holds what it should and nothing else, refusing rather than removing anything that contains
    the save folder or the checkpoint to load; a fresh start refuses a TDA path of the new config that
    already holds another run's store or trajectory, in any folder. Rank 0 decides and removes; every
    rank gets its outcome. Returns whether the start continues the folder's run (its ``train_data``
    folder is reused, see :func:`build_trainer`)."""
    from olmo.util import find_latest_checkpoint

    folder = Path(cfg.save_folder)
    if cfg.try_load_latest_save:
        latest = find_latest_checkpoint(folder) if folder.is_dir() else None
        if latest is None and cfg.remote_save_folder:
            latest = find_latest_checkpoint(cfg.remote_save_folder)
        if latest is not None:     # a resume (after a preemption, say): as OLMo's script, reset nothing
            log.info("try_load_latest_save: resuming from %s", latest)
            cfg.load_path = str(latest)
            cfg.reset_trainer_state = cfg.reset_optimizer_state = False
    # rank 0 checks and removes; the others wait for its outcome, so all raise or all go on together
    return decided_on_rank0(lambda: _check_and_clear(cfg, tda_cfg, folder), catch=ConfigError)


def _check_and_clear(cfg, tda_cfg: TDAConfig, folder: Path) -> bool:
    load = _local(cfg.load_path)
    if load is not None and not load.exists():
        raise ConfigError(f"load_path: no such checkpoint {cfg.load_path}")
    if cfg.dry_run:
        return False
    facts = _folder_facts(folder)
    plan = plan_start(facts, _flags(cfg, folder, load))
    if isinstance(plan, Refuse):
        raise ConfigError(f"{folder}: {plan.reason}")
    if isinstance(plan, Resume):      # a resume keeps the folder: the store is cut back when it is restored
        if plan.step is None and facts.run:
            log.warning("%s: %s: %s", folder, plan.why, cfg.load_path)
        return plan.continues
    if plan.clear:
        log.warning("%s: %s", folder, plan.why)
        # without save_overwrite (a run stopped before its first checkpoint), only what lies in the
        # save folder is removed: a store elsewhere may be another run's (a continued one's)
        _clear_old_run(folder, load, only_inside=not cfg.save_overwrite)
    for path, kind in ((Path(tda_cfg.store.path or folder / "tda" / "store"), "store"),
                       (Path(tda_cfg.trajectory.path or folder / "tda" / "trajectory"), "trajectory")):
        if _holds(path, kind, rows=True):
            raise ConfigError(f"tda.{kind}.path {path} already holds a {kind} (of another run): a new run would mix "
                              "into it; point it elsewhere or remove it")
    return plan.clear


def _folder_facts(folder: Path) -> Folder:
    """What the plan needs of ``folder``: a run's ``config.yaml``, its checkpoints' steps, and the end its
    ``tda.yaml`` recorded."""
    if not (folder / "config.yaml").is_file():
        return Folder(checkpoints=_checkpoint_steps(folder))
    try:
        saved = yaml.safe_load((folder / TDA_YAML).read_text()) or {}
    except (OSError, yaml.YAMLError):
        saved = {}
    return Folder(run=True, checkpoints=_checkpoint_steps(folder),
                  finished=isinstance(saved, dict) and saved.get("finished") is not None)


def _flags(cfg, folder: Path, load: Path | None) -> Flags:
    inside = load is not None and _inside(load, folder) and _checkpoint_step(load) is not None
    return Flags(load_step=_checkpoint_step(load) if inside else None,
                 load_outside=cfg.load_path is not None and not inside, latest=bool(cfg.try_load_latest_save),
                 overwrite=bool(cfg.save_overwrite), reset=bool(cfg.reset_trainer_state))


def _checkpoint_steps(folder: Path) -> tuple[int, ...]:
    if not folder.is_dir():
        return ()
    return tuple(sorted({_checkpoint_step(p) for p in folder.iterdir() if _CHECKPOINT.match(p.name)}))


def _clear_old_run(folder: Path, load: Path | None, *, only_inside: bool = False) -> None:
    """Remove the old run's checkpoints and TDA outputs: never anything holding the folder or ``load``,
    nor a store a live process is writing; ``only_inside``: refuse, rather than remove, an output
    outside the folder."""
    checkpoints = [p for p in folder.iterdir() if _CHECKPOINT.match(p.name) or p.name in _LATEST]
    stale = checkpoints + _old_tda_outputs(folder)
    for path in stale:
        if path in checkpoints and path.is_symlink():
            continue                  # `latest`: only the link goes, whatever it points at
        for keep, what in ((folder, "the save folder"), (load, "load_path")):
            if keep is not None and _inside(keep, path):
                raise ConfigError(f"{path} (of the old run in {folder}) contains {what} {keep}: refusing to "
                                  "remove it; point the old run's TDA paths elsewhere or clear it yourself")
        if only_inside and not _inside(path, folder):
            raise ConfigError(f"{folder}: its run stopped before its first checkpoint, and starting it over would "
                              f"remove {path}, outside the folder (another run's store?): pass --save_overwrite "
                              "to remove it, or point tda paths elsewhere")
        if _store_in_use(path):
            raise ConfigError(f"{path} (of the old run in {folder}) is being written by a running process (its "
                              "writer lock is held): stop that run first, or use another save_folder")
    if stale:
        log.warning("a fresh start over the old run: removing its %s", ", ".join(map(str, stale)))
    for path in stale:
        _remove(path, through_link=path not in checkpoints)


def _checkpoint_step(path: Path) -> int | None:
    """The step of an OLMo checkpoint folder (``stepN``, ``stepN-unsharded``, or a link to one)."""
    match = _CHECKPOINT.match(path.resolve().name)
    return int(match.group(1)) if match else None


_CHECKPOINT = re.compile(r"^step(\d+)(-unsharded)?$")
_LATEST = ("latest", "latest-unsharded")


def _local(path) -> Path | None:
    """A local ``load_path`` (``file://`` stripped), or None for none or a remote one."""
    if path is None:
        return None
    text = str(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    return None if "://" in text else Path(text)


def _inside(path: Path, parent: Path) -> bool:
    """Whether ``path`` is ``parent`` or lies under it (symlinks resolved)."""
    path, parent = path.resolve(), parent.resolve()
    return path == parent or parent in path.parents


def _holds(path: Path, kind: str, *, rows: bool = False) -> bool:
    """Whether ``path`` holds a store (its ``store.json``; with ``rows``, a store with rows: an empty
    one, left by a run that failed before its first step, may be reused) or trajectory checkpoints."""
    if kind == "store":
        if not (path / STORE_JSON).is_file():
            return False
        if not rows:
            return True
        from ..store import GradientStore
        try:
            return GradientStore.open(path).num_rows > 0
        except Exception:  # noqa: BLE001 - unreadable: it is not ours to reuse either
            return True
    return path.is_dir() and any(p.is_dir() and _TRAJECTORY_ENTRY.match(p.name) for p in path.iterdir())


_TRAJECTORY_ENTRY = re.compile(r"^step\d+(\..*\.tmp|\.tmp)?$")     # a checkpoint, or the debris of one
_STORE_ENTRY = re.compile(r"^(store\.json.*|manifest-r\d+\.json.*|shards|index|locks|quarantine|cache|\..*)$")


def _old_tda_outputs(folder: Path) -> list[Path]:
    """What the run in ``folder`` wrote under TDA, by its ``tda.yaml`` (the defaults under
    ``folder/tda`` if it has none): the store and trajectory where they hold one and nothing else
    (never a relative path: older versions saved them as given), its selection log, metrics and
    estimated eigenbasis."""
    tda = folder / "tda"
    try:
        saved = yaml.safe_load((folder / TDA_YAML).read_text()) or {}
        old, old_store_id = TDAConfig.from_dict(saved.get("tda")), saved.get("store_id")
    except (OSError, yaml.YAMLError, ConfigError, AttributeError):
        old, old_store_id = TDAConfig(), None
    out = []
    for named, default, kind in ((old.store.path, tda / "store", "store"),
                                 (old.trajectory.path, tda / "trajectory", "trajectory")):
        path = Path(named or default)
        if named and not path.is_absolute():      # saved by a version that kept it relative: to what, unknown
            log.warning("save_overwrite: leaving %s (the old run's tda.%s.path, relative to a directory this "
                        "process cannot know) as it is", named, kind)
            continue
        entry = _STORE_ENTRY if kind == "store" else _TRAJECTORY_ENTRY
        if kind == "store" and old_store_id and _holds(path, kind) and _store_id(path) != old_store_id:
            log.warning("save_overwrite: leaving %s (the old run's tda.store.path) as it is: it holds another "
                        "store now (id %s, the old run wrote %s)", path, _store_id(path), old_store_id)
            continue
        if _holds(path, kind) and all(entry.match(p.name) for p in path.iterdir()):
            if path not in out:
                out.append(path)
        elif os.path.lexists(path) and path not in out:
            log.warning("save_overwrite: leaving %s (the old run's tda.%s.path) as it is: it holds more than a %s",
                        path, kind, kind)
    out += [p for p in (tda / "selection", tda / "metrics.jsonl") if os.path.lexists(p)]
    if not old.capture.basis and (tda / BASIS_FILE).is_file():
        out.append(tda / BASIS_FILE)
    return out


def _store_in_use(path: Path) -> bool:
    """Whether a live process holds one of the store's writer locks (``locks/r*.lock``; where the
    filesystem has no flock, nothing can tell, and the answer is no)."""
    import fcntl

    from ..store.format import LOCK_DIR

    for lock_file in (path / LOCK_DIR).glob("r*.lock") if (path / LOCK_DIR).is_dir() else ():
        try:
            fd = os.open(lock_file, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            return True
        except OSError:
            pass
        finally:
            os.close(fd)
    return False


def _store_id(path: Path) -> str | None:
    """The id in a store's ``store.json`` (None: unreadable, or made before stores had ids)."""
    from ..store.errors import StoreError
    from ..store.meta import load_store_json

    try:
        return load_store_json(path).get("store_id")
    except StoreError:
        return None


def _remove(path: Path, *, through_link: bool = False) -> None:
    """Remove a file, folder or link; ``through_link``: a linked folder (a store on another disk) is
    emptied and its link kept. A failure is an error: a half-removed store must not be appended to."""
    try:
        if through_link and path.is_symlink() and path.is_dir():
            for child in path.iterdir():
                _remove(child)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink(missing_ok=True)
    except OSError as e:
        raise ConfigError(f"save_overwrite: cannot remove the old run's {path} ({e.strerror or e}); remove it "
                          "yourself") from None
