"""GradientCapture: per-example projected gradients of nn.Linear layers from any ``backward()`` loop.

Shapes (legend): B examples in a forward, T tokens per example (all dims between the first and the
last are flattened into T), I/O layer input/output width, Ki/Ko projected widths.

The hot path, per selected Linear and forward call:
  forward hook  : ``acts_BTKi = P_in a``   (fp32, autocast off) and a tensor hook on the output
  tensor hook   : ``grads_BTKo = P_out g`` then ``Ĝ_BKoKi = grads_BTKoᵀ @ acts_BTKi`` added to the record
                  (with ``capture.rank: c``, a layer whose examples are short by the FLOP rule of
                  :func:`~olmo_tda.capture.factors.factor_route` keeps the two token factors instead)
Nothing else happens on the step: de-scaling by ``loss_scale``, concatenation over micro-batches and
rank-c factorization (LoRIF) happen once per record, lazily, off the hooks. An example whose gradient
is not finite keeps non-finite rows (its LoRIF factors are NaN), which the store skips and counts.

Why a tensor hook on the output and not ``register_full_backward_hook``: the latter breaks when the
Linear's output is modified in place (OLMo's ``clip_qkv`` clamp); a tensor hook registered before
the in-place op receives the gradient w.r.t. the pre-modification value, which is what we need.
Each forward call captures its own activations in the hook's closure, so a Linear used twice in one
forward adds both contributions; activation checkpointing recomputes a forward whose gradient hooks
either are the only ones that fire (re-entrant: the first forward runs under no_grad and is skipped)
or never fire (non-reentrant: the recomputed outputs are not in the backward graph). What a forward
hook measures for :meth:`GradientCapture.moments` is therefore added when its gradient hook fires.

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
import fnmatch
import logging
import math
import re
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..config import CaptureConfig, FactorRoute, to_plain
from ..store.record import GradientRecord, LowRank, cat_rows
from .factors import factor_route, lowrank_factors, truncate_dense
from .projection import Projector, make_projector, specs_hash

__all__ = ["GradientCapture", "Recording", "CaptureError", "LayerMoments", "reduce_moments",
           "canonical_name", "select_linears"]

log = logging.getLogger(__name__)

# Wrapper segments that DDP / FSDP / activation checkpointing / torch.compile insert into module
# names. Projector seeds derive from names, so a layer must have the same name however it is wrapped.
_WRAPPER_SEGMENTS = re.compile(r"(^|\.)(module|_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)(?=\.|$)")


def canonical_name(name: str) -> str:
    """Module name with wrapper segments removed: ``module.blocks.0._fsdp_wrapped_module.ff_out``
    → ``blocks.0.ff_out``."""
    return _WRAPPER_SEGMENTS.sub("", name).lstrip(".")


class CaptureError(RuntimeError):
    """Capture was used in a way that cannot give correct gradients; the message says how to fix it."""


class Recording:
    """Per-example gradients collected during one ``with cap.record(ids, loss_scale)`` block.

    Rows follow forward order: with gradient accumulation (several forward/backward pairs inside one
    block) ``ids`` lists the examples of every micro-batch, in the order the forwards ran.
    """

    def __init__(self, capture: "GradientCapture", ids: Any, loss_scale: float):
        self.ids = _as_ids(ids)
        self.loss_scale = float(loss_scale)
        self.projector_hash = capture.projector_hash
        """Identifies the projectors: :func:`~olmo_tda.attribute` refuses a store made with others."""
        self.projector_specs = capture.projector_specs
        """Each layer's projector spec: names the first layer and field that differ from a store's."""
        self.basis_version = capture.basis_version
        """Digest of the eigenbasis version these gradients were projected with (None: unversioned)."""
        self._capture = capture
        # forward id -> name -> dense Ĝ [B, Ko, Ki], or token factors (g [B, T, Ko], a [B, T, Ki])
        self._parts: dict[int, dict[str, Any]] = {}
        self._dense: dict[str, torch.Tensor] | None = None
        self._stored: dict[str, torch.Tensor | LowRank] | None = None
        self._assembled: dict[str, list[Any]] | None = None
        self._active = True

    def _add(self, forward_id: int, name: str, grad: Any) -> None:
        """Add one backward's contribution: dense ``[B, Ko, Ki]`` or token factors ``(g, a)``."""
        part = self._parts.setdefault(forward_id, {})
        rows, new_rows = _part_rows(part), _rows(grad)
        if part and new_rows != rows:
            other = next(iter(part))
            embeddings = [n for n in (name, other) if isinstance(self._capture.modules.get(n), nn.Embedding)]
            raise CaptureError(
                f"layer {name} saw {new_rows} examples but {other} saw {rows} in the same forward: "
                "capture needs every captured layer's input batch-first ([B, ..., features]); exclude layers "
                "that flatten or permute the batch (e.g. MoE experts, seq-first [T, B, H] inputs)"
                + (f". {embeddings[0]} is an embedding: one looked up once and broadcast over the batch (a "
                   "learned position embedding, e.g. OLMo's wpe) has no per-example gradient; add it to "
                   "capture.exclude" if embeddings else ""))
        old = part.get(name)
        if old is None:
            part[name] = grad
        elif isinstance(old, tuple) and isinstance(grad, tuple):   # the layer ran again: more tokens
            part[name] = (torch.cat([old[0], grad[0]], dim=1), torch.cat([old[1], grad[1]], dim=1))
        elif not isinstance(old, tuple) and not isinstance(grad, tuple):
            old += grad                                              # dense capture: in place, as before
        else:
            part[name] = _as_dense(old) + _as_dense(grad)

    @property
    def num_backward_rows(self) -> int:
        return sum(_part_rows(p) for p in self._parts.values())

    def dense(self) -> dict[str, torch.Tensor]:
        """``{name: [len(ids), Ko, Ki]}`` float32: gradients of each example's summed token loss.

        Available once the ``with cap.record(...)`` block has ended (later backward passes in the
        block would otherwise be missed).
        """
        if self._active:
            raise CaptureError("Recording.dense() was called inside its `with capture.record(...)` block; "
                               "call it after the block ends")
        if self._dense is None:
            self._dense = {name: _cat([_as_dense(p) for p in parts]) for name, parts in self._assemble().items()}
        return self._dense

    def stored(self) -> dict[str, torch.Tensor | LowRank]:
        """What the store keeps: :meth:`dense` for dense layers and, for layers captured with
        ``capture.rank: c``, :class:`~olmo_tda.store.record.LowRank` factors (exact for examples of
        at most c tokens, else the best rank-c approximation)."""
        if self._active:
            raise CaptureError("Recording.stored() was called inside its `with capture.record(...)` block; "
                               "call it after the block ends")
        if self._stored is None:
            ranks = self._capture.layer_ranks
            self._stored = {name: cat_rows([_factorize(p, ranks[name]) for p in parts]) if ranks[name]
                            else _cat([_as_dense(p) for p in parts]) for name, parts in self._assemble().items()}
        return self._stored

    def _assemble(self) -> dict[str, list[Any]]:
        """Per layer, each forward's part (zeros for a layer that was silent in it), in forward order,
        with the loop's normalization undone (in place, once)."""
        if self._assembled is not None:
            return self._assembled
        shapes = self._capture.layer_shapes
        parts = [self._parts[f] for f in sorted(self._parts)]
        rows = [_part_rows(p) for p in parts]
        if not parts and not len(self.ids):          # an empty block: zero rows of every layer
            self._assembled = {name: [torch.zeros(0, k_out, k_in)] for name, (k_out, k_in) in shapes.items()}
            return self._assembled
        if sum(rows) != len(self.ids):
            raise CaptureError(
                f"record got {len(self.ids)} ids but the backward pass(es) carried {sum(rows)} examples "
                f"(per forward: {rows}). Pass the ids of every example whose loss was backpropagated, "
                "in forward order; was a forward run with capture paused or under no_grad?")
        fired = set().union(*parts) if parts else set()
        self._capture._warn_silent_layers(set(shapes) - fired)
        self._assembled = {name: [part[name] if name in part else torch.zeros(n, k_out, k_in, device=_device(part))
                                  for part, n in zip(parts, rows)]
                           for name, (k_out, k_in) in shapes.items()}
        if self.loss_scale != 1.0:
            # dense parts are our own bmm results: in place. A token factor with an identity output side
            # is autograd's gradient itself (possibly expanded, or the same tensor for two layers whose
            # outputs were summed): a new tensor
            self._assembled = {name: [(p[0] * self.loss_scale, p[1]) if isinstance(p, tuple)
                                      else p.mul_(self.loss_scale) for p in chunks]
                               for name, chunks in self._assembled.items()}
        return self._assembled

    def to_record(self, step: int, lr: float) -> GradientRecord:
        """The store's unit: a :class:`~olmo_tda.store.record.GradientRecord` of this block."""
        return GradientRecord(ids=self.ids, step=step, lr=lr, loss_scale=self.loss_scale, grads=self.stored(),
                              basis=self.basis_version)


