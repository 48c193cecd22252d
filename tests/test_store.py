"""The gradient store: exact round trips, crash safety (real SIGKILLs), errors users can act on.

Oracles: the data written is known (random tensors kept in the test, or the workers' deterministic
function of (id, step, layer)), so every read is compared exactly — bitwise for float32, and for
16-bit dtypes against torch's own rounding of the same values.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import _store_kill_worker as worker
import olmo_tda
from olmo_tda.config import StoreConfig, StoreDType
from olmo_tda.store import (
    GradientRecord,
    GradientStore,
    NonFiniteGradientWarning,
    StoreCorruptError,
    StoreError,
    StoreMismatchError,
    StoreWriteError,
    StoreWriter,
)
from olmo_tda.store import manifest as manifest_module
from olmo_tda.store import window as window_module
from olmo_tda.store import writer as writer_module
from olmo_tda.store import locks as locks_module
from olmo_tda.store.locks import RankLock

META = worker.META
LAYERS = [layer["name"] for layer in worker.LAYERS]


def random_records(steps, rows_per_step=3, seed=0, layers=worker.LAYERS):
    """Records with random float32 gradients (kept by the caller as the oracle)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in steps:
        ids = np.arange(rows_per_step, dtype=np.int64) + 10 * step
        grads = {layer["name"]: torch.randn(rows_per_step, *layer["shape"], generator=gen) * 3.0
                 for layer in layers}
        out.append(GradientRecord(ids=ids, step=step, lr=0.1 / (step + 1), loss_scale=2.0 + step, grads=grads))
    return out


def expected_rows(records):
    """``{(id, step): (lr, loss_scale, {layer: [k_out, k_in]})}`` of a list of records."""
    rows = {}
    for r in records:
        for i, ex in enumerate(r.ids):
            rows[(int(ex), r.step)] = (r.lr, r.loss_scale, {n: g[i] for n, g in r.grads.items()})
    return rows


def rows_of(block):
    return {(int(i), int(s)): k for k, (i, s) in enumerate(zip(block.ids, block.steps))}


def tmp_files(path):
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*.tmp"))


def write_store(path, records, **config):
    with GradientStore.create(path, META, StoreConfig(**config)) as w:
        for r in records:
            w.append(r)
    return GradientStore.open(path)


def check_worker_rows(store):
    """Every row equals the workers' deterministic data; no duplicate keys. Returns the set of steps."""
    block = store.read_all()
    keys = list(zip(block.ids.tolist(), block.steps.tolist()))
    assert len(keys) == len(set(keys)), "duplicate (id, step) rows"
    for k, (_ex, step) in enumerate(keys):
        assert block.lr[k] == worker.lr_at(step) and block.loss_scale[k] == worker.loss_scale_at(step)
    check_worker_grads(block)
    steps = set(block.steps.tolist())
    for step in steps:  # a step is written by one window: all of its rows or none
        assert sorted(block.ids[block.steps == step].tolist()) == sorted(worker.ids_at(step).tolist())
    return steps


def check_worker_grads(block):
    """Every row's gradients are the workers' deterministic data for its (id, step), bit for bit."""
    for k, (ex, step) in enumerate(zip(block.ids.tolist(), block.steps.tolist())):
        for li, layer in enumerate(worker.LAYERS):
            want = torch.from_numpy(worker.expected_grad(ex, step, li, layer["shape"]))
            assert torch.equal(block.grads[layer["name"]][k], want), (ex, step, layer["name"])


# ---------------------------------------------------------------------------------------------
# round trips


def test_float32_round_trip_is_bitwise_with_layer_subsets_and_any_block_size(tmp_path):
    records = random_records(range(7), rows_per_step=3)
    store = write_store(tmp_path / "s", records, flush_every=2)
    want = expected_rows(records)
    full = store.read_all()
    assert len(full) == len(want) == store.num_rows == 21
    assert store.steps.tolist() == list(range(7)) and store.num_examples == 21
    assert [s.seq for s in store.shards] == [0, 1, 2, 3]  # windows of 2 steps: 0-1, 2-3, 4-5, 6
    for k, key in enumerate(zip(full.ids.tolist(), full.steps.tolist())):
        lr, scale, grads = want[key]
        assert full.lr[k] == lr and full.loss_scale[k] == scale
        for name in LAYERS:
            assert full.grads[name].dtype == torch.float32
            assert torch.equal(full.grads[name][k], grads[name])  # bitwise
    for block_size in (1, 2, 5, 8, 100):
        blocks = list(store.iter_blocks(layers=[LAYERS[1]], block_size=block_size))
        assert all(len(b) == block_size for b in blocks[:-1]) and 0 < len(blocks[-1]) <= block_size
        assert all(list(b.grads) == [LAYERS[1]] for b in blocks)
        assert np.array_equal(np.concatenate([b.ids for b in blocks]), full.ids)
        assert np.array_equal(np.concatenate([b.steps for b in blocks]), full.steps)
        assert torch.equal(torch.cat([b.grads[LAYERS[1]] for b in blocks]), full.grads[LAYERS[1]])


def test_default_block_is_sized_by_decoded_bytes(tmp_path, monkeypatch):
    from olmo_tda.store import reader as reader_module

    records = random_records(range(7), rows_per_step=3)
    store = write_store(tmp_path / "s", records, flush_every=2)
    full = store.read_all()
    row_bytes = {name: 4 * int(np.prod(layer["shape"])) for name, layer in zip(LAYERS, worker.LAYERS)}
    want = min(reader_module.MAX_BLOCK_ROWS, reader_module.BLOCK_BYTES // sum(row_bytes.values()))
    assert store.block_rows() == want
    # a budget of 4 rows of every layer: default blocks of 4 rows; one layer alone fits more rows
    monkeypatch.setattr(reader_module, "BLOCK_BYTES", 4 * sum(row_bytes.values()))
    assert store.block_rows() == 4
    assert store.block_rows([LAYERS[0]]) == 4 * sum(row_bytes.values()) // row_bytes[LAYERS[0]]
    blocks = list(store.iter_blocks())
    assert [len(b) for b in blocks] == [4, 4, 4, 4, 4, 1]
    assert np.array_equal(np.concatenate([b.ids for b in blocks]), full.ids)
    for name in LAYERS:
        assert torch.equal(torch.cat([b.grads[name] for b in blocks]), full.grads[name])
    one_shot = list(store.iter_blocks(layers=(n for n in [LAYERS[0]])))   # a generator is read once
    assert all(list(b.grads) == [LAYERS[0]] for b in one_shot)
    rows = store.block_rows([LAYERS[0]])
    assert rows > 4 and all(len(b) == rows for b in one_shot[:-1]) and sum(len(b) for b in one_shot) == 21
    monkeypatch.setattr(reader_module, "BLOCK_BYTES", 1)           # less than a row: one row a block
    assert store.block_rows() == 1 and len(list(store.iter_blocks())) == 21
    monkeypatch.setattr(reader_module, "BLOCK_BYTES", 1 << 40)     # never more than the cap
    assert store.block_rows() == reader_module.MAX_BLOCK_ROWS


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
def test_compressed_round_trip_is_bitwise(tmp_path, compression):
    # 50 rows a record: a window of 3 spans 3 segments, joined for the compressed write
    records = random_records(range(5), rows_per_step=50, seed=15)
    store = write_store(tmp_path / "s", records, flush_every=3, compression=compression)
    want = expected_rows(records)
    for block in store.iter_blocks(block_size=37):
        for k, key in enumerate(zip(block.ids.tolist(), block.steps.tolist())):
            for name in LAYERS:
                assert torch.equal(block.grads[name][k], want[key][2][name])
    assert store.num_rows == 250


def test_windows_reuse_their_buffers_and_only_the_structure_passes_through_memory(tmp_path, monkeypatch):
    """Windows after the first are encoded into the same buffers, and of each shard only libhdf5's
    structure and the per-row fields are built in memory: the rows go from the window to the file."""
    from olmo_tda.store import format as format_module

    structures = []

    class Spy(format_module._StructureFile):
        def __init__(self):
            super().__init__()
            structures.append(self)

    monkeypatch.setattr(format_module, "_StructureFile", Spy)
    layers = [{"name": f"l{i}", "shape": [32, 32], "projector": {"seed": 0}} for i in range(3)]
    meta = {**META, "layers": layers}
    records = random_records(range(12), rows_per_step=40, layers=layers)
    buffers = []
    with GradientStore.create(tmp_path / "s", meta, StoreConfig(flush_every=4)) as w:
        for r in records:
            w.append(r)
            if r.step % 4 == 3:
                w.flush()
                buffers.append([g for seg in w._window.segments for g in seg.grads])   # held: no address reuse
    assert len(buffers[0]) > 3
    assert all(len(b) == len(buffers[0]) and all(x is y for x, y in zip(b, buffers[0])) for b in buffers)
    store = GradientStore.open(tmp_path / "s")
    assert len(store.shards) == 3 and len(structures) == 3
    for spy, shard in zip(structures, store.shards):
        in_memory = sum(len(piece) for _, piece in spy.pieces)
        assert shard.bytes == spy.size == (tmp_path / "s" / shard.file).stat().st_size
        assert in_memory < 16 << 10 < shard.bytes // 8, (in_memory, shard.bytes)
    block, want = store.read_all(), expected_rows(records)
    rows = rows_of(block)
    assert set(rows) == set(want) and block.ids.tolist() == [i for r in records for i in r.ids.tolist()]
    for key, (_lr, _scale, grads) in want.items():
        for name, g in grads.items():
            assert torch.equal(block.grads[name][rows[key]], g), (key, name)


def test_a_window_grown_past_the_flush_bound_is_released_once_written(tmp_path):
    """Segments beyond what ``flush_mb`` needs (the window grew while the disk failed) are freed by
    the write that empties them; rows keep their order through a truncation and later appends."""
    from olmo_tda.store.window import Window

    window = Window([(8, 8)], np.float32, keep_bytes=300 * 8 * 8 * 4)

    def append(step, rows=30):
        seg, lo = window.reserve(rows)
        seg.grads[0][lo:lo + rows] = step
        window.commit(seg, lo, np.ones(rows, bool), np.arange(rows) + 100 * step, step, 0.1, 1.0)

    for step in range(40):                                      # 40 records of 30 rows: 1200 rows
        append(step)
    assert [seg.capacity for seg in window.segments] == [64, 64, 128, 256, 512, 1024]
    assert window.drop_steps_after(29) == 300 and window.rows == 900
    for step in range(30, 36):                                  # appended after the truncation
        append(step)
    chunks = window.chunks()
    assert np.array_equal(np.concatenate([c["grads"][0][:, 0, 0] for c in chunks]), np.repeat(np.arange(36), 30))
    assert np.array_equal(np.concatenate([c["steps"] for c in chunks]), np.repeat(np.arange(36), 30))
    window.clear()
    # 1080 rows > 300 + one record: keep the fewest leading segments that hold 300 rows
    assert window.rows == 0 and [seg.capacity for seg in window.segments] == [64, 64, 128, 256]


def test_steady_windows_at_the_flush_bound_reuse_every_segment(tmp_path, monkeypatch):
    """Windows closed by ``flush_mb`` (a post-hoc capture) reach the same segments each time; the
    writer keeps all of them, so no window after the first allocates (record-end waste included)."""
    made = []

    class Counted(window_module.WindowSegment):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self.capacity)

    monkeypatch.setattr(window_module, "WindowSegment", Counted)
    layers = [{"name": "l0", "shape": [8, 8], "projector": {"seed": 0}}]
    meta = {**META, "layers": layers}
    config = StoreConfig(flush_every=10 ** 6, flush_mb=1000 * 8 * 8 * 4 / 2 ** 20)   # a window: >= 1000 rows
    gen = torch.Generator().manual_seed(0)
    with GradientStore.create(tmp_path / "s", meta, config) as w:
        for r in range(210):                                    # 48-row records at one step: 10 windows of 21
            w.append(GradientRecord(ids=np.arange(48) + 48 * r, step=0, lr=0.1, loss_scale=1.0,
                                    grads={"l0": torch.randn(48, 8, 8, generator=gen)}))
            if r == 20:
                w.flush()
                first = list(made)
    assert len(GradientStore.open(tmp_path / "s").shards) == 10
    assert made == first == [64, 64, 128, 256, 512, 1024], made      # nothing allocated after window 1


