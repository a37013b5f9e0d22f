"""What measuring needs, for ``stoker bench`` and the scripts in benchmarks/: a child process
run under a time (and memory) limit, peak RSS, and the page cache warmed or dropped.

A measurement runs in a process of its own so that one loader's threads, workers, imports
and memory do not colour the next one's figures. ``run_child`` starts it in a session of its
own (its process group holds whatever it starts: DataLoader workers, curl, a forked pool),
hands its stdout over line by line as it arrives, so that a child killed part-way still
leaves what it finished, and kills the whole group when it runs past its time, past an RSS
limit, or when the caller is interrupted. A child reports its result as a JSON object on its
last line of stdout; ``ChildRun.result`` is that object.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

STDERR_TAIL = 3000  # bytes of a child's stderr kept for the report
#: ``ChildRun.killed`` of the other children of a group that one child's failure ended.
SIBLING_FAILED = "killed: another child failed"
_POLL = 0.1  # seconds between looks at the children's RSS, clock and exit

# -- peak RSS -------------------------------------------------------------------


def proc_status_bytes(key: str, path: str = "/proc/self/status") -> int:
    """The value of a ``Key:  N kB`` line of a /proc file (``VmRSS:``, ``VmHWM:`` in
    /proc/PID/status, ``Pss:`` in smaps_rollup), in bytes."""
    with open(path) as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise LookupError(f"{key} not in {path}")


def peak_rss_bytes(pid: int | str = "self") -> int:
    """A process's peak RSS so far (VmHWM). Not ``ru_maxrss``: a child started by fork or
    vfork inherits its parent's high-water mark there, so a small child under a large
    parent would report the parent's."""
    return proc_status_bytes("VmHWM:", f"/proc/{pid}/status")


