"""Linear datamodeling score (LDS) of graddot, TracIn-CP and influence (raw, lorif, ekfac, joint) on a tiny OLMo,
on CPU.

Protocol (Park et al., TRAK, 2023), everything seeded:

- Data: ``num_train`` training passages and ``num_queries`` held-out query passages of ``seq``
  bytes from the shipped demo corpus (disjoint windows of the same text).
- Model: a tiny OLMo (byte vocabulary, untied head, no dropout) trained with AdamW, constant lr,
  mini-batches of ``batch`` for ``epochs`` epochs, mean token CE. The lr and epoch count were set
  from the held-out query loss of a half-size run (its minimum is near 20 epochs), never from LDS.
- Ground truth: ``retrains`` random half-subsets S_j of the training set. Each is trained twice
  from a fresh init with the same number of epochs: repetition r ∈ {A, B} uses init seed 1+r for
  every subset (so within a repetition subsets differ only in their data and its order) and a
  data-order seed per (r, j). The outcome of query q on S_j is the mean over A and B of its
  summed token CE at the end of training.
- Split-half reliability: per query, Spearman across subsets of loss_A vs loss_B, mean over
  queries — the noise ceiling of any attribution method at this protocol. The Spearman-Brown value
  2ρ/(1+ρ) is the ceiling for the A/B mean actually used as ground truth.
- Attribution: on a separate model trained on the full training set (init seed 0), per-example
  gradients of the summed token CE through the library's ``GradientCapture`` (orthogonal projection
  to ``proj_dim`` per side, and unprojected: ``exact``), written to a ``GradientStore`` and scored
  with ``attribute`` (graddot; influence with ``hessian`` raw, lorif and ekfac, default damping
  ratio 0.1, lorif rank ``rank``; and ``joint``, one explicit Fisher over all layers, on the
  projected and eigenbasis stores, where D fits its limit). TracIn-CP is
  ``olmo_tda.methods.tracin.tracin_cp`` over ``checkpoints`` evenly spaced weights of that run's
  trajectory (the last is the final model), each weighted by the lr.
  Raw influence is only run projected: unprojected it needs a D×D Cholesky per layer (head:
  D = 257·(d_model+1)), and with N rows lorif at rank ≥ N equals it anyway. EK-FAC runs both ways:
  its factors are k_out² + k_in² + k_out·k_in floats a layer, unprojected too.
- Compact rows (``--compact-k``, ``--compact-c``; 0 turns them off): the store the fidelity
  benchmark recommends, at this model's size — the KFAC eigenbasis at ``compact_k`` per side
  (estimated from 4 training batches at the final weights), LoRIF rank-``compact_c`` factors,
  bfloat16 on disk — scored by graddot and the default influence (ekfac), queries captured dense
  in the same basis. No TracIn there (its basis belongs to the final weights).
- Budget rows (``--budget-k K``; 0 turns them off): two dense eigenbasis stores (``--budget-dtype``,
  fp32 by default) of the same K·K floats a layer on average: ``even`` (k=K per side on every layer) and ``budget``
  (``capture.budget`` = K²·layers, split across layers by their spectra, sides capped at
  ``proj_dim``), each scored by graddot and influence raw, ekfac and joint.
- LDS: a positive score means training on i lowers q's loss, so the prediction for S_j is
  Σ_{i∈S_j} score(q, i) and LDS = mean over queries of Spearman(prediction_j, −loss_j) across subsets.
  ± is the standard error over queries. Time per row: its gradients (capture + store write, shared
  by graddot and influence and counted in each) plus scoring; TracIn recomputes them at every checkpoint.
- Adam rows (``--adam``): the attribution model's final AdamW ``exp_avg_sq`` gives TrackStar's
  preconditioner ``u = 1/(√v̂ + ε)``, applied to the stored rows as ``olmo_tda.methods.optimizer``
  approximates it (rank-1 ``u ≈ r cᵀ``, mapped into the projected space: ``M_out Ĝ M_inᵀ``) on the
  ``k=proj_dim`` random store, the unprojected one and the compact eigenbasis store: ``adam-graddot``
  and ``adam-gradcos`` (both sides corrected, TrackStar), ``less-gradcos`` (training side only, LESS),
  ``adam-diag-gradcos`` (the diagonal of M only), next to plain ``gradcos``; ``adam-scaled-*``: the same
  rank-1 ``u`` applied exactly before projection (a second capture under ``GradientCapture.scaled``);
  on the unprojected store also the exact TrackStar (``trackstar-*``: the full elementwise ``u``).
- Runs on one torch thread (``--threads``): the matmuls are tiny and a second thread on a shared
  2-core machine made retrains several times slower.

    python benchmarks/lds.py                 # 256 train, 32 queries, 64 subsets × 2 seeds (~10 min, 2 cores)
    python benchmarks/lds.py --quick         # 128 train, 16 queries, 32 subsets × 2 seeds (~2.5 min)
    python benchmarks/lds.py --retrains 128 --proj-dim 16
    python benchmarks/lds.py --quick --adam  # + Adam-corrected (TrackStar / LESS) rows

Prints a table, then one JSON line of the headline numbers (last line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr

from olmo_tda import CaptureConfig, GradientCapture, GradientRecord, GradientStore, StoreConfig, attribute
from olmo_tda.capture import estimate_eigenbasis
from olmo_tda.capture.hooks import select_linears
from olmo_tda.config import ProjectionType, StoreDType
from olmo_tda.demo.corpus import ByteTokenizer, build_passages
from olmo_tda.methods.influence import JOINT_MAX_DIM
from olmo_tda.methods.optimizer import AdamCorrection
from olmo_tda.methods.tracin import tracin_cp

QUICK = {"num_train": 128, "num_queries": 16, "retrains": 32}
ADAM_FIT: dict[str, float] = {}
"""``{row tag: worst rms log residual of the rank-1 fit of u over layers}`` of the ``--adam`` rows."""


def make_model(args, seed: int):
    from olmo.config import ModelConfig
    from olmo.model import OLMo

    torch.manual_seed(seed)
    model = OLMo(ModelConfig(d_model=args.d_model, n_heads=1, n_layers=args.n_layers, mlp_ratio=4, vocab_size=257,
                             embedding_size=257, max_sequence_length=args.seq, rope=True, attention_dropout=0.0,
                             residual_dropout=0.0, embedding_dropout=0.0, weight_tying=False, init_device="cpu"))
    model.reset_parameters()
    return model


def train(args, data: torch.Tensor, init_seed: int, order_seed: int, keep_every: int = 0):
    """Train a fresh model on ``data``; return it, if ``keep_every`` the weights every that many steps, the
    number of steps and the optimizer (its final state: ``--adam``)."""
    model = make_model(args, init_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(order_seed)
    kept, step = [], 0
    for _ in range(args.epochs):
        for idx in torch.randperm(len(data), generator=gen).split(args.batch):
            batch = data[idx]
            loss = F.cross_entropy(model(batch).logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if keep_every and step % keep_every == 0:
                kept.append(SimpleNamespace(step=step, lr=args.lr, tracin_lr=args.lr,
                                            state={k: v.clone() for k, v in model.state_dict().items()}))
    if keep_every and kept[-1].step != step:      # the final weights are always a TracIn checkpoint
        kept.append(SimpleNamespace(step=step, lr=args.lr, tracin_lr=args.lr,
                                    state={k: v.clone() for k, v in model.state_dict().items()}))
    return model, kept, step, opt


@torch.no_grad()
def query_losses(model, queries: torch.Tensor) -> np.ndarray:
    """Summed token CE of each query, ``[Q]``."""
    model.eval()
    logits = model(queries).logits[:, :-1]
    ce = F.cross_entropy(logits.flatten(0, 1), queries[:, 1:].flatten(), reduction="none")
    model.train()
    return ce.view(len(queries), -1).sum(1).double().numpy()


def ground_truth(args, train_data, queries):
    """``(subset masks [S, N] bool, losses [2, S, Q])``: every subset trained with repetitions A and B."""
    n = len(train_data)
    masks = np.zeros((args.retrains, n), dtype=bool)
    losses = np.zeros((2, args.retrains, len(queries)))
    for j in range(args.retrains):
        masks[j, np.random.default_rng(10_000 + j).choice(n, n // 2, replace=False)] = True
        for r in range(2):
            model, _, _, _ = train(args, train_data[torch.from_numpy(masks[j])], init_seed=1 + r,
                                order_seed=100_000 * (r + 1) + j)
            losses[r, j] = query_losses(model, queries)
    return masks, losses


def summed_ce(model, chunk: torch.Tensor) -> torch.Tensor:
    logits = model(chunk).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")


def recordings(cap, model, data: torch.Tensor, batch: int = 64):
    """One capture recording of the summed token CE's per-example gradients per batch."""
    for start in range(0, len(data), batch):
        chunk = data[start:start + batch]
        with cap.record(np.arange(start, start + len(chunk))) as rec:
            summed_ce(model, chunk).backward()
        model.zero_grad(set_to_none=True)
        yield rec


