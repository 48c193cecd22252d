"""Online data selection: the order rewrite, the policies against brute force, the persisted log, and
a round on a tiny OLMo against torch.func gradients with the training state checked untouched."""

from __future__ import annotations

import copy
import functools
import json
import re

import numpy as np
import pytest
import torch

from olmo_tda.config import ConfigError, SelectionConfig, TDAConfig
from olmo_tda.training.selection import (DataOrder, SelectionError, SelectionLog, greats_order, order_window,
                                         rewrite_order, round_stats)
from olmo_tda.training.selector import OnlineSelector
from conftest import exact_per_example_grads, tiny_olmo


@pytest.mark.parametrize("seed", range(6))
def test_rewrite_never_loses_duplicates_or_touches_consumed(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 60))
    order = rng.permutation(n).astype(np.int64)
    start = int(rng.integers(0, n))
    width = int(rng.integers(1, n - start + 1))
    window = order[start:start + width]
    new_window = rng.permutation(window)
    keep = int(rng.integers(1, width + 1))
    out = rewrite_order(order, start, new_window, keep)
    assert np.array_equal(out[:start], order[:start])                 # consumed positions unchanged
    assert np.array_equal(np.sort(out), np.sort(order))                # nothing lost or duplicated
    assert np.array_equal(out[start:start + keep], new_window[:keep])  # kept, best first
    assert np.array_equal(out[n - (width - keep):], new_window[keep:])  # the rest at the end of the epoch
    if keep == width:                                                   # reorder: a permutation in place
        assert np.array_equal(out[start + width:], order[start + width:])


def test_rewrite_refuses_a_window_that_is_not_the_upcoming_one():
    order = np.arange(10)
    with pytest.raises(SelectionError, match="not a permutation"):
        rewrite_order(order, 2, np.array([2, 3, 9]), 3)
    with pytest.raises(SelectionError, match="keep"):
        rewrite_order(order, 2, np.array([3, 2]), 0)


def _greats_brute_force(G, target, lr, batch, curvature=None):
    """GREATS by definition: explicit Gram matrix, Python loops."""
    W = len(G)
    gram = [[float(np.dot(G[i], G[j])) for j in range(W)] for i in range(W)]
    align = [lr * float(np.dot(G[i], target)) for i in range(W)]
    left, order = set(range(W)), []
    while left:
        slot = []
        for _ in range(min(batch, len(left))):
            c = lr ** 2 if curvature is None else curvature
            gains = {i: align[i] - c * sum(gram[i][j] for j in slot) for i in left}
            best = max(sorted(gains), key=lambda i: gains[i])
            slot.append(best)
            left.remove(best)
        order += slot
    return order


@pytest.mark.parametrize("lr,batch,curvature", [(0.05, 4, None), (1.0, 3, None), (1e-6, 5, None), (0.05, 4, 0.3)])
@pytest.mark.parametrize("gram", [True, False])
def test_greats_equals_its_definition(lr, batch, curvature, gram, monkeypatch):
    """Both routes (one Gram GEMM, or a product per pick for windows too large for it) against the
    definition."""
    from olmo_tda.training import selection
    if not gram:
        monkeypatch.setattr(selection, "GRAM_BYTES", 0)
    gen = torch.Generator().manual_seed(1)
    G = torch.randn(13, 7, generator=gen, dtype=torch.float64)
    G[5] = G[2]                                      # a duplicate: redundancy must push it apart
    target = torch.randn(7, generator=gen, dtype=torch.float64)
    order, gains = greats_order(G, target, lr, batch, curvature)
    assert order.tolist() == _greats_brute_force(G.numpy(), target.numpy(), lr, batch, curvature)
    if curvature is not None:                        # a stronger redundancy term changes the order
        assert order.tolist() != greats_order(G, target, lr, batch)[0].tolist()
    if lr == 1e-6:                                   # no redundancy to speak of: the alignment order
        assert order.tolist() == np.argsort(-(G @ target).numpy(), kind="stable").tolist()


def test_greats_splits_duplicates_that_alignment_keeps_together():
    # rows 0 and 1 are the same best-aligned example; row 2 is less aligned but orthogonal to them
    G = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 0.8]], dtype=torch.float64)
    target = torch.tensor([1.0, 1.0], dtype=torch.float64)
    assert order_window("alignment", grads=G, target=target)[0].tolist()[:2] == [0, 1]
    order, gains = greats_order(G, target, lr_eff=0.5, batch_size=2)
    assert order.tolist() == [0, 2, 1]               # the twin waits for the next update
    assert gains[2] == pytest.approx(0.5 * 0.8) and gains[1] == pytest.approx(0.5)  # a new slot: no penalty


def test_policies_order_by_their_scores():
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(9, 4, generator=gen)
    losses = np.linspace(1, 2, 9)[::-1].copy()
    order, _ = order_window("loss", losses=losses)
    assert order.tolist() == list(range(9))
    order, scores = order_window("gradnorm", grads=G)
    assert np.all(np.diff(scores[order]) <= 0)
    a, _ = order_window("random", num=9, seed=3)          # the random policy measures nothing
    b, _ = order_window("random", num=9, seed=3)
    c, _ = order_window("random", num=9, seed=4)
    assert a.tolist() == b.tolist() != c.tolist() and sorted(a.tolist()) == list(range(9))
    with pytest.raises(SelectionError, match="needs"):
        order_window("alignment", grads=G)
    with pytest.raises(SelectionError, match="unknown"):
        order_window("best", grads=G)


