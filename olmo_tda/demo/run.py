"""The embedded demo: train a tiny OLMo on shipped text with capture on, then ask which passages
made it say something.

Everything is real: an ``olmo.model.OLMo``, an AdamW loop with OLMo's loss normalization (CE sum /
tokens in the batch), the hook-based capture, the async HDF5 store, and streaming attribution. It
needs no network and finishes in about a minute on 2 CPU cores.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..capture import GradientCapture
from ..config import CaptureConfig, StoreConfig, StoreDType
from ..methods import attribute
from ..report.html import plot_training, write_attribution_report
from ..store import GradientStore
from .corpus import ByteTokenizer, build_passages, corpus_fingerprint

__all__ = ["DemoConfig", "DemoSummary", "run_demo"]

log = logging.getLogger(__name__)

FREE_QUERIES = [
    "The for statement is used to iterate over the elements of a sequence",
    "Return a new dictionary initialized from an optional positional argument",
    "raise an exception if the file does not exist",
]


@dataclass(kw_only=True)
class DemoConfig:
    num_passages: int = 3072
    """Training examples (passages of ``seq_len`` bytes from the shipped corpus)."""
    seq_len: int = 64
    batch_size: int = 16
    epochs: int = 2
    d_model: int = 128
    n_layers: int = 2
    lr: float = 3e-3
    proj_dim: int = 16
    store_dtype: StoreDType = StoreDType.FLOAT16
    num_self_queries: int = 8
    top_k: int = 5
    seed: int = 0


@dataclass
class DemoSummary:
    out_dir: Path
    examples_captured: int
    rows_captured: int
    hits: int
    num_self_queries: int
    wall_s: float
    final_loss: float
    store_bytes: int
    report: Path
    results: list[dict] = field(default_factory=list)

    def line(self) -> str:
        return (f"demo: {self.examples_captured} examples captured, self-query top-1 hit rate "
                f"{self.hits}/{self.num_self_queries}, wall {self.wall_s:.0f} s")


def _model(cfg: DemoConfig, vocab_size: int):
    from olmo.config import ModelConfig
    from olmo.model import OLMo

    torch.manual_seed(cfg.seed)
    model = OLMo(ModelConfig(
        d_model=cfg.d_model, n_heads=max(1, cfg.d_model // 32), n_layers=cfg.n_layers, mlp_ratio=4,
        vocab_size=vocab_size, embedding_size=((vocab_size + 127) // 128) * 128, max_sequence_length=cfg.seq_len,
        rope=True, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0, weight_tying=False,
        include_bias=False, init_device="cpu"))
    model.reset_parameters()
    return model


def _losses(model, tokens_BT: torch.Tensor) -> torch.Tensor:
    logits = model(tokens_BT).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens_BT[:, 1:].flatten(),
                                             reduction="none").view(tokens_BT.shape[0], -1).sum(1)


def _train(cfg: DemoConfig, model, capture: GradientCapture, data: torch.Tensor, passages: list[str], out: Path,
           progress: bool) -> tuple[list[int], list[float], list[float]]:
    """The training loop: OLMo's loss normalization, capture around backward, store after the step."""
    from tqdm.auto import tqdm

    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    steps_per_epoch = len(data) // cfg.batch_size
    total = steps_per_epoch * cfg.epochs
    schedule = lambda s: cfg.lr * min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / total))
    meta = capture.store_metadata() | {"extra": {"corpus": corpus_fingerprint(passages), "demo": True}}
    gen = torch.Generator().manual_seed(cfg.seed)
    steps, losses, gnorms = [], [], []
    with GradientStore.create(out / "store", meta, StoreConfig(dtype=cfg.store_dtype, flush_every=64)) as store:
        bar = tqdm(total=total, desc="demo: train + capture", disable=not progress, unit="step")
        for step in range(total):
            if step % steps_per_epoch == 0:
                order = torch.randperm(len(data), generator=gen)
            ids = order[(step % steps_per_epoch) * cfg.batch_size:][: cfg.batch_size]
            batch = data[ids]
            lr = schedule(step)
            for group in optim.param_groups:
                group["lr"] = lr
            loss_scale = batch.numel()                       # OLMo: CE sum / tokens in the batch
            loss = _losses(model, batch).sum() / loss_scale
            with capture.record(ids, loss_scale=loss_scale) as rec:
                loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            record = rec.to_record(step=step, lr=lr)
            store.append(record)
            steps.append(step)
            losses.append(loss.item() * loss_scale / (batch.shape[0] * (batch.shape[1] - 1)))
            gnorms.append(float(torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in record.grads.values())).mean()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.close()
    return steps, losses, gnorms


