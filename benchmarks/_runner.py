"""What the benchmarks with --timeout and --budget (arrays.py, h2d.py, gds.py) share: each
measurement in a child process (``stoker.tools.measure``) that is killed with its whole
process group when it runs past --timeout, when the whole run's --budget ends, or on SIGTERM
or Ctrl-C; and a run that is cut short still prints, at once, everything that finished.

The benchmarks run as scripts (``python benchmarks/h2d.py``), so this folder is on
``sys.path`` and they ``import _runner``; so do the child processes they start, which run
the same script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from stoker.tools import measure


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


def run_child(
    command: list[str], slot: Slot, on_line: Callable[[str], None] | None = None
) -> measure.ChildRun:
    """``stoker.tools.measure.run_child`` within `slot`: a child killed when it runs out is
    reported as ``slot.timed_out()``, which says whether the budget cut it."""
    run = measure.run_child(command, timeout=slot.seconds, on_line=on_line)
    if run.killed is not None:
        run.killed = slot.timed_out()
    return run


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
