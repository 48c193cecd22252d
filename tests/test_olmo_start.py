"""``olmo-tda train``'s start rules over a folder that holds a run (olmo_train._choose_start): what a
fresh start removes, and what it refuses to touch. In-process on a one-rank gloo group; the folders
are built by hand, with real stores and trajectory checkpoints. Then the resume itself, for real: a
2-rank FSDP run (torchrun, gloo) restored from OLMo's sharded checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from olmo_tda.config import ConfigError, StoreConfig, TDAConfig
from olmo_tda.integrations import olmo_train
from olmo_tda.store import GradientRecord, GradientStore
from olmo_tda.store import manifest as manifest_module
from olmo_tda.training.trajectory import Trajectory


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    olmo_train.init_distributed()
    yield
    olmo_train.release_distributed()


def _store(path: Path, rows: int = 2) -> Path:
    meta = {"capture": {}, "projector_hash": "h", "layers": [{"name": "a", "shape": [2, 2], "projector": {}}]}
    with GradientStore.create(path, meta, StoreConfig()) as w:
        if rows:
            w.append(GradientRecord(ids=np.arange(rows), step=1, lr=0.1, loss_scale=1.0,
                                    grads={"a": torch.ones(rows, 2, 2)}))
    return path


def _old_run(folder: Path, tda: dict | None = None) -> Path:
    """A folder as a finished run leaves it: config.yaml, tda.yaml, checkpoints, TDA outputs."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("run_name: old\n")
    (folder / "tda.yaml").write_text(yaml.safe_dump({"tda": TDAConfig.from_dict(tda or {}).to_dict()}))
    for name in ("step0", "step2-unsharded", "step2"):
        (folder / name).mkdir()
        (folder / name / "model.pt").write_bytes(b"x")
    os.symlink("step2", folder / "latest")
    (folder / "steps_notes.txt").write_text("mine")                # a user's file that only looks like one
    if not (tda or {}).get("store"):
        _store(folder / "tda" / "store")
    traj = Trajectory(TDAConfig.from_dict({"trajectory": {"enabled": True}}).trajectory, folder / "tda" / "trajectory")
    traj.maybe_save(0, {"w": torch.zeros(1)}, lrs=[0.1], tokens_seen=0)
    (folder / "tda" / "selection").mkdir()
    (folder / "tda" / "metrics.jsonl").write_text("{}\n")
    return folder


def _cfg(folder: Path, **kw) -> SimpleNamespace:
    base = dict(save_folder=str(folder), try_load_latest_save=False, remote_save_folder=None, load_path=None,
                dry_run=False, save_overwrite=True, reset_trainer_state=False, reset_optimizer_state=False)
    return SimpleNamespace(**{**base, **kw})


def test_a_fresh_start_removes_the_old_runs_checkpoints_and_tda_outputs_only(tmp_path):
    run = _old_run(tmp_path / "run")
    olmo_train._choose_start(_cfg(run), TDAConfig())
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "steps_notes.txt", "tda", "tda.yaml"]
    assert list((run / "tda").iterdir()) == []


def test_a_fresh_start_removes_an_old_store_whose_index_has_sealed_segments(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_module, "SEAL_SHARDS", 2)        # a long run's store: index/ holds blocks
    run = _old_run(tmp_path / "run")
    meta = {"capture": {}, "projector_hash": "h", "layers": [{"name": "a", "shape": [2, 2], "projector": {}}]}
    with GradientStore.create(run / "tda" / "store", meta, StoreConfig(flush_every=1)) as w:
        for step in (2, 3, 4):
            w.append(GradientRecord(ids=np.arange(2), step=step, lr=0.1, loss_scale=1.0,
                                    grads={"a": torch.ones(2, 2, 2)}))
    assert any((run / "tda" / "store" / "index").iterdir())
    olmo_train._choose_start(_cfg(run), TDAConfig())
    assert list((run / "tda").iterdir()) == []