def grads_in_batches(cap, model, data: torch.Tensor, batch: int = 64):
    """Per-example gradients of the summed token CE, ``(ids [n], {layer: [n, Ko, Ki]})`` per batch."""
    for rec in recordings(cap, model, data, batch):
        yield rec.ids, rec.dense()


def stacked(cap, model, data: torch.Tensor) -> dict[str, torch.Tensor]:
    parts = [g for _, g in grads_in_batches(cap, model, data)]
    return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}


def ordered(result, n: int) -> np.ndarray:
    """``[Q, n]`` scores with column i = training example i."""
    out = np.full((result.all_scores.shape[0], n), np.nan)
    out[:, result.all_ids] = result.all_scores.numpy()
    return out


def eigen_config(args, kind: str, model) -> tuple[CaptureConfig, StoreDType, str]:
    """``(capture config, store dtype, row tag)`` of an eigenbasis store: ``compact`` (the fidelity
    benchmark's recommendation), ``even`` (dense k=``budget_k`` on every layer) or ``budget`` (the
    same floats split across layers by ``capture.budget``, sides capped at ``proj_dim``)."""
    if kind == "compact":
        cfg = CaptureConfig(proj_dim=args.compact_k, proj_type=ProjectionType.EIGEN, rank=args.compact_c)
        return cfg, StoreDType.BFLOAT16, f"eigen k={args.compact_k} c={args.compact_c} bf16"
    dtype = StoreDType(args.budget_dtype)
    suffix = " bf16" if dtype is StoreDType.BFLOAT16 else ""
    if kind == "even":
        return CaptureConfig(proj_dim=args.budget_k, proj_type=ProjectionType.EIGEN), dtype, \
            f"eigen k={args.budget_k}{suffix}"
    budget = args.budget_k ** 2 * len(select_linears(model, CaptureConfig()))
    return CaptureConfig(proj_dim=args.proj_dim, proj_type=ProjectionType.EIGEN, budget=budget), \
        dtype, f"eigen budget={budget}{suffix}"


