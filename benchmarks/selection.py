"""Does online selection reach a target-domain validation loss in fewer steps, and at equal compute?

A tiny OLMo (the demo model, byte tokenizer) pretrains through ``olmo_tda``'s real OLMo trainer on a
pool of three real-text sources, one memmap file each (so rounds report the fraction per source):

- ``target``: passages of Python's reference manual (``pydoc_data.topics``: English prose);
- ``offtarget``: passages of the standard library's own source code (Python code);
- ``corrupt``: target-style passages with their bytes shuffled (half) or uniformly random (half).

Validation: held-out reference-manual passages (never trained on, never in the selection target).
The selection target is another disjoint set of reference-manual passages. The run budget is less
than one epoch of the pool (the data-rich regime of pretraining), so the order decides what is seen;
in ``filter`` mode each round reads ``1 / keep_fraction`` fresh candidates per example trained, and the
pool is sized so that those never run out (demoted examples wait at the end of the epoch: a run that
reached them would train on its own rejects; the script refuses such a setting).

Arms: ``none`` (plain OLMo order, ``tda.enabled: false``) and ``random``, ``loss``, ``gradnorm``,
``alignment``, ``greats`` (``tda.selection`` rounds every ``--every`` steps over the next ``--window``
examples; ``--mode filter`` by default, keeping half of each window — the random arm too, so it is
the control for "which half"), ``alignment-head``, ``greats-head``: the same policies scored on
the output head's gradient only (``exclude_modules`` = every block), whose round runs no backward
through the network, and ``alignment-sampled``, ``greats-sampled``: rounds that measure only
``--sample`` (32) of the window's examples (``selection.measure``) and score every other example as
the mean of its source's measured ones — here the three sources are pure, the best case for that.
Each arm runs the same seeds (model init and base order per seed).

- ``steps_saved_frac`` = 1 − (first step at which the arm's validation loss reaches the ``none``
  arm's final one, linearly interpolated between evaluations) / the ``none`` arm's steps; 0 when
  never reached. Both curves are first averaged over the last ``--smooth`` evaluations (3: 30
  steps), since on raw curves even the reference "reached" its own final loss 10% early.
- ``compute_matched_delta``: the arm's validation loss once its training steps plus its selection
  rounds (converted to steps by this run's median step time) cost what the ``none`` arm's steps cost,
  minus the ``none`` arm's final loss (negative = better).

The headline keys are ``greats-sampled``'s (the mean over seeds; ``greats``' when that arm is not
run); every arm's are in ``arms``.

    python benchmarks/selection.py --quick     # 1 seed, ~5 min on 2 cores
    python benchmarks/selection.py             # 5 seeds, ~22 min
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["none", "random", "loss", "gradnorm", "alignment", "greats", "alignment-head", "greats-head",
        "alignment-sampled", "greats-sampled"]
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


def build_corpus(seq: int, n_each: int, n_val: int, n_target: int, seed: int) -> dict[str, list[str]]:
    from pydoc_data.topics import topics

    rng = np.random.default_rng(seed)
    prose = _windows(" ".join(re.sub(r"\s+", " ", topics[k]).strip() for k in sorted(topics)), seq)
    code_src = []
    for name in _CODE_MODULES:
        try:
            module = __import__(name)
            code_src.append(inspect.getsource(module))
        except (ImportError, OSError, TypeError):
            continue
    code = _windows("\n".join(code_src), seq)
    need = n_each * 2 + n_val + n_target
    if len(prose) < need or len(code) < n_each:
        raise SystemExit(f"selection: the local corpus has {len(prose)} prose / {len(code)} code passages of "
                         f"{seq} bytes; need {need} / {n_each}: lower --n-each")
    prose_idx = rng.permutation(len(prose))
    cut = np.cumsum([n_each, n_val, n_target, n_each])
    target = [prose[i] for i in prose_idx[:cut[0]]]
    val = [prose[i] for i in prose_idx[cut[0]:cut[1]]]
    target_set = [prose[i] for i in prose_idx[cut[1]:cut[2]]]
    base_corrupt = [prose[i] for i in prose_idx[cut[2]:cut[3]]]
    corrupt = []
    for k, p in enumerate(base_corrupt):
        b = bytearray(p.encode("ascii"))
        if k % 2 == 0:
            rng.shuffle(b)
        else:
            b = bytearray(rng.integers(32, 127, size=len(b)).astype(np.uint8).tobytes())
        corrupt.append(b.decode("ascii"))
    offtarget = [code[i] for i in rng.choice(len(code), size=n_each, replace=False)]
    return {"target": target, "offtarget": offtarget, "corrupt": corrupt, "val": val, "target_set": target_set}


def write_data(corpus: dict[str, list[str]], folder: Path, seq: int) -> dict[str, Path]:
    from olmo_tda.demo.data import write_memmap

    paths = {}
    for name in ("target", "offtarget", "corrupt"):
        paths[name] = write_memmap(corpus[name], folder / name / f"{name}.npy", seq)
    (folder / "target.txt").write_text("\n".join(corpus["target_set"]) + "\n")
    return paths


# -- one arm ------------------------------------------------------------------------------------------

def run_arm(arm: str, seed: int, paths: dict[str, Path], val_tokens: torch.Tensor, folder: Path, args) -> dict:
    from olmo_tda.integrations import olmo_train
    from olmo_tda.integrations.olmo import load_configs

    overrides = [f"--data.paths=[{','.join(str(paths[k]) for k in ('target', 'offtarget', 'corrupt'))}]",
                 f"--save_folder={folder / f'{arm}-s{seed}'}", f"--max_duration={args.steps}", f"--stop_at={args.steps}",
                 f"--seed={seed}", "--save_interval_unsharded=null", "--console_log_interval=100000",
                 f"--model.d_model={args.d_model}", f"--global_train_batch_size={args.batch}",
                 f"--device_train_microbatch_size={args.batch}", "--scheduler.t_warmup=10",
                 "--tda.store.enabled=false", "--tda.trajectory.enabled=false"]
    if arm == "none":
        overrides.append("--tda.enabled=false")
    else:
        policy, _, scope = arm.partition("-")
        exclude = SCOPES[scope] if scope == "head" else args.exclude
        measure = args.sample if scope == "sampled" else args.measure
        overrides += ["--tda.enabled=true", "--tda.selection.enabled=true", f"--tda.selection.policy={policy}",
                      f"--tda.selection.every_n={args.every}", f"--tda.selection.window={args.window}",
                      f"--tda.selection.start_step={args.start_step}",
                      f"--tda.selection.target={paths['target'].parent.parent / 'target.txt'}",
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
    curve, step_s, round_s = [], [], {}
    state = {"t": None, "trainer": None}

    def on_step(step: int, metrics: dict) -> None:
        now = time.perf_counter()
        sel = float(metrics.get("tda/selection_seconds", 0.0))
        if state["t"] is not None:
            step_s.append(now - state["t"] - sel)
        if sel:
            round_s[step] = sel
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, validation_loss(state["trainer"], val_tokens)))
        state["t"] = time.perf_counter()

    device = olmo_train.init_distributed()
    trainer = olmo_train.build_trainer(cfg, tda, device, step_callbacks=[on_step])
    state["trainer"] = trainer
    with trainer:
        curve.append((0, validation_loss(trainer, val_tokens)))
        trainer.fit()
    fronts = []
    rounds_file = folder / f"{arm}-s{seed}" / "tda" / "selection" / "rounds.jsonl"
    if rounds_file.exists():
        for line in rounds_file.read_text().splitlines():
            r = json.loads(line)
            if r.get("source_frac_front"):
                fronts.append(r["source_frac_front"])
    return {"curve": curve, "step_s": statistics.median(step_s), "round_s": round_s,
            "front_target_frac": statistics.mean(f.get("target", 0.0) for f in fronts) if fronts else None}


@torch.no_grad()
def validation_loss(trainer, val_tokens: torch.Tensor) -> float:
    """Mean next-token CE on the held-out target passages (eval mode, RNG untouched)."""
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


def summarize(results: dict[str, list[dict]], steps: int, smooth: int = 1) -> dict:
    base = results["none"]
    out = {}
    for arm, runs in results.items():
        saved, matched, finals, overhead = [], [], [], []
        for run, ref in zip(runs, base):
            curve, ref_curve = smoothed(run["curve"], smooth), smoothed(ref["curve"], smooth)
            level = ref_curve[-1][1]
            reach = steps_to_reach(curve, level)
            saved.append(0.0 if reach is None else 1.0 - reach / steps)
            matched.append(loss_at(curve, compute_matched_step(run, steps)) - level)
            finals.append(curve[-1][1] - level)
            overhead.append(sum(run["round_s"].values()) / (run["step_s"] * steps))
        out[arm] = {"steps_saved_frac": float(np.mean(saved)), "compute_matched_delta": float(np.mean(matched)),
                    "final_delta": float(np.mean(finals)), "selection_overhead": float(np.mean(overhead)),
                    "front_target_frac": (float(np.mean([r["front_target_frac"] for r in runs]))
                                          if runs[0]["front_target_frac"] is not None else None),
                    "per_seed_steps_saved": [round(x, 4) for x in saved],
                    "per_seed_compute_matched": [round(x, 4) for x in matched]}
    return out


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm, runs in results.items():
        run = runs[0]
        xs, ys = zip(*run["curve"])
        axes[0].plot(xs, ys, label=arm, lw=1.4 if arm in ("none", "greats", "greats-head") else 1)
        costs = [s + sum(v for k, v in run["round_s"].items() if k <= s) / run["step_s"] for s in xs]
        axes[1].plot(costs, ys, label=arm, lw=1.4 if arm in ("none", "greats", "greats-head") else 1)
    axes[0].set(xlabel="optimizer step", ylabel="held-out target loss (nats/byte)", title="by steps (seed 0)")
    axes[1].set(xlabel="compute (steps + selection rounds, in step-equivalents)", title="by compute (seed 0)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 seed (~5 min on 2 cores)")
    p.add_argument("--seeds", type=int, default=5,
                   help="seeds per arm (one seed's steps saved ranges over 0-0.43: 3 seeds are too few to read)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-each", type=int, default=3200,
                   help="training passages per source (the filter arms read steps*batch/keep_fraction of them)")
    p.add_argument("--n-val", type=int, default=256)
    p.add_argument("--every", type=int, default=10, help="selection.every_n")
    p.add_argument("--window", type=int, default=320, help="selection.window")
    p.add_argument("--start-step", type=int, default=0, help="selection.start_step: no round before this step")
    p.add_argument("--mode", default="filter", choices=["reorder", "filter"],
                   help="selection.mode for every selecting arm (reorder was measured worse: see docs/BENCHMARKS.md)")
    p.add_argument("--keep-fraction", type=float, default=0.5, help="filter mode")
    p.add_argument("--target-examples", type=int, default=64)
    p.add_argument("--proj-dim", type=int, default=16)
    p.add_argument("--embeddings", action=argparse.BooleanOptionalAction, default=False,
                   help="selection.embeddings: score the token-embedding gradient too")
    p.add_argument("--precondition", action=argparse.BooleanOptionalAction, default=True,
                   help="selection.precondition: greats/alignment score g / sqrt(v) (diagonal K-FAC second moment)")
    p.add_argument("--remove-common", action=argparse.BooleanOptionalAction, default=True,
                   help="selection.remove_common: greats/alignment score gradients projected off the window's "
                        "mean direction")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                   help="selection.normalize: greats/alignment compare gradients of equal length (a cosine)")
    p.add_argument("--exclude", default="",
                   help="selection.exclude_modules of the arms without a -scope, comma-separated fnmatch patterns")
    p.add_argument("--measure", type=int, default=0,
                   help="selection.measure: window examples measured per round (0 = all)")
    p.add_argument("--sample", type=int, default=32, help="selection.measure of the -sampled arms")
    p.add_argument("--score-tokens", type=int, default=0, help="0 = all (16 scored noticeably worse)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--smooth", type=int, default=3,
                   help="validation losses averaged over the last N evaluations before the metrics (1 = raw)")
    p.add_argument("--out", default=None, help="folder for runs and the PNG (default: a temp dir)")
    p.add_argument("--png", default=None,
                   help="where the curves go (default: OUT/selection_curves.png; docs/BENCHMARKS.md's figure is "
                        "docs/selection_curves.png, written by the full run only when asked)")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds = 1
    arms = args.arms.split(",")
    if "none" not in arms:
        raise SystemExit("selection: the 'none' arm is the reference; keep it in --arms")
    from olmo_tda.config import SelectionPolicy
    for arm in arms:
        policy, _, scope = arm.partition("-")
        if arm != "none" and (policy not in {p.value for p in SelectionPolicy} or (scope and scope not in SCOPES)):
            raise SystemExit(f"selection: unknown arm {arm!r}; arms are none or a policy "
                             f"({', '.join(p.value for p in SelectionPolicy)}), optionally with -{'/-'.join(SCOPES)}")
    read = args.steps * args.batch / (args.keep_fraction if args.mode == "filter" else 1.0) + args.window
    if read > 3 * args.n_each:
        raise SystemExit(f"selection: the filter arms would read {read:.0f} candidates but the pool holds "
                         f"{3 * args.n_each}: past that they would train on the examples they demoted. "
                         f"Raise --n-each to {math.ceil(read / 3)} or lower --steps / raise --keep-fraction")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t_start = time.perf_counter()
    folder = Path(args.out or tempfile.mkdtemp(prefix="olmo_tda_selection_"))
    results: dict[str, list[dict]] = {a: [] for a in arms}
    from olmo_tda.demo.corpus import ByteTokenizer

    for seed in range(args.seeds):
        corpus = build_corpus(args.seq, args.n_each, args.n_val, args.target_examples, seed=seed)
        paths = write_data(corpus, folder / f"data-s{seed}", args.seq)
        tok = ByteTokenizer()
        val = torch.tensor([tok.encode(t) for t in corpus["val"]], dtype=torch.long)
        for arm in arms:
            t0 = time.perf_counter()
            results[arm].append(run_arm(arm, seed, paths, val, folder, args))
            print(f"  seed {seed} {arm:9s} final val {results[arm][-1]['curve'][-1][1]:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    summary = summarize(results, args.steps, args.smooth)
    png = Path(args.png) if args.png else folder / "selection_curves.png"
    plot(results, png)
    print(f"\nselection: tiny OLMo d_model {args.d_model}, {args.steps} steps x {args.batch} x {args.seq} bytes "
          f"(pool {3 * args.n_each}: {args.steps * args.batch / (3 * args.n_each):.2f} epoch), rounds every "
          f"{args.every} steps over {args.window} upcoming examples ({args.mode}), scored on "
          f"{args.score_tokens or args.seq} tokens, "
          f"k={args.proj_dim}, {'preconditioned' if args.precondition else 'raw gradients'}"
          f"{', common direction removed' if args.remove_common else ''}{', cosine' if args.normalize else ''}, "
          f"{args.seeds} seed(s), "
          f"curves averaged over the last {args.smooth} evaluations; -sampled arms measure {args.sample} of each "
          "window")
    print(f"{'arm':17s} {'steps_saved':>11s} {'cm_delta':>9s} {'final_delta':>11s} {'overhead':>9s} {'target@front':>12s}")
    for arm, s in summary.items():
        front = "-" if s["front_target_frac"] is None else f"{s['front_target_frac']:.2f}"
        print(f"{arm:17s} {s['steps_saved_frac']:11.3f} {s['compute_matched_delta']:+9.4f} {s['final_delta']:+11.4f} "
              f"{s['selection_overhead']:9.2f} {front:>12s}")
    headline = next((a for a in ("greats-sampled", "greats") if a in summary), arms[-1])
    head = summary[headline]
    result = {"benchmark": "selection", "steps_saved_frac": round(head["steps_saved_frac"], 4),
              "compute_matched_delta": round(head["compute_matched_delta"], 5), "headline_arm": headline,
              "targets_met": {"steps_saved_0.25": head["steps_saved_frac"] >= 0.25,
                              "compute_matched_negative": head["compute_matched_delta"] < 0},
              "arms": {a: {k: (round(v, 5) if isinstance(v, float) else v) for k, v in s.items()}
                       for a, s in summary.items()},
              "curves": {a: [[s, round(v, 5)] for s, v in runs[0]["curve"]] for a, runs in results.items()},
              "curves_by_seed": {a: [[[s, round(v, 5)] for s, v in run["curve"]] for run in runs]
                                 for a, runs in results.items()},
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "png")}, "png": args.png,
              "seconds": round(time.perf_counter() - t_start, 1), "torch": torch.__version__,
              "python": platform.python_version()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
