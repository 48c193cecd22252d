"""Data-aware projectors: each layer's KFAC eigenbasis, estimated once and frozen with the run.

For a Linear layer ``y = W a`` the per-token input covariance ``A = E[a aᵀ]`` (``n_in × n_in``, with
the appended 1 of the bias column when the bias is captured) and output-gradient covariance
``S = E[g gᵀ]`` (``n_out × n_out``; ``g = ∂ℓ/∂y`` of the summed token loss) are the two Kronecker
factors of KFAC's Fisher ``F ≈ A ⊗ S``. The rows of ``P_in`` / ``P_out`` are the top-``k``
eigenvectors of ``A`` / ``S`` (orthonormal, largest eigenvalue first), so ``Ĝ = P_out G P_inᵀ`` keeps
the gradient's coordinates in the ``k_out·k_in`` Kronecker directions where the Fisher is largest.

Unlike the random projectors these are **not scaled and not unbiased**: ``⟨Ĝ_i, Ĝ_j⟩`` is the exact
inner product of the two gradients *restricted to the dominant Kronecker subspace*, never an
estimate of the full one (the discarded directions are simply dropped). A side with ``k >= n`` is the
identity (exact), as for random projectors.

Determinism: covariances are accumulated in float64, decomposed on the CPU with ``torch.linalg.eigh``
and each eigenvector's sign is fixed so that its largest-magnitude entry (the first, on ties) is
positive; the same covariance always gives the same matrices. Distributed estimation sums the
covariances over ranks and broadcasts rank 0's matrices, so every rank holds identical bits.

The file is safetensors (no pickle) written atomically, with a JSON header (layers, shapes, k, tokens
used, a content digest). A projector's ``spec()`` carries that digest, so a store made with one basis
refuses queries projected with another.

Example::

    from olmo_tda.capture.eigenbasis import estimate_eigenbasis
    cfg = CaptureConfig(proj_dim=16, proj_type="eigen", basis="basis.safetensors")
    loss_fn = lambda model, batch: token_losses(model(batch).logits, batch).sum()   # summed token loss
    estimate_eigenbasis(model, batches[:4], loss_fn, cfg).save(cfg.basis)
    cap = GradientCapture(model, cfg)               # projects onto the frozen eigenbasis

Legend: ``_KO`` / ``_KI`` rows × layer output / input width; ``_II`` / ``_OO`` covariances.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..config import CaptureConfig, ConfigError
from .layers import select_linears
from .projection import MatrixProjector, matrices_digest

__all__ = ["EigenBasis", "EigenBasisError", "EigenProjector", "KroneckerCovariance", "LayerBasis",
           "allocate_budget", "best_rectangle", "split_budget", "estimate_covariances", "eigenbasis_from_covariances",
           "estimate_eigenbasis"]

log = logging.getLogger(__name__)

FORMAT_NAME = "olmo_tda.eigenbasis"
FORMAT_VERSION = 1


class EigenBasisError(ConfigError):
    """An eigenbasis file is missing, unreadable, or does not fit the model; the message names the
    file and the layer."""


# ---------------------------------------------------------------------------------------------
# the basis


@dataclass(frozen=True, eq=False)     # tensors: compare fields explicitly
class LayerBasis:
    """One layer's frozen eigenbasis (rows: eigenvectors, largest eigenvalue first)."""

    proj_out: torch.Tensor
    """``[k_out, n_out]`` float32: top eigenvectors of ``E[g gᵀ]``."""
    proj_in: torch.Tensor
    """``[k_in, n_in]`` float32: top eigenvectors of ``E[a aᵀ]`` (last column: bias, when ``bias``)."""
    eigvals_out: torch.Tensor
    """``[k_out]`` float64, descending."""
    eigvals_in: torch.Tensor
    """``[k_in]`` float64, descending."""
    trace_out: float
    """``tr E[g gᵀ]``: the sum of all eigenvalues, kept ones or not."""
    trace_in: float
    bias: bool
    """The input side includes the bias column (the appended 1)."""
    num_tokens: int
    """Token rows the covariances were averaged over."""

    @property
    def n_out(self) -> int:
        return self.proj_out.shape[1]

    @property
    def n_in(self) -> int:
        return self.proj_in.shape[1]

    def explained(self) -> tuple[float, float]:
        """Fractions of ``tr E[g gᵀ]`` and ``tr E[a aᵀ]`` that the kept directions carry."""
        return (float(self.eigvals_out.sum()) / max(self.trace_out, 1e-300),
                float(self.eigvals_in.sum()) / max(self.trace_in, 1e-300))


