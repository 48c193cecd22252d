"""olmo_tda: training-data attribution built into LLM pretraining.

Capture compact per-example gradients inside an ordinary training step, stream them to a crash-safe
HDF5 store, and ask which training examples made the model do something::

    from olmo_tda import GradientCapture, CaptureConfig, GradientStore, StoreConfig, attribute

and, for a run of ``olmo-tda train`` or of the DeepSpeed example, ``from olmo_tda import open_run, Query``:
``open_run("runs/tiny").attribute([Query("Ada Brell was born in", " Tulsa")], group_by="document")``.
"""

__version__ = "0.2.0"

from .capture import CaptureError, GradientCapture, Recording
from .config import CaptureConfig, ConfigError, StoreConfig, TDAConfig
from .errors import TDAError
from .methods import AttributionResult, attribute
from .methods.queries import Query
from .store import GradientRecord, GradientStore

__all__ = ["__version__", "GradientCapture", "Recording", "CaptureError", "CaptureConfig", "StoreConfig",
           "TDAConfig", "TDAError", "ConfigError", "GradientStore", "GradientRecord", "attribute", "AttributionResult",
           "Query", "OLMoRun", "DeepSpeedRun", "open_run"]

_RUNS = ("OLMoRun", "DeepSpeedRun", "open_run")


def __getattr__(name: str):
    """The run readers (``from olmo_tda import OLMoRun``), imported on first use: they import OLMo,
    which ``import olmo_tda`` alone does not."""
    if name in _RUNS:
        from .integrations import olmo_query

        return getattr(olmo_query, name)
    raise AttributeError(f"module 'olmo_tda' has no attribute {name!r}")
