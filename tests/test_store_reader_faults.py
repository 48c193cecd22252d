"""The gradient store's read/open side under faults: races with a live writer, damaged metadata,
shards that disagree with the index or ``store.json``, damaged bytes, failing writes during a scan,
short reads.

Each race is forced deterministically: the writer acts inside the scan's manifest read (between the
listing of ``shards/`` and the use of what was listed). Oracles: the rows written are kept by the test
and compared exactly (float32).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from olmo_tda.config import StoreConfig
from olmo_tda.store import GradientRecord, GradientStore, StoreCorruptError, StoreError
from olmo_tda.store import manifest as manifest_module
from olmo_tda.store.format import open_h5
from olmo_tda.store.reader import _ShardReader

LAYERS = [{"name": "fc", "shape": [3, 5], "projector": {"seed": 0}},
          {"name": "fc2", "shape": [4, 2], "projector": {"seed": 0}}]
META = {"capture": {"proj_dim": 4}, "layers": LAYERS, "projector_hash": "reader-faults"}


def record(step, rows=2, seed=None):
    gen = torch.Generator().manual_seed(step if seed is None else seed)
    ids = np.arange(rows, dtype=np.int64) + 10 * step
    grads = {layer["name"]: torch.randn(rows, *layer["shape"], generator=gen) for layer in LAYERS}
    return GradientRecord(ids=ids, step=step, lr=0.1, loss_scale=1.0, grads=grads)


def assert_rows(block, records):
    """``block`` holds exactly the rows of ``records``, bit for bit."""
    want = {(int(i), r.step): {n: g[k] for n, g in r.grads.items()} for r in records for k, i in enumerate(r.ids)}
    got = {(int(i), int(s)): k for k, (i, s) in enumerate(zip(block.ids, block.steps))}
    assert set(got) == set(want)
    for key, k in got.items():
        for name, grad in want[key].items():
            assert torch.equal(block.grads[name][k], grad), (key, name)


def writer(path, **config):
    return GradientStore.create(path, META, StoreConfig(**config))


def during_manifest_read(monkeypatch, action):
    """Run ``action`` once, inside the scan's first manifest read (after it listed ``shards/``)."""
    real, done = manifest_module.read_manifest, []

    def read_manifest(root, rank):
        if not done:
            done.append(True)
            return action(lambda: real(root, rank))
        return real(root, rank)

    monkeypatch.setattr(manifest_module, "read_manifest", read_manifest)


# ---------------------------------------------------------------------------------------------
# A. open / refresh racing a live writer


@pytest.mark.parametrize("scanner", ["refresh", "open", "other rank's writer"])
def test_a_shard_made_durable_during_the_scan_is_read_not_reported_missing(tmp_path, monkeypatch, scanner):
    path = tmp_path / "s"
    records = [record(0), record(1)]
    with writer(path, flush_every=100) as w:
        w.append(records[0])
        w.flush()
        store = GradientStore.open(path)
        w.append(records[1])                      # buffered: the listing will not see its shard

        def flush_then_read(read):
            w.flush()                             # shard 1 renamed into place, then the manifest lists it
            return read()

        during_manifest_read(monkeypatch, flush_then_read)
        if scanner == "refresh":
            store.refresh()
        elif scanner == "open":
            store = GradientStore.open(path)
        else:
            with GradientStore.create(path, META, StoreConfig(), rank=1):
                pass
            monkeypatch.undo()
            store = GradientStore.open(path)
        assert store.num_rows == 4
        assert_rows(store.read_all(), records)


def test_shards_a_live_writer_truncates_away_during_the_scan_are_gone_not_errors(tmp_path, monkeypatch):
    path = tmp_path / "s"
    records = [record(s) for s in range(4)]
    with writer(path, flush_every=1) as w:
        for r in records:
            w.append(r)
        w.flush()                                 # shards 0..3, one step each, all listed by the scan

        def truncate_then_read(read):
            assert w.truncate_after(1) == 4       # manifest drops shards 2, 3; then their files go
            return read()

        during_manifest_read(monkeypatch, truncate_then_read)
        store = GradientStore.open(path)
        assert store.steps.tolist() == [0, 1]
        assert_rows(store.read_all(), records[:2])


