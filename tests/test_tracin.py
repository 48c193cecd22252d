"""Trajectory checkpoints and TracIn on real OLMo runs, against brute force.

Oracles: the saved checkpoints read with safetensors directly, per-example gradients of each
example's summed next-token CE from ``torch.func.vmap(grad)``, learning rates from the checkpoints'
own metadata and the store's per-step records, OLMo's data order from its ``global_indices.npy``,
and OLMo's per-device token normalization (batch × seq) as the loss scale.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from _warm import run_module
from conftest import rel_err
from olmo_tda.config import TrajectoryConfig
from olmo_tda.demo.corpus import ByteTokenizer, build_passages
from olmo_tda.demo.data import write_memmap
from olmo_tda.methods.tracin import nearest_checkpoint, tracin_cp
from olmo_tda.training.trajectory import Trajectory, TrajectoryError

ROOT = Path(__file__).resolve().parents[1]
SEQ, GBS, D_MODEL = 32, 8, 128
QUERIES = ["The for statement is used to iterate over the elements", "Return the absolute value of a number"]


def _train(tmp: Path, run: str, steps: int, *extra: str) -> Path:
    args = [f"--data.paths=[{tmp / 'data' / 'train.npy'}]", f"--save_folder={tmp / run}", f"--max_duration={steps}",
            f"--stop_at={steps}", f"--model.d_model={D_MODEL}", "--model.n_heads=4",
            f"--model.max_sequence_length={SEQ}",
            f"--global_train_batch_size={GBS}", "--device_train_microbatch_size=4", "--console_log_interval=1000",
            f"--save_interval_unsharded={steps}", "--tda.store.dtype=float32", "--tda.trajectory.enabled=true", *extra]
    done = run_module("olmo_tda.cli", ["train", str(ROOT / "configs" / "demo_tiny.yaml"), *args], timeout=600,
                      cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr[-5000:]
    return tmp / run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracin")
    write_memmap(build_passages(128, SEQ, seed=5), tmp / "data" / "train.npy", SEQ)
    return {"exact": _train(tmp, "exact", 50, "--tda.capture.proj_dim=0", "--tda.trajectory.every=10"),
            "k64": _train(tmp, "k64", 50, "--tda.capture.proj_dim=64", "--tda.trajectory.every=10"),
            "every_step": _train(tmp, "every_step", 12, "--tda.capture.proj_dim=0", "--tda.trajectory.every=1"),
            "data": tmp / "data" / "train.npy"}


def _model(run_dir: Path):
    from olmo.config import TrainConfig
    from olmo.model import OLMo

    cfg = TrainConfig.load(run_dir / "config.yaml")
    cfg.model.init_device = "cpu"
    return OLMo(cfg.model)


def _checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _exact(model, weights: dict, tokens: torch.Tensor, layers: list[str]) -> dict[str, torch.Tensor]:
    """``{layer: [B, O, I]}`` exact per-example gradients of summed next-token CE at ``weights``."""
    from torch.func import functional_call, grad, vmap

    def loss_one(p, toks):
        logits = functional_call(model, p, (toks[None],)).logits
        return torch.nn.functional.cross_entropy(logits[0, :-1], toks[1:], reduction="sum")

    g = vmap(grad(loss_one), in_dims=(None, 0))({k: v.double() for k, v in weights.items()}, tokens)
    return {name: g[f"{name}.weight"] for name in layers}


def _query_tokens() -> torch.Tensor:
    tok = ByteTokenizer()
    return torch.tensor([tok.encode(q)[:SEQ] for q in QUERIES])


def _dot(a: dict, b: dict, layers: list[str]) -> torch.Tensor:
    return sum(a[n].reshape(len(a[n]), -1).double() @ b[n].reshape(len(b[n]), -1).double().T for n in layers)


def test_trajectory_checkpoints_follow_the_schedule_and_hold_what_tracin_needs(runs):
    ckpts = Trajectory.list(runs["exact"] / "tda" / "trajectory")
    assert [c.step for c in ckpts] == [0, 10, 20, 30, 40, 50]
    store_hash = json.loads((runs["exact"] / "tda" / "store" / "store.json").read_text())["projector_hash"]
    assert all(c.projector_hash == store_hash and c.dtype == "float32" for c in ckpts)
    assert [c.tokens_seen for c in ckpts] == [s * GBS * SEQ for s in (0, 10, 20, 30, 40, 50)]
    assert all(c.bytes == (c.path / "model.safetensors").stat().st_size > 0 for c in ckpts)
    # the weights after step 50 are the ones OLMo saved in its own checkpoint at step 50
    olmo = torch.load(runs["exact"] / "step50-unsharded" / "model.pt", weights_only=True)
    mine = _checkpoint_weights(ckpts[-1].path)
    assert set(mine) == set(olmo) and all(torch.equal(mine[k], olmo[k]) for k in olmo)
    # the lr of step s as the store recorded it
    from olmo_tda.store import GradientStore

    block = GradientStore.open(runs["exact"] / "tda" / "store").read_all(layers=[])
    for c in ckpts[1:]:
        assert np.allclose(block.lr[block.steps == c.step], c.lr, rtol=1e-12)
    # and of step s+1, the step that used gradients at θ_s (warmup: 20 steps, so they differ)
    for c in ckpts[:-1]:
        assert np.allclose(block.lr[block.steps == c.step + 1], c.next_lrs[0], rtol=1e-12)
    assert ckpts[1].next_lrs[0] > ckpts[1].lr and ckpts[-1].next_lrs is None


def test_tracin_cp_equals_brute_force_from_the_saved_checkpoints(runs):
    from olmo_tda.integrations.olmo_query import OLMoRun

    run = OLMoRun(runs["exact"])
    ids = np.arange(0, 128, 3)
    scores, got_ids = run.tracin(QUERIES, ids=ids)
    assert np.array_equal(got_ids, ids)
    model, layers = _model(runs["exact"]), list(run.store.layers)
    data = torch.from_numpy(np.memmap(runs["data"], dtype=np.uint16, mode="r").reshape(-1, SEQ)[ids].astype(np.int64))
    # θ_s weighted by η_{s+1} as the store recorded it (the last checkpoint, 50, by η_50)
    from olmo_tda.store import GradientStore

    block = GradientStore.open(runs["exact"] / "tda" / "store").read_all(layers=[])
    want = 0
    for ckpt in Trajectory.list(runs["exact"] / "tda" / "trajectory"):
        eta = block.lr[block.steps == min(ckpt.step + 1, 50)][0]
        weights = _checkpoint_weights(ckpt.path)
        want = want + eta * _dot(_exact(model, weights, _query_tokens(), layers),
                                            _exact(model, weights, data, layers), layers)
    assert rel_err(scores, want) < 1e-5


def test_inrun_tracin_with_a_checkpoint_every_step_equals_first_order_tracin_ideal(runs):
    """Σ over the steps s that used z of (η_s / loss_scale_s) ⟨∇L_q(θ_{s-1}), ∇ℓ_z(θ_{s-1})⟩ over the
    captured layers, with θ_{s-1} the checkpoint before step s and z's steps from OLMo's data order."""
    from olmo_tda.integrations.olmo_query import OLMoRun

    run_dir = runs["every_step"]
    run = OLMoRun(run_dir)
    scores, ids = run.tracin(QUERIES, inrun=True)
    model, layers = _model(run_dir), list(run.store.layers)
    order = np.memmap(run_dir / "train_data" / "global_indices.npy", dtype=np.uint32, mode="r")
    data = np.memmap(runs["data"], dtype=np.uint16, mode="r").reshape(-1, SEQ)
    want = torch.zeros(len(QUERIES), 128, dtype=torch.float64)
    for step in range(1, 13):
        before = run_dir / "tda" / "trajectory" / f"step{step - 1:08d}"
        lr = json.loads((run_dir / "tda" / "trajectory" / f"step{step:08d}" / "meta.json").read_text())["lrs"][0]
        used = np.asarray(order[(step - 1) * GBS: step * GBS], dtype=np.int64)
        weights = _checkpoint_weights(before)
        s = _dot(_exact(model, weights, _query_tokens(), layers),
                 _exact(model, weights, torch.from_numpy(data[used].astype(np.int64)), layers), layers)
        want[:, used] += lr / (GBS * SEQ) * s
    assert np.array_equal(ids, np.unique(np.asarray(order[: 12 * GBS])))
    assert rel_err(scores, want[:, ids]) < 1e-5


def test_projected_tracin_ranks_like_exact_and_five_checkpoints_like_all(runs):
    from scipy.stats import spearmanr

    from olmo_tda.integrations.olmo_query import OLMoRun

    ids = np.arange(128)
    exact_run, k64_run = OLMoRun(runs["exact"]), OLMoRun(runs["k64"])
    exact, _ = exact_run.tracin(QUERIES, ids=ids)
    projected, _ = k64_run.tracin(QUERIES, ids=ids)
    rho = [spearmanr(exact[q], projected[q])[0] for q in range(len(QUERIES))]
    ckpts = exact_run.checkpoints()
    five, _ = exact_run.tracin(QUERIES, ids=ids, checkpoints=ckpts[1:])
    rho5 = [spearmanr(exact[q], five[q])[0] for q in range(len(QUERIES))]
    top10 = [len(set(np.argsort(-exact[q].numpy())[:10]) & set(np.argsort(-five[q].numpy())[:10]))
             for q in range(len(QUERIES))]
    print(f"TracIn-CP k=64 vs exact: Spearman {np.round(rho, 3).tolist()}; "
          f"5 checkpoints (10..50) vs all 6: Spearman {np.round(rho5, 3).tolist()}, top-10 overlap {top10}")
    assert min(rho) >= 0.9
    assert min(rho5) > 0.5


def test_interrupted_tracin_cp_resumes_to_the_same_scores(tmp_path):
    """Per-checkpoint scores are kept in the work dir: a pass that dies after two checkpoints,
    rerun, computes only the rest and returns exactly an uninterrupted pass's scores."""
    gen = torch.Generator().manual_seed(0)
    traj = Trajectory(TrajectoryConfig(enabled=True, every=1), tmp_path / "traj")
    ckpts = [traj.save(s, {"w": torch.full((2,), float(s))}, lrs=[0.1 / (s + 1)], tokens_seen=0) for s in range(4)]
    queries = {s: {"a": torch.randn(2, 3, 4, generator=gen)} for s in range(4)}
    train = {s: {"a": torch.randn(10, 3, 4, generator=gen)} for s in range(4)}
    calls = []

    def train_at(ckpt, fail_at=None):
        calls.append(ckpt.step)
        if ckpt.step == fail_at:
            raise KeyboardInterrupt
        for start in (0, 5):
            yield np.arange(start, start + 5), {"a": train[ckpt.step]["a"][start:start + 5]}

    full, ids = tracin_cp(ckpts, lambda c: queries[c.step], train_at, layers=["a"])
    with pytest.raises(KeyboardInterrupt):
        tracin_cp(ckpts, lambda c: queries[c.step], lambda c: train_at(c, fail_at=2), layers=["a"],
                  work_dir=tmp_path / "work", fingerprint={"q": 1})
    calls.clear()
    resumed, ids2 = tracin_cp(ckpts, lambda c: queries[c.step], train_at, layers=["a"],
                              work_dir=tmp_path / "work", fingerprint={"q": 1})
    assert calls == [2, 3]                      # checkpoints 0 and 1 were not recomputed
    assert torch.equal(resumed, full) and np.array_equal(ids, ids2)
    brute = sum(0.1 / (c.step + 1)
                * (queries[c.step]["a"].reshape(2, -1).double() @ train[c.step]["a"].reshape(10, -1).double().T)
                for c in ckpts)
    assert rel_err(full, brute) < 1e-12