def _cat(chunks: list[torch.Tensor]) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _rows(grad: Any) -> int:
    return (grad[0] if isinstance(grad, tuple) else grad).shape[0]


def _part_rows(part: dict[str, Any]) -> int:
    return _rows(next(iter(part.values()))) if part else 0


def _device(part: dict[str, Any]) -> torch.device:
    first = next(iter(part.values()))
    return (first[0] if isinstance(first, tuple) else first).device


def _as_dense(grad: Any) -> torch.Tensor:
    """``[B, Ko, Ki]`` of a part: dense already, or ``gᵀ a`` of its token factors."""
    return torch.bmm(grad[0].transpose(1, 2), grad[1]) if isinstance(grad, tuple) else grad


def _factorize(grad: Any, rank: int) -> LowRank:
    """Rank-c factors of one forward's part: from token factors (exact when T <= c) or by SVD of Ĝ.
    An example whose part is not finite gets NaN factors (the decompositions refuse non-finite
    input), so the store skips and counts it as it does a non-finite dense row."""
    if isinstance(grad, tuple):
        bad = ~(torch.isfinite(grad[0]).flatten(1).all(1) & torch.isfinite(grad[1]).flatten(1).all(1))
    else:
        bad = ~torch.isfinite(grad).flatten(1).all(1)
    if not bool(bad.any()):
        return LowRank(*(lowrank_factors(grad[0], grad[1], rank) if isinstance(grad, tuple)
                         else truncate_dense(grad, rank)))
    keep = (~bad).view(-1, *([1] * (_first(grad).ndim - 1)))
    if isinstance(grad, tuple):
        A, B = lowrank_factors(grad[0].where(keep, 0.0), grad[1].where(keep, 0.0), rank)
    else:
        A, B = truncate_dense(grad.where(keep, 0.0), rank)
    A[bad] = float("nan")
    return LowRank(A, B)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):       # torch.func's wrappers have no storage to compare
        return False


