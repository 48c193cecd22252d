"""Example Megatron-style pretraining under DeepSpeed with tda on: an OLMo model, ZeRO stage and bf16
from the DeepSpeed config, the ordinary ``engine(batch)`` / ``engine.backward`` / ``engine.step``
loop, checkpoints every ``save_every`` steps and automatic resume. One line attaches tda.

It is an example of a user's own training script: everything olmo_tda needs from it is the one
``attach(engine)`` line (and, for ``proj_type: eigen``, ``estimate_basis`` before the first step); the
rest — model, data order, checkpoints, resume — is the script's. ``olmo-tda attribute RUN_DIR`` opens
its runs (``run.json``, ``model.safetensors``: :class:`olmo_tda.integrations.olmo_query.DeepSpeedRun`).

Run (one process, or under a launcher: ``launch/local_deepspeed.sh``, ``launch/slurm_deepspeed.sbatch``)::

    python examples/deepspeed_pretrain.py configs/deepspeed_tiny.yaml --steps=20 \\
        --deepspeed.zero_optimization.stage=3 --tda.capture.proj_dim=32

Without a launcher (neither ``RANK`` nor ``WORLD_SIZE`` set) it is a process group of one, set up as
torchrun would. The YAML holds ``run_dir``, ``seed``, ``steps``, ``save_every``, ``model`` (OLMo
``ModelConfig`` fields), ``data`` (``paths`` of uint16 token memmaps — empty builds the demo corpus —
and ``seq_len``: by default, and necessarily, ``model.max_sequence_length``), ``deepspeed`` (the
DeepSpeed config dict) and ``tda`` (also accepted inside the DeepSpeed dict). ``--a.b=c`` overrides
any key. Bad input exits 2 with one ``error:`` line naming the key, before training starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import json
import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from olmo_tda.config import ConfigError, ProjectionType, TDAConfig, to_plain
from olmo_tda.store.errors import StoreError
from olmo_tda.store.format import write_json_atomic
from olmo_tda.training.selection import DataOrder
from olmo_tda.integrations import (decided_on_rank0, end_failed_rank, one_of_several_ranks, quiet_olmo_warnings,
                                   torchrun_restart_warning)
from olmo_tda.integrations.olmo_query import RUN_JSON, WEIGHTS_FILE
from olmo_tda.integrations.run_folder import Flags, Folder, Refuse, plan_start

__all__ = ["CausalLM", "load_config", "main", "train", "RUN_JSON", "WEIGHTS_FILE"]

log = logging.getLogger("deepspeed_pretrain")


class CausalLM(nn.Module):
    """Megatron-style model: takes the batch dict, returns the micro-batch's token-mean CE
    (``tda.batch.reduction: token_mean``; ``batch["index"]`` carries the global example ids), or
    with ``reduction="sum"`` the summed token CE (what an eigenbasis estimate takes)."""

    def __init__(self, model_config: Any):
        super().__init__()
        from olmo.model import OLMo

        self.olmo = OLMo(model_config)

    def forward(self, batch: dict[str, torch.Tensor], reduction: str = "mean") -> torch.Tensor:
        logits = self.olmo(batch["input_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100,
                               reduction=reduction)


def load_config(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The run YAML with ``--a.b=c`` overrides applied (OmegaConf), checked, as a plain dict.

    Checked before any process group starts: every key is known (a misspelt one names the closest
    valid one), ``steps``/``seed``/``save_every`` are integers, ``model`` builds an OLMo model,
    ``data.seq_len`` (default: ``model.max_sequence_length``) equals ``model.max_sequence_length``
    so that ``olmo-tda attribute`` can decode the run's passages, and ``tda`` parses. Raises
    :class:`ConfigError` (one line: the file and the key path) otherwise."""
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    dotlist = []
    for item in overrides or []:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text or text.startswith("="):
            raise ConfigError(f"override {item!r}: expected --key=value, e.g. --steps=20")
        try:
            OmegaConf.from_dotlist([text])
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({_one_line(e)})") from None
        dotlist.append(text)
    try:
        loaded = OmegaConf.load(path)
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"{path}: expected a mapping at top level, got a list")
        data = OmegaConf.to_container(OmegaConf.merge(loaded, OmegaConf.from_dotlist(dotlist)), resolve=True)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({_one_line(e)})") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}") from None
    try:
        return _check_config(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


_TOP_LEVEL = ("run_dir", "seed", "steps", "save_every", "model", "data", "deepspeed", "tda", "tokenizer")
_DATA_KEYS = ("paths", "seq_len")
_DEEPSPEED_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _check_config(data: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(data) - set(_TOP_LEVEL))
    if unknown:
        hints = [f"'{c[0]}' for '{k}'" for k in unknown for c in [difflib.get_close_matches(k, _TOP_LEVEL, n=1)] if c]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise ConfigError(f"unknown top-level keys {unknown}{hint}; expected {sorted(_TOP_LEVEL)}")
    for key in ("run_dir", "steps", "model", "deepspeed"):
        if data.get(key) in (None, ""):
            raise ConfigError(f"'{key}' is required")
    run_dir = data["run_dir"]
    if not isinstance(run_dir, (str, int)) or isinstance(run_dir, bool):
        raise ConfigError(f"run_dir: expected a folder path, got {run_dir!r}")
    out = {**data, "run_dir": str(run_dir), "steps": _integer(data, "steps", minimum=1),
           "seed": _integer(data, "seed", minimum=0), "save_every": _integer(data, "save_every", minimum=0)}
    if not isinstance(data.get("tokenizer"), (str, type(None))):
        raise ConfigError(f"tokenizer: expected a tokenizer identifier, got {data['tokenizer']!r}")
    for key in ("model", "deepspeed", "data", "tda"):
        if not isinstance(data.get(key) or {}, dict):
            raise ConfigError(f"{key}: expected a mapping, got {data[key]!r}")
    out["model"], max_len = _check_model(data["model"])
    out["data"] = _check_data(data.get("data") or {}, max_len)
    ds_config = dict(data["deepspeed"])
    for key in _DEEPSPEED_BATCH_KEYS:   # DeepSpeed compares them with numbers unchecked (a TypeError)
        if key in ds_config and (not isinstance(ds_config[key], int) or isinstance(ds_config[key], bool)
                                 or ds_config[key] < 1):
            raise ConfigError(f"deepspeed.{key}: expected an integer >= 1, got {ds_config[key]!r}")
    if ds_config.get("managed_gradient_accumulation", True) is not True:
        # this script's loop is the managed one (engine.step() after every micro-batch, DeepSpeed keeping the
        # boundary); unmanaged, each engine.step() is an optimizer update, and steps would count micro-batches
        raise ConfigError(f"deepspeed.managed_gradient_accumulation: {ds_config['managed_gradient_accumulation']!r} is "
                          "not supported by this script, whose loop leaves the accumulation boundary to DeepSpeed "
                          "(engine.step() after every micro-batch): remove the key or set it to true")
    if "tda" in data and "tda" in ds_config:
        raise ConfigError("give the tda section once, at top level or inside 'deepspeed', not both")
    tda = TDAConfig.from_dict(data["tda"] if "tda" in data else ds_config.pop("tda", None))
    target = tda.selection.target
    if tda.enabled and tda.selection.enabled and target and not Path(target).is_file():
        raise ConfigError(f"tda.selection.target: no such file {target!r}")
    out["deepspeed"], out["tda"] = ds_config, tda.to_dict()
    return out


def _integer(data: dict[str, Any], key: str, *, minimum: int) -> int:
    value = data.get(key)
    if value is None:   # seed, save_every (steps is required)
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _check_model(section: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``section`` checked against OLMo's ``ModelConfig`` (as OLMo's own loader checks it: key
    names, types, enum values) and built once on the meta device; returns it with the values
    converted (``"128"`` -> 128) and the model's ``max_sequence_length``."""
    from olmo.config import ModelConfig
    from olmo.model import OLMo
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    names = [f.name for f in dataclasses.fields(ModelConfig)]
    for key in section:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else "; see olmo.config.ModelConfig for the fields"
            raise ConfigError(f"model.{key}: unknown key{hint}")
    try:
        model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), section))
    except OmegaConfBaseException as e:
        raise ConfigError(f"model.{e.full_key}: {str(e).splitlines()[0]}") from None
    try:   # the meta device allocates nothing: any failure here is OLMo refusing the config
        OLMo(dataclasses.replace(model_cfg, init_device="meta"))
    except Exception as e:  # noqa: BLE001 -- OLMo checks with asserts and arithmetic as well as its own error
        where = traceback.extract_tb(e.__traceback__)[-1]
        raise ConfigError(f"model: OLMo cannot build this model: {': '.join(filter(None, (type(e).__name__, str(e))))} "
                          f"(at {Path(where.filename).name}:{where.lineno}: {where.line})") from None
    return {k: to_plain(getattr(model_cfg, k)) for k in section}, model_cfg.max_sequence_length