def test_nearest_checkpoint_pairs_each_step_with_the_weights_it_used():
    # a gradient of step s was taken at θ_{s-1}
    assert nearest_checkpoint(np.array([1, 5, 10, 11, 16, 17, 40]), [0, 10, 20]).tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert nearest_checkpoint(np.array([6, 7]), [0, 10]).tolist() == [0, 1]   # θ_5 ties: the earlier one


def test_trajectory_schedule_and_retention(tmp_path):
    w = {"w": torch.ones(2, 2)}

    def kept(cfg, steps, lrs=None):
        traj = Trajectory(cfg, tmp_path / f"t{len(list(tmp_path.iterdir()))}")
        for s in steps:
            traj.maybe_save(s, w, lrs=[(lrs or {}).get(s, 1e-3)], tokens_seen=s)
        return [c.step for c in Trajectory.list(traj.path)]

    assert kept(TrajectoryConfig(enabled=True, every=10), range(0, 51)) == [0, 10, 20, 30, 40, 50]
    assert kept(TrajectoryConfig(enabled=True, every=5, schedule="log"), range(0, 51)) == [0, 5, 10, 20, 40]
    lrs = {s: (1e-3 if s <= 20 else 1e-4) for s in range(71)}   # 10x lower lr: 10x sparser
    assert kept(TrajectoryConfig(enabled=True, every=5, schedule="lr"), range(0, 71), lrs) == [0, 5, 10, 15, 20, 70]
    assert kept(TrajectoryConfig(enabled=True, every=10, retention="last", keep=3), range(0, 51)) == [30, 40, 50]
    assert kept(TrajectoryConfig(enabled=True, every=10, retention="thinned", keep=3), range(0, 51)) == [0, 40, 50]
    half = kept(TrajectoryConfig(enabled=True, every=10, dtype="bfloat16"), [0])
    assert half == [0]