def test_round_stats():
    ids = np.array([10, 11, 12, 13])
    order = np.array([3, 0, 1, 2])                   # 13 promoted, the others demoted
    scores = np.array([1.0, 0.5, 0.2, 3.0])
    s = round_stats(ids, order, scores, 4, {10: 0.9, 11: 0.4, 12: 0.3, 13: 5.0}, ["a", "b", "a", "b"])
    assert s["promoted_mean_score"] == 3.0 and s["demoted_mean_score"] == pytest.approx(1.7 / 3)
    assert s["rank_corr_prev"] == pytest.approx(1.0)
    assert s["source_frac_window"] == {"a": 0.5, "b": 0.5}
    assert s["source_frac_front"] == {"a": 0.5, "b": 0.5}      # front half: 13 (b), 10 (a)
    assert sum(s["score_hist"]["counts"]) == 4


def test_log_replays_truncates_and_survives_a_torn_line(tmp_path):
    log = SelectionLog(tmp_path)
    base = np.arange(20)
    o1 = rewrite_order(base, 4, np.array([7, 6, 5, 4]), 4)
    log.append(epoch=0, step=2, start=4, keep=4, window_ids=np.array([7, 6, 5, 4]), stats={})
    o2 = rewrite_order(o1, 8, np.array([10, 9, 8, 11]), 2)
    log.append(epoch=0, step=4, start=8, keep=2, window_ids=np.array([10, 9, 8, 11]), stats={})
    log.append(epoch=1, step=30, start=0, keep=1, window_ids=np.array([0]), stats={})
    assert np.array_equal(log.replay(base, 0, 3)[0], o1)
    assert np.array_equal(log.replay(base, 0, 100)[0], o2)
    with open(log.index_file, "a") as f:
        f.write('{"epoch": 0, "st')                     # a crash mid-append
    assert len(log.rounds()) == 3
    assert log.truncate_after(0, 2) == 2
    assert np.array_equal(log.replay(base, 0, 100)[0], o1)
    assert not list(tmp_path.glob("round-e0000-s0000000004*"))
    (tmp_path / json.loads(log.index_file.read_text().splitlines()[0])["file"]).write_bytes(b"junk")
    with pytest.raises(SelectionError, match="cannot be read"):
        log.replay(base, 0, 100)


def test_a_torn_last_line_never_swallows_the_next_round(tmp_path):
    """A crash mid-append with no round to drop on resume (the likeliest case: the torn round is the
    first after the checkpoint): the re-run round and the ones after it are all logged and readable.
    A line that lost only its newline is a whole round and is kept."""
    log = SelectionLog(tmp_path)
    base = np.arange(20)
    log.append(epoch=0, step=2, start=4, keep=4, window_ids=np.array([7, 6, 5, 4]), stats={})
    with open(log.index_file, "a") as f:
        f.write('{"epoch": 0, "step": 4, "st')            # the crash
    assert log.truncate_after(0, 4) == 0                   # resume from the checkpoint at step 4
    log.append(epoch=0, step=4, start=8, keep=4, window_ids=np.array([11, 10, 9, 8]), stats={})
    log.append(epoch=0, step=6, start=12, keep=4, window_ids=np.array([15, 14, 13, 12]), stats={})
    assert [r["step"] for r in log.rounds()] == [2, 4, 6]
    want = rewrite_order(rewrite_order(rewrite_order(base, 4, np.array([7, 6, 5, 4]), 4),
                                       8, np.array([11, 10, 9, 8]), 4), 12, np.array([15, 14, 13, 12]), 4)
    assert np.array_equal(DataOrder(20, lambda e: base, log).epoch_order(0), want)
    # the crash came after a whole line but before its newline: the round took effect, keep it
    log.index_file.write_bytes(log.index_file.read_bytes()[:-1])
    log.append(epoch=0, step=8, start=16, keep=4, window_ids=np.array([19, 18, 17, 16]), stats={})
    assert [r["step"] for r in log.rounds()] == [2, 4, 6, 8]
    assert not list(tmp_path.glob("*.tmp*"))


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="tda.selection.target"):
        TDAConfig.from_dict({"selection": {"enabled": True, "policy": "alignment"}})
    with pytest.raises(ConfigError, match="tda.selection.keep_fraction"):
        TDAConfig.from_dict({"selection": {"keep_fraction": 0}})
    with pytest.raises(ConfigError, match="no such file"):
        TDAConfig.from_dict({"selection": {"enabled": True, "target": str(tmp_path / "nope.txt")}})
    with pytest.raises(ConfigError, match="policy"):
        TDAConfig.from_dict({"selection": {"policy": "best"}})


def _tokens(n, T=12, seed=0):
    return torch.randint(0, 96, (n, T), generator=torch.Generator().manual_seed(seed))


