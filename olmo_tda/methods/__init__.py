"""Attribution methods over a gradient store, one interface, registered by name.

Example (query gradients captured with the store's capture config)::

    from olmo_tda import attribute
    result = attribute("runs/demo/tda/store", rec.dense(), method="gradcos", top_k=5)
    print(result.as_dicts()[0])      # [{"index": ..., "step": ..., "score": ...}, ...]
"""

from . import graddot as _graddot  # noqa: F401  (registers graddot, gradcos)
from .base import AttributionMethod, AttributionResult, attribute, available_methods, get_method, register_method

__all__ = ["attribute", "AttributionResult", "AttributionMethod", "register_method", "get_method",
           "available_methods"]