def test_a_shard_flushed_and_truncated_away_during_the_scan_is_gone_not_missing(tmp_path, monkeypatch):
    # the listing misses shard 1 (step 2), the manifest read lists it, and a truncate removes it before
    # it is looked up again: the manifest, read once more, no longer lists it
    path = tmp_path / "s"
    records = [record(s) for s in range(3)]
    with writer(path, flush_every=100) as w:
        w.append(records[0])
        w.append(records[1])
        w.flush()
        w.append(records[2])

        def flush_read_truncate(read):
            w.flush()
            state = read()
            assert sorted(state.shards) == [0, 1]
            w.truncate_after(1)
            return state

        during_manifest_read(monkeypatch, flush_read_truncate)
        store = GradientStore.open(path)
        assert_rows(store.read_all(), records[:2])


def test_a_shard_missing_under_a_live_writer_is_still_reported(tmp_path):
    path = tmp_path / "s"
    with writer(path, flush_every=1) as w:
        w.append(record(0))
        w.append(record(1))
        w.flush()
        (path / "shards" / "r00000-00000000.h5").unlink()
        with pytest.raises(StoreCorruptError,
                           match=r"r00000-00000000.h5 is listed in manifest-r00000.json but missing"):
            GradientStore.open(path)


# ---------------------------------------------------------------------------------------------
# B. damaged but parseable store.json / manifest


def _edit_json(path: Path, edit):
    data = json.loads(path.read_text())
    path.write_text(json.dumps(edit(data)))


def _without(key):
    return lambda d: {k: v for k, v in d.items() if k != key}


def _layer0(**changes):
    def edit(d):
        layer = {k: v for k, v in d["layers"][0].items() if k not in changes or changes[k] is not None}
        layer.update({k: v for k, v in changes.items() if v is not None})
        return {**d, "layers": [layer, *d["layers"][1:]]}
    return edit


@pytest.mark.parametrize("edit, field", [
    (lambda d: [], "the file"),
    (lambda d: None, "the file"),
    (_without("layers"), "layers"),
    (lambda d: {**d, "layers": []}, "layers"),
    (_without("dtype"), "dtype"),
    (lambda d: {**d, "dtype": "float64"}, "dtype"),
    (lambda d: {**d, "format_version": "x"}, "format_version"),
    (lambda d: {**d, "capture": []}, "capture"),
    (_without("projector_hash"), "projector_hash"),
    (_layer0(shape=None), r"layers\[0\].shape"),
    (_layer0(shape=[4, "5"]), r"layers\[0\].shape"),
    (_layer0(shape=[3, 5, 1]), r"layers\[0\].shape"),
    (_layer0(rank=-1), r"layers\[0\].rank"),
    (_layer0(name="fc2"), r"layers\[1\].name"),
    (lambda d: {**d, "layers": ["fc", *d["layers"][1:]]}, r"layers\[0\]"),
])
def test_a_damaged_store_json_is_a_corrupt_error_naming_the_field(tmp_path, edit, field):
    path = tmp_path / "s"
    with writer(path, flush_every=1) as w:
        w.append(record(0))
    _edit_json(path / "store.json", edit)
    with pytest.raises(StoreCorruptError, match=rf"store.json is damaged: {field} "):
        GradientStore.open(path)


def _shard0(**changes):
    return lambda d: {**d, "shards": [{**d["shards"][0], **changes}, *d["shards"][1:]]}


@pytest.mark.parametrize("edit, field", [
    (lambda d: {**d, "counters": []}, "counters"),
    (lambda d: {**d, "counters": {"rows_written": "2"}}, "counters.rows_written"),
    (lambda d: {**d, "shards": {}}, "shards"),
    (_without("next_seq"), "next_seq"),
    (lambda d: {**d, "rank": 3}, "rank"),
    (_shard0(num_rows="2"), r"shards\[0\].num_rows"),
    (_shard0(num_rows=2.0), r"shards\[0\].num_rows"),
    (_shard0(bytes=None), r"shards\[0\].bytes"),
    (_shard0(file="../../elsewhere.h5"), r"shards\[0\].file"),
    (_shard0(step_min=5), r"shards\[0\]"),
    (lambda d: {**d, "shards": [d["shards"][0], d["shards"][0]]}, r"shards\[1\].seq"),
    (lambda d: {**d, "shards": [7]}, r"shards\[0\]"),
])
def test_a_damaged_manifest_is_a_corrupt_error_naming_the_field_and_repair_rebuilds_it(tmp_path, edit, field):
    path = tmp_path / "s"
    records = [record(0), record(1)]
    with writer(path, flush_every=1) as w:
        for r in records:
            w.append(r)
    _edit_json(path / "manifest-r00000.json", edit)
    with pytest.raises(StoreCorruptError, match=rf"manifest-r00000.json is damaged: {field} .*repair=True"):
        GradientStore.open(path)
    with pytest.warns(RuntimeWarning, match="rebuilding unreadable manifest"):
        store = GradientStore.open(path, repair=True)
    assert_rows(store.read_all(), records)
    assert GradientStore.open(path).num_rows == 4      # the rebuilt manifest was written