def test_an_interrupted_tracin_cp_pass_over_a_run_resumes_to_the_same_scores(runs, monkeypatch):
    """A real pass over the run's 6 checkpoints dies while recomputing the 4th; the rerun recomputes
    only checkpoints 4-6 and returns exactly the scores of an uninterrupted pass."""
    import shutil

    from olmo_tda.integrations.olmo_query import OLMoRun

    run, ids = OLMoRun(runs["exact"]), np.arange(0, 128, 5)
    cache = runs["exact"] / "tda" / "tracin"
    shutil.rmtree(cache, ignore_errors=True)
    original, calls = OLMoRun.train_gradients, []

    def counting(self, ids, fail_at=None, **kw):
        calls.append(len(calls))
        if len(calls) == fail_at:
            raise KeyboardInterrupt("killed mid-pass")
        return original(self, ids, **kw)

    monkeypatch.setattr(OLMoRun, "train_gradients", lambda self, ids, **kw: counting(self, ids, 4, **kw))
    with pytest.raises(KeyboardInterrupt):
        run.tracin(QUERIES, ids=ids)
    monkeypatch.setattr(OLMoRun, "train_gradients", lambda self, ids, **kw: counting(self, ids, **kw))
    calls.clear()
    resumed, _ = run.tracin(QUERIES, ids=ids)
    assert len(calls) == 3                       # checkpoints 30, 40, 50 only
    shutil.rmtree(cache)
    fresh, _ = run.tracin(QUERIES, ids=ids)
    assert torch.equal(resumed, fresh)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(3, 3, generator=torch.Generator().manual_seed(seed))}


