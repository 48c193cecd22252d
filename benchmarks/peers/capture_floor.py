"""Where the time of our capture pass goes, on a peers workload (the ``attr`` pass of the peers table).

Five passes over the workload's training examples, interleaved, medians of ``--repeats``:

- ``bare``: forward + backward with nothing captured (weights frozen: ``activation_grads_only``);
- ``minimal``: a hand-written floor for our design — a forward hook that projects each layer's
  input and a tensor hook that projects its output gradient and adds ``Gᵀ A`` with one bmm, using
  our projector matrices; no records, checks, ids or store;
- ``fused``: the same products with each projection folded into a matmul the layer does anyway —
  ``x [W; P_in]ᵀ`` in the forward, ``g [W, P_outᵀ]`` in the backward (one GEMM each instead of two;
  the layer's forward is swapped for a custom autograd function, weights frozen as in every pass);
- ``ours_nostore``: :class:`~olmo_tda.GradientCapture` with its records assembled (``stored()``);
- ``ours``: the same, appended to a :class:`~olmo_tda.store.GradientStore` (what the table times).

Then the GEMMs of each scored layer at the workload's batch: the layer's own forward matmul, our
projection of its input and of its output gradient (``F.linear(x, P)``), and the same projections
computed transposed (``P @ xᵀ``).

    python -m benchmarks.peers.capture_floor --workdir /tmp/pwo     # a peers run's workdir (~1 min)
    python -m benchmarks.peers.capture_floor --arch olmo            # prepares a fresh workload first
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from olmo_tda import CaptureConfig, GradientCapture
from olmo_tda.capture import activation_grads_only
from olmo_tda.config import StoreConfig
from olmo_tda.store import GradientStore

from .workload import ARCHS, Workload, example_losses, load, prepare, threads, warm_up

PASSES = ("bare", "minimal", "fused", "ours_nostore", "ours")
HOOKED = ("bare", "minimal", "fused")     # passes that bypass GradientCapture's own hooks


def _minimal_hooks(cap: GradientCapture, sink: list) -> Callable[[], None]:
    """The floor: project both sides, one bmm a layer; ``(layer, [B, k_out, k_in])`` appended to
    ``sink``. Returns what removes the hooks."""
    handles = []
    for name, module in cap.modules.items():
        p_out, p_in = cap.projectors[name].matrices()

        def forward(m, args, out, name=name, p_in=p_in, p_out=p_out):
            a = args[0].detach()
            acts = F.linear(a.reshape(a.shape[0], -1, a.shape[-1]), p_in)

            def on_grad(g, acts=acts):
                grads = F.linear(g.reshape(g.shape[0], -1, g.shape[-1]), p_out)
                sink.append((name, torch.bmm(grads.transpose(1, 2), acts)))
            out.register_hook(on_grad)
        handles.append(module.register_forward_hook(forward))
    return lambda: [h.remove() for h in handles]


class _FusedLinear(torch.autograd.Function):
    """``y = x Wᵀ + b`` computed as the first ``n_out`` columns of ``x [W; P_in]ᵀ``, whose last
    columns are the projected input; the backward's ``g [W, P_outᵀ]`` gives the input gradient and
    the projected output gradient in one GEMM. Weights are frozen: no weight gradient."""

    @staticmethod
    def forward(ctx, x, w_cat, b_cat, back_cat, n_out, name, sink):
        y = F.linear(x.reshape(-1, x.shape[-1]), w_cat, b_cat)
        ctx.acts = y[:, n_out:].reshape(x.shape[0], -1, w_cat.shape[0] - n_out)
        ctx.back_cat, ctx.x_shape, ctx.name, ctx.sink = back_cat, x.shape, name, sink
        return y[:, :n_out].reshape(*x.shape[:-1], n_out)

    @staticmethod
    def backward(ctx, g):
        n_in = ctx.x_shape[-1]
        both = g.reshape(-1, g.shape[-1]) @ ctx.back_cat
        grads = both[:, n_in:].reshape(ctx.x_shape[0], -1, both.shape[1] - n_in)
        ctx.sink.append((ctx.name, torch.bmm(grads.transpose(1, 2), ctx.acts)))
        return both[:, :n_in].reshape(ctx.x_shape), None, None, None, None, None, None


def _fused_forwards(cap: GradientCapture, sink: list) -> Callable[[], None]:
    """Each scored layer's forward swapped for :class:`_FusedLinear` (same ``sink`` entries as
    :func:`_minimal_hooks`). Returns what restores the layers."""
    swapped = []
    for name, module in cap.modules.items():
        p_out, p_in = cap.projectors[name].matrices()
        w = module.weight.detach()
        w_cat = torch.cat([w, p_in]).contiguous()
        b_cat = None if module.bias is None else torch.cat([module.bias.detach(), p_in.new_zeros(len(p_in))])
        back_cat = torch.cat([w, p_out.T], dim=1).contiguous()

        def forward(x, name=name, w_cat=w_cat, b_cat=b_cat, back_cat=back_cat, n_out=w.shape[0]):
            return _FusedLinear.apply(x, w_cat, b_cat, back_cat, n_out, name, sink)
        module.forward = forward
        swapped.append(module)

    def restore() -> None:
        for module in swapped:
            del module.forward
    return restore


FLOOR_HOOKS = {"minimal": _minimal_hooks, "fused": _fused_forwards}
"""The hand-written floor passes: ``kind -> install(cap, sink)``, which returns what uninstalls."""


def products(kind: str, model, cfg: CaptureConfig, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{layer: [B, k_out, k_in]}``: what the ``minimal`` or ``fused`` pass computes for ``batch``."""
    cap = GradientCapture(model, cfg)
    sink: list = []
    undo = FLOOR_HOOKS[kind](cap, sink)
    cap.remove()
    try:
        with activation_grads_only(model):
            example_losses(model(batch), batch).sum().backward()
    finally:
        undo()
    return dict(sink)


