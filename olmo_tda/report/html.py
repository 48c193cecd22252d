"""A self-contained HTML report: top-k training passages per query and plots of the run.

Plots are PNGs (matplotlib, Agg backend) written beside the HTML and linked, so the report opens
from a cluster filesystem or a laptop without a server.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Sequence

from ..config import ConfigError

__all__ = ["plot_training", "plot_selection", "read_metrics", "write_attribution_report", "write_run_report"]


def plot_training(path: Path, steps: Sequence[int], losses: Sequence[float],
                  grad_norms: Sequence[float] | None = None, title: str = "training",
                  second_label: str = "‖ĝ‖ (mean over batch)") -> Path:
    """Loss curve (and a second per-step capture statistic, if given) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if grad_norms is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.2), squeeze=False)
    axes[0][0].plot(steps, losses, lw=1)
    axes[0][0].set(xlabel="step", ylabel="loss (nats/token)", title=f"{title}: loss")
    if grad_norms is not None:
        axes[0][1].plot(steps, grad_norms, lw=1, color="tab:orange")
        axes[0][1].set(xlabel="step", ylabel=second_label, title="capture")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_selection(path: Path, rounds: Sequence[dict[str, Any]]) -> Path:
    """The selection rounds of a run (``tda/selection/rounds.jsonl``) as a PNG: promoted vs demoted
    mean score (the sources policy: its weights per source), rank correlation with the previous round,
    the front's fraction per data source, and seconds per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rounds]
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.4))
    weighted = sorted({s for r in rounds for s in (r.get("source_weight") or {})})
    if weighted:        # the sources policy: its weights per source, not per-example scores
        for src in weighted:
            axes[0].plot(steps, [(r.get("source_weight") or {}).get(src, float("nan")) for r in rounds], ".-",
                         label=src)
        axes[0].set(xlabel="step", ylabel="weight", title="source weights (sources)", ylim=(0, 1))
    for key, label in (("promoted_mean_score", "promoted"), ("demoted_mean_score", "demoted")) if not weighted else ():
        axes[0].plot(steps, [r.get(key) if r.get(key) is not None else float("nan") for r in rounds], ".-", label=label)
    if not weighted:
        axes[0].set(xlabel="step", ylabel="mean score", title=f"scores ({rounds[0].get('policy', '?')})")
    axes[0].legend()
    axes[1].plot(steps, [r["rank_corr_prev"] if r.get("rank_corr_prev") is not None else float("nan")
                         for r in rounds], ".-", color="tab:purple")
    axes[1].set(xlabel="step", ylabel="Spearman", title="rank correlation with the previous round", ylim=(-1, 1))
    sources = sorted({s for r in rounds for s in (r.get("source_frac_front") or {})})
    for src in sources:
        axes[2].plot(steps, [(r.get("source_frac_front") or {}).get(src, float("nan")) for r in rounds], ".-",
                     label=src)
    axes[2].set(xlabel="step", ylabel="fraction", title="front of the window, per source", ylim=(0, 1))
    if sources:
        axes[2].legend()
    axes[3].bar(steps, [r.get("seconds", 0.0) for r in rounds],
                width=max(1, (steps[-1] - steps[0]) / max(len(steps), 1) * 0.6)
                if len(steps) > 1 else 1, color="tab:gray")
    axes[3].set(xlabel="step", ylabel="s", title="seconds per round")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``tda/metrics.jsonl``, one per step (a step written twice, by a run
    resumed before its resume cut the file back, keeps its last row), in step order. A torn last
    line (a crash mid-write) is skipped; any other line that is not a JSON object is an error
    naming ``path:line``."""
    import json

    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    by_step: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise ConfigError(f"{path}:{n}: corrupt line (not JSON)") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ConfigError(f"{path}:{n}: expected a JSON object with an integer 'step'")
        by_step[row["step"]] = row
    return [by_step[step] for step in sorted(by_step)]