def test_writing_a_window_holds_little_beyond_the_window(tmp_path):
    """Peak resident memory of a fresh process while one ~76 MB post-hoc window is encoded and written
    stays near the window: no in-memory image of the shard, no joined copy, no copy when the window
    grows (2.2x before 2026-12-02). 129 records of 16 rows: just past a power-of-two number of rows."""
    from benchmarks.store_append import window_peak

    grown = window_peak(32, 129, tmp_path / "s")
    assert GradientStore.open(tmp_path / "s").num_rows == 129 * 16
    # numpy backs large arrays with 2 MB huge pages: the new segment's first rows touch one per
    # layer (1.30 measured); the BytesIO image gave 2.40x, growing the window by copying 2.10x
    assert grown < 1.5, grown


def test_short_pwrites_still_write_the_whole_shard(tmp_path, monkeypatch):
    """``pwrite`` may write less than asked: a shard written 4093 bytes a call is byte-identical."""
    from olmo_tda.store import format as format_module

    records = random_records(range(3), rows_per_step=50)
    write_store(tmp_path / "whole", records)
    real = os.pwrite
    calls = []

    def short_pwrite(fd, data, offset):
        calls.append(len(data))
        return real(fd, memoryview(data)[:4093], offset)

    monkeypatch.setattr(format_module.os, "pwrite", short_pwrite)
    write_store(tmp_path / "short", records)
    assert max(calls) > 4093
    a, b = sorted((tmp_path / "whole" / "shards").iterdir()), sorted((tmp_path / "short" / "shards").iterdir())
    assert [f.name for f in a] == [f.name for f in b] and all(x.read_bytes() == y.read_bytes() for x, y in zip(a, b))


def test_structure_file_reads_back_what_was_written_like_a_real_file(tmp_path):
    """libhdf5's in-memory file: random writes (overlapping, past the end), reads and truncations
    give what the same calls give on a real file."""
    from olmo_tda.store.format import _StructureFile

    rng = random.Random(3)
    ours = _StructureFile()
    with open(tmp_path / "real", "w+b") as real:
        for _ in range(400):
            op = rng.random()
            pos = rng.randrange(0, 3000)
            if op < 0.5:
                data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
                for f in (ours, real):
                    f.seek(pos)
                    f.write(data)
            elif op < 0.9:
                size = rng.randrange(0, 400)
                got = (ours.seek(pos), ours.read(size))[1]
                want = (real.seek(pos), real.read(size))[1]
                # a read past the end: a file returns less; libhdf5 never asks for it (it knows the EOA)
                assert got[:len(want)] == want and (len(got) == len(want) or pos + size > ours.size)
            else:
                size = rng.randrange(0, 3500)
                ours.truncate(size)
                real.truncate(size)
            real.seek(0, 2)
            assert ours.seek(0, 2) == real.tell() == ours.tell()


def test_step_and_id_filters_match_brute_force(tmp_path):
    records = random_records(range(6), rows_per_step=4)
    store = write_store(tmp_path / "s", records, flush_every=4)
    full = store.read_all()
    steps, ids = [1, 4, 5, 99], [10, 12, 41, 52, 7]
    mask = np.isin(full.steps, steps) & np.isin(full.ids, ids)
    for block_size in (1, 3, 64):
        blocks = list(store.iter_blocks(block_size=block_size, steps=steps, ids=ids))
        got_ids = np.concatenate([b.ids for b in blocks])
        assert np.array_equal(got_ids, full.ids[mask])
        assert torch.equal(torch.cat([b.grads[LAYERS[0]] for b in blocks]), full.grads[LAYERS[0]][mask])
    assert len(store.read_all(steps=[1000])) == 0
    with pytest.raises(KeyError, match="did you mean 'blocks.0.att_proj'"):
        store.read_all(layers=["blocks.0.att_prj"])


