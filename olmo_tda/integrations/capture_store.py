"""Capture + store: one concern of a training run, shared by the OLMo trainer and the DeepSpeed attach.

:class:`CaptureStore` owns this rank's gradient store and, with ``capture.basis_every``, the
eigenbasis that follows training. The integrations make each optimizer step's record (each framework
its own way: OLMo one record around the micro-batch loop, DeepSpeed one per micro-batch, joined at the
step) and hand it to :meth:`CaptureStore.commit`; everything after that is here and is the same for
both: the append, the basis refresh, the step's ``tda/*`` capture numbers, the run's row count, the
store's position in a checkpoint, and on resume the checks before anything is cut, then the cut.

A checkpoint holds :meth:`CaptureStore.state_dict` (plain types); a resume calls
:meth:`CaptureStore.check_resume` (refusals: other projectors, another run's store, a checkpoint of an
abandoned run) before any part of the run changes anything on disk, then :meth:`CaptureStore.resume`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch

from ..capture import GradientCapture
from ..capture.eigenbasis import EigenBasisError
from ..config import ConfigError, StoreConfig
from ..store import GradientRecord, GradientStore, StoreError
from ..store.format import BASES_DIR
from ..training.metrics import capture_numbers
from . import _group, decided_on_rank0, done_on_every_rank

__all__ = ["CaptureStore", "check_rows_continue", "cut_departed_ranks", "resume_state"]

log = logging.getLogger(__name__)


class CaptureStore:
    """This rank's store (and following basis) for ``capture`` on ``model``: see the module doc.

    ``meta`` is what ``store.json`` records beside the capture's own metadata (``extra``);
    ``barrier`` synchronizes the ranks when a following basis is written (None on one rank)."""

    def __init__(self, model: torch.nn.Module, capture: GradientCapture, config: StoreConfig, path: str | Path,
                 meta: Mapping[str, Any], *, rank: int, world_size: int, barrier: Callable[[], None] | None = None):
        self.capture = capture
        self.path = Path(path)
        self.store = GradientStore.create(self.path, capture.store_metadata() | dict(meta), config, rank=rank)
        self.follower = None
        self.run_rows = 0           # the run's rows so far, all ranks, through resumes
        self.row_bytes = (4 if config.dtype.value == "float32" else 2) * capture.floats_per_example
        if capture.basis is not None:      # capture.basis_every: the basis follows the run
            from ..capture.following import BasisFollower

            try:
                self.follower = BasisFollower(model, capture, capture.config, self.path / BASES_DIR,
                                              writer=rank == 0, distributed=world_size > 1, barrier=barrier)
                self.follower.start(1)      # a resume replaces the history with its checkpoint's
            except BaseException:
                self.store.close()
                raise

    # -- the step ------------------------------------------------------------------------------

    def before_step(self, step: int) -> None:
        """Before the forward of ``step``: a following basis samples token rows when a refresh is near."""
        if self.follower is not None:
            self.follower.before_step(step)

    def commit(self, record: GradientRecord | None, step: int) -> float:
        """After the optimizer applied ``step``: append its ``record`` (None: this rank had no row),
        then refresh a following basis if due (this step's rows are the old version's). Returns the
        milliseconds the append took (the writer thread does the rest)."""
        append_ms = 0.0
        if record is not None:
            t0 = time.perf_counter()
            self.store.append(record)
            append_ms = 1e3 * (time.perf_counter() - t0)
        if self.follower is not None:
            self.follower.after_step(step)
        return append_ms

    def numbers(self, *, rows: int, append_ms: float, seconds: float
                ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """This rank's capture numbers of the step: to sum over the ranks, to maximize, and the same
        on every rank (:func:`~olmo_tda.training.metrics.capture_numbers`)."""
        return capture_numbers(self.store, self.follower, rows=rows, append_ms=append_ms, seconds=seconds,
                               row_bytes=self.row_bytes)

    def count_run_rows(self, metrics: dict[str, float]) -> None:
        """``metrics["tda/rows_captured"]``, the step's rows summed over the ranks, becomes the run's
        total so far (carried over a resume by the checkpoint)."""
        self.run_rows += int(metrics["tda/rows_captured"])
        metrics["tda/rows_captured"] = float(self.run_rows)

    # -- checkpoints ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Make every committed step durable (before a checkpoint that records it exists)."""
        self.store.flush()

    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint at ``step`` records (plain types): the store's path, id and position,
        the projectors, the run's row count and a following basis's versions."""
        state = {"store": str(self.store.path), "store_id": self.store.store_id, "step": int(step),
                 "projector_hash": self.capture.projector_hash, "rows_captured": self.run_rows,
                 **resume_state(self.store)}
        if self.follower is not None:       # the basis versions in force up to this step
            state["basis"] = self.follower.state_dict()
        return state

    def check_resume(self, saved: Mapping[str, Any] | None, step: int, *, new_timeline: bool = False) -> None:
        """Before any part of a resume from the checkpoint of ``step`` changes anything: refuse other
        projectors than its store's, another run's store, a checkpoint of an abandoned run, and a
        following basis whose versions the rows kept need are missing or unlisted."""
        saved = dict(saved) if saved is not None else None
        if saved is not None and saved.get("projector_hash") != self.capture.projector_hash:
            raise ConfigError(f"tda.capture: resuming with projectors {self.capture.projector_hash}, but the "
                              f"checkpoint's store used {saved.get('projector_hash')}; keep tda.capture as it was")
        self.store.check_resume(saved, step)
        check_rows_continue(self.store, saved, step)
        if self.follower is not None:
            try:
                self.follower.check_resume(None if new_timeline else (saved or {}).get("basis"), step,
                                           stored=self.store.bases_up_to(step))
            except EigenBasisError as e:
                raise ConfigError(f"tda.capture.basis_every: {e}") from None

    def resume(self, saved: Mapping[str, Any] | None, step: int, *, new_timeline: bool = False) -> None:
        """Go on from the checkpoint of ``step`` (``saved``: its :meth:`state_dict`; ``new_timeline``:
        only its weights are kept and the run counts from 0): drop every rank's rows after ``step``
        (they will be re-run), and keep a following basis's versions in force up to it."""
        saved = {} if saved is None or new_timeline else saved
        self.run_rows = int(saved.get("rows_captured", saved.get("rows_captured_run", 0)))
        dropped = done_on_every_rank(lambda: self.store.truncate_after(step))  # all raise alike, once all cut
        if dropped:
            log.info("tda: dropped %d of this rank's stored rows past step %d (they will be re-run)", dropped, step)
        cut_departed_ranks(self.store, step)     # resumed on fewer ranks: the others' later rows too
        if self.follower is not None:       # the versions in force up to here; later ones' files removed
            try:
                self.follower.load_state_dict(saved.get("basis"), step, stored=self.store.bases)
            except EigenBasisError as e:
                raise ConfigError(f"tda.capture.basis_every: {e}") from None

    def start_over(self) -> None:
        """Start the run over from step 0 over the rows an attempt that stopped without a checkpoint
        stored: every rank drops them, as a resume from step 0 would (collective)."""
        self.resume(None, 0)

    def close(self) -> None:
        """Remove a following basis's hooks, then write the last window and close the store."""
        try:
            if self.follower is not None:
                self.follower.remove()
        finally:
            self.store.close()


