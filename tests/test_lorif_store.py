"""LoRIF rank-c factors end to end: capture → store → reader → methods, against dense gradients.

Ground truth is the dense projected gradient of the same capture config with ``rank: 0`` (itself
checked against torch.func in test_capture.py): factors must reproduce it exactly when an example
has <= c tokens and be its best rank-c approximation (Eckart–Young, from a float64 SVD) otherwise,
on every factorization route; every inner-product route must give the same scores.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conftest import rel_err
from olmo_tda import CaptureConfig, GradientCapture, GradientStore, StoreConfig
from olmo_tda.methods.base import attribute
from olmo_tda import ops
from olmo_tda.ops import inner, inner_route, sq_norms
from olmo_tda.store.record import GradientRecord, LowRank


class TokenMLP(nn.Module):
    """Per-token MLP ``[B, T, 12] -> [B, T, 10]``; ``fc1`` can run twice (a shared layer)."""

    def __init__(self, twice: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 10)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen) * 0.4
        self.twice = twice

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.twice:
            h = h + torch.tanh(self.fc1(torch.sin(3 * x)))
        return self.fc2(h)


def _grads(model, x, config, loss_scale=1.0):
    cap = GradientCapture(model, config)
    with cap.record(range(len(x)), loss_scale=loss_scale) as rec:
        ((model(x) ** 2).sum() / loss_scale).backward()
    model.zero_grad(set_to_none=True)
    cap.remove()
    return cap, rec


def _inputs(n, tokens, seed=1):
    return torch.randn(n, tokens, 12, generator=torch.Generator().manual_seed(seed))


def _best_rank(dense, c):
    u, s, vh = torch.linalg.svd(dense.double())
    return ((u[:, :, :c] * s[:, None, :c]) @ vh[:, :c]).float()


@pytest.mark.parametrize("route", ["auto", "qr", "dense"])
@pytest.mark.parametrize("tokens", [3, 9])
@pytest.mark.parametrize("twice", [False, True])
def test_captured_factors_are_exact_or_the_best_rank_c(route, tokens, twice):
    model, x, c = TokenMLP(twice), _inputs(5, tokens), 4
    base = dict(proj_dim=10, seed=3)
    _, dense_rec = _grads(model, x, CaptureConfig(**base))
    cap, rec = _grads(model, x, CaptureConfig(**base, rank=c, factor_route=route), loss_scale=7.0)
    stored = rec.stored()
    assert cap.layer_ranks == {"fc1": c, "fc2": c}
    for name, want in dense_rec.dense().items():
        got = stored[name]
        assert isinstance(got, LowRank) and got.A.shape == (5, 10, c) and got.B.shape == (5, 10, c)
        assert rel_err(rec.dense()[name], want) < 1e-5            # exact dense stays available (queries)
        exact_in_rank = tokens * (2 if twice and name == "fc1" else 1) <= c
        target = want if exact_in_rank else _best_rank(want, c)
        assert rel_err(got.dense(), target) < 1e-5, (name, route)
        if not exact_in_rank:
            assert rel_err(got.dense(), want) > 1e-3              # truncation really happened


def test_rank_applies_only_where_factors_are_smaller():
    model = TokenMLP()
    # k=3: c·(3+3)=24 >= 9 → dense; k=10: 100 > 4·(10+10) → factors
    cap = GradientCapture(model, CaptureConfig(proj_dim=3, rank=4))
    assert cap.layer_ranks == {"fc1": 0, "fc2": 0}
    meta = cap.store_metadata()
    assert all("rank" not in layer for layer in meta["layers"])
    cap.remove()
    cap = GradientCapture(model, CaptureConfig(proj_dim=10, rank=4))
    assert [layer["rank"] for layer in cap.store_metadata()["layers"]] == [4, 4]
    cap.remove()


def _factor_pair():
    gen = torch.Generator().manual_seed(5)
    dense = torch.randn(3, 6, 5, generator=gen, dtype=torch.float64)
    lr = LowRank(torch.randn(7, 6, 2, generator=gen, dtype=torch.float64),
                 torch.randn(7, 5, 2, generator=gen, dtype=torch.float64))
    lr_q = LowRank(torch.randn(3, 6, 3, generator=gen, dtype=torch.float64),
                   torch.randn(3, 5, 3, generator=gen, dtype=torch.float64))
    return dense, lr, lr_q


def test_every_inner_route_equals_the_dense_product():
    dense, lr, lr_q = _factor_pair()
    cases = [(dense, lr), (lr_q, lr), (lr, dense), (lr_q, dense), (dense, dense)]
    for x, y in cases:
        xd = x.dense() if isinstance(x, LowRank) else x
        yd = y.dense() if isinstance(y, LowRank) else y
        want = xd.reshape(len(xd), -1) @ yd.reshape(len(yd), -1).T
        for route in ("auto", "model", "factorized", "materialized"):
            assert rel_err(inner(x, y, route), want) < 1e-12, (type(x), type(y), route)
    assert rel_err(sq_norms(lr), (lr.dense() ** 2).sum(dim=(1, 2))) < 1e-12
    with pytest.raises(ValueError, match="route must be"):
        inner(dense, lr, "ghost")
    with pytest.raises(ValueError, match="shapes differ"):
        inner(dense[:, :5], lr)


@pytest.mark.parametrize("rank", [1, 3])
def test_tiled_materialization_crosses_tile_boundaries(monkeypatch, rank):
    # a tile of 3 rows over 10 rows: the last tile is partial; rank 1 takes the broadcast path
    from olmo_tda.capture import factors
    monkeypatch.setattr(factors, "_TILE_BYTES", 3 * 5 * 4 * 8)
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(4, 5, 4, dtype=torch.float64, generator=gen)
    A = torch.randn(10, 5, rank, dtype=torch.float64, generator=gen)
    B = torch.randn(10, 4, rank, dtype=torch.float64, generator=gen)
    want = torch.einsum("qoi,noc,nic->qn", q, A, B)
    assert rel_err(factors.dot_dense_tiles(q, A, B), want) < 1e-12
    assert rel_err(inner(LowRank(A, B), q, "materialized"), want.T) < 1e-12
    # bf16 factors against fp32 queries compute in fp32
    got = factors.dot_dense_tiles(q.float(), A.bfloat16(), B.bfloat16())
    assert got.dtype == torch.float32
    assert rel_err(got.double(), torch.einsum("qoi,noc,nic->qn", q, A.bfloat16().double(), B.bfloat16().double())) < 1e-5


def test_inner_route_is_the_flop_rule():
    # dense queries vs factors (measured per-row costs Q·c vs 6.5 + 0.5·Q + 0.1·c): few queries
    # against small ranks → factorized; more → materialized tile by tile
    assert inner_route(1, 1000, 64, 64, 0, 4) == "factorized"
    assert inner_route(4, 1000, 64, 64, 0, 2) == "factorized"
    assert inner_route(1, 1000, 64, 64, 0, 8) == "materialized"
    assert inner_route(4, 1000, 64, 64, 0, 4) == "materialized"
    assert inner_route(16, 1000, 64, 64, 0, 1) == "materialized"
    assert inner_route(64, 1000, 64, 64, 0, 1) == "materialized"
    assert inner_route(16, 1000, 64, 64, 0, 8) == "materialized"
    assert inner_route(1000, 1, 64, 64, 1, 0) == inner_route(1, 1000, 64, 64, 0, 1)    # symmetric
    # factors vs factors at small ranks: factorized; at ranks near the width: materialized
    assert inner_route(16, 1000, 64, 64, 2, 2) == "factorized"
    assert inner_route(16, 1000, 64, 64, 48, 48) == "materialized"
    assert inner_route(4, 4, 8, 8, 0, 0) == "materialized"


def _slowed(monkeypatch, name, calls):
    """Make ``ops.<name>`` (one route's kernel) 30 ms slower, counting its calls."""
    import time
    real = getattr(ops, name)

    def slow(*args):
        calls[name] = calls.get(name, 0) + 1
        time.sleep(0.03)
        return real(*args)
    monkeypatch.setattr(ops, name, slow)


@pytest.mark.parametrize("slow, want_route", [("dot_dense_factor", "materialized"), ("dot_dense_tiles", "factorized")])
@pytest.mark.parametrize("queries_are_factors", [False, True])
def test_auto_times_near_ties_and_keeps_the_faster_route(monkeypatch, slow, want_route, queries_are_factors):
    # Q=1 dense query vs c=8 factors: the model's costs are 8 vs 7.8 (a near-tie), so auto runs both
    # routes, keeps the faster — here the one not slowed by 30 ms — and later calls of the shape
    # (other rows, the short last block) take it without timing
    monkeypatch.setattr(ops, "_measured", {})
    calls = {}
    _slowed(monkeypatch, slow, calls)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 64, 64, dtype=torch.float64, generator=gen)
    lr = LowRank(torch.randn(1024, 64, 8, dtype=torch.float64, generator=gen),
                 torch.randn(1024, 64, 8, dtype=torch.float64, generator=gen))
    want = q.reshape(1, -1) @ lr.dense().reshape(1024, -1).T
    x, y = (lr, q) if queries_are_factors else (q, lr)
    want = want.T if queries_are_factors else want
    assert ops.auto_route(x, y) is None                        # not timed yet
    assert rel_err(inner(x, y), want) < 1e-12
    timed_calls = 1 + ops._TIMED_ROUNDS                        # a warm-up, then one 30 ms call a round
    assert calls[slow] == timed_calls
    assert ops.auto_route(x, y) == want_route
    assert list(ops.measured_routes().values()) == [want_route]
    short = (lr[:700], q) if queries_are_factors else (q, lr[:700])
    assert ops.auto_route(*short) == want_route                # 700 rows round up to the same key
    assert rel_err(inner(*short), want[:700] if queries_are_factors else want[:, :700]) < 1e-12
    assert rel_err(inner(x, y), want) < 1e-12
    assert calls[slow] == timed_calls                          # no more timing, the slow route not taken
    assert rel_err(inner(x, y, "model"), want) < 1e-12         # the model alone: its own pick, untimed
    model_takes_slow = inner_route(1, 1024, 64, 64, 0, 8) == ("factorized" if slow == "dot_dense_factor"
                                                               else "materialized")
    assert calls[slow] == timed_calls + model_takes_slow
    ops.clear_measured_routes()
    assert ops.auto_route(x, y) is None