def test_tracin_cp_rescores_a_rewritten_checkpoint_and_only_that_one(tmp_path):
    """The resume cache is keyed by each checkpoint's content: a checkpoint rewritten at the same step
    with the same lr (a retrain over the folder, a resumed run) or whose weights file was replaced
    by other means (same size, mtime put back) is scored again; the others come from the cache.
    "Gradients" are the weights themselves, so the oracle is a sum over the tensors written."""
    traj_dir, scale = tmp_path / "traj", torch.arange(1.0, 5.0)
    written = {s: _weights(s) for s in range(3)}
    for s, w in written.items():
        Trajectory(TrajectoryConfig(enabled=True, every=1), traj_dir).save(s, w, lrs=[0.1 * (s + 1)], tokens_seen=0)
    calls = []

    def train_at(c):
        calls.append(c.step)
        w = c.load()["w"]
        yield np.arange(4), {"w": w[None].repeat(4, 1, 1) * scale[:, None, None]}

    def score():
        calls.clear()
        ckpts = Trajectory.list(traj_dir)
        got, _ = tracin_cp(ckpts, lambda c: {"w": c.load()["w"][None]}, train_at, layers=["w"],
                           work_dir=tmp_path / "work", fingerprint={"q": 1})
        want = sum(0.1 * (s + 1) * (w["w"].double() ** 2).sum() * scale.double() for s, w in written.items())
        assert rel_err(got[0], want) < 1e-6
        return list(calls)

    assert score() == [0, 1, 2]
    assert score() == []                                   # all cached
    written[1] = _weights(100)                             # rewritten: same step, same lr, other weights
    Trajectory(TrajectoryConfig(enabled=True, every=1), traj_dir).save(1, written[1], lrs=[0.2], tokens_seen=0)
    assert score() == [1]
    from safetensors.torch import save_file

    f = traj_dir / "step00000002" / "model.safetensors"   # replaced behind the trajectory's back
    before = f.stat()
    written[2] = _weights(200)
    save_file(written[2], str(f))
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert f.stat().st_size == before.st_size and f.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.raises(TrajectoryError, match="step00000002: model.safetensors is damaged"):
        score()                                            # its meta.json's checksum is of the old weights
    meta = json.loads((f.parent / "meta.json").read_text())
    (f.parent / "meta.json").write_text(json.dumps({**meta, "crc32": zlib.crc32(f.read_bytes())}))
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert score() == [2]                                  # replaced with its checksum: scored again
    assert sorted(p.name[:12] for p in (tmp_path / "work").rglob("*.npz")) == [f"step0000000{s}" for s in range(3)]