def _diag_preconditioner(model, names, tokens, tokens_per_batch, damping):
    """``({name: 1 / sqrt(v) [O, I]}, mean of R_i C_j)`` with ``v_ij = R_i C_j / N``, measured by plain
    hooks: ``R`` the mean square of each output's gradient of the summed token loss, ``C`` of each
    input, per token."""
    modules = dict(model.named_modules())
    acts, outs = {}, {}

    def keep(name, module, args, output):
        acts[name], outs[name] = args[0].detach(), output

    handles = [modules[n].register_forward_hook(functools.partial(keep, n)) for n in names]
    logits = model(tokens).logits
    for h in handles:
        h.remove()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
    deltas = torch.autograd.grad(ce, [outs[n] for n in names])
    out, fisher = {}, []
    for n, d in zip(names, deltas):
        a = acts[n].reshape(-1, acts[n].shape[-1]).double()
        d = d.reshape(-1, d.shape[-1]).double()
        r, c = d.square().mean(0), a.square().mean(0)
        r, c = r.clamp_min(damping * r.mean()), c.clamp_min(damping * c.mean())
        out[n] = (tokens_per_batch / (r[:, None] * c[None, :])).sqrt()
        fisher.append((r[:, None] * c[None, :]).flatten())
    return out, float(torch.cat(fisher).mean())


@pytest.mark.parametrize("precondition,common", [(False, False), (True, False), (True, True)])
def test_round_measures_exact_gradients_and_leaves_training_untouched(tmp_path, precondition, common):
    """The round's GREATS order equals the one computed from exact (vmap) per-example gradients:
    raw; preconditioned by P from the target's moments; and (the default) preconditioned, projected
    off the window's mean direction and cosine-normalized. Weights, optimizer state, gradients and
    RNG are left exactly as they were."""
    torch.manual_seed(0)
    model = tiny_olmo(attention_dropout=0.1, residual_dropout=0.1)     # dropout: eval mode must be used
    model.train()
    data = _tokens(24)
    target = _tokens(5, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(data[:4]).logits.sum().backward()
    opt.step()                                                          # non-trivial optimizer state and grads
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
              {n: p.grad.clone() for n, p in model.named_parameters()}, torch.get_rng_state())
    (tmp_path / "target.txt").write_text("target texts (the round gets them as tokens)\n")
    cfg = SelectionConfig(enabled=True, every_n=1, window=10, policy="greats", target=str(tmp_path / "target.txt"),
                          proj_dim=0, target_examples=5, micro_batch=3, precondition=precondition,
                          remove_common=common, normalize=common)
    sel = OnlineSelector(cfg, model, forward=lambda m, ids: m(ids).logits, log_folder=tmp_path / "sel",
                         target_tokens=target)
    order = np.arange(24)
    new, stats = sel.run(step=1, epoch=0, order=order, start=6, fetch=lambda ids: data[ids], lr=0.5,
                         tokens_per_batch=4 * 12, batch_size=4)
    # the training state is exactly as it was
    assert model.training
    for k, v in before[0].items():
        assert torch.equal(model.state_dict()[k], v), k
    assert torch.equal(torch.get_rng_state(), before[3])
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[2][n]), n
    assert json.dumps(opt.state_dict(), default=str) == json.dumps(before[1], default=str)
    # the order: consumed untouched, the window permuted
    assert np.array_equal(new[:6], order[:6]) and np.array_equal(np.sort(new[6:16]), np.arange(6, 16))
    assert np.array_equal(new[16:], order[16:])
    # the measured gradients are the exact ones (eval mode: dropout off)
    model.eval()
    names = list(sel.capture.modules)
    exact = exact_per_example_grads(model, data[6:16])
    exact_t = exact_per_example_grads(model, target)
    # preconditioned: P from the target's moments scales the window; GREATS' curvature is η²·h
    precond, fisher = (_diag_preconditioner(model, names, target, 4 * 12, cfg.precondition_damping) if precondition
                       else (None, 1.0))
    model.train()
    flat = torch.cat([(exact[f"{n}.weight"].double() * (precond[n] if precondition else 1)).reshape(10, -1)
                      for n in names], dim=1)
    tgt = torch.cat([exact_t[f"{n}.weight"].reshape(5, -1) for n in names], dim=1).double().sum(0) / (5 * 11)
    eta = 0.5 / 48
    scaled_only, _ = greats_order(flat, tgt, eta, 4, curvature=eta ** 2 * fisher)
    if common:
        mean = flat.mean(0)
        flat = flat - torch.outer(flat @ mean, mean) / mean.dot(mean)      # off the window's mean direction
        norms = flat.norm(dim=1, keepdim=True)
        flat = flat * norms.mean() / norms                                 # equal lengths
    want, _ = greats_order(flat, tgt, eta, 4, curvature=eta ** 2 * fisher)
    assert stats["preconditioned"] is precondition
    assert stats["common_removed"] is common and stats["normalized"] is common
    if precondition:                    # the scaling changes the order here (the check can fail)
        raw = torch.cat([exact[f"{n}.weight"].reshape(10, -1) for n in names], dim=1).double()
        assert not np.array_equal(greats_order(raw, tgt, eta, 4)[0], want)
    if common:                          # and so do the common direction and the lengths
        assert not np.array_equal(scaled_only, want)
    logged = np.load(tmp_path / "sel" / json.loads((tmp_path / "sel" / "rounds.jsonl").read_text())["file"])
    assert np.array_equal(logged, new[6:16]) and np.array_equal(new[6:16], 6 + want)
    assert stats["examples_rescored"] == 10 and stats["seconds"] > 0
    sel.close()


