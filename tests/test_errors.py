"""One root for the package's own errors: every exception class olmo_tda defines derives from
:class:`~olmo_tda.errors.TDAError`, and keeps the builtin base callers catch (``ValueError``,
``RuntimeError``)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import olmo_tda
from olmo_tda import TDAError


def _package_modules():
    """Every module under olmo_tda, imported (none has import-time side effects; the OLMo integration
    imports OLMo, the one slow import)."""
    for info in pkgutil.walk_packages(olmo_tda.__path__, prefix="olmo_tda."):
        yield importlib.import_module(info.name)


def test_every_package_exception_derives_from_tda_error():
    defined, stray = [], []
    for module in _package_modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or not issubclass(cls, Exception) or issubclass(cls, Warning):
                continue
            defined.append(cls)
            if not issubclass(cls, TDAError):
                stray.append(f"{cls.__module__}.{cls.__qualname__}")
    assert not stray, (f"{stray} do not derive from olmo_tda.errors.TDAError: make them "
                       "`class X(TDAError, <builtin base>)` (or subclass a package error)")
    assert len(defined) >= 10          # the walk found the package's errors (not an empty import)


@pytest.mark.parametrize("name, builtin", [
    ("olmo_tda.config.ConfigError", ValueError),
    ("olmo_tda.capture.eigenbasis.EigenBasisError", ValueError),
    ("olmo_tda.capture.CaptureError", RuntimeError),
    ("olmo_tda.store.StoreError", RuntimeError),
    ("olmo_tda.store.StoreMismatchError", ValueError),
    ("olmo_tda.methods.AttributionError", ValueError),
    ("olmo_tda.methods.optimizer.AdamCorrectionError", ValueError),
    ("olmo_tda.training.trajectory.TrajectoryError", RuntimeError),
    ("olmo_tda.training.selection.SelectionError", RuntimeError),
])
def test_families_keep_their_builtin_base(name, builtin):
    module, _, attr = name.rpartition(".")
    cls = getattr(importlib.import_module(module), attr)
    assert issubclass(cls, TDAError) and issubclass(cls, builtin)


def test_user_errors_are_config_errors():
    from olmo_tda.config import ConfigError
    from olmo_tda.methods import get_method

    with pytest.raises(ConfigError, match="unknown attribution method 'nope'; available: ") as info:
        get_method("nope")
    assert isinstance(info.value, ValueError)       # what callers caught before
