"""Run the benchmarks and regenerate the generated sections of docs/benchmarks/peers.md.

    python -m benchmarks.run_all                 # peers side by side, both models (~22 min), then the doc
    python -m benchmarks.run_all --quick         # peers --quick (~8 min)
    python -m benchmarks.run_all --arch olmo     # only the ai2-olmo model's table
    python -m benchmarks.run_all --all           # also every other script (its --quick where it has one)

Generated text sits between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED: name -->``.
Only those blocks are rewritten; the analysis around them is written by hand and stays. A block
that does not exist yet is appended at the end of the file. Every script prints its headline as a
JSON last line, and ``--all`` collects those lines into the ``headlines`` block.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks" / "peers.md"

# the other scripts and the flags that keep them short; each prints a JSON last line
OTHERS = {
    "capture_overhead": ["--rounds", "3"],
    "olmo_overhead": ["--rounds", "3"],
    "deepspeed_overhead": ["--rounds", "3"],
    "routing": ["--quick"],
    "store_query": ["--quick"],
    "store_read": ["--quick"],
    "store_append": ["--quick"],
    "store_open": ["--sizes", "200,800", "--rounds", "3"],
    "store_resume": ["--ranks", "4", "--shards", "300", "--rounds", "2", "--stagger-ms", "20"],
    "fidelity_bytes": ["--quick"],
    "projection_fidelity": [],
    "tied_head_fidelity": [],
    "lds": ["--quick"],
    "influence_fit": ["--quick"],
    "selection": ["--quick"],
}


# the peers workload's model -> (generated block, the section it is appended under if absent)
BLOCKS = {
    "linear": ("peers", "## Side by side with the peers — dattri-llm, Kronfluence, dattri, TRAK, LogIX"),
    "olmo": ("peers_olmo", "### The same on ai2-olmo's OLMo model"),
}


def replace_block(doc: str, name: str, body: str, title: str) -> str:
    """``doc`` with block ``name`` holding ``body`` (appended under ``title`` if absent)."""
    begin, end = f"<!-- BEGIN GENERATED: {name} -->", f"<!-- END GENERATED: {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(doc):
        return pattern.sub(lambda _: block, doc, count=1)
    return doc.rstrip() + f"\n\n{title}\n\n{block}\n"


def run_script(name: str, flags: list[str]) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    out = {"command": "python benchmarks/" + " ".join([f"{name}.py", *flags]), "rc": proc.returncode,
           "seconds": time.perf_counter() - t0}
    if proc.returncode == 0 and lines:
        try:
            out["json"] = json.loads(lines[-1])
        except json.JSONDecodeError as e:         # the row says so; the other scripts still run
            out["error"] = [f"its last line is not JSON ({e})"]
    else:
        out["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return out


def _cell(text: str) -> str:
    """``text`` as a markdown table cell in backticks: no pipe or backtick can end it early."""
    return "`" + text.replace("`", "'").replace("|", "\\|").replace("\n", " ") + "`"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the peers benchmark in its --quick mode")
    p.add_argument("--all", action="store_true", help="also run every other benchmark script")
    p.add_argument("--venvs", type=Path, default=None, help="where the peers' venvs live (created if missing)")
    p.add_argument("--doc", type=Path, default=DOC)
    p.add_argument("--arch", default="linear,olmo",
                   help="the peers workload's models, comma-separated: linear (plain nn.Linear LM), olmo (ai2-olmo)")
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    import run as peers  # noqa: E402  (benchmarks/peers/run.py)

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    for a in archs:
        if a not in BLOCKS:
            p.error(f"unknown --arch {a!r}; known: {', '.join(BLOCKS)}")
    peer_args = (["--quick"] if args.quick else []) + (["--venvs", str(args.venvs)] if args.venvs else [])
    doc = args.doc.read_text() if args.doc.exists() else "# Benchmarks\n"
    for arch in archs:
        result = peers.main([*peer_args, "--arch", arch])
        result["command"] = "python -m benchmarks.run_all" + (" --quick" if args.quick else "") + \
            (f" --arch {args.arch}" if args.arch != "linear,olmo" else "")
        block, title = BLOCKS[arch]
        doc = replace_block(doc, block, peers.markdown(result), title)
        args.doc.write_text(doc)             # each table as soon as it exists
    if args.all:
        lines = ["| script | seconds | JSON last line |", "|---|--:|---|"]
        for name, flags in OTHERS.items():
            r = run_script(name, flags)
            shown = json.dumps(r["json"]) if "json" in r else f"failed (rc {r['rc']}): {r['error'][0]}"
            lines.append(f"| `{r['command']}` | {r['seconds']:.0f} | {_cell(shown)} |")
            print(f"[run_all] {name}: {'ok' if 'json' in r else 'FAILED'} ({r['seconds']:.0f} s)", file=sys.stderr)
        doc = replace_block(doc, "headlines", "\n".join(lines), "## Latest headline of every script (run_all --all)")
    args.doc.write_text(doc)
    print(f"[run_all] wrote {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
