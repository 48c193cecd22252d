"""Errors of the gradient store; every message names the path involved and what to do."""

from __future__ import annotations

import errno
import os

from ..errors import TDAError

__all__ = ["StoreError", "StoreMismatchError", "StoreCorruptError", "StoreWriteError", "describe_os_error"]


class StoreError(TDAError, RuntimeError):
    """Base class of every gradient-store failure; the message names the path and a remedy."""


class StoreMismatchError(StoreError, ValueError):
    """An append or read was refused because the store was written with different settings."""


class StoreCorruptError(StoreError):
    """A finalized shard or manifest cannot be read; ``GradientStore.open(path, repair=True)`` quarantines it."""


class StoreWriteError(StoreError):
    """Writing a shard failed in the background writer; nothing already durable was damaged."""


def describe_os_error(exc: BaseException, full_remedy: str = "Free space or move store.path") -> str:
    """Human cause of an I/O failure; disk-full (``full_remedy``: what to do about it, for the files
    at hand) and file-too-large get a plain-words remedy."""
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC or code == errno.EDQUOT:
        return f"the disk is full (or the quota is exhausted): {exc}. {full_remedy}"
    if code == errno.EFBIG:
        return f"file too large for this filesystem or process limit (ulimit -f): {exc}"
    if code == errno.ENOTDIR:
        return f"a parent of the path is a regular file, not a directory: {exc}"
    if code == errno.EEXIST:
        return f"the path exists and is not a directory: {exc}"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"the location is not writable ({os.strerror(code)}): {exc}"
    return f"{type(exc).__name__}: {exc}"
