"""DeepSpeed ZeRO 1/2/3 for real: 2-rank torchrun (gloo, CPU) runs of a tiny OLMo LM through
``deepspeed.initialize``, the user's loop unchanged, tda attached from the DeepSpeed config.

Oracles (independent of the code under test): the full weights before every step (gathered by the
worker), per-example gradients of each example's summed token CE from ``torch.func.vmap(grad)``
on a plain copy of the model, the data order and the lr schedule as plain functions of the step.
All tests here have ``deepspeed`` or ``zero`` in their names (``pytest -k deepspeed``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import _deepspeed_worker as worker
from conftest import DS_EXAMPLE, deepspeed_example, outside_slurm_env, rel_err
from olmo_tda.store import GradientStore

pytest.importorskip("deepspeed")

HERE = Path(__file__).resolve().parent
MATRIX = [f"stage={s},gas={g},dtype={d}" for s in (1, 2, 3) for g in (1, 2) for d in ("fp32", "bf16")]
EXTRA = ["stage=3,gas=2,dtype=fp32,init=1",                    # zero.Init partitioned construction
         "stage=3,gas=2,dtype=bf16,init=1,attach=before",      # capture attached before initialize
         "stage=1,gas=2,dtype=fp32,reduction=sum",             # the user's other loss reductions
         "stage=2,gas=2,dtype=fp32,reduction=example_mean",
         "stage=2,gas=2,dtype=fp32,backward=direct",           # loss.backward() instead of engine.backward
         "stage=3,gas=2,dtype=bf16,backward=scale",            # engine.scale(loss).backward()
         "stage=3,gas=2,dtype=bf16,init=1,traj=1,steps=3",     # trajectory checkpoints gathered from ZeRO-3
         "stage=2,gas=2,dtype=fp32,nan_step=2,steps=3",         # overflow: the engine skips step 2
         "stage=1,gas=1,dtype=fp32,nan_step=1,steps=2"]
AUTOCAST = ["stage=2,gas=2,dtype=autocast16",                 # fp16 autocast: a 2^16 loss scale to undo
            "stage=1,gas=2,dtype=autocast16,backward=scale",
            "stage=2,gas=2,dtype=autocast16,backward=scale_outside",
            "stage=2,gas=2,dtype=fp32,backward=scale_outside",
            "stage=1,gas=2,dtype=autocast16,backward=engine_outside"]
RANKED = ["stage=3,gas=2,dtype=fp32,init=1,rank=3"]               # LoRIF factors (12 tokens > c: truncated)
EMB = ["stage=3,gas=2,dtype=fp32,init=1,emb=1",                 # capture.embeddings on a partitioned table
       "stage=3,gas=2,dtype=fp32,init=1,emb=2"]                  # ... whose head is tied to it
BF16_TOL = 3e-2
"""bf16 keeps 8 significant bits (unit roundoff 2^-9 ≈ 2e-3); the forward and backward through two
blocks round activations and output gradients in bf16 ~20 times in sequence, so the engine's own bf16
per-example gradients differ from fp32 math on the same (bf16-rounded) weights by ~1e-2 (measured
worst 7.5e-3 over the matrix: see test_deepspeed_bf16_error_is_the_engines_own_rounding). The
tolerance is 4x that; the fp32 runs of the same cases agree to < 1e-6."""


DS_CONFIG = HERE.parent / "configs" / "deepspeed_tiny.yaml"


def pretrain_two_ranks(cwd: Path, overrides: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """The DeepSpeed example script on 2 ranks (torchrun, gloo) with ``overrides``; it must succeed.
    ``env``: more variables, over this environment without Slurm's."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DS_EXAMPLE),
           str(DS_CONFIG), *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**outside_slurm_env(), "OMP_NUM_THREADS": "1", **(env or {})})
    assert done.returncode == 0, done.stderr[-6000:]
    return done


def torchrun(out: Path, *cases: str, expect_ok: bool = True, timeout: int = 900, nproc: int = 2,
             env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / "_deepspeed_worker.py"), str(out), *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE)
    if expect_ok:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-8000:]
        assert "Abort" not in done.stderr and "core dumped" not in done.stderr, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    torchrun(out, *MATRIX, *EXTRA, *AUTOCAST, *RANKED, *EMB, "errors")
    return out


