"""Optimizer-aware scores: gradients divided by Adam's second moment (TrackStar, LESS), in projected space.

AdamW moves weight ``w_ij`` by ``η·m_ij / (√v̂_ij + ε)``, so what an example did to the model is its
gradient rescaled elementwise by ``u = 1 / (√v̂ + ε)`` (``v̂ = exp_avg_sq / (1 − β₂ᵗ)``), not ``η·G``.
TrackStar (Chang et al. 2024) scores ``⟨G_q ⊘ √v̂, G_i ⊘ √v̂⟩`` (unit-normalised: ``gradcos``), i.e. a
diagonal-Fisher inner product; LESS (Xia et al. 2024) takes the cosine of the query gradient with the
training example's Adam step ``u ⊙ G_i`` (one-sided). A store holds only ``Ĝ = P_out G P_inᵀ``
(``P_out [k_out, n_out]``, ``P_in [k_in, n_in(+1)]``, bias column last), from which ``u ⊙ G`` cannot be
formed. The approximation here, per layer:

1. **Rank-1 preconditioner**: ``u ≈ r cᵀ`` (``r [n_out]``, ``c [n_in(+1)]``), fitted in log space:
   ``log r_i = mean_j log u_ij``, ``log c_j = mean_i log u_ij − mean log u``. This is the least-squares
   fit of ``log u`` by a row plus a column term, i.e. it minimises the *relative* error of
   ``r_i c_j`` over all entries equally. Relative error is what matters: after the correction every
   entry ``g_ij u_ij`` has about the same size (v ≈ E[g²]), so a fit in linear scale (Frobenius /
   SVD) would be dominated by the few entries with tiny ``v`` (dead units, ``u`` up to 1/ε). Exact
   (up to a scale shared by ``r`` and ``c``) whenever ``u`` is rank-1. ``fit="adafactor"`` is
   Adafactor's factorisation of ``v`` instead (row sums × column sums / total, ε ignored).
   Then ``G ⊘ (√v̂+ε) ≈ diag(r) G diag(c)``.
2. **Captured subspace**: ``G ≈ P_out⁺ Ĝ P_in⁺ᵀ`` (the minimum-norm gradient with those rows; ``P⁺ = Pᵀ``
   for orthonormal rows), so ``P_out diag(r) G diag(c) P_inᵀ ≈ M_out Ĝ M_inᵀ`` with
   ``M_out = P_out diag(r) P_out⁺ [k_out, k_out]`` and ``M_in = P_in diag(c) P_in⁺ [k_in, k_in]``.
   Exact when each side's row space is invariant under ``diag(r)`` / ``diag(c)`` — an identity
   (``k ≥ n``) side, or ``r`` constant — or when ``G`` lies in the captured subspace. With a constant
   ``u`` (SGD) ``M`` is that constant times the identity, for any ``P``.

So the result is exactly TrackStar's ``u ⊙ G`` when both sides are unprojected and ``u`` is rank-1.
``mode="diag"`` keeps only the diagonals of ``M_out``, ``M_in`` (each stored coordinate scaled by the
preconditioner averaged over its direction: cheaper, and exact for coordinate-aligned projections);
``mode="elementwise"`` applies the full ``u`` and needs unprojected rows (exact TrackStar).

Example::

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ...                                                    # train; then capture rows with `cap`
    corr = AdamCorrection.from_optimizer(opt, model, cap)  # or from_checkpoint("exp_avg_sq.safetensors", cap)
    result = attribute(store, queries, method="adam-gradcos", correction=corr)

Legend: ``_OI`` a layer's ``[n_out, n_in(+1)]``; ``_KO`` / ``_KI`` projector rows; ``_KK`` ``[k, k]``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..capture.hooks import canonical_name
from ..capture.projection import matrices_digest
from ..config import ConfigError
from ..errors import TDAError
from ..store.record import LowRank
from .base import register_method
from .graddot import GradCos, GradDot

__all__ = ["AdamCorrection", "AdamCorrectionError", "LayerCorrection", "AdamCorrected", "AdamGradDot",
           "AdamGradCos", "exp_avg_sq_from_optimizer", "exp_avg_sq_from_state_dict"]

log = logging.getLogger(__name__)

MODES = ("kron", "diag", "elementwise")
FITS = ("log", "adafactor")
SIDES = ("both", "train")


class AdamCorrectionError(TDAError, ValueError):
    """The optimizer state does not fit the captured layers; the message names the layer and the fix."""


@dataclass(frozen=True, eq=False)
class LayerCorrection:
    """One layer's correction of stored rows ``Ĝ [k_out, k_in]``: ``M_out Ĝ M_inᵀ`` with ``out`` = ``M_out``
    and ``in_`` = ``M_in``, each a ``[k, k]`` matrix or a ``[k]`` vector standing for a diagonal one
    (``diag`` mode, and any unprojected side); or, ``elementwise``, ``u ⊙ Ĝ`` with ``out`` = ``u``."""

    mode: str
    out: torch.Tensor
    in_: torch.Tensor | None
    fit_error: float
    """RMS of the rank-1 fit's residual of ``log u`` (0: u is rank-1; 0.1: typically 10% off per entry)."""
    digest: str
    """The first 16 hex digits of the projector matrices' digest (as in a store's projector spec)."""
    r: torch.Tensor | None = None
    """``[n_out]`` float32: the rank-1 fit's row factor (``u ≈ r cᵀ``)."""
    c: torch.Tensor | None = None
    """``[n_in(+1)]`` float32: its column factor (bias column last)."""

    @property
    def shape(self) -> tuple[int, int]:
        """``(k_out, k_in)`` of the rows it applies to."""
        if self.mode == "elementwise":
            return tuple(self.out.shape)
        return (self.out.shape[0], self.in_.shape[0])

    def apply(self, grads: "torch.Tensor | LowRank") -> "torch.Tensor | LowRank":
        """Corrected rows ``[n, k_out, k_in]``: dense in, dense out; factors stay factors (``A ← M_out A``,
        ``B ← M_in B``: the same rank) except under ``elementwise``."""
        if self.mode == "elementwise":
            grads = grads.dense() if isinstance(grads, LowRank) else grads
            return grads * self.out.to(grads.dtype)
        if isinstance(grads, LowRank):
            return LowRank(_left(self.out, grads.A), _left(self.in_, grads.B))
        return _left(self.in_, _left(self.out, grads).transpose(1, 2)).transpose(1, 2)


