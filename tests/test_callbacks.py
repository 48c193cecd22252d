"""Training callbacks: the public API (``tda.callbacks`` in YAML, ``Callback`` subclasses from Python)
and the shared metrics log, under OLMo's trainer and DeepSpeed's engine on 2 ranks.

A user callback named in YAML (tests/_witness_callback.py: the docs' example ``RowNorms`` plus a
witness) sees every step's record on every rank, checked against the data order; its state survives a
SIGKILL and a resume from an earlier checkpoint (its final counts are the whole run's, not the resumed
part's). OLMo and DeepSpeed runs write the same ``tda/*`` keys to an offline W&B run, and the values
are checked: W&B's rows against ``metrics.jsonl``'s, row counts against the batch sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _wandb_history import run_history
from conftest import DS_EXAMPLE, deepspeed_example, outside_slurm_env
from olmo_tda.config import ConfigError, TDAConfig
from olmo_tda.training.callbacks import Callback, Callbacks, StepEnd, load_callback
from test_olmo_integration import GBS, ROOT, _expected_ids, _overrides, data_dir  # noqa: F401

HERE = Path(__file__).resolve().parent
PYPATH = os.pathsep.join([str(HERE), str(ROOT / "docs" / "examples"), os.environ.get("PYTHONPATH", "")])
CAPTURE_KEYS = {"tda/rows_captured", "tda/rows_skipped_nonfinite", "tda/examples_per_s", "tda/bytes_written",
                "tda/append_ms", "tda/row_norm_sq"}


class Counter(Callback):
    def __init__(self):
        self.seen = 0

    def on_step_end(self, event):
        self.seen += len(event.ids)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def _event(step: int, n: int) -> StepEnd:
    return StepEnd(step=step, model=None, ids=np.arange(n), record=None, metrics={})


def test_callbacks_dispatch_in_order_and_their_states_round_trip_by_name():
    a, b = Counter(), Counter()
    run = Callbacks([a, b])
    run.step_end(_event(1, 3))
    assert run.keys == ["Counter", "Counter#2"] and run.state_dict() == {"Counter": {"seen": 3}, "Counter#2": {"seen": 3}}
    again = Callbacks([Counter(), Counter()])
    again.load_gathered([run.state_dict()], rank=0)
    assert [c.seen for c in again.callbacks] == [3, 3]
    fresh = Callbacks([Counter()])
    fresh.load_gathered([run.state_dict()], rank=1)      # a rank the checkpoint did not have: afresh
    assert fresh.callbacks[0].seen == 0


def test_callback_specs_are_checked_and_name_the_fix():
    assert isinstance(load_callback("test_callbacks:Counter"), Counter)
    with pytest.raises(ConfigError, match="expected 'package.module:ClassName'"):
        load_callback("test_callbacks.Counter")
    with pytest.raises(ConfigError, match="cannot import no_such_module.*PYTHONPATH"):
        load_callback("no_such_module:X")
    with pytest.raises(ConfigError, match="has no Nope"):
        load_callback("test_callbacks:Nope")
    with pytest.raises(ConfigError, match="not a subclass of olmo_tda.training.callbacks.Callback"):
        load_callback("test_callbacks:_event")
    with pytest.raises(ConfigError, match=r"tda.callbacks\[1\]: expected 'package.module:ClassName'"):
        TDAConfig.from_dict({"enabled": True, "callbacks": ["a:B", "nocolon"]})
    with pytest.raises(ConfigError, match="is not an olmo_tda.training.callbacks.Callback"):
        Callbacks([object()])


def _steps_seen(folder: Path, rank: int) -> dict[int, list[int]]:
    """The witness's last record of each step on ``rank`` (a step re-run after the resume: its rerun)."""
    out = {}
    for line in (folder / f"steps_rank{rank}.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["ids"]
    return out


def _check_wandb_against_metrics(tda_dir: Path, steps: int, per_step: int, row_bytes: int) -> dict[int, dict]:
    history = run_history(tda_dir / "wandb")
    logged = {json.loads(x)["step"]: json.loads(x) for x in (tda_dir / "metrics.jsonl").read_text().splitlines()}
    assert sorted(logged) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        if step not in history:     # the killed attempt's W&B run may not have synced its last steps
            continue
        row = history[step]
        assert {k for k in row if k.startswith("tda/")} == CAPTURE_KEYS, sorted(row)    # OLMo's = DeepSpeed's
        for key in CAPTURE_KEYS - {"tda/examples_per_s", "tda/append_ms", "tda/row_norm_sq"}:
            assert row[key] == logged[step][key], (step, key)
        assert row["tda/rows_captured"] == step * per_step
        assert row["tda/rows_skipped_nonfinite"] == 0 and row["tda/examples_per_s"] > 0 and row["tda/append_ms"] >= 0
        assert row["tda/bytes_written"] % row_bytes == 0        # whole rows (a resumed store counts its earlier ones)
        assert row["tda/row_norm_sq"] > 0
    assert max(history) == steps
    return history


def test_olmo_two_ranks_user_callback_from_yaml_sees_every_record_and_survives_sigkill(data_dir, tmp_path):
    """2-rank DDP: the witness SIGKILLs rank 1 in step 6; the run resumes from its step-4 checkpoint
    and ends at 8. Every step's record was seen on both ranks with the ids OLMo's order gives that
    step, and the callbacks' final counts are the whole run's (restored from the checkpoint)."""
    run_dir = data_dir / "cb_olmo"
    args = _overrides(data_dir, "cb_olmo", 8, "--distributed_strategy=ddp", "--save_interval_unsharded=4",
                      "--tda.store.flush_every=1", "--save_overwrite=true", "--tda.callbacks=[_witness_callback:Witness]",
                      "--tda.wandb.enabled=true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "olmo_tda.cli",
           "train", str(ROOT / "configs" / "demo_tiny.yaml")]
    env = {**outside_slurm_env(), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "PYTHONPATH": PYPATH, "WITNESS_DIR": str(tmp_path)}
    killed = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**env, "WITNESS_KILL_AT": "6"})
    assert killed.returncode != 0 and not (tmp_path / "final_rank1.json").exists(), killed.stderr[-3000:]
    done = subprocess.run([*cmd, *args, f"--load_path={run_dir / 'step4-unsharded'}"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-6000:]
    for rank in (0, 1):
        seen = _steps_seen(tmp_path, rank)
        assert sorted(seen) == list(range(1, 9))
        final = json.loads((tmp_path / f"final_rank{rank}.json").read_text())
        assert final["steps"] == 8 and final["rows"] == 8 * GBS // 2, final
    for step in range(1, 9):
        both = np.sort(np.concatenate([_steps_seen(tmp_path, r)[step] for r in (0, 1)]))
        assert np.array_equal(both, _expected_ids(run_dir, step)), step
    row_bytes = 4 * _floats_per_example(run_dir / "tda" / "store")
    _check_wandb_against_metrics(run_dir / "tda", 8, GBS, row_bytes)


def _floats_per_example(store_path: Path) -> int:
    from olmo_tda.store import GradientStore

    store = GradientStore.open(store_path)
    return sum(int(np.prod(shape)) for shape in store.layer_shapes.values())


def test_deepspeed_zero2_two_ranks_same_wandb_keys_and_callback_survives_sigkill(tmp_path):
    """The DeepSpeed example on 2 ranks (ZeRO-2): the same witness from YAML is killed in step 3 and
    the rerun resumes from the step-2 checkpoint; W&B gets the same tda/* keys as the OLMo run's."""
    script = deepspeed_example()

    witness = tmp_path / "witness"
    witness.mkdir()
    run = tmp_path / "run"
    args = [f"--run_dir={run}", "--model.d_model=32", "--model.embedding_size=257", "--data.seq_len=32",
            "--model.max_sequence_length=32", "--deepspeed.train_micro_batch_size_per_gpu=2",
            "--deepspeed.zero_optimization.stage=2", "--tda.capture.proj_dim=16", "--tda.store.flush_every=1",
            "--save_every=2", "--steps=4", "--tda.callbacks=[_witness_callback:Witness]", "--tda.wandb.enabled=true"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DS_EXAMPLE),
           str(ROOT / "configs" / "deepspeed_tiny.yaml"), *args]
    env = {**outside_slurm_env(), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "PYTHONPATH": PYPATH, "WITNESS_DIR": str(witness)}
    killed = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**env, "WITNESS_KILL_AT": "3"})
    assert killed.returncode != 0 and not (witness / "final_rank1.json").exists(), killed.stderr[-3000:]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0 and "resumed from" in done.stderr, done.stderr[-6000:]
    num = int((run / "data" / "train.npy").stat().st_size // 2 // 32)
    order = dict(world=2, micro_bs=2, gas=2, num=num, seed=0)
    per_rank = 2 * 2
    for rank in (0, 1):
        seen = _steps_seen(witness, rank)
        assert sorted(seen) == [1, 2, 3, 4]
        for step, ids in seen.items():
            want = np.concatenate([script.step_ids(step, rank, m, **order) for m in range(2)])
            assert np.array_equal(np.sort(ids), np.sort(want)), (rank, step)
        final = json.loads((witness / f"final_rank{rank}.json").read_text())
        assert final["steps"] == 4 and final["rows"] == 4 * per_rank, final
    row_bytes = 4 * _floats_per_example(run / "tda" / "store")
    _check_wandb_against_metrics(run / "tda", 4, 2 * per_rank, row_bytes)


def test_a_callback_state_a_checkpoint_cannot_read_back_is_refused_at_save_naming_it():
    import torch

    class Bad(Counter):
        def state_dict(self):
            return {"seen": self.seen, "hist": {"a": [np.zeros(2)]}}

    good = Callbacks([Counter()])
    good.callbacks[0].seen = 2
    assert good.state_dict() == {"Counter": {"seen": 2}}
    ok = Callbacks([Counter()])
    ok.callbacks[0].state_dict = lambda: {"t": torch.ones(2), "nested": [1, 2.5, "x", None, {"k": True}]}
    assert torch.equal(ok.state_dict()["Counter"]["t"], torch.ones(2))
    with pytest.raises(ConfigError, match=r"Bad.state_dict\(\)\['hist'\]\['a'\]\[0\] holds a numpy.ndarray"):
        Callbacks([Bad()]).state_dict()