def exact_grads(weights: dict, ids: np.ndarray, tied: bool = False) -> dict[str, torch.Tensor]:
    """``{linear name: [B, O, I]}`` gradients of each example's summed token CE, fp32 torch.func,
    and the token table's (transposed: ``[B, d, V]``, as capture stores it) under its module name."""
    from torch.func import functional_call, grad, vmap

    model = worker.TokenMeanLM(tied=tied)   # the weights are replaced by the saved ones below
    input_ids, labels = worker.tokens()

    def summed_ce(params, x, y):
        logits = functional_call(model.olmo, params, (x[None],)).logits[0]
        return torch.nn.functional.cross_entropy(logits.float(), y, ignore_index=-100, reduction="sum")

    params = {name[len("olmo."):]: w for name, w in weights.items()}
    g = vmap(grad(summed_ce), in_dims=(None, 0, 0))(params, input_ids[ids], labels[ids])
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return {**{name: g[f"{name[len('olmo.'):]}.weight"] for name in linears},
            "olmo.transformer.wte": g["transformer.wte.weight"].transpose(1, 2)}


def stored_rows(root: Path):
    store = GradientStore.open(root / "store")
    block = store.read_all()
    return store, block


def check_against_torch_func(root: Path, case: dict, tol: float, world: int = 2) -> float:
    store, block = stored_rows(root)
    keys = list(zip(block.ids.tolist(), block.steps.tolist()))
    assert len(keys) == len(set(keys)), "duplicate (id, step) rows"
    applied = [s for s in range(1, case["steps"] + 1) if s != case["nan_step"]]
    assert sorted(set(block.steps.tolist())) == applied
    worst = 0.0
    for step in applied:
        ids = np.concatenate([worker.ids_for(step, r, m, case["gas"], world) for r in range(world)
                              for m in range(case["gas"])])
        rows = np.flatnonzero(block.steps == step)
        order = {int(i): k for k, i in zip(rows, block.ids[rows])}
        assert sorted(order) == sorted(ids.tolist()), f"step {step}: stored ids differ from the data order"
        take = np.array([order[int(i)] for i in ids])
        skipped = int(0 < case["nan_step"] < step)
        assert np.allclose(block.lr[take], worker.lr_at(step, skipped), rtol=1e-6)
        weights = torch.load(root / f"weights_step{step}.pt", weights_only=True)
        exact = exact_grads(weights, ids, tied=case["emb"] == 2)
        assert set(exact) == set(store.layers) | ({"olmo.transformer.wte"} if not case["emb"] else set())
        for name in store.layers:
            got, want = block.grads[name][take], exact[name].double()
            if store.layer_ranks[name]:         # LoRIF: the best rank-c approximation of the exact gradient
                u, s, vh = torch.linalg.svd(want)
                c = store.layer_ranks[name]
                got, want = got.dense(), (u[:, :, :c] * s[:, None, :c]) @ vh[:, :c]
            err = rel_err(got.double(), want)
            worst = max(worst, err)
            assert err < tol, f"{root.name} step {step} {name}: relative error {err:.2e} >= {tol}"
    return worst


@pytest.mark.parametrize("text", MATRIX + EXTRA[:7] + AUTOCAST + RANKED + EMB, ids=lambda t: worker.case_name(worker.parse_case(t)))
def test_deepspeed_zero_capture_equals_torch_func_per_example_gradients(runs, text):
    case = worker.parse_case(text)
    root = runs / worker.case_name(case)
    assert (root / "done").exists(), "the worker did not finish this case"
    check_against_torch_func(root, case, 1e-4 if case["dtype"] == "fp32" else BF16_TOL)


def test_deepspeed_bf16_error_is_the_engines_own_rounding(runs):
    """The bf16 error is bf16 arithmetic, not capture: the same comparison in fp32 is ~1e-6, and the
    bf16 error is of the order of bf16 rounding (not 0, which would mean the engine ran in fp32)."""
    worst_bf16 = max(check_against_torch_func(runs / worker.case_name(worker.parse_case(t)),
                                              worker.parse_case(t), BF16_TOL) for t in MATRIX if "bf16" in t)
    worst_fp32 = max(check_against_torch_func(runs / worker.case_name(worker.parse_case(t)),
                                              worker.parse_case(t), 1e-4) for t in MATRIX if "fp32" in t)
    print(f"worst relative error: bf16 {worst_bf16:.2e}, fp32 {worst_fp32:.2e}")
    assert worst_fp32 < 1e-5
    assert 1e-3 < worst_bf16 < BF16_TOL / 2


@pytest.mark.parametrize("text", EXTRA[7:], ids=["zero2-gas2", "zero1-gas1-first-step"])
def test_deepspeed_zero_overflow_step_is_dropped(runs, text):
    case = worker.parse_case(text)
    root = runs / worker.case_name(case)
    committed, dropped, _ = (int(v) for v in (root / "done").read_text().split())
    assert dropped == 1 and committed == case["steps"] - 1
    check_against_torch_func(root, case, 1e-4)   # also: the skipped step has no rows at all


