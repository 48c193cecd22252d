"""Influence with a damped per-layer Fisher: the explicit (raw), low-rank Woodbury (lorif) and EK-FAC
paths against explicit inverses computed here, on random low-rank data and on a tiny OLMo's exact
per-example gradients (torch.func)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from conftest import exact_per_example_grads, rel_err, tiny_olmo, token_losses
from olmo_tda.capture import GradientCapture
from olmo_tda.config import CaptureConfig, StoreConfig
from olmo_tda.methods import attribute, get_method
from olmo_tda.store import GradientRecord, GradientStore


def _store(tmp_path, grads: dict[str, torch.Tensor], name="s"):
    layers = [{"name": n, "shape": list(g.shape[1:]), "projector": {}} for n, g in grads.items()]
    meta = {"capture": {}, "projector_hash": "h", "layers": layers}
    n = len(next(iter(grads.values())))
    with GradientStore.create(tmp_path / name, meta, StoreConfig()) as w:
        for start in range(0, n, 7):   # several records, so the streaming passes see several blocks
            w.append(GradientRecord(ids=np.arange(start, min(n, start + 7)), step=1, lr=0.1, loss_scale=1.0,
                                    grads={k: g[start:start + 7] for k, g in grads.items()}))
    return GradientStore.open(tmp_path / name)


def _explicit(train: torch.Tensor, damping_ratio=0.1, damping=None):
    g = train.reshape(len(train), -1).double()
    fisher = g.T @ g / len(g)
    lam = damping if damping is not None else damping_ratio * torch.trace(fisher).item() / len(fisher)
    return torch.linalg.inv(fisher + lam * torch.eye(len(fisher), dtype=torch.float64)), lam


def test_woodbury_equals_the_explicit_inverse_when_rank_covers_the_gradients_and_degrades_below(tmp_path):
    gen = torch.Generator().manual_seed(0)
    n, shape = 20, (6, 8)                                   # D = 48 > N = 20: rank(F) = 20
    scales = torch.logspace(0, -2, n, dtype=torch.float64)  # a decaying spectrum, as real gradients have
    train = (torch.randn(n, n, generator=gen, dtype=torch.float64) * scales) @ torch.randn(n, 48, generator=gen,
                                                                                         dtype=torch.float64)
    train = train.float().reshape(n, *shape)
    store = _store(tmp_path, {"fc": train})
    queries = torch.randn(3, *shape, generator=gen)
    inv, lam = _explicit(train)
    want = queries.reshape(3, -1).double() @ inv
    errors = {}
    for rank in (24, 20, 12, 6, 2):
        method = get_method("influence", hessian="lorif", rank=rank)
        method.fit(store, ["fc"])
        assert method.info["damping"]["fc"] == pytest.approx(lam, rel=1e-6)
        errors[rank] = rel_err(method.prepare({"fc": queries})["fc"].reshape(len(want), -1), want)
    print("Woodbury vs explicit (F+λI)^-1 q, rank(F)=20:", {r: f"{e:.1e}" for r, e in errors.items()})
    assert errors[24] < 1e-4 and errors[20] < 1e-4
    assert errors[2] > errors[6] > errors[12] > 10 * errors[20]      # truncation error grows as r shrinks
    raw = get_method("influence", hessian="raw")
    raw.fit(store, ["fc"])
    assert rel_err(raw.prepare({"fc": queries})["fc"].reshape(len(want), -1), want) < 1e-8


def _explicit_ekfac(train: torch.Tensor, damping_ratio=0.1):
    """The EK-FAC matrix built densely, independently of the streaming code: the Kronecker
    eigenbasis K = U_S ⊗ U_A of S = E[G Gᵀ], A = E[Gᵀ G], and F_ekfac = K diag(Kᵀ F K) Kᵀ, the part
    of the explicit D×D Fisher that is diagonal in that basis; returns its damped inverse and λ."""
    g = train.double()
    n, k_out, k_in = g.shape
    u_out = torch.linalg.eigh(torch.einsum("noi,npi->op", g, g) / n)[1]
    u_in = torch.linalg.eigh(torch.einsum("noi,nop->ip", g, g) / n)[1]
    kron = torch.kron(u_out, u_in)                      # row-major vec(G): vec(U_S X U_Aᵀ) = (U_S ⊗ U_A) vec(X)
    flat_g = g.reshape(n, -1)
    fisher = flat_g.T @ flat_g / n
    approx = kron @ torch.diag(torch.diagonal(kron.T @ fisher @ kron)) @ kron.T
    lam = damping_ratio * torch.trace(fisher).item() / len(fisher)
    return torch.linalg.inv(approx + lam * torch.eye(len(fisher), dtype=torch.float64)), lam


def test_ekfac_equals_its_explicit_kronecker_matrix_and_the_exact_inverse_when_f_is_kronecker_diagonal(tmp_path):
    gen = torch.Generator().manual_seed(3)
    shape = (4, 6)
    # random gradients: EK-FAC equals the explicitly built eigenbasis-diagonal matrix's inverse
    train = torch.randn(30, 4, 4, generator=gen, dtype=torch.float64) @ torch.randn(30, 4, 6, generator=gen,
                                                                                     dtype=torch.float64)
    queries = torch.randn(3, *shape, generator=gen, dtype=torch.float64)
    store = _store(tmp_path, {"fc": train.float()}, "random")
    method = get_method("influence", hessian="ekfac")
    method.fit(store, ["fc"], block_size=7)             # both passes sum over several streamed blocks
    inv, lam = _explicit_ekfac(train.float())
    assert method.info["damping"]["fc"] == pytest.approx(lam, rel=1e-6)
    got = method.prepare({"fc": queries})["fc"].reshape(3, -1)
    assert rel_err(got, queries.reshape(3, -1) @ inv) < 1e-8
    raw_inv, _ = _explicit(train.float())
    assert rel_err(got, queries.reshape(3, -1) @ raw_inv) > 1e-2     # an approximation of raw here

    # gradients whose Fisher is diagonal in a Kronecker basis: rotations of C ∘ h_r over the 24 rows
    # h_r of a Hadamard-like ±1 design (orthogonal columns), so every cross moment vanishes exactly;
    # then EK-FAC is the exact damped inverse
    hadamard = torch.tensor([[1.0]], dtype=torch.float64)
    while len(hadamard) < 32:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)])
    signs = hadamard[:, :24].reshape(32, 4, 6)
    u = torch.linalg.qr(torch.randn(4, 4, generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=torch.float64))[0]
    spread = torch.logspace(0, -2, 24, dtype=torch.float64).reshape(4, 6)    # distinct second moments
    cores = torch.randn(2, 1, 4, 6, generator=gen, dtype=torch.float64) * spread
    diag_train = u @ (cores * signs).reshape(64, 4, 6) @ v.T
    fisher = diag_train.reshape(64, -1).T @ diag_train.reshape(64, -1)
    rotated = torch.kron(u, v).T @ fisher @ torch.kron(u, v)
    assert (rotated - torch.diag(torch.diagonal(rotated))).abs().max() < 1e-10 * rotated.abs().max()
    store = _store(tmp_path, {"fc": diag_train.float()}, "kron_diagonal")
    exact_inv, _ = _explicit(diag_train.float())
    for hessian in ("ekfac", "raw"):
        method = get_method("influence", hessian=hessian)
        method.fit(store, ["fc"], block_size=9)
        got = method.prepare({"fc": queries})["fc"].reshape(3, -1)
        assert rel_err(got, queries.reshape(3, -1) @ exact_inv) < 1e-5, hessian


@pytest.fixture(scope="module")
def olmo_grads(tmp_path_factory):
    """A tiny OLMo's exact per-example gradients (torch.func) and a store of the same gradients
    captured unprojected."""
    tmp = tmp_path_factory.mktemp("infl")
    model = tiny_olmo(d_model=16, n_heads=2, mlp_ratio=2, vocab_size=32, embedding_size=32, max_sequence_length=8)
    gen = torch.Generator().manual_seed(1)
    train_ids = torch.randint(0, 32, (48, 8), generator=gen)
    query_ids = torch.randint(0, 32, (4, 8), generator=gen)
    capture = GradientCapture(model, CaptureConfig(proj_dim=0))
    with GradientStore.create(tmp / "store", capture.store_metadata(), StoreConfig()) as w:
        for start in range(0, 48, 16):
            batch = train_ids[start:start + 16]
            with capture.record(range(start, start + 16)) as rec:
                token_losses(model(batch).logits, batch).sum().backward()
            model.zero_grad(set_to_none=True)
            w.append(rec.to_record(step=1, lr=0.1))
    with capture.record(range(4)) as rec:
        token_losses(model(query_ids).logits, query_ids).sum().backward()
    capture.remove()
    layers = list(capture.layer_shapes)
    exact_train = exact_per_example_grads(model, train_ids)
    exact_query = exact_per_example_grads(model, query_ids)
    return {"store": GradientStore.open(tmp / "store"), "queries": rec.dense(), "layers": layers,
            "train": {n: exact_train[f"{n}.weight"] for n in layers},
            "query": {n: exact_query[f"{n}.weight"] for n in layers}}


def _explicit_influence(data, damping_ratio=0.1):
    total = 0
    for name in data["layers"]:
        inv, _ = _explicit(data["train"][name], damping_ratio)
        q = data["query"][name].reshape(4, -1).double()
        total = total + q @ inv @ data["train"][name].reshape(48, -1).double().T
    return total


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(np.mean([spearmanr(a[q], b[q])[0] for q in range(len(a))]))


def test_influence_equals_explicit_damped_fisher_influence_on_a_tiny_olmo(olmo_grads):
    want = _explicit_influence(olmo_grads)
    results = {}
    for hessian, options in (("raw", {}), ("lorif", {"rank": 48})):       # rank = N: every direction kept
        res = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian=hessian, top_k=5,
                        return_scores=True, projector_hash=None, **options)
        order = np.argsort(res.all_ids)
        scores = res.all_scores[:, order]
        results[hessian] = (_spearman(scores, want), rel_err(scores, want))
        assert set(res.info["damping"]) == set(olmo_grads["layers"]) and res.info["hessian"] == hessian
    print("influence vs explicit (F+λI)^-1, λ = 0.1 tr(F)/D: "
          + ", ".join(f"{h}: Spearman {s:.4f}, rel. err {e:.1e}" for h, (s, e) in results.items()))
    assert results["raw"][0] >= 0.95 and results["raw"][1] < 1e-4
    assert results["lorif"][0] >= 0.95 and results["lorif"][1] < 1e-3


def test_ekfac_influence_on_a_tiny_olmo_equals_the_explicit_ekfac_matrix(olmo_grads):
    """On real gradients EK-FAC is an approximation of the full Fisher: the streamed result equals
    the dense EK-FAC matrix built here from the torch.func gradients, and its agreement with exact
    influence is reported beside raw's."""
    res = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian="ekfac", top_k=5,
                    return_scores=True, projector_hash=None)
    scores = res.all_scores[:, np.argsort(res.all_ids)]
    want = 0
    for name in olmo_grads["layers"]:
        inv, lam = _explicit_ekfac(olmo_grads["train"][name])
        assert res.info["damping"][name] == pytest.approx(lam, rel=1e-5)
        q = olmo_grads["query"][name].reshape(4, -1).double()
        want = want + q @ inv @ olmo_grads["train"][name].reshape(48, -1).double().T
    exact = _explicit_influence(olmo_grads)
    print(f"EK-FAC vs its explicit matrix: rel. err {rel_err(scores, want):.1e}; vs exact damped-Fisher influence: "
          f"Spearman {_spearman(scores, exact):.4f}")
    assert res.info["hessian"] == "ekfac" and rel_err(scores, want) < 1e-6
    for ratio in (1e-2, 1.0, 1e2):                       # and at other dampings, streamed in blocks of 10 rows
        res = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian="ekfac", damping_ratio=ratio,
                        top_k=1, return_scores=True, block_size=10)
        scores = res.all_scores[:, np.argsort(res.all_ids)]
        want = sum(olmo_grads["query"][n].reshape(4, -1).double() @ _explicit_ekfac(olmo_grads["train"][n], ratio)[0]
                   @ olmo_grads["train"][n].reshape(48, -1).double().T for n in olmo_grads["layers"])
        assert rel_err(scores, want) < 1e-6, ratio