def test_a_fresh_start_leaves_a_store_folder_that_holds_more_than_the_store(tmp_path):
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    (outputs / "precious.bin").write_bytes(b"keep")
    _store(outputs)                               # the old run wrote its store into a folder of other files
    run = _old_run(tmp_path / "a", {"store": {"path": str(outputs)}})
    with pytest.raises(ConfigError, match="tda.store.path .* already holds a store"):
        olmo_train._choose_start(_cfg(run), TDAConfig.from_dict({"store": {"path": str(outputs)}}))
    assert (outputs / "precious.bin").read_bytes() == b"keep" and (outputs / "store.json").is_file()
    olmo_train._choose_start(_cfg(run), TDAConfig())      # the new run's store elsewhere: the old one stays
    assert (outputs / "precious.bin").read_bytes() == b"keep" and not (run / "step2").exists()

    run = _old_run(tmp_path / "b", {"store": {"path": str(tmp_path / "b")}})
    _store(run)                                                       # the store is the run folder itself
    olmo_train._choose_start(_cfg(run), TDAConfig())
    assert (run / "store.json").is_file() and GradientStore.open(run).num_rows == 2 and not (run / "step2").exists()


def test_a_relative_path_of_an_older_run_is_left_alone(tmp_path, monkeypatch):
    """Older versions saved tda.store.path as given: relative to a directory no later process knows.
    From another directory the same name is another run's store, which must survive."""
    old_cwd, now = tmp_path / "then", tmp_path / "now"
    for d in (old_cwd, now):
        _store(d / "store")
    run = _old_run(tmp_path / "run", {"store": {"path": "store"}})
    monkeypatch.chdir(now)
    olmo_train._choose_start(_cfg(run), TDAConfig())
    assert GradientStore.open(now / "store").num_rows == 2 and GradientStore.open(old_cwd / "store").num_rows == 2


def test_a_fresh_start_removes_the_store_its_old_run_wrote_not_one_made_there_since(tmp_path):
    """tda.yaml records the id of the store its run wrote: a store another run has made at that path
    since is left alone; the old run's own store (the same id) goes."""
    for replaced in (True, False):
        store = _store(tmp_path / f"store{replaced}")
        run = _old_run(tmp_path / f"run{replaced}", {"store": {"path": str(store)}})
        saved = yaml.safe_load((run / "tda.yaml").read_text())
        saved["store_id"] = GradientStore.open(store).meta["store_id"]
        (run / "tda.yaml").write_text(yaml.safe_dump(saved))
        if replaced:                  # the old store removed by hand, another run's made at its path
            for child in store.iterdir():
                olmo_train._remove(child)
            _store(store, rows=3)
        olmo_train._choose_start(_cfg(run), TDAConfig())
        assert not (run / "step2").exists()
        if replaced:
            assert GradientStore.open(store).num_rows == 3
        else:
            assert not store.exists()


def test_trajectory_debris_and_an_outside_latest_link(tmp_path):
    """A crash mid-rewrite leaves stepN.old.tmp (the old trajectory is still removed); a `latest` link
    to a checkpoint outside the folder is only unlinked, even when that checkpoint is loaded."""
    run = _old_run(tmp_path / "run")
    (run / "tda" / "trajectory" / "step00000000.old.tmp").mkdir()
    elsewhere = tmp_path / "other" / "step5"
    elsewhere.mkdir(parents=True)
    (run / "latest").unlink()
    os.symlink(elsewhere, run / "latest")
    olmo_train._choose_start(_cfg(run, load_path=str(run / "latest"), reset_trainer_state=True), TDAConfig())
    assert elsewhere.is_dir() and not os.path.lexists(run / "latest")
    assert not (run / "tda" / "trajectory").exists()


