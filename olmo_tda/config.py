"""The ``tda:`` configuration section: typed, strict, self-explaining.

Users meet these dataclasses as the ``tda:`` section of a training YAML (or a plain dict) and as
dotted command-line overrides (``capture.proj_dim=32``). Loading is strict: an unknown key, a value
of the wrong type or one out of range raises :class:`ConfigError` naming the full key path and, for
a misspelt key, the closest valid one.

Example::

    from olmo_tda.config import TDAConfig
    cfg = TDAConfig.from_dict({"enabled": True, "capture": {"proj_dim": 32}})
    cfg = TDAConfig.from_yaml("run.yaml", overrides=["store.dtype=float16"])
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import fnmatch
import math
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from .errors import TDAError

__all__ = [
    "ConfigError",
    "ProjectionType",
    "StoreDType",
    "FactorRoute",
    "CaptureConfig",
    "LayerOverride",
    "StoreConfig",
    "LossReduction",
    "BatchConfig",
    "TrajectorySchedule",
    "TrajectoryRetention",
    "TrajectoryConfig",
    "SelectionPolicy",
    "SelectionMode",
    "SelectionConfig",
    "TDAConfig",
    "parse_config",
    "apply_overrides",
    "to_plain",
]


class ConfigError(TDAError, ValueError):
    """A configuration value, argument, flag or input file the user gave is unknown, mistyped, out of
    range or malformed; the message names it (key path, flag, file:line) and the fix."""


class ProjectionType(str, enum.Enum):
    """How the Kronecker projectors are made: seeded random draws (scaled so that ``E[PᵀP] = I``)
    or a data-aware eigenbasis read from a file."""

    ORTHOGONAL = "orthogonal"
    """Haar-random orthonormal rows scaled by √(n/k): unbiased like Gaussian, much lower variance."""
    GAUSSIAN = "gaussian"
    RADEMACHER = "rademacher"
    EIGEN = "eigen"
    """Rows = top-k eigenvectors of each layer's E[a aᵀ] / E[g gᵀ] (KFAC eigenbasis), read from
    ``capture.basis``. Not scaled: inner products are those of the gradients restricted to the
    dominant Kronecker subspace (not unbiased estimates of the full ones)."""


class StoreDType(str, enum.Enum):
    """On-disk dtype of stored gradients (bfloat16 is kept as raw 16-bit words; HDF5 has no bf16)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class FactorRoute(str, enum.Enum):
    """How rank-c (LoRIF) factors of an example with more than c tokens are computed. Every route
    gives the best rank-c approximation of the same projected gradient."""

    AUTO = "auto"
    """The cheaper of the two by FLOP count (token count vs projected widths)."""
    QR = "qr"
    """Thin QRs of the two token-factor matrices and an SVD of the small core: never forms Ĝ."""
    DENSE = "dense"
    """Form the k_out×k_in projected gradient, then truncate it (an eigendecomposition of its smaller
    Gram matrix, the same factors as an SVD's; cheaper for long examples at small k)."""


class LossReduction(str, enum.Enum):
    """How a loop without OLMo's trainer reduced each micro-batch's token losses to the scalar it
    backpropagates (the divisor capture undoes)."""

    TOKEN_MEAN = "token_mean"
    """Sum of CE over the micro-batch's counted label positions / their number (HF, Megatron)."""
    EXAMPLE_MEAN = "example_mean"
    """Mean over the micro-batch's examples of each example's summed token loss."""
    SUM = "sum"
    """Plain sum over examples and tokens."""


