"""Fidelity of the rows a run stores, through a whole run from scratch: a random projection, an
eigenbasis frozen at step 0, and an eigenbasis that follows the run, at equal bytes per example.

A tiny OLMo (the demo's model: d_model 128, 2 layers, byte tokens, AdamW 3e-3) pretrains **from
scratch** on the shipped demo corpus through ``TDATrainer`` (``olmo_tda.integrations.olmo_train.train``)
with capture on, once per arm, the same seed and data order:

- ``random``: ``proj_type: orthogonal`` (today's default kind), k per side;
- ``frozen``: ``proj_type: eigen``, the basis estimated before step 1 and kept;
- ``following``: ``proj_type: eigen`` with ``capture.basis_every`` (versions re-estimated from the
  training steps' own token rows).

Every layer stores k_out × k_in = k × k values in bfloat16 in every arm: equal bytes. The trainer
keeps the weights before each step of a window of ``--window`` steps ending at each of ``--points``
measurement points spread over the run (the trajectory the rows were captured along). At each
point, the rows stored for those steps (batch × window rows) are compared with exact per-example
gradients recomputed at the very weights each row was captured at (``proj_dim: 0`` capture, equal to
torch.func in tests/test_capture.py): per held-out query (passages never trained on), GradDot of the
query's exact gradient at the row's weights, projected with the row's own projection, against the
stored row, vs the exact GradDot; the Spearman over the rows, averaged over the queries. So each
number says how well the stored rows keep the ranking exact gradients give, where the run was.

``refresh_overhead`` = the following arm's seconds spent sampling token rows and refreshing the
basis / its training seconds (``train_step`` wall time), in the same run.
``olmo_1b_bytes_per_example`` is what ``configs/olmo_1b.yaml``'s capture stores per example
(OLMo-1B's 64 captured Linears, its proj_dim/budget, its store dtype).

    python benchmarks/fidelity_in_run.py                      # 600 steps, 6 points, 24 queries (~3 min, 2 cores)
    python benchmarks/fidelity_in_run.py --quick              # 600 steps, 4 points, 16 queries (~2 min)
    python benchmarks/fidelity_in_run.py --ceiling            # + a basis re-estimated at each point (the ceiling)
    python benchmarks/fidelity_in_run.py --arms following --d-model 512 --steps 200 --points 2   # overhead vs width

Prints a table, then one JSON line (last line).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parents[1]
QUICK = dict(steps=600, points=4, queries=16)


def kept_weights_trainer(keep: set[int], kept: dict, timing: list):
    """A TDATrainer that keeps the weights each step of ``keep`` runs at (before its update) and
    times its steps."""
    from olmo_tda.integrations.olmo import TDATrainer

    class Keeper(TDATrainer):
        def train_step(self, batch, reduce_global_loss=True):
            if self.global_step in keep:
                kept[self.global_step] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            t0 = time.perf_counter()
            out = super().train_step(batch, reduce_global_loss=reduce_global_loss)
            timing.append(time.perf_counter() - t0)
            return out

    return Keeper


def train_arm(arm: str, args, data: Path, work: Path, keep: set[int]):
    from olmo_tda.integrations.olmo import load_configs
    from olmo_tda.integrations.olmo_train import train

    capture = {"random": ["--tda.capture.proj_type=orthogonal"],
               "frozen": ["--tda.capture.proj_type=eigen"],
               "following": ["--tda.capture.proj_type=eigen", f"--tda.capture.basis_every={args.every}",
                             f"--tda.capture.basis_tokens={args.tokens}"]}[arm]
    capture.append(f"--tda.capture.basis_batches={args.basis_batches}")
    overrides = [f"--data.paths=[{data}]", f"--save_folder={work / arm}", f"--max_duration={args.steps}",
                 f"--stop_at={args.steps}", f"--save_interval_unsharded={args.steps}", f"--seed={args.seed}",
                 f"--global_train_batch_size={args.batch}", f"--device_train_microbatch_size={args.batch}",
                 "--console_log_interval=100000", f"--tda.capture.proj_dim={args.k}", "--tda.store.dtype=bfloat16",
                 "--tda.trajectory.enabled=false", f"--model.d_model={args.d_model}",
                 f"--model.n_heads={max(1, args.d_model // 32)}", *capture]
    cfg, tda = load_configs(ROOT / "configs" / "demo_tiny.yaml", overrides)
    kept, timing = {}, []
    train(cfg, tda, trainer_cls=kept_weights_trainer(keep, kept, timing))
    return cfg, kept, float(sum(timing))


def exact_grads(model, capture_cfg, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """float64 ``{layer: [n, O, I]}``: each sequence's summed next-token CE gradient, exactly."""
    from olmo_tda import GradientCapture
    from olmo_tda.capture import activation_grads_only

    cap = GradientCapture(model, capture_cfg)
    try:
        with activation_grads_only(model):
            with cap.record(np.arange(len(tokens))) as rec:
                logits = model(tokens).logits
                torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                                  reduction="sum").backward()
            model.zero_grad(set_to_none=True)
        return {n: g.double() for n, g in rec.dense().items()}
    finally:
        cap.remove()


