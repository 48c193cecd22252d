"""A selection round at the current weights: measure the upcoming window and the target through the
capture engine, order the window by the policy, rewrite the upcoming part of the epoch's order.

Framework-neutral: the integration supplies the model, how to fetch an example's tokens, how to run
the model on token ids, and where the epoch's order lives; :class:`OnlineSelector` does the rest.

- greats / alignment with ``precondition``: the target pass also sums each layer's input and
  output-gradient second moments (summed over ranks), and the window is captured already divided by
  the Adam-like ``sqrt(v)`` they give — see :meth:`OnlineSelector._scales`.
- ``measure: m`` (< window): only a random, source-proportional sample of m window examples is
  measured; every other one is scored from its source's measured rows (see :func:`impute_rows`).
- Measuring never changes training: parameter ``.grad`` are set aside and put back, the model runs in
  eval mode (no dropout) and restores its mode, the RNG streams are forked; there is no optimizer.
- With several ranks the window (and the target) is split evenly across ranks (short ranks repeat a
  row that is then ignored, so every rank runs the same number of forwards — FSDP needs that), the
  compact gradients are all-gathered, rank 0 orders the window and broadcasts the order: every rank
  applies the same one, and rank 0 alone writes the log.

Example (a plain torch model and a data order held in memory)::

    selector = OnlineSelector(SelectionConfig(enabled=True, every_n=10, window=64, policy="loss"),
                              model, forward=lambda m, ids: m(ids), log_folder="run/tda/selection")
    if selector.due(step):
        new_order, stats = selector.run(step=step, epoch=0, order=order, start=consumed,
                                        fetch=lambda ids: tokens[ids], lr=lr, tokens_per_batch=B * T,
                                        batch_size=B)
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..capture import GradientCapture
from ..capture.hooks import reduce_moments
from ..config import CaptureConfig, ConfigError, ProjectionType, SelectionConfig, SelectionMode, SelectionPolicy
from .mixture import SourceMixer, pull_forward
from .selection import POLICIES, SelectionError, SelectionLog, order_window, rewrite_order, round_stats

__all__ = ["OnlineSelector", "untouched_training_state", "load_target"]

log = logging.getLogger(__name__)

Forward = Callable[[nn.Module, torch.Tensor], torch.Tensor]
"""``forward(model, input_ids [B, T]) -> logits [B, T, V]``."""


TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")
TOKEN_SUFFIXES = (".npy", ".bin", ".dat", ".memmap")


def target_kind(path: str | Path) -> str:
    """``"text"``, ``"jsonl"`` or ``"tokens"``: how :func:`load_target` reads ``path``, by its suffix
    (any case). Another suffix is refused: read as token ids, a text would pass as nonsense ids."""
    suffix = Path(path).suffix.lower()
    for kind, suffixes in (("text", TEXT_SUFFIXES), ("jsonl", JSONL_SUFFIXES), ("tokens", TOKEN_SUFFIXES)):
        if suffix in suffixes:
            return kind
    raise ConfigError(f"selection target {path}: unknown file type {suffix or '(no suffix)'!r}; use "
                      f"{'/'.join(TEXT_SUFFIXES)} (documents separated by blank lines), "
                      f"{'/'.join(JSONL_SUFFIXES)} (a JSON object "
                      f"with a 'text' field per line) or {'/'.join(TOKEN_SUFFIXES)} (token ids)")


def load_target(path: str | Path, seq_len: int, encode: Callable[[str], list[int]], *, num: int,
                eos_token_id: int, memmap_dtype: np.dtype = np.uint16, vocab_size: int | None = None
                ) -> torch.Tensor:
    """``[n <= num, seq_len]`` int64 target rows from ``path``, by its suffix (:func:`target_kind`):

    - text (``.txt``, ``.text``, ``.md``): documents separated by blank lines, each kept whole with
      its own newlines (code, poems, tables stay what the model trains on); JSONL (``.jsonl``,
      ``.json``): a ``text`` field per line. Documents are tokenized, joined with EOS and cut into
      ``seq_len`` rows (the pretraining layout);
    - token ids (``.npy``, ``.bin``, ``.dat``, ``.memmap``): a ``.npy`` with a header holds a 2-D array
      of ids, rows cut to ``seq_len``; without one, OLMo's raw memmap of ``memmap_dtype`` ids, cut
      into ``seq_len`` rows. With ``vocab_size``, an id outside ``[0, vocab_size)`` is refused.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"selection target {path}: no such file")
    kind = target_kind(path)
    if kind != "tokens":
        stream: list[int] = []
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"selection target {path}: not UTF-8 text ({e})") from None
        if kind == "text":      # documents are blank-line separated blocks, their own newlines kept
            lines = [block.strip("\n") for block in re.split(r"\n[ \t]*\n", text)]
        else:
            lines = text.splitlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if kind == "jsonl":
                try:
                    line = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ConfigError(f"selection target {path}:{n}: expected a JSON object with a 'text' "
                                      "field") from None
                if not isinstance(line, str):
                    raise ConfigError(f"selection target {path}:{n}: 'text' is {type(line).__name__}, not a string")
            stream += list(encode(line)) + [eos_token_id]
            if len(stream) >= num * seq_len:
                break
        rows = np.asarray(stream[:len(stream) // seq_len * seq_len], dtype=np.int64).reshape(-1, seq_len)
    elif _has_npy_header(path):         # a real .npy (OLMo's memmaps have no header)
        arr = np.load(path, allow_pickle=False)
        if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
            raise ConfigError(f"selection target {path}: expected a 2-D array of integer token ids, got "
                              f"{arr.dtype} of shape {arr.shape}")
        if arr.shape[1] < 2:      # no next token to predict: the target's mean token loss is 0/0
            raise ConfigError(f"selection target {path}: rows of {arr.shape[1]} token(s) (shape {arr.shape}); each "
                              f"needs at least 2 tokens, up to seq_len={seq_len} (longer rows are cut to it)")
        rows = arr[:, :seq_len]
    else:
        itemsize = np.dtype(memmap_dtype).itemsize
        if path.stat().st_size % itemsize:
            raise ConfigError(f"selection target {path}: {path.stat().st_size} bytes is not a whole number of "
                              f"{np.dtype(memmap_dtype).name} token ids (is it a token file?)")
        flat = np.memmap(path, dtype=memmap_dtype, mode="r") if path.stat().st_size else np.zeros(0, memmap_dtype)
        rows = np.asarray(flat[:len(flat) // seq_len * seq_len]).reshape(-1, seq_len)
    if len(rows) == 0:
        raise ConfigError(f"selection target {path}: fewer than {seq_len} tokens, not one full row")
    rows = np.asarray(rows[:num], dtype=np.int64)
    if vocab_size is not None and (rows.min() < 0 or rows.max() >= vocab_size):
        raise ConfigError(f"selection target {path}: token ids span [{rows.min()}, {rows.max()}], outside the model's "
                          f"vocabulary [0, {vocab_size}) (another tokenizer's ids, or not a token file?)")
    return torch.from_numpy(rows)


def _has_npy_header(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(6) == b"\x93NUMPY"


@contextlib.contextmanager
def untouched_training_state(model: nn.Module) -> Iterator[None]:
    """Run extra forwards/backwards without a trace: ``.grad`` of every parameter set aside (and
    restored), eval mode (restored), the CPU and CUDA RNG streams forked."""
    params = list(model.parameters())
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    was_training = model.training
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            model.eval()
            yield
    finally:
        model.train(was_training)
        for p, g in zip(params, saved):
            p.grad = g


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_shared(folder: Path, rank: int, world: int) -> None:
    """Refuse, on every rank alike, a round log some rank cannot see (collective). Rank 0 writes the
    log, and every rank reads it: each rank's loader follows the order its rounds make, and a resume
    replays them. A folder on each node's own disk (a save_folder that is not shared) would leave the
    other nodes an empty log: their resume hung in OLMo's barrier, or (DeepSpeed) trained those ranks
    on another order than rank 0's, silently."""
    probe: list = [None]
    if rank == 0:
        name = f".shared-check-{uuid.uuid4().hex}"
        try:
            (folder / name).write_bytes(b"")
            probe[0] = name
        except OSError as e:
            probe[0] = OSError(f"tda.selection: cannot write in the round log folder {folder}: {e}")
    dist.broadcast_object_list(probe, src=0)
    if isinstance(probe[0], OSError):
        raise probe[0]
    seen: list = [None] * world
    dist.all_gather_object(seen, os.path.exists(folder / probe[0]))
    if rank == 0:
        with contextlib.suppress(OSError):
            os.remove(folder / probe[0])
    blind = [r for r, visible in enumerate(seen) if not visible]
    if blind:
        raise ConfigError(f"tda.selection: rank(s) {blind} do not see the round log folder {folder} that rank 0 "
                          "writes (a save_folder on each node's own disk?): every rank follows and, on resume, "
                          "replays its rounds. Put save_folder (OLMo) / run_dir (DeepSpeed) on a filesystem all "
                          "nodes share")


def _set_aside_nonfinite(grads: torch.Tensor | None, losses: np.ndarray | None, sample: np.ndarray, ids: np.ndarray,
                         step: int) -> tuple[torch.Tensor | None, np.ndarray | None, np.ndarray]:
    """Zero the measured rows whose gradient or loss is NaN/inf (one would make every score NaN: the
    common direction and the mean norm are over all rows) and return the window positions they are
    at, which the round places last; a warning names their ids."""
    bad = np.zeros(len(sample), dtype=bool)
    if grads is not None:
        bad |= ~torch.isfinite(grads).all(dim=1).numpy()
    if losses is not None:
        bad |= ~np.isfinite(losses)
    if not bad.any():
        return grads, losses, np.zeros(0, dtype=np.int64)
    log.warning("selection round after step %d: %d examples have a non-finite gradient or loss and go last in the "
                "window: ids %s", step, int(bad.sum()), ids[sample[bad]][:16].tolist())
    if grads is not None:
        grads = grads.clone()
        grads[torch.from_numpy(bad)] = 0
    if losses is not None:
        losses = np.where(bad, 0.0, losses)
    return grads, losses, np.asarray(sample[bad], dtype=np.int64)


def _my_rows(num: int, rank: int, world: int) -> tuple[np.ndarray, int]:
    """This rank's contiguous chunk of ``num`` rows padded to ``ceil(num / world)`` with row 0 or its
    own first row (padding is ignored after the gather), and how many rows are real."""
    per = math.ceil(num / world)
    rows = np.arange(rank * per, min((rank + 1) * per, num))
    pad = np.full(per - len(rows), rows[0] if len(rows) else 0)
    return np.concatenate([rows, pad]).astype(np.int64), len(rows)


class OnlineSelector:
    """Runs rounds of online data selection (see the module docstring).

    Args:
        config: the ``tda.selection`` section.
        model: what the rounds run (an FSDP-wrapped model as is; a DDP model's ``.module``).
        forward: ``forward(model, input_ids) -> logits``.
        log_folder: where rounds are persisted (rank 0 writes).
        target_tokens: ``[n, L]`` ids of the target data (greats / alignment).
        micro_batch: examples per forward/backward of a round.
        device: where token rows go.
        pause: other captures to pause during a round (the run's own per-step capture).
    """

    def __init__(self, config: SelectionConfig, model: nn.Module, *, forward: Forward, log_folder,
                 target_tokens: torch.Tensor | None = None, micro_batch: int = 8,
                 device: torch.device | str = "cpu", pause: tuple[GradientCapture, ...] = (),
                 capture: GradientCapture | None = None, sources: list[str] | None = None,
                 source_shares: list[float] | None = None):
        config.validate()
        self.config = config
        self.model = model
        self.forward = forward
        self.device = torch.device(device)
        self.micro_batch = config.micro_batch or micro_batch
        self.rank, self.world = _dist()
        self.log = SelectionLog(log_folder, writer=self.rank == 0)
        if self.world > 1:
            _check_shared(self.log.folder, self.rank, self.world)
        self._pause = pause
        self.mixer: SourceMixer | None = None
        self._fold_seconds = 0.0
        self._pending: list[tuple[np.ndarray, object]] = []      # (ids, Recording) since the last fold
        self._source_index: Callable[[np.ndarray], np.ndarray] | None = None
        self.capture = None
        self._owns_capture = True
        if config.policy is SelectionPolicy.SOURCES:
            if capture is None or target_tokens is None or not sources:
                raise ConfigError("selection policy 'sources' needs the run's capture (its rows), target tokens "
                                  "and the data's source names")
            self.capture, self._owns_capture = capture, False
            shares = source_shares if source_shares is not None else [1.0] * len(sources)
            self.mixer = SourceMixer(sources, shares=shares,
                                     temperature=config.source_temperature, memory=config.source_memory,
                                     floor=config.source_floor,
                                     decay=config.source_decay, precondition=config.precondition,
                                     damping=config.precondition_damping)
            self._needs = frozenset({"target"})
        else:
            self._needs = POLICIES[config.policy.value][1]
        if "target" in self._needs and target_tokens is None:
            raise ConfigError(f"selection policy {config.policy.value!r} needs target tokens")
        self.target_tokens = target_tokens
        if "grads" in self._needs:
            cap = CaptureConfig(proj_dim=config.proj_dim, proj_type=ProjectionType.ORTHOGONAL, seed=config.seed,
                                exclude=list(config.exclude_modules), embeddings=config.embeddings)
            self.capture = GradientCapture(model, cap)
            self.capture.pause()                # silent during training steps; resumed inside a round
        self._prev_scores: dict[int, float] | None = None

    def due(self, step: int) -> bool:
        cfg = self.config
        return cfg.enabled and step > 0 and step >= cfg.start_step and step % cfg.every_n == 0

    def close(self) -> None:
        if self.capture is not None and self._owns_capture:
            self.capture.remove()

    # -- the sources policy: rows the training step captured ----------------------------------------

    def observe(self, record) -> None:
        """Keep one step's :class:`~olmo_tda.capture.hooks.Recording` on this rank for the ``sources``
        policy; its rows (:meth:`~olmo_tda.capture.hooks.Recording.dense`) are folded into the sums at
        the next round or checkpoint (:meth:`sync`), in one batch: the step itself only keeps a
        reference (a factor-stored capture's dense rows are formed then, off the step). A no-op for
        other policies."""
        if self.mixer is not None and len(record.ids):
            self._pending.append((np.asarray(record.ids, dtype=np.int64), record))

    def sync(self, source_index: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """Fold the kept rows into the mixer, summed over ranks. Collective: every rank calls it at
        the same points (each round, and before its state goes into a checkpoint)."""
        if self.mixer is None:
            return
        t0 = time.perf_counter()
        source_index = source_index or self._source_index
        if self._pending:
            if source_index is None:
                raise SelectionError("selection policy 'sources' needs each example's data source")
            dense = [(i, rec.dense()) for i, rec in self._pending]
            names = list(dense[0][1])
            rows = torch.cat([torch.cat([g[n].reshape(len(i), -1) for i, g in dense]) for n in names], dim=1)
            self.mixer.observe(source_index(np.concatenate([i for i, _ in self._pending])), rows)
            self._pending = []
        reduce = None
        if self.world > 1:
            def reduce(flat: torch.Tensor) -> torch.Tensor:
                buf = flat.to(self.device)
                dist.all_reduce(buf)
                return buf.cpu()
        width = sum(k_out * k_in for k_out, k_in in self.capture.layer_shapes.values())
        self.mixer.sync(reduce, width=width)
        self._fold_seconds += time.perf_counter() - t0

    def _run_sources(self, *, step: int, epoch: int, order: np.ndarray, start: int, batch_size: int,
                     source_index: Callable[[np.ndarray], np.ndarray] | None) -> tuple[np.ndarray | None, dict]:
        """A ``sources`` round: the next ``every_n`` steps' examples drawn by the learned source weights
        (see :mod:`olmo_tda.training.mixture`)."""
        t0 = time.perf_counter()
        cfg, mixer = self.config, self.mixer
        if source_index is None:
            raise SelectionError("selection policy 'sources' needs each example's data source")
        if start >= len(order):
            return None, {}
        self._source_index = source_index
        self.sync(source_index)
        refreshed = mixer.needs_target(cfg.target_every)
        measured = 0
        if refreshed:
            with untouched_training_state(self.model):
                target = self._target_gradient()
            if not bool(torch.isfinite(target).all()):       # all-reduced: every rank raises
                raise SelectionError(f"selection round after step {step}: the target gradient is not finite (the "
                                     f"model diverged, or a target example has no finite loss): {cfg.target}")
            mixer.set_target(target)
            measured = min(cfg.target_examples, len(self.target_tokens))
        round_seed = int(np.random.SeedSequence([cfg.seed, epoch, step]).generate_state(1)[0])
        decided: list = [None]
        if self.rank == 0:          # rank 0 decides; every rank applies the same draw
            scores = mixer.scores()
            weights = mixer.weights(mixer.accumulate(scores))
            ids, counts = mixer.pick(order, start, source_index, cfg.every_n * batch_size, weights, round_seed)
            decided[0] = (ids, counts, scores, weights)
        if self.world > 1:
            dist.broadcast_object_list(decided, src=0)
        ids, counts, scores, weights = decided[0]
        if self.rank != 0:      # rank 0's evidence, so that every rank's checkpointable state is the same
            mixer.evidence = mixer.memory * mixer.evidence + scores
        rows_seen = mixer.counts.numpy().copy()
        mixer.end_round()
        new_order = pull_forward(order, start, ids)
        names = mixer.names
        stats = {"examples_rescored": int(len(ids)), "examples_measured": int(measured), "policy": cfg.policy.value,
                 "mode": "pull", "target_refreshed": bool(refreshed), "preconditioned": bool(mixer.precondition),
                 "score_mean": float(np.mean(scores)), "score_hist": {"counts": [], "edges": []},
                 "source_weight": {n: float(w) for n, w in zip(names, weights)},
                 "source_score": {n: float(c) for n, c in zip(names, scores)},
                 "source_rows": {n: float(r) for n, r in zip(names, rows_seen)},
                 "source_frac_front": {n: float(c) / max(len(ids), 1) for n, c in zip(names, counts)},
                 # every selection second since the last round: this round's, and folding each step's rows
                 "seconds": time.perf_counter() - t0 + self._fold_seconds}
        self._fold_seconds = 0.0
        self.log.append(epoch=epoch, step=step, start=start, keep=len(ids), window_ids=ids, stats=stats, rule="pull")
        return new_order, stats

    # -- measuring ---------------------------------------------------------------------------------

    def _truncate(self, tokens: torch.Tensor) -> torch.Tensor:
        n = self.config.score_tokens
        return tokens[:, :n] if n and tokens.shape[1] > n else tokens

    def _example_losses(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B]`` summed next-token CE of each row."""
        logits = self.forward(self.model, input_ids)
        labels = input_ids[:, 1:]
        ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), reduction="none")
        return ce.view(labels.shape).sum(dim=1)

    def _measure(self, tokens: torch.Tensor, grads: bool, real: int | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(grads [n, D] or None, summed token losses [n])`` of the rows of ``tokens`` (already
        truncated to ``score_tokens``); rows from ``real`` on are padding and do not count in the
        capture's moments."""
        tokens = tokens.to(self.device)
        real = len(tokens) if real is None else real
        rows, losses = [], []
        for lo in range(0, len(tokens), self.micro_batch):
            chunk = tokens[lo:lo + self.micro_batch]
            if not grads:
                with torch.no_grad():
                    losses.append(self._example_losses(chunk).detach().float().cpu())
                continue
            with self.capture.record(np.arange(lo, lo + len(chunk))) as rec, _outputs_of(self.capture) as outs, \
                    self.capture.moment_rows(min(len(chunk), max(0, real - lo))):
                per_example = self._example_losses(chunk)
                # gradients w.r.t. the captured layers' outputs only: the capture hooks see them,
                # and no parameter gradient is formed or accumulated (nor reduced by DDP/ZeRO hooks)
                torch.autograd.grad(per_example.sum(), outs, allow_unused=True)
            losses.append(per_example.detach().float().cpu())
            rows.append(torch.cat([g.reshape(len(chunk), -1) for g in rec.dense().values()], dim=1).cpu())
        return (torch.cat(rows) if grads else None), torch.cat(losses)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        out = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(out, x.contiguous())
        return torch.cat(out)

    def _measure_window(self, ids: np.ndarray, fetch: Callable[[np.ndarray], torch.Tensor]):
        """``(grads [W, D] or None, summed token losses [W], tokens scored per example)``: this
        rank's chunk measured, then every rank's gathered (chunks are contiguous, so the first W
        gathered rows are the window in order)."""
        rows, _ = _my_rows(len(ids), self.rank, self.world)
        tokens = self._truncate(fetch(ids[rows]))
        grads, losses = self._measure(tokens, grads="grads" in self._needs)
        losses = self._gather(losses.to(self.device)).cpu()[:len(ids)]
        if grads is not None:
            grads = self._gather(grads.to(self.device)).cpu()[:len(ids)]
        return grads, losses, tokens.shape[1]

    def _scales(self, moments: dict, tokens_per_batch: int
                ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
        """``({layer: (s_out, s_in)}, h)`` from the moments summed over ranks: ``s_out_i·s_in_j =
        1 / sqrt(v_ij)`` with ``v_ij = R_i·C_j / N``, the second moment of a batch gradient averaged over
        N = tokens per batch when each token's gradient has second moment ``R_i·C_j`` (diagonal K-FAC;
        exact for independent tokens) — what Adam divides by; ``h`` the mean of ``R_i·C_j`` over every
        coordinate, the per-token Fisher diagonal's average (GREATS' isotropic curvature)."""
        reduce_moments(moments, self.device)
        n4 = float(tokens_per_batch) ** 0.25
        scales, fisher, coords = {}, 0.0, 0
        for name, m in moments.items():
            r, c = m.second_moment(self.config.precondition_damping)
            scales[name] = ((n4 / r.sqrt()).float(), (n4 / c.sqrt()).float())
            fisher += float(r.sum()) * float(c.sum())
            coords += r.numel() * c.numel()
        return scales, fisher / max(coords, 1)

    def _target_gradient(self) -> torch.Tensor:
        """``[D]`` gradient of the target's mean token loss (summed over ranks' shares)."""
        tokens = self._truncate(self.target_tokens[:self.config.target_examples])
        rows, real = _my_rows(len(tokens), self.rank, self.world)
        grads, _ = self._measure(tokens[rows], grads=True, real=real)
        total = grads[:real].double().sum(dim=0).to(self.device)
        if self.world > 1:
            dist.all_reduce(total)
        return (total / (len(tokens) * (tokens.shape[1] - 1))).float().cpu()

    # -- the round --------------------------------------------------------------------------------

    def run(self, *, step: int, epoch: int, order: np.ndarray, start: int,
            fetch: Callable[[np.ndarray], torch.Tensor], lr: float, tokens_per_batch: int, batch_size: int,
            sources: Callable[[np.ndarray], list[str]] | None = None,
            source_index: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[np.ndarray | None, dict]:
        """One round after optimizer step ``step``: ``(the epoch's new order, stats)``; the order is
        None when no upcoming position is left. ``order``: the epoch's global order (ids);
        ``start``: the first position not yet consumed; ``fetch(ids) -> [n, T]`` token ids;
        ``source_index(ids) -> [n]`` indices into the ``sources`` names (the ``sources`` policy)."""
        if self.mixer is not None:
            return self._run_sources(step=step, epoch=epoch, order=order, start=start, batch_size=batch_size,
                                     source_index=source_index)
        t0 = time.perf_counter()
        cfg = self.config
        ids = np.asarray(order[start:start + cfg.window], dtype=np.int64)
        if len(ids) == 0:
            return None, {}
        groups = sources(ids) if sources is not None else None
        round_seed = int(np.random.SeedSequence([cfg.seed, epoch, step]).generate_state(1)[0])
        sample = measured_sample(len(ids), cfg.measure if self._needs else 0, groups, round_seed)
        with contextlib.ExitStack() as stack:
            for other in self._pause:
                stack.enter_context(other.pause())
            stack.enter_context(untouched_training_state(self.model))
            if self.capture is not None:
                stack.enter_context(_resumed(self.capture))
            precondition = cfg.precondition and "target" in self._needs and tokens_per_batch > 0
            # the target pass measures the moments that give the preconditioner P; the window is then
            # captured as P·g_i (what Adam would do with each example) and compared with the raw ḡ
            scales, fisher, target = None, 0.0, None
            if "target" in self._needs:
                with self.capture.moments() if precondition else contextlib.nullcontext() as moments:
                    target = self._target_gradient()
                if precondition:
                    scales, fisher = self._scales(moments, tokens_per_batch)
            with self.capture.scaled(scales) if scales else contextlib.nullcontext():
                grads, losses, length = self._measure_window(ids[sample], fetch) if self._needs else (None, None, 0)
        mean_losses = None if losses is None else (losses.double() / (length - 1)).numpy()
        perm = torch.zeros(len(ids), dtype=torch.int64)
        scores = torch.zeros(len(ids), dtype=torch.float64)
        compared = grads is not None and target is not None        # greats / alignment
        broken = np.zeros(0, dtype=np.int64)      # window positions whose measurement is NaN/inf
        ok = np.ones(len(sample), dtype=bool)     # measured rows that count in window-wide means
        if target is not None and not bool(torch.isfinite(target).all()):   # all-reduced: every rank raises
            raise SelectionError(f"selection round after step {step}: the target gradient is not finite (the "
                                 f"model diverged, or a target example has no finite loss): {cfg.target}")
        if self.rank == 0:
            grads, mean_losses, broken = _set_aside_nonfinite(grads, mean_losses, sample, ids, step)
            # the measured rows that count in window-wide means (the common direction, the mean norm,
            # a source's mean for the unmeasured): a set-aside row is zeros, not a measurement
            ok = ~np.isin(sample, broken)
            if cfg.remove_common and compared and int(ok.sum()) > 1:
                # what every candidate does alike cannot tell them apart, yet its coefficient (which
                # follows each example's loss, not its content) dominated the ranking
                grads = remove_common_direction(grads, rows=torch.from_numpy(ok))
            if cfg.normalize and compared:
                # unit length per example, keeping the summed-token scale of the batch's update
                norms = grads.double().norm(dim=1, keepdim=True)
                mean_norm = norms[torch.from_numpy(ok)].mean() if ok.any() else norms.mean()
                grads = (grads.double() * (mean_norm / norms.clamp_min(1e-30))).float()
            lr_eff = lr / max(tokens_per_batch, 1)
            # GREATS' second-order term ½Δθᵀ H Δθ of the step Δθ = η Σ g_i (g_i = P·g_i when
            # preconditioned): H = I for plain gradients (the paper's SGD form), H = h·I with h the mean
            # per-token Fisher diagonal for Adam-like steps (H = I would weigh P-sized steps ~N/h times
            # too much and favour whatever is least like the picks so far)
            kw = dict(lr_eff=lr_eff, batch_size=batch_size, curvature=lr_eff ** 2 * (fisher if scales else 1.0),
                      seed=round_seed)
            if len(sample) == len(ids):
                p, s = order_window(cfg.policy.value, grads=grads, target=target, losses=mean_losses,
                                    num=len(ids), **kw)
            elif cfg.policy.value == "greats":
                # the unmeasured stand in as their source's mean measured gradient: the expected
                # alignment, and the redundancy of picking more of that source
                p, s = order_window("greats", grads=impute_rows(grads, sample, len(ids), groups, ok=ok),
                                    target=target, num=len(ids), **kw)
            else:       # a per-example score: each unmeasured example gets its source's mean score
                _, s = order_window(cfg.policy.value, grads=grads, target=target, losses=mean_losses,
                                    num=len(sample), **kw)
                s = impute_rows(torch.as_tensor(np.asarray(s, dtype=np.float64))[:, None], sample, len(ids),
                                groups, ok=ok)[:, 0].numpy()
                p = np.argsort(-s, kind="stable")
            if len(broken):                         # last, in their order: never promoted on a NaN score
                s = np.asarray(s, dtype=np.float64).copy()
                s[broken] = -np.inf
                p = np.concatenate([p[~np.isin(p, broken)], broken])
            perm, scores = torch.from_numpy(p), torch.from_numpy(np.asarray(s, dtype=np.float64))
        if self.world > 1:          # rank 0 decides; every rank applies the same order
            for t in (perm, scores):
                buf = t.to(self.device)
                dist.broadcast(buf, src=0)
                t.copy_(buf.cpu())
        perm_np, scores_np = perm.numpy(), scores.numpy()
        keep = len(ids) if cfg.mode is SelectionMode.REORDER else max(1, math.ceil(cfg.keep_fraction * len(ids)))
        placed = perm_np
        if keep < len(ids):         # filter: the kept examples keep their relative order (batches stay mixed)
            placed = np.concatenate([np.sort(perm_np[:keep]), perm_np[keep:]])
        new_order = rewrite_order(np.asarray(order, dtype=np.int64), start, ids[placed], keep)
        if self._prev_scores is None and self.log.writer:      # after a resume: the last logged round's
            self._prev_scores = self.log.previous_scores(epoch, step)
        stats = round_stats(ids, perm_np, scores_np, keep, self._prev_scores, groups)
        stats.update(examples_measured=int(len(sample)) if self._needs else 0,
                     policy=cfg.policy.value, mode=cfg.mode.value, preconditioned=bool(scales),
                     common_removed=bool(cfg.remove_common and compared and len(ids) > 1),
                     normalized=bool(cfg.normalize and compared), seconds=time.perf_counter() - t0,
                     mean_loss_window=_mean_loss(mean_losses, ok))
        self._prev_scores = dict(zip(ids.tolist(), scores_np.tolist()))
        self.log.append(epoch=epoch, step=step, start=start, keep=keep, window_ids=ids[placed], stats=stats,
                        scores=scores_np[placed])
        return new_order, stats


def _mean_loss(losses: np.ndarray | None, ok: np.ndarray) -> float | None:
    """The window's mean loss over its measured rows that were not set aside (None without any)."""
    if losses is None:
        return None
    good = ok & np.isfinite(losses)
    return float(losses[good].mean()) if good.any() else None


@contextlib.contextmanager
def _outputs_of(capture: GradientCapture) -> Iterator[list[torch.Tensor]]:
    """Collects the outputs of the captured layers' forwards run inside the block."""
    outs: list[torch.Tensor] = []

    def keep(module, args, output):
        if output.requires_grad:
            outs.append(output)
    handles = [m.register_forward_hook(keep) for m in capture.modules.values()]
    try:
        yield outs
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _resumed(capture: GradientCapture) -> Iterator[None]:
    capture.resume()
    try:
        yield
    finally:
        capture.pause()


def remove_common_direction(grads: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``[W, D]`` rows projected off the unit direction of their mean: ``g_i − ⟨g_i, u⟩ u``, ``u = ḡ/‖ḡ‖``;
    ``rows`` (a ``[W]`` bool mask) picks the rows whose mean that is (default: all)."""
    g = grads.double()
    mean = (g if rows is None else g[rows]).mean(dim=0)
    norm = float(mean.norm())
    if norm == 0.0:
        return grads
    unit = mean / norm
    return (g - (g @ unit)[:, None] * unit[None, :]).to(grads.dtype)


def measured_sample(num: int, measure: int, groups: list[str] | None, seed: int) -> np.ndarray:
    """Sorted window positions a round measures: all ``num`` when ``measure`` is 0 or covers the
    window, else ``measure`` drawn at random, each source getting its share of them to within one
    (systematic sampling over a random order, with a random phase per source)."""
    if not measure or measure >= num:
        return np.arange(num)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num)
    if groups is None:
        return np.sort(perm[:measure])
    _, group = np.unique(np.asarray(groups), return_inverse=True)
    phase = rng.random(int(group.max()) + 1)
    g = group[perm]                                     # the sources in the random order
    size = np.bincount(g)
    by_source = np.argsort(g, kind="stable")
    seen = np.empty(num)                                # how many of its source came before, in that order
    seen[by_source] = np.arange(num) - (np.cumsum(size) - size)[g[by_source]]
    key = (seen + phase[g]) / size[g]
    return np.sort(perm[np.argsort(key, kind="stable")[:measure]])


def impute_rows(rows: torch.Tensor, measured: np.ndarray, num: int, groups: list[str] | None,
                ok: np.ndarray | None = None) -> torch.Tensor:
    """``[num, ...]``: ``rows[k]`` at window position ``measured[k]``; every other position the mean
    of the measured rows of its source (of every measured row when its source has none measured, or
    the sources are unknown). ``ok`` (a bool mask over ``measured``) leaves rows out of those means
    (set-aside measurements); they still sit at their own positions."""
    out = rows.new_empty((num, *rows.shape[1:]))
    out[torch.as_tensor(measured)] = rows
    rest = torch.as_tensor(np.setdiff1d(np.arange(num), measured))
    if ok is not None and ok.any() and not ok.all():
        rows, measured = rows[torch.from_numpy(np.asarray(ok))], np.asarray(measured)[ok]
    overall = rows.double().mean(dim=0)
    if groups is None:
        out[rest] = overall.to(rows.dtype)
        return out
    _, group = np.unique(np.asarray(groups), return_inverse=True)
    at = torch.as_tensor(group[measured])
    sums = torch.zeros((int(group.max()) + 1, *rows.shape[1:]), dtype=torch.float64).index_add_(0, at, rows.double())
    counts = torch.bincount(at, minlength=len(sums)).view(-1, *[1] * (rows.dim() - 1))
    means = torch.where(counts > 0, sums / counts.clamp_min(1), overall)       # none measured: all of them
    out[rest] = means[torch.as_tensor(group)[rest]].to(rows.dtype)
    return out
