"""Locks on files that every process of the node shares: open-file-description locks
(``F_OFD_SETLK``), which die with their process and are not dropped when some other
descriptor of the same file is closed; and the private folders the cache keeps them in."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
import time

from stoker._process import in_forked_child
from stoker.errors import StokerError


def _flock(kind: int) -> bytes:
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 0, 0)


def try_lock(fd: int, exclusive: bool) -> bool:
    """Lock the file of `fd` (shared, or `exclusive`) unless another process's lock is in
    the way; whether it is locked now."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def wait_for_lock(fd: int, exclusive: bool, deadline: float, what: str) -> None:
    """Lock the file of `fd`, trying again until `deadline` (StokerError about `what`
    after): an OFD lock has no blocking form that a deadline can cut short."""
    delay = 0.002
    while not try_lock(fd, exclusive):
        if time.monotonic() > deadline:
            raise StokerError(f"{what}: still locked by another process after waiting")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


# Every descriptor that carries a lock, so a forked child can close its copies: a lock
# on an open file description lasts while any copy of it is open, and a child that kept
# one would keep the parent's lock after the parent let go.
_lock_fds: set[int] = set()
_lock_fds_lock = threading.Lock()


def open_locked_fd(path: str, flags: int) -> int:
    """A descriptor of `path` to take locks on, closed in a forked child."""
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with _lock_fds_lock:
        _lock_fds.add(fd)
    return fd


def close_locked_fd(fd: int) -> None:
    with _lock_fds_lock:
        _lock_fds.discard(fd)
    os.close(fd)


@in_forked_child
def _close_parents_lock_fds() -> None:
    global _lock_fds_lock
    _lock_fds_lock = threading.Lock()
    for fd in _lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _lock_fds.clear()


def private_dirs(path: str) -> None:
    """makedirs with every folder it makes private to the user (makedirs' own mode only
    reaches the last one)."""
    if os.path.isdir(path):
        return
    private_dirs(os.path.dirname(path))
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
