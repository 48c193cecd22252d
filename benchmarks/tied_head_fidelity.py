"""What a model whose output head is tied to its token table (OLMo ``weight_tying``, as OLMo-1B)
loses when the table is not captured, and what ``capture.embeddings`` gives back.

A 2-block OLMo with a tied head, trained on the shipped demo corpus (as ``projection_fidelity.py``).
Ground truth: GradDot over *every* parameter, from per-example gradients by ``torch.func.vmap(grad)``
(independent of capture); ``max_rel_err_matrices`` compares with GradDot over the Linear and
Embedding parameters (the norms' weights left out), which the exact arm with the table must equal. Each arm's scores come from ``GradientCapture`` as a user would run it:
the blocks' Linears only (the default, which cannot see ``F.linear(x, wte.weight)``), or with
``embeddings: true`` (the table with its head's share), exact (``proj_dim=0``) and projected.
Mean per-query Spearman against the ground truth; projected arms average 2 projector seeds.

    python benchmarks/tied_head_fidelity.py                 # d_model 64 and 256 (~3 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from projection_fidelity import train_model  # noqa: E402

from olmo_tda import CaptureConfig, GradientCapture  # noqa: E402
from olmo_tda.demo.corpus import ByteTokenizer, build_passages  # noqa: E402


def summed_losses(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(x).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten(),
                                             reduction="none").view(len(x), -1).sum(1)


def full_gradients(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([n, all parameters], [n, Linear and Embedding parameters])``: each row's gradient of its
    summed token loss (torch.func); the second leaves out the norms' weights, which capture never takes."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}
    g = vmap(grad(lambda p, xi: summed_losses(lambda t: functional_call(model, p, (t,)), xi[None])[0]),
             in_dims=(None, 0))(params, x)
    flat = {k: v.reshape(len(x), -1).double() for k, v in g.items()}
    layers = {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
              for p, _ in m.named_parameters(recurse=False)}
    return torch.cat(list(flat.values()), dim=1), torch.cat([v for k, v in flat.items() if k in layers], dim=1)


def captured(model, cfg: CaptureConfig, x: torch.Tensor) -> torch.Tensor:
    cap = GradientCapture(model, cfg)
    with cap.record(range(len(x))) as rec:
        summed_losses(model, x).sum().backward()
    model.zero_grad(set_to_none=True)
    cap.remove()
    return torch.cat([v.reshape(len(x), -1) for v in rec.dense().values()], dim=1).double()


def measure(d_model: int, args) -> list[dict]:
    tok = ByteTokenizer()
    passages = build_passages(args.num_train + args.num_queries + 2048, 64, seed=1)
    data = torch.tensor([tok.encode(p) for p in passages])
    model, final_loss = train_model(d_model, args.steps, data[args.num_train + args.num_queries:], tied=True)
    model.eval()
    train, query = data[:args.num_train], data[args.num_train:args.num_train + args.num_queries]
    (q_all, q_mat), (t_all, t_mat) = full_gradients(model, query), full_gradients(model, train)
    truth, truth_mat = (q_all @ t_all.T).numpy(), (q_mat @ t_mat.T).numpy()
    rows = []
    logging.getLogger("olmo_tda.capture.hooks").setLevel(logging.ERROR)     # the arm without the table warns
    for k in [0] + [int(x) for x in args.ks.split(",")]:
        for table in (False, True):
            rhos = []
            for seed in range(1 if k == 0 else args.seeds):
                cfg = CaptureConfig(proj_dim=k, seed=seed, embeddings=table)
                s = (captured(model, cfg, query) @ captured(model, cfg, train).T).numpy()
                rhos += [spearmanr(s[q], truth[q])[0] for q in range(len(s))]
            rows.append({"d_model": d_model, "k": k, "table": table, "spearman": float(np.mean(rhos)),
                         # how far the scores are from those over every weight matrix (the last seed's)
                         "max_rel_err_matrices": float(np.abs(s - truth_mat).max() / np.abs(truth_mat).max()),
                         "final_loss": final_loss})
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-models", default="64,256")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--num-train", type=int, default=128)
    p.add_argument("--num-queries", type=int, default=8)
    p.add_argument("--ks", default="16,64", help="projected widths (exact is always measured)")
    p.add_argument("--seeds", type=int, default=2)
    args = p.parse_args(argv)
    try:
        d_models, _ = [int(d) for d in args.d_models.split(",")], [int(k) for k in args.ks.split(",")]
    except ValueError:
        p.error(f"--d-models and --ks take comma-separated integers, got {args.d_models!r} and {args.ks!r}")
    torch.manual_seed(0)
    rows = [r for d in d_models for r in measure(d, args)]
    print(f"\ntied-head OLMo, 2 blocks, {args.steps} steps; GradDot vs exact all-parameter GradDot, "
          f"{args.num_train} train x {args.num_queries} queries")
    print(f"{'d_model':>7s} {'k':>5s} {'captured':22s} {'Spearman':>9s}")
    for r in rows:
        print(f"{r['d_model']:7d} {r['k'] or 'exact':>5} {'blocks + tied table' if r['table'] else 'blocks only':22s} "
              f"{r['spearman']:9.3f}")
    by = {(r["d_model"], r["k"], r["table"]): r["spearman"] for r in rows}
    big = max(r["d_model"] for r in rows)
    result = {"benchmark": "tied_head_fidelity", "rows": rows,
              "exact_blocks_only": by[(big, 0, False)], "exact_with_table": by[(big, 0, True)],
              "exact_with_table_max_rel_err": max(r["max_rel_err_matrices"] for r in rows if r["k"] == 0 and r["table"]),
              "d_model": big}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
