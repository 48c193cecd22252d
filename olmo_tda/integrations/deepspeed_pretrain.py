"""Example Megatron-style pretraining under DeepSpeed with tda on: an OLMo model, ZeRO stage and bf16
from the DeepSpeed config, the ordinary ``engine(batch)`` / ``engine.backward`` / ``engine.step``
loop, checkpoints every ``save_every`` steps and automatic resume. One line attaches tda.

Run (one process, or under a launcher: ``launch/local_deepspeed.sh``, ``launch/slurm_deepspeed.sbatch``)::

    python -m olmo_tda.integrations.deepspeed_pretrain configs/deepspeed_tiny.yaml --steps=20 \\
        --deepspeed.zero_optimization.stage=3 --tda.capture.proj_dim=32

The YAML holds ``run_dir``, ``seed``, ``steps``, ``save_every``, ``model`` (OLMo ``ModelConfig``
fields), ``data`` (``paths`` of uint16 token memmaps — empty builds the demo corpus — and
``seq_len``), ``deepspeed`` (the DeepSpeed config dict) and ``tda`` (also accepted inside the
DeepSpeed dict). ``--a.b=c`` overrides any key.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, TDAConfig
from ..training.selection import DataOrder

__all__ = ["CausalLM", "load_config", "main", "train", "RUN_JSON", "WEIGHTS_FILE"]

RUN_JSON = "run.json"
"""Beside the run's outputs: model config, resolved data paths, tokenizer, tda config."""
WEIGHTS_FILE = "model.safetensors"
"""The final full weights, for queries."""

log = logging.getLogger(__name__)


