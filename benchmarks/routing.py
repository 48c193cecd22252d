"""Does the automatic (FLOP-count) route pick the fastest one? Measured across sequence lengths.

Three routed operations, each timed on every route it has, with the library as it is:

- ``capture``: rank-c factors of ``Ĝ = gᵀa`` from T token factors (B=32 examples, k=64, c=4):
  ``factor_route`` picks ``"tokens"`` (``lowrank_factors``: QRs of the token factors, exact copy for
  T <= c) or ``"dense"`` (form Ĝ with a bmm, then ``truncate_dense``: SVD of the 64×64 Ĝ).
- ``ghost``: the cross-gram ``cross_gram(g1, a1, g2, a2, force=...)`` of Q=16 vs N=256 examples of
  T tokens (k=64): ``"factorized"`` (ghost: Σ_ts (a·a')(g·g')) vs ``"materialized"`` (form Ĝ, GEMM).
- ``query``: ``inner(dense queries [Q, 64, 64], LowRank [N=1024, 64, 64, c])`` (one block of
  ``attribute``) for Q ∈ {1, 4, 16, 64} and c ∈ {1, 2, 4, 8}: factorized ``sum(A ∘ (qB))`` vs
  materialized (``A Bᵀ`` one cache-sized tile of rows at a time, each followed by a GEMM). Where
  the cost model's two costs are within ``ops.TIE_BAND``, ``auto`` times both routes on its first
  call (the warm-up) and keeps the faster; the table marks those points "timed" and shows what the
  model alone would have taken.

Per point, the routes (and ``auto``, which calls the library's router) are timed in interleaved
rounds (order rotated every round), each sample repeating the call for at least --min-sample-s,
and compared by median: ``auto / best`` (the headline). ``chosen / best`` compares the fixed-route
medians only (the quality of the rule's choice, free of the auto arm's own timing noise). A forced
route whose FLOP count is >= --skip-factor times the other route's and costs > 2 GFLOP (or whose
intermediates exceed --max-gib) is not run; it is counted as slower (the router never picks it: it
only picks the smaller count).

The "what if" lines replay the measured medians under other settings of the rule
(``factors._EIGH_FLOPS`` for capture; a weight on the factorized side's FLOPs for ghost; the two
measured weights of ``ops.inner_route`` for query) to show which setting would fix a wrong choice; the headline
always uses the library unchanged.

    python benchmarks/routing.py                 # table, then one JSON line
    python benchmarks/routing.py --quick         # 5 rounds of 20 ms samples (~40 s)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time

import torch

from olmo_tda.capture import factors
from olmo_tda.capture.factors import cross_gram, factor_route, lowrank_factors, route, truncate_dense
from olmo_tda import ops
from olmo_tda.ops import inner, inner_route
from olmo_tda.store.record import LowRank

K = 64


def time_routes(fns: dict, rounds: int, min_sample_s: float) -> dict[str, float]:
    """Median seconds per call of each function, interleaved rounds with rotating order."""
    reps = {}
    for name, fn in fns.items():
        fn()                                     # warm-up (allocations, lazy init)
        t0 = time.perf_counter()
        fn()
        reps[name] = max(1, math.ceil(min_sample_s / max(time.perf_counter() - t0, 1e-6)))
    if "auto" in reps:      # auto runs one of the fixed routes: time it with the fastest one's repeat count
        reps["auto"] = max(reps.values())
    samples = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            fn, n = fns[name], reps[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(v) for name, v in samples.items()}


def _row(op: str, point: str, chosen: str, medians: dict, skipped: dict, flops: dict) -> dict:
    fixed = {k: v for k, v in medians.items() if k != "auto"}
    best = min(fixed, key=fixed.get)
    return {"op": op, "point": point, "auto_route": chosen, "best_route": best, "medians_s": medians,
            "skipped": skipped, "flops": flops, "auto_over_best": medians["auto"] / fixed[best],
            "chosen_over_best": fixed[chosen] / fixed[best] if chosen in fixed else float("nan")}


# -- (a) capture-time factorization ---------------------------------------------------------------

def sweep_capture(args, gen) -> list[dict]:
    rows = []
    c = args.rank
    for T in args.tokens:
        g = torch.randn(args.capture_batch, T, K, generator=gen)
        a = torch.randn(args.capture_batch, T, K, generator=gen)

        def job(decide, g=g, a=a, T=T):
            # every arm goes through the same decision point as capture's hook (only auto's costs
            # a FLOP count); "tokens" keeps g, a and factors them by QR, "dense" forms Ĝ and truncates
            # it by its Gram's eigendecomposition
            if decide(T) == "tokens":
                return lowrank_factors(g, a, c)
            return truncate_dense(torch.bmm(g.transpose(1, 2), a), c)

        fns = {"tokens": lambda: job(lambda T: "tokens"), "dense": lambda: job(lambda T: "dense"),
               "auto": lambda: job(lambda T: factor_route(T, K, K, c))}
        medians = time_routes(fns, args.rounds, args.min_sample_s)
        rows.append(_row("capture", f"T={T}", factor_route(T, K, K, c), medians, {}, {}))
    return rows


# -- (b) ghost cross-gram -------------------------------------------------------------------------

def ghost_flops(q: int, n: int, T: int) -> dict[str, int]:
    return {"factorized": q * n * T * T * 2 * K, "materialized": (q + n) * T * K * K + q * n * K * K}


def sweep_ghost(args, gen) -> list[dict]:
    rows = []
    q, n = args.ghost_q, args.ghost_n
    for T in args.tokens:
        g1, a1 = torch.randn(q, T, K, generator=gen), torch.randn(q, T, K, generator=gen)
        g2, a2 = torch.randn(n, T, K, generator=gen), torch.randn(n, T, K, generator=gen)
        flops = ghost_flops(q, n, T)
        ghost_gib = 2 * q * n * T * T * 4 / 2**30            # the two [Q, N, T, T] einsum products
        skipped = {}
        for name, other in (("factorized", "materialized"), ("materialized", "factorized")):
            if flops[name] >= args.skip_factor * flops[other] and flops[name] > 2e9:
                skipped[name] = f"{flops[name] / flops[other]:.0f}x the FLOPs"
        if ghost_gib > args.max_gib and "factorized" not in skipped:
            skipped["factorized"] = f"{ghost_gib:.1f} GiB of intermediates"
        fns = {name: (lambda name=name: cross_gram(g1, a1, g2, a2, force=name))
               for name in ("factorized", "materialized") if name not in skipped}
        fns["auto"] = lambda: cross_gram(g1, a1, g2, a2)
        medians = time_routes(fns, args.rounds, args.min_sample_s)
        rows.append(_row("ghost", f"T={T}", route(q, n, T, K, K), medians, skipped, flops))
    return rows


# -- (c) query-time inner products against factors ------------------------------------------------

def query_flops(q: int, n: int, c: int) -> dict[str, int]:
    d = K * K
    return {"factorized": q * n * c * d, "materialized": (n * c) * d + q * n * d}


def sweep_query(args, gen) -> list[dict]:
    rows = []
    n = args.query_n
    for q in args.query_q:
        x = torch.randn(q, K, K, generator=gen)
        for c in args.ranks:
            y = LowRank(torch.randn(n, K, c, generator=gen), torch.randn(n, K, c, generator=gen))
            fns = {name: (lambda name=name: inner(x, y, name)) for name in ("factorized", "materialized")}
            fns["auto"] = lambda: inner(x, y)
            timed_before = len(ops.measured_routes())
            medians = time_routes(fns, args.rounds, args.min_sample_s)       # auto's warm-up call times near-ties
            row = _row("query", f"Q={q},c={c}", ops.auto_route(x, y), medians, {}, query_flops(q, n, c))
            row["model_route"] = inner_route(q, n, K, K, 0, c)
            row["timed"] = len(ops.measured_routes()) > timed_before
            row["model_over_best"] = medians[row["model_route"]] / medians[row["best_route"]]
            rows.append(row)
    return rows


# -- what if --------------------------------------------------------------------------------------

def replay(rows: list[dict], pick) -> tuple[float, str]:
    """Max over rows of (median of the route ``pick(row)`` chooses) / best; skipped routes count as
    infinitely slow."""
    worst, where = 0.0, ""
    for r in rows:
        fixed = {k: v for k, v in r["medians_s"].items() if k != "auto"}
        choice = pick(r)
        ratio = fixed[choice] / min(fixed.values()) if choice in fixed else float("inf")
        if ratio > worst:
            worst, where = ratio, r["point"]
    return worst, where


def what_if_capture(rows: list[dict], args) -> list[dict]:
    out = []
    saved = factors._EIGH_FLOPS
    try:
        for value in (0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0):
            factors._EIGH_FLOPS = value

            def pick(r):
                return factor_route(int(r["point"][2:]), K, K, args.rank)
            worst, where = replay(rows, pick)
            out.append({"_EIGH_FLOPS": value, "max_over_best": worst, "at": where,
                        "dense_from_T": next((int(r["point"][2:]) for r in rows if pick(r) == "dense"), None)})
    finally:
        factors._EIGH_FLOPS = saved
    return out


def what_if_query_weights(rows: list[dict]) -> list[dict]:
    """Dense queries vs factors: the library's rule (factorized ``Q·c`` vs materialized
    ``a + b·Q + m·c``) replayed at other settings of ``ops._MATERIALIZE`` (a) and
    ``ops._GEMM_PER_QUERY`` (b); m stays."""
    out = []
    saved = ops._MATERIALIZE, ops._GEMM_PER_QUERY
    try:
        for a in (4.0, 5.0, 6.0, 6.5, 7.0, 8.0, 10.0):
            for b in (0.25, 0.5, 0.75):
                ops._MATERIALIZE, ops._GEMM_PER_QUERY = a, b

                def pick(r):
                    q, c = (int(part.split("=")[1]) for part in r["point"].split(","))
                    return inner_route(q, 1024, K, K, 0, c)
                worst, where = replay(rows, pick)
                out.append({"a,b": f"{a},{b}", "max_over_best": worst, "at": where})
    finally:
        ops._MATERIALIZE, ops._GEMM_PER_QUERY = saved
    return out


def what_if_weight(rows: list[dict]) -> list[dict]:
    """Route by ``weight · factorized FLOPs < materialized FLOPs`` (weight 1 = the library's rule)."""
    out = []
    for weight in (0.25, 0.5, 1, 2, 4, 8, 16):
        def pick(r, weight=weight):
            f = r["flops"]
            return "factorized" if weight * f["factorized"] < f["materialized"] else "materialized"
        worst, where = replay(rows, pick)
        out.append({"factorized_weight": weight, "max_over_best": worst, "at": where})
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,2,4,8,16,24,32,40,48,56,64,128,256,512,1024",
                   help="sequence lengths T (40-56 probe the capture rule's switch at T=54)")
    p.add_argument("--ops", default="capture,ghost,query")
    p.add_argument("--rank", type=int, default=4, help="LoRIF rank c for the capture sweep")
    p.add_argument("--capture-batch", type=int, default=32)
    p.add_argument("--ghost-q", type=int, default=16)
    p.add_argument("--ghost-n", type=int, default=256)
    p.add_argument("--query-q", default="1,4,16,64")
    p.add_argument("--query-n", type=int, default=1024, help="rows per block (attribute's default block)")
    p.add_argument("--ranks", default="1,2,4,8", help="factor ranks for the query sweep")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--min-sample-s", type=float, default=0.05)
    p.add_argument("--skip-factor", type=float, default=16.0)
    p.add_argument("--max-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="5 rounds, 20 ms samples")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.min_sample_s = 5, 0.02
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
        args.query_q = [int(q) for q in args.query_q.split(",")]
        args.ranks = [int(c) for c in args.ranks.split(",")]
    except ValueError:
        p.error("--tokens, --query-q and --ranks take comma-separated integers")
    ops = args.ops.split(",")
    sweeps = {"capture": sweep_capture, "ghost": sweep_ghost, "query": sweep_query}
    if not set(ops) <= set(sweeps):
        p.error(f"--ops: unknown {sorted(set(ops) - set(sweeps))}; choose from {', '.join(sweeps)}")
    gen = torch.Generator().manual_seed(args.seed)
    t_start = time.perf_counter()
    rows = [r for op in ops for r in sweeps[op](args, gen)]

    print(f"routing: k={K}, capture B={args.capture_batch} c={args.rank}; ghost Q={args.ghost_q} N={args.ghost_n}; "
          f"query N={args.query_n}; threads={torch.get_num_threads()}, rounds={args.rounds}, "
          f"samples >= {args.min_sample_s * 1e3:.0f} ms, medians in ms")
    print(f"{'op':>7} {'point':>10} {'auto route':>12} {'best route':>12} {'route ms (auto first)':>44} "
          f"{'auto/best':>9} {'chosen/best':>11}")
    for r in rows:
        ms = "  ".join(f"{k} {v * 1e3:.3g}" for k, v in r["medians_s"].items() if k == "auto") + "  " + "  ".join(
            f"{k} {v * 1e3:.3g}" for k, v in r["medians_s"].items() if k != "auto")
        ms += "".join(f"  {k} skipped ({why})" for k, why in r["skipped"].items())
        flag = ""
        if r["auto_over_best"] > 1.10:     # auto runs the chosen route's code: same route = timing noise
            flag = "  <-- >10% slower" + (" (auto chose the best route: timing noise)"
                                         if r["auto_route"] == r["best_route"] else "")
        if r.get("timed"):
            flag += f"  (timed; the model alone: {r['model_route']}, {r['model_over_best']:.3f}x)"
        print(f"{r['op']:>7} {r['point']:>10} {r['auto_route']:>12} {r['best_route']:>12} {ms:>44} "
              f"{r['auto_over_best']:>9.3f} {r['chosen_over_best']:>11.3f}{flag}")

    per_op = {}
    for op in ops:
        op_rows = [r for r in rows if r["op"] == op]
        worst = max(op_rows, key=lambda r: r["auto_over_best"])
        per_op[op] = {"max_auto_over_best": round(worst["auto_over_best"], 4), "at": worst["point"],
                      "max_chosen_over_best": round(max(r["chosen_over_best"] for r in op_rows), 4),
                      "wrong_choices": [r["point"] for r in op_rows if r["auto_route"] != r["best_route"]]}
        if op == "query":       # what timing the near-ties buys over the cost model alone
            per_op[op]["timed_points"] = [r["point"] for r in op_rows if r["timed"]]
            per_op[op]["max_model_over_best"] = round(max(r["model_over_best"] for r in op_rows), 4)
    worst = max(rows, key=lambda r: r["auto_over_best"])
    what_if = {}
    if "capture" in ops:
        what_if["capture"] = what_if_capture([r for r in rows if r["op"] == "capture"], args)
    if "ghost" in ops:
        what_if["ghost"] = what_if_weight([r for r in rows if r["op"] == "ghost"])
    if "query" in ops:
        what_if["query"] = what_if_query_weights([r for r in rows if r["op"] == "query"])
    for op, lines in what_if.items():
        key = next(k for k in lines[0] if k not in ("max_over_best", "at", "dense_from_T"))
        print(f"what if ({op}, replaying the measured medians): " + "; ".join(
            f"{key}={w[key]}: max {w['max_over_best']:.3f} at {w['at']}" for w in lines))
    worst_choice = max(rows, key=lambda r: r["chosen_over_best"])
    # auto runs exactly the fixed route it chose (the same call), so the route it takes is judged by
    # that route's own median; the auto arm's separate timing adds only run-to-run noise (shown too)
    ok = worst_choice["chosen_over_best"] <= 1.10
    print(f"auto route within 10% of the best fixed route everywhere: {'yes' if ok else 'NO'} (worst: the "
          f"route auto takes is {worst_choice['chosen_over_best']:.3f}x the best at {worst_choice['op']} "
          f"{worst_choice['point']}); the auto arm's own timing, noise included: worst "
          f"{worst['auto_over_best']:.3f}x at {worst['op']} {worst['point']} (auto {worst['auto_route']}, "
          f"best {worst['best_route']})")
    result = {"benchmark": "routing", "k": K, "rank": args.rank, "capture_batch": args.capture_batch,
              "ghost_q": args.ghost_q, "ghost_n": args.ghost_n, "query_n": args.query_n, "tokens": args.tokens,
              "rounds": args.rounds, "threads": torch.get_num_threads(),
              "max_auto_over_best": round(worst["auto_over_best"], 4),
              **{f"max_auto_over_best_{op}": v["max_auto_over_best"] for op, v in per_op.items()},
              "worst_case": {"op": worst["op"], "point": worst["point"], "auto_route": worst["auto_route"],
                             "best_route": worst["best_route"]},
              "within_10pct": ok, "max_chosen_over_best": round(worst_choice["chosen_over_best"], 4),
              "worst_choice": {"op": worst_choice["op"], "point": worst_choice["point"],
                               "auto_route": worst_choice["auto_route"], "best_route": worst_choice["best_route"]},
              "per_op": per_op,
              "what_if": {op: [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in w.items()} for w in lines]
                          for op, lines in what_if.items()},
              "rows": [{"op": r["op"], "point": r["point"], "auto": r["auto_route"], "best": r["best_route"],
                        "ms": {k: round(v * 1e3, 4) for k, v in r["medians_s"].items()},
                        "auto_over_best": round(r["auto_over_best"], 4),
                        **({"model": r["model_route"], "timed": r["timed"]} if "timed" in r else {})} for r in rows],
              "total_s": round(time.perf_counter() - t_start, 1),
              "torch": torch.__version__, "python": platform.python_version()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
