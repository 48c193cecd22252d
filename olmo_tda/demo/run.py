"""The embedded demo: pretrain a tiny OLMo on shipped text with ``tda.enabled: true``, then ask which
passages made it say something.

Everything is the product's real path: the shipped corpus is written as OLMo memmap data, OLMo's own
data loader, optimizer and scheduler run inside :class:`~olmo_tda.integrations.olmo.TDATrainer`
(the same code as ``olmo-tda train``), the async HDF5 store records every example of every step,
and the queries go through :class:`~olmo_tda.integrations.olmo_query.OLMoRun` (the same code as
``olmo-tda attribute``). No network; about a minute on 2 CPU cores.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from ..report.html import plot_training, write_attribution_report
from .corpus import build_passages
from .data import write_memmap

__all__ = ["DemoConfig", "DemoSummary", "run_demo", "demo_config_path"]

log = logging.getLogger(__name__)

# Each fits the demo model's 64-token context (a byte tokenizer: one token per UTF-8 byte), else it is cut.
FREE_QUERIES = [
    "The for statement iterates over the elements of a sequence",
    "Return a new dictionary initialized from an optional argument",
    "raise an exception if the file does not exist",
]


def demo_config_path() -> Path:
    """The demo's OLMo YAML (shipped in the package; ``configs/demo_tiny.yaml`` links to it)."""
    return Path(str(resources.files("olmo_tda.demo") / "demo_tiny.yaml"))


@dataclass(kw_only=True)
class DemoConfig:
    num_passages: int = 3072
    """Training examples (passages of 64 bytes from the shipped corpus)."""
    epochs: int = 2
    batch_size: int = 16
    proj_dim: int = 16
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


def run_demo(out_dir: str | Path, cfg: DemoConfig | None = None, *, progress: bool = True) -> DemoSummary:
    """Write data, train with capture, query, report. Returns the summary (and writes ``report.html``)."""
    from tqdm.auto import tqdm

    from ..integrations.olmo import load_configs
    from ..integrations.olmo_query import OLMoRun
    from ..integrations.olmo_train import train

    cfg = cfg or DemoConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    seq_len = 64
    passages = build_passages(cfg.num_passages, seq_len, seed=cfg.seed)
    data = write_memmap(passages, out / "data" / "train.npy", seq_len)
    steps = cfg.num_passages // cfg.batch_size * cfg.epochs
    train_cfg, tda_cfg = load_configs(demo_config_path(), [
        f"--max_duration={steps}", f"--stop_at={steps}", f"--save_interval_unsharded={steps}",
        f"--global_train_batch_size={cfg.batch_size}", f"--tda.capture.proj_dim={cfg.proj_dim}",
        f"--tda.capture.seed={cfg.seed}", "--console_log_interval=1000000",
        f"--tda.trajectory.every={max(1, steps // 4)}"])      # 5 trajectory checkpoints for TracIn
    # paths set on the config, not as overrides: OLMo's override parser reads `,` and `]` in a path as YAML
    train_cfg.data.paths = [str(data)]
    train_cfg.save_folder = str(out / "run")
    bar = tqdm(total=steps, desc="demo: OLMo pretraining with capture", unit="step", disable=not progress)

    def on_step(step: int, metrics: dict) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{metrics.get('train/CrossEntropyLoss', float('nan')):.3f}")

    train(train_cfg, tda_cfg, step_callbacks=[on_step])
    bar.close()

    run = OLMoRun(out / "run")
    rng = np.random.default_rng(cfg.seed)
    self_ids = sorted(rng.choice(len(passages), size=cfg.num_self_queries, replace=False).tolist())
    texts = [passages[i] for i in self_ids] + FREE_QUERIES
    answers = run.attribute(texts, top_k=cfg.top_k)           # the default: influence, joint Fisher
    hits = 0
    for q, answer in enumerate(answers):
        target = self_ids[q] if q < len(self_ids) else None
        answer["kind"] = "self-query (a training passage)" if target is not None else "free-text query"
        answer["target"] = target
        for row in answer["results"]:
            row["hit"] = row["index"] == target
        hits += bool(answer["results"]) and answer["results"][0]["hit"]
    wall = time.perf_counter() - t0

    metrics = [json.loads(line) for line in (out / "run" / "tda" / "metrics.jsonl").read_text().splitlines()]
    by_step = {m["step"]: m for m in metrics}            # a resumed run may repeat steps: keep the last
    xs = sorted(by_step)
    plot = plot_training(out / "training.png", xs, [by_step[x]["train/CrossEntropyLoss"] for x in xs],
                         [by_step[x].get("tda/examples_per_s", float("nan")) for x in xs], title="demo",
                         second_label="captured examples / s")
    store = run.store
    summary = DemoSummary(out_dir=out, examples_captured=store.num_examples, rows_captured=store.num_rows,
                          hits=hits, num_self_queries=len(self_ids), wall_s=wall,
                          final_loss=float(np.mean([by_step[x]["train/CrossEntropyLoss"] for x in xs[-20:]])),
                          store_bytes=store.nbytes, report=out / "report.html", results=answers)
    write_attribution_report(summary.report, title="olmo_tda demo", images=[plot], queries=answers, summary={
        "examples captured": summary.examples_captured, "rows (example, step)": summary.rows_captured,
        "steps": steps, "final loss (nats/token)": f"{summary.final_loss:.3f}", "method": "influence (joint Fisher)",
        "projection": f"{tda_cfg.capture.proj_type.value} k={cfg.proj_dim}",
        "store": f"{summary.store_bytes / 2**20:.1f} MiB ({tda_cfg.store.dtype.value})",
        "self-query top-1": f"{hits}/{len(self_ids)}", "wall": f"{wall:.0f} s", "run": str(out / "run")})
    (out / "results.json").write_text(json.dumps(answers, indent=1))
    return summary