class CausalLM(nn.Module):
    """Megatron-style model: takes the batch dict, returns the micro-batch's token-mean CE
    (``tda.batch.reduction: token_mean``; ``batch["index"]`` carries the global example ids)."""

    def __init__(self, model_config: Any):
        super().__init__()
        from olmo.model import OLMo

        self.olmo = OLMo(model_config)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.olmo(batch["input_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)


def load_config(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The run YAML with ``--a.b=c`` overrides applied (OmegaConf), checked, as a plain dict."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        cfg = OmegaConf.merge(OmegaConf.load(path),
                              OmegaConf.from_dotlist([o[2:] if o.startswith("--") else o for o in overrides or []]))
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {e}") from None
    known = {"run_dir", "seed", "steps", "save_every", "model", "data", "deepspeed", "tda", "tokenizer"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown top-level keys {unknown}; expected {sorted(known)}")
    for key in ("run_dir", "steps", "model", "deepspeed"):
        if data.get(key) in (None, ""):
            raise ConfigError(f"{path}: '{key}' is required")
    if "tda" in data and "tda" in data["deepspeed"]:
        raise ConfigError(f"{path}: give the tda section once, at top level or inside 'deepspeed', not both")
    return data


class TokenData:
    """Fixed-length instances of uint16 token memmaps; instance ``i`` is example id ``i``."""

    def __init__(self, paths: list[str], seq_len: int):
        arrays = [np.memmap(p, dtype=np.uint16, mode="r") for p in paths]
        self.chunks = [a[: len(a) // seq_len * seq_len].reshape(-1, seq_len) for a in arrays]
        self.offsets = np.cumsum([0] + [len(c) for c in self.chunks])
        self.seq_len = seq_len

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def batch(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        rows = []
        for i in ids:
            k = int(np.searchsorted(self.offsets, i, side="right") - 1)
            rows.append(np.asarray(self.chunks[k][i - self.offsets[k]], dtype=np.int64))
        input_ids = torch.from_numpy(np.stack(rows))
        labels = torch.full_like(input_ids, -100)
        labels[:, :-1] = input_ids[:, 1:]
        return {"input_ids": input_ids, "labels": labels, "index": torch.from_numpy(np.asarray(ids, dtype=np.int64))}


def step_ids(step: int, rank: int, micro: int, *, world: int, micro_bs: int, gas: int, num: int, seed: int) -> np.ndarray:
    """Global ids of (1-based) ``step``'s micro-batch ``micro`` on ``rank``: a seeded permutation per
    epoch, consumed in order — a pure function of the step, so a resumed run continues exactly."""
    per_step = world * micro_bs * gas
    start = (step - 1) * per_step + (rank * gas + micro) * micro_bs
    return np.asarray([_epoch_order(seed, pos // num, num)[pos % num] for pos in range(start, start + micro_bs)],
                      dtype=np.int64)


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, num: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num)


def _prepare_data(cfg: dict[str, Any], run_dir: Path, rank: int) -> list[str]:
    paths = list((cfg.get("data") or {}).get("paths") or [])
    if paths:
        missing = [p for p in paths if not Path(p).is_file()]
        if missing:
            raise ConfigError(f"data.paths: no such file(s) {missing}")
        return paths
    import torch.distributed as dist

    from ..demo.corpus import build_passages
    from ..demo.data import write_memmap

    target = run_dir / "data" / "train.npy"
    if rank == 0 and not target.exists():
        write_memmap(build_passages(2048, int(cfg["data"]["seq_len"]), seed=0), target, int(cfg["data"]["seq_len"]))
    if dist.is_initialized():
        dist.barrier()
    return [str(target)]


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train per ``cfg`` (see :func:`load_config`); returns a summary dict."""
    import deepspeed
    import torch.distributed as dist
    from olmo.config import ModelConfig

    from .deepspeed import attach

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(cfg["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    ds_config = dict(cfg["deepspeed"])
    tda_section = cfg.get("tda", ds_config.pop("tda", None)) or {}
    tda = TDAConfig.from_dict(tda_section)
    if tda.enabled and tda.store.path is None:
        tda.store.path = str(run_dir / "tda" / "store")
    if rank == 0:
        (run_dir / "config.json").write_text(json.dumps({**cfg, "tda": tda.to_dict()}, indent=2))

    torch.manual_seed(int(cfg.get("seed", 0)))
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    model_cfg = ModelConfig(**{"init_device": "cpu", **cfg["model"]})
    with deepspeed.zero.Init(enabled=stage == 3, config_dict_or_path=ds_config):
        model = CausalLM(model_cfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config)
    session = attach(engine, tda)
    data_paths = _prepare_data(cfg, run_dir, rank)
    data = TokenData(data_paths, int(cfg["data"]["seq_len"]))
    if rank == 0:   # what `olmo-tda attribute RUN` needs to open this run (DeepSpeedRun)
        from ..demo.data import BYTE_TOKENIZER_ID

        tokenizer = cfg.get("tokenizer") or (BYTE_TOKENIZER_ID if not (cfg.get("data") or {}).get("paths") else None)
        (run_dir / RUN_JSON).write_text(json.dumps({
            "kind": "deepspeed_pretrain", "model": cfg["model"], "data_paths": [str(Path(p).resolve()) for p in data_paths],
            "seq_len": int(cfg["data"]["seq_len"]), "tokenizer": tokenizer, "tda": tda.to_dict(),
            "weights": WEIGHTS_FILE}, indent=2))
    ckpt = run_dir / "checkpoints"
    if (ckpt / "latest").exists():
        engine.load_checkpoint(str(ckpt))          # tda resumes its store from the checkpoint too
        log.info("resumed from %s at step %d", ckpt, engine.global_steps)

    gas, micro_bs = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    steps, save_every = int(cfg["steps"]), int(cfg.get("save_every") or 0)
    seed, num = int(cfg.get("seed", 0)), len(data)
    data_order = DataOrder(num, lambda epoch: _epoch_order(seed, epoch, num))
    selection = None
    if tda.enabled and tda.selection.enabled:
        selection = _start_selection(engine, tda, session, data, data_order, cfg, run_dir)
        if engine.global_steps:
            selection.resume(engine.global_steps)
    device = engine.device
    t0, losses = time.perf_counter(), []
    for step in range(engine.global_steps + 1, steps + 1):
        step_loss = 0.0
        for micro in range(gas):                                      # the ordinary DeepSpeed loop
            ids = data_order.ids((step - 1) * world * micro_bs * gas + (rank * gas + micro) * micro_bs, micro_bs)
            batch = {k: v.to(device) for k, v in data.batch(ids).items()}
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
            step_loss += float(loss.detach()) / gas
        losses.append(step_loss)
        if selection is not None:
            stats = selection.on_step_end(step)
            if stats and rank == 0:
                log.info("step %d: selection rescored %d examples in %.2f s", step, stats["examples_rescored"],
                         stats["seconds"])
        if rank == 0 and (step % 10 == 0 or step == steps):
            log.info("step %d/%d loss %.4f lr %.2e", step, steps, step_loss, engine.get_lr()[0])
        if save_every and step % save_every == 0:
            engine.save_checkpoint(str(ckpt), tag=f"step{step}")
    if save_every and steps % save_every:
        engine.save_checkpoint(str(ckpt), tag=f"step{steps}")
    _save_final_weights(engine, run_dir / WEIGHTS_FILE, rank)
    summary = {"steps": steps, "final_loss": losses[-1] if losses else None, "seconds": time.perf_counter() - t0,
               "zero_stage": stage, "world_size": world,
               "tda": session.metrics() if tda.enabled and tda.store.enabled else None}
    session.close()
    if selection is not None:
        selection.close()
    if rank == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _start_selection(engine: Any, tda: TDAConfig, session: Any, data: TokenData, data_order: DataOrder,
                     cfg: dict[str, Any], run_dir: Path):
    from ..demo.corpus import ByteTokenizer
    from ..demo.data import BYTE_TOKENIZER_ID
    from ..training.selector import load_target
    from .deepspeed import DeepSpeedSelection

    seq_len = int(cfg["data"]["seq_len"])
    target = None
    if tda.selection.target:
        byte_data = not (cfg.get("data") or {}).get("paths") or cfg.get("tokenizer") == BYTE_TOKENIZER_ID
        if Path(tda.selection.target).suffix in (".txt", ".jsonl") and not byte_data:
            raise ConfigError("tda.selection.target: this script tokenizes target texts with the byte tokenizer only; "
                              "give a token file (.npy ids or a uint16 memmap) for other tokenizers")
        target = load_target(tda.selection.target, seq_len, ByteTokenizer().encode, num=tda.selection.target_examples,
                             eos_token_id=int(cfg["model"].get("eos_token_id", 256)))
    return DeepSpeedSelection(engine, tda.selection, order=data_order, seq_len=seq_len,
                              fetch=lambda ids: data.batch(ids)["input_ids"],
                              forward=lambda m, ids: m.olmo(ids).logits, log_folder=run_dir / "tda" / "selection",
                              target_tokens=target, pause=(session.capture,) if session.capture is not None else ())


def _save_final_weights(engine: Any, path: Path, rank: int) -> None:
    """Full fp32 weights as safetensors (gathered from ZeRO-3 partitions; every rank joins, rank 0
    writes): queries run at these weights, with no pickle and no DeepSpeed needed to read them."""
    import deepspeed
    from safetensors.torch import save_file

    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=engine.zero_optimization_stage() == 3):
        state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in module.state_dict().items()}
    if rank == 0:
        tmp = path.with_name(path.name + ".tmp")
        save_file(state, str(tmp))
        tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m olmo_tda.integrations.deepspeed_pretrain",
                                     description="Megatron-style OLMo pretraining under DeepSpeed with tda capture.")
    parser.add_argument("config", help="run YAML (see configs/deepspeed_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="--a.b=value overrides")
    args, unknown = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = train(load_config(args.config, args.overrides + unknown))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import os

    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
