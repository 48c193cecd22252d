"""Which layers capture hooks: canonical names, selection by ``capture.modules`` / ``exclude``, the
shape of each layer's gradient, and :class:`CaptureError`, the error for every misuse of capture.

Example::

    from torch import nn
    from olmo_tda.capture.layers import canonical_name, layer_dims, select_linears
    from olmo_tda.config import CaptureConfig

    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    layers = select_linears(model, CaptureConfig(exclude=["2"]))          # {'0': Linear(8, 16)}
    print({n: layer_dims(m) for n, m in layers.items()})                # {'0': (16, 8)}
    print(canonical_name("module.blocks.0._fsdp_wrapped_module.ff_out"))  # blocks.0.ff_out
"""

from __future__ import annotations

import fnmatch
import re
from typing import Sequence

from torch import nn

from ..config import CaptureConfig
from ..errors import TDAError

__all__ = ["CaptureError", "canonical_name", "select_linears", "layer_dims"]

# Wrapper segments that DDP / FSDP / activation checkpointing / torch.compile insert into module
# names. Projector seeds derive from names, so a layer must have the same name however it is wrapped.
_WRAPPER_SEGMENTS = re.compile(r"(^|\.)(module|_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)(?=\.|$)")


def canonical_name(name: str) -> str:
    """Module name with wrapper segments removed: ``module.blocks.0._fsdp_wrapped_module.ff_out``
    → ``blocks.0.ff_out``."""
    return _WRAPPER_SEGMENTS.sub("", name).lstrip(".")


class CaptureError(TDAError, RuntimeError):
    """Capture was used in a way that cannot give correct gradients; the message says how to fix it."""


def select_linears(model: nn.Module, config: CaptureConfig) -> dict[str, nn.Linear | nn.Embedding]:
    """The layers ``config`` selects (``modules`` minus ``exclude``), by canonical name: every
    ``nn.Linear``, and every ``nn.Embedding`` with ``config.embeddings``. What :class:`GradientCapture`
    hooks and :mod:`.eigenbasis` estimates covariances for (Linear only: eigen refuses embeddings)."""
    kinds = (nn.Linear, nn.Embedding) if config.embeddings else (nn.Linear,)
    what = "nn.Linear or nn.Embedding" if config.embeddings else "nn.Linear"
    layers: dict[str, nn.Module] = {}
    raw_names: dict[str, str] = {}
    for raw, module in model.named_modules():
        if not isinstance(module, kinds):
            continue
        name = canonical_name(raw)
        if name in layers and layers[name] is not module:
            raise CaptureError(f"layers {raw_names[name]!r} and {raw!r} have the same canonical name "
                               f"{name!r} once wrapper segments are removed; projector seeds derive from "
                               "names, so rename one of the modules")
        layers[name], raw_names[name] = module, raw
    chosen = {n: m for n, m in layers.items() if matches(n, config.modules) and not matches(n, config.exclude)}
    if not chosen:
        raise CaptureError(
            f"capture.modules={config.modules} exclude={config.exclude} selects no {what}; "
            f"the model's {what} layers are: {sorted(layers)[:20]}{' ...' if len(layers) > 20 else ''}")
    for name, m in chosen.items():
        if isinstance(m, nn.Embedding) and m.scale_grad_by_freq:
            raise CaptureError(f"embedding {name} has scale_grad_by_freq=True: its gradient is scaled by token "
                               "counts of the whole batch, so an example's gradient depends on the others; "
                               "exclude it from capture")
    return chosen


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether ``name`` matches one of the glob ``patterns`` (``capture.modules`` / ``exclude``)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def layer_dims(module: nn.Module) -> tuple[int, int]:
    """``(n_out, n_in)`` of a captured layer's gradient, bias column not counted: a Linear's
    ``(out_features, in_features)``; an embedding's ``(embedding_dim, num_embeddings)`` (the
    transposed table, as a Linear on one-hot inputs)."""
    if isinstance(module, nn.Embedding):
        return module.embedding_dim, module.num_embeddings
    return module.out_features, module.in_features