class EigenBasis:
    """Per-layer eigenbases ``{layer name: LayerBasis}`` with a content digest; saved as safetensors.

    ``digest`` is the sha256 of every layer's name and projection matrices (float32 bytes): two files
    with equal digests project identically. ``path`` is where it was loaded from / saved to.
    """

    def __init__(self, layers: dict[str, LayerBasis], *, path: str | os.PathLike[str] | None = None,
                 budget: int = 0, cap: tuple[int, int] | None = None):
        if not layers:
            raise EigenBasisError("an eigenbasis needs at least one layer")
        self.layers = dict(sorted(layers.items()))
        self.path = Path(path) if path is not None else None
        self.budget = int(budget)
        """``capture.budget`` the widths were allocated for (0: not allocated). When nonzero each
        layer's ``(k_out, k_in)`` is the number of eigenvectors it keeps per side (:meth:`dims`)."""
        self.cap = (int(cap[0]), int(cap[1])) if budget and cap is not None else None
        """``(k_out, k_in)`` that capped each side when the widths were allocated (``capture.proj_dim``);
        None when not allocated, or in a file from before it was recorded."""
        self.digest = _digest(self.layers)

    def __repr__(self) -> str:
        return (f"EigenBasis({len(self.layers)} layers, digest={self.digest[:16]}, path={self.path}"
                + (f", budget={self.budget})" if self.budget else ")"))

    def dims(self, name: str) -> tuple[int, int]:
        """``(k_out, k_in)`` the layer keeps: its allocated width when the basis is budgeted."""
        lb = self.layer(name)
        return lb.proj_out.shape[0], lb.proj_in.shape[0]

    @property
    def num_tokens(self) -> int:
        """Tokens the estimate used (the most any layer saw: a layer called once per forward sees all)."""
        return max(lb.num_tokens for lb in self.layers.values())

    def where(self) -> str:
        return str(self.path) if self.path is not None else "<in-memory eigenbasis>"

    def layer(self, name: str) -> LayerBasis:
        """The layer's basis; a clear error naming the layer and the file when it has none."""
        try:
            return self.layers[name]
        except KeyError:
            shown = ", ".join(list(self.layers)[:12]) + (" ..." if len(self.layers) > 12 else "")
            raise EigenBasisError(
                f"eigenbasis {self.where()} has no layer {name!r} (it has: {shown}); it was estimated for "
                "another model or another capture.modules/exclude selection: re-estimate it, or point "
                "capture.basis at the right file") from None

    # -- file ------------------------------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        """The JSON header stored in the file's metadata."""
        return {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "digest": self.digest,
            "num_tokens": self.num_tokens, "budget": self.budget,
            **({"budget_cap": list(self.cap)} if self.cap is not None else {}),
            "convention": "rows = eigenvectors of E[a a^T] (in, bias column last) and E[g g^T] (out, g = grad "
                          "of the summed token loss), largest eigenvalue first, largest-|entry| positive; unscaled",
            "layers": {n: {"n_out": lb.n_out, "n_in": lb.n_in, "k_out": lb.proj_out.shape[0],
                           "k_in": lb.proj_in.shape[0], "bias": lb.bias, "num_tokens": lb.num_tokens,
                           "trace_out": lb.trace_out, "trace_in": lb.trace_in}
                       for n, lb in self.layers.items()},
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (temp file, fsync, rename, fsync of the directory); returns the path."""
        from safetensors.torch import save

        path = Path(path)
        tensors = {}
        for name, lb in self.layers.items():
            tensors.update({f"{name}/out": lb.proj_out, f"{name}/in": lb.proj_in,
                            f"{name}/out_eigvals": lb.eigvals_out, f"{name}/in_eigvals": lb.eigvals_in})
        # one metadata key: safetensors writes a multi-key metadata map in a per-process random order,
        # and equal bases should be equal files
        data = save({k: v.contiguous() for k, v in tensors.items()},
                    metadata={FORMAT_NAME: json.dumps(self.header(), sort_keys=True)})
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)          # mkstemp's 0600 would hide the file from other users
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "EigenBasis":
        """Read and verify a file written by :meth:`save` (shapes against the header, digest against
        the tensors); any mismatch is an :class:`EigenBasisError` naming the file."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise EigenBasisError(f"capture.basis: eigenbasis file {path} does not exist (a training run "
                                  "estimates it before its first step; elsewhere use estimate_eigenbasis(...).save)")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:   # safetensors raises its own error types for truncated/corrupt files
            raise EigenBasisError(f"eigenbasis {path}: not a readable safetensors file ({e})") from None
        if FORMAT_NAME not in meta:
            raise EigenBasisError(f"{path} is not an olmo_tda eigenbasis (its metadata has no {FORMAT_NAME!r} header)")
        try:
            header = json.loads(meta[FORMAT_NAME])
        except ValueError as e:
            raise EigenBasisError(f"eigenbasis {path}: unreadable header ({e})") from None
        if not isinstance(header, dict) or not isinstance(header.get("layers"), dict):
            raise EigenBasisError(f"eigenbasis {path}: damaged header: 'layers' is missing or not a mapping")
        if not isinstance(header.get("format_version", -1), int):
            raise EigenBasisError(f"eigenbasis {path}: damaged header: format_version "
                                  f"{header.get('format_version')!r}")
        if int(header.get("format_version", -1)) > FORMAT_VERSION:
            raise EigenBasisError(f"{path} has format_version {header.get('format_version')}, newer than this "
                                  f"olmo_tda reads ({FORMAT_VERSION}); upgrade olmo_tda")
        layers = {}
        for name, h in header["layers"].items():
            fields = ("trace_out", "trace_in", "bias", "num_tokens", "k_out", "n_out", "k_in", "n_in")
            if not isinstance(h, dict) or any(k not in h for k in fields):
                absent = [k for k in fields if not isinstance(h, dict) or k not in h]
                raise EigenBasisError(f"eigenbasis {path}: damaged header: layer {name!r} lacks {absent}")
            try:
                lb = LayerBasis(proj_out=tensors[f"{name}/out"], proj_in=tensors[f"{name}/in"],
                                eigvals_out=tensors[f"{name}/out_eigvals"], eigvals_in=tensors[f"{name}/in_eigvals"],
                                trace_out=float(h["trace_out"]), trace_in=float(h["trace_in"]),
                                bias=bool(h["bias"]), num_tokens=int(h["num_tokens"]))
                want = [(int(h["k_out"]), int(h["n_out"])), (int(h["k_in"]), int(h["n_in"]))]
            except KeyError as e:
                raise EigenBasisError(f"eigenbasis {path}: layer {name!r} lacks tensor {e}") from None
            except (TypeError, ValueError) as e:
                raise EigenBasisError(f"eigenbasis {path}: damaged header: layer {name!r} has a field of the "
                                      f"wrong type ({e})") from None
            if [tuple(lb.proj_out.shape), tuple(lb.proj_in.shape)] != want:
                raise EigenBasisError(f"eigenbasis {path}: layer {name!r} has matrices {tuple(lb.proj_out.shape)}, "
                                      f"{tuple(lb.proj_in.shape)} but its header says {want}")
            layers[name] = lb
        try:
            budget = int(header.get("budget", 0))
        except (TypeError, ValueError):
            raise EigenBasisError(f"eigenbasis {path}: damaged header: budget {header.get('budget')!r}") from None
        cap = header.get("budget_cap")
        if cap is not None and not (isinstance(cap, list) and len(cap) == 2
                                    and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in cap)):
            raise EigenBasisError(f"eigenbasis {path}: damaged header: budget_cap {cap!r}")
        basis = cls(layers, path=path, budget=budget, cap=None if cap is None else tuple(cap))
        if basis.digest != header.get("digest"):
            raise EigenBasisError(f"eigenbasis {path} is corrupt: its matrices hash to {basis.digest[:16]}, "
                                  f"its header says {str(header.get('digest'))[:16]}")
        return basis

    @classmethod
    def open(cls, basis: "str | os.PathLike[str] | EigenBasis") -> "EigenBasis":
        """``basis`` itself, or the file loaded once per process (re-read if the file changes)."""
        if isinstance(basis, EigenBasis):
            return basis
        path = Path(basis)
        try:
            st = path.resolve().stat()
        except FileNotFoundError:
            return cls.load(path)      # raises the clear "does not exist" error
        return _load_cached(str(path.resolve()), st.st_mtime_ns, st.st_size, st.st_ino)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int, size: int, ino: int) -> EigenBasis:
    return EigenBasis.load(path)


