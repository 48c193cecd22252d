"""``olmo-tda train``: our own OLMo training entry point (OLMo's ``scripts/train.py`` is not in the
wheel and hard-codes CUDA + NCCL). Same steps, device-agnostic: gloo on CPU, nccl on GPU; DDP or
FSDP; a single process works without ``torchrun`` (a one-rank gloo group is made for it).
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from ..config import TDAConfig
from .olmo import TDA_YAML, TDATrainer

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
                  step_callbacks=()) -> TDATrainer:
    """Model, wrapping, optimizer, scheduler, data loader and the trainer — OLMo's recipe.
    ``trainer_cls=olmo.train.Trainer`` builds OLMo's own trainer from the same pieces (parity tests)."""
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
    train_loader = build_train_dataloader(cfg)
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


def _save_configs(cfg, tda_cfg: TDAConfig) -> None:
    folder = Path(cfg.save_folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save(folder / "config.yaml")                         # plain OLMo: loadable by OLMo's tools
    (folder / TDA_YAML).write_text(yaml.safe_dump({"tda": tda_cfg.to_dict()}, sort_keys=False))


def _start_wandb(cfg) -> None:
    import wandb

    if cfg.wandb is None or (dist.get_rank() != 0 and cfg.wandb.rank_zero_only):
        return
    os.environ.setdefault("WANDB_MODE", "offline")            # online only when the user says so
    wandb_dir = Path(cfg.save_folder) / "wandb"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    wandb.init(dir=wandb_dir, project=cfg.wandb.project, entity=cfg.wandb.entity, group=cfg.wandb.group,
               name=cfg.wandb.name, tags=cfg.wandb.tags, config=cfg.asdict(exclude=["wandb"]))


def train(cfg, tda_cfg: TDAConfig, step_callbacks=()) -> None:
    """Run OLMo pretraining with TDA as configured (call under torchrun, or plainly for one process).
    ``step_callbacks``: ``fn(step, metrics)`` called after every optimizer step."""
    from olmo.config import CheckpointType

    device = init_distributed()
    if cfg.run_name is None:
        cfg.run_name = Path(cfg.save_folder).name
    if dist.get_rank() == 0 and not cfg.dry_run:
        _save_configs(cfg, tda_cfg)
    dist.barrier()
    _start_wandb(cfg)
    try:
        with build_trainer(cfg, tda_cfg, device, step_callbacks=step_callbacks) as trainer:
            if cfg.load_path is not None:
                log.info("loading checkpoint %s", cfg.load_path)
                trainer.restore_checkpoint(cfg.load_path, load_optimizer_state=not cfg.reset_optimizer_state,
                                           load_trainer_state=not cfg.reset_trainer_state)
            elif not cfg.dry_run and not cfg.no_pre_train_checkpoint:
                kind = CheckpointType.sharded if cfg.save_num_checkpoints_to_keep != 0 else CheckpointType.unsharded
                trainer.save_checkpoint(kind)
            if not cfg.dry_run:
                trainer.fit()
    finally:
        import wandb
        if wandb.run is not None:
            wandb.finish()
        if dist.is_initialized():
            dist.barrier()
        release_distributed()
