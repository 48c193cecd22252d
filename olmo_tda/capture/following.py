"""An eigenbasis that follows the run: versions re-estimated from the training steps themselves.

A basis estimated once, before step 1 of a run from scratch, is the basis of a random model, and
the gradients drift out of it as the model trains (docs/BASES.md has the measured decay). With
``capture.basis_every: N`` a run re-estimates it on a schedule (:func:`is_refresh_step`): at steps
``N/16, N/8, N/4, N/2`` (the weights move fastest early on), then every ``N`` steps.

A refresh costs no extra forward or backward. During the ``capture.basis_batches`` steps before a
refresh step, :class:`TokenSampler` keeps ``capture.basis_tokens`` token rows per rank of each
Linear's input ``a`` and output gradient ``g`` (evenly spaced within each micro-batch); at the
refresh step the new top-k eigenvectors of ``E[a aᵀ]`` and ``E[g gᵀ]`` come from those rows by
subspace iteration started at the previous version plus ``OVERSAMPLE`` seeded columns
(:func:`refreshed_basis`): ``ITERS`` products ``Xᵀ(X V)`` (float32) with the ``T × n`` sample ``X``,
then a Rayleigh-Ritz step (float64); a side no wider than the subspace takes the exact ``eigh`` of
``XᵀX`` instead. Distributed, the ``n × m``
products and the small Rayleigh-Ritz matrices are summed over the ranks and rank 0's result is
broadcast, so every rank holds identical bits. Each layer keeps its widths, so every version's
rows have the store's shapes.

:class:`BasisFollower` owns the schedule, the sampler and the version history
``[(first_step, digest)]`` (rows of step ``s`` are projected with the last version whose
``first_step <= s``); a refresh after step ``r`` makes a version in force from step ``r + 1``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..config import CaptureConfig
from .eigenbasis import EigenBasis, EigenBasisError, _broadcast, _comm_device, _select, fix_signs

__all__ = ["refresh_steps", "is_refresh_step", "TokenSampler", "refreshed_basis", "BasisFollower",
           "EARLY_DIVISORS"]

log = logging.getLogger(__name__)

EARLY_DIVISORS = (16, 8, 4, 2)
"""Early refreshes at ``basis_every // d`` for each ``d``: the weights of a run from scratch move
fastest at the start, where a basis of step 0 decays within tens of steps."""
OVERSAMPLE = 8
"""Extra directions carried by the subspace iteration."""
ITERS = 1
"""Products ``Xᵀ(X V)`` per refresh before the Rayleigh-Ritz step: started at the previous version
(near the new one), one keeps 99.9%+ of the variance the exact top-k keeps (tests/test_following_basis.py);
in the in-run benchmark two were no better and cost 40% more."""


def refresh_steps(every: int, up_to: int) -> list[int]:
    """The refresh steps ``<= up_to`` of the schedule with period ``every`` (0: none)."""
    if every <= 0:
        return []
    early = sorted({every // d for d in EARLY_DIVISORS if every // d >= 1} - {every})
    return [s for s in early if s <= up_to] + list(range(every, up_to + 1, every))


def is_refresh_step(step: int, every: int) -> bool:
    """Whether a run with ``capture.basis_every = every`` re-estimates its basis after ``step``."""
    if every <= 0 or step < 1:
        return False
    return step % every == 0 or (step < every and any(every // d == step for d in EARLY_DIVISORS))


class TokenSampler:
    """Forward hooks that, while :attr:`active`, keep up to ``per_call`` evenly spaced token rows of
    each selected Linear's input (bias 1 appended when captured) and of its output gradient, float32,
    on the layer's device. A forward whose output never gets a gradient adds nothing (its rows are
    added in the tensor hook on its output); rows beyond ``keep`` per layer drop the oldest."""

    def __init__(self, modules: dict[str, nn.Linear], with_bias: dict[str, bool], per_call: int, keep: int):
        self.with_bias, self.per_call, self.keep = with_bias, max(1, per_call), max(1, keep)
        self.active = False
        self.seconds = 0.0
        self.rows: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._held: dict[str, int] = {}          # rows held per layer (the sum of its list's lengths)
        self._picks: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._handles = [m.register_forward_hook(partial(self._on_forward, n), with_kwargs=True)
                         for n, m in modules.items()]

    def _on_forward(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        if not self.active or not torch.is_grad_enabled() or not output.requires_grad:
            return
        t0 = time.perf_counter()
        acts = (args[0] if args else kwargs["input"]).detach()
        flat = acts.reshape(-1, acts.shape[-1])
        pick = self._pick(flat.shape[0], flat.device)
        a = flat.index_select(0, pick).float()
        if self.with_bias[name]:
            a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
        output.register_hook(partial(self._on_grad, name, a, pick))
        self.seconds += time.perf_counter() - t0

    def _pick(self, n: int, device: torch.device) -> torch.Tensor:
        """Row indices of ``per_call`` evenly spaced tokens of ``n`` (made once per batch shape)."""
        pick = self._picks.get((n, device))
        if pick is None:
            pick = self._picks[(n, device)] = torch.linspace(0, n - 1, min(n, self.per_call),
                                                             device=device).round().long()
        return pick

    def _on_grad(self, name: str, a: torch.Tensor, pick: torch.Tensor, grad: torch.Tensor) -> None:
        t0 = time.perf_counter()
        g = grad.detach().reshape(-1, grad.shape[-1]).index_select(0, pick).float()
        ins, outs = self.rows.setdefault(name, ([], []))
        ins.append(a)
        outs.append(g)
        held = self._held.get(name, 0) + len(a)
        while held - len(ins[0]) >= self.keep:     # the oldest go while the rest still hold ``keep``
            held -= len(ins.pop(0))
            outs.pop(0)
        self._held[name] = held
        self.seconds += time.perf_counter() - t0

    def take(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{layer: (a rows [T, n_in], g rows [T, n_out])}``, the last ``keep`` of each; clears them."""
        out = {n: (torch.cat(ins)[-self.keep:], torch.cat(outs)[-self.keep:]) for n, (ins, outs) in self.rows.items()}
        self.rows, self._held = {}, {}
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _sum(t: torch.Tensor, world: bool) -> torch.Tensor:
    if world:
        moved = t.to(_comm_device())
        dist.all_reduce(moved)
        return moved.to(t.device)
    return t


