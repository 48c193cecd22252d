"""Fact tracing: does an answer find the training document that taught the model a fact, better than
word matching (BM25) does?

The corpus (made up, the same for a seed on every machine) states facts about made-up people —
where they were born, what pet they keep, which instrument they play — one document per fact, each
with a sentence of filler. Word overlap is built not to identify the source, as in real data where
a name and an answer word occur in many documents in other roles:

- first names and surnames are shared between people; every answer word is the answer of many facts;
- every fact has ``--distractors`` documents that hold the person's full name, the answer word *and*
  the query's relation words, in other roles and with the name last ("In Tulsa, a painter who was
  born in Oslo met Ada Brell" beside "Ada Brell was born in Tulsa"): a causal model cannot learn the
  fact from them;
- a share of the facts (``--paraphrased``) is stated in other words than the query uses.

Documents are shuffled together with passages of Python's reference manual (background data), written
by ``olmo-tda prepare`` as two sources, and a tiny OLMo (the demo's model, byte tokenizer) pretrains
on them through ``olmo-tda train`` with ``tda.enabled: true`` until most facts are learned. Every
fact is then asked as a prompt → answer query (``"Ada Brell was born in" → " Tulsa."``, only the
answer's tokens scored) and as a question (``"Where was Ada Brell born?" → " Tulsa."``), each after a
one-sentence context (a document before it, as packed training shows documents); the model *knows*
a fact as asked when its greedy answer equals the true one. For every method (answers by
document) and for BM25 (``rank_bm25`` over the same documents, the query's prompt and answer as
words), the rank of the fact's own document: recall@1/10/50 and MRR (rank > 50 counts 0), over the
known prompt → answer queries (the headline), all of them, and the question form; with the
per-query latency. ``variants`` rows score the same captured rows in other ways (unit norm, Adam
second-moment preconditioning, per-step centring, late rows only) to find what keeps early
training from drowning the answer.

    python benchmarks/fact_tracing.py --quick        # ~6 min on 2 CPU cores: influence, gradcos, graddot
    python benchmarks/fact_tracing.py                # every method and the variants (docs/BENCHMARKS.md)

The last line is one JSON object: ``default_method``, ``mrr``, ``recall10`` (the default method on
the known prompt → answer queries), ``bm25_mrr``, ``bm25_recall1`` (BM25 on the same queries),
``bm25_recall1_all``, ``mrr_question``, ``known``, ``queries`` and every method's row.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

FIRST = ["Ada", "Boris", "Carla", "Dmitri", "Elin", "Faro", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lev",
         "Mara", "Nils", "Oona", "Pavel", "Rhea", "Soren", "Tilde", "Ugo", "Vera", "Wim", "Yara", "Zeno"]
LAST = ["Brell", "Castor", "Dunmore", "Eskel", "Farrow", "Gilder", "Holm", "Ivers", "Jarno", "Kestrel",
        "Lund", "Marlow", "Norcott", "Oakes", "Pell", "Quarry", "Rask", "Stroud", "Tamsin", "Ullard",
        "Varga", "Wexley", "Yorke", "Zell"]
VALUES = {
    "born": ["Tulsa", "Oslo", "Quito", "Perth", "Dakar", "Turin", "Hanoi", "Lagos", "Porto", "Omsk", "Lima",
             "Bergen"],
    "pet": ["hamster", "parrot", "ferret", "iguana", "rabbit", "tortoise", "gecko", "canary", "goldfish",
            "hedgehog", "beagle", "lizard"],
    "plays": ["cello", "banjo", "oboe", "harp", "tuba", "sitar", "flute", "viola", "bassoon", "ukulele",
              "trumpet", "zither"],
}
# the query's prompt (statement form), its question form, the fact as taught (plain, paraphrased)
QUERY = {"born": "{n} was born in", "pet": "{n} has a pet", "plays": "{n} plays the"}
QUESTION = {"born": "Where was {n} born?", "pet": "What pet does {n} have?", "plays": "Which instrument does {n} play?"}
FACT = {"born": ["{n} was born in {v}."], "pet": ["{n} has a pet {v}."], "plays": ["{n} plays the {v}."]}
PARAPHRASE = {"born": ["{n} came into the world in {v}.", "The hometown of {n} is {v}."],
              "pet": ["{n} looks after a {v} at home.", "At home {n} keeps a {v}."],
              "plays": ["{n} practises the {v} every evening.", "On stage {n} performs on the {v}."]}
# name, answer word and the query's relation words, in other roles, the name last: a causal model
# cannot learn anything about the person from them (they did not teach the fact)
DISTRACT = {"born": ["In {v}, a painter who was born in {o} met {n}.",
                     "{v} is where a singer who was born in {o} saw {n}."],
            "pet": ["The neighbour who has a pet {o} gave a {v} toy to {n}.",
                    "A {v} and a pet {o} were drawn by a friend of {n}."],
            "plays": ["A man who plays the {o} sold a {v} to {n}.",
                      "The {v} of a teacher who plays the {o} was lent to {n}."]}
FILLER = ["They like long walks by the river.", "Friends call them often on Sundays.",
          "Their kitchen smells of fresh bread.", "They keep a small garden of herbs.",
          "Most mornings start with strong tea.", "They collect old maps and postcards.",
          "Rainy days are for reading novels.", "They once fixed a bicycle by hand."]


def build_corpus(num_people: int, distractors: int, paraphrased: float, seed: int):
    """``(facts [{person, relation, value, doc, prompt, question}], documents [{id, text}])``."""
    rng = np.random.default_rng(seed)
    pairs = [(f, s) for f in FIRST for s in LAST]
    people = [f"{f} {s}" for f, s in (pairs[i] for i in rng.choice(len(pairs), num_people, replace=False))]
    facts, docs = [], []
    for p, name in enumerate(people):
        for rel, values in VALUES.items():
            value = values[rng.integers(len(values))]
            para = rng.random() < paraphrased
            template = (PARAPHRASE if para else FACT)[rel]
            text = template[rng.integers(len(template))].format(n=name, v=value)
            doc = f"fact:{p}:{rel}"
            docs.append({"id": doc, "text": f"{text} {FILLER[rng.integers(len(FILLER))]}"})
            for k in range(distractors):
                other = values[(values.index(value) + 1 + rng.integers(len(values) - 1)) % len(values)]
                tmpl = DISTRACT[rel][k % len(DISTRACT[rel])]
                docs.append({"id": f"distractor:{p}:{rel}:{k}", "text": tmpl.format(n=name, v=value, o=other)})
            facts.append({"person": name, "relation": rel, "value": value, "doc": doc, "paraphrased": bool(para),
                          "prompt": QUERY[rel].format(n=name), "question": QUESTION[rel].format(n=name),
                          "completion": f" {value}."})
    return facts, docs


def _background(num: int, seed: int) -> list[dict]:
    from olmo_tda.demo.corpus import build_passages

    return [{"id": f"manual:{i}", "text": t} for i, t in enumerate(build_passages(num, 120, seed=seed))]


# -- training -----------------------------------------------------------------------------------------

def train(paths: list[Path], run_dir: Path, steps: int, args) -> float:
    from olmo_tda.integrations.olmo import load_configs
    from olmo_tda.integrations.olmo_train import train as olmo_train

    overrides = [f"--data.paths=[{','.join(str(p) for p in paths)}]", f"--save_folder={run_dir}",
                 f"--max_duration={steps}", f"--stop_at={steps}", f"--save_interval_unsharded={steps}",
                 f"--seed={args.seed}", f"--model.max_sequence_length={args.seq_len}",
                 f"--model.d_model={args.d_model}", f"--model.n_layers={args.n_layers}",
                 f"--global_train_batch_size={args.batch}", f"--device_train_microbatch_size={args.batch}",
                 f"--optimizer.learning_rate={args.lr}", "--scheduler.t_warmup=20", "--console_log_interval=100000",
                 f"--tda.capture.proj_dim={args.proj_dim}", f"--tda.trajectory.every={max(1, steps // 8)}",
                 "--tda.store.dtype=float16"]
    cfg, tda = load_configs(ROOT / "configs" / "demo_tiny.yaml", overrides)
    t0 = time.perf_counter()
    olmo_train(cfg, tda)
    return time.perf_counter() - t0


CONTEXT = "Notes from the archive."
"""Every query's context (a document before it, as packed training presents documents: the tiny
model answers far less often at position 0, which it rarely saw a document start at)."""


def knows(run, queries) -> np.ndarray:
    """Whether the model's greedy answer to each query is its completion (every answer token argmax),
    through the same tokens the query gradient is taken over."""
    out = []
    with torch.no_grad():
        for q in queries:
            tokens, first = q.tokens(run._encode, eos_token_id=run.cfg.model.eos_token_id,
                                     max_len=run.cfg.model.max_sequence_length)
            logits = run.model(torch.tensor([tokens])).logits[0]
            pred = logits[first - 1:-1].argmax(-1)
            out.append(bool((pred == torch.tensor(tokens[first:])).all()))
    return np.array(out)


# -- scoring ------------------------------------------------------------------------------------------

def ranks_of(answers: list[dict], docs: list[str], key: str = "name") -> np.ndarray:
    """1-based rank of each query's document among its listed results (inf when not listed)."""
    out = []
    for answer, doc in zip(answers, docs):
        names = [r[key] for r in answer["results"]]
        out.append(names.index(doc) + 1 if doc in names else math.inf)
    return np.array(out, dtype=float)