def test_try_load_latest_save_resumes_even_with_reset_flags(tmp_path):
    """As OLMo's script: a checkpoint found by try_load_latest_save is resumed (reset flags cleared),
    so a run preempted after its first checkpoint neither restarts nor clears itself."""
    run = _old_run(tmp_path / "run")
    cfg = _cfg(run, try_load_latest_save=True, reset_trainer_state=True, reset_optimizer_state=True)
    olmo_train._choose_start(cfg, TDAConfig())
    assert cfg.load_path == str(run / "step2") and not cfg.reset_trainer_state and not cfg.reset_optimizer_state
    assert (run / "step2").is_dir() and GradientStore.open(run / "tda" / "store").num_rows == 2


@pytest.mark.parametrize("load", ["step2", "file://{run}/step2", "step9"])
def test_a_reset_start_never_removes_the_checkpoint_it_loads_nor_runs_on_a_missing_one(tmp_path, load):
    run = _old_run(tmp_path / "run")
    load_path = load.format(run=run) if "://" in load else str(run / load)
    with pytest.raises(ConfigError, match="no such checkpoint" if load == "step9" else "another save_folder"):
        olmo_train._choose_start(_cfg(run, load_path=load_path, reset_trainer_state=True), TDAConfig())
    assert (run / "step2").is_dir() and (run / "tda" / "store").is_dir()


def test_a_new_run_refuses_a_store_or_trajectory_of_another_run(tmp_path):
    other = _store(tmp_path / "other_store")
    with pytest.raises(ConfigError, match="tda.store.path .* already holds a store"):
        olmo_train._choose_start(_cfg(tmp_path / "new"), TDAConfig.from_dict({"store": {"path": str(other)}}))
    _store(tmp_path / "empty_store", rows=0)      # left by a run that failed before its first step: reused
    empty = TDAConfig.from_dict({"store": {"path": str(tmp_path / "empty_store")}})
    olmo_train._choose_start(_cfg(tmp_path / "new"), empty)
    traj = _old_run(tmp_path / "old") / "tda" / "trajectory"
    with pytest.raises(ConfigError, match="tda.trajectory.path .* already holds a trajectory"):
        olmo_train._choose_start(_cfg(tmp_path / "new"), TDAConfig.from_dict({"trajectory": {"path": str(traj)}}))


def test_a_linked_store_is_emptied_through_its_link(tmp_path):
    disk = _store(tmp_path / "big_disk" / "store")
    run = _old_run(tmp_path / "run", {"store": {"path": str(tmp_path / "run" / "tda" / "store")}})
    os.symlink(disk, run / "tda" / "store")
    olmo_train._choose_start(_cfg(run), TDAConfig())
    assert (run / "tda" / "store").is_symlink() and list(disk.iterdir()) == []


def test_a_resume_and_a_held_folder_without_save_overwrite(tmp_path):
    run = _old_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="already holds a run.*--try_load_latest_save"):
        olmo_train._choose_start(_cfg(run, save_overwrite=False), TDAConfig())
    olmo_train._choose_start(_cfg(run, load_path=str(run / "step2")), TDAConfig())      # a resume: untouched
    assert (run / "step2").is_dir() and GradientStore.open(run / "tda" / "store").num_rows == 2


def test_a_requeue_without_save_overwrite_continues_the_run_and_nothing_else(tmp_path):
    """A requeued job (try_load_latest_save, save_overwrite: false as configs/olmo_1b.yaml) continues
    the run from its latest checkpoint, removing nothing; resuming an earlier checkpoint (its later
    ones would be overwritten) still needs save_overwrite, and so does a run that ended without any."""
    run = _old_run(tmp_path / "run")
    cfg = _cfg(run, try_load_latest_save=True, save_overwrite=False)
    assert olmo_train._choose_start(cfg, TDAConfig()) is True
    assert cfg.load_path == str(run / "step2") and (run / "step2-unsharded").is_dir() and (run / "step0").is_dir()
    assert GradientStore.open(run / "tda" / "store").num_rows == 2 and (run / "tda" / "metrics.jsonl").is_file()
    assert olmo_train._choose_start(_cfg(run, load_path=str(run / "latest"), save_overwrite=False), TDAConfig())
    with pytest.raises(ConfigError, match=r"step 0, not the latest checkpoint .* \(step 2\)"):
        olmo_train._choose_start(_cfg(run, load_path=str(run / "step0"), save_overwrite=False), TDAConfig())
    for name in ("step0", "step2", "step2-unsharded", "latest"):
        olmo_train._remove(run / name)
    (run / "tda.yaml").write_text(yaml.safe_dump({**yaml.safe_load((run / "tda.yaml").read_text()),
                                                  "finished": {"step": 2}}))
    with pytest.raises(ConfigError, match="ended without saving a checkpoint: pass --save_overwrite"):
        olmo_train._choose_start(_cfg(run, try_load_latest_save=True, save_overwrite=False), TDAConfig())
    assert GradientStore.open(run / "tda" / "store").num_rows == 2
    assert olmo_train._choose_start(_cfg(tmp_path / "new", try_load_latest_save=True, save_overwrite=False),
                                    TDAConfig()) is False                        # a first start: fresh