def children_peak_rss_bytes() -> int:
    """The largest peak RSS of this process's children that have exited and been waited
    for (DataLoader workers, once the loader is done with them)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


# -- the page cache ---------------------------------------------------------------


@dataclass(frozen=True)
class ReadThrough:
    """What ``read_through`` read, and how long it took."""

    nbytes: int
    seconds: float
    first_s: float  # to the first chunk


def read_through(
    paths: Iterable[str], *, chunk: int = 16 << 20, limit: int | None = None
) -> ReadThrough:
    """Read `paths` front to back, `chunk` bytes at a time, unbuffered, stopping after
    `limit` bytes if given; a folder stands for every file under it. It is how the page
    cache is warmed, and timed it is the sequential-read ceiling (the measurements that
    report one give their own `chunk`). An OSError names the file it came from."""
    buffer = bytearray(chunk)
    total = 0
    first = None
    start = time.perf_counter()
    for path in _files(paths):
        try:
            with open(path, "rb", buffering=0) as f:
                while limit is None or total < limit:
                    n = f.readinto(buffer)
                    if not n:
                        break
                    total += n
                    if first is None:
                        first = time.perf_counter() - start
        except OSError as e:
            if e.filename is None:
                e.filename = path
            raise
        if limit is not None and total >= limit:
            break
    seconds = time.perf_counter() - start
    return ReadThrough(total, seconds, first if first is not None else seconds)


def _files(paths: Iterable[str]) -> Iterable[str]:
    for path in paths:
        if os.path.isdir(path):
            for top, _, names in os.walk(path):
                yield from (os.path.join(top, name) for name in names)
        else:
            yield path


def evict_from_page_cache(path: str) -> None:
    """Best effort, without root: write the file back, then ask the kernel to drop its
    cached pages (``posix_fadvise(POSIX_FADV_DONTNEED)``; pages mapped or in use stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_page_cache() -> None:
    """Empty the whole page cache (and the dentry and inode caches): ``sync``, then
    ``3 > /proc/sys/vm/drop_caches``. Root only; raises PermissionError otherwise."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# -- a measurement in a child process ---------------------------------------------


@dataclass
class ChildRun:
    """How a child process ended, and what it said."""

    command: list[str]
    returncode: int | None = None
    killed: str | None = None  # why it was killed ("timed out after 60 s"), None if not
    lines: list[str] = field(default_factory=list)  # its stdout
    stderr: str = ""  # the end of its stderr
    peak_rss: int = 0  # its VmHWM in bytes as last seen (read every 0.1 s while it ran)

    @property
    def failed(self) -> str | None:
        """Why it did not end well ("timed out after 60 s", "exit status 1"), or None."""
        if self.killed is not None:
            return self.killed
        if self.returncode != 0:
            return f"exit status {self.returncode}"
        return None

    @property
    def result(self) -> dict[str, Any] | None:
        """The JSON object on its last non-empty line of stdout, or None."""
        printed = [line for line in self.lines if line.strip()]
        if not printed:
            return None
        try:
            value = json.loads(printed[-1])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


def run_child(
    command: Sequence[str],
    *,
    timeout: float,
    on_line: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
    rss_limit: float | None = None,
) -> ChildRun:
    """Run `command` as a measurement (see the module's docstring), killing its process
    group after `timeout` seconds or when its RSS passes `rss_limit` bytes, and calling
    `on_line` with each line of its stdout the moment it arrives. An exception while it runs
    (Ctrl-C, a SIGTERM handler's) kills it too and goes on up."""
    (run,) = run_children([command], timeout=timeout, on_line=on_line, env=env, rss_limit=rss_limit)
    return run


def run_children(
    commands: Sequence[Sequence[str]],
    *,
    timeout: float,
    on_line: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
    rss_limit: float | None = None,
) -> list[ChildRun]:
    """``run_child`` for children that run at once and stand or fall together (the ranks of
    one job): all are killed when their summed RSS passes `rss_limit`, when `timeout`
    passes, or when one of them fails (the others get ``SIBLING_FAILED``: they could be
    waiting for it). `on_line` hears every child's lines."""
    children: list[_Child] = []
    try:
        for command in commands:
            children.append(_Child(list(command), env))
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for child in children:
                selector.register(child.stdout, selectors.EVENT_READ, child)
            while any(child.proc.poll() is None for child in children):
                reason = _reason_to_stop(children, deadline, timeout, rss_limit)
                if reason is not None:
                    for child in children:
                        if child.proc.poll() is None:
                            child.run.killed = reason
                    break
                left = max(0.0, deadline - time.monotonic())
                for key, _ in selector.select(timeout=min(_POLL, left)):
                    if not key.data.take(on_line):
                        selector.unregister(key.fileobj)
    except BaseException:
        for child in children:
            child.close()
        raise
    finally:
        for child in children:  # the group: workers a child left would hold its pipes
            kill_process_group(child.proc)
    for child in children:
        child.finish(on_line)
    return [child.run for child in children]


def kill_process_group(proc: subprocess.Popen[Any] | None, grace: float = 0.0) -> None:
    """Kill the process group of `proc` (started with ``start_new_session``) and reap
    `proc`: SIGTERM first and up to `grace` seconds to go, if `grace`, then SIGKILL. The
    group is killed even after `proc` has exited, since what it started (DataLoader workers)
    can outlive it, holding its pipes and memory; the group keeps its id while any member
    lives, so the signal cannot reach a stranger."""
    if proc is None:
        return
    if grace > 0 and proc.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # no such group any more, or a member we may not signal
        proc.kill()  # does nothing once proc is reaped
    proc.wait()


class _Child:
    """One running child: its process, its stdout as it comes, its stderr in a file."""

    def __init__(self, command: list[str], env: dict[str, str] | None) -> None:
        self.run = ChildRun(command)
        # stderr to a file, not a pipe: it is read only at the end, and a full pipe would
        # block the child
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        try:
            self.proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=self.stderr, env=env, start_new_session=True
            )
        except BaseException:
            self.stderr.close()
            raise
        assert self.proc.stdout is not None
        self.stdout = self.proc.stdout
        os.set_blocking(self.stdout.fileno(), False)
        self.pending = b""
        self.closed = False

    def take(self, on_line: Callable[[str], None] | None) -> bool:
        """Hand over the whole lines its stdout has; False once it is closed."""
        try:
            chunk = os.read(self.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return True
        if not chunk:
            self.closed = True
            return False
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        for line in lines:
            self._hand_over(line, on_line)
        return True

    def finish(self, on_line: Callable[[str], None] | None) -> None:
        """After the kill: the lines still in the pipe (a killed child's half-written last
        line is dropped), the exit status, the end of stderr."""
        give_up = time.monotonic() + 1.0  # a process that left the group may hold the pipe
        with selectors.DefaultSelector() as selector:
            selector.register(self.stdout, selectors.EVENT_READ)
            while not self.closed and time.monotonic() < give_up:
                if selector.select(timeout=0.1):
                    self.take(on_line)
        if self.pending and self.run.killed is None:
            self._hand_over(self.pending, on_line)
        self.run.returncode = self.proc.returncode
        self.stderr.seek(max(0, self.stderr.seek(0, os.SEEK_END) - STDERR_TAIL))
        self.run.stderr = self.stderr.read().decode(errors="replace")
        self.close()

    def close(self) -> None:
        self.stdout.close()
        self.stderr.close()

    def _hand_over(self, line: bytes, on_line: Callable[[str], None] | None) -> None:
        text = line.decode(errors="replace")
        self.run.lines.append(text)
        if on_line is not None:
            on_line(text)


def _reason_to_stop(
    children: list[_Child], deadline: float, timeout: float, rss_limit: float | None
) -> str | None:
    """Why the running children must be killed now, or None; notes their peak RSS."""
    rss = 0
    for child in children:
        if child.proc.poll() is None:
            with contextlib.suppress(OSError, LookupError):  # it has just exited
                child.run.peak_rss = max(child.run.peak_rss, peak_rss_bytes(child.proc.pid))
                rss += proc_status_bytes("VmRSS:", f"/proc/{child.proc.pid}/status")
    if rss_limit is not None and rss > rss_limit:
        return f"> {rss_limit / 1e9:g} GB (killed)"
    if time.monotonic() >= deadline:
        return f"timed out after {timeout:g} s"
    if len(children) > 1 and any(child.proc.returncode not in (None, 0) for child in children):
        return SIBLING_FAILED
    return None