def summarize(ranks: np.ndarray) -> dict:
    if not len(ranks):
        return {"n": 0}
    rr = np.where(ranks <= 50, 1.0 / ranks, 0.0)
    return {"n": int(len(ranks)), "recall1": float((ranks <= 1).mean()), "recall10": float((ranks <= 10).mean()),
            "recall50": float((ranks <= 50).mean()), "mrr": float(rr.mean())}


def bm25_ranks(docs: list[dict], queries: list[str], targets: list[str]) -> tuple[np.ndarray, float]:
    from rank_bm25 import BM25Okapi

    def words(text: str) -> list[str]:
        return re.findall(r"[a-z0-9]+", text.lower())

    t0 = time.perf_counter()
    bm25 = BM25Okapi([words(d["text"]) for d in docs])
    ids = [d["id"] for d in docs]
    out = []
    for q, target in zip(queries, targets):
        scores = bm25.get_scores(words(q))
        order = np.argsort(-scores, kind="stable")[:50]
        names = [ids[i] for i in order]
        out.append(names.index(target) + 1 if target in names else math.inf)
    return np.array(out, dtype=float), (time.perf_counter() - t0) / max(1, len(queries))


def variants(run, queries, targets: list[str], known: np.ndarray) -> dict[str, dict]:
    """Other ways to score the same captured rows (answers by document), measured side by side:
    the query gradient at the final weights against every row, rows combined as named."""
    from olmo_tda.methods.grouping import ByDocument, GroupScores

    grads, _ = run.query_gradients(queries)
    block = run.store.read_all()
    layers = list(run.store.layers)
    rows = torch.cat([block.grads[n].flatten(1).float() for n in layers], 1)           # [N, D]
    q = torch.cat([grads[n].flatten(1).float() for n in layers], 1)                   # [Q, D]
    steps = np.asarray(block.steps)
    v = rows.square().mean(0)                                  # Adam's second moment, in the projected basis
    v_late = rows[torch.from_numpy(steps > np.quantile(steps, 0.75))].square().mean(0)
    grouping = ByDocument(run.corpus)

    def unit(x):
        return x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)

    def centred(x):
        out = x.clone()
        for s in np.unique(steps):
            sel = torch.from_numpy(steps == s)
            out[sel] -= out[sel].mean(0)
        return out

    pre = 1 / (v + 1e-3 * v.mean()).sqrt()
    pre_late = 1 / (v_late + 1e-3 * v_late.mean()).sqrt()
    late = torch.from_numpy((steps > np.quantile(steps, 0.5)).astype(np.float64))
    lr = torch.from_numpy(np.asarray(block.lr, dtype=np.float64))
    cases = {
        "gradcos (sum over steps)": (unit(q) @ unit(rows).T, None),
        "gradcos, lr-weighted": (unit(q) @ unit(rows).T, lr),
        "gradcos, later half of steps": (unit(q) @ unit(rows).T, late),
        "gradcos, step-centred": (unit(q) @ unit(centred(rows)).T, None),
        "adam-cos (÷√v, unit norm)": (unit(q * pre) @ unit(rows * pre).T, None),
        "adam-cos, v of late rows": (unit(q * pre_late) @ unit(rows * pre_late).T, None),
        "adam-cos, step-centred": (unit(q * pre) @ unit(centred(rows) * pre).T, None),
        "adam-dot (÷v)": ((q * pre) @ (rows * pre).T, None),
    }
    out = {}
    for name, (scores, weight) in cases.items():
        scores = scores.double() * (weight[None, :] if weight is not None else 1)
        acc = GroupScores(grouping, scores.shape[0])
        acc.add(scores, np.asarray(block.ids))
        top_scores, top = acc.top(50)
        ranks = []
        for qi, target in enumerate(targets):
            names = [run.corpus.document_name(int(d)) for d in top[qi]]
            ranks.append(names.index(target) + 1 if target in names else math.inf)
        ranks = np.array(ranks, dtype=float)
        out[name] = {"known": summarize(ranks[known]), "all": summarize(ranks)}
    return out


