"""Adam-corrected scores (olmo_tda.methods.optimizer) against float64 brute force.

A tiny model (token table, Linear with bias, Linear without) is trained a few steps with
``torch.optim.AdamW``; its real ``exp_avg_sq`` gives the preconditioner ``u = 1/(√v̂ + ε)``. The oracle
takes exact per-example gradients from ``torch.func``, fits ``u ≈ r cᵀ`` itself, and computes the
stated approximation ``P_out diag(r) Π_out G Π_in diag(c) P_inᵀ`` (``Π = P⁺P``) and the exact
TrackStar ``u ⊙ G`` where the approximation must equal it.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.func import functional_call, grad, vmap

from olmo_tda import GradientCapture, GradientStore, StoreConfig, attribute
from olmo_tda.config import CaptureConfig
from olmo_tda.methods.optimizer import (AdamCorrection, AdamCorrectionError, LayerCorrection,
                                        exp_avg_sq_from_state_dict)
from olmo_tda.store.record import LowRank

V, D, H, C, T = 7, 5, 6, 4, 3          # vocabulary, embedding width, hidden width, classes, tokens
EPS = 1e-8


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc = nn.Linear(D, H)
        self.head = nn.Linear(H, C, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(self.emb(x))))


def summed_loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, C), y.reshape(-1), reduction="sum")


@pytest.fixture(scope="module")
def trained():
    """``(model, optimizer, x [24, T], y [24, T])`` after 6 AdamW steps (real optimizer state)."""
    torch.manual_seed(0)
    model = Tiny()
    x, y = torch.randint(0, V, (24, T)), torch.randint(0, C, (24, T))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, eps=EPS)
    for step in range(6):
        idx = torch.arange(step * 4, step * 4 + 8) % 24
        (summed_loss(model, x[idx], y[idx]) / idx.numel()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, x, y


def exact_grads(model, x, y) -> dict[str, torch.Tensor]:
    """``{layer: [B, n_out, n_in(+1)]}`` float64 per-example gradients in the capture's layout: the
    token table transposed, the bias as the last input column."""
    m64 = copy.deepcopy(model).double()
    params = {k: v.detach() for k, v in m64.named_parameters()}
    g = vmap(grad(lambda p, xi, yi: summed_loss(lambda inp: functional_call(m64, p, (inp,)), xi[None], yi[None])),
             in_dims=(None, 0, 0))(params, x, y)
    return {"emb": g["emb.weight"].transpose(1, 2), "fc": torch.cat([g["fc.weight"], g["fc.bias"][..., None]], -1),
            "head": g["head.weight"]}


def exact_u(opt, model) -> dict[str, torch.Tensor]:
    """``{layer: u [n_out, n_in(+1)]}`` float64 from the optimizer, as AdamW divides:
    ``1/(√(v/(1−β₂ᵗ)) + ε)``."""
    def v(p):
        st = opt.state[p]
        return st["exp_avg_sq"].double() / (1 - 0.999 ** float(st["step"]))

    vs = {"emb": v(model.emb.weight).T, "fc": torch.cat([v(model.fc.weight), v(model.fc.bias)[:, None]], 1),
          "head": v(model.head.weight)}
    return {n: 1 / (x.sqrt() + EPS) for n, x in vs.items()}


def log_fit(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_u = u.log()
    return log_u.mean(1).exp(), (log_u.mean(0) - log_u.mean()).exp()


def cos_scores(queries: dict, train: dict, cosine: bool = True) -> torch.Tensor:
    q = torch.cat([queries[n].flatten(1) for n in sorted(queries)], 1)
    t = torch.cat([train[n].flatten(1) for n in sorted(train)], 1)
    if cosine:
        q, t = q / q.norm(dim=1, keepdim=True), t / t.norm(dim=1, keepdim=True)
    return q @ t.T


def store_and_queries(tmp_path, model, x, y, cfg: CaptureConfig):
    """A store of examples 0-15 and a recording of queries 16-23 through ``cfg``."""
    cap = GradientCapture(model, cfg)
    with GradientStore.create(tmp_path / "store", cap.store_metadata(), StoreConfig()) as writer:
        with cap.record(np.arange(16)) as rec:
            summed_loss(model, x[:16], y[:16]).backward()
        writer.append(rec.to_record(step=6, lr=0.05))
    with cap.record(np.arange(16, 24)) as queries:
        summed_loss(model, x[16:], y[16:]).backward()
    model.zero_grad()
    cap.remove()
    return cap, tmp_path / "store", queries


def all_scores(store, queries, **kw) -> torch.Tensor:
    res = attribute(store, queries, top_k=1, return_scores=True, **kw)
    assert np.array_equal(res.all_ids, np.arange(16))
    return res.all_scores


@pytest.mark.parametrize("method,sides", [("adam-gradcos", "both"), ("adam-graddot", "both"),
                                          ("adam-gradcos", "train")])
def test_projected_scores_equal_the_stated_approximation(tmp_path, trained, method, sides):
    """Random Gaussian projections (k < n on every side): scores equal the brute-force approximation
    ``P_out diag(r) Π_out G Π_in diag(c) P_inᵀ`` in float64, with r, c fitted independently here."""
    model, opt, x, y = trained
    cfg = CaptureConfig(proj_dim=3, proj_type="gaussian", embeddings=True, seed=3)
    cap, store, queries = store_and_queries(tmp_path, model, x, y, cfg)
    corr = AdamCorrection.from_optimizer(opt, model, cap)
    got = all_scores(store, queries, method=method, correction=corr, sides=sides)

    grads, u = exact_grads(model, x, y), exact_u(opt, model)
    approx, plain = {}, {}
    for name, g in grads.items():
        p_out, p_in = (m.double() for m in cap.projection(name))
        assert p_out.shape[0] < p_out.shape[1] and p_in.shape[0] < p_in.shape[1]
        r, c = log_fit(u[name])
        pi_out, pi_in = torch.linalg.pinv(p_out) @ p_out, torch.linalg.pinv(p_in) @ p_in
        approx[name] = p_out @ (r[:, None] * (pi_out @ g @ pi_in) * c[None, :]) @ p_in.T
        plain[name] = p_out @ g @ p_in.T
    query_side = approx if sides == "both" else plain
    want = cos_scores({n: a[16:] for n, a in query_side.items()}, {n: a[:16] for n, a in approx.items()},
                      cosine=method == "adam-gradcos")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    # the correction changes the scores: the test would not notice a no-op
    assert not torch.allclose(got, all_scores(store, queries, method=method.removeprefix("adam-")), rtol=1e-2)


def test_scaled_capture_applies_the_rank1_fit_exactly(trained):
    """``cap.scaled(corr.scales())`` captures ``P_out diag(r) G diag(c) P_inᵀ`` with no subspace assumption."""
    model, opt, x, y = trained
    cap = GradientCapture(model, CaptureConfig(proj_dim=3, proj_type="gaussian", embeddings=True, seed=3))
    corr = AdamCorrection.from_optimizer(opt, model, cap)
    with cap.scaled(corr.scales()), cap.record(np.arange(24)) as rec:
        summed_loss(model, x, y).backward()
    model.zero_grad()
    grads, u = exact_grads(model, x, y), exact_u(opt, model)
    for name, g in grads.items():
        p_out, p_in = (m.double() for m in cap.projection(name))
        r, c = log_fit(u[name])
        want = p_out @ (r[:, None] * g * c[None, :]) @ p_in.T
        torch.testing.assert_close(rec.dense()[name].double(), want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    cap.remove()


def test_unprojected_rank1_preconditioner_is_exact_trackstar(tmp_path, trained):
    """k = n (identity projectors) and a ``v`` whose ``1/(√v + ε)`` is exactly rank-1: adam-graddot and
    adam-gradcos equal TrackStar's ``⟨u⊙G_q, u⊙G_i⟩`` from exact per-example gradients."""
    model, opt, x, y = trained
    cap, store, queries = store_and_queries(tmp_path, model, x, y, CaptureConfig(proj_dim=0, embeddings=True))
    gen = torch.Generator().manual_seed(1)
    grads = exact_grads(model, x, y)
    u = {n: torch.exp(torch.randn(g.shape[1], 1, generator=gen, dtype=torch.float64))
         * torch.exp(torch.randn(1, g.shape[2], generator=gen, dtype=torch.float64)) for n, g in grads.items()}
    v = {n: (1 / x - EPS) ** 2 for n, x in u.items()}
    state = {"emb.weight": v["emb"].T, "fc.weight": v["fc"][:, :-1], "fc.bias": v["fc"][:, -1],
             "head.weight": v["head"]}
    corr = AdamCorrection.from_optimizer_state(state, cap, eps=EPS)
    assert max(layer.fit_error for layer in corr.layers.values()) < 1e-5
    exact = {n: g * u[n] for n, g in grads.items()}
    for method, cosine in (("adam-graddot", False), ("adam-gradcos", True)):
        want = cos_scores({n: e[16:] for n, e in exact.items()}, {n: e[:16] for n, e in exact.items()}, cosine)
        got = all_scores(store, queries, method=method, correction=corr)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_elementwise_mode_is_trackstar_with_the_real_optimizer_state(tmp_path, trained):
    """Unprojected rows, the full (not rank-1) ``u`` of the trained AdamW: exact TrackStar."""
    model, opt, x, y = trained
    cap, store, queries = store_and_queries(tmp_path, model, x, y, CaptureConfig(proj_dim=0, embeddings=True))
    corr = AdamCorrection.from_optimizer(opt, model, cap, mode="elementwise")
    grads, u = exact_grads(model, x, y), exact_u(opt, model)
    exact = {n: g * u[n] for n, g in grads.items()}
    want = cos_scores({n: e[16:] for n, e in exact.items()}, {n: e[:16] for n, e in exact.items()})
    torch.testing.assert_close(all_scores(store, queries, method="adam-gradcos", correction=corr), want,
                               rtol=1e-4, atol=1e-5)
    # the rank-1 fit of this real u is not exact: its residual is reported
    assert max(layer.fit_error for layer in AdamCorrection.from_optimizer(opt, model, cap).layers.values()) > 0.05


