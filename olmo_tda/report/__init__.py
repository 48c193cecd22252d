"""Reports: HTML pages and PNG plots of runs and attribution results.

Example::

    from olmo_tda.report import plot_training
    plot_training(Path("loss.png"), steps=[0, 1, 2], losses=[3.0, 2.5, 2.2])
"""

from .html import plot_training, write_attribution_report

__all__ = ["plot_training", "write_attribution_report"]
