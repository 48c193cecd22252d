"""Low-rank (LoRIF) factors of per-example gradients, and inner products that never materialize them.

Legend: B examples, T tokens, Ko/Ki projected output/input widths, c the factor rank, Q/N the two
sides of a cross-gram. A projected per-example gradient is ``Ĝ = Σ_t g_t a_tᵀ = gᵀ a`` with token
factors ``g [T, Ko]`` and ``a [T, Ki]``.

- :func:`lowrank_factors`: ``Ĝ ≈ A Bᵀ`` with ``A [Ko, c]``, ``B [Ki, c]``. Exact when ``T ≤ c`` (the
  token factors themselves, zero-padded). Otherwise the best rank-c approximation (truncated SVD)
  computed from thin QRs of the token factors and an SVD of a core of at most T×T: the Ko×Ki
  gradient is never formed.
- Inner products between representations: dense·dense, dense·factor ``sum(A ∘ (Q B))``,
  factor·factor ``sum((A₁ᵀA₂) ∘ (B₁ᵀB₂))`` and ghost (raw token factors)
  ``Σ_{t,s} (a_t·a'_s)(g_t·g'_s)``; :func:`route` picks factorized vs materialized by FLOP count.

Example::

    A, B = lowrank_factors(g_BTKo, a_BTKi, rank=4)      # [B, Ko, 4], [B, Ki, 4]
    scores = dot_factor_factor(A[:2], B[:2], A, B)      # [2, B] = ⟨Ĝ_q, Ĝ_n⟩
"""

from __future__ import annotations

import torch

from ..config import ConfigError

__all__ = ["lowrank_factors", "truncate_dense", "factor_route", "dot_dense_dense", "dot_dense_factor",
           "materialize", "dot_dense_tiles", "dot_factor_factor", "dot_ghost", "route", "cross_gram"]

# Rough FLOP constants of LAPACK's Householder QR and thin SVD on an m×n matrix (p = min(m, n)):
# QR ≈ 2·m·n·p, SVD with vectors ≈ SVD_FLOPS·m·n·p (the token route's ≤T×T core). The dense route's
# Gram matrix and its symmetric eigendecomposition (:func:`truncate_dense`) cost EIGH_FLOPS·p²·max(m, n)
# in the same units: batched small QRs run far below the GEMM rate, so this constant is fitted, not
# counted. Only the ratio of the two routes matters; benchmarks/routing.py measures where they cross
# (at k=64, c=4) and replays its medians under other constants to check these.
_SVD_FLOPS = 4
_EIGH_FLOPS = 0.5


def _qr_flops(m: int, n: int) -> int:
    return 2 * m * n * min(m, n)


def _svd_flops(m: int, n: int) -> int:
    return _SVD_FLOPS * m * n * min(m, n)


def _gram_eigh_flops(m: int, n: int) -> float:
    return _EIGH_FLOPS * min(m, n) ** 2 * max(m, n)


def factor_route(tokens: int, k_out: int, k_in: int, rank: int) -> str:
    """How to get rank-``c`` factors of ``Ĝ = gᵀ a`` from ``T`` token factors, by FLOP count:
    ``"tokens"`` keeps the token factors (exact when T ≤ c, else :func:`lowrank_factors`' QRs of
    2·T·(Ko+Ki)·min(T, k) plus an SVD of the ≤T×T core) or ``"dense"`` forms Ĝ (2·T·Ko·Ki) and
    truncates it (:func:`truncate_dense`: a Gram matrix and its eigendecomposition). Short examples
    keep tokens; long ones go dense."""
    if tokens <= rank:
        return "tokens"
    p, q = min(tokens, k_out), min(tokens, k_in)
    via_tokens = _qr_flops(tokens, k_out) + _qr_flops(tokens, k_in) + _qr_flops(k_out, p) \
        + _qr_flops(k_in, q) + 2 * tokens * p * q + _svd_flops(p, q)
    via_dense = 2 * tokens * k_out * k_in + _gram_eigh_flops(k_out, k_in)
    return "tokens" if via_tokens <= via_dense else "dense"