def test_sources_of_the_state_agree(tmp_path, trained):
    """A live optimizer, its state_dict mapped to names, and a safetensors file give one correction."""
    model, opt, _, _ = trained
    cap = GradientCapture(model, CaptureConfig(proj_dim=3, embeddings=True, seed=3))
    live = AdamCorrection.from_optimizer(opt, model, cap)
    bc = 1 - 0.999 ** 6
    by_name = exp_avg_sq_from_state_dict(opt.state_dict(), [n for n, _ in model.named_parameters()])
    save_file({k: v.contiguous() for k, v in by_name.items()}, tmp_path / "v.safetensors")
    from_file = AdamCorrection.from_checkpoint(tmp_path / "v.safetensors", cap, eps=EPS, bias_correction=bc)
    for name in live.layers:
        for a, b in zip(live.matrices(name), from_file.matrices(name)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    cap.remove()


@pytest.mark.parametrize("fit", ["log", "adafactor"])
def test_both_fits_recover_a_rank1_preconditioner(fit):
    """Unprojected sides keep ``r`` and ``c`` as vectors: ``r cᵀ = 1/√v`` when ``v = a bᵀ`` (ε = 0)."""
    gen = torch.Generator().manual_seed(2)
    a, b = torch.rand(6, generator=gen) + 0.1, torch.rand(5, generator=gen) + 0.1
    corr = AdamCorrection.from_optimizer_state({"fc.weight": torch.outer(a, b)}, {"fc": (torch.eye(6), torch.eye(5))},
                                               eps=0.0, fit=fit)
    r, c = corr.matrices("fc")
    torch.testing.assert_close(torch.outer(r, c), torch.outer(a, b).rsqrt(), rtol=1e-5, atol=0)
    assert corr.layers["fc"].fit_error < 1e-5


def test_factors_stay_factors_and_match_dense():
    gen = torch.Generator().manual_seed(0)
    rows = LowRank(torch.randn(5, 4, 2, generator=gen), torch.randn(5, 3, 2, generator=gen))
    for mode, out, in_ in (("kron", torch.randn(4, 4, generator=gen), torch.randn(3, 3, generator=gen)),
                           ("diag", torch.rand(4, generator=gen), torch.rand(3, generator=gen))):
        layer = LayerCorrection(mode, out, in_, 0.0, "")
        got = layer.apply(rows)
        assert isinstance(got, LowRank)
        torch.testing.assert_close(got.dense(), layer.apply(rows.dense()), rtol=1e-5, atol=1e-6)


def test_bad_optimizer_state_is_refused_with_the_layer_named(tmp_path, trained):
    model, opt, x, y = trained
    cap = GradientCapture(model, CaptureConfig(proj_dim=3, embeddings=True, seed=3))
    state = {n: opt.state[p]["exp_avg_sq"] for n, p in model.named_parameters()}

    def build(**changes):
        s = {k: v for k, v in {**state, **changes}.items() if v is not None}
        return AdamCorrection.from_optimizer_state(s, cap, eps=EPS)

    with pytest.raises(AdamCorrectionError, match="no exp_avg_sq for captured layer 'head'"):
        build(**{"head.weight": None})
    with pytest.raises(AdamCorrectionError, match=r"'fc' captures its bias .* 'fc.bias'"):
        build(**{"fc.bias": None})
    with pytest.raises(AdamCorrectionError, match=r"'head'.* shape \(6, 4\).* \(4, 6\)"):
        build(**{"head.weight": state["head.weight"].T})
    with pytest.raises(AdamCorrectionError, match=r"'fc'.*1 of 36 .*NaN"):
        bad = state["fc.weight"].clone()
        bad[0, 0] = float("nan")
        build(**{"fc.weight": bad})
    with pytest.raises(AdamCorrectionError, match="negative"):
        build(**{"head.weight": -state["head.weight"]})
    with pytest.raises(AdamCorrectionError, match="elementwise.* needs unprojected rows"):
        AdamCorrection.from_optimizer_state(state, cap, mode="elementwise")
    with pytest.raises(AdamCorrectionError, match="mode must be one of"):
        AdamCorrection.from_optimizer_state(state, cap, mode="full")
    cap.remove()

    # a correction built with other projectors than the store's is refused by attribute
    _, store, queries = store_and_queries(tmp_path, model, x, y, CaptureConfig(proj_dim=3, embeddings=True, seed=3))
    other = GradientCapture(model, CaptureConfig(proj_dim=3, embeddings=True, seed=4))
    with pytest.raises(AdamCorrectionError, match="store was projected with matrices"):
        attribute(store, queries, method="adam-gradcos",
                  correction=AdamCorrection.from_optimizer_state(state, other, eps=EPS))
    with pytest.raises(TypeError, match="correction must be an AdamCorrection"):
        attribute(store, queries, method="adam-gradcos", correction=state)
    narrow = AdamCorrection.from_optimizer_state(state, other, eps=EPS, layers=["fc"])
    with pytest.raises(AdamCorrectionError, match="no Adam correction for layer"):
        attribute(store, queries, method="adam-gradcos", correction=narrow)
    other.remove()
