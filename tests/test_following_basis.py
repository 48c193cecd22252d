"""An eigenbasis that follows the run: versions, per-shard records, per-version query projection.

Ground truth: exact per-example gradients (autograd, one example at a time) at the weights each
row was captured at, projected in float64 with the matrices of the version in force at its step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from olmo_tda import GradientCapture, GradientStore, attribute
from olmo_tda.capture.eigenbasis import EigenBasis, EigenBasisError, estimate_eigenbasis
from olmo_tda.capture.following import BasisFollower, is_refresh_step, refresh_steps, refreshed_basis
from olmo_tda.config import CaptureConfig, StoreConfig
from olmo_tda.methods import BasisQueries
from olmo_tda.methods.tracin import tracin_inrun

N_IN, HIDDEN, N_OUT, K = 8, 96, 6, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, N_OUT))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed per-example squared error (x: [B, T, N_IN], y: [B, T, N_OUT])."""
    return (model(x) - y).square().sum()


def _data(steps: int, batch: int = 6, tokens: int = 5):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, tokens, N_IN, generator=gen), torch.randn(batch, tokens, N_OUT, generator=gen))
            for _ in range(steps)]


def test_schedule_refreshes_early_then_every_n():
    assert refresh_steps(100, 600) == [6, 12, 25, 50, 100, 200, 300, 400, 500, 600]
    assert [s for s in range(1, 601) if is_refresh_step(s, 100)] == refresh_steps(100, 600)
    assert refresh_steps(0, 600) == [] and not is_refresh_step(100, 0)
    assert refresh_steps(4, 9) == [1, 2, 4, 8]


def test_refresh_finds_the_top_eigenvectors_of_the_sampled_rows():
    gen = torch.Generator().manual_seed(3)
    n, k = 200, 6
    scales = torch.logspace(1, -3, n, dtype=torch.float64)
    x = torch.randn(4000, n, generator=gen, dtype=torch.float64) * scales
    x = x @ torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64)).Q.T
    vals, vecs = torch.linalg.eigh(x.T @ x / len(x))
    exact = vecs.flip(1).T[:k]
    from olmo_tda.capture.eigenbasis import LayerBasis

    near = torch.linalg.qr((exact + 0.02 * torch.randn(k, n, generator=gen, dtype=torch.float64)).T).Q.T
    cold = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64)).Q.T
    # a refresh starts at the previous version, near the new one; from a random start one product keeps less
    for warm, floor in ((near, 0.999), (cold, 0.9)):
        lb = LayerBasis(proj_out=torch.eye(3), proj_in=warm.float(), eigvals_out=torch.ones(3, dtype=torch.float64),
                        eigvals_in=torch.ones(k, dtype=torch.float64), trace_out=3.0, trace_in=1.0, bias=False,
                        num_tokens=1)
        new = refreshed_basis(EigenBasis({"l": lb}), {"l": (x.float(), torch.randn(4000, 3))})
        got = new.layers["l"].proj_in.double()
        # the variance the k directions keep, against the most any k directions can keep
        cov = x.T @ x / len(x)
        kept = torch.trace(got @ cov @ got.T) / vals.flip(0)[:k].sum()
        assert kept > floor, kept
        if warm is near:                # the span (bar its edge direction) and the eigenvalues
            assert torch.linalg.svdvals(got @ exact.T)[:k - 1].min() > 0.99
            assert torch.allclose(new.layers["l"].eigvals_in, vals.flip(0)[:k], rtol=1e-2)
        assert torch.equal(new.layers["l"].proj_out, torch.eye(3))       # an identity side is kept as it is