@pytest.mark.parametrize("text", ["stage=2,gas=2,dtype=fp32", *AUTOCAST])
def test_deepspeed_zero_store_metadata_and_per_row_loss_scale(runs, text):
    """Rows carry their divisor in the applied update: counted labels of the micro-batch × GAS × the
    data-parallel ranks averaged, never the fp16 loss scale (TracIn weights rows by lr / loss_scale; the
    optimizer unscales before its step)."""
    case = worker.parse_case(text)
    store, block = stored_rows(runs / worker.case_name(case))
    assert store.meta["extra"]["framework"] == "deepspeed" and store.meta["extra"]["zero_stage"] == case["stage"]
    assert {s.rank for s in store.shards} == {0, 1}
    _, labels = worker.tokens()
    for step in (1, 2):
        for rank in range(2):
            for micro in range(2):
                ids = worker.ids_for(step, rank, micro, 2)
                counted = int((labels[ids] != -100).sum())
                rows = [k for k in range(len(block.ids)) if block.steps[k] == step and block.ids[k] in ids]
                assert np.all(block.loss_scale[rows] == counted * 2 * 2)     # × GAS × the 2 ranks averaged


def test_deepspeed_zero3_save_kill_load_continue_has_no_duplicate_or_missing_rows(tmp_path):
    """ZeRO-3 with zero.Init: checkpoint at step 3, rows of steps 4-5 made durable, SIGKILL after step
    6 (its window unflushed), resume from the checkpoint to step 8. The store must hold every (id, step)
    of steps 1-8 exactly once, equal to an uninterrupted run's rows; the trajectory (every 2 steps) the
    uninterrupted run's checkpoints, the crashed run's steps 4 and 6 replaced, with the same tokens
    seen and learning rates."""
    base = "stage=3,gas=2,dtype=fp32,init=1,steps=8,traj=2"
    killed = torchrun(tmp_path, base, base + ",save_at=3,kill_after=6", expect_ok=False)
    assert killed.returncode != 0
    crashed = tmp_path / worker.case_name(worker.parse_case(base + ",save_at=3"))
    assert not (crashed / "done").exists()
    before = GradientStore.open(crashed / "store", repair=True)
    assert max(before.steps) == 5, "the test needs rows past the checkpoint on disk"
    torchrun(tmp_path, base + ",save_at=3,resume=1")
    # both ranks' indexes hold sealed blocks (the worker seals every 2 shards) cut back by the resume
    assert {p.name[:6] for p in (crashed / "store" / "index").glob("*.json")} == {"r00000", "r00001"}
    _, straight = stored_rows(tmp_path / worker.case_name(worker.parse_case(base)))
    _, resumed = stored_rows(crashed)
    keys = list(zip(resumed.ids.tolist(), resumed.steps.tolist()))
    assert len(keys) == len(set(keys)), "duplicate (id, step) after resume"
    want = {(int(i), s) for s in range(1, 9) for r in range(2) for m in range(2) for i in worker.ids_for(s, r, m, 2)}
    assert set(keys) == want, f"missing {sorted(want - set(keys))[:5]} extra {sorted(set(keys) - want)[:5]}"
    # DeepSpeed's monitor got the run's row counts (both ranks), carried over the resume: the killed
    # session's steps 1-6, then the resumed one's 4-8
    logged = (crashed / "monitor" / "tda" / "tda_rows_captured.csv").read_text().split()
    per_step = len(want) // 8
    assert [float(line.split(",")[1]) for line in logged if not line.startswith("step")] == \
        [float(per_step * s) for s in (1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8)]
    where = {key: k for k, key in enumerate(zip(straight.ids.tolist(), straight.steps.tolist()))}
    take = np.array([where[key] for key in keys])
    assert np.allclose(resumed.lr, straight.lr[take], rtol=1e-12)
    for name, g in resumed.grads.items():
        assert rel_err(g.double(), straight.grads[name][take].double()) < 1e-5, name
    from olmo_tda.training.trajectory import Trajectory
    ref = {c.step: c for c in Trajectory.list(tmp_path / worker.case_name(worker.parse_case(base)) / "trajectory")}
    got = {c.step: c for c in Trajectory.list(crashed / "trajectory")}
    assert sorted(got) == sorted(ref) == [0, 2, 4, 6, 8]
    for step, c in ref.items():
        assert got[step].tokens_seen == c.tokens_seen and np.isclose(got[step].tracin_lr, c.tracin_lr), step
        if step > 3:            # written again by the resumed run, at the uninterrupted run's weights
            assert all(torch.allclose(a, c.load()[k], atol=1e-5) for k, a in got[step].load().items()), step


