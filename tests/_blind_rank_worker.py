"""``olmo-tda train`` (or, with ``deepspeed`` first, the DeepSpeed example script) whose rank 1 cannot
see the files rank 0 writes in the selection log folder (as on a save_folder local to each node), for
the test that selection refuses such a folder.

With ``TDA_TEST_TEARDOWN_BLOCKS=1`` tearing the process down blocks for good, as a teardown waiting on a
peer that failed with it: ``destroy_process_group`` and the interpreter's finalization (an object whose
``__del__`` sleeps): a failed rank must end without either."""

import os
import sys
import time

if os.environ.get("TDA_TEST_TEARDOWN_BLOCKS") == "1":
    import torch.distributed as dist

    def _blocks(*args, **kwargs):
        time.sleep(3600)

    class _BlocksWhenFinalized:
        def __del__(self):
            time.sleep(3600)

    dist.destroy_process_group = _blocks
    _finalized_at_exit = _BlocksWhenFinalized()

from olmo_tda.training import selector

_exists = os.path.exists


class _BlindPath:
    """``os.path`` for the selector module, blind on rank 1 to the probe file rank 0 writes."""

    def __getattr__(self, name):
        return getattr(os.path, name)

    @staticmethod
    def exists(path):
        if os.environ.get("RANK") == "1" and ".shared-check-" in str(path):
            return False
        return _exists(path)


class _BlindOs:
    path = _BlindPath()

    def __getattr__(self, name):
        return getattr(os, name)


selector.os = _BlindOs()

if sys.argv[1] == "deepspeed":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from deepspeed_pretrain import main as deepspeed_main

    sys.exit(deepspeed_main(sys.argv[2:]))
from olmo_tda.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