def test_a_run_stopped_before_its_first_checkpoint_is_started_over_by_any_start(tmp_path):
    """A run that neither saved a checkpoint nor recorded its end (preempted, crashed, requeued or
    restarted before its first checkpoint) holds nothing a start could resume: any start, without
    save_overwrite and whatever launched it, starts it over, removing its TDA outputs first. A
    continued pretraining from another run's checkpoint resumes that checkpoint again (the resume cuts
    the stopped attempt's rows), or with reset_trainer_state starts over from step 0. Once a checkpoint
    exists, the start resumes it and never starts over."""
    run = _old_run(tmp_path / "run")
    for name in ("step0", "step2", "step2-unsharded", "latest"):
        olmo_train._remove(run / name)

    def start(load_path=None, reset=False):
        cfg = _cfg(run, try_load_latest_save=True, save_overwrite=False, load_path=load_path, reset_trainer_state=reset)
        return olmo_train._choose_start(cfg, TDAConfig())

    (run / "step2").mkdir()
    (run / "step4").mkdir()
    assert start() is True                            # the folder holds checkpoints: resumed, never started over
    for cfg, error in ((_cfg(run, load_path=str(run / "step2"), save_overwrite=False), "not the latest checkpoint"),
                       (_cfg(run, save_overwrite=False), "already holds a run")):
        with pytest.raises(ConfigError, match=error):
            olmo_train._choose_start(cfg, TDAConfig())
    assert (run / "step2").is_dir() and GradientStore.open(run / "tda" / "store").num_rows == 2
    for name in ("step2", "step4"):
        olmo_train._remove(run / name)
    other = tmp_path / "other" / "step3"
    other.mkdir(parents=True)
    assert start(load_path=str(other)) is True
    assert GradientStore.open(run / "tda" / "store").num_rows == 2 and (run / "tda" / "metrics.jsonl").is_file()
    assert start(load_path=str(other), reset=True) is True
    assert list((run / "tda").iterdir()) == [] and other.is_dir()
    _store(run / "tda" / "store")
    assert start() is True                                             # its run, over from step 0
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "steps_notes.txt", "tda", "tda.yaml"]
    assert list((run / "tda").iterdir()) == []
    _store(run / "tda" / "store")
    olmo_train._choose_start(_cfg(run, save_overwrite=False), TDAConfig())     # a plain rerun, too
    assert list((run / "tda").iterdir()) == []


def test_a_torchrun_that_would_restart_over_its_shared_store_is_told_the_fix(monkeypatch):
    """torchrun with --max_restarts > 0 and its rendezvous store shared with the workers (torch's
    default): restarts can fail to form their process group, so the run says to set
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (with it, the agent does not share the store). No restarts,
    or the store not shared: nothing to say."""
    from olmo_tda.integrations import torchrun_restart_warning

    for key in ("TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.delenv(key, raising=False)
    assert torchrun_restart_warning() is None
    for restarts, shared, says in (("3", "True", True), ("0", "True", False), ("3", "False", False),
                                   ("", "True", False), ("x", "True", False)):
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
        warning = torchrun_restart_warning()
        assert (warning is not None) == says, (restarts, shared)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert "--max_restarts=3" in torchrun_restart_warning()
    assert "Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment" in torchrun_restart_warning()
    # set, and the store shared anyway: the static rendezvous (--master_addr/--master_port) always shares it
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    assert "shares it anyway (the static one, --master_addr/--master_port): use --rdzv_backend=c10d" \
        in torchrun_restart_warning()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "²")       # str.isdigit() takes it, int() does not
    assert torchrun_restart_warning() is None