def eigen_store(args, model, train_data, store: Path, steps: int, cfg: CaptureConfig, dtype: StoreDType):
    """Estimate ``cfg``'s KFAC eigenbasis from 4 batches of the training set at the final weights,
    store every training example through it. Returns a dense capture in the same basis for the
    queries (exact projected query gradients, not rank-c factors)."""
    batches = [train_data[i * args.batch:(i + 1) * args.batch] for i in range(4)]
    estimate_eigenbasis(model, batches, summed_ce, cfg).save(store.with_suffix(".basis.safetensors"))
    model.zero_grad(set_to_none=True)
    cfg.basis = str(store.with_suffix(".basis.safetensors"))
    cap = GradientCapture(model, cfg)
    with GradientStore.create(store, cap.store_metadata(), StoreConfig(dtype=dtype)) as writer:
        for rec in recordings(cap, model, train_data):
            writer.append(rec.to_record(step=steps, lr=args.lr))
    cap.remove()
    cfg.rank = 0
    return GradientCapture(model, cfg)


def adam_options(opt, model, cap, exact: bool) -> tuple[list, float, AdamCorrection]:
    """``([(label, attribute options)], seconds to build the corrections, the kron correction)`` of the
    ``--adam`` rows."""
    t0 = time.perf_counter()
    kron = AdamCorrection.from_optimizer(opt, model, cap)
    options = [("gradcos", {"method": "gradcos"}),
               ("adam-graddot", {"method": "adam-graddot", "correction": kron}),
               ("adam-gradcos", {"method": "adam-gradcos", "correction": kron}),
               ("less-gradcos", {"method": "adam-gradcos", "correction": kron, "sides": "train"})]
    if exact:
        elem = AdamCorrection.from_optimizer(opt, model, cap, mode="elementwise")
        options += [("trackstar-graddot", {"method": "adam-graddot", "correction": elem}),
                    ("trackstar-gradcos", {"method": "adam-gradcos", "correction": elem})]
    else:
        diag = AdamCorrection.from_optimizer(opt, model, cap, mode="diag")
        options.append(("adam-diag-gradcos", {"method": "adam-gradcos", "correction": diag}))
    return options, time.perf_counter() - t0, kron


