"""What stoker's jobs on Ray share: Ray found (or a UsageError saying how to install it), a
cluster joined, and a list of work items run as Ray tasks, one item a task, their results
streamed back to the driver as each ends.

Ray runs a task again when its worker dies (a node lost, a process killed); one that
raises is not run again, and its error is raised in the driver. Work items therefore write
nothing a reader could take for finished before they end: each moves its output into place
once whole.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any

from stoker.errors import StokerError, UsageError

#: Set to a file path in the driver's environment, a task writing a shard kills its own
#: worker once, halfway through its shard, where that file does not exist yet (it makes it
#: first): the tests' way to see Ray run a task again.
KILL_ONCE_ENV = "STOKER_RAY_TEST_KILL_ONCE"


def require_ray() -> Any:
    """The ray module, or a UsageError that says how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401  (the tasks are Ray Data's)
    except ImportError as e:
        raise UsageError(f"this needs Ray Data ({e}): pip install 'stoker[ray]' (ray[data])") from e
    return ray


def connect(address: str | None) -> Any:
    """The ray module, connected: to the cluster at `address` ("auto": the one this
    machine is part of), else to the one already joined, else to the one ``RAY_ADDRESS``
    names, else to a new local one."""
    ray = require_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except ConnectionError as e:
            raise ConnectionError(f"{e}{_token_hint(address)}") from e
    return ray


def _token_hint(address: str | None) -> str:
    """How to reach a cluster that wants a token, where that may be why a join failed.

    Clusters started by ``ray start`` (Ray 2.5x) check a token, which Ray looks for only
    when the address is ``auto`` or RAY_AUTH_MODE says so."""
    token = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if address in (None, "auto") or "RAY_AUTH_MODE" in os.environ:
        return ""
    where = "the token in ~/.ray/auth_token" if os.path.exists(token) else "RAY_AUTH_TOKEN"
    return (
        f" (a cluster with token authentication is joined with --ray auto on one of its"
        f" nodes, or with RAY_AUTH_MODE=token and {where})"
    )


#: Times Ray runs a task again whose worker died (an error the task raised is not retried).
TASK_RETRIES = 3


def run_each(
    count: int,
    work: Callable[[int], str],
    address: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[int, str]]:
    """``work(i)`` for i in [0, count), each a Ray task; yields (i, its result) as tasks end,
    in no set order. `work` is put in Ray's object store once, pickled, and unpickled once
    per worker process: what it holds (a Dataset's index, a plan) travels once to each
    worker, not with each task. Tasks in flight are kept to a few per CPU of the cluster,
    so that a million items cost the driver no more than a thousand. A task that raises
    ends the job with its error; one whose worker dies is run again, TASK_RETRIES times.

    These are Ray Core tasks: a job's first ends after about 1 s, then 10 ms a task here,
    against 2.3 s and 23 ms through Ray Data (measured on 2 cores, benchmarks/pack.py).
    `env`: variables set in the tasks' workers (beside the job's own)."""
    ray = connect(address)
    # (in a list: Ray hands a task its ObjectRef then, not the object, so that each
    # worker unpickles the work once, on its first task, see _run_one)
    held = [ray.put(cloudpickle_dumps(work))]
    options: dict[str, Any] = {"max_retries": TASK_RETRIES, "scheduling_strategy": "SPREAD"}
    if env:
        options["runtime_env"] = {"env_vars": env}
    task = ray.remote(**options)(_run_one)
    most = max(2, 4 * int(ray.cluster_resources().get("CPU", 1)))
    waiting: dict[Any, int] = {}
    next_item = 0
    try:
        while next_item < count or waiting:
            while next_item < count and len(waiting) < most:
                waiting[task.remote(held, next_item)] = next_item
                next_item += 1
            done, _ = ray.wait(list(waiting), num_returns=1)
            for ref in done:
                item = waiting.pop(ref)
                yield item, _result(ray, ref)
    finally:
        for ref in waiting:  # a task failed, or the caller stopped: the rest are not needed
            ray.cancel(ref)


def _result(ray: Any, ref: Any) -> str:
    """A task's result, or its error: a StokerError or OSError as the task raised it (its
    message names the file), anything else as Ray's error, with the task's traceback."""
    try:
        return str(ray.get(ref))
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, (StokerError, OSError)):
            raise cause from None
        raise


def cloudpickle_dumps(work: Callable[[int], str]) -> bytes:
    from ray import cloudpickle

    dumps: Callable[[object], bytes] = cloudpickle.dumps
    return bytes(dumps(work))


#: This worker's work function: the ObjectRef it came in, and the function.
_WORK: list[Any] = [None, None]


def _run_one(held: list[Any], item: int) -> str:
    import ray

    if _WORK[0] != held[0]:
        _WORK[:] = [held[0], pickle.loads(ray.get(held[0]))]
    return _WORK[1](item)


def die_once(marker: str) -> bool:
    """Whether this is the one time to die (see KILL_ONCE_ENV): the marker made now."""
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    return True
