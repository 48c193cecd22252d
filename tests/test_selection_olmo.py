"""Online selection inside real OLMo runs (``olmo-tda train``): the rewrite never loses, duplicates
or moves a consumed example; a resumed run reproduces the rewritten order; 2 ranks (gloo) train on
one order; ``selection.enabled: false`` is plain training. Oracles: the ids each step actually
trained on (from the capture store) and OLMo's own order rebuilt from its seed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from olmo_tda.demo.corpus import build_passages
from olmo_tda.demo.data import write_memmap
from olmo_tda.store import GradientStore
from conftest import DS_EXAMPLE, deepspeed_example, free_port
from test_olmo_integration import GBS, ROOT, SEQ, _overrides, _run, _train

N_EXAMPLES = 256


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("olmo_sel")
    passages = build_passages(N_EXAMPLES, SEQ, seed=3)
    write_memmap(passages, tmp / "data" / "train.npy", SEQ)
    (tmp / "target.txt").write_text("\n".join(passages[:16]) + "\n")
    return tmp


def _sel_args(data_dir: Path, run: str, steps: int, *extra: str, policy: str = "greats") -> list[str]:
    return _overrides(data_dir, run, steps, "--tda.selection.enabled=true", "--tda.selection.every_n=3",
                      "--tda.selection.window=40", f"--tda.selection.policy={policy}",
                      f"--tda.selection.target={data_dir / 'target.txt'}", "--tda.selection.target_examples=8",
                      "--tda.selection.proj_dim=8", "--save_interval_unsharded=null", *extra)


def _trained_ids(run_dir: Path) -> dict[int, np.ndarray]:
    block = GradientStore.open(run_dir / "tda" / "store").read_all(layers=[])
    return {int(s): np.sort(block.ids[block.steps == s]) for s in np.unique(block.steps)}


def _base_order(run_dir: Path) -> np.ndarray:
    """OLMo's own epoch-0 order, rebuilt from the run's config (what a run without selection uses)."""
    from olmo.config import TrainConfig
    from olmo.data.iterable_dataset import IterableDataset

    cfg = TrainConfig.load(run_dir / "config.yaml")
    ds = IterableDataset(list(range(N_EXAMPLES)), cfg.global_train_batch_size, seed=cfg.data.seed or cfg.seed,
                         shuffle=True, drop_last=cfg.data.drop_last, world_size=1, rank=0, fs_local_rank=0)
    return ds._build_global_indices().astype(np.int64)


def _check_run(run_dir: Path, steps: int, mode: str = "reorder") -> list[dict]:
    rounds = [json.loads(x) for x in (run_dir / "tda" / "selection" / "rounds.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rounds] == list(range(3, steps, 3)) or [r["step"] for r in rounds] == list(range(3, steps + 1, 3))
    final = np.memmap(run_dir / "train_data" / "global_indices.npy", dtype=np.uint32, mode="r").astype(np.int64)
    base = _base_order(run_dir)
    assert np.array_equal(np.sort(final), np.sort(base)), "the epoch lost or duplicated an example"
    trained = _trained_ids(run_dir)
    # every step trained on exactly the positions of the final order (so positions consumed before a
    # round were never changed by a later one), and the examples of the steps are all different
    for step, ids in trained.items():
        assert np.array_equal(ids, np.sort(final[(step - 1) * GBS: step * GBS])), step
    seen = np.concatenate(list(trained.values()))
    assert len(seen) == len(set(seen.tolist())), "an example was trained twice within the epoch"
    # the rounds did rewrite the order (the first round's window is not the base order's)
    r0 = rounds[0]
    window = np.load(run_dir / "tda" / "selection" / r0["file"])
    assert r0["start"] == 3 * GBS and not np.array_equal(window, base[r0["start"]:r0["start"] + len(window)])
    if mode == "reorder":
        assert np.array_equal(np.sort(window), np.sort(base[r0["start"]:r0["start"] + len(window)]))
    return rounds


def test_reorder_rewrites_only_upcoming_positions_and_loses_nothing(data_dir):
    # OLMo sends its step metrics to W&B every 4 steps, the rounds come at steps 3, 6, 9: their stats
    # reach W&B only if logged at the round's own step
    _run(_sel_args(data_dir, "sel_reorder", 10, "--wandb.project=olmo-tda-test", "--wandb.log_interval=4"),
         env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    rounds = _check_run(data_dir / "sel_reorder", 10)
    assert rounds[0]["policy"] == "greats" and rounds[0]["examples_rescored"] == 40
    assert sum(rounds[0]["score_hist"]["counts"]) == 40 and rounds[1]["rank_corr_prev"] is not None
    metrics = [json.loads(x) for x in (data_dir / "sel_reorder" / "tda" / "metrics.jsonl").read_text().splitlines()]
    assert "tda/selection_seconds" in metrics[2] and "tda/selection_seconds" not in metrics[1]
    blob = next((data_dir / "sel_reorder" / "wandb").rglob("*.wandb")).read_bytes()
    for key in ("tda/selection_seconds", "tda/selection_scores", "tda/selection_promoted_mean_score"):
        assert key.encode() in blob, key
    # the run's HTML report plots the rounds
    from olmo_tda.cli import main as cli_main

    assert cli_main(["report", str(data_dir / "sel_reorder")]) == 0
    html = (data_dir / "sel_reorder" / "tda" / "report.html").read_text()
    assert "selection.png" in html and "selection rounds" in html
    assert (data_dir / "sel_reorder" / "tda" / "selection.png").read_bytes()[:4] == b"\x89PNG"


def test_filter_moves_the_rest_to_the_end_of_the_epoch(data_dir):
    _run(_sel_args(data_dir, "sel_filter", 7, "--tda.selection.mode=filter", "--tda.selection.keep_fraction=0.25",
                   policy="loss"))
    rounds = _check_run(data_dir / "sel_filter", 7, mode="filter")
    final = np.memmap(data_dir / "sel_filter" / "train_data" / "global_indices.npy", dtype=np.uint32, mode="r")
    r = rounds[-1]
    moved = np.load(data_dir / "sel_filter" / "tda" / "selection" / r["file"])[r["keep"]:]
    assert np.array_equal(np.asarray(final[N_EXAMPLES - len(moved):]), moved)


def _stopped_and_resumed(data_dir: Path, *, steps: int, stop: int, every: int) -> dict[int, np.ndarray]:
    """``sel_full``: ``steps`` steps; ``sel_resumed``: stopped after ``stop``, then resumed from its last
    checkpoint (every ``every`` steps) to ``steps``. Both trained the same ids at every step; returns them."""
    full, resumed = data_dir / "sel_full", data_dir / "sel_resumed"
    _run(_sel_args(data_dir, "sel_full", steps, f"--save_interval_unsharded={every}"))
    _run(_sel_args(data_dir, "sel_resumed", stop, f"--save_interval_unsharded={every}"))
    last = resumed / f"step{stop // every * every}-unsharded"
    assert last.exists()
    _run(_sel_args(data_dir, "sel_resumed", steps, f"--save_interval_unsharded={every}", "--save_overwrite",
                   f"--load_path={last}"))
    a, b = _trained_ids(full), _trained_ids(resumed)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert np.array_equal(a[step], b[step]), step
    return a


def test_resume_reproduces_the_rewritten_order(data_dir):
    full, resumed = data_dir / "sel_full", data_dir / "sel_resumed"
    # a run that stopped after step 8 (and had already logged a round past the checkpoint at 4... )
    a = _stopped_and_resumed(data_dir, steps=12, stop=8, every=4)
    for name in ("global_indices.npy",):
        assert np.array_equal(np.fromfile(full / "train_data" / name, dtype=np.uint32),
                              np.fromfile(resumed / "train_data" / name, dtype=np.uint32))
    rounds = [json.loads(x)["step"] for x in (resumed / "tda" / "selection" / "rounds.jsonl").read_text().splitlines()]
    assert rounds == [3, 6, 9, 12]

    # into another save_folder: its log lacks the round at step 3, so the order cannot be replayed and
    # the resume is refused (it went on in the plain order); with the log copied there it replays
    elsewhere = data_dir / "sel_elsewhere"
    args = _sel_args(data_dir, "sel_elsewhere", 12, "--save_interval_unsharded=4",
                     f"--load_path={full / 'step4-unsharded'}")
    refused = _train(args)
    assert refused.returncode != 0
    assert "the checkpoint's run had applied 1 selection rounds by step 4" in refused.stdout + refused.stderr
    shutil.rmtree(elsewhere / "tda" / "selection", ignore_errors=True)
    shutil.copytree(full / "tda" / "selection", elsewhere / "tda" / "selection")
    _run(args + ["--save_overwrite"])
    c = _trained_ids(elsewhere)
    assert sorted(c) == list(range(5, 13)) and all(np.array_equal(a[step], c[step]) for step in c)
    # selection switched off on resume: allowed (the user's call), and said; its checkpoints keep the
    # rounds applied before, so switching it back on beside a log without them is refused
    off_dir = data_dir / "sel_off_resumed"
    off = _train(_sel_args(data_dir, "sel_off_resumed", 5, f"--load_path={full / 'step4-unsharded'}",
                           "--tda.selection.enabled=false", "--save_interval_unsharded=5"))
    assert off.returncode == 0, off.stderr[-4000:]
    assert "had applied 1 selection rounds by step 4, and tda.selection is off now" in off.stdout + off.stderr
    back_on = _train(_sel_args(data_dir, "sel_off_resumed", 6, "--save_interval_unsharded=5", "--save_overwrite",
                               f"--load_path={off_dir / 'step5-unsharded'}"))
    assert back_on.returncode != 0
    assert "had applied 1 selection rounds by step 5" in back_on.stdout + back_on.stderr
    # restore_dataloader: false (the weights only, e.g. to train on): the data restarts at step 0, so
    # no round of that run applies and a new folder without its log is not refused; its own rounds
    # rewrite its own order as a fresh run's do
    _run(_sel_args(data_dir, "sel_weights_only", 6, f"--load_path={full / 'step4-unsharded'}",
                   "--restore_dataloader=false"))
    _check_run(data_dir / "sel_weights_only", 6)
    # the run's other TDA state starts there too: its row count, and its trajectory at θ_0 = the weights loaded
    logged = [json.loads(x) for x in (data_dir / "sel_weights_only" / "tda" / "metrics.jsonl").read_text().splitlines()]
    assert [m["tda/rows_captured"] for m in logged] == [float(s * GBS) for s in range(1, 7)]
    import torch

    from olmo_tda.training.trajectory import Trajectory
    first = min(Trajectory.list(data_dir / "sel_weights_only" / "tda" / "trajectory"), key=lambda c: c.step)
    loaded = torch.load(full / "step4-unsharded" / "model.pt", weights_only=True)
    kept = first.load()
    assert first.step == 0 and kept.keys() <= loaded.keys() and kept
    assert all(torch.equal(kept[k].float(), loaded[k].float()) for k in kept)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """64 examples: 8 global batches an epoch, so a dozen steps cross into epoch 1."""
    tmp = tmp_path_factory.mktemp("olmo_sel_small")
    passages = build_passages(64, SEQ, seed=5)
    write_memmap(passages, tmp / "data" / "train.npy", SEQ)
    (tmp / "target.txt").write_text("\n".join(passages[:16]) + "\n")
    return tmp


def test_resume_in_a_later_epoch_reproduces_the_order(small_dir):
    """A run over 64 examples (8 steps an epoch) with rounds every 3 steps, one of them cut at the end
    of epoch 0 (its window reaches past it) and one in epoch 1, stopped after step 11 and resumed from
    its step-10 checkpoint (epoch 1: OLMo reshuffles, then this epoch's rounds are replayed, the
    later one dropped) to step 14: every step trains the ids the uninterrupted run's did, and each
    epoch trains every example once."""
    full, resumed = small_dir / "sel_full", small_dir / "sel_resumed"
    a = _stopped_and_resumed(small_dir, steps=14, stop=11, every=5)
    for epoch in (range(1, 9), range(9, 15)):
        seen = np.concatenate([a[s] for s in epoch])
        assert len(seen) == len(set(seen.tolist())), "an example trained twice within an epoch"
    assert len(np.concatenate([a[s] for s in range(1, 9)])) == 64
    rounds = [json.loads(x) for x in (resumed / "tda" / "selection" / "rounds.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in rounds] == [(0, 3), (0, 6), (1, 9), (1, 12)]
    base = [json.loads(x) for x in (full / "tda" / "selection" / "rounds.jsonl").read_text().splitlines()]
    for r, f in zip(rounds, base, strict=True):      # the same rounds (their timings aside)
        assert (r["start"], r["keep"], r["window"]) == (f["start"], f["keep"], f["window"])
        assert np.array_equal(np.load(resumed / "tda" / "selection" / r["file"]),
                              np.load(full / "tda" / "selection" / f["file"]))
    assert rounds[1]["start"] + rounds[1]["window"] == 64 and rounds[1]["window"] < 40   # cut at epoch 0's end


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_on_one_rewritten_order(data_dir, strategy):
    """Each rank scores half the window; rank 0 decides; the store's rows (both ranks' examples)
    follow the one rewritten order."""
    run = f"sel_2rank_{strategy}"
    _run(_sel_args(data_dir, run, 7, f"--distributed_strategy={strategy}"), nproc=2, timeout=600)
    _check_run(data_dir / run, 7)
    block = GradientStore.open(data_dir / run / "tda" / "store").read_all(layers=[])
    assert len(set(GradientStore.open(data_dir / run / "tda" / "store").summary()["ranks"])) == 2
    assert len(block.ids) == 7 * GBS


def _each_rank_alone(args: list[str], logs: list[Path], port: int) -> list[tuple[int, str]]:
    """``tests/_blind_rank_worker.py ARGS`` as 2 ranks, each its own process with no launcher agent to
    end it (as ranks on different nodes) and a teardown that blocks for good; (exit code, output) of each."""
    import subprocess
    import sys

    from conftest import outside_slurm_env

    env = {**outside_slurm_env(), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "TDA_TEST_TEARDOWN_BLOCKS": "1",
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ranks = []
    try:
        for r, path in enumerate(logs):        # files: a full pipe cannot stall a rank
            with open(path, "w") as f:
                ranks.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "_blind_rank_worker.py"), *args],
                                              cwd=logs[0].parent, stdout=f, stderr=subprocess.STDOUT,
                                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}))
        for p in ranks:
            p.wait(timeout=240)
    finally:
        for p in ranks:
            p.kill()
    return [(p.returncode, path.read_text()) for p, path in zip(ranks, logs)]


def test_selection_refuses_a_log_folder_some_rank_cannot_see(data_dir):
    """2 ranks, rank 1 blind to what rank 0 writes in the round log folder (tests/_blind_rank_worker.py,
    as a save_folder on each node's own disk): both ranks refuse at start, naming rank 1 and the fix,
    before any step (on resume such a run hung, or with DeepSpeed trained ranks on different orders).

    Each rank must also end by itself although tearing its process down would block for good, as a
    teardown waiting on the peer that failed with it (once seen in CI: 300 s, one error printed,
    neither rank gone)."""
    args = ["train", str(ROOT / "configs" / "demo_tiny.yaml"), *_sel_args(data_dir, "sel_blind", 4)]
    outs = _each_rank_alone(args, [data_dir / f"sel_blind_rank{r}.log" for r in range(2)], free_port())
    for r, (code, out) in enumerate(outs):
        assert code == 2, f"rank {r}: {out[-4000:]}"
        assert out.count("rank(s) [1] do not see the round log folder") == 1, f"rank {r}: {out[-4000:]}"
        assert "on a filesystem all nodes share" in out
    assert not (data_dir / "sel_blind" / "tda" / "metrics.jsonl").exists() or \
        not (data_dir / "sel_blind" / "tda" / "metrics.jsonl").read_text().strip()
    assert not list((data_dir / "sel_blind" / "tda" / "selection").glob(".shared-check-*"))


def test_deepspeed_script_refuses_a_log_folder_some_rank_cannot_see_and_each_rank_ends(tmp_path):
    """The same under the DeepSpeed example script: each rank refuses, closes its store (which only the
    exit would have done: the refusal comes after attach) and ends by itself although its teardown would block."""
    passages = build_passages(16, 32, seed=11)
    (tmp_path / "target.txt").write_text("\n".join(passages) + "\n")
    run = tmp_path / "run"
    args = ["deepspeed", str(ROOT / "configs" / "deepspeed_tiny.yaml"), f"--run_dir={run}", "--steps=2",
            "--model.d_model=32", "--model.embedding_size=257", "--data.seq_len=32", "--model.max_sequence_length=32",
            "--deepspeed.train_micro_batch_size_per_gpu=2", "--tda.capture.proj_dim=8",
            "--tda.selection.enabled=true", "--tda.selection.every_n=2", "--tda.selection.window=24",
            f"--tda.selection.target={tmp_path / 'target.txt'}", "--tda.selection.target_examples=6",
            "--tda.selection.proj_dim=8"]
    outs = _each_rank_alone(args, [tmp_path / f"rank{r}.log" for r in range(2)], free_port())
    for r, (code, out) in enumerate(outs):
        assert code == 2, f"rank {r}: {out[-4000:]}"
        assert out.count("rank(s) [1] do not see the round log folder") == 1, f"rank {r}: {out[-4000:]}"
        assert f": rank {r} closed (" in out, f"rank {r}: {out[-4000:]}"    # its store, before os._exit
    assert not list((run / "tda" / "selection").glob(".shared-check-*"))


def test_selection_disabled_is_plain_training(data_dir):
    """tda on, selection off (and no capture store): the same losses, weights and data order as
    OLMo's own Trainer."""
    import torch
    import torch.distributed as dist
    from olmo.train import Trainer

    from olmo_tda.integrations import olmo_train
    from olmo_tda.integrations.olmo import load_configs

    out = {}
    for name, cls, extra in (("olmo", Trainer, ["--tda.enabled=false"]),
                             ("off", None, ["--tda.selection.enabled=false", "--tda.store.enabled=false"])):
        cfg, tda = load_configs(ROOT / "configs" / "demo_tiny.yaml",
                                _overrides(data_dir, f"sel_parity_{name}", 5, *extra))
        trainer = olmo_train.build_trainer(cfg, tda, olmo_train.init_distributed(), trainer_cls=cls)
        losses, ids = [], []
        for batch in trainer.train_loader:
            trainer.global_step += 1
            ids.append(batch["index"].tolist())
            losses.append(trainer.train_step(batch)["train/CrossEntropyLoss"])
            if trainer.global_step == 5:
                break
        out[name] = (losses, ids, {k: v.clone() for k, v in trainer.model.state_dict().items()})
        trainer.close()
    dist.destroy_process_group()
    assert out["olmo"][0] == out["off"][0] and out["olmo"][1] == out["off"][1]
    for k, v in out["olmo"][2].items():
        assert torch.equal(v, out["off"][2][k]), k
    assert not (data_dir / "sel_parity_off" / "tda" / "selection").exists()


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])     # ZeRO-3 is the stricter case
def test_deepspeed_callback_two_ranks_and_resume(tmp_path, stage):
    """DeepSpeed example script, 2 ranks (gloo), ZeRO-2 or 3: rounds every 2 steps rewrite the data
    order both ranks read (the store's rows of each step are exactly that step's positions of the
    replayed order, no example twice), and a rerun that resumes from the step-4 checkpoint replays
    the rounds up to it and re-runs the later ones identically."""
    import os
    import subprocess
    import sys

    script = deepspeed_example()
    from olmo_tda.training.selection import DataOrder, SelectionLog

    passages = build_passages(64, 32, seed=11)
    (tmp_path / "target.txt").write_text("\n".join(passages) + "\n")
    run = tmp_path / "run"
    common = [f"--run_dir={run}", "--save_every=4", "--model.d_model=32", "--model.embedding_size=257",
              "--data.seq_len=32", "--model.max_sequence_length=32", "--deepspeed.train_micro_batch_size_per_gpu=2",
              f"--deepspeed.zero_optimization.stage={stage}", "--tda.capture.proj_dim=8", "--tda.store.flush_every=1",
              "--tda.selection.enabled=true", "--tda.selection.every_n=2", "--tda.selection.window=24",
              f"--tda.selection.target={tmp_path / 'target.txt'}", "--tda.selection.target_examples=6",
              "--tda.selection.proj_dim=8"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DS_EXAMPLE),
           str(ROOT / "configs" / "deepspeed_tiny.yaml")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first_round6 = None
    for steps in (6, 8):      # the rerun resumes from step 4: round 6 is dropped and re-run
        done = subprocess.run([*cmd, *common, f"--steps={steps}"], capture_output=True, text=True, timeout=600,
                              env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-6000:]
        if first_round6 is None:
            first_round6 = np.load(next((run / "tda" / "selection").glob("round-*-s0000000006.npy")))
    assert np.array_equal(np.load(next((run / "tda" / "selection").glob("round-*-s0000000006.npy"))), first_round6)
    assert "resumed from" in done.stderr
    rounds = [json.loads(x) for x in (run / "tda" / "selection" / "rounds.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rounds] == [2, 4, 6, 8]
    num = int((run / "data" / "train.npy").stat().st_size // 2 // 32)
    order = DataOrder(num, lambda e: script._epoch_order(0, e, num), SelectionLog(run / "tda" / "selection", writer=False))
    per_step = 2 * 2 * 2
    block = GradientStore.open(run / "tda" / "store").read_all(layers=[])
    for step in range(1, 9):
        want = np.sort(order.ids((step - 1) * per_step, per_step))
        assert np.array_equal(np.sort(block.ids[block.steps == step]), want), step
    seen = block.ids
    assert len(seen) == len(set(seen.tolist())) == 8 * per_step
    base = script._epoch_order(0, 0, num)
    assert not np.array_equal(order.epoch_order(0)[per_step * 2:per_step * 2 + 24], base[per_step * 2:per_step * 2 + 24])
    # the step-8 checkpoint says 4 rounds were applied by then: a log cut to 2 cannot replay the order
    log_file = run / "tda" / "selection" / "rounds.jsonl"
    full_log = log_file.read_text()
    log_file.write_text("".join(full_log.splitlines(keepends=True)[:2]))
    records = {name: (run / name).read_bytes() for name in ("run.json", "config.json", "checkpoints/latest")}
    refused = subprocess.run([*cmd, *common, "--steps=10"], capture_output=True, text=True, timeout=600, env=env,
                             cwd=tmp_path)
    assert refused.returncode != 0 and "exitcode  : 2" in refused.stderr, refused.stderr[-4000:]   # ConfigError
    assert "had applied 4 selection rounds by step 8" in refused.stderr and "holds 2" in refused.stderr
    # refused before this launch wrote anything: the run's records and its log are as they were
    assert {name: (run / name).read_bytes() for name in records} == records
    assert len(log_file.read_text().splitlines()) == 2 and not (run / "checkpoints" / "step10").exists()
    # selection switched off on resume: allowed (the user's call), and said; its step-9 checkpoint keeps
    # the 4 rounds, so switching selection back on beside the cut log is still refused
    plain = subprocess.run([*cmd, *common, "--steps=9", "--tda.selection.enabled=false"], capture_output=True,
                           text=True, timeout=600, env=env, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-4000:]
    assert "had applied 4 selection rounds by step 8, and tda.selection is off now" in plain.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == "step9"
    back_on = subprocess.run([*cmd, *common, "--steps=10"], capture_output=True, text=True, timeout=600, env=env,
                             cwd=tmp_path)
    assert back_on.returncode != 0 and "had applied 4 selection rounds by step 9" in back_on.stderr


def test_a_round_inside_the_olmo_trainer_leaves_weights_optimizer_and_rngs_untouched(data_dir):
    """The whole OLMo-side round (measure, decide, rewrite the order file, restart the loader) after
    3 real steps: weights, AdamW state, parameter grads and the python/numpy/torch RNG streams are
    exactly as before, and the next batch comes from the rewritten order."""
    import copy
    import random

    import torch
    import torch.distributed as dist

    from olmo_tda.integrations import olmo_train
    from olmo_tda.integrations.olmo import load_configs

    cfg, tda = load_configs(ROOT / "configs" / "demo_tiny.yaml", _sel_args(data_dir, "sel_untouched", 4, "--tda.selection.every_n=100", policy="greats"))
    trainer = olmo_train.build_trainer(cfg, tda, olmo_train.init_distributed())
    it = iter(trainer.train_loader)
    for _ in range(3):
        batch = next(it)
        trainer.global_step += 1
        trainer.global_train_examples_seen_this_epoch += GBS
        trainer.train_step(batch)
    before = (copy.deepcopy(trainer.model.state_dict()), copy.deepcopy(trainer.optim.state_dict()),
              {n: None if p.grad is None else p.grad.clone() for n, p in trainer.model.named_parameters()},
              random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    metrics = {}
    trainer.selection.round(metrics)
    after_sd = trainer.model.state_dict()
    assert all(torch.equal(after_sd[k], v) for k, v in before[0].items())
    opt = trainer.optim.state_dict()
    for pid, st in before[1]["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(opt["state"][pid][k]), torch.as_tensor(v)), (pid, k)
    for n, p in trainer.model.named_parameters():
        assert (p.grad is None and before[2][n] is None) or torch.equal(p.grad, before[2][n]), n
    assert random.getstate() == before[3] and np.array_equal(np.random.get_state()[1], before[4])
    assert torch.equal(torch.get_rng_state(), before[5])
    assert metrics["tda/selection_examples_rescored"] == 40
    order = np.memmap(data_dir / "sel_untouched" / "train_data" / "global_indices.npy", dtype=np.uint32, mode="r")
    nxt = next(it)                           # the restarted iterator serves the rewritten order
    assert np.array_equal(np.sort(nxt["index"].numpy()), np.sort(np.asarray(order[3 * GBS:4 * GBS])))
    trainer.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("flag", ["--data.generate_doc_lengths=true", "--data.generate_attention_mask=true"])
def test_selection_refuses_data_masks_its_rounds_would_not_apply(data_dir, flag):
    """A round scores the plain next-token loss of every position; with masks or document lengths
    training's loss is another one, so the scores would rank examples by the wrong gradient."""
    import torch.distributed as dist

    from olmo_tda.config import ConfigError
    from olmo_tda.integrations import olmo_train
    from olmo_tda.integrations.olmo import load_configs

    cfg, tda = load_configs(ROOT / "configs" / "demo_tiny.yaml", _sel_args(data_dir, "sel_masked", 2, flag))
    try:
        with pytest.raises(ConfigError, match=f"tda.selection does not apply data.{flag[7:].split('=')[0]}"):
            olmo_train.build_trainer(cfg, tda, olmo_train.init_distributed())
    finally:
        dist.destroy_process_group()
