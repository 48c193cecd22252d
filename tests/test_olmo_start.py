"""``olmo-tda train``'s start rules over a folder that holds a run (olmo_train._choose_start): what a
fresh start removes, and what it refuses to touch. In-process on a one-rank gloo group; the folders
are built by hand, with real stores and trajectory checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from olmo_tda.config import ConfigError, StoreConfig, TDAConfig
from olmo_tda.integrations import olmo_train
from olmo_tda.store import GradientRecord, GradientStore
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
    with pytest.raises(ConfigError, match="already holds a run"):
        olmo_train._choose_start(_cfg(run, save_overwrite=False), TDAConfig())
    olmo_train._choose_start(_cfg(run, load_path=str(run / "step2")), TDAConfig())      # a resume: untouched
    assert (run / "step2").is_dir() and GradientStore.open(run / "tda" / "store").num_rows == 2
