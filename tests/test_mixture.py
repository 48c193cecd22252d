"""The ``sources`` selection policy's parts: source scores from captured rows against a brute-force
float64 computation (per-example gradients from ``torch.func``), the weights and quotas they give,
the pull-forward order rewrite and its replay from the round log, and the mixer's checkpoint state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from olmo_tda.capture import GradientCapture
from olmo_tda.config import CaptureConfig, ConfigError, SelectionConfig
from olmo_tda.training.mixture import SourceMixer, pull_forward, quotas
from olmo_tda.training.selection import SelectionError, SelectionLog

V, T, H = 11, 6, 8          # vocabulary, tokens per example, hidden width


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.fc = nn.Linear(H, H, bias=False)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(self.emb(x))))


def _summed_loss(model, x):
    logits = model(x)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1), reduction="sum")


def _exact_rows(model: nn.Module, x: torch.Tensor, names: list[str], proj: dict | None) -> torch.Tensor:
    """``[B, D]`` float64: each example's summed-token-loss gradient of ``names``' weights from
    torch.func, projected as ``P_out G P_inᵀ`` when ``proj`` holds the matrices."""
    m64 = TinyLM().double()
    m64.load_state_dict(model.state_dict())
    params = {k: v.detach() for k, v in m64.named_parameters()}

    def loss(p, xi):
        return _summed_loss(lambda inp: functional_call(m64, p, (inp,)), xi[None])

    grads = vmap(grad(loss), in_dims=(None, 0))(params, x)
    cols = []
    for n in names:
        g = grads[f"{n}.weight"]                                  # [B, O, I]
        if proj is not None:
            p_out, p_in = (m.double() for m in proj[n])
            g = p_out @ g @ p_in.T
        cols.append(g.reshape(len(x), -1))
    return torch.cat(cols, dim=1)


def _captured_rows(cap: GradientCapture, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with cap.record(np.arange(len(x))) as rec:
        _summed_loss(model, x).backward()
    model.zero_grad()
    return torch.cat([g.reshape(len(x), -1) for g in rec.dense().values()], dim=1)


def _brute_scores(rows: torch.Tensor, source: np.ndarray, target: torch.Tensor, shares: np.ndarray,
                  precondition: bool, damping: float) -> np.ndarray:
    """The policy's cosine, written out with loops in float64."""
    rows, target = rows.double(), target.double()
    means = [rows[torch.as_tensor(source == s)].mean(dim=0) for s in range(len(shares))]
    common = sum(float(shares[s]) * means[s] for s in range(len(shares))) / float(shares.sum())
    direction = target.clone()
    if precondition:
        v = (rows ** 2).mean(dim=0)
        v = torch.clamp(v, min=damping * float(v.mean()))
        direction = direction / v.sqrt()
    out = []
    for s in range(len(shares)):
        d = means[s] - common
        out.append(float(d @ direction / (d.norm() * direction.norm())))
    return np.array(out)


@pytest.mark.parametrize("proj_dim", [0, 4])
@pytest.mark.parametrize("precondition", [True, False])
def test_source_scores_from_captured_rows_equal_brute_force_float64(proj_dim, precondition):
    torch.manual_seed(0)
    model = TinyLM()
    cap = GradientCapture(model, CaptureConfig(proj_dim=proj_dim, seed=3, modules=["fc", "head"]))
    names = list(cap.layer_shapes)
    proj = {n: cap.projection(n) for n in names} if proj_dim else None
    gen = torch.Generator().manual_seed(1)
    # three sources with different token statistics, seen over two steps
    steps = [torch.randint(0, V, (9, T), generator=gen) for _ in range(2)]
    for x in steps:
        x[:3] %= 4                     # source 0: low ids
        x[3:6] = x[3:6] % 4 + 7        # source 1: high ids
    source = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2])
    target_x = torch.randint(0, 4, (5, T), generator=gen)
    shares = np.array([0.5, 0.3, 0.2])
    mixer = SourceMixer(["low", "high", "any"], shares=shares, precondition=precondition, min_rows=1)
    for x in steps:                     # what the trainer does each step: this step's rows, then a fold
        mixer.observe(source, _captured_rows(cap, model, x))
        mixer.sync()
    # the target: the mean-token-loss gradient through the same capture (any scale: a cosine)
    mixer.set_target(_captured_rows(cap, model, target_x).double().sum(dim=0))
    got = mixer.scores()

    rows = torch.cat([_exact_rows(model, x, names, proj) for x in steps])
    exact_target = _exact_rows(model, target_x, names, proj).sum(dim=0)
    want = _brute_scores(rows, np.concatenate([source, source]), exact_target, shares, precondition, 0.01)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert got[0] > got[1]              # the target is low ids: the low-id source scores above the high-id one
    cap.remove()


def test_a_row_with_nan_is_left_out_and_sums_decay_per_round():
    mixer = SourceMixer(["a", "b"], shares=[1, 1], min_rows=1, decay=0.5)
    rows = torch.tensor([[1.0, 0.0], [float("nan"), 1.0], [0.0, 2.0]])
    mixer.observe(np.array([0, 0, 1]), rows)
    mixer.sync()
    assert mixer.counts.tolist() == [1.0, 1.0] and mixer.sums.tolist() == [[1.0, 0.0], [0.0, 2.0]]
    mixer.end_round()
    assert mixer.counts.tolist() == [0.5, 0.5] and mixer.sums.tolist() == [[0.5, 0.0], [0.0, 1.0]]


