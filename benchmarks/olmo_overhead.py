"""Step-time overhead of tda capture inside OLMo's own ``Trainer.train_step``, as ratios from one run.

``capture_overhead.py`` times a bare forward/backward/AdamW loop; this times the real integration:
``olmo_tda.integrations.olmo_train.build_trainer`` (OLMo's data loader, DDP wrapper — a one-rank gloo
group —, OLMo's optimizer with gradient clipping, its scheduler, its micro-batch loop) with
``TDATrainer`` doing the capture and handing each step to the async HDF5 store. CPU, fp32.

ONE trainer, ONE model and optimizer for all arms (separate model copies made the ratios noisy,
1.03-1.12x between identical runs); an arm is which capture is active:
  plain : every capture paused, and OLMo's base ``Trainer.train_step`` called directly, so no store
          append happens (a paused capture's hooks return at once: a few microseconds per layer);
  k<K>  : ``TDATrainer.train_step`` with that capture resumed and its store attached.
Arms run in interleaved rounds: each round, a block of ``--block`` steps per arm on the same batches,
arm order alternating between rounds. A capture arm's block ends with ``store.flush()`` inside the
timed region, so all of its writer thread's work (encoding, HDF5, fsync) is charged to it
(conservative: a shard every block). Medians of wall-clock and CPU time (all threads) per step.

Data: byte-tokenized passages of the shipped corpus (``olmo_tda.demo``) when it has enough of
``--seq`` bytes and the vocabulary covers bytes, else random token ids; OLMo memmap either way.

    python benchmarks/olmo_overhead.py                  # table, then one JSON line
    python benchmarks/olmo_overhead.py --ks 64 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from _timing import print_table, summarize, timed_block

from olmo_tda.config import StoreDType, TDAConfig

BYTE_VOCAB = 257     # UTF-8 bytes + end-of-text (olmo_tda.demo.corpus.ByteTokenizer)


def write_data(path: Path, num_instances: int, seq: int, vocab: int, seed: int) -> str:
    """OLMo memmap training data of ``num_instances`` x ``seq`` tokens; returns which kind was written."""
    from olmo_tda.demo.corpus import build_passages
    from olmo_tda.demo.data import write_memmap

    if vocab >= BYTE_VOCAB:
        try:
            write_memmap(build_passages(num_instances, seq, seed=seed), path, seq)
            return "corpus"
        except ValueError:       # the shipped corpus has too few passages of this length
            pass
    tokens = np.random.default_rng(seed).integers(0, vocab, size=num_instances * seq, dtype=np.uint16)
    path.parent.mkdir(parents=True, exist_ok=True)
    mm = np.memmap(path, dtype=np.uint16, mode="w+", shape=tokens.size)
    mm[:] = tokens
    mm.flush()
    del mm
    return "random"


def train_config(args, data_path: Path, save_folder: Path, steps: int):
    """OLMo's TrainConfig for the benchmark model (built here so the benchmark does not move with
    the demo's YAML)."""
    from olmo.config import TrainConfig

    special = min(BYTE_VOCAB - 1, args.vocab - 1)
    return TrainConfig.new(
        run_name="olmo-overhead", seed=6198, save_folder=str(save_folder), save_overwrite=True,
        precision="fp32", distributed_strategy="ddp",
        model=dict(d_model=args.d_model, n_heads=max(1, args.d_model // 64), n_layers=args.n_layers,
                   mlp_ratio=8, vocab_size=args.vocab, embedding_size=args.vocab, eos_token_id=special,
                   pad_token_id=special, max_sequence_length=args.seq, rope=True, weight_tying=args.tied,
                   attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0, include_bias=False,
                   init_device="cpu", init_fn="normal"),
        optimizer=dict(name="adamw", learning_rate=1e-4, weight_decay=0.1, betas=[0.9, 0.95]),
        scheduler=dict(name="constant"),
        data=dict(paths=[str(data_path)], memmap_dtype="uint16", pad_direction="right", num_workers=0,
                  drop_last=True, persistent_workers=False),
        tokenizer=dict(identifier="olmo_tda:bytes"),
        global_train_batch_size=args.batch, device_train_microbatch_size=args.microbatch,
        max_duration=steps, stop_at=steps,        # steps are driven by hand; never reached
        max_grad_norm=1.0, save_interval=None, save_interval_unsharded=None, no_pre_train_checkpoint=True,
        save_data_indices=False, wandb=None, console_log_interval=10**9)


def _attach(trainer, cap, store) -> None:
    """Point the trainer's capture and its capture+store part at one arm's pair."""
    part = trainer.capture_store
    trainer.capture = part.capture = cap
    part.store = store
    part.row_bytes = (4 if store.dtype.value == "float32" else 2) * cap.floats_per_example


class Arms:
    """The trainer plus one (capture, store) pair per k; the first pair is the trainer's own."""

    def __init__(self, trainer, ks: list[int], tda: TDAConfig, root: Path):
        from olmo_tda.capture import GradientCapture
        from olmo_tda.store import GradientStore

        self.trainer = trainer
        self.pairs = {f"k{ks[0]}": (trainer.capture, trainer.store)}
        for k in ks[1:]:
            cap = GradientCapture(trainer.dist_model, dataclasses.replace(tda.capture, proj_dim=k))
            store = GradientStore.create(root / f"k{k}", cap.store_metadata(), tda.store)
            self.pairs[f"k{k}"] = (cap, store)
        for cap, _ in self.pairs.values():
            cap.pause()
        self.names = ["plain", *self.pairs]
        self.times = {n: [] for n in self.names}
        self.cpu_times = {n: [] for n in self.names}
        self.examples = dict.fromkeys(self.names, 0)

    def step(self, arm: str, batch: dict) -> None:
        from olmo.train import Trainer

        t = self.trainer
        t.global_step += 1
        if arm == "plain":
            Trainer.train_step(t, batch)        # OLMo's step; the paused capture records nothing
        else:
            t.train_step(batch)                 # TDATrainer: capture, then append to the arm's store
        self.examples[arm] += len(batch["input_ids"])

    def block(self, arm: str, batches: list[dict], measure: bool) -> None:
        """Run a block; record (wall, CPU) seconds per step, the store drained inside the timing."""
        t = self.trainer
        cap, store = self.pairs.get(arm, (None, None))
        if cap is not None:
            _attach(t, cap, store)              # TDATrainer reads its capture and store each step
        wall, cpu = timed_block(lambda batch: self.step(arm, batch), batches, cap, store)
        if measure:
            self.times[arm].append(wall)
            self.cpu_times[arm].append(cpu)

    def close(self) -> dict[str, int]:
        """Close every store and capture (the trainer's own through ``trainer.close()``); bytes on disk per arm."""
        from olmo_tda.store import GradientStore

        first = next(iter(self.pairs))
        _attach(self.trainer, *self.pairs[first])
        sizes = {"plain": 0}
        for name, (cap, store) in self.pairs.items():
            if name != first:
                store.close()
                cap.remove()
        self.trainer.close()
        for name, (_, store) in self.pairs.items():
            sizes[name] = GradientStore.open(store.path).nbytes
        return sizes


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="global_train_batch_size (one rank)")
    p.add_argument("--microbatch", type=int, default=8, help="device_train_microbatch_size")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tied", action="store_true", help="tie the output head (then it is not an nn.Linear)")
    p.add_argument("--rounds", type=int, default=6, help="measured rounds (after one warm-up round)")
    p.add_argument("--block", type=int, default=3, help="steps per arm per round")
    p.add_argument("--ks", default="64", help="comma-separated proj_dim per capture arm, e.g. 16,64")
    p.add_argument("--dtype", default="float32", choices=[d.value for d in StoreDType])
    p.add_argument("--flush-every", type=int, default=64)
    args = p.parse_args(argv)
    if args.batch % args.microbatch:
        p.error("--batch must be a multiple of --microbatch")
    ks = [int(k) for k in args.ks.split(",")]

    import torch.distributed as dist

    from olmo_tda.integrations.olmo_train import build_trainer, init_distributed

    logging.disable(logging.WARNING)                # OLMo's per-step info logs would be timed
    warnings.filterwarnings("ignore")
    rounds = args.rounds + 1                        # + warm-up
    tda = TDAConfig.from_dict({"enabled": True, "capture": {"proj_dim": ks[0]},
                               "store": {"dtype": args.dtype, "flush_every": args.flush_every}})
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_kind = write_data(tmp / "data" / "train.npy", rounds * args.block * args.batch, args.seq, args.vocab, 0)
        cfg = train_config(args, tmp / "data" / "train.npy", tmp / "run", 10**9)
        device = init_distributed()
        try:
            arms = Arms(build_trainer(cfg, tda, device), ks, tda, tmp / "extra")
            try:
                loader = iter(arms.trainer.train_loader)
                for round_ in range(rounds):
                    batches = [next(loader) for _ in range(args.block)]   # the same batches for every arm
                    for arm in (arms.names if round_ % 2 == 0 else arms.names[::-1]):
                        arms.block(arm, batches, measure=round_ >= 1)
            finally:
                bytes_per_arm = arms.close()    # stops the writer threads even on error
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    rows = summarize(arms.names, arms.times, arms.cpu_times, bytes_per_arm, arms.examples)
    plain, plain_cpu = rows[0]["median_s"], rows[0]["cpu_s"]
    print(f"OLMo trainer overhead: d_model={args.d_model} layers={args.n_layers} seq={args.seq} batch={args.batch} "
          f"microbatch={args.microbatch} vocab={args.vocab} tied={args.tied} data={data_kind} "
          f"threads={torch.get_num_threads()} store={args.dtype} rounds={args.rounds}x{args.block} steps")
    print_table(rows)
    result = {"benchmark": "olmo_overhead", "d_model": args.d_model, "n_layers": args.n_layers, "seq": args.seq,
              "batch": args.batch, "microbatch": args.microbatch, "vocab": args.vocab, "tied": args.tied,
              "rounds": args.rounds, "block": args.block, "store_dtype": args.dtype, "data": data_kind,
              "plain_s": plain, "plain_cpu_s": plain_cpu,
              **{f"ratio_{r['arm']}": round(r["ratio"], 4) for r in rows[1:]},
              **{f"cpu_ratio_{r['arm']}": round(r["cpu_ratio"], 4) for r in rows[1:]},
              **{f"bytes_per_example_{r['arm']}": round(r["bytes_per_example"]) for r in rows[1:]},
              "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
