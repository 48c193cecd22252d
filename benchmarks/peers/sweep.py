"""Does the margin over dattri-llm hold away from the peers table's one point (d_model 64, k = 8)?

    python benchmarks/peers/sweep.py                          # the default grid, ~15 min on 2 cores
    python benchmarks/peers/sweep.py --points linear:64:8,olmo:128:32 --peers dattri_llm,logix

Each point ``arch:d_model:k`` is one ``run.py --systems olmo_tda,<peers> --arch A --d-model D --k K``
in its own process (3 interleaved repeats, medians; the peers' venvs as ``run.py`` makes them). A
point that fails is reported with its reason and the sweep goes on. The table gives, per point and
peer: both systems' examples/s and their ratio, both as a share of the bare forward+backward, the
step-overhead ratio (theirs / ours), bytes per example, and Spearman with exact GradDot and with
exact influence. "ceiling ×" is the bare forward+backward's rate over the peer's: the ratio a
capture that cost nothing would reach, so a target above it is out of reach of any design that
needs a backward pass. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as peers_run  # noqa: E402  (its systems, and its number format: fmt)
from workload import ARCHS, Workload  # noqa: E402

DEFAULT_POINTS = "linear:64:16,linear:64:32,linear:128:8,linear:128:32,olmo:64:32,olmo:128:8"
TARGET = 2.0     # issue 8: at least 2x dattri-llm's per-example gradient throughput at the same k


def parse_points(text: str) -> list[tuple[str, int, int]]:
    """``"linear:64:16,olmo:128:8"`` -> ``[("linear", 64, 16), ("olmo", 128, 8)]``; a clear error else."""
    points = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in ARCHS or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
            raise ValueError(f"bad point {item!r}: expected arch:d_model:k with arch in {ARCHS} and positive "
                             "integers, e.g. linear:64:16")
        arch, d_model, k = parts[0], int(parts[1]), int(parts[2])
        heads = Workload().n_heads
        if d_model % heads:
            raise ValueError(f"bad point {item!r}: d_model must be a multiple of the workload's {heads} heads")
        points.append((arch, d_model, k))
    if not points:
        raise ValueError("no points given")
    return points


def run_point(point: tuple[str, int, int], peers: list[str], repeats: int, timeout: float, out: Path,
              extra: list[str]) -> dict:
    """One ``run.py`` for ``point``: ``{"point", "ok", "rows"/"error", "seconds"}``."""
    arch, d_model, k = point
    cmd = [sys.executable, str(HERE / "run.py"), "--systems", ",".join(["olmo_tda", *peers]),
           "--repeats", str(repeats), "--arch", arch, "--d-model", str(d_model), "--k", str(k),
           "--out", str(out), *extra]
    t0 = time.perf_counter()
    # its own process group, so a timeout also stops the workers run.py started: none may go on
    # competing for the cores while the next point is timed
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"point": point, "ok": False, "error": f"timed out after {timeout:g} s",
                "seconds": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
        return {"point": point, "ok": False, "error": f"run.py exited {proc.returncode}: {tail[0]}",
                "seconds": seconds}
    try:
        rows = json.loads(out.read_text())["rows"]
    except (ValueError, KeyError) as e:
        return {"point": point, "ok": False, "error": f"run.py's result {out} is unreadable: {e}", "seconds": seconds}
    return {"point": point, "ok": True, "rows": rows, "seconds": seconds}


def pair(result: dict, peer: str) -> dict:
    """Our row against ``peer``'s at one point: the numbers the table shows."""
    arch, d_model, k = result["point"]
    out = {"arch": arch, "d_model": d_model, "k": k, "peer": peer}
    if not result["ok"]:
        return {**out, "ok": False, "error": result["error"]}
    ours, theirs = result["rows"]["olmo_tda"], result["rows"].get(peer, {})
    if not ours.get("ok") or not theirs.get("ok"):
        why = ours.get("error") if not ours.get("ok") else theirs.get("error", "not run")
        return {**out, "ok": False, "error": f"{'olmo_tda' if not ours.get('ok') else peer}: {why}"}
    bare = ours.get("bare_pass_examples_per_s")

    def share(rate):
        return rate / bare if bare else None
    return {**out, "ok": True,
            "ours_ex_s": ours["examples_per_s"], "peer_ex_s": theirs["examples_per_s"],
            "ratio": theirs["throughput_ratio"], "bare_ex_s": bare,
            "ceiling": bare / theirs["examples_per_s"] if bare else None,
            "ours_of_bare": share(ours["examples_per_s"]), "peer_of_bare": share(theirs["examples_per_s"]),
            "overhead_ratio": theirs.get("overhead_ratio"),
            "ours_bytes": ours.get("bytes_per_example"), "peer_bytes": theirs.get("bytes_per_example"),
            "ours_spearman": ours.get("spearman"), "peer_spearman": theirs.get("spearman"),
            "ours_influence": ours.get("influence_spearman"), "peer_influence": theirs.get("influence_spearman")}


