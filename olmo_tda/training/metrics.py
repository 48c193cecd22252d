"""The run's step metrics, written the same way under OLMo and DeepSpeed: every step's row in
``<folder>/metrics.jsonl`` (a local copy for reports; W&B may be off or offline) and the ``tda/*``
keys in W&B, from rank 0.

:class:`MetricsLogger` is the last of a run's callbacks, so keys other callbacks add to the step's
metrics are written too. Its state is the last step it wrote; a resume cuts the file back to the
checkpoint's step (its later steps will be run again).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ..config import WandbConfig
from .callbacks import Callback, StepEnd

__all__ = ["MetricsLogger", "METRICS_FILE"]

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricsLogger(Callback):
    """``metrics.jsonl`` and W&B for a run whose tda folder is ``folder``; both on rank 0 only.

    W&B: the ``tda/*`` keys of every step go to the W&B run of this process if there is one (OLMo's,
    or the user's). With ``wandb.enabled`` and none running, one is started in ``folder`` (offline
    unless ``wandb.mode`` or ``WANDB_MODE`` says otherwise) and finished by :meth:`close`.
    """

    def __init__(self, folder: str | Path, wandb_config: WandbConfig | None = None, *, rank: int = 0,
                 config: dict[str, Any] | None = None, wandb: bool = True):
        self.rank = rank
        self.path = Path(folder) / METRICS_FILE
        self._file = None
        self._started_wandb = False
        self._wandb = wandb
        self.last_step = 0
        if rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        wandb_config = wandb_config or WandbConfig()
        if wandb_config.enabled and wandb:
            import wandb as wandb_lib

            if wandb_lib.run is None:
                try:
                    wandb_lib.init(dir=str(self.path.parent), project=wandb_config.project, name=wandb_config.name,
                                   mode=os.environ.get("WANDB_MODE") or wandb_config.mode.value, config=config)
                except BaseException:
                    self._file.close()
                    raise
                self._started_wandb = True

    def on_step_end(self, event: StepEnd) -> None:
        self.log(event.step, event.metrics)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.last_step = step
        if self._file is None:
            return
        self._file.write(json.dumps({"step": step, **metrics}, default=_number) + "\n")
        import wandb

        if self._wandb and wandb.run is not None:
            wandb.log({k: v for k, v in metrics.items() if k.startswith("tda/")}, step=step)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cut_after(int(state["step"]))

    def cut_after(self, step: int) -> None:
        """Keep the file's rows up to ``step`` (written to a temp file, then renamed)."""
        self.last_step = step
        if self._file is None:
            return
        from ..report.html import read_metrics

        self._file.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            kept = [row for row in read_metrics(self.path) if row["step"] <= step]
            with open(tmp, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except (ValueError, OSError) as e:   # a damaged local copy must not stop the run: W&B has them too
            log.warning("tda: %s: %s; left as it is (steps past %d stay in it)", self.path, e, step)
            tmp.unlink(missing_ok=True)
        self._file = open(self.path, "a", buffering=1)

    def close(self, exit_code: int = 0) -> None:
        """Close the file, and finish a W&B run this logger started with the run's ``exit_code``."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._started_wandb:
            import wandb

            if wandb.run is not None:
                wandb.finish(exit_code=exit_code)
            self._started_wandb = False


def _number(value: Any) -> Any:
    """A value a callback added that JSON cannot write (a 0-d tensor, a numpy scalar): as a float."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def capture_numbers(store: Any, follower: Any, *, rows: int, append_ms: float, seconds: float,
                    row_bytes: int) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """One step's capture numbers on this rank, as three dicts of ``tda/*`` keys: to be summed over
    the ranks (rows captured this step, throughput, the store's cumulative skipped rows and bytes),
    to be maximized over them (``append_ms``: a rank whose writer falls behind holds up every rank's
    next step, and would go unseen in rank 0's own number or in a mean), and the same on every rank
    (the eigenbasis versions of a following basis). OLMo and DeepSpeed runs log exactly these keys."""
    stats = store.stats
    sums = {"tda/rows_captured": float(rows),
            "tda/rows_skipped_nonfinite": float(stats.get("rows_skipped_nonfinite", 0)),
            "tda/examples_per_s": rows / max(seconds, 1e-9),
            "tda/bytes_written": float(stats.get("rows_written", 0) * row_bytes)}
    same = {} if follower is None else {"tda/basis_versions": float(len(follower.versions)),
                                        "tda/basis_refresh_s": float(follower.refresh_seconds)}
    return sums, {"tda/append_ms": append_ms}, same
