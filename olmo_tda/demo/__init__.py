"""The embedded CPU demo (``olmo-tda demo``).

Example::

    from olmo_tda.demo import DemoConfig, run_demo
    print(run_demo("demo_out", DemoConfig(num_passages=512, epochs=1)).line())
"""

from .run import DemoConfig, DemoSummary, run_demo

__all__ = ["DemoConfig", "DemoSummary", "run_demo"]