# ---------------------------------------------------------------------------------------------
# C. shards checked against store.json on read


@pytest.mark.parametrize("edit, says", [
    (_layer0(shape=[5, 3]), r"layer 'fc' is stored as \(5, 3\) float32"),
    (lambda d: {**d, "dtype": "float16"}, r"layer 'fc' is stored as \(3, 5\) float16"),
])
def test_a_shard_that_contradicts_store_json_is_a_corrupt_error_naming_both(tmp_path, edit, says):
    path = tmp_path / "s"
    with writer(path, flush_every=2) as w:
        w.append(record(0))
        w.append(record(1))
    _edit_json(path / "store.json", edit)
    store = GradientStore.open(path)
    store_json = re.escape(str(path / "store.json"))
    with pytest.raises(StoreCorruptError, match=r"r00000-00000000.h5: dataset grads/L0000 holds rows of "
                                                rf"\(3, 5\) float32, but {store_json} says {says}"):
        store.read_all()


# ---------------------------------------------------------------------------------------------
# D. a reader opened before a writer's truncate_after


@pytest.mark.parametrize("read", [
    lambda s: s.read_all(),
    lambda s: s.read_all(layers=["fc"]),
    lambda s: s.read_all(steps=[0, 1, 2, 3]),
])
def test_a_reader_opened_before_a_cut_reads_what_it_opened_and_a_refresh_applies_the_cut(tmp_path, read):
    """A cut never rewrites the shard it runs through: a reader opened before it reads the rows it
    opened, all checked, and a refresh voids the rows after the cut."""
    path = tmp_path / "s"
    records = [record(s) for s in range(4)]
    with writer(path, flush_every=4) as w:
        for r in records:
            w.append(r)
        w.flush()                                 # one shard of 8 rows
        store = GradientStore.open(path)
        w.truncate_after(1)                       # a cut marker: steps 2-3 of that shard are void
        assert sorted(set(read(store).steps.tolist())) == [0, 1, 2, 3]
        store.refresh()
        assert store.num_rows == 4 and store.num_examples == 4 and store.steps.tolist() == [0, 1]
        assert sorted(set(read(store).steps.tolist())) == [0, 1]
        assert_rows(store.read_all(), records[:2])


@pytest.mark.parametrize("readahead", [True, False])
def test_a_reader_opened_before_a_truncate_removed_a_shard_is_told_to_refresh(tmp_path, readahead):
    path = tmp_path / "s"
    records = [record(s) for s in range(4)]
    with writer(path, flush_every=1) as w:
        for r in records:
            w.append(r)
        w.flush()                                 # shards 0..3, one step each
        store = GradientStore.open(path)
        w.truncate_after(1)                       # shards 2, 3 removed
        seen = []
        with pytest.raises(StoreError, match=r"r00000-00000002.h5 is gone since the store was opened.*"
                                             r"refresh\(\)") as exc:
            for block in store.iter_blocks(block_size=2, readahead=readahead):
                seen.append(int(block.steps[0]))
        assert type(exc.value) is StoreError and seen == [0, 1]
        store.refresh()
        assert_rows(store.read_all(), records[:2])


