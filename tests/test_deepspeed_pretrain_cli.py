"""The DeepSpeed example script's command line (``python examples/deepspeed_pretrain.py``):
docs/DEEPSPEED.md's plain single-process command trains (no launcher, no MPI), and every bad input is refused
before training with one ``error:`` line naming the key, never a traceback. The 2-rank run, resume and
queries are in ``test_deepspeed.py``. All tests here have ``deepspeed`` in their names."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from _warm import run_module
from conftest import outside_slurm_env
from olmo_tda.config import ConfigError

pytest.importorskip("deepspeed")

from conftest import DS_EXAMPLE, deepspeed_example  # noqa: E402

script = deepspeed_example()

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "deepspeed_tiny.yaml"
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
              "ROLE_RANK", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
              "MV2_COMM_WORLD_SIZE", "AZUREML_EXPERIMENT_ID", "SM_TRAINING_ENV")
"""What a launcher (torchrun, deepspeed, MPI, AzureML, SageMaker) sets: none of it in a plain run."""
SMALL = ["--model.d_model=32", "--model.embedding_size=257", "--model.max_sequence_length=32", "--data.seq_len=32",
         "--deepspeed.train_micro_batch_size_per_gpu=2", "--tda.capture.proj_dim=8"]


def run_script(tmp_path: Path, *args: str, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """The script as docs/DEEPSPEED.md runs it: ``python -m``, no launcher variables in the environment
    (``env``: more variables)."""
    plain = {k: v for k, v in outside_slurm_env().items() if k not in LAUNCH_ENV}
    return run_module(str(DS_EXAMPLE), [str(CONFIG), *args], timeout=timeout,
                      env={**plain, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=tmp_path)


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def store_files(run: Path) -> dict[str, bytes]:
    """Every file of the run's gradient store, by path, with its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted((run / "tda" / "store").rglob("*")) if p.is_file()}