def _check_data(section: dict[str, Any], max_len: int) -> dict[str, Any]:
    for key in section:
        if key not in _DATA_KEYS:
            close = difflib.get_close_matches(str(key), _DATA_KEYS, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(_DATA_KEYS)}"
            raise ConfigError(f"data.{key}: unknown key{hint}")
    paths = section.get("paths") or []
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ConfigError(f"data.paths: expected a list of token files, e.g. --data.paths=[a.npy,b.npy], got {paths!r}")
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise ConfigError(f"data.paths: no such file(s) {missing}")
    seq_len = max_len if section.get("seq_len") is None else section["seq_len"]
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        raise ConfigError(f"data.seq_len: expected an integer >= 2, got {seq_len!r}")
    if seq_len != max_len:
        # The run's passages are decoded by index in rows of model.max_sequence_length at query time.
        raise ConfigError(f"data.seq_len {seq_len} != model.max_sequence_length {max_len}: set both to the same "
                          f"length (e.g. --data.seq_len={max_len}), or `olmo-tda attribute` cannot query the run")
    return {"paths": paths, "seq_len": seq_len}


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


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


def step_ids(step: int, rank: int, micro: int, *, world: int, micro_bs: int, gas: int, num: int,
             seed: int) -> np.ndarray:
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
        return paths
    import torch.distributed as dist

    from olmo_tda.demo.corpus import build_passages
    from olmo_tda.demo.data import write_memmap

    target = run_dir / "data" / "train.npy"
    if rank == 0 and not target.exists():
        write_memmap(build_passages(2048, int(cfg["data"]["seq_len"]), seed=0), target, int(cfg["data"]["seq_len"]))
    if dist.is_initialized():
        dist.barrier()
    return [str(target)]


