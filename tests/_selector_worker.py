"""Worker for tests/test_selection.py::test_two_rank_preconditioned_round_equals_one_process, run
under ``torchrun --nproc_per_node 2`` (gloo, CPU): one preconditioned GREATS round of a tiny OLMo,
the window and the target split across the two ranks, once evenly and once unevenly (the second rank
then pads its share with repeats, which must not count in the moments), and once measuring a
5-example sample of the window (``measure``, sources known); rank 0 saves each round's order and
promoted mean score.

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 _selector_worker.py OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from conftest import tiny_olmo
from olmo_tda.config import SelectionConfig
from olmo_tda.training.selector import OnlineSelector

SPLITS = [(10, 4, 0), (9, 5, 0), (10, 4, 5)]
"""(window, target examples, measure): even over 2 ranks, uneven (padding rows), a measured sample."""


def round_scores(out: Path, log: Path, window: int = 10, target_examples: int = 4, measure: int = 0
                 ) -> tuple[np.ndarray, float]:
    """The round's new order of the window and its promoted examples' mean score, on the current
    process group (none: one process)."""
    model = tiny_olmo()
    data = torch.randint(0, 96, (24, 12), generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 96, (target_examples, 12), generator=torch.Generator().manual_seed(1))
    (out / "target.txt").write_text("t\n")
    cfg = SelectionConfig(enabled=True, every_n=1, window=window, policy="greats", target=str(out / "target.txt"),
                          proj_dim=8, target_examples=target_examples, micro_batch=2, precondition=True,
                          measure=measure)
    sel = OnlineSelector(cfg, model, forward=lambda m, ids: m(ids).logits, log_folder=log, target_tokens=target)
    order, stats = sel.run(step=1, epoch=0, order=np.arange(24), start=4, fetch=lambda ids: data[ids], lr=0.5,
                           tokens_per_batch=48, batch_size=4, sources=lambda ids: [f"s{i % 3}" for i in ids])
    sel.close()
    assert stats["preconditioned"] and stats["examples_measured"] == (measure or window)
    return order[4:4 + window], stats["promoted_mean_score"]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    for k, (window, target_examples, measure) in enumerate(SPLITS):
        order, promoted = round_scores(out, out / f"sel2-{k}", window, target_examples, measure)
        gathered = [None, None]
        dist.all_gather_object(gathered, order.tolist() + [promoted])
        if dist.get_rank() == 0:
            np.save(out / f"two_ranks_{k}.npy", np.asarray(gathered, dtype=np.float64))
    dist.barrier()          # leave together: a rank tearing gloo down while the other still saves can abort
    # and leave without tearing gloo down at all: a rank aborted once in CI (SIGABRT, "terminate called
    # without an active exception", 2026-12-02; not reproduced in 9 local runs), the signature of a C++
    # thread destroyed unjoined, which only gloo's teardown has here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
