"""One interface for attribution methods, a registry by name, and the streaming top-k driver.

A method turns query gradients into a query state once (``prepare``), then scores blocks of
training gradients streamed from a store (``score_block``), so memory is bounded by the block size
and the number of queries, never by the store. Shapes: Q queries, n rows in a block, D_l the
flattened width of layer l, k the top-k.

Top-k order: score descending, ties to the row earlier in store order (shard order, append order
within a shard: what ``iter_blocks`` yields whatever the block size), so the answer does not depend
on ``block_size``. Each (id, step) appears at most once, at its best row: two ranks that trained the
same example in the same step store two rows, which summing methods (in-run TracIn) rightly count
twice, but a list of the most influential training rows names it once.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol

import numpy as np
import torch

from ..config import ConfigError
from ..errors import TDAError
from .grouping import ByExample, GroupBy, GroupScores, Grouping

__all__ = ["AttributionMethod", "AttributionResult", "BasisQueries", "ProjectedQueries", "register_method",
           "get_method", "available_methods", "attribute", "AttributionError"]

log = logging.getLogger(__name__)


class AttributionError(TDAError, ValueError):
    """The queries do not fit the store (layers, shapes, projectors, eigenbasis versions), or there is
    nothing finite to score; the message names both sides and the fix."""


class AttributionMethod(Protocol):
    """Scores training rows against queries; implementations are registered by name."""

    name: str

    def prepare(self, queries: dict[str, torch.Tensor]) -> Any:
        """Query state from ``{layer: [Q, Ko, Ki]}`` (computed once, reused for every block)."""

    def score_block(self, state: Any, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[Q, n]`` scores of a block ``{layer: [n, Ko, Ki]}``."""


_METHODS: dict[str, type] = {}


def register_method(cls: type) -> type:
    """Class decorator: make a method available by its ``name`` to :func:`attribute` and the CLI."""
    _METHODS[cls.name] = cls
    return cls


def available_methods() -> list[str]:
    return sorted(_METHODS)


def get_method(name: str, **options: Any) -> AttributionMethod:
    if name not in _METHODS:
        raise ConfigError(f"unknown attribution method {name!r}; available: {', '.join(available_methods())}")
    return _METHODS[name](**options)


@dataclass
class AttributionResult:
    """Top-k training rows per query (rows are (example id, step) pairs), best first."""

    method: str
    layers: list[str]
    scores: torch.Tensor             # [Q, k] float64
    ids: np.ndarray                  # [Q, k'] int64, k' = min(top_k, distinct (id, step) scored)
    steps: np.ndarray                # [Q, k] int64
    num_scored: int = 0              # training rows scored
    all_scores: torch.Tensor | None = None   # [Q, N] when requested
    all_ids: np.ndarray | None = None        # [N]
    all_steps: np.ndarray | None = None      # [N]
    info: dict[str, Any] = field(default_factory=dict)
    group_by: str = "row"
    """What ``ids`` name: ``row`` (example ids with their ``steps``), ``example`` (instance ids, ``steps``
    -1: summed over steps), ``document`` (document ids) or ``source`` (source indices); see
    :mod:`olmo_tda.methods.grouping`."""

    def as_dicts(self) -> list[list[dict[str, Any]]]:
        """Per query: ``[{"index", "step", "score"}, ...]`` (JSON-ready)."""
        out = []
        for q in range(self.scores.shape[0]):
            out.append([{"index": int(i), "step": int(s), "score": float(v)}
                        for i, s, v in zip(self.ids[q], self.steps[q], self.scores[q]) if i >= 0])
        return out


class BasisQueries(dict):
    """Query gradients per eigenbasis version, ``{digest: Recording | ProjectedQueries}``, for a store
    whose basis follows the run (``store.bases``): each version's rows are scored against the queries
    projected with that version. :func:`~olmo_tda.methods.queries.query_gradients` with ``store=``
    makes one."""

    def version(self, digest: str | None) -> Any:
        """The queries projected with ``digest``; refuses a missing version and one filed under
        another version's digest, naming both."""
        if digest not in self:
            raise AttributionError(f"no queries projected with eigenbasis version {str(digest)[:16]} (given: "
                                   f"{', '.join(str(d)[:16] for d in self) or 'none'}); project them with "
                                   "store.load_basis(digest)")
        own = getattr(self[digest], "basis_version", None)
        if own is not None and own != digest:
            raise AttributionError(f"the queries filed under eigenbasis version {str(digest)[:16]} were projected with "
                                   f"version {own[:16]}: scores between two bases are noise; project them with that "
                                   "version (store.load_basis(digest))")
        return self[digest]