@pytest.mark.gpu
def test_deepspeed_zero2_fp16_loss_scale_is_undone_on_cuda(tmp_path):
    """fp16 (DeepSpeed refuses it on CPU): the dynamic loss scale (2^8 here) multiplies the
    backpropagated loss; the stored gradients must not carry it. One rank, nccl."""
    text = "stage=2,gas=2,dtype=fp16,steps=3"
    torchrun(tmp_path, text, nproc=1, env={"DS_WORKER_DEVICE": "cuda"})
    case = worker.parse_case(text)
    root = tmp_path / worker.case_name(case)
    committed, dropped, _ = (int(v) for v in (root / "done").read_text().split())
    assert (committed, dropped) == (3, 0)        # 2^8 does not overflow this model
    check_against_torch_func(root, case, BF16_TOL, world=1)   # fp16 keeps 3 more bits than bf16


def test_deepspeed_bad_input_names_the_problem_and_disabled_touches_nothing(runs):
    """On a real 2-rank engine: each misuse raises ConfigError naming the key and the fix; a
    disabled config adds no hook and wraps no engine method; the YAML section and set_batch work."""
    import json

    results = json.loads((runs / "errors" / "results.json").read_text())
    assert results["no_tda_entry"].startswith("ConfigError: tda: no config given") and "'tda' entry" in results["no_tda_entry"]
    assert results["no_store_path"].startswith("ConfigError: tda.store.path:")
    assert results["missing_ids"].startswith("ConfigError: tda.batch.ids_key:") and "set_batch" in results["missing_ids"]
    assert results["missing_labels"].startswith("ConfigError: tda.batch.reduction:") and "'targets'" in results["missing_labels"]
    assert results["set_batch"] == f"ok: {worker.MICRO}"
    assert results["eigen_no_basis"].startswith("ConfigError: tda.capture.basis: proj_type 'eigen'") and \
        "does not exist" in results["eigen_no_basis"] and "deepspeed.estimate_basis(" in results["eigen_no_basis"]
    assert results["estimate_random"].startswith("ConfigError: estimate_basis: tda.capture.proj_type is 'orthogonal'")
    assert results["estimate_basis"] == f"ok: True grads=0 rows={worker.MICRO}"
    assert results["disabled"] == "ok: hooks=0 wrapped=[]"
    assert results["yaml"] == "ok: (8, 8)"
    assert results["projector_mismatch"].startswith("ConfigError: tda.capture: resuming with projectors")
    assert results["warm_start"].startswith("ok: global_steps=")          # load_module_only: no resume checks
    assert results["attach_twice"].startswith("ConfigError: attach: engine.step, engine.backward")
    assert results["reserved_key"].startswith("ConfigError: save_checkpoint: client_state key 'olmo_tda'")
    assert results["rollback_metrics"] == {"rows_captured": 0, "steps_committed": 0, "steps_dropped_overflow": 0,
                                           "rows_skipped_nonfinite": 0}
    # the rollback run passed the abandoned checkpoint's step: its step's rows are there again, of the new run
    assert re.match(r"ConfigError: tda: the checkpoint of step (\d+) belongs to an abandoned run: a later resume cut "
                    r"the store back to step (\d+)", results["abandoned"]), results["abandoned"]


def test_deepspeed_example_zero3_on_two_ranks_starts_from_olmos_init(tmp_path):
    """ZeRO-3 builds the model partitioned, where OLMo's own init met empty tensors: the script
    re-runs it, each layer's weights gathered in turn. The step-0 trajectory checkpoint (the gathered
    initial weights) equals a plain build of the same config and seed, tied head included."""
    from olmo.config import ModelConfig
    from safetensors.torch import load_file

    script = deepspeed_example()
    from olmo_tda.training.trajectory import Trajectory

    run = tmp_path / "run"
    overrides = [f"--run_dir={run}", "--model.d_model=32", "--model.embedding_size=257", "--data.seq_len=32",
                 "--model.max_sequence_length=32", "--deepspeed.train_micro_batch_size_per_gpu=2",
                 "--deepspeed.zero_optimization.stage=3", "--deepspeed.bf16.enabled=false", "--model.weight_tying=true",
                 "--tda.capture.proj_dim=8", "--tda.trajectory.enabled=true", "--steps=1", "--save_every=0"]
    done = pretrain_two_ranks(tmp_path, overrides)
    assert "re-running OLMo's init on the partitioned model, layer by layer" in done.stderr
    theta0 = load_file(str(Trajectory.list(run / "tda" / "trajectory")[0].path / "model.safetensors"))
    cfg = script.load_config(DS_CONFIG, overrides)
    torch.manual_seed(0)
    plain = script.CausalLM(ModelConfig(**{"init_device": "cpu", **cfg["model"]})).state_dict()
    assert set(theta0) == set(plain)
    assert all(torch.equal(theta0[k], plain[k]) for k in plain), \
        {k: float((theta0[k] - plain[k]).abs().max()) for k in plain}