def test_joint_influence_equals_the_explicit_whole_model_inverse_on_a_tiny_olmo(olmo_grads, monkeypatch):
    """hessian="joint": one damped Fisher over all layers' coordinates (cross-layer blocks included),
    λ = ratio·tr(F)/D, against the explicit inverse built here from the torch.func gradients; streamed
    in blocks of 10 rows, at a fixed damping, and through the fitted-Fisher cache."""
    layers = olmo_grads["layers"]
    g = torch.cat([olmo_grads["train"][n].reshape(48, -1) for n in layers], 1).double()
    q = torch.cat([olmo_grads["query"][n].reshape(4, -1) for n in layers], 1).double()
    inv, lam = _explicit(g)
    want = q @ inv @ g.T
    for f in (olmo_grads["store"].path / "cache").glob("*"):
        f.unlink()
    for options in ({}, {"block_size": 10}):
        res = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian="joint", top_k=5,
                        damping_ratio=0.1, return_scores=True, projector_hash=None, **options)
        scores = res.all_scores[:, np.argsort(res.all_ids)]
        assert rel_err(scores, want) < 1e-6 and res.info["hessian"] == "joint"
        assert set(res.info["damping"]) == set(layers) and all(v == pytest.approx(lam) for v in
                                                               res.info["damping"].values())
    assert res.info["cached"]                 # the second question read the fitted factor back
    inv3, _ = _explicit(g, damping=3.0)
    res = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian="joint", damping=3.0,
                    top_k=1, return_scores=True)
    assert rel_err(res.all_scores[:, np.argsort(res.all_ids)], q @ inv3 @ g.T) < 1e-6
    # per-layer raw is a different estimator: the cross-layer blocks change the scores
    raw = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian="raw", top_k=1,
                    return_scores=True)
    assert rel_err(raw.all_scores[:, np.argsort(raw.all_ids)], want) > 1e-2
    # queries must carry the fitted layers; too wide a store is refused before any pass
    method = get_method("influence", hessian="joint")
    method.fit(olmo_grads["store"], layers)
    with pytest.raises(ValueError, match="was fitted on layers"):
        method.prepare({layers[0]: olmo_grads["queries"][layers[0]]})
    import olmo_tda.methods.influence as influence_module

    monkeypatch.setattr(influence_module, "JOINT_MAX_DIM", g.shape[1] - 1)
    monkeypatch.setattr(influence_module, "JOINT_AUTO_RANK", 56)        # covers rank(F) = 48: exact again
    wide = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", damping=3.0, top_k=1,
                     return_scores=True)
    assert wide.info["hessian"] == "joint" and wide.info["rank"] == 56       # too wide to be explicit: top-r
    assert rel_err(wide.all_scores[:, np.argsort(wide.all_ids)], q @ inv3 @ g.T) < 1e-6
    # the defaults: joint with λ = 0.01·tr(F)/D (measured on fact tracing); 0.1 per layer
    assert get_method("influence").hessian == "joint" and get_method("influence").damping_ratio == 0.01
    assert get_method("influence", hessian="ekfac").damping_ratio == 0.1


