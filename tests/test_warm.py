"""The tests' warm runner (``_warm.run_module``) behaves as the ``python -m`` it stands in for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _warm import run_module
from conftest import DS_EXAMPLE, outside_slurm_env

ROOT = Path(__file__).resolve().parents[1]


def _env(**more: str) -> dict[str, str]:
    return {**outside_slurm_env(), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **more}


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else ""


@pytest.mark.parametrize("argv", [
    ["train", str(ROOT / "configs" / "demo_tiny.yaml"), "--tda.capture.proj_dimm=8"],    # a bad key
    ["inspect", "no_such_store"],                                                        # relative to cwd
    ["attribute"],                                                                       # argparse usage
])
def test_a_warm_run_ends_as_a_cold_one(tmp_path, argv):
    cold = subprocess.run([sys.executable, "-m", "olmo_tda.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=_env(), cwd=tmp_path)
    warm = run_module("olmo_tda.cli", argv, env=_env(), cwd=tmp_path, timeout=120)
    assert cold.returncode != 0
    assert (warm.returncode, _last_line(warm.stderr), warm.stdout) == \
        (cold.returncode, _last_line(cold.stderr), cold.stdout)


def test_a_warm_run_reads_its_own_working_directory(tmp_path):
    """Through the DeepSpeed entry's preloaded process: a relative config path is found in the run's
    working directory, the script's usage error is its exit status, and nothing the preloaded process
    printed (importing DeepSpeed warns) leaks into a run's output."""
    (tmp_path / "bad.yaml").write_text("stepz: 3\n")
    cold = subprocess.run([sys.executable, str(DS_EXAMPLE), "bad.yaml"],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    for _ in range(2):
        done = run_module(str(DS_EXAMPLE), ["bad.yaml"], env=_env(), cwd=tmp_path,
                          timeout=120)
        assert done.returncode == cold.returncode == 2 and "unknown top-level keys ['stepz']" in done.stderr
        assert (done.stdout, done.stderr) == (cold.stdout, cold.stderr)


def test_a_warm_run_past_its_timeout_is_killed_and_the_next_run_is_served(tmp_path):
    data = tmp_path / "train.npy"
    from olmo_tda.demo.corpus import build_passages
    from olmo_tda.demo.data import write_memmap

    write_memmap(build_passages(64, 32, seed=3), data, 32)
    argv = ["train", str(ROOT / "configs" / "demo_tiny.yaml"), f"--data.paths=[{data}]",
            f"--save_folder={tmp_path / 'run'}", "--max_duration=1000", "--stop_at=1000", "--model.d_model=64",
            "--model.n_heads=4", "--model.max_sequence_length=32", "--global_train_batch_size=4",
            "--device_train_microbatch_size=2", "--save_interval_unsharded=null"]
    with pytest.raises(subprocess.TimeoutExpired):
        run_module("olmo_tda.cli", argv, env=_env(), cwd=tmp_path, timeout=3)
    after = run_module("olmo_tda.cli", ["inspect", "no_such_store"], env=_env(), cwd=tmp_path, timeout=120)
    assert after.returncode != 0 and "no_such_store" in after.stderr


def test_a_run_left_mid_way_does_not_hand_its_reply_to_the_next(tmp_path):
    """An interrupt while a warm run is in flight (pytest-timeout, Ctrl-C): the next run gets its own
    result, not the interrupted run's."""
    import signal

    class Interrupted(Exception):
        pass

    def interrupt(*_):
        raise Interrupted

    slow = ["train", str(ROOT / "configs" / "demo_tiny.yaml"), "--tda.capture.proj_dimm=8"]
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            run_module("olmo_tda.cli", slow, env=_env(), cwd=tmp_path, timeout=120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    after = run_module("olmo_tda.cli", ["inspect", "no_such_store"], env=_env(), cwd=tmp_path, timeout=120)
    assert after.returncode != 0 and "no_such_store" in after.stderr and "proj_dimm" not in after.stderr


def test_startup_variables_that_differ_run_cold(tmp_path):
    """PYTHONPATH is read when an interpreter starts: a run that sets it gets a real process (which
    runs the sitecustomize found there; a forked one would not)."""
    (tmp_path / "sitecustomize.py").write_text("import sys; print('a fresh interpreter', file=sys.stderr)\n")
    done = run_module("olmo_tda.cli", ["inspect", "x"], env=_env(PYTHONPATH=str(tmp_path)), cwd=tmp_path,
                      timeout=120)
    assert done.returncode != 0 and "a fresh interpreter" in done.stderr
    warm = run_module("olmo_tda.cli", ["inspect", "x"], env=_env(), cwd=tmp_path, timeout=120)
    assert warm.returncode == done.returncode and "a fresh interpreter" not in warm.stderr
