"""``olmo-tda train`` whose rank 1 takes 80 ms more over each store append (a writer falling behind a
slow disk), for the test that ``tda/append_ms`` is the slowest rank's, not rank 0's."""

import os
import sys
import time

from olmo_tda.store.writer import StoreWriter

_append = StoreWriter.append


def _slow_append(self, record):
    if os.environ.get("RANK") == "1":
        time.sleep(0.08)
    return _append(self, record)


StoreWriter.append = _slow_append

from olmo_tda.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