def projections(arm: str, run_dir: Path, store, digest: str | None, model, cfg_capture, k: int):
    """``{layer: (P_out, P_in)}`` float64 that the arm's rows of a version were projected with."""
    from olmo_tda import GradientCapture
    from olmo_tda.capture.eigenbasis import EigenBasis

    if arm == "random":
        cap = GradientCapture(model, cfg_capture)
        try:
            return {n: tuple(m.double() for m in cap.projection(n)) for n in cap.projectors}
        finally:
            cap.remove()
    basis = store.load_basis(digest) if arm == "following" else EigenBasis.load(run_dir / "tda" / "basis.safetensors")
    out = {}
    for name, lb in basis.layers.items():
        p_out = lb.proj_out[:k] if k < lb.n_out else torch.eye(lb.n_out)
        p_in = lb.proj_in[:k] if k < lb.n_in else torch.eye(lb.n_in)
        out[name] = (p_out.double(), p_in.double())
    return out


def same_step_basis(model, store, cfg_capture, train_tokens: np.ndarray, point: int, batches: int):
    """The eigenbasis estimated at the weights the model holds now over the batches of the ``batches``
    steps up to ``point``: the basis a row would get if it were re-estimated where the row was taken."""
    from olmo_tda.capture.eigenbasis import estimate_eigenbasis

    tokens = [torch.from_numpy(train_tokens[b.ids].astype(np.int64))
              for b in store.iter_blocks(layers=[], steps=range(point - batches + 1, point + 1), block_size=10**6)]

    def summed(m, t):
        return torch.nn.functional.cross_entropy(m(t).logits[:, :-1].flatten(0, 1).float(), t[:, 1:].flatten(),
                                                 reduction="sum")
    return estimate_eigenbasis(model, tokens, summed, cfg_capture)