def time_pass(kind: str, w: Workload, model, train: torch.Tensor, cfg: CaptureConfig) -> float:
    """Examples per second of one pass of ``kind`` over ``train``."""
    cap = GradientCapture(model, cfg)
    sink: list = []
    undo = FLOOR_HOOKS[kind](cap, sink) if kind in FLOOR_HOOKS else None
    if kind in HOOKED:
        cap.remove()
    tmp = tempfile.TemporaryDirectory()
    t0 = time.perf_counter()
    store = GradientStore.create(Path(tmp.name) / "s", cap.store_metadata(), StoreConfig()) if kind == "ours" else None
    with activation_grads_only(model):
        for lo in range(0, len(train), w.batch):
            batch = train[lo:lo + w.batch]
            if kind in HOOKED:
                example_losses(model(batch), batch).sum().backward()
                sink.clear()
                continue
            with cap.record(np.arange(lo, lo + len(batch))) as rec:
                example_losses(model(batch), batch).sum().backward()
            if store is not None:
                store.append(rec.to_record(step=0, lr=0.0))
            else:
                rec.stored()
    if store is not None:
        store.close()
    seconds = time.perf_counter() - t0
    if undo is not None:
        undo()
    if kind not in HOOKED:
        cap.remove()
    tmp.cleanup()
    return len(train) / seconds


