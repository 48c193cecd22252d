"""The root of the package's own errors.

Every error ``olmo_tda`` raises on purpose derives from :class:`TDAError`, and also from the builtin a
caller would expect (``ValueError`` for a bad input, ``RuntimeError`` for a failure while running), so
``except TDAError`` catches them all and ``except ValueError`` keeps working. Each message names what
was wrong (key path, flag, file, layer) and how to fix it. The families:

- :class:`~olmo_tda.config.ConfigError` (``ValueError``): a setting, argument, flag or input file the
  user gave is unknown, mistyped, out of range or malformed.

  - :class:`~olmo_tda.capture.eigenbasis.EigenBasisError`: an eigenbasis file is missing, unreadable or
    does not fit the model.
- :class:`~olmo_tda.capture.CaptureError` (``RuntimeError``): capture used in a way that cannot give
  correct gradients.
- :class:`~olmo_tda.store.StoreError` (``RuntimeError``): the gradient store failed;
  ``StoreMismatchError`` (also ``ValueError``: written with other settings), ``StoreCorruptError``,
  ``StoreWriteError``.
- :class:`~olmo_tda.methods.AttributionError` (``ValueError``): the queries do not fit the store (layers,
  shapes, projectors, eigenbasis versions), or there is nothing finite to score.
- :class:`~olmo_tda.methods.optimizer.AdamCorrectionError` (``ValueError``): optimizer state that does
  not fit the captured layers.
- :class:`~olmo_tda.training.trajectory.TrajectoryError` (``RuntimeError``): a trajectory directory is
  missing, incomplete or inconsistent.
- :class:`~olmo_tda.training.selection.SelectionError` (``RuntimeError``): a selection round or its saved
  state is inconsistent.

``tests/test_errors.py`` checks that every exception class defined in the package derives from it.
"""

from __future__ import annotations

__all__ = ["TDAError"]


class TDAError(Exception):
    """Base class of every error the package raises on purpose (see the module docstring for the
    families); catch it to tell ``olmo_tda``'s refusals from bugs and third-party failures."""
