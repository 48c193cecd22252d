"""Writer locks: one live writer per rank, and a way to tell a dead writer's debris."""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

from .errors import StoreError, describe_os_error
from .format import LOCK_DIR

__all__ = ["LOCK_WAIT_S", "RankLock"]

logger = logging.getLogger(__name__)

LOCK_WAIT_S = 5.0
"""How long a new writer waits for its rank's lock: readers and other ranks' writers take it briefly
while scanning for a dead writer's debris (concurrent start of several ranks), a live writer keeps it."""


class RankLock:
    """An exclusive ``flock`` on ``locks/r{rank}.lock``, held by a rank's writer while it is alive.

    The kernel drops it when the process dies (also on SIGKILL), so a lock that can be taken means
    that rank's ``*.tmp`` files are debris. On filesystems without flock support the lock is a no-op
    (``held`` is False) and tmp files of other ranks are then never deleted.
    """

    def __init__(self, fd: int | None, path: Path):
        self._fd = fd
        self.path = path

    @property
    def held(self) -> bool:
        return self._fd is not None

    @classmethod
    def acquire_for_writing(cls, root: Path, rank: int) -> "RankLock":
        path = root / LOCK_DIR / f"r{rank:05d}.lock"
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(f"cannot create the writer lock {path} of rank {rank} in gradient store {root}: "
                             f"{describe_os_error(e)}") from e
        deadline = time.monotonic() + LOCK_WAIT_S
        try:
            while True:   # another rank's scan holds this lock for milliseconds: wait that out
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.02)
        except BlockingIOError:
            os.close(fd)
            raise StoreError(
                f"rank {rank} of gradient store {root} is already being written (lock {path} is held "
                "by another writer, in this or another process); close it first, or give each "
                "process its own rank") from None
        except OSError as e:
            os.close(fd)
            logger.warning("gradient store %s: flock unsupported here (%s); concurrent writers of "
                           "rank %d will not be detected", root, e, rank)
            return cls(None, path)
        return cls(fd, path)

    @classmethod
    def try_acquire(cls, root: Path, rank: int) -> "RankLock | None":
        """The lock if no live writer holds it (a missing lock file: no writer ever ran), else None."""
        path = root / LOCK_DIR / f"r{rank:05d}.lock"
        try:
            fd = os.open(path, os.O_RDONLY)  # read-only suffices for flock; works on a read-only mount
        except FileNotFoundError:
            return cls(None, path)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None  # held by a live writer, or flock unsupported: assume alive
        return cls(fd, path)

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None
