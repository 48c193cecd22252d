"""Worker for tests/test_selection.py::test_two_rank_preconditioned_round_equals_one_process, run
under ``torchrun --nproc_per_node 2`` (gloo, CPU): one preconditioned GREATS round of a tiny OLMo,
the window and the target split across the two ranks; rank 0 saves the round's scores and order.

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 _selector_worker.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from conftest import tiny_olmo
from olmo_tda.config import SelectionConfig
from olmo_tda.training.selector import OnlineSelector

WINDOW, TARGET = 10, 4          # even splits: no padding rows (those would count twice in the moments)


def round_scores(out: Path, log: Path) -> tuple[np.ndarray, float]:
    """The round's new order of the window and its promoted examples' mean score, on the current
    process group (none: one process)."""
    model = tiny_olmo()
    data = torch.randint(0, 96, (24, 12), generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 96, (TARGET, 12), generator=torch.Generator().manual_seed(1))
    (out / "target.txt").write_text("t\n")
    cfg = SelectionConfig(enabled=True, every_n=1, window=WINDOW, policy="greats", target=str(out / "target.txt"),
                          proj_dim=8, target_examples=TARGET, micro_batch=2, precondition=True)
    sel = OnlineSelector(cfg, model, forward=lambda m, ids: m(ids).logits, log_folder=log, target_tokens=target)
    order, stats = sel.run(step=1, epoch=0, order=np.arange(24), start=4, fetch=lambda ids: data[ids], lr=0.5,
                           tokens_per_batch=48, batch_size=4)
    sel.close()
    assert stats["preconditioned"]
    return order[4:4 + WINDOW], stats["promoted_mean_score"]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    order, promoted = round_scores(out, out / "sel2")
    gathered = [None, None]
    dist.all_gather_object(gathered, order.tolist() + [promoted])
    if dist.get_rank() == 0:
        np.save(out / "two_ranks.npy", np.asarray(gathered, dtype=np.float64))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
