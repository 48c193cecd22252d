"""A self-contained HTML report: top-k training passages per query and plots of the run.

Plots are PNGs (matplotlib, Agg backend) written beside the HTML and linked, so the report opens
from a cluster filesystem or a laptop without a server.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Sequence

__all__ = ["plot_training", "write_attribution_report"]


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


def write_attribution_report(path: Path, *, title: str, summary: dict[str, Any],
                             queries: list[dict[str, Any]], images: Sequence[Path] = ()) -> Path:
    """Write ``path`` (HTML). ``queries``: ``[{"query": str, "kind": str, "results": [{"index", "step",
    "score", "text", "hit"?}]}]``."""
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
        parts.append("<table><tr><th>#</th><th>index</th><th>step</th><th>score</th><th>training passage</th></tr>")
        for rank, r in enumerate(q["results"], 1):
            cls = " class='hit'" if r.get("hit") else ""
            parts.append(f"<tr{cls}><td>{rank}</td><td>{r['index']}</td><td>{r['step']}</td>"
                         f"<td>{r['score']:.4g}</td><td><code>{esc(r.get('text', ''))}</code></td></tr>")
        parts.append("</table>")
    Path(path).write_text("".join(parts))
    return Path(path)
