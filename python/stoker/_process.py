"""What belongs to one process, written once: values made on first use in each process,
hooks that run in a forked child, background threads, and waits Ctrl-C can interrupt.

A DataLoader worker is a forked child. The parent's threads do not exist there, and a
lock another thread of the parent held at the fork stays held forever. So every registry
of threads, event loops, locks or descriptors lives here, and a child starts afresh."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import os
import queue
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_values: dict[Hashable, tuple[int, Any]] = {}
_child_hooks: list[Callable[[], None]] = []


def per_process(key: Hashable, make: Callable[[], T]) -> T:
    """The value ``make()`` gave in this process for `key`; made on first use, and again
    in a forked child."""
    pid = os.getpid()
    with _lock:
        found = _values.get(key)
        if found is None or found[0] != pid:
            found = _values[key] = (pid, make())
        return found[1]


def values() -> list[Any]:
    """Every value this process made with per_process."""
    pid = os.getpid()
    with _lock:
        return [value for owner, value in _values.values() if owner == pid]


class ProcessLocal(Generic[T]):
    """An object's piece of per-process state (a lock, a thread pool): made on first use
    in each process, and not pickled (the other side makes its own)."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._pid = 0
        self._value: T | None = None

    def get(self) -> T:
        pid = os.getpid()
        if self._pid != pid:
            with _lock:
                if self._pid != pid:
                    self._value, self._pid = self._make(), pid
        return self._value  # type: ignore[return-value]

    def __getstate__(self) -> dict[str, Any]:
        return {"_make": self._make, "_pid": 0, "_value": None}


def in_forked_child(hook: Callable[[], None]) -> Callable[[], None]:
    """Run `hook` in every forked child, right after the fork. Usable as a decorator."""
    _child_hooks.append(hook)
    return hook


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # (the parent's values stay, unused: their owner pid differs)
    for hook in _child_hooks:
        hook()


os.register_at_fork(after_in_child=_after_fork_in_child)


def wait_result(future: concurrent.futures.Future) -> Any:
    """``future.result()``, waited in short slices so that Ctrl-C gets through."""
    while True:
        try:
            return future.result(timeout=0.05)
        except concurrent.futures.TimeoutError:
            continue


class DaemonPool:
    """Threads for work that waits (on locks, room, downloads). Daemons: a process that is
    exiting does not wait for work it no longer needs."""

    def __init__(self, workers: int, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((future, fn))
        return future

    def _work(self) -> None:
        while True:
            future, fn = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)
            del future, fn


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block: opening a dataset of a hundred
    thousand shards makes as many dicts that all stay alive, and each collection the
    allocations set off would walk every one of them again (none is garbage)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def usable_cores() -> int:
    """Cores this process may run on (a container or taskset may allow fewer than exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def daemon_pool(workers: int, name: str) -> DaemonPool:
    """This process's pool of `workers` daemon threads called `name`."""
    return per_process(("daemon-pool", name, workers), lambda: DaemonPool(workers, name))


def shared_reader(num_threads: int | None = None) -> Any:
    """The process's ShardReader for `num_threads` (0 or None: one per core).

    One pool of threads serves every dataset; the reader rebuilds it by itself in a forked
    child (a DataLoader worker), so this is safe across fork.
    """
    import stoker._core as _core  # (the extension, not imported before a reader is wanted)

    key = (num_threads or 0, 256)

    def make() -> Any:
        reader = _core.ShardReader(*key)
        limit = _decoded_cache_limit()
        if limit is not None:
            reader.chunk_cache_bytes = limit
        return reader

    return per_process(("shard-reader", key), make)


DECODED_CACHE_VARIABLE = "STOKER_DECODED_CACHE_BYTES"


def set_decoded_cache_bytes(limit: int) -> None:
    """Sets the most bytes of decoded chunks each process keeps across batches: decoded
    Parquet column chunks and HDF5, Zarr and TIFF chunks (256 MiB unless set; 0 keeps
    none). The cache starts smaller and grows only as far as what is read again needs
    and fits (see the docs' Arrays page). Readers already made take the new limit, and
    drop what they held; so do DataLoader workers started after the call, forked or
    spawned (the limit is passed on in the environment, as STOKER_DECODED_CACHE_BYTES,
    which may also be set before the program starts)."""
    from stoker.errors import UsageError

    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise UsageError(f"set_decoded_cache_bytes takes a whole number of bytes, not {limit!r}")
    os.environ[DECODED_CACHE_VARIABLE] = str(limit)
    for value in values():
        if hasattr(value, "chunk_cache_bytes"):  # the process's readers
            value.chunk_cache_bytes = limit


def _decoded_cache_limit() -> int | None:
    text = os.environ.get(DECODED_CACHE_VARIABLE)
    if text is None or not text.strip():
        return None
    try:
        limit = int(text)
    except ValueError:
        limit = -1
    if limit < 0:
        from stoker.errors import UsageError

        raise UsageError(f"{DECODED_CACHE_VARIABLE} is a whole number of bytes, not {text!r}")
    return limit