def adam_scaled_rows(args, model, cap, store_cfg: CaptureConfig, dtype: StoreDType, train_data, queries, steps: int,
                     store: Path, tag: str, corr: AdamCorrection) -> dict:
    """``adam-scaled-*`` rows: the rank-1 fit applied exactly at capture (``GradientCapture.scaled``, no
    captured-subspace assumption) into a second store of the same projectors (``store_cfg``), queries
    through ``cap``, scored by plain graddot and gradcos; time includes the second capture."""
    t0 = time.perf_counter()
    with cap.pause():
        writer_cap = GradientCapture(model, store_cfg)
        with writer_cap.scaled(corr.scales()), \
                GradientStore.create(store, writer_cap.store_metadata(), StoreConfig(dtype=dtype)) as writer:
            for rec in recordings(writer_cap, model, train_data):
                writer.append(rec.to_record(step=steps, lr=args.lr))
        writer_cap.remove()
    with cap.scaled(corr.scales()):
        query_grads = stacked(cap, model, queries)
    grad_s, rows = time.perf_counter() - t0, {}
    for method in ("graddot", "gradcos"):
        t0 = time.perf_counter()
        res = attribute(store, query_grads, top_k=1, return_scores=True, projector_hash=cap.projector_hash,
                        method=method)
        rows[f"adam-scaled-{method} {tag}"] = (ordered(res, len(train_data)), grad_s + time.perf_counter() - t0)
    return rows


def attribution_scores(args, model, checkpoints, train_data, queries, proj_dim: int, work: Path,
                       eigen: str | None = None, opt=None) -> dict:
    """``{row label: (scores [Q, N], seconds)}`` of every method at one capture config (``eigen``: one of
    :func:`eigen_config`'s stores, scored by graddot and influence — the compact one by the default
    influence only; no TracIn: the basis belongs to the final weights). With ``opt`` (the model's
    AdamW), also the ``--adam`` rows."""
    compact = eigen == "compact"
    if eigen:
        cfg, dtype, tag = eigen_config(args, eigen, model)
    else:
        tag = f"k={proj_dim}" if proj_dim else "exact"
    steps = checkpoints[-1].step
    final = {k: v.clone() for k, v in model.state_dict().items()}
    n, rows = len(train_data), {}
    t0 = time.perf_counter()
    store = work / f"store-{tag.replace(' ', '_').replace('=', '')}"
    if eigen:
        cap = eigen_store(args, model, train_data, store, steps, cfg, dtype)
    else:
        cap = GradientCapture(model, CaptureConfig(proj_dim=proj_dim, seed=0))
        with GradientStore.create(store, cap.store_metadata(), StoreConfig()) as writer:
            for ids, grads in grads_in_batches(cap, model, train_data):
                writer.append(GradientRecord(ids=ids, step=steps, lr=args.lr, loss_scale=1.0, grads=grads))
    query_grads = stacked(cap, model, queries)
    grad_s = time.perf_counter() - t0          # shared by graddot and influence; counted in each row

    options = [("graddot", {"method": "graddot"})]
    if compact:
        options.append(("influence ekfac", {"method": "influence", "hessian": "ekfac",
                                            "damping_ratio": args.damping_ratio}))
    elif proj_dim:
        options.append(("influence raw", {"method": "influence", "hessian": "raw",
                                          "damping_ratio": args.damping_ratio}))
    if not eigen:
        options.append(("influence lorif", {"method": "influence", "hessian": "lorif", "rank": args.rank,
                                            "damping_ratio": args.damping_ratio}))
    if not compact:
        options.append(("influence ekfac", {"method": "influence", "hessian": "ekfac",
                                            "damping_ratio": args.damping_ratio}))
    width = sum(k_out * k_in for k_out, k_in in cap.layer_shapes.values())
    if proj_dim and not compact and width <= JOINT_MAX_DIM:
        options.append(("influence joint", {"method": "influence", "hessian": "joint",
                                            "damping_ratio": args.damping_ratio}))
    build_s, corr = {}, None
    if opt is not None:
        extra, seconds, corr = adam_options(opt, model, cap, exact=not proj_dim)
        ADAM_FIT[tag] = max(c.fit_error for c in corr.layers.values())
        options += extra
        build_s = {label: seconds for label, _ in extra if label != "gradcos"}
    for label, kw in options:
        t0 = time.perf_counter()
        res = attribute(store, query_grads, top_k=1, return_scores=True, projector_hash=cap.projector_hash, **kw)
        rows[f"{label} {tag}"] = (ordered(res, n), grad_s + build_s.get(label, 0.0) + time.perf_counter() - t0)
    if corr is not None and proj_dim:
        store_cfg = dataclasses.replace(cfg, rank=args.compact_c) if eigen else CaptureConfig(proj_dim=proj_dim, seed=0)
        rows.update(adam_scaled_rows(args, model, cap, store_cfg, dtype if eigen else StoreDType.FLOAT32, train_data,
                                     queries, steps, Path(f"{store}-adam-scaled"), tag, corr))
    if eigen:
        cap.remove()
        return rows

    def at(ckpt):
        model.load_state_dict(ckpt.state)
        return model

    t0 = time.perf_counter()
    scores, ids = tracin_cp(checkpoints, lambda c: stacked(cap, at(c), queries),
                            lambda c: grads_in_batches(cap, at(c), train_data), layers=list(cap.layer_shapes))
    tracin = np.full((len(queries), n), np.nan)
    tracin[:, ids] = scores.numpy()
    rows[f"tracin {tag}"] = (tracin, time.perf_counter() - t0)
    model.load_state_dict(final)
    cap.remove()
    return rows