class ProjectedQueries(dict):
    """``{layer: [Q, Ko, Ki]}`` projected with eigenbasis version ``basis_version``."""

    def __init__(self, grads: dict[str, torch.Tensor], basis_version: str | None):
        super().__init__(grads)
        self.basis_version = basis_version


def _per_basis(store: Any, queries: Any) -> dict[str | None, Any]:
    """``{version: queries}`` to score each version's rows with (``{None: queries}`` for a store of
    one projection); refuses a version without queries and a recording filed under another version."""
    versions = list(getattr(store, "bases", []) or [])
    if not isinstance(queries, BasisQueries):
        own = getattr(queries, "basis_version", None)
        if not versions:
            return {None: queries}
        if versions == [own]:
            return {own: queries}
        raise AttributionError(f"the store's rows were projected with {len(versions)} eigenbasis versions "
                               f"({', '.join(d[:12] for d in versions)}); a query must be projected with each: pass "
                               "BasisQueries({digest: recording}) (query_gradients(..., store=store) makes it)")
    if not versions:
        raise AttributionError("BasisQueries were given but the store has one projection (no eigenbasis versions): "
                               "pass the queries' Recording itself")
    return {d: queries.version(d) for d in versions}


class _BasisView:
    """The rows of one eigenbasis version of a store, for methods that fit on the rows (influence)."""

    def __init__(self, store: Any, basis: str | None):
        self._store, self._basis = store, basis

    def iter_blocks(self, *args: Any, **kwargs: Any):
        return self._store.iter_blocks(*args, basis=self._basis, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _as_queries(queries: Any) -> dict[str, torch.Tensor]:
    if hasattr(queries, "dense"):
        queries = queries.dense()
    if not isinstance(queries, dict) or not queries:
        raise TypeError("queries must be a Recording or a non-empty {layer: Tensor[Q, Ko, Ki]} dict")
    from ..store.record import LowRank

    queries = {name: q.dense() if isinstance(q, LowRank) else q for name, q in queries.items()}   # rec.stored()
    odd = {name: type(q).__name__ for name, q in queries.items() if not isinstance(q, torch.Tensor)}
    if odd:
        raise TypeError(f"queries must be a Recording or a {{layer: Tensor[Q, Ko, Ki]}} dict; got {odd}")
    sizes = {q.shape[0] for q in queries.values()}
    if len(sizes) != 1:
        raise AttributionError(f"query gradients disagree on the number of queries: {sorted(sizes)}")
    return {name: q.detach().to("cpu", torch.float32) for name, q in queries.items()}


def _check_queries(queries: dict[str, torch.Tensor], layers: list[str]) -> None:
    """Refuse non-finite query gradients (every score of that query would be NaN and its top-k arbitrary);
    warn about all-zero ones (every score 0: the top-k is just the first rows in store order)."""
    bad = {n: torch.nonzero(~torch.isfinite(queries[n].flatten(1)).all(1)).flatten().tolist() for n in layers}
    bad = {n: rows for n, rows in bad.items() if rows}
    if bad:
        rows = sorted({r for v in bad.values() for r in v})
        where = "; ".join(f"{n}: queries {v[:10]}" for n, v in list(bad.items())[:5])
        raise AttributionError(f"query gradients of queries {rows[:20]} hold NaN or inf ({where}"
                               f"{'; ...' if len(bad) > 5 else ''}): check those queries' losses (an empty or fully "
                               f"masked text, an fp16 overflow) and recompute them")
    sq = sum(queries[n].flatten(1).double().square().sum(1) for n in layers)
    zero = torch.nonzero(sq == 0).flatten().tolist()
    if zero:
        log.warning("query gradients of queries %s are zero in every scored layer: each of their scores is 0 and "
                    "their top-k is the first rows in store order, not an attribution", zero[:20])


def _top_unique(scores: torch.Tensor, ids: np.ndarray, steps: np.ndarray, k: int
                ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Per query, the first ``k`` distinct (id, step) of ``[Q, m]`` candidates in the order score
    descending (NaN ranks as -inf), then column ascending (callers put candidates in store order), each at its
    first (best) column. Every query gets the same count: min(k, distinct pairs among its candidates)."""
    m = scores.shape[1]
    key = torch.nan_to_num(scores, nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf)
    width = min(m, 2 * k)              # duplicates are rare: look a little past k, wider only if needed
    while True:
        vals, cols = torch.topk(key, width, dim=1)
        if width < m and bool(((key >= vals[:, -1:]).sum(1) > width).any()):
            cols = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :width]  # ties across the cut
        else:                          # the top `width` set is exact; order it by (score desc, column asc)
            cols = np.take_along_axis(cols.numpy(), np.lexsort((cols.numpy(), -vals.numpy()), axis=1), axis=1)
            cols = torch.from_numpy(cols)
        cols_np = cols.numpy()
        top_ids, top_steps = np.take_along_axis(ids, cols_np, axis=1), np.take_along_axis(steps, cols_np, axis=1)
        first = _first_occurrences(top_ids, top_steps)
        if width == m or first.sum(1).min() >= k:
            break
        width = min(m, 2 * width)
    keep = min(k, int(first.sum(1).min()))
    take = np.argsort(~first, axis=1, kind="stable")[:, :keep]
    return (torch.gather(scores, 1, torch.gather(cols, 1, torch.from_numpy(take))),
            np.take_along_axis(top_ids, take, axis=1), np.take_along_axis(top_steps, take, axis=1))


def _first_occurrences(ids: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """``[Q, w]`` bool: whether each (id, step) is the first of its kind in its query row."""
    num_q, w = ids.shape
    rows = np.repeat(np.arange(num_q), w)
    cols = np.tile(np.arange(w), num_q)
    flat_ids, flat_steps = ids.reshape(-1), steps.reshape(-1)
    order = np.lexsort((cols, flat_steps, flat_ids, rows))
    same = np.zeros(len(order), dtype=bool)
    same[1:] = ((rows[order][1:] == rows[order][:-1]) & (flat_ids[order][1:] == flat_ids[order][:-1])
                & (flat_steps[order][1:] == flat_steps[order][:-1]))
    first = np.empty(len(order), dtype=bool)
    first[order] = ~same
    return first.reshape(num_q, w)


def projector_difference(specs: dict[str, dict[str, Any]] | None, meta: dict[str, Any]) -> str:
    """What differs between the queries' projector ``specs`` and the store's (``meta["layers"]``), as
    advice: a replaced eigenbasis file cannot be fixed by the capture config."""
    generic = "capture the queries with the store's capture config (seed, proj_dim, proj_type, layers)"
    stored = {layer.get("name"): layer.get("projector") for layer in meta.get("layers", []) if isinstance(layer, dict)}
    if not specs or not stored:
        return generic
    for name, spec in specs.items():
        theirs = stored.get(name)
        if theirs is None or theirs == spec:
            continue
        fields = sorted(k for k in set(spec) | set(theirs) if spec.get(k) != theirs.get(k))
        if ("basis_digest" in fields and "kind" not in fields and spec.get("basis_digest")
                and theirs.get("basis_digest")):
            return (f"layer {name!r} was projected onto another eigenbasis (basis digest {spec['basis_digest']} "
                    f"here, {theirs.get('basis_digest')} in the store): the basis file was replaced or "
                    "re-estimated after the store was written; query with the basis the run captured with")
        return (f"layer {name!r} differs in {', '.join(fields)} ({', '.join(f'{k}={spec.get(k)!r}' for k in fields)} "
                f"here, {', '.join(f'{k}={theirs.get(k)!r}' for k in fields)} in the store); {generic}")
    return generic


def _grouping(group_by: "str | Grouping") -> "Grouping | None":
    """None for rows; the grouping object otherwise (``"example"`` needs nothing but the store)."""
    if not isinstance(group_by, str):
        return group_by
    try:
        kind = GroupBy(group_by)
    except ValueError:
        raise ConfigError(f"group_by must be one of {[g.value for g in GroupBy]} or a Grouping, "
                          f"got {group_by!r}") from None
    if kind in (GroupBy.DOCUMENT, GroupBy.SOURCE):
        raise ConfigError(f"group_by={group_by!r} needs the training data: pass ByDocument(corpus) or "
                          "BySource(corpus) (olmo_tda.methods.grouping; a run's OLMoRun builds them)")
    return ByExample() if kind is GroupBy.EXAMPLE else None


def attribute(store: Any, queries: Any, *, method: str | AttributionMethod = "graddot", top_k: int = 10,
              layers: Iterable[str] | None = None, block_size: int | None = None, return_scores: bool = False,
              projector_hash: str | None = None, projector_specs: dict[str, Any] | None = None,
              group_by: "str | Grouping" = "row", **method_options: Any) -> AttributionResult:
    """Score every training row of ``store`` against ``queries`` and keep the top ``top_k`` per query:
    rows (ties to the earlier row in store order; each (id, step) once: see the module docstring),
    or the examples, documents or sources their scores add up to (``group_by``).

    Args:
        store: a store path or an open store (anything with ``layers`` and ``iter_blocks``).
        queries: a :class:`~olmo_tda.capture.Recording` or ``{layer: [Q, Ko, Ki]}``, captured with the
            same projectors as the store (same capture config); NaN/inf in a scored layer is refused.
        method: a registered name (``graddot``, ``gradcos``, ...) or a method object.
        layers: restrict scoring to these layers (default: every layer present in both).
        block_size: training rows per streamed block (None: the store's
            :meth:`~olmo_tda.store.GradientStore.block_rows`, 64 MB of decoded rows); memory is
            O(Q·(top_k + block_size)) plus the block's rows.
        return_scores: also return the full ``[Q, N]`` score matrix, one column per stored row
            (duplicate (id, step) rows included; memory O(Q·N)).
        projector_hash: the capture's ``projector_hash`` for plain-dict queries (a Recording carries
            its own); compared with the store's, since scores across different projectors are noise.
        projector_specs: the capture's ``projector_specs`` for plain-dict queries, so a mismatch names
            the layer and field that differ.
        group_by: ``"row"``, ``"example"`` (each example's rows summed over its steps), or a
            :class:`~olmo_tda.methods.grouping.Grouping` (``ByDocument(corpus)``, ``BySource(corpus)``);
            memory O(Q·G) for G groups.
    """
    if top_k < 1:
        raise ConfigError(f"top_k must be >= 1, got {top_k}")
    grouping = _grouping(group_by)
    if isinstance(store, (str, Path)):
        from ..store import GradientStore
        store = GradientStore.open(store)
    by_basis, chosen = _checked_queries(store, queries, layers, projector_hash, projector_specs)
    states = {}
    for digest, version_queries in by_basis.items():
        # one method per version: a curvature fitted on one version's rows is not another's
        algo = (get_method(method, **method_options) if isinstance(method, str)
                else method if len(by_basis) == 1 else copy.deepcopy(method))
        if hasattr(algo, "fit"):        # methods that need the training rows first (influence: the Fisher)
            algo.fit(store if digest is None else _BasisView(store, digest), chosen, block_size=block_size)
        states[digest] = (algo, algo.prepare({n: version_queries[n] for n in chosen}))
    num_q = next(iter(next(iter(by_basis.values())).values())).shape[0]
    return _stream(store, states, chosen, num_q, top_k=top_k, block_size=block_size, return_scores=return_scores,
                   grouping=grouping)


def _checked_queries(store: Any, queries: Any, layers: Iterable[str] | None, projector_hash: str | None,
                     projector_specs: dict[str, Any] | None) -> tuple[dict[Any, dict[str, torch.Tensor]], list[str]]:
    """``({basis digest or None: {layer: [Q, Ko, Ki]}}, the layers to score)``, the queries checked
    against the store: projectors, eigenbasis versions, layers, shapes, finite values."""
    by_basis = _per_basis(store, queries)
    queries = next(iter(by_basis.values()))
    projector_hash = getattr(queries, "projector_hash", projector_hash)
    stored_hash = getattr(store, "meta", {}).get("projector_hash")
    if projector_hash is not None and stored_hash is not None and projector_hash != stored_hash:
        raise AttributionError(f"the queries were projected with projectors {projector_hash}, the store with "
                               f"{stored_hash}: "
                               + projector_difference(getattr(queries, "projector_specs", projector_specs),
                                                      getattr(store, "meta", {}))
                               + f" — see `olmo-tda inspect {getattr(store, 'path', '')}`")
    by_basis = {d: _as_queries(q) for d, q in by_basis.items()}
    queries = next(iter(by_basis.values()))
    if len({tuple(sorted(q)) for q in by_basis.values()}) > 1 or len({q[n].shape[0] for q in by_basis.values()
                                                                     for n in q}) > 1:
        raise AttributionError("the queries of the eigenbasis versions differ in layers or number of queries: project "
                               "the same queries with every version")
    if layers is None and set(queries) != set(store.layers):
        log.warning("queries cover %d layers and the store %d: scoring the %d they share (pass layers= to "
                    "choose explicitly)", len(queries), len(store.layers), len(set(queries) & set(store.layers)))
    chosen = list(layers) if layers is not None else [n for n in store.layers if n in queries]
    missing = [n for n in chosen if n not in queries or n not in store.layers]
    if missing or not chosen:
        raise AttributionError(f"layers {missing or chosen} are not in both the store ({len(store.layers)} layers) "
                               f"and the queries ({sorted(queries)[:5]}...)")
    shapes = getattr(store, "layer_shapes", None)
    for version_queries in by_basis.values():
        for name in chosen:
            want = tuple(shapes[name]) if shapes else None
            if want is not None and tuple(version_queries[name].shape[1:]) != want:
                raise AttributionError(f"query gradient of {name} has shape {tuple(version_queries[name].shape[1:])}, "
                                       f"the store holds {want}: were the queries captured with the store's capture "
                                       "config?")
        _check_queries(version_queries, chosen)
    return by_basis, chosen


def _stream(store: Any, states: dict[Any, tuple[Any, Any]], chosen: list[str], num_q: int, *, top_k: int,
            block_size: int | None, return_scores: bool, grouping: "Grouping | None") -> AttributionResult:
    """One pass over the store's blocks: each block scored by its eigenbasis version's method and
    state, the top ``top_k`` rows (or groups) per query kept as it goes."""
    algo = list(states.values())[-1][0]      # the last version's, as the loop below leaves it
    best_scores = torch.full((num_q, 0), -torch.inf, dtype=torch.float64)
    best_ids = np.zeros((num_q, 0), dtype=np.int64)
    best_steps = np.zeros((num_q, 0), dtype=np.int64)
    kept_scores, kept_ids, kept_steps = [], [], []
    num_rows = 0
    groups = GroupScores(grouping, num_q) if grouping is not None else None
    for block in store.iter_blocks(layers=chosen, block_size=block_size):
        algo, state = states[getattr(block, "basis", None)]
        scores = algo.score_block(state, block.grads).to(torch.float64)        # [Q, n]
        ids_n = np.asarray(block.ids, dtype=np.int64)
        steps_n = np.asarray(block.steps, dtype=np.int64)
        num_rows += len(ids_n)
        if return_scores:
            kept_scores.append(scores)
            kept_ids.append(ids_n)
            kept_steps.append(steps_n)
        if groups is not None:
            groups.add(scores, ids_n)
            continue
        # the kept rows come before the block: all of them are earlier in store order
        merged = torch.cat([best_scores, scores], dim=1)
        merged_ids = np.concatenate([best_ids, np.broadcast_to(ids_n, (num_q, len(ids_n)))], axis=1)
        merged_steps = np.concatenate([best_steps, np.broadcast_to(steps_n, (num_q, len(steps_n)))], axis=1)
        best_scores, best_ids, best_steps = _top_unique(merged, merged_ids, merged_steps, top_k)

    if groups is not None:
        best_scores, best_ids = groups.top(top_k)
        best_steps = np.full_like(best_ids, -1)
    result = AttributionResult(method=algo.name, layers=chosen, scores=best_scores, ids=best_ids,
                               steps=best_steps, num_scored=num_rows, info=getattr(algo, "info", {}),
                               group_by=grouping.group_by.value if grouping is not None else "row")
    if return_scores:
        result.all_scores = torch.cat(kept_scores, dim=1) if kept_scores else torch.zeros(num_q, 0)
        result.all_ids = np.concatenate(kept_ids) if kept_ids else np.zeros(0, np.int64)
        result.all_steps = np.concatenate(kept_steps) if kept_steps else np.zeros(0, np.int64)
    return result