def test_weights_follow_accumulated_evidence_with_a_floor():
    mixer = SourceMixer(["a", "b", "c"], shares=[0.5, 0.25, 0.25], temperature=0.5, memory=0.5, floor=0.2)
    z = mixer.accumulate(np.array([0.4, 0.0, -0.4]))
    z = mixer.accumulate(np.array([0.2, 0.0, 0.0]))
    np.testing.assert_allclose(z, [0.4 * 0.5 + 0.2, 0.0, -0.2])
    raw = np.array([0.5, 0.25, 0.25]) * np.exp(z / 0.5)
    want = 0.8 * raw / raw.sum() + 0.2 * np.array([0.5, 0.25, 0.25])
    np.testing.assert_allclose(mixer.weights(), want)
    assert mixer.weights().sum() == pytest.approx(1.0)


def test_quotas_sum_cap_and_follow_the_weights():
    assert quotas(np.array([0.5, 0.3, 0.2]), np.array([100, 100, 100]), 10).tolist() == [5, 3, 2]
    # a capped source gives its share to the others, in proportion to their weights
    assert quotas(np.array([0.8, 0.1, 0.1]), np.array([2, 100, 100]), 10).tolist() == [2, 4, 4]
    assert quotas(np.array([1.0, 0.0]), np.array([3, 5]), 10).tolist() == [3, 5]      # fewer left than asked
    got = quotas(np.array([0.37, 0.41, 0.22]), np.array([1000] * 3), 97)
    assert got.sum() == 97 and np.all(np.abs(got - np.array([0.37, 0.41, 0.22]) * 97) < 1)


def test_pick_draws_each_sources_next_examples_by_quota():
    order = np.arange(40)
    source_of = lambda ids: ids % 4       # noqa: E731
    mixer = SourceMixer(list("abcd"), shares=[1, 1, 1, 1])
    ids, counts = mixer.pick(order, 8, source_of, 12, np.array([0.5, 0.25, 0.25, 0.0]), seed=1)
    assert counts.tolist() == [6, 3, 3, 0]
    # source a's next six unconsumed ids (position >= 8), b's and c's next three, shuffled together
    assert sorted(ids.tolist()) == sorted([8, 12, 16, 20, 24, 28, 9, 13, 17, 10, 14, 18])


def test_pull_forward_moves_ids_and_keeps_the_rest_in_order():
    order = np.array([5, 3, 9, 1, 7, 0, 2, 8, 6, 4])
    out = pull_forward(order, 3, np.array([8, 1]))
    assert out.tolist() == [5, 3, 9, 8, 1, 7, 0, 2, 6, 4]
    with pytest.raises(SelectionError, match="not distinct ids found at positions >= 3"):
        pull_forward(order, 3, np.array([3]))           # already consumed
    with pytest.raises(SelectionError):
        pull_forward(order, 3, np.array([8, 8]))


def test_the_round_log_replays_pull_rounds_and_window_rounds(tmp_path):
    log = SelectionLog(tmp_path / "sel")
    base = np.arange(20)
    log.append(epoch=0, step=2, start=4, keep=3, window_ids=np.array([15, 4, 11]), stats={}, rule="pull")
    after_first = pull_forward(base, 4, np.array([15, 4, 11]))
    log.append(epoch=0, step=4, start=8, keep=2, window_ids=after_first[8:12][::-1].copy(), stats={})
    from olmo_tda.training.selection import rewrite_order

    want = rewrite_order(after_first, 8, after_first[8:12][::-1].copy(), 2)
    got, applied = log.replay(base, 0, 10)
    assert applied == 2 and got.tolist() == want.tolist()
    assert log.rounds()[0]["rule"] == "pull" and "rule" not in log.rounds()[1]


def test_mixer_state_round_trips_and_refuses_other_sources():
    a = SourceMixer(["x", "y"], shares=[1, 3], min_rows=1)
    a.observe(np.array([0, 1, 1]), torch.randn(3, 5))
    a.sync()
    a.set_target(torch.randn(5))
    a.accumulate(a.scores())
    a.end_round()
    b = SourceMixer(["x", "y"], shares=[1, 3], min_rows=1)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.sums, b.sums) and np.array_equal(a.evidence, b.evidence) and b.rounds == 1
    np.testing.assert_array_equal(a.weights(), b.weights())
    with pytest.raises(ValueError, match="keep data.paths"):
        SourceMixer(["y", "x"], shares=[1, 1]).load_state_dict(a.state_dict())


def test_config_checks_the_sources_settings(tmp_path):
    target = tmp_path / "t.txt"
    target.write_text("x\n")
    with pytest.raises(ConfigError, match="selection.target"):
        SelectionConfig(enabled=True, policy="sources").validate()
    for key, bad in (("source_temperature", 0.0), ("source_memory", 1.0), ("source_floor", 1.5),
                     ("target_every", 0), ("source_decay", -0.1)):
        with pytest.raises(ConfigError, match=f"selection.{key}"):
            SelectionConfig(enabled=True, policy="sources", target=str(target), **{key: bad}).validate()


def test_the_deepspeed_callback_refuses_the_sources_policy_by_name(tmp_path):
    from olmo_tda.integrations.deepspeed import DeepSpeedSelection

    target = tmp_path / "t.txt"
    target.write_text("x\n")
    cfg = SelectionConfig(enabled=True, policy="sources", target=str(target))
    cfg.validate()
    with pytest.raises(ConfigError, match="policy sources runs in OLMo runs"):
        DeepSpeedSelection(object(), cfg, order=None, fetch=None, forward=None, seq_len=8, log_folder=tmp_path)