def test_tracin_cp_weights_each_checkpoint_by_the_lr_of_the_step_that_used_it(tmp_path):
    """θ_s's gradient feeds step s+1, so TracIn-CP weights θ_s by η_{s+1} (θ_0 by η_1, as before);
    the last checkpoint, which no step used, keeps its own step's lr."""
    lr = {s: 1e-3 * s for s in range(1, 10)}                # warmup: every step's lr differs
    traj = Trajectory(TrajectoryConfig(enabled=True, every=3), tmp_path / "traj")
    traj.maybe_save(0, _weights(0), lrs=[lr[1]], tokens_seen=0)
    for s in range(1, 10):
        traj.maybe_save(s, _weights(s), lrs=[lr[s]], tokens_seen=s)
    ckpts = Trajectory.list(tmp_path / "traj")
    assert [c.step for c in ckpts] == [0, 3, 6, 9]
    assert [c.lr for c in ckpts] == [lr[1], lr[3], lr[6], lr[9]]
    assert [c.next_lrs for c in ckpts] == [[lr[1]], [lr[4]], [lr[7]], None]
    eta = [lr[1], lr[4], lr[7], lr[9]]
    assert [c.tracin_lr for c in ckpts] == eta
    got, _ = tracin_cp(ckpts, lambda c: {"w": c.load()["w"][None]},
                       lambda c: iter([(np.arange(1), {"w": c.load()["w"][None]})]), layers=["w"])
    want = sum(e * (_weights(s)["w"].double() ** 2).sum() for e, s in zip(eta, (0, 3, 6, 9)))
    assert rel_err(got[0, 0], want) < 1e-6


def _lr_warmup(s: int) -> float:
    return 1e-3 * min(1.0, s / 10)


def _lr_schedule_steps(every: int, last: int) -> list[int]:
    """The ``lr`` schedule written out: keep step s once the lr summed since the last kept step
    reaches ``every`` x the highest lr so far (step 0 always)."""
    kept, since, peak = [0], 0.0, 0.0
    for s in range(1, last + 1):
        peak, since = max(peak, _lr_warmup(s)), since + _lr_warmup(s)
        if since >= every * peak * (1 - 1e-9):
            kept, since = kept + [s], 0.0
    return kept


