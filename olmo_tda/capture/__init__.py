"""Capture: per-example projected gradients of nn.Linear layers, from any torch loop.

Example::

    import torch
    from olmo_tda.capture import GradientCapture
    from olmo_tda.config import CaptureConfig

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    cap = GradientCapture(model, CaptureConfig(proj_dim=0))           # exact gradients
    loss = ((model(x) - y) ** 2).sum(dim=1).mean()                    # the loop divides by 5
    with cap.record(ids=range(5), loss_scale=5) as rec:
        loss.backward()
    print({k: tuple(v.shape) for k, v in rec.dense().items()})      # {'0': (5, 16, 9), '2': (5, 4, 17)}
    cap.remove()
"""

from .eigenbasis import EigenBasis, EigenProjector, estimate_eigenbasis
from .following import BasisFollower, refreshed_basis
from .hooks import CaptureError, GradientCapture, Recording, activation_grads_only, canonical_name
from .projection import IdentityProjector, Projector, RandomProjector, make_projector, register_projector

__all__ = ["GradientCapture", "Recording", "activation_grads_only", "CaptureError", "canonical_name", "Projector",
           "IdentityProjector", "RandomProjector", "EigenBasis", "EigenProjector", "estimate_eigenbasis",
           "BasisFollower", "refreshed_basis",
           "make_projector", "register_projector"]
