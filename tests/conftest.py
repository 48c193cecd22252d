"""Shared oracles and tiny models for the tests.

Ground truth is always computed independently of the code under test: per-example gradients from
``torch.func.vmap(grad(...))`` over ``functional_call``; capture is compared against it.
"""

from __future__ import annotations

import os
from pathlib import Path
import warnings

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# functorch warns that SDPA has no batching rule (a slow fallback); irrelevant at test sizes.
warnings.filterwarnings("ignore", message=".*batching rule.*")


def tiny_olmo(**overrides):
    """A tiny ``olmo.model.OLMo`` (d_model 64, 2 layers), dropout off so gradients are deterministic."""
    from olmo.config import ModelConfig
    from olmo.model import OLMo

    cfg = dict(d_model=64, n_heads=4, n_layers=2, mlp_ratio=4, vocab_size=96, embedding_size=96,
               max_sequence_length=32, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
               init_device="cpu", weight_tying=False, include_bias=False)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = OLMo(ModelConfig(**cfg))
    model.reset_parameters()
    return model


def token_losses(logits, input_ids, label_mask=None):
    """Per-example summed next-token CE ``[B]`` (masked labels contribute nothing)."""
    labels = input_ids[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
                                           reduction="none").view(labels.shape)
    if label_mask is not None:
        ce = ce * label_mask[:, 1:].to(ce.dtype)
    return ce.sum(dim=1)


def exact_per_example_grads(model, input_ids, label_mask=None, autocast_dtype=None):
    """``{param_name: [B, *param.shape]}``: gradient of each example's summed token loss (torch.func)."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, ids, mask):
        ctx = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
               else torch.autocast("cpu", enabled=False))
        with ctx:
            logits = functional_call(model, p, (ids[None],)).logits
        return token_losses(logits, ids[None], None if mask is None else mask[None])[0]

    mask = label_mask if label_mask is not None else torch.ones_like(input_ids)
    return vmap(grad(loss_one), in_dims=(None, 0, 0))(params, input_ids, mask)


def linear_grad(exact: dict, name: str, with_bias: bool) -> torch.Tensor:
    """Exact per-example gradient of Linear ``name`` as ``[B, O, I(+1)]`` (bias as the last column)."""
    w = exact[f"{name}.weight"]
    if not with_bias:
        return w
    return torch.cat([w, exact[f"{name}.bias"].unsqueeze(-1)], dim=-1)


def free_port() -> int:
    """A local TCP port free at the time of asking (for a process group's MASTER_PORT / rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DS_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deepspeed_pretrain.py"
"""The DeepSpeed example trainer (a user's script, outside the package)."""


def deepspeed_example():
    """``examples/deepspeed_pretrain.py`` imported as the module ``deepspeed_pretrain``, as the
    script's own folder on ``sys.path`` makes it importable when it runs."""
    import importlib
    import sys

    folder = str(DS_EXAMPLE.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("deepspeed_pretrain")


def outside_slurm_env() -> dict:
    """This process's environment without Slurm's job variables: a test that itself runs inside a
    (requeued) Slurm job gives the runs it starts only the job it names."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def olmo_factory():
    return tiny_olmo


def pytest_collection_modifyitems(config, items):
    """GPU-only checks run where CUDA exists and are skipped (not failed) elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def restore_environ():
    """Every test gets the environment back as it found it. Tests that start a one-process group in
    the pytest process (``init_distributed`` sets RANK/MASTER_PORT/... in ``os.environ``) would
    otherwise hand their port to every later subprocess run — a port this process may still hold."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
