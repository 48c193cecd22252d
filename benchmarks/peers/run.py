"""olmo_tda side by side with dattri-llm, Kronfluence, dattri, TRAK and LogIX, on one workload.

    python benchmarks/peers/run.py              # 3 interleaved repeats; table, then one JSON line
    python benchmarks/peers/run.py --quick      # 1 repeat, 512 train examples
    python benchmarks/peers/run.py --arch olmo  # the same on ai2-olmo's OLMo model instead
    python benchmarks/peers/run.py --here --device cuda --systems olmo_tda,dattri_llm   # on a GPU
    python -m benchmarks.run_all                # both, and docs/benchmarks/peers.md regenerated

Each peer runs in its own venv (made by ``venvs.py``), as a fresh process per measurement, on the
same data, the same checkpoint and the same projection size. The shared workload is in
``workload.py``: every system keeps k·k floats per scored layer and example (TRAK keeps the same
total over the whole model).

For each system:
- **ex/s**: training examples per second of the pass that computes and stores their projected
  gradients.
- **step overhead**: extra seconds per AdamW step with in-loop capture, relative to plain steps.
  Only olmo_tda, dattri-llm and LogIX capture inside a training loop.
- **bytes/ex**: on disk, or in RAM where the library keeps its store there.
- **16 queries**: seconds from 16 query texts to their scores against every training example.
- **peak RSS**: peak resident memory of the process.
- **Spearman**: mean over queries of the rank correlation of its scores with exact GradDot scores
  from ``torch.func`` per-example gradients (no projection).

Repeats are interleaved: repeat r runs the systems in an order rotated by r, and the table shows
medians over repeats. Ratios are olmo_tda's number against each peer's, measured in the same run.

``--device cuda`` puts the model, data and exact scores on the GPU; every system runs there but
olmo_tda's unprojected row (its store would be tens of GB; its row says so). ``--here`` runs every system in this
interpreter instead of its venv (a machine without a package index: ``benchmarks/peers/gpu_check.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import venvs  # noqa: E402
from workload import ARCHS, OLMO_LIB_ENV, RELATIVE_DAMPING, Workload, prepare, spearman_rows  # noqa: E402

OURS = "olmo_tda"
OURS_EIGEN = "olmo_tda_eigen"       # our data-aware projection at the same bytes (fidelity row)
OURS_HEAD = "olmo_tda_head"         # ... with the head given more of the same (or fewer) bytes
OURS_BUDGET = "olmo_tda_budget"     # ... the same floats split across layers by capture.budget
OURS_FULL = "olmo_tda_full"         # unprojected store + EK-FAC: Kronfluence's setting, not the same floats
OUR_ROWS = (OURS, OURS_EIGEN, OURS_HEAD, OURS_BUDGET, OURS_FULL)
UNPROJECTED = (OURS_FULL, "kronfluence")     # compared with each other, not with the k-floats rows
HEADLINE_PEER = "dattri_llm"
SYSTEMS = [*OUR_ROWS, *venvs.PEERS]
IN_LOOP = (OURS, "dattri_llm", "logix")
LABELS = {"olmo_tda": "olmo_tda", "olmo_tda_eigen": "olmo_tda eigen + LoRIF c=1",
          "olmo_tda_head": "olmo_tda eigen, head-weighted", "olmo_tda_budget": "olmo_tda eigen, capture.budget",
          "olmo_tda_full": "olmo_tda unprojected, EK-FAC",
          "dattri_llm": "dattri-llm", "kronfluence": "Kronfluence", "dattri": "dattri",
          "traker": "TRAK (traker)", "logix": "LogIX (logix-ai)"}


def run_worker(python: str, system: str, mode: str, workdir: Path, out: Path, timeout: float,
               olmo_lib: str | None = None) -> dict:
    cmd = [python, str(HERE / "worker.py"), system, mode, str(workdir), str(out)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TQDM_DISABLE": "1"}
    if olmo_lib:
        env[OLMO_LIB_ENV] = olmo_lib
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    if out.exists():
        return json.loads(out.read_text())
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"ok": False, "error": f"worker exited {proc.returncode}: {' | '.join(tail)}"}


def _median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get("ok") and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(systems: list[str], attr: dict, loop: dict, spearman: dict, status: dict) -> dict:
    rows = {}
    for s in systems:
        ok = [r for r in attr[s] if r.get("ok")]
        row = {"system": s, "label": LABELS[s], "version": status[s].get("version"), "ok": bool(ok)}
        if not status[s]["ok"]:
            row.update(ok=False, error=f"install: {status[s]['reason']}")
        elif not ok:
            row["error"] = attr[s][0].get("error", "failed") if attr[s] else "not run"
        else:
            row.update(examples_per_s=_median(ok, "examples_per_s"), query_s=_median(ok, "query_s"),
                       bare_pass_examples_per_s=_median(ok, "bare_pass_examples_per_s"),
                       bytes_per_example=_median(ok, "bytes_per_example"), peak_rss_mb=_median(ok, "peak_rss_mb"),
                       peak_cuda_mb=_median(ok, "peak_cuda_mb"),
                       spearman=spearman.get(s), settings=ok[0].get("settings"), repeats=len(ok),
                       requested=len(attr[s]), floats_per_example=ok[0].get("floats_per_example"))
            if len(ok) < len(attr[s]):      # medians of the repeats that ran: said in the row
                row["repeat_error"] = next(r.get("error") for r in attr[s] if not r.get("ok"))
        lp = [r for r in loop.get(s, []) if r.get("ok")]
        if lp:
            row["overhead"] = _median(lp, "overhead")
            if len(lp) < len(loop[s]):      # a median of the repeats that ran: said in the cell
                row["overhead_repeats"] = f"{len(lp)} of {len(loop[s])}"
            row["plain_step_s"] = _median(lp, "plain_step_s")
            row["capture_step_s"] = _median(lp, "capture_step_s")
        elif s in loop and loop[s]:
            row["overhead_error"] = loop[s][0].get("error")
        rows[s] = row
    ours = rows[OURS]
    for s, row in rows.items():
        if s in OUR_ROWS or not row.get("ok") or not ours.get("ok"):
            continue
        row["throughput_ratio"] = ours["examples_per_s"] / row["examples_per_s"]   # ours / theirs
        row["query_ratio"] = row["query_s"] / ours["query_s"]                      # theirs / ours
        if row.get("overhead") is not None and ours.get("overhead"):
            row["overhead_ratio"] = row["overhead"] / ours["overhead"]             # theirs / ours
    return rows


def fmt(v, spec: str, none: str = "—") -> str:
    return none if v is None else format(v, spec)


def table(rows: dict) -> list[str]:
    head = ("| system | version | ex/s | ours ×| step overhead | ours ×| bytes/ex | 16 queries s | ours ×"
            "| peak RSS MB | Spearman vs exact | influence Spearman |")
    out = [head, "|" + "---|" * 12]
    for _s, r in rows.items():
        if not r.get("ok"):
            out.append(f"| {r['label']} | {r.get('version') or '—'} | failed: {r.get('error', '?')} |" + " |" * 9)
            continue
        ov = "failed" if r.get("overhead_error") else fmt(r.get("overhead"), "+.0%", "post hoc only")
        if r.get("overhead_repeats"):
            ov += f" ({r['overhead_repeats']} repeats ran)"
        partial = r["repeats"] < r["requested"]
        label = r["label"] + (f" ({r['repeats']} of {r['requested']} repeats ran)" if partial else "")
        out.append(f"| {label} | {r['version'] or '—'} | {r['examples_per_s']:.0f} | {fmt(r.get('throughput_ratio'), '.1f')} "
                   f"| {ov} | {fmt(r.get('overhead_ratio'), '.1f')} | {r['bytes_per_example']:.0f} "
                   f"| {r['query_s']:.2f} | {fmt(r.get('query_ratio'), '.1f')} | {r['peak_rss_mb']:.0f}"
                   + (f" (GPU {r['peak_cuda_mb']:.0f})" if r.get("peak_cuda_mb") is not None else "") + " "
                   f"| {fmt(r.get('spearman'), '.3f')} | {fmt(r.get('influence_spearman'), '.3f')} |")
    return out


def headline(rows: dict) -> dict:
    peer = rows.get(HEADLINE_PEER, {})
    ours = rows[OURS]
    others = {s: r for s, r in rows.items() if s not in (*OUR_ROWS, HEADLINE_PEER) and r.get("ok")}
    peers = {s: r for s, r in rows.items() if s not in OUR_ROWS and r.get("ok")}
    # at the same stored bytes: Kronfluence stores nothing and scores exact gradients, so it is not
    # a same-k comparison; it is reported in its row
    same_bytes = {s: r for s, r in peers.items() if r.get("bytes_per_example")}
    best = max(same_bytes, key=lambda s: same_bytes[s].get("spearman") or -1, default=None)
    # ours at the same stored floats: rows that keep no more per example than our default row (k·k a layer)
    budget = ours.get("floats_per_example") or 0
    same_floats = {s for s, r in rows.items() if s in OUR_ROWS and s not in UNPROJECTED and r.get("ok")
                   and (r.get("floats_per_example") or budget + 1) <= budget}
    ours_best = max((rows[s].get("spearman") or -1 for s in same_floats), default=None)

    def best_influence(mine: bool, unprojected: bool):
        return max((r.get("influence_spearman") or -1 for s, r in rows.items()
                    if (s in OUR_ROWS) == mine and (s in UNPROJECTED) == unprojected and r.get("ok")
                    and (not mine or unprojected or s in same_floats)), default=None)
    return {
        "throughput_vs_dattri_llm": peer.get("throughput_ratio"),
        "overhead_vs_dattri_llm": peer.get("overhead_ratio"),
        "min_throughput_vs_other_peers": min((r["throughput_ratio"] for r in others.values()), default=None),
        "bare_pass_examples_per_s": ours.get("bare_pass_examples_per_s"),
        "spearman_ours": ours.get("spearman"),
        "spearman_ours_best": ours_best,
        "spearman_best_peer": same_bytes[best].get("spearman") if best else None,
        "best_peer": best,
        # influence agreement at the same stored floats, and unprojected (ours stored, Kronfluence recomputed)
        "influence_spearman_ours_best": best_influence(True, False),
        "influence_spearman_best_peer": best_influence(False, False),
        "influence_spearman_ours_unprojected": best_influence(True, True),
        "influence_spearman_kronfluence": best_influence(False, True),
    }


def machine() -> dict:
    import torch

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "gpu": gpu, "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def losses(rows: dict) -> list[str]:
    """Every metric on which a peer's row is better than our default row by more than 5%, in words."""
    ours, out = rows[OURS], []
    if not ours.get("ok"):
        return ["olmo_tda itself failed: " + str(ours.get("error"))]
    checks = [("examples_per_s", "throughput", "{:.0f} ex/s", max), ("overhead", "step overhead", "{:+.0%}", min),
              ("bytes_per_example", "bytes per example", "{:.0f} B", min), ("query_s", "16-query time", "{:.2f} s", min),
              ("peak_rss_mb", "peak memory", "{:.0f} MB", min), ("spearman", "agreement with exact", "{:.3f}", max),
              ("influence_spearman", "influence agreement with exact", "{:.3f}", max)]
    for s, r in rows.items():
        if s in OUR_ROWS or not r.get("ok"):
            continue
        for key, what, f, better in checks:
            theirs, mine = r.get(key), ours.get(key)
            # within 5% is a tie on this noisy machine
            if theirs is None or mine is None or better(theirs, mine) != theirs \
                    or abs(theirs - mine) <= 0.05 * max(abs(theirs), abs(mine)):
                continue
            note = " (it stores nothing and recomputes every train gradient per query)" \
                if s == "kronfluence" and key in ("bytes_per_example", "spearman") else ""
            out.append(f"{LABELS[s]}: {what} {f.format(theirs)} vs ours {f.format(mine)}{note}")
    return out