_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun and the deepspeed launcher set in every process; DeepSpeed needs all of them."""
_OTHER_LAUNCHERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE",
                    "AZUREML_EXPERIMENT_ID", "SM_TRAINING_ENV")
"""Launchers whose processes DeepSpeed discovers itself (MPI via mpi4py, AzureML, SageMaker)."""


@contextlib.contextmanager
def _launch_env() -> Iterator[None]:
    """A plain ``python -m`` run (no launcher: neither RANK nor WORLD_SIZE set) is a process group of
    one, set up as torchrun would (a free local port); without it DeepSpeed looks for MPI. The
    variables set here are removed again afterwards."""
    present = [k for k in _LAUNCH_ENV if k in os.environ]
    if any(k in os.environ for k in _OTHER_LAUNCHERS) or len(present) == len(_LAUNCH_ENV):
        yield
        return
    if "RANK" in present or "WORLD_SIZE" in present:
        missing = [k for k in _LAUNCH_ENV if k not in present]
        raise ConfigError(f"launcher environment: {', '.join(present)} set but {', '.join(missing)} not; start under "
                          "torchrun or the deepspeed launcher, or unset them all to run as a single process")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    added = {k: v for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=str(port)).items() if k not in os.environ}
    log.info("no launcher: training as a single process (%s)", " ".join(f"{k}={v}" for k, v in added.items()))
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train per ``cfg`` (see :func:`load_config`); returns a summary dict. Under a launcher (torchrun,
    the deepspeed launcher) one process per rank; without one, a single process."""
    with _launch_env():
        return _train(cfg)