def _digest(layers: dict[str, LayerBasis]) -> str:
    h = hashlib.sha256()
    for name, lb in sorted(layers.items()):
        h.update(json.dumps([name, list(lb.proj_out.shape), list(lb.proj_in.shape)]).encode())
        h.update(bytes.fromhex(matrices_digest(lb.proj_out.float().contiguous(), lb.proj_in.float().contiguous())))
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:     # e.g. platforms where directories cannot be opened
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# the projector


class EigenProjector(MatrixProjector):
    """One layer's rows of a frozen :class:`EigenBasis`: the first ``k`` stored eigenvectors per side
    (a basis estimated at a larger k serves every smaller one); a side with ``k >= n`` is the
    identity. Not scaled: projected inner products are those of the gradients restricted to the
    dominant Kronecker subspace, not unbiased estimates of the full ones."""

    def __init__(self, name: str, n_out: int, n_in: int, k_out: int, k_in: int, basis: EigenBasis,
                 *, versioned: bool = False):
        self.versioned = versioned
        """A basis that follows the run (``capture.basis_every``): the spec names no matrices, each
        shard names its version, and :meth:`rebase` moves to the next one."""
        lb = self._fitting(basis, name, n_out, n_in)
        self.basis_digest = basis.digest
        super().__init__(name, self._rows(basis, name, "out", lb.proj_out, k_out),
                         self._rows(basis, name, "in", lb.proj_in, k_in))

    @staticmethod
    def _fitting(basis: EigenBasis, name: str, n_out: int, n_in: int) -> LayerBasis:
        """The layer's basis, refused when it was estimated for another layer shape."""
        lb = basis.layer(name)
        if (lb.n_out, lb.n_in) != (n_out, n_in):
            raise EigenBasisError(
                f"eigenbasis {basis.where()}: layer {name!r} was estimated with (n_out, n_in) = ({lb.n_out}, "
                f"{lb.n_in}) but the model's layer has ({n_out}, {n_in}) (n_in counts a captured bias column: "
                f"the basis has bias={lb.bias}); re-estimate it for this model and capture.include_bias")
        return lb

    @staticmethod
    def _rows(basis: EigenBasis, name: str, side: str, stored_KN: torch.Tensor, k: int) -> torch.Tensor:
        stored, n = stored_KN.shape
        if k >= n:
            return torch.eye(n)
        if k > stored:
            hint = (f" (its widths were allocated for capture.budget {basis.budget}: set capture.budget: "
                    f"{basis.budget} to use them)" if basis.budget else "")
            raise EigenBasisError(f"eigenbasis {basis.where()}: layer {name!r} keeps {stored} {side}put eigenvectors "
                                  f"but capture.proj_dim asks for {k}; re-estimate the basis with proj_dim >= {k}"
                                  + hint)
        return stored_KN[:k].float().clone()

    def rebase(self, basis: EigenBasis) -> None:
        """Project onto ``basis`` (a later version of the same layers, widths unchanged) from now on."""
        lb = self._fitting(basis, self.name, self.n_out, self.n_in)
        device = self._out_W.device
        self.proj_out_KO = self._rows(basis, self.name, "out", lb.proj_out, self.k_out)
        self.proj_in_KI = self._rows(basis, self.name, "in", lb.proj_in, self.k_in)
        self.basis_digest = basis.digest
        self._bind(device)

    def spec(self) -> dict[str, Any]:
        if self.versioned:
            return {"kind": "eigen", "shape": [self.k_out, self.k_in], "layer_shape": [self.n_out, self.n_in],
                    "basis": "versioned"}
        return {"kind": "eigen", "shape": [self.k_out, self.k_in], "layer_shape": [self.n_out, self.n_in],
                "basis_digest": self.basis_digest[:16],
                "digest": matrices_digest(self.proj_out_KO, self.proj_in_KI)[:16]}