def test_a_shard_replaced_after_hdf5_opened_it_is_not_read_at_the_old_offsets(tmp_path):
    """Shards are written once, but a file can still be put in one's place by hand (a restore from a
    copy): a reader that had the old one open does not read the new one at the old offsets."""
    path = tmp_path / "s"
    with writer(path, flush_every=4) as w:
        for s in range(8):
            w.append(record(s))
        w.flush()
        shard_path = path / "shards" / "r00000-00000000.h5"
        with _ShardReader(open_h5(shard_path), shard_path) as shard:
            assert shard.read("grads/L0000", np.arange(2)).shape == (2, 3, 5)   # raw file not yet open
            shard._file.close()
            shard._file = None
            shutil.copyfile(path / "shards" / "r00000-00000001.h5", path / "shards" / "other.tmp")
            os.replace(path / "shards" / "other.tmp", shard_path)               # another file under its name
            with pytest.raises(StoreError, match=r"r00000-00000000.h5 changed since the store was opened "
                                                 r"\(another file has its name now\)"):
                shard.read("grads/L0001")


def test_rows_past_a_datasets_end_are_refused(tmp_path):
    path = tmp_path / "s"
    with writer(path, flush_every=2) as w:
        w.append(record(0))
        w.append(record(1))
    shard_path = path / "shards" / "r00000-00000000.h5"
    for name in ("grads/L0000", "ids"):
        with _ShardReader(open_h5(shard_path), shard_path) as shard:
            with pytest.raises(StoreError, match=rf"rows 3..4 of dataset {name} were asked for; it has 4"):
                shard.read(name, np.array([3, 4]))


# ---------------------------------------------------------------------------------------------
# E. damaged bytes inside a complete shard


