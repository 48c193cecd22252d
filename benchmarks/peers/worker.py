"""Runs one system on the shared workload, in that system's own venv, and writes one JSON result.

    python worker.py SYSTEM attr     WORKDIR OUT.json   # store the train gradients, answer 16 queries
    python worker.py SYSTEM overhead WORKDIR OUT.json   # in-loop capture vs plain training steps

``attr`` times the train pass, which computes and stores each example's projected gradient
(examples/s), and the query pass: from 16 query texts to their [16, N] scores, store read included.
It writes the scores next to OUT as ``.npy``; the orchestrator compares them with the exact ones.
``overhead`` trains two identical copies of the model with AdamW. One is plain, the other is wrapped
by the system's in-loop capture (writing to its store). The copies alternate in blocks of steps,
and each block's seconds per step is one sample.

The adapters use each library only through its documented public API. The settings, and why they
are set that way, are in comments next to each call. One thing is the same for all of them: every
system keeps k·k = 64 floats per scored layer per example (or, for TRAK, the same total over the
whole model).
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import (RELATIVE_DAMPING, Clock, dir_bytes, example_losses, linear_names, load,  # noqa: E402
                      peak_cuda_mb, peak_rss_mb, threads, warm_up)

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


# ---------------------------------------------------------------------------------------------------
# olmo_tda


def olmo_tda_attr(w, model, train, query, tmp: Path, *, eigen: bool = False, head_budget: bool = False,
                  budget: bool = False, influence: bool = False, unprojected: bool = False) -> dict:
    from olmo_tda import CaptureConfig, GradientCapture
    from olmo_tda.capture import activation_grads_only, estimate_eigenbasis
    from olmo_tda.config import LayerOverride, ProjectionType, StoreConfig
    from olmo_tda.methods import attribute
    from olmo_tda.store import GradientStore

    with Clock() as c_train:
        if eigen:
            # the same floats per layer as everyone (k·k), spent as LoRIF rank-1 factors of a wider
            # eigen projection: k' = k·k/2 per side, A [k', 1] and B [k', 1]
            cfg = CaptureConfig(proj_dim=w.k * w.k // 2, proj_type=ProjectionType.EIGEN, rank=1)
            if head_budget:
                # the output head carries most of the gradient (74% of the KFAC energy tr E[ggᵀ]·tr E[aaᵀ]
                # of the basis batches here; 65% of the score mass in fidelity_bytes.py): it gets k=8k,
                # every other layer k=2k, rank 1 (4k floats), and the head the largest rank (up to 3,
                # 16k floats each) that keeps the total within the others' k·k per layer: rank 3 on the
                # plain LM's 13 layers (768 floats of 832), rank 2 on OLMo's 9 (512 of 576)
                # (the head is the last nn.Linear: TinyLM's head, OLMo's untied transformer.ff_out)
                names = linear_names(model)
                head_rank = min(3, (w.k * w.k * len(names) - 4 * w.k * (len(names) - 1)) // (16 * w.k))
                if head_rank < 1:
                    raise ValueError(f"head-weighted: {len(names)} layers at k={w.k} leave the head no rank")
                cfg.proj_dim = 2 * w.k
                cfg.overrides = [LayerOverride(modules=[names[-1]], proj_dim=8 * w.k, rank=head_rank)]
            if budget:
                # the same floats as everyone's k·k per layer in all, split across the layers by their
                # spectra (capture.budget); dense rows, no side wider than k·k
                cfg.proj_dim, cfg.rank, cfg.budget = w.k * w.k, 0, w.k * w.k * len(linear_names(model))
            # data-aware projection: the KFAC eigenbasis of each layer, from 4 batches at these
            # weights (its cost is counted in the train pass)
            batches = [train[i * w.batch:(i + 1) * w.batch] for i in range(4)]
            with Clock() as c_basis:     # a fixed cost, paid once per basis: its share of the pass is reported
                basis = estimate_eigenbasis(model, batches, lambda m, b: example_losses(m(b), b).sum(), cfg)
                basis.save(tmp / "basis.safetensors")
            cfg.basis = str(tmp / "basis.safetensors")
        elif unprojected:
            # Kronfluence's setting: no projection, every example's full gradient (here stored)
            cfg = CaptureConfig(proj_dim=0)
        else:
            cfg = CaptureConfig(proj_dim=w.k, seed=0)
        cap = GradientCapture(model, cfg)
        store = GradientStore.create(tmp / "store", cap.store_metadata(), StoreConfig())
        with activation_grads_only(model):        # the post-hoc path of `olmo-tda attribute`
            for lo in range(0, len(train), w.batch):
                batch = train[lo:lo + w.batch]
                with cap.record(np.arange(lo, lo + len(batch))) as rec:
                    example_losses(model(batch), batch).sum().backward()
                store.append(rec.to_record(step=0, lr=0.0))
        store.close()
    with Clock() as c_query:
        with activation_grads_only(model):
            with cap.record(np.arange(len(query))) as qrec:
                example_losses(model(query), query).sum().backward()
        # influence: explicit per-layer projected Fisher, λ_l = 0.1·tr(F_l)/D_l (our default damping). Not
        # our default hessian (ekfac, which predicts retraining better): raw is our closest to the exact
        # damped-Fisher influence this column measures (benchmarks/peers/influence_levers.py). Unprojected,
        # raw would be a D×D matrix per layer (the head: 16384²), so that row uses ekfac, as Kronfluence does
        # The capture.budget row (eigen coordinates chosen for influence) uses hessian="joint": one Fisher
        # over all its layers together, TRAK's estimator (levers: 0.46 → 0.49 here, 0.41 → 0.53 on OLMo)
        hessian = "ekfac" if unprojected else "joint" if budget else "raw"
        method = {"method": "influence", "hessian": hessian, "damping_ratio": RELATIVE_DAMPING} if influence \
            else {"method": "graddot"}
        res = attribute(GradientStore.open(tmp / "store"), qrec, top_k=100, return_scores=True, **method)
    order = np.argsort(res.all_ids)
    scores = res.all_scores.cpu().numpy()[:, order]
    shapes = [(p.k_out, p.k_in) for p in cap.projectors.values()]
    floats = cap.floats_per_example
    cap.remove()
    # the floor every system shares: the same forward+backward with nothing captured
    with Clock() as c_bare, activation_grads_only(model):
        for lo in range(0, len(train), w.batch):
            batch = train[lo:lo + w.batch]
            example_losses(model(batch), batch).sum().backward()
    model.zero_grad(set_to_none=True)
    kind = "proj_dim=0 (unprojected)" if unprojected else f"proj_dim={w.k}, orthogonal random"
    if eigen:
        kind = (f"proj_dim={cfg.proj_dim}, proj_type=eigen (KFAC eigenbasis from 4 batches, timed: "
                f"{c_basis.seconds:.2f} s of the pass's {c_train.seconds:.2f} s), rank={cfg.rank}"
                + (f", overrides=[{cfg.overrides[0].modules[0]}: proj_dim={8 * w.k}, "
                   f"rank={cfg.overrides[0].rank}]" if head_budget else "")
                + (f", budget={cfg.budget} (widths {' '.join('x'.join(map(str, p)) for p in shapes)})"
                   if budget else ""))
    return {"train_s": c_train.seconds, "query_s": c_query.seconds, "store_bytes": dir_bytes(tmp / "store"),
            "bare_pass_examples_per_s": len(train) / c_bare.seconds, "floats_per_example": floats,
            "scores": scores, "settings": f"CaptureConfig({kind}), graddot, fp32 HDF5 store",
            "influence_settings": f"influence hessian={method.get('hessian')}, damping_ratio {RELATIVE_DAMPING}"}


def olmo_tda_loop(w, model, opt, tmp: Path):
    from olmo_tda import CaptureConfig, GradientCapture
    from olmo_tda.config import StoreConfig
    from olmo_tda.store import GradientStore

    cap = GradientCapture(model, CaptureConfig(proj_dim=w.k, seed=0))
    store = GradientStore.create(tmp / "loop", cap.store_metadata(), StoreConfig(flush_every=10 ** 6))
    state = {"step": 0, "seen": 0}

    def step(batch):
        loss_scale = batch.shape[0]          # the loop trains on the batch mean; capture undoes it
        with cap.record(np.arange(state["seen"], state["seen"] + len(batch)), loss_scale=loss_scale) as rec:
            (example_losses(model(batch), batch).sum() / loss_scale).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        store.append(rec.to_record(step=state["step"], lr=1e-4))
        state["step"] += 1
        state["seen"] += len(batch)

    return step, store.flush, "mean"


# ---------------------------------------------------------------------------------------------------
# dattri-llm


def _dattri_llm_manager(w, model, out: Path, interval: int):
    from dattri_llm import GradientStorageManager, HookManager, HookManagerConfig, OffloadCallback

    # logra = Kronecker projection, proj_dim per factor, so k·k floats per layer (as ours).
    # The documented "device" projection key crashes the logra hook in 0.1.0, so it is left out.
    proj = {"__default__": {"style": "logra", "proj_dim": w.k, "proj_type": "normal",
                            "proj_max_batch_size": w.batch, "proj_seed": 0}}
    cfg = HookManagerConfig(linear_io=[f"^{n}$" for n in linear_names(model)], projection_kwargs=proj)
    fm = GradientStorageManager(str(out))
    hm = HookManager(model, config=cfg, callbacks=[OffloadCallback(offload_interval=interval, file_manager=fm,
                                                                   recording_type="per_sample")])
    return hm


def _dattri_llm_capture(w, model, ids, out: Path) -> None:
    hm = _dattri_llm_manager(w, model, out, interval=32)
    with hm.collect():
        for lo in range(0, len(ids), w.batch):
            batch = ids[lo:lo + w.batch]
            model.zero_grad(set_to_none=True)
            # a SUM over examples: each captured gradient is that example's own
            example_losses(model(input_ids=batch), batch).sum().backward()
    hm.remove()
    model.zero_grad(set_to_none=True)


def _dattri_llm_args(w, tmp: Path):
    from dattri_llm import AttributionArguments

    return AttributionArguments(output_dir=str(tmp / "attr"), per_device_train_batch_size=w.batch,
                                per_device_eval_batch_size=w.batch, use_cpu=w.device == "cpu",
                                dataloader_pin_memory=False)


def _dattri_llm_scores(w, score, train, query) -> np.ndarray:
    """(Q, N) from its (n_train, n_query) score, rows identified by content hash."""
    from dattri_llm import hash_batch

    tr_h = sum((hash_batch({"input_ids": train[lo:lo + w.batch]}) for lo in range(0, len(train), w.batch)), [])
    return score.query(tr_h, hash_batch({"input_ids": query})).T.cpu().numpy()


def dattri_llm_attr(w, model, train, query, tmp: Path) -> dict:
    from dattri_llm import TracInAttributor

    with Clock() as c_train:
        _dattri_llm_capture(w, model, train, tmp / "train")
    with Clock() as c_query:
        _dattri_llm_capture(w, model, query, tmp / "query")
        s = TracInAttributor(_dattri_llm_args(w, tmp)).attribute_from_cache(str(tmp / "train"), str(tmp / "query"))
        scores = _dattri_llm_scores(w, s, train, query)
    return {"train_s": c_train.seconds, "query_s": c_query.seconds, "store_bytes": dir_bytes(tmp / "train"),
            "scores": scores, "settings": f"HookManager logra proj_dim={w.k} normal, TracInAttributor (graddot)"}


def dattri_llm_infl(w, model, train, query, tmp: Path) -> dict:
    from dattri_llm import EKFACAttributor

    with Clock() as c:         # from the model to the scores, as every system's influence time
        _dattri_llm_capture(w, model, train, tmp / "train")
        _dattri_llm_capture(w, model, query, tmp / "query")
        s = EKFACAttributor(_dattri_llm_args(w, tmp)).attribute_from_cache(
            str(tmp / "train"), str(tmp / "query"), damping=RELATIVE_DAMPING, relative_damping=True)
    return {"infl_s": c.seconds, "scores": _dattri_llm_scores(w, s, train, query),
            "settings": f"EKFACAttributor on the logra k={w.k} store, damping={RELATIVE_DAMPING}, relative_damping=True"}


def dattri_llm_loop(w, model, opt, tmp: Path):
    hm = _dattri_llm_manager(w, model, tmp / "loop", interval=10 ** 6)
    ctx = {"cm": None}

    def step(batch):
        if ctx["cm"] is None:
            ctx["cm"] = hm.collect()
            ctx["cm"].__enter__()
        example_losses(model(input_ids=batch), batch).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def end():
        # leaving collect() runs the callbacks' flush: the block's records go to disk here
        ctx["cm"].__exit__(None, None, None)
        ctx["cm"] = None

    return step, end, "sum"


# ---------------------------------------------------------------------------------------------------
# dattri (LoGra)


class _WithLoss(torch.nn.Module):
    """dattri's LoGra computes query gradients as ``model(**batch).loss`` and rescales per-example
    gradients by the batch size (HF mean convention), so the loss is the batch MEAN here."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return SimpleNamespace(loss=example_losses(self.lm(input_ids), input_ids).mean())