def test_lowrank_joint_influence_is_woodbury_on_the_top_eigenpairs_of_the_whole_model_fisher(olmo_grads, monkeypatch):
    """hessian="joint", rank=r: the explicit joint result when r covers rank(F) (48 rows, so rank 48 of
    D = 1088), and below it the Woodbury inverse built here from the top-r eigenpairs of the explicit
    whole-model Fisher (cross-layer blocks included); no width limit, and a cache of its own."""
    layers = olmo_grads["layers"]
    g = torch.cat([olmo_grads["train"][n].reshape(48, -1) for n in layers], 1).double()
    q = torch.cat([olmo_grads["query"][n].reshape(4, -1) for n in layers], 1).double()
    fisher = g.T @ g / len(g)
    lam = 0.1 * torch.trace(fisher).item() / len(fisher)
    evals, evecs = torch.linalg.eigh(fisher)

    def truncated(r):                     # (V_r S_r V_rᵀ + λI)⁻¹, V_r the top-r eigenvectors
        v, s = evecs[:, -r:], evals[-r:]
        return (torch.eye(len(fisher), dtype=torch.float64) - v @ torch.diag(s / (s + lam)) @ v.T) / lam

    inv, _ = _explicit(g)
    for f in (olmo_grads["store"].path / "cache").glob("*"):
        f.unlink()
    explicit = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian="joint", top_k=1,
                         damping_ratio=0.1, return_scores=True)
    scores = {}
    # F's top eigenvalues are close together here (in units of λ: 1702, 1600, 1532 ... 1008 at #16), so subspace
    # iteration converges slowly below rank(F): at r=16, 3 iterations are 40% off the truncation, 20
    # are 0.2% off, 40 are 1e-5 off
    for rank, options in ((56, {}), (56, {"block_size": 10}), (16, {"iterations": 40}), (4, {"iterations": 40})):
        for f in (olmo_grads["store"].path / "cache").glob("*"):      # block_size is not in the cache key
            f.unlink()
        res = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian="joint", rank=rank,
                        damping_ratio=0.1, top_k=1, return_scores=True, projector_hash=None, **options)
        scores[rank] = res.all_scores[:, np.argsort(res.all_ids)]
        assert res.info["rank"] == rank and "cached" not in res.info
        assert all(v == pytest.approx(lam) for v in res.info["damping"].values())
        assert rel_err(scores[rank], q @ truncated(min(rank, 48)) @ g.T) < (1e-6 if rank > 48 else 1e-3), rank
    assert rel_err(scores[56], q @ inv @ g.T) < 1e-6
    assert rel_err(scores[56], explicit.all_scores[:, np.argsort(explicit.all_ids)]) < 1e-6
    assert rel_err(scores[4], scores[56]) > rel_err(scores[16], scores[56]) > 1     # truncation shows
    for _ in range(2):                    # the second reads the cache the first wrote
        again = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian="joint", rank=56, damping_ratio=0.1,
                          top_k=1, return_scores=True)
    assert again.info["cached"] and again.info["rank"] == 56
    assert rel_err(again.all_scores[:, np.argsort(again.all_ids)], scores[56]) < 1e-9
    explicit = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian="joint", top_k=1)
    assert "cached" not in explicit.info and "rank" not in explicit.info      # not the rank-56 entry
    import olmo_tda.methods.influence as influence_module

    monkeypatch.setattr(influence_module, "JOINT_MAX_DIM", g.shape[1] - 1)
    res = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian="joint", rank=56,
                    damping=1.0, top_k=1, return_scores=True)
    inv1, _ = _explicit(g, damping=1.0)
    assert rel_err(res.all_scores[:, np.argsort(res.all_ids)], q @ inv1 @ g.T) < 1e-6