@pytest.mark.parametrize("dtype,torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_16bit_round_trip_equals_torch_rounding(tmp_path, dtype, torch_dtype):
    records = random_records(range(3), rows_per_step=5, seed=1)
    store = write_store(tmp_path / "s", records, flush_every=2, dtype=dtype)
    assert store.meta["dtype"] == dtype
    block = store.read_all()
    want = expected_rows(records)
    for k, key in enumerate(zip(block.ids.tolist(), block.steps.tolist())):
        for name in LAYERS:
            rounded = want[key][2][name].to(torch_dtype).float()
            assert torch.equal(block.grads[name][k], rounded)
            assert not torch.equal(rounded, want[key][2][name])  # the rounding is real, not a no-op
    # 2 bytes per value on disk
    import h5py

    for shard in store.shards:
        with h5py.File(tmp_path / "s" / shard.file, "r") as f:
            for i, layer in enumerate(worker.LAYERS):
                ds = f[f"grads/L{i:04d}"]
                assert ds.id.get_storage_size() == 2 * shard.num_rows * np.prod(layer["shape"])


def test_store_json_is_self_describing_and_summary(tmp_path):
    meta = {**META, "extra": {"data_fingerprint": "abc123"}}
    with GradientStore.create(tmp_path / "s", meta, StoreConfig(dtype="bfloat16")) as w:
        for r in random_records(range(2)):
            w.append(r)
    stored = json.loads((tmp_path / "s" / "store.json").read_text())
    assert stored["format"] == "olmo_tda.store" and stored["format_version"] == 1
    assert stored["gradient_convention"] == "sum_token_loss;loss_scale=update_share"
    assert stored["representation"] == "dense"
    assert stored["dtype"] == "bfloat16" and stored["library_version"] == olmo_tda.__version__
    assert stored["layers"] == worker.LAYERS and stored["capture"] == META["capture"]
    assert stored["projector_hash"] == "kill-test" and stored["extra"] == {"data_fingerprint": "abc123"}
    summary = GradientStore.open(tmp_path / "s").summary()
    json.dumps(summary)  # plain values only
    assert summary["num_rows"] == 6 and summary["steps"] == {"count": 2, "min": 0, "max": 1}
    assert summary["layers"] == [{"name": n, "shape": s, "rank": 0} for n, s in
                                 [(layer["name"], layer["shape"]) for layer in worker.LAYERS]]
    assert summary["stats"]["rows_written"] == 6 and summary["shards"] == 1 and summary["dtype"] == "bfloat16"


def test_a_store_without_rows_reads_as_empty(tmp_path):
    w = GradientStore.create(tmp_path / "s", META, StoreConfig())
    store = GradientStore.open(tmp_path / "s")  # while the writer is open, before any shard
    assert store.num_rows == 0 and store.num_examples == 0 and len(store.steps) == 0
    empty = store.read_all(layers=[LAYERS[1]])
    assert len(empty) == 0 and empty.grads[LAYERS[1]].shape == (0, 4, 4)
    assert store.summary()["steps"] == {"count": 0, "min": None, "max": None}
    w.close()
    assert GradientStore.open(tmp_path / "s").num_rows == 0
    with pytest.raises(StoreError, match="closed"):
        w.append(random_records([0])[0])


def test_bad_meta_and_bad_records_are_refused_in_the_caller(tmp_path):
    with pytest.raises(ValueError, match="projector_hash"):
        GradientStore.create(tmp_path / "a", {"capture": {}, "layers": worker.LAYERS}, StoreConfig())
    dup = {**META, "layers": [worker.LAYERS[0], worker.LAYERS[0]]}
    with pytest.raises(ValueError, match="duplicate"):
        GradientStore.create(tmp_path / "b", dup, StoreConfig())
    with GradientStore.create(tmp_path / "c", META, StoreConfig()) as w:
        rec = random_records([0])[0]
        del rec.grads[LAYERS[1]]
        with pytest.raises(ValueError, match="missing=\\['blocks.1/ff_out'\\]"):
            w.append(rec)
        rec = random_records([0])[0]
        rec.grads[LAYERS[1]] = torch.zeros(3, 4, 5)
        with pytest.raises(ValueError, match=r"expected \[N, 4, 4\]"):
            w.append(rec)
    rec = random_records([0])[0]
    with pytest.raises(ValueError, match="one per row"):
        GradientRecord(ids=rec.ids, step=0, lr=0.1, loss_scale=np.ones(2), grads=rec.grads)
    with pytest.raises(ValueError, match="positive and finite"):
        GradientRecord(ids=rec.ids, step=0, lr=0.1, loss_scale=np.array([1.0, 0.0, 2.0]), grads=rec.grads)


def test_per_row_loss_scales_survive_duplicate_and_nonfinite_filtering(tmp_path):
    """A record whose micro-batches were normalized differently keeps one loss_scale per row,
    aligned with its ids after rows are skipped."""
    rec = random_records([3], rows_per_step=4, seed=9)[0]
    rec.ids[:] = [5, 6, 5, 7]                    # row 2 repeats id 5
    rec.grads[LAYERS[0]][3, 0, 0] = float("nan")  # row 3 is non-finite
    rec.loss_scale = np.array([11.0, 12.0, 13.0, 14.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        with GradientStore.create(tmp_path / "s", META, StoreConfig()) as w:
            w.append(rec)
    block = GradientStore.open(tmp_path / "s").read_all()
    assert block.ids.tolist() == [5, 6] and block.loss_scale.tolist() == [11.0, 12.0]


# ---------------------------------------------------------------------------------------------
# readahead: the next shard's bytes are requested while this one is read


class _InlineExecutor:
    """Stands in for the reader's helper thread: runs each request at once, in order."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        pass

    def submit(self, fn, *args):
        _InlineExecutor.calls.append(args)
        fn(*args)

    def shutdown(self, wait=True, cancel_futures=False):
        pass


@pytest.fixture
def inline_readahead(monkeypatch):
    from olmo_tda.store import reader

    _InlineExecutor.calls = []
    monkeypatch.setattr(reader, "ThreadPoolExecutor", _InlineExecutor)
    return _InlineExecutor.calls


def test_readahead_asks_for_exactly_the_selected_layers_bytes_of_each_shard(tmp_path, inline_readahead):
    records = random_records(range(7), rows_per_step=3, seed=21)
    store = write_store(tmp_path / "s", records, flush_every=2)
    want = expected_rows(records)
    for layers in (None, [LAYERS[1]]):
        inline_readahead.clear()
        blocks = list(store.iter_blocks(layers=layers, block_size=4))
        plain = list(store.iter_blocks(layers=layers, block_size=4, readahead=False))
        for b, p in zip(blocks, plain, strict=True):
            assert np.array_equal(b.ids, p.ids) and all(torch.equal(b.grads[n], p.grads[n]) for n in b.grads)
        chosen = LAYERS if layers is None else layers
        # per shard: the first at once (its layers); each next one, one ahead: its head (metadata and
        # small datasets) and its layers; from the third on, two ahead: its head alone, before it is opened
        paths = [store.path / info.file for info in store.shards]
        assert [path for path, _ in inline_readahead] == [paths[0], paths[1], paths[2], paths[2], paths[3], paths[3]]
        layer_requests = [inline_readahead[i] for i in (0, 1, 3, 5)]
        heads = [_head_of(path) for path in paths]
        for j, ((_path, ranges), early) in enumerate(zip(layer_requests, (None, None, 2, 4))):
            head, ends = heads[j]
            if j:
                assert ranges[0] == (0, head) and head >= max(ends.values())     # ids, steps, lr, loss_scale
            if early is not None:       # sized by the shard before it (1.5x), which covers its own head
                before = heads[j - 1][0]
                assert inline_readahead[early][1] == [(0, before + before // 2)] and before + before // 2 >= head
        for (path, ranges), info in zip(layer_requests, store.shards):
            ranges = [r for r in ranges if r[0]]
            assert path == store.path / info.file
            assert len(ranges) == len(chosen)
            raw = path.read_bytes()
            keys = [(int(i), int(s)) for i, s in zip(*_keys_of(path))]
            for (offset, length), name in zip(ranges, chosen):
                # the requested bytes are that layer's rows, as written (independent of h5py's reader)
                got = np.frombuffer(raw[offset:offset + length], dtype=np.float32)
                rows = torch.stack([want[key][2][name] for key in keys])
                assert np.array_equal(got, rows.numpy().ravel())
    inline_readahead.clear()
    list(store.iter_blocks(ids=[0, 1, 20]))                          # sparse selections read no ahead
    assert inline_readahead == []


def _head_of(path):
    """(offset of the first gradient dataset, {small dataset: its end offset}) of a shard."""
    import h5py

    with h5py.File(path, "r") as f:
        ends = {k: f[k].id.get_offset() + f[k].id.get_storage_size() for k in ("ids", "steps", "lr", "loss_scale")}
        return f["grads/L0000"].id.get_offset(), ends


def _keys_of(path):
    import h5py

    with h5py.File(path, "r") as f:
        return f["ids"][:], f["steps"][:]


def test_readahead_of_a_compressed_store_asks_for_whole_files(tmp_path, inline_readahead):
    store = write_store(tmp_path / "s", random_records(range(4), seed=22), flush_every=2, compression="gzip")
    assert len(list(store.iter_blocks(block_size=2))) == 6
    assert [ranges for _, ranges in inline_readahead] == [[(0, 0)], [(0, 0)]]


def test_willneed_covers_each_range_in_readahead_windows_and_never_raises(tmp_path, monkeypatch):
    from olmo_tda.store import reader

    path = tmp_path / "f"
    path.write_bytes(b"x" * 5000)
    seen = []
    monkeypatch.setattr(reader.os, "posix_fadvise", lambda fd, off, length, advice: seen.append((off, length, advice)),
                        raising=False)
    monkeypatch.setattr(reader, "_readahead_window", lambda dev: 1024)
    reader._willneed(path, [(100, 2500), (0, 0)])
    assert seen[:3] == [(100, 1024, os.POSIX_FADV_WILLNEED), (1124, 1024, os.POSIX_FADV_WILLNEED),
                        (2148, 452, os.POSIX_FADV_WILLNEED)]
    assert [(o, n) for o, n, _ in seen[3:]] == [(0, 1024), (1024, 1024), (2048, 1024), (3072, 1024), (4096, 904)]
    reader._willneed(tmp_path / "missing", [(0, 0)])                 # a hint: a failure is not an error


@pytest.mark.parametrize("config", [{}, {"dtype": "bfloat16"}, {"dtype": "float16"}, {"compression": "gzip"}])
def test_shard_reader_reads_what_hdf5_reads(tmp_path, config):
    # the reader reads contiguous datasets straight from the file at their byte offsets: every
    # dataset, whole or any row selection (contiguous, ragged, sparse), equals h5py's own read
    import h5py
    from olmo_tda.store.reader import _ShardReader

    store = write_store(tmp_path / "s", random_records(range(5), rows_per_step=4, seed=31), flush_every=3, **config)
    selections = [None, np.arange(2, 9), np.array([0, 1, 3, 4, 6]), np.array([0, 11]), np.array([5])]
    for info in store.shards:
        path = store.path / info.file
        with h5py.File(path, "r") as f:
            want = {name: f[name][:] for name in ["ids", "steps", "lr", "loss_scale", *f["grads"]]
                    for name in ([name] if name in f else [f"grads/{name}"])}
        with _ShardReader(h5py.File(path, "r"), path) as shard:
            for name, full in want.items():
                if name.startswith("grads/"):               # compressed gradients go through HDF5
                    assert (shard._layout(name)[3] is None) == ("compression" in config)
                for rows in selections:
                    rows = rows if rows is None else rows[rows < len(full)]
                    got = shard.read(name, rows)
                    assert got.dtype == full.dtype and np.array_equal(got, full if rows is None else full[rows])


def test_a_truncated_dataset_names_the_shard_and_the_dataset(tmp_path, monkeypatch):
    import h5py
    from olmo_tda.store import reader

    store = write_store(tmp_path / "s", random_records(range(2), seed=32), flush_every=2)
    path = store.path / store.shards[0].file
    with reader._ShardReader(h5py.File(path, "r"), path) as shard:
        dsid, shape, dtype, _ = shard._layout("grads/L0001")
        shard._layouts["grads/L0001"] = (dsid, shape, dtype, path.stat().st_size - 8)    # runs past the end
        with pytest.raises(StoreCorruptError, match=r"r00000-00000000.h5: dataset grads/L0001 ends after 8 of"):
            shard.read("grads/L0001")


def test_a_shard_corrupted_after_open_fails_in_its_turn_with_readahead(tmp_path, inline_readahead):
    path = tmp_path / "s"
    store = write_store(path, random_records(range(6), seed=23), flush_every=2)
    victim = path / "shards" / "r00000-00000001.h5"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    for readahead in (True, False):
        seen = []
        with pytest.raises(StoreCorruptError, match="r00000-00000001.h5"):
            for block in store.iter_blocks(block_size=1, readahead=readahead):
                seen.append(int(block.steps[0]))
        assert seen == [0, 0, 0, 1, 1, 1]             # the first shard's rows, then the error


# ---------------------------------------------------------------------------------------------
# append, reopen, truncate


def test_reopen_continues_seq_numbering_and_skips_duplicates(tmp_path, caplog):
    path = tmp_path / "s"
    first = random_records(range(6), seed=2)
    write_store(path, first, flush_every=2)
    second = random_records(range(4, 9), seed=3)  # steps 4, 5 overlap: same keys, different values
    with GradientStore.create(path, META, StoreConfig(flush_every=2)) as w:
        for r in second:
            w.append(r)
        # a record repeating an id within itself, and a repeat of a buffered key
        rec = random_records([9], seed=4)[0]
        rec.ids[:] = [90, 91, 90]
        w.append(rec)
        w.append(random_records([9], seed=5)[0])
        w.flush()  # stats count what the writer thread has processed
        stats = w.stats
    assert stats["rows_skipped_duplicate"] == 6 + 1 + 2  # steps 4-5 on disk; id 90 twice; 90, 91 buffered
    assert "already stored" in caplog.text
    store = GradientStore.open(path)
    assert [s.seq for s in store.shards] == [0, 1, 2, 3, 4, 5]
    block = store.read_all()
    keys = list(zip(block.ids.tolist(), block.steps.tolist()))
    assert len(keys) == len(set(keys)) == 6 * 3 + 3 * 3 + 3
    want = {**expected_rows(second), **expected_rows(first)}  # the first write of a key wins
    for k, key in enumerate(keys):
        if key[1] < 9:
            assert torch.equal(block.grads[LAYERS[0]][k], want[key][2][LAYERS[0]])
    assert store.stats["rows_written"] == 30 and store.stats["records_appended"] == 13


def test_step_keys_agree_with_isin_across_merges():
    from olmo_tda.store.keys import StepKeys

    rng = np.random.default_rng(0)
    held = rng.choice(10_000, 300, replace=False)
    keys, truth = StepKeys(3, held, merge_at=50), set(held.tolist())
    for _ in range(200):
        ids = rng.integers(0, 10_000, 16)
        assert keys.contains(ids).tolist() == np.isin(ids, list(truth)).tolist()
        new = ids[rng.random(16) < 0.5]
        keys.add(new)
        truth.update(new.tolist())
        assert len(keys) == len(truth)
    assert 2 <= len(keys._runs) <= math.log2(len(truth) / 50) + 2       # merged into O(log n) runs
    assert not StepKeys(0).contains(np.array([1, 2])).any()


def test_one_large_step_spans_shards_by_flush_mb_and_duplicates_are_found_across_them(tmp_path):
    """A post-hoc capture at one step: windows close by size, not by step count; a key already in
    an earlier shard of the same step, in the window, or in a shard of an earlier writer is skipped."""
    path = tmp_path / "s"
    row_bytes = sum(4 * math.prod(layer["shape"]) for layer in worker.LAYERS)
    cfg = {"flush_every": 1000, "flush_mb": 6 * row_bytes / 2 ** 20}       # a window: 6 rows
    records = random_records([5] * 11, rows_per_step=3, seed=11)
    for i, r in enumerate(records):
        r.ids[:] = np.arange(3 * i, 3 * i + 3)
    with GradientStore.create(path, META, StoreConfig(**cfg)) as w:
        for r in records:
            w.append(r)                       # 5 shards of 6 rows; ids 30-32 in the window
        again = random_records([5], rows_per_step=3, seed=12)[0]
        again.ids[:] = [0, 31, 40]            # 0: five shards back; 31: in the window; 40: new
        w.append(again)
        w.flush()
        assert w.stats["rows_skipped_duplicate"] == 2
    store = GradientStore.open(path)
    assert len(store.shards) == 6 and all(s.step_min == s.step_max == 5 for s in store.shards)
    assert sorted(store.read_all().ids.tolist()) == [*range(33), 40]
    want = expected_rows(records)
    block = store.read_all()
    for k, key in enumerate(zip(block.ids.tolist(), block.steps.tolist())):
        if key[0] < 33:
            assert torch.equal(block.grads[LAYERS[1]][k], want[key][2][LAYERS[1]])
    with GradientStore.create(path, META, StoreConfig(**cfg)) as w:     # a second writer, same step
        w.append(records[4])
        w.append(again)
        w.flush()
        assert w.stats["rows_skipped_duplicate"] == 2 + 6            # counters carry over writers
        assert w.truncate_after(4) == 34                       # truncation drops the whole step
        w.append(records[4])                                   # ...so its keys are free again
        w.flush()
        assert w.stats["rows_skipped_duplicate"] == 8
    assert sorted(GradientStore.open(path).read_all().ids.tolist()) == [12, 13, 14]


def test_the_key_index_finds_each_steps_ids_and_forgets_shards_cut_since(tmp_path, monkeypatch):
    """What a writer's duplicate check sees at a step, against the rows read back: every rank's
    shards whose step range covers it, shards added after the first lookup included. A shard another
    rank's writer removed after this writer read its index (both resuming) holds nothing, and is not
    opened again at every later step of the replay."""
    from olmo_tda.store import keys as keys_module

    path = tmp_path / "s"
    for rank, every in ((0, 3), (1, 2)):
        recs = random_records(range(12), seed=20 + rank)
        for r in recs:
            r.ids += 1000 * rank
        with GradientStore.create(path, META, StoreConfig(flush_every=every), rank=rank) as w:
            for r in recs:
                w.append(r)
    store = GradientStore.open(path)
    block = store.read_all()
    truth = lambda step: sorted(block.ids[block.steps == step].tolist())   # noqa: E731
    index = keys_module.KeyIndex(path, store.shards[:-1], cache_shards=2)
    assert index.ids_at(13).tolist() == []
    assert index.ids_at(11).tolist() == [i for i in truth(11) if i < 1000]   # rank 1's last shard not in it
    last = store.shards[-1]                                # as a writer adds the shard it flushed
    index.add(last, {step: np.array([i for i in truth(step) if i >= 1000]) for step in (last.step_min, last.step_max)})
    for step in range(12):
        assert index.ids_at(step).tolist() == truth(step)
    cut = [s for s in store.shards[:-1] if s.rank == 1 and s.step_min >= 4]
    for info in cut:
        (path / info.file).unlink()                        # rank 1's resume cut them after the index was read
    looked, exists, h5_open = [], os.path.exists, keys_module.open_h5     # a stat or an open of a file
    monkeypatch.setattr(os.path, "exists", lambda p: looked.append(os.fspath(p)) or exists(p))
    monkeypatch.setattr(keys_module, "open_h5", lambda p: looked.append(os.fspath(p)) or h5_open(p))
    for _ in range(2):
        for step in range(4, 10):
            assert index.ids_at(step).tolist() == [i for i in truth(step) if i < 1000]
    assert sum(info.file in p for info in cut for p in looked) == len(cut)    # each looked for once


def test_a_step_revisited_inside_one_window_still_finds_its_buffered_keys(tmp_path):
    """Steps 5, 6, 5 in one window: returning to step 5 rebuilds its keys from the window."""
    records = random_records([5, 6, 5], rows_per_step=3, seed=13)
    records[2].ids[:] = [records[0].ids[1], 500, 501]
    store = write_store(tmp_path / "s", records, flush_every=1000)
    assert store.stats["rows_skipped_duplicate"] == 1 and store.num_rows == 8 and len(store.shards) == 1
    keys = list(zip(*[a.tolist() for a in (store.read_all().ids, store.read_all().steps)]))
    assert len(keys) == len(set(keys))


def test_truncate_after_drops_later_steps_then_appending_resumes(tmp_path):
    path = tmp_path / "s"
    records = random_records(range(10), seed=6)
    with GradientStore.create(path, META, StoreConfig(flush_every=3)) as w:
        for r in records:
            w.append(r)  # shards: steps 0-2, 3-5, 6-8; step 9 buffered
        assert w.truncate_after(4) == 5 * 3
        assert w.stats["rows_truncated"] == 15
        assert w.truncate_after(4) == 0  # idempotent
    store = GradientStore.open(path)
    assert store.steps.tolist() == [0, 1, 2, 3, 4]
    assert [(s.seq, s.step_min, s.step_max) for s in store.shards] == [(0, 0, 2), (1, 3, 4)]
    assert not (path / "shards" / "r00000-00000002.h5").exists() and tmp_files(path) == []
    want = expected_rows(records)
    block = store.read_all()
    for k, key in enumerate(zip(block.ids.tolist(), block.steps.tolist())):
        assert torch.equal(block.grads[LAYERS[1]][k], want[key][2][LAYERS[1]])
    # resume: steps 5.. are appended again without being mistaken for duplicates
    again = random_records(range(5, 8), seed=7)
    with GradientStore.create(path, META, StoreConfig(flush_every=3)) as w:
        for r in again:
            w.append(r)
        assert w.stats["rows_skipped_duplicate"] == 0
    store = GradientStore.open(path)
    assert store.steps.tolist() == list(range(8)) and store.num_rows == 24
    assert store.shards[-1].seq == 5  # seq numbers are never reused: 3 and 4 are the two cuts


def test_a_checkpoint_of_an_abandoned_run_is_refused_after_the_rollback_run_passes_its_step(tmp_path):
    """Checkpoint A at step 8; a resume from step 4 abandons it; the rollback run writes steps 5-9 and
    crashes before any checkpoint. A (what ``try_load_latest_save`` or DeepSpeed's ``latest`` would
    pick) has its step's rows again, but of the new run: resuming it would keep that run's rows
    before step 8 under A's model, so it is refused, naming the step the store was cut to. The
    checkpoints of the run the store continues resume as before, and the log survives a reopen."""
    from olmo_tda.config import ConfigError
    from olmo_tda.integrations.capture_store import check_rows_continue, resume_state

    path = tmp_path / "s"
    with GradientStore.create(path, META, StoreConfig(flush_every=3)) as w:
        for r in random_records(range(1, 5), seed=1):
            w.append(r)
        w.flush()
        old4 = {"store_id": w.store_id, **resume_state(w)}       # the checkpoints of steps 4 and 8 (A),
        for r in random_records(range(5, 9), seed=3):           # both saved before the rollback
            w.append(r)
        w.flush()
        old8 = {"store_id": w.store_id, **resume_state(w)}
        check_rows_continue(w, old8, 8)
        w.truncate_after(4)                      # the resume from step 4
    with GradientStore.create(path, META, StoreConfig(flush_every=3)) as w:
        assert w.timeline()[1] == 1              # the log is in the manifest
        older = {k: v for k, v in old8.items() if k != "timeline"}  # a checkpoint from before the log: reach
        with pytest.raises(ConfigError, match="it now holds them only up to step 4"):
            check_rows_continue(w, older, 8)
        for r in random_records(range(5, 10), seed=2):
            w.append(r)
        w.flush()
        assert w.reached(8) == 8                 # rows up to A's step again: reach alone cannot tell
        with pytest.raises(ConfigError, match="checkpoint of step 8 belongs to an abandoned run: a later resume "
                                              "cut the store back to step 4"):
            check_rows_continue(w, old8, 8)
        check_rows_continue(w, old4, 4)          # the rollback's own checkpoint: on the run the store continues
        new9 = {"store_id": w.store_id, **resume_state(w)}
        check_rows_continue(w, new9, 9)
        check_rows_continue(w, {**old8, "store_id": "another"}, 8)      # another store's: check_resume's case
        w.truncate_after(9)                      # an ordinary crash-resume from step 9
    with GradientStore.create(path, META, StoreConfig(flush_every=3)) as w:
        check_rows_continue(w, new9, 9)
        assert w.rolled_back_below(0, 8) == 4 and w.rolled_back_below(1, 8) is None
        assert w.rolled_back_below(5, 8) is None         # a log shorter than the checkpoint's: cannot tell
    data = json.loads((path / "manifest-r00000.json").read_text())
    assert data["truncations"] == [4, 9] and data["log_id"] == new9["timeline_id"] == old8["timeline_id"]
    # a manifest rebuilt from the shards (repair) starts a new, empty log: every cut in it came after
    # any checkpoint saved before, so a rollback below one is still seen once the new log has grown
    (path / "manifest-r00000.json").write_text("{damaged")
    with pytest.warns(RuntimeWarning, match="rebuilding unreadable manifest"):
        GradientStore.open(path, repair=True)
    with GradientStore.create(path, META, StoreConfig(flush_every=3)) as w:
        assert w.timeline()[1] == 2 and w.timeline()[0] != new9["timeline_id"]     # rebuilt from the cut markers
        w.truncate_after(6)
        for r in random_records(range(7, 11), seed=4):
            w.append(r)
        w.flush()
        assert w.timeline()[1] == 3
        old_style = {k: v for k, v in new9.items() if k != "cut_seq"}       # a checkpoint from before cut markers
        with pytest.raises(ConfigError, match="cut the store back to step 4"):     # another log: every cut checked
            check_rows_continue(w, old_style, 9)
        with pytest.raises(ConfigError, match="checkpoint of step 9 belongs to an abandoned run: a later resume "
                                              "cut the store back to step 6"):
            check_rows_continue(w, new9, 9)
    data = json.loads((path / "manifest-r00000.json").read_text())
    data["truncations"] = [4, "nine"]
    (path / "manifest-r00000.json").write_text(json.dumps(data))
    with pytest.raises(StoreCorruptError, match="truncations must be a list of ints"):
        GradientStore.open(path)
    data["truncations"] = [4]
    del data["log_id"]                           # a manifest from before log ids: one fixed id, on every open,
    (path / "manifest-r00000.json").write_text(json.dumps(data))        # whether or not a write kept it
    with GradientStore.create(path, META, StoreConfig()) as w:
        saved = {"store_id": w.store_id, **resume_state(w)}              # saved before anything is written
    with GradientStore.create(path, META, StoreConfig()) as w:
        check_rows_continue(w, saved, 8)         # the cut to step 4 came before this checkpoint: accepted
    del data["truncations"]                      # a manifest from before the log: read, with an empty log
    (path / "manifest-r00000.json").write_text(json.dumps(data))
    with GradientStore.create(path, META, StoreConfig()) as w:
        assert w.timeline()[1] == 0 and w.rolled_back_below(0, 8) is None


@pytest.mark.parametrize("change,stored_text,requested_text", [
    ({"projector_hash": "other-hash"}, '"kill-test"', '"other-hash"'),
    ({"capture": {"proj_dim": [6, 12], "seed": 0}}, "[6, 10]", "[6, 12]"),
    ({"layers": [worker.LAYERS[0], {**worker.LAYERS[1], "shape": [4, 8]}]}, "[4, 4]", "[4, 8]"),
    ({"dtype": "float16"}, '"float32"', '"float16"'),
])
def test_mismatched_append_is_refused_showing_both_sides(tmp_path, change, stored_text, requested_text):
    path = tmp_path / "s"
    write_store(path, random_records(range(1)))
    meta = {**META, **{k: v for k, v in change.items() if k != "dtype"}}
    config = StoreConfig(dtype=change.get("dtype", "float32"))
    with pytest.raises(StoreMismatchError) as info:
        GradientStore.create(path, meta, config)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert stored_text in message and requested_text in message and str(path) in message
    assert f"stored:    {stored_text}" in message and f"requested: {requested_text}" in message
    GradientStore.create(path, META, StoreConfig()).close()  # the original settings still work


def test_a_store_from_before_loss_scale_counted_the_ranks_is_read_not_appended_to(tmp_path):
    """Rows of a store written when ``loss_scale`` left out the data-parallel ranks (convention
    "sum_token_loss") would be weighted world-size times differently by in-run TracIn than new rows:
    appending is refused naming both conventions; reading still works."""
    path = tmp_path / "s"
    records = random_records(range(2))
    write_store(path, records)
    meta = json.loads((path / "store.json").read_text())
    (path / "store.json").write_text(json.dumps({**meta, "gradient_convention": "sum_token_loss"}))
    assert GradientStore.open(path).num_rows == 6
    with pytest.raises(StoreMismatchError) as info:
        GradientStore.create(path, META, StoreConfig())
    assert 'stored:    "sum_token_loss"' in str(info.value)
    assert 'requested: "sum_token_loss;loss_scale=update_share"' in str(info.value)


def test_a_writer_waits_out_another_ranks_brief_scan_of_its_lock(tmp_path):
    """Ranks start together: rank 1's startup scan briefly takes rank 0's lock (looking for a dead
    writer's debris) exactly when rank 0 acquires it. Rank 0 must wait, not fail."""
    path = tmp_path / "s"
    GradientStore.create(path, META, StoreConfig()).close()
    held = RankLock.try_acquire(path, 0)
    assert held is not None and held.held
    threading.Timer(0.3, held.release).start()
    t0 = time.monotonic()
    GradientStore.create(path, META, StoreConfig()).close()
    assert time.monotonic() - t0 >= 0.25


@pytest.mark.parametrize("opener", ["writer", "reader"])
def test_another_ranks_open_never_holds_a_ranks_lock_through_its_scan(tmp_path, monkeypatch, opener):
    """All ranks of a resumed run open at once, and a scan of a long run's rank takes long (its
    manifest, segments, a stat a shard; seconds on a parallel filesystem): rank 0's writer must not
    wait that out, let alone be refused after LOCK_WAIT_S, while rank 1's writer (or a reader) is
    in the middle of reading rank 0."""
    path = tmp_path / "s"
    write_store(path, random_records(range(4)), flush_every=1)
    rec = random_records([0], seed=3)[0]
    rec.ids += 1000
    with GradientStore.create(path, META, StoreConfig(), rank=1) as w:
        w.append(rec)
    monkeypatch.setattr(locks_module, "LOCK_WAIT_S", 0.3)
    reading, release = threading.Event(), threading.Event()
    read_manifest = manifest_module.read_manifest

    def slow_read(root, rank):            # rank 1's open pauses while it reads rank 0
        if rank == 0 and threading.current_thread().name == "other":
            reading.set()
            release.wait(10)
        return read_manifest(root, rank)

    monkeypatch.setattr(manifest_module, "read_manifest", slow_read)
    opened: list = []
    other = threading.Thread(name="other", target=lambda: opened.append(
        GradientStore.create(path, META, StoreConfig(), rank=1) if opener == "writer" else GradientStore.open(path)))
    other.start()
    try:
        assert reading.wait(10)
        GradientStore.create(path, META, StoreConfig()).close()    # rank 0's writer, meanwhile
    finally:
        release.set()
        other.join(10)
    if opener == "writer":
        opened[0].close()
    else:
        assert opened[0].num_rows == 15


@pytest.mark.parametrize("at", ["before", "cut"])
def test_a_departed_ranks_rows_after_the_step_are_cut_whatever_its_crash_in_truncate_after_left(tmp_path, zygote,
                                                                                                 at):
    """A rank that is not in the resumed run never reopens to finish its own cut. Killed inside
    truncate_after before its cut marker was durable, its rows stay, and the resume's
    truncate_departed cuts them; killed after, they are void already for every reader and writer,
    so nothing is left to cut (found in review when cuts rewrote shards)."""
    path = tmp_path / "s"
    for rank in (0, 2):
        with GradientStore.create(path, META, StoreConfig(flush_every=10), rank=rank) as w:
            for step in range(10):
                w.append(worker.make_record(step, ids=[1000 * rank + step]))
    pid = zygote.start("truncate_crash", path=str(path), step=5, rank=2, at=at)      # keeps 0-5 of its one shard
    status = zygote.wait_exit(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    left = 4 if at == "before" else 0
    block = GradientStore.open(path).read_all()
    assert int(((block.ids >= 2000) & (block.steps > 5)).sum()) == left
    with GradientStore.create(path, META, StoreConfig(), rank=0) as w0:
        assert w0.departed_after(5, 2) == ([2] if left else [])
        assert w0.truncate_departed(5, 2) == left
    block = GradientStore.open(path).read_all()
    assert sorted(block.ids[block.ids >= 2000].tolist()) == [2000 + s for s in range(6)]


def test_a_writer_stats_another_ranks_shards_only_when_its_manifest_may_lag_its_files(tmp_path, monkeypatch):
    """A resume of R ranks made every rank stat every rank's shards (R x all of them at once, on a
    parallel filesystem's metadata server). A writer now takes another rank's entries as they are
    unless that rank's manifest says a truncation was rewriting its shards, or predates the flag.
    A reader still checks every shard (it reads their rows)."""
    path = tmp_path / "s"
    for rank in (0, 1):
        recs = random_records(range(6), seed=30 + rank)
        for r in recs:
            r.ids += 1000 * rank
        with GradientStore.create(path, META, StoreConfig(flush_every=2), rank=rank) as w:
            for r in recs:
                w.append(r)
            assert w.truncate_after(4) == 3                   # cut through the shard of steps 4-5: 4 kept
    manifest = path / "manifest-r00001.json"
    assert json.loads(manifest.read_text())["truncating"] is False
    stat, stats = os.stat, []
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: stats.append(os.fspath(p)) or stat(p, *a, **k))

    def rank1_stats(open_it):
        stats.clear()
        open_it()
        return sum("shards/r00001-" in p for p in stats)

    assert rank1_stats(lambda: GradientStore.create(path, META, StoreConfig(), rank=0).close()) == 0
    assert rank1_stats(lambda: GradientStore.open(path)) == 3
    for flag in (True, None):                                   # None: a manifest from before the flag
        data = json.loads(manifest.read_text())
        if flag is None:
            del data["truncating"]
        else:
            data["truncating"] = flag
        manifest.write_text(json.dumps(data))
        assert rank1_stats(lambda: GradientStore.create(path, META, StoreConfig(), rank=0).close()) == 3
    data["truncating"] = "yes"
    manifest.write_text(json.dumps(data))
    with pytest.raises(StoreCorruptError, match="manifest-r00001.json is damaged: truncating must be true or false"):
        GradientStore.open(path)


def test_a_damaged_shard_of_another_rank_is_named_when_a_replayed_step_needs_its_keys(tmp_path):
    """A writer no longer stats other ranks' shards at open, so one damaged since (cut short on disk)
    is found when a replayed step looks its keys up: the error names the shard and the repair."""
    path = tmp_path / "s"
    with GradientStore.create(path, META, StoreConfig(flush_every=2), rank=1) as w:
        for r in random_records(range(4), seed=40):
            r.ids += 1000
            w.append(r)
    shard = path / "shards/r00001-00000001.h5"                 # steps 2-3
    shard.write_bytes(shard.read_bytes()[:200])
    with GradientStore.create(path, META, StoreConfig(flush_every=1)) as w:     # rank 0 opens regardless
        w.append(random_records([0], seed=41)[0])                                # step 0: rank 1's sound shard
        w.flush()
        w.append(random_records([2], seed=42)[0])
        with pytest.raises(StoreWriteError) as info:
            w.flush()
    message = str(info.value)
    assert str(shard) in message and "cannot be read for the duplicate check of step(s) 2..3" in message
    assert "repair=True" in message


def test_voided_shards_go_only_after_the_manifest_that_drops_them_and_a_gone_one_is_not_missing(
        tmp_path, zygote, monkeypatch):
    """Killed right after its cut marker, a rank's manifest still lists the shards the cut voided. Its
    next writer drops them and removes their files only once its manifest no longer names them: an
    open that failed in between leaves the files, and a listed shard whose file is gone is no error
    when a cut voids it whole. A shard whose file changed size is re-read with its cut applied."""
    path = tmp_path / "s"
    pid = zygote.start("append_loop", path=str(path), start_step=0, flush_every=2, max_steps=10)
    zygote.read(lambda m: m.get("pid") == pid and m.get("event") == "closed")
    assert zygote.wait_exit(pid) == 0
    pid = zygote.start("truncate_crash", path=str(path), step=4, at="cut")    # voids shards 3, 4 (steps 6-9)
    assert os.WIFSIGNALED(zygote.wait_exit(pid))
    shard = lambda seq: path / "shards" / f"r00000-{seq:08d}.h5"              # noqa: E731
    monkeypatch.setattr(manifest_module, "write_manifest", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(StoreError, match="cannot rewrite .*manifest-r00000.json"):
        GradientStore.create(path, META, StoreConfig())
    monkeypatch.undo()
    assert shard(3).exists() and shard(4).exists()                            # still named by the manifest
    shard(3).unlink()                                                          # gone, but void: no error
    assert check_worker_rows(GradientStore.open(path)) == set(range(5))
    with open(shard(2), "ab") as f:                                           # steps 4-5, cut through
        f.write(b"\0" * 64)
    assert check_worker_rows(GradientStore.open(path)) == set(range(5))       # re-read, its cut kept
    GradientStore.create(path, META, StoreConfig()).close()
    assert not shard(4).exists() and check_worker_rows(GradientStore.open(path)) == set(range(5))


def test_a_damaged_cut_marker_or_cuts_entry_is_refused_by_name_never_ignored(tmp_path):
    """A cut marker voids an abandoned run's rows: one that cannot be read must not be skipped (its
    rows would come back), so every open refuses it, naming the file; a manifest's ``cuts`` that is
    not what a writer writes is named too."""
    path = tmp_path / "s"
    with GradientStore.create(path, META, StoreConfig(flush_every=10)) as w:
        for step in range(10):
            w.append(worker.make_record(step))
        w.flush()
        assert w.truncate_after(5) == 4 * worker.ROWS_PER_STEP
    marker = path / "shards" / "r00000-00000001.cut.json"
    assert json.loads(marker.read_text())["step"] == 5
    assert check_worker_rows(GradientStore.open(path)) == set(range(6))
    manifest = path / "manifest-r00000.json"
    data = json.loads(manifest.read_text())
    assert data["format_version"] == 3 and data["cuts"] == {"1": 5}        # refused by readers of version 2
    assert data["recent_shards"][0]["cut"] == 5 and data["recent_shards"][0]["stored_rows"] == 10 * worker.ROWS_PER_STEP
    del data["cuts"]                                   # the manifest lost the cut: the marker still holds
    manifest.write_text(json.dumps(data))
    assert check_worker_rows(GradientStore.open(path)) == set(range(6))
    marker.write_text('{"format": "olmo_tda.store.cut", "rank": 0, "seq": 1, "step": "five"}')
    for opening in (lambda: GradientStore.open(path), lambda: GradientStore.create(path, META, StoreConfig())):
        with pytest.raises(StoreCorruptError, match=r"cut marker .*r00000-00000001.cut.json is damaged"):
            opening()
    data["cuts"] = {"1": "five"}
    manifest.write_text(json.dumps(data))
    with pytest.raises(StoreCorruptError, match="manifest-r00000.json is damaged: cuts must map seqs to steps"):
        GradientStore.open(path)


def test_the_manifests_are_a_cache_without_them_a_store_reads_and_resumes_the_same(tmp_path):
    """The listing is the truth: shards, written once and self-describing, and cut markers. With every
    manifest and sealed block gone, the store opens with the same rows and the cut in force, a writer
    goes on from it, and a checkpoint's rollback check still sees the cut made after it."""
    from olmo_tda.config import ConfigError
    from olmo_tda.integrations.capture_store import check_rows_continue, resume_state

    path = tmp_path / "s"
    with GradientStore.create(path, META, StoreConfig(flush_every=3)) as w:
        for step in range(12):
            w.append(worker.make_record(step))
        w.flush()
        saved = {"store_id": w.store_id, **resume_state(w)}      # a checkpoint at step 11
        w.truncate_after(6)                                      # a resume from an earlier one
        for step in range(7, 9):
            w.append(worker.make_record(step))
    before = GradientStore.open(path)
    want = before.read_all()
    for manifest in path.glob("manifest-*.json"):
        manifest.unlink()
    shutil.rmtree(path / "index", ignore_errors=True)
    after = GradientStore.open(path)
    assert [(s.seq, s.num_rows, s.step_max, s.cut) for s in after.shards] == \
        [(s.seq, s.num_rows, s.step_max, s.cut) for s in before.shards]
    got = after.read_all()
    assert got.ids.tolist() == want.ids.tolist() and got.steps.tolist() == want.steps.tolist()
    assert all(torch.equal(got.grads[name], want.grads[name]) for name in want.grads)
    assert check_worker_rows(after) == set(range(9))
    with GradientStore.create(path, META, StoreConfig(flush_every=3)) as w:
        assert w.timeline()[1] == 1                              # the cut, from its marker
        with pytest.raises(ConfigError, match="checkpoint of step 11 belongs to an abandoned run: a later resume "
                                              "cut the store back to step 6"):
            check_rows_continue(w, saved, 11)
        for step in range(7, 12):                                # 7-8 again (a replay), then new steps
            w.append(worker.make_record(step))
        w.flush()
        assert w.stats["rows_skipped_duplicate"] == 2 * worker.ROWS_PER_STEP
    assert check_worker_rows(GradientStore.open(path)) == set(range(12))


def test_a_truncating_flag_an_older_olmo_tda_left_is_cleared_by_the_ranks_own_reopen(tmp_path):
    """An olmo_tda that rewrote shards on a cut set ``truncating`` while it did, and a crash left it
    set; the rank's own open reconciles every shard and clears it (else every other rank's writer
    would stat its shards at every open for good)."""
    path = tmp_path / "s"
    with GradientStore.create(path, META, StoreConfig(flush_every=10)) as w:
        for step in range(10):
            w.append(worker.make_record(step))
    manifest = path / "manifest-r00000.json"
    data = json.loads(manifest.read_text())
    data["truncating"] = True
    manifest.write_text(json.dumps(data))
    GradientStore.create(path, META, StoreConfig()).close()
    assert json.loads(manifest.read_text())["truncating"] is False
    assert check_worker_rows(GradientStore.open(path)) == set(range(10))


def test_a_flush_renamed_before_its_failure_is_cut_by_a_truncation_before_its_retry(tmp_path, monkeypatch):
    """The shard of a flush that failed after its rename (the folder's fsync) sits at the next seq,
    unindexed, its rows still in the window; a truncate_after before the retry must not leave the
    file's later rows for the next open to adopt (found in review)."""
    from olmo_tda.store import format as format_module

    path = tmp_path / "s"
    w = GradientStore.create(path, META, StoreConfig(flush_every=100))
    for step in range(4):
        w.append(worker.make_record(step))
    w.flush()
    for step in range(4, 8):
        w.append(worker.make_record(step))
    real = format_module.fsync_dir

    def fail_on_shards(p):
        if Path(p).name == "shards":
            raise OSError(errno.EIO, "Input/output error")
        real(p)

    monkeypatch.setattr(format_module, "fsync_dir", fail_on_shards)
    with pytest.raises(StoreWriteError):
        w.flush()
    monkeypatch.undo()
    assert (path / "shards/r00000-00000001.h5").exists()
    assert w.truncate_after(3) == 4 * worker.ROWS_PER_STEP
    w.close()
    assert check_worker_rows(GradientStore.open(path)) == set(range(4))


def test_second_writer_of_the_same_rank_is_refused_and_ranks_are_independent(tmp_path, monkeypatch):
    monkeypatch.setattr(locks_module, "LOCK_WAIT_S", 0.2)
    path = tmp_path / "s"
    w0 = GradientStore.create(path, META, StoreConfig(flush_every=1))
    with pytest.raises(StoreError, match="already being written"):
        GradientStore.create(path, META, StoreConfig())
    w1 = GradientStore.create(path, META, StoreConfig(flush_every=1), rank=1)
    w0.append(random_records([0], seed=1)[0])
    rec = random_records([0], seed=2)[0]
    rec.ids += 1000
    w1.append(rec)
    w0.close()
    w1.close()
    store = GradientStore.open(path)
    assert sorted(s.file for s in store.shards) == ["shards/r00000-00000000.h5", "shards/r00001-00000000.h5"]
    assert store.num_rows == 6 and store.summary()["ranks"] == [0, 1]


# ---------------------------------------------------------------------------------------------
# non-finite rows


@pytest.mark.parametrize("dtype,torch_dtype", [("float32", torch.float32), ("float16", torch.float16),
                                               ("bfloat16", torch.bfloat16)])
def test_nonfinite_rows_are_skipped_counted_and_warned(tmp_path, dtype, torch_dtype):
    path = tmp_path / "s"
    records = random_records(range(2), rows_per_step=4, seed=8)
    records[0].grads[LAYERS[0]][1, 2, 3] = float("nan")
    records[1].grads[LAYERS[1]][3, 0, 0] = float("-inf")
    with GradientStore.create(path, META, StoreConfig(flush_every=10, dtype=dtype)) as w:
        for r in records:
            w.append(r)
        with pytest.warns(NonFiniteGradientWarning, match=r"skipped 2 rows .*ids \[1, 13\]"):
            w.flush()
        assert w.stats["rows_skipped_nonfinite"] == 2
    store = GradientStore.open(path)
    assert store.stats["rows_skipped_nonfinite"] == 2
    block = store.read_all()
    assert sorted(zip(block.ids.tolist(), block.steps.tolist())) == [(0, 0), (2, 0), (3, 0), (10, 1), (11, 1), (12, 1)]
    want = expected_rows(records)
    for k, key in enumerate(zip(block.ids.tolist(), block.steps.tolist())):
        for name in LAYERS:
            assert torch.equal(block.grads[name][k], want[key][2][name].to(torch_dtype).float())


def test_float16_overflow_counts_as_nonfinite_with_a_hint(tmp_path):
    rec = random_records([0], rows_per_step=3, seed=9)[0]
    rec.grads[LAYERS[0]][2] *= 1e5  # finite in float32, inf in float16
    with GradientStore.create(tmp_path / "s", META, StoreConfig(dtype="float16")) as w:
        w.append(rec)
        with pytest.warns(NonFiniteGradientWarning, match="bfloat16"):
            w.flush()
    assert GradientStore.open(tmp_path / "s").read_all().ids.tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------
# creation and write errors


def test_unwritable_location_raises_store_error_naming_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for path in (blocker / "store", blocker):
        with pytest.raises(StoreError, match="cannot create a gradient store at") as info:
            GradientStore.create(path, META, StoreConfig())
        assert str(path) in str(info.value) and "store.path" in str(info.value)
    with pytest.raises(StoreError, match="not a gradient store"):
        GradientStore.open(tmp_path)


def test_write_failure_surfaces_in_caller_and_the_window_is_retried(tmp_path, monkeypatch):
    path = tmp_path / "s"
    # 50 rows a record: the held window grows new segments while it waits for the disk
    records = random_records(range(5), rows_per_step=50, seed=10)
    real = writer_module.write_shard
    failures = {"left": 1}

    def flaky_write_shard(*args, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    w = GradientStore.create(path, META, StoreConfig(flush_every=2))
    w.append(records[0])
    w.append(records[1])
    w.flush()
    monkeypatch.setattr(writer_module, "write_shard", flaky_write_shard)
    w.append(records[2])
    w.append(records[3])  # the writer thread now fails to write steps 2-3
    deadline = time.monotonic() + 10
    while w._error is None and time.monotonic() < deadline:  # the thread records its failure
        time.sleep(0.01)
    capacity = w._window.capacity                   # what the first window (2 records) needed
    with pytest.raises(StoreWriteError, match="disk is full") as info:
        w.append(records[4])
    assert str(path) in str(info.value) and "retries" in str(info.value)
    w.flush()  # the held window (3 steps by now) is durable after this: written by the thread or here
    assert capacity == 128 and w._window.capacity == 256        # it grew a segment for its 3rd record, kept
    w.close()
    assert w._window.capacity == 0                              # a closed writer holds no buffers
    assert w._window.segments == [] and w.stats["buffered_rows"] == 0       # a closed writer holds no rows
    store = GradientStore.open(path)
    # the append that reported the error still queued its own record: nothing is dropped, bit for bit
    block, want = store.read_all(), expected_rows(records)
    assert sorted(set(block.steps.tolist())) == [0, 1, 2, 3, 4] and tmp_files(path) == []
    rows = rows_of(block)
    assert set(rows) == set(want)
    for key, (lr, scale, grads) in want.items():
        assert block.lr[rows[key]] == lr and block.loss_scale[rows[key]] == scale
        for name, g in grads.items():
            assert torch.equal(block.grads[name][rows[key]], g), (key, name)


def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True)
    return done.returncode == 0


def test_disk_full_on_a_real_tiny_filesystem(tmp_path):
    """ENOSPC from a 256 KiB tmpfs; needs mount rights (root). The rlimit test below always runs."""
    mnt = tmp_path / "mnt"
    if not _mount_tmpfs(mnt, "size=256k"):
        pytest.skip("cannot mount a tmpfs here (not root); test_disk_full_rlimit_in_subprocess covers EFBIG")
    try:
        path = mnt / "s"
        w = GradientStore.create(path, META, StoreConfig(flush_every=1000))
        w.append(worker.make_record(0))
        first = w.flush()
        w.append(worker.make_record(1, rows=1200))  # ~360 KB: more than the filesystem holds
        with pytest.raises(StoreWriteError, match="the disk is full") as info:
            w.flush()
        assert str(path) in str(info.value)
        assert tmp_files(path) == []
        assert [s.file for s in GradientStore.open(path).shards] == [first.file]
        subprocess.run(["mount", "-o", "remount,size=2m", str(mnt)], check=True)
        assert w.flush().num_rows == 1200  # the window stayed buffered; retry succeeds
        w.close()
        assert GradientStore.open(path).num_rows == 4 + 1200
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(StoreError, match="not writable"):
            GradientStore.create(mnt / "other", META, StoreConfig())
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ---------------------------------------------------------------------------------------------
# corruption and recovery


def test_truncated_shard_raises_corrupt_error_and_repair_quarantines_it(tmp_path):
    path = tmp_path / "s"
    write_store(path, random_records(range(6), seed=12), flush_every=2)
    victim = path / "shards" / "r00000-00000001.h5"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(StoreCorruptError, match="r00000-00000001.h5") as info:
        GradientStore.open(path)
    assert "repair=True" in str(info.value)
    with pytest.raises(StoreCorruptError, match="r00000-00000001.h5"):
        GradientStore.create(path, META, StoreConfig())  # a writer refuses too
    with pytest.warns(RuntimeWarning, match="quarantine"):
        store = GradientStore.open(path, repair=True)
    assert store.steps.tolist() == [0, 1, 4, 5]
    assert (path / "quarantine" / "r00000-00000001.h5").exists() and not victim.exists()
    assert GradientStore.open(path).steps.tolist() == [0, 1, 4, 5]  # the manifest was updated
    with GradientStore.create(path, META, StoreConfig(flush_every=2)) as w:
        for r in random_records([2, 3], seed=13):
            w.append(r)
    assert GradientStore.open(path).steps.tolist() == list(range(6))


def test_missing_listed_shard_is_an_error_unless_repairing(tmp_path):
    path = tmp_path / "s"
    write_store(path, random_records(range(4), seed=14), flush_every=2)
    (path / "shards" / "r00000-00000000.h5").unlink()
    with pytest.raises(StoreCorruptError, match="r00000-00000000.h5.*missing"):
        GradientStore.open(path)
    with pytest.warns(RuntimeWarning, match="dropping missing shard"):
        assert GradientStore.open(path, repair=True).steps.tolist() == [2, 3]
    assert GradientStore.open(path).num_rows == 6


def test_reader_leaves_a_live_writers_tmp_files_alone(tmp_path):
    path = tmp_path / "s"
    w = GradientStore.create(path, META, StoreConfig(flush_every=1))
    w.append(random_records([0])[0])
    w.flush()
    fake = path / "shards" / "r00000-00000007.h5.tmp"  # as if the writer were mid-write
    fake.write_bytes(b"partial")
    store = GradientStore.open(path)  # while the writer is open: sees the durable shard
    assert store.num_rows == 3 and fake.exists()
    w.append(random_records([1])[0])
    w.flush()
    assert store.num_rows == 3
    store.refresh()
    assert store.num_rows == 6
    w.close()
    GradientStore.open(path)
    assert not fake.exists()  # the writer is gone: its temp files are debris


def test_back_pressure_blocks_append_instead_of_queueing_unboundedly(tmp_path, monkeypatch):
    real_ingest = StoreWriter._ingest
    outstanding = {"now": 0, "max": 0}
    lock = threading.Lock()

    def slow_ingest(self, record):
        time.sleep(0.1)
        with lock:
            outstanding["now"] -= 1
        real_ingest(self, record)

    monkeypatch.setattr(StoreWriter, "_ingest", slow_ingest)
    records = random_records(range(8))
    w = GradientStore.create(tmp_path / "s", META, StoreConfig(flush_every=100, queue_size=1))
    start = time.monotonic()
    for r in records:
        with lock:
            outstanding["now"] += 1
            outstanding["max"] = max(outstanding["max"], outstanding["now"])
        w.append(r)
        assert w._queue.qsize() <= 1
    elapsed = time.monotonic() - start
    w.close()
    # one record in the queue + one being ingested (+1 counted before its append blocks)
    assert outstanding["max"] <= 3
    assert elapsed >= 0.1 * (len(records) - 2) * 0.9  # append waited for the writer
    assert GradientStore.open(tmp_path / "s").num_rows == 24


# ---------------------------------------------------------------------------------------------
# crashes: real SIGKILLs of writer processes


class Zygote:
    """Client of tests/_store_kill_worker.py: forks pre-imported writer processes on request."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                            os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, str(Path(worker.__file__))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self._buf = b""
        self.read(lambda m: m.get("event") == "zygote-ready", timeout=60)

    def read(self, match, timeout=20.0):
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                message = json.loads(line)
                if message.get("event") == "error":
                    raise AssertionError(f"worker failed: {message['error']}")
                if match(message):
                    return message
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no answer from the store worker")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError("store worker exited")
            self._buf += chunk

    def start(self, task, **args) -> int:
        self.proc.stdin.write((json.dumps({"task": task, **args}) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(lambda m: "pid" in m and "exit" not in m and "event" not in m)["pid"]

    def wait_exit(self, pid, timeout=20.0) -> int:
        return self.read(lambda m: m.get("pid") == pid and "exit" in m, timeout)["exit"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def sigkill_append_loop(zygote, path, rng, next_step, trial, **task):
    """One random-SIGKILL trial: an append loop resumed a little before ``next_step`` (as a restarted
    run would: overlap is skipped), killed at a random moment; the store must hold whole steps, bit-exact,
    no debris. Returns the durable steps."""
    pid = zygote.start("append_loop", path=str(path), start_step=max(0, next_step - 3), step_sleep=0.002, **task)
    zygote.read(lambda m: m.get("pid") == pid and m.get("event") == "ready")
    time.sleep(rng.uniform(0.0, 0.25))
    os.kill(pid, signal.SIGKILL)
    status = zygote.wait_exit(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    store = GradientStore.open(path)
    assert tmp_files(path) == [], f"trial {trial}"
    steps = check_worker_rows(store)
    # windows are durable in order, so the durable steps are a prefix 0..max without gaps
    assert steps == set(range(len(steps))), f"trial {trial}: gaps in {sorted(steps)}"
    return steps


def test_sigkill_at_random_moments_never_leaves_partial_or_duplicate_rows(tmp_path, zygote):
    path = tmp_path / "s"
    GradientStore.create(path, META, StoreConfig()).close()
    rng = random.Random(1234)
    next_step = 0
    for trial in range(12):
        next_step = len(sigkill_append_loop(zygote, path, rng, next_step, trial, flush_every=2))
    assert next_step > 4  # the children did make progress
    # a final writer in this process continues the sequence with overlap
    with GradientStore.create(path, META, StoreConfig(flush_every=2)) as w:
        for step in range(next_step - 2, next_step + 5):
            w.append(worker.make_record(step))
        assert w.stats["rows_skipped_duplicate"] >= 2 * worker.ROWS_PER_STEP
    steps = check_worker_rows(GradientStore.open(path))
    assert steps == set(range(next_step + 5))


def test_sigkill_inside_one_large_step_loses_at_most_the_unflushed_window(tmp_path, zygote):
    """A post-hoc capture appends every example at one step: windows close by ``flush_mb``, so a
    SIGKILL loses at most the queue and one window, and a rerun from the start skips what is durable."""
    path, rows, step = tmp_path / "s", 4, 7
    row_bytes = sum(4 * math.prod(layer["shape"]) for layer in worker.LAYERS)
    per_window = 5                                              # records a window holds
    flush_mb = per_window * rows * row_bytes / 2 ** 20
    pid = zygote.start("one_step_loop", path=str(path), step=step, rows=rows, flush_mb=flush_mb)
    reported = zygote.read(lambda m: m.get("pid") == pid and m.get("event") == "appended" and m["record"] >= 40)
    os.kill(pid, signal.SIGKILL)
    assert os.WIFSIGNALED(zygote.wait_exit(pid))
    store = GradientStore.open(path)
    assert check_worker_rows_at(store, step) == set(range(store.num_rows))    # a prefix of the ids, bit-exact
    assert len(store.shards) >= 7 and tmp_files(path) == []
    lost = (reported["record"] + 1) * rows - store.num_rows
    assert lost <= (2 + per_window) * rows, f"lost {lost} rows"                # queue_size 2 + a window
    # rerun from the first record: what is durable is skipped, across all the step's shards
    records = store.num_rows // rows + 20
    pid = zygote.start("one_step_loop", path=str(path), step=step, rows=rows, flush_mb=flush_mb, records=records)
    zygote.read(lambda m: m.get("pid") == pid and m.get("event") == "closed")
    assert zygote.wait_exit(pid) == 0
    assert check_worker_rows_at(GradientStore.open(path), step) == set(range(records * rows))


def check_worker_rows_at(store, step):
    """Every row is at ``step`` and equals the workers' data for (id, step); no duplicate ids. Returns the ids."""
    block = store.read_all()
    assert set(block.steps.tolist()) <= {step} and len(set(block.ids.tolist())) == len(block.ids)
    check_worker_grads(block)
    return set(block.ids.tolist())


@pytest.mark.parametrize("crash_at", ["before_rename", "before_manifest"])
def test_crash_at_each_point_of_the_write_protocol(tmp_path, zygote, crash_at):
    path = tmp_path / "s"
    pid = zygote.start("append_loop", path=str(path), start_step=0, flush_every=2, max_steps=20,
                       crash_at=crash_at, crash_after=3)
    status = zygote.wait_exit(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    shard_files = sorted(p.name for p in (path / "shards").iterdir())
    manifest = json.loads((path / "manifest-r00000.json").read_text())
    listed = sorted(Path(s["file"]).name for s in manifest["shards"])
    if crash_at == "before_rename":
        assert "r00000-00000002.h5.tmp" in shard_files and len(listed) == 2
        expected_steps = set(range(4))
    else:  # the third shard is in place but the manifest does not list it yet
        assert "r00000-00000002.h5" in shard_files and len(listed) == 2
        expected_steps = set(range(6))
    store = GradientStore.open(path)
    assert check_worker_rows(store) == expected_steps and tmp_files(path) == []
    with GradientStore.create(path, META, StoreConfig(flush_every=2)) as w:  # persists the adoption
        assert len(json.loads((path / "manifest-r00000.json").read_text())["shards"]) == len(expected_steps) // 2
        for step in range(3, 10):
            w.append(worker.make_record(step))
    assert check_worker_rows(GradientStore.open(path)) == set(range(10))
    assert [s.seq for s in GradientStore.open(path).shards] == list(range(5))


@pytest.mark.parametrize("at", ["before", "cut", "manifest"])
def test_crash_inside_truncate_leaves_the_cut_all_or_nothing_and_no_shard_rewritten(tmp_path, zygote, at):
    """SIGKILL inside truncate_after: before its cut marker is durable nothing is cut; from then on the
    cut holds for every reader, whatever the manifest says, and the rank's next writer removes the
    shards it voided. No shard file is ever rewritten: the ones kept are byte for byte as written."""
    path = tmp_path / "s"
    pid = zygote.start("append_loop", path=str(path), start_step=0, flush_every=2, max_steps=10)
    zygote.read(lambda m: m.get("pid") == pid and m.get("event") == "closed")
    assert zygote.wait_exit(pid) == 0
    written = {p.name: p.read_bytes() for p in (path / "shards").glob("*.h5")}
    pid = zygote.start("truncate_crash", path=str(path), step=4, at=at)  # voids step 5 of 4-5, and 6-9
    status = zygote.wait_exit(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    cut = at != "before"
    assert check_worker_rows(GradientStore.open(path)) == set(range(5 if cut else 10)) and tmp_files(path) == []
    with GradientStore.create(path, META, StoreConfig(flush_every=2)) as w:
        assert w.stats["shards"] == (3 if cut else 5)
        assert w.truncate_after(4) == (0 if cut else 5 * worker.ROWS_PER_STEP)
        for step in range(5, 7):
            w.append(worker.make_record(step))
    assert check_worker_rows(GradientStore.open(path)) == set(range(7))
    after = {p.name: p.read_bytes() for p in (path / "shards").glob("*.h5")}
    assert {name for name in written if name in after} == {f"r00000-{s:08d}.h5" for s in range(3)}
    assert all(after[name] == written[name] for name in written if name in after)
    assert sorted(p.name for p in (path / "shards").glob("*.cut.json")) == \
        ([f"r00000-{s:08d}.cut.json" for s in (5, 6)] if cut else ["r00000-00000005.cut.json"])


def test_disk_full_rlimit_in_subprocess(tmp_path, zygote):
    """EFBIG via RLIMIT_FSIZE (works without root): caller sees StoreWriteError, nothing durable is lost."""
    path = tmp_path / "s"
    pid = zygote.start("disk_full", path=str(path), limit_bytes=40_000, big_rows=200)
    result = zygote.read(lambda m: m.get("pid") == pid and m.get("event") == "result")
    assert zygote.wait_exit(pid) == 0
    assert result["error"] is not None and "file too large" in result["error"] and str(path) in result["error"]
    assert result["tmp_after_failure"] == []
    assert result.get("retry_error") is None and result["retry_rows"] == 200
    store = GradientStore.open(path)
    assert store.num_rows == worker.ROWS_PER_STEP + 200 and tmp_files(path) == []
    assert sorted(set(store.steps.tolist())) == [0, 1]


def test_no_pickle_on_the_read_path(tmp_path, monkeypatch):
    import pickle

    write_store(tmp_path / "s", random_records(range(3)), flush_every=1)

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used on the read path")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    store = GradientStore.open(tmp_path / "s")
    assert len(store.read_all()) == 9 and store.summary()["num_rows"] == 9


def test_warnings_module_is_quiet_for_clean_data(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_store(tmp_path / "s", random_records(range(3)), flush_every=1).read_all()


@pytest.mark.gpu
def test_cuda_and_mixed_device_records_store_the_bytes_of_their_cpu_copies(tmp_path):
    """The writer joins a record's layers on their device before the one copy to host; layers on
    different devices are moved first. Either way the rows are the CPU record's, bit for bit."""
    records = random_records(range(3), seed=21)
    moved = []
    for i, r in enumerate(records):
        grads = {name: (g.cuda() if i == 1 or name == LAYERS[0] else g) for name, g in r.grads.items()}
        moved.append(GradientRecord(ids=r.ids, step=r.step, lr=r.lr, loss_scale=r.loss_scale, grads=grads))
    for dtype in ("float32", "bfloat16"):
        cpu = write_store(tmp_path / f"cpu-{dtype}", records, dtype=dtype).read_all()
        gpu = write_store(tmp_path / f"gpu-{dtype}", moved, dtype=dtype).read_all()
        for name in LAYERS:
            assert torch.equal(cpu.grads[name], gpu.grads[name]), (dtype, name)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_layers_of_different_float_dtypes_are_encoded_as_each_alone(tmp_path, dtype):
    """Layers of different float dtypes in one record (a GPU record is joined into one tensor before
    its copy to the host, which promotes): each layer's stored words are what encoding it alone gives."""
    from olmo_tda.store.format import decode_grads, encode_grads

    for first, second in ((torch.bfloat16, torch.float16), (torch.float64, torch.float32)):
        r = random_records([0], seed=22)[0]
        g = r.grads[LAYERS[0]].double()
        # just above float16's and bfloat16's rounding midpoints above 1, where a cast through float32
        # and a direct one differ: the store must give what torch's own cast gives
        g.view(-1)[:2] = torch.tensor([1 + 2 ** -11 + 2 ** -40, 1 + 2 ** -8 + 2 ** -40], dtype=torch.float64)
        r.grads[LAYERS[0]] = g.to(first)
        r.grads[LAYERS[1]] = r.grads[LAYERS[1]].to(second)
        block = write_store(tmp_path / f"s-{first}", [r], dtype=dtype).read_all()
        for name in LAYERS:
            want = decode_grads(encode_grads(r.grads[name], StoreDType(dtype)), StoreDType(dtype))
            assert torch.equal(block.grads[name], want), (first, name)


def test_float16_underflow_is_warned_once(tmp_path, caplog):
    """float16's smallest subnormal is ~6e-8: gradients of 1e-9 are stored as 0 (read back: exactly 0,
    the oracle), which float16 says once per writer; values it keeps say nothing, and bfloat16 keeps
    them (float32's exponent range)."""
    def record(step, scale):
        gen = torch.Generator().manual_seed(step)
        grads = {layer["name"]: torch.randn(4, *layer["shape"], generator=gen) * scale for layer in worker.LAYERS}
        return GradientRecord(ids=np.arange(4), step=step, lr=0.1, loss_scale=1.0, grads=grads)

    with caplog.at_level("WARNING"):
        write_store(tmp_path / "ok", [record(1, 1e-3), record(2, 1e-3)], dtype="float16", flush_every=1)
    assert "float16 stored" not in caplog.text
    with caplog.at_level("WARNING"):
        write_store(tmp_path / "tiny", [record(1, 1e-9), record(2, 1e-9)], dtype="float16", flush_every=1)
    assert caplog.text.count("float16 stored") == 1 and "store.dtype=bfloat16 keeps float32's range" in caplog.text
    block = GradientStore.open(tmp_path / "tiny").read_all()
    assert all(float(torch.as_tensor(block.grads[n]).abs().max()) == 0 for n in LAYERS)     # all gone
    caplog.clear()
    with caplog.at_level("WARNING"):
        write_store(tmp_path / "bf16", [record(1, 1e-9)], dtype="bfloat16")
    assert "float16 stored" not in caplog.text
    kept = GradientStore.open(tmp_path / "bf16").read_all().grads
    assert all(float(torch.as_tensor(b).abs().min()) > 0 for b in kept.values())