def _top_rows(x_TN: torch.Tensor | None, n: int, k: int, warm_KN: torch.Tensor, world: bool,
              iters: int = ITERS) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """``(rows [k, n] float32, eigenvalues [k] float64, trace, tokens)`` of ``E[x xᵀ]`` over the
    sampled rows of every rank (``x_TN`` float32, None: this rank saw none), started at ``warm_KN``.
    The products run in float32 (the rows are float32 samples), the small eigendecompositions in
    float64."""
    x = x_TN if x_TN is not None else torch.zeros(0, n, device=_comm_device() if world else "cpu")
    tokens = int(_sum(torch.tensor([float(x.shape[0])], dtype=torch.float64, device=x.device), world).item())
    trace = float(_sum(torch.linalg.vector_norm(x).square().reshape(1), world).item())
    m = min(n, k + OVERSAMPLE)
    if n <= m:                                          # narrow: the exact eigendecomposition
        values, vectors = torch.linalg.eigh(_sum(x.T @ x, world).double())
        values, rows = values.flip(0)[:k], vectors.flip(1).T[:k]
    else:
        gen = torch.Generator().manual_seed(n * 1_000_003 + k)  # the same extra columns on every rank
        q = torch.cat([warm_KN.T.float(), torch.randn(n, m - warm_KN.shape[0], generator=gen)], dim=1).to(x.device)
        for _ in range(iters):      # (the first product needs no orthonormal start: its range is what counts)
            q = torch.linalg.qr(_sum(x.T @ (x @ q), world)).Q
        xq = x @ q
        values, small = torch.linalg.eigh(_sum(xq.T @ xq, world).double())   # Rayleigh-Ritz on span(q)
        values, rows = values.flip(0)[:k], (q.double() @ small.flip(1)).T[:k]
    scale = max(tokens, 1)
    return (fix_signs(rows.cpu().contiguous()).float().contiguous(), (values.cpu().clamp(min=0) / scale).contiguous(),
            trace / scale, tokens)


