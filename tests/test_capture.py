"""Capture equals exact per-example gradients (torch.func) on plain and OLMo models, in every mode
the issue names: GAS, activation checkpointing, clip_qkv, biases, masked labels, reuse, bf16."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from olmo_tda import CaptureConfig, CaptureError, GradientCapture
from conftest import exact_per_example_grads, linear_grad, rel_err, tiny_olmo, token_losses

TOL = 1e-5


def _olmo_capture_vs_exact(model, input_ids, label_mask=None, micro_batches=1, config=None, oracle_model=None):
    cap = GradientCapture(model, config or CaptureConfig(proj_dim=0))
    loss_scale = input_ids.numel()            # OLMo: CE sum / tokens in the device batch
    ids = torch.arange(100, 100 + input_ids.shape[0])
    with cap.record(ids, loss_scale=loss_scale) as rec:
        for chunk, mask in zip(input_ids.chunk(micro_batches),
                               (label_mask.chunk(micro_batches) if label_mask is not None else [None] * micro_batches)):
            logits = model(chunk).logits
            loss = token_losses(logits, chunk, mask).sum() / loss_scale
            loss.backward()
    got = rec.dense()
    exact = exact_per_example_grads(oracle_model or model, input_ids, label_mask)
    assert set(got) == {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    errs = {name: rel_err(g, linear_grad(exact, name, cap._with_bias[name])) for name, g in got.items()}
    cap.remove()
    return errs


def _ids(b=3, t=12, vocab=96, seed=1):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_plain_mlp_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5))
    x, y = torch.randn(6, 7), torch.randn(6, 5)
    cap = GradientCapture(model, CaptureConfig(proj_dim=0))
    with cap.record(range(6), loss_scale=6) as rec:
        ((model(x) - y) ** 2).sum(1).mean().backward()

    from torch.func import functional_call, grad, vmap
    params = {k: v.detach() for k, v in model.named_parameters()}
    exact = vmap(grad(lambda p, xi, yi: ((functional_call(model, p, (xi[None],)) - yi) ** 2).sum()),
                 in_dims=(None, 0, 0))(params, x, y)
    for name in ("0", "2"):
        assert rel_err(rec.dense()[name], linear_grad(exact, name, True)) < TOL
    # the capture must not change the training gradient
    assert rel_err(model[0].weight.grad * 6, exact["0.weight"].sum(0)) < TOL


def test_olmo_exact():
    errs = _olmo_capture_vs_exact(tiny_olmo(), _ids())
    assert max(errs.values()) < TOL, errs


def test_olmo_gradient_accumulation():
    errs = _olmo_capture_vs_exact(tiny_olmo(), _ids(b=4), micro_batches=2)
    assert max(errs.values()) < TOL, errs


def test_olmo_activation_checkpointing():
    """OLMo's own (non-reentrant) checkpointing: forward hooks fire twice, gradients are exact once."""
    from olmo.config import ActivationCheckpointingStrategy

    model = tiny_olmo()
    model.train()
    model.set_activation_checkpointing(ActivationCheckpointingStrategy.whole_layer)
    calls = []
    model.transformer.blocks[0].att_proj.register_forward_hook(lambda *a: calls.append(1))
    # torch.func cannot run through checkpointing: the oracle is the same weights without it
    errs = _olmo_capture_vs_exact(model, _ids(), oracle_model=tiny_olmo())
    assert len(calls) == 2, "checkpointing did not recompute: the test would prove nothing"
    assert max(errs.values()) < TOL, errs