def _train(cfg: dict[str, Any]) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.zero.utils import ZeRORuntimeException
    from olmo.config import ModelConfig

    from olmo_tda.integrations.deepspeed import attach, estimate_basis
    from olmo_tda.integrations.deepspeed_selection import check_selection_log
    from olmo_tda.integrations.olmo import basis_path

    run_dir = Path(cfg["run_dir"])
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run_dir: cannot create {run_dir}: {e.strerror or e}") from None
    if (warning := torchrun_restart_warning()) and os.environ.get("RANK") == "0":
        log.warning("%s", warning)          # before the process group, which a restart may fail to form
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config = dict(cfg["deepspeed"])
    tda_section = cfg.get("tda", ds_config.pop("tda", None)) or {}
    tda = TDAConfig.from_dict(tda_section)
    if tda.enabled and tda.store.path is None:
        tda.store.path = str(run_dir / "tda" / "store")

    torch.manual_seed(int(cfg.get("seed", 0)))
    stage = _check_deepspeed_config(ds_config)
    data_paths = _prepare_data(cfg, run_dir, rank)
    data = TokenData(data_paths, int(cfg["data"]["seq_len"]))
    if len(data) == 0:
        raise ConfigError(f"data.paths: {data_paths} hold no full row of data.seq_len={data.seq_len} tokens")
    model_cfg = ModelConfig(**{"init_device": "cpu", **cfg["model"]})
    with deepspeed.zero.Init(enabled=stage == 3, config_dict_or_path=ds_config):
        model = CausalLM(model_cfg)
    if stage == 3:
        _reinit_partitioned(model.olmo)
    seed, num = int(cfg.get("seed", 0)), len(data)
    data_order = DataOrder(num, lambda epoch: _epoch_order(seed, epoch, num))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config)
    if tda.enabled and tda.store.enabled and tda.capture.proj_type is ProjectionType.EIGEN and not tda.capture.exact:
        # as an OLMo run: estimated at the initial weights if missing, from the first micro-batches
        tda.capture.basis = str(basis_path(tda.capture, run_dir))
        estimate_basis(engine, _basis_batches(engine, data, data_order, tda.capture.basis_batches),
                       lambda m, batch: m(batch, reduction="sum"), tda)
    session = attach(engine, tda)
    ckpt = run_dir / "checkpoints"
    client_state = None
    if (ckpt / "latest").exists():
        try:
            # DeepSpeed fails on a checkpoint of another ZeRO stage with an empty AssertionError
            decided_on_rank0(lambda: _check_same_zero(run_dir, ckpt, stage, world), catch=ConfigError)
            recorded_batch, latest_step = decided_on_rank0(
                lambda: (_saved_run(run_dir).get("train_batch_size"), _latest_step(ckpt)))
            _check_same_batch(engine, ckpt, world, recorded_batch)
            if latest_step is not None:      # before the load, which cuts the store back to that step
                _check_steps(int(cfg["steps"]), latest_step, ckpt)
            _, client_state = engine.load_checkpoint(str(ckpt))     # tda resumes its store from it too
            # DeepSpeed's own count, once loaded: the one check for a run.json written before the batch was
            # recorded; with one, it still catches a batch changed part-way through the run
            _check_same_batch(engine, ckpt, world, None)
            if tda.enabled and tda.selection.enabled:   # refused here, before this launch writes anything
                check_selection_log(run_dir / "tda" / "selection",
                                    engine.global_steps * engine.train_batch_size() // len(data),
                                    engine.global_steps, (client_state or {}).get(SELECTION_KEY))
        except (ConfigError, StoreError):
            session.close()                          # tda's own refusals name their remedy
            raise
        except (RuntimeError, KeyError, ValueError, OSError, AssertionError, ZeRORuntimeException) as e:
            session.close()
            raise ConfigError(f"run_dir: cannot resume from the checkpoint in {ckpt}: {type(e).__name__}: "
                              f"{_one_line(e)[:400]} -- run with the config that wrote it ({run_dir / 'config.json'}), "
                              f"or give a new run_dir to start over") from None
        log.info("resumed from %s at step %d", ckpt, engine.global_steps)
        try:                                          # a checkpoint tagged step{steps} would hold a later step
            _check_steps(int(cfg["steps"]), engine.global_steps, ckpt)
        except ConfigError:
            session.close()
            raise
    elif session.store is not None and session.store.held_rows():
        rows, path = session.store.held_rows(), session.store.path
        # the run-folder plan (its end is summary.json); rank 0 reads, every rank gets the one answer
        plan = decided_on_rank0(lambda: plan_start(Folder(run=True, finished=(run_dir / "summary.json").exists()),
                                                   Flags(latest=True)))
        if isinstance(plan, Refuse):
            session.close()
            raise ConfigError(f"run_dir: {run_dir} has no checkpoint to resume from, but the gradient store {path} "
                              f"holds {rows} rows of an earlier run, which ended (summary.json): this run's would "
                              f"be mixed into it. Give a new run_dir (or tda.store.path), or remove {path} to "
                              "start over")
        log.warning("run_dir: %s: %s (the %d rows stored in %s are dropped)", run_dir, plan.why, rows, path)
        session.start_over()
    elif session.metrics_log is not None:       # an attempt that stored no row may have logged steps
        session.metrics_log.cut_after(0)
    # Written once the run has started or resumed: a refused resume leaves the files of the run it
    # refused to continue as they were.
    if rank == 0:
        write_json_atomic(run_dir / "config.json", {**cfg, "tda": tda.to_dict()})
        # what `olmo-tda attribute RUN` needs to open this run (DeepSpeedRun)
        from olmo_tda.demo.data import BYTE_TOKENIZER_ID

        tokenizer = cfg.get("tokenizer") or (BYTE_TOKENIZER_ID if not (cfg.get("data") or {}).get("paths") else None)
        if tokenizer is None:
            log.warning("no `tokenizer:` for data.paths: `olmo-tda attribute %s` will not be able to encode queries",
                        run_dir)
        write_json_atomic(run_dir / RUN_JSON, {
            "kind": "deepspeed_pretrain", "model": cfg["model"],
            "data_paths": [str(Path(p).resolve()) for p in data_paths],
            "seq_len": int(cfg["data"]["seq_len"]), "tokenizer": tokenizer, "tda": tda.to_dict(),
            "weights": WEIGHTS_FILE,
            "zero_stage": stage, "world_size": world,                 # what its checkpoints need to load
            "train_batch_size": engine.train_batch_size()})           # and to read the same data order

    gas, micro_bs = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    steps, save_every = int(cfg["steps"]), int(cfg.get("save_every") or 0)
    selection = None
    if tda.enabled and tda.selection.enabled:
        selection = _start_selection(engine, tda, session, data, data_order, cfg, run_dir)
        # a start without a checkpoint: an earlier log's rounds go; a resume: the log holds the
        # checkpoint's rounds (checked above, right after the load: not read and broadcast again here)
        selection.resume(engine.global_steps)
        carried = None
    else:
        # the rounds applied before selection was switched off go on in this run's checkpoints, so that
        # switching it back on later is still checked against them
        carried = (client_state or {}).get(SELECTION_KEY)
        if carried and carried.get("rounds"):
            log.warning("the checkpoint's run had applied %d selection rounds by step %d, and tda.selection is off "
                        "now: this run trains on the plain data order from here", carried["rounds"],
                        engine.global_steps)
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
            engine.save_checkpoint(str(ckpt), tag=f"step{step}", client_state=_client_state(selection, step, carried))
    if save_every and steps % save_every:
        engine.save_checkpoint(str(ckpt), tag=f"step{steps}", client_state=_client_state(selection, steps, carried))
    _save_final_weights(engine, run_dir / WEIGHTS_FILE, rank)
    summary = {"steps": steps, "final_loss": losses[-1] if losses else None, "seconds": time.perf_counter() - t0,
               "zero_stage": stage, "world_size": world,
               # rows: the run's, over the ranks and through resumes (collective); steps: this session's
               "tda": session.run_metrics() if tda.enabled and tda.store.enabled else None}
    session.close()
    if selection is not None:
        selection.close()
    if rank == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _reinit_partitioned(olmo: nn.Module) -> None:
    """OLMo's own init on a model ``zero.Init`` built partitioned. zero.Init partitions each layer as
    it is built, so OLMo's ``reset_parameters`` (at the end of ``OLMo.__init__``) met empty tensors
    and the weights kept torch's defaults (a tied head on N(0, 1) embeddings starts at loss ~26).
    It runs again here, each layer's weights gathered only while OLMo's ``init_normal`` draws them
    (its other resets, of norms to ones and zeros, redo what their construction did): every rank
    draws the same numbers in the same order from the same seed, rank 0's are kept, the weights of
    a plain build, and no rank holds more than one layer whole (ai2-olmo 0.6.0, pinned: every weight
    its blocks and embeddings draw goes through ``olmo.model.init_normal``)."""
    import deepspeed
    import olmo.model as olmo_model

    draw = olmo_model.init_normal

    def gathered(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with deepspeed.zero.GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=0):
            return draw(module, *args, **kwargs)

    log.info("ZeRO-3: re-running OLMo's init on the partitioned model, layer by layer")
    olmo_model.init_normal = gathered
    try:
        olmo.reset_parameters()
    finally:
        olmo_model.init_normal = draw


