"""How well projected GradDot scores rank training examples, vs exact (unprojected) GradDot.

Trains a small OLMo on the shipped demo corpus for a few hundred steps (a trained model's gradients
are far from isotropic, unlike a fresh one's), then, at the final weights, computes exact
per-example gradients of N training passages and Q held-out queries (capture with proj_dim=0,
which tests/test_capture.py proves equal to torch.func gradients), and for each projection kind and
k the mean per-query Spearman correlation of projected vs exact GradDot scores, with and without
the output head (which can carry most of the score mass).

    python benchmarks/projection_fidelity.py                  # d_model 64 and 256
    python benchmarks/projection_fidelity.py --d-models 256 --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from scipy.stats import spearmanr

from olmo_tda import CaptureConfig, GradientCapture
from olmo_tda.capture.projection import make_projector
from olmo_tda.demo.corpus import ByteTokenizer, build_passages


def train_model(d_model: int, steps: int, data: torch.Tensor, seed: int = 0, tied: bool = False):
    from olmo.config import ModelConfig
    from olmo.model import OLMo

    torch.manual_seed(seed)
    model = OLMo(ModelConfig(d_model=d_model, n_heads=max(1, d_model // 64), n_layers=2, mlp_ratio=4,
                             vocab_size=257, embedding_size=384, max_sequence_length=data.shape[1], rope=True,
                             attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
                             weight_tying=tied, init_device="cpu"))
    model.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = data[torch.randint(0, len(data), (16,), generator=gen)]
        logits = model(batch).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, loss.item()


def exact_grads(model, cap, batch):
    with cap.record(range(len(batch))) as rec:
        logits = model(batch).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(),
                                          reduction="sum").backward()
    model.zero_grad(set_to_none=True)
    return rec.dense()


def measure(d_model: int, args) -> list[dict]:
    tok = ByteTokenizer()
    passages = build_passages(args.num_train + args.num_queries + 2048, 64, seed=1)
    data = torch.tensor([tok.encode(p) for p in passages])
    model, final_loss = train_model(d_model, args.steps, data[args.num_train + args.num_queries:])
    cap = GradientCapture(model, CaptureConfig(proj_dim=0))
    names = list(cap.modules)
    head = [n for n in names if not n.startswith("transformer.blocks")]
    train = {n: [] for n in names}
    for chunk in data[: args.num_train].split(32):
        for n, g in exact_grads(model, cap, chunk).items():
            train[n].append(g)
    train = {n: torch.cat(v) for n, v in train.items()}
    queries = exact_grads(model, cap, data[args.num_train: args.num_train + args.num_queries])
    cap.remove()

    def scores(tr, qu, layers):
        return sum(qu[n].flatten(1).double() @ tr[n].flatten(1).double().T for n in layers)

    exact = {"all": scores(train, queries, names),
             "no_head": scores(train, queries, [n for n in names if n not in head])}
    head_mass = (scores(train, queries, head).abs().sum() / sum(
        scores(train, queries, [n]).abs().sum() for n in names)).item()
    rows = []
    for kind in args.kinds.split(","):
        for k in [int(x) for x in args.ks.split(",")]:
            rhos = {"all": [], "no_head": []}
            for seed in range(args.seeds):
                proj = {n: make_projector(n, *train[n].shape[1:], (k, k), kind, seed).matrices() for n in names}
                ptr = {n: proj[n][0] @ train[n] @ proj[n][1].T for n in names}
                pq = {n: proj[n][0] @ queries[n] @ proj[n][1].T for n in names}
                for subset, layers in (("all", names), ("no_head", [n for n in names if n not in head])):
                    s = scores(ptr, pq, layers)
                    rhos[subset] += [spearmanr(exact[subset][q], s[q])[0] for q in range(len(s))]
            rows.append({"d_model": d_model, "kind": kind, "k": k, "spearman": float(np.mean(rhos["all"])),
                         "spearman_no_head": float(np.mean(rhos["no_head"])), "head_mass": head_mass,
                         "final_loss": final_loss})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-models", default="64,256")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--num-train", type=int, default=128)
    p.add_argument("--num-queries", type=int, default=8)
    p.add_argument("--kinds", default="orthogonal,gaussian")
    p.add_argument("--ks", default="16,64")
    p.add_argument("--seeds", type=int, default=2)
    args = p.parse_args(argv)
    try:
        d_models, _ = [int(d) for d in args.d_models.split(",")], [int(k) for k in args.ks.split(",")]
    except ValueError:
        p.error(f"--d-models and --ks take comma-separated integers, got {args.d_models!r} and {args.ks!r}")
    rows = [r for d in d_models for r in measure(d, args)]
    print(f"{'d_model':>7} {'kind':>11} {'k':>4} {'spearman':>9} {'no head':>8} {'head mass':>9} {'loss':>6}")
    for r in rows:
        print(f"{r['d_model']:>7} {r['kind']:>11} {r['k']:>4} {r['spearman']:>9.3f} {r['spearman_no_head']:>8.3f} "
              f"{r['head_mass']:>9.2f} {r['final_loss']:>6.2f}")
    headline = {f"spearman_d{r['d_model']}_{r['kind']}_k{r['k']}": round(r["spearman"], 3) for r in rows}
    print(json.dumps({"benchmark": "projection_fidelity", "steps": args.steps, "num_train": args.num_train,
                      "num_queries": args.num_queries, "seeds": args.seeds, **headline}))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
