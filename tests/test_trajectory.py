"""Trajectory checkpoints on disk: thinned retention (spread, resume), what counts as a checkpoint,
damaged weights, and the lr TracIn-CP weights a checkpoint by when steps were skipped.

Oracles: the retention rule written out by brute force over the saves' ordinals; an uninterrupted
run's kept checkpoints (for a resumed one); the values written (each checkpoint's weights mark its
step and timeline) and the learning rates fed in.
"""

from __future__ import annotations

import errno
import logging
import shutil

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

from conftest import rel_err
from olmo_tda.config import TrajectoryConfig
from olmo_tda.methods.tracin import tracin_cp
from olmo_tda.training.trajectory import Trajectory, TrajectoryError


def _steps(path) -> list[int]:
    return [c.step for c in Trajectory.list(path)]


def _thinned_oracle(num_saves: int, keep: int) -> list[int]:
    """The ordinals ``thinned`` keeps after ``num_saves`` saves, as its docstring states the rule: the
    multiples of 2^j for the smallest j leaving at most keep - 1 of them, plus the newest save."""
    newest = num_saves - 1
    for j in range(64):
        multiples = [o for o in range(num_saves) if o % 2 ** j == 0]
        if len(multiples) <= keep - 1:
            return sorted(set(multiples) | {newest})
    raise AssertionError("unreachable")


def test_thinned_retention_spreads_over_the_whole_run(tmp_path):
    """keep=3 over steps 0..1000 (every 10: saves 0..100) keeps step 0, save 64 (step 640: the middle
    checkpoint moves on as the run grows) and the newest; after every save, the kept set is the rule's,
    with between keep/2 and keep checkpoints at most twice the even spacing apart."""
    for keep in (2, 3, 4, 5, 8):
        cfg = TrajectoryConfig(enabled=True, every=10, retention="thinned", keep=keep)
        traj = Trajectory(cfg, tmp_path / f"k{keep}")
        for s in range(1001):
            traj.maybe_save(s, {"w": torch.zeros(1)}, lrs=[1e-3], tokens_seen=s)
            if s % 10:
                continue
            saves = s // 10 + 1
            kept = _steps(traj.path)
            assert kept == [10 * o for o in _thinned_oracle(saves, keep)], (keep, s, kept)
            assert kept[0] == 0 and kept[-1] == s
            if saves > keep - 1:
                assert keep / 2 <= len(kept) <= keep, (keep, s, kept)
                assert max(np.diff(kept)) <= 2 * s / (keep - 1), (keep, s, kept)
        if keep == 3:
            assert kept == [0, 640, 1000]
        if keep == 8:
            assert kept == [0, 160, 320, 480, 640, 800, 960, 1000]
    ordinals = [c.ordinal for c in Trajectory.list(tmp_path / "k8")]
    assert ordinals == [0, 16, 32, 48, 64, 80, 96, 100]


def _run(cfg: TrajectoryConfig, path, *, last: int, crash_at: int | None = None, resume_at: int | None = None,
         lr=lambda s: 1e-3 * min(1.0, max(s, 1) / 8)):
    """Steps 0..last, each checkpoint's weights [step, timeline]; with ``crash_at``, the process dies after
    that step and a new one resumes from the training checkpoint at ``resume_at`` (its saved state).
    Returns the kept steps after each step from ``crash_at`` on (those of the final timeline)."""
    listings = {}

    def step(traj, s, timeline):
        traj.maybe_save(s, {"w": torch.tensor([float(s), timeline])}, lrs=[lr(s)], tokens_seen=s)

    traj, states = Trajectory(cfg, path), {}
    for s in range((last if crash_at is None else crash_at) + 1):
        step(traj, s, 1.0)
        states[s] = traj.state_dict()                      # what each training checkpoint holds
        listings[s] = _steps(path)
    if crash_at is not None:
        traj = Trajectory(cfg, path)                       # a new process
        traj.resume(resume_at, states[resume_at])
        assert all(s <= resume_at for s in _steps(path))
        for s in range(resume_at + 1, last + 1):
            step(traj, s, 2.0)
            listings[s] = _steps(path)
    return listings