def _basis_batches(engine: Any, data: "TokenData", order: DataOrder, num: int) -> Iterator[dict[str, torch.Tensor]]:
    """The micro-batches that estimate a missing eigenbasis: ``num`` per rank from the start of the
    data order (rank r takes the r-th group of them)."""
    import torch.distributed as dist

    micro, first = engine.train_micro_batch_size_per_gpu(), dist.get_rank() * num
    for j in range(num):
        yield {k: v.to(engine.device) for k, v in data.batch(order.ids((first + j) * micro, micro)).items()}


def _check_same_zero(run_dir: Path, ckpt: Path, stage: int, world: int) -> None:
    """Refuse, naming both, a resume under another ZeRO stage, or (ZeRO 1-3: the optimizer state is
    partitioned over the ranks) another number of ranks, than the run's checkpoints were written with
    (``run.json`` records them; a run.json without them, written before they were recorded, says nothing)."""
    saved = _saved_run(run_dir)
    then_stage, then_world = saved.get("zero_stage"), saved.get("world_size")
    if isinstance(then_stage, int) and then_stage != stage:
        raise ConfigError(f"deepspeed.zero_optimization.stage: {stage}, but the checkpoint in {ckpt} was written at "
                          f"ZeRO stage {then_stage}, which DeepSpeed cannot load under another stage: resume with "
                          f"stage {then_stage}, or give a new run_dir to start over")
    if stage > 0 and isinstance(then_world, int) and then_world != world:
        raise ConfigError(f"the checkpoint in {ckpt} was written by {then_world} rank(s) and this run has {world}: "
                          f"DeepSpeed cannot repartition ZeRO-{stage} optimizer state over another number of ranks; "
                          f"resume with {then_world} rank(s), or give a new run_dir to start over")


