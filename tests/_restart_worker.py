"""A training entry point whose first attempt under torchrun fails, for the tests that torchrun's
restart (``--max_restarts``) starts over a run stopped before its first checkpoint.

``python _restart_worker.py deepspeed|olmo ARGS...``: the DeepSpeed example script or ``olmo-tda
train`` with ``ARGS``. The first rank 1 to reach its third training step dies there (``os._exit``,
no cleanup), once a shard of the store in ``$RESTART_TEST_SHARDS`` is on disk, so the restart finds
stored rows of the failed attempt and no checkpoint. With ``RESTART_TEST_HANG=1`` the first rank 0 to
get there sleeps instead of going on (as a rank blocked in a collective does on a GPU), so on several
nodes its agent restarts it for the change of nodes, not for a failure of its own. "First" is kept
in marker files in the folder ``$RESTART_TEST_MARKS``."""

import glob
import os
import sys
import time


def _first(mark: str) -> bool:
    """Whether this is the first process to get here with ``mark`` (its marker file is made now)."""
    try:
        fd = os.open(os.path.join(os.environ["RESTART_TEST_MARKS"], mark), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _at_third_step() -> None:
    rank = os.environ.get("RANK")
    if rank == "1" and _first("died"):
        deadline = time.monotonic() + 120
        while not glob.glob(os.path.join(os.environ["RESTART_TEST_SHARDS"], "*.h5")):
            if time.monotonic() > deadline:
                print("restart worker: no shard was written within 120 s", file=sys.stderr, flush=True)
                break
            time.sleep(0.05)
        print("restart worker: rank 1 of attempt 0 dies now", file=sys.stderr, flush=True)
        os._exit(1)
    if rank == "0" and os.environ.get("RESTART_TEST_HANG") == "1" and _first("hung"):
        print("restart worker: rank 0 of attempt 0 hangs now", file=sys.stderr, flush=True)
        time.sleep(600)


kind, args = sys.argv[1], sys.argv[2:]

if kind == "deepspeed":
    from deepspeed.runtime.engine import DeepSpeedEngine

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    import deepspeed_pretrain as entry

    _forward = DeepSpeedEngine.forward

    def _forward_at_third_step(self, *a, **k):
        if self.global_steps == 2:           # steps 1 and 2 taken
            _at_third_step()
        return _forward(self, *a, **k)

    DeepSpeedEngine.forward = _forward_at_third_step
    sys.exit(entry.main(args))
elif kind == "olmo":
    from olmo_tda.integrations import olmo as integration

    _step = integration.TDATrainer.train_step

    def _step_at_third_step(self, batch, **kwargs):
        if self.global_step == 3:            # counted before its step: steps 1 and 2 taken
            _at_third_step()
        return _step(self, batch, **kwargs)

    integration.TDATrainer.train_step = _step_at_third_step
    from olmo_tda.cli import main

    sys.exit(main(["train", *args]))
else:
    sys.exit(f"restart worker: unknown kind {kind!r}")
