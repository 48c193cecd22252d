"""An example training callback: the running mean squared norm of the captured gradient rows, kept
across a resume, and logged as ``tda/row_norm_sq`` every step (to ``tda/metrics.jsonl`` and W&B).

Name it in the run's YAML (this folder on PYTHONPATH)::

    tda:
      enabled: true
      callbacks: ["row_norms:RowNorms"]

or pass it from Python: ``olmo_train.train(cfg, tda, step_callbacks=[RowNorms()])`` or
``attach(engine, callbacks=[RowNorms()])``.
"""

from __future__ import annotations

import torch

from olmo_tda.training.callbacks import Callback, StepEnd


class RowNorms(Callback):
    """Per rank: steps and rows seen, and the sum of the rows' squared norms (dense layers only)."""

    def __init__(self):
        self.steps = 0
        self.rows = 0
        self.sum_sq = 0.0

    def on_step_end(self, event: StepEnd) -> None:
        self.steps += 1
        if event.record is None:
            return
        dense = [g for g in event.record.grads.values() if torch.is_tensor(g)]
        self.rows += len(event.record.ids)
        self.sum_sq += sum(float(g.double().pow(2).sum()) for g in dense)
        event.metrics["tda/row_norm_sq"] = self.sum_sq / max(self.rows, 1)     # this rank's running mean

    def state_dict(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "sum_sq": self.sum_sq}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.rows, self.sum_sq = int(state["steps"]), int(state["rows"]), float(state["sum_sq"])
