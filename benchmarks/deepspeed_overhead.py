"""Step-time overhead of tda capture through a DeepSpeed ZeRO engine, as ratios from one run.

The real integration: an OLMo model wrapped Megatron-style (``CausalLM``: batch in, token-mean loss
out) under ``deepspeed.initialize`` (ZeRO stage ``--stage``, default 2; one gloo rank on CPU;
gradient accumulation ``--gas``), the ordinary ``engine(batch)`` / ``engine.backward`` /
``engine.step`` loop, and ``olmo_tda.integrations.deepspeed.attach`` doing the capture and handing
every optimizer step to the async HDF5 store.

ONE engine for both arms (separate engines would add model-copy noise); an arm is whether tda acts:
  plain : capture paused and the engine's own (class) ``backward``/``step`` called, bypassing the
          tda wrappers — the hooks of a paused capture return at once (a few µs per layer);
  k<K>  : the attached session: capture resumed, wrapped ``backward``/``step``, store appends.
Arms run in interleaved rounds on the same batches, arm order alternating; a capture arm's block
ends with ``store.flush()`` inside the timing, so its writer thread's work is charged to it.
Medians of wall-clock and CPU time (all threads) per optimizer step.

    python benchmarks/deepspeed_overhead.py                # table, then one JSON line
    python benchmarks/deepspeed_overhead.py --stage 3 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from _timing import print_table, summarize, timed_block

from olmo_tda.config import StoreDType, TDAConfig


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4, help="train_micro_batch_size_per_gpu")
    p.add_argument("--gas", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--bf16", action="store_true", help="DeepSpeed bf16 (slow on most CPUs)")
    p.add_argument("--k", type=int, default=64, help="proj_dim of the capture arm")
    p.add_argument("--rounds", type=int, default=6, help="measured rounds (after one warm-up round)")
    p.add_argument("--block", type=int, default=3, help="optimizer steps per arm per round")
    p.add_argument("--dtype", default="float32", choices=[d.value for d in StoreDType])
    p.add_argument("--flush-every", type=int, default=64)
    args = p.parse_args(argv)

    import deepspeed
    import torch.distributed as dist
    from olmo.config import ModelConfig

    from olmo_tda.integrations.deepspeed import attach
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from deepspeed_pretrain import CausalLM       # the example trainer's model wrapper

    for var, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29400 + os.getpid() % 500)),
                       ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(var, value)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    deepspeed.init_distributed(dist_backend="gloo")
    arm = f"k{args.k}"
    names = ["plain", arm]
    times, cpu_times = {n: [] for n in names}, {n: [] for n in names}
    examples = dict.fromkeys(names, 0)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            torch.manual_seed(0)
            model = CausalLM(ModelConfig(
                d_model=args.d_model, n_heads=max(1, args.d_model // 64), n_layers=args.n_layers, mlp_ratio=8,
                vocab_size=args.vocab, embedding_size=args.vocab, eos_token_id=0, pad_token_id=0,
                max_sequence_length=args.seq, rope=True, weight_tying=False, attention_dropout=0.0,
                residual_dropout=0.0, embedding_dropout=0.0, include_bias=False, init_device="cpu", init_fn="normal"))
            ds_config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
                         "gradient_clipping": 1.0, "zero_optimization": {"stage": args.stage},
                         "bf16": {"enabled": args.bf16}, "steps_per_print": 10**9,
                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": True}}}
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
            tda = TDAConfig.from_dict({"enabled": True, "capture": {"proj_dim": args.k},
                                       "store": {"path": str(Path(tmp) / "store"), "dtype": args.dtype,
                                                 "flush_every": args.flush_every}})
            session = attach(engine, tda)
            session.capture.pause()
            gen = np.random.default_rng(0)
            engine_cls = type(engine)

            def make_step(plain: bool):
                backward = (lambda loss: engine_cls.backward(engine, loss)) if plain else engine.backward
                step = (lambda: engine_cls.step(engine)) if plain else engine.step

                def one_step(micro_batches):
                    for batch in micro_batches:
                        loss = engine(batch)
                        backward(loss)
                        step()
                return one_step

            steps = {"plain": make_step(True), arm: make_step(False)}
            next_id = 0
            for round_ in range(args.rounds + 1):
                blocks = []
                for _ in range(args.block):      # the same batches for both arms
                    micro_batches = []
                    for _ in range(args.gas):
                        ids = torch.arange(next_id, next_id + args.micro)
                        next_id += args.micro
                        tokens = torch.from_numpy(gen.integers(0, args.vocab, (args.micro, args.seq)))
                        labels = torch.full_like(tokens, -100)
                        labels[:, :-1] = tokens[:, 1:]
                        micro_batches.append({"input_ids": tokens, "labels": labels, "index": ids})
                    blocks.append(micro_batches)
                for name in (names if round_ % 2 == 0 else names[::-1]):
                    capture = session.capture if name != "plain" else None
                    store = session.store if name != "plain" else None
                    wall, cpu = timed_block(steps[name], blocks, capture, store)
                    if round_ >= 1:
                        times[name].append(wall)
                        cpu_times[name].append(cpu)
                        examples[name] += args.block * args.gas * args.micro
            session.close()
            from olmo_tda.store import GradientStore

            stored = GradientStore.open(Path(tmp) / "store")
            bytes_per_arm = {"plain": 0, arm: stored.nbytes * examples[arm] / max(1, stored.num_rows)}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    rows = summarize(names, times, cpu_times, bytes_per_arm, examples)
    print(f"DeepSpeed ZeRO-{args.stage} overhead: d_model={args.d_model} layers={args.n_layers} seq={args.seq} "
          f"micro={args.micro} gas={args.gas} vocab={args.vocab} bf16={args.bf16} k={args.k} "
          f"threads={torch.get_num_threads()} store={args.dtype} rounds={args.rounds}x{args.block} steps")
    print_table(rows)
    result = {"benchmark": "deepspeed_overhead", "zero_stage": args.stage, "d_model": args.d_model,
              "n_layers": args.n_layers, "seq": args.seq, "micro": args.micro, "gas": args.gas, "vocab": args.vocab,
              "bf16": args.bf16, "k": args.k, "rounds": args.rounds, "block": args.block, "store_dtype": args.dtype,
              "plain_s": rows[0]["median_s"], "plain_cpu_s": rows[0]["cpu_s"],
              f"ratio_{arm}": round(rows[1]["ratio"], 4), f"cpu_ratio_{arm}": round(rows[1]["cpu_ratio"], 4),
              f"bytes_per_example_{arm}": round(rows[1]["bytes_per_example"]),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
              "python": platform.python_version()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
