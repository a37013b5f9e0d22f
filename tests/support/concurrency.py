"""Running test code on many threads, or processes, at once."""

from __future__ import annotations

import subprocess
import sys
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
    import faulthandler
    import os
    import signal
    import time

    import pytest

    pid = os.fork()
    if pid == 0:  # the child: report by exit status only, never return into pytest
        try:
            # A child about to be killed as hung first says where it is (on stderr, which
            # pytest shows with the failure).
            faulthandler.dump_traceback_later(max(seconds - 1, 0.5), exit=False)
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


_CHILD = """
import sys, numpy as np, stoker
urls, cache = sys.argv[2:], sys.argv[1]
ds = stoker.Dataset(urls, cache_dir=cache)
batch = ds.get_batch(np.arange(len(ds)))
print(len(batch))
"""


def open_in_processes(urls: list[str], cache: str, processes: int) -> list[str]:
    """`processes` Python processes at once, each opening `urls` on the cache `cache` and
    reading every sample; what each printed (its sample count)."""
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, cache, *urls],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    out = []
    for child in children:
        stdout, stderr = child.communicate(timeout=120)
        assert child.returncode == 0, stderr
        out.append(stdout.strip())
    return out