def measure(arm: str, args, cfg, kept: dict, run_dir: Path, train_tokens: np.ndarray, queries: torch.Tensor,
            points: list[int]) -> tuple[list[float], float, list[float]]:
    """Mean per-query Spearman at each point, the largest relative error of a stored row against the
    exact gradient projected with its own projection (the store's bfloat16 rounding), and (following
    arm, ``--ceiling``) the Spearman of the same exact rows projected with a basis re-estimated at each
    point's last step (the ceiling of any schedule)."""
    from olmo.model import OLMo

    from olmo_tda import GradientStore
    from olmo_tda.config import CaptureConfig

    store = GradientStore.open(run_dir / "tda" / "store")
    cfg.model.init_device = "cpu"
    model = OLMo(cfg.model)
    model.eval()
    saved = yaml.safe_load((run_dir / "tda.yaml").read_text())["tda"]["capture"]
    exact_cfg = CaptureConfig(proj_dim=0, modules=saved["modules"], exclude=saved["exclude"],
                              include_bias=saved["include_bias"])
    arm_cfg = CaptureConfig(proj_dim=args.k, proj_type="orthogonal", seed=saved["seed"], modules=saved["modules"],
                            exclude=saved["exclude"], include_bias=saved["include_bias"])
    rhos, worst, ceiling = [], 0.0, []
    for point in points:
        exact_s, approx_s, best_s = [], [], []
        oracle = None
        if arm == "following" and args.ceiling:
            model.load_state_dict(kept[point])
            eigen_cfg = CaptureConfig(proj_dim=args.k, proj_type="eigen", basis="unused", modules=saved["modules"],
                                      exclude=saved["exclude"], include_bias=saved["include_bias"])
            oracle = same_step_basis(model, store, eigen_cfg, train_tokens, point, args.basis_batches)
        for step in range(point - args.window + 1, point + 1):
            model.load_state_dict(kept[step])
            block = next(store.iter_blocks(steps=[step], block_size=10**6))
            tokens = torch.from_numpy(train_tokens[block.ids].astype(np.int64))
            rows = exact_grads(model, exact_cfg, tokens)
            q = exact_grads(model, exact_cfg, queries)
            proj = projections(arm, run_dir, store, block.basis, model, arm_cfg, args.k)
            exact = sum(torch.einsum("qoi,noi->qn", q[n], rows[n]) for n in store.layers)
            approx = 0
            for n in store.layers:
                p_out, p_in = proj[n]
                q_hat = p_out @ q[n] @ p_in.T
                stored = block.grads[n].double()
                want = p_out @ rows[n] @ p_in.T
                worst = max(worst, float((stored - want).norm() / want.norm().clamp_min(1e-30)))
                approx = approx + torch.einsum("qoi,noi->qn", q_hat, stored)
            exact_s.append(exact)
            approx_s.append(approx)
            if oracle is not None:
                best = 0
                for n in store.layers:
                    lb = oracle.layers[n]
                    p_out = (lb.proj_out[:args.k] if args.k < lb.n_out else torch.eye(lb.n_out)).double()
                    p_in = (lb.proj_in[:args.k] if args.k < lb.n_in else torch.eye(lb.n_in)).double()
                    best = best + torch.einsum("qoi,noi->qn", p_out @ q[n] @ p_in.T, p_out @ rows[n] @ p_in.T)
                best_s.append(best)
        e, a = torch.cat(exact_s, 1).numpy(), torch.cat(approx_s, 1).numpy()
        rhos.append(float(np.mean([spearmanr(e[i], a[i])[0] for i in range(len(e))])))
        if best_s:
            b = torch.cat(best_s, 1).numpy()
            ceiling.append(float(np.mean([spearmanr(e[i], b[i])[0] for i in range(len(e))])))
    return rhos, worst, ceiling