@pytest.mark.parametrize("keep,every,schedule,crash_at,resume_at", [
    (4, 5, "every", 50, 25), (4, 5, "every", 50, 27), (3, 1, "every", 40, 7), (5, 2, "every", 61, 60),
    (6, 3, "every", 70, 0), (4, 1, "every", 33, 32), (3, 2, "log", 70, 9), (5, 3, "lr", 55, 20),
])
def test_a_resumed_thinned_trajectory_ends_with_the_checkpoints_of_an_uninterrupted_one(
        tmp_path, keep, every, schedule, crash_at, resume_at):
    """A run crashed at step ``crash_at`` and resumed from its training checkpoint at ``resume_at``:
    once past ``crash_at``, after every step it keeps exactly the steps (and lrs) the uninterrupted run
    keeps, those up to ``resume_at`` from the first timeline and the rest from the resumed one."""
    cfg = TrajectoryConfig(enabled=True, every=every, schedule=schedule, retention="thinned", keep=keep)
    last = crash_at + 40
    whole = _run(cfg, tmp_path / "whole", last=last)
    resumed = _run(cfg, tmp_path / "resumed", last=last, crash_at=crash_at, resume_at=resume_at)
    for s in range(crash_at, last + 1):
        assert resumed[s] == whole[s], (s, resumed[s], whole[s])
    a, b = Trajectory.list(tmp_path / "whole"), Trajectory.list(tmp_path / "resumed")
    assert [c.step for c in b] == [c.step for c in a]
    assert [(c.ordinal, c.lrs, c.next_lrs) for c in a] == [(c.ordinal, c.lrs, c.next_lrs) for c in b]
    assert [c.load()["w"].tolist() for c in b] == [[float(c.step), 1.0 if c.step <= resume_at else 2.0] for c in b]


def test_resume_without_the_saved_count_warns_for_thinned(tmp_path, caplog):
    cfg = TrajectoryConfig(enabled=True, every=1, retention="thinned", keep=3)
    traj = Trajectory(cfg, tmp_path / "t")
    for s in range(6):
        traj.maybe_save(s, {"w": torch.zeros(1)}, lrs=[1e-3], tokens_seen=s)
    state = {k: v for k, v in traj.state_dict().items() if k != "saves"}   # a state from before save counts
    with caplog.at_level(logging.WARNING, logger="olmo_tda.training.trajectory"):
        Trajectory(cfg, tmp_path / "t").resume(5, state)
    assert "without the saved count" in caplog.text


