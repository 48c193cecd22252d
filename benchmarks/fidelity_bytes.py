"""Fidelity per stored byte: how well compact stored gradients rank training examples, vs their size.

Trains a small OLMo (d_model 256 by default) on the shipped demo corpus, then at the final weights
captures the *exact* per-example gradients of N training passages and Q held-out queries
(``proj_dim=0``, proven equal to torch.func in tests/test_capture.py) and the exact GradDot scores.
Then, through the real capture path (``GradientCapture`` → ``Recording.stored()``, i.e. LoRIF
factors computed from the token factors), for every combination of

- projection: ``gaussian`` (LoGRA's random), ``orthogonal`` (random, lower variance), ``eigen`` (the
  KFAC eigenbasis from a short pass over 4 training batches at the final weights), ``eigen@early``
  (the same, estimated at 10% of training and frozen) and ``eigen@init`` (estimated at the initial
  weights — what an OLMo run with ``proj_type: eigen`` does by default);
- k (per side), LoRIF rank c (0 = dense), and storage dtype (float32 | bfloat16: the store's codec
  rounding applied to the stored rows);

it reports bytes stored per example and the mean per-query Spearman and Pearson of the scores
(queries exact-projected, training rows as stored) against the exact scores, with and without the
output head. The target: mean per-query Spearman ≥ 0.95 at ≤ 1/32 of the bytes of dense Gaussian
k=64 in float32; the best configuration meeting it is printed as the recommendation. Each row also
gives the Spearman with the queries replaced by their best rank-r factors (``--query-ranks``;
``attribute(..., query_rank=r)``, which ``store_query.py`` times), on these real gradients.

    python benchmarks/fidelity_bytes.py                    # d_model 256, 300 steps, 60 configurations
    python benchmarks/fidelity_bytes.py --quick            # 18 configurations incl. the recommended one
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import pearsonr, spearmanr

from olmo_tda import CaptureConfig, GradientCapture
from olmo_tda.capture.eigenbasis import estimate_eigenbasis
from olmo_tda.demo.corpus import ByteTokenizer, build_passages
from olmo_tda.ops import lowrank_queries
from olmo_tda.store.record import LowRank, cat_rows


def make_model(d_model: int, seq: int, seed: int = 0):
    from olmo.config import ModelConfig
    from olmo.model import OLMo

    torch.manual_seed(seed)
    model = OLMo(ModelConfig(d_model=d_model, n_heads=max(1, d_model // 64), n_layers=2, mlp_ratio=4,
                             vocab_size=257, embedding_size=384, max_sequence_length=seq, rope=True,
                             attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
                             weight_tying=False, init_device="cpu"))
    model.reset_parameters()
    return model


def summed_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")


def train(model, data: torch.Tensor, steps: int, on_step=None, seed: int = 0) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        if on_step:
            on_step(step)
        batch = data[torch.randint(0, len(data), (16,), generator=gen)]
        loss = summed_loss(model, batch) / batch[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


def capture(model, config: CaptureConfig, data: torch.Tensor, stored: bool):
    """Per layer: the stored representation (dense or LowRank) or the exact-projected dense rows."""
    cap = GradientCapture(model, config)
    parts = []
    for chunk in data.split(32):
        with cap.record(range(len(chunk))) as rec:
            summed_loss(model, chunk).backward()
        model.zero_grad(set_to_none=True)
        parts.append(rec.stored() if stored else rec.dense())
    floats = cap.floats_per_example
    sizes = {n: (r * (ko + ki) if r else ko * ki) for (n, (ko, ki)), r in
             zip(cap.layer_shapes.items(), cap.layer_ranks.values())}
    cap.remove()
    return {name: cat_rows([p[name] for p in parts]) for name in parts[0]}, floats, sizes


def rounded(x, dtype: str):
    """The store codec's rounding (bfloat16 keeps the upper 16 bits of float32)."""
    if dtype == "float32":
        return x
    f = (lambda t: t.to(torch.bfloat16).to(torch.float32))
    return LowRank(f(x.A), f(x.B)) if isinstance(x, LowRank) else f(x)


