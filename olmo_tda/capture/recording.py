"""Recording: what one ``with cap.record(ids, loss_scale=...)`` block yields.

The hot path (:mod:`.hot_path`) adds each backward's contribution under (forward id, layer) with
:meth:`Recording._add`: a dense ``Ĝ [B, Ko, Ki]``, or token factors ``(g [B, T, Ko], a [B, T, Ki])``
on the LoRIF route. Everything else happens once per record, lazily, after the block: forwards in
order, zeros for a layer that was silent in one, the loop's ``loss_scale`` undone, micro-batches
concatenated (:meth:`~Recording.dense`) or factored to rank c (:meth:`~Recording.stored`), and
:meth:`~Recording.to_record` hands the store a :class:`~olmo_tda.store.record.GradientRecord`.

Example::

    with cap.record(ids=range(5), loss_scale=5) as rec:    # cap: a GradientCapture
        loss.backward()
    rec.dense()                                           # {name: [5, Ko, Ki]}
    writer.append(rec.to_record(step, lr))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..store.record import GradientRecord, LowRank, cat_rows
from .factors import lowrank_factors, truncate_dense
from .layers import CaptureError

if TYPE_CHECKING:
    from .hooks import GradientCapture

__all__ = ["Recording"]


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


def _first(grad: Any) -> torch.Tensor:
    return grad[0] if isinstance(grad, tuple) else grad


def _as_ids(ids: Any) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids if not isinstance(ids, range) else np.arange(ids.start, ids.stop, ids.step))
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise CaptureError(f"example ids must be integers (global data indices), got dtype {arr.dtype}")
    return arr.astype(np.int64).reshape(-1)

