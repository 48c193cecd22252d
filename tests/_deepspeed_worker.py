"""Worker for tests/test_deepspeed.py, run under ``torchrun --nproc_per_node 2`` (gloo, CPU).

Trains a tiny OLMo language model through ``deepspeed.initialize`` for each requested case
(ZeRO stage, gradient accumulation, dtype, zero.Init, where tda attaches) with unprojected capture,
and saves what the test needs as an independent oracle: the full fp32 weights before every step
(gathered from ZeRO-3 partitions). The data order, the loss and the lr schedule are plain functions
of the step, shared with the test through this module.

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 _deepspeed_worker.py OUT CASE...
where CASE is ``stage=2,gas=2,dtype=bf16,init=1,attach=before,nan_step=2,steps=3,save_at=0,kill_after=0,resume=0``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

NUM_EXAMPLES, SEQ, VOCAB, MICRO = 64, 12, 96, 2
BASE_LR = 1e-3
DEVICE = os.environ.get("DS_WORKER_DEVICE", "cpu")   # "cuda": the GPU check (nccl, fp16 possible)


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [N, T], labels [N, T])``: labels are next tokens, with the last position and a
    random ~20% of positions ignored (-100) so micro-batches count different numbers of tokens."""
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (NUM_EXAMPLES, SEQ), generator=gen)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[torch.rand(ids.shape, generator=gen) < 0.2] = -100
    return ids, labels


def ids_for(step: int, rank: int, micro: int, gas: int, world: int = 2) -> np.ndarray:
    """Global example ids of (1-based) ``step``, ``rank``, micro-batch ``micro``."""
    rng = np.random.default_rng(7)
    order = np.concatenate([rng.permutation(NUM_EXAMPLES) for _ in range(4)])   # 4 epochs
    per_step = world * gas * MICRO
    start = (step - 1) * per_step + (rank * gas + micro) * MICRO
    return order[start:start + MICRO]


def lr_at(step: int, skipped: int = 0) -> float:
    """The lr optimizer step ``step`` (1-based) uses: LambdaLR(1/(s+1)) stepped once per applied
    step before it (DeepSpeed does not step the scheduler on a skipped step; ``skipped`` of them)."""
    return BASE_LR / (step - skipped)


def olmo_config(**overrides):
    from olmo.config import ModelConfig

    cfg = dict(d_model=32, n_heads=4, n_layers=2, mlp_ratio=4, vocab_size=VOCAB, embedding_size=VOCAB,
               max_sequence_length=SEQ, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
               init_device="cpu", weight_tying=False, include_bias=False)
    cfg.update(overrides)
    return ModelConfig(**cfg)


class TokenMeanLM(nn.Module):
    """Megatron-style: the model takes the batch and returns the micro-batch's loss, reduced as
    ``reduction`` says (``token_mean``: CE averaged over counted labels, as Megatron and HF do)."""

    def __init__(self, reduction: str = "token_mean", tied: bool = False):
        super().__init__()
        from olmo.model import OLMo

        self.olmo = OLMo(olmo_config(weight_tying=tied))
        self.reduction = reduction

    def forward(self, batch: dict) -> torch.Tensor:
        logits = self.olmo(batch["input_ids"]).logits
        ce = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100,
                             reduction="sum" if self.reduction != "token_mean" else "mean")
        return ce / len(logits) if self.reduction == "example_mean" else ce


def parse_case(text: str) -> dict:
    case = dict(stage=2, gas=1, dtype="fp32", init=0, attach="after", nan_step=0, steps=2, save_at=0,
                kill_after=0, resume=0, proj=0, reduction="token_mean", backward="engine", traj=0, rank=0, emb=0)
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        case[key] = value if key in ("dtype", "attach", "reduction", "backward") else int(value)
    return case


