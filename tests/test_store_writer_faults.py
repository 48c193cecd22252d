"""The store's write side under faults: a truncation that fails part-way, windows of only NaN rows,
ranks racing to create a store, a store.json that cannot be written, and records with a bad lr.

Failures are injected where the disk would fail (a function raising ``OSError`` once, or a real
``RLIMIT_FSIZE``); outcomes are checked by reading the store back with ``GradientStore.open``
against the workers' deterministic rows.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import resource
import signal
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import _store_kill_worker as worker
from olmo_tda.config import StoreConfig
from olmo_tda.store import (
    GradientRecord,
    GradientStore,
    NonFiniteGradientWarning,
    StoreError,
    StoreMismatchError,
    StoreWriteError,
)
from olmo_tda.store import writer as writer_module

ROWS = worker.ROWS_PER_STEP


def tmp_files(path):
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*.tmp"))


def keys_of(store):
    block = store.read_all()
    return list(zip(block.ids.tolist(), block.steps.tolist()))


def fail_once(real, exc, when=lambda *args: True, after=0):
    """``real`` that raises ``exc`` on its ``after + 1``-th call matching ``when``."""
    seen = {"n": 0}

    def wrapper(*args, **kwargs):
        if when(*args):
            seen["n"] += 1
            if seen["n"] == after + 1:
                raise exc
        return real(*args, **kwargs)
    return wrapper


def write_steps(path, steps, flush_every=2):
    w = GradientStore.create(path, worker.META, StoreConfig(flush_every=flush_every))
    for step in steps:
        w.append(worker.make_record(step))
    w.flush()
    return w


# ---------------------------------------------------------------------------------------------
# truncate_after that fails part-way


def test_truncate_failing_at_its_cut_marker_changes_nothing_and_its_retry_drops_the_rows(tmp_path, monkeypatch):
    path = tmp_path / "s"
    w = write_steps(path, range(6))      # shards: steps 0-1, 2-3 (cut through below), 4-5 (voided)
    written = {p.name: p.read_bytes() for p in (path / "shards").iterdir()}
    monkeypatch.setattr(writer_module, "write_cut",
                        fail_once(writer_module.write_cut, OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(StoreWriteError, match=r"truncate.*failed.*disk is full") as info:
        w.truncate_after(2)
    assert str(path) in str(info.value)
    assert tmp_files(path) == []                          # no half-written marker is left behind
    assert w.stats["rows_truncated"] == 0
    assert sorted({s for _, s in keys_of(GradientStore.open(path))}) == list(range(6))   # nothing dropped yet

    assert w.truncate_after(2) == 3 * ROWS                # the retry does it all: steps 3, 4, 5
    store = GradientStore.open(path)
    assert sorted(set(store.steps.tolist())) == [0, 1, 2] and store.num_rows == 3 * ROWS
    assert sorted(p.name for p in (path / "shards").iterdir()) == \
        ["r00000-00000000.h5", "r00000-00000001.h5", "r00000-00000004.cut.json"]    # seq 3: the failed try's
    assert all((path / "shards" / name).read_bytes() == data for name, data in written.items()
               if (path / "shards" / name).exists())     # the shard the cut runs through is not rewritten
    # the resumed run replays steps 3-5: stored once, none mistaken for a duplicate
    for step in range(3, 6):
        w.append(worker.make_record(step))
    w.close()
    assert w.stats["rows_skipped_duplicate"] == 0 and w.stats["rows_truncated"] == 3 * ROWS
    store = GradientStore.open(path)
    keys = keys_of(store)
    assert len(keys) == len(set(keys)) == 6 * ROWS
    assert sorted(set(store.steps.tolist())) == list(range(6)) and tmp_files(path) == []


def test_a_cut_marker_renamed_into_place_before_its_write_failed_keeps_its_seq(tmp_path, monkeypatch):
    """The marker's folder fsync failed after its rename: the marker is on disk though truncate_after
    raised. Its seq was taken first, so the retry's marker and the replayed steps' shard come after it
    (never beside it at the same seq, where the replayed rows would be read as cut)."""
    from olmo_tda.store import cuts as cuts_module

    path = tmp_path / "s"
    w = write_steps(path, range(6))                      # shards 0-2, steps 0-1, 2-3, 4-5
    real = cuts_module.write_json_atomic

    def renamed_then_failed(*args, **kwargs):
        real(*args, **kwargs)
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(cuts_module, "write_json_atomic", renamed_then_failed)
    with pytest.raises(StoreWriteError, match=r"truncate.*failed.*Input/output error"):
        w.truncate_after(2)
    monkeypatch.undo()
    assert (path / "shards" / "r00000-00000003.cut.json").exists()
    assert w.truncate_after(2) == 3 * ROWS                # the retry: its own marker, seq 4
    for step in range(3, 6):
        w.append(worker.make_record(step))
    w.close()
    assert w.stats["rows_skipped_duplicate"] == 0
    assert sorted(p.name for p in (path / "shards").iterdir()) == [
        "r00000-00000000.h5", "r00000-00000001.h5", "r00000-00000003.cut.json", "r00000-00000004.cut.json",
        "r00000-00000005.h5", "r00000-00000006.h5"]
    store = GradientStore.open(path)
    keys = keys_of(store)
    assert len(keys) == len(set(keys)) == 6 * ROWS and sorted(set(store.steps.tolist())) == list(range(6))


def test_truncate_failing_after_its_cut_marker_keeps_the_cut_and_its_retry_converges(tmp_path, monkeypatch):
    path = tmp_path / "s"
    w = write_steps(path, range(8))      # shards: 0-1, 2-3 (cut through), 4-5 and 6-7 (voided)
    monkeypatch.setattr(writer_module, "write_manifest",
                        fail_once(writer_module.write_manifest, OSError(errno.EIO, "Input/output error")))
    with pytest.raises(StoreWriteError, match=r"truncate.*failed.*Input/output error"):
        w.truncate_after(2)
    monkeypatch.undo()
    assert tmp_files(path) == []
    store = GradientStore.open(path)                      # the durable marker holds, whatever the manifest says
    assert sorted(set(store.steps.tolist())) == [0, 1, 2]
    w.flush()                                             # the manifest this writer owes is written now
    assert json.loads((path / "manifest-r00000.json").read_text())["cuts"] == {"4": 2}

    assert w.truncate_after(2) == 0                       # nothing was left to drop
    assert w.stats["rows_truncated"] == 5 * ROWS          # steps 3-7, once each
    for step in range(3, 8):                              # resume: replayed steps are new rows again
        w.append(worker.make_record(step))
    w.close()
    assert w.stats["rows_skipped_duplicate"] == 0
    store = GradientStore.open(path)
    keys = keys_of(store)
    assert len(keys) == len(set(keys)) == 8 * ROWS and sorted(set(store.steps.tolist())) == list(range(8))


def test_a_voided_shard_that_cannot_be_removed_is_left_to_the_ranks_next_writer(tmp_path, monkeypatch, caplog):
    path = tmp_path / "s"
    w = write_steps(path, range(8))
    eio = OSError(errno.EIO, "Input/output error")
    unlink = fail_once(os.unlink, eio, when=lambda p, *rest: str(p).endswith(".h5"), after=1)
    monkeypatch.setattr(os, "unlink", unlink)
    with caplog.at_level("WARNING", logger="olmo_tda.store.writer"):
        assert w.truncate_after(2) == 5 * ROWS            # the cut is done: its marker and manifest are durable
    monkeypatch.undo()
    assert "r00000-00000003.h5, whose rows the cut voids" in caplog.text
    assert (path / "shards" / "r00000-00000003.h5").exists()
    assert sorted(set(GradientStore.open(path).steps.tolist())) == [0, 1, 2]
    w.close()
    GradientStore.create(path, worker.META, StoreConfig()).close()
    assert not (path / "shards" / "r00000-00000003.h5").exists()
    assert sorted(set(GradientStore.open(path).steps.tolist())) == [0, 1, 2]


# ---------------------------------------------------------------------------------------------
# non-finite rows


def test_windows_of_only_nonfinite_rows_are_warned_about_while_the_run_goes_on(tmp_path):
    path = tmp_path / "s"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = GradientStore.create(path, worker.META, StoreConfig(flush_every=2))
        w.append(worker.make_record(0))
        w.append(worker.make_record(1))
        for step in range(2, 6):          # the run diverged: every row NaN
            record = worker.make_record(step)
            for g in record.grads.values():
                g.fill_(float("nan"))
            w.append(record)
        deadline = time.monotonic() + 5   # two windows of 2 steps each: warned without a flush
        while sum(issubclass(c.category, NonFiniteGradientWarning) for c in caught) < 2 \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        seen_before_close = [str(c.message) for c in caught if issubclass(c.category, NonFiniteGradientWarning)]
        w.close()
    assert len(seen_before_close) == 2
    assert "steps 2..3" in seen_before_close[0] and "steps 4..5" in seen_before_close[1]
    assert sum(int(re.search(r"skipped (\d+) rows", m).group(1)) for m in seen_before_close) == 4 * ROWS
    assert str(worker.ids_at(2).tolist()[:ROWS]).strip("[]") in seen_before_close[0]
    store = GradientStore.open(path)
    assert sorted(set(store.steps.tolist())) == [0, 1] and store.num_rows == 2 * ROWS
    assert store.stats["rows_skipped_nonfinite"] == 4 * ROWS


# ---------------------------------------------------------------------------------------------
# creating store.json


def test_ranks_racing_to_create_a_store_with_different_settings_are_refused(tmp_path, monkeypatch):
    """Both ranks find no store.json, then rank 1 publishes its own after rank 0 has checked: the
    first one must stay and rank 1 must be refused (a ``Path`` whose ``exists`` waits forces this)."""
    path = tmp_path / "s"
    both_looked = threading.Barrier(2, timeout=5)
    rank0_done = threading.Event()

    class RacingPath(type(Path())):
        def exists(self, *args, **kwargs):
            found = super().exists(*args, **kwargs)
            if self.name == "store.json" and threading.current_thread().name.startswith("rank"):
                both_looked.wait()
                if threading.current_thread().name == "rank1":
                    rank0_done.wait(5)
            return found

    monkeypatch.setattr(writer_module, "Path", RacingPath)
    metas = {0: worker.META, 1: {**worker.META, "projector_hash": "other-seed"}}
    out = {}

    def create(rank):
        try:
            out[rank] = GradientStore.create(path, metas[rank], StoreConfig(flush_every=1), rank=rank)
        except Exception as e:  # noqa: BLE001 - inspected below
            out[rank] = e
        finally:
            if rank == 0:
                rank0_done.set()

    threads = [threading.Thread(target=create, args=(rank,), name=f"rank{rank}") for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for v in out.values():
        if not isinstance(v, Exception):
            v.close()
    assert not isinstance(out[0], Exception), out[0]
    assert isinstance(out[1], StoreMismatchError), out[1]
    assert '"kill-test"' in str(out[1]) and '"other-seed"' in str(out[1])
    assert GradientStore.open(path).meta["projector_hash"] == "kill-test"
    assert [p.name for p in path.iterdir() if p.name.startswith("store.json")] == ["store.json"]


def test_store_json_that_cannot_be_written_raises_store_error_naming_it(tmp_path):
    """A real file-size limit (``ulimit -f``) lets the 8-byte probe through but not store.json."""
    path = tmp_path / "s"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        with pytest.raises(StoreError) as info:
            GradientStore.create(path, worker.META, StoreConfig())
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    message = str(info.value)
    assert str(path / "store.json") in message and "file too large" in message and "store.path" in message
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EFBIG
    assert sorted(p.name for p in path.iterdir()) == ["shards"]       # no store.json, no temp file
    with GradientStore.create(path, worker.META, StoreConfig()) as w:  # with room, creating works
        w.append(worker.make_record(0))
    assert GradientStore.open(path).num_rows == ROWS


# ---------------------------------------------------------------------------------------------
# learning rate


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1e-3, "fast", torch.tensor([0.1, 0.2])])
def test_a_record_with_a_nonfinite_or_negative_lr_is_refused_naming_step_and_value(lr):
    good = worker.make_record(7)
    with pytest.raises(ValueError, match=r"lr of step 7 must be a finite number >= 0, got .*"
                                         + re.escape(repr(lr)[:5])):
        GradientRecord(ids=good.ids, step=7, lr=lr, loss_scale=1.0, grads=good.grads)


def test_zero_and_tensor_learning_rates_are_stored_as_numbers(tmp_path):
    path = tmp_path / "s"
    with GradientStore.create(path, worker.META, StoreConfig()) as w:
        for step, lr in [(0, 0.0), (1, torch.tensor(0.5, dtype=torch.float64))]:  # post-hoc capture; a
            good = worker.make_record(step)                                        # scheduler's tensor lr
            w.append(GradientRecord(ids=good.ids, step=step, lr=lr, loss_scale=1.0, grads=good.grads))
    block = GradientStore.open(path).read_all()
    assert sorted(set(zip(block.steps.tolist(), block.lr.tolist()))) == [(0, 0.0), (1, 0.5)]
    assert not any(math.isnan(x) for x in block.lr)
    assert np.all(block.lr >= 0)


def test_a_resume_refuses_another_runs_store_that_holds_rows(tmp_path, caplog):
    """check_resume, which both integrations call before a resume cuts anything: the checkpoint
    names the store its run wrote by id. Another store here with rows is refused (its rows stay);
    the same store (moved: another path) or a new, empty one continues; without ids (stores and
    checkpoints made before ids) a different path is only warned about."""
    ours = GradientStore.create(tmp_path / "ours", worker.META, StoreConfig())
    ours.append(worker.make_record(1))
    ours.flush()
    theirs = {"store": str(tmp_path / "theirs"), "store_id": "0" * 32}
    assert ours.store_id and len(ours.store_id) == 32 and ours.held_rows() == ROWS
    with pytest.raises(StoreMismatchError, match=rf"tda.store.path {tmp_path / 'ours'} holds the store "
                                                 rf"{ours.store_id} with {ROWS} rows of another run"):
        ours.check_resume(theirs, 1)
    ours.check_resume(theirs, 0)      # its rows are all after the step: this run's earlier try, cut on resume
    ours.check_resume({"store": "/moved/from/here", "store_id": ours.store_id}, 1)   # the same store, moved
    with caplog.at_level("WARNING"):
        caplog.clear()
        ours.check_resume({"store": str(tmp_path / "ours")}, 1)                   # no id, same path: silent
        assert not caplog.records
        ours.check_resume({"store": str(tmp_path / "theirs")}, 1)                 # no id, another path
        assert "whose run stored its gradients in" in caplog.text
    ours.close()
    assert GradientStore.open(tmp_path / "ours").num_rows == ROWS

    new = GradientStore.create(tmp_path / "new", worker.META, StoreConfig())
    assert new.store_id != ours.store_id and new.held_rows() == 0
    with caplog.at_level("WARNING"):
        caplog.clear()
        new.check_resume(theirs, 1)                                               # empty: continues, said
        assert f"stored its gradients in {tmp_path / 'theirs'}" in caplog.text
    new.close()


def test_a_resume_on_more_ranks_rereads_the_others_cuts_so_no_replayed_row_looks_a_duplicate(tmp_path,
                                                                                              monkeypatch):
    """Resumed on more ranks, a rank replays ids another rank held at steps that rank has cut since
    this rank's writer opened: after the resume's cut every rank re-reads the others, so the replayed
    rows are stored, not skipped as duplicates of rows a cut voided."""
    from olmo_tda.integrations import capture_store
    from olmo_tda.integrations.capture_store import cut_departed_ranks

    path = tmp_path / "s"
    for rank in (0, 1):                                   # the old run: 2 ranks, steps 0-5
        with GradientStore.create(path, worker.META, StoreConfig(flush_every=6), rank=rank) as w:
            for step in range(6):
                w.append(worker.make_record(step, ids=[10 * step + rank]))
    writers = [GradientStore.create(path, worker.META, StoreConfig(flush_every=1), rank=r) for r in range(3)]
    for w in writers:                                     # the resume on 3 ranks from step 2: each opened,
        w.truncate_after(2)                               # then each cuts its own rows
    monkeypatch.setattr(capture_store, "_group", lambda: (True, 0, 3))
    monkeypatch.setattr(capture_store, "decided_on_rank0", lambda decide, catch=Exception: decide())
    for w in writers:
        cut_departed_ranks(w, 2)
    for step in range(3, 6):                              # rank 2 now trains the ids rank 1 had
        writers[2].append(worker.make_record(step, ids=[10 * step + 1]))
    for w in writers:
        w.close()
    assert writers[2].stats["rows_skipped_duplicate"] == 0
    keys = keys_of(GradientStore.open(path))
    assert len(keys) == len(set(keys))
    assert sorted(k for k in keys if k[1] >= 3) == [(10 * s + 1, s) for s in range(3, 6)]


def test_a_resume_on_fewer_ranks_cuts_the_departed_ranks_rows_too(tmp_path):
    """A run of 2 ranks stored steps 1-4; resumed from step 2 on one rank, rank 1 has no writer to
    cut its rows of steps 3-4: they stayed, and the resumed run's own rows at those (id, step) were
    skipped as duplicates. cut_departed_ranks (both integrations call it after truncate_after)."""
    from olmo_tda.integrations.capture_store import cut_departed_ranks

    path = tmp_path / "s"
    for rank in (0, 1):
        with GradientStore.create(path, worker.META, StoreConfig(flush_every=1), rank=rank) as w:
            for step in range(1, 5):
                w.append(worker.make_record(step, ids=worker.ids_at(step) + 1000 * rank))
    resumed = GradientStore.create(path, worker.META, StoreConfig(flush_every=1), rank=0)
    resumed.truncate_after(2)
    assert resumed.departed_after(2, world_size=1) == [1] and resumed.departed_after(4, world_size=1) == []
    cut_departed_ranks(resumed, 2)                          # no process group: a run of one rank
    assert resumed.departed_after(2, world_size=1) == []
    for step in (3, 4):                                      # the resumed run takes rank 1's examples too
        resumed.append(worker.make_record(step, ids=np.concatenate([worker.ids_at(step), worker.ids_at(step) + 1000])))
    resumed.close()
    keys = keys_of(GradientStore.open(path))
    assert len(keys) == len(set(keys)) == 8 * ROWS         # each (id, step) once: none skipped, none left over
    assert GradientStore.open(path).stats["rows_truncated"] == 4 * ROWS