def test_influence_damping_sweep(olmo_grads):
    """Damping moves influence from a sharp inverse (small λ) to its λ → ∞ limit, a gradient dot with
    each layer weighted by 1/λ_l ∝ D_l/tr(F_l) (per-layer damping); at every λ the implementation
    matches the explicit inverse."""
    def layer_trace_over_dim(n):
        g = olmo_grads["train"][n].reshape(48, -1).double()
        return float((g * g).sum()) / 48 / g.shape[1]

    graddot = sum(olmo_grads["query"][n].reshape(4, -1).double() @ olmo_grads["train"][n].reshape(48, -1).double().T
                  / layer_trace_over_dim(n) for n in olmo_grads["layers"])
    rows = []
    for ratio in (1e-3, 1e-2, 1e-1, 1.0, 10.0, 1e3):
        res = attribute(olmo_grads["store"], olmo_grads["queries"], method="influence", hessian="lorif",
                        damping_ratio=ratio, top_k=1, return_scores=True)
        scores = res.all_scores[:, np.argsort(res.all_ids)]
        rows.append((ratio, _spearman(scores, _explicit_influence(olmo_grads, ratio)), _spearman(scores, graddot)))
    print("damping ratio | Spearman vs explicit | Spearman vs the λ→∞ limit (layer-normalized graddot)")
    for ratio, vs_explicit, vs_dot in rows:
        print(f"{ratio:>13g} | {vs_explicit:>20.4f} | {vs_dot:>19.4f}")
    assert all(vs_explicit >= 0.95 for _, vs_explicit, _ in rows)
    assert rows[-1][2] > 0.99 and rows[0][2] < 0.9 and rows[-1][2] > rows[-2][2] > rows[0][2]


