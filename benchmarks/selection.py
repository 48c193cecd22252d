"""Does online selection reach a target domain's validation loss in fewer steps, and at equal compute?

A tiny OLMo (the demo model, byte tokenizer) pretrains through ``olmo_tda``'s real OLMo trainer on a
pool of real-text sources, one memmap file each (so rounds know every example's source). Two pools:

- ``--pool natural`` (default): four sources of real text that ship with Python and its packages, no
  synthetic noise: ``reference`` (the reference manual's prose, ``pydoc_data.topics``), ``code`` (the
  standard library's source), ``docstrings`` (the standard library's API docstrings), ``licenses``
  (the licence texts shipped with the installed packages, and the system's common licences where
  present). Each target domain (``--targets``, default ``reference,code``) is taken in turn: its
  validation passages and its selection target (``target.jsonl``) are disjoint held-out passages of
  that source.
- ``--pool shipped``: ``target`` (reference-manual prose), ``offtarget`` (stdlib code) and ``corrupt``
  (target passages with shuffled or random bytes); the one target is ``target``.

Arms (each runs the same seeds: model init and base order per seed):

- ``none``: the plain OLMo order (``tda.enabled: false``); evaluated on every target's validation set.
- ``ceiling``: trains on the target source alone: how much any choice of data could win there.
- ``sources`` (the headline): per-source weights learned online from the rows the training step
  captures (``tda.selection.policy: sources``, ``tda.store.enabled: true``); the target gradient is
  refreshed every ``--target-every`` rounds, the round's only backward passes.
- ``random``, ``loss``, ``gradnorm``, ``alignment``, ``greats`` and their ``-head`` / ``-sampled``
  variants: per-example rounds every ``--every`` steps over the next ``--window`` examples
  (``--mode filter`` keeps half of each window; ``-head`` scores the output head only; ``-sampled``
  measures ``--sample`` of each window and scores the rest by their source's mean).

Numbers per (arm, target), over seeds (mean and a 95% t-interval):

- ``steps_saved_frac`` = 1 − (first step at which the arm's validation loss reaches the ``none``
  arm's final one, linearly interpolated between evaluations) / the ``none`` arm's steps; 0 when
  never reached. Both curves are first averaged over the last ``--smooth`` evaluations.
- ``compute_matched_delta``: the arm's validation loss once its training steps plus every second of
  selection work (rounds, target gradients, folding the captured rows; converted to steps by the
  arm's median step time) cost what the ``none`` arm's steps cost, minus the ``none`` arm's final loss
  (negative = better).
- ``selection_overhead``: all selection seconds / training seconds of the same run.
- ``capture_step_ratio``: the arm's median step time / the ``none`` arm's. The capture runs for
  attribution whether selection is on or not, so it is reported, not charged.
- ``share_of_ceiling``: the arm's steps saved / the ceiling's.

The last line is one JSON object; its headline keys are the ``sources`` arm's (``worst_*`` over
targets), or ``greats-sampled``'s when that arm is not run.

    python benchmarks/selection.py --quick                     # natural pool, 1 seed (~3 min on 2 cores)
    python benchmarks/selection.py                             # natural pool, 5 seeds
    python benchmarks/selection.py --pool shipped --seeds 2 --arms none,sources,greats-sampled
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["none", "ceiling", "sources", "random", "loss", "gradnorm", "alignment", "greats", "alignment-head",
        "greats-head", "alignment-sampled", "greats-sampled"]
DEFAULT_ARMS = {"natural": "none,ceiling,sources,greats-sampled", "shipped": "none,sources,greats-sampled"}
SCOPES = {"head": "transformer.blocks.*", "sampled": None}
"""Arm suffixes: ``greats-head`` scores with the output head's gradient only (every block excluded),
so a round's backward stops at the logits; ``greats-sampled`` measures only ``--sample`` examples of
each window (``selection.measure``) and scores the rest by their source's mean."""
_CODE_MODULES = ["argparse", "collections", "dataclasses", "difflib", "enum", "functools", "inspect", "json",
                 "logging", "pathlib", "pprint", "shutil", "statistics", "string", "tempfile", "textwrap",
                 "threading", "typing", "unittest", "zipfile", "tarfile", "csv", "calendar", "configparser",
                 "email", "http", "heapq", "fractions", "decimal", "optparse", "pickle", "random", "subprocess"]


