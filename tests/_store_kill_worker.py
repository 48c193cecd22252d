"""Subprocess side of the store's crash tests: deterministic data, and a forking "zygote".

Importing torch costs seconds; the crash tests need many short-lived writer processes. So one
zygote process imports everything once and, per request, ``fork()``s a child that runs a task and
is killed (or dies) there. The zygote has used no torch thread pool before forking, so the child is
as clean as a fresh interpreter.

Protocol, one JSON object per line. Parent → zygote (stdin): ``{"task": name, ...args}``.
Zygote → parent (stdout): ``{"pid": p}`` once forked, ``{"pid": p, "exit": status}`` once reaped;
children add ``{"pid": p, "event": ...}`` lines (written with one ``os.write``, so never torn).

Every gradient a child writes is a deterministic function of (example id, step, layer), so the
parent can check bit-exactness of whatever survived a crash.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time

import numpy as np

LAYERS = [{"name": "blocks.0.att_proj", "shape": [6, 10], "projector": {"seed": 0, "kind": "gaussian"}},
          {"name": "blocks.1/ff_out", "shape": [4, 4], "projector": {"seed": 0, "kind": "gaussian"}}]
META = {"capture": {"proj_dim": [6, 10], "seed": 0}, "layers": LAYERS, "projector_hash": "kill-test"}
ROWS_PER_STEP = 4


def ids_at(step: int, rows: int = ROWS_PER_STEP) -> np.ndarray:
    """Example ids of a step; ids recur at later steps (like epochs), so (id, step) is the key."""
    return ((np.arange(rows) + 3 * step) % max(50, rows)).astype(np.int64)


def expected_grad(example_id: int, step: int, layer: int, shape) -> np.ndarray:
    """float32 ``shape``: the gradient the workers write for (id, step, layer)."""
    k = np.arange(shape[0] * shape[1], dtype=np.float64)
    v = np.sin(0.37 * k + 1.3 * example_id + 0.71 * step + 2.1 * layer) * (1.0 + step % 5)
    return v.astype(np.float32).reshape(shape)


def lr_at(step: int) -> float:
    return 1e-3 / (1.0 + step)


def loss_scale_at(step: int) -> float:
    return 1.0 + 0.5 * step


def make_record(step: int, rows: int = ROWS_PER_STEP, layers=LAYERS, ids=None):
    import torch

    from olmo_tda.store import GradientRecord

    ids = ids_at(step, rows) if ids is None else np.asarray(ids, dtype=np.int64)
    grads = {layer["name"]: torch.from_numpy(np.stack([expected_grad(int(i), step, li, layer["shape"])
                                                       for i in ids]))
             for li, layer in enumerate(layers)}
    return GradientRecord(ids=ids, step=step, lr=lr_at(step), loss_scale=loss_scale_at(step), grads=grads)


# ---------------------------------------------------------------------------------------------
# child tasks (run in a forked child; they never return normally)


def _event(**data) -> None:
    os.write(1, (json.dumps({"pid": os.getpid(), **data}) + "\n").encode())


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def task_append_loop(path: str, start_step: int, flush_every: int, dtype: str = "float32",
                     max_steps: int | None = None, crash_at: str | None = None, crash_after: int = 1,
                     step_sleep: float = 0.0, seal: int | None = None) -> None:
    """Append steps from ``start_step`` on until killed (or ``max_steps``, then close).

    ``crash_at`` SIGKILLs this process deterministically at a point of the write protocol, on the
    ``crash_after``-th time it is reached: ``"before_rename"`` (temp shard written and fsynced),
    ``"before_manifest"`` (shard renamed, manifest not yet updated), ``"after_segment"`` (a block of
    the index sealed into its segment file, the manifest naming it not yet written). ``seal``: the
    shards per sealed segment (``manifest.SEAL_SHARDS``).
    """
    from olmo_tda.config import StoreConfig
    from olmo_tda.store import GradientStore, format as fmt, manifest as mmod, writer as wmod

    if seal is not None:
        mmod.SEAL_SHARDS = seal

    calls = {"n": 0}

    def reached() -> bool:
        calls["n"] += 1
        return calls["n"] >= crash_after

    if crash_at == "before_rename":
        def write_shard(root, rank, seq, *args, **kwargs):
            tmp, info = fmt.prepare_shard(root, rank, seq, *args, **kwargs)
            if reached():
                _kill_self()
            fmt.commit_shard(root, tmp, info)
            return info
        wmod.write_shard = write_shard
    elif crash_at == "before_manifest":
        real_write_manifest = wmod.write_manifest

        def write_manifest(root, state):
            if state.shards and reached():
                _kill_self()
            real_write_manifest(root, state)
        wmod.write_manifest = write_manifest
    elif crash_at == "after_segment":
        real_write_segment = mmod._write_segment

        def write_segment(*args):
            segment = real_write_segment(*args)
            if reached():
                _kill_self()
            return segment
        mmod._write_segment = write_segment

    store = GradientStore.create(path, META, StoreConfig(flush_every=flush_every, dtype=dtype, queue_size=2))
    _event(event="ready")
    step = start_step
    while max_steps is None or step < start_step + max_steps:
        store.append(make_record(step))
        step += 1
        if step_sleep:
            time.sleep(step_sleep)
    store.close()
    _event(event="closed", last_step=step - 1)


def task_one_step_loop(path: str, step: int, rows: int, flush_mb: float, start: int = 0,
                       records: int | None = None) -> None:
    """A post-hoc capture: records ``start, start + 1, ...`` all at ``step``, record ``r`` holding ids
    ``r·rows .. r·rows + rows - 1``; windows close by ``flush_mb`` only. Reports each appended record."""
    from olmo_tda.config import StoreConfig
    from olmo_tda.store import GradientStore

    store = GradientStore.create(path, META, StoreConfig(flush_mb=flush_mb, queue_size=2))
    _event(event="ready")
    r = start
    while records is None or r < start + records:
        store.append(make_record(step, ids=np.arange(r * rows, (r + 1) * rows)))
        _event(event="appended", record=r)
        r += 1
        time.sleep(0.002)
    store.close()
    _event(event="closed")


def task_truncate_crash(path: str, step: int, rank: int = 0, at: str = "manifest") -> None:
    """Rank ``rank``'s ``truncate_after(step)``, SIGKILLed at ``at``: "before" the cut marker is
    written, right after it ("cut"), or after the manifest that follows it ("manifest"), before the
    shards the cut voided are removed."""
    from olmo_tda.config import StoreConfig
    from olmo_tda.store import GradientStore, writer as wmod

    real_write_cut, real_write_manifest = wmod.write_cut, wmod.write_manifest

    def write_cut(*args):
        if at == "before":
            _kill_self()
        real_write_cut(*args)
        if at == "cut":
            _kill_self()

    def write_manifest(root, state):
        real_write_manifest(root, state)
        if at == "manifest" and state.cuts:
            _kill_self()
    wmod.write_cut, wmod.write_manifest = write_cut, write_manifest
    store = GradientStore.create(path, META, StoreConfig(flush_every=2), rank=rank)
    store.truncate_after(step)
    _event(event="survived")


def task_disk_full(path: str, limit_bytes: int, big_rows: int) -> None:
    """Hit RLIMIT_FSIZE (EFBIG) on a shard write; report what the caller saw, then retry after raising it."""
    from olmo_tda.config import StoreConfig
    from olmo_tda.store import GradientStore, StoreWriteError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of failing write()
    store = GradientStore.create(path, META, StoreConfig(flush_every=1000))
    store.append(make_record(0))
    store.flush()  # small, durable shard
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    store.append(make_record(1, rows=big_rows))
    result = {"event": "result", "error": None}
    try:
        store.flush()
    except StoreWriteError as e:
        result["error"] = str(e)
    result["tmp_after_failure"] = sorted(p for p in os.listdir(os.path.join(path, "shards")) if p.endswith(".tmp"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    try:
        info = store.flush()  # the window stayed in memory: retry now that the limit is gone
        result["retry_rows"] = info.num_rows if info else 0
        store.close()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        result["retry_error"] = repr(e)
    _event(**result)


TASKS = {"append_loop": task_append_loop, "one_step_loop": task_one_step_loop, "truncate_crash": task_truncate_crash,
         "disk_full": task_disk_full}


# ---------------------------------------------------------------------------------------------
# zygote


def main() -> None:
    import torch  # noqa: F401 - imported once here so forked children start instantly

    import olmo_tda.store  # noqa: F401

    os.write(1, b'{"event": "zygote-ready"}\n')
    for line in sys.stdin:
        request = json.loads(line)
        task = TASKS[request.pop("task")]
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                import torch

                torch.set_num_threads(1)
                task(**request)
            except BaseException as e:  # noqa: BLE001 - report, never fall back into the zygote loop
                _event(event="error", error=repr(e))
                status = 1
            os._exit(status)
        os.write(1, (json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        os.write(1, (json.dumps({"pid": pid, "exit": status}) + "\n").encode())


if __name__ == "__main__":
    main()
