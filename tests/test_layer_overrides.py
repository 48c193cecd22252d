"""capture.overrides: a per-layer proj_dim / rank, checked against exact per-example gradients."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from conftest import rel_err
from olmo_tda import CaptureConfig, ConfigError, GradientCapture, GradientStore, StoreConfig, TDAConfig
from olmo_tda.capture import estimate_eigenbasis
from olmo_tda.config import LayerOverride, ProjectionType
from olmo_tda.methods.base import attribute
from olmo_tda.store.record import LowRank


class TokenMLP(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.fc1, self.fc2, self.head = nn.Linear(12, 16), nn.Linear(16, 14), nn.Linear(14, 20, bias=False)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen) * 0.4

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def loss_of(out):
    return (out ** 2).sum()


def exact_grads(model, x):
    """Per-example weight (and bias) gradients by torch.func: {layer: [N, out, in(+1)]}."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p, xi):
        return loss_of(torch.func.functional_call(model, p, (xi.unsqueeze(0),)))

    g = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(params, x)
    out = {}
    for name in ("fc1", "fc2", "head"):
        w = g[f"{name}.weight"]
        out[name] = torch.cat([w, g[f"{name}.bias"].unsqueeze(-1)], -1) if f"{name}.bias" in g else w
    return out


CFG = CaptureConfig(proj_dim=8, seed=2, overrides=[
    LayerOverride(modules=["head"], proj_dim=[12, 14], rank=2),   # head: wider, rank-2 factors
    LayerOverride(modules=["fc*"], rank=0),                       # fc1/fc2: default k, dense
    LayerOverride(modules=["fc2"], proj_dim=4),                   # never reached: fc* matched first
])


def test_overrides_set_each_layers_budget_and_stay_exact():
    model, x = TokenMLP(), torch.randn(6, 5, 12, generator=torch.Generator().manual_seed(1))
    cap = GradientCapture(model, CFG)
    assert cap.layer_shapes == {"fc1": (8, 8), "fc2": (8, 8), "head": (12, 14)}
    assert cap.layer_ranks == {"fc1": 0, "fc2": 0, "head": 2}
    assert cap.floats_per_example == 64 + 64 + 2 * (12 + 14)
    with cap.record(range(6)) as rec:
        loss_of(model(x)).backward()
    exact = exact_grads(model, x)
    stored = rec.stored()
    for name, g in exact.items():
        p_out, p_in = cap.projection(name)
        want = p_out @ g @ p_in.T                       # the projection, applied independently
        assert rel_err(rec.dense()[name], want) < 1e-5, name
    assert isinstance(stored["head"], LowRank) and stored["head"].A.shape == (6, 12, 2)
    u, s, vh = torch.linalg.svd(rec.dense()["head"].double())
    best2 = ((u[:, :, :2] * s[:, None, :2]) @ vh[:, :2]).float()
    assert rel_err(stored["head"].dense(), best2) < 1e-5     # 5 tokens > c=2: the best rank-2
    cap.remove()


def test_store_round_trip_with_mixed_layers(tmp_path):
    model, x = TokenMLP(), torch.randn(10, 2, 12, generator=torch.Generator().manual_seed(3))
    cap = GradientCapture(model, CFG)
    store = GradientStore.create(tmp_path / "s", cap.store_metadata(), StoreConfig())
    with cap.record(range(10)) as rec:
        loss_of(model(x)).backward()
    store.append(rec.to_record(step=0, lr=0.1))
    store.close()
    opened = GradientStore.open(tmp_path / "s")
    assert opened.layer_ranks == {"fc1": 0, "fc2": 0, "head": 2}
    queries = {n: g[:3] for n, g in rec.dense().items()}
    got = attribute(opened, queries, method="graddot", top_k=10, return_scores=True).all_scores
    exact = exact_grads(model, x)                      # T=2 <= c: the head's factors are exact too
    want = sum(torch.einsum("qab,nab->qn", *(cap.projection(n)[0] @ exact[n][s] @ cap.projection(n)[1].T
                                             for s in (slice(0, 3), slice(None)))) for n in exact)
    assert rel_err(got.float(), want) < 1e-4


def test_overrides_parse_from_yaml_and_bad_ones_name_the_key():
    cfg = TDAConfig.from_dict({"enabled": True, "capture": {"proj_dim": 16, "overrides": [
        {"modules": ["*ff_out"], "proj_dim": [64, 32], "rank": 3}]}})
    o = cfg.capture.overrides[0]
    assert isinstance(o, LayerOverride) and cfg.capture.dims_for("blocks.0.ff_out") == (64, 32)
    assert cfg.capture.rank_for("blocks.0.ff_out") == 3 and cfg.capture.dims_for("blocks.0.att_proj") == (16, 16)
    assert cfg.capture.max_dims == (64, 32)
    bad = [({"modules": [], "rank": 1}, "overrides[0].modules"),
           ({"modules": ["x"]}, "sets neither"),
           ({"modules": ["x"], "rank": -1}, "overrides[0].rank"),
           ({"modules": ["x"], "proj_dim": [0, 4]}, "overrides[0].proj_dim"),
           ({"modules": ["x"], "projdim": 4}, "did you mean 'proj_dim'")]
    for override, needle in bad:
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            TDAConfig.from_dict({"enabled": True, "capture": {"overrides": [override]}})
    with pytest.raises(ConfigError, match="eigen capture cannot mix"):
        CaptureConfig(proj_dim=4, proj_type=ProjectionType.EIGEN, basis="b",
                      overrides=[LayerOverride(modules=["x"], proj_dim=0)]).validate()


def test_eigenbasis_keeps_the_widest_override_and_unused_ones_warn(tmp_path, caplog):
    model = TokenMLP()
    batches = [torch.randn(4, 5, 12, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    cfg = CaptureConfig(proj_dim=4, overrides=[LayerOverride(modules=["head"], proj_dim=10, rank=1)])
    basis = estimate_eigenbasis(model, batches, lambda m, b: loss_of(m(b)), cfg)
    assert basis.layer("head").proj_out.shape[0] == 10 and basis.layer("fc1").proj_out.shape[0] == 10
    basis.save(tmp_path / "b.safetensors")
    eig = CaptureConfig(proj_dim=4, proj_type=ProjectionType.EIGEN, basis=str(tmp_path / "b.safetensors"),
                        overrides=cfg.overrides)
    cap = GradientCapture(model, eig)
    assert cap.layer_shapes["head"] == (10, 10) and cap.layer_shapes["fc1"] == (4, 4)
    cap.remove()
    with caplog.at_level(logging.WARNING, logger="olmo_tda.capture.hooks"):
        GradientCapture(model, CaptureConfig(overrides=[LayerOverride(modules=["nope*"], rank=1)])).remove()
    assert "match no captured layer" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="olmo_tda.capture.hooks"):    # first match wins: 'head' is taken
        GradientCapture(model, CaptureConfig(overrides=[LayerOverride(modules=["*"], rank=1),
                                                        LayerOverride(modules=["head"], rank=3)])).remove()
    assert "[['head']] match only layers an earlier override already sets" in caplog.text
    assert "match no captured layer" not in caplog.text