def _run(tmp_path, steps: int = 7, every: int = 4):
    """Train ``steps`` SGD steps with a following basis; return what the ground truth needs."""
    model = _model()
    cfg = CaptureConfig(proj_dim=K, proj_type="eigen", basis=str(tmp_path / "basis0.safetensors"), basis_every=every,
                        basis_batches=2, basis_tokens=40)
    data = _data(steps)
    estimate_eigenbasis(model, data[:2], lambda m, b: _loss(m, *b), cfg).save(cfg.basis)
    cap = GradientCapture(model, cfg)
    store = GradientStore.create(tmp_path / "store", cap.store_metadata(), StoreConfig(flush_every=100))
    follower = BasisFollower(model, cap, cfg, tmp_path / "store" / "bases")
    follower.start(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    weights, ids = {}, {}
    for step, (x, y) in enumerate(data, 1):
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
        ids[step] = np.arange(len(x)) + 100 * step % 7           # ids repeat across steps
        follower.before_step(step)
        with cap.record(ids[step]) as rec:
            _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        store.append(rec.to_record(step, lr=0.05))
        follower.after_step(step)
    store.close()
    return model, cap, cfg, data, weights, ids, follower


def _version_at(follower: BasisFollower, step: int) -> str:
    return [d for s, d in follower.versions if s <= step][-1]


def _exact_projected(model, weights, x, y, basis: EigenBasis) -> dict[str, torch.Tensor]:
    """float64 ``{layer: [B, K, K]}``: each example's exact gradient projected with ``basis``."""
    model.load_state_dict(weights)
    out = {}
    for name, layer in (("0", model[0]), ("2", model[2])):
        lb = basis.layers[name]
        p_out = lb.proj_out[:K].double() if lb.proj_out.shape[0] < lb.n_out else torch.eye(lb.n_out, dtype=torch.float64)
        p_in = lb.proj_in[:K].double()
        rows = []
        for i in range(len(x)):
            gw, gb = torch.autograd.grad(_loss(model, x[i:i + 1], y[i:i + 1]), [layer.weight, layer.bias])
            g = torch.cat([gw, gb[:, None]], dim=1).double()
            rows.append(p_out @ g @ p_in.T)
        out[name] = torch.stack(rows)
    return out


def test_rows_of_two_versions_score_as_brute_force(tmp_path):
    model, cap, cfg, data, weights, ids, follower = _run(tmp_path)
    store = GradientStore.open(tmp_path / "store")
    digests = [d for _, d in follower.versions]
    assert len(digests) == len(set(digests)) >= 3 and store.bases == digests
    for info in store.shards:          # a shard holds one version, the one in force at its steps
        assert {_version_at(follower, s) for s in range(info.step_min, info.step_max + 1)} == {info.basis}
    final = {k: v.clone() for k, v in model.state_dict().items()}
    qx, qy = _data(1, batch=2)[0]
    queries = BasisQueries()
    for d in digests:
        cap.use_basis(store.load_basis(d))
        with cap.record([0, 1]) as rec:
            _loss(model, qx, qy).backward()
        model.zero_grad()
        queries[d] = rec
    # ground truth, row by row in store order
    expected, lr_w = [], []
    for block in store.iter_blocks(block_size=3):
        for i, s in zip(block.ids, block.steps):
            basis = store.load_basis(_version_at(follower, int(s)))
            assert block.basis == basis.digest
            x, y = data[int(s) - 1]
            row = _exact_projected(model, weights[int(s)], x[[list(ids[int(s)]).index(i)]],
                                   y[[list(ids[int(s)]).index(i)]], basis)
            q = _exact_projected(model, final, qx, qy, basis)
            expected.append(sum((q[n] * row[n]).flatten(1).sum(1) for n in q))
            lr_w.append(0.05)
    expected = torch.stack(expected, dim=1)                                  # [Q, N]
    model.load_state_dict(final)
    got = attribute(store, queries, method="graddot", return_scores=True, top_k=3).all_scores
    torch.testing.assert_close(got, expected, rtol=2e-4, atol=1e-6)
    cos = attribute(store, queries, method="gradcos", return_scores=True, top_k=3).all_scores
    norms_q = {d: torch.cat([queries[d].dense()[n].flatten(1) for n in ("0", "2")], 1).double().norm(dim=1)
               for d in digests}
    rows_n = torch.cat([torch.cat([b.grads[n].flatten(1) for n in ("0", "2")], 1).double().norm(dim=1)
                        for b in store.iter_blocks(block_size=3)])
    q_n = torch.stack([norms_q[b.basis] for b in store.iter_blocks(block_size=1)], dim=1)
    torch.testing.assert_close(cos, expected / (q_n * rows_n), rtol=2e-4, atol=1e-6)
    # in-run TracIn: every row paired with its own version's query projection
    scores, example_ids = tracin_inrun(store, lambda step: BasisQueries({d: queries[d].dense() for d in digests}),
                                       [len(data)])
    all_ids = np.concatenate([b.ids for b in store.iter_blocks()])
    want = torch.zeros(2, all_ids.max() + 1, dtype=torch.float64).index_add_(
        1, torch.from_numpy(all_ids), expected * torch.tensor(lr_w, dtype=torch.float64))
    torch.testing.assert_close(scores, want[:, example_ids], rtol=2e-4, atol=1e-6)


def test_a_query_of_the_wrong_version_is_refused(tmp_path):
    model, cap, cfg, data, weights, ids, follower = _run(tmp_path, steps=3)
    store = GradientStore.open(tmp_path / "store")
    d = store.bases
    qx, qy = _data(1, batch=2)[0]
    recs = {}
    for digest in d:
        cap.use_basis(store.load_basis(digest))
        with cap.record([0, 1]) as rec:
            _loss(model, qx, qy).backward()
        recs[digest] = rec
    swapped = BasisQueries({d[0]: recs[d[1]], **{x: recs[x] for x in d[1:]}})
    with pytest.raises(ValueError, match=f"{d[0][:16]}.*{d[1][:16]}"):
        attribute(store, swapped, method="graddot")
    with pytest.raises(ValueError, match="eigenbasis versions"):
        attribute(store, recs[d[-1]], method="graddot")           # one recording for a store of several
    with pytest.raises(ValueError, match=f"no queries projected with eigenbasis version {d[0][:16]}"):
        attribute(store, BasisQueries({x: recs[x] for x in d[1:]}), method="graddot")
    with pytest.raises(ValueError, match="read_all"):
        store.read_all()
    assert [b["digest"] for b in store.summary()["bases"]] == [x[:16] for x in d]
    assert store.verify()["damaged"] == []
    # a version's file with flipped bytes, then gone: verify lists it, loading it is refused by name
    path = store.basis_path(d[0])
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF
    path.write_bytes(bytes(data))
    from olmo_tda.capture.eigenbasis import _load_cached
    _load_cached.cache_clear()
    assert [x["file"] for x in store.verify()["damaged"]] == [f"bases/{d[0]}.safetensors"]
    path.unlink()
    with pytest.raises(EigenBasisError, match=str(path)):
        store.load_basis(d[0])
    assert store.summary()["bases"][0]["file"] is False


def test_resume_keeps_the_versions_up_to_its_step_and_cuts_the_later_ones(tmp_path):
    model, cap, cfg, data, weights, ids, follower = _run(tmp_path, steps=5)
    folder = tmp_path / "store" / "bases"
    state = follower.state_dict()
    assert [s for s, _ in follower.versions] == [1, 2, 3, 5]
    again = BasisFollower(model, cap, cfg, folder)
    again.load_state_dict(state, step=2)          # rows of steps 1, 2 kept; step 3's version is in force next
    assert again.versions == follower.versions[:3]
    assert cap.basis_version == follower.versions[2][1]
    assert sorted(p.stem for p in folder.glob("*.safetensors")) == sorted(d for _, d in follower.versions[:3])
    (folder / f"{follower.versions[1][1]}.safetensors").unlink()
    with pytest.raises(EigenBasisError, match=follower.versions[1][1][:16]):
        BasisFollower(model, cap, cfg, folder).load_state_dict(state, step=2)