def markdown(result: dict) -> str:
    """The peers tables of docs/benchmarks/peers.md, regenerated by benchmarks/run_all.py."""
    rows, h, w, m = result["rows"], result["headline"], result["workload"], result["machine"]
    layers = result.get("scored_layers", {})
    model = ("ai2-olmo's OLMo (RoPE, SwiGLU, fused QKV, SDPA attention, untied head)"
             if w.get("arch") == "olmo" else "causal LM of plain nn.Linear layers")
    kinds: dict[str, tuple[int, int]] = {}          # one entry per layer kind: blocks.N. dropped, out×in
    for n, (o, i) in layers.items():
        kinds.setdefault(re.sub(r"^.*blocks\.\d+\.", "", n) if ".blocks." in f".{n}" else ".".join(n.split(".")[-2:]),
                         (o, i))
    shapes = ", ".join(f"{k} {o}×{i}" for k, (o, i) in kinds.items())
    lines = [f"Command: `{result['command']}` ({result['repeats']} interleaved repeats, medians; "
             f"{result['seconds']:.0f} s).",
             f"Machine: {m['cpu']}, {m['cores']} cores, " + (f"{m['gpu']} (device {w['device']}), "
                                                              if w.get("device", "cpu") != "cpu" else "")
             + f"Python {m['python']}, torch {m['torch']}.",
             "",
             f"Workload: {model}, d_model {w['d_model']}, {w['n_layers']} blocks, vocab {w['vocab']}, "
             f"{len(layers)} bias-free nn.Linear layers scored ({shapes}); {w['n_train']} train and "
             f"{w['n_query']} query byte passages "
             f"of {w['seq_len']} tokens (this Python's stdlib sources), batch {w['batch']}, k = {w['k']} per side "
             f"({w['k'] * w['k']} floats per layer per example), λ = {w['damping']}.",
             ""]
    lines += table(rows)
    lines += [""]
    fmtx = lambda v: "n/a" if v is None else f"{v:.1f}x"  # noqa: E731
    verdict = lambda v, t: "" if v is None else (" — met" if v >= t else " — **missed**")  # noqa: E731
    lines.append(f"**olmo_tda vs dattri-llm: {fmtx(h['throughput_vs_dattri_llm'])}** per-example gradient "
                 f"throughput (target ≥ 2x{verdict(h['throughput_vs_dattri_llm'], 2)}); **olmo_tda vs dattri-llm: "
                 f"{fmtx(h['overhead_vs_dattri_llm'])}** lower training-step overhead. Against every other peer, the "
                 f"smallest throughput ratio is {fmtx(h['min_throughput_vs_other_peers'])} (target ≥ 3x"
                 f"{verdict(h['min_throughput_vs_other_peers'], 3)}). The same forward+backward with nothing "
                 f"captured runs at {fmt(h['bare_pass_examples_per_s'], '.0f')} ex/s here: no system's gradient pass "
                 f"can be faster. Spearman with exact scores at the "
                 f"same stored floats: olmo_tda {fmt(h['spearman_ours'], '.3f')} (random), "
                 f"{fmt(h['spearman_ours_best'], '.3f')} (best of ours); best peer "
                 f"{LABELS.get(h['best_peer'], '—')} {fmt(h['spearman_best_peer'], '.3f')}.")
    lines.append("")
    peer_infl = h["influence_spearman_best_peer"]
    influence_verdict = verdict(h["influence_spearman_ours_best"] if peer_infl is not None else None, peer_infl)
    lines.append(f"Curvature: influence with each system's own damped curvature at λ = {RELATIVE_DAMPING} × its mean "
                 f"eigenvalue, against exact per-layer damped empirical-Fisher influence (unprojected, Woodbury). "
                 f"At the same stored floats: best of ours {fmt(h['influence_spearman_ours_best'], '.3f')}, best "
                 f"peer {fmt(h['influence_spearman_best_peer'], '.3f')} (target: at least the best peer"
                 f"{influence_verdict}). "
                 f"Unprojected: olmo_tda's stored full "
                 f"gradients with EK-FAC {fmt(h['influence_spearman_ours_unprojected'], '.3f')}, Kronfluence's "
                 f"EK-FAC {fmt(h['influence_spearman_kronfluence'], '.3f')}. Each system's influence time (in "
                 "its settings below) runs from the model to the scores: every pass over the training data, the "
                 "fit and the 16 queries.")
    lines.append("")
    lines.append("Where a peer beats olmo_tda (its default row) by more than 5% on this run:")
    lines += [f"- {item}" for item in losses(rows)] or ["- nowhere"]
    lines.append("")
    lines.append("Settings per system:")
    for _s, r in rows.items():
        why = r.get("settings") or r.get("error")
        extra = f" In-loop capture: {r['overhead_error']}." if r.get("overhead_error") else ""
        if r.get("repeat_error"):
            extra += f" A failed repeat: {r['repeat_error']}."
        if r.get("influence_settings"):
            extra += f" Influence: {r['influence_settings']} ({r['influence_s']:.2f} s)."
        elif r.get("influence_error"):
            extra += f" Influence: {r['influence_error']}."
        lines.append(f"- {r['label']}: {why}.{extra}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 repeat, 512 train examples")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--venvs", type=Path, default=venvs.DEFAULT_DIR, help="where the peers' venvs live")
    p.add_argument("--n-train", type=int, default=None)
    p.add_argument("--k", type=int, default=None, help="projection width per side")
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--arch", choices=ARCHS, default="linear",
                   help="the model: 'linear' (plain nn.Linear LM) or 'olmo' (ai2-olmo's OLMo, same size)")
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda'")
    p.add_argument("--here", action="store_true", help="run the peers in this interpreter, not their venvs")
    p.add_argument("--skip-influence", action="store_true", help="no curvature (influence) pass")
    p.add_argument("--timeout", type=float, default=900, help="seconds per worker before it counts as failed")
    p.add_argument("--out", type=Path, default=None, help="also write the full result JSON here")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    if OURS not in systems:
        systems.insert(0, OURS)
    repeats = args.repeats or (1 if args.quick else 3)
    if args.device != "cpu":
        import torch

        if not args.device.startswith("cuda") or not torch.cuda.is_available():
            p.error(f"--device {args.device}: this torch ({torch.__version__}) has no CUDA device"
                    if args.device.startswith("cuda") else f"--device must be cpu or cuda, not {args.device!r}")
    w = Workload()
    w = replace(w, n_train=args.n_train or (512 if args.quick else w.n_train), k=args.k or w.k,
                d_model=args.d_model or w.d_model, seq_len=args.seq_len or w.seq_len, arch=args.arch,
                n_layers=args.n_layers or w.n_layers, batch=args.batch or w.batch, device=args.device)
    t0 = time.perf_counter()

    status = {s: {"ok": True, "python": sys.executable, "version": _our_version()} for s in OUR_ROWS}
    for s in systems:
        if s in status:
            continue
        status[s] = venvs.here(s) if args.here else venvs.ensure(s, args.venvs,
                                                                   log=lambda m: print(m, file=sys.stderr))
        if status[s]["ok"] and w.arch == "olmo":
            # the peer's venv has no ai2-olmo: it imports it from a folder of its own (venvs.olmo_lib)
            lib = venvs.olmo_lib(args.venvs, log=lambda m: print(m, file=sys.stderr), python=status[s]["python"])
            if lib["ok"]:
                status[s]["olmo_lib"] = lib["path"]
            else:
                status[s] = {**status[s], "ok": False, "reason": lib["reason"]}
    runnable = [s for s in systems if status[s]["ok"]]

    attr: dict[str, list] = {s: [] for s in systems}
    loop: dict[str, list] = {}
    def save_partial() -> None:
        """The raw worker results so far: a run cut short (a device's time limit) still leaves them."""
        if args.out:
            args.out.write_text(json.dumps({"partial": True, "attr": attr, "loop": loop, "infl": infl}, default=str))

    infl: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="olmo_tda_peers_") as tmp:
        workdir = Path(tmp) / "work"
        prepare(workdir, w)
        scored = json.loads((workdir / "scored.json").read_text())
        exact = np.load(workdir / "exact.npy")
        exact_infl = np.load(workdir / "exact_influence.npy")
        spear: dict[str, list[float]] = {}
        for r in range(repeats):
            order = runnable[r % len(runnable):] + runnable[:r % len(runnable)]
            for s in order:
                out = Path(tmp) / f"{s}.attr.{r}.json"
                res = run_worker(status[s]["python"], s, "attr", workdir, out, args.timeout,
                                 status[s].get("olmo_lib"))
                attr[s].append(res)
                if res.get("ok"):
                    spear.setdefault(s, []).append(spearman_rows(np.load(out.with_suffix(".npy")), exact))
                    res["spearman"] = spear[s][-1]
                save_partial()
                print(f"[peers] repeat {r} {s:12s} attr: " + (f"{res['examples_per_s']:.0f} ex/s, query "
                      f"{res['query_s']:.2f} s" if res.get("ok") else f"FAILED {res.get('error')}"), file=sys.stderr)
            if r == 0 and not args.skip_influence:     # curvature scores are deterministic: one pass each
                for s in order:
                    out = Path(tmp) / f"{s}.infl.json"
                    res = run_worker(status[s]["python"], s, "infl", workdir, out, args.timeout,
                                 status[s].get("olmo_lib"))
                    infl[s] = res
                    if res.get("ok"):
                        res["spearman"] = spearman_rows(np.load(out.with_suffix(".npy")), exact_infl)
                    save_partial()
                    print(f"[peers] {s:12s} influence: " + (f"Spearman {res['spearman']:.3f}, {res['infl_s']:.2f} s"
                          if res.get("ok") else f"{res.get('error')}"), file=sys.stderr)
            for s in order:
                if s not in IN_LOOP:
                    continue
                out = Path(tmp) / f"{s}.loop.{r}.json"
                res = run_worker(status[s]["python"], s, "overhead", workdir, out, args.timeout,
                                 status[s].get("olmo_lib"))
                loop.setdefault(s, []).append(res)
                save_partial()
                print(f"[peers] repeat {r} {s:12s} loop: " + (f"overhead {res['overhead']:+.1%}" if res.get("ok")
                      else f"FAILED {res.get('error')}"), file=sys.stderr)
    rows = summarize(systems, attr, loop, {s: statistics.median(v) for s, v in spear.items()}, status)
    for s, res in infl.items():
        if res.get("ok"):
            rows[s].update(influence_spearman=res["spearman"], influence_s=res["infl_s"],
                           influence_settings=res.get("settings"))
        else:
            rows[s]["influence_error"] = res.get("error")
    # the command that reproduces this table: every flag that changed the workload or the repeats
    requested = ",".join(s.strip() for s in args.systems.split(",") if s.strip())
    flags = [("--quick", args.quick), ("--systems", requested != ",".join(SYSTEMS) and requested),
             ("--repeats", args.repeats), ("--n-train", args.n_train), ("--k", args.k),
             ("--d-model", args.d_model), ("--seq-len", args.seq_len), ("--n-layers", args.n_layers),
             ("--batch", args.batch), ("--arch", w.arch != "linear" and w.arch),
             ("--device", w.device != "cpu" and w.device), ("--here", args.here),
             ("--skip-influence", args.skip_influence)]
    cmd = " ".join(["python benchmarks/peers/run.py",
                    *(flag if value is True else f"{flag} {value}" for flag, value in flags if value)])
    result = {"rows": rows, "headline": headline(rows), "workload": asdict(w), "machine": machine(),
              "scored_layers": scored,
              "repeats": repeats, "seconds": time.perf_counter() - t0, "command": cmd}
    for line in table(rows):
        print(line)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({**result["headline"], "repeats": repeats,
                      "systems": {s: {k: r.get(k) for k in ("ok", "examples_per_s", "overhead", "bytes_per_example",
                                                            "query_s", "peak_rss_mb", "peak_cuda_mb", "spearman",
                                                            "error")}
                                  for s, r in rows.items()}}))
    return result


def _our_version() -> str:
    try:
        import importlib.metadata as md
        return md.version("olmo-tda")
    except Exception:
        return "checkout"


if __name__ == "__main__":
    main()