def refreshed_basis(previous: EigenBasis, samples: dict[str, tuple[torch.Tensor, torch.Tensor]], *,
                    distributed: bool = False) -> EigenBasis:
    """A new version of ``previous``: each layer's top eigenvectors, as many per side as it keeps
    now, of the covariances of ``samples`` (``{layer: (a [T, n_in], g [T, n_out])}``, this rank's),
    started at its current ones. A side ``previous`` keeps whole (``k >= n``: an identity projection)
    is kept as it is. ``distributed``: every rank of the default group calls; all get rank 0's bits."""
    world = distributed and dist.is_initialized() and dist.get_world_size() > 1
    layers = {}
    for name in sorted(previous.layers):                # the same order on every rank
        lb = previous.layers[name]
        a, g = samples.get(name, (None, None))
        fields: dict[str, Any] = {}
        for side, x, rows, n in (("in", a, lb.proj_in, lb.n_in), ("out", g, lb.proj_out, lb.n_out)):
            if rows.shape[0] >= n:
                continue
            if x is not None and x.shape[1] != n:
                raise EigenBasisError(f"refreshing eigenbasis layer {name!r}: sampled {side}put rows have width "
                                      f"{x.shape[1]}, the basis {n}")
            x32 = None if x is None else x.detach().float()           # on its device
            new_rows, values, trace, tokens = _top_rows(x32, n, rows.shape[0], rows, world)
            if tokens == 0:         # the same on every rank: the sum of the counts
                log.warning("refreshing the eigenbasis: layer %s got no sampled token rows on any rank (no gradient "
                            "in the sampled steps): its %sput side keeps the previous version's directions", name, side)
                continue
            fields.update({f"proj_{side}": new_rows, f"eigvals_{side}": values, f"trace_{side}": trace,
                           "num_tokens": tokens})
        layers[name] = dataclasses.replace(lb, **fields)
    basis = EigenBasis(layers, budget=previous.budget, cap=previous.cap)
    return _broadcast(basis) if world else basis


