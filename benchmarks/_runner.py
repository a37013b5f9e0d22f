"""What the GPU benchmarks (h2d.py, gds.py) share: each measurement in a child process that
is killed with its whole process group when it runs past --timeout, when the whole run's
--budget ends, or on SIGTERM or Ctrl-C; and a run that is cut short still prints, at once,
everything that finished.

The benchmarks run as scripts (``python benchmarks/h2d.py``), so this folder is on
``sys.path`` and they ``import _runner``; so do the child processes they start, which run
the same script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import selectors
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from stoker.tools.serve import kill_process_group

STDERR_TAIL = 3000  # bytes of a failed child's stderr kept for the report


def say(*parts: object) -> None:
    """Print now: a run cut short still shows everything that finished."""
    print(*parts, flush=True)


class Stop(BaseException):
    """SIGTERM or the budget ends the run (as Ctrl-C does with KeyboardInterrupt): the tables
    are printed from what finished. A BaseException, so no ``except Exception`` swallows it."""


class Interruptible:
    """``with Interruptible("h2d") as measuring:`` around the measurements: SIGTERM raises
    Stop inside it; Stop and Ctrl-C end the block quietly, saying so, with the reason left in
    ``measuring.stopped`` (None if the block ran to its end), so the tables still follow."""

    def __init__(self, program: str) -> None:
        self.program = program
        self.stopped: str | None = None

    def __enter__(self) -> Interruptible:
        signal.signal(signal.SIGTERM, self._raise_stop)
        return self

    @staticmethod
    def _raise_stop(signum, frame) -> None:
        raise Stop(f"signal {signum}")

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is None or not issubclass(kind, (Stop, KeyboardInterrupt)):
            return False
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the tables
        self.stopped = str(error) or kind.__name__
        say(f"\n{self.program}: stopped ({self.stopped}); the tables below hold what finished")
        return True


def why_no_cuda() -> str | None:
    """Why there is no usable CUDA device here (a benchmark then says so and exits with status
    0, so a machine without one is not a failure), or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    timeout: float,
    timeout_help: str,
    measured: str,
    json_help: str,
) -> None:
    """--timeout (default `timeout` seconds), --budget (cutting what `measured` names) and
    --json."""
    parser.add_argument("--timeout", type=float, default=timeout, help=timeout_help)
    parser.add_argument(
        "--budget",
        type=float,
        help=f"seconds for the whole run: {measured} that do not fit are cut or not started",
    )
    parser.add_argument("--json", help=json_help)


@dataclass(frozen=True)
class Slot:
    """How long one measurement's process may run: --timeout, or less where the budget ends
    first (the report says which)."""

    seconds: float
    cut_by_budget: bool

    def timed_out(self) -> str:
        note = " (the budget ran out)" if self.cut_by_budget else ""
        return f"timed out after {self.seconds:.0f} s{note}"


class Limits:
    """--timeout for each measurement and --budget for the whole run, the budget counted from
    when this is made (just after the arguments are read)."""

    def __init__(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        if args.timeout <= 0 or (args.budget is not None and args.budget <= 0):
            parser.error("--timeout and --budget must be positive")
        self.timeout: float = args.timeout
        self.budget: float | None = args.budget
        self.began = time.monotonic()

    def left(self) -> float:
        if self.budget is None:
            return math.inf
        return self.budget - (time.monotonic() - self.began)

    def require(self, seconds: float) -> None:
        """Stop the run unless `seconds` of the budget are left for the next step: a step
        started with less would only be cut."""
        if self.left() < seconds:
            raise Stop(f"the budget of {self.budget:g} s is spent")

    def next_slot(self) -> Slot:
        self.require(5)
        left = self.left()
        return Slot(min(self.timeout, left), left < self.timeout)


@dataclass(frozen=True)
class ChildExit:
    failed: str | None  # why it did not end well ("timed out after 45 s", "exit status 1")
    stderr: str  # the end of its stderr


def run_child(command: list[str], slot: Slot, on_line: Callable[[str], None]) -> ChildExit:
    """Run `command` in a new session (its own process group, so DataLoader workers and other
    children it starts die with it), calling `on_line` with each line of its stdout the moment
    it arrives, so a child killed part-way leaves what it finished. Killed when `slot` runs
    out; Stop and Ctrl-C while it runs kill it too and go on up."""
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: it cannot fill up and block
        proc = None
        deadline = time.monotonic() + slot.seconds
        failed = None
        try:
            proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=err, start_new_session=True
            )
            if not _read_lines(proc, deadline, on_line):
                failed = slot.timed_out()
            else:
                try:  # its stdout is closed; a moment to exit even when the slot is spent
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    failed = slot.timed_out()
        finally:
            kill_process_group(proc)
            if proc is not None:
                proc.stdout.close()
        if failed is None and proc.returncode != 0:
            failed = f"exit status {proc.returncode}"
        err.seek(max(0, err.seek(0, os.SEEK_END) - STDERR_TAIL))
        return ChildExit(failed, err.read().decode(errors="replace"))


def _read_lines(proc: subprocess.Popen, deadline: float, on_line: Callable[[str], None]) -> bool:
    """Hand `proc`'s stdout to `on_line` line by line until it closes (True) or the deadline
    passes (False). Select with a timeout rather than block in a read: the deadline must hold
    however quiet the child is."""
    pending = b""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not selector.select(timeout=min(left, 1.0)):
                continue
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                if pending:  # a last line without its newline
                    on_line(pending.decode(errors="replace"))
                return True
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                on_line(line.decode(errors="replace"))


def stamp_if_current(path: str, want: dict) -> dict | None:
    """The stamp a finished data preparation left at `path`, if it was made for `want`;
    a stale one is removed (the data is written again)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        stamp = json.load(f)
    if all(stamp.get(k) == v for k, v in want.items()):
        return stamp
    os.unlink(path)
    return None
