"""A tied output head: OLMo's ``weight_tying`` computes ``logits = F.linear(ln_f(x), wte.weight)``, so
the token table's gradient has a second share that no ``nn.Linear`` hook sees. With the table
captured (``capture.embeddings``), two forward hooks and one tensor hook add that share to the table's
rows, through the same accumulate step as the lookup's (:meth:`LayerHooks._add
<olmo_tda.capture.hot_path.LayerHooks._add>`).

The table's captured rows are the transposed table (d out, V in). The head's share of that gradient,
transposed, is ``Σ_t x_t ⊗ ∂L/∂logits_t``: the table's projectors apply with the roles swapped
(``P_out`` on x, ``P_in`` on the logits' gradient), and it adds to the lookup's share like a second
call of the layer.

  forward hook on ``ln_f``  : ``x_BTKo = P_out x``, kept until the model's forward returns
  forward hook on the model : a tensor hook on ``output.logits``
  tensor hook               : ``P_in (∂L/∂logits · s)`` (s undoes ``scale_logits``), added with x_BTKo

Example::

    cap = GradientCapture(olmo_model, CaptureConfig(embeddings=True))   # finds the head by itself
    [name for name, *_ in tied_heads(olmo_model)]                       # ['transformer.wte']
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn

from .hot_path import _fp32, _in_backward
from .layers import canonical_name

__all__ = ["TiedHeadHooks", "tied_heads"]


def tied_heads(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module, float]]:
    """``[(canonical table name, final norm, model, logit scale)]`` for every OLMo
    (``olmo.model.OLMo``: ``config.weight_tying``, ``transformer.wte`` and ``transformer.ln_f``) in
    ``model`` whose logits are ``F.linear(ln_f(x), wte.weight)``."""
    found = []
    for raw, m in model.named_modules():
        cfg, tr = getattr(m, "config", None), getattr(m, "transformer", None)
        if type(m).__name__ != "OLMo" or not getattr(cfg, "weight_tying", False) or tr is None:
            continue
        wte, ln_f = getattr(tr, "wte", None), getattr(tr, "ln_f", None)
        if isinstance(wte, nn.Embedding) and ln_f is not None:
            scale = 1 / math.sqrt(cfg.d_model) if getattr(cfg, "scale_logits", False) else 1.0
            found.append((canonical_name(f"{raw}.transformer.wte" if raw else "transformer.wte"), ln_f, m, scale))
    return found


class TiedHeadHooks:
    """The tied-head hooks of :class:`~olmo_tda.capture.hooks.GradientCapture`, which mixes them in
    beside :class:`~olmo_tda.capture.hot_path.LayerHooks` (whose ``_recording``, ``_add`` and
    ``_counted`` they use) and registers them for each ``(table name, ln_f, model, logit scale)`` of
    :func:`tied_heads` whose table is captured."""

    _tied_acts: dict[str, Any]      # table name -> (forward id, x_BTKo, s_in, moment_in) until the logits

    def _on_head_input(self, name: str, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._paused or not torch.is_grad_enabled() or not output.requires_grad or _in_backward():
            return
        proj = self.projectors[name].to(output.device)
        with _fp32(output.device.type):
            x = output.detach().reshape(output.shape[0], -1, output.shape[-1]).float()
            moment_in = None if self._moments is None else self._moments[name].measure_head_in(self._counted(x))
            scale = self._scales.get(name) if self._scales is not None else None
            if scale is not None:
                x = x * scale[0].to(x.device)
            self._tied_acts[name] = (self._forward_id, proj.project_out(x), None if scale is None else scale[1],
                                     moment_in)

    def _on_head_output(self, name: str, scale: float, module: nn.Module, args: tuple, output: Any) -> None:
        pending = self._tied_acts.pop(name, None)
        logits = getattr(output, "logits", None)
        if pending is None or pending[0] != self._forward_id or logits is None or not logits.requires_grad:
            return
        logits.register_hook(partial(self._on_head_grad, name, pending[0], scale, *pending[1:]))

    def _on_head_grad(self, name: str, forward_id: int, scale: float, x_BTKo: torch.Tensor,
                      s_in: torch.Tensor | None, moment_in: Any, grad: torch.Tensor) -> None:
        rec = self._recording(name, False)
        if rec is None:
            return
        if moment_in is not None and self._moments is not None:
            moment_in()
        proj = self.projectors[name]
        with _fp32(grad.device.type):
            g = grad.detach().reshape(grad.shape[0], -1, grad.shape[-1]).float()
            if scale != 1.0:            # the gradient w.r.t. the logits before OLMo's in-place scale_logits
                g = g * scale
            if self._moments is not None:
                self._moments[name].add_head_out(self._counted(g), rec.loss_scale)
            if s_in is not None:
                g = g * s_in.to(g.device)
            self._add(rec, name, forward_id, x_BTKo, proj.project_in(g, False))