def test_auto_times_only_near_ties(monkeypatch):
    # outside TIE_BAND (Q=64 vs c=8: 512 vs 42.3), two factor sides, or a product too small to time,
    # auto is the cost model: one route runs once, nothing is measured
    monkeypatch.setattr(ops, "_measured", {})
    calls = {}
    _slowed(monkeypatch, "dot_dense_factor", calls)
    _slowed(monkeypatch, "dot_dense_tiles", calls)
    gen = torch.Generator().manual_seed(4)
    lr = LowRank(torch.randn(256, 64, 8, generator=gen), torch.randn(256, 64, 8, generator=gen))
    cases = [(torch.randn(64, 64, 64, generator=gen), lr),                       # far from a tie
             (LowRank(torch.randn(1, 64, 8), torch.randn(1, 64, 8)), lr),        # factors·factors
             (torch.randn(1, 8, 8, generator=gen), LowRank(lr.A[:4, :8], lr.B[:4, :8]))]   # 2k multiply-adds
    for x, y in cases:
        assert ops.auto_route(x, y) == inner_route(len(x), len(y), y.shape[1], y.shape[2], ops._rank(x), ops._rank(y))
        inner(x, y)
    assert calls == {"dot_dense_tiles": 2} and ops.measured_routes() == {}


def _write(path, cap, records, dtype="float32"):
    with GradientStore.create(path, cap.store_metadata(), StoreConfig(dtype=dtype, flush_every=2)) as w:
        for r in records:
            w.append(r)
    return GradientStore.open(path)