def table(pairs: list[dict]) -> list[str]:
    lines = ["| model | d_model | k | peer | ours ex/s | peer ex/s | ours × | ceiling × | ours / bare | peer / bare "
             "| overhead, theirs / ours | bytes/ex ours / peer | Spearman ours / peer | influence ours / peer |",
             "|---|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for p in pairs:
        head = f"| {p['arch']} | {p['d_model']} | {p['k']} | {p['peer']} "
        if not p["ok"]:
            error = str(p["error"]).replace("|", "\\|")        # run.py joins worker errors with " | "
            lines.append(head + f"| failed: {error} |" + " |" * 9)
            continue
        # three decimals: a 1.996 must not print as a 2.00 that met the target
        lines.append(head + f"| {p['ours_ex_s']:.0f} | {p['peer_ex_s']:.0f} | {p['ratio']:.3f} "
                     f"| {peers_run.fmt(p['ceiling'], '.2f')} "
                     f"| {peers_run.fmt(p['ours_of_bare'], '.2f')} | {peers_run.fmt(p['peer_of_bare'], '.2f')} "
                     f"| {peers_run.fmt(p['overhead_ratio'], '.1f')} "
                     f"| {peers_run.fmt(p['ours_bytes'], '.0f')} / {peers_run.fmt(p['peer_bytes'], '.0f')} "
                     f"| {peers_run.fmt(p['ours_spearman'], '.3f')} / {peers_run.fmt(p['peer_spearman'], '.3f')} "
                     f"| {peers_run.fmt(p['ours_influence'], '.3f')} / {peers_run.fmt(p['peer_influence'], '.3f')} |")
    return lines


def summary(pairs: list[dict]) -> dict:
    """Per peer: how many points were measured, the ratios' min and median, how many met TARGET
    (the target is dattri-llm's; for another peer the count is reported all the same), and at how
    many TARGET was above the ceiling (bare pass / peer)."""
    out = {}
    for peer in dict.fromkeys(p["peer"] for p in pairs):
        ratios = [p["ratio"] for p in pairs if p["peer"] == peer and p["ok"]]
        out[peer] = {"points": len(ratios), "failed": sum(p["peer"] == peer and not p["ok"] for p in pairs),
                     "min_ratio": min(ratios, default=None),
                     "median_ratio": statistics.median(ratios) if ratios else None,
                     f"at_least_{TARGET:g}x": sum(r >= TARGET for r in ratios),
                     f"ceiling_below_{TARGET:g}x": sum(p["ceiling"] is not None and p["ceiling"] < TARGET
                                                      for p in pairs if p["peer"] == peer and p["ok"])}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default=DEFAULT_POINTS, help="comma-separated arch:d_model:k")
    p.add_argument("--peers", default="dattri_llm", help="comma-separated peers of run.py (default dattri_llm)")
    p.add_argument("--repeats", type=int, default=3, help="run.py's interleaved repeats per point")
    p.add_argument("--n-train", type=int, default=None, help="run.py's --n-train (default its 1024)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per point before it counts as failed")
    args = p.parse_args(argv)
    try:
        points = parse_points(args.points)
    except ValueError as e:
        p.error(str(e))
    peers = list(dict.fromkeys(s.strip() for s in args.peers.split(",") if s.strip()))
    unknown = [s for s in peers if s not in peers_run.SYSTEMS or s in peers_run.OUR_ROWS]
    if unknown or not peers:
        p.error(f"--peers: unknown {unknown or '(none given)'}; known: {', '.join(peers_run.venvs.PEERS)}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.n_train is not None and args.n_train < 1:
        p.error(f"--n-train must be >= 1, got {args.n_train}")
    if not args.timeout > 0:
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    extra = ["--n-train", str(args.n_train)] if args.n_train else []
    t0 = time.perf_counter()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="olmo_tda_peers_sweep_") as tmp:
        for i, point in enumerate(points):
            res = run_point(point, peers, args.repeats, args.timeout, Path(tmp) / f"point{i}.json", extra)
            print(f"[sweep] {':'.join(map(str, point))}: " + ("ok" if res["ok"] else f"FAILED {res['error']}")
                  + f" ({res['seconds']:.0f} s)", file=sys.stderr)
            pairs += [pair(res, peer) for peer in peers]
    for line in table(pairs):
        print(line)
    out = {"benchmark": "peers_sweep", "repeats": args.repeats, "seconds": round(time.perf_counter() - t0),
           "summary": summary(pairs), "points": pairs}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