# ---------------------------------------------------------------------------------------------
# estimation


@dataclass
class KroneckerCovariance:
    """One layer's accumulated second moments (float64, sums until divided by ``num_tokens``)."""

    cov_in: torch.Tensor
    """``[n_in(+1), n_in(+1)]``: ``Σ a aᵀ`` (bias: ``a`` with a 1 appended)."""
    cov_out: torch.Tensor
    """``[n_out, n_out]``: ``Σ g gᵀ``."""
    num_tokens: int
    bias: bool

    def mean(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E[g gᵀ], E[a aᵀ])``."""
        n = max(self.num_tokens, 1)
        return self.cov_out / n, self.cov_in / n


class _CovarianceHooks:
    """Owns the forward hooks of one estimation pass. The input rows of a forward call are added in
    the tensor hook on its output, together with the gradient rows, so a forward whose output never
    gets a gradient (an activation-checkpoint forward, a no_grad forward) adds nothing."""

    def __init__(self, modules: dict[str, nn.Linear], with_bias: dict[str, bool]):
        self.with_bias = with_bias
        self.covs: dict[str, KroneckerCovariance] = {}
        self._handles = [m.register_forward_hook(partial(self._on_forward, n), with_kwargs=True)
                         for n, m in modules.items()]

    def _on_forward(self, name: str, module: nn.Linear, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        if not torch.is_grad_enabled() or not output.requires_grad:
            return
        acts = (args[0] if args else kwargs["input"]).detach()
        output.register_hook(partial(self._on_grad, name, acts))

    def _on_grad(self, name: str, acts: torch.Tensor, grad: torch.Tensor) -> None:
        with torch.autocast(grad.device.type, enabled=False):
            a = acts.reshape(-1, acts.shape[-1]).double()
            if self.with_bias[name]:
                a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
            g = grad.detach().reshape(-1, grad.shape[-1]).double()
            cov = self.covs.get(name)
            if cov is None:
                cov = self.covs[name] = KroneckerCovariance(
                    a.new_zeros(a.shape[1], a.shape[1]), g.new_zeros(g.shape[1], g.shape[1]), 0, self.with_bias[name])
            cov.cov_in.addmm_(a.T, a)
            cov.cov_out.addmm_(g.T, g)
            cov.num_tokens += a.shape[0]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _select(model: nn.Module, config: CaptureConfig) -> tuple[dict[str, nn.Linear], dict[str, bool]]:
    """The Linear layers (canonical names) a ``GradientCapture`` with ``config`` captures, and which of
    them capture a bias column: exactly the capture's own selection rule."""
    modules = {n: m for n, m in select_linears(model, config).items() if isinstance(m, nn.Linear)}
    return modules, {n: config.include_bias and m.bias is not None for n, m in modules.items()}