class BasisFollower:
    """The schedule, the sampler and the version history of a run's following eigenbasis.

    ``capture``: the run's :class:`~olmo_tda.capture.GradientCapture` (``capture.basis_every > 0``),
    projecting onto the first version; ``folder``: where versions are written as
    ``<digest>.safetensors`` (the store's ``bases/``); ``writer``: whether this rank writes them
    (rank 0; a rank that finds no file after the barrier writes its own copy, for node-local
    folders). Call :meth:`before_step` before a step's forward and :meth:`after_step` after its
    optimizer step, on every rank.
    """

    def __init__(self, model: nn.Module, capture: Any, config: CaptureConfig, folder: Path, *,
                 writer: bool = True, distributed: bool = False, barrier: Callable[[], None] | None = None):
        self.capture, self.config, self.folder = capture, config, Path(folder)
        self.writer, self.distributed, self._barrier = writer, distributed, barrier
        modules, with_bias = _select(model, config)
        per_call = max(1, config.basis_tokens // config.basis_batches)
        self.sampler = TokenSampler(modules, with_bias, per_call, config.basis_tokens)
        self.versions: list[tuple[int, str]] = []
        """``[(first_step, digest)]``, ascending: the basis of rows at step ``s`` is the last with
        ``first_step <= s``."""
        self.refresh_seconds = 0.0
        """Seconds spent sampling and refreshing so far (this process)."""

    @property
    def current(self) -> EigenBasis:
        return self.capture.basis

    def start(self, step: int) -> None:
        """A fresh run: the capture's basis is the version in force from ``step``; written to the folder."""
        self._publish(self.current)
        self.versions = [(int(step), self.current.digest)]

    def before_step(self, step: int) -> None:
        """Sample this step's token rows if a refresh is due within ``basis_batches`` steps."""
        every, window = self.config.basis_every, self.config.basis_batches
        self.sampler.active = any(is_refresh_step(s, every) for s in range(step, step + window))

    def after_step(self, step: int) -> EigenBasis | None:
        """After the optimizer step ``step``: on a refresh step, the new version (in force from
        ``step + 1``), else None. Collective on a refresh step."""
        if not is_refresh_step(step, self.config.basis_every):
            return None
        t0 = time.perf_counter()
        self.sampler.active = False
        basis = refreshed_basis(self.current, self.sampler.take(), distributed=self.distributed)
        self._publish(basis)
        self.capture.use_basis(basis)
        self.versions.append((step + 1, basis.digest))
        self.refresh_seconds += time.perf_counter() - t0 + self.sampler.seconds
        self.sampler.seconds = 0.0
        log.info("tda: eigenbasis version %d (%s) in force from step %d (refresh %.2fs)", len(self.versions),
                 basis.digest[:12], step + 1, time.perf_counter() - t0)
        return basis

    def _publish(self, basis: EigenBasis) -> None:
        path = self.folder / f"{basis.digest}.safetensors"
        if self.writer and not path.is_file():
            basis.save(path)
        if self._barrier is not None:
            self._barrier()
        if not path.is_file():          # a node-local folder: this node keeps its own (identical) copy
            basis.save(path)
        basis.path = path

    def state_dict(self) -> dict[str, Any]:
        return {"versions": [[s, d] for s, d in self.versions]}

    def check_resume(self, state: dict[str, Any] | None, step: int, stored: list[str] = ()) -> list[tuple[int, str]]:
        """The versions a resume after ``step`` keeps (those in force up to ``step + 1``), or
        :class:`EigenBasisError` when a kept version's file, or that of a version ``stored`` rows were
        projected with, is missing, or when those rows name a version the checkpoint does not list.
        Changes nothing: a resume calls it before anything is cut, and again after."""
        versions = [(int(s), str(d)) for s, d in (state or {}).get("versions", [])]
        kept = [(s, d) for s, d in versions if s <= step + 1] or [(1, self.current.digest)]
        for digest in dict.fromkeys([*stored, *(d for _, d in kept)]):
            path = self.folder / f"{digest}.safetensors"
            if not path.is_file():
                raise EigenBasisError(f"resuming: eigenbasis version {digest[:16]}, which stored rows were projected "
                                      f"with, is missing: {path} (restore it from a copy of the run folder)")
        unknown = sorted(set(stored) - {d for _, d in kept})
        if unknown:
            raise EigenBasisError(f"resuming after step {step}: the store holds rows of eigenbasis version(s) "
                                  f"{', '.join(d[:16] for d in unknown)} that the checkpoint does not list (rows of "
                                  "another run, or a checkpoint of another run)")
        return kept

    def load_state_dict(self, state: dict[str, Any] | None, step: int, stored: list[str] = ()) -> None:
        """Resume after ``step`` (the store already cut back to it): keep the versions in force up to
        ``step + 1`` and project with the last; the files of later versions are removed (a resume that
        cuts the store back cuts its bases back). A missing file of a kept version, or of a version
        that ``stored`` rows (the store's, after the cut) were projected with, is refused, naming it."""
        kept = self.check_resume(state, step, stored)
        self.versions = kept
        self.capture.use_basis(EigenBasis.open(self.folder / f"{kept[-1][1]}.safetensors"))
        if self.writer:
            keep = {d for _, d in kept}
            for stale in self.folder.glob("*.safetensors"):
                if stale.stem not in keep:
                    stale.unlink()

    def remove(self) -> None:
        self.sampler.remove()
