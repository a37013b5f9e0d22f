"""Running test code on many threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_in_threads(work: Callable[[int], None], count: int) -> None:
    """Run work(0) ... work(count - 1) on `count` threads at once; re-raise the first error."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as e:  # re-raised below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def run_in_fork(check: Callable[[], bool], seconds: float, what: str) -> None:
    """Run check() in a forked child; fail if it returns False, raises, or hangs."""
    import os
    import signal
    import time

    import pytest

    pid = os.fork()
    if pid == 0:  # the child: report by exit status only, never return into pytest
        try:
            os._exit(0 if check() else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, f"{what}: the child failed"
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"{what}: the child hung")
        time.sleep(0.005)