def test_only_canonically_named_folders_that_agree_with_their_meta_are_checkpoints(tmp_path, caplog):
    """Copies beside the checkpoints (``step00000004.bak``, ``step00000004 copy``, a copy renamed to
    another step) are neither listed, nor scored, nor kept through a resume."""
    traj = Trajectory(TrajectoryConfig(enabled=True, every=4), tmp_path / "t")
    for s in range(9):
        traj.maybe_save(s, {"w": torch.ones(1, 1)}, lrs=[1.0], tokens_seen=s)
    for copy in ("step00000004.bak", "step00000004 copy", "step0000004", "step00000006"):
        shutil.copytree(traj.path / "step00000004", traj.path / copy)
    with caplog.at_level(logging.WARNING, logger="olmo_tda.training.trajectory"):
        ckpts = Trajectory.list(traj.path)
    assert [(c.step, c.path.name) for c in ckpts] == [(0, "step00000000"), (4, "step00000004"), (8, "step00000008")]
    assert "step00000004.bak is not a checkpoint folder" in caplog.text
    assert "step00000006 holds meta.json of step 4, not 6" in caplog.text
    score, _ = tracin_cp(ckpts, lambda c: {"w": c.load()["w"][None]},
                         lambda c: iter([(np.arange(1), {"w": c.load()["w"][None]})]), layers=["w"])
    assert score.item() == 3.0                 # 3 checkpoints x lr 1 x <1, 1>
    Trajectory(TrajectoryConfig(enabled=True, every=4), traj.path).resume(2)
    assert [c.path.name for c in Trajectory.list(traj.path)] == ["step00000000"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_non_finite_weights_are_refused_naming_the_checkpoint_and_tensor(tmp_path, bad, dtype):
    traj = Trajectory(TrajectoryConfig(enabled=True, every=1, dtype=dtype), tmp_path / "t")
    good = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    ckpts = [traj.save(s, good, lrs=[0.5], tokens_seen=0) for s in range(2)]
    damaged = {"a": good["a"].clone(), "b": good["b"].clone()}
    damaged["b"][2] = bad
    ckpts[1] = traj.save(1, damaged, lrs=[0.5], tokens_seen=0)
    assert all(torch.equal(v, good[k]) for k, v in ckpts[0].load().items())
    if bad != bad:                                   # NaN: never a legitimate value, refused on load
        with pytest.raises(TrajectoryError, match=r"step00000001: tensor 'b' .* 1 NaN values"):
            ckpts[1].load()
        with pytest.raises(TrajectoryError, match=r"step00000001: tensor 'b'"):
            tracin_cp(ckpts, lambda c: {"b": c.load()["b"][None, None]},
                      lambda c: iter([(np.arange(1), {"b": c.load()["b"][None, None]})]), layers=["b"])
    else:                                            # inf may be a mask buffer's: loaded; its scores refused
        assert ckpts[1].load()["b"][2] == bad
        with pytest.raises(ValueError, match=r"tracin: scores at checkpoint step 1 \(.*step00000001\)"):
            tracin_cp(ckpts, lambda c: {"b": c.load()["b"][None, None]},
                      lambda c: iter([(np.arange(1), {"b": c.load()["b"][None, None]})]), layers=["b"])


def test_flipped_bytes_in_the_weights_are_refused_naming_the_checkpoint(tmp_path):
    """A byte changed inside a checkpoint's tensor data (the file still parses, the value is finite)
    is caught by the CRC-32 its meta.json keeps (zlib's, over the bytes written: the oracle), before
    TracIn-CP scores with it."""
    import zlib

    traj = Trajectory(TrajectoryConfig(enabled=True, every=1), tmp_path / "t")
    weights = {"w": torch.arange(64.0).reshape(8, 8)}
    ckpts = [traj.save(s, weights, lrs=[0.5], tokens_seen=0) for s in range(2)]
    path = ckpts[1].path / "model.safetensors"
    assert ckpts[1].crc32 == zlib.crc32(path.read_bytes())
    data = bytearray(path.read_bytes())
    data[-9] ^= 0x01                                  # the low bits of a float32 near the end: still finite
    path.write_bytes(bytes(data))
    assert torch.isfinite(__import__("safetensors.torch").torch.load_file(str(path))["w"]).all()
    with pytest.raises(TrajectoryError, match=r"step00000001: model.safetensors is damaged \(checksum"):
        Trajectory.list(traj.path)[1].load()
    with pytest.raises(TrajectoryError, match=r"step00000001: model.safetensors is damaged"):
        tracin_cp(Trajectory.list(traj.path), lambda c: {"w": c.load()["w"][None]},
                  lambda c: iter([(np.arange(1), {"w": c.load()["w"][None]})]), layers=["w"])
    assert torch.equal(ckpts[0].load()["w"], weights["w"])


def test_a_skipped_step_leaves_next_lrs_to_the_next_step_taken(tmp_path):
    """DeepSpeed fp16: step 5 overflowed (no maybe_save; θ_5 = θ_4), so step 6 is the one that used the
    gradients at θ_4 and TracIn-CP weights θ_4 by η_6, also in a run resumed at the skipped step after
    a crashed timeline had set θ_4's next_lrs from its own step 6."""
    lr = {s: 1e-4 * s for s in range(13)}                # warmup: every step's lr differs
    cfg = TrajectoryConfig(enabled=True, every=4)

    def steps(traj, first, last, lr_factor=1.0):
        for s in range(first, last + 1):
            if s != 5:
                traj.maybe_save(s, _marked(s), lrs=[lr_factor * lr[max(s, 1)]], tokens_seen=s)

    traj = Trajectory(cfg, tmp_path / "whole")
    steps(traj, 0, 12)
    ckpts = Trajectory.list(traj.path)
    assert [c.step for c in ckpts] == [0, 4, 8, 12]
    assert [c.next_lrs for c in ckpts] == [[lr[1]], [lr[6]], [lr[9]], None]
    eta = [lr[1], lr[6], lr[9], lr[12]]
    assert [c.tracin_lr for c in ckpts] == eta
    got, _ = tracin_cp(ckpts, lambda c: {"w": c.load()["w"][None]},
                       lambda c: iter([(np.arange(1), {"w": c.load()["w"][None]})]), layers=["w"])
    want = sum(e * (_marked(s)["w"].double() ** 2).sum() for e, s in zip(eta, (0, 4, 8, 12)))
    assert rel_err(got[0, 0], want) < 1e-6

    crashed = Trajectory(cfg, tmp_path / "resumed")
    steps(crashed, 0, 4)
    state = crashed.state_dict()                         # the checkpoint at step 5 holds the state of step 4
    steps(crashed, 6, 10, lr_factor=3.0)                 # another lr schedule, then the crash
    assert Trajectory.list(crashed.path)[1].next_lrs == [3.0 * lr[6]]
    resumed = Trajectory(cfg, tmp_path / "resumed")
    resumed.resume(5, state)
    steps(resumed, 6, 12)
    assert [(c.step, c.next_lrs) for c in Trajectory.list(resumed.path)] == [(c.step, c.next_lrs) for c in ckpts]


def _marked(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 2), float(step + 1))}