def test_a_sharded_checkpointer_that_cannot_work_here_is_refused_before_training():
    """OLMo's `local` checkpointer raises NotImplementedError under torch >= 2.3 (and `torch_new`'s
    reader does not fit this torch): refused at start, naming the option and the one that works."""
    from olmo.config import DistributedStrategy
    from olmo.config import ShardedCheckpointerType as Kind

    def check(**kw):
        base = dict(load_path=None, load_path_sharded_checkpointer=None, sharded_checkpointer=Kind.torch_legacy,
                    distributed_strategy=DistributedStrategy.fsdp, save_interval=2, save_interval_ephemeral=None,
                    save_num_checkpoints_to_keep=-1)
        olmo_train._check_sharded_checkpointers(SimpleNamespace(**{**base, **kw}))

    check()
    with pytest.raises(ConfigError, match="sharded_checkpointer=local would save .*: use sharded_checkpointer="
                                          "torch_legacy"):
        check(sharded_checkpointer=Kind.local)
    with pytest.raises(ConfigError, match="load_path_sharded_checkpointer=local reads the sharded checkpoint r/step2"
                                          ".*stepN-unsharded"):
        check(load_path="r/step2", load_path_sharded_checkpointer=Kind.local)
    check(load_path="r/step2-unsharded", load_path_sharded_checkpointer=Kind.local)   # not read by it
    check(sharded_checkpointer=Kind.local, distributed_strategy=DistributedStrategy.ddp)  # saves no sharded
    if "torch_new" in olmo_train._broken_checkpointers():      # OLMo 0.6 with torch >= 2.3
        with pytest.raises(ConfigError, match="sharded_checkpointer=torch_new reads"):
            check(load_path="r/step2", sharded_checkpointer=Kind.torch_new, save_interval=None,
                  save_num_checkpoints_to_keep=0)


# --- resuming an FSDP run from OLMo's sharded checkpoints, for real --------------------------------

ROOT = Path(__file__).resolve().parents[1]
SEQ, GBS = 32, 8


def _train_two_ranks(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """``olmo-tda train`` of a tiny OLMo under torchrun, 2 ranks (gloo), whatever its exit status. The
    environment this module's one-rank group set up (RANK, MASTER_PORT, ...) is not passed on."""
    from olmo_tda.demo.corpus import build_passages
    from olmo_tda.demo.data import write_memmap

    data = tmp / "data" / "train.npy"
    if not data.exists():
        write_memmap(build_passages(256, SEQ, seed=3), data, SEQ)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "olmo_tda.cli",
           "train", str(ROOT / "configs" / "demo_tiny.yaml"), f"--data.paths=[{data}]", "--model.d_model=64",
           "--model.n_heads=4", f"--model.max_sequence_length={SEQ}", f"--global_train_batch_size={GBS}",
           "--device_train_microbatch_size=2", "--console_log_interval=1000", "--tda.capture.proj_dim=0",
           "--tda.store.dtype=float32", "--tda.trajectory.enabled=false", *args]
    env = {k: v for k, v in os.environ.items() if k not in olmo_train._ONE_PROCESS_KEYS}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"})