def _us(fn, reps: int = 50) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def gemm_rows(w: Workload, model, cfg: CaptureConfig, repeats: int) -> list[dict]:
    """Per scored layer, µs (median of ``repeats``) of its forward matmul (``matmul``) and of our
    projections of its input and output gradient, as ``F.linear`` and transposed (``_T``)."""
    cap = GradientCapture(model, cfg)
    rows = []
    rows_m = w.batch * w.seq_len
    gen = torch.Generator().manual_seed(0)
    for name, module in cap.modules.items():
        p_out, p_in = cap.projectors[name].matrices()
        a = torch.randn(rows_m, module.in_features, generator=gen)
        g = torch.randn(rows_m, module.out_features, generator=gen)
        fns = {"matmul": lambda: F.linear(a, module.weight.detach()),
               "proj_in": lambda: F.linear(a, p_in), "proj_in_T": lambda: p_in @ a.T,
               "proj_out": lambda: F.linear(g, p_out), "proj_out_T": lambda: p_out @ g.T}
        for fn in fns.values():
            _us(fn, 5)
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for key, fn in fns.items():
                samples[key].append(_us(fn))
        rows.append({"layer": name, "shape": [module.out_features, module.in_features],
                     "k": [p_out.shape[0], p_in.shape[0]],
                     **{k: round(statistics.median(v), 1) for k, v in samples.items()}})
    cap.remove()
    return rows


def run(workdir: Path, repeats: int) -> dict:
    w, model, train, _ = load(workdir)
    cfg = CaptureConfig(proj_dim=w.k, seed=0)
    warm_up(model, train[:w.batch])
    for kind in PASSES:                          # one untimed pass each: allocator and kernel warm-up
        time_pass(kind, w, model, train[:4 * w.batch], cfg)
    samples: dict[str, list[float]] = {k: [] for k in PASSES}
    for _ in range(repeats):
        for kind in PASSES:
            samples[kind].append(time_pass(kind, w, model, train, cfg))
    rate = {k: statistics.median(v) for k, v in samples.items()}
    return {"benchmark": "capture_floor", "workdir": str(workdir), "arch": w.arch, "repeats": repeats,
            "examples_per_s": {k: round(v, 1) for k, v in rate.items()},
            "runs": {k: [round(x) for x in v] for k, v in samples.items()},
            "minimal_over_bare": round(rate["minimal"] / rate["bare"], 3),
            "ours_over_bare": round(rate["ours"] / rate["bare"], 3),
            "ours_over_minimal": round(rate["ours"] / rate["minimal"], 3),
            "fused_over_minimal": round(rate["fused"] / rate["minimal"], 3),
            "store_cost": round(1 - rate["ours"] / rate["ours_nostore"], 3),
            "gemm_us": gemm_rows(w, model, cfg, repeats)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None, help="a peers run's workdir (default: a fresh one under /tmp)")
    p.add_argument("--arch", choices=ARCHS, default="linear", help="the model of a fresh workload (no --workdir)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats of the five passes")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    threads()
    workdir = Path(args.workdir or f"/tmp/olmo_tda_capture_floor_{args.arch}")
    if not (workdir / "model.pt").exists():
        prepare(workdir, Workload(arch=args.arch))
    out = run(workdir, args.repeats)
    rate = out["examples_per_s"]
    print(f"capture floor: {workdir} ({out['arch']}), examples/s, median of {args.repeats} interleaved repeats")
    for kind in PASSES:
        print(f"  {kind:13s} {rate[kind]:8.0f}  ({rate[kind] / rate['bare']:.2f} of bare)  runs {out['runs'][kind]}")
    print(f"  ours / minimal {out['ours_over_minimal']:.3f}; fused / minimal {out['fused_over_minimal']:.3f}; "
          f"the store costs {100 * out['store_cost']:.1f}% of the pass")
    print(f"{'layer':40s} {'out×in':>9s} {'k':>5s} {'layer µs':>9s} "
          f"{'P a':>7s} {'P aᵀ':>7s} {'P g':>7s} {'P gᵀ':>7s}")
    for r in out["gemm_us"]:
        print(f"{r['layer'][-40:]:40s} {'x'.join(map(str, r['shape'])):>9s} {'x'.join(map(str, r['k'])):>5s} "
              f"{r['matmul']:9.1f} {r['proj_in']:7.1f} {r['proj_in_T']:7.1f} "
              f"{r['proj_out']:7.1f} {r['proj_out_T']:7.1f}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
