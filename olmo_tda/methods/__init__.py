"""Attribution methods over a gradient store, one interface, registered by name.

Example: a store of 3 training rows, scored against one query (in practice both come from a
:class:`~olmo_tda.GradientCapture` with the same config; a Recording can be passed directly)::

    import tempfile, torch
    from olmo_tda import GradientRecord, GradientStore, StoreConfig, attribute
    meta = {"capture": {}, "projector_hash": "h", "layers": [{"name": "fc", "shape": [2, 2], "projector": {}}]}
    path = tempfile.mkdtemp() + "/store"
    with GradientStore.create(path, meta, StoreConfig()) as store:
        store.append(GradientRecord(ids=[7, 8, 9], step=0, lr=0.1, loss_scale=1.0,
                                    grads={"fc": torch.tensor([[[1., 0], [0, 0]], [[0, 1], [0, 0]],
                                                               [[2, 0], [0, 0]]])}))
    result = attribute(path, {"fc": torch.tensor([[[1., 0], [0, 0]]])}, method="graddot", top_k=2)
    print(result.as_dicts()[0])      # [{'index': 9, 'step': 0, 'score': 2.0}, {'index': 7, 'step': 0, 'score': 1.0}]
"""

from . import graddot as _graddot  # noqa: F401  (registers graddot, gradcos)
from . import influence as _influence  # noqa: F401  (registers influence)
from . import optimizer as _optimizer  # noqa: F401  (registers adam-graddot, adam-gradcos)
from .base import (AttributionError, AttributionMethod, AttributionResult, BasisQueries, ProjectedQueries, attribute,
                   available_methods, get_method, register_method)

__all__ = ["attribute", "AttributionResult", "AttributionMethod", "BasisQueries", "ProjectedQueries",
           "register_method", "get_method", "available_methods", "AttributionError"]
