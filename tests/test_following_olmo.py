"""A following eigenbasis inside OLMo training, for real: 2-rank DDP and FSDP runs refresh to the same
bits on every rank, stored rows equal exact gradients projected with their own version, and a
SIGKILL between a refresh and the next checkpoint, then a resume, leaves every row under the version
it was captured with and every version's file whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from olmo_tda.capture.following import is_refresh_step, refresh_steps
from olmo_tda.store import GradientStore
from conftest import rel_err
from test_olmo_integration import (GBS, ROOT, _exact_grads_from_checkpoint, _expected_ids, _overrides, _run,
                                   data_dir)  # noqa: F401  (data_dir: the module's fixture)

EVERY = 4
FOLLOW = ("--tda.capture.proj_type=eigen", "--tda.capture.proj_dim=4", f"--tda.capture.basis_every={EVERY}",
          "--tda.capture.basis_batches=1", "--tda.capture.basis_tokens=64")


def _version_steps(store: GradientStore) -> dict[int, str]:
    """``{step: digest}`` of every stored row, checking that each shard's rows share one version."""
    out: dict[int, str] = {}
    for block in store.iter_blocks(layers=[]):
        assert block.basis is not None
        for s in np.unique(block.steps).tolist():
            assert out.setdefault(s, block.basis) == block.basis, f"step {s} under two versions"
    return out


def _first_steps(steps: int) -> list[int]:
    """Steps at which a new version comes in force: 1, and the step after each refresh."""
    return [1] + [s + 1 for s in refresh_steps(EVERY, steps - 1)]


def _check_versions(store: GradientStore, steps: int) -> dict[int, str]:
    by_step = _version_steps(store)
    assert sorted(by_step) == list(range(1, steps + 1))
    changes = [s for s in sorted(by_step) if s == 1 or by_step[s] != by_step[s - 1]]
    assert changes == _first_steps(steps), changes
    for digest in store.bases:                          # every version's file is whole and is that version
        assert store.load_basis(digest).digest == digest
    folder = store.path / "bases"
    assert not list(folder.glob("*.tmp")) and not list(folder.glob(".*"))
    files = {p.stem for p in folder.glob("*.safetensors")}
    # a refresh after the last step makes the version in force from the next: no rows yet
    assert files >= set(store.bases) and len(files) == len(store.bases) + is_refresh_step(steps, EVERY)
    return by_step


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_refresh_to_identical_bases_and_rows_match_their_version(data_dir, strategy):
    run = f"follow_{strategy}"
    save = "--save_interval_unsharded=3" if strategy == "ddp" else "--save_interval_unsharded=null"
    _run(_overrides(data_dir, run, 6, f"--distributed_strategy={strategy}", save, *FOLLOW), nproc=2)
    store = GradientStore.open(data_dir / run / "tda" / "store")
    by_step = _check_versions(store, 6)
    for rank in (0, 1):        # each rank's shards name the same version at the same step: identical bits
        ranks_own = {s: info.basis for info in store.shards if info.rank == rank
                     for s in range(info.step_min, info.step_max + 1)}
        assert ranks_own == by_step, rank
    if strategy == "fsdp":
        return
    # rows of step 4 were taken at the step-3 checkpoint's weights, projected with the version in force
    # at step 4: the same as exact per-example gradients projected with that file's matrices
    run_dir = data_dir / run
    basis = store.load_basis(by_step[4])
    block = store.read_all(steps=[4], basis=by_step[4])
    data = np.memmap(data_dir / "data" / "train.npy", dtype=np.uint16, mode="r")
    assert np.array_equal(np.sort(block.ids), _expected_ids(run_dir, 4))
    exact = _exact_grads_from_checkpoint(run_dir, 3, block.ids, data)
    for name in store.layers:
        lb = basis.layers[name]
        p_out, p_in = lb.proj_out[:4].double(), lb.proj_in[:4].double()
        g = exact[f"{name}.weight"].double()
        if lb.bias:
            g = torch.cat([g, exact[f"{name}.bias"].double()[..., None]], dim=-1)
        want = p_out @ g @ p_in.T
        assert rel_err(block.grads[name].double(), want) < 1e-4, name


def test_sigkill_after_a_refresh_then_resume_keeps_every_row_under_its_version(data_dir):
    run_dir = data_dir / "follow_kill"
    args = _overrides(data_dir, "follow_kill", 12, "--save_interval_unsharded=5", "--tda.store.flush_every=1",
                      "--save_overwrite=true", *FOLLOW)
    cmd = [sys.executable, "-m", "olmo_tda.cli", "train", str(ROOT / "configs" / "demo_tiny.yaml"), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    bases = run_dir / "tda" / "store" / "bases"
    deadline = time.monotonic() + 240
    try:                     # the step-8 refresh is the 5th version (1 initial + steps 1, 2, 4, 8)
        while time.monotonic() < deadline and len(list(bases.glob("*.safetensors"))) < 5:
            assert proc.poll() is None, "training ended before it could be killed"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(list(bases.glob("*.safetensors"))) >= 5
    # resume from the step-5 checkpoint, before that refresh: the store and the bases are cut back to
    # it, and steps 6-12 (and the step-8 refresh) run again
    _run(args + [f"--load_path={run_dir / 'step5-unsharded'}"])
    store = GradientStore.open(run_dir / "tda" / "store")
    _check_versions(store, 12)
    block = store.iter_blocks(layers=[])
    keys = [(i, s) for b in block for i, s in zip(b.ids.tolist(), b.steps.tolist())]
    assert len(keys) == len(set(keys)) == 12 * GBS

    # a version a resume needs, gone: refused, naming the file
    victim = store.basis_path(_version_steps(store)[7])
    victim.unlink()
    full = subprocess.run([*cmd, f"--load_path={run_dir / 'step10-unsharded'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"})
    assert full.returncode != 0 and str(victim) in full.stderr + full.stdout, (full.stdout + full.stderr)[-3000:]


def test_a_following_run_answers_with_every_method(data_dir):
    """open_run on the 2-rank DDP run above (several versions): every method answers; GradDot's
    scores are the store's rows against the queries projected with each row's version."""
    from olmo_tda import Query, attribute, open_run
    from olmo_tda.methods import BasisQueries

    run_dir = data_dir / "follow_ddp"
    if not (run_dir / "tda" / "store").exists():
        _run(_overrides(data_dir, "follow_ddp", 6, "--distributed_strategy=ddp", *FOLLOW), nproc=2)
    run = open_run(run_dir)
    queries = [Query("The for statement", " is used")]
    grads, _ = run.query_gradients(queries)
    assert isinstance(grads, BasisQueries) and list(grads) == run.store.bases and len(grads) > 2
    want = attribute(run.store, grads, method="graddot", top_k=3)
    got = run.attribute(queries, method="graddot", group_by="row", top_k=3)
    assert [r["index"] for r in got[0]["results"]] == want.ids[0].tolist()
    for method in ("influence", "tracin", "tracin-inrun"):
        results = run.attribute(queries, method=method, top_k=3)[0]["results"]
        assert len(results) == 3 and all(np.isfinite(r["score"]) for r in results), method