@pytest.mark.parametrize("resume_at", [12, 22])
def test_a_resumed_trajectory_keeps_exactly_the_checkpoints_of_an_uninterrupted_one(tmp_path, resume_at):
    """schedule 'lr' under warmup: a run that crashed at step 33 and resumed from its training
    checkpoint at step ``resume_at`` (12: a kept step; 22: between two) keeps the same steps, with the
    same lrs, as an uninterrupted run; the crashed timeline's checkpoints past the resume step are
    gone and the resumed run's weights stand in their place."""
    cfg = TrajectoryConfig(enabled=True, every=4, schedule="lr")

    def step(traj, s, timeline):
        traj.maybe_save(s, {"w": torch.tensor([float(s), timeline])}, lrs=[_lr_warmup(max(s, 1))], tokens_seen=s)

    whole = Trajectory(cfg, tmp_path / "whole")
    for s in range(41):
        step(whole, s, 0.0)
    crashed, states = Trajectory(cfg, tmp_path / "resumed"), {}
    for s in range(34):
        step(crashed, s, 1.0)
        states[s] = crashed.state_dict()                  # what each training checkpoint would hold
    resumed = Trajectory(cfg, tmp_path / "resumed")       # a new process
    resumed.resume(resume_at, states[resume_at])
    assert max(c.step for c in Trajectory.list(resumed.path)) <= resume_at
    for s in range(resume_at + 1, 41):
        step(resumed, s, 2.0)
    want = _lr_schedule_steps(4, 40)
    assert want == [0, 7, 12, 16, 20, 24, 28, 32, 36, 40]
    a, b = Trajectory.list(whole.path), Trajectory.list(resumed.path)
    assert [c.step for c in a] == [c.step for c in b] == want
    assert [(c.lrs, c.next_lrs) for c in a] == [(c.lrs, c.next_lrs) for c in b]
    assert [c.load()["w"].tolist() for c in b] == [[float(s), 1.0 if s <= resume_at else 2.0] for s in want]


def test_checkpoints_past_the_restart_are_removed_even_without_resume(tmp_path):
    """A run restarted at step 18 (from a training checkpoint at 17) whose integration did not call
    resume(): the first maybe_save drops the old timeline's 20 and 25 before anything else, and the
    new run's own checkpoints replace them."""
    cfg = TrajectoryConfig(enabled=True, every=5)
    old = Trajectory(cfg, tmp_path / "t")
    for s in range(28):
        old.maybe_save(s, {"w": torch.tensor([float(s), 1.0])}, lrs=[1e-3], tokens_seen=s)
    assert [c.step for c in Trajectory.list(old.path)] == [0, 5, 10, 15, 20, 25]
    new = Trajectory(cfg, tmp_path / "t")
    new.maybe_save(18, {"w": torch.tensor([18.0, 2.0])}, lrs=[1e-3], tokens_seen=18)
    assert [c.step for c in Trajectory.list(old.path)] == [0, 5, 10, 15]
    for s in range(19, 31):
        new.maybe_save(s, {"w": torch.tensor([float(s), 2.0])}, lrs=[1e-3], tokens_seen=s)
    kept = Trajectory.list(old.path)
    assert [c.step for c in kept] == [0, 5, 10, 15, 20, 25, 30]
    assert [c.load()["w"][1].item() for c in kept] == [1.0] * 4 + [2.0] * 3


def test_resume_refuses_a_state_from_a_later_step_and_takes_one_from_a_skipped_step(tmp_path):
    """A state saved after the resume step is another checkpoint's: refused. One from an earlier step
    is what a loop that skips maybe_save on steps it did not apply (DeepSpeed's fp16 overflow steps
    still count) saves: taken, and the run goes on as if uninterrupted."""
    cfg = TrajectoryConfig(enabled=True, every=4, schedule="lr")
    traj = Trajectory(cfg, tmp_path / "t")
    for s in range(12):
        if s != 11:                 # step 11 overflowed: DeepSpeed counts it, nothing is saved for it
            traj.maybe_save(s, {"w": torch.zeros(1)}, lrs=[1e-3], tokens_seen=s)
    with pytest.raises(TrajectoryError, match="saved at step 10 but the run resumes at step 9"):
        Trajectory(cfg, tmp_path / "t").resume(9, traj.state_dict())
    resumed = Trajectory(cfg, tmp_path / "t")
    resumed.resume(11, traj.state_dict())
    for s in range(12, 20):
        assert resumed.due(s, 1e-3) == traj.due(s, 1e-3), s