def lowrank_factors(grads_BTKo: torch.Tensor, acts_BTKi: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [B, Ko, c], B [B, Ki, c])`` with ``A Bᵀ`` the best rank-``c`` approximation of ``gᵀ a``."""
    if rank < 1:
        raise ConfigError(f"rank must be >= 1, got {rank}")
    g, a = grads_BTKo, acts_BTKi
    num, tokens, k_out = g.shape
    k_in = a.shape[-1]
    if tokens <= rank:                       # exact: the token factors, zero-padded to rank columns
        # each pair balanced (equal norms, as U√S and V√S below; a pair with a zero side is zero):
        # output gradients are often orders of magnitude smaller than activations, and a float16
        # store would flush the small side to zero
        # (NaN and inf stay non-finite, so the store still skips such an example)
        g_norm, a_norm = g.norm(dim=-1, keepdim=True), a.norm(dim=-1, keepdim=True)       # [B, T, 1]
        zero = (g_norm == 0) | (a_norm == 0)
        ratio = torch.where(zero, 1, a_norm / torch.where(zero, 1, g_norm)).sqrt()
        A = g.new_zeros(num, k_out, rank)
        B = a.new_zeros(num, k_in, rank)
        A[:, :, :tokens] = (g * torch.where(zero, 0, ratio)).transpose(1, 2)
        B[:, :, :tokens] = (a * torch.where(zero, 0, 1 / ratio)).transpose(1, 2)
        return A, B
    # gᵀa = Rgᵀ (Qgᵀ Qa) Ra with g = Qg Rg, a = Qa Ra; then Rgᵀ = U1 S1, Raᵀ = U2 S2 (thin QRs):
    # gᵀa = U1 (S1 Qgᵀ Qa S2ᵀ) U2ᵀ, an SVD of the small middle factor finishes it.
    qg, rg = torch.linalg.qr(g.double())                 # [B, T, p], [B, p, Ko]
    qa, ra = torch.linalg.qr(a.double())                 # [B, T, q], [B, q, Ki]
    u1, s1 = torch.linalg.qr(rg.transpose(1, 2))         # [B, Ko, p'], [B, p', p]
    u2, s2 = torch.linalg.qr(ra.transpose(1, 2))         # [B, Ki, q'], [B, q', q]
    core = s1 @ (qg.transpose(1, 2) @ qa) @ s2.transpose(1, 2)
    uz, sz, vz = torch.linalg.svd(core, full_matrices=False)
    c = min(rank, sz.shape[-1])
    root = sz[:, :c].sqrt().unsqueeze(1)
    A, B = _pad_rank((u1 @ uz[:, :, :c]) * root, (u2 @ vz.transpose(1, 2)[:, :, :c]) * root, rank)
    return A.to(g.dtype), B.to(a.dtype)


def _pad_rank(A: torch.Tensor, B: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero columns appended up to ``rank`` (a gradient of rank below c is stored at width c)."""
    missing = rank - A.shape[2]
    if missing <= 0:
        return A, B
    return (torch.cat([A, A.new_zeros(*A.shape[:2], missing)], dim=2),
            torch.cat([B, B.new_zeros(*B.shape[:2], missing)], dim=2))