def _records(model, config, steps=3, tokens=3):
    cap = GradientCapture(model, config)
    out = []
    for step in range(steps):
        x = _inputs(4, tokens, seed=10 + step)
        with cap.record(np.arange(4) + 4 * step, loss_scale=2.0) as rec:
            ((model(x) ** 2).sum() / 2.0).backward()
        model.zero_grad(set_to_none=True)
        out.append(rec.to_record(step=step, lr=0.1))
    return cap, out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_factor_store_round_trip_and_methods_equal_dense(tmp_path, dtype):
    model = TokenMLP()
    cap_d, dense_recs = _records(model, CaptureConfig(proj_dim=10, seed=1))
    cap_f, factor_recs = _records(model, CaptureConfig(proj_dim=10, seed=1, rank=4))   # T=3 <= c: exact
    dense = _write(tmp_path / "d", cap_d, dense_recs, dtype)
    factors = _write(tmp_path / "f", cap_f, factor_recs, dtype)
    assert factors.meta["representation"] == "lorif" and dense.meta["representation"] == "dense"
    assert factors.layer_ranks == {"fc1": 4, "fc2": 4} and factors.layer_shapes == dense.layer_shapes
    # 2·10·4 floats per layer row instead of 10·10
    assert factors.summary()["floats_per_row"] == 2 * 80 and dense.summary()["floats_per_row"] == 2 * 100
    block = factors.read_all()
    assert isinstance(block.grads["fc1"], LowRank) and len(block) == 12
    want = dense.read_all()
    tol = 1e-5 if dtype == "float32" else 2e-2
    for name in ("fc1", "fc2"):
        assert rel_err(block.grads[name].dense(), want.grads[name]) < tol
    # small blocks concatenate factors across shards the same way
    pieces = list(factors.iter_blocks(block_size=5))
    assert [len(p) for p in pieces] == [5, 5, 2] and isinstance(pieces[0].grads["fc2"], LowRank)
    # default blocks are sized by the decoded bytes of what is stored: factor rows are smaller, so
    # the same budget holds more of them (5 factor rows = 4 dense rows here); scores do not change
    from olmo_tda.store import reader as reader_module
    ref_scores = attribute(factors, {n: g[:3] for n, g in want.grads.items()}, top_k=12, return_scores=True,
                           block_size=100).all_scores
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reader_module, "BLOCK_BYTES", 5 * 4 * 2 * 80)
        assert factors.block_rows() == 5 and dense.block_rows() == 4
        assert [len(p) for p in factors.iter_blocks()] == [5, 5, 2]
        got = attribute(factors, {n: g[:3] for n, g in want.grads.items()}, top_k=12, return_scores=True)
        assert torch.allclose(got.all_scores, ref_scores, rtol=1e-6, atol=1e-9)

    queries = {n: g[:3] for n, g in want.grads.items()}
    for method, opts in [("graddot", {}), ("gradcos", {}), ("influence", {"hessian": "raw"}),
                         ("influence", {"hessian": "lorif", "rank": 8}), ("influence", {"hessian": "ekfac"})]:
        ref = attribute(dense, queries, method=method, top_k=12, return_scores=True, **opts)
        for route in ("auto", "model", "factorized", "materialized"):
            got = attribute(factors, queries, method=method, top_k=12, return_scores=True, route=route, **opts)
            assert rel_err(got.all_scores, ref.all_scores) < 10 * tol, (method, opts, route)