def estimate_covariances(model: nn.Module, batches: Iterable[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                         config: CaptureConfig, *, distributed: bool = False) -> dict[str, KroneckerCovariance]:
    """Sum ``a aᵀ`` and ``g gᵀ`` over every token of ``batches`` for each Linear ``config`` selects.

    Runs ``loss_fn(model, batch).backward()`` per batch (no optimizer step) in eval mode (no dropout);
    the parameters' ``.grad`` and the model's training mode are restored afterwards. ``loss_fn`` should
    return the **summed** token loss (the gradient convention); a constant factor only rescales the
    eigenvalues. ``distributed=True`` (every rank of the default group must call): the sums are
    all-reduced, so each rank returns the covariances of all ranks' batches.
    """
    modules, with_bias = _select(model, config)
    params = list(model.parameters())
    saved_grads = [p.grad for p in params]
    was_training = model.training
    hooks = _CovarianceHooks(modules, with_bias)
    seen = 0
    try:
        for p in params:
            p.grad = None       # fresh tensors: the saved ones are not accumulated into
        model.eval()
        with torch.enable_grad():
            for batch in batches:
                loss = loss_fn(model, batch)
                loss.backward()
                for p in params:
                    p.grad = None
                seen += 1
    finally:
        hooks.remove()
        model.train(was_training)
        for p, g in zip(params, saved_grads):
            p.grad = g
    covs = hooks.covs
    if distributed:
        covs = _all_reduce(covs, modules, with_bias)
    missing = sorted(set(modules) - set(covs))
    if not covs and not seen:
        raise EigenBasisError("estimating the eigenbasis: no batches were given (the batches iterable was empty"
                              f"{' on this rank, and no rank reached a layer' if distributed else ''})")
    if missing:
        raise EigenBasisError(f"layers {missing} received no gradient while estimating the eigenbasis; if the "
                              "model calls them through F.linear capture cannot see them: add them to capture.exclude")
    return {n: covs[n] for n in sorted(covs)}


def _comm_device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
            else torch.device("cpu"))