def test_top_examples_breaks_ties_by_id_order_and_lists_an_id_once():
    from olmo_tda.methods.tracin import top_examples

    ids = np.array([9, 4, 7, 4, 2, 5])
    scores = torch.tensor([[1.0, 3.0, 3.0, 5.0, 3.0, 0.0], [0.0] * 6], dtype=torch.float64)
    res = top_examples("tracin", scores, ids, 4, ["a"])
    assert res.ids.tolist() == [[4, 7, 2, 9], [9, 4, 7, 2]]     # id 4 once, at its best score (5)
    assert res.scores.tolist() == [[5.0, 3.0, 3.0, 1.0], [0.0] * 4]


def test_inrun_tracin_counts_an_example_trained_twice_in_a_step_twice(tmp_path):
    """Two ranks trained example 2 in step 1: both rows entered the update, so in-run TracIn adds
    both (the top-k of attribute() lists the pair once; see methods/base.py)."""
    from olmo_tda import GradientRecord, GradientStore, StoreConfig
    from olmo_tda.methods.tracin import tracin_inrun

    meta = {"capture": {}, "projector_hash": "h", "layers": [{"name": "a", "shape": [2, 2], "projector": {}}]}
    g = torch.randn(4, 2, 2, generator=torch.Generator().manual_seed(0))
    w0 = GradientStore.create(tmp_path / "s", meta, StoreConfig(), rank=0)
    w1 = GradientStore.create(tmp_path / "s", meta, StoreConfig(), rank=1)
    w0.append(GradientRecord(ids=[0, 1, 2], step=1, lr=0.1, loss_scale=2.0, grads={"a": g[:3]}))
    w1.append(GradientRecord(ids=[2], step=1, lr=0.1, loss_scale=4.0, grads={"a": g[3:]}))
    w0.close()
    w1.close()
    q = torch.randn(1, 2, 2, generator=torch.Generator().manual_seed(1))
    scores, ids = tracin_inrun(GradientStore.open(tmp_path / "s"), lambda step: {"a": q}, [0])
    dot = (q.reshape(1, -1).double() @ g.reshape(4, -1).double().T)[0]
    assert ids.tolist() == [0, 1, 2]
    want = torch.stack([0.1 / 2 * dot[0], 0.1 / 2 * dot[1], 0.1 / 2 * dot[2] + 0.1 / 4 * dot[3]])
    assert rel_err(scores[0], want) < 1e-6


