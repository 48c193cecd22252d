"""GradientCapture: per-example projected gradients of nn.Linear layers from any ``backward()`` loop.

This file is the owner: it selects the layers (:mod:`.layers`), builds their projectors (checking an
eigenbasis file against ``capture.budget``), registers every hook and removes them all, and offers
the blocks a loop uses — ``record`` (yields a :class:`~olmo_tda.capture.recording.Recording`),
``pause``, ``moments`` (:mod:`.moments`), ``scaled``. What the hooks do on a step is
:mod:`.hot_path` (hook → project → accumulate), plus :mod:`.tied_head` for a tied output head.

Example::

    cap = GradientCapture(model, CaptureConfig(proj_dim=64, seed=0))
    loss = model(x).sum() / x.shape[0]
    with cap.record(ids, loss_scale=x.shape[0]) as rec:
        loss.backward()
    grads = rec.dense()          # {name: [len(ids), 64, 64]}
    cap.remove()
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..config import CaptureConfig, ConfigError, to_plain
from .hot_path import LayerHooks
from .hot_path import _in_backward as _in_backward    # integrations/deepspeed.py imports it from here
from .layers import CaptureError, canonical_name, layer_dims, matches, select_linears
from .moments import LayerMoments, reduce_moments
from .projection import Projector, make_projector, specs_hash
from .recording import Recording
from .tied_head import TiedHeadHooks, tied_heads

__all__ = ["GradientCapture", "Recording", "CaptureError", "LayerMoments", "reduce_moments",
           "canonical_name", "select_linears"]

log = logging.getLogger(__name__)


class GradientCapture(LayerHooks, TiedHeadHooks):
    """Owns the hooks on a model's selected ``nn.Linear`` layers (and ``nn.Embedding`` layers with
    ``capture.embeddings``) and turns backward passes into per-example projected gradients.

    Args:
        model: the (possibly DDP/FSDP-wrapped) model. Layers are named canonically, wrappers removed.
        config: which layers and which projection; ``proj_dim=0`` captures exact gradients.
        enabled: False registers nothing at all (zero hooks, zero overhead).
    """

    def __init__(self, model: nn.Module, config: CaptureConfig | None = None, *, enabled: bool = True):
        self.config = config or CaptureConfig()
        self.config.validate()
        self.model = model
        self.enabled = enabled
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._paused = False
        self._active: Recording | None = None
        self._forward_id = 0
        self._pending_forwards = 0          # grad-enabled forwards not yet closed by a backward
        self._backward_callback_queued = False
        self._warned_unrecorded = False
        self._warned_silent: set[str] = set()
        self._projector_hash: str | None = None
        self._projector_specs: dict[str, dict[str, Any]] | None = None
        self._layer_ranks: dict[str, int] | None = None
        self.modules: dict[str, nn.Module] = select_linears(model, self.config) if enabled else {}
        self._with_bias = {n: self.config.include_bias and getattr(m, "bias", None) is not None
                           for n, m in self.modules.items()}
        self.projectors: dict[str, Projector] = {
            name: make_projector(name, n_out, n_in + self._with_bias[name], self._dims_for(name),
                                 self.config.proj_type, self.config.seed, basis=self.config.basis)
            for name, (n_out, n_in) in ((n, layer_dims(m)) for n, m in self.modules.items())
        }
        self.basis = None
        """The :class:`~olmo_tda.capture.eigenbasis.EigenBasis` projected onto now, when it follows the
        run (``capture.basis_every``): :meth:`use_basis` moves to a new version."""
        if self.config.basis_every and enabled:
            self._version_projectors()
        self._tied = self._captured_tied_heads() if enabled else []
        """``[(table name, final-norm module, model module, logit scale)]`` of OLMo output heads tied to a
        captured token table: their share of the table's gradient is added to the table's rows."""
        self._tied_acts: dict[str, Any] = {}
        self._scales: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._moments: dict[str, LayerMoments] | None = None
        self._moment_rows: int | None = None     # only the first rows of a batch count (the rest: padding)
        if enabled:
            self._warn_unused_overrides()
            self._attach()

    def _captured_tied_heads(self) -> list[tuple[str, nn.Module, nn.Module, float]]:
        """The model's tied output heads whose token table is captured (:func:`.tied_head.tied_heads`);
        a selected table left out by ``capture.embeddings: false`` is warned about."""
        tied = tied_heads(self.model)
        wanted = [t for t in tied if matches(t[0], self.config.modules) and not matches(t[0], self.config.exclude)]
        if wanted and not self.config.embeddings:
            log.warning("the model's output head is tied to its token table (%s): capture does not see it (it is "
                        "F.linear on the table, not an nn.Linear). Set capture.embeddings: true to capture the "
                        "table with the head's share of its gradient (selection.embeddings for selection rounds)",
                        wanted[0][0])
        return [t for t in tied if t[0] in self.modules]

    def _warn_unused_overrides(self) -> None:
        unused = [o for o in self.config.overrides if not any(self.config.override_for(n) is o for n in self.modules)]
        shadowed = [o.modules for o in unused if any(matches(n, o.modules) for n in self.modules)]
        if shadowed:
            log.warning("capture.overrides %s match only layers an earlier override already sets (the first match "
                        "wins): they change nothing", shadowed)
        if len(unused) > len(shadowed):
            log.warning("capture.overrides %s match no captured layer (captured: %s ...)",
                        [o.modules for o in unused if o.modules not in shadowed], list(self.modules)[:4])

    # -- selection and hooks -------------------------------------------------------------------

    def _dims_for(self, name: str) -> tuple[int, int]:
        """Layer ``name``'s ``(k_out, k_in)``: the config's, or under ``capture.budget`` the width the
        eigenbasis file allocated it (the file must have been allocated for the same budget)."""
        if not self.config.budget:
            return self.config.dims_for(name)
        from .eigenbasis import EigenBasis, EigenBasisError

        basis = EigenBasis.open(self.config.basis)
        if basis.budget != self.config.budget:
            raise EigenBasisError(
                f"capture.budget is {self.config.budget} but eigenbasis {basis.where()} was "
                + (f"allocated for a budget of {basis.budget}" if basis.budget else "estimated without a budget")
                + ": re-estimate it with this capture config (a training run does so when the file is absent)")
        cap = self.config.proj_dims
        if basis.cap is not None and basis.cap != cap or any(a > b for a, b in zip(basis.dims(name), cap)):
            raise EigenBasisError(
                f"capture.proj_dim caps each side at {cap} under capture.budget, but eigenbasis {basis.where()} was "
                + (f"allocated under a cap of {basis.cap}" if basis.cap is not None
                   else f"allocated layer {name} {basis.dims(name)}")
                + ": re-estimate it with this capture config (a training run does so when the file is absent)")
        return basis.dims(name)

    def _version_projectors(self) -> None:
        from .eigenbasis import EigenBasis, EigenProjector

        self.basis = EigenBasis.open(self.config.basis)
        self.projectors = {name: EigenProjector(name, p.n_out, p.n_in, p.k_out, p.k_in, self.basis, versioned=True)
                           for name, p in self.projectors.items()}

    @property
    def basis_version(self) -> str | None:
        """Digest of the eigenbasis version projected onto now (None unless it follows the run)."""
        return self.basis.digest if self.basis is not None else None

    def use_basis(self, basis: Any) -> None:
        """Project onto ``basis`` (another version of the run's eigenbasis: the same layers and widths)
        from the next forward on. Only for a capture whose basis follows the run."""
        if self.basis is None:
            raise CaptureError("use_basis: this capture's projections are not versioned (capture.basis_every "
                               "is 0, or proj_type is not 'eigen')")
        if self._active is not None:
            raise CaptureError("use_basis: cannot change the basis inside a record(...) block")
        for projector in self.projectors.values():
            projector.rebase(basis)
        self.basis = basis

    def _attach(self) -> None:
        try:
            self._handles.append(self.model.register_forward_pre_hook(self._on_model_forward))
            for name, module in self.modules.items():
                self._handles.append(module.register_forward_hook(partial(self._on_forward, name),
                                                                  with_kwargs=True))
            for name, norm, root, scale in self._tied:
                self._handles.append(norm.register_forward_hook(partial(self._on_head_input, name)))
                self._handles.append(root.register_forward_hook(partial(self._on_head_output, name, scale)))
        except BaseException:
            self.remove()
            raise

    def _warn_silent_layers(self, names: set[str]) -> None:
        new = sorted(names - self._warned_silent)
        if new:
            self._warned_silent.update(new)
            log.warning("selected layers %s received no gradient in a record (their zeros are stored). If the "
                        "model calls them through F.linear (e.g. nn.MultiheadAttention.out_proj) capture cannot "
                        "see them: add them to capture.exclude", new)

    # -- public API ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def record(self, ids: Sequence[int] | np.ndarray | torch.Tensor, *, loss_scale: float = 1.0
               ) -> Iterator[Recording]:
        """Collect the per-example gradients of the backward passes run inside the block.

        Args:
            ids: global ids of the examples whose losses are backpropagated, in forward order
                (all micro-batches, when the block spans several backward calls).
            loss_scale: the divisor the loop applied to the summed token loss (e.g. OLMo's tokens in
                the device batch, DeepSpeed's B·GAS, times an fp16 loss scale); it is undone so the
                stored gradient is that of each example's summed token loss.
        """
        if not self.enabled:
            raise CaptureError("this GradientCapture records nothing: it was built with enabled=False "
                               "or its hooks were removed")
        if self._active is not None:
            raise CaptureError("capture.record(...) blocks cannot be nested")
        if not (loss_scale > 0 and np.isfinite(loss_scale)):
            raise CaptureError(f"loss_scale must be a positive finite number, got {loss_scale!r}")
        rec = Recording(self, ids, loss_scale)
        self._active = rec
        try:
            yield rec
        except BaseException:
            # a backward that raised never ran its end-of-backward callback: forget the forwards it
            # covered, or every later re-entrant recompute would be refused
            self._pending_forwards, self._backward_callback_queued = 0, False
            raise
        finally:
            self._active = None
            rec._active = False

    @contextlib.contextmanager
    def moments(self) -> Iterator[dict[str, "LayerMoments"]]:
        """Accumulate, over the passes run inside the block, each layer's per-feature sums of squares
        of its raw inputs and of its output gradients (de-scaled by the record's ``loss_scale``),
        before any projection or scaling: the two factors of a diagonal K-FAC estimate of the
        gradient's second moment, ``E[g_ij²] ≈ E[δ_i²]·E[a_j²]`` (see :meth:`LayerMoments.second_moment`).
        Output gradients count only inside ``record`` blocks. Cannot be nested."""
        if self._moments is not None:
            raise CaptureError("capture.moments() blocks cannot be nested")
        self._moments = {n: LayerMoments(*layer_dims(m), bias=self._with_bias[n]) for n, m in self.modules.items()}
        try:
            yield self._moments
        finally:
            self._moments = None

    @contextlib.contextmanager
    def moment_rows(self, num: int) -> Iterator[None]:
        """Inside the block (forward and backward), only the first ``num`` rows of each batch count in
        :meth:`moments`; the rest are padding (a rank with fewer examples than the others runs as many
        batches as they do, so collective forwards stay matched). Gradients are captured as usual."""
        if num < 0:
            raise CaptureError(f"moment_rows must be >= 0, got {num}")
        previous, self._moment_rows = self._moment_rows, int(num)
        try:
            yield
        finally:
            self._moment_rows = previous

    @contextlib.contextmanager
    def scaled(self, scales: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
        """Inside the block, every captured gradient ``g [O, I]`` of a layer in ``scales`` is that of
        ``diag(s_out) g diag(s_in)`` (``s_out [O]``, ``s_in [I(+1)]``, the bias column last): the
        output gradients and inputs are scaled before they are projected, so a diagonal preconditioner
        of Kronecker form costs two elementwise products per layer. A token table's ``s_in`` is per
        vocabulary id."""
        for n, (s_out, s_in) in scales.items():
            if n not in self.modules:
                raise CaptureError(f"scales name {n!r}, which is not a captured layer")
            n_out, n_in = layer_dims(self.modules[n])
            n_in += self._with_bias[n]
            if tuple(s_out.shape) != (n_out,) or tuple(s_in.shape) != (n_in,):
                raise CaptureError(f"scales of {n}: expected s_out [{n_out}] and s_in [{n_in}], got "
                                   f"{list(s_out.shape)} and {list(s_in.shape)}")
        previous, self._scales = self._scales, {n: (o.float(), i.float()) for n, (o, i) in scales.items()}
        try:
            yield
        finally:
            self._scales = previous

    def pause(self) -> "_Pause":
        """Stop capturing until :meth:`resume` (or the end of a ``with cap.pause():`` block)."""
        return _Pause(self)

    def resume(self) -> None:
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    def remove(self) -> None:
        """Remove every hook this object registered. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.enabled = False

    def __enter__(self) -> "GradientCapture":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    @property
    def num_hooks(self) -> int:
        return len(self._handles)

    @property
    def layer_ranks(self) -> dict[str, int]:
        """``{name: c}`` of layers stored as rank-c LoRIF factors (0: dense). ``capture.rank`` (or the
        layer's override) applies where ``c·(Ko+Ki) < Ko·Ki``; elsewhere the dense gradient is smaller
        and exact."""
        if self._layer_ranks is None:
            ranks = {n: self.config.rank_for(n) for n in self.layer_shapes}
            self._layer_ranks = {n: c if c and c * (ko + ki) < ko * ki else 0
                                 for (n, (ko, ki)), c in zip(self.layer_shapes.items(), ranks.values())}
        return self._layer_ranks

    @property
    def floats_per_example(self) -> int:
        """Numbers stored per example row over all layers (``c·(Ko+Ki)`` for a factored layer)."""
        return sum(r * (ko + ki) if r else ko * ki
                   for (ko, ki), r in zip(self.layer_shapes.values(), self.layer_ranks.values()))

    @property
    def layer_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (k_out, k_in)}`` of the stored per-example gradient of each layer."""
        return {n: (p.k_out, p.k_in) for n, p in self.projectors.items()}

    def projection(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P_out [Ko, O], P_in [Ki, I(+1)])`` of a layer; the bias column, if captured, is last."""
        return self.projectors[name].matrices()

    @property
    def projector_specs(self) -> dict[str, dict[str, Any]]:
        """Every layer's projector spec (kind, seed, shapes, matrix digest), computed once."""
        if self._projector_specs is None:
            self._projector_specs = {n: p.spec() for n, p in self.projectors.items()}
        return self._projector_specs

    @property
    def projector_hash(self) -> str:
        """Hash of every layer's projector spec (kind, seed, shapes, matrix digest)."""
        if self._projector_hash is None:
            self._projector_hash = specs_hash(self.projector_specs)
        return self._projector_hash

    def store_metadata(self) -> dict[str, Any]:
        """What a store needs to describe (and later verify) this capture's gradients."""
        return {
            "capture": to_plain(self.config),
            "layers": [{"name": n, "shape": list(self.layer_shapes[n]), "bias": self._with_bias[n],
                        "projector": p.spec(), **({"rank": self.layer_ranks[n]} if self.layer_ranks[n] else {})}
                       for n, p in self.projectors.items()],
            "projector_hash": self.projector_hash,
        }


class _Pause(contextlib.AbstractContextManager):
    """Returned by :meth:`GradientCapture.pause`: already paused; leaving a ``with`` block restores."""

    def __init__(self, capture: GradientCapture):
        self._capture, self._previous = capture, capture._paused
        capture._paused = True

    def __exit__(self, *exc: Any) -> None:
        self._capture._paused = self._previous


@contextlib.contextmanager
def activation_grads_only(model: torch.nn.Module, *, embedding_grads: bool = True) -> Iterator[None]:
    """Backward without weight gradients: capture builds per-example gradients from activations and
    output gradients, so only the embeddings keep ``requires_grad`` (cheap, and it makes autograd
    run through the network). Saves the dW matmuls, ~1/4 of a forward+backward.

    ``embedding_grads=False``: no parameter gets a gradient at all; the embeddings' outputs are made
    to require one instead (an added zero, so in-place ops on them stay legal). For a model whose
    parameter gradients something else consumes as they arrive (a DeepSpeed engine's reduction
    hooks) when the backward is not a training step's. Hooks registered on an embedding before this
    context see its output before it requires a gradient."""
    params = list(model.parameters())
    saved = {p: p.requires_grad for p in params}
    modules = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    embeddings = {p for m in modules for p in m.parameters()}
    if not embedding_grads and not modules:
        raise ConfigError("activation_grads_only(embedding_grads=False): the model has no nn.Embedding whose output "
                          "could carry the backward through the network with every weight frozen")
    handles = []
    try:
        if embeddings:
            for p in params:
                p.requires_grad_(embedding_grads and p in embeddings)
        if not embedding_grads:
            handles = [m.register_forward_hook(_needs_grad) for m in modules]
        yield
    finally:
        for h in handles:
            h.remove()
        for p, flag in saved.items():
            p.requires_grad_(flag)


def _needs_grad(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    """An embedding's output that requires a gradient while its weight does not (grad mode only)."""
    if not isinstance(output, torch.Tensor):
        raise CaptureError(f"activation_grads_only(embedding_grads=False): an embedding ({type(module).__name__}) "
                           f"returned a {type(output).__name__}, not a tensor: its output cannot carry the backward")
    if not torch.is_grad_enabled() or output.requires_grad:
        return None
    return output + torch.zeros((), dtype=output.dtype, device=output.device, requires_grad=True)
