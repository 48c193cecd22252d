"""LoRIF factor math against dense gradients formed explicitly: factors are exact when T ≤ c and the
best rank-c approximation otherwise (vs torch.linalg.svd of the dense gradient); every inner-product
route equals the dense one."""

from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from olmo_tda.capture.factors import (
    cross_gram,
    dot_dense_dense,
    dot_dense_factor,
    dot_factor_factor,
    dot_ghost,
    lowrank_factors,
    route,
    truncate_dense,
)


def _tokens(n, t, ko, ki, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, t, ko, generator=gen, dtype=torch.float64), torch.randn(n, t, ki, generator=gen,
                                                                                 dtype=torch.float64)


def _dense(g, a):
    return g.transpose(1, 2) @ a


@pytest.mark.parametrize("tokens, rank", [(3, 4), (4, 4), (1, 8)])
def test_factors_are_exact_when_tokens_fit_the_rank(tokens, rank):
    g, a = _tokens(5, tokens, 6, 7)
    A, B = lowrank_factors(g, a, rank)
    assert A.shape == (5, 6, rank) and B.shape == (5, 7, rank)
    assert rel_err(A @ B.transpose(1, 2), _dense(g, a)) < 1e-14


def test_exact_factors_are_balanced_so_a_float16_store_keeps_small_gradients():
    """Output gradients far smaller than activations: each stored column pair has equal norms (as the
    truncated route's U√S, V√S), so factors cast to float16 keep the gradient; the raw token factors
    flushed the output side to zero."""
    torch.manual_seed(0)
    g, a = 1e-7 * torch.randn(3, 2, 6), 1e2 * torch.randn(3, 2, 5)
    g[1, 1] = 0                                             # a token with no gradient: a zero column pair
    A, B = lowrank_factors(g, a, rank=4)
    exact = g.transpose(1, 2) @ a
    assert rel_err(A @ B.transpose(1, 2), exact) < 1e-6
    assert torch.allclose(A.norm(dim=1), B.norm(dim=1), rtol=1e-5, atol=0)
    assert float(A[1, :, 1].abs().max()) == float(B[1, :, 1].abs().max()) == 0.0
    assert rel_err(A.half().float() @ B.half().float().transpose(1, 2), exact) < 2e-3
    for bad in (float("nan"), float("inf")):                 # stays non-finite: the store skips the example
        g[2, 0, 0] = bad
        A, B = lowrank_factors(g, a, rank=4)
        assert not A[2].isfinite().all() and A[:2].isfinite().all() and B[:2].isfinite().all()


@pytest.mark.parametrize("rank", [1, 2, 5])
def test_factors_are_the_best_rank_c_approximation(rank):
    g, a = _tokens(4, 12, 9, 7)
    dense = _dense(g, a)
    A, B = lowrank_factors(g, a, rank)
    u, s, vh = torch.linalg.svd(dense)
    best = (u[:, :, :rank] * s[:, None, :rank]) @ vh[:, :rank]      # Eckart–Young
    assert rel_err(A @ B.transpose(1, 2), best) < 1e-10
    # the token count above the input width (T=12 > Ki=7): rank 7 reproduces the gradient exactly
    A7, B7 = lowrank_factors(g, a, 7)
    assert rel_err(A7 @ B7.transpose(1, 2), dense) < 1e-10


@pytest.mark.parametrize("ko, ki", [(6, 9), (9, 6), (8, 8)])
@pytest.mark.parametrize("rank", [1, 3, 6, 11])
def test_truncate_dense_is_the_svd_truncation(ko, ki, rank):
    """The Gram-eigendecomposition route equals torch.linalg.svd's Eckart–Young truncation on either
    narrower side, splits it as U√S / V√S, pads ranks above min(Ko, Ki) with zero columns, and gives
    rank-deficient (incl. all-zero) examples zero columns instead of NaNs."""
    g, a = _tokens(5, 12, ko, ki, seed=rank)
    dense = _dense(g, a)
    dense[1] = 0.0                                                       # a zero gradient
    dense[2] = torch.outer(g[2, 0], a[2, 0])                             # rank 1
    for dtype in (torch.float64, torch.float32):
        A, B = truncate_dense(dense.to(dtype), rank)
        assert A.dtype == B.dtype == dtype and A.shape == (5, ko, rank) and B.shape == (5, ki, rank)
        assert torch.isfinite(A).all() and torch.isfinite(B).all()
        u, s, vh = torch.linalg.svd(dense)
        c = min(rank, ko, ki)
        best = (u[:, :, :c] * s[:, None, :c]) @ vh[:, :c]
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        assert rel_err((A @ B.transpose(1, 2)).double(), best) < tol
        assert (A[1] == 0).all() and (B[1] == 0).all()
        # U√S and V√S: each side's columns are orthogonal with squared norms equal to the singular values
        for side in (A, B):
            gram = side.double().transpose(1, 2) @ side.double()
            want = torch.diag_embed(torch.cat([s[:, :c], s.new_zeros(5, rank - c)], dim=1))
            assert rel_err(gram[[0, 3, 4]], want[[0, 3, 4]]) < tol
        if rank > c:
            assert (A[:, :, c:] == 0).all() and (B[:, :, c:] == 0).all()


