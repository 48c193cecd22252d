"""``olmo-tda train`` with rank 1 failing at step 3 (a full disk, say), for the test that a failing
rank neither hangs the others nor hides its error. The process group's timeout is cut to 90 s, so a
rank left waiting on the failed one would outlast the test's limit."""

import datetime
import sys

import torch.distributed as dist

_init = dist.init_process_group


def _short_timeout(*args, **kwargs):
    kwargs["timeout"] = datetime.timedelta(seconds=90)
    return _init(*args, **kwargs)


dist.init_process_group = _short_timeout

from olmo_tda.integrations import olmo as integration  # noqa: E402

_step = integration.TDATrainer.train_step


def _failing_step(self, batch, **kwargs):
    if dist.get_rank() == 1 and self.global_step == 3:
        raise OSError("injected: disk full on rank 1")
    return _step(self, batch, **kwargs)


integration.TDATrainer.train_step = _failing_step

from olmo_tda.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