# -- the corpus ---------------------------------------------------------------------------------------

def _windows(text: str, seq: int) -> list[str]:
    data = text.encode("ascii", errors="ignore")
    return [data[s:s + seq].decode("ascii") for s in range(0, len(data) - seq, seq)]


def _prose(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _code_text() -> str:
    src = []
    for name in _CODE_MODULES:
        try:
            src.append(inspect.getsource(__import__(name)))
        except (ImportError, OSError, TypeError):
            continue
    return "\n".join(src)


def _reference_text() -> str:
    from pydoc_data.topics import topics

    return " ".join(_prose(topics[k]) for k in sorted(topics))


def _docstring_text() -> str:
    """Every public function's and class's docstring in the standard library's top-level modules
    (deterministic: modules and names sorted)."""
    import importlib
    import pkgutil
    import sysconfig
    import warnings

    out = []
    stdlib = sysconfig.get_paths()["stdlib"]
    skip = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data", "lib2to3", "test"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in sorted(pkgutil.iter_modules([stdlib]), key=lambda m: m.name):
            if info.name.startswith("_") or info.name in skip:
                continue
            try:
                module = importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - a module this platform cannot import is simply left out
                continue
            for name in sorted(vars(module)):
                obj = getattr(module, name)
                if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)) \
                        and getattr(obj, "__module__", None) == info.name:
                    doc = inspect.getdoc(obj)
                    if doc:
                        out.append(_prose(doc))
    return " ".join(out)


def _license_text() -> str:
    """The licence files of the installed packages and the system's common licences, each distinct
    text once (sorted by content hash: the same text whatever the install order)."""
    import glob
    import hashlib
    import site
    import sysconfig

    roots = {sysconfig.get_paths()["purelib"], *getattr(site, "getsitepackages", lambda: [])()}
    files = [f for r in sorted(roots) for pat in ("*.dist-info/**/LICEN[CS]E*", "*.dist-info/**/COPYING*")
             for f in glob.glob(f"{r}/{pat}", recursive=True)]
    files += glob.glob("/usr/share/common-licenses/*")
    texts = {}
    for f in files:
        try:
            text = _prose(Path(f).read_text(encoding="utf-8", errors="ignore"))
        except (OSError, IsADirectoryError):
            continue
        if len(text) > 200:
            texts[hashlib.sha256(text.encode()).hexdigest()] = text
    return " ".join(texts[k] for k in sorted(texts))


NATURAL = {"reference": _reference_text, "code": _code_text, "docstrings": _docstring_text,
           "licenses": _license_text}
"""The natural pool's sources: name -> the source's whole text."""


def build_corpus(pool: str, seq: int, n_each: int, n_val: int, n_target: int, targets: list[str],
                 seed: int) -> dict:
    """``{"train": {source: passages}, "val": {target: passages}, "target_set": {target: passages}}``:
    per source ``n_each`` training passages of ``seq`` bytes; per target source also ``n_val``
    validation and ``n_target`` selection-target passages, all three disjoint."""
    rng = np.random.default_rng(seed)
    if pool == "shipped":
        texts = {"target": _windows(_reference_text(), seq), "offtarget": _windows(_code_text(), seq)}
    else:
        texts = {name: _windows(fn(), seq) for name, fn in NATURAL.items()}
    out = {"train": {}, "val": {}, "target_set": {}}
    for name, passages in texts.items():
        extra = n_val + n_target if name in targets else 0
        if pool == "shipped" and name == "target":
            extra += n_each                 # the corrupt source is made of held-out target passages
        if len(passages) < n_each + extra:
            raise SystemExit(f"selection: source {name!r} has {len(passages)} passages of {seq} bytes; need "
                             f"{n_each + extra}: lower --n-each")
        idx = rng.permutation(len(passages))
        out["train"][name] = [passages[i] for i in idx[:n_each]]
        if name in targets:
            out["val"][name] = [passages[i] for i in idx[n_each:n_each + n_val]]
            out["target_set"][name] = [passages[i] for i in idx[n_each + n_val:n_each + n_val + n_target]]
        if pool == "shipped" and name == "target":
            corrupt = []
            for k, i in enumerate(idx[n_each + extra - n_each:n_each + extra]):
                b = bytearray(passages[i].encode("ascii"))
                if k % 2 == 0:
                    rng.shuffle(b)
                else:
                    b = bytearray(rng.integers(32, 127, size=len(b)).astype(np.uint8).tobytes())
                corrupt.append(b.decode("ascii"))
            out["train"]["corrupt"] = corrupt
    return out


