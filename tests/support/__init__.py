"""What the tests share: shard writers, servers, the CUDA stand-in, process helpers."""

from __future__ import annotations

from pathlib import Path

#: The repository's root: ``tests`` is importable from here.
REPO = str(Path(__file__).resolve().parents[2])
#: The test data kept in the repository.
DATA = Path(REPO) / "tests" / "data"


def child_preamble(module: str) -> str:
    """Python source for ``python -c`` that imports the test module `module` (its
    ``__name__``) as ``m`` in a child process, wherever the test files live."""
    return (
        f"import sys, json, importlib\nsys.path.insert(0, {REPO!r})\n"
        f"m = importlib.import_module({module!r})\n"
    )