def _cached_pass(tmp_path, steps=(0, 1, 2)):
    """Checkpoints whose "gradients" are their weights, scored by TracIn-CP with a resume cache: returns
    a function running one pass ``-> (scores, ids, checkpoint steps recomputed)`` and the brute-force scores."""
    traj = Trajectory(TrajectoryConfig(enabled=True, every=1), tmp_path / "traj")
    written = {s: _weights(s) for s in steps}
    for s, w in written.items():
        traj.save(s, w, lrs=[0.1 * (s + 1)], tokens_seen=0)
    scale = torch.arange(1.0, 5.0)

    def score():
        calls = []

        def train_at(c):
            calls.append(c.step)
            yield np.arange(4), {"w": c.load()["w"][None].repeat(4, 1, 1) * scale[:, None, None]}

        got, ids = tracin_cp(Trajectory.list(traj.path), lambda c: {"w": c.load()["w"][None]}, train_at,
                             layers=["w"], work_dir=tmp_path / "work", fingerprint={"q": 1})
        return got, ids, calls

    want = sum(0.1 * (s + 1) * (w["w"].double() ** 2).sum() * scale.double() for s, w in written.items())
    return score, want


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "no_scores", "nan"])
def test_a_damaged_cache_file_is_recomputed_with_a_warning(tmp_path, caplog, damage):
    """A cached per-checkpoint score file cut short, overwritten or without its arrays is treated as
    absent: recomputed (that checkpoint only), warned naming the file, and cached again; so is one
    holding NaN scores (cached before they were refused)."""
    score, want = _cached_pass(tmp_path)
    got, _, calls = score()
    assert calls == [0, 1, 2] and rel_err(got[0], want) < 1e-6
    (part,) = (tmp_path / "work").rglob("step00000001-*.npz")
    if damage == "truncated":
        os.truncate(part, 100)
    elif damage == "garbage":
        part.write_bytes(b"not a zip file" * 50)
    elif damage == "empty":
        part.write_bytes(b"")
    elif damage == "no_scores":
        with open(part, "wb") as f:
            np.savez(f, other=np.zeros(3))
    else:
        with open(part, "wb") as f:
            np.savez(f, scores=np.full((1, 4), np.nan), ids=np.arange(4))
    with caplog.at_level("WARNING", logger="olmo_tda.methods.tracin"):
        again, _, calls = score()
    assert calls == [1] and torch.equal(again, got)
    assert f"cached scores {part} are damaged" in caplog.text
    assert score()[2] == []                                 # the rewritten file is good


def test_two_identical_queries_writing_the_same_cache_file_at_once_both_succeed(tmp_path, monkeypatch):
    """A second query (another process or thread) writes the same checkpoint's scores while the first is
    between opening its temporary file and renaming it: both finish with the right scores, leaving one
    valid cache file and no temporary files."""
    score, want = _cached_pass(tmp_path, steps=(0,))
    real_savez, written_to = np.savez, []

    def interleaved_savez(f, **arrays):
        written_to.append(f.name)
        if len(written_to) == 1:                             # the other writer runs to completion now
            other, _, _ = score()
            assert rel_err(other[0], want) < 1e-6
        real_savez(f, **arrays)

    monkeypatch.setattr(np, "savez", interleaved_savez)
    got, _, _ = score()
    assert rel_err(got[0], want) < 1e-6
    assert len(written_to) == 2 and written_to[0] != written_to[1]
    files = sorted(p.name for p in (tmp_path / "work").rglob("*") if p.is_file())
    assert len(files) == 2 and files[0] == "key.json" and files[1].startswith("step00000000-")
    monkeypatch.setattr(np, "savez", real_savez)
    again, _, calls = score()
    assert calls == [] and torch.equal(again, got)


def test_a_failed_cache_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    score, _ = _cached_pass(tmp_path, steps=(0,))

    def disk_full(f, **arrays):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(OSError, match="No space left"):
        score()
    assert [p.name for p in (tmp_path / "work").rglob("*") if p.is_file()] == ["key.json"]


def test_non_finite_scores_are_refused_naming_the_checkpoint_and_never_cached(tmp_path):
    """Gradients that overflowed at one checkpoint (the weights themselves are finite) give NaN/inf
    scores: refused, naming that checkpoint, rather than ranked; nothing is cached for it."""
    traj = Trajectory(TrajectoryConfig(enabled=True, every=1), tmp_path / "traj")
    ckpts = [traj.save(s, _weights(s), lrs=[0.1], tokens_seen=0) for s in range(3)]

    def train_at(c):
        g = c.load()["w"][None].repeat(2, 1, 1)
        if c.step == 1:
            g[1, 0, 0] = float("inf")                       # inf * 0 or inf - inf: NaN in the dot
        yield np.arange(2), {"w": g}

    with pytest.raises(ValueError, match=r"scores at checkpoint step 1 \(.*step00000001\)"):
        tracin_cp(ckpts, lambda c: {"w": c.load()["w"][None]}, train_at, layers=["w"],
                  work_dir=tmp_path / "work", fingerprint={"q": 1})
    assert sorted(p.name[:12] for p in (tmp_path / "work").rglob("*.npz")) == ["step00000000"]