def test_influence_bad_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="hessian must be 'raw', 'lorif', 'ekfac' or 'joint'"):
        get_method("influence", hessian="kfac")
    for damping in (0.0, -1.0, float("inf"), float("nan")):      # inf damping would zero every score
        with pytest.raises(ValueError, match="damping must be finite and > 0"):
            get_method("influence", damping=damping)
    with pytest.raises(ValueError, match="damping_ratio must be finite and > 0"):
        get_method("influence", damping_ratio=float("inf"))
    with pytest.raises(ValueError, match="rank is the rank of hessian='lorif' or 'joint', not of hessian='ekfac'"):
        get_method("influence", hessian="ekfac", rank=16)
    with pytest.raises(ValueError, match="not of hessian='raw'"):
        get_method("influence", hessian="raw", rank=64)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        get_method("influence", hessian="joint", rank=0)
    with pytest.raises(ValueError, match="oversample must be >= 0"):
        get_method("influence", hessian="lorif", oversample=-70)
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        get_method("influence", hessian="lorif", iterations=-1)
    store = _store(tmp_path, {"fc": torch.zeros(4, 2, 2)})
    for hessian in ("ekfac", "raw", "lorif", "joint"):
        for damping in (None, 1.0):        # an explicit λ does not make all-zero rows informative
            with pytest.raises(ValueError, match="zero gradients|gradients are all zero"):
                attribute(store, {"fc": torch.ones(1, 2, 2)}, method="influence", hessian=hessian, damping=damping)
    assert get_method("influence").hessian == "joint"


