"""Projectors: bit-identical from (seed, name, side) in any process; projected inner products are
unbiased; k=64 GradDot rankings agree with exact ones on the tiny OLMo."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from olmo_tda import CaptureConfig, GradientCapture
from olmo_tda.capture.projection import make_projector
from olmo_tda.config import ProjectionType
from conftest import exact_per_example_grads, linear_grad, tiny_olmo, token_losses

_DIGEST = """
import hashlib, sys
from olmo_tda.capture.projection import make_projector
p = make_projector(sys.argv[1], 48, 33, (16, 8), sys.argv[2], 7)
po, pi = p.matrices()
print(hashlib.sha256(po.numpy().tobytes() + pi.numpy().tobytes()).hexdigest())
"""


def _digest(name, kind):
    po, pi = make_projector(name, 48, 33, (16, 8), kind, 7).matrices()
    return hashlib.sha256(po.numpy().tobytes() + pi.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("kind", ["orthogonal", "gaussian", "rademacher"])
def test_projectors_bit_identical_across_processes(kind):
    out = subprocess.run([sys.executable, "-c", _DIGEST, "blocks.3.ff_out", kind], check=True,
                         capture_output=True, text=True).stdout.strip()
    torch.manual_seed(123)           # the global RNG must not matter
    torch.randn(10)
    assert out == _digest("blocks.3.ff_out", kind)
    assert _digest("blocks.3.ff_in", kind) != out      # different layers get different matrices
    po, pi = make_projector("x", 48, 33, (16, 8), kind, 7).matrices()
    assert not torch.equal(po[:8, :33], pi[:8])        # sides are independent draws


def test_rademacher_entries_and_scale():
    po, pi = make_projector("l", 500, 300, (64, 32), ProjectionType.RADEMACHER, 0).matrices()
    assert set(torch.unique(po * 8).tolist()) == {-1.0, 1.0}
    # E[PᵀP] = I: the diagonal of PᵀP is exactly 1 for Rademacher, ≈1 for Gaussian
    assert torch.allclose((pi.T @ pi).diagonal(), torch.ones(300))
    pg, _ = make_projector("l", 500, 300, (64, 32), ProjectionType.GAUSSIAN, 0).matrices()
    assert abs((pg.T @ pg).diagonal().mean().item() - 1.0) < 0.02


@pytest.mark.parametrize("kind", ["orthogonal", "gaussian", "rademacher"])
def test_projected_inner_products_are_unbiased(kind):
    torch.manual_seed(0)
    g1, g2 = torch.randn(40, 30), torch.randn(40, 30)
    g2 = g2 + 0.8 * g1                           # a correlated pair: exact inner product far from 0
    exact = (g1 * g2).sum().item()
    ests = []
    for seed in range(300):
        po, pi = make_projector("layer", 40, 30, (8, 8), kind, seed).matrices()
        ests.append(((po @ g1 @ pi.T) * (po @ g2 @ pi.T)).sum().item())
    ests = np.array(ests)
    stderr = ests.std(ddof=1) / np.sqrt(len(ests))
    assert abs(ests.mean() - exact) < 4 * stderr, (ests.mean(), exact, stderr)
    assert stderr < 0.1 * abs(exact)             # the test has power: the estimate is informative


def test_unbiased_through_capture_over_seeds():
    """The same property end to end through the hooks, over 64 seeds, on a real OLMo gradient pair
    that is strongly correlated (the second sequence is the first with two tokens changed), so the
    exact inner product is far from zero and the test has power."""
    model = tiny_olmo()
    first = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(0))
    second = first.clone()
    second[0, 3], second[0, 7] = 5, 11
    ids = torch.cat([first, second])
    exact = exact_per_example_grads(model, ids)
    name = "transformer.blocks.1.ff_out"
    g = linear_grad(exact, name, False)
    want = (g[0] * g[1]).sum().item()
    ests = []
    for seed in range(64):
        cap = GradientCapture(model, CaptureConfig(proj_dim=16, seed=seed, modules=[name], proj_type="gaussian"))
        with cap.record([0, 1]) as rec:
            token_losses(model(ids).logits, ids).sum().backward()
        model.zero_grad()
        d = rec.dense()[name]
        ests.append((d[0] * d[1]).sum().item())
        cap.remove()
    ests = np.array(ests)
    stderr = ests.std(ddof=1) / np.sqrt(len(ests))
    assert stderr < 0.1 * abs(want), (want, stderr)
    assert abs(ests.mean() - want) < 4 * stderr, (ests.mean(), want, stderr)


def test_graddot_k64_spearman_vs_exact_tiny_olmo():
    model = tiny_olmo()
    gen = torch.Generator().manual_seed(5)
    train = torch.randint(0, 96, (48, 16), generator=gen)
    queries = torch.randint(0, 96, (6, 16), generator=gen)
    exact_t = exact_per_example_grads(model, train)
    exact_q = exact_per_example_grads(model, queries)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    flat = lambda ex: torch.cat([ex[n + ".weight"].flatten(1) for n in names], dim=1)
    exact_scores = flat(exact_q) @ flat(exact_t).T

    cap = GradientCapture(model, CaptureConfig(proj_dim=64, seed=0))
    recs = []
    for batch in (train, queries):
        with cap.record(range(len(batch))) as rec:
            token_losses(model(batch).logits, batch).sum().backward()
        recs.append({n: g.flatten(1) for n, g in rec.dense().items()})
    proj_scores = torch.cat([recs[1][n] for n in names], 1) @ torch.cat([recs[0][n] for n in names], 1).T
    rhos = [spearmanr(exact_scores[q].numpy(), proj_scores[q].numpy())[0] for q in range(len(queries))]
    assert np.mean(rhos) >= 0.9, rhos


def test_orthogonal_rows_and_identity_when_k_exceeds_width():
    p = make_projector("l", 500, 300, (64, 32), ProjectionType.ORTHOGONAL, 0)
    po, pi = p.matrices()
    assert torch.allclose(po @ po.T, torch.eye(64) * 500 / 64, atol=1e-4)
    assert torch.allclose(pi @ pi.T, torch.eye(32) * 300 / 32, atol=1e-4)
    # a side narrower than k is kept exact, and the stored shape says so
    p = make_projector("l", 40, 10, (16, 16), ProjectionType.GAUSSIAN, 0)
    assert (p.k_out, p.k_in) == (16, 10) and torch.equal(p.matrices()[1], torch.eye(10))