def test_round_with_embeddings_scores_the_exact_table_gradient(tmp_path):
    """``embeddings: true`` adds the token table to the score: the round's alignment order is the
    one of exact gradients over the Linears and the (transposed) table; wpe is left out."""
    model = tiny_olmo()
    data, target = _tokens(16), _tokens(4, seed=1)
    (tmp_path / "target.txt").write_text("t\n")
    cfg = SelectionConfig(enabled=True, every_n=1, window=12, policy="alignment", target=str(tmp_path / "target.txt"),
                          proj_dim=0, target_examples=4, micro_batch=5, embeddings=True, exclude_modules=["*wpe"],
                          precondition=False, remove_common=False, normalize=False)
    sel = OnlineSelector(cfg, model, forward=lambda m, ids: m(ids).logits, log_folder=tmp_path / "sel",
                         target_tokens=target)
    assert "transformer.wte" in sel.capture.modules and "transformer.wpe" not in sel.capture.modules
    new, stats = sel.run(step=1, epoch=0, order=np.arange(16), start=2, fetch=lambda ids: data[ids], lr=0.1,
                         tokens_per_batch=48, batch_size=4)
    model.eval()
    exact, exact_t = exact_per_example_grads(model, data[2:14]), exact_per_example_grads(model, target)

    def flat(g, n, table=True):
        rows = [g[f"{m}.weight"].transpose(1, 2) if m.endswith("wte") else g[f"{m}.weight"]
                for m in sel.capture.modules if table or not m.endswith("wte")]
        return torch.cat([r.reshape(n, -1) for r in rows], dim=1).double()
    align = flat(exact, 12) @ (flat(exact_t, 4).sum(0) / (4 * 11))
    want, _ = order_window("alignment", align=align.numpy())
    assert np.array_equal(new[2:14], 2 + want)
    # without the table the order differs: the table's gradient is not negligible here
    no_table = flat(exact, 12, table=False) @ flat(exact_t, 4, table=False).sum(0)
    assert not np.array_equal(np.argsort(-no_table.numpy()), want)
    sel.close()


def test_preconditioned_round_scales_a_tied_token_table_by_its_own_moments(tmp_path):
    """A tied table's gradient has two shares (lookup and head); its second-moment factors add both:
    rows (d) see the lookup's output gradient and the head's input, columns (V) the lookup's id counts
    and the logits' gradient, over the target. The round's alignment is ⟨ḡ, P·g_i⟩ with P from them."""
    model = tiny_olmo(weight_tying=True)
    data, target = _tokens(16), _tokens(4, seed=1)
    (tmp_path / "target.txt").write_text("t\n")
    cfg = SelectionConfig(enabled=True, every_n=1, window=12, policy="alignment", target=str(tmp_path / "target.txt"),
                          proj_dim=0, target_examples=4, micro_batch=5, embeddings=True, precondition=True,
                          exclude_modules=["*wpe"], remove_common=False, normalize=False)
    sel = OnlineSelector(cfg, model, forward=lambda m, ids: m(ids).logits, log_folder=tmp_path / "sel",
                         target_tokens=target)
    new, stats = sel.run(step=1, epoch=0, order=np.arange(16), start=2, fetch=lambda ids: data[ids], lr=0.1,
                         tokens_per_batch=48, batch_size=4)
    assert stats["preconditioned"]
    model.eval()
    exact, exact_t = exact_per_example_grads(model, data[2:14]), exact_per_example_grads(model, target)
    names = list(sel.capture.modules)
    linears = [n for n in names if not n.endswith("wte")]
    precond, _ = _diag_preconditioner(model, linears, target, 48, cfg.precondition_damping)
    # the table: [d, V] rows as captured (transposed weight); both shares measured by plain hooks
    seen = {}
    hooks = [model.transformer.wte.register_forward_hook(lambda m, a, o: seen.update(ids=a[0], emb=o)),
             model.transformer.ln_f.register_forward_hook(lambda m, a, o: seen.update(x=o))]
    logits = model(target).logits
    for h in hooks:
        h.remove()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten(), reduction="sum")
    d_emb, d_logits = torch.autograd.grad(ce, [seen["emb"], logits])
    tokens = 2 * target.numel()
    r = (d_emb.double().square().sum((0, 1)) + seen["x"].detach().double().square().sum((0, 1))) / tokens
    c = (torch.bincount(seen["ids"].flatten(), minlength=96).double() + d_logits.double().square().sum((0, 1))) / tokens
    r, c = r.clamp_min(0.01 * r.mean()), c.clamp_min(0.01 * c.mean())
    precond["transformer.wte"] = (48 / (r[:, None] * c[None, :])).sqrt()
    model.train()

    def flat(g, n, scaled):
        rows = [g[f"{m}.weight"].transpose(1, 2) if m.endswith("wte") else g[f"{m}.weight"] for m in names]
        return torch.cat([(r.double() * (precond[m] if scaled else 1)).reshape(n, -1)
                          for m, r in zip(names, rows)], dim=1)
    tgt = flat(exact_t, 4, False).sum(0) / (4 * 11)
    want, _ = order_window("alignment", align=(flat(exact, 12, True) @ tgt).numpy())
    assert np.array_equal(new[2:14], 2 + want)
    assert not np.array_equal(np.argsort(-(flat(exact, 12, False) @ tgt).numpy(), kind="stable"), want)
    sel.close()