def case_name(case: dict) -> str:
    return f"zero{case['stage']}-gas{case['gas']}-{case['dtype']}" + ("-init" if case["init"] else "") + \
        (f"-{case['attach']}" if case["attach"] != "after" else "") + (f"-nan{case['nan_step']}" if case["nan_step"] else "") + \
        ("-resume" if case["save_at"] else "") + (f"-{case['reduction']}" if case["reduction"] != "token_mean" else "") + \
        (f"-{case['backward']}-backward" if case["backward"] != "engine" else "") + ("-traj" if case["traj"] else "") + \
        (f"-rank{case['rank']}" if case["rank"] else "") + ("-emb" if case["emb"] else "") + ("-tied" if case["emb"] == 2 else "")


def ds_config(case: dict, store: Path) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": case["gas"],
            "zero_optimization": {"stage": case["stage"]}, "bf16": {"enabled": case["dtype"] == "bf16"},
            "fp16": {"enabled": case["dtype"] == "fp16", "initial_scale_power": 8},
            # fp16 autocast (runs on CPU): the ZeRO optimizer's GradScaler (2^16) multiplies the loss
            **({"torch_autocast": {"enabled": True, "dtype": "torch.float16"}} if case["dtype"] == "autocast16" else {}),
            "steps_per_print": 10_000, "wall_clock_breakdown": False,
            # resumed runs log the tda/* numbers through DeepSpeed's own monitor (CSV files on rank 0)
            **({"csv_monitor": {"enabled": True, "output_path": str(store.parent / "monitor"), "job_name": "tda"}}
               if case["save_at"] else {}),
            "tda": {"enabled": True, "capture": {"proj_dim": case["proj"], "rank": case["rank"],
                                                 # the token table too; the learned position table is
                                                 # broadcast over the batch (no per-example gradient);
                                                 # emb=2: a head tied to the table (OLMo-1B's)
                                                 **({"embeddings": True, "exclude": ["*wpe"]} if case["emb"] else {})},
                    "store": {"path": str(store), "flush_every": 2}, "batch": {"reduction": case["reduction"]},
                    "trajectory": {"enabled": bool(case["traj"]), "every": max(1, case["traj"])}}}


def full_weights(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=engine.zero_optimization_stage() == 3):
        return {name: p.detach().float().cpu().clone() for name, p in params}


def run_case(case: dict, out: Path) -> None:
    import deepspeed
    import torch.distributed as dist
    from olmo_tda.integrations.deepspeed import attach
    from olmo_tda.capture import GradientCapture
    from olmo_tda.config import CaptureConfig

    rank = dist.get_rank()
    root = out / case_name(case)
    root.mkdir(parents=True, exist_ok=True)
    config = ds_config(case, root / "store")
    torch.manual_seed(0)
    with deepspeed.zero.Init(enabled=bool(case["init"]), config_dict_or_path=config):
        model = TokenMeanLM(case["reduction"], tied=bool(case["emb"] == 2))
    capture = GradientCapture(model, CaptureConfig(proj_dim=case["proj"])) if case["attach"] == "before" else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                      lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                                          opt, lambda s: 1.0 / (s + 1)))
    tda = attach(engine, capture=capture)
    first = 1
    if case["resume"]:
        path, client = engine.load_checkpoint(str(root / "ckpt"))
        assert path is not None and client.get("user") == "kept", client
        first = engine.global_steps + 1
    input_ids, labels = tokens()
    for step in range(first, case["steps"] + 1):
        weights = full_weights(engine)
        if rank == 0 and not case["resume"]:
            torch.save(weights, root / f"weights_step{step}.pt")
        for micro in range(case["gas"]):
            ids = ids_for(step, rank, micro, case["gas"], dist.get_world_size())
            batch = {"input_ids": input_ids[ids].to(DEVICE), "labels": labels[ids].to(DEVICE),
                     "index": torch.from_numpy(ids)}
            loss = engine(batch)
            if step == case["nan_step"] and rank == 0 and micro == 0:
                loss = loss * float("nan")
            if case["backward"] == "direct":
                loss.backward()                   # torch-style backward, supported by ZeRO 1-3
            elif case["backward"] == "scale":
                engine.scale(loss).backward()     # DeepSpeed's manual-backward form
            elif case["backward"] == "scale_outside":      # the loss computed outside the module: DeepSpeed's
                engine.scale(loss * 1.0).backward()        # 1/gas hook is then behind it, on the module output
            elif case["backward"] == "engine_outside":
                engine.backward(loss * 1.0)
            else:
                engine.backward(loss)
            engine.step()
        assert engine.global_steps == step
        if step == case["save_at"]:
            engine.save_checkpoint(str(root / "ckpt"), client_state={"user": "kept"})
        if step == case["kill_after"] - 1:
            tda.flush()          # rows past the checkpoint are durable: resume must truncate them
        if step == case["kill_after"]:
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)      # no close(): the unflushed window is lost
    tda.close()
    assert "step" not in engine.__dict__          # close() restored the engine's own methods
    if rank == 0:
        (root / "done").write_text(f"{tda.steps_committed} {tda.steps_dropped} {tda.rows_captured}\n")


