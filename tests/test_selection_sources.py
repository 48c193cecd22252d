"""The ``sources`` selection policy inside real OLMo runs (``olmo-tda train``): each round pulls the
next ``every_n`` steps' examples forward by the learned source weights, and the steps train exactly
those, in the per-source counts the weights give; the weights reach metrics.jsonl and W&B; a 2-rank
run stopped and resumed from a checkpoint trains the uninterrupted run's ids at every step (the
mixer's sums and evidence ride in the checkpoint). Oracle: the ids each step trained on, read from
the capture store, and each example's source from the file it came from."""

from __future__ import annotations

import inspect
import json
import json as json_module
from pathlib import Path

import numpy as np
import pytest

from olmo_tda.demo.corpus import build_passages
from olmo_tda.demo.data import write_memmap
from olmo_tda.store import GradientStore
from olmo_tda.training.mixture import quotas
from test_olmo_integration import GBS, SEQ, _run, _train

N_EACH = 128
SOURCES = ["prose", "code", "other"]


def _code_passages(n: int) -> list[str]:
    text = inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder) + inspect.getsource(inspect)
    data = text.encode("ascii", errors="ignore")
    return [data[s:s + SEQ].decode("ascii") for s in range(0, SEQ * n, SEQ)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("olmo_sources")
    prose = build_passages(2 * N_EACH + 16, SEQ, seed=3)
    write_memmap(prose[:N_EACH], tmp / "prose" / "prose.npy", SEQ)
    write_memmap(_code_passages(N_EACH), tmp / "code" / "code.npy", SEQ)
    write_memmap(prose[N_EACH:2 * N_EACH], tmp / "other" / "other.npy", SEQ)
    (tmp / "target.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in prose[2 * N_EACH:]))
    return tmp


def _args(data_dir: Path, run: str, steps: int, *extra: str) -> list[str]:
    paths = ",".join(str(data_dir / s / f"{s}.npy") for s in SOURCES)
    return [f"--data.paths=[{paths}]", f"--save_folder={data_dir / run}", f"--max_duration={steps}",
            f"--stop_at={steps}", "--model.d_model=64", "--model.n_heads=4", "--model.max_sequence_length=32",
            f"--global_train_batch_size={GBS}", "--device_train_microbatch_size=2", "--console_log_interval=1000",
            "--save_num_unsharded_checkpoints_to_keep=-1", "--tda.capture.proj_dim=8", "--tda.store.dtype=float32",
            "--tda.store.flush_every=2", "--tda.selection.enabled=true", "--tda.selection.policy=sources",
            "--tda.selection.every_n=3", f"--tda.selection.target={data_dir / 'target.jsonl'}",
            "--tda.selection.target_examples=4", "--tda.selection.target_every=2",
            "--tda.selection.source_temperature=0.05", "--save_interval_unsharded=null", *extra]


def _trained_ids(run_dir: Path) -> dict[int, np.ndarray]:
    block = GradientStore.open(run_dir / "tda" / "store").read_all(layers=[])
    return {int(s): np.sort(block.ids[block.steps == s]) for s in np.unique(block.steps)}


def test_rounds_pull_the_weighted_mix_forward_and_log_it(data_dir):
    run = data_dir / "src_one"
    _run(_args(data_dir, "src_one", 9, "--wandb.project=olmo-tda-test", "--wandb.log_interval=4"),
         env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    rounds = [json.loads(x) for x in (run / "tda" / "selection" / "rounds.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rounds] == [3, 6, 9]
    assert [r["target_refreshed"] for r in rounds] == [True, False, True]
    assert [r["examples_measured"] for r in rounds] == [4, 0, 4]
    trained = _trained_ids(run)
    seen = np.concatenate(list(trained.values()))
    assert len(seen) == len(set(seen.tolist())) == 9 * GBS, "an example was trained twice, or a step lost one"
    for r in rounds[:2]:
        assert r["rule"] == "pull" and r["start"] == r["step"] * GBS and r["window"] == 3 * GBS
        weights = np.array([r["source_weight"][s] for s in SOURCES])
        assert weights.sum() == pytest.approx(1.0) and np.all(weights > 0)
        # the next every_n steps train exactly the round's ids ...
        pulled = np.load(run / "tda" / "selection" / r["file"])
        steps = range(r["step"] + 1, r["step"] + 4)
        got = np.concatenate([trained[s] for s in steps])
        assert np.array_equal(np.sort(got), np.sort(pulled))
        # ... in the per-source counts the weights give (no source is short of examples here)
        counts = np.bincount(got // N_EACH, minlength=3)
        assert counts.tolist() == quotas(weights, np.full(3, N_EACH), 3 * GBS).tolist()
        assert [r["source_frac_front"][s] for s in SOURCES] == pytest.approx(counts / (3 * GBS))
    # the round after the first learned from the rows: the target is prose, so code is weighted down
    assert rounds[1]["source_weight"]["code"] < rounds[1]["source_weight"]["prose"]
    metrics = [json.loads(x) for x in (run / "tda" / "metrics.jsonl").read_text().splitlines()]
    assert {f"tda/selection_weight/{s}" for s in SOURCES} <= set(metrics[2]) and "tda/selection_seconds" in metrics[5]
    blob = next((run / "wandb").rglob("*.wandb")).read_bytes()
    for key in ("tda/selection_weight/prose", "tda/selection_score/code", "tda/selection_front_frac/other",
                "tda/selection_target_refreshed"):
        assert key.encode() in blob, key
    from olmo_tda.cli import main as cli_main      # the run's report plots the weights

    assert cli_main(["report", str(run)]) == 0
    assert (run / "tda" / "selection.png").read_bytes()[:4] == b"\x89PNG"


def test_two_ranks_resumed_from_a_checkpoint_train_the_uninterrupted_runs_ids(data_dir):
    full, resumed = data_dir / "src_full", data_dir / "src_resumed"
    _run(_args(data_dir, "src_full", 12, "--save_interval_unsharded=4"), nproc=2, timeout=600)
    _run(_args(data_dir, "src_resumed", 8, "--save_interval_unsharded=4"), nproc=2, timeout=600)
    _run(_args(data_dir, "src_resumed", 12, "--save_interval_unsharded=4", "--save_overwrite",
               f"--load_path={resumed / 'step8-unsharded'}"), nproc=2, timeout=600)
    a, b = _trained_ids(full), _trained_ids(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in range(1, 13):
        assert np.array_equal(a[step], b[step]), step
    assert len(set(GradientStore.open(full / "tda" / "store").summary()["ranks"])) == 2
    ra = [json.loads(x) for x in (full / "tda" / "selection" / "rounds.jsonl").read_text().splitlines()]
    rb = [json.loads(x) for x in (resumed / "tda" / "selection" / "rounds.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [3, 6, 9, 12]
    for x, y in zip(ra, rb):        # the weights went on from the checkpoint's sums and evidence
        assert x["source_weight"] == pytest.approx(y["source_weight"], rel=1e-9, abs=1e-12)


def test_sources_refuses_a_run_without_the_store(data_dir):
    done = _train(_args(data_dir, "src_nostore", 2, "--tda.enabled=true", "--tda.store.enabled=false"))
    assert done.returncode != 0 and "needs tda.store.enabled: true" in done.stderr + done.stdout
