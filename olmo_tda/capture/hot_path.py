"""The hot path: per captured ``nn.Linear`` / ``nn.Embedding`` and forward call, hook → project →
accumulate into the open :class:`~olmo_tda.capture.recording.Recording`, which hands the store its rows.

Shapes (legend): B examples in a forward, T tokens per example (all dims between the first and the
last are flattened into T), I/O layer input/output width, Ki/Ko projected widths.

  forward hook  : ``acts_BTKi = P_in a``   (fp32, autocast off) and a tensor hook on the output
                  (an embedding looks up ``P_in``'s columns for its token ids instead)
  tensor hook   : ``grads_BTKo = P_out g`` then ``Ĝ_BKoKi = grads_BTKoᵀ @ acts_BTKi`` added to the record
                  (with ``capture.rank: c``, a layer whose examples are short by the FLOP rule of
                  :func:`~olmo_tda.capture.factors.factor_route` keeps the two token factors instead)
Nothing else happens on the step: de-scaling by ``loss_scale``, concatenation over micro-batches and
rank-c factorization (LoRIF) happen once per record, lazily, off the hooks. An example whose gradient
is not finite keeps non-finite rows (its LoRIF factors are NaN), which the store skips and counts.
Two optional multiplications ride along: ``GradientCapture.scaled`` (a diagonal preconditioner,
applied before projecting) and ``GradientCapture.moments`` (sums of squares, :mod:`.moments`).

Why a tensor hook on the output and not ``register_full_backward_hook``: the latter breaks when the
Linear's output is modified in place (OLMo's ``clip_qkv`` clamp); a tensor hook registered before
the in-place op receives the gradient w.r.t. the pre-modification value, which is what we need.
Each forward call captures its own activations in the hook's closure, so a Linear used twice in one
forward adds both contributions; activation checkpointing recomputes a forward whose gradient hooks
either are the only ones that fire (re-entrant: the first forward runs under no_grad and is skipped)
or never fire (non-reentrant: the recomputed outputs are not in the backward graph). What a forward
hook measures for ``GradientCapture.moments`` is therefore added when its gradient hook fires.

Example (what :class:`~olmo_tda.capture.hooks.GradientCapture` registers for you)::

    cap = GradientCapture(model, CaptureConfig(proj_dim=64, seed=0))   # LayerHooks on every Linear
    with cap.record(ids, loss_scale=x.shape[0]) as rec:
        (model(x).sum() / x.shape[0]).backward()                       # _on_forward, then _on_grad
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Any

import torch
from torch import nn

from ..config import CaptureConfig, FactorRoute
from .factors import factor_route
from .layers import CaptureError
from .moments import LayerMoments
from .projection import Projector
from .recording import Recording

__all__ = ["LayerHooks"]

log = logging.getLogger(__name__)


class LayerHooks:
    """The per-layer hooks of :class:`~olmo_tda.capture.hooks.GradientCapture`, which mixes them in
    and registers them (``_on_model_forward`` on the model, ``_on_forward`` on each captured layer).
    They read the capture's state, set by its constructor and its context managers:"""

    config: CaptureConfig
    projectors: dict[str, Projector]
    layer_ranks: dict[str, int]             # {name: c} of layers stored as rank-c factors (0: dense)
    _with_bias: dict[str, bool]             # a bias column is captured (last in P_in)
    _paused: bool                           # GradientCapture.pause
    _active: Recording | None               # the open record(...) block
    _forward_id: int                        # numbers the model's forwards: rows follow forward order
    _pending_forwards: int                  # grad-enabled forwards not yet closed by a backward
    _backward_callback_queued: bool
    _warned_unrecorded: bool
    _scales: dict[str, tuple[torch.Tensor, torch.Tensor]] | None    # GradientCapture.scaled
    _moments: dict[str, LayerMoments] | None                        # GradientCapture.moments
    _moment_rows: int | None                                        # GradientCapture.moment_rows

    def _on_model_forward(self, module: nn.Module, args: Any) -> None:
        self._forward_id += 1
        if torch.is_grad_enabled() and not _in_backward() and not self._paused:
            self._pending_forwards += 1

    def _on_forward(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        if self._paused or not torch.is_grad_enabled() or not output.requires_grad:
            return
        acts = (args[0] if args else kwargs["input"]).detach()
        proj = self.projectors[name].to(acts.device)
        scale = self._scales.get(name) if self._scales is not None else None
        moment_in = None
        if isinstance(module, nn.Embedding):
            if acts.ndim < 1:
                raise CaptureError(f"embedding {name} got a scalar input; capture needs a leading batch dimension "
                                   "([B, ...] token ids)")
            ids = acts.reshape(acts.shape[0], -1)
            acts_BTKi = proj.project_ids(ids, module.padding_idx)
            if self._moments is not None:
                moment_in = self._moments[name].measure_ids(self._counted(ids), module.padding_idx)
            if scale is not None:
                acts_BTKi = acts_BTKi * scale[1].to(acts_BTKi.device)[ids].unsqueeze(-1)
        else:
            if acts.ndim < 2:
                raise CaptureError(f"layer {name} got an unbatched input of shape {tuple(acts.shape)}; capture "
                                   "needs a leading batch dimension ([B, ..., features])")
            with _fp32(acts.device.type):
                a = acts.reshape(acts.shape[0], -1, acts.shape[-1]).float()
                if self._moments is not None:
                    moment_in = self._moments[name].measure_in(self._counted(a))
                if scale is None:
                    acts_BTKi = proj.project_in(a, self._with_bias[name])
                else:
                    acts_BTKi = proj.project_in(_scaled_in(a, scale[1].to(a.device), self._with_bias[name]), False)
        # An identity input side keeps the input itself until backward: a later in-place change to it
        # (which autograd allows when the weight needs no gradient) would change the capture
        alias = (acts, acts._version) if proj.in_identity and _same_memory(acts_BTKi, acts) else None
        # A forward inside a backward is an activation-checkpoint recompute; its hooks fire only for
        # re-entrant checkpointing, where they belong to the forward being backpropagated.
        output.register_hook(partial(self._on_grad, name, self._forward_id, _in_backward(), acts_BTKi,
                                     None if scale is None else scale[0], moment_in, alias))

    def _on_grad(self, name: str, forward_id: int, recomputed: bool, acts_BTKi: torch.Tensor,
                 s_out: torch.Tensor | None, moment_in: Any, alias: tuple[torch.Tensor, int] | None,
                 grad: torch.Tensor) -> None:
        rec = self._recording(name, recomputed)
        if rec is None:
            return
        if alias is not None and alias[0]._version != alias[1]:
            raise CaptureError(f"the input of layer {name} was modified in place after its forward: its "
                               "projection is the identity (proj_dim >= the layer's width), so capture reads "
                               "the input at backward time. Make the in-place op out of place, or project")
        if moment_in is not None and self._moments is not None:
            moment_in()
        proj = self.projectors[name]
        with _fp32(grad.device.type):
            g = grad.detach().reshape(grad.shape[0], -1, grad.shape[-1]).float()
            if self._moments is not None:
                self._moments[name].add_out(self._counted(g), rec.loss_scale)
            if s_out is not None:           # the scaling in effect at this layer's forward
                g = g * s_out.to(g.device)
            grads_BTKo = proj.project_out(g)
            self._add(rec, name, forward_id, grads_BTKo, acts_BTKi, owned=alias is None)

    def _recording(self, name: str, recomputed: bool) -> Recording | None:
        """The active record for a gradient arriving now (None: outside any record, warned once)."""
        if not self._backward_callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._backward_callback_queued = True
        rec = self._active
        if rec is None:
            if not self._warned_unrecorded:
                log.warning("a backward pass reached captured layers outside `with capture.record(...)`; "
                            "its gradients are ignored")
                self._warned_unrecorded = True
            return None
        if recomputed and self._pending_forwards > 1:
            raise CaptureError(
                f"re-entrant activation checkpointing recomputed layer {name} during a backward that covers "
                f"{self._pending_forwards} forwards: its examples cannot be told apart. Use "
                "checkpoint(..., use_reentrant=False) (OLMo's default), or one backward per forward (a "
                "grad-enabled forward that is never backpropagated counts too: run it under torch.no_grad())")
        return rec

    def _add(self, rec: Recording, name: str, forward_id: int, grads_BTKo: torch.Tensor,
             acts_BTKi: torch.Tensor, *, owned: bool = True) -> None:
        """Add ``Σ_t g_t ⊗ a_t`` of one forward: as token factors (LoRIF route) or one bmm.
        ``owned=False``: ``acts_BTKi`` is the layer's input itself (an identity input side), which
        the caller may overwrite once the backward is done (a reused input buffer): token factors,
        kept until the record ends, keep a copy."""
        proj = self.projectors[name]
        rank = self.layer_ranks[name]
        if rank and self._keep_tokens(grads_BTKo.shape[1], proj.k_out, proj.k_in, rank):
            rec._add(forward_id, name, (grads_BTKo, acts_BTKi if owned else acts_BTKi.clone()))
        else:
            rec._add(forward_id, name, torch.bmm(grads_BTKo.transpose(1, 2), acts_BTKi))

    def _keep_tokens(self, tokens: int, k_out: int, k_in: int, rank: int) -> bool:
        route = self.config.factor_route
        if route is FactorRoute.AUTO:
            return factor_route(tokens, k_out, k_in, rank) == "tokens"
        return tokens <= rank or route is FactorRoute.QR

    def _on_backward_end(self) -> None:
        self._pending_forwards = 0
        self._backward_callback_queued = False

    def _counted(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of a batch that count in the moments."""
        return x if self._moment_rows is None else x[:self._moment_rows]


def _scaled_in(a_BTI: torch.Tensor, s_in: torch.Tensor, bias: bool) -> torch.Tensor:
    """Inputs times ``s_in``; with a bias, the bias column (``s_in[-1]`` times ones) appended, to be
    projected as a plain input of width I+1."""
    if not bias:
        return a_BTI * s_in
    col = s_in[-1].expand(*a_BTI.shape[:-1], 1)
    return torch.cat([a_BTI * s_in[:-1], col], dim=-1)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):       # torch.func's wrappers have no storage to compare
        return False


def _fp32(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for capture's own math — entered only when autocast is on (entering and leaving
    the context costs ~20 us, twice per layer per step)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) \
        else contextlib.nullcontext()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
