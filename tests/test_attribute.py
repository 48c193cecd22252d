"""Streaming attribution equals brute-force scoring over the whole store, for any block size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from olmo_tda import GradientRecord, GradientStore, StoreConfig, attribute
from olmo_tda.methods import available_methods

LAYERS = {"a": (6, 5), "b": (3, 4)}


@pytest.fixture
def store_and_data(tmp_path):
    meta = {"capture": {"proj_dim": 0}, "projector_hash": "t",
            "layers": [{"name": n, "shape": list(s), "projector": {}} for n, s in LAYERS.items()]}
    gen = torch.Generator().manual_seed(0)
    rows = {n: [] for n in LAYERS}
    ids_all, steps_all = [], []
    with GradientStore.create(tmp_path / "s", meta, StoreConfig(flush_every=3)) as store:
        for step in range(10):
            ids = np.arange(step * 7, step * 7 + 7)
            grads = {n: torch.randn(7, *s, generator=gen) * (1 + step) for n, s in LAYERS.items()}
            store.append(GradientRecord(ids=ids, step=step, lr=0.1, loss_scale=1.0, grads=grads))
            for n in LAYERS:
                rows[n].append(grads[n])
            ids_all.append(ids)
            steps_all.append(np.full(7, step))
    train = {n: torch.cat(v) for n, v in rows.items()}
    queries = {n: torch.randn(4, *s, generator=gen) for n, s in LAYERS.items()}
    return tmp_path / "s", train, queries, np.concatenate(ids_all), np.concatenate(steps_all)


def _brute(train, queries, layers, cosine):
    t = torch.cat([train[n].flatten(1) for n in layers], 1).double()
    q = torch.cat([queries[n].flatten(1) for n in layers], 1).double()
    s = q @ t.T
    if cosine:
        s = s / q.norm(dim=1)[:, None] / t.norm(dim=1)[None, :]
    return s


@pytest.mark.parametrize("method", ["graddot", "gradcos"])
@pytest.mark.parametrize("block_size", [1, 5, 16, 1000])
def test_streaming_topk_equals_brute_force(store_and_data, method, block_size):
    path, train, queries, ids, steps = store_and_data
    want = _brute(train, queries, ["a", "b"], method == "gradcos")
    res = attribute(path, queries, method=method, top_k=6, block_size=block_size, return_scores=True)
    order = np.lexsort((ids, steps))          # rows may stream in any order: compare by (step, id)
    got_order = np.lexsort((res.all_ids, res.all_steps))
    # float32 scoring vs a float64 oracle: agreement to float32 precision of the largest score
    assert torch.allclose(res.all_scores[:, got_order], want[:, order], rtol=1e-5, atol=1e-6 * want.abs().max().item())
    top_vals, top_idx = torch.topk(want, 6, dim=1)
    assert torch.allclose(res.scores, top_vals, rtol=1e-5)
    assert np.array_equal(res.ids, ids[top_idx.numpy()])
    assert np.array_equal(res.steps, steps[top_idx.numpy()])
    assert res.num_scored == 70


def test_layer_subset_and_errors(store_and_data):
    path, train, queries, *_ = store_and_data
    res = attribute(path, queries, method="graddot", top_k=3, layers=["b"], return_scores=True)
    assert torch.allclose(res.all_scores.max(1).values, _brute(train, queries, ["b"], False).max(1).values)
    with pytest.raises(ValueError, match="shape"):
        attribute(path, {"a": torch.randn(2, 6, 6), "b": torch.randn(2, 3, 4)})
    with pytest.raises(ValueError, match="unknown attribution method 'nope'"):
        attribute(path, queries, method="nope")
    assert {"graddot", "gradcos"} <= set(available_methods())


def test_memory_is_bounded_by_block_size(store_and_data, monkeypatch):
    """The driver never asks the store for more than block_size rows and keeps only top-k."""
    path, _, queries, *_ = store_and_data
    store = GradientStore.open(path)
    seen = []
    real = store.iter_blocks

    def spy(**kw):
        for block in real(**kw):
            seen.append(len(block.ids))
            yield block

    monkeypatch.setattr(store, "iter_blocks", spy)
    res = attribute(store, queries, top_k=4, block_size=8)
    assert max(seen) <= 8 and sum(seen) == 70
    assert res.scores.shape == (4, 4) and res.all_scores is None


def test_queries_from_other_projectors_are_refused(tmp_path):
    from olmo_tda import CaptureConfig, GradientCapture

    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(4, 6)
    caps = [GradientCapture(model, CaptureConfig(proj_dim=4, seed=s)) for s in (0, 1)]
    # both captures see the same backward; each records it with its own projectors
    with caps[0].record(range(4)) as rec0, caps[1].record(range(4)) as rec1:
        model(x).pow(2).sum().backward()
    with GradientStore.create(tmp_path / "s", caps[0].store_metadata(), StoreConfig()) as store:
        store.append(rec0.to_record(step=0, lr=1.0))
    assert attribute(tmp_path / "s", rec0, top_k=1).ids[0, 0] >= 0          # same projectors: fine
    with pytest.raises(ValueError, match="projected with projectors .* the store with"):
        attribute(tmp_path / "s", rec1, top_k=1)
    with pytest.raises(ValueError, match="projected with projectors"):
        attribute(tmp_path / "s", rec1.dense(), top_k=1, projector_hash=caps[1].projector_hash)
