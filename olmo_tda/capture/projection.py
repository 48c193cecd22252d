"""Kronecker projectors: ``Ĝ = P_out G P_inᵀ`` with the same matrices everywhere.

A projector maps one Linear layer's per-token input ``a`` (width ``n_in``) and output gradient ``g``
(width ``n_out``) to ``k_in`` and ``k_out`` wide factors. Random projectors are generated on the CPU
from ``(seed, module name, side)`` alone, so every rank, device, process and checkpoint builds
bit-identical matrices. Entries are scaled by ``1/√k`` so ``E[PᵀP] = I`` and projected inner
products are unbiased estimates of the exact ones.

A projector is an object with its own state (``spec()`` describes it, ``matrices()`` returns it) so
that data-aware projectors are added by registering a new class, without touching the hooks: kind
``eigen`` (:mod:`olmo_tda.capture.eigenbasis`) reads each layer's KFAC eigenbasis from a frozen file,
passed to :func:`make_projector` as ``basis``.

Example::

    from olmo_tda.capture.projection import make_projector
    proj = make_projector("blocks.0.att_proj", n_out=192, n_in=64, k=(16, 16), kind="gaussian", seed=0)
    a_TK = proj.project_in(torch.randn(10, 64))    # [10, 16]
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
import torch.nn.functional as F

from ..config import ConfigError, ProjectionType

if TYPE_CHECKING:
    from .eigenbasis import EigenBasis

__all__ = ["Projector", "IdentityProjector", "MatrixProjector", "RandomProjector", "make_projector",
           "register_projector", "projector_seed", "specs_hash", "matrices_digest"]


class Projector(Protocol):
    """Maps a layer's input rows ``[..., n_in]`` and output-gradient rows ``[..., n_out]`` to k-wide rows.

    ``n_in`` counts the bias column when the layer's bias is captured: ``project_in`` receives the
    raw input (without the column) and adds the bias term itself, so no concatenation is needed.
    ``project_ids`` is ``project_in`` of one-hot rows given as integer ids (an embedding table,
    ``n_in`` = its vocabulary): a lookup of ``P_in``'s columns; ``padding_idx`` rows project to 0
    (that table row gets no gradient).
    """

    k_out: int
    k_in: int
    in_identity: bool
    """``project_in`` may hand back its input itself (no copy): capture then checks it is not changed."""

    def project_in(self, acts: torch.Tensor, with_bias: bool) -> torch.Tensor: ...
    def project_ids(self, ids: torch.Tensor, padding_idx: int | None) -> torch.Tensor: ...
    def project_out(self, grads: torch.Tensor) -> torch.Tensor: ...
    def matrices(self) -> tuple[torch.Tensor, torch.Tensor]: ...
    def spec(self) -> dict[str, Any]: ...
    def to(self, device: torch.device) -> "Projector": ...


def projector_seed(seed: int, name: str, side: str) -> int:
    """A 63-bit generator seed derived from (seed, module name, side); stable across processes."""
    digest = hashlib.sha256(f"olmo_tda/{seed}/{name}/{side}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _append_ones(acts: torch.Tensor) -> torch.Tensor:
    """``[..., n] -> [..., n + 1]``: the bias column of an exactly captured input."""
    ones = torch.ones(*acts.shape[:-1], 1, dtype=acts.dtype, device=acts.device)
    return torch.cat([acts, ones], dim=-1)


class IdentityProjector:
    """``proj_dim=0``: exact, unprojected gradients (k_out = n_out, k_in = n_in [+1 for bias])."""

    in_identity = True

    def __init__(self, name: str, n_out: int, n_in: int):
        self.name, self.k_out, self.k_in = name, n_out, n_in

    def project_in(self, acts: torch.Tensor, with_bias: bool) -> torch.Tensor:
        return _append_ones(acts) if with_bias else acts

    def project_ids(self, ids: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        return _mask_padding(F.one_hot(ids, self.k_in).float(), ids, padding_idx)

    def project_out(self, grads: torch.Tensor) -> torch.Tensor:
        return grads

    def matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.eye(self.k_out), torch.eye(self.k_in)

    def spec(self) -> dict[str, Any]:
        return {"kind": "identity", "shape": [self.k_out, self.k_in]}

    def to(self, device: torch.device) -> "IdentityProjector":
        return self


def _mask_padding(rows: torch.Tensor, ids: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    return rows if padding_idx is None else rows.masked_fill_((ids == padding_idx).unsqueeze(-1), 0.0)


def _is_identity(mat: torch.Tensor) -> bool:
    return mat.shape[0] == mat.shape[1] and torch.equal(mat, torch.eye(mat.shape[0], dtype=mat.dtype))


def matrices_digest(proj_out_KO: torch.Tensor, proj_in_KI: torch.Tensor) -> str:
    """sha256 of the two matrices' float32 bytes: a store refuses matrices that differ in any bit."""
    return hashlib.sha256(proj_out_KO.numpy().tobytes() + proj_in_KI.numpy().tobytes()).hexdigest()


