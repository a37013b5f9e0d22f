"""Writers' unfinished work: a hidden folder beside (or in) the output, named for the host
and process that write it, whose files are moved into place only when they are complete.

A folder scan (``stoker.Dataset(folder)``) never reads hidden entries, so a writer that
was killed leaves nothing that opens as data. The next writer into the same place removes
the work folders of this host whose process is gone; those of other hosts (a shared file
system) and of live processes are left alone.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket

log = logging.getLogger("stoker.writer")

WORK_FOLDER = re.compile(r"\.stoker-(?P<kind>writer|pack)-(?P<pid>\d+)-[0-9a-f]+-(?P<host>.+)\Z")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def make_work_folder(parent: str, kind: str) -> str:
    """A new hidden work folder in `parent` for a writer of `kind` ("writer", "pack")."""
    name = f".stoker-{kind}-{os.getpid()}-{secrets.token_hex(4)}-{_host()}"
    path = os.path.join(parent, name)
    os.makedirs(path)
    return path


def remove_dead_work(parent: str) -> list[str]:
    """Remove the work folders in `parent` that writers of this host left when their
    process died; returns their names."""
    try:
        names = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    host, removed = _host(), []
    for name in sorted(names):
        found = WORK_FOLDER.match(name)
        if found is None or found["host"] != host:
            continue
        pid = int(found["pid"])
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        removed.append(name)
    if removed:
        log.warning(
            "%s: removed %d work folder(s) of writers that died before finishing (%s)",
            parent,
            len(removed),
            ", ".join(removed[:3]) + (", ..." if len(removed) > 3 else ""),
        )
    return removed
