"""olmo_tda: training-data attribution built into LLM pretraining.

Capture compact per-example gradients inside an ordinary training step, stream them to a crash-safe
HDF5 store, and ask which training examples made the model do something::

    from olmo_tda import GradientCapture, CaptureConfig, GradientStore, StoreConfig, attribute
"""

__version__ = "0.1.0"

from .capture import CaptureError, GradientCapture, Recording
from .config import CaptureConfig, ConfigError, StoreConfig, TDAConfig
from .methods import AttributionResult, attribute
from .store import GradientRecord, GradientStore

__all__ = ["__version__", "GradientCapture", "Recording", "CaptureError", "CaptureConfig", "StoreConfig",
           "TDAConfig", "ConfigError", "GradientStore", "GradientRecord", "attribute", "AttributionResult"]
