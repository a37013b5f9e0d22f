"""Files on disk, for every layer: a JSON document read with a located error, a file
written atomically, and where the node cache lives by default."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable

from stoker.errors import ShardFormatError, located


def default_cache_root() -> str:
    """Where the node cache is when no cache_dir is given: $STOKER_CACHE, else
    $XDG_CACHE_HOME/stoker, else ~/.cache/stoker."""
    root = os.environ.get("STOKER_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "stoker")
    return os.path.abspath(root)


def write_atomically(out: str, parts: Iterable[bytes | memoryview]) -> None:
    """Write `parts` to `out` through a temporary file beside it, synced, then renamed: a
    reader sees the old file or the whole new one, and a crash leaves no short file under
    the name. The file is readable as others are (the umask's mode, not mkstemp's 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=".stoker-", suffix=".tmp", dir=os.path.dirname(out) or ".")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_json(path: str, what: str) -> object:
    """The JSON document at `path` (`what` it should be, for the error otherwise)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        raise located(ShardFormatError, path, 0, f"not readable {what} ({e})") from e
