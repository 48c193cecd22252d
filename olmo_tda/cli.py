"""``olmo-tda``: the command line. The only module that prints."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from .config import ConfigError
from .errors import TDAError

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig(num_passages=512, epochs=2) if args.quick else DemoConfig()
    summary = run_demo(args.out, cfg, progress=not args.no_progress)
    for q in summary.results:
        print(f"\n[{q['kind']}] {q['query'][:90]!r}")
        for rank, r in enumerate(q["results"][:3], 1):
            mark = "  <- itself" if r.get("hit") else ""
            print(f"  {rank}. #{r['index']:<5} {r['source']:<8} score {r['score']:+.3f}  {r['text'][:70]!r}{mark}")
    print(f"\nreport: {summary.report}")
    print(summary.line())
    return 0


def resolve_store(path: str | Path) -> Path:
    """A store directory, or a run directory holding one: where its saved config puts it (by default
    ``tda/store``; ``store`` or ``run/tda/store`` for the demo's output folder)."""
    from .integrations.olmo_query import run_outputs

    path = Path(path)
    named = run_outputs(path)
    for candidate in (path, *(named[:1] if named else ()), path / "tda" / "store", path / "store",
                      path / "run" / "tda" / "store"):
        if (candidate / "store.json").exists():
            return candidate
    return path


def _cmd_train(args: argparse.Namespace) -> int:
    from .integrations.olmo import load_configs
    from .integrations.olmo_train import train

    cfg, tda_cfg = load_configs(args.config, args.overrides)
    train(cfg, tda_cfg)
    return 0


def _read_queries(args: argparse.Namespace) -> list:
    """``--query`` texts (each paired with an ``--answer`` when answers are given) and ``--query-file``'s."""
    from .methods.queries import Query, read_queries

    texts, answers = list(args.query or []), list(args.answer or [])
    if answers and len(answers) != len(texts):
        raise ConfigError(f"--answer pairs with --query in order: got {len(texts)} --query and {len(answers)} "
                          "--answer")
    queries = [Query(t, a) for t, a in zip(texts, answers)] if answers else [Query(t) for t in texts]
    if args.query_file:
        queries += read_queries(args.query_file)
    if not queries:
        raise ConfigError("give --query TEXT (repeatable, with --answer TEXT for prompt → answer queries) or "
                          "--query-file F.jsonl")
    return queries


def _read_ids(spec: str) -> list[int]:
    """``"3,5,9"`` or ``@file`` (integers separated by whitespace or commas)."""
    text = Path(spec[1:]).read_text() if spec.startswith("@") else spec
    try:
        ids = [int(tok) for tok in text.replace(",", " ").split()]
    except ValueError as e:
        raise ConfigError(f"--ids: expected integers (training instance indices), {e}") from None
    if not ids or min(ids) < 0:
        raise ConfigError("--ids: give at least one non-negative training instance index")
    return ids


def _cmd_attribute(args: argparse.Namespace) -> int:
    from .integrations.olmo_query import open_run

    run_dir = Path(args.run)
    if not (run_dir / "config.yaml").exists() and (run_dir / "run" / "config.yaml").exists():
        run_dir = run_dir / "run"                        # the demo's output folder
    ids = _read_ids(args.ids) if args.ids else None
    if ids is not None and args.method != "tracin":
        raise ConfigError("--ids chooses the training examples TracIn-CP recomputes; use it with --method tracin")
    options = {k: v for k, v in (("hessian", args.hessian), ("damping", args.damping), ("rank", args.rank),
                                 ("damping_ratio", args.damping_ratio)) if v is not None}
    if options and args.method != "influence":
        raise ConfigError(f"--hessian/--damping/--damping-ratio/--rank apply to --method influence, not {args.method}")
    if args.damping is not None and args.damping_ratio is not None:
        raise ConfigError("--damping (one λ for every layer) and --damping-ratio (λ relative to each layer's "
                          "Fisher) exclude each other: give one")
    if args.rank is not None and args.hessian not in (None, "lorif", "joint"):
        raise ConfigError(f"--rank is the rank of --hessian lorif or joint (the default), not of {args.hessian}")
    for flag, key, value, default in (("--route", "route", args.route, "auto"),
                                      ("--query-rank", "query_rank", args.query_rank, 0)):
        if value != default:
            if args.method not in ("graddot", "gradcos", "influence"):
                raise ConfigError(f"{flag} applies to graddot, gradcos and influence, not {args.method}")
            options[key] = value
    for flag, out in (("--json", args.json), ("--html", args.html)):
        if out and not Path(out).resolve().parent.is_dir():       # before the work, not after it
            raise ConfigError(f"{flag} {out}: no such folder {Path(out).resolve().parent}")
    queries = _read_queries(args)
    run = open_run(run_dir, skip_damaged=args.skip_damaged)
    answers = run.attribute(queries, method=args.method, top_k=args.top_k, group_by=args.group_by,
                            progress=sys.stderr.isatty(), ids=ids, **options)
    settings = _settings(args.method, run.last_info, options)
    listing = not args.json                 # with --json the file holds the answers; stdout a summary
    if args.method == "influence":
        info = run.last_info
        damping = info["damping"]
        rank = info.get("rank")
        print(f"influence: hessian {info['hessian']}{', rank ' + str(rank) if rank else ''}, damping λ "
              f"{'(one, all layers)' if info['hessian'] == 'joint' else 'per layer'} {settings['damping']} over "
              f"{info['num_rows']} rows")
        for answer in answers:
            answer["damping"] = damping
    if "skipped_rows" in settings:
        print(f"skipped {settings['skipped_rows']} rows of {len(settings['skipped_shards'])} damaged shards "
              f"({', '.join(settings['skipped_shards'][:5])}): their examples are scored without them")
    for answer in answers:
        answer["settings"] = settings
    for answer in answers if listing else ():
        _print_answer(answer, args.group_by)
    if args.json:
        Path(args.json).write_text(json.dumps(answers, indent=1))
        found = sum(bool(a["results"]) for a in answers)
        print(f"wrote {args.json}: {len(answers)} answers ({found} with results), method {args.method}, "
              f"by {args.group_by}, top {args.top_k}")
    if args.html:
        from .report.html import write_attribution_report

        shown = [{**a, "kind": f"query ({args.method}, by {args.group_by})"} for a in answers]
        write_attribution_report(Path(args.html), title=f"olmo_tda: {args.method} on {run_dir}",
                                 summary={"run": str(run_dir), "top_k": args.top_k, **settings},
                                 queries=shown)
        print(f"wrote {args.html}")
    return 0


def _print_answer(answer: dict[str, Any], group_by: str) -> None:
    if "completion" in answer:
        print(f"\nprompt: {answer['prompt'][:100]!r} → answer: {answer['completion'][:60]!r}")
    else:
        print(f"\nquery: {answer['query'][:100]!r}")
    if "scored_tokens" in answer:
        print(f"  (scored on its first {answer['scored_tokens']} of {answer['tokens']} tokens: the model's "
              "max_sequence_length)")
    if group_by == "source":
        print(f"  {'#':>2} {'score':>10} {'instances':>9}  source")
        for rank, r in enumerate(answer["results"], 1):
            print(f"  {rank:>2} {r['score']:>+10.4f} {r['instances']:>9}  {r['source']}")
        return
    first = {"row": "step", "example": "source", "document": "name"}[group_by]
    print(f"  {'#':>2} {'index':>8} {first:>12} {'score':>9}  training {group_by if group_by != 'row' else 'passage'}")
    for rank, r in enumerate(answer["results"], 1):
        label = str(r["step"] if group_by == "row" else r["source"] if group_by == "example" else r["name"])
        print(f"  {rank:>2} {r['index']:>8} {label[-12:]:>12} {r['score']:>+9.4f}  {r['text'][:80]!r}")


def _settings(method: str, info: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """What decided an answer's scores, saved with it (JSON and HTML): the method, the options
    given (route, query rank, ...) and what the method reports of itself, λ above all (as its
    range over the layers)."""
    out: dict[str, Any] = {"method": method, **options, **{k: v for k, v in info.items() if k != "damping"}}
    damping = info.get("damping")
    if damping:
        low, high = min(damping.values()), max(damping.values())
        out["damping"] = f"{low:.3g}" if low == high else f"{low:.3g}..{high:.3g}"
    return out


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .store import GradientStore

    from .training.trajectory import Trajectory

    from .integrations.olmo_query import run_outputs

    path = Path(args.path)
    named = run_outputs(path)
    trajectory = next((c for c in (*(named[1:] if named else ()), path / "tda" / "trajectory",
                                   path / "run" / "tda" / "trajectory", path)
                       if c.is_dir() and any(c.glob("step*/meta.json"))), None)
    store_dir = resolve_store(path)
    store = GradientStore.open(store_dir) if (store_dir / "store.json").exists() or trajectory is None else None
    summary = store.summary() if store is not None else {}
    damaged = []
    if args.verify:
        if store is None:
            raise SystemExit(f"error: --verify: no gradient store at {path}")
        checked = summary["verify"] = store.verify()
        damaged = checked["damaged"]
    if trajectory is not None:
        t = Trajectory.summary(trajectory)
        summary["trajectory"] = {"path": t["path"], "checkpoints": t["checkpoints"], "steps": t["steps"],
                                 "bytes": t["bytes"], "bytes_each": [c.bytes for c in Trajectory.list(trajectory)],
                                 "dtype": t["dtype"], "lrs": t["lrs"]}
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 1 if damaged else 0
    for key, value in summary.items():
        if key == "verify":
            continue
        if isinstance(value, (dict, list)):
            value = json.dumps(value, default=str)
            value = value if len(value) < 200 else value[:197] + "..."
        print(f"{key:>22}: {value}")
    if args.verify:
        v = summary["verify"]
        print(f"{'verify':>22}: {v['datasets']} datasets in {v['shards']} shards, {v['bytes_read']} bytes read: "
              + (f"{len(damaged)} damaged" if damaged else "all checksums match")
              + (f"; {len(v['unchecked'])} shards have no checksums (written by an older version)"
                 if v["unchecked"] else "")
              + (f"; {len(v['changed'])} shards changed while read (a live writer truncated them): run again"
                 if v["changed"] else ""))
        for d in damaged:
            print(f"damaged: {d['file']}" + (f" {d['dataset']}" if d["dataset"] else "") + f": {d['problem']}",
                  file=sys.stderr)
    return 1 if damaged else 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from .data import prepare
    from .demo.data import BYTE_TOKENIZER_ID

    if args.tokenizer == BYTE_TOKENIZER_ID:
        from .demo.corpus import ByteTokenizer

        tok = ByteTokenizer()
        encode, eos, vocab = tok.encode, tok.eos_token_id, tok.vocab_size
    else:
        from olmo.tokenizer import Tokenizer

        kwargs = {"eos_token_id": args.eos_token_id} if args.eos_token_id is not None else {}
        hf = (Tokenizer.from_file(args.tokenizer, **kwargs) if Path(args.tokenizer).is_file()
              else Tokenizer.from_pretrained(args.tokenizer, **kwargs))
        encode, eos, vocab = (lambda text: hf.encode(text, add_special_tokens=False)), hf.eos_token_id, hf.vocab_size
    paths = prepare(args.inputs, args.out, encode=encode, eos_token_id=eos, vocab_size=vocab)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    for path in paths:
        print(f"wrote {path} ({path.stat().st_size // (2 if dtype == 'uint16' else 4)} tokens) and its document index")
    print("\nin the training YAML (one source per file; data.datasets: {label: [path]} names them otherwise):")
    print(f"tokenizer:\n  identifier: {args.tokenizer}\nmodel:\n  eos_token_id: {eos}\n"
          f"data:\n  memmap_dtype: {dtype}\n  paths: [{', '.join(str(p) for p in paths)}]")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .report.html import write_run_report

    print(f"wrote {write_run_report(Path(args.run), Path(args.out) if args.out else None)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="olmo-tda", description="Training-data attribution inside pretraining.")
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    loud.add_argument("-q", "--quiet", action="store_true",
                      help="fewer log lines: train without OLMo's INFO lines (its warnings and errors stay), "
                           "the other commands' errors only")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny OLMo on shipped text with capture on, then query it (CPU)")
    demo.add_argument("--out", default="demo_out", help="output directory (default: demo_out)")
    demo.add_argument("--quick", action="store_true", help="a smaller run (seconds), for smoke tests")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=_cmd_demo)
    train = sub.add_parser("train", help="OLMo pretraining with the tda: section (run under torchrun for >1 rank)")
    train.add_argument("config", help="OLMo training YAML, optionally with a tda: section")
    train.add_argument("overrides", nargs=argparse.REMAINDER,
                       help="dotted overrides in OLMo's style, e.g. --max_duration=100 --tda.capture.proj_dim=32")
    train.set_defaults(func=_cmd_train)
    attr = sub.add_parser("attribute", help="which training passages made the model produce these texts?")
    attr.add_argument("run", help="run directory of olmo-tda train (or the demo's output folder)")
    attr.add_argument("--ids", help="TracIn-CP: only these training instances (\"3,5,9\" or @file); default all")
    attr.add_argument("--hessian", choices=["raw", "lorif", "ekfac", "joint"],
                      help="influence: one Fisher over all layers together (joint, the default: finds the "
                           "document that taught a fact best; explicit up to 16384 floats a row, else rank "
                           "1024), EK-FAC per layer (predicts retraining best), explicit D×D per layer, or "
                           "rank-r Woodbury per layer")
    attr.add_argument("--damping", type=float, help="influence: λ for every layer (default: --damping-ratio)")
    attr.add_argument("--damping-ratio", type=float,
                      help="influence: λ = RATIO·tr(F)/D, the Fisher's mean eigenvalue times RATIO (default "
                           "0.01 for joint, 0.1 per layer)")
    attr.add_argument("--rank", type=int, help="influence lorif: rank r of each layer's Fisher (default 64); "
                                                  "joint: rank r of the whole-model Fisher (default: explicit "
                                                  "up to 16384 floats a row, else 1024)")
    attr.add_argument("--route", choices=["auto", "model", "factorized", "materialized"], default="auto",
                      help="inner products with LoRIF factor stores: by cost, timed at near-ties (auto), by "
                           "the cost model alone (model), or forced")
    attr.add_argument("--query-rank", type=int, default=0,
                      help="approximate each query gradient by its best rank-r factors (faster on factor "
                           "stores); 0 = exact queries")
    attr.add_argument("--html", help="also write an HTML report of the answers to this file")
    attr.add_argument("--query", action="append", help="query text (repeatable); with --answer, the prompt")
    attr.add_argument("--answer", action="append",
                      help="the answer the --query prompt should lead to (repeatable, paired in order): only "
                           "its tokens are scored, the prompt is context")
    attr.add_argument("--query-file", help="JSONL: per line a string, {\"text\": ...} or {\"prompt\": ..., "
                                           "\"completion\": ...}")
    attr.add_argument("--group-by", choices=["example", "document", "source", "row"], default="example",
                      help="list training examples (default; summed over their steps), documents of the data "
                           "files (an instance's score split by token share), sources (data files or "
                           "data.datasets labels), or raw (example, step) rows")
    attr.add_argument("--skip-damaged", action="store_true",
                      help="leave out store shards whose checksums fail (counted in the output) instead of "
                           "refusing to answer")
    from .methods import available_methods
    attr.add_argument("--method", default="influence", choices=[*available_methods(), "tracin", "tracin-inrun"],
                      help="influence (default): the damped whole-model Fisher inverse (see --hessian); "
                           "gradcos/graddot: gradient similarity; tracin: TracIn-CP over the run's trajectory "
                           "checkpoints; tracin-inrun: the captured gradients weighted by lr/loss_scale, queries "
                           "at the nearest checkpoint")
    attr.add_argument("--top-k", type=int, default=10)
    attr.add_argument("--json", help="write the answers as JSON to this file (stdout then holds a summary)")
    attr.set_defaults(func=_cmd_attribute)
    inspect = sub.add_parser("inspect",
                             help="summarize a gradient store and trajectory (or a run directory holding them)")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    inspect.add_argument("--verify", action="store_true",
                         help="read every shard and check its checksums; exit 1 naming any damaged one")
    inspect.set_defaults(func=_cmd_inspect)
    prep = sub.add_parser("prepare", help="text/JSONL files to OLMo memmap training data with a document index "
                                          "(one source per file)")
    prep.add_argument("inputs", nargs="+", help=".jsonl/.json (a \"text\" field per line, named by \"id\") or "
                                                ".txt/.text/.md (documents separated by blank lines)")
    prep.add_argument("--out", required=True, help="folder for <stem>.npy and <stem>.npy.docs.npz per input")
    prep.add_argument("--tokenizer", default="olmo_tda:bytes",
                      help="olmo_tda:bytes (default: UTF-8 bytes, end-of-text 256), a tokenizer.json file, or a "
                           "Hugging Face tokenizer identifier (it must be cached locally)")
    prep.add_argument("--eos-token-id", type=int, help="end-of-text id of a tokenizer file (default: its own)")
    prep.set_defaults(func=_cmd_prepare)
    report = sub.add_parser("report", help="HTML report of a run: training curve and online-selection rounds")
    report.add_argument("run", help="run directory of olmo-tda train")
    report.add_argument("--out", help="HTML file (default: RUN/tda/report.html; plots beside it)")
    report.set_defaults(func=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .integrations import quiet_olmo_warnings

    quiet_olmo_warnings()
    if args.command == "train":                 # OLMo's own console, as its train script sets it up
        from olmo.util import prepare_cli_environment

        prepare_cli_environment()
        if args.verbose or args.quiet:
            logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    else:
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.ERROR if args.quiet else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("WANDB_MODE", "offline")
    from . import integrations

    try:
        return args.func(args)
    except (Exception, KeyboardInterrupt) as e:
        # a failed train still in a group of several ranks (train leaves it so): see end_failed_rank
        several = args.command == "train" and integrations.one_of_several_ranks()
        ours = isinstance(e, (TDAError, ValueError, OSError, RuntimeError))  # ours name the problem: no traceback
        if not several and (args.verbose or not ours):
            raise
        if args.verbose or not ours:
            traceback.print_exc()
        if ours:
            print(f"olmo-tda {args.command}: error: {e}", file=sys.stderr)
        status = 2 if ours else 1
    if several:         # reported: go, before a teardown that can wait on the other failed ranks
        integrations.end_failed_rank(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
