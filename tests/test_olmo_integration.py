"""OLMo pretraining with tda enabled, for real: 2-rank torchrun (gloo) under DDP and FSDP, resume after
SIGKILL, and tda disabled = plain OLMo. Oracles: OLMo's own global data order (which ids each step
consumed) and torch.func per-example gradients recomputed from the previous step's checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from olmo_tda.demo.corpus import build_passages
from olmo_tda.demo.data import write_memmap
from olmo_tda.store import GradientStore
from _warm import run_module
from conftest import free_port, outside_slurm_env, rel_err

ROOT = Path(__file__).resolve().parents[1]
SEQ, GBS = 32, 8


def _overrides(tmp: Path, run: str, steps: int, *extra: str) -> list[str]:
    return [f"--data.paths=[{tmp / 'data' / 'train.npy'}]", f"--save_folder={tmp / run}", f"--max_duration={steps}",
            f"--stop_at={steps}",  # OLMo otherwise runs 10 steps past max_duration
            "--model.d_model=64", "--model.n_heads=4", "--model.max_sequence_length=32",
            f"--global_train_batch_size={GBS}", "--device_train_microbatch_size=2", "--console_log_interval=1000",
            "--save_num_unsharded_checkpoints_to_keep=-1", "--tda.capture.proj_dim=0", "--tda.store.dtype=float32",
            "--tda.store.flush_every=2", *extra]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("olmo")
    write_memmap(build_passages(256, SEQ, seed=3), tmp / "data" / "train.npy", SEQ)
    return tmp


def _run(args: list[str], nproc: int = 1, timeout: int = 300, env=None) -> subprocess.CompletedProcess:
    full_env = {**outside_slurm_env(), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})}
    train = ["train", str(ROOT / "configs" / "demo_tiny.yaml"), *args]
    if nproc == 1:
        done = run_module("olmo_tda.cli", train, env=full_env, cwd=ROOT, timeout=timeout)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "olmo_tda.cli", *train]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def _as_stopped(run_dir: Path) -> None:
    """A run that ended, made the run of an attempt stopped before its end: its tda.yaml without the
    ``finished`` record the end writes (the test's stand-in for a preemption)."""
    saved = yaml.safe_load((run_dir / "tda.yaml").read_text())
    del saved["finished"]
    (run_dir / "tda.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))


def _expected_ids(run_dir: Path, step: int) -> np.ndarray:
    order = np.memmap(run_dir / "train_data" / "global_indices.npy", dtype=np.uint32, mode="r")  # OLMo: raw uint32
    return np.sort(np.asarray(order[(step - 1) * GBS: step * GBS]))


def _exact_grads_from_checkpoint(run_dir: Path, ckpt_step: int, ids: np.ndarray, data: np.ndarray):
    from olmo.config import TrainConfig
    from olmo.model import OLMo
    from torch.func import functional_call, grad, vmap

    cfg = TrainConfig.load(run_dir / "config.yaml")          # plain OLMo can read our run's config
    cfg.model.init_device = "cpu"
    model = OLMo(cfg.model)
    state = torch.load(run_dir / f"step{ckpt_step}-unsharded" / "model.pt", weights_only=True)
    model.load_state_dict(state)
    params = {k: v.detach() for k, v in model.named_parameters()}
    tokens = torch.from_numpy(data.reshape(-1, SEQ)[ids].astype(np.int64))

    def loss_one(p, toks):
        logits = functional_call(model, p, (toks[None],)).logits
        return torch.nn.functional.cross_entropy(logits[0, :-1], toks[1:], reduction="sum")

    return vmap(grad(loss_one), in_dims=(None, 0))(params, tokens)


TIED = ("--model.weight_tying=true", "--tda.capture.embeddings=true")
"""OLMo-1B's head: logits = F.linear(x, wte.weight); the store's wte rows hold the table's whole
per-example gradient (lookup and head), checked against torch.func below."""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_store_is_complete_and_exact(data_dir, strategy):
    run = f"run_{strategy}"
    # OLMo's unsharded FSDP checkpoint (full state dict, offload_to_cpu) segfaults inside torch on a
    # CPU-only build, so the FSDP run saves none; its oracle is the DDP run's step-3 checkpoint
    # (same seed, same data order: the two runs follow the same trajectory up to float rounding).
    save = "--save_interval_unsharded=3" if strategy == "ddp" else "--save_interval_unsharded=null"
    args = [f"--distributed_strategy={strategy}", save, "--tda.trajectory.enabled=true", "--tda.trajectory.every=3",
            *TIED, "--try_load_latest_save=true", "--save_overwrite=false"]
    env = None
    if strategy == "fsdp":     # saving no checkpoint, a Slurm job's attempt stopped at step 2; its requeue starts over
        _run(_overrides(data_dir, run, 2, *args, "--seed=7"), nproc=2, env={"SLURM_JOB_ID": "5150"})
        _as_stopped(data_dir / run)
        env = {"SLURM_JOB_ID": "5150", "SLURM_RESTART_COUNT": "1"}
    _run(_overrides(data_dir, run, 6, *args), nproc=2, env=env)
    run_dir = data_dir / run
    store = GradientStore.open(run_dir / "tda" / "store")
    block = store.read_all()
    keys = list(zip(block.ids.tolist(), block.steps.tolist()))
    assert len(keys) == len(set(keys)), "duplicate (id, step) rows"
    for step in range(1, 7):                                 # every consumed id, exactly once per step
        assert np.array_equal(np.sort(block.ids[block.steps == step]), _expected_ids(run_dir, step)), step
    assert sorted({s.rank for s in store.shards}) == [0, 1]   # both ranks wrote their own examples
    # each rank divides by its own tokens and DDP/FSDP average the 2 ranks: a row's share of the update
    # is 1 / (the global batch's tokens), what in-run TracIn weights it by (was the per-rank count, 2x off)
    assert np.allclose(block.loss_scale, GBS * SEQ)

    # step 4 used the weights saved at step 3: stored unprojected gradients == exact ones
    if strategy == "fsdp" and not (data_dir / "run_ddp" / "step3-unsharded").exists():
        _run(_overrides(data_dir, "run_ddp", 6, "--distributed_strategy=ddp", "--save_interval_unsharded=3", *TIED),
             nproc=2)

    # trajectory checkpoints hold the full weights (FSDP: gathered on rank 0), as OLMo's own step-3 checkpoint
    from safetensors.torch import load_file

    from olmo_tda.training.trajectory import Trajectory

    assert [c.step for c in Trajectory.list(run_dir / "tda" / "trajectory")] == [0, 3, 6]
    olmo_step3 = torch.load(data_dir / "run_ddp" / "step3-unsharded" / "model.pt", weights_only=True)
    kept = load_file(str(run_dir / "tda" / "trajectory" / "step00000003" / "model.safetensors"))
    assert set(kept) == set(olmo_step3)
    assert max(rel_err(kept[k], olmo_step3[k]) for k in kept) < 1e-5
    data = np.memmap(data_dir / "data" / "train.npy", dtype=np.uint16, mode="r")
    rows = np.flatnonzero(block.steps == 4)
    ids = block.ids[rows]
    exact = _exact_grads_from_checkpoint(data_dir / "run_ddp", 3, ids, data)
    assert "transformer.wte" in store.layers and "transformer.ff_out" not in store.layers   # tied: no Linear head
    for name in store.layers:
        want = exact[f"{name}.weight"]
        err = rel_err(block.grads[name][rows], want.transpose(1, 2) if name.endswith("wte") else want)
        assert err < 1e-4, (name, err)

    # tda/metrics.jsonl's step-4 loss is the run's (both ranks' tokens at θ_3), not rank 0's own, on a
    # step OLMo does not log (console_log_interval=1000)
    from olmo.config import TrainConfig
    from olmo.model import OLMo

    cfg = TrainConfig.load(data_dir / "run_ddp" / "config.yaml")
    cfg.model.init_device = "cpu"
    model = OLMo(cfg.model)
    model.load_state_dict(olmo_step3)
    tokens = torch.from_numpy(data.reshape(-1, SEQ)[_expected_ids(run_dir, 4)].astype(np.int64))
    with torch.no_grad():
        logits = model(tokens).logits
    # OLMo's loss: the CE sum over the batch divided by its tokens (B·SEQ, not the B·(SEQ-1) predictions)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(),
                                             reduction="sum").item() / tokens.numel()
    logged = {json.loads(x)["step"]: json.loads(x) for x in (run_dir / "tda" / "metrics.jsonl").read_text().splitlines()}
    assert abs(logged[4]["train/CrossEntropyLoss"] / want - 1) < 1e-4, (logged[4]["train/CrossEntropyLoss"], want)
    # the capture counters are the run's (both ranks' rows), as the store holds them
    assert [logged[s]["tda/rows_captured"] for s in range(1, 7)] == \
        [float((block.steps <= s).sum()) for s in range(1, 7)]


def test_sigkill_and_resume_leaves_no_duplicates_or_gaps(data_dir):
    run_dir = data_dir / "run_kill"
    args = _overrides(data_dir, "run_kill", 14, "--save_interval_unsharded=4", "--tda.store.flush_every=1")
    cmd = [sys.executable, "-m", "olmo_tda.cli", "train", str(ROOT / "configs" / "demo_tiny.yaml"), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    try:                                        # kill once steps past the step-8 checkpoint are stored
        while time.monotonic() < deadline:
            store_dir = run_dir / "tda" / "store"
            if (run_dir / "step8-unsharded").exists() and store_dir.exists():
                try:
                    if GradientStore.open(store_dir).steps.max(initial=0) >= 10:
                        break
                except Exception:   # noqa: BLE001 - a store mid-creation may not open yet
                    pass
            assert proc.poll() is None, "training ended before it could be killed"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_steps = GradientStore.open(run_dir / "tda" / "store", repair=True).steps
    assert killed_steps.max() >= 10 and not (run_dir / "step14-unsharded").exists()

    _run(args + [f"--load_path={run_dir / 'step8-unsharded'}"])
    block = GradientStore.open(run_dir / "tda" / "store").read_all(layers=[])
    keys = list(zip(block.ids.tolist(), block.steps.tolist()))
    assert len(keys) == len(set(keys)), "duplicate (id, step) rows after resume"
    assert sorted(set(block.steps.tolist())) == list(range(1, 15)), "missing steps after resume"
    for step in range(1, 15):
        assert np.array_equal(np.sort(block.ids[block.steps == step]), _expected_ids(run_dir, step)), step
    # the logged row count goes on from the checkpoint's, as if never interrupted
    logged = [json.loads(x) for x in (run_dir / "tda" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, 15))
    assert [m["tda/rows_captured"] for m in logged] == [float(s * GBS) for s in range(1, 15)]


def test_disabled_is_plain_olmo(data_dir):
    """tda.enabled=false: no hooks, no store, and the same losses as OLMo's own Trainer; enabled
    capture does not change them either."""
    import torch.distributed as dist
    from olmo.train import Trainer

    from olmo_tda.integrations import olmo_train
    from olmo_tda.integrations.olmo import load_configs

    losses = {}
    for name, enabled, cls in (("olmo", False, Trainer), ("off", False, None), ("on", True, None)):
        cfg, tda = load_configs(ROOT / "configs" / "demo_tiny.yaml",
                                _overrides(data_dir, f"run_parity_{name}", 5, f"--tda.enabled={str(enabled).lower()}"))
        device = olmo_train.init_distributed()
        trainer = olmo_train.build_trainer(cfg, tda, device, trainer_cls=cls)
        hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in trainer.model.modules())
        assert (hooks > 0) == enabled, (name, hooks)
        got = []
        for batch in trainer.train_loader:
            trainer.global_step += 1
            got.append(trainer.train_step(batch)["train/CrossEntropyLoss"])
            if trainer.global_step == 5:
                break
        trainer.close()
        losses[name] = got
    dist.destroy_process_group()
    assert losses["olmo"] == losses["off"] == losses["on"]
    assert not (data_dir / "run_parity_off" / "tda").exists() and (data_dir / "run_parity_on" / "tda").exists()


def test_capture_stats_reach_wandb_offline(data_dir, tmp_path):
    """tda/* step metrics go through OLMo's own W&B logging (offline here: no network) and its console
    (set up as OLMo's train script does), not buried under warnings nobody can act on."""
    run_dir = data_dir / "run_wandb"
    done = _run(_overrides(data_dir, "run_wandb", 3, "--wandb.project=olmo-tda-test", "--wandb.log_interval=1",
                           "--save_interval_unsharded=null", "--console_log_interval=1"),
                env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    console = done.stdout
    assert all(f"[step={s}/3,epoch=0]" in console for s in (1, 2, 3)), console[-3000:]
    assert console.count("tda/rows_captured=") == 3 and "tda/examples_per_s=" in console
    assert "register_new_resolver" not in done.stdout + done.stderr
    assert "Disabling autocast" not in done.stdout + done.stderr
    files = list((run_dir / "wandb").rglob("*.wandb"))
    assert files, "no offline W&B run was written"
    blob = files[0].read_bytes()
    for key in ("tda/rows_captured", "tda/examples_per_s", "tda/bytes_written", "tda/rows_skipped_nonfinite",
                "train/CrossEntropyLoss"):
        assert key.encode() in blob, key
    lines = [json.loads(x) for x in (run_dir / "tda" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3] and lines[-1]["tda/rows_captured"] == 3 * GBS


def _train(args: list[str], cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    """``olmo-tda train`` in one process, whatever its exit status."""
    return run_module("olmo_tda.cli", ["train", str(ROOT / "configs" / "demo_tiny.yaml"), *args], timeout=300, cwd=cwd,
                      env={**outside_slurm_env(), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})})


def test_train_quiet_keeps_warnings_and_drops_olmos_info_lines(data_dir):
    """``olmo-tda -q train``: the run trains and stores as without it, and its console holds no INFO
    line of OLMo's (the run without -q does: its step lines), while a warning still shows (here: the
    second run starting over the first with save_overwrite)."""
    args = _overrides(data_dir, "run_quiet", 2, "--save_interval_unsharded=null", "--save_overwrite=true")
    outs = []
    for flag in ([], ["-q"]):
        done = run_module("olmo_tda.cli", [*flag, "train", str(ROOT / "configs" / "demo_tiny.yaml"), *args],
                          timeout=300, cwd=ROOT, env={**outside_slurm_env(), "OMP_NUM_THREADS": "1",
                                                      "WANDB_MODE": "offline"})
        assert done.returncode == 0, done.stderr[-3000:]
        assert GradientStore.open(data_dir / "run_quiet" / "tda" / "store").num_rows == 2 * GBS
        outs.append((done.stdout + done.stderr).splitlines())
    loud, quiet = outs
    assert any("\tINFO\t" in line for line in loud) and not any("\tINFO\t" in line for line in quiet), quiet[:20]
    assert any("\tWARNING\t" in line and "a fresh start over the old run" in line for line in quiet), quiet[:20]


def test_append_ms_is_the_slowest_ranks(data_dir):
    """2 ranks, rank 1's store append 80 ms slower (tests/_slow_append_worker.py): every step's
    tda/append_ms in metrics.jsonl (rank 0 writes it) is at least that, though rank 0's own appends
    take well under a millisecond."""
    run_dir = data_dir / "run_slow_append"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "_slow_append_worker.py"), "train", str(ROOT / "configs" / "demo_tiny.yaml"),
           *_overrides(data_dir, "run_slow_append", 3, "--save_interval_unsharded=null")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**outside_slurm_env(), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logged = [json.loads(x) for x in (run_dir / "tda" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    assert all(m["tda/append_ms"] >= 80 for m in logged), [m["tda/append_ms"] for m in logged]


def test_a_requeued_job_starts_over_the_run_it_left_without_a_checkpoint(data_dir):
    """A Slurm job stopped before its run's first checkpoint, requeued (the same command) with
    save_overwrite: false: the run starts over, and its store holds each step's rows once. A run that
    saves no checkpoint at all records its end, and a start after that end is refused, leaving it as
    it was (the stopped attempt is that run without the record)."""
    run_dir = data_dir / "run_requeue"
    args = _overrides(data_dir, "run_requeue", 2, "--save_interval_unsharded=null", "--try_load_latest_save=true",
                      "--save_overwrite=false")
    job = {"SLURM_JOB_ID": "4242"}
    assert _train(args + ["--seed=7"], env=job).returncode == 0      # (its config edited before the requeue)
    assert not list(run_dir.glob("step*")) and GradientStore.open(run_dir / "tda" / "store").num_rows == 2 * GBS
    saved = yaml.safe_load((run_dir / "tda.yaml").read_text())
    assert saved["finished"] == {"step": 2}
    store = (run_dir / "tda" / "store" / "store.json").read_bytes()
    ended = _train(args, env={**job, "SLURM_RESTART_COUNT": "1"})
    assert ended.returncode != 0
    assert "holds a run that ended without saving a checkpoint" in ended.stderr + ended.stdout
    assert (run_dir / "tda" / "store" / "store.json").read_bytes() == store
    _as_stopped(run_dir)
    requeued = _train(args, env={**job, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr[-4000:]
    assert "starting it over" in requeued.stdout + requeued.stderr
    block = GradientStore.open(run_dir / "tda" / "store").read_all(layers=[])
    for step in (1, 2):
        assert np.array_equal(np.sort(block.ids[block.steps == step]), _expected_ids(run_dir, step)), step
    assert len(block.ids) == 2 * GBS
    store = (run_dir / "tda" / "store" / "store.json").read_bytes()
    again = _train(args, env={**job, "SLURM_RESTART_COUNT": "1"})      # it ended again
    assert again.returncode != 0 and "ended without saving a checkpoint" in again.stderr + again.stdout
    assert (run_dir / "tda" / "store" / "store.json").read_bytes() == store


def _restart_setup(data_dir: Path, name: str, **env) -> tuple[Path, list[str], dict]:
    """A run of 4 steps that saves no checkpoint (none before step 0 either) under
    ``tests/_restart_worker.py``: its folder, the ``olmo-tda train`` arguments, and the environment
    (torchrun's store not shared with the workers, as restarts need: see torchrun_restart_warning)."""
    run_dir = data_dir / f"run_{name}"
    marks = data_dir / f"marks_{name}"
    marks.mkdir()
    args = _overrides(data_dir, f"run_{name}", 4, "--save_interval_unsharded=null", "--save_interval=null",
                      "--no_pre_train_checkpoint=true", "--try_load_latest_save=true", "--save_overwrite=false",
                      "--tda.store.flush_every=1")
    return run_dir, [str(ROOT / "tests" / "_restart_worker.py"), "olmo", str(ROOT / "configs" / "demo_tiny.yaml"),
                     *args], {**outside_slurm_env(), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
                              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "RESTART_TEST_MARKS": str(marks),
                              "RESTART_TEST_SHARDS": str(run_dir / "tda" / "store" / "shards"), **env}


def test_a_torchrun_restart_starts_over_the_run_stopped_before_its_first_checkpoint(data_dir):
    """torchrun --max_restarts=1 on 2 ranks, no_pre_train_checkpoint and save_overwrite: false: attempt
    0's rank 1 dies in step 3 with the rows of steps 1-2 stored and no checkpoint; torchrun restarts
    both ranks and the restart starts the run over: the store ends with each step's rows of OLMo's data
    order once. A later torchrun over the folder of a run stopped before its first checkpoint starts
    it over again."""
    run_dir, worker, env = _restart_setup(data_dir, "torchrun_restart")

    def launch(max_restarts: int) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--max_restarts={max_restarts}", *worker]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)

    done = launch(max_restarts=1)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "rank 1 of attempt 0 dies now" in out and "stopped before its first checkpoint: starting it over" in out, \
        out[-6000:]
    assert "shares its rendezvous store" not in out
    assert not list(run_dir.glob("step*"))
    saved = yaml.safe_load((run_dir / "tda.yaml").read_text())
    assert saved["finished"] == {"step": 4}
    block = GradientStore.open(run_dir / "tda" / "store").read_all(layers=[])
    for step in (1, 2, 3, 4):
        assert np.array_equal(np.sort(block.ids[block.steps == step]), _expected_ids(run_dir, step)), step
    assert len(block.ids) == 4 * GBS
    _as_stopped(run_dir)
    again = launch(max_restarts=0)
    assert again.returncode == 0 and "starting it over" in again.stdout + again.stderr, again.stderr[-4000:]
    block = GradientStore.open(run_dir / "tda" / "store").read_all(layers=[])
    assert sorted(block.steps.tolist()) == sorted([1, 2, 3, 4] * GBS)


@pytest.mark.slow  # two torchrun agents, a rendezvous and a membership restart: about a minute on 2 cores
def test_a_torchrun_restart_for_a_change_of_nodes_starts_the_run_over(data_dir):
    """Two torchrun "nodes" (one rank each, c10d rendezvous, --max_restarts=1): in attempt 0 rank 1
    dies in step 3 while rank 0 hangs there (as a rank blocked in a collective on a GPU does), so rank
    0's agent restarts it for the change of nodes, its restart count still 0, while the other agent
    counts a failure. Rank 0's new worker is then a restart of its agent's run (a new worker at the
    same count) and starts the run over: each step's rows of OLMo's data order end in the store once."""
    run_dir, worker, env = _restart_setup(data_dir, "torchrun_nodes", RESTART_TEST_HANG="1")
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=nodes", "--max_restarts=1", *worker]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
             for _ in range(2)]
    try:
        outs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    out = "\n".join(outs)
    assert all(node.returncode == 0 for node in nodes), out[-8000:]
    assert "rank 1 of attempt 0 dies now" in out and "rank 0 of attempt 0 hangs now" in out
    assert "stopped before its first checkpoint: starting it over" in out, out[-8000:]
    saved = yaml.safe_load((run_dir / "tda.yaml").read_text())
    assert saved["finished"] == {"step": 4}
    block = GradientStore.open(run_dir / "tda" / "store").read_all(layers=[])
    for step in (1, 2, 3, 4):
        assert np.array_equal(np.sort(block.ids[block.steps == step]), _expected_ids(run_dir, step)), step
    assert len(block.ids) == 4 * GBS


def test_a_requeued_job_resumes_its_outside_load_path_again(data_dir):
    """A job that continued another run (load_path outside its own folder), stopped before its first
    checkpoint and requeued (any later start does the same): it resumes that load_path again, and the rows its first attempt stored
    past the loaded step are cut, so its store holds steps 3-4 once each, of the requeue's data order
    (the first attempt ran with another seed: leftover rows would show as wrong ids)."""
    source = data_dir / "run_source"
    assert _train(_overrides(data_dir, "run_source", 2, "--save_interval_unsharded=2")).returncode == 0
    ckpt = source / "step2-unsharded"
    run_dir = data_dir / "run_requeue_load"
    args = _overrides(data_dir, "run_requeue_load", 4, "--save_interval_unsharded=null", f"--load_path={ckpt}",
                      "--save_overwrite=false")
    job = {"SLURM_JOB_ID": "4343"}
    first = _train(args + ["--seed=7"], env=job)
    assert first.returncode == 0, first.stderr[-4000:]
    assert not list(run_dir.glob("step*"))
    _as_stopped(run_dir)
    assert sorted(set(GradientStore.open(run_dir / "tda" / "store").read_all(layers=[]).steps.tolist())) == [3, 4]
    requeued = _train(args, env={**job, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr[-4000:]
    assert f"starting it over from load_path (its rows past that step are cut): {ckpt}" in \
        requeued.stdout + requeued.stderr
    block = GradientStore.open(run_dir / "tda" / "store").read_all(layers=[])
    assert len(block.ids) == 2 * GBS and sorted(set(block.steps.tolist())) == [3, 4]
    for step in (3, 4):
        assert np.array_equal(np.sort(block.ids[block.steps == step]), _expected_ids(run_dir, step)), step


def test_a_run_folder_is_overwritten_resumed_or_refused_never_mixed(data_dir, tmp_path):
    """OLMo's start rules, with the TDA outputs kept consistent with the checkpoints: a folder that
    holds a run needs save_overwrite; a fresh start over it leaves nothing of the old run (store,
    trajectory, checkpoints); a refused resume leaves the folder as it was; try_load_latest_save
    resumes. Relative paths are saved absolute, and the metrics stay in tda/ wherever the store is."""
    run = data_dir / "run_reuse"
    data = os.path.relpath(data_dir / "data" / "train.npy", tmp_path)
    args = [a for a in _overrides(data_dir, "run_reuse", 4) if not a.startswith("--data.paths")]
    args += [f"--data.paths=[{data}]", "--save_interval_unsharded=2", "--tda.trajectory.enabled=true",
             "--tda.trajectory.schedule=lr", "--tda.trajectory.every=2", "--tda.store.path=store_elsewhere"]
    from olmo_tda.config import TrajectoryConfig
    from olmo_tda.training.trajectory import Trajectory

    def stored(store_dir):
        block = GradientStore.open(store_dir).read_all(layers=[])
        return sorted(zip(block.steps.tolist(), block.ids.tolist())), set(block.lr.tolist())

    def uninterrupted_trajectory(store_dir):
        """The steps schedule `lr` keeps in one uninterrupted pass over the stored steps' lrs."""
        block = GradientStore.open(store_dir).read_all(layers=[])
        lr = dict(zip(block.steps.tolist(), block.lr.tolist()))
        sim = Trajectory(TrajectoryConfig(enabled=True, schedule="lr", every=2), tmp_path / "sim")
        return [s for s in range(max(lr) + 1) if sim.due(s, lr.get(s, 0.0))]

    assert _train(args + ["--optimizer.learning_rate=0.003"], cwd=tmp_path).returncode == 0
    store_dir = tmp_path / "store_elsewhere"
    first, lrs = stored(store_dir)
    assert {s for s, _ in first} == {1, 2, 3, 4} and (run / "step4-unsharded").is_dir()
    assert (run / "tda" / "metrics.jsonl").is_file() and not (store_dir.parent / "metrics.jsonl").exists()
    saved = (run / "config.yaml").read_text() + (run / "tda.yaml").read_text()
    assert str(data_dir / "data" / "train.npy") in saved and str(store_dir) in saved     # absolute

    refused = _train(args + ["--save_overwrite=false"], cwd=tmp_path)
    assert refused.returncode != 0 and "already holds a run" in refused.stderr + refused.stdout
    tda_yaml = (run / "tda.yaml").read_bytes()
    bad_resume = _train(args + [f"--load_path={run / 'step2-unsharded'}", "--tda.capture.seed=7"], cwd=tmp_path)
    assert bad_resume.returncode != 0 and (run / "tda.yaml").read_bytes() == tda_yaml
    # a dry run from an earlier checkpoint restores it and stops: nothing of the run is cut back
    metrics = (run / "tda" / "metrics.jsonl").read_bytes()
    dry = _train(args + [f"--load_path={run / 'step2-unsharded'}", "--dry_run=true"], cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert stored(store_dir)[0] == first and (run / "tda" / "metrics.jsonl").read_bytes() == metrics
    assert (run / "tda.yaml").read_bytes() == tda_yaml

    # a fresh start over the old run, 2 steps at another learning rate: nothing of the first is left
    again = [a.replace("--max_duration=4", "--max_duration=2").replace("--stop_at=4", "--stop_at=2") for a in args]
    assert _train(again + ["--optimizer.learning_rate=0.03"], cwd=tmp_path).returncode == 0
    second, lrs2 = stored(store_dir)
    assert {s for s, _ in second} == {1, 2} and len(second) == len(set(second)) == 2 * GBS
    assert not (run / "step4-unsharded").exists() and lrs2.isdisjoint(lrs)
    steps = [json.loads(x)["step"] for x in (run / "tda" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert [c.step for c in Trajectory.list(run / "tda" / "trajectory")] == uninterrupted_trajectory(store_dir)

    # try_load_latest_save: on from the latest checkpoint to step 8, each step once
    more = [a.replace("--max_duration=4", "--max_duration=8").replace("--stop_at=4", "--stop_at=8") for a in args]
    assert _train(more + ["--try_load_latest_save=true", "--optimizer.learning_rate=0.03"],
                  cwd=tmp_path).returncode == 0
    third, _ = stored(store_dir)
    assert {s for s, _ in third} == set(range(1, 9)) and len(third) == len(set(third)) == 8 * GBS
    for step in range(1, 9):
        assert sorted(i for s, i in third if s == step) == _expected_ids(run, step).tolist(), step
    # the lr schedule's sums (mid-way at step 2, under warmup) came back with the checkpoint: the same
    # steps as one uninterrupted pass (restarted sums keep [0, 5, ...] here)
    kept = [c.step for c in Trajectory.list(run / "tda" / "trajectory")]
    assert kept == uninterrupted_trajectory(store_dir) and kept[-1] > 2, kept
    # the same command again (a requeue after the job finished): at its end, nothing is trained
    # (OLMo's fit would train and store one step past stop_at)
    done = _train(more + ["--try_load_latest_save=true", "--optimizer.learning_rate=0.03"], cwd=tmp_path)
    assert done.returncode == 0 and "nothing to train" in done.stdout + done.stderr, done.stderr[-3000:]
    assert stored(store_dir)[0] == third and not (run / "step9-unsharded").exists()

    # back to an earlier checkpoint of the same run: the steps after it run again, and the store and
    # the metrics hold each step once (the abandoned steps' rows are cut, not appended after)
    redo = _train(more + [f"--load_path={run / 'step6-unsharded'}", "--optimizer.learning_rate=0.03"], cwd=tmp_path)
    assert redo.returncode == 0, redo.stderr[-3000:]
    fourth, _ = stored(store_dir)
    assert {s for s, _ in fourth} == set(range(1, 9)) and len(fourth) == len(set(fourth)) == 8 * GBS
    steps = [json.loads(x)["step"] for x in (run / "tda" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)), steps

    # resuming this run's checkpoint into another folder, with its own store: said, not silent
    other = [a.replace(str(run), str(data_dir / "run_reuse_other")).replace("store_elsewhere", "store_other")
             .replace("--max_duration=8", "--max_duration=9").replace("--stop_at=8", "--stop_at=9") for a in more]
    done = _train(other + [f"--load_path={run / 'step6-unsharded'}", "--optimizer.learning_rate=0.03"], cwd=tmp_path)
    assert done.returncode == 0 and "whose run stored its gradients in" in done.stdout + done.stderr
    # that store now holds steps 7-9 of its own: resuming the first run's step 8 there is refused (its
    # rows of steps 7-8 would stay beside the first run's history); rows only after the step would be cut
    held, _ = stored(tmp_path / "store_other")
    mixed = _train(other + [f"--load_path={run / 'step8-unsharded'}", "--optimizer.learning_rate=0.03"],
                   cwd=tmp_path)
    assert mixed.returncode != 0 and "continuing would mix the two runs' rows" in mixed.stdout + mixed.stderr
    assert stored(tmp_path / "store_other")[0] == held and {s for s, _ in held} == {7, 8, 9}

    # roll back to step 4 and stop at 6: step8-unsharded is now of an abandoned timeline, its rows of
    # steps 7-8 cut; try_load_latest_save picks it (the highest step) and is refused, not left with a gap
    back = [a.replace("--stop_at=8", "--stop_at=6") for a in more]
    assert _train(back + [f"--load_path={run / 'step4-unsharded'}", "--optimizer.learning_rate=0.03"],
                  cwd=tmp_path).returncode == 0
    assert {s for s, _ in stored(store_dir)[0]} == set(range(1, 7)) and (run / "step8-unsharded").is_dir()
    stale = _train(more + ["--try_load_latest_save=true", "--optimizer.learning_rate=0.03"], cwd=tmp_path)
    out = stale.stdout + stale.stderr
    assert stale.returncode != 0, out[-2000:]
    assert "the checkpoint of step 8 belongs to an abandoned run: a later resume cut the store back to step 4" in out
    assert {s for s, _ in stored(store_dir)[0]} == set(range(1, 7))            # nothing was cut or added


def test_a_failing_rank_ends_the_job_with_its_own_error(data_dir):
    """Rank 1 raises at step 3: the job ends promptly (no rank waits in a barrier for it until the
    process group times out) and the output carries the real error."""
    args = _overrides(data_dir, "run_fault", 6, "--save_interval_unsharded=null")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "_olmo_fault_worker.py"), "train", str(ROOT / "configs" / "demo_tiny.yaml"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=80, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"})
    assert done.returncode != 0
    assert "injected: disk full on rank 1" in done.stdout + done.stderr