def _latest_step(ckpt: Path) -> int | None:
    """The step of the checkpoint DeepSpeed's ``latest`` names, by this script's tags (``step<N>``);
    None if it names another tag or cannot be read."""
    try:
        tag = (ckpt / "latest").read_text().strip()
    except OSError:
        return None
    return int(tag[4:]) if tag.startswith("step") and tag[4:].isdigit() else None


def _check_steps(steps: int, step: int, ckpt: Path) -> None:
    """Refuse a run asked for fewer steps than its checkpoint holds."""
    if step > steps:
        raise ConfigError(f"steps: {steps} is below the step {step} of the checkpoint in {ckpt}; give --steps >= "
                          f"{step}, or a new run_dir to start over")


def _check_same_batch(engine: Any, ckpt: Path, world: int, recorded: Any) -> None:
    """Refuse, naming both, a resume whose global batch (examples a step) differs from the one the
    checkpoint's run trained with: this script reads example ``(step - 1) · batch + i`` at each step, so
    another batch would skip or repeat examples (and shift selection's rounds). Micro-batch size,
    gradient accumulation and (ZeRO-0) rank count may change if their product stays the same.

    The checkpoint's batch is ``recorded`` (run.json's ``train_batch_size``: checked before the load,
    which cuts the store and trajectory back to the checkpoint's step), or, with ``recorded`` None,
    DeepSpeed's own count after the load, ``global_samples / global_steps`` (a checkpoint from before
    DeepSpeed counted samples falls back to the current batch: then nothing is checked)."""
    batch = engine.train_batch_size()
    if recorded is not None:
        if not isinstance(recorded, int) or recorded == batch:
            return
        then, steps, samples = str(recorded), None, None
    else:
        steps, samples = engine.global_steps, engine.global_samples
        if not steps or samples == steps * batch:
            return
        then = str(samples // steps) if samples % steps == 0 else None
    trained = f"trained {samples} examples in {steps} steps ({then or f'{samples / steps:.2f} on average'} a step)" \
        if steps else f"was written by a run of {then} examples a step"
    remedy = (f"Resume with {then} examples a step (micro-batch size and gradient accumulation may change if "
              "their product x ranks stays the same), or give a new run_dir to start over") if then else \
        "Its run changed its batch part-way: give a new run_dir to start over"
    raise ConfigError(
        f"deepspeed.train_batch_size: {batch} examples a step (train_micro_batch_size_per_gpu "
        f"{engine.train_micro_batch_size_per_gpu()} x gradient_accumulation_steps "
        f"{engine.gradient_accumulation_steps()} x {world} rank(s)), but the checkpoint in {ckpt} {trained}: the data "
        f"order is read by step x batch, so another batch would skip or repeat examples. {remedy}")


def _saved_run(run_dir: Path) -> dict[str, Any]:
    """The run's ``run.json``; unreadable or not an object: empty."""
    try:
        saved = json.loads((run_dir / RUN_JSON).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _check_deepspeed_config(ds_config: dict[str, Any]) -> int:
    """DeepSpeed's own check of ``ds_config`` (with this world size), as a :class:`ConfigError`
    naming the key; returns the ZeRO stage."""
    import copy

    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    try:
        return int(DeepSpeedConfig(copy.deepcopy(ds_config)).zero_optimization_stage)
    except ValidationError as e:   # one of DeepSpeed's sections (pydantic models): find its key path
        err = e.errors()[0]
        key = ".".join(map(str, err["loc"]))
        paths = [p for p in _key_paths(ds_config, err["loc"][-1], err.get("input")) if p.endswith(key)] if key else []
        where = f"deepspeed.{paths[0]}" if len(paths) == 1 else f"deepspeed ({e.title}.{key})"
        raise ConfigError(f"{where}: {err['msg']} (got {err.get('input')!r})") from None
    except (AssertionError, TypeError, ValueError) as e:   # its checks across keys (batch sizes, precisions)
        raise ConfigError(f"deepspeed: DeepSpeed rejected the config: {_one_line(e) or type(e).__name__}") from None


def _key_paths(tree: Any, key: Any, value: Any, prefix: str = "") -> list[str]:
    """Dotted paths of ``key`` holding ``value`` anywhere in the nested dict ``tree``."""
    if not isinstance(tree, dict):
        return []
    found = [f"{prefix}{k}" for k, v in tree.items() if k == key and v == value]
    return found + [p for k, v in tree.items() for p in _key_paths(v, key, value, f"{prefix}{k}.")]


SELECTION_KEY = "tda_selection"
"""Key of the selection's state (rounds applied, log folder) in this script's checkpoints' client_state."""


def _client_state(selection: Any, step: int, carried: dict[str, Any] | None) -> dict[str, Any]:
    state = selection.state_dict(step) if selection is not None else carried
    return {SELECTION_KEY: state} if state else {}


def _start_selection(engine: Any, tda: TDAConfig, session: Any, data: TokenData, data_order: DataOrder,
                     cfg: dict[str, Any], run_dir: Path):
    from olmo_tda.demo.corpus import ByteTokenizer
    from olmo_tda.demo.data import BYTE_TOKENIZER_ID
    from olmo_tda.training.selector import load_target, target_kind
    from olmo_tda.integrations.deepspeed_selection import DeepSpeedSelection

    seq_len = int(cfg["data"]["seq_len"])
    target = None
    if tda.selection.target:
        byte_data = not (cfg.get("data") or {}).get("paths") or cfg.get("tokenizer") == BYTE_TOKENIZER_ID
        try:
            kind = target_kind(tda.selection.target)
        except ValueError as e:
            raise ConfigError(f"tda.selection.target: {e}") from None
        if kind != "tokens" and not byte_data:
            raise ConfigError("tda.selection.target: this script tokenizes target texts with the byte tokenizer only; "
                              "give a token file (.npy ids or a uint16 memmap) for other tokenizers")
        eos = int(cfg["model"].get("eos_token_id", 256))
        try:
            target = load_target(tda.selection.target, seq_len, ByteTokenizer().encode,
                                 num=tda.selection.target_examples, eos_token_id=eos,
                                 vocab_size=_vocab_rows(engine.module.olmo.config))
        except (OSError, ValueError) as e:
            raise ConfigError(f"tda.selection.target: {e}") from None
    return DeepSpeedSelection(engine, tda.selection, order=data_order, seq_len=seq_len,
                              fetch=lambda ids: data.batch(ids)["input_ids"],
                              forward=lambda m, ids: m.olmo(ids).logits, log_folder=run_dir / "tda" / "selection",
                              target_tokens=target, pause=(session.capture,) if session.capture is not None else ())


def _vocab_rows(model_cfg: Any) -> int:
    """Token ids the model's embedding takes: ``[0, embedding_size or vocab_size)``."""
    return int(model_cfg.embedding_size or model_cfg.vocab_size)


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
    parser = argparse.ArgumentParser(prog="python examples/deepspeed_pretrain.py",
                                     description="Megatron-style OLMo pretraining under DeepSpeed with tda capture.")
    parser.add_argument("config", help="run YAML (see configs/deepspeed_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="--a.b=value overrides")
    args, unknown = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_olmo_warnings()
    try:
        summary = train(load_config(args.config, args.overrides + unknown))
    except (ConfigError, StoreError) as e:    # a store another config wrote, a corrupt or full one
        print(f"error: {e}", file=sys.stderr)
        status = 2
    except (Exception, KeyboardInterrupt):
        if not one_of_several_ranks():
            raise
        traceback.print_exc()
        status = 1
    else:
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(summary))
        return 0
    if one_of_several_ranks():      # reported: go, before a teardown that can wait on the other failed ranks
        from olmo_tda.integrations.deepspeed import close_open_sessions

        close_open_sessions()       # what the exit would close (an error mid-run leaves its session open)
        end_failed_rank(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
