"""Training-step overhead of capture + store, as ratios measured in one run (this machine is noisy).

A small OLMo on CPU (d_model 512, 4 layers, seq 256, batch 8 by default): a plain AdamW step vs the
same step with GradientCapture on every nn.Linear and the async HDF5 store writing each step's
per-example gradients, at k=16 and k=64. Arms run in interleaved rounds (each round: a block of
``--block`` steps per arm, arm order alternating between rounds). A capture arm's block ends with
``store.flush()`` inside the timed region, so all of its writer thread's work (encoding, HDF5, fsync)
is charged to it and never spills into another arm's timing; this is conservative (a shard every
block instead of every ``--flush-every`` steps). The per-step time of each block is one sample; an
arm's median over rounds is compared with the plain arm's.

    python benchmarks/capture_overhead.py                # table, then one JSON line
    python benchmarks/capture_overhead.py --rounds 3     # quicker
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from olmo_tda import CaptureConfig, GradientCapture
from olmo_tda.config import StoreConfig, StoreDType
from olmo_tda.store import GradientStore


def build_model(args):
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


class Arm:
    """One configuration: its own model copy and optimizer, so arms never share state."""

    def __init__(self, name: str, args, proj_dim: int | None, root: Path):
        self.name = name
        self.model = build_model(args)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.capture = self.store = None
        if proj_dim is not None:
            self.capture = GradientCapture(self.model, CaptureConfig(proj_dim=proj_dim))
            self.store = GradientStore.create(root / name, self.capture.store_metadata(),
                                              StoreConfig(dtype=StoreDType(args.dtype), flush_every=args.flush_every))
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.next_id = 0

    def step(self, batch: torch.Tensor, step: int) -> None:
        logits = self.model(batch).logits
        loss_scale = batch.numel()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(),
                                                 reduction="sum") / loss_scale
        if self.capture is None:
            loss.backward()
        else:
            ids = torch.arange(self.next_id, self.next_id + batch.shape[0])
            with self.capture.record(ids, loss_scale=loss_scale) as rec:
                loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        if self.capture is not None:
            self.store.append(rec.to_record(step=step, lr=1e-4))
        self.next_id += batch.shape[0]

    def block(self, batches: list[torch.Tensor], first_step: int) -> tuple[float, float]:
        """(wall, CPU) seconds per step over a block, the store drained to disk inside the timing.
        CPU time sums every thread of the process (training threads and the store's writer)."""
        t0, c0 = time.perf_counter(), time.process_time()
        for i, batch in enumerate(batches):
            self.step(batch, first_step + i)
        if self.store is not None:
            self.store.flush()
        return (time.perf_counter() - t0) / len(batches), (time.process_time() - c0) / len(batches)

    def close(self) -> int:
        if self.store is None:
            return 0
        self.store.close()
        return GradientStore.open(self.store.path).nbytes


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = p.parse_args(argv)

    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as tmp:
        arms = [Arm("plain", args, None, Path(tmp))]
        arms += [Arm(f"k{k}", args, int(k), Path(tmp)) for k in args.ks.split(",")]
        for round_ in range(args.rounds + 1):
            batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen) for _ in range(args.block)]
            order = arms if round_ % 2 == 0 else arms[::-1]      # alternate who goes first
            for arm in order:
                wall, cpu = arm.block(batches, round_ * args.block)
                if round_ >= 1:
                    arm.times.append(wall)
                    arm.cpu_times.append(cpu)
        bytes_per_arm = {arm.name: arm.close() for arm in arms}
    plain = statistics.median(arms[0].times)
    plain_cpu = statistics.median(arms[0].cpu_times)
    rows = []
    for arm in arms:
        med, med_cpu = statistics.median(arm.times), statistics.median(arm.cpu_times)
        rows.append({"arm": arm.name, "median_s": med, "ratio": med / plain, "cpu_s": med_cpu,
                     "cpu_ratio": med_cpu / plain_cpu,
                     "bytes_per_example": bytes_per_arm[arm.name] / max(1, arm.next_id)})
    print(f"capture overhead: OLMo d_model={args.d_model} layers={args.n_layers} seq={args.seq} batch={args.batch} "
          f"vocab={args.vocab} tied={args.tied} threads={torch.get_num_threads()} store={args.dtype} "
          f"rounds={args.rounds}x{args.block} steps")
    print(f"{'arm':>6} {'wall s/step':>12} {'wall ratio':>10} {'CPU s/step':>11} {'CPU ratio':>10} {'bytes/example':>14}")
    for r in rows:
        print(f"{r['arm']:>6} {r['median_s']:>12.3f} {r['ratio']:>10.3f} {r['cpu_s']:>11.3f} {r['cpu_ratio']:>10.3f} "
              f"{r['bytes_per_example']:>14.0f}")
    result = {"benchmark": "capture_overhead", "d_model": args.d_model, "n_layers": args.n_layers,
              "seq": args.seq, "batch": args.batch, "vocab": args.vocab, "tied": args.tied,
              "rounds": args.rounds, "block": args.block, "plain_s": plain, "store_dtype": args.dtype,
              **{f"ratio_{r['arm']}": round(r["ratio"], 4) for r in rows[1:]},
              **{f"cpu_ratio_{r['arm']}": round(r["cpu_ratio"], 4) for r in rows[1:]},
              "torch": torch.__version__, "python": platform.python_version()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