def test_deepspeed_pretrain_runs_as_one_process_without_a_launcher(tmp_path):
    """No RANK/WORLD_SIZE (plain ``python -m``): a process group of one (DeepSpeed would look for
    MPI otherwise), a queryable run; a rerun asking for fewer steps than its checkpoint is refused."""
    done = run_script(tmp_path, f"--run_dir={tmp_path / 'run'}", "--steps=2", "--save_every=2", *SMALL)
    assert done.returncode == 0, done.stderr[-6000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 1 and summary["steps"] == 2 and summary["tda"]["steps_committed"] == 2
    assert "no launcher: training as a single process" in done.stderr
    run = tmp_path / "run"
    assert (run / script.WEIGHTS_FILE).is_file() and (run / "checkpoints" / "latest").is_file()
    run_json = json.loads((run / script.RUN_JSON).read_text())
    assert run_json["seq_len"] == run_json["model"]["max_sequence_length"] == 32
    written = {name: (run / name).read_bytes() for name in ("config.json", script.RUN_JSON)}
    assert run_json["train_batch_size"] == 4
    stored = store_files(run)
    again = run_script(tmp_path, f"--run_dir={tmp_path / 'run'}", "--steps=1", *SMALL)
    assert again.returncode == 2
    assert "steps: 1 is below the step 2 of the checkpoint" in error_line(again.stderr)
    # another model: refused by the gradient store, or (tda off) by the checkpoint, in one line each
    wider = run_script(tmp_path, f"--run_dir={tmp_path / 'run'}", "--steps=3", *SMALL, "--model.d_model=64")
    assert wider.returncode == 2
    assert f"gradient store {run / 'tda' / 'store'} was written with different settings" in error_line(wider.stderr)
    untracked = run_script(tmp_path, f"--run_dir={tmp_path / 'run'}", "--steps=3", *SMALL, "--model.d_model=64",
                           "--tda.enabled=false")
    assert untracked.returncode == 2
    line = error_line(untracked.stderr)
    assert f"run_dir: cannot resume from the checkpoint in {run / 'checkpoints'}: RuntimeError: " in line
    assert "size mismatch" in line and "give a new run_dir to start over" in line
    # another ZeRO stage: DeepSpeed's own failure is an empty AssertionError; refused before it, naming both
    zero3 = run_script(tmp_path, f"--run_dir={tmp_path / 'run'}", "--steps=3", *SMALL,
                       "--deepspeed.zero_optimization.stage=3")
    assert zero3.returncode == 2
    assert (f"deepspeed.zero_optimization.stage: 3, but the checkpoint in {run / 'checkpoints'} was written at ZeRO "
            "stage 2") in error_line(zero3.stderr)
    # another global batch (examples a step): the data order is read by step x batch, so refused, naming both
    bigger = run_script(tmp_path, f"--run_dir={run}", "--steps=3", *SMALL,
                        "--deepspeed.train_micro_batch_size_per_gpu=4")
    assert bigger.returncode == 2
    assert ("deepspeed.train_batch_size: 8 examples a step (train_micro_batch_size_per_gpu 4 x "
            f"gradient_accumulation_steps 2 x 1 rank(s)), but the checkpoint in {run / 'checkpoints'} was written by "
            "a run of 4 examples a step") in error_line(bigger.stderr)
    # the refused runs left the files of the run they refused to continue as they were, its store's too
    assert {name: (run / name).read_bytes() for name in written} == written
    assert store_files(run) == stored
    # the same batch split otherwise (micro-batch 1, accumulation 4) resumes, and step 3 reads the examples
    # the first split would have
    split = run_script(tmp_path, f"--run_dir={run}", "--steps=3", *SMALL,
                       "--deepspeed.train_micro_batch_size_per_gpu=1", "--deepspeed.gradient_accumulation_steps=4")
    assert split.returncode == 0, split.stderr[-4000:]
    from olmo_tda.store import GradientStore

    block = GradientStore.open(run / "tda" / "store").read_all(layers=[], steps=[3])
    num = len(script.TokenData(run_json["data_paths"], 32))
    want = [int(i) for m in range(2) for i in script.step_ids(3, 0, m, world=1, micro_bs=2, gas=2, num=num, seed=0)]
    assert sorted(block.ids.tolist()) == sorted(want) and len(want) == 4
    summary["tda"]["rows_captured"] += 4
    # without its checkpoint the run cannot be resumed, and its store is not appended to by a new one
    shutil.rmtree(run / "checkpoints")
    fresh = run_script(tmp_path, f"--run_dir={run}", "--steps=2", *SMALL)
    assert fresh.returncode == 2
    assert f"run_dir: {run} has no checkpoint to resume from, but the gradient store {run / 'tda' / 'store'} holds " \
           f"{summary['tda']['rows_captured']} rows of an earlier run" in error_line(fresh.stderr)


def test_deepspeed_pretrain_starts_over_the_run_stopped_before_its_first_checkpoint(tmp_path):
    """A run stopped before its first checkpoint (a preemption, a requeue, a restart: a run that saves
    no checkpoint, without the summary.json of its end, leaves its folder as one) is started over by
    the next start, whatever launched it: the store's rows of the stopped attempt go, and it ends with
    each step's rows once. A start after the run ended is refused and leaves it as it was."""
    from olmo_tda.store import GradientStore

    run = tmp_path / "run"
    args = (f"--run_dir={run}", "--steps=2", "--save_every=0", *SMALL)
    first = run_script(tmp_path, *args, "--seed=1")     # (its config edited before the restart)
    assert first.returncode == 0, first.stderr[-4000:]
    assert not (run / "checkpoints").exists()
    rows = GradientStore.open(run / "tda" / "store").num_rows
    finished = run_script(tmp_path, *args)             # after its end
    assert finished.returncode == 2 and "has no checkpoint to resume from" in error_line(finished.stderr)
    assert "which ended (summary.json)" in error_line(finished.stderr)
    (run / "summary.json").unlink()                 # as an attempt stopped before its end leaves it
    requeued = run_script(tmp_path, *args)
    assert requeued.returncode == 0, requeued.stderr[-4000:]
    assert f"starting it over (the {rows} rows stored in {run / 'tda' / 'store'} are dropped)" in requeued.stderr
    block = GradientStore.open(run / "tda" / "store").read_all(layers=[])
    assert len(block.ids) == rows and sorted(set(block.steps.tolist())) == [1, 2]
    assert all(len(set(block.ids[block.steps == s].tolist())) == (block.steps == s).sum() for s in (1, 2))
    again = run_script(tmp_path, *args)                # it ended again
    assert again.returncode == 2
    assert f"run_dir: {run} has no checkpoint to resume from" in error_line(again.stderr)
    assert GradientStore.open(run / "tda" / "store").num_rows == rows


def test_deepspeed_pretrain_estimates_a_missing_eigenbasis_without_touching_training(tmp_path):
    """proj_type eigen without a basis file: the script estimates one at the initial weights (ZeRO-2,
    and ZeRO-3 through the partitioned engine, as an OLMo run does), captures through it, and a
    resume reuses it. The estimate gives no weight a gradient (the engine's reduction hooks would
    add it to the first step): a run given the same file ends at the same loss with the same rows."""
    import numpy as np
    import torch

    from olmo_tda.capture.eigenbasis import EigenBasis
    from olmo_tda.store import GradientStore

    def rows(run):
        block = GradientStore.open(run / "tda" / "store").read_all()
        order = np.lexsort((block.ids, block.steps))
        return block.ids[order], {n: g[order] for n, g in block.grads.items()}

    eigen = ["--tda.capture.proj_type=eigen", "--tda.capture.basis_batches=2", "--save_every=1", *SMALL]
    for stage in (2, 3):
        run, given = tmp_path / f"z{stage}", tmp_path / f"z{stage}_given"
        zero = f"--deepspeed.zero_optimization.stage={stage}"
        first = run_script(tmp_path, f"--run_dir={run}", zero, "--steps=2", *eigen)
        assert first.returncode == 0, first.stderr[-4000:]
        assert f"tda: estimating the eigenbasis through the engine (ZeRO stage {stage}, 1 rank)" in first.stderr
        basis = EigenBasis.load(run / "tda" / "basis.safetensors")
        store = GradientStore.open(run / "tda" / "store")
        assert set(store.layer_shapes) == set(basis.layers) and store.num_rows > 0
        assert all(s == (8, 8) for s in store.layer_shapes.values())
        assert json.loads((run / script.RUN_JSON).read_text())["tda"]["capture"]["basis"] == \
            str(run / "tda" / "basis.safetensors")
        other = run_script(tmp_path, f"--run_dir={given}", zero, "--steps=2", *eigen,
                           f"--tda.capture.basis={run / 'tda' / 'basis.safetensors'}")
        assert other.returncode == 0 and "estimating" not in other.stderr, other.stderr[-4000:]
        loss = [json.loads(done.stdout.strip().splitlines()[-1])["final_loss"] for done in (first, other)]
        assert loss[0] == loss[1], (stage, loss)
        (ids, grads), (ids2, grads2) = rows(run), rows(given)
        assert np.array_equal(ids, ids2) and all(torch.equal(grads[n], grads2[n]) for n in grads)
    digest = basis.digest
    again = run_script(tmp_path, f"--run_dir={run}", "--deepspeed.zero_optimization.stage=3", "--steps=3", *eigen)
    assert again.returncode == 0 and "resumed from" in again.stderr and "estimating" not in again.stderr, \
        again.stderr[-4000:]
    assert EigenBasis.load(run / "tda" / "basis.safetensors").digest == digest


@pytest.mark.slow
def test_deepspeed_pretrain_zero3_starts_from_the_weights_of_a_plain_build(tmp_path):
    """ZeRO-3 builds the model partitioned (zero.Init), where OLMo's own init met empty tensors: the
    first step's loss (at the initial weights, same data) must equal ZeRO-2's, tied head included,
    and sit near ln(vocab) as OLMo's init gives. (Slow: the 2-rank test_deepspeed_example_zero3_on_two_
    ranks_starts_from_olmos_init checks the weights themselves in the default run.)"""
    import math

    losses = {}
    for stage in (2, 3):
        done = run_script(tmp_path, f"--run_dir={tmp_path / f'z{stage}'}", "--steps=1", "--save_every=0", *SMALL,
                          f"--deepspeed.zero_optimization.stage={stage}", "--deepspeed.bf16.enabled=false",
                          "--model.weight_tying=true", "--tda.enabled=false")
        assert done.returncode == 0, done.stderr[-4000:]
        losses[stage] = json.loads((tmp_path / f"z{stage}" / "summary.json").read_text())["final_loss"]
    assert abs(losses[3] - losses[2]) < 1e-4 * losses[2], losses
    assert abs(losses[2] - math.log(257)) < 0.5, losses


def test_deepspeed_pretrain_bad_deepspeed_section_or_data_is_one_line_error(tmp_path):
    """Refusals that need the process group (DeepSpeed checks its config against the world size;
    the data rows are counted; the eigenbasis is written after deepspeed.initialize): exit 2 with
    the key path, no traceback."""
    short = tmp_path / "short.bin"
    short.write_bytes(b"\x01\x00" * 10)       # 10 tokens: not one row of 32
    cases = [(["--deepspeed.zero_optimization.stagee=3"], "deepspeed.zero_optimization.stagee: Extra inputs are not"),
             (["--deepspeed.train_batch_size=7"], "deepspeed: DeepSpeed rejected the config: Check batch related"),
             ([f"--data.paths=[{short}]"], "data.paths: ['" + str(short) + "'] hold no full row of data.seq_len=32"),
             (["--tda.capture.proj_type=eigen", f"--tda.capture.basis={short}/basis.safetensors"],
              f"tda.capture.basis: cannot write the eigenbasis to {short}/basis.safetensors")]
    for overrides, message in cases:
        done = run_script(tmp_path, f"--run_dir={tmp_path / 'run'}", "--steps=1", *SMALL, *overrides)
        assert done.returncode == 2 and message in error_line(done.stderr), (overrides, done.stderr[-3000:])
        assert not (tmp_path / "run" / script.RUN_JSON).exists()


@pytest.mark.parametrize("overrides, message", [
    (["--model.d_modell=128"], "model.d_modell: unknown key; did you mean 'd_model'?"),
    (["--steps=abc"], "steps: expected an integer >= 1, got 'abc'"),
    (["--steps=0"], "steps: expected an integer >= 1, got 0"),
    (["--save_every=often"], "save_every: expected an integer >= 0, got 'often'"),
    (["--seed=-1"], "seed: expected an integer >= 0, got -1"),
    (["--stepz=3"], "unknown top-level keys ['stepz'] (did you mean 'steps' for 'stepz'?)"),
    (["--steps", "20"], "override '--steps': expected --key=value, e.g. --steps=20"),
    (["--steps=[20"], "override '--steps=[20': value is not valid YAML"),
    (["--model=3"], "model: expected a mapping, got 3"),
    (["--deepspeed=3"], "deepspeed: expected a mapping, got 3"),
    (["--model.d_model=abc"], "model.d_model: Value 'abc' of type 'str' could not be converted to Integer"),
    (["--model.init_fn=normall"], "model.init_fn: Invalid value 'normall', expected one of"),
    (["--model.d_model=130"], "model: OLMo cannot build this model: AssertionError (at model.py:"),
    (["--model.embedding_size=100"], "model: OLMo cannot build this model: OLMoConfigurationError: embedding size"),
    (["--data.path=[a.npy]"], "data.path: unknown key; did you mean 'paths'?"),
    (["--data.paths=a.npy"], "data.paths: expected a list of token files, e.g. --data.paths=[a.npy,b.npy], got 'a."),
    (["--data.paths=[a.npy]"], "data.paths: no such file(s) ['a.npy']"),
    (["--data.seq_len=32"], "data.seq_len 32 != model.max_sequence_length 64: set both to the same length"),
    (["--model.max_sequence_length=32"], "data.seq_len 64 != model.max_sequence_length 32"),
    (["--deepspeed.train_micro_batch_size_per_gpu=abc"], "deepspeed.train_micro_batch_size_per_gpu: expected an"),
    (["--deepspeed.managed_gradient_accumulation=false"], "deepspeed.managed_gradient_accumulation: False is not "
                                                           "supported by this script"),
    (["--tda.capture.proj_dimm=8"], "tda.capture.proj_dimm: unknown key; did you mean 'proj_dim'?"),
    (["--tda.selection.enabled=true", "--tda.selection.target=none.txt"], "tda.selection.target: no such file"),
])
def test_deepspeed_pretrain_bad_value_is_one_line_error_naming_the_key(tmp_path, capsys, monkeypatch, overrides,
                                                                       message):
    """Checked before any process group or DeepSpeed starts: exit 2 and one ``error:`` line."""
    monkeypatch.chdir(tmp_path)
    assert script.main([str(CONFIG), f"--run_dir={tmp_path / 'run'}", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in error_line(err), err
    assert not (tmp_path / "run").exists()


def test_deepspeed_pretrain_unwritable_run_dir_is_one_line_error(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert script.main([str(CONFIG), f"--run_dir={tmp_path / 'file' / 'run'}"]) == 2
    assert f"run_dir: cannot create {tmp_path / 'file' / 'run'}: " in error_line(capsys.readouterr().err)


@pytest.mark.parametrize("text, message", [("a: [1\n", "not valid YAML"), ("- 1\n", "expected a mapping at top level"),
                                           ("", "'run_dir' is required")])
def test_deepspeed_pretrain_bad_yaml_file_is_one_line_error(tmp_path, capsys, text, message):
    (tmp_path / "run.yaml").write_text(text)
    assert script.main([str(tmp_path / "run.yaml")]) == 2
    assert message in error_line(capsys.readouterr().err)


def test_deepspeed_pretrain_data_seq_len_defaults_to_the_models(tmp_path):
    """The one data.seq_len a queryable run can have; the model values come back as OLMo types them."""
    cfg = script.load_config(CONFIG, ["--data.seq_len=null", "--model.max_sequence_length=32", "--model.d_model=32",
                                      f"--run_dir={tmp_path}"])
    assert cfg["data"] == {"paths": [], "seq_len": 32}
    assert cfg["model"]["d_model"] == 32 and cfg["model"]["init_fn"] == "normal"
    with pytest.raises(ConfigError, match=r"data\.seq_len 32 != model\.max_sequence_length 64"):
        script.load_config(CONFIG, ["--data.seq_len=32"])


def test_deepspeed_pretrain_launch_env_is_one_process_then_restored(monkeypatch):
    """Without a launcher the process group of one is set up as torchrun would, and undone after;
    a half-set launcher environment is refused naming what is missing; a full one is left alone."""
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    with script._launch_env():
        assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")} == \
            {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        assert 0 < int(os.environ["MASTER_PORT"]) < 65536
    assert not any(k in os.environ for k in LAUNCH_ENV)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match="launcher environment: RANK set but WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                                          "MASTER_PORT not"):
        with script._launch_env():
            pass
    full = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="1234")
    for key, value in full.items():
        monkeypatch.setenv(key, value)
    with script._launch_env():
        assert {k: os.environ[k] for k in full} == full


def test_deepspeed_pretrain_trajectory_beside_a_moved_store_is_found_by_queries(tmp_path):
    """``tda.store.path`` elsewhere: the trajectory goes beside the store (``attach``'s default), and
    ``inspect``/``attribute`` look there, not in ``<run_dir>/tda/trajectory`` (they said 'no trajectory')."""
    from olmo_tda.integrations.olmo_query import open_run, run_outputs

    store = tmp_path / "elsewhere" / "store"
    done = run_script(tmp_path, f"--run_dir={tmp_path / 'run'}", "--steps=2", *SMALL, f"--tda.store.path={store}",
                      "--tda.trajectory.enabled=true", "--tda.trajectory.every=1")
    assert done.returncode == 0, done.stderr[-6000:]
    assert sorted(p.name for p in (tmp_path / "elsewhere" / "trajectory").iterdir()) == \
        ["step00000000", "step00000001", "step00000002"]
    assert run_outputs(tmp_path / "run") == (store, tmp_path / "elsewhere" / "trajectory")
    run = open_run(tmp_path / "run")
    assert [c.step for c in run.checkpoints()] == [0, 1, 2]
    answers = run.attribute(["def f(x): return x"], method="tracin-inrun", top_k=3)
    assert len(answers[0]["results"]) == 3


def test_a_resume_with_another_global_batch_is_refused_by_run_json_or_deepspeeds_count():
    """Before the load, run.json's train_batch_size decides; without it (an older run.json), DeepSpeed's
    own count once loaded, global_samples / global_steps. Another split of the same batch passes."""
    from types import SimpleNamespace

    def engine(micro, gas, steps=0, samples=0):
        return SimpleNamespace(train_batch_size=lambda: micro * gas * 2, train_micro_batch_size_per_gpu=lambda: micro,
                               gradient_accumulation_steps=lambda: gas, global_steps=steps, global_samples=samples)

    check, ckpt = script._check_same_batch, Path("ckpt")
    check(engine(2, 2), ckpt, 2, 8)                         # the same batch
    check(engine(1, 4), ckpt, 2, 8)                         # split otherwise
    check(engine(2, 2), ckpt, 2, None)                      # nothing recorded, nothing loaded yet
    check(engine(4, 1, steps=5, samples=40), ckpt, 2, None)
    check(engine(2, 2), ckpt, 2, "8")                       # not a count: not ours to judge
    with pytest.raises(ConfigError, match=r"train_batch_size: 16 examples a step \(train_micro_batch_size_per_gpu 4 "
                                          r"x gradient_accumulation_steps 2 x 2 rank\(s\)\), but the checkpoint in "
                                          r"ckpt was written by a run of 8 examples a step: .* Resume with 8 examples"):
        check(engine(4, 2), ckpt, 2, 8)
    with pytest.raises(ConfigError, match=r"trained 40 examples in 5 steps \(8 a step\).* Resume with 8 examples"):
        check(engine(4, 2, steps=5, samples=40), ckpt, 2, None)
    with pytest.raises(ConfigError, match=r"trained 44 examples in 5 steps \(8.80 on average a step\).* changed its "
                                          r"batch part-way: give a new run_dir"):
        check(engine(4, 2, steps=5, samples=44), ckpt, 2, None)


def test_a_resume_under_another_zero_stage_or_rank_count_is_refused_before_deepspeed_loads(tmp_path):
    """run.json records the ZeRO stage and rank count the checkpoints were written with: a resume that
    differs is refused naming both (DeepSpeed itself fails with an empty AssertionError on another
    stage, and on another rank count of a partitioned optimizer). Stage 0 holds whole optimizer state,
    and a run.json from before the record says nothing: both let DeepSpeed try."""
    ckpt = tmp_path / "checkpoints"
    check = script._check_same_zero
    check(tmp_path, ckpt, 3, 2)                                     # no run.json
    (tmp_path / script.RUN_JSON).write_text(json.dumps({"kind": "deepspeed_pretrain"}))
    check(tmp_path, ckpt, 3, 2)                                     # an older run.json
    (tmp_path / script.RUN_JSON).write_text(json.dumps({"zero_stage": 2, "world_size": 4}))
    check(tmp_path, ckpt, 2, 4)
    with pytest.raises(ConfigError, match=r"stage: 1, but the checkpoint in .* was written at ZeRO stage 2"):
        check(tmp_path, ckpt, 1, 4)
    with pytest.raises(ConfigError, match=r"written by 4 rank\(s\) and this run has 2: .* ZeRO-2 .* resume with 4"):
        check(tmp_path, ckpt, 2, 2)
    (tmp_path / script.RUN_JSON).write_text(json.dumps({"zero_stage": 0, "world_size": 4}))
    check(tmp_path, ckpt, 0, 2)