def test_truncated_factor_rows_score_as_their_dense_product_and_stored_queries_work(tmp_path):
    """Examples longer than c tokens store their best rank-c approximation: every method scores those
    rows as a dense store holding the same approximations (materialized here) does, GradDot also as
    the explicit float64 inner products. Factored queries (``rec.stored()``) are taken as their dense
    product: exact at T <= c, so they score as the dense queries."""
    model = TokenMLP()
    cap_f, factor_recs = _records(model, CaptureConfig(proj_dim=10, seed=1, rank=2), tokens=6)    # T=6 > c=2
    cap_d, _ = _records(model, CaptureConfig(proj_dim=10, seed=1), steps=1)
    factors = _write(tmp_path / "f", cap_f, factor_recs)
    assert factors.layer_ranks == {"fc1": 2, "fc2": 2}
    materialized = [GradientRecord(ids=r.ids, step=r.step, lr=r.lr, loss_scale=r.loss_scale,
                                   grads={n: g.dense() for n, g in r.grads.items()}) for r in factor_recs]
    dense = _write(tmp_path / "d", cap_d, materialized)
    rows = dense.read_all()
    x = _inputs(3, 6, seed=99)
    with cap_f.record(range(3)) as rec:
        ((model(x) ** 2).sum()).backward()
    model.zero_grad(set_to_none=True)
    queries = rec.dense()
    assert rel_err(torch.stack([g.dense() for g in rec.stored().values()]),
                   torch.stack(list(queries.values()))) > 1e-3          # truncated: the factors are not exact
    explicit = sum(queries[n].flatten(1).double() @ rows.grads[n].flatten(1).double().T for n in queries)
    got = attribute(factors, queries, method="graddot", top_k=12, return_scores=True)
    assert rel_err(got.all_scores, explicit) < 1e-5
    for method, opts in [("gradcos", {}), ("influence", {"hessian": "raw"}), ("influence", {"hessian": "ekfac"})]:
        ref = attribute(dense, queries, method=method, top_k=12, return_scores=True, **opts)
        got = attribute(factors, queries, method=method, top_k=12, return_scores=True, **opts)
        assert rel_err(got.all_scores, ref.all_scores) < 1e-4, (method, opts)
    # factored queries: their product, which is exact for examples of at most c tokens
    with cap_f.record(range(3)) as short:
        ((model(_inputs(3, 2, seed=98)) ** 2).sum()).backward()
    model.zero_grad(set_to_none=True)
    assert all(isinstance(g, LowRank) for g in short.stored().values())
    ref = attribute(factors, short, top_k=12, return_scores=True)
    got = attribute(factors, short.stored(), top_k=12, return_scores=True)
    assert rel_err(got.all_scores, ref.all_scores) < 1e-5
    with pytest.raises(TypeError, match="got {'fc1': 'ndarray'}"):
        attribute(factors, {"fc1": np.zeros((1, 10, 10))}, top_k=2)


