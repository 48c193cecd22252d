"""``olmo-tda train`` whose rank 1 cannot see the files rank 0 writes in the selection log folder (as
on a save_folder local to each node), for the test that selection refuses such a folder."""

import os
import sys

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

from olmo_tda.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