@pytest.mark.parametrize("hessian", ["raw", "lorif", "ekfac"])
def test_a_layer_with_zero_gradients_is_left_out_not_fatal(tmp_path, hessian, caplog):
    """A layer whose every stored row is zero (a frozen or unused module) used to refuse the whole
    question under the default relative damping; it adds exactly 0 to every score, so the answer is
    the influence of the other layers alone (explicit damped inverse), with a warning naming it."""
    gen = torch.Generator().manual_seed(0)
    train = torch.randn(20, 3, 2, generator=gen)
    store = _store(tmp_path, {"fc": train, "dead": torch.zeros(20, 2, 2)})
    q = torch.randn(2, 3, 2, generator=gen)
    res = attribute(store, {"fc": q, "dead": torch.randn(2, 2, 2, generator=gen)}, method="influence",
                    hessian=hessian, return_scores=True, **({"rank": 6} if hessian == "lorif" else {}))
    assert "1 layer(s) have zero gradients in every stored row" in caplog.text and "'dead'" in caplog.text
    assert res.info["dead_layers"] == ["dead"] and list(res.info["damping"]) == ["fc"]
    if hessian == "ekfac":      # not the exact inverse; it must equal the 'fc'-only store's answer
        alone = attribute(_store(tmp_path, {"fc": train}, name="alone"), {"fc": q}, method="influence",
                          hessian="ekfac", return_scores=True).all_scores
    else:
        inv, _ = _explicit(train)
        alone = q.reshape(2, -1).double() @ inv @ train.reshape(20, -1).double().T
    torch.testing.assert_close(res.all_scores.double(), alone.double(), rtol=1e-6, atol=1e-9)
    again = attribute(store, {"fc": q, "dead": torch.randn(2, 2, 2, generator=gen)}, method="influence",
                      hessian=hessian, return_scores=True, **({"rank": 6} if hessian == "lorif" else {}))
    assert again.info["cached"] and torch.equal(again.all_scores, res.all_scores)   # the cache keeps it out