class _CheckpointedMLP(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.inner = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return self.head(checkpoint(self.inner, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_with_gradient_accumulation_plain_model(reentrant):
    torch.manual_seed(0)
    model = _CheckpointedMLP(reentrant)
    x = torch.randn(6, 4, 5, requires_grad=reentrant)   # re-entrant needs an input that requires grad
    cap = GradientCapture(model, CaptureConfig(proj_dim=0))
    with cap.record(range(6)) as rec:
        for chunk in x.split(3):                          # forward, backward, forward, backward
            model(chunk).pow(2).sum().backward()
    from torch.func import functional_call, grad, vmap
    plain = _CheckpointedMLP(reentrant)
    plain.load_state_dict(model.state_dict())
    plain.forward = lambda t: plain.head(plain.inner(t))
    params = {k: v.detach() for k, v in plain.named_parameters()}
    exact = vmap(grad(lambda p, xi: functional_call(plain, p, (xi[None],)).pow(2).sum()),
                 in_dims=(None, 0))(params, x.detach())
    for name in ("inner.0", "inner.2", "head"):
        assert rel_err(rec.dense()[name], linear_grad(exact, name, True)) < TOL, name


def test_reentrant_checkpointing_over_two_forwards_is_refused():
    """Two forwards then one backward: a re-entrant recompute cannot tell whose examples it holds."""
    model = _CheckpointedMLP(reentrant=True)
    x = torch.randn(6, 5, requires_grad=True)
    cap = GradientCapture(model, CaptureConfig(proj_dim=0))
    with pytest.raises(CaptureError, match="use_reentrant=False"):
        with cap.record(range(6)):
            (model(x[:3]).sum() + model(x[3:]).sum()).backward()
    # the non-reentrant form of the same loop is fine
    model.reentrant = False
    with cap.record(range(6)) as rec:
        (model(x[:3]).sum() + model(x[3:]).sum()).backward()
    assert rec.dense()["head"].shape[0] == 6


def test_olmo_clip_qkv_inplace_clamp():
    model = tiny_olmo(clip_qkv=0.05)
    # the clamp must actually bite, or the test proves nothing
    qkv = model.transformer.blocks[0].att_proj(torch.randn(2, 5, 64))
    assert (qkv.abs() > 0.05).float().mean() > 0.2
    errs = _olmo_capture_vs_exact(model, _ids())
    assert max(errs.values()) < TOL, errs


def test_olmo_include_bias():
    model = tiny_olmo(include_bias=True)
    for p in model.parameters():   # OLMo inits biases to zero: make them matter
        if p.ndim == 1:
            nn.init.normal_(p, std=0.1)
    errs = _olmo_capture_vs_exact(model, _ids())
    assert max(errs.values()) < TOL, errs


def test_olmo_label_masked_tokens():
    ids = _ids(b=3, t=12)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    mask[2, 8:] = 0
    errs = _olmo_capture_vs_exact(tiny_olmo(), ids, label_mask=mask)
    assert max(errs.values()) < TOL, errs


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


def test_linear_used_twice_in_one_forward():
    torch.manual_seed(0)
    model = _Twice()
    x = torch.randn(4, 3, 6)
    cap = GradientCapture(model, CaptureConfig(proj_dim=0))
    with cap.record(range(4)) as rec:
        model(x).pow(2).sum().backward()
    from torch.func import functional_call, grad, vmap
    params = {k: v.detach() for k, v in model.named_parameters()}
    exact = vmap(grad(lambda p, xi: functional_call(model, p, (xi[None],)).pow(2).sum()),
                 in_dims=(None, 0))(params, x)
    assert rel_err(rec.dense()["shared"], linear_grad(exact, "shared", True)) < TOL


def test_bf16_autocast_within_tolerance():
    """Factors are computed in fp32 from the bf16 activations/gradients the model produced; the
    oracle runs the same bf16-autocast forward per example. bf16 has 8 mantissa bits (ε≈3.9e-3)
    and the batched vs per-example kernels round differently, so agreement is to a few ε: 3e-2."""
    model = tiny_olmo()
    ids = _ids()
    cap = GradientCapture(model, CaptureConfig(proj_dim=0))
    with cap.record(range(3), loss_scale=ids.numel()) as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids).logits
        (token_losses(logits, ids).sum() / ids.numel()).backward()
    exact = exact_per_example_grads(model, ids, autocast_dtype=torch.bfloat16)
    exact_fp32 = exact_per_example_grads(model, ids)
    for name, g in rec.dense().items():
        assert g.dtype == torch.float32
        assert rel_err(g, exact[name + ".weight"]) < 3e-2, name
        # sanity: the bf16 run is genuinely not the fp32 one, and both are close
        assert rel_err(g, exact_fp32[name + ".weight"]) < 6e-2


def test_no_grad_forward_is_ignored_and_eval_forward_doesnt_leak():
    model = tiny_olmo()
    ids = _ids()
    cap = GradientCapture(model, CaptureConfig(proj_dim=0))
    with torch.no_grad():
        model(ids)            # e.g. an eval step between training steps
    with cap.record(range(3), loss_scale=1.0) as rec:
        token_losses(model(ids).logits, ids).sum().backward()
    exact = exact_per_example_grads(model, ids)
    assert all(rel_err(g, exact[n + ".weight"]) < TOL for n, g in rec.dense().items())


def _olmo_with_biases():
    """A tiny OLMo with biases, drawn nonzero (OLMo inits them to zero) so they matter."""
    model = tiny_olmo(include_bias=True)
    for p in model.parameters():
        if p.ndim == 1:
            nn.init.normal_(p, std=0.1)
    return model


def test_projected_equals_projection_of_exact():
    model = _olmo_with_biases()
    ids = _ids()
    cap = GradientCapture(model, CaptureConfig(proj_dim=(16, 8), seed=3))
    with cap.record(range(3)) as rec:
        token_losses(model(ids).logits, ids).sum().backward()
    exact = exact_per_example_grads(model, ids)
    for name, g in rec.dense().items():
        p_out, p_in = cap.projection(name)
        assert g.shape == (3, 16, 8)
        want = p_out @ linear_grad(exact, name, True) @ p_in.T
        assert rel_err(g, want) < TOL, name


def test_scaled_capture_is_the_projection_of_the_scaled_exact_gradient():
    """``cap.scaled`` captures ``diag(s_out) g diag(s_in)`` (bias column included), projected; the
    moments gathered in the same pass are the plain per-feature sums of squares of the inputs and of
    the de-scaled output gradients."""
    model = _olmo_with_biases()
    ids = _ids()
    cap = GradientCapture(model, CaptureConfig(proj_dim=(16, 8), seed=3))
    gen = torch.Generator().manual_seed(0)
    scales = {}
    for name, m in cap.modules.items():
        scales[name] = (torch.rand(m.out_features, generator=gen) + 0.5,
                        torch.rand(m.in_features + 1, generator=gen) + 0.5)
    seen, grads = {}, {}

    def keep(name, module, args, output):
        seen[name] = args[0].detach()
        output.register_hook(lambda g: grads.__setitem__(name, g.detach()))
    hooks = [m.register_forward_hook(functools.partial(keep, n)) for n, m in cap.modules.items()]
    loss_scale = 7.0
    with cap.moments() as moments, cap.scaled(scales), cap.record(range(3), loss_scale=loss_scale) as rec:
        (token_losses(model(ids).logits, ids).sum() / loss_scale).backward()
    for h in hooks:
        h.remove()
    deltas = [grads[n] for n in cap.modules]
    exact = exact_per_example_grads(model, ids)
    for name, g in rec.dense().items():
        p_out, p_in = cap.projection(name)
        s_out, s_in = scales[name]
        want = p_out @ (s_out[:, None] * linear_grad(exact, name, True) * s_in[None, :]) @ p_in.T
        assert rel_err(g, want) < TOL, name
    for (name, m), d in zip(cap.modules.items(), deltas):
        a = seen[name].reshape(-1, m.in_features).double()
        want_in = torch.cat([a.square().sum(0), torch.tensor([float(len(a))], dtype=torch.float64)])
        want_out = (d.reshape(-1, m.out_features).double() * loss_scale).square().sum(0)
        assert moments[name].tokens == len(a)
        assert rel_err(moments[name].in_sq, want_in) < TOL and rel_err(moments[name].out_sq, want_out) < TOL, name
    # outside the blocks: plain capture again
    with cap.record(range(3)) as rec:
        token_losses(model(ids).logits, ids).sum().backward()
    name = next(iter(cap.modules))
    p_out, p_in = cap.projection(name)
    assert rel_err(rec.dense()[name], p_out @ linear_grad(exact, name, True) @ p_in.T) < TOL
    cap.remove()


def test_moment_rows_count_only_the_real_rows():
    """``cap.moment_rows(n)``: padding rows after the first ``n`` of a batch (a rank's repeats under an
    uneven split) leave the moments exactly as a pass over the real rows alone — every layer kind:
    Linears, the token table's lookup and its tied head — while their gradients are still captured."""
    model = tiny_olmo(weight_tying=True)
    ids = _ids(b=2)
    padded = torch.cat([ids, ids[:1]])
    cfg = CaptureConfig(proj_dim=8, seed=2, embeddings=True, exclude=["*wpe"])
    cap = GradientCapture(model, cfg)
    with cap.moments() as alone, cap.record(range(2)):
        token_losses(model(ids).logits, ids).sum().backward()
    with cap.moments() as masked, cap.moment_rows(2), cap.record(range(3)) as rec:
        token_losses(model(padded).logits, padded).sum().backward()
    with cap.moments() as unmasked, cap.record(range(3)):
        token_losses(model(padded).logits, padded).sum().backward()
    assert all(g.shape[0] == 3 for g in rec.dense().values())
    assert any(n.endswith("wte") for n in alone)
    for name in alone:
        assert masked[name].tokens == alone[name].tokens
        assert rel_err(masked[name].in_sq, alone[name].in_sq) < TOL, name
        assert rel_err(masked[name].out_sq, alone[name].out_sq) < TOL, name
        assert unmasked[name].tokens > alone[name].tokens          # without it the repeat would count
    with pytest.raises(CaptureError, match="moment_rows"):
        with cap.moment_rows(-1):
            pass
    cap.remove()


def test_pause_remove_and_disabled():
    model = tiny_olmo()
    ids = _ids()
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    cap = GradientCapture(model, CaptureConfig(proj_dim=4))
    assert cap.num_hooks == n_linear + 1
    with cap.pause():
        out = model(ids)
    with cap.record(range(3)) as rec:
        out.logits.sum().backward()
    with pytest.raises(CaptureError, match="ids"):
        rec.dense()                      # nothing was captured while paused
    cap.remove()
    assert cap.num_hooks == 0
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    off = GradientCapture(model, CaptureConfig(proj_dim=4), enabled=False)
    assert off.num_hooks == 0 and not any(m._forward_hooks for m in model.modules())


def test_ids_mismatch_and_bad_loss_scale_are_clear_errors():
    model = nn.Linear(3, 2)
    cap = GradientCapture(model, CaptureConfig(proj_dim=0))
    with cap.record([1, 2]) as rec:
        model(torch.randn(3, 3)).sum().backward()
    with pytest.raises(CaptureError, match="2 ids but .* 3 examples"):
        rec.dense()
    with pytest.raises(CaptureError, match="loss_scale"):
        with cap.record([1], loss_scale=0.0):
            pass


def test_module_selection_and_canonical_names():
    model = tiny_olmo()
    cap = GradientCapture(model, CaptureConfig(proj_dim=4, modules=["*blocks.*"], exclude=["*ff_out"]))
    assert sorted(cap.modules) == sorted(f"transformer.blocks.{i}.{n}" for i in range(2)
                                         for n in ("att_proj", "attn_out", "ff_proj"))
    with pytest.raises(CaptureError, match="selects no nn.Linear"):
        GradientCapture(model, CaptureConfig(modules=["nothing*"]))
    cap.remove()
    # a DDP-style wrapper must not change names (projector seeds derive from them)
    wrapped = nn.Module()
    wrapped.module = model
    cap2 = GradientCapture(wrapped, CaptureConfig(proj_dim=4))
    assert "transformer.blocks.0.att_proj" in cap2.modules
    cap2.remove()


def test_misuse_gets_clear_errors(caplog):
    lin = nn.Linear(3, 2)
    cap = GradientCapture(lin, CaptureConfig(proj_dim=0))
    with cap.record([0, 1]) as rec:
        lin(input=torch.randn(2, 3)).sum().backward()           # keyword input works
        with pytest.raises(CaptureError, match="inside its"):
            rec.dense()
    assert rec.dense()[""].shape == (2, 2, 4)
    with pytest.raises(CaptureError, match="unbatched input"):
        lin(torch.randn(3))
    with pytest.raises(CaptureError, match="integers"):
        with cap.record(torch.tensor([0.5, 1.5])):
            pass
    cap.remove()
    with pytest.raises(CaptureError, match="removed"):
        with cap.record([0]):
            pass

    class Flattens(nn.Module):                                   # an MoE-style layer sees B*T rows
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x).sum() + self.b(x.flatten(0, 1)).sum()

    m = Flattens()
    cap = GradientCapture(m, CaptureConfig(proj_dim=0))
    with pytest.raises(CaptureError, match="batch-first"):
        with cap.record([0, 1]):
            m(torch.randn(2, 4, 3)).backward()
    cap.remove()

    twin = nn.Module()
    twin.add_module("0", nn.Linear(2, 2))
    twin.module = nn.Sequential(nn.Linear(2, 2))               # "module.0" canonicalizes to "0" too
    with pytest.raises(CaptureError, match="same canonical name"):
        GradientCapture(twin)

    class WithMHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(4, 1, batch_first=True)   # out_proj runs through F.linear
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            return self.head(self.mha(x, x, x)[0])

    m = WithMHA()
    cap = GradientCapture(m, CaptureConfig(proj_dim=0))
    x = torch.randn(2, 3, 4)
    with cap.record([0, 1]) as rec:
        m(x).sum().backward()
    with caplog.at_level("WARNING"):
        rec.dense()
    assert "out_proj" in caplog.text and "capture.exclude" in caplog.text


# -- embeddings (capture.embeddings) ------------------------------------------------------------

def test_olmo_embedding_exact_and_projected():
    """The token table's per-example gradient, transposed (a Linear on one-hot inputs), equals
    torch.func's; projected, it equals P_out Gᵀ P_inᵀ of the exact one. Linears are unchanged."""
    model = tiny_olmo()
    ids = _ids()
    ids[0, :3] = ids[0, 5]                      # a token repeated in one example: its rows add up
    exact = exact_per_example_grads(model, ids)
    for cfg in (CaptureConfig(proj_dim=0, embeddings=True, exclude=["*wpe"]),
                CaptureConfig(proj_dim=(16, 8), seed=5, embeddings=True, exclude=["*wpe"])):
        cap = GradientCapture(model, cfg)
        assert "transformer.wte" in cap.modules and cap.layer_shapes["transformer.wte"] == (
            (64, 96) if cfg.exact else (16, 8))
        with cap.record(range(3)) as rec:
            token_losses(model(ids).logits, ids).sum().backward()
        model.zero_grad()
        p_out, p_in = cap.projection("transformer.wte")
        want = p_out @ exact["transformer.wte.weight"].transpose(1, 2) @ p_in.T
        assert rel_err(rec.dense()["transformer.wte"], want) < TOL
        name = "transformer.blocks.0.att_proj"
        p_out, p_in = cap.projection(name)
        assert rel_err(rec.dense()[name], p_out @ exact[name + ".weight"] @ p_in.T) < TOL
        cap.remove()
    # the learned position table is looked up once ([1, T]) and broadcast: no per-example gradient
    cap = GradientCapture(model, CaptureConfig(proj_dim=4, embeddings=True))
    with pytest.raises(CaptureError, match="wpe is an embedding.*capture.exclude"):
        with cap.record(range(3)):
            token_losses(model(ids).logits, ids).sum().backward()
    cap.remove()


def test_embedding_padding_idx_and_factored_route():
    """padding_idx rows get no gradient (as in torch); LoRIF factors (T <= c: exact) agree."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 6, padding_idx=0), nn.Tanh(), nn.Linear(6, 3))
    x = torch.randint(1, 20, (4, 4), generator=torch.Generator().manual_seed(2))
    x[:, -2:] = 0                               # padded tails
    y = torch.randn(4, 4, 3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    exact = vmap(grad(lambda p, xi, yi: ((functional_call(model, p, (xi[None],)) - yi) ** 2).sum()),
                 in_dims=(None, 0, 0))(params, x, y)["0.weight"].transpose(1, 2)
    assert exact[:, :, 0].abs().max() == 0 and exact.abs().max() > 0      # torch's own rule
    for cfg in (CaptureConfig(proj_dim=0, embeddings=True), CaptureConfig(proj_dim=(4, 8), seed=1, embeddings=True),
                CaptureConfig(proj_dim=0, embeddings=True, rank=4)):
        cap = GradientCapture(model, cfg)
        with cap.record(range(4)) as rec:
            ((model(x) - y) ** 2).sum().backward()
        p_out, p_in = cap.projection("0")
        want = p_out @ exact @ p_in.T
        assert rel_err(rec.dense()["0"], want) < TOL
        if cfg.rank:                            # 4 * (6 + 20) < 6 * 20: stored as factors, exact for T = 4
            stored = rec.stored()["0"]
            assert stored.A.shape == (4, 6, 4)
            assert rel_err(stored.A @ stored.B.transpose(1, 2), want) < TOL
        cap.remove()
        model.zero_grad()


def test_embedding_selection_rules_and_errors():
    model = tiny_olmo()
    cap = GradientCapture(model, CaptureConfig(proj_dim=4))
    assert "transformer.wte" not in cap.modules         # off by default: stores keep their layout
    cap.remove()
    cap = GradientCapture(model, CaptureConfig(proj_dim=4, embeddings=True, modules=["*wte"]))
    assert list(cap.modules) == ["transformer.wte"]
    cap.remove()
    with pytest.raises(CaptureError, match="selects no nn.Linear or nn.Embedding"):
        GradientCapture(model, CaptureConfig(embeddings=True, modules=["nothing*"]))
    freq = nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Linear(4, 2))
    with pytest.raises(CaptureError, match="scale_grad_by_freq"):
        GradientCapture(freq, CaptureConfig(embeddings=True))
    from olmo_tda.config import ConfigError
    with pytest.raises(ConfigError, match="embeddings"):
        CaptureConfig(embeddings=True, proj_type="eigen", basis="x.safetensors").validate()


@pytest.mark.parametrize("scale_logits", [False, True])
def test_tied_head_share_is_added_to_the_table(scale_logits, caplog):
    """OLMo with weight_tying: logits = F.linear(x, wte.weight). With capture.embeddings the table's
    rows hold its whole gradient (lookup + head), exactly as torch.func gives it; without, capture
    warns that the head is not seen."""
    model = tiny_olmo(weight_tying=True, scale_logits=scale_logits)
    ids = _ids()
    exact = exact_per_example_grads(model, ids)["transformer.wte.weight"].transpose(1, 2)
    for cfg in (CaptureConfig(proj_dim=0, embeddings=True, exclude=["*wpe"]),
                CaptureConfig(proj_dim=(16, 8), seed=2, embeddings=True, exclude=["*wpe"]),
                CaptureConfig(proj_dim=(16, 8), seed=2, embeddings=True, exclude=["*wpe"], rank=4, factor_route="qr")):
        cap = GradientCapture(model, cfg)
        with cap.record(range(3)) as rec:
            token_losses(model(ids).logits, ids).sum().backward()
        model.zero_grad()
        p_out, p_in = cap.projection("transformer.wte")
        want = p_out @ exact @ p_in.T
        assert rel_err(rec.dense()["transformer.wte"], want) < TOL
        if cfg.rank:        # 12 lookup + 12 head tokens > c: the best rank-c approximation of the sum
            lr = rec.stored()["transformer.wte"]
            u, s, vh = torch.linalg.svd(want)
            assert rel_err(lr.A @ lr.B.transpose(1, 2), (u[:, :, :4] * s[:, None, :4]) @ vh[:, :4]) < 1e-4
        cap.remove()
    with caplog.at_level("WARNING"):
        GradientCapture(model, CaptureConfig(proj_dim=4, modules=["*blocks.*"])).remove()
        assert "tied" not in caplog.text            # the table was left out on purpose: no warning
        GradientCapture(model, CaptureConfig(proj_dim=4)).remove()
    assert "tied to its token table" in caplog.text


class _Parallel(nn.Module):
    """Two captured Linears whose outputs are summed: autograd hands both hooks the same tensor."""

    def __init__(self, n_in=16, n_out=8):
        super().__init__()
        self.a, self.b = nn.Linear(n_in, n_out, bias=False), nn.Linear(n_in, n_out, bias=False)

    def forward(self, x):
        return self.a(x) + self.b(x)


@pytest.mark.parametrize("loss_kind", ["mean", "squared"])
def test_lorif_tokens_with_an_identity_output_side_are_scaled_once(loss_kind):
    """``capture.rank`` keeps token factors; with an identity output side (k_out = the layer's width)
    the factor is autograd's gradient tensor itself. De-scaling by ``loss_scale`` must neither write
    into an expanded gradient (``sum()/B``) nor scale twice a gradient shared by two layers."""
    from torch.func import functional_call, grad, vmap
    torch.manual_seed(0)
    B, T = 3, 2
    model, x, target = _Parallel(), torch.randn(B, T, 16), torch.randn(B, T, 8)
    loss_of = (lambda out, t: out.sum()) if loss_kind == "mean" else (lambda out, t: ((out - t) ** 2).sum())
    cap = GradientCapture(model, CaptureConfig(proj_dim=(8, 4), seed=1, rank=2))
    assert cap.layer_ranks == {"a": 2, "b": 2}
    with cap.record(range(B), loss_scale=B) as rec:
        (loss_of(model(x), target) / B).backward()
    got = rec.dense()
    params = {k: v.detach() for k, v in model.named_parameters()}
    exact = vmap(grad(lambda p, xi, ti: loss_of(functional_call(model, p, (xi[None],)), ti[None])),
                 in_dims=(None, 0, 0))(params, x, target)
    for name in ("a", "b"):
        p_out, p_in = cap.projectors[name].matrices()
        assert rel_err(got[name], p_out @ exact[f"{name}.weight"] @ p_in.T) < TOL, name
    cap.remove()


@pytest.mark.parametrize("route", ["auto", "qr", "dense"])
def test_a_nonfinite_example_under_lorif_is_skipped_not_fatal(tmp_path, route):
    """One example's activations hold an inf: with ``capture.rank`` its factors are NaN (the
    decompositions would raise), the other examples are exact, and the store skips and counts it."""
    from olmo_tda.capture.factors import truncate_dense
    from olmo_tda.config import StoreConfig
    from olmo_tda.store import GradientStore

    torch.manual_seed(0)
    B, T = 3, 2 if route == "dense" else 12
    lin = nn.Linear(32, 32, bias=False)
    x, w = torch.randn(B, T, 32), torch.randn(B, T, 32)
    x[1, 0, 0] = float("inf")
    cfg = CaptureConfig(proj_dim=16, seed=0, rank=2, factor_route="qr" if route == "qr" else "auto")
    cap = GradientCapture(lin, cfg)
    cap._keep_tokens = (lambda *a: False) if route == "dense" else cap._keep_tokens
    with cap.record([10, 11, 12]) as rec:
        (lin(x) * w).sum().backward()
    stored = rec.stored()[""]
    assert torch.isnan(stored.A[1]).all() and torch.isfinite(stored.A[[0, 2]]).all()
    p_out, p_in = cap.projectors[""].matrices()
    exact = p_out @ torch.einsum("bto,bti->boi", w, x)[[0, 2]] @ p_in.T
    A, B_ = truncate_dense(exact, 2)
    assert rel_err(stored.A[[0, 2]] @ stored.B[[0, 2]].transpose(1, 2), A @ B_.transpose(1, 2)) < 1e-4
    store = GradientStore.create(tmp_path / "s", cap.store_metadata(), StoreConfig())
    with pytest.warns(RuntimeWarning, match="skipped 1 rows"):
        store.append(rec.to_record(step=1, lr=0.1))
        store.close()
    back = GradientStore.open(tmp_path / "s")
    assert sorted(back.read_all().ids.tolist()) == [10, 12] and back.stats["rows_skipped_nonfinite"] == 1
    cap.remove()


def test_moments_count_a_checkpointed_forward_once():
    """Non-reentrant checkpointing re-runs the forward hooks during backward; the inputs' moments must
    still count each forward once, as the output gradients' do (R and C of the same tokens)."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 5)
    counts, first = {}, None
    for reentrant in (None, False, True):
        model = _CheckpointedMLP(bool(reentrant))
        model.load_state_dict(_CheckpointedMLP(False).state_dict() if first is None else first)
        first = model.state_dict()
        if reentrant is None:
            model.forward = lambda t, m=model: m.head(m.inner(t))
        cap = GradientCapture(model, CaptureConfig(proj_dim=4, seed=0))
        with cap.moments() as moments, cap.record(range(3)):
            model(x.clone().requires_grad_(bool(reentrant))).pow(2).sum().backward()
        counts[reentrant] = {n: (m.tokens, m.in_sq.clone(), m.out_sq.clone()) for n, m in moments.items()}
        cap.remove()
    for reentrant in (False, True):
        for name, (tokens, in_sq, out_sq) in counts[None].items():
            got = counts[reentrant][name]
            assert got[0] == tokens == 15, (reentrant, name, got[0])
            assert rel_err(got[1], in_sq) < TOL and rel_err(got[2], out_sq) < TOL, (reentrant, name)


def test_reentrant_checkpointing_survives_a_paused_step_and_a_failed_backward():
    """Forwards run while paused, and a backward that raised mid-way, leave nothing behind that would
    make a later single-forward step look like a backward over several forwards."""
    torch.manual_seed(0)
    model = _CheckpointedMLP(reentrant=True)
    x = torch.randn(6, 5, requires_grad=True)
    cap = GradientCapture(model, CaptureConfig(proj_dim=0))
    with cap.pause():
        model(x[:3]).sum().backward()                       # e.g. a selector's own pass
    with cap.record(range(3)) as rec:
        model(x[:3]).sum().backward()
    assert rec.dense()["head"].shape[0] == 3

    def fail(grad):
        raise ValueError("a user hook failed")

    with pytest.raises(ValueError, match="user hook"):
        with cap.record(range(3)):
            out = model(x[:3])
            out.register_hook(fail)
            out.sum().backward()
    for _ in range(2):
        with cap.record(range(3)) as rec:
            model(x[3:]).sum().backward()
        assert rec.dense()["head"].shape[0] == 3
    cap.remove()


def test_an_identity_input_side_refuses_an_input_changed_in_place():
    """With an identity input side the capture reads the layer's input at backward time; autograd lets
    it change in place when the weight needs no gradient, so the capture must refuse, not mis-read."""
    lin = nn.Linear(4, 3, bias=False).requires_grad_(False)     # the post-hoc path's frozen weights
    x = torch.randn(2, 4, requires_grad=True)
    for proj_dim, ok in ((0, False), (2, True)):
        cap = GradientCapture(lin, CaptureConfig(proj_dim=proj_dim))
        with cap.record(range(2)) as rec:
            h = x * 1.0
            out = lin(h)
            h.mul_(100.0)
            if ok:
                out.sum().backward()
            else:
                with pytest.raises(CaptureError, match="modified in place"):
                    out.sum().backward()
        if ok:
            assert rec.dense()[""].shape == (2, 2, 2)
        cap.remove()


def test_token_factors_of_an_identity_input_side_survive_a_reused_input_buffer():
    """With a LoRIF rank, short examples keep their token factors until the record ends; with an
    identity input side the input factor is the layer's input. A gradient-accumulation loop that
    copies each micro-batch into one input buffer must not overwrite the earlier ones' rows: they
    equal exact per-example gradients from torch.func."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32, bias=False), nn.Tanh(), nn.Linear(32, 4, bias=False))
    batches = [torch.randn(2, 3, 8) for _ in range(2)]
    params = {k: v.detach() for k, v in model.named_parameters()}
    exact = torch.cat([vmap(grad(lambda p, xi: functional_call(model, p, (xi[None],)).pow(2).sum()),
                            in_dims=(None, 0))(params, b)["0.weight"] for b in batches])
    cap = GradientCapture(model, CaptureConfig(proj_dim=0, rank=4, modules=["0"]))
    buffer = torch.empty(2, 3, 8)
    with cap.record(range(4)) as rec:
        for b in batches:
            buffer.copy_(b)
            model(buffer).pow(2).sum().backward()
    cap.remove()
    assert cap.layer_ranks == {"0": 4}
    assert rel_err(rec.dense()["0"], exact) < 1e-5


def test_an_empty_record_has_zero_rows():
    cap = GradientCapture(nn.Linear(5, 3), CaptureConfig(proj_dim=0, rank=1))
    with cap.record([]) as rec:
        pass
    assert rec.dense()[""].shape == (0, 3, 6)
    assert len(rec.to_record(step=1, lr=0.1).ids) == 0
    cap.remove()


class _EmbedInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.out = nn.Embedding(20, 6), nn.Linear(6, 8), nn.Linear(8, 20)

    def forward(self, ids):
        x = self.emb(ids)
        x.mul_(2.0)                                  # in place on the lookup's output
        return self.out(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("embedding_grads", [True, False])
def test_activation_grads_only_reaches_every_layer_with_no_weight_gradient(embedding_grads):
    """activation_grads_only: the backward reaches every captured layer (per-example gradients equal
    torch.func's) while only the embeddings' weights get a gradient, or with
    ``embedding_grads=False`` none at all (the lookups' outputs carry it, and an in-place op on them
    stays legal); requires_grad is restored after. Without an nn.Embedding that mode is refused."""
    from torch.func import functional_call, grad, vmap

    from olmo_tda.capture import activation_grads_only

    torch.manual_seed(0)
    model = _EmbedInPlace()
    ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(1))

    def loss(p, x):
        logits = functional_call(model, p, (x,))
        return nn.functional.cross_entropy(logits.flatten(0, -2), x.flatten(), reduction="sum")

    exact = vmap(grad(lambda p, x: loss(p, x[None])), in_dims=(None, 0))(
        {k: v.detach() for k, v in model.named_parameters()}, ids)
    cap = GradientCapture(model, CaptureConfig(proj_dim=0))
    with activation_grads_only(model, embedding_grads=embedding_grads):
        with cap.record(range(4)) as rec:
            loss(dict(model.named_parameters()), ids).backward()
    for name in ("fc", "out"):
        assert rel_err(rec.dense()[name], linear_grad(exact, name, True)) < TOL, name
    assert (model.emb.weight.grad is not None) == embedding_grads
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("emb."))
    assert all(p.requires_grad for p in model.parameters())
    cap.remove()
    with pytest.raises(ValueError, match="no nn.Embedding"):
        with activation_grads_only(nn.Sequential(nn.Linear(3, 2)), embedding_grads=False):
            pass

    class Pair(nn.Embedding):                     # a lookup that returns (vectors, mask)
        def forward(self, ids):
            return super().forward(ids), ids != 0

    pair = Pair(5, 3)
    with activation_grads_only(pair, embedding_grads=False), pytest.raises(CaptureError, match="returned a tuple"):
        pair(torch.tensor([[1, 2]]))
    assert pair.weight.requires_grad and not pair._forward_hooks


class _PlainLM(nn.Module):
    """A token model of plain torch layers (no ai2-olmo: the lent GPU machine has none)."""

    def __init__(self, vocab=96, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.down(nn.functional.gelu(self.up(h))))


def _plain_lm_capture_errors(device, autocast_dtype=None, proj_dim=0):
    """Per-layer relative error of the capture against torch.func's exact per-example gradients (run
    under the same autocast, projected by the capture's own matrices when ``proj_dim`` is set)."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = _PlainLM().to(device)
    ids = _ids(b=4).to(device)

    def losses(p, x):                             # each example's summed next-token loss
        with torch.autocast(device, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            logits = functional_call(model, p, (x,))
        ce = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten(), reduction="none")
        return ce.view(x.shape[0], -1).sum(1)

    exact = vmap(grad(lambda p, x: losses(p, x[None])[0]), in_dims=(None, 0))(
        {k: v.detach() for k, v in model.named_parameters()}, ids)
    cap = GradientCapture(model, CaptureConfig(proj_dim=proj_dim, seed=3))
    with cap.record(range(4), loss_scale=ids.numel()) as rec:
        (losses(dict(model.named_parameters()), ids).sum() / ids.numel()).backward()
    errs = {}
    for name, g in rec.dense().items():
        want = linear_grad(exact, name, cap._with_bias[name])
        if proj_dim:
            p_out, p_in = cap.projection(name)
            want = p_out.to(want) @ want @ p_in.to(want).T
        assert g.dtype == torch.float32, (name, g.dtype)
        assert g.device.type == device, f"{name}'s captured rows left the model's device for {g.device}"
        errs[name] = rel_err(g.double().cpu(), want.double().cpu())
    assert set(errs) == {"up", "down", "head"}
    cap.remove()
    return errs


@pytest.mark.parametrize("case", ["fp32", "projected", "bf16"])
def test_plain_token_model_capture_is_exact_on_cpu(case):
    """The CPU half of the CUDA test below, through the same code: it must pass here to mean anything there."""
    errs = _plain_lm_capture_errors("cpu", torch.bfloat16 if case == "bf16" else None,
                                    (16, 8) if case == "projected" else 0)
    assert max(errs.values()) < (3e-2 if case == "bf16" else TOL), errs


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fp32", "projected", "bf16"])
def test_cuda_capture_is_exact_with_and_without_bf16_autocast(case):
    """On CUDA, fp32 (dense and projected: the CPU-drawn projectors move to the GPU) within fp32 rounding
    and bf16 autocast within a few bf16 ε (3e-2, as on CPU) of torch.func's exact per-example gradients.
    Prints the errors (run with -s) so the device run records them."""
    errs = _plain_lm_capture_errors("cuda", torch.bfloat16 if case == "bf16" else None,
                                    (16, 8) if case == "projected" else 0)
    print(f"\n[cuda capture {case}] max rel err vs exact: {max(errs.values()):.2e} {errs}")
    assert max(errs.values()) < (3e-2 if case == "bf16" else 1e-4), errs