def _check(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {message}")


def _check_types(obj: Any, path: str) -> None:
    """Type-check a config built directly in Python as strictly as one parsed from YAML, and
    normalize its plain fields the same way (``schedule="log"`` becomes the enum member)."""
    parsed = _parse_dataclass(type(obj), {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, path)
    for f in dataclasses.fields(obj):
        value = getattr(parsed, f.name)
        if not dataclasses.is_dataclass(value):
            setattr(obj, f.name, value)


@dataclass(kw_only=True)
class LayerOverride:
    """A different budget for some layers: their own ``proj_dim`` and/or ``rank``."""

    modules: list[str] = field(default_factory=list)
    """fnmatch patterns on the captured layers' names; the first override that matches a layer wins."""
    proj_dim: int | tuple[int, int] | None = None
    """``k`` or ``(k_out, k_in)`` for these layers (None: ``capture.proj_dim``)."""
    rank: int | None = None
    """LoRIF rank c for these layers (None: ``capture.rank``; 0: dense)."""


@dataclass(kw_only=True)
class CaptureConfig:
    """What is captured: which Linear layers, projected how."""

    proj_dim: int | tuple[int, int] = 64
    """Projection width per side: ``k`` (both sides) or ``(k_out, k_in)``. 0 = exact, unprojected."""
    proj_type: ProjectionType = ProjectionType.ORTHOGONAL
    """Distribution of projector entries (random kinds are scaled so projected inner products are
    unbiased), or ``eigen``: the data-aware eigenbasis in ``basis``. A side whose width is <= k is
    kept exact (identity): a wider map only adds noise and bytes."""
    seed: int = 0
    """Projector seed. Matrices derive from (seed, module name, side): identical on every rank."""
    modules: list[str] = field(default_factory=lambda: ["*"])
    """fnmatch patterns on module names (``model.named_modules()``) selecting nn.Linear layers (and
    nn.Embedding layers with ``embeddings: true``)."""
    exclude: list[str] = field(default_factory=list)
    """fnmatch patterns removed from the selection (e.g. ``"*ff_out"`` for an untied output head)."""
    include_bias: bool = True
    """Capture a layer's bias gradient as one extra input column (only for layers with a bias)."""
    embeddings: bool = False
    """Also capture ``nn.Embedding`` layers that ``modules``/``exclude`` select, as a Linear on one-hot
    token inputs: the stored gradient is ``P_out (∂L/∂W)ᵀ P_inᵀ`` of the ``[V, d]`` table (token side
    ``V``, projected by looking up columns of ``P_in``; no one-hot is formed). An OLMo whose output
    head is tied to the table (``weight_tying``) gets the head's share added, so the rows are the
    table's whole gradient; other ``F.linear`` uses of a table are not seen. Random projections only."""
    rank: int = 0
    """LoRIF factor rank c: store each example's projected gradient as ``A [k_out, c] Bᵀ [c, k_in]``
    (exact when the example has <= c token rows in the layer, counting every call of it, else its best
    rank-c approximation). 0 = dense. A layer where c·(k_out+k_in) >= k_out·k_in is stored dense:
    that is both smaller and exact."""
    factor_route: FactorRoute = FactorRoute.AUTO
    """How factors of examples longer than c tokens are computed (``auto`` | ``qr`` | ``dense``)."""
    basis: str | None = None
    """Safetensors file of a frozen eigenbasis (:mod:`olmo_tda.capture.eigenbasis`); required when
    ``proj_type`` is ``eigen``. A training run defaults it to ``<save_folder>/tda/basis.safetensors``
    and, when the file does not exist yet, estimates it before the first step."""
    basis_batches: int = 4
    """Training batches (per rank) a run uses to estimate a missing eigenbasis, at its initial weights."""
    basis_every: int = 0
    """``proj_type: eigen`` in a training run: re-estimate the eigenbasis every this many steps, and
    early in the run at steps ``basis_every/16, /8, /4, /2`` (where the model changes fastest), so
    the basis follows the weights (0 = frozen at the first estimate). Each estimate is a new basis
    version, a content-addressed file in the store's ``bases/``; every shard records the version
    its rows were projected with and queries are projected once per version (docs/BASES.md). The
    widths of every layer stay those of the first estimate."""
    basis_tokens: int = 512
    """Token rows per rank that a refresh samples from the training batches of the
    ``basis_batches`` steps before it (evenly spaced within each micro-batch): the covariances of
    a refresh come from the training step itself, with no extra forward or backward. They are held
    on the layer's device until the refresh: ``basis_tokens × Σ(n_in + n_out) × 4`` bytes per rank
    (OLMo-1B: 1.3 GB at 512)."""
    budget: int = 0
    """At most this many floats per example over all captured layers, split by the eigenbasis
    estimate (``proj_type: eigen`` only; 0 = off, every layer gets ``proj_dim``). Each layer's share
    follows the number of its Kronecker eigen-directions whose K-FAC curvature exceeds influence's
    default damping (0.1 × the mean); a layer that cannot hold its share (``proj_dim`` caps each
    side) passes the excess on. Its ``(k_out, k_in)`` is the rectangle of top eigenvectors with the
    most effective dimension ``Σ κ/(κ+λ)`` within the share. The widths (and the cap) are frozen in
    the basis file at estimation: capture refuses the file under another budget or ``proj_dim``.
    Floats of dense rows: with ``rank`` a layer stores its factors where smaller. At the same floats
    this agrees with exact influence better than an even split (docs/BENCHMARKS.md)."""
    overrides: list[LayerOverride] = field(default_factory=list)
    """Per-layer budgets, e.g. ``[{modules: ["*ff_out"], proj_dim: 64, rank: 3}]``: give the layers
    that carry most of the score (an LM's output head) more of the bytes. First match wins."""

    def validate(self, path: str = "capture", *, require_basis: bool = True) -> None:
        """``require_basis=False``: the ``tda:`` section of a training run, which supplies a default
        ``basis`` itself."""
        _check_types(self, path)
        dims = self.proj_dims
        _check(all(d >= 0 for d in dims), f"{path}.proj_dim", f"must be >= 0, got {self.proj_dim!r}")
        _check((dims[0] == 0) == (dims[1] == 0), f"{path}.proj_dim",
               f"either both sides are projected or neither (0 = exact), got {self.proj_dim!r}")
        _check(self.seed >= 0, f"{path}.seed", f"must be >= 0, got {self.seed}")
        _check(self.rank >= 0, f"{path}.rank", f"must be >= 0 (0 = dense gradients), got {self.rank}")
        _check(self.basis_batches >= 1, f"{path}.basis_batches", f"must be >= 1, got {self.basis_batches}")
        _check(self.basis_every >= 0, f"{path}.basis_every", f"must be >= 0 (0 = frozen), got {self.basis_every}")
        _check(self.basis_tokens >= 1, f"{path}.basis_tokens", f"must be >= 1, got {self.basis_tokens}")
        if self.basis_every:
            _check(self.proj_type is ProjectionType.EIGEN and not self.exact, f"{path}.basis_every",
                   f"re-estimates an eigenbasis: it needs proj_type 'eigen' and a nonzero proj_dim, got proj_type "
                   f"{self.proj_type.value!r}, proj_dim {self.proj_dim!r}")
        if require_basis and self.proj_type is ProjectionType.EIGEN and not self.exact:
            _check(bool(self.basis), f"{path}.basis",
                   "proj_type 'eigen' needs the eigenbasis file: estimate one with "
                   "olmo_tda.capture.eigenbasis.estimate_eigenbasis(...).save(PATH), set capture.basis=PATH "
                   "(an OLMo training run does this itself)")
        if self.basis and self.proj_type is not ProjectionType.EIGEN:
            warnings.warn(f"{path}.basis is ignored: proj_type is {self.proj_type.value!r}, not 'eigen'", stacklevel=2)
        _check(len(self.modules) > 0, f"{path}.modules", "needs at least one pattern ('*' = all)")
        _check(not (self.embeddings and self.proj_type is ProjectionType.EIGEN and not self.exact),
               f"{path}.embeddings", "is not supported with proj_type 'eigen' (the eigenbasis covers Linear layers "
               "only): use a random proj_type, or embeddings: false")
        _check(self.budget >= 0, f"{path}.budget", f"must be >= 0 (0 = off), got {self.budget}")
        if self.budget:
            _check(self.proj_type is ProjectionType.EIGEN and not self.exact, f"{path}.budget",
                   f"splits floats across layers by their eigenbasis spectra: it needs proj_type 'eigen' and a "
                   f"nonzero proj_dim (the cap per side), got proj_type {self.proj_type.value!r}, proj_dim "
                   f"{self.proj_dim!r}")
            _check(all(o.proj_dim is None for o in self.overrides), f"{path}.overrides",
                   "cannot set proj_dim when capture.budget allocates the layers' widths (rank is allowed)")
        for i, o in enumerate(self.overrides):
            where = f"{path}.overrides[{i}]"
            _check(len(o.modules) > 0, f"{where}.modules", "needs at least one pattern")
            _check(o.proj_dim is not None or o.rank is not None, where, "sets neither proj_dim nor rank")
            if o.proj_dim is not None:
                d = _dims(o.proj_dim)
                _check(all(x >= 0 for x in d) and (d[0] == 0) == (d[1] == 0), f"{where}.proj_dim",
                       f"must be >= 0 on both sides, or 0 on both (exact), got {o.proj_dim!r}")
                _check((d == (0, 0)) == self.exact or self.proj_type is not ProjectionType.EIGEN, f"{where}.proj_dim",
                       "an eigen capture cannot mix exact and projected layers (the basis would be partial)")
            _check(o.rank is None or o.rank >= 0, f"{where}.rank", f"must be >= 0 (0 = dense), got {o.rank}")

    @property
    def proj_dims(self) -> tuple[int, int]:
        """``(k_out, k_in)``."""
        return _dims(self.proj_dim)

    @property
    def exact(self) -> bool:
        return self.proj_dims == (0, 0)

    def override_for(self, name: str) -> LayerOverride | None:
        return next((o for o in self.overrides if any(fnmatch.fnmatchcase(name, p) for p in o.modules)), None)

    def dims_for(self, name: str) -> tuple[int, int]:
        """``(k_out, k_in)`` of layer ``name``, overrides applied."""
        o = self.override_for(name)
        return _dims(o.proj_dim) if o is not None and o.proj_dim is not None else self.proj_dims

    def rank_for(self, name: str) -> int:
        o = self.override_for(name)
        return o.rank if o is not None and o.rank is not None else self.rank

    @property
    def max_dims(self) -> tuple[int, int]:
        """The widest ``(k_out, k_in)`` any layer asks for (what an eigenbasis must keep)."""
        dims = [self.proj_dims] + [_dims(o.proj_dim) for o in self.overrides if o.proj_dim is not None]
        return (max(d[0] for d in dims), max(d[1] for d in dims))


def _dims(proj_dim: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(proj_dim, int):
        return (proj_dim, proj_dim)
    return (int(proj_dim[0]), int(proj_dim[1]))


@dataclass(kw_only=True)
class StoreConfig:
    """Where and how captured gradients are written."""

    path: str | None = None
    """Store directory. In a training run it defaults to ``<save_folder>/tda/store``."""
    dtype: StoreDType = StoreDType.FLOAT32
    """On-disk dtype of gradients. Rankings barely move in 16 bits (see docs/BENCHMARKS.md)."""
    flush_every: int = 32
    """Training steps per shard. A crash loses at most this window of unflushed steps."""
    flush_mb: float = 1024.0
    """A window is also written once its encoded rows reach this many MB, even inside one step (a
    post-hoc capture appends every example at one step), so however large a step is, the writer
    holds about this much (its window buffers, kept between windows; with ``compression`` up to
    twice that while a shard is built) and a crash loses at most this much. A failing disk keeps the
    window in memory, growing, until a write succeeds."""
    queue_size: int = 8
    """Records the background writer may hold before the training step waits (back-pressure)."""
    compression: str | None = None
    """HDF5 filter for gradient datasets (``None`` or ``"lzf"``/``"gzip"``); off by default for speed."""
    enabled: bool = True
    """Capture every training example into the store. False: a run that only selects data (or,
    OLMo runs only, only keeps trajectory checkpoints; under DeepSpeed the trajectory needs the
    store) — no capture hooks on the training step, no store."""

    def validate(self, path: str = "store") -> None:
        _check_types(self, path)
        _check(self.flush_every >= 1, f"{path}.flush_every", f"must be >= 1, got {self.flush_every}")
        _check(math.isfinite(self.flush_mb) and self.flush_mb > 0, f"{path}.flush_mb",
               f"must be a positive number of MB, got {self.flush_mb}")
        _check(self.queue_size >= 1, f"{path}.queue_size", f"must be >= 1, got {self.queue_size}")
        _check(self.compression in (None, "lzf", "gzip"), f"{path}.compression",
               f"must be null, 'lzf' or 'gzip', got {self.compression!r}")


@dataclass(kw_only=True)
class BatchConfig:
    """What a forward's batch tells capture in loops without OLMo's trainer (DeepSpeed, plain torch):
    which examples it holds and how their loss was normalized. OLMo runs ignore this section."""

    ids_key: str = "index"
    """Key of the global example ids (data indices) in the batch dict given to the model."""
    reduction: LossReduction = LossReduction.TOKEN_MEAN
    """How the loop reduced token losses to the backpropagated scalar of one micro-batch."""
    labels_key: str = "labels"
    """Key of the label tensor counted by ``reduction: token_mean``."""
    ignore_index: int = -100
    """Label value that contributes no loss (not counted)."""
    shift_labels: bool = False
    """True when the model shifts labels itself (``labels == input_ids``, HF style): the first
    position of each row is then not counted."""

    def validate(self, path: str = "batch") -> None:
        _check_types(self, path)
        _check(bool(self.ids_key), f"{path}.ids_key", "must be a non-empty key name")
        _check(bool(self.labels_key), f"{path}.labels_key", "must be a non-empty key name")


class TrajectorySchedule(str, enum.Enum):
    """When a trajectory checkpoint is kept (step 0, the initial weights, is always kept)."""

    EVERY = "every"
    """Every ``every`` optimizer steps."""
    LOG = "log"
    """At steps ``every``, 2·every, 4·every, ...: dense early, where the weights move most."""
    LR = "lr"
    """When the learning rate summed since the last checkpoint reaches ``every`` × the highest lr
    seen: denser while the lr is high (equals ``every`` under a constant lr)."""


class TrajectoryRetention(str, enum.Enum):
    """Which checkpoints survive once there are more than ``keep``."""

    ALL = "all"
    """Keep every checkpoint (``keep`` is ignored)."""
    LAST = "last"
    """Keep the newest ``keep``."""
    THINNED = "thinned"
    """Spread over the whole run: number the saves 0, 1, 2, ... in the order they are made (the count
    survives resumes); after save n, keep the saves whose number is a multiple of 2^j, for the
    smallest j that leaves at most ``keep - 1`` of them in 0..n, plus save n itself. Once more than
    ``keep - 1`` saves were made (before, all are kept) that is between ``keep / 2`` and ``keep``
    checkpoints, the first and the newest among them, 2^j saves apart (the newest closer): at most twice
    the spacing of ``keep`` evenly spaced saves. A dropped checkpoint is never one a later save would
    keep, so a resumed run ends with the checkpoints of an uninterrupted one."""


@dataclass(kw_only=True)
class TrajectoryConfig:
    """Light trajectory checkpoints for TracIn: weights plus what scoring needs, kept on their own
    schedule and retention (independent of the trainer's checkpoint pruning)."""

    enabled: bool = False
    """Keep trajectory checkpoints (needs ``tda.enabled``)."""
    every: int = 100
    """The schedule's spacing in optimizer steps (see ``schedule``)."""
    schedule: TrajectorySchedule = TrajectorySchedule.EVERY
    """every | log | lr."""
    retention: TrajectoryRetention = TrajectoryRetention.ALL
    """all | last | thinned."""
    keep: int = 0
    """How many checkpoints ``last`` keeps, and the most ``thinned`` keeps (>= 2)."""
    dtype: StoreDType = StoreDType.FLOAT32
    """Dtype of the saved weights (float32 | float16 | bfloat16)."""
    path: str | None = None
    """Directory; in a training run it defaults to ``<save_folder>/tda/trajectory``."""

    def validate(self, path: str = "trajectory") -> None:
        _check_types(self, path)
        _check(self.every >= 1, f"{path}.every", f"must be >= 1, got {self.every}")
        if self.retention != TrajectoryRetention.ALL:
            _check(self.keep >= 2, f"{path}.keep",
                   f"retention {self.retention.value!r} needs keep >= 2 checkpoints, got {self.keep}")


class SelectionPolicy(str, enum.Enum):
    """How the examples of an upcoming window are scored and ordered (highest first)."""

    GREATS = "greats"
    """Greedy per global batch: ``η⟨g_i, ḡ_target⟩ − η² Σ_{j picked in the batch} ⟨g_i, g_j⟩``
    (η = lr / tokens per global batch; the redundancy term penalizes near-duplicates)."""
    ALIGNMENT = "alignment"
    """``⟨g_i, ḡ_target⟩``: first-order decrease of the target loss, no redundancy term."""
    LOSS = "loss"
    """The example's mean token loss at the current weights (forward only)."""
    GRADNORM = "gradnorm"
    """The norm of the example's (projected) gradient."""
    RANDOM = "random"
    """A seeded random order of the window (the control arm)."""
    SOURCES = "sources"
    """Per-source weights learned from the rows the training step captured (no backward pass over
    the data): the next ``every_n`` steps' examples are drawn from the sources by those weights
    (:mod:`olmo_tda.training.mixture`). Needs the store on (its rows) and a target."""


class SelectionMode(str, enum.Enum):
    """What a round does with the ordered window."""

    REORDER = "reorder"
    """The window's positions get its examples in score order: every example is still trained on
    exactly once per epoch."""
    FILTER = "filter"
    """The top ``keep_fraction`` stay (in score order); the rest move to the end of the epoch's
    order (later, never deleted)."""


@dataclass(kw_only=True)
class SelectionConfig:
    """Online data selection: every ``every_n`` steps, score the next ``window`` examples of the
    data order at the current weights and rewrite that upcoming part of the order."""

    enabled: bool = False
    """Run selection rounds (OLMo runs: ``olmo-tda train``; DeepSpeed: :class:`DeepSpeedSelection`)."""
    every_n: int = 50
    """Optimizer steps between rounds (a round runs after step every_n, 2·every_n, ...)."""
    start_step: int = 0
    """No round before this optimizer step (0 = from the first ``every_n``). Early in training the
    score is right about the next step but not about the run: at the byte/unigram stage shuffled
    text helps the next step as much as the target does."""
    window: int = 512
    """Upcoming examples (global, over all ranks) rescored per round; positions already consumed
    are never touched."""
    policy: SelectionPolicy = SelectionPolicy.GREATS
    """greats | alignment | loss | gradnorm | random | sources."""
    mode: SelectionMode = SelectionMode.REORDER
    """reorder | filter."""
    keep_fraction: float = 0.5
    """``filter``: the fraction of the window that stays in place."""
    target: str | None = None
    """The target data: a text file (documents separated by blank lines, newlines inside a document
    kept), a JSONL file with a ``text`` field per line, or
    a token file (``.npy`` array [n, seq_len] of ids, or OLMo's raw memmap of ``memmap_dtype`` ids
    chunked to the model's sequence length). Needed by greats and alignment."""
    target_examples: int = 64
    """How many target examples form the target gradient (the first n of ``target``)."""
    exclude_modules: list[str] = field(default_factory=list)
    """fnmatch patterns of layers left out of the score (e.g. ``"*ff_out"`` for the output head);
    they are still trained."""
    embeddings: bool = False
    """Score the token-embedding table's gradient too (``capture.embeddings``). A learned position
    table broadcast over the batch (OLMo's ``wpe``) has no per-example gradient: exclude it."""
    proj_dim: int = 32
    """Projection width per side of the gradients a round compares (0 = exact)."""
    score_tokens: int = 0
    """Score each example on its first n tokens only (0 = all): a cheaper, approximate round."""
    measure: int = 0
    """Measure only this many of the window's examples per round (0 = all), drawn at random and spread
    over the data sources in proportion; every other example is scored as the mean of the measured,
    already transformed gradients (or losses) of its source (of all measured ones when the source is
    unknown): its expected score. A round then costs ``measure`` forward/backward passes instead of
    ``window``, which is what lets the selection pay for itself at equal compute; it ranks sources, not
    the examples inside a source it did not measure."""
    precondition: bool = True
    """greats / alignment: score what the optimizer would do with each example, not its raw gradient:
    every window gradient is divided, coordinate by coordinate, by an Adam-like ``sqrt(v)``, with ``v``
    the diagonal K-FAC estimate ``E[δ_i²]·E[a_j²]`` measured on the round's target pass (see
    docs/ARCHITECTURE.md). Without it a few high-variance directions (early in training: the byte or
    token frequencies every text shares) dominate the score."""
    remove_common: bool = True
    """greats / alignment: project every window gradient off the direction of the window's mean
    gradient before scoring. That direction is what every candidate would do alike, so it cannot tell
    them apart, but its coefficient follows each example's loss and dominated the ranking."""
    normalize: bool = True
    """greats / alignment: give every window gradient the same length (the window's mean, after
    ``remove_common``) before scoring, so the score is a cosine: long or high-loss examples no longer
    win by their gradient's size alone."""
    precondition_damping: float = 0.01
    """Floor of each second-moment factor, as a fraction of its mean (features the target never
    exercised would otherwise be weighted without bound)."""
    micro_batch: int = 0
    """Examples per forward/backward of a round (0 = the run's device micro-batch)."""
    seed: int = 0
    """Seeds the projectors and the random policy (varied per round)."""
    target_every: int = 5
    """``sources``: rounds between refreshes of the target gradient (its backward passes over
    ``target_examples`` are the policy's only ones); 1 = every round."""
    source_temperature: float = 0.1
    """``sources``: weights are ``share·exp(z / source_temperature)``, ``z`` each source's cosine with
    the target (in [-1, 1]) accumulated over rounds with ``source_memory``: lower is greedier."""
    source_memory: float = 0.9
    """``sources``: per round, the weight the evidence of earlier rounds keeps (0 = this round only)."""
    source_floor: float = 0.1
    """``sources``: the fraction of each round's examples drawn in the data's natural proportions,
    so every source keeps being trained on and measured."""
    source_decay: float = 0.5
    """``sources``: per round, the weight the captured rows seen so far keep against the new ones."""

    def validate(self, path: str = "selection") -> None:
        _check_types(self, path)
        _check(self.every_n >= 1, f"{path}.every_n", f"must be >= 1, got {self.every_n}")
        _check(self.window >= 1, f"{path}.window", f"must be >= 1, got {self.window}")
        _check(self.start_step >= 0, f"{path}.start_step", f"must be >= 0, got {self.start_step}")
        _check(0.0 < self.keep_fraction <= 1.0, f"{path}.keep_fraction", f"must be in (0, 1], got {self.keep_fraction}")
        _check(self.target_examples >= 1, f"{path}.target_examples", f"must be >= 1, got {self.target_examples}")
        _check(self.proj_dim >= 0, f"{path}.proj_dim", f"must be >= 0 (0 = exact), got {self.proj_dim}")
        _check(self.score_tokens >= 0, f"{path}.score_tokens", f"must be >= 0 (0 = all), got {self.score_tokens}")
        _check(self.measure >= 0, f"{path}.measure", f"must be >= 0 (0 = the whole window), got {self.measure}")
        _check(self.score_tokens != 1, f"{path}.score_tokens", "needs at least 2 tokens (one next-token loss)")
        _check(0 < self.precondition_damping < math.inf, f"{path}.precondition_damping",
               f"must be finite and > 0, got {self.precondition_damping}")
        _check(self.micro_batch >= 0, f"{path}.micro_batch", f"must be >= 0, got {self.micro_batch}")
        _check(self.seed >= 0, f"{path}.seed", f"must be >= 0, got {self.seed}")
        _check(self.target_every >= 1, f"{path}.target_every", f"must be >= 1, got {self.target_every}")
        _check(0 < self.source_temperature < math.inf, f"{path}.source_temperature",
               f"must be finite and > 0, got {self.source_temperature}")
        _check(0.0 <= self.source_floor <= 1.0, f"{path}.source_floor", f"must be in [0, 1], got {self.source_floor}")
        _check(0.0 <= self.source_memory < 1.0, f"{path}.source_memory", f"must be in [0, 1), got {self.source_memory}")
        _check(0.0 <= self.source_decay <= 1.0, f"{path}.source_decay", f"must be in [0, 1], got {self.source_decay}")
        if self.enabled and self.policy in (SelectionPolicy.GREATS, SelectionPolicy.ALIGNMENT,
                                            SelectionPolicy.SOURCES):
            _check(bool(self.target), f"{path}.target",
                   f"policy {self.policy.value!r} scores against target data: set selection.target to a text, "
                   "JSONL or token file")
        if self.target and self.enabled:
            _check(Path(self.target).is_file(), f"{path}.target", f"no such file: {self.target}")


class WandbMode(str, enum.Enum):
    OFFLINE = "offline"
    """Written under the run's folder only; ``wandb sync`` uploads it later."""
    ONLINE = "online"
    """Streamed to the W&B server (needs a login)."""


@dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases logging of the ``tda/*`` step metrics. Under OLMo, a run OLMo itself logs to
    (its ``wandb:`` section) gets them whatever this says; this section starts a run where none is
    (a DeepSpeed run, an OLMo run without ``wandb:``)."""

    enabled: bool = False
    """Start a W&B run (on rank 0) when none is running, and log every step's ``tda/*`` metrics to it."""
    project: str = "olmo-tda"
    """The W&B project of a run this section starts."""
    name: str | None = None
    """The W&B run's name; by default W&B makes one up."""
    mode: WandbMode = WandbMode.OFFLINE
    """``offline`` (the default: no network, no login) or ``online``. ``WANDB_MODE`` overrides it."""

    def validate(self, path: str = "wandb") -> None:
        _check_types(self, path)
        _check(bool(self.project), f"{path}.project", "must be a non-empty project name")


@dataclass(kw_only=True)
class TDAConfig:
    """The whole ``tda:`` section. ``enabled: true`` is the one flag that switches TDA on."""

    enabled: bool = False
    """Master switch. False means no hooks, no threads, no files: the run is the plain run."""
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    trajectory: TrajectoryConfig = field(default_factory=TrajectoryConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    callbacks: list[str] = field(default_factory=list)
    """The run's own training callbacks, ``"package.module:ClassName"`` each (a subclass of
    :class:`olmo_tda.training.callbacks.Callback`, built with no arguments): after every optimizer
    step each gets the step, the model, the batch's ids, the captured record and the metrics, and its
    ``state_dict`` travels in the run's checkpoints (docs/CALLBACKS.md)."""

    def validate(self, path: str = "tda") -> None:
        _check_types(self, path)
        self.capture.validate(f"{path}.capture", require_basis=False)   # a run defaults capture.basis
        self.store.validate(f"{path}.store")
        self.batch.validate(f"{path}.batch")
        self.trajectory.validate(f"{path}.trajectory")
        self.selection.validate(f"{path}.selection")
        self.wandb.validate(f"{path}.wandb")
        for n, spec in enumerate(self.callbacks):
            _check(spec.count(":") == 1 and all(spec.split(":")), f"{path}.callbacks[{n}]",
                   f"expected 'package.module:ClassName', got {spec!r}")
        if self.selection.enabled and not self.enabled:
            warnings.warn(f"{path}.selection is ignored: {path}.enabled is false (the run is plain training)",
                          stacklevel=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, *, path: str = "tda") -> "TDAConfig":
        return parse_config(cls, {} if data is None else data, path=path)

    @classmethod
    def from_yaml(cls, file: str | Path, *, overrides: list[str] | None = None,
                  section: str | None = "tda") -> "TDAConfig":
        """Load from a YAML file; with ``section``, read that top-level key (the ``tda:`` section)."""
        try:
            raw = yaml.safe_load(Path(file).read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{file}: not valid YAML: {e}") from None
        if raw is None:
            raw = {}
        _check(isinstance(raw, dict), str(file), f"expected a mapping at top level, got {type(raw).__name__}")
        if section is not None:
            raw = raw.get(section)
            raw = {} if raw is None else raw
            _check(isinstance(raw, dict), section, f"expected a mapping, got {type(raw).__name__}")
        data = apply_overrides(raw, overrides or [], path=section or "tda")
        return cls.from_dict(data, path=section or "tda")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-safe dict (enums as strings, tuples as lists)."""
        return to_plain(self)


# ---------------------------------------------------------------------------------------------
# strict parsing


def parse_config(cls: type, data: Any, *, path: str) -> Any:
    """Build dataclass ``cls`` from ``data`` strictly, then run its ``validate``."""
    obj = _parse_value(cls, data, path)
    obj.validate(path)
    return obj


def _parse_dataclass(cls: type, data: Any, path: str) -> Any:
    if isinstance(data, cls):       # built in Python (an override in a list): checked as strictly as YAML
        data = {f.name: getattr(data, f.name) for f in dataclasses.fields(cls) if f.init}
    _check(isinstance(data, dict), path, f"expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"{path}.{key}: unknown key{hint}")
        kwargs[key] = _parse_value(hints[key], value, f"{path}.{key}")
    return cls(**kwargs)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _parse_value(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _parse_dataclass(tp, value, path)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            _check(type(None) in options, path, "must not be null")
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _parse_value(option, value, path)
            except ConfigError as e:
                errors.append(str(e).split(": ", 1)[-1])
        raise ConfigError(f"{path}: {value!r} matches none of: " + "; ".join(errors))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        valid = [m.value for m in tp]
        if isinstance(value, tp):
            return value
        if value not in valid:
            close = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{path}: {value!r} is not one of {valid}{hint}")
        return tp(value)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        _check(isinstance(value, (list, tuple)), path, f"expected a list, got {type(value).__name__} {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            _check(len(value) == len(args), path, f"expected {len(args)} items, got {len(value)}")
            return tuple(_parse_value(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_parse_value(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    if tp is bool:
        _check(isinstance(value, bool), path, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), path,
               f"expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), path,
               f"expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), path, f"expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"{path}: unsupported config type {_type_name(tp)}")  # a bug in our dataclasses


def to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------
# dotted overrides


def apply_overrides(data: dict[str, Any], overrides: list[str], *, path: str = "tda") -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML scalars/lists) to a copy of ``data``.

    A leading ``--`` and a leading ``tda.`` are accepted, so ``--tda.capture.proj_dim=32`` works.
    """
    out = _deepcopy(data)
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. capture.proj_dim=32")
        key, raw = text.split("=", 1)
        if key.startswith(path + "."):
            key = key[len(path) + 1:]
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from None
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {path}.{'.'.join(parts[:i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data