def olmo_1b_bytes() -> int:
    """Bytes per example that configs/olmo_1b.yaml's capture stores (OLMo-1B's Linears, no model built)."""
    from olmo_tda.config import TDAConfig

    raw = yaml.safe_load((ROOT / "configs" / "olmo_1b.yaml").read_text())
    m, tda = raw["model"], TDAConfig.from_dict(raw["tda"])
    d, hidden = m["d_model"], m["mlp_ratio"] * m["d_model"]
    per_block = [(3 * d, d), (d, d), (hidden, d), (d, hidden // 2)]          # att_proj, attn_out, ff_proj, ff_out
    layers = [shape for _ in range(m["n_layers"]) for shape in per_block]
    cap = tda.capture
    if cap.budget:
        floats = cap.budget
    else:
        k_out, k_in = cap.proj_dims
        floats = sum(min(k_out, o) * min(k_in, i) for o, i in layers)
    return floats * (4 if tda.store.dtype.value == "float32" else 2)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"smaller run: {QUICK} (explicit flags still win)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--points", type=int, default=6, help="measurement points, evenly spread (the last: the end)")
    p.add_argument("--window", type=int, default=12, help="steps whose rows are compared at each point")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--queries", type=int, default=24)
    p.add_argument("--train", type=int, default=4096, help="training passages (the data cycles over them)")
    p.add_argument("--k", type=int, default=16, help="projection width per side, every arm")
    p.add_argument("--every", type=int, default=200, help="capture.basis_every of the following arm")
    p.add_argument("--tokens", type=int, default=1024, help="capture.basis_tokens of the following arm")
    p.add_argument("--d-model", type=int, default=128, help="model width (the demo's: 128)")
    p.add_argument("--basis-batches", type=int, default=4, help="capture.basis_batches of the eigen arms")
    p.add_argument("--seed", type=int, default=6198)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--arms", default="random,frozen,following")
    p.add_argument("--ceiling", action="store_true",
                   help="also project the following arm's rows with a basis re-estimated at each point")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if f"--{key}" not in (argv if argv is not None else sys.argv):
                setattr(args, key, value)
    torch.set_num_threads(args.threads)
    import os

    os.environ.setdefault("WANDB_MODE", "offline")
    from olmo_tda.demo.corpus import ByteTokenizer, build_passages
    from olmo_tda.demo.data import write_memmap

    points = [round(args.steps * (i + 1) / args.points) for i in range(args.points)]
    keep = {s for pt in points for s in range(pt - args.window + 1, pt + 1)}
    seq = 64
    passages = build_passages(args.train + args.queries, seq, seed=args.seed)
    tok = ByteTokenizer()
    result: dict = {"steps": args.steps, "points": points, "k": args.k, "every": args.every, "tokens": args.tokens,
                    "d_model": args.d_model}
    with tempfile.TemporaryDirectory(prefix="fidelity_in_run_") as tmp:
        work = Path(tmp)
        data = write_memmap(passages[:args.train], work / "data" / "train.npy", seq)
        train_tokens = np.array([tok.encode(x) for x in passages[:args.train]], dtype=np.int64)
        queries = torch.tensor([tok.encode(x) for x in passages[args.train:]], dtype=torch.long)
        rows = {}
        for arm in args.arms.split(","):
            t0 = time.perf_counter()
            cfg, kept, train_s = train_arm(arm, args, data, work, keep)
            rhos, worst, ceiling = measure(arm, args, cfg, kept, work / arm, train_tokens, queries, points)
            rows[arm] = rhos
            if ceiling:
                rows["same_step"] = ceiling
                result["same_step_min"] = min(ceiling)
            result[f"{arm}_min"] = min(rhos)
            result[f"{arm}_row_error"] = worst
            if arm == "following":
                metrics = [json.loads(x) for x in (work / arm / "tda" / "metrics.jsonl").read_text().splitlines()]
                result["refresh_seconds"] = metrics[-1]["tda/basis_refresh_s"]
                result["basis_versions"] = int(metrics[-1]["tda/basis_versions"])
                result["refresh_overhead"] = result["refresh_seconds"] / train_s
                result["training_seconds"] = train_s
            from olmo_tda import GradientStore

            store = GradientStore.open(work / arm / "tda" / "store")
            result["bytes_per_example"] = 2 * sum(a * b for a, b in store.layer_shapes.values())
            print(f"[{arm}] trained and measured in {time.perf_counter() - t0:.0f}s; rho by point "
                  f"{[round(r, 3) for r in rhos]}", file=sys.stderr, flush=True)
    result["olmo_1b_bytes_per_example"] = olmo_1b_bytes()
    print(f"{'step':>6} " + " ".join(f"{a:>10}" for a in rows))
    for i, pt in enumerate(points):
        print(f"{pt:>6} " + " ".join(f"{rows[a][i]:>10.3f}" for a in rows))
    print(f"{'min':>6} " + " ".join(f"{min(rows[a]):>10.3f}" for a in rows))
    print(f"bytes/example {result['bytes_per_example']} (every arm); OLMo-1B config {result['olmo_1b_bytes_per_example']}"
          + (f"; refresh {result['refresh_seconds']:.2f}s / training {result['training_seconds']:.1f}s = "
             f"{100 * result['refresh_overhead']:.2f}% ({result['basis_versions']} versions)"
             if "refresh_overhead" in result else ""))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
