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
"""

from __future__ import annotations

import argparse
import json
import platform
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

    def __init__(self, args, ks: list[int], root: Path):
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
        self.times = {name: [] for name in self.arms}
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
        if cap is not None:
            store.append(rec.to_record(step=self.step_no, lr=1e-4))
        self.examples[arm] += batch.shape[0]
        self.step_no += 1

    def block(self, arm: str, batches: list[torch.Tensor], measure: bool) -> None:
        """Run a block; record (wall, CPU) seconds per step, the store drained inside the timing."""
        cap, store = self.arms[arm]
        wall, cpu = timed_block(lambda batch: self.step(arm, batch), batches, cap, store, self.sync)
        if measure:
            self.times[arm].append(wall)
            self.cpu_times[arm].append(cpu)

    def close(self) -> dict[str, int]:
        sizes = {"plain": 0}
        for name, (cap, store) in self.arms.items():
            if store is not None:
                store.close()
                sizes[name] = GradientStore.open(store.path).nbytes
                cap.remove()
        return sizes


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
    args = p.parse_args(argv)
    if args.arch == "linear" and args.tied:
        p.error("--tied: the plain nn.Linear LM (--arch linear) has an untied head only")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch ({torch.__version__}) has no CUDA device")

    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(args, [int(k) for k in args.ks.split(",")], Path(tmp))
        names = list(trainer.arms)
        for round_ in range(args.rounds + 1):
            batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
                       for _ in range(args.block)]
            for arm in (names if round_ % 2 == 0 else names[::-1]):    # alternate who goes first
                trainer.block(arm, batches, measure=round_ >= 1)
        bytes_per_arm = trainer.close()
    rows = summarize(names, trainer.times, trainer.cpu_times, bytes_per_arm, trainer.examples)
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
              "torch": torch.__version__, "python": platform.python_version(),
              "gpu": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else None}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