class MatrixProjector:
    """A projector given by two explicit float32 CPU matrices ``P_out [k_out, n_out]`` and
    ``P_in [k_in, n_in]`` (last column: bias). Subclasses say where the matrices come from
    (``spec()``); the hot path is shared. A side whose matrix is the identity skips its matmul.
    """

    def __init__(self, name: str, proj_out_KO: torch.Tensor, proj_in_KI: torch.Tensor):
        self.name = name
        self.proj_out_KO = proj_out_KO      # [k_out, n_out]
        self.proj_in_KI = proj_in_KI        # [k_in, n_in] (last column: bias)
        (self.k_out, self.n_out), (self.k_in, self.n_in) = proj_out_KO.shape, proj_in_KI.shape
        self._bind(torch.device("cpu"))

    def _bind(self, device: torch.device) -> None:
        # The [k, n] matrices themselves on the compute device, used as F.linear weights: x @ Pᵀ with P
        # row-major is the layout BLAS is fastest at for a narrow k (1.5-1.9x faster than x @ (Pᵀ
        # made contiguous), measured for the projections of 64- and 256-wide layers on CPU); an
        # identity side (k >= n) skips its matmul altogether.
        self._out_W = self.proj_out_KO.contiguous().to(device)            # [k_out, n_out]
        self._in_W = self.proj_in_KI.contiguous().to(device)              # [k_in, n_in]
        self._in_W_nobias = self._in_W[:, : self.n_in - 1].contiguous()
        self._bias_col = self._in_W[:, -1].contiguous()
        self._in_W_T: torch.Tensor | None = None        # [n_in, k_in], made on first project_ids
        self._out_identity = _is_identity(self.proj_out_KO)
        self.in_identity = _is_identity(self.proj_in_KI)

    def project_in(self, acts: torch.Tensor, with_bias: bool) -> torch.Tensor:
        if self.in_identity:
            return _append_ones(acts) if with_bias else acts
        if not with_bias:
            return F.linear(acts, self._in_W)
        # [a, 1] @ P_inᵀ == a @ P_inᵀ[:-1] + P_inᵀ[-1]: no concatenated copy of the activations.
        return F.linear(acts, self._in_W_nobias, self._bias_col)

    def project_ids(self, ids: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        if self.in_identity:
            return _mask_padding(F.one_hot(ids, self.n_in).float(), ids, padding_idx)
        if self._in_W_T is None:
            self._in_W_T = self._in_W.T.contiguous()
        return _mask_padding(F.embedding(ids, self._in_W_T), ids, padding_idx)

    def project_out(self, grads: torch.Tensor) -> torch.Tensor:
        return grads if self._out_identity else F.linear(grads, self._out_W)

    def matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj_out_KO, self.proj_in_KI

    def spec(self) -> dict[str, Any]:
        return {"kind": "matrix", "shape": [self.k_out, self.k_in], "layer_shape": [self.n_out, self.n_in],
                "digest": matrices_digest(self.proj_out_KO, self.proj_in_KI)[:16]}

    def to(self, device: torch.device) -> "MatrixProjector":
        if self._out_W.device != device:
            self._bind(device)
        return self


class RandomProjector(MatrixProjector):
    """Random projector drawn on CPU from a per-(layer, side) seed.

    Gaussian/Rademacher entries are scaled by 1/√k. Orthogonal rows are the first k columns of a
    Haar-random orthogonal matrix (QR of a Gaussian in float64, signs fixed by R's diagonal, then
    rounded to float32) scaled by √(n/k), so ``E[PᵀP] = I`` as well, with lower variance. A side
    with ``k >= n`` is the identity (exact): projecting up can only add noise and bytes.
    """

    def __init__(self, name: str, n_out: int, n_in: int, k_out: int, k_in: int,
                 kind: ProjectionType, seed: int):
        self.name, self.kind, self.seed = name, ProjectionType(kind), seed
        super().__init__(name, self._draw(k_out, n_out, "out"), self._draw(k_in, n_in, "in"))

    def spec(self) -> dict[str, Any]:
        # the digest makes a store refuse matrices that differ in any bit (e.g. another LAPACK's QR)
        return {"kind": self.kind.value, "seed": self.seed, "shape": [self.k_out, self.k_in],
                "layer_shape": [self.n_out, self.n_in],
                "digest": matrices_digest(self.proj_out_KO, self.proj_in_KI)[:16]}

    def _draw(self, k: int, n: int, side: str) -> torch.Tensor:
        if k >= n:
            return torch.eye(n)
        gen = torch.Generator(device="cpu").manual_seed(projector_seed(self.seed, self.name, side))
        if self.kind is ProjectionType.ORTHOGONAL:
            q, r = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
            q *= torch.sign(torch.diagonal(r)).masked_fill_(torch.diagonal(r) == 0, 1.0)
            return (q.T * (n / k) ** 0.5).to(torch.float32).contiguous()
        if self.kind is ProjectionType.GAUSSIAN:
            mat = torch.randn(k, n, generator=gen, dtype=torch.float32)
        else:
            mat = torch.randint(0, 2, (k, n), generator=gen).to(torch.float32).mul_(2).sub_(1)
        return mat.div_(k ** 0.5)


ProjectorFactory = Callable[..., Projector]
_REGISTRY: dict[str, tuple[ProjectorFactory, bool]] = {}

def register_projector(kind: str, factory: ProjectorFactory, *, uses_basis: bool = False) -> None:
    """Register a projector class under ``kind``, called as ``factory(name, n_out, n_in, k, seed)``;
    with ``uses_basis``, as ``factory(name, n_out, n_in, k, seed, basis=basis)`` (the data file or
    object given to :func:`make_projector`, possibly None)."""
    _REGISTRY[kind] = (factory, uses_basis)


def _eigen_factory(name: str, n_out: int, n_in: int, k: tuple[int, int], seed: int, *, basis: Any) -> Projector:
    from .eigenbasis import EigenBasis, EigenProjector   # imported on use: it imports this module

    if basis is None:
        raise ConfigError("capture.basis: proj_type 'eigen' needs the eigenbasis file (estimate one with "
                          "olmo_tda.capture.eigenbasis.estimate_eigenbasis(...).save(PATH))")
    return EigenProjector(name, n_out, n_in, k[0], k[1], EigenBasis.open(basis))


for _kind in ProjectionType:
    if _kind is ProjectionType.EIGEN:
        register_projector(_kind.value, _eigen_factory, uses_basis=True)
    else:
        register_projector(_kind.value, lambda name, n_out, n_in, k, seed, _k=_kind:
                           RandomProjector(name, n_out, n_in, k[0], k[1], _k, seed))


def make_projector(name: str, n_out: int, n_in: int, k: tuple[int, int], kind: ProjectionType | str,
                   seed: int, *, basis: "str | os.PathLike[str] | EigenBasis | None" = None) -> Projector:
    """The projector for one layer; ``k == (0, 0)`` gives the exact (identity) projector.

    ``n_in`` includes the bias column when the bias is captured. ``basis`` (``capture.basis``: a
    safetensors file, or an :class:`~olmo_tda.capture.eigenbasis.EigenBasis`) is used by data-aware
    kinds (``eigen``) and ignored by the random ones; a file is read once per process.
    """
    if k == (0, 0):
        return IdentityProjector(name, n_out, n_in)
    kind = kind.value if isinstance(kind, ProjectionType) else str(kind)
    if kind not in _REGISTRY:
        raise ConfigError(f"unknown projector kind {kind!r}; registered: {sorted(_REGISTRY)}")
    factory, uses_basis = _REGISTRY[kind]
    if uses_basis:
        return factory(name, n_out, n_in, k, seed, basis=basis)
    return factory(name, n_out, n_in, k, seed)


def specs_hash(specs: dict[str, dict[str, Any]]) -> str:
    """A short stable hash of all layers' projector specs (what a store checks on append/read)."""
    text = json.dumps(specs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