def _left(m: torch.Tensor, x_NKC: torch.Tensor) -> torch.Tensor:
    """``M x`` for each of the n matrices ``x [K, C]``; a vector ``m`` is a diagonal ``M``."""
    m = m.to(x_NKC.dtype)
    return x_NKC * m[:, None] if m.ndim == 1 else torch.matmul(m, x_NKC)


def _matrices(proj: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(proj, "matrices"):
        return proj.matrices()
    if isinstance(proj, (tuple, list)) and len(proj) == 2:
        return proj[0], proj[1]
    raise TypeError(f"a projection must be a Projector (GradientCapture(...).projectors[name]) or a (P_out, P_in) "
                    f"pair, got {type(proj).__name__}")


def _is_identity(mat: torch.Tensor) -> bool:
    """Without forming an eye (an unprojected MLP side is 8192 wide)."""
    return (mat.ndim == 2 and mat.shape[0] == mat.shape[1] and bool((torch.diagonal(mat) == 1).all())
            and int(mat.count_nonzero()) == mat.shape[0])


def _fit_rank1(v_OI: torch.Tensor, eps: float, fit: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``(log u, r, c, rms log residual)`` for ``u = 1/(√v + ε)``; float64 reductions over a float32
    matrix (an OLMo-7B MLP matrix has 45M entries)."""
    log_u = -torch.log(v_OI.float().sqrt() + eps)                            # [O, I] float32
    if fit == "log":
        log_r = log_u.mean(1, dtype=torch.float64)
        log_c = log_u.mean(0, dtype=torch.float64) - log_r.mean()
        r, c = log_r.exp(), log_c.exp()
    else:                                   # Adafactor: v ≈ R Cᵀ / S, so 1/√v ≈ (1/√R)(√S/√C)ᵀ
        row = v_OI.sum(1, dtype=torch.float64).clamp_min(1e-300)
        col = v_OI.sum(0, dtype=torch.float64).clamp_min(1e-300)
        r, c = row.rsqrt(), col.rsqrt() * row.sum().sqrt()
        log_r, log_c = r.log(), c.log()
    resid = log_u - log_r.float()[:, None] - log_c.float()[None, :]
    return log_u, r, c, float(resid.square().mean(dtype=torch.float64).sqrt())


def _side(proj_KN: torch.Tensor, scale_N: torch.Tensor, mode: str) -> torch.Tensor:
    """``M = P diag(s) P⁺`` (``kron``) or its diagonal (``diag``), float64; an identity side is
    ``diag(s)`` itself, kept as the vector ``s``."""
    if _is_identity(proj_KN):
        return scale_N.clone()
    p = proj_KN.double()
    m = (p * scale_N[None, :]) @ torch.linalg.pinv(p)
    return m if mode == "kron" else torch.diagonal(m).clone()


class AdamCorrection:
    """Per-layer Adam corrections of projected rows (see the module docstring for the approximation).

    Build with :meth:`from_optimizer` (a live ``torch.optim.Adam``/``AdamW``), :meth:`from_checkpoint`
    (a safetensors file of ``exp_avg_sq`` by parameter name) or :meth:`from_optimizer_state` (a dict).
    """

    def __init__(self, layers: Mapping[str, LayerCorrection], *, mode: str, fit: str, eps: float,
                 bias_correction: float):
        self.layers = dict(layers)
        self.mode, self.fit, self.eps, self.bias_correction = mode, fit, eps, bias_correction

    def matrices(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(M_out [k_out, k_out], M_in [k_in, k_in])`` of a layer; a ``[k]`` vector stands for a
        diagonal matrix (``diag`` mode, and an unprojected side in any mode)."""
        layer = self.layers[name]
        if layer.mode == "elementwise":
            raise AdamCorrectionError(f"layer {name!r}: an elementwise correction has no (M_out, M_in)")
        return layer.out, layer.in_

    def scales(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{layer: (r [n_out], c [n_in(+1)])}``, the rank-1 preconditioner, for
        :meth:`GradientCapture.scaled <olmo_tda.capture.GradientCapture.scaled>`: rows captured inside
        ``with cap.scaled(corr.scales()):`` are ``P_out diag(r) G diag(c) P_inᵀ`` exactly, for any
        projector (no captured-subspace assumption; score them with plain ``graddot``/``gradcos``)."""
        return {n: (layer.r, layer.c) for n, layer in self.layers.items()}

    @property
    def info(self) -> dict[str, Any]:
        return {"mode": self.mode, "fit": self.fit, "eps": self.eps, "bias_correction": self.bias_correction,
                "fit_error": {n: round(c.fit_error, 4) for n, c in self.layers.items()}}

    def check(self, grads: Mapping[str, "torch.Tensor | LowRank"]) -> None:
        """Refuse rows of a layer without a correction, or of another shape than it was built for."""
        missing = [n for n in grads if n not in self.layers]
        if missing:
            raise AdamCorrectionError(f"no Adam correction for layers {missing[:5]} (it covers "
                                      f"{sorted(self.layers)[:5]}...): build it from the same capture as the store, "
                                      "or pass layers=")
        for name, g in grads.items():
            shape = tuple(g.shape[1:])
            if shape != self.layers[name].shape:
                raise AdamCorrectionError(f"layer {name!r}: rows of shape {shape} but the correction was built for "
                                          f"{self.layers[name].shape}: build it with the store's projectors")

    def apply(self, grads: Mapping[str, "torch.Tensor | LowRank"]) -> dict[str, "torch.Tensor | LowRank"]:
        """Corrected ``{layer: rows [n, k_out, k_in]}`` (after :meth:`check`)."""
        self.check(grads)
        return {name: self.layers[name].apply(g) for name, g in grads.items()}

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_optimizer_state(cls, exp_avg_sq: Mapping[str, torch.Tensor], projections: Any, *, eps: float = 1e-8,
                             bias_correction: float = 1.0, mode: str = "kron", fit: str = "log",
                             layers: Iterable[str] | None = None, transposed: Iterable[str] = ()) -> "AdamCorrection":
        """Corrections of the captured layers from Adam's second moments.

        Args:
            exp_avg_sq: parameter name -> ``exp_avg_sq`` (``weight [n_out, n_in]``, ``bias [n_out]``);
                wrapper segments (``module.``, ``_fsdp_wrapped_module.``) are ignored.
            projections: a :class:`~olmo_tda.GradientCapture` (its ``projectors``; token tables are
                found from its modules) or ``{layer: Projector | (P_out, P_in)}``. A ``P_in`` one
                column wider than the weight means the bias is captured: its ``exp_avg_sq`` is needed.
            eps: Adam's ε (``u = 1/(√v̂ + ε)``).
            bias_correction: ``1 − β₂ᵗ`` (``v̂ = v / bias_correction``); 1 leaves v as given.
            mode: ``kron`` (default), ``diag`` or ``elementwise`` (unprojected rows only).
            fit: the rank-1 fit, ``log`` (default) or ``adafactor``.
            layers: which captured layers (default all).
            transposed: layers whose weight is stored ``[n_in, n_out]`` (token tables: ``[V, d]``);
                found automatically from a GradientCapture.
        """
        if mode not in MODES:
            raise AdamCorrectionError(f"mode must be one of {MODES}, got {mode!r}")
        if fit not in FITS:
            raise AdamCorrectionError(f"fit must be one of {FITS}, got {fit!r}")
        if not (eps >= 0 and bias_correction > 0):
            raise AdamCorrectionError(f"eps must be >= 0 and bias_correction > 0, got {eps!r} and {bias_correction!r}")
        transposed = set(transposed)
        if hasattr(projections, "projectors"):
            modules = getattr(projections, "modules", {})
            transposed |= {n for n, m in modules.items() if isinstance(m, nn.Embedding)}
            projections = projections.projectors
        v_by_name = {canonical_name(k): v for k, v in exp_avg_sq.items()}
        chosen = list(layers) if layers is not None else list(projections)
        unknown = [n for n in chosen if n not in projections]
        if unknown:
            raise AdamCorrectionError(f"layers {unknown[:5]} are not captured (captured: {list(projections)[:5]}...)")
        out = {}
        for name in chosen:
            p_out, p_in = _matrices(projections[name])
            v_OI = _layer_v(name, v_by_name, p_out.shape[1], p_in.shape[1], name in transposed) / bias_correction
            if eps == 0 and bool((v_OI == 0).any()):
                raise AdamCorrectionError(f"layer {name!r}: exp_avg_sq has zeros and eps is 0 (1/√v is infinite); "
                                          "pass Adam's eps")
            log_u, r, c, err = _fit_rank1(v_OI, eps, fit)
            digest = matrices_digest(p_out.float().contiguous(), p_in.float().contiguous())[:16]
            if mode == "elementwise":
                if not (_is_identity(p_out) and _is_identity(p_in)):
                    raise AdamCorrectionError(
                        f"layer {name!r}: mode='elementwise' needs unprojected rows (proj_dim 0), but its projectors "
                        f"are {tuple(p_out.shape)} and {tuple(p_in.shape)}; use mode='kron' for projected rows")
                out[name] = LayerCorrection(mode, log_u.exp(), None, 0.0, digest, r.float(), c.float())
                continue
            out[name] = LayerCorrection(mode, _side(p_out, r, mode).float(), _side(p_in, c, mode).float(), err, digest,
                                        r.float(), c.float())
        if out:
            worst = max(out, key=lambda n: out[n].fit_error)
            log.info("tda/adam: rank-1 fit of 1/sqrt(v) (%s), worst rms log residual %.3f (%s)", fit,
                     out[worst].fit_error, worst)
        return cls(out, mode=mode, fit=fit, eps=eps, bias_correction=bias_correction)

    @classmethod
    def from_checkpoint(cls, path: "str | os.PathLike[str]", projections: Any, **options: Any) -> "AdamCorrection":
        """From a safetensors file of ``exp_avg_sq`` tensors keyed by parameter name (no pickle); see
        :meth:`from_optimizer_state` for ``options`` (pass Adam's ``eps`` and ``bias_correction``)."""
        from safetensors.torch import load_file

        try:
            state = load_file(os.fspath(path))
        except (OSError, ValueError, RuntimeError) as e:
            raise AdamCorrectionError(f"cannot read exp_avg_sq from {os.fspath(path)!r}: {e}") from e
        return cls.from_optimizer_state(state, projections, **options)

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, model: nn.Module, projections: Any,
                       **options: Any) -> "AdamCorrection":
        """From a live Adam/AdamW: its ``exp_avg_sq``, ``eps`` and bias correction ``1 − β₂ᵗ`` (per
        parameter, from its step); ``options`` as in :meth:`from_optimizer_state` (an explicit ``eps``
        wins)."""
        if "bias_correction" in options:
            raise AdamCorrectionError("from_optimizer applies each parameter's own bias correction 1 - beta2^step; "
                                      "pass bias_correction only to from_optimizer_state / from_checkpoint")
        exp_avg_sq, eps = exp_avg_sq_from_optimizer(optimizer, model)
        if "eps" not in options:
            if len(set(eps.values())) > 1:
                raise AdamCorrectionError(f"the optimizer's parameter groups use several eps "
                                          f"{sorted(set(eps.values()))}: pass eps= explicitly")
            options["eps"] = next(iter(eps.values()), 1e-8)
        return cls.from_optimizer_state(exp_avg_sq, projections, **options)


def _layer_v(name: str, v_by_name: Mapping[str, torch.Tensor], n_out: int, n_in: int, transposed: bool
             ) -> torch.Tensor:
    """``v [n_out, n_in]`` of a layer: its weight's, transposed for a token table, with the bias's
    appended as the last column when ``n_in`` counts one."""
    key = f"{name}.weight"
    if key not in v_by_name:
        near = sorted(k for k in v_by_name if k.startswith(name))[:3] or sorted(v_by_name)[:3]
        raise AdamCorrectionError(f"no exp_avg_sq for captured layer {name!r} (looked for {key!r}; the state has "
                                  f"{len(v_by_name)} tensors, e.g. {near}): pass the optimizer state of the captured "
                                  "model, keyed by parameter name")
    v = v_by_name[key].detach().to("cpu", torch.float32)
    if transposed and v.ndim == 2:
        v = v.T
    width = v.shape[1] if v.ndim == 2 else -1
    if v.ndim != 2 or v.shape[0] != n_out or width not in (n_in, n_in - 1):
        raise AdamCorrectionError(
            f"layer {name!r}: exp_avg_sq of {key} has shape {tuple(v_by_name[key].shape)}, but its projectors take "
            f"gradients of shape ({n_out}, {n_in}) (bias column included when captured)"
            + (" after transposing the token table" if transposed else
               "; a token table ([V, d] weight) must be listed in transposed="))
    if width == n_in - 1:                   # the bias column
        bkey = f"{name}.bias"
        if bkey not in v_by_name:
            raise AdamCorrectionError(f"layer {name!r} captures its bias but the state has no exp_avg_sq for {bkey!r}")
        vb = v_by_name[bkey].detach().to("cpu", torch.float32)
        if tuple(vb.shape) != (n_out,):
            raise AdamCorrectionError(f"layer {name!r}: exp_avg_sq of {bkey} has shape {tuple(vb.shape)}, expected "
                                      f"({n_out},)")
        v = torch.cat([v, vb[:, None]], dim=1)
    bad = ~torch.isfinite(v)
    if bool(bad.any()):
        raise AdamCorrectionError(f"layer {name!r}: {int(bad.sum())} of {v.numel()} exp_avg_sq values are NaN/inf "
                                  "(the optimizer state is damaged or the run diverged): use another checkpoint's "
                                  "state")
    if bool((v < 0).any()):
        raise AdamCorrectionError(f"layer {name!r}: exp_avg_sq has negative values: is it really Adam's second moment?")
    return v


def exp_avg_sq_from_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module
                              ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``({parameter name: exp_avg_sq / (1 − β₂ᵗ)}, {parameter name: eps})`` of a live Adam/AdamW
    (parameters matched by identity; names canonical). Parameters it never stepped are left out."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    v, eps = {}, {}
    for name, p in model.named_parameters():
        st = optimizer.state.get(p, {})
        if "exp_avg_sq" not in st or id(p) not in group_of:
            continue
        group = group_of[id(p)]
        beta2 = group.get("betas", (0.9, 0.999))[1]
        step = float(st.get("step", 0))
        bc = 1 - beta2 ** step if step > 0 else 1.0
        v[canonical_name(name)] = st["exp_avg_sq"].detach() / bc
        eps[canonical_name(name)] = float(group.get("eps", 1e-8))
    if not v:
        raise AdamCorrectionError("the optimizer holds no exp_avg_sq for the model's parameters: is it an Adam "
                                  "that has taken a step, built over this model's parameters?")
    return v, eps


def exp_avg_sq_from_state_dict(state_dict: Mapping[str, Any], param_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """``{parameter name: exp_avg_sq}`` from ``torch.optim`` ``state_dict()`` output (not bias-corrected).

    Its ``state`` is keyed by position in the order the parameters were given to the optimizer
    (``param_names``: e.g. ``[n for n, _ in model.named_parameters()]``); a state keyed by names is
    taken as is."""
    state = state_dict["state"]
    order = [i for g in state_dict["param_groups"] for i in g["params"]]
    if len(order) != len(param_names) and not all(isinstance(k, str) for k in state):
        raise AdamCorrectionError(f"the optimizer state covers {len(order)} parameters but {len(param_names)} names "
                                  "were given: pass the names in the order the optimizer was built with")
    names = dict(zip(order, param_names))
    return {canonical_name(k if isinstance(k, str) else names[k]): s["exp_avg_sq"]
            for k, s in state.items() if "exp_avg_sq" in s}


# ---------------------------------------------------------------------------------------------
# scoring


class AdamCorrected:
    """Wraps a gradient-similarity method so it scores Adam-corrected rows: queries too with
    ``sides="both"`` (TrackStar: ``⟨u⊙G_q, u⊙G_i⟩``), training rows only with ``"train"`` (LESS: the
    query gradient against the example's Adam step ``u⊙G_i``)."""

    def __init__(self, inner: Any, correction: AdamCorrection, sides: str = "both"):
        if not isinstance(correction, AdamCorrection):
            raise TypeError(f"{inner.name}: correction must be an AdamCorrection (AdamCorrection.from_optimizer / "
                            f"from_checkpoint), got {type(correction).__name__}")
        if sides not in SIDES:
            raise ConfigError(f"adam-{inner.name}: sides must be one of {SIDES}, got {sides!r}")
        if hasattr(inner, "fit"):
            raise ConfigError(f"adam-{inner.name}: methods that fit on the store's rows are not supported")
        self.inner, self.correction, self.sides = inner, correction, sides
        self.name = f"adam-{inner.name}"
        self.info = {**getattr(inner, "info", {}), "sides": sides, **correction.info}

    def fit(self, store: Any, layers: Sequence[str], block_size: int | None = None) -> None:
        """Not a fit: refuse a store whose projectors are not those the correction was built with."""
        if getattr(store, "bases", None):
            raise AdamCorrectionError(f"{self.name}: the store's rows were projected with {len(store.bases)} "
                                      "eigenbasis versions (capture.basis_every) and a correction is built for one "
                                      "projection; "
                                      "score it with graddot/gradcos, or a store of one basis")
        specs = {d.get("name"): d.get("projector") or {} for d in getattr(store, "meta", {}).get("layers", [])
                 if isinstance(d, dict)}
        for name in layers:
            if name not in self.correction.layers:
                raise AdamCorrectionError(f"no Adam correction for layer {name!r}: build it from the store's capture")
            digest = specs.get(name, {}).get("digest")
            if digest and digest != self.correction.layers[name].digest:
                raise AdamCorrectionError(
                    f"layer {name!r}: the store was projected with matrices {digest}, the correction built with "
                    f"{self.correction.layers[name].digest}: build it from the store's capture config")

    def prepare(self, queries: dict[str, torch.Tensor]) -> Any:
        self.correction.check(queries)
        return self.inner.prepare(self.correction.apply(queries) if self.sides == "both" else queries)

    def score_block(self, state: Any, grads: dict) -> torch.Tensor:
        return self.inner.score_block(state, self.correction.apply(grads))


@register_method
class AdamGradDot(AdamCorrected):
    """``graddot`` of Adam-corrected rows (``correction=``: an :class:`AdamCorrection`)."""

    name = "adam-graddot"

    def __init__(self, correction: AdamCorrection, sides: str = "both", route: str = "auto", query_rank: int = 0):
        super().__init__(GradDot(route, query_rank), correction, sides)


@register_method
class AdamGradCos(AdamCorrected):
    """``gradcos`` of Adam-corrected rows (TrackStar with ``sides="both"``, LESS with ``"train"``)."""

    name = "adam-gradcos"

    def __init__(self, correction: AdamCorrection, sides: str = "both", route: str = "auto", query_rank: int = 0):
        super().__init__(GradCos(route, query_rank), correction, sides)