class _DictDS(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def _dattri_logra(w, model, train, query, tmp: Path, **options):
    """(attributor, train loader, query loader); proj_dim = k·k per layer (√ per factor)."""
    from dattri.algorithm.logra import LoGraAttributor
    from dattri.task import AttributionTask
    from torch.utils.data import DataLoader

    wrapped = _WithLoss(model)
    task = AttributionTask(loss_func=lambda m, batch, device: m(**batch).loss, model=wrapped,
                           checkpoints=wrapped.state_dict())
    attr = LoGraAttributor(task=task, layer_names=[f"lm.{n}" for n in linear_names(model)], device=w.device,
                           proj_dim=w.k * w.k, offload="cpu", cache_dir=str(tmp / "cache"), **options)
    return (attr, DataLoader(_DictDS(train), batch_size=w.batch, shuffle=False),
            DataLoader(_DictDS(query), batch_size=w.batch, shuffle=False))


def dattri_attr(w, model, train, query, tmp: Path) -> dict:
    # "Identity" Hessian = projected graddot
    attr, tr, qd = _dattri_logra(w, model, train, query, tmp, hessian="Identity")
    with Clock() as c_train:
        attr.cache(tr)
    with Clock() as c_query:
        scores = attr.attribute(tr, qd).T.cpu().numpy()
    # offload="disk" needs pinned memory (CUDA) in 0.3.0, so the store is held in RAM: its size is
    # the projected rows it holds, k·k fp32 per layer
    held = len(train) * w.k * w.k * len(linear_names(model)) * 4
    return {"train_s": c_train.seconds, "query_s": c_query.seconds, "store_bytes": held, "scores": scores,
            "settings": f"LoGraAttributor proj_dim={w.k * w.k} hessian=Identity offload=cpu (disk offload needs "
                        "CUDA pinned memory; bytes/ex = the rows it holds in RAM)"}


def dattri_infl(w, model, train, query, tmp: Path) -> dict:
    # eFIM: explicit k×k empirical Fisher per layer; damping is relative (× tr/dim) in dattri
    attr, tr, qd = _dattri_logra(w, model, train, query, tmp, hessian="eFIM", damping=RELATIVE_DAMPING)
    with Clock() as c:
        attr.cache(tr)
        scores = attr.attribute(tr, qd).T.cpu().numpy()
    return {"infl_s": c.seconds, "scores": scores,
            "settings": f"LoGraAttributor proj_dim={w.k * w.k} hessian=eFIM damping={RELATIVE_DAMPING} (relative)"}


# ---------------------------------------------------------------------------------------------------
# traker (TRAK)


def traker_attr(w, model, train, query, tmp: Path, *, influence: bool = False) -> dict:
    from trak import TRAKer
    from trak.modelout_functions import AbstractModelOutput
    from trak.projectors import BasicProjector, ProjectionType

    class NegLoss(AbstractModelOutput):
        """f = −(summed CE) with a constant out-to-loss term: TRAK's features are then the projected
        per-example loss gradients (up to sign), the same quantity every other system stores."""

        def __init__(self):
            super().__init__()

        @staticmethod
        def get_output(model, weights, buffers, input_ids):
            ids = input_ids.unsqueeze(0)
            logits = torch.func.functional_call(model, (weights, buffers), args=(ids,))
            return -example_losses(logits, ids).sum()

        def get_out_to_loss_grad(self, model, weights, buffers, batch):
            return torch.ones(batch[0].shape[0], 1, device=batch[0].device)

    names = linear_names(model)
    grad_wrt = [f"{n}.weight" for n in names]
    params = dict(model.named_parameters())
    grad_dim = sum(params[n].numel() for n in grad_wrt)
    k_total = w.k * w.k * len(names)                     # the same floats per example as the others
    # CPU forces BasicProjector (normal), and on a GPU it is kept (its CudaProjector needs the fast_jl
    # extension built); block_size < proj_dim avoids its free_memory() bug
    proj = BasicProjector(grad_dim=grad_dim, proj_dim=k_total, seed=0, block_size=min(100, k_total // 2),
                          proj_type=ProjectionType.normal, device=w.device, dtype=torch.float32)
    n, q = len(train), len(query)
    extra = 0 if influence else q
    traker = TRAKer(model=model, task=NegLoss(), train_set_size=n + extra, save_dir=str(tmp / "trak"), device=w.device,
                    projector=proj, use_half_precision=False, grad_wrt=grad_wrt, lambda_reg=w.damping)
    ckpt = {k: v.clone() for k, v in model.state_dict().items()}
    traker.load_checkpoint(ckpt, model_id=0)
    with Clock() as c_train:
        for lo in range(0, n, w.batch):
            batch = train[lo:lo + w.batch]
            traker.featurize(batch=(batch,), num_samples=len(batch))
    if influence:
        # TRAK's own estimator, φ_q (ΦᵀΦ + λI)⁻¹ Φᵀ, with λ relative like everyone's: 0.1·tr(ΦᵀΦ)/k
        # (its lambda_reg is absolute, so it is set once the features exist)
        phi = torch.as_tensor(np.asarray(traker.saver.current_store["grads"][:]), dtype=torch.float64)
        traker.score_computer.lambda_reg = RELATIVE_DAMPING * float((phi * phi).sum()) / k_total
        with Clock() as c_infl:
            traker.finalize_features()
            traker.start_scoring_checkpoint(exp_name="qi", checkpoint=ckpt, model_id=0, num_targets=q)
            traker.score(batch=(query,), num_samples=q)
            scores = np.asarray(traker.finalize_scores(exp_name="qi")).T
        return {"infl_s": c_train.seconds + c_infl.seconds, "scores": scores,      # featurize counted too
                "settings": f"TRAK scores (ΦᵀΦ + λI)⁻¹, whole model k={k_total}, λ = {RELATIVE_DAMPING}·tr(ΦᵀΦ)/k"}
    # the queries' features, stored as extra rows, give the graddot agreement (TRAK's own score
    # applies (ΦᵀΦ + λI)⁻¹, a different estimator)
    for lo in range(0, q, w.batch):
        traker.featurize(batch=(query[lo:lo + w.batch],), num_samples=len(query[lo:lo + w.batch]))
    store_bytes = dir_bytes(tmp / "trak")
    traker.finalize_features()
    feats = torch.as_tensor(np.asarray(traker.saver.current_store["grads"][:]), dtype=torch.float32)
    scores = (feats[n:] @ feats[:n].T).numpy()
    with Clock() as c_query:
        traker.start_scoring_checkpoint(exp_name="q", checkpoint=ckpt, model_id=0, num_targets=q)
        traker.score(batch=(query,), num_samples=q)
        traker.finalize_scores(exp_name="q")
    return {"train_s": c_train.seconds, "query_s": c_query.seconds, "store_bytes": store_bytes * n // (n + q),
            "scores": scores, "settings": f"TRAKer BasicProjector normal proj_dim={k_total} (whole model), "
                                          f"lambda_reg={w.damping}; agreement from its stored features"}


# ---------------------------------------------------------------------------------------------------
# kronfluence


def kronfluence_attr(w, model, train, query, tmp: Path, *, influence: bool = False) -> dict:
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from torch.utils.data import TensorDataset

    names = linear_names(model)

    class LMTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            (ids,) = batch
            return example_losses(model(ids), ids).sum()

        def compute_measurement(self, batch, model):
            (ids,) = batch
            return example_losses(model(ids), ids).sum()

        def get_influence_tracked_modules(self):
            return names

    task = LMTask()
    model = prepare_model(model, task)
    if influence:
        an = Analyzer("peers", model=model, task=task, cpu=w.device == "cpu", output_dir=str(tmp / "kf"),
                      disable_tqdm=True, log_level=logging.WARNING)
        with Clock() as c:
            an.fit_all_factors(factors_name="ekfac", dataset=TensorDataset(train), per_device_batch_size=w.batch,
                               factor_args=FactorArguments(strategy="ekfac"), overwrite_output_dir=True)
            # damping_factor=None: 0.1 × the mean eigenvalue per module (its heuristic = our convention)
            an.compute_pairwise_scores(scores_name="si", factors_name="ekfac", query_dataset=TensorDataset(query),
                                       train_dataset=TensorDataset(train), per_device_query_batch_size=w.batch,
                                       per_device_train_batch_size=w.batch,
                                       score_args=ScoreArguments(damping_factor=None), overwrite_output_dir=True)
        return {"infl_s": c.seconds, "scores": an.load_pairwise_scores("si")["all_modules"].numpy(),
                "settings": "EK-FAC (unprojected), damping_factor=None = 0.1 × mean eigenvalue per module"}
    an = Analyzer("peers", model=model, task=task, cpu=w.device == "cpu", output_dir=str(tmp / "kf"),
                  disable_tqdm=True, log_level=logging.WARNING)
    # Kronfluence stores no per-example gradient: the score pass recomputes every train gradient
    # against the (preconditioned) query gradients. "identity" = graddot, exact (no projection).
    an.fit_all_factors(factors_name="identity", dataset=TensorDataset(train), per_device_batch_size=w.batch,
                       factor_args=FactorArguments(strategy="identity"), overwrite_output_dir=True)
    with Clock() as c_query:
        an.compute_pairwise_scores(scores_name="s", factors_name="identity", query_dataset=TensorDataset(query),
                                   train_dataset=TensorDataset(train), per_device_query_batch_size=w.batch,
                                   per_device_train_batch_size=w.batch,
                                   score_args=ScoreArguments(damping_factor=w.damping), overwrite_output_dir=True)
        scores = an.load_pairwise_scores("s")["all_modules"].numpy()
    return {"train_s": c_query.seconds, "query_s": c_query.seconds, "store_bytes": 0, "scores": scores,
            "settings": f"strategy=identity (exact graddot, no projection), damping_factor={w.damping}; "
                        "no store: every query pass recomputes all train gradients (train_s = that pass)"}


# ---------------------------------------------------------------------------------------------------
# LogIX


def _logix_run(w, model, tmp: Path, name: str, covariance: bool = False):
    from logix import LogIX
    from logix.statistic import Covariance, Log

    cfg = tmp / f"{name}.yaml"
    # rank r = k: the logged gradient of the r×r bottleneck is k·k floats per layer
    cfg.write_text(f"root_dir: {tmp}\nlora:\n  init: random\n  rank: {w.k}\n")
    run = LogIX(name, config=str(cfg))
    run.watch(model, name_filter=linear_names(model))   # NB: freezes every untracked parameter
    run.add_lora()
    run.setup({"grad": [Log, Covariance] if covariance else [Log]})
    run.save(True)
    return run


def _logix_log(w, run, model, train) -> None:
    """Log every train example's projected gradient, then flush (``finalize``)."""
    for lo in range(0, len(train), w.batch):
        batch = train[lo:lo + w.batch]
        with run(data_id=[str(i) for i in range(lo, lo + len(batch))]):
            model.zero_grad()
            example_losses(model(batch), batch).sum().backward()
    run.finalize()


def _logix_scores(run, model, train, query, **options) -> np.ndarray:
    """[Q, N] scores of the queries against the log, columns in train order."""
    run.eval()
    loader = run.build_log_dataloader(batch_size=64)
    with run(data_id=[f"q{i}" for i in range(len(query))]):
        model.zero_grad()
        example_losses(model(query), query).sum().backward()
    res = run.compute_influence_all(run.get_log(), loader, mode="dot", **options)
    ids = [int(i) for i in res["tgt_ids"]] if "tgt_ids" in res else list(range(len(train)))
    return np.asarray(res["influence"])[:, np.argsort(ids)]


def logix_attr(w, model, train, query, tmp: Path) -> dict:
    with Clock() as c_train:
        run = _logix_run(w, model, tmp, "attr")
        _logix_log(w, run, model, train)
    with Clock() as c_query:
        scores = _logix_scores(run, model, train, query, precondition=False)
    return {"train_s": c_train.seconds, "query_s": c_query.seconds, "store_bytes": dir_bytes(tmp / "attr"),
            "scores": scores, "settings": f"LoRA init=random rank={w.k}, save=grad, mode=dot, no preconditioning"}


def logix_infl(w, model, train, query, tmp: Path) -> dict:
    with Clock() as c:
        run = _logix_run(w, model, tmp, "infl", covariance=True)     # "raw": the k×k Fisher of the log
        _logix_log(w, run, model, train)
        # damping=None: 0.1 × mean eigenvalue (in 0.1.1 the first module's value is reused for the rest)
        scores = _logix_scores(run, model, train, query, precondition=True, damping=None)
    return {"infl_s": c.seconds, "scores": scores,
            "settings": f"LoRA rank {w.k}, hessian raw (Covariance of the log), damping=None (0.1 × mean eigenvalue)"}


def logix_loop(w, model, opt, tmp: Path):
    run = _logix_run(w, model, tmp, "loop")
    # watch() and add_lora() leave only LoRA's parameters trainable: a training loop still trains the
    # model, so what the optimizer holds learns again (else this arm skips every weight gradient and
    # update the plain arm makes, and LogIX's overhead comes out too small)
    for group in opt.param_groups:
        for p in group["params"]:
            p.requires_grad_(True)
    state = {"seen": 0}

    def step(batch):
        with run(data_id=[str(i) for i in range(state["seen"], state["seen"] + len(batch))]):
            example_losses(model(batch), batch).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["seen"] += len(batch)

    return step, run.logger.finalize, "sum"


def _ours_infl(*a, **kw) -> dict:
    r = olmo_tda_attr(*a, influence=True, **kw)
    # from the model to the scores, as every system's influence time: the train capture counted too
    return {"infl_s": r["train_s"] + r["query_s"], "scores": r["scores"], "settings": r["influence_settings"]}


SYSTEMS = {
    "olmo_tda": {"attr": olmo_tda_attr, "loop": olmo_tda_loop, "infl": _ours_infl},
    "olmo_tda_eigen": {"attr": lambda *a: olmo_tda_attr(*a, eigen=True)},
    "olmo_tda_head": {"attr": lambda *a: olmo_tda_attr(*a, eigen=True, head_budget=True),
                      "infl": lambda *a: _ours_infl(*a, eigen=True, head_budget=True)},
    "olmo_tda_budget": {"attr": lambda *a: olmo_tda_attr(*a, eigen=True, budget=True),
                        "infl": lambda *a: _ours_infl(*a, eigen=True, budget=True)},
    "olmo_tda_full": {"attr": lambda *a: olmo_tda_attr(*a, unprojected=True),
                      "infl": lambda *a: _ours_infl(*a, unprojected=True)},
    "dattri_llm": {"attr": dattri_llm_attr, "loop": dattri_llm_loop, "infl": dattri_llm_infl},
    "dattri": {"attr": dattri_attr, "infl": dattri_infl},
    "traker": {"attr": traker_attr, "infl": lambda *a: traker_attr(*a, influence=True)},
    "kronfluence": {"attr": kronfluence_attr, "infl": lambda *a: kronfluence_attr(*a, influence=True)},
    "logix": {"attr": logix_attr, "loop": logix_loop, "infl": logix_infl},
}


# the adapters that place their work on the model's device: every peer's (each given the workload's
# device where it takes one), not olmo_tda's unprojected row (at a GPU workload's size its store is
# tens of GB)
ON_ANY_DEVICE = ("olmo_tda", "olmo_tda_eigen", "olmo_tda_head", "olmo_tda_budget", "dattri_llm", "kronfluence",
                 "dattri", "traker", "logix")


# ---------------------------------------------------------------------------------------------------


def _on_device(system: str, w) -> None:
    if w.device != "cpu" and system not in ON_ANY_DEVICE:
        raise NotImplementedError(f"{system}: this benchmark runs it on CPU only (device {w.device}); "
                                  f"on a GPU it compares {', '.join(ON_ANY_DEVICE)}")


def _scores_of(system: str, mode: str, workdir: Path, out: Path) -> tuple[dict, int, float]:
    """Run ``SYSTEMS[system][mode]`` on the workload, save its ``[Q, N]`` scores next to ``out``:
    ``(its other results, N, peak RSS in MB before it ran)``."""
    w, model, train, query = load(workdir)
    _on_device(system, w)
    warm_up(model, train[:w.batch])
    base = peak_rss_mb()
    with tempfile.TemporaryDirectory(prefix=f"peers_{system}_{mode}_") as tmp:
        r = SYSTEMS[system][mode](w, model, train, query, Path(tmp))
    scores = np.asarray(r.pop("scores"), dtype=np.float64)
    if scores.shape != (len(query), len(train)):
        raise RuntimeError(f"{system} returned {mode} scores of shape {scores.shape}, "
                           f"expected {(len(query), len(train))}")
    np.save(out.with_suffix(".npy"), scores)
    return r, len(train), base


def run_attr(system: str, workdir: Path, out: Path) -> dict:
    r, n, base = _scores_of(system, "attr", workdir, out)
    peak = peak_rss_mb()
    return {**r, "examples_per_s": n / r["train_s"], "bytes_per_example": r["store_bytes"] / n,
            "peak_rss_mb": peak, "peak_over_model_mb": peak - base, "peak_cuda_mb": peak_cuda_mb()}


def run_overhead(system: str, workdir: Path, out: Path, rounds: int = 6, block: int = 6) -> dict:
    w, model, train, _ = load(workdir)
    _on_device(system, w)
    if "loop" not in SYSTEMS[system]:
        raise NotImplementedError(f"{system} has no in-loop capture: it only runs post hoc from a checkpoint")
    plain, captured = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_c = torch.optim.AdamW(captured.parameters(), lr=1e-4)
    with tempfile.TemporaryDirectory(prefix=f"peers_{system}_loop_") as tmp:
        cap_step, cap_end, form = SYSTEMS[system]["loop"](w, captured, opt_c, Path(tmp))

        def plain_step(batch):
            loss = example_losses(plain(batch), batch).sum()
            (loss / len(batch) if form == "mean" else loss).backward()
            opt_p.step()
            opt_p.zero_grad(set_to_none=True)

        arms = {"plain": (plain_step, lambda: None), "capture": (cap_step, cap_end)}
        times = {"plain": [], "capture": []}
        nb = len(train) // w.batch
        b = 0
        for r in range(rounds + 1):                       # round 0 warms up
            for arm in (("plain", "capture") if r % 2 else ("capture", "plain")):
                step, end = arms[arm]
                with Clock() as c:
                    for _ in range(block):
                        step(train[(b % nb) * w.batch:(b % nb + 1) * w.batch])
                        b += 1
                    end()
                if r:
                    times[arm].append(c.seconds / block)
    med = {a: float(np.median(t)) for a, t in times.items()}
    return {"plain_step_s": med["plain"], "capture_step_s": med["capture"], "overhead": med["capture"] / med["plain"] - 1,
            "samples": times, "peak_rss_mb": peak_rss_mb(), "peak_cuda_mb": peak_cuda_mb()}


def run_infl(system: str, workdir: Path, out: Path) -> dict:
    return _scores_of(system, "infl", workdir, out)[0]


def main(argv: list[str]) -> int:
    system, mode, workdir, out = argv[0], argv[1], Path(argv[2]), Path(argv[3])
    threads()
    try:
        if mode == "infl" and "infl" not in SYSTEMS[system]:
            raise NotImplementedError(f"{system}: no curvature (influence) mode in this benchmark")
        run = {"attr": run_attr, "overhead": run_overhead, "infl": run_infl}[mode]
        result = run(system, workdir, out)
        result["ok"] = True
    except Exception as exc:                 # reported as that system's failure, with the reason
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result.update(system=system, mode=mode, torch=torch.__version__)
    out.write_text(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
