"""The store's index at run lengths with thousands of shards: a rank's manifest lists only its newest
shards and names sealed segment files (``index/``) holding the older ones, so a flush rewrites a
manifest of bounded size. ``SEAL_SHARDS`` is made tiny here so a few flushes seal several blocks.

Oracles: the rows written (random float32, or the kill worker's deterministic data) compared bit for
bit, and the shard files on disk (the truth the index must agree with).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

import _store_kill_worker as worker
from olmo_tda.config import StoreConfig
from olmo_tda.store import GradientStore, StoreCorruptError, StoreError
from olmo_tda.store import manifest as manifest_module
from test_store import (META, Zygote, check_worker_rows, expected_rows, random_records, rows_of,
                        sigkill_append_loop)

SEAL = 4


@pytest.fixture(autouse=True)
def tiny_seal(monkeypatch):
    monkeypatch.setattr(manifest_module, "SEAL_SHARDS", SEAL)


def manifest(path):
    return json.loads((Path(path) / "manifest-r00000.json").read_text())


def segment_files(path):
    folder = Path(path) / "index"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def listed(head):
    """The shards a manifest lists itself."""
    return head["recent_shards"] if head["format_version"] == 2 else head["shards"]


def named_segments(path):
    return sorted(Path(ref["file"]).name for ref in manifest(path).get("segments", []))


def assert_rows(store, records):
    """``store`` holds exactly the rows of ``records``, bit for bit, and its index lists exactly the
    shard files on disk."""
    block = store.read_all()
    want, got = expected_rows(records), rows_of(block)
    assert set(got) == set(want)
    for key, k in got.items():
        lr, scale, grads = want[key]
        assert block.lr[k] == lr and block.loss_scale[k] == scale
        for name, g in grads.items():
            assert torch_equal(block.grads[name][k], g), (key, name)
    on_disk = sorted(p.name for p in (store.path / "shards").glob("*.h5"))
    assert sorted(Path(info.file).name for info in store.shards) == on_disk


def torch_equal(a, b):
    import torch
    return torch.equal(a, b)


def test_a_long_run_seals_its_index_into_segments_each_written_once(tmp_path):
    path, records = tmp_path / "s", random_records(range(23))
    contents: dict[str, bytes] = {}
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:
        for r in records:
            w.append(r)
            w.flush()
            head = manifest(path)
            assert len(listed(head)) < SEAL                # the manifest stays bounded
            for name in segment_files(path):               # a sealed block is never written again
                data = (path / "index" / name).read_bytes()
                assert contents.setdefault(name, data) == data, name
            assert segment_files(path) == named_segments(path)
    head = manifest(path)
    assert head["format_version"] == 2 and len(head["segments"]) == 5 and len(listed(head)) == 3
    assert "upgrade olmo_tda" in head["shards"]        # what an olmo_tda reading only format 1 refuses it with
    assert [(ref["first_seq"], ref["last_seq"], ref["num_shards"]) for ref in head["segments"]] == \
        [(s, s + SEAL - 1, SEAL) for s in range(0, 20, SEAL)]
    store = GradientStore.open(path)
    assert len(store.shards) == 23 and store.stats["rows_written"] == 69
    assert_rows(store, records)
    # a writer reopening it appends after it, skipping the rows it already holds
    more = random_records(range(21, 30), seed=1)
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:
        for r in more:
            w.append(r)
        w.flush()
        assert w.stats["rows_skipped_duplicate"] == 6
    assert_rows(GradientStore.open(path), records + more[2:])
    assert len(manifest(path)["segments"]) == 7 and segment_files(path) == named_segments(path)


def test_a_truncation_into_a_sealed_block_writes_it_again_and_the_writer_removes_the_old_one(tmp_path):
    path, records = tmp_path / "s", random_records(range(14))
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:
        for r in records:
            w.append(r)
    before = named_segments(path)                          # blocks 0-3, 4-7, 8-11
    assert len(before) == 3
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:
        assert w.truncate_after(5) == 8 * 3
        assert len(segment_files(path)) == 4               # the replaced block stays while the writer runs
        more = random_records(range(6, 9), seed=2)
        for r in more:
            w.append(r)
    after = named_segments(path)
    assert after[0] == before[0] and after[1] != before[1] and len(after) == 2
    assert segment_files(path) == after                    # the old block went at close
    refs = manifest(path)["segments"]
    assert (refs[1]["first_seq"], refs[1]["last_seq"], refs[1]["num_shards"]) == (4, 7, 2)
    store = GradientStore.open(path)
    assert_rows(store, records[:6] + more)
    assert store.stats["rows_truncated"] == 24


def _edit(path, name, edit):
    file = Path(path) / name
    file.write_text(json.dumps(edit(json.loads(file.read_text()))))


def _seg0(path):
    return manifest(path)["segments"][0]["file"]


def _ref0(**changes):
    return lambda d: {**d, "segments": [{**d["segments"][0], **changes}, *d["segments"][1:]]}


KEPT = "its counters and truncation log are kept"
REBUILT = "rebuilding unreadable manifest"


@pytest.mark.parametrize("damage, says, repaired", [
    (lambda p: (p / _seg0(p)).unlink(), r"segment .*r00000-00000000-\w+\.json is named by manifest-r00000.json but "
                                        "missing", KEPT),
    (lambda p: (p / _seg0(p)).write_text("{"), r"segment .*r00000-00000000-\w+\.json is unreadable", KEPT),
    (lambda p: _edit(p, _seg0(p), lambda d: {**d, "shards": d["shards"][:-1]}),
     r"segment .* is damaged: shards must be a list of the 4 shards the manifest counts, got 3", KEPT),
    (lambda p: _edit(p, _seg0(p), lambda d: {**d, "shards": [{**d["shards"][0], "seq": 9, "file":
                                                              "shards/r00000-00000009.h5"}, *d["shards"][1:]]}),
     r"segment .* is damaged: shards\[0\].seq must be in 0..3", KEPT),
    (lambda p: _edit(p, _seg0(p), lambda d: {**d, "rank": 1}), r"segment .* is damaged: rank must be 0", KEPT),
    (lambda p: _edit(p, _seg0(p), lambda d: {**d, "format_version": 7}),
     r"segment .* is damaged: format_version must be 1", KEPT),
    (lambda p: _edit(p, "manifest-r00000.json", _ref0(file="../../elsewhere.json")),
     r"manifest-r00000.json is damaged: segments\[0\].file", REBUILT),
    (lambda p: _edit(p, "manifest-r00000.json", _ref0(file="index/r00000-00000000-0123abcd.json\n")),
     r"manifest-r00000.json is damaged: segments\[0\].file", REBUILT),
    (lambda p: _edit(p, "manifest-r00000.json", _ref0(last_seq=4)),
     r"manifest-r00000.json is damaged: segments\[1\] must cover seqs after", REBUILT),
    (lambda p: _edit(p, "manifest-r00000.json", lambda d: {**d, "recent_shards": [
        *d["recent_shards"], json.loads((p / _seg0(p)).read_text())["shards"][2]]}),
     r"manifest-r00000.json is damaged: segments\[0\] covers a shard recent_shards lists", REBUILT),
    (lambda p: _edit(p, "manifest-r00000.json", lambda d: {**d, "format_version": 1}),
     r"manifest-r00000.json is damaged: shards must be a list", REBUILT),
    (lambda p: _edit(p, "manifest-r00000.json", lambda d: {**d, "segments": {}}),
     r"manifest-r00000.json is damaged: segments must be a list", REBUILT),
])
def test_a_damaged_or_missing_segment_is_a_corrupt_error_naming_it_and_repair_rebuilds_the_index(
        tmp_path, damage, says, repaired):
    """A damaged segment (the manifest itself sound) is rebuilt from the shard files keeping the
    manifest's counters and truncation log, so a checkpoint's rollback check still sees its cuts; a
    damaged manifest is rebuilt whole, as before segments."""
    path, records = tmp_path / "s", random_records(range(12))
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:
        for r in records:
            w.append(r)
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:
        w.truncate_after(9)
        timeline, counters = w.timeline(), {k: w.stats[k] for k in ("rows_written", "rows_truncated")}
    records = records[:10]
    assert timeline[1] == 1 and counters == {"rows_written": 36, "rows_truncated": 6}
    damage(path)
    with pytest.raises(StoreCorruptError, match=says + r".*repair=True"):
        GradientStore.open(path)
    with pytest.warns(RuntimeWarning, match=repaired):
        assert_rows(GradientStore.open(path, repair=True), records)
    assert_rows(GradientStore.open(path), records)      # the rebuilt index was written, sealed again
    assert len(manifest(path)["segments"]) == 2
    with GradientStore.create(path, META, StoreConfig()) as w:
        after = w.timeline(), {k: w.stats[k] for k in ("rows_written", "rows_truncated")}
    if repaired == KEPT:
        assert after == (timeline, counters)
    else:
        assert after[0][0] != timeline[0] and after[1]["rows_truncated"] == 0
    assert segment_files(path) == named_segments(path)  # the damaged block's file went with the writer's open


def test_a_manifest_of_a_newer_format_is_refused_not_repaired(tmp_path):
    path = tmp_path / "s"
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:
        w.append(random_records([0])[0])
    _edit(path, "manifest-r00000.json", lambda d: {**d, "format_version": 4})
    for repair in (False, True):
        with pytest.raises(StoreError, match="format_version 4, newer than this olmo_tda reads .*upgrade"):
            GradientStore.open(path, repair=repair)


def test_a_reader_whose_segment_its_writer_replaced_meanwhile_reads_the_new_manifest(tmp_path, monkeypatch):
    """The race a segment's removal opens: a reader read the manifest, then the writer (truncating,
    then closing) replaced the block it names and removed the old file, then the reader reads it."""
    path, records = tmp_path / "s", random_records(range(10))
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:
        for r in records:
            w.append(r)
    live = GradientStore.create(path, META, StoreConfig())     # holds the rank's lock as the reader opens
    real, done = manifest_module._read_segment, []

    def read_segment(root, name, *args):
        if not done:
            done.append(name)
            live.truncate_after(2)
            live.close()
        return real(root, name, *args)

    monkeypatch.setattr(manifest_module, "_read_segment", read_segment)
    store = GradientStore.open(path)
    assert done and not (path / done[0]).exists()
    assert_rows(store, records[:3])


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def test_sigkill_at_random_moments_with_blocks_sealing_keeps_every_durable_row(tmp_path, zygote, monkeypatch):
    """Like the store's random-SIGKILL test, with a block sealed every other flush."""
    path = tmp_path / "s"
    GradientStore.create(path, META, StoreConfig()).close()
    rng = random.Random(99)
    next_step = 0
    for trial in range(8):
        next_step = len(sigkill_append_loop(zygote, path, rng, next_step, trial, flush_every=1, seal=2))
        assert set(named_segments(path)) <= set(segment_files(path))
    assert next_step > 8 and len(manifest(path)["segments"]) >= 3
    monkeypatch.setattr(manifest_module, "SEAL_SHARDS", 2)
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:
        for step in range(next_step - 2, next_step + 3):
            w.append(worker.make_record(step))
    assert check_worker_rows(GradientStore.open(path)) == set(range(next_step + 3))
    assert segment_files(path) == named_segments(path)