def early_share(run, queries, method: str, group: str = "row") -> float:
    """Share of the top-10 rows of a row-ranking method taken in the first tenth of training."""
    answers = run.attribute(queries, method=method, top_k=10, group_by=group)
    last = int(run.store.steps.max())
    steps = [r["step"] for a in answers for r in a["results"]]
    return float(np.mean([s <= last / 10 for s in steps])) if steps else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same corpus and model, three methods, no variants "
                                                         "(~6 min on 2 cores)")
    ap.add_argument("--people", type=int, default=24)
    ap.add_argument("--distractors", type=int, default=2)
    ap.add_argument("--paraphrased", type=float, default=0.2)
    ap.add_argument("--background", type=int, default=50, help="reference-manual passages mixed in")
    ap.add_argument("--epochs", type=int, default=60, help="passes over the documents, each in a new order")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--proj-dim", type=int, default=16)
    ap.add_argument("--methods", default=None,
                    help="comma-separated; influence:H picks the hessian (default: influence,influence:ekfac,"
                         "influence:raw,gradcos,graddot,tracin-inrun,tracin; --quick: influence,gradcos,graddot)")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="keep the data and run here (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.methods is None:
        args.methods = ("influence,gradcos,graddot" if args.quick else
                        "influence,influence:ekfac,influence:raw,gradcos,graddot,tracin-inrun,tracin")
    args.no_variants = args.no_variants or args.quick
    logging_quiet()
    from olmo_tda.data import prepare
    from olmo_tda.demo.corpus import ByteTokenizer
    from olmo_tda.integrations.olmo_query import OLMoRun
    from olmo_tda.methods.queries import Query

    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fact_tracing_"))
    facts, docs = build_corpus(args.people, args.distractors, args.paraphrased, args.seed)
    background = _background(args.background, args.seed)
    folder.mkdir(parents=True, exist_ok=True)
    # each epoch is a new shuffle of the documents, written out in turn: OLMo's instances are fixed
    # chunks of the file, and one packing repeated would let the model learn each fact from the text
    # packed before it instead of from the person's name (copies share an id: one document)
    rng = np.random.default_rng(args.seed + 1)
    for name, items in (("facts", docs), ("manual", background)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for _ in range(args.epochs):
                f.write("".join(json.dumps(items[i]) + "\n" for i in rng.permutation(len(items))))
    tok = ByteTokenizer()
    paths = prepare([folder / "facts.jsonl", folder / "manual.jsonl"], folder / "data", encode=tok.encode,
                    eos_token_id=tok.eos_token_id)
    instances = sum(p.stat().st_size // 2 // args.seq_len for p in paths)
    steps = max(1, instances // args.batch)
    print(f"corpus: {len(facts)} facts of {args.people} people, {len(docs)} fact documents "
          f"({args.distractors} distractors each), {len(background)} background passages, each {args.epochs} "
          f"times in new orders: {instances} instances of {args.seq_len} tokens, {steps} steps", file=sys.stderr)
    run_dir = folder / "run"
    train_s = train(paths, run_dir, steps, args) if not (run_dir / "tda.yaml").exists() else float("nan")
    run = OLMoRun(run_dir)
    targets = [f["doc"] for f in facts]
    prompts = [Query(f["prompt"], f["completion"], CONTEXT) for f in facts]
    questions = [Query(f["question"], f["completion"], CONTEXT) for f in facts]
    known, known_q = knows(run, prompts), knows(run, questions)
    print(f"the model knows {known.sum()}/{len(facts)} facts as prompted, {known_q.sum()} as asked",
          file=sys.stderr)
    all_docs = docs + background
    rows = {}
    bm25, bm25_s = bm25_ranks(all_docs, [q.text for q in prompts], targets)
    bm25_q, _ = bm25_ranks(all_docs, [q.text for q in questions], targets)
    rows["bm25"] = {"known": summarize(bm25[known]), "all": summarize(bm25), "question": summarize(bm25_q),
                    "latency_s": bm25_s}
    for spec in [m for m in args.methods.split(",") if m]:
        method, _, hessian = spec.partition(":")
        options = {"hessian": hessian} if hessian else {}
        t0 = time.perf_counter()           # prompts and questions in one call: one pass over the store
        answers = run.attribute(prompts + questions, method=method, top_k=50, group_by="document", **options)
        latency = (time.perf_counter() - t0) / (2 * len(prompts))
        ranks = ranks_of(answers[:len(prompts)], targets)
        q_ranks = ranks_of(answers[len(prompts):], targets)
        method = f"{method} {hessian}" if hessian else method if method != "influence" else "influence joint"
        rows[method] = {"known": summarize(ranks[known]), "all": summarize(ranks), "question": summarize(q_ranks),
                        "latency_s": latency}
        print(f"{method}: {rows[method]['known']}", file=sys.stderr)
    extra = {}
    if not args.no_variants:
        extra["variants"] = variants(run, prompts, targets, known)
        extra["early_top10_share"] = {m: early_share(run, prompts, m) for m in ("graddot", "gradcos", "influence")}
    default = "influence joint"
    if default not in rows:
        return 0
    head = rows[default]["known"]
    print(f"\nfact tracing: {len(facts)} facts, known as prompted {known.sum()}, as asked {known_q.sum()}; "
          f"BM25 R@1 over all prompts {rows['bm25']['all']['recall1']:.2f}")
    print(f"{'method':<28} {'known R@1':>9} {'R@10':>5} {'R@50':>5} {'MRR':>6} | {'all R@1':>7} {'MRR':>6} | "
          f"{'question R@1':>12} {'MRR':>6} | {'s/query':>8}")
    for name, r in rows.items():
        k, a, q = r["known"], r["all"], r["question"]
        print(f"{name:<28} {k.get('recall1', 0):>9.2f} {k.get('recall10', 0):>5.2f} {k.get('recall50', 0):>5.2f} "
              f"{k.get('mrr', 0):>6.3f} | {a['recall1']:>7.2f} {a['mrr']:>6.3f} | {q['recall1']:>12.2f} "
              f"{q['mrr']:>6.3f} | {r['latency_s']:>8.3f}")
    for name, r in extra.get("variants", {}).items():
        k, a = r["known"], r["all"]
        print(f"{name:<28} {k.get('recall1', 0):>9.2f} {k.get('recall10', 0):>5.2f} {k.get('recall50', 0):>5.2f} "
              f"{k.get('mrr', 0):>6.3f} | {a['recall1']:>7.2f} {a['mrr']:>6.3f} |")
    summary = {"default_method": default, "mrr": head.get("mrr"), "recall1": head.get("recall1"),
               "recall10": head.get("recall10"), "bm25_mrr": rows["bm25"]["known"].get("mrr"),
               "bm25_recall1": rows["bm25"]["known"].get("recall1"), "bm25_recall1_all": rows["bm25"]["all"]["recall1"],
               "mrr_question": rows[default]["question"]["mrr"], "known": int(known.sum()),
               "known_question": int(known_q.sum()), "queries": len(facts), "train_s": train_s, "steps": steps,
               "methods": rows, **extra, "quick": args.quick,
               "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}"}
    print(json.dumps(summary))
    return 0


def logging_quiet() -> None:
    import logging
    import os
    import warnings

    os.environ.setdefault("WANDB_MODE", "offline")
    logging.basicConfig(level=logging.ERROR)
    for name in ("olmo", "olmo_tda", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


if __name__ == "__main__":
    sys.exit(main())