def cut_departed_ranks(store: Any, step: int) -> None:
    """On resume, after each rank's own ``truncate_after(step)``: drop the rows after ``step`` that
    ranks this run does not have wrote (a run resumed on fewer ranks), then have every rank re-read
    the others' shards and cuts. Rank 0 cuts; every rank gets its outcome, so all raise or all go on.

    Call it once every rank has cut its own rows (:meth:`CaptureStore.resume` waits for that). The
    re-read happens whenever there are several ranks: each writer opened before the others cut, and a
    run resumed on another number of ranks hands a rank ids another rank held at the steps it
    replays; read as they were at open, that rank's rows cut since would make the replayed rows look
    like duplicates, and they would be skipped."""
    world = _group()[2]
    departed = store.departed_after(step, world)    # the same answer on every rank
    if departed:
        try:
            decided_on_rank0(lambda: store.truncate_departed(step, world))
        except Exception as e:  # noqa: BLE001 - named in the error every rank raises
            raise StoreError(f"resuming on {world} ranks: cutting back the rows of the ranks this run does not "
                             f"have failed: {type(e).__name__}: {e}") from e
    if departed or world > 1:
        store.rescan_others()


def resume_state(store: Any) -> dict[str, Any]:
    """What a checkpoint records of the store's position, beside its path, id and step: this rank's
    last durable step (flushed first), how many truncations its rows have been through, and the seq
    its next shard or cut marker takes."""
    log_id, count = store.timeline()
    return {"reached": store.reached(), "timeline": count, "timeline_id": log_id, "cut_seq": store.next_seq}


def check_rows_continue(store: Any, saved: dict[str, Any] | None, step: int) -> None:
    """Before a resume from the checkpoint of ``step`` (``saved``: its :func:`resume_state` and
    store id) cuts the store back: refuse a checkpoint of an abandoned run. That is one saved before
    a later resume from an earlier checkpoint cut the store below its step (e.g.
    ``try_load_latest_save`` or DeepSpeed's ``latest`` picking it while the rollback run has no
    newer checkpoint), or one whose rows up to its step are no longer held. Its model is of the
    abandoned run while the store holds the new run's rows before its step, or none. Rank 0 decides
    (the checkpoint's state and its own shards); every rank raises alike."""

    def decide() -> None:
        if not saved or saved.get("store_id") != store.store_id:
            return
        why = None
        if saved.get("timeline") is not None:
            cut = store.rolled_back_below((saved.get("timeline_id"), int(saved["timeline"])), step,
                                          since_seq=saved.get("cut_seq"))
            if cut is not None:
                why = f"a later resume cut the store back to step {cut}"
        if why is None and saved.get("reached") is not None:
            want, have = min(int(saved["reached"]), step), store.reached(step)
            if have is None or have < want:
                why = (f"it was saved when the store held this run's rows up to step {want}, but it now holds "
                       f"them only up to step {have}")
        if why is not None:
            raise ConfigError(f"tda: the checkpoint of step {step} belongs to an abandoned run: {why} (a resume from "
                              f"an earlier checkpoint), so the store {store.path} holds another run's rows before "
                              f"step {step}, or none. Resume from a checkpoint of the run the store continues "
                              "(OLMo: --load_path=...; DeepSpeed: load_checkpoint(dir, tag=...)), or remove this one")

    decided_on_rank0(decide, catch=ConfigError)