def test_a_crash_after_sealing_a_block_before_the_manifest_names_it(tmp_path, zygote):
    path = tmp_path / "s"
    pid = zygote.start("append_loop", path=str(path), start_step=0, flush_every=1, max_steps=20,
                       crash_at="after_segment", crash_after=2, seal=3)
    assert os.WIFSIGNALED(zygote.wait_exit(pid))
    # the second block (shards 3-5) is on disk; the manifest names only the first
    assert len(segment_files(path)) == 2 and len(named_segments(path)) == 1
    (path / "index" / "r00000-00000006-0123abcd.json.tmp").write_text("{")   # a block killed mid-write
    assert check_worker_rows(GradientStore.open(path)) == set(range(6))
    assert len(segment_files(path)) == 2                   # a reader removes the temp of a dead writer only
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:
        assert segment_files(path) == named_segments(path)     # the writer's open removed the stray block
        for step in range(6, 9):
            w.append(worker.make_record(step))
    assert check_worker_rows(GradientStore.open(path)) == set(range(9))


def test_two_ranks_seal_their_own_blocks_and_a_departed_ranks_are_cut_under_its_lock(tmp_path):
    """Each rank's writer removes only its own rank's stray blocks; a run resumed on one rank cuts
    rank 1's sealed blocks back as rank 1's writer would."""
    path = tmp_path / "s"
    per_rank = {rank: random_records(range(10), seed=rank) for rank in (0, 1)}
    for r in per_rank[1]:
        r.ids = r.ids + 1000                       # rank 1 holds other examples
    writers = {rank: GradientStore.create(path, META, StoreConfig(flush_every=1), rank=rank) for rank in (0, 1)}
    for step in range(10):
        for rank in (0, 1):
            writers[rank].append(per_rank[rank][step])
    writers[0].close()
    by_rank = {rank: sorted(p.name for p in (path / "index").glob(f"r0000{rank}-*.json")) for rank in (0, 1)}
    assert len(by_rank[0]) == len(by_rank[1]) == 2
    writers[1].close()
    assert sorted(p.name for p in (path / "index").glob("r00001-*.json")) == by_rank[1]
    assert_rows(GradientStore.open(path), per_rank[0] + per_rank[1])

    with GradientStore.create(path, META, StoreConfig(flush_every=1), rank=0) as w:
        assert w.truncate_departed(5, world_size=1) == 4 * 3
    rank1 = json.loads((path / "manifest-r00001.json").read_text())
    assert [(ref["first_seq"], ref["last_seq"], ref["num_shards"]) for ref in rank1["segments"]] == \
        [(0, 3, 4), (4, 7, 2)]
    assert sorted(p.name for p in (path / "index").glob("r00001-*.json")) == \
        sorted(Path(ref["file"]).name for ref in rank1["segments"])
    assert sorted(p.name for p in (path / "index").glob("r00000-*.json")) == by_rank[0]
    assert_rows(GradientStore.open(path), per_rank[0] + per_rank[1][:6])


def test_a_rewritten_block_never_takes_the_name_of_the_one_it_replaces(tmp_path, monkeypatch):
    """A block keeps its first seq when rewritten, so only the random token tells the names apart: a
    token drawn again must not overwrite the block the manifest on disk still names."""
    path, records = tmp_path / "s", random_records(range(6))
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:
        for r in records:
            w.append(r)
    old = named_segments(path)[0]
    before = (path / "index" / old).read_text()
    writer = GradientStore.create(path, META, StoreConfig())
    real, drawn = manifest_module.uuid.uuid4, []

    def uuid4():                            # the old block's token first, then fresh ones
        drawn.append(real() if drawn else type("U", (), {"hex": old.split("-")[2][:8] + "0" * 24})())
        return drawn[-1]

    monkeypatch.setattr(manifest_module.uuid, "uuid4", uuid4)
    writer.truncate_after(1)
    assert len(drawn) == 2
    assert (path / "index" / old).read_text() == before     # untouched while the writer runs
    assert named_segments(path) == [f"r00000-00000000-{drawn[1].hex[:8]}.json"]
    writer.close()
    assert_rows(GradientStore.open(path), records[:2])