def test_a_damaged_compressed_chunk_names_the_shard_and_the_dataset(tmp_path):
    path = tmp_path / "s"
    with writer(path, flush_every=2, compression="gzip") as w:
        w.append(record(0, rows=40))
        w.append(record(1, rows=40))
    shard_path = path / "shards" / "r00000-00000000.h5"
    with h5py.File(shard_path, "r") as f:
        chunk = f["grads/L0001"].id.get_chunk_info(0)
    with open(shard_path, "r+b") as fh:               # same size: open() trusts it
        fh.seek(chunk.byte_offset + chunk.size // 4)
        fh.write(b"\xff" * (chunk.size // 2))
    store = GradientStore.open(path)
    assert len(store.read_all(layers=["fc"])) == 80   # the undamaged layer still reads
    with pytest.raises(StoreCorruptError, match=r"r00000-00000000.h5: dataset grads/L0001 cannot be read "
                                                r"\(.*\); the file is damaged.*move it out"):
        store.read_all()


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_verify_finds_a_flipped_bit_inside_a_complete_shard(tmp_path, compression, capsys):
    """Bit rot inside a complete, well-formed shard reads back silently as other numbers; ``verify``
    (``olmo-tda inspect --verify``) recomputes each dataset's CRC-32 and names the shard and dataset.
    The oracle: zlib's CRC-32 of the rows the test wrote, and a byte the test flipped itself."""
    import zlib

    from olmo_tda.cli import main

    path = tmp_path / "s"
    records = [record(step, rows=40) for step in range(4)]
    with writer(path, flush_every=2, compression=compression) as w:
        for r in records:
            w.append(r)
    store = GradientStore.open(path)
    clean = store.verify()
    assert clean["damaged"] == [] and clean["unchecked"] == [] and clean["shards"] == 2
    assert clean["datasets"] == 2 * 6 and clean["bytes_read"] == 2 * 80 * (8 + 8 + 8 + 8 + 4 * (15 + 8))
    assert main(["inspect", str(path), "--verify"]) == 0
    shard_path = path / "shards" / "r00000-00000001.h5"
    with h5py.File(shard_path, "r") as f:             # the writer's checksum is of the rows it was given
        rows = torch.cat([r.grads["fc2"] for r in records[2:]]).numpy()
        assert int(f["grads/L0001"].attrs["crc32"]) == zlib.crc32(rows.tobytes())
        if compression:
            chunk = f["grads/L0001"].id.get_chunk_info(0)
            at = chunk.byte_offset + chunk.size - 8          # inside the deflate stream's last bytes
        else:
            at = f["grads/L0001"].id.get_offset() + 7 * 4 * 8 + 1
    data = bytearray(shard_path.read_bytes())
    data[at] ^= 0x10
    shard_path.write_bytes(bytes(data))
    if not compression:             # the bytes decode as other numbers; the read's checksum refuses them
        with pytest.raises(StoreCorruptError, match=r"r00000-00000001.h5: layer 'fc2' \(grads/L0001\) is damaged"):
            GradientStore.open(path).read_all(layers=["fc2"])
        assert len(GradientStore.open(path).read_all(layers=["fc"])) == 160      # an undamaged layer reads
    found = GradientStore.open(path).verify()
    assert [(d["file"], d["dataset"]) for d in found["damaged"]] in (
        [("shards/r00000-00000001.h5", "grads/L0001")], [("shards/r00000-00000001.h5", None)])
    assert main(["inspect", str(path), "--verify"]) == 1
    err = capsys.readouterr().err
    assert "damaged: shards/r00000-00000001.h5" in err and "grads/L0001" in err
    with h5py.File(path / "shards" / "r00000-00000000.h5", "r+") as f:    # written before checksums were kept
        for name in ("ids", "steps", "lr", "loss_scale", "grads/L0000", "grads/L0001"):
            del f[name].attrs["crc32"]
    assert GradientStore.open(path).verify()["unchecked"] == ["shards/r00000-00000000.h5"]


def test_verify_lists_shards_a_live_writer_truncated_as_changed_not_damaged(tmp_path, capsys):
    """A reader opened while its writer runs; the writer's ``truncate_after`` (a resume) then cuts
    through one shard (never rewriting it) and removes another. ``verify`` lists the removed one as
    changed while read (not damage: the CLI exits 0), checks the others, and after ``refresh`` checks
    what is there now."""
    from olmo_tda.cli import main

    path = tmp_path / "s"
    w = writer(path, flush_every=2)
    try:
        for step in range(6):
            w.append(record(step, rows=3))
        w.flush()                                       # shards 0 (steps 0-1), 1 (2-3), 2 (4-5)
        store = GradientStore.open(path)
        assert [s.file for s in store.shards][-2:] == ["shards/r00000-00000001.h5", "shards/r00000-00000002.h5"]
        w.truncate_after(2)                             # shard 1 cut through (step 2 live), shard 2 removed
        found = store.verify()
        assert found["changed"] == ["shards/r00000-00000002.h5"]
        assert found["damaged"] == [] and found["datasets"] == 2 * 6     # shards 0 and 1, checked
        assert main(["inspect", str(path), "--verify"]) == 0
        store.refresh()
        again = store.verify()
        assert again["changed"] == [] and again["damaged"] == [] and again["datasets"] == 2 * 6
    finally:
        w.close()
    capsys.readouterr()


def test_a_shard_whose_key_column_cannot_be_found_names_it(tmp_path):
    path = tmp_path / "s"
    with writer(path, flush_every=2) as w:
        w.append(record(0))
        w.append(record(1))
    shard_path = path / "shards" / "r00000-00000000.h5"
    data = shard_path.read_bytes()
    assert data.count(b"ids\x00") == 1
    shard_path.write_bytes(data.replace(b"ids\x00", b"idz\x00"))     # same size, name damaged
    store = GradientStore.open(path)
    for read in (lambda: store.num_examples, store.read_all):
        with pytest.raises(StoreCorruptError, match=r"r00000-00000000.h5: dataset ids cannot be opened"):
            read()


# ---------------------------------------------------------------------------------------------
# F. failing writes while opening


def test_a_lock_that_cannot_be_created_is_a_store_error_naming_it(tmp_path):
    path = tmp_path / "s"
    with writer(path, flush_every=1) as w:
        w.append(record(0))
    (path / "locks" / "r00000.lock").unlink()
    (path / "locks").rmdir()
    (path / "locks").write_text("not a directory")
    lock = re.escape(str(path / "locks" / "r00000.lock"))
    with pytest.raises(StoreError, match=rf"cannot create the writer lock {lock} of rank 0"):
        writer(path)


def test_a_manifest_rewrite_on_a_full_disk_during_the_scan_is_a_store_error(tmp_path, monkeypatch):
    path = tmp_path / "s"
    with writer(path, flush_every=1) as w:
        w.append(record(0))
    (path / "manifest-r00000.json").unlink()          # the writer's scan adopts the shard and rewrites it

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manifest_module, "write_json_atomic", disk_full)
    with pytest.raises(StoreError, match=r"cannot rewrite .*manifest-r00000.json .*the disk is full"):
        writer(path)
    monkeypatch.undo()
    with writer(path):                                # the failed create released its lock
        pass


def test_a_quarantine_that_cannot_be_created_is_a_store_error(tmp_path):
    path = tmp_path / "s"
    with writer(path, flush_every=1) as w:
        w.append(record(0))
        w.append(record(1))
    victim = path / "shards" / "r00000-00000001.h5"
    victim.write_bytes(victim.read_bytes()[:100])
    (path / "quarantine").write_text("not a directory")
    with pytest.raises(StoreError, match=r"cannot move unreadable shard .*r00000-00000001.h5 to"):
        GradientStore.open(path, repair=True)


# ---------------------------------------------------------------------------------------------
# G. reads longer than one read() returns


class _ShortReads:
    """A raw file whose ``readinto`` returns at most ``cap`` bytes, as Linux does above 0x7ffff000."""

    def __init__(self, raw, cap):
        self.raw, self.cap, self.calls = raw, cap, 0

    def seek(self, offset):
        return self.raw.seek(offset)

    def readinto(self, view):
        self.calls += 1
        return self.raw.readinto(view[:self.cap])

    def close(self):
        self.raw.close()


def test_a_read_longer_than_one_read_call_returns_is_completed(tmp_path):
    path = tmp_path / "s"
    with writer(path, flush_every=3) as w:
        for s in range(3):
            w.append(record(s, rows=5))
    shard_path = path / "shards" / "r00000-00000000.h5"
    with h5py.File(shard_path, "r") as f:
        want = f["grads/L0000"][:]
    with _ShardReader(open_h5(shard_path), shard_path) as shard:
        shard._file = short = _ShortReads(open(shard_path, "rb", buffering=0), cap=64)
        got = shard.read("grads/L0000")
        assert np.array_equal(got, want) and short.calls > want.nbytes // 64


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_reads_refuse_a_damaged_shard_or_skip_it_whole(tmp_path, compression):
    """Every read path checks the stored checksums: ``attribute`` over a store with flipped bytes in
    one shard refuses, naming the shard and the layer; with ``skip_damaged`` its answer equals the
    answer over a store written without that shard's records (the oracle), and the skipped rows are
    counted."""
    from olmo_tda import attribute

    records = [record(step, rows=40) for step in range(6)]
    damaged, clean = tmp_path / "damaged", tmp_path / "clean"
    for path, kept in ((damaged, records), (clean, records[:2] + records[4:])):
        with writer(path, flush_every=2, compression=compression) as w:
            for r in kept:
                w.append(r)
    shard_path = damaged / "shards" / "r00000-00000001.h5"          # steps 2 and 3
    with h5py.File(shard_path, "r") as f:
        ds = f["grads/L0000"]
        at = (ds.id.get_chunk_info(0).byte_offset + 40 if compression else ds.id.get_offset() + 123)
    data = bytearray(shard_path.read_bytes())
    data[at:at + 64] = bytes(b ^ 0xA5 for b in data[at:at + 64])
    shard_path.write_bytes(bytes(data))
    queries = {n: torch.randn(3, *layer["shape"], generator=torch.Generator().manual_seed(9))
               for n, layer in ((layer["name"], layer) for layer in LAYERS)}
    with pytest.raises(StoreCorruptError, match=r"r00000-00000001.h5: (layer 'fc' \(grads/L0000\) is damaged"
                                                r"|dataset grads/L0000 cannot be read)"):
        attribute(GradientStore.open(damaged), queries, method="graddot", top_k=20)
    store = GradientStore.open(damaged, skip_damaged=True)
    got = attribute(store, queries, method="graddot", top_k=20)
    want = attribute(GradientStore.open(clean), queries, method="graddot", top_k=20)
    if not compression:
        assert store.skipped == {"shards/r00000-00000001.h5": {
            "rows": 80, "dataset": "grads/L0000", "layer": "fc", "problem": store.skipped[
                "shards/r00000-00000001.h5"]["problem"]}}
    assert got.num_scored == want.num_scored == 160
    assert np.array_equal(got.ids, want.ids) and np.array_equal(got.steps, want.steps)
    assert torch.equal(got.scores, want.scores)