def write_run_report(run_dir: Path, path: Path | None = None) -> Path:
    """``<run>/tda/report.html`` (or ``path``): the run's training curve from ``tda/metrics.jsonl``
    and, when the run selected data online, its selection rounds. Plots sit beside the HTML.
    ``run_dir`` may be the demo's output folder (its run is in ``run/``)."""
    from ..training.selection import SelectionLog

    run_dir = Path(run_dir)
    if not (run_dir / "tda").is_dir() and (run_dir / "run" / "tda").is_dir():
        run_dir = run_dir / "run"                        # the demo's output folder
    tda = run_dir / "tda"
    metrics_file = tda / "metrics.jsonl"
    rounds_file = tda / "selection" / "rounds.jsonl"
    if not metrics_file.is_file() and not rounds_file.is_file():
        raise FileNotFoundError(f"{run_dir}: no tda/metrics.jsonl or tda/selection/rounds.jsonl to report on")
    rows = [r for r in read_metrics(metrics_file) if "train/CrossEntropyLoss" in r] if metrics_file.is_file() else []
    rounds = SelectionLog(rounds_file.parent, writer=False).rounds()
    if not rows and not rounds:
        raise FileNotFoundError(f"{run_dir}: its tda/metrics.jsonl and tda/selection/rounds.jsonl hold no step "
                                "yet to report on")
    path = Path(path) if path else tda / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    images, summary = [], {"run": str(run_dir)}
    if rows:
        images.append(plot_training(path.parent / "training.png", [r["step"] for r in rows],
                                    [r["train/CrossEntropyLoss"] for r in rows], title=run_dir.name))
        summary["steps"] = rows[-1]["step"]
        summary["final train loss"] = f"{rows[-1]['train/CrossEntropyLoss']:.4f}"
    if rounds:
        images.append(plot_selection(path.parent / "selection.png", rounds))
        summary["selection rounds"] = len(rounds)
        summary["selection policy / mode"] = f"{rounds[-1].get('policy')} / {rounds[-1].get('mode')}"
        summary["selection seconds (total)"] = f"{sum(r.get('seconds', 0.0) for r in rounds):.1f}"
        summary["examples rescored"] = sum(r.get("examples_rescored", 0) for r in rounds)
        if any("examples_measured" in r for r in rounds):
            summary["examples measured (forward + backward)"] = sum(r.get("examples_measured", 0) for r in rounds)
    return write_attribution_report(path, title=f"olmo_tda run: {run_dir.name}", summary=summary, queries=[],
                                    images=images)


def write_attribution_report(path: Path, *, title: str, summary: dict[str, Any],
                             queries: list[dict[str, Any]], images: Sequence[Path] = ()) -> Path:
    """Write ``path`` (HTML). ``queries``: ``[{"query": str, "kind": str, "results": [{"index", "score",
    "text"?, "step"?, "name"?, "source"?, "hit"?}]}]``."""
    esc = html.escape
    rows = "".join(f"<tr><th>{esc(str(k))}</th><td>{esc(str(v))}</td></tr>" for k, v in summary.items())
    parts = [f"<!doctype html><meta charset='utf-8'><title>{esc(title)}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
             "td,th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}"
             "table{border-collapse:collapse;margin-bottom:1.5em}.q{background:#f4f4f8;padding:6px}"
             ".hit{background:#e3f6e3}code{white-space:pre-wrap}</style>",
             f"<h1>{esc(title)}</h1><table>{rows}</table>"]
    for image in images:
        parts.append(f"<img src='{esc(Path(image).name)}' style='max-width:100%'>")
    for q in queries:
        parts.append(f"<h3>{esc(q.get('kind', 'query'))}</h3><div class='q'><code>{esc(q['query'])}</code></div>")
        results = q["results"]
        # rows name a step, documents a name, every entry of a run's answer its source
        cols = [c for c in ("step", "name", "source", "instances") if any(c in r for r in results)]
        parts.append("<table><tr><th>#</th><th>index</th>" + "".join(f"<th>{c}</th>" for c in cols)
                     + "<th>score</th><th>training text</th></tr>")
        for rank, r in enumerate(results, 1):
            cls = " class='hit'" if r.get("hit") else ""
            extra = "".join(f"<td>{esc(str(r.get(c, '')))}</td>" for c in cols)
            parts.append(f"<tr{cls}><td>{rank}</td><td>{r['index']}</td>{extra}"
                         f"<td>{r['score']:.4g}</td><td><code>{esc(r.get('text', ''))}</code></td></tr>")
        parts.append("</table>")
    Path(path).write_text("".join(parts), encoding="utf-8", errors="replace")   # as the page declares
    return Path(path)