def write_data(corpus: dict, folder: Path, seq: int) -> dict[str, Path]:
    """One memmap per source (``folder/<source>/<source>.npy``) and, per target, ``target-<name>.jsonl``
    (one passage per line as JSON: newlines inside a passage are kept)."""
    from olmo_tda.demo.data import write_memmap

    paths = {name: write_memmap(passages, folder / name / f"{name}.npy", seq)
             for name, passages in corpus["train"].items()}
    for name, passages in corpus["target_set"].items():
        (folder / f"target-{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in passages))
    return paths


# -- one arm ------------------------------------------------------------------------------------------

def run_arm(arm: str, target: str | None, seed: int, paths: dict[str, Path], vals: dict[str, torch.Tensor],
            folder: Path, args) -> dict:
    """One training run: ``curves`` ({target: [(step, val loss)]}, every target's validation set),
    the median step time, each round's selection seconds by step, the target source's share of
    the rounds' fronts."""
    from olmo_tda.integrations import olmo_train
    from olmo_tda.integrations.olmo import load_configs

    data = [paths[target]] if arm == "ceiling" else list(paths.values())
    name = f"{arm}-s{seed}" if target is None else f"{arm}-{target}-s{seed}"
    run_dir = folder / name
    overrides = [f"--data.paths=[{','.join(str(p) for p in data)}]",
                 f"--save_folder={run_dir}", f"--max_duration={args.steps}", f"--stop_at={args.steps}",
                 f"--seed={seed}", "--save_interval_unsharded=null", "--console_log_interval=100000",
                 f"--model.d_model={args.d_model}", f"--global_train_batch_size={args.batch}",
                 f"--device_train_microbatch_size={args.batch}", "--scheduler.t_warmup=10",
                 "--tda.trajectory.enabled=false"]
    target_file = paths[next(iter(paths))].parent.parent / f"target-{target}.jsonl"
    if arm in ("none", "ceiling"):
        overrides.append("--tda.enabled=false")
    elif arm == "sources":
        overrides += ["--tda.enabled=true", "--tda.store.enabled=true", "--tda.selection.enabled=true",
                      "--tda.selection.policy=sources", f"--tda.selection.every_n={args.every}",
                      f"--tda.selection.start_step={args.start_step}", f"--tda.selection.target={target_file}",
                      f"--tda.selection.target_examples={args.target_examples}",
                      f"--tda.selection.target_every={args.target_every}",
                      f"--tda.selection.source_temperature={args.temperature}",
                      f"--tda.selection.source_memory={args.memory}",
                      f"--tda.selection.source_floor={args.floor}", f"--tda.selection.source_decay={args.decay}",
                      f"--tda.selection.precondition={str(args.precondition).lower()}",
                      f"--tda.selection.seed={seed}"]
    else:
        policy, _, scope = arm.partition("-")
        exclude = SCOPES[scope] if scope == "head" else args.exclude
        measure = args.sample if scope == "sampled" else args.measure
        overrides += ["--tda.enabled=true", "--tda.store.enabled=false", "--tda.selection.enabled=true",
                      f"--tda.selection.policy={policy}",
                      f"--tda.selection.every_n={args.every}", f"--tda.selection.window={args.window}",
                      f"--tda.selection.start_step={args.start_step}", f"--tda.selection.target={target_file}",
                      f"--tda.selection.target_examples={args.target_examples}",
                      f"--tda.selection.proj_dim={args.proj_dim}", f"--tda.selection.score_tokens={args.score_tokens}",
                      f"--tda.selection.measure={measure}",
                      f"--tda.selection.seed={seed}", f"--tda.selection.mode={args.mode}",
                      f"--tda.selection.keep_fraction={args.keep_fraction}",
                      f"--tda.selection.precondition={str(args.precondition).lower()}",
                      f"--tda.selection.remove_common={str(args.remove_common).lower()}",
                      f"--tda.selection.normalize={str(args.normalize).lower()}",
                      f"--tda.selection.embeddings={str(args.embeddings and scope != 'head').lower()}",
                      f"--tda.selection.exclude_modules=[{exclude}]"]
    cfg, tda = load_configs(ROOT / "configs" / "demo_tiny.yaml", overrides)
    curves: dict[str, list] = {t: [] for t in vals}
    step_s, round_s = [], {}
    state = {"t": None, "trainer": None}

    def evaluate(step: int) -> None:
        for t, tokens in vals.items():
            curves[t].append((step, validation_loss(state["trainer"], tokens)))

    def on_step(step: int, metrics: dict) -> None:
        now = time.perf_counter()
        sel = float(metrics.get("tda/selection_seconds", 0.0))
        if state["t"] is not None:
            step_s.append(now - state["t"] - sel)
        if sel:
            round_s[step] = sel
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step)
        state["t"] = time.perf_counter()

    device = olmo_train.init_distributed()
    trainer = olmo_train.build_trainer(cfg, tda, device, step_callbacks=[on_step])
    state["trainer"] = trainer
    with trainer:
        evaluate(0)
        trainer.fit()
    fronts, weights = [], []
    rounds_file = run_dir / "tda" / "selection" / "rounds.jsonl"
    if rounds_file.exists():
        for line in rounds_file.read_text().splitlines():
            r = json.loads(line)
            if r.get("source_frac_front"):
                fronts.append(r["source_frac_front"])
            if r.get("source_weight"):
                weights.append(r["source_weight"])
    front_source = target if arm != "ceiling" else None
    if run_dir.exists():
        shutil.rmtree(run_dir / "tda" / "store", ignore_errors=True)      # rows are not needed afterwards
    return {"curves": curves, "step_s": statistics.median(step_s), "round_s": round_s,
            "front_target_frac": (statistics.mean(f.get(front_source, 0.0) for f in fronts)
                                  if fronts and front_source else None),
            "last_weights": weights[-1] if weights else None}