def check_errors(out: Path) -> None:
    """Bad input on a real engine: each check's outcome (the error text, or what happened) -> JSON."""
    import json

    import deepspeed
    import torch.distributed as dist
    from olmo_tda.config import ConfigError
    from olmo_tda.integrations.deepspeed import attach, estimate_basis

    root = out / "errors"
    root.mkdir(parents=True, exist_ok=True)
    config = ds_config(parse_case(""), root / "store")
    del config["tda"]
    torch.manual_seed(0)
    model = TokenMeanLM()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=BASE_LR),
                                      config=config)
    input_ids, labels = tokens()
    ids = ids_for(1, dist.get_rank(), 0, 1)
    batch = {"input_ids": input_ids[ids], "labels": labels[ids], "index": torch.from_numpy(ids)}
    results = {}

    def outcome(name, fn):
        try:
            results[name] = f"ok: {fn()}"
        except ConfigError as e:
            results[name] = f"ConfigError: {e}"

    outcome("no_tda_entry", lambda: attach(engine))
    outcome("no_store_path", lambda: attach(engine, {"enabled": True}))
    good = {"enabled": True, "store": {"path": str(root / "store")}}

    def forward_with(section, batch):
        tda = attach(engine, {**good, **section})
        try:
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
            return tda.rows_captured
        finally:
            tda.close()

    outcome("missing_ids", lambda: forward_with({}, {k: v for k, v in batch.items() if k != "index"}))
    outcome("missing_labels", lambda: forward_with({"batch": {"labels_key": "targets"}}, batch))
    basis = root / "basis.safetensors"
    eigen = {**good, "capture": {"proj_type": "eigen", "proj_dim": 4, "basis": str(basis)},
             "store": {"path": str(root / "eigen_store")}}
    outcome("eigen_no_basis", lambda: attach(engine, eigen))
    outcome("estimate_random", lambda: estimate_basis(engine, [batch], None, good))

    def estimated():
        counted = lambda m, b: m(b) * (b["labels"] != -100).sum()      # noqa: E731  summed token CE
        path = estimate_basis(engine, [batch], counted, eigen)
        grads = sum(p.grad is not None for p in engine.module.parameters())
        rows = forward_with({k: eigen[k] for k in ("capture", "store")}, batch)
        return f"{path == basis and basis.is_file()} grads={grads} rows={rows}"

    outcome("estimate_basis", estimated)

    def explicit():
        tda = attach(engine, good)
        tda.set_batch(ids, divisor=float((labels[ids] != -100).sum()))
        loss = engine({k: v for k, v in batch.items() if k != "index"})
        engine.backward(loss)
        engine.step()
        tda.close()
        return tda.rows_captured

    outcome("set_batch", explicit)

    def disabled():
        def count():
            return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in engine.module.modules())

        before = count()
        tda = attach(engine, {"enabled": False})
        hooks = count() - before
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        tda.close()
        return f"hooks={hooks} wrapped={sorted(k for k in ('step', 'backward') if k in engine.__dict__)}"

    outcome("disabled", disabled)
    yaml_file = root / f"run{dist.get_rank()}.yaml"      # one file per rank: a shared one races (truncate vs read)
    yaml_file.write_text(f"tda:\n  enabled: true\n  capture: {{proj_dim: 8}}\n  store: {{path: {root / 'yaml_store'}}}\n")
    outcome("yaml", lambda: (lambda t: (t.capture.layer_shapes["olmo.transformer.ff_out"], t.close())[0])(attach(engine, yaml_file)))

    def projector_mismatch():
        tda = attach(engine, {**good, "capture": {"proj_dim": 0}, "store": {"path": str(root / "pm_store")}})
        engine.save_checkpoint(str(root / "ckpt"))
        tda.close()
        tda = attach(engine, {**good, "capture": {"proj_dim": 8}, "store": {"path": str(root / "other_store")}})
        try:
            engine.load_checkpoint(str(root / "ckpt"))
        finally:
            tda.close()

    outcome("projector_mismatch", projector_mismatch)

    def warm_start():          # weights only from that checkpoint: not a resume of its run (other projectors)
        tda = attach(engine, {**good, "capture": {"proj_dim": 8}, "store": {"path": str(root / "warm_store")}})
        try:
            engine.load_checkpoint(str(root / "ckpt"), load_module_only=True)
            return f"global_steps={engine.global_steps} rows={tda.store.held_rows()}"
        finally:
            tda.close()

    outcome("warm_start", warm_start)

    def attach_twice():
        first = attach(engine, {**good, "store": {"path": str(root / "twice_store")}})
        try:
            attach(engine, {**good, "store": {"path": str(root / "twice_store2")}})
        finally:
            first.close()

    outcome("attach_twice", attach_twice)

    def reserved_key():
        tda = attach(engine, {**good, "store": {"path": str(root / "key_store")}})
        try:
            engine.save_checkpoint(str(root / "ckpt_key"), client_state={"olmo_tda": "mine"})
        finally:
            tda.close()

    outcome("reserved_key", reserved_key)

    def abandoned():            # `latest` names a checkpoint that a later rollback abandoned
        tda = attach(engine, {**good, "store": {"path": str(root / "ab_store"), "flush_every": 1}})
        folder = str(root / "ckpt_ab")

        def steps(n):
            for _ in range(n):
                engine.backward(engine(batch))
                engine.step()

        try:
            steps(1)
            engine.save_checkpoint(folder, tag="early")
            steps(2)
            engine.save_checkpoint(folder, tag="late")
            engine.load_checkpoint(folder, tag="early")      # the rollback
            results["rollback_metrics"] = tda.metrics()      # this rank's counts start again at the resume
            steps(3)                                         # past the late one's step, no checkpoint: a crash
            tda.flush()
            engine.load_checkpoint(folder)                   # `latest`: the abandoned late one
            return "loaded"
        finally:
            tda.close()

    outcome("abandoned", abandoned)
    if dist.get_rank() == 0:
        (root / "results.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    import deepspeed

    from olmo_tda.store import manifest

    # a block sealed every 2 shards: every run here also writes, truncates (resumes) and reads the
    # store's sealed index segments, as a long run's ranks do after 256 shards each
    manifest.SEAL_SHARDS = 2
    out = Path(sys.argv[1])
    deepspeed.init_distributed(dist_backend="nccl" if DEVICE == "cuda" else "gloo")
    try:
        for text in sys.argv[2:]:
            if text == "errors":
                check_errors(out)
            else:
                run_case(parse_case(text), out)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