def spearman_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per query (column), Spearman across subsets (rows) of ``a`` [S, Q] vs ``b`` [S, Q]."""
    return np.array([spearmanr(a[:, q], b[:, q])[0] for q in range(a.shape[1])])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"smaller run: {QUICK} (explicit flags still win)")
    p.add_argument("--num-train", type=int, default=256)
    p.add_argument("--num-queries", type=int, default=32)
    p.add_argument("--retrains", type=int, default=64, help="random half-subsets (each trained twice)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--proj-dim", type=int, default=32, help="projected capture width per side (also run exact)")
    p.add_argument("--rank", type=int, default=32, help="lorif rank r")
    p.add_argument("--compact-k", type=int, default=16,
                   help="the compact store's eigenbasis width per side (0: no compact rows)")
    p.add_argument("--compact-c", type=int, default=4, help="the compact store's LoRIF rank c")
    p.add_argument("--budget-k", type=int, default=8,
                   help="eigen rows at k·k floats a layer: even (k per side everywhere) and split by capture.budget "
                        "(0: none)")
    p.add_argument("--budget-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the budget rows' store dtype")
    p.add_argument("--adam", action="store_true",
                   help="also score Adam-corrected rows (TrackStar/LESS, olmo_tda.methods.optimizer) with the final "
                        "AdamW state, on the projected, unprojected and compact stores")
    p.add_argument("--damping-ratio", type=float, default=0.1)
    p.add_argument("--checkpoints", type=int, default=5, help="TracIn-CP checkpoints (evenly spaced, last = final)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; the matmuls are tiny, and on a shared 2-core machine a second thread "
                        "made retrains 2-10x slower")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    tok = ByteTokenizer()
    data = torch.tensor([tok.encode(s) for s in build_passages(args.num_train + args.num_queries, args.seq, seed=1)])
    train_data, queries = data[:args.num_train], data[args.num_train:]

    t0 = time.perf_counter()
    steps_full = args.epochs * -(-args.num_train // args.batch)
    model, checkpoints, _, opt = train(args, train_data, init_seed=0, order_seed=0,
                                       keep_every=max(1, steps_full // args.checkpoints))
    opt = opt if args.adam else None
    full_loss = query_losses(model, queries).mean()
    full_s = time.perf_counter() - t0
    rows = {}
    with tempfile.TemporaryDirectory(prefix="lds-") as work:
        for proj_dim in (args.proj_dim, 0):
            rows.update(attribution_scores(args, model, checkpoints, train_data, queries, proj_dim, Path(work),
                                           opt=opt))
        for eigen in ("compact",) * bool(args.compact_k) + ("even", "budget") * bool(args.budget_k):
            rows.update(attribution_scores(args, model, checkpoints, train_data, queries, args.proj_dim, Path(work),
                                           eigen=eigen, opt=opt if eigen == "compact" else None))

    t0 = time.perf_counter()
    masks, losses = ground_truth(args, train_data, queries)
    retrain_s = time.perf_counter() - t0
    reliability = float(np.mean(spearman_rows(losses[0], losses[1])))
    ceiling = 2 * reliability / (1 + reliability) if reliability > -1 else -1.0    # Spearman-Brown
    outcome = -losses.mean(axis=0)                                  # [S, Q]: higher = lower loss

    print(f"{args.num_train} train / {args.num_queries} queries of {args.seq} bytes; OLMo d_model {args.d_model}, "
          f"{args.n_layers} layers; {args.epochs} epochs AdamW lr {args.lr}; full model {steps_full} steps "
          f"(query loss/token {full_loss / (args.seq - 1):.3f}, {full_s:.1f} s), TracIn-CP over steps "
          f"{[c.step for c in checkpoints]}")
    print(f"{args.retrains} half-subsets x 2 seeds trained in {retrain_s:.0f} s (query loss/token "
          f"{losses.mean() / (args.seq - 1):.3f}); split-half reliability {reliability:.3f} "
          f"(Spearman-Brown {ceiling:.3f})")
    print(f"{'method':<40} {'LDS':>7} {'± se':>6} {'time s':>7}")
    lds = {}
    order = ["graddot", "tracin", "influence raw", "influence lorif", "influence ekfac", "influence joint", "gradcos",
             "adam-graddot", "adam-gradcos", "less-gradcos", "adam-diag-gradcos", "adam-scaled-graddot",
             "adam-scaled-gradcos", "trackstar-graddot", "trackstar-gradcos"]

    def split(label):            # (method, capture config: "k=32", "exact" or an eigen store's)
        method = next(m for m in order if label.startswith(m + " "))
        return method, label[len(method) + 1:]

    def config_rank(config):
        return (1 if config == "exact" else 4 if config.startswith("eigen budget") else 2 if " c=" in config
                else 3 if config.startswith("eigen k=") else 0)

    for label in sorted(rows, key=lambda s: (config_rank(split(s)[1]), order.index(split(s)[0]))):
        scores, seconds = rows[label]
        per_query = spearman_rows(masks.astype(np.float64) @ scores.T, outcome)
        lds[label] = (float(per_query.mean()), float(per_query.std(ddof=1) / np.sqrt(len(per_query))))
        print(f"{label:<40} {lds[label][0]:>7.3f} {lds[label][1]:>6.3f} {seconds:>7.1f}")

    def key(label):
        method, config = split(label)
        return ("lds_" + method.replace(" ", "_").replace("-", "_")
                + ("", "_exact", "_compact", "_eigen", "_budget")[config_rank(config)])

    if ADAM_FIT:
        print("adam: rank-1 fit of 1/(sqrt(v)+eps), worst rms log residual over layers: "
              + ", ".join(f"{tag} {err:.3f}" for tag, err in ADAM_FIT.items()))
    headline = {key(label): round(v[0], 4) for label, v in lds.items()}
    headline.update({key(label) + "_se": round(v[1], 4) for label, v in lds.items() if "exact" not in label})
    print(json.dumps({"benchmark": "lds", "retrains": args.retrains, "num_train": args.num_train,
                      "num_queries": args.num_queries, "proj_dim": args.proj_dim, "rank": args.rank,
                      "compact": ({"k": args.compact_k, "c": args.compact_c, "dtype": "bfloat16"}
                                  if args.compact_k else None),
                      "budget_k": args.budget_k, "budget_dtype": args.budget_dtype,
                      "damping_ratio": args.damping_ratio, "checkpoints": len(checkpoints),
                      "reliability": round(reliability, 4),
                      "reliability_spearman_brown": round(ceiling, 4), **headline,
                      "seconds": round(time.perf_counter() - started, 1)}))
    return lds


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