def _query_gradients(cfg: DemoConfig, model, capture: GradientCapture, passages: list[str]
                     ) -> tuple[dict[str, torch.Tensor], list[int], list[str]]:
    """Self-queries (training passages) and free-text queries, at the final weights."""
    tok = ByteTokenizer()
    rng = np.random.default_rng(cfg.seed)
    self_ids = sorted(rng.choice(len(passages), size=cfg.num_self_queries, replace=False).tolist())
    query_texts = [passages[i] for i in self_ids] + FREE_QUERIES
    grads: dict[str, list[torch.Tensor]] = {}
    for text in query_texts:              # one at a time: free queries have different lengths
        with capture.record([0]) as rec:
            _losses(model, torch.tensor([tok.encode(text)])).sum().backward()
        model.zero_grad(set_to_none=True)
        for name, g in rec.dense().items():
            grads.setdefault(name, []).append(g)
    return {n: torch.cat(gs) for n, gs in grads.items()}, self_ids, query_texts


def run_demo(out_dir: str | Path, cfg: DemoConfig | None = None, *, progress: bool = True) -> DemoSummary:
    """Train, capture, store, query, report. Returns the summary (and writes ``report.html``)."""
    cfg = cfg or DemoConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok = ByteTokenizer()
    passages = build_passages(cfg.num_passages, cfg.seq_len, seed=cfg.seed)
    data = torch.tensor([tok.encode(p) for p in passages], dtype=torch.long)          # [N, T]
    (out / "passages.jsonl").write_text("".join(json.dumps({"index": i, "text": p}) + "\n"
                                                for i, p in enumerate(passages)))
    model = _model(cfg, tok.vocab_size)
    with GradientCapture(model, CaptureConfig(proj_dim=cfg.proj_dim, seed=cfg.seed)) as capture:  # removes hooks
        steps, losses, gnorms = _train(cfg, model, capture, data, passages, out, progress)
        queries, self_ids, query_texts = _query_gradients(cfg, model, capture, passages)
        result = attribute(out / "store", queries, method="gradcos", top_k=cfg.top_k,
                           projector_hash=capture.projector_hash)
    total = len(steps)

    hits = 0
    report_queries = []
    for q, (text, top) in enumerate(zip(query_texts, result.as_dicts())):
        target = self_ids[q] if q < len(self_ids) else None
        hit = bool(top) and top[0]["index"] == target
        hits += hit
        for r in top:
            r["text"] = passages[r["index"]]
            r["hit"] = r["index"] == target
        report_queries.append({"query": text, "kind": "self-query (a training passage)" if target is not None
                               else "free-text query", "target": target, "results": top})
    reader = GradientStore.open(out / "store")
    wall = time.perf_counter() - t0
    plot = plot_training(out / "training.png", steps, losses, gnorms, title="demo")
    summary = DemoSummary(out_dir=out, examples_captured=reader.num_examples, rows_captured=reader.num_rows,
                          hits=hits, num_self_queries=len(self_ids), wall_s=wall, final_loss=float(np.mean(losses[-20:])),
                          store_bytes=reader.nbytes, report=out / "report.html", results=report_queries)
    write_attribution_report(summary.report, title="olmo_tda demo", images=[plot], queries=report_queries, summary={
        "examples captured": summary.examples_captured, "rows (example, step)": summary.rows_captured,
        "steps": total, "final loss (nats/token)": f"{summary.final_loss:.3f}", "method": "gradcos",
        "projection": f"orthogonal k={cfg.proj_dim}", "store": f"{summary.store_bytes / 2**20:.1f} MiB "
        f"({cfg.store_dtype.value})", "self-query top-1": f"{hits}/{len(self_ids)}", "wall": f"{wall:.0f} s"})
    (out / "results.json").write_text(json.dumps(report_queries, indent=1))
    return summary
