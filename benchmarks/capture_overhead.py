"""Training-step overhead of capture + store, as ratios measured in one run (this machine is noisy).

A small OLMo on CPU (d_model 512, 4 layers, seq 256, batch 8 by default) trained with AdamW. Arms:
the plain step, and the same step with GradientCapture on every nn.Linear plus the async HDF5 store
writing each step's per-example gradients, at k=16 and k=64. All arms share ONE model and optimizer
(so memory layout and cache behaviour are identical); an arm is which capture is active — the
inactive captures are paused (their hooks return at once: a few microseconds per layer).

Arms run in interleaved rounds: each round a block of ``--block`` steps per arm, arm order
alternating between rounds. A capture arm's block ends with ``store.flush()`` inside the timed
region, so all of its writer thread's work (encoding, HDF5, fsync) is charged to it and never spills
into another arm's timing (conservative: a shard every block). Each block gives one wall-clock and
one CPU-time (all threads of the process) sample per step; an arm's median is compared with the
plain arm's.

    python benchmarks/capture_overhead.py                # table, then one JSON line
    python benchmarks/capture_overhead.py --rounds 3     # quicker
    python benchmarks/capture_overhead.py --arch linear --device cuda --autocast bf16 \
        --d-model 1024 --n-layers 8 --seq 1024 --batch 16 --vocab 32000   # on a GPU, no ai2-olmo

``--arch linear`` is the peers benchmark's causal LM of plain ``nn.Linear`` layers (the same d_model,
layers and vocabulary, an untied head; a GELU MLP of width 8·d_model: 16·d² weights a block against
OLMo SwiGLU's 12·d²): it needs no ai2-olmo, so it runs on a GPU machine that lacks it. On
``--device cuda`` every block is timed from and to a synchronized device.

``--breakdown`` splits a capture arm's overhead: it adds, per k, an arm ``k<k>-cap`` that captures
and assembles each step's per-example gradients on the device but stores nothing, and prints what
part of each storing arm's step is the final drain of its store (``of it flush s``: encoding, HDF5
and fsync of the block's window that the writer thread had not finished while the steps ran).
``k<k>-cap`` − plain is the capture's own compute; ``k<k>`` − ``k<k>-cap`` is the store's (its
device-to-host copy, the writer thread's share of the CPU, and the drain).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from _timing import print_table, summarize, timed_block

from olmo_tda import CaptureConfig, GradientCapture
from olmo_tda.config import StoreConfig, StoreDType
from olmo_tda.store import GradientStore


def build_model(args):
    if args.arch == "linear":
        sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
        from workload import TinyLM, Workload

        torch.manual_seed(0)
        return TinyLM(Workload(vocab=args.vocab, d_model=args.d_model, n_heads=args.d_model // 64,
                               n_layers=args.n_layers, mlp_ratio=8, seq_len=args.seq))
    from olmo.config import ModelConfig
    from olmo.model import OLMo

    torch.manual_seed(0)
    model = OLMo(ModelConfig(d_model=args.d_model, n_heads=args.d_model // 64, n_layers=args.n_layers,
                             mlp_ratio=8, vocab_size=args.vocab, embedding_size=args.vocab,
                             max_sequence_length=args.seq, rope=True, attention_dropout=0.0,
                             residual_dropout=0.0, embedding_dropout=0.0, weight_tying=args.tied,
                             include_bias=False, init_device="cpu"))
    model.reset_parameters()
    return model


class Trainer:
    """One model and optimizer; each arm is a (capture, store) pair, or none for the plain step."""

    def __init__(self, args, ks: list[int], root: Path, breakdown: bool = False):
        self.model = build_model(args).to(args.device)
        self.autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16,
                                       enabled=args.autocast == "bf16")
        self.sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else None
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.arms: dict[str, tuple[GradientCapture | None, object]] = {"plain": (None, None)}
        for k in ks:
            cap = GradientCapture(self.model, CaptureConfig(proj_dim=k))
            cap.pause()
            store = GradientStore.create(root / f"k{k}", cap.store_metadata(),
                                         StoreConfig(dtype=StoreDType(args.dtype), flush_every=args.flush_every))
            self.arms[f"k{k}"] = (cap, store)
            if breakdown:
                cap_only = GradientCapture(self.model, CaptureConfig(proj_dim=k))
                cap_only.pause()
                self.arms[f"k{k}-cap"] = (cap_only, None)
        self.times = {name: [] for name in self.arms}
        self.flush_times = {name: [] for name, (_, store) in self.arms.items() if store is not None}
        self.cpu_times = {name: [] for name in self.arms}
        self.examples = {name: 0 for name in self.arms}
        self.step_no = 0

    def step(self, arm: str, batch: torch.Tensor) -> None:
        cap, store = self.arms[arm]
        with self.autocast:
            out = self.model(batch)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss_scale = batch.numel()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(),
                                                 reduction="sum").float() / loss_scale
        if cap is None:
            loss.backward()
        else:
            ids = torch.arange(self.examples[arm], self.examples[arm] + batch.shape[0])
            with cap.record(ids, loss_scale=loss_scale) as rec:
                loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        if store is not None:
            store.append(rec.to_record(step=self.step_no, lr=1e-4))
        elif cap is not None:
            rec.stored()          # assembled on the device, as for the store, then dropped
        self.examples[arm] += batch.shape[0]
        self.step_no += 1

    def block(self, arm: str, batches: list[torch.Tensor], measure: bool) -> None:
        """Run a block; record (wall, CPU) seconds per step, the store drained inside the timing."""
        cap, store = self.arms[arm]
        phases = {}
        wall, cpu = timed_block(lambda batch: self.step(arm, batch), batches, cap, store, self.sync, phases)
        if measure:
            self.times[arm].append(wall)
            self.cpu_times[arm].append(cpu)
            if store is not None:
                self.flush_times[arm].append(phases["flush"])

    def close(self) -> dict[str, int]:
        sizes = {}
        for name, (cap, store) in self.arms.items():
            sizes[name] = 0
            if store is not None:
                store.close()
                sizes[name] = GradientStore.open(store.path).nbytes
            if cap is not None:
                cap.remove()
        return sizes


def profile_block(trainer: Trainer, arm: str, batches: list[torch.Tensor], device: str) -> None:
    """One block of ``arm`` under torch.profiler: its operators, by self device (or CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        trainer.block(arm, batches, measure=False)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"profile of one block of {arm} ({len(batches)} steps), by {key}:")
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=["olmo", "linear"], default="olmo",
                   help="ai2-olmo's OLMo, or the peers benchmark's plain nn.Linear LM (no ai2-olmo needed)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--autocast", choices=["none", "bf16"], default="none", help="bf16 autocast forward")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tied", action="store_true", help="tie the output head (then it is not an nn.Linear)")
    p.add_argument("--rounds", type=int, default=6, help="measured rounds (after one warm-up round)")
    p.add_argument("--block", type=int, default=3, help="steps per arm per round")
    p.add_argument("--dtype", default="float32", choices=[d.value for d in StoreDType])
    p.add_argument("--flush-every", type=int, default=64)
    p.add_argument("--ks", default="16,64")
    p.add_argument("--breakdown", action="store_true",
                   help="add a capture-only arm per k and show each store's drain (see above)")
    p.add_argument("--profile", metavar="ARMS",
                   help="after the timing, run one block of each of these arms (comma-separated, e.g. "
                        "plain,k16-cap) under torch.profiler and print its operators by self device time "
                        "(self CPU time on cpu)")
    args = p.parse_args(argv)
    if args.arch == "linear" and args.tied:
        p.error("--tied: the plain nn.Linear LM (--arch linear) has an untied head only")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch ({torch.__version__}) has no CUDA device")

    ks = [int(k) for k in args.ks.split(",")]
    unknown = [arm for arm in (args.profile or "").split(",") if arm and arm != "plain"
               and arm not in {f"k{k}" for k in ks} | ({f"k{k}-cap" for k in ks} if args.breakdown else set())]
    if unknown:
        p.error(f"--profile: no arm {', '.join(unknown)} (arms: plain, k<k> for --ks, k<k>-cap with --breakdown)")
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(args, ks, Path(tmp), args.breakdown)
        names = list(trainer.arms)
        for round_ in range(args.rounds + 1):
            batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
                       for _ in range(args.block)]
            for arm in (names if round_ % 2 == 0 else names[::-1]):    # alternate who goes first
                trainer.block(arm, batches, measure=round_ >= 1)
        for arm in args.profile.split(",") if args.profile else []:
            profile_block(trainer, arm, batches, args.device)
        bytes_per_arm = trainer.close()
    rows = summarize(names, trainer.times, trainer.cpu_times, bytes_per_arm, trainer.examples)
    for row in rows:
        if args.breakdown and row["arm"] in trainer.flush_times:
            row["flush_s"] = statistics.median(trainer.flush_times[row["arm"]])
    plain = rows[0]["median_s"]
    print(f"capture overhead: {'OLMo' if args.arch == 'olmo' else 'plain nn.Linear LM'} on {args.device} "
          f"(autocast {args.autocast}) d_model={args.d_model} layers={args.n_layers} seq={args.seq} batch={args.batch} "
          f"vocab={args.vocab} tied={args.tied} threads={torch.get_num_threads()} store={args.dtype} "
          f"rounds={args.rounds}x{args.block} steps")
    print_table(rows)
    result = {"benchmark": "capture_overhead", "arch": args.arch, "device": args.device,
              "autocast": args.autocast, "d_model": args.d_model, "n_layers": args.n_layers,
              "seq": args.seq, "batch": args.batch, "vocab": args.vocab, "tied": args.tied,
              "rounds": args.rounds, "block": args.block, "plain_s": plain, "store_dtype": args.dtype,
              **{f"ratio_{r['arm']}": round(r["ratio"], 4) for r in rows[1:]},
              **{f"cpu_ratio_{r['arm']}": round(r["cpu_ratio"], 4) for r in rows[1:]},
              **{f"flush_s_{r['arm']}": round(r["flush_s"], 5) for r in rows if "flush_s" in r},
              "torch": torch.__version__, "python": platform.python_version(),
              "gpu": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else None}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