def truncate_dense(grads_BKoKi: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [B, Ko, c], B [B, Ki, c])``: the best rank-``c`` approximation of dense gradients, split as
    ``U √S`` and ``V √S`` like :func:`lowrank_factors`.

    From the eigendecomposition of the Gram matrix of the narrower side (``Ĝ Ĝᵀ`` when Ko ≤ Ki) in
    float64, not an SVD of ``Ĝ``: the top-c eigenvectors ``U`` span the top-c singular subspace, and
    ``Ĝᵀ U = V S`` gives the other side, so ``A Bᵀ = U Uᵀ Ĝ`` is exactly the Eckart–Young
    truncation. The same factors as an SVD's (up to signs), 1.1–2.9× faster on CPU at k ≤ 64
    (LAPACK's batched SVD is the slow part of a capture with ``rank``)."""
    if rank < 1:
        raise ConfigError(f"rank must be >= 1, got {rank}")
    _, k_out, k_in = grads_BKoKi.shape
    left = k_out <= k_in
    m = grads_BKoKi.double() if left else grads_BKoKi.double().transpose(1, 2)      # [B, p, r], p ≤ r
    vals, vecs = torch.linalg.eigh(m @ m.transpose(1, 2))                           # ascending
    c = min(rank, vals.shape[-1])
    u = vecs[:, :, -c:].flip(-1)                                                    # [B, p, c]
    s = vals[:, -c:].flip(-1).clamp_min(0).sqrt()                                   # singular values
    root = s.sqrt().unsqueeze(1)
    # Ĝᵀu_j = s_j v_j, so v_j √s_j = Ĝᵀu_j / √s_j; a zero singular value gets a zero column
    other = (m.transpose(1, 2) @ u) * torch.where(root > 0, 1 / root.clamp_min(1e-300), torch.zeros_like(root))
    A, B = _pad_rank(*((u * root, other) if left else (other, u * root)), rank)
    return A.to(grads_BKoKi.dtype), B.to(grads_BKoKi.dtype)


def dot_dense_dense(q: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``[Q, N]`` of dense ``[Q, Ko, Ki]`` · dense ``[N, Ko, Ki]``."""
    width = q.shape[1] * q.shape[2]            # not -1: either side may have 0 rows
    return q.reshape(len(q), width) @ g.reshape(len(g), width).T


def dot_dense_factor(q: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``[Q, N]`` of dense ``[Q, Ko, Ki]`` · factors ``A [N, Ko, c]``, ``B [N, Ki, c]``: ``sum(A ∘ (q B))``,
    as one GEMM ``[Q·Ko, Ki] @ [Ki, N·c]`` and a reduction over Ko and c."""
    num_q, k_out, k_in = q.shape
    num_n, _, c = A.shape
    qb = q.reshape(num_q * k_out, k_in) @ B.permute(1, 0, 2).reshape(k_in, num_n * c)     # [Q·Ko, N·c]
    prod = qb.view(num_q, k_out, num_n * c) * A.permute(1, 0, 2).reshape(1, k_out, num_n * c)
    return prod.sum(dim=1).view(num_q, num_n, c).sum(dim=2)


def materialize(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, Ko, Ki] = A Bᵀ`` (into ``out`` when given). Rank 1 is a broadcast outer product: a
    batched matmul with an inner dimension of 1 takes a path several times slower on CPU."""
    if A.shape[2] == 1:
        return torch.mul(A, B.transpose(1, 2), out=out)
    return torch.bmm(A, B.transpose(1, 2), out=out)


# Rows materialized at a time by dot_dense_tiles: a tile of ~4 MiB stays in cache between the write
# and the GEMM that reads it (whole blocks of Ko·Ki rows are memory-bound; benchmarks/routing.py).
_TILE_BYTES = 4 << 20


def dot_dense_tiles(q: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``[Q, N]`` of dense ``[Q, Ko, Ki]`` · factors, materializing ``A Bᵀ`` one cache-sized tile of
    rows at a time into a reused buffer, each tile followed by one GEMM against the queries
    (c·Ko·Ki + Q·Ko·Ki multiply-adds per row, against Q·c·Ko·Ki for :func:`dot_dense_factor`)."""
    num_q, k_out, k_in = q.shape
    num_n = A.shape[0]
    dtype = torch.promote_types(q.dtype, A.dtype)
    tile = max(1, min(num_n, _TILE_BYTES // (k_out * k_in * dtype.itemsize)))
    q_t = q.reshape(num_q, k_out * k_in).to(dtype).T
    buf = torch.empty(tile, k_out, k_in, dtype=dtype, device=A.device)
    out = torch.empty(num_n, num_q, dtype=dtype, device=A.device)
    for start in range(0, num_n, tile):
        stop = min(num_n, start + tile)
        rows = materialize(A[start:stop].to(dtype), B[start:stop].to(dtype), out=buf[:stop - start])
        torch.mm(rows.view(stop - start, k_out * k_in), q_t, out=out[start:stop])
    return out.T


def dot_factor_factor(A1: torch.Tensor, B1: torch.Tensor, A2: torch.Tensor, B2: torch.Tensor) -> torch.Tensor:
    """``[Q, N]`` of factors · factors: ``sum((A₁ᵀ A₂) ∘ (B₁ᵀ B₂))``."""
    num_q, k_out, c1 = A1.shape
    num_n, k_in, c2 = B2.shape
    # two GEMMs [c₁·Q, K] @ [K, c₂·N], rows and columns ordered factor column first, so the sums
    # over c₁ and c₂ add whole contiguous [Q, N] slices (a sum over interleaved axes ran ~20x slower;
    # einsum picks a far slower batched layout for these shapes)
    aa = A1.permute(2, 0, 1).reshape(c1 * num_q, k_out) @ A2.permute(2, 0, 1).reshape(c2 * num_n, k_out).T
    bb = B1.permute(2, 0, 1).reshape(c1 * num_q, k_in) @ B2.permute(2, 0, 1).reshape(c2 * num_n, k_in).T
    return aa.mul_(bb).view(c1, num_q, c2, num_n).sum(dim=0).sum(dim=1)


def dot_ghost(g1: torch.Tensor, a1: torch.Tensor, g2: torch.Tensor, a2: torch.Tensor) -> torch.Tensor:
    """``[Q, N]`` from raw token factors (``g [., T, Ko]``, ``a [., T, Ki]``): ``Σ_{t,s} (a·a')(g·g')``."""
    return (torch.einsum("qto,nso->qnts", g1, g2) * torch.einsum("qti,nsi->qnts", a1, a2)).sum(dim=(2, 3))


def route(num_q: int, num_n: int, tokens: int, k_in: int, k_out: int) -> str:
    """``"factorized"`` or ``"materialized"`` for a Q×N cross-gram of T-token factors, by FLOP count:
    factorized ``Q·N·T²·(Ko+Ki)``, materialized ``(Q+N)·T·Ko·Ki + Q·N·Ko·Ki``."""
    factorized = num_q * num_n * tokens * tokens * (k_out + k_in)
    materialized = (num_q + num_n) * tokens * k_out * k_in + num_q * num_n * k_out * k_in
    return "factorized" if factorized < materialized else "materialized"


def cross_gram(g1: torch.Tensor, a1: torch.Tensor, g2: torch.Tensor, a2: torch.Tensor,
               force: str | None = None) -> torch.Tensor:
    """``[Q, N]`` inner products of two sets of token-factor gradients, by the cheaper route (or
    ``force="factorized"|"materialized"``). Every route gives the same numbers."""
    choice = force or route(len(g1), len(g2), max(g1.shape[1], g2.shape[1]), a1.shape[-1], g1.shape[-1])
    if choice == "factorized":
        return dot_ghost(g1, a1, g2, a2)
    if choice != "materialized":
        raise ConfigError(f"route must be 'factorized' or 'materialized', got {choice!r}")
    return dot_dense_dense(g1.transpose(1, 2) @ a1, g2.transpose(1, 2) @ a2)