def _all_reduce(covs: dict[str, KroneckerCovariance], modules: dict[str, nn.Linear],
                with_bias: dict[str, bool]) -> dict[str, KroneckerCovariance]:
    device, out = _comm_device(), {}
    for name in sorted(modules):      # the same order on every rank; a layer a rank never saw adds zeros
        m = modules[name]
        n_in = m.in_features + with_bias[name]
        cov = covs.get(name) or KroneckerCovariance(torch.zeros(n_in, n_in, dtype=torch.float64),
                                                    torch.zeros(m.out_features, m.out_features, dtype=torch.float64),
                                                    0, with_bias[name])
        parts = [cov.cov_in.to(device), cov.cov_out.to(device),
                 torch.tensor([float(cov.num_tokens)], dtype=torch.float64, device=device)]
        for t in parts:
            dist.all_reduce(t)
        if parts[2].item() > 0:
            out[name] = KroneckerCovariance(parts[0], parts[1], int(parts[2].item()), with_bias[name])
    return out


def _eigh_desc(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vectors [n, n] float64 rows, values [n] float64)`` of a symmetric matrix, largest eigenvalue
    first, each row's largest-|entry| (first on ties) positive."""
    values, vectors = torch.linalg.eigh(cov.detach().to("cpu", torch.float64))
    return fix_signs(vectors.flip(1).T.contiguous()), values.flip(0).contiguous()


def fix_signs(rows: torch.Tensor) -> torch.Tensor:
    """Each row's largest-|entry| (first on ties) made positive: one covariance, one set of matrices."""
    pivot = rows.abs().argmax(dim=1, keepdim=True)
    return rows * torch.where(rows.gather(1, pivot) < 0, -1.0, 1.0).to(rows.dtype)


BUDGET_DAMPING = 0.1
"""λ of the budget split, relative to the mean K-FAC eigenvalue: influence's default damping ratio."""


def _damping(ev_out: torch.Tensor, ev_in: torch.Tensor, damping: float) -> float:
    """``λ = damping · mean κ`` over the layer's whole ``κ = s ⊗ a`` grid."""
    return damping * float(ev_out.sum()) * float(ev_in.sum()) / (len(ev_out) * len(ev_in))


def split_budget(weights: dict[str, float], budget: int, limits: dict[str, int] | None = None) -> dict[str, int]:
    """``budget`` floats as ``{layer: share}``: one float each, the rest in proportion to ``weights``
    (largest remainders). A layer whose share would pass its ``limit`` (the most it can hold) gets
    the limit and the excess is split again over the others, so the shares sum to exactly ``budget``
    unless every layer is at its limit."""
    names = sorted(weights)
    if budget < len(names):
        raise EigenBasisError(f"capture.budget is {budget} floats per example but {len(names)} layers are "
                              f"captured: every layer needs at least one (raise the budget or capture fewer layers)")
    limits = limits or {}
    full: dict[str, int] = {}
    while True:
        free = [n for n in names if n not in full]
        if not free:
            return full
        rest = budget - sum(full.values())
        total = sum(weights[n] for n in free)
        quota = {n: (rest - len(free)) * (weights[n] / total if total > 0 else 1 / len(free)) for n in free}
        share = {n: 1 + int(quota[n]) for n in free}
        for n in sorted(free, key=lambda n: (int(quota[n]) - quota[n], n))[:rest - sum(share.values())]:
            share[n] += 1
        over = [n for n in free if share[n] > limits.get(n, share[n])]
        if not over:
            return {**full, **share}
        full.update({n: limits[n] for n in over})