@pytest.mark.parametrize("cause", ["safetensors", "oserror"])
def test_a_failed_write_names_the_checkpoint_and_keeps_the_earlier_ones(tmp_path, monkeypatch, cause):
    """A full disk mid-write: one TrajectoryError (a RuntimeError, which the CLI prints in one line)
    naming the checkpoint and the cause, no ``.tmp`` folder left, the earlier checkpoint loading with
    its exact weights, and the next save (space freed) given the ordinal the failed one would have had."""
    traj = Trajectory(TrajectoryConfig(enabled=True, every=4), tmp_path / "t")
    traj.maybe_save(0, _marked(0), lrs=[1.0], tokens_seen=0)
    real_save_file = safetensors.torch.save_file

    def full_disk(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as f:              # what a real full disk leaves: a partial file
            f.write(b"\0" * 10)
        if cause == "safetensors":                  # safetensors' own wording of ENOSPC
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(TrajectoryError) as info:
        for s in range(1, 5):
            traj.maybe_save(s, _marked(s), lrs=[1.0], tokens_seen=s)
    message = str(info.value)
    assert message.startswith(f"cannot write trajectory checkpoint {traj.path / 'step00000004'}: the disk is full")
    assert "No space left on device" in message and "tda.trajectory.path" in message
    assert sorted(p.name for p in traj.path.iterdir()) == ["step00000000"]
    (kept,) = Trajectory.list(traj.path)
    assert kept.step == 0 and kept.ordinal == 0
    assert torch.equal(kept.load()["w"], _marked(0)["w"])

    monkeypatch.setattr(safetensors.torch, "save_file", real_save_file)
    ckpt = traj.save(4, _marked(4), lrs=[1.0], tokens_seen=4)
    assert ckpt.ordinal == 1 and torch.equal(ckpt.load()["w"], _marked(4)["w"])
    assert _steps(traj.path) == [0, 4]