def scores(queries, train_rows, layers) -> torch.Tensor:
    from olmo_tda.ops import inner

    return sum(inner(queries[n].to(torch.float64), train_rows[n].to(torch.float64)) for n in layers)


def agreement(exact: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    sp = [spearmanr(exact[q].numpy(), approx[q].numpy())[0] for q in range(len(exact))]
    pe = [pearsonr(exact[q].numpy(), approx[q].numpy())[0] for q in range(len(exact))]
    return float(np.mean(sp)), float(np.mean(pe))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--num-train", type=int, default=128)
    p.add_argument("--num-queries", type=int, default=16)
    p.add_argument("--ks", default="16,32,64")
    p.add_argument("--ranks", default="0,1,2,4")
    p.add_argument("--kinds", default="gaussian,orthogonal,eigen,eigen@early,eigen@init")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--quick", action="store_true", help="ks 32,64; ranks 0,2,4; kinds gaussian,eigen,eigen@init")
    p.add_argument("--query-ranks", default="4",
                   help="also score with the queries as their best rank-r factors (comma list; '' for none)")
    args = p.parse_args(argv)
    if args.quick:
        args.ks, args.ranks, args.kinds = "32,64", "0,2,4", "gaussian,eigen,eigen@init"
    t0 = time.perf_counter()
    tok = ByteTokenizer()
    passages = build_passages(args.num_train + args.num_queries + 2048, args.seq, seed=1)
    data = torch.tensor([tok.encode(x) for x in passages])
    train_x, query_x = data[: args.num_train], data[args.num_train: args.num_train + args.num_queries]
    pool = data[args.num_train + args.num_queries:]
    model = make_model(args.d_model, args.seq)
    work = Path(tempfile.mkdtemp(prefix="fidelity_bytes-"))
    bases: dict[str, Path] = {}
    basis_batches = [pool[i * 16:(i + 1) * 16] for i in range(4)]
    k_max = max(int(k) for k in args.ks.split(","))

    def estimate(tag: str) -> None:
        bases[tag] = work / f"{tag}.safetensors"
        estimate_eigenbasis(model, basis_batches, summed_loss, CaptureConfig(proj_dim=k_max)).save(bases[tag])

    early = max(1, args.steps // 10)
    estimate("init")
    final_loss = train(model, pool, args.steps, on_step=lambda s: estimate("early") if s == early else None)
    estimate("final")

    exact_train, _, _ = capture(model, CaptureConfig(proj_dim=0), train_x, stored=False)
    exact_q, _, _ = capture(model, CaptureConfig(proj_dim=0), query_x, stored=False)
    names = list(exact_train)
    subsets = {"all": names, "no_head": [n for n in names if n.startswith("transformer.blocks")]}
    exact = {s: scores(exact_q, exact_train, layers) for s, layers in subsets.items()}
    head = [n for n in names if n not in subsets["no_head"]]
    head_mass = float(scores(exact_q, exact_train, head).abs().sum() /
                      sum(scores(exact_q, exact_train, [n]).abs().sum() for n in names))
    del exact_train

    rows, query_rows = [], {}
    query_ranks = [int(r) for r in args.query_ranks.split(",") if r.strip()]
    for kind, k, c in itertools.product(args.kinds.split(","), map(int, args.ks.split(",")),
                                        map(int, args.ranks.split(","))):
        base = {"proj_dim": k, "rank": c}
        if kind.startswith("eigen"):
            base |= {"proj_type": "eigen", "basis": str(bases[kind.split("@")[1] if "@" in kind else "final"])}
        else:
            base |= {"proj_type": kind, "seed": 0}
        if (kind, k) not in query_rows:          # queries are exact-projected: independent of c
            query_rows[kind, k] = capture(model, CaptureConfig(**base), query_x, stored=False)[0]
        q_rows = query_rows[kind, k]
        q_factored = {r: lowrank_queries(q_rows, r) for r in query_ranks}     # the same for every dtype
        t_rows, floats, sizes = capture(model, CaptureConfig(**base), train_x, stored=True)
        for dtype in args.dtypes.split(","):
            stored = {n: rounded(x, dtype) for n, x in t_rows.items()}
            itemsize = 4 if dtype == "float32" else 2
            row = {"kind": kind, "k": k, "c": c, "dtype": dtype,
                   "bytes": itemsize * floats,
                   "bytes_no_head": itemsize * sum(sizes[n] for n in subsets["no_head"])}
            for subset, layers in subsets.items():
                sp, pe = agreement(exact[subset], scores(q_rows, stored, layers))
                suffix = "" if subset == "all" else "_no_head"
                row[f"spearman{suffix}"], row[f"pearson{suffix}"] = sp, pe
            for r in query_ranks:               # the queries' best rank-r factors (query_rank=r)
                row[f"spearman_q{r}"] = agreement(exact["all"], scores(q_factored[r], stored, names))[0]
            rows.append(row)

    ref_bytes = 4 * sum(min(64, ko) * min(64, ki) for ko, ki in
                        ((exact_q[n].shape[1], exact_q[n].shape[2]) for n in names))
    for r in rows:
        r["bytes_ratio"] = r["bytes"] / ref_bytes
    print(f"d_model {args.d_model}, {args.steps} steps (final loss {final_loss:.2f}), N={args.num_train}, "
          f"Q={args.num_queries}; head carries {head_mass:.0%} of |exact score| mass; "
          f"reference = dense gaussian k=64 float32 = {ref_bytes} B/example")
    print(f"{'projection':>12} {'k':>3} {'c':>2} {'dtype':>8} {'B/example':>10} {'of ref':>7} "
          f"{'spearman':>8} {'pearson':>8} {'sp nohead':>9} {'pe nohead':>9}"
          + "".join(f" {'sp q' + str(q):>8}" for q in query_ranks))
    for r in sorted(rows, key=lambda r: (r["bytes"], -r["spearman"])):
        print(f"{r['kind']:>12} {r['k']:>3} {r['c']:>2} {r['dtype']:>8} {r['bytes']:>10} "
              f"{r['bytes_ratio']:>7.4f} {r['spearman']:>8.3f} {r['pearson']:>8.3f} "
              f"{r['spearman_no_head']:>9.3f} {r['pearson_no_head']:>9.3f}"
              + "".join(f" {r[f'spearman_q{q}']:>8.3f}" for q in query_ranks))
    ok = [r for r in rows if r["bytes_ratio"] <= 1 / 32 + 1e-9 and r["spearman"] >= 0.95]
    best = max(ok, key=lambda r: (r["spearman"], -r["bytes"])) if ok else \
        max((r for r in rows if r["bytes_ratio"] <= 1 / 32 + 1e-9), key=lambda r: r["spearman"], default=None)
    gauss = next((r for r in rows if (r["kind"], r["k"], r["c"], r["dtype"]) == ("gaussian", 64, 0, "float32")), None)
    if best:
        print(f"recommended (best Spearman at <= 1/32 of the reference bytes): {best['kind']} k={best['k']} "
              f"c={best['c']} {best['dtype']}: {best['bytes']} B/example, Spearman {best['spearman']:.3f} "
              f"({'meets' if best in ok else 'MISSES'} the 0.95 target)")
    print(json.dumps({"benchmark": "fidelity_bytes", "d_model": args.d_model, "steps": args.steps,
                      "num_train": args.num_train, "num_queries": args.num_queries, "head_mass": round(head_mass, 3),
                      "ref_bytes": ref_bytes,
                      "gaussian_k64_spearman": round(gauss["spearman"], 4) if gauss else None,
                      "recommended": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in best.items()}
                      if best else None,
                      "target_met": bool(ok), "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