def test_the_cache_keeps_one_fit_per_option_set_as_the_store_grows(tmp_path):
    """A store queried while training appends to it: each new state is fitted once and replaces the
    file of the older state with the same options (a D×D float64 factor per layer each); other
    option sets keep their own file."""
    gen = torch.Generator().manual_seed(1)
    meta = {"capture": {}, "projector_hash": "h", "layers": [{"name": "fc", "shape": [4, 4], "projector": {}}]}
    q = {"fc": torch.randn(1, 4, 4, generator=gen)}
    cache = tmp_path / "s" / "cache"
    with GradientStore.create(tmp_path / "s", meta, StoreConfig(flush_every=1)) as w:
        for step in range(1, 4):
            w.append(GradientRecord(ids=np.arange(8), step=step, lr=0.1, loss_scale=1.0,
                                    grads={"fc": torch.randn(8, 4, 4, generator=gen)}))
            w.flush()
            store = GradientStore.open(tmp_path / "s")
            assert store.num_rows == 8 * step
            raw = attribute(store, q, method="influence", hessian="raw", return_scores=True)
            assert "cached" not in raw.info
            inv, _ = _explicit(torch.cat([b.grads["fc"] for b in store.iter_blocks()]))
            want = q["fc"].reshape(1, -1).double() @ inv @ torch.cat(
                [b.grads["fc"] for b in store.iter_blocks()]).reshape(-1, 16).double().T
            torch.testing.assert_close(raw.all_scores.double(), want, rtol=1e-6, atol=1e-9)
            assert len(list(cache.glob("influence-*.safetensors"))) == 1
    attribute(store, q, method="influence", hessian="ekfac")
    assert len(list(cache.glob("influence-*.safetensors"))) == 2 and not list(cache.glob("*.tmp"))


@pytest.mark.parametrize("hessian", ["raw", "lorif", "ekfac", "joint", "joint-rank"])
def test_fitted_fisher_is_cached_beside_the_store_and_a_damaged_cache_is_recomputed(olmo_grads, hessian, caplog):
    store = olmo_grads["store"]
    rank = {"rank": 16} if hessian in ("lorif", "joint-rank") else {}
    hessian = hessian.split("-")[0]
    for f in (store.path / "cache").glob("*"):
        f.unlink()
    first = attribute(store, olmo_grads["queries"], method="influence", hessian=hessian, **rank, return_scores=True)
    assert "cached" not in first.info and len(list((store.path / "cache").glob("influence-*.safetensors"))) == 1
    second = attribute(store, olmo_grads["queries"], method="influence", hessian=hessian, **rank, return_scores=True)
    assert second.info["cached"] and torch.equal(first.all_scores, second.all_scores)
    assert second.info["damping"] == first.info["damping"]
    other = attribute(store, olmo_grads["queries"], method="influence", hessian=hessian, **rank, damping=3.0)
    assert "cached" not in other.info                 # other options: another cache entry
    cache = sorted((store.path / "cache").glob("influence-*.safetensors"))[0]
    cache.write_bytes(b"not a safetensors file")
    for f in (store.path / "cache").glob("influence-*.safetensors"):
        f.write_bytes(b"garbage")
    third = attribute(store, olmo_grads["queries"], method="influence", hessian=hessian, **rank, return_scores=True)
    assert "cached" not in third.info and torch.equal(third.all_scores, first.all_scores)
    assert "ignoring unreadable cache" in caplog.text
    assert GradientStore.open(store.path).num_rows == 48      # the store itself is untouched


@pytest.mark.parametrize("hessian", ["raw", "joint"])
def test_a_damping_that_float64_cannot_resolve_warns(tmp_path, hessian, caplog):
    """Fewer rows than dimensions: F is singular and F + λI with λ ~1e-14 of its mean eigenvalue
    loses most digits in float64. That warns,
    naming the relative damping; the default relative damping does not."""
    gen = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(6, 4, 4, generator=gen, dtype=torch.float64).float()}
    store = _store(tmp_path, grads)
    query = {"a": torch.randn(2, 4, 4, generator=gen)}
    mean_eig = float(grads["a"].double().flatten(1).square().sum()) / 6 / 16
    with caplog.at_level("WARNING", logger="olmo_tda.methods.influence"):
        attribute(store, query, method="influence", hessian=hessian, damping=1e-14 * mean_eig)
    assert "mean Fisher eigenvalue" in caplog.text and "e-14" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="olmo_tda.methods.influence"):
        attribute(store, query, method="influence", hessian=hessian)
        attribute(store, query, method="influence", hessian=hessian, damping=1e-6 * mean_eig)
        # more rows than dimensions: F is invertible, a tiny damping is no warning matter
        many = _store(tmp_path, {"a": torch.randn(40, 4, 4, generator=gen)}, name="many")
        attribute(many, query, method="influence", hessian=hessian, damping=1e-14 * mean_eig)
    assert "mean Fisher eigenvalue" not in caplog.text