def test_normalized_alignment_is_a_cosine(tmp_path):
    """``normalize: true`` ranks by ⟨ḡ, g_i⟩ / |g_i| (exact gradients, no preconditioner), which here
    differs from the raw inner product's order."""
    model = tiny_olmo()
    data, target = _tokens(16), _tokens(4, seed=1)
    (tmp_path / "target.txt").write_text("t\n")
    cfg = SelectionConfig(enabled=True, every_n=1, window=12, policy="alignment", target=str(tmp_path / "target.txt"),
                          proj_dim=0, target_examples=4, micro_batch=5, precondition=False, normalize=True,
                          remove_common=False)
    sel = OnlineSelector(cfg, model, forward=lambda m, ids: m(ids).logits, log_folder=tmp_path / "sel",
                         target_tokens=target)
    new, _ = sel.run(step=1, epoch=0, order=np.arange(16), start=2, fetch=lambda ids: data[ids], lr=0.1,
                     tokens_per_batch=48, batch_size=4)
    model.eval()
    exact, exact_t = exact_per_example_grads(model, data[2:14]), exact_per_example_grads(model, target)
    names = list(sel.capture.modules)
    g = torch.cat([exact[f"{n}.weight"].reshape(12, -1) for n in names], dim=1).double()
    t = torch.cat([exact_t[f"{n}.weight"].reshape(4, -1) for n in names], dim=1).double().sum(0)
    want = np.argsort(-((g @ t) / g.norm(dim=1)).numpy(), kind="stable")
    assert np.array_equal(new[2:14], 2 + want)
    assert not np.array_equal(np.argsort(-(g @ t).numpy(), kind="stable"), want)
    sel.close()


SOURCES = {i: "abc"[i % 3] if i < 10 else "c" for i in range(16)}
"""Data source of each of 16 ids: sources of 4, 3 and 5 examples in the window 2..13."""


def _sampled_selector(tmp_path, policy, measure):
    """A tiny OLMo, 16 data and 4 target passages, and a selector measuring ``measure`` of a window of
    12 exactly (unprojected, not preconditioned)."""
    torch.manual_seed(0)
    model = tiny_olmo()
    data, target = _tokens(16), _tokens(4, seed=1)
    (tmp_path / "target.txt").write_text("t\n")
    cfg = SelectionConfig(enabled=True, every_n=1, window=12, policy=policy, target=str(tmp_path / "target.txt"),
                          proj_dim=0, target_examples=4, micro_batch=4, precondition=False, measure=measure)
    sel = OnlineSelector(cfg, model, forward=lambda m, ids: m(ids).logits, log_folder=tmp_path / "sel",
                         target_tokens=target)
    return model, data, target, cfg, sel


def _exact_scored_rows(model, sel, data, target, window, rows):
    """``(rows' exact gradients off their mean direction at their mean length [len(rows), D], the
    target's mean-token gradient [D])``: what a round with remove_common and normalize compares,
    from torch.func (``rows``: window positions, the ones that count in the window's means)."""
    model.eval()
    names = list(sel.capture.modules)
    exact, exact_t = exact_per_example_grads(model, data[window]), exact_per_example_grads(model, target)
    g = torch.cat([exact[f"{n}.weight"].reshape(len(window), -1) for n in names], dim=1).double()
    t = torch.cat([exact_t[f"{n}.weight"].reshape(len(target), -1) for n in names], dim=1).double().sum(0)
    t = t / (len(target) * (target.shape[1] - 1))
    m = g[rows]
    mean = m.mean(0)
    m = m - torch.outer(m @ mean, mean) / mean.dot(mean)
    return m * m.norm(dim=1, keepdim=True).mean() / m.norm(dim=1, keepdim=True), t


@pytest.mark.parametrize("policy", ["greats", "alignment"])
def test_a_measured_sample_scores_the_rest_by_their_source(tmp_path, policy):
    """``measure: 6`` of a 12-example window from 3 sources: only 6 examples are forwarded; with
    exact gradients of those 6 (off their mean direction, equal lengths), every other example is
    scored as its source's mean measured row (greats) or mean score (alignment)."""
    model, data, target, cfg, sel = _sampled_selector(tmp_path, policy, measure=6)
    label = SOURCES
    fetched = []

    def fetch(ids):
        fetched.extend(ids.tolist())
        return data[ids]

    new, stats = sel.run(step=1, epoch=0, order=np.arange(16), start=2, fetch=fetch, lr=0.1, tokens_per_batch=48,
                         batch_size=4, sources=lambda ids: [label[int(i)] for i in ids])
    assert len(fetched) == 6 and stats["examples_measured"] == 6 and stats["examples_rescored"] == 12
    window = np.arange(2, 14)
    groups = [label[int(i)] for i in window]
    counts = {g: sum(label[i] == g for i in fetched) for g in "abc"}
    assert all(abs(counts[g] - 6 * groups.count(g) / 12) < 1 for g in "abc"), counts       # in proportion
    measured = np.sort(np.asarray(fetched)) - 2
    m, t = _exact_scored_rows(model, sel, data, target, window, measured)
    by_source = {s: [k for k, i in enumerate(measured) if groups[i] == s] for s in "abc"}
    eta = 0.1 / 48
    if policy == "greats":
        rows = torch.stack([m[list(measured).index(i)] if i in measured else m[by_source[groups[i]]].mean(0)
                            for i in range(12)])
        want, _ = greats_order(rows, t, eta, 4, curvature=eta ** 2)
    else:
        score = (m @ t).numpy()
        full = np.array([score[list(measured).index(i)] if i in measured else score[by_source[groups[i]]].mean()
                         for i in range(12)])
        want = np.argsort(-full, kind="stable")
    assert np.array_equal(new[2:14], 2 + want)
    full_cfg = SelectionConfig(**{**cfg.__dict__, "measure": 0})
    every = OnlineSelector(full_cfg, model, forward=lambda m, ids: m(ids).logits, log_folder=tmp_path / "all",
                           target_tokens=target)
    model.train()
    all_new, _ = every.run(step=1, epoch=0, order=np.arange(16), start=2, fetch=lambda ids: data[ids], lr=0.1,
                           tokens_per_batch=48, batch_size=4)
    assert not np.array_equal(all_new, new)         # the sample made a difference (the check can fail)
    sel.close()
    every.close()