@torch.no_grad()
def validation_loss(trainer, val_tokens: torch.Tensor) -> float:
    """Mean next-token CE on held-out passages (eval mode, RNG untouched)."""
    model = trainer.dist_model
    was = model.training
    model.eval()
    try:
        with torch.random.fork_rng():
            total, count = 0.0, 0
            for lo in range(0, len(val_tokens), 64):
                x = val_tokens[lo:lo + 64]
                logits = model(input_ids=x).logits
                ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum")
                total, count = total + float(ce), count + x[:, 1:].numel()
    finally:
        model.train(was)
    return total / count


# -- the numbers --------------------------------------------------------------------------------------

def steps_to_reach(curve: list[tuple[int, float]], level: float) -> float | None:
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if l1 <= level:
            return s0 + (s1 - s0) * ((l0 - level) / (l0 - l1) if l0 != l1 else 1.0) if l0 > level else float(s0)
    return None


def loss_at(curve: list[tuple[int, float]], step: float) -> float:
    xs, ys = zip(*curve)
    return float(np.interp(step, xs, ys))


def compute_matched_step(result: dict, budget_steps: int) -> float:
    """The step at which training steps + selection rounds (in step-equivalents) reach the budget."""
    per_step = result["step_s"]
    cost, prev = 0.0, 0
    for step in range(1, budget_steps + 1):
        cost += 1.0 + result["round_s"].get(step, 0.0) / per_step
        if cost >= budget_steps:
            return float(step)
        prev = step
    return float(prev)


def smoothed(curve: list[tuple[int, float]], width: int) -> list[tuple[int, float]]:
    """Each evaluation replaced by the mean of the last ``width`` (fewer at the start): the loss of
    a run this short moves by more between evaluations than the arms differ by at the end, so the
    first crossing of a level on the raw curve is mostly noise (the reference even "reaches" its
    own final loss early)."""
    vals = [v for _, v in curve]
    return [(s, float(np.mean(vals[max(0, i - width + 1):i + 1]))) for i, (s, _) in enumerate(curve)]


