"""Training-time components beside the step: trajectory checkpoints for TracIn, and online data
selection (:mod:`.selection`: policies, the order rewrite, the round log; :mod:`.selector`: a round
at the current weights).

Example::

    import tempfile, torch
    from olmo_tda.config import TrajectoryConfig
    from olmo_tda.training import Trajectory
    traj = Trajectory(TrajectoryConfig(enabled=True, every=2), tempfile.mkdtemp() + "/trajectory")
    for step in range(5):
        traj.maybe_save(step, {"w": torch.full((2,), float(step))}, lrs=[1e-3], tokens_seen=step * 64)
    print([c.step for c in Trajectory.list(traj.path)])     # [0, 2, 4]
"""

from .selection import DataOrder, SelectionError, SelectionLog, rewrite_order
from .selector import OnlineSelector
from .trajectory import Trajectory, TrajectoryCheckpoint, TrajectoryError

__all__ = ["Trajectory", "TrajectoryCheckpoint", "TrajectoryError", "OnlineSelector", "SelectionLog", "SelectionError",
           "DataOrder", "rewrite_order"]