def test_measured_sample_is_proportional_and_reproducible():
    from olmo_tda.training.selector import impute_rows, measured_sample

    groups = ["a"] * 50 + ["b"] * 30 + ["c"] * 20
    for seed in range(20):
        s = measured_sample(100, 17, groups, seed)
        assert len(s) == 17 and np.array_equal(s, np.unique(s))
        for g, n in (("a", 50), ("b", 30), ("c", 20)):
            assert abs(sum(groups[i] == g for i in s) - 17 * n / 100) < 1
        assert np.array_equal(s, measured_sample(100, 17, groups, seed))
    assert not np.array_equal(measured_sample(100, 17, groups, 0), measured_sample(100, 17, groups, 1))
    assert np.array_equal(measured_sample(10, 0, None, 0), np.arange(10))
    assert np.array_equal(measured_sample(10, 12, None, 0), np.arange(10))
    assert len(measured_sample(10, 4, None, 0)) == 4
    rows = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 4.0]])
    out = impute_rows(rows, np.array([0, 1, 2]), 6, ["x", "y", "x", "y", "x", "z"])
    assert torch.equal(out[:3], rows) and torch.equal(out[3], rows[1])         # y: its one measured row
    assert torch.equal(out[4], torch.tensor([3.0, 2.0]))                        # x: the mean of rows 0 and 2
    assert torch.equal(out[5], rows.mean(0))                                    # z: none measured -> all
    assert torch.equal(impute_rows(rows, np.array([0, 1, 2]), 4, None)[3], rows.mean(0))
    with pytest.raises(ConfigError, match="tda.selection.measure"):
        TDAConfig.from_dict({"selection": {"measure": -1}})


def test_capture_scales_and_moments_refuse_bad_input():
    from olmo_tda.capture import GradientCapture, CaptureError
    from olmo_tda.config import CaptureConfig

    model = tiny_olmo()
    cap = GradientCapture(model, CaptureConfig(proj_dim=4))
    name = next(iter(cap.modules))
    with pytest.raises(CaptureError, match="not a captured layer"):
        with cap.scaled({"nope": (torch.ones(1), torch.ones(1))}):
            pass
    with pytest.raises(CaptureError, match=f"scales of {name}"):
        with cap.scaled({name: (torch.ones(3), torch.ones(3))}):
            pass
    with cap.moments():
        with pytest.raises(CaptureError, match="cannot be nested"):
            with cap.moments():
                pass
    with pytest.raises(ConfigError, match="precondition_damping"):
        TDAConfig.from_dict({"selection": {"precondition_damping": 0}})
    cap.remove()


def test_round_at_the_end_of_the_epoch_does_nothing(tmp_path):
    model = tiny_olmo()
    cfg = SelectionConfig(enabled=True, every_n=1, window=4, policy="loss")
    sel = OnlineSelector(cfg, model, forward=lambda m, ids: m(ids).logits, log_folder=tmp_path)
    data = _tokens(8)
    new, _ = sel.run(step=3, epoch=0, order=np.arange(8), start=8, fetch=lambda ids: data[ids], lr=1.0,
                     tokens_per_batch=1, batch_size=1)
    assert new is None
    new, _ = sel.run(step=4, epoch=0, order=np.arange(8), start=6, fetch=lambda ids: data[ids], lr=1.0,
                     tokens_per_batch=1, batch_size=1)      # a window cut short by the epoch's end
    assert sorted(new[6:].tolist()) == [6, 7]


def test_rounds_start_at_start_step(tmp_path):
    (tmp_path / "target.txt").write_text("t\n")
    cfg = SelectionConfig(enabled=True, every_n=10, window=4, policy="loss", start_step=25)
    sel = OnlineSelector(cfg, tiny_olmo(), forward=lambda m, ids: m(ids).logits, log_folder=tmp_path / "sel")
    assert [s for s in range(0, 61) if sel.due(s)] == [30, 40, 50, 60]
    sel.config.start_step = 0
    assert [s for s in range(0, 31) if sel.due(s)] == [10, 20, 30]
    sel.close()
    with pytest.raises(ConfigError, match="tda.selection.start_step"):
        TDAConfig.from_dict({"selection": {"start_step": -1}})


