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


def _int_store(path, rows_by_rank, layers=(("a", (2, 3)), ("b", (2, 2)))):
    """A store of small-integer gradients (every float32 dot product is exact, so ties are exact ties):
    ``rows_by_rank`` = {rank: [(ids, step, {layer: [n, ...]}), ...]} appended in that order."""
    meta = {"capture": {"proj_dim": 0}, "projector_hash": "t",
            "layers": [{"name": n, "shape": list(s), "projector": {}} for n, s in layers]}
    writers = {r: GradientStore.create(path, meta, StoreConfig(flush_every=2), rank=r) for r in rows_by_rank}
    for rank, records in rows_by_rank.items():
        for ids, step, grads in records:
            writers[rank].append(GradientRecord(ids=ids, step=step, lr=0.1, loss_scale=1.0, grads=grads))
    for w in writers.values():
        w.close()
    return path


def _int_grads(gen, n):
    return {"a": torch.randint(-2, 3, (n, 2, 3), generator=gen).float(),
            "b": torch.randint(-2, 3, (n, 2, 2), generator=gen).float()}


@pytest.mark.parametrize("block_size", [1, 2, 3, 5, 7, 16, 64, None])
def test_topk_ties_go_to_the_earlier_row_in_store_order_for_any_block_size(tmp_path, block_size):
    """Many exactly tied scores (repeated rows): the top-k is (score descending, store position
    ascending), whatever the block size; the oracle sorts the brute-force scores explicitly."""
    gen = torch.Generator().manual_seed(3)
    base = _int_grads(gen, 6)
    pick = torch.randint(0, 6, (48,), generator=gen)              # 48 rows drawn from 6: ties everywhere
    grads = {n: g[pick] for n, g in base.items()}
    records = [(np.arange(s * 8, s * 8 + 8), s, {n: g[s * 8:s * 8 + 8] for n, g in grads.items()}) for s in range(6)]
    path = _int_store(tmp_path / "s", {0: records})
    queries = {n: torch.cat([g[:2], torch.randint(-2, 3, (1, *g.shape[1:]), generator=gen).float()])
               for n, g in base.items()}
    res = attribute(path, queries, method="graddot", top_k=10, block_size=block_size, return_scores=True)
    assert np.array_equal(res.all_ids, np.arange(48))            # store order = append order here
    brute = _brute(grads, queries, ["a", "b"], False)
    for q in range(3):
        want = sorted(range(48), key=lambda i: (-brute[q, i].item(), i))[:10]
        assert res.ids[q].tolist() == want, (q, block_size)
        assert res.steps[q].tolist() == [i // 8 for i in want]
        assert res.scores[q].tolist() == [brute[q, i].item() for i in want]


@pytest.mark.parametrize("block_size", [1, 2, 64])
def test_an_id_step_stored_by_two_ranks_is_listed_once_at_its_best_row(tmp_path, block_size):
    """Two ranks trained example 2 in step 1 (rank 1's row scores higher): top-k lists (2, 1) once,
    with the higher score; the full score matrix keeps both rows."""
    gen = torch.Generator().manual_seed(4)
    g0, g1 = _int_grads(gen, 4), _int_grads(gen, 2)
    g1 = {n: torch.stack([3 * g0[n][2], g[1]]) for n, g in g1.items()}       # rank 1's (2, 1): 3x rank 0's
    g2 = {n: g0[n][2:3] for n in g0}                                            # (2, 2): the same example later
    path = _int_store(tmp_path / "s", {0: [(np.arange(4), 1, g0)], 1: [(np.array([2, 5]), 1, g1),
                                                                        (np.array([2]), 2, g2)]})
    queries = {n: g0[n][2:3].clone() for n in g0}
    res = attribute(path, queries, top_k=10, block_size=block_size, return_scores=True)
    rows = list(zip(res.all_ids.tolist(), res.all_steps.tolist()))
    assert len(rows) == 7 and rows.count((2, 1)) == 2
    best: dict = {}
    for (i, s), v in zip(rows, res.all_scores[0].tolist()):
        best[(i, s)] = max(best.get((i, s), -np.inf), v)
    want = sorted(best, key=lambda p: (-best[p], rows.index(p)))
    got = list(zip(res.ids[0].tolist(), res.steps[0].tolist()))
    assert got == want and len(got) == 6 and got[0] == (2, 1)
    assert res.scores[0].tolist() == [best[p] for p in want]
    d = sum(g0[n][2].square().sum().item() for n in g0)
    assert best[(2, 1)] == 3 * d and best[(2, 2)] == d


@pytest.mark.parametrize("method", ["graddot", "gradcos", "influence"])
def test_non_finite_queries_are_refused_naming_the_queries_and_layers(store_and_data, method):
    path, _, queries, *_ = store_and_data
    bad = {n: q.clone() for n, q in queries.items()}
    bad["b"][1, 0, 0] = float("nan")
    bad["a"][3, 2, 1] = float("inf")
    with pytest.raises(ValueError, match=r"queries \[1, 3\] hold NaN or inf \(a: queries \[3\]; b: queries \[1\]"):
        attribute(path, bad, method=method, top_k=3)
    # a non-finite layer that is not scored does not matter
    res = attribute(path, {"a": bad["a"][:3], "b": bad["b"][:1].expand(3, -1, -1)}, layers=["a"], top_k=3)
    assert torch.isfinite(res.scores).all()


def test_a_zero_query_warns_and_gets_the_first_rows_in_store_order(store_and_data, caplog):
    path, train, queries, ids, steps = store_and_data
    zero = {n: torch.cat([torch.zeros(1, *q.shape[1:]), q[:1]]) for n, q in queries.items()}
    with caplog.at_level("WARNING", logger="olmo_tda.methods.base"):
        res = attribute(path, zero, top_k=4, block_size=5, return_scores=True)
    assert "queries [0] are zero in every scored layer" in caplog.text
    assert res.ids[0].tolist() == res.all_ids[:4].tolist() and res.scores[0].tolist() == [0.0] * 4
    caplog.clear()
    with caplog.at_level("WARNING", logger="olmo_tda.methods.base"):
        attribute(path, queries, top_k=4)
    assert "zero in every scored layer" not in caplog.text


def test_a_projector_mismatch_names_what_differs():
    """The refusal of queries projected otherwise than the store names the layer and field; only a
    changed eigenbasis (both eigen, other basis) is called a replaced basis file."""
    from olmo_tda.methods.base import projector_difference

    eigen = {"kind": "eigen", "shape": [4, 4], "basis_digest": "aaaa", "digest": "d1"}
    meta = {"layers": [{"name": "fc", "projector": eigen}]}
    swapped = projector_difference({"fc": {**eigen, "basis_digest": "bbbb", "digest": "d2"}}, meta)
    assert "layer 'fc' was projected onto another eigenbasis (basis digest bbbb here, aaaa in the store)" in swapped
    random = {"kind": "orthogonal", "shape": [4, 4], "seed": 0, "digest": "d3"}
    for ours, theirs in ((random, eigen), (eigen, random)):
        text = projector_difference({"fc": ours}, {"layers": [{"name": "fc", "projector": theirs}]})
        assert text.startswith("layer 'fc' differs in ") and "kind=" in text and "eigenbasis" not in text
    assert "capture config" in projector_difference(None, meta)