def _first(grad: Any) -> torch.Tensor:
    return grad[0] if isinstance(grad, tuple) else grad


def _as_ids(ids: Any) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids if not isinstance(ids, range) else np.arange(ids.start, ids.stop, ids.step))
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise CaptureError(f"example ids must be integers (global data indices), got dtype {arr.dtype}")
    return arr.astype(np.int64).reshape(-1)


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
    chosen = {n: m for n, m in layers.items() if _matches(n, config.modules) and not _matches(n, config.exclude)}
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


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _tied_heads(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module, float]]:
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


def layer_dims(module: nn.Module) -> tuple[int, int]:
    """``(n_out, n_in)`` of a captured layer's gradient, bias column not counted: a Linear's
    ``(out_features, in_features)``; an embedding's ``(embedding_dim, num_embeddings)`` (the
    transposed table, as a Linear on one-hot inputs)."""
    if isinstance(module, nn.Embedding):
        return module.embedding_dim, module.num_embeddings
    return module.out_features, module.in_features


class GradientCapture:
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
        tied = _tied_heads(model) if enabled else []
        wanted = [t for t in tied if _matches(t[0], self.config.modules) and not _matches(t[0], self.config.exclude)]
        if enabled and wanted and not self.config.embeddings:
            log.warning("the model's output head is tied to its token table (%s): capture does not see it (it is "
                        "F.linear on the table, not an nn.Linear). Set capture.embeddings: true to capture the "
                        "table with the head's share of its gradient (selection.embeddings for selection rounds)",
                        wanted[0][0])
        self._tied = [t for t in tied if t[0] in self.modules]
        """``[(table name, final-norm module, model module, logit scale)]`` of OLMo output heads tied to a
        captured token table: their share of the table's gradient is added to the table's rows."""
        self._tied_acts: dict[str, Any] = {}
        self._scales: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._moments: dict[str, LayerMoments] | None = None
        self._moment_rows: int | None = None     # only the first rows of a batch count (the rest: padding)
        unused = [o for o in self.config.overrides
                  if enabled and not any(self.config.override_for(n) is o for n in self.modules)]
        shadowed = [o.modules for o in unused
                    if any(fnmatch.fnmatchcase(n, p) for n in self.modules for p in o.modules)]
        if shadowed:
            log.warning("capture.overrides %s match only layers an earlier override already sets (the first match "
                        "wins): they change nothing", shadowed)
        if len(unused) > len(shadowed):
            log.warning("capture.overrides %s match no captured layer (captured: %s ...)",
                        [o.modules for o in unused if o.modules not in shadowed], list(self.modules)[:4])
        if enabled:
            self._attach()

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

    # A tied output head: logits = F.linear(x, W) with W [V, d] the token table, whose captured rows
    # are the transposed table (d out, V in). The head's share of that gradient, transposed, is
    # Σ_t x_t ⊗ ∂L/∂logits_t: the table's projectors apply with the roles swapped (P_out on x, P_in on
    # the logits' gradient), and it adds to the lookup's share like a second call of the layer.

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

    def _keep_tokens(self, tokens: int, k_out: int, k_in: int, rank: int) -> bool:
        route = self.config.factor_route
        if route is FactorRoute.AUTO:
            return factor_route(tokens, k_out, k_in, rank) == "tokens"
        return tokens <= rank or route is FactorRoute.QR

    def _on_backward_end(self) -> None:
        self._pending_forwards = 0
        self._backward_callback_queued = False

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

    def _counted(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of a batch that count in the moments."""
        return x if self._moment_rows is None else x[:self._moment_rows]

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


class LayerMoments:
    """Per-feature sums of squares of one layer's inputs (``in_sq [I(+1)]``, bias column last; a
    token table: per-id counts) and output gradients (``out_sq [O]``), over ``tokens`` positions.
    Filled by :meth:`GradientCapture.moments`: the input side is measured at the forward and added
    when that forward's gradient arrives (``measure_*`` return the addition), so a forward that is
    never backpropagated, or recomputed by non-reentrant activation checkpointing, counts once or
    not at all, like the output side."""

    def __init__(self, n_out: int, n_in: int, *, bias: bool = False):
        self.out_sq = torch.zeros(n_out, dtype=torch.float64)
        self.in_sq = torch.zeros(n_in + bias, dtype=torch.float64)
        self.tokens = 0
        self.bias = bias

    def measure_in(self, a_BTI: torch.Tensor) -> Callable[[], None]:
        sq = a_BTI.square().sum(dim=(0, 1)).double()
        return partial(self._add_in, sq, a_BTI.shape[0] * a_BTI.shape[1], self.bias)

    def measure_ids(self, ids_BT: torch.Tensor, padding_idx: int | None) -> Callable[[], None]:
        flat = ids_BT.reshape(-1)
        if padding_idx is not None:
            flat = flat[flat != padding_idx]
        return partial(self._add_in, torch.bincount(flat, minlength=self.in_sq.numel()).double(),
                       ids_BT.numel(), False)

    def _add_in(self, sq: torch.Tensor, tokens: int, bias: bool) -> None:
        self.in_sq[:sq.numel()] += sq.cpu()
        if bias:
            self.in_sq[-1] += tokens
        self.tokens += tokens

    def add_out(self, g_BTO: torch.Tensor, loss_scale: float) -> None:
        self.out_sq += g_BTO.square().sum(dim=(0, 1)).double().cpu() * loss_scale ** 2

    # a tied output head: the table's rows are [d out, V in]; the head sees x (d) and ∂L/∂logits (V)
    def measure_head_in(self, x_BTD: torch.Tensor) -> Callable[[], None]:
        return partial(self._add_head_in, x_BTD.square().sum(dim=(0, 1)).double(), x_BTD.shape[0] * x_BTD.shape[1])

    def _add_head_in(self, sq: torch.Tensor, tokens: int) -> None:
        self.out_sq += sq.cpu()
        self.tokens += tokens

    def add_head_out(self, g_BTV: torch.Tensor, loss_scale: float) -> None:
        self.in_sq += g_BTV.square().sum(dim=(0, 1)).double().cpu() * loss_scale ** 2

    def second_moment(self, damping: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(R [O], C [I])`` with ``E[g_ij²] ≈ R_i·C_j`` for ``g`` the gradient of one token's loss:
        ``R = out_sq / tokens``, ``C = in_sq / tokens``, each floored at ``damping`` times its mean
        (a feature never seen would otherwise get an unbounded preconditioner)."""
        n = max(self.tokens, 1)
        r, c = self.out_sq / n, self.in_sq / n
        return r.clamp_min(damping * float(r.mean())), c.clamp_min(damping * float(c.mean()))