def test_an_fsdp_run_resumes_from_its_sharded_checkpoint(tmp_path):
    """OLMo's sharded FSDP checkpoints pickle torch.distributed's ShardedTensor, which torch's
    weights_only load refuses unless allowlisted. A run of 4 steps saves them at steps 2 and 4; resumed
    from step 2 it runs steps 3-4 again and stores each step once, with the uninterrupted run's rows
    (the same weights, so model, optimizer and RNG state all came back)."""
    run = tmp_path / "run"
    args = [f"--save_folder={run}", "--max_duration=4", "--stop_at=4", "--distributed_strategy=fsdp",
            "--save_interval=2", "--save_num_checkpoints_to_keep=-1", "--save_interval_unsharded=null",
            "--tda.store.flush_every=1"]
    first = _train_two_ranks(tmp_path, *args)
    assert first.returncode == 0, first.stderr[-4000:]
    assert (run / "step2" / "rank1.pt").is_file()
    uninterrupted = GradientStore.open(run / "tda" / "store").read_all()
    # what a resume keeps (a fresh start would remove it): the checkpoint and the shards of steps 1-2
    kept = [run / "step2" / "rank0.pt", *sorted((run / "tda" / "store" / "shards").glob("r0000[01]-0000000[01].h5"))]
    assert len(kept) == 5
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in kept]

    resumed = _train_two_ranks(tmp_path, *args, f"--load_path={run / 'step2'}")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in kept] == before
    block = GradientStore.open(run / "tda" / "store").read_all()
    keys = list(zip(block.ids.tolist(), block.steps.tolist()))
    assert len(keys) == len(set(keys)) == 4 * GBS and set(block.steps.tolist()) == {1, 2, 3, 4}
    order = np.memmap(run / "train_data" / "global_indices.npy", dtype=np.uint32, mode="r")
    want = {key: row for row, key in enumerate(zip(uninterrupted.ids.tolist(), uninterrupted.steps.tolist()))}
    for step in (1, 2, 3, 4):
        assert sorted(block.ids[block.steps == step].tolist()) == sorted(order[(step - 1) * GBS:step * GBS]), step
    rows = [want[key] for key in keys]
    for name in block.grads:
        got, ref = torch.as_tensor(block.grads[name]), torch.as_tensor(uninterrupted.grads[name][rows])
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, name


def test_starting_over_a_stopped_run_never_removes_another_runs_store_nor_a_live_one(tmp_path):
    """A run stopped before its first checkpoint is started over by any start, but without
    save_overwrite only what lies in its folder goes: a store elsewhere that its tda.yaml names (a
    continued run writing into its base run's store) is refused, not removed. And a store whose writer
    lock a live process holds is never removed, with or without save_overwrite."""
    base_store = _store(tmp_path / "base" / "tda" / "store")
    run = _old_run(tmp_path / "run", tda={"store": {"path": str(base_store)}})
    saved = yaml.safe_load((run / "tda.yaml").read_text())
    saved["store_id"] = GradientStore.open(base_store).meta["store_id"]
    (run / "tda.yaml").write_text(yaml.safe_dump(saved))
    for name in ("step0", "step2", "step2-unsharded", "latest"):
        olmo_train._remove(run / name)
    with pytest.raises(ConfigError, match="outside the folder .* pass --save_overwrite"):
        olmo_train._choose_start(_cfg(run, try_load_latest_save=True, save_overwrite=False), TDAConfig())
    assert GradientStore.open(base_store).num_rows == 2

    live = _old_run(tmp_path / "live")
    for name in ("step0", "step2", "step2-unsharded", "latest"):
        olmo_train._remove(live / name)
    writer = GradientStore.create(live / "tda" / "store", {"capture": {}, "projector_hash": "h", "layers": [
        {"name": "a", "shape": [2, 2], "projector": {}}]}, StoreConfig())     # a live writer holds rank 0's lock
    try:
        for overwrite in (False, True):
            with pytest.raises(ConfigError, match="being written by a running process"):
                olmo_train._choose_start(_cfg(live, save_overwrite=overwrite), TDAConfig())
        assert GradientStore.open(live / "tda" / "store").num_rows == 2
    finally:
        writer.close()
    olmo_train._choose_start(_cfg(live, save_overwrite=False), TDAConfig())     # closed: started over
    assert not (live / "tda" / "store").exists()
