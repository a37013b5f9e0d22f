"""The array formats a Dataset reads, by name: each format's module registers how its
sources are opened, and ``stoker.arrays`` looks the opener up by the name that
``stoker.formats`` gives a source. Which name a file or store has is decided there, not
here, so that the table of source kinds stays in one place."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stoker.arrays.array_fields import ArrayField
from stoker.errors import StokerError

#: (inode, size, modification time in ns) of what was opened; zeros where there is no one
#: file to check (a store's chunks are checked each as it is read).
Identity = tuple[int, int, int]


@dataclass(frozen=True)
class ArrayFormat:
    """How sources of one array format are opened.

    `find_arrays(path, arrays)` gives the source's rows and its fields (each of `arrays`,
    else every array whose first axis has the source's length); `identity(path)` what reads
    check the source against.
    """

    name: str
    find_arrays: Callable[[str, Sequence[str] | None], tuple[int, list[ArrayField]]]
    identity: Callable[[str], Identity]


_FORMATS: dict[str, ArrayFormat] = {}


def register(array_format: ArrayFormat) -> None:
    """Make `array_format` the opener of sources of its name."""
    _FORMATS[array_format.name] = array_format


def array_format_named(name: str) -> ArrayFormat:
    """The registered opener of array format `name` ("hdf5", "zarr")."""
    found = _FORMATS.get(name)
    if found is None:
        raise StokerError(f"internal: no array format {name!r} is registered")
    return found