def test_deepspeed_example_estimates_the_eigenbasis_over_both_ranks_batches(tmp_path):
    """proj_type eigen without a basis file on 2 ranks under ZeRO-3 (fp32): the file the script
    writes, through the partitioned engine, is the eigenbasis of the covariances summed over both
    ranks' micro-batches at the initial weights: the same as one process estimating it over all of
    them on a plain build (the batches rebuilt from the script's data order)."""
    from olmo_tda.capture.eigenbasis import EigenBasis, estimate_eigenbasis
    from olmo_tda.config import TDAConfig
    script = deepspeed_example()
    from olmo_tda.training.selection import DataOrder

    run = tmp_path / "run"
    overrides = [f"--run_dir={run}", "--model.d_model=32", "--model.embedding_size=257", "--data.seq_len=32",
                 "--model.max_sequence_length=32", "--deepspeed.train_micro_batch_size_per_gpu=2",
                 "--tda.capture.proj_dim=8", "--tda.capture.proj_type=eigen", "--tda.capture.basis_batches=2",
                 "--deepspeed.zero_optimization.stage=3", "--deepspeed.bf16.enabled=false", "--steps=1",
                 "--save_every=0"]
    pretrain_two_ranks(tmp_path, overrides)
    got = EigenBasis.load(run / "tda" / "basis.safetensors")

    cfg = script.load_config(DS_CONFIG, overrides)
    from olmo.config import ModelConfig
    torch.manual_seed(0)                                   # the script's seed: the same initial weights
    model = script.CausalLM(ModelConfig(**{"init_device": "cpu", **cfg["model"]}))
    data = script.TokenData([str(run / "data" / "train.npy")], 32)
    order = DataOrder(len(data), lambda epoch: script._epoch_order(0, epoch, len(data)))
    batches = [data.batch(order.ids(j * 2, 2)) for j in range(4)]      # rank 0's 2, then rank 1's 2

    def summed(m, batch):
        logits = m.olmo(batch["input_ids"]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")

    capture = TDAConfig.from_dict({"capture": {"proj_dim": 8}}).capture
    want = estimate_eigenbasis(model, batches, summed, capture)
    assert set(got.layers) == set(want.layers)
    for name, lb in want.layers.items():
        mine = got.layer(name)
        for side in ("eigvals_out", "eigvals_in"):
            assert rel_err(getattr(mine, side), getattr(lb, side)) < 1e-6, (name, side)


def test_deepspeed_zero2_two_ranks_follow_the_basis_with_identical_bits(tmp_path):
    """capture.basis_every under DeepSpeed ZeRO-2 on 2 ranks (the example script): every rank's shards
    name the same version at every step (identical bits: the digest hashes the matrices), versions
    come in force the step after each refresh, and each version's file is whole."""
    from olmo_tda.capture.following import refresh_steps
    from olmo_tda.store import GradientStore

    run = tmp_path / "run"
    pretrain_two_ranks(tmp_path, [f"--run_dir={run}", "--model.d_model=32", "--model.embedding_size=257",
                                  "--data.seq_len=32", "--model.max_sequence_length=32",
                                  "--deepspeed.train_micro_batch_size_per_gpu=2", "--tda.capture.proj_dim=4",
                                  "--tda.capture.proj_type=eigen", "--tda.capture.basis_every=4",
                                  "--tda.capture.basis_batches=1", "--tda.capture.basis_tokens=32",
                                  "--deepspeed.zero_optimization.stage=2", "--deepspeed.bf16.enabled=false",
                                  "--steps=6", "--save_every=0"])
    store = GradientStore.open(run / "tda" / "store")
    per_rank = {r: {s: info.basis for info in store.shards if info.rank == r
                    for s in range(info.step_min, info.step_max + 1)} for r in (0, 1)}
    assert per_rank[0] == per_rank[1] and sorted(per_rank[0]) == list(range(1, 7))
    steps = per_rank[0]
    changes = [s for s in sorted(steps) if s == 1 or steps[s] != steps[s - 1]]
    assert changes == [1] + [s + 1 for s in refresh_steps(4, 5)]
    for digest in store.bases:
        assert store.load_basis(digest).digest == digest


def test_deepspeed_example_pretraining_script_trains_resumes_and_fills_the_store(tmp_path):
    """The Megatron-style example (OLMo under deepspeed.initialize, ZeRO-2, bf16) on 2 ranks: a Slurm
    job's attempt stopped before its first checkpoint (1 step, none saved), its requeue starts over
    for 4 steps with checkpoints every 2, rerun to 6 steps resumes; the store holds each (id, step) of
    the script's data order exactly once; a bad config exits 2 naming the key."""
    script = deepspeed_example()

    overrides = [f"--run_dir={tmp_path / 'run'}", "--model.d_model=32", "--model.embedding_size=257",
                 "--data.seq_len=32", "--model.max_sequence_length=32", "--deepspeed.train_micro_batch_size_per_gpu=2",
                 "--tda.capture.proj_dim=16", "--tda.store.flush_every=1"]
    for steps, restart in ((1, "0"), (4, "1"), (6, "1")):     # the first attempt with another data order
        every = ["--save_every=2"] if steps > 1 else ["--save_every=0", "--seed=1"]
        done = pretrain_two_ranks(tmp_path, [*overrides, *every, f"--steps={steps}"],
                                  env={"SLURM_JOB_ID": "8086", "SLURM_RESTART_COUNT": restart})
        assert ("starting it over" in done.stderr) == (steps == 4)
        if steps == 1:
            (tmp_path / "run" / "summary.json").unlink()     # as an attempt stopped before its end leaves it
    assert "resumed from" in done.stderr
    summary = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert summary["zero_stage"] == 2 and summary["world_size"] == 2 and summary["tda"]["steps_committed"] == 2
    store = GradientStore.open(tmp_path / "run" / "tda" / "store")
    block = store.read_all(layers=store.layers[:1])
    keys = list(zip(block.ids.tolist(), block.steps.tolist()))
    assert len(keys) == len(set(keys))
    assert summary["tda"]["rows_captured"] == len(keys)       # the run's rows: both ranks, through the resume
    num = int((tmp_path / "run" / "data" / "train.npy").stat().st_size // 2 // 32)
    order = dict(world=2, micro_bs=2, gas=2, num=num, seed=0)
    want = {(int(i), s) for s in range(1, 7) for r in range(2) for m in range(2) for i in script.step_ids(s, r, m, **order)}
    assert set(keys) == want
    assert store.layer_shapes["olmo.transformer.ff_out"] == (16, 16)
    # `olmo-tda attribute` opens the DeepSpeed run: a trained passage asked as a query finds itself
    import json as _json

    from olmo_tda.cli import main as cli_main

    passages = [_json.loads(line)["text"] for line in (tmp_path / "run" / "data" / "passages.jsonl").read_text().splitlines()]
    trained = int(block.ids[block.steps == 6][0])
    for method in ("gradcos", "influence"):
        out_json = tmp_path / f"{method}.json"
        assert cli_main(["attribute", str(tmp_path / "run"), "--query", passages[trained], "--method", method,
                         "--top-k", "2", "--json", str(out_json)]) == 0
        top = _json.loads(out_json.read_text())[0]["results"][0]
        assert top["index"] == trained and top["text"] == passages[trained], (method, top)
    bad = subprocess.run([sys.executable, str(DS_EXAMPLE), str(DS_CONFIG),
                          "--stepz=3"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert bad.returncode == 2 and "unknown top-level keys ['stepz']" in bad.stderr


@pytest.mark.slow  # three DeepSpeed starts on 2 ranks: about 1-2 minutes on 2 cores (the OLMo twin runs by default)
def test_deepspeed_example_torchrun_restart_starts_over_the_run_stopped_before_its_first_checkpoint(tmp_path):
    """torchrun --max_restarts=1: attempt 0's rank 1 dies in step 3 (rows of the first steps stored,
    no checkpoint), torchrun restarts both ranks, and the restart starts the run over: it says so,
    drops the dead attempt's rows, and the store ends with each (id, step) of the script's data order
    once. Another torchrun over that folder after the run ended is refused."""
    import re

    script = deepspeed_example()

    run = tmp_path / "run"
    overrides = [f"--run_dir={run}", "--model.d_model=32", "--model.embedding_size=257", "--data.seq_len=32",
                 "--model.max_sequence_length=32", "--deepspeed.train_micro_batch_size_per_gpu=2",
                 "--tda.capture.proj_dim=8", "--tda.store.flush_every=1", "--save_every=0", "--steps=3"]

    def launch(max_restarts: int) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--max_restarts={max_restarts}", str(HERE / "_restart_worker.py"), "deepspeed", str(DS_CONFIG),
               *overrides]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                              env={**outside_slurm_env(), "OMP_NUM_THREADS": "1",
                                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",    # see torchrun_restart_warning
                                   "RESTART_TEST_MARKS": str(tmp_path),
                                   "RESTART_TEST_SHARDS": str(run / "tda" / "store" / "shards")})

    done = launch(max_restarts=1)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "rank 1 of attempt 0 dies now" in done.stderr
    over = re.search(r"stopped before its first checkpoint: starting it over "
                     r"\(the (\d+) rows stored in (\S+) are dropped\)", done.stderr)
    assert over is not None, done.stderr[-6000:]
    assert int(over.group(1)) > 0 and over.group(2) == str(run / "tda" / "store")
    block = GradientStore.open(run / "tda" / "store").read_all(layers=[])
    keys = list(zip(block.ids.tolist(), block.steps.tolist()))
    num = int((run / "data" / "train.npy").stat().st_size // 2 // 32)
    order = dict(world=2, micro_bs=2, gas=2, num=num, seed=0)
    want = {(int(i), s) for s in range(1, 4) for r in range(2) for m in range(2)
            for i in script.step_ids(s, r, m, **order)}
    assert len(keys) == len(set(keys)) and set(keys) == want
    again = launch(max_restarts=0)                # the run ended (its summary.json)
    assert again.returncode != 0
    assert f"error: run_dir: {run} has no checkpoint to resume from" in again.stderr, again.stderr[-4000:]
    assert GradientStore.open(run / "tda" / "store").num_rows == len(keys)


def test_deepspeed_zero3_trajectory_checkpoints_hold_the_gathered_weights(runs):
    """tda.trajectory under ZeRO-3 (zero.Init, bf16): checkpoint s holds θ_s, the full weights the
    worker gathered itself before step s+1; lr and tokens as the step used them."""
    from olmo_tda.training.trajectory import Trajectory

    case = worker.parse_case("stage=3,gas=2,dtype=bf16,init=1,traj=1,steps=3")
    root = runs / worker.case_name(case)
    kept = Trajectory.list(root / "trajectory")
    assert [c.step for c in kept] == [0, 1, 2, 3]
    for c in kept[:-1]:
        before_next = torch.load(root / f"weights_step{c.step + 1}.pt", weights_only=True)
        weights = c.load()
        assert set(weights) >= set(before_next)
        assert all(torch.equal(weights[k], before_next[k]) for k in before_next), c.step
    assert [c.tokens_seen for c in kept] == [0, 96, 192, 288]      # 2 ranks x GAS 2 x 2 examples x 12 tokens
    assert np.allclose([c.lr for c in kept[1:]], [worker.lr_at(s) for s in (1, 2, 3)])


PIPELINE_SCRIPT = """
import os, torch, deepspeed
deepspeed.init_distributed(dist_backend="gloo")
from deepspeed.pipe import PipelineModule
from olmo_tda.config import ConfigError
from olmo_tda.integrations.deepspeed import attach
net = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)], num_stages=1, loss_fn=torch.nn.MSELoss())
engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config={
    "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
try:
    attach(engine, {"enabled": True, "store": {"path": os.environ["STORE"]}})
    print("ATTACHED")
except ConfigError as e:
    print("REFUSED", e)
"""


def test_a_pipeline_engine_is_refused_not_silently_never_captured(tmp_path):
    """A PipelineEngine steps inside train_batch without engine.step(): attach would capture nothing
    and pile up records, so it is refused, naming what to use."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_PORT": str(29500 + os.getpid() % 500), "LOCAL_RANK": "0", "STORE": str(tmp_path / "store")}
    done = subprocess.run([sys.executable, "-c", PIPELINE_SCRIPT], capture_output=True, text=True, timeout=300,
                          env=env)
    assert "REFUSED attach: pipeline-parallel DeepSpeed engines" in done.stdout, \
        done.stdout[-2000:] + done.stderr[-3000:]
    assert not (tmp_path / "store").exists()


SESSION_SCRIPT = """
import os, sys, torch, deepspeed
sys.path.insert(0, os.environ["TESTS"])
deepspeed.init_distributed(dist_backend="gloo")
import _deepspeed_worker as w
from olmo_tda.integrations.deepspeed import attach, close_open_sessions
case = w.parse_case("")
torch.manual_seed(0)
model = w.TokenMeanLM()
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  config=w.ds_config(case, os.environ["STORE"]))
attach(engine)
input_ids, labels = w.tokens()
ids = w.ids_for(1, 0, 0, 1, 1)
engine.backward(engine({"input_ids": input_ids[ids], "labels": labels[ids], "index": torch.from_numpy(ids)}))
engine.step()                                           # one step: under flush_every (2), still in the window
if os.environ["CLOSE"] == "1":
    close_open_sessions()
os._exit(0)                                             # as integrations.end_failed_rank ends a failed rank
"""


def test_close_open_sessions_writes_the_window_a_failed_rank_would_lose(tmp_path):
    """A failed rank of several ends with ``os._exit``, which skips the atexit closer of a session an
    error left open: close_open_sessions, called just before, writes its window (without it: 0 rows)."""
    from olmo_tda.store import GradientStore

    rows = {}
    for close in ("0", "1"):
        store = tmp_path / f"store{close}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1",
               "MASTER_PORT": str(29000 + (os.getpid() + int(close)) % 500), "LOCAL_RANK": "0",
               "STORE": str(store), "CLOSE": close, "TESTS": str(Path(__file__).parent)}
        done = subprocess.run([sys.executable, "-c", SESSION_SCRIPT], capture_output=True, text=True, timeout=300,
                              env=env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        rows[close] = len(GradientStore.open(store).read_all(layers=[]).ids)
    assert rows == {"0": 0, "1": worker.MICRO}, rows


def test_estimate_basis_refusals_name_the_cause_and_tda_off_does_nothing(tmp_path):
    """estimate_basis on one process (only ``engine.module`` and the stage are read, so a plain module
    stands in for the engine): tda or its store off does nothing; a model whose loss does not depend
    on an nn.Embedding's output, empty batches and an unwritable path are refused naming the cause;
    a working estimate writes the file and leaves no weight a gradient."""
    import types

    from olmo_tda.capture.eigenbasis import EigenBasis, EigenBasisError
    from olmo_tda.config import ConfigError
    from olmo_tda.integrations.deepspeed import estimate_basis

    class Lookup(torch.nn.Module):
        def __init__(self, functional: bool):
            super().__init__()
            self.functional = functional
            self.emb, self.out = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)

        def forward(self, ids):
            x = torch.nn.functional.embedding(ids, self.emb.weight) if self.functional else self.emb(ids)
            return torch.nn.functional.cross_entropy(self.out(x).flatten(0, 1), ids.flatten(), reduction="sum")

    torch.manual_seed(0)
    batches = [torch.randint(0, 10, (2, 5)) for _ in range(2)]
    basis = tmp_path / "basis.safetensors"
    config = {"enabled": True, "store": {"path": str(tmp_path / "store")},
              "capture": {"proj_type": "eigen", "proj_dim": 2, "basis": str(basis)}}

    def engine(functional=False):
        return types.SimpleNamespace(module=Lookup(functional), zero_optimization_stage=lambda: 0)

    loss = lambda m, b: m(b)                                                # noqa: E731
    assert estimate_basis(engine(), batches, loss, {**config, "enabled": False}) is None
    assert estimate_basis(engine(), batches, loss, {**config, "store": {"enabled": False}}) is None
    assert not basis.exists()
    with pytest.raises(ConfigError, match="does not depend on the output of any nn.Embedding"):
        estimate_basis(engine(functional=True), batches, loss, config)
    with pytest.raises(EigenBasisError, match="no batches were given"):
        estimate_basis(engine(), [], loss, config)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"tda.capture.basis: cannot write the eigenbasis to .*afile"):
        estimate_basis(engine(), batches, loss,
                       {**config, "capture": {**config["capture"], "basis": str(tmp_path / "afile" / "b.st")}})
    with pytest.raises(ConfigError, match="proj_dim is 0"):
        estimate_basis(engine(), batches, loss, {**config, "capture": {"proj_type": "eigen", "proj_dim": 0}})
    with pytest.raises(ConfigError, match="names no file"):
        estimate_basis(engine(), batches, loss, {**config, "capture": {"proj_type": "eigen", "proj_dim": 2}})
    model = engine()
    assert estimate_basis(model, batches, loss, config) == basis
    assert set(EigenBasis.load(basis).layers) == {"out"}
    assert all(p.grad is None for p in model.module.parameters())