def best_rectangle(ev_out: torch.Tensor, ev_in: torch.Tensor, share: int, cap: tuple[int, int],
                   damping: float = BUDGET_DAMPING) -> tuple[int, int]:
    """The ``(a, b)``, ``a·b <= share``, each side at most ``cap`` and the layer's width, whose top
    ``a × b`` eigenvector rectangle holds the most effective dimension ``Σ κ/(κ+λ)`` (``κ = s_o·a_i``
    from the descending spectra, ``λ = damping · mean κ``); the narrowest output side on ties."""
    ev_out, ev_in = (v.to(torch.float64).clamp(min=0) for v in (ev_out, ev_in))
    lam = _damping(ev_out, ev_in, damping)
    kappa = torch.outer(ev_out[:min(cap[0], len(ev_out))], ev_in[:min(cap[1], len(ev_in))])
    value = kappa / (kappa + lam) if lam > 0 else torch.zeros_like(kappa)
    mass = value.cumsum(0).cumsum(1)                 # mass[a-1, b-1]: Σ over the top a × b rectangle
    best = None
    for a in range(1, min(mass.shape[0], share) + 1):
        b = min(mass.shape[1], share // a)
        kept = float(mass[a - 1, b - 1])
        if best is None or kept > best[0] + 1e-12:
            best = (kept, a, b)
    return best[1], best[2]


def allocate_budget(spectra: dict[str, tuple[torch.Tensor, torch.Tensor]], budget: int,
                    cap: tuple[int, int], damping: float = BUDGET_DAMPING) -> dict[str, tuple[int, int]]:
    """Split ``budget`` floats per example across layers: ``{name: (k_out, k_in)}``.

    ``spectra[name] = (eigenvalues of E[g gᵀ], of E[a aᵀ])``, descending. The K-FAC curvature of the
    Kronecker direction ``(o, i)`` is ``κ = s_o·a_i``, and influence damps it with
    ``λ = damping · mean κ``. Directions with ``κ > λ`` are the ones the damped inverse keeps
    (each carries about the same weight in an influence score, the rest are damped away), so a layer's
    share of the budget is proportional to their count (:func:`split_budget`; a layer's share is at
    most its capped ``k_out·k_in``, the excess goes to the others), and within it the layer keeps
    :func:`best_rectangle`.
    """
    counts = {}
    for name, (ev_out, ev_in) in spectra.items():
        ev_out, ev_in = (v.to(torch.float64).clamp(min=0) for v in (ev_out, ev_in))
        lam = _damping(ev_out, ev_in, damping)
        # #{s_o·a_i > λ} without forming the n_out × n_in grid: per o, the a_i above λ / s_o (the same
        # count up to rounding at exact ties)
        above = len(ev_in) - torch.searchsorted(ev_in.flip(0), lam / ev_out.clamp(min=1e-300), right=True)
        counts[name] = max(int(above.sum()), 1) if lam > 0 else 1
    limits = {n: min(cap[0], len(s)) * min(cap[1], len(a)) for n, (s, a) in spectra.items()}
    shares = split_budget(counts, budget, limits)
    return {name: best_rectangle(*spectra[name], shares[name], cap, damping) for name in sorted(spectra)}


def eigenbasis_from_covariances(
        covs: dict[str, KroneckerCovariance], k: int | tuple[int, int], *, budget: int = 0,
        agree: Callable[[dict[str, tuple[int, int]]], dict[str, tuple[int, int]]] | None = None) -> EigenBasis:
    """Top-``k`` eigenvectors (``k``: both sides, or ``(k_out, k_in)``) of each layer's covariances;
    a side narrower than its k keeps its full eigenbasis (a projector uses the identity there).

    ``budget`` > 0: each layer keeps the widths :func:`allocate_budget` gives it (``k`` caps each side),
    passed through ``agree`` when given (a distributed estimate replaces them with rank 0's)."""
    k_out, k_in = (k, k) if isinstance(k, int) else k

    def top(cov: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        vectors, values = _eigh_desc(cov)
        return vectors[:rows].clone(), values          # every eigenvalue (the split needs them), k rows

    means = {name: cov.mean() for name, cov in covs.items()}
    decomposed = {name: (top(m_out, k_out), top(m_in, k_in)) for name, (m_out, m_in) in means.items()}
    if budget:
        dims = allocate_budget({n: (d[0][1], d[1][1]) for n, d in decomposed.items()}, budget, (k_out, k_in))
        dims = agree(dims) if agree is not None else dims
    layers = {}
    for name, cov in covs.items():
        cov_out, cov_in = means[name]
        (rows_out, vals_out), (rows_in, vals_in) = decomposed[name]
        ko, ki = dims[name] if budget else (k_out, k_in)
        p_out, v_out = rows_out[:ko].float().contiguous(), vals_out[:ko].contiguous()
        p_in, v_in = rows_in[:ki].float().contiguous(), vals_in[:ki].contiguous()
        layers[name] = LayerBasis(proj_out=p_out, proj_in=p_in, eigvals_out=v_out, eigvals_in=v_in,
                                  trace_out=float(torch.trace(cov_out)), trace_in=float(torch.trace(cov_in)),
                                  bias=cov.bias, num_tokens=cov.num_tokens)
        for side, values, n in (("out", v_out, cov_out.shape[0]), ("in", v_in, cov_in.shape[0])):
            live = int((values > values[0] * 1e-10).sum()) if values[0] > 0 else 0
            if live < values.numel() < n:      # (a side with k >= n is the identity: nothing is arbitrary)
                log.warning("eigenbasis: layer %s %sput side has only %d directions with variance among its top %d "
                            "(from %d tokens); the rest are arbitrary null-space directions: use more tokens",
                            name, side, live, values.numel(), cov.num_tokens)
    return EigenBasis(layers, budget=budget, cap=(k_out, k_in))


def estimate_eigenbasis(model: nn.Module, batches: Iterable[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                        config: CaptureConfig, *, k: int | tuple[int, int] | None = None,
                        distributed: bool = False) -> EigenBasis:
    """The KFAC eigenbasis of every Linear ``config`` selects, from one pass over ``batches``.

    Args:
        model: the (possibly DDP/FSDP-wrapped) model; layers are named canonically like capture's.
        batches: a few representative batches (any objects ``loss_fn`` accepts).
        loss_fn: ``loss_fn(model, batch)`` → the batch's **summed** token loss (a scalar tensor).
        config: the capture config: layer selection (``modules``/``exclude``), ``include_bias``, and
            ``proj_dim`` as the default ``k``.
        k: eigenvectors kept per side (default: the widest ``proj_dim`` of ``config``, overrides
            included); capture may later use any smaller k with the same file.
        distributed: every rank calls with its own batches; covariances are summed over the default
            process group and rank 0's matrices broadcast, so all ranks return the identical basis.

    Returns an :class:`EigenBasis` (``.save(path)`` freezes it for ``capture.basis``).
    """
    k = config.max_dims if k is None else k
    if (k if isinstance(k, int) else min(k)) < 1:
        raise ConfigError(f"k must be >= 1 per side (capture.proj_dim is {config.proj_dim!r}; 0 means exact)")
    covs = estimate_covariances(model, batches, loss_fn, config, distributed=distributed)
    world = distributed and dist.get_world_size() > 1
    # every rank takes rank 0's split (eigh may differ in the last bit across ranks), so the matrices
    # broadcast below have one shape everywhere
    basis = eigenbasis_from_covariances(covs, k, budget=config.budget, agree=_broadcast_dims if world else None)
    if world:
        basis = _broadcast(basis)
    if config.budget:
        log.info("eigenbasis: capture.budget %d floats per example split over %d layers (%d used): %s", config.budget,
                 len(basis.layers), sum(a * b for a, b in map(basis.dims, basis.layers)),
                 ", ".join(f"{n} {a}x{b}" for n, (a, b) in ((n, basis.dims(n)) for n in basis.layers)))
    for name, lb in basis.layers.items():
        out_frac, in_frac = lb.explained()
        log.info("eigenbasis %s: k=(%d, %d) keeps %.1f%% of tr E[ggᵀ], %.1f%% of tr E[aaᵀ] (%d tokens)",
                 name, lb.proj_out.shape[0], lb.proj_in.shape[0], 100 * out_frac, 100 * in_frac, lb.num_tokens)
    return basis


def _broadcast(basis: EigenBasis) -> EigenBasis:
    """Rank 0's matrices on every rank (eigh may differ in the last bit across devices/libraries)."""
    device, layers = _comm_device(), {}
    for name, lb in basis.layers.items():
        fields = {}
        for f in ("proj_out", "proj_in", "eigvals_out", "eigvals_in"):
            t = getattr(lb, f).to(device)
            dist.broadcast(t, src=0)
            fields[f] = t.cpu()
        traces = torch.tensor([lb.trace_out, lb.trace_in], dtype=torch.float64, device=device)
        dist.broadcast(traces, src=0)
        layers[name] = dataclasses.replace(lb, **fields, trace_out=traces[0].item(), trace_in=traces[1].item())
    return EigenBasis(layers, budget=basis.budget, cap=basis.cap)


def _broadcast_dims(dims: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Rank 0's per-layer widths (every rank holds the same layer names)."""
    names = sorted(dims)
    t = torch.tensor([dims[n] for n in names], dtype=torch.int64, device=_comm_device())
    dist.broadcast(t, src=0)
    return {n: (int(a), int(b)) for n, (a, b) in zip(names, t.tolist())}
