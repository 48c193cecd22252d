"""A test's user callback (named in YAML as ``_witness_callback:Witness``): the docs' example
``RowNorms`` plus a witness of what it was handed. Every step it checks the record against the
batch's ids and appends ``{rank, step, ids, rows}`` to ``$WITNESS_DIR/steps_rank{r}.jsonl``; at
``$WITNESS_KILL_AT`` (on rank 1, or rank 0 alone) it SIGKILLs its own process, as a preemption
would; at the end of the run it writes its state to ``$WITNESS_DIR/final_rank{r}.json``."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
from row_norms import RowNorms


class Witness(RowNorms):
    def on_step_end(self, event) -> None:
        super().on_step_end(event)
        rec = event.record
        assert rec is not None and rec.step == event.step, (rec, event.step)
        assert np.array_equal(np.sort(np.asarray(rec.ids)), np.sort(event.ids)), (rec.ids, event.ids)
        assert all(len(g) == len(rec.ids) for g in rec.grads.values())
        folder = Path(os.environ["WITNESS_DIR"])
        with open(folder / f"steps_rank{event.rank}.jsonl", "a") as f:
            f.write(json.dumps({"rank": event.rank, "step": event.step, "ids": np.asarray(rec.ids).tolist(),
                                "rows_so_far": self.rows}) + "\n")
        kill_at = int(os.environ.get("WITNESS_KILL_AT", "0"))
        if kill_at and event.step == kill_at and event.rank == min(1, event.world_size - 1):
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        from torch import distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        (Path(os.environ["WITNESS_DIR"]) / f"final_rank{rank}.json").write_text(json.dumps(self.state_dict()))