def test_every_inner_product_route_equals_dense():
    g1, a1 = _tokens(3, 5, 6, 4, seed=1)
    g2, a2 = _tokens(7, 5, 6, 4, seed=2)
    want = dot_dense_dense(_dense(g1, a1), _dense(g2, a2))
    A1, B1 = lowrank_factors(g1, a1, 5)                                # T ≤ c: exact factors
    A2, B2 = lowrank_factors(g2, a2, 5)
    assert rel_err(dot_dense_factor(_dense(g1, a1), A2, B2), want) < 1e-12
    assert rel_err(dot_factor_factor(A1, B1, A2, B2), want) < 1e-12
    assert rel_err(dot_ghost(g1, a1, g2, a2), want) < 1e-12
    for force in ("factorized", "materialized", None):
        assert rel_err(cross_gram(g1, a1, g2, a2, force=force), want) < 1e-12
    with pytest.raises(ValueError, match="route must be"):
        cross_gram(g1, a1, g2, a2, force="ghostly")


@pytest.mark.parametrize("c1, c2", [(3, 2), (1, 4), (2, 1)])
def test_factor_factor_with_unequal_ranks_and_packed_rows(c1, c2):
    # the reader hands out A and B as strided views of one packed [N, Ko + Ki, c] block; the query
    # side often has another rank (query_rank): equal to the dense product of the formed matrices
    gen = torch.Generator().manual_seed(7)
    A1, B1 = torch.randn(5, 6, c1, generator=gen, dtype=torch.float64), torch.randn(5, 4, c1, generator=gen,
                                                                                     dtype=torch.float64)
    packed = torch.randn(9, 6 + 4, c2, generator=gen, dtype=torch.float64)
    A2, B2 = packed[:, :6], packed[:, 6:]
    want = dot_dense_dense(A1 @ B1.transpose(1, 2), A2 @ B2.transpose(1, 2))
    assert rel_err(dot_factor_factor(A1, B1, A2, B2), want) < 1e-12
    assert rel_err(dot_factor_factor(A2, B2, A1, B1), want.T) < 1e-12


def test_route_is_the_flop_rule():
    # short sequences: factorized (T² small); long ones with narrow layers: materialized
    assert route(16, 1000, 4, 64, 64) == "factorized"
    assert route(16, 1000, 512, 64, 64) == "materialized"
    q, n, t, ki, ko = 8, 100, 40, 32, 48
    factorized = q * n * t * t * (ko + ki)
    materialized = (q + n) * t * ko * ki + q * n * ko * ki
    assert route(q, n, t, ki, ko) == ("factorized" if factorized < materialized else "materialized")


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16, torch.float64])
def test_inner_computes_mixed_dtypes_alike_on_every_route(low):
    """float32 queries against factors (or dense rows) of another dtype: every route gives the
    promoted dtype's product of the explicit gradients (a factor route used to raise on the mix)."""
    from olmo_tda.ops import inner
    from olmo_tda.store.record import LowRank

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 4, generator=gen)
    A, B = torch.randn(9, 6, 2, generator=gen).to(low), torch.randn(9, 4, 2, generator=gen).to(low)
    dense = (A.double() @ B.double().transpose(1, 2))
    tol = 1e-12 if low is torch.float64 else 1e-5
    for y, rows in ((LowRank(A, B), dense), (dense.to(low), dense.to(low).double())):
        want = dot_dense_dense(q.double(), rows)
        for how in ("auto", "model", "factorized", "materialized"):
            got = inner(q, y, how)
            assert got.dtype == torch.promote_types(torch.float32, low), (how, got.dtype)
            assert rel_err(got.double(), want) < tol, how
            assert rel_err(inner(y, q, how).double(), want.T) < tol, how
    assert rel_err(inner(LowRank(A, B), LowRank(A.float(), B.float()), "factorized").double(),
                   dot_dense_dense(dense, dense)) < tol


def test_inner_with_no_rows_on_either_side_is_empty_on_every_route():
    from olmo_tda.ops import inner, sq_norms
    from olmo_tda.store.record import LowRank

    q, none = torch.randn(2, 6, 4), torch.zeros(0, 6, 4)
    factors, no_factors = LowRank(torch.randn(3, 6, 2), torch.randn(3, 4, 2)), LowRank(torch.zeros(0, 6, 2),
                                                                                        torch.zeros(0, 4, 2))
    for x, y, shape in ((q, none, (2, 0)), (none, q, (0, 2)), (q, no_factors, (2, 0)), (no_factors, factors, (0, 3)),
                        (factors, no_factors, (3, 0)), (none, no_factors, (0, 0))):
        for how in ("auto", "model", "factorized", "materialized"):
            assert inner(x, y, how).shape == shape, (how, shape)
    assert sq_norms(none).shape == (0,) and sq_norms(no_factors).shape == (0,)
    assert dot_dense_dense(none, q).shape == (0, 2)