def ci95(values: list[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: Student's t 95% interval of the mean (a point for one value)."""
    from scipy.stats import t

    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, mean, mean
    half = float(t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return mean, mean - half, mean + half


def summarize(results: dict[tuple[str, str], list[dict]], base: list[dict], steps: int, smooth: int = 1) -> dict:
    """Per ``"arm@target"``: each figure's mean, 95% interval and per-seed values against ``base``
    (the ``none`` runs, seed by seed)."""
    out = {}
    ref_step = statistics.median(r["step_s"] for r in base)
    for (arm, target), runs in results.items():
        saved, matched, finals, overhead = [], [], [], []
        for run, ref in zip(runs, base):
            curve, ref_curve = smoothed(run["curves"][target], smooth), smoothed(ref["curves"][target], smooth)
            level = ref_curve[-1][1]
            reach = steps_to_reach(curve, level)
            saved.append(0.0 if reach is None else 1.0 - reach / steps)
            matched.append(loss_at(curve, compute_matched_step(run, steps)) - level)
            finals.append(curve[-1][1] - level)
            overhead.append(sum(run["round_s"].values()) / (run["step_s"] * steps))
        fronts = [r["front_target_frac"] for r in runs if r["front_target_frac"] is not None]
        entry = {}
        for key, vals in (("steps_saved_frac", saved), ("compute_matched_delta", matched), ("final_delta", finals),
                          ("selection_overhead", overhead)):
            mean, lo, hi = ci95(vals)
            entry[key], entry[f"{key}_ci95"] = mean, [lo, hi]
            entry[f"per_seed_{key}"] = [round(v, 4) for v in vals]
        entry["capture_step_ratio"] = statistics.median(r["step_s"] for r in runs) / ref_step
        entry["front_target_frac"] = float(np.mean(fronts)) if fronts else None
        if runs[0].get("last_weights"):
            entry["last_weights_seed0"] = {k: round(v, 3) for k, v in runs[0]["last_weights"].items()}
        out[f"{arm}@{target}"] = entry
    for key, entry in out.items():
        ceiling = out.get(f"ceiling@{key.split('@')[1]}")
        entry["share_of_ceiling"] = (entry["steps_saved_frac"] / ceiling["steps_saved_frac"]
                                     if ceiling and ceiling["steps_saved_frac"] > 0 else None)
    return out


def plot(results: dict[tuple[str, str], list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = sorted({t for _, t in results})
    fig, axes = plt.subplots(len(targets), 2, figsize=(11, 4 * len(targets)), squeeze=False)
    for row, target in enumerate(targets):
        for (arm, t), runs in results.items():
            if t != target:
                continue
            run = runs[0]
            xs, ys = zip(*run["curves"][target])
            bold = arm in ("none", "sources", "ceiling")
            axes[row][0].plot(xs, ys, label=arm, lw=1.6 if bold else 1)
            costs = [s + sum(v for k, v in run["round_s"].items() if k <= s) / run["step_s"] for s in xs]
            axes[row][1].plot(costs, ys, label=arm, lw=1.6 if bold else 1)
        axes[row][0].set(xlabel="optimizer step", ylabel=f"held-out {target} loss (nats/byte)",
                         title=f"target {target}: by steps (seed 0)")
        axes[row][1].set(xlabel="compute (steps + selection work, in step-equivalents)",
                         title=f"target {target}: by compute (seed 0)")
        axes[row][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", default="natural", choices=["natural", "shipped"])
    p.add_argument("--targets", default=None,
                   help="target sources taken in turn (natural: default reference,code; shipped: target)")
    p.add_argument("--quick", action="store_true", help="1 seed")
    p.add_argument("--seeds", type=int, default=5, help="seeds per arm")
    p.add_argument("--arms", default=None, help=f"default: natural {DEFAULT_ARMS['natural']}; shipped "
                                                f"{DEFAULT_ARMS['shipped']}")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-each", type=int, default=None,
                   help="training passages per source (default: natural 5000, shipped 3200; the filter arms "
                        "read steps*batch/keep_fraction of the pool, the ceiling arm steps*batch of its source)")
    p.add_argument("--n-val", type=int, default=192, help="validation passages per target")
    p.add_argument("--every", type=int, default=10, help="selection.every_n")
    p.add_argument("--window", type=int, default=320, help="selection.window (per-example arms)")
    p.add_argument("--start-step", type=int, default=0, help="selection.start_step: no round before this step")
    p.add_argument("--mode", default="filter", choices=["reorder", "filter"],
                   help="selection.mode of the per-example arms")
    p.add_argument("--keep-fraction", type=float, default=0.5, help="filter mode")
    p.add_argument("--target-examples", type=int, default=16)
    p.add_argument("--target-every", type=int, default=10, help="sources: rounds between target-gradient refreshes")
    p.add_argument("--temperature", type=float, default=0.1, help="sources: selection.source_temperature")
    p.add_argument("--memory", type=float, default=0.9, help="sources: selection.source_memory")
    p.add_argument("--floor", type=float, default=0.1, help="sources: selection.source_floor")
    p.add_argument("--decay", type=float, default=0.5, help="sources: selection.source_decay")
    p.add_argument("--proj-dim", type=int, default=16)
    p.add_argument("--embeddings", action=argparse.BooleanOptionalAction, default=False,
                   help="selection.embeddings: score the token-embedding gradient too")
    p.add_argument("--precondition", action=argparse.BooleanOptionalAction, default=True,
                   help="selection.precondition")
    p.add_argument("--remove-common", action=argparse.BooleanOptionalAction, default=True,
                   help="selection.remove_common (per-example arms)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                   help="selection.normalize (per-example arms)")
    p.add_argument("--exclude", default="",
                   help="selection.exclude_modules of the arms without a -scope, comma-separated fnmatch patterns")
    p.add_argument("--measure", type=int, default=0,
                   help="selection.measure: window examples measured per round (0 = all)")
    p.add_argument("--sample", type=int, default=32, help="selection.measure of the -sampled arms")
    p.add_argument("--score-tokens", type=int, default=0, help="0 = all")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--smooth", type=int, default=3,
                   help="validation losses averaged over the last N evaluations before the metrics (1 = raw)")
    p.add_argument("--out", default=None, help="folder for runs and the PNG (default: a temp dir)")
    p.add_argument("--png", default=None, help="where the curves go (default: OUT/selection_curves.png)")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds = 1
    args.arms = args.arms or DEFAULT_ARMS[args.pool]
    args.n_each = args.n_each or (5000 if args.pool == "natural" else 3200)
    sources = list(NATURAL) if args.pool == "natural" else ["target", "offtarget", "corrupt"]
    targets = (args.targets or ("reference,code" if args.pool == "natural" else "target")).split(",")
    if unknown := [t for t in targets if t not in sources or t == "corrupt"]:
        raise SystemExit(f"selection: unknown target(s) {unknown} for the {args.pool} pool; its sources are {sources}")
    arms = args.arms.split(",")
    if "none" not in arms:
        raise SystemExit("selection: the 'none' arm is the reference; keep it in --arms")
    from olmo_tda.config import SelectionPolicy
    for arm in arms:
        policy, _, scope = arm.partition("-")
        if arm not in ("none", "ceiling") and (policy not in {p.value for p in SelectionPolicy}
                                               or (scope and scope not in SCOPES) or (scope and policy == "sources")):
            raise SystemExit(f"selection: unknown arm {arm!r}; arms are none, ceiling, sources or a policy "
                             f"({', '.join(p.value for p in SelectionPolicy if p.value != 'sources')}), optionally "
                             f"with -{'/-'.join(SCOPES)}")
    pool_size = len(sources) * args.n_each
    read = args.steps * args.batch / (args.keep_fraction if args.mode == "filter" else 1.0) + args.window
    if any(a not in ("none", "ceiling", "sources") for a in arms) and read > pool_size:
        raise SystemExit(f"selection: the filter arms would read {read:.0f} candidates but the pool holds "
                         f"{pool_size}: past that they would train on the examples they demoted. "
                         f"Raise --n-each to {math.ceil(read / len(sources))} or lower --steps / raise --keep-fraction")
    if "ceiling" in arms and args.steps * args.batch > args.n_each:
        raise SystemExit(f"selection: the ceiling arm trains {args.steps * args.batch} examples of one source, which "
                         f"holds {args.n_each}: raise --n-each")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t_start = time.perf_counter()
    folder = Path(args.out or tempfile.mkdtemp(prefix="olmo_tda_selection_"))
    base: list[dict] = []
    results: dict[tuple[str, str], list[dict]] = {}
    from olmo_tda.demo.corpus import ByteTokenizer

    for seed in range(args.seeds):
        corpus = build_corpus(args.pool, args.seq, args.n_each, args.n_val, args.target_examples, targets, seed=seed)
        paths = write_data(corpus, folder / f"data-s{seed}", args.seq)
        tok = ByteTokenizer()
        vals = {t: torch.tensor([tok.encode(x) for x in corpus["val"][t]], dtype=torch.long) for t in targets}
        for arm in arms:
            for target in ([None] if arm == "none" else targets):
                t0 = time.perf_counter()
                run = run_arm(arm, target, seed, paths, vals, folder, args)
                if arm == "none":
                    base.append(run)
                    for t in targets:
                        results.setdefault(("none", t), []).append(run)
                else:
                    results.setdefault((arm, target), []).append(run)
                final = " ".join(f"{t} {c[-1][1]:.4f}" for t, c in run["curves"].items())
                print(f"  seed {seed} {arm:15s} {target or '(all)':10s} final val {final} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    summary = summarize(results, base, args.steps, args.smooth)
    png = Path(args.png) if args.png else folder / "selection_curves.png"
    plot(results, png)
    print(f"\nselection ({args.pool} pool: {', '.join(sources)}): tiny OLMo d_model {args.d_model}, {args.steps} steps x "
          f"{args.batch} x {args.seq} bytes ({args.steps * args.batch / pool_size:.2f} epoch of the pool), rounds every "
          f"{args.every} steps; sources: target gradient every {args.target_every} rounds over {args.target_examples} "
          f"examples, temperature {args.temperature}, memory {args.memory}, floor {args.floor}, decay {args.decay}"
          f"{', preconditioned' if args.precondition else ''}; per-example arms: window {args.window} ({args.mode}), "
          f"-sampled measure {args.sample}; {args.seeds} seed(s), mean [95% interval], curves averaged over the last "
          f"{args.smooth} evaluations")
    print(f"{'arm':16s} {'target':10s} {'steps_saved':>22s} {'compute_matched':>27s} {'equal_steps':>9s} {'overhead':>8s} "
          f"{'capture':>7s} {'of ceil':>7s} {'front':>6s}")

    def fmt(e: dict, key: str, spec: str) -> str:
        lo, hi = e[f"{key}_ci95"]
        return f"{e[key]:{spec}} [{lo:{spec}},{hi:{spec}}]"

    for key, e in summary.items():
        arm, target = key.split("@")
        if arm == "none":
            continue
        share = "-" if e["share_of_ceiling"] is None else f"{e['share_of_ceiling']:.2f}"
        front = "-" if e["front_target_frac"] is None else f"{e['front_target_frac']:.2f}"
        print(f"{arm:16s} {target:10s} {fmt(e, 'steps_saved_frac', '.3f'):>22s} "
              f"{fmt(e, 'compute_matched_delta', '+.4f'):>27s} {e['final_delta']:+9.4f} "
              f"{e['selection_overhead']:8.3f} {e['capture_step_ratio']:7.2f} {share:>7s} {front:>6s}")
    headline = next((a for a in ("sources", "greats-sampled", "greats") if a in arms),
                    next(a for a in arms if a not in ("none", "ceiling")) if len(arms) > 1 else "none")
    heads = [summary[f"{headline}@{t}"] for t in targets]
    result = {"benchmark": "selection", "pool": args.pool, "headline_arm": headline, "targets": targets,
              "worst_compute_matched_delta": round(max(h["compute_matched_delta"] for h in heads), 5),
              "worst_ci95_high": round(max(h["compute_matched_delta_ci95"][1] for h in heads), 5),
              "best_steps_saved_frac": round(max(h["steps_saved_frac"] for h in heads), 4),
              "selection_overhead": round(max(h["selection_overhead"] for h in heads), 5),
              "ceiling_steps_saved": {t: (round(summary[f"ceiling@{t}"]["steps_saved_frac"], 4)
                                          if f"ceiling@{t}" in summary else None) for t in targets},
              "steps_saved_frac": round(float(np.mean([h["steps_saved_frac"] for h in heads])), 4),
              "compute_matched_delta": round(float(np.mean([h["compute_matched_delta"] for h in heads])), 5),
              "arms": {k: {kk: (round(v, 5) if isinstance(v, float) else v) for kk, v in e.items()}
                       for k, e in summary.items()},
              "curves_by_seed": {f"{a}@{t}": [[[s, round(v, 5)] for s, v in run["curves"][t]] for run in runs]
                                 for (a, t), runs in results.items()},
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "png")}, "png": str(png),
              "seconds": round(time.perf_counter() - t_start, 1), "torch": torch.__version__,
              "python": platform.python_version()}
    result["targets_met"] = {"worst_ci95_high_le_0.005": result["worst_ci95_high"] <= 0.005,
                             "steps_saved_0.25_with_negative_ci": any(
                                 h["steps_saved_frac"] >= 0.25 and h["compute_matched_delta_ci95"][1] < 0 for h in heads),
                             "overhead_le_0.05": result["selection_overhead"] <= 0.05}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