def reduce_moments(moments: dict[str, LayerMoments], device: torch.device | str = "cpu") -> None:
    """Sum every layer's moments over the ranks of the default process group, in one all-reduce
    (``device``: where the collective runs — the rank's GPU under NCCL). No-op without one."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or not moments:
        return
    parts = [t for m in moments.values() for t in (m.out_sq, m.in_sq, torch.tensor([float(m.tokens)]).double())]
    buf = torch.cat(parts).to(device)
    dist.all_reduce(buf)
    buf = buf.cpu()
    at = 0
    for m in moments.values():
        n_out, n_in = m.out_sq.numel(), m.in_sq.numel()
        m.out_sq, m.in_sq = buf[at:at + n_out].clone(), buf[at + n_out:at + n_out + n_in].clone()
        m.tokens = int(round(float(buf[at + n_out + n_in])))
        at += n_out + n_in + 1


def _scaled_in(a_BTI: torch.Tensor, s_in: torch.Tensor, bias: bool) -> torch.Tensor:
    """Inputs times ``s_in``; with a bias, the bias column (``s_in[-1]`` times ones) appended, to be
    projected as a plain input of width I+1."""
    if not bias:
        return a_BTI * s_in
    col = s_in[-1].expand(*a_BTI.shape[:-1], 1)
    return torch.cat([a_BTI * s_in[:-1], col], dim=-1)


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
        raise ValueError("activation_grads_only(embedding_grads=False): the model has no nn.Embedding whose output "
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


def _fp32(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for capture's own math — entered only when autocast is on (entering and leaving
    the context costs ~20 us, twice per layer per step)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) \
        else contextlib.nullcontext()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1

