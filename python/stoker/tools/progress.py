"""Progress bars for the command line: tqdm's where it is installed (``pip install
'stoker[cli]'``), else none; the work done is the same either way."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class _NoBar:
    """What the tools use of a tqdm bar, doing nothing."""

    def __init__(self, iterable: Iterable[Any] | None) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterable or ())

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


def progress_bar(iterable: Iterable[Any] | None = None, **options: Any) -> Any:
    """``tqdm(iterable, **options)``, or a bar that shows nothing without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(iterable)
    return tqdm(iterable, **options)
