"""A training entry point whose first attempt under torchrun fails, for the tests that torchrun's
restart (``--max_restarts``) starts over a run stopped before its first checkpoint.

``python _restart_worker.py deepspeed|olmo ARGS...``: the DeepSpeed example script or ``olmo-tda
train`` with ``ARGS``. In attempt 0 (``TORCHELASTIC_RESTART_COUNT``), rank 1 dies (``os._exit``, no
cleanup) at its third training step, once a shard of the store in ``$RESTART_TEST_SHARDS`` is on disk,
so the restart finds stored rows of the failed attempt and no checkpoint."""

import glob
import os
import sys
import time


def _die_when_rows_are_stored() -> None:
    deadline = time.monotonic() + 120
    while not glob.glob(os.path.join(os.environ["RESTART_TEST_SHARDS"], "*.h5")):
        if time.monotonic() > deadline:
            print("restart worker: no shard was written within 120 s", file=sys.stderr, flush=True)
            break
        time.sleep(0.05)
    print("restart worker: rank 1 of attempt 0 dies now", file=sys.stderr, flush=True)
    os._exit(1)


FAILS = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1"
kind, args = sys.argv[1], sys.argv[2:]

if kind == "deepspeed":
    from olmo_tda.integrations import deepspeed_pretrain as entry

    if FAILS:
        from deepspeed.runtime.engine import DeepSpeedEngine

        _forward = DeepSpeedEngine.forward

        def _forward_then_fail(self, *a, **k):
            if self.global_steps == 2:           # steps 1 and 2 taken: the third one fails
                _die_when_rows_are_stored()
            return _forward(self, *a, **k)

        DeepSpeedEngine.forward = _forward_then_fail
    sys.exit(entry.main(args))
elif kind == "olmo":
    from olmo_tda.integrations import olmo as integration

    if FAILS:
        _step = integration.TDATrainer.train_step

        def _step_then_fail(self, batch, **kwargs):
            if self.global_step == 3:            # counted before its step: steps 1 and 2 taken
                _die_when_rows_are_stored()
            return _step(self, batch, **kwargs)

        integration.TDATrainer.train_step = _step_then_fail
    from olmo_tda.cli import main

    sys.exit(main(["train", *args]))
else:
    sys.exit(f"restart worker: unknown kind {kind!r}")