def test_store_refuses_the_wrong_representation(tmp_path):
    model = TokenMLP()
    cap_f, factor_recs = _records(model, CaptureConfig(proj_dim=10, rank=4), steps=1)
    cap_d, dense_recs = _records(model, CaptureConfig(proj_dim=10), steps=1)
    with GradientStore.create(tmp_path / "s", cap_f.store_metadata(), StoreConfig()) as w:
        with pytest.raises(ValueError, match="holds this layer as rank-4 factors"):
            w.append(dense_recs[0])
        bad = GradientRecord(ids=factor_recs[0].ids, step=0, lr=0.1, loss_scale=1.0,
                             grads={n: LowRank(g.A[:, :, :2], g.B[:, :, :2]) for n, g in factor_recs[0].grads.items()})
        with pytest.raises(ValueError, match="rank-2 factors"):
            w.append(bad)
        w.append(factor_recs[0])
    from olmo_tda.store.errors import StoreMismatchError
    with pytest.raises(StoreMismatchError, match="rank"):
        GradientStore.create(tmp_path / "s", cap_d.store_metadata(), StoreConfig())


@pytest.mark.parametrize("method, opts", [("graddot", {}), ("gradcos", {}), ("influence", {"hessian": "raw"}),
                                          ("influence", {"hessian": "ekfac"})])
def test_query_rank_scores_the_best_rank_r_queries(tmp_path, method, opts):
    """``query_rank=r`` = the same method with each (preconditioned, normalized) query replaced by its
    best rank-r approximation, computed here independently by SVD against the dense store."""
    model = TokenMLP()
    cap_d, dense_recs = _records(model, CaptureConfig(proj_dim=10, seed=1))
    cap_f, factor_recs = _records(model, CaptureConfig(proj_dim=10, seed=1, rank=4))
    dense = _write(tmp_path / "d", cap_d, dense_recs)
    factors = _write(tmp_path / "f", cap_f, factor_recs)
    queries = {n: g[:3] for n, g in dense.read_all().grads.items()}
    exact = attribute(dense, queries, method=method, top_k=12, return_scores=True, **opts)
    got = attribute(factors, queries, method=method, top_k=12, return_scores=True, query_rank=2, **opts)
    assert got.info["query_rank"] == 2

    from olmo_tda.methods.base import get_method
    algo = get_method(method, **opts)
    if hasattr(algo, "fit"):
        algo.fit(dense, list(queries))
    state = algo.prepare(queries)
    truncated = {n: _best_rank(q.reshape(3, 10, 10), 2).double() for n, q in state.items()}
    rows = dense.read_all()
    want = sum(truncated[n].reshape(3, -1) @ rows.grads[n].double().reshape(12, -1).T for n in truncated)
    if method == "gradcos":
        want = want / torch.sqrt(sum((rows.grads[n].double() ** 2).sum(dim=(1, 2)) for n in truncated))
    assert rel_err(got.all_scores, want) < 1e-4
    assert rel_err(got.all_scores, exact.all_scores) > 1e-3          # an approximation, not a no-op