def test_two_rank_preconditioned_round_equals_one_process(tmp_path):
    """2-rank gloo: each rank measures half the window and half the target; the moments are summed
    over ranks before the preconditioner is formed, so both ranks apply the order one process finds —
    also when the split is uneven and a rank's padding rows (repeats) must not count in the moments,
    and when only a sample of the window is measured."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(here / "_selector_worker.py"), str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=here)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    from _selector_worker import SPLITS, round_scores
    assert any(w % 2 and t % 2 for w, t, _ in SPLITS) and any(m for *_, m in SPLITS)   # uneven; sampled
    for k, (window, target_examples, measure) in enumerate(SPLITS):
        two = np.load(tmp_path / f"two_ranks_{k}.npy")
        (tmp_path / f"one{k}").mkdir()
        order, promoted = round_scores(tmp_path / f"one{k}", tmp_path / f"one{k}" / "sel", window, target_examples,
                                       measure)
        assert np.array_equal(two[0, :-1], two[1, :-1])                   # both ranks apply one order
        assert np.array_equal(two[0, :-1].astype(np.int64), order)        # the one a single process finds
        assert two[0, -1] == pytest.approx(promoted, rel=1e-4), (window, target_examples)


def test_selection_target_is_read_by_its_suffix_and_checked(tmp_path):
    """Texts, JSONL and token files give the same rows whatever the suffix's case; a file of another
    type, a token file of the wrong size or with ids outside the vocabulary, and a JSONL text that is
    not a string are refused naming the file, never read as nonsense ids."""
    from olmo_tda.training.selector import load_target

    def encode(text):
        return list(text.encode())

    lines = ["the quick brown fox", "jumps over the lazy dog", "and runs away"]
    want = list(b"the quick brown fox") + [0] + list(b"jumps over the lazy dog") + [0] + list(b"and runs away") + [0]
    want = torch.tensor(want[:len(want) // 8 * 8]).reshape(-1, 8)
    for name in ("t.txt", "t.TXT", "t.text", "t.md"):
        (tmp_path / name).write_text("\n\n".join(lines) + "\n")
        assert torch.equal(load_target(tmp_path / name, 8, encode, num=100, eos_token_id=0, vocab_size=257), want)
    # a document's own newlines stay newlines (code, poems): only a blank line ends a document
    (tmp_path / "code.txt").write_text("def f():\n    return 1\n\n\n  \nx = f()\n")
    doc = list(b"def f():\n    return 1") + [0] + list(b"x = f()") + [0]
    got = load_target(tmp_path / "code.txt", 4, encode, num=100, eos_token_id=0)
    assert got.flatten().tolist() == doc[:len(doc) // 4 * 4]
    (tmp_path / "t.JSONL").write_text("".join(json.dumps({"text": x}) + "\n" for x in lines))
    assert torch.equal(load_target(tmp_path / "t.JSONL", 8, encode, num=100, eos_token_id=0), want)
    np.asarray(want.flatten(), dtype=np.uint16).tofile(tmp_path / "t.bin")      # OLMo's raw memmap
    assert torch.equal(load_target(tmp_path / "t.bin", 8, encode, num=100, eos_token_id=0, vocab_size=257), want)
    np.save(tmp_path / "t.npy", want.numpy())
    assert torch.equal(load_target(tmp_path / "t.npy", 8, encode, num=2, eos_token_id=0), want[:2])

    np.save(tmp_path / "one.npy", want.numpy()[:, :1])      # rows without a next token to predict
    with pytest.raises(ValueError, match=re.escape("one.npy: rows of 1 token(s) (shape (7, 1)); each needs")):
        load_target(tmp_path / "one.npy", 8, encode, num=4, eos_token_id=0)
    (tmp_path / "t.csv").write_text("a,b\n")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    (tmp_path / "bad.jsonl").write_text('{"text": 3}\n')
    (tmp_path / "big.bin").write_bytes(b"ab" * 64)             # two bytes of text read as one id: 25185
    for name, message in (("t.csv", "unknown file type '.csv'"), ("odd.bin", "3 bytes is not a whole number"),
                          ("bad.jsonl", "bad.jsonl:1: 'text' is int, not a string"),
                          ("big.bin", "token ids span [25185, 25185], outside the model's vocabulary [0, 257)")):
        with pytest.raises(ValueError, match=re.escape(message)):
            load_target(tmp_path / name, 8, encode, num=4, eos_token_id=0, vocab_size=257)


@pytest.mark.parametrize("policy", ["greats", "alignment", "loss"])
def test_an_example_with_a_nonfinite_gradient_goes_last_and_the_round_still_ranks_the_rest(tmp_path, caplog, policy):
    """One NaN/inf example once made every score NaN (the common direction and mean norm span all
    rows) and the round kept the old order as if scored; now it is set aside, placed last and named."""
    model = tiny_olmo()
    data, target = _tokens(16), _tokens(4, seed=1)
    (tmp_path / "target.txt").write_text("t\n")
    cfg = SelectionConfig(enabled=True, every_n=1, window=12, policy=policy, target=str(tmp_path / "target.txt"),
                          proj_dim=16, target_examples=4, micro_batch=5)
    sel = OnlineSelector(cfg, model, forward=lambda m, ids: m(ids).logits, log_folder=tmp_path / "sel",
                         target_tokens=target)
    real = sel._measure_window

    def overflowed(ids, fetch):                   # window position 3 (id 5) overflows
        grads, losses, length = real(ids, fetch)
        if grads is not None:
            grads[3, 0] = float("inf")
        losses[3] = float("nan")
        return grads, losses, length
    sel._measure_window = overflowed
    with caplog.at_level("WARNING"):
        new, stats = sel.run(step=1, epoch=0, order=np.arange(16), start=2, fetch=lambda ids: data[ids], lr=0.1,
                             tokens_per_batch=48, batch_size=4)
    assert sorted(new[2:14]) == list(range(2, 14)) and new[13] == 5        # a permutation, id 5 last
    assert "1 examples have a non-finite gradient or loss and go last in the window: ids [5]" in caplog.text
    hist = sel.log.rounds()[-1]["score_hist"]
    assert sum(hist["counts"]) == 11 and np.isfinite(hist["edges"]).all()    # the 11 scored ones
    with pytest.raises(SelectionError, match="batch_size must be >= 1"):
        greats_order(torch.randn(4, 3), torch.randn(3), 0.1, 0)
    if policy != "loss":                                    # a NaN target: the round (on every rank) refuses
        sel._target_gradient = lambda: torch.full((sel.capture.floats_per_example,), float("nan"))
        with pytest.raises(SelectionError, match="the target gradient is not finite"):
            sel.run(step=2, epoch=0, order=new, start=6, fetch=lambda ids: data[ids], lr=0.1, tokens_per_batch=48,
                    batch_size=4)
    sel.close()


@pytest.mark.parametrize("policy", ["greats", "alignment"])
def test_a_set_aside_example_counts_in_no_window_mean(tmp_path, policy):
    """A measured example whose gradient overflows is zeroed and placed last; it must not count as a
    zero in the common direction, the mean norm or its source's mean that stands in for the
    unmeasured: the rest are ranked as if it had not been measured (exact torch.func ground truth)."""
    model, data, target, _, sel = _sampled_selector(tmp_path, policy, measure=7)
    label = SOURCES
    real, fetched = sel._measure_window, []

    def overflowed(ids, fetch):                 # the second measured example overflows
        fetched.extend(ids.tolist())
        grads, losses, length = real(ids, fetch)
        grads[1, 0] = float("inf")
        return grads, losses, length
    sel._measure_window = overflowed
    new, _ = sel.run(step=1, epoch=0, order=np.arange(16), start=2, fetch=lambda ids: data[ids], lr=0.1,
                     tokens_per_batch=48, batch_size=4, sources=lambda ids: [label[int(i)] for i in ids])
    window = np.arange(2, 14)
    groups = [label[int(i)] for i in window]
    measured = np.asarray(fetched) - 2
    bad, good = measured[1], np.delete(measured, 1)
    m, t = _exact_scored_rows(model, sel, data, target, window, good)     # the means: good measured rows only
    row = {int(i): m[k] for k, i in enumerate(good)}
    by_source = {s: [k for k, i in enumerate(good) if groups[i] == s] for s in "abc"}
    eta = 0.1 / 48
    if policy == "greats":
        rows = torch.stack([torch.zeros_like(m[0]) if i == bad else row[i] if i in row
                            else m[by_source[groups[i]]].mean(0) for i in range(12)])
        want, full = greats_order(rows, t, eta, 4, curvature=eta ** 2)
    else:
        score = (m @ t).numpy()
        full = np.array([score[list(good).index(i)] if i in good else score[by_source[groups[i]]].mean()
                         for i in range(12)])
        want = np.argsort(-full, kind="stable")
    want = np.concatenate([want[want != bad], [bad]])
    assert np.array_equal(new[2:14], 2 + want)
    logged = sel.log.previous_scores(0, 2)             # what the round scored, by id
    assert logged[2 + bad] == -np.inf
    got = np.array([logged[2 + i] for i in range(12) if i != bad])
    np.testing.assert_allclose(got, np.delete(full, bad), rtol=1e-4, atol=1e-6 * np.abs(full).max())
    sel.close()


def test_rank_corr_prev_survives_a_resume(tmp_path):
    """The first round after a resume compares its scores with the last logged round's, read from
    the log's scores file, exactly as the uninterrupted run did in memory; a truncated round's scores
    file goes with it."""
    model = tiny_olmo()
    data, target = _tokens(24), _tokens(4, seed=1)
    (tmp_path / "target.txt").write_text("t\n")
    cfg = SelectionConfig(enabled=True, every_n=1, window=12, policy="alignment",
                          target=str(tmp_path / "target.txt"), proj_dim=16, target_examples=4, micro_batch=6)

    def selector(folder):
        return OnlineSelector(cfg, model, forward=lambda m, ids: m(ids).logits, log_folder=folder,
                              target_tokens=target)

    def two_rounds(sel, resume_between=False):
        kw = dict(epoch=0, fetch=lambda ids: data[ids], lr=0.1, tokens_per_batch=48, batch_size=4)
        order, first = sel.run(step=1, order=np.arange(24), start=2, **kw)
        if resume_between:
            sel.close()
            sel = selector(sel.log.folder)      # a new process: nothing in memory
            assert sel.log.truncate_after(0, 1) == 0
        _, second = sel.run(step=2, order=order, start=6, **kw)
        sel.close()
        return first, second

    first, straight = two_rounds(selector(tmp_path / "a"))
    assert first["rank_corr_prev"] is None and straight["rank_corr_prev"] is not None
    assert straight["rank_corr_common"] == 8                    # window positions 6..13 were scored twice
    _, resumed = two_rounds(selector(tmp_path / "b"), resume_between=True)
    assert resumed["rank_corr_prev"] == pytest.approx(straight["rank_corr_prev"], abs=1e-12)
    log = SelectionLog(tmp_path / "b")
    scores = sorted(p.name for p in (tmp_path / "b").glob("*.scores.npy"))
    assert scores == [r["scores_file"] for r in log.rounds()] and len(scores) == 2
    assert log.truncate_after(0, 1) == 1 and len(list((tmp_path / "b").glob("*.scores.npy"))) == 1
    (tmp_path / "b" / scores[0]).write_bytes(b"junk")       # a damaged scores file loses only the statistic
    assert log.previous_scores(0, 2) is None
