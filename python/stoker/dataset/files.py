"""Datasets of loose files: a CSV of ``filename,label`` rows and the folder it names, or
any list of file names. Each file is one sample; its key is the name up to the first dot
of its base name, its field the rest, by the rule shard members follow."""

from __future__ import annotations

import csv as csv_module
import os
from collections.abc import Sequence

import numpy as np

import stoker._core as _core
from stoker.errors import ReadError, ShardFormatError, located


def files_index(root: str, names: Sequence[str], source: str) -> tuple[list[str], np.ndarray, dict]:
    """The paths, identities and one index (every file a sample of one member) of files
    `names` under `root`. Files that cannot be read are reported together (the first few
    and the count), as being listed in `source`."""
    paths = [os.path.join(root, name) for name in names]
    identities, errors = _core.stat_files(paths, 0)
    missing = np.flatnonzero(errors)
    if len(missing):
        shown = ", ".join(paths[i] for i in missing[:5])
        raise located(
            ReadError,
            paths[missing[0]],
            0,
            f"{len(missing)} file(s) listed in {source} cannot be read "
            f"({os.strerror(int(errors[missing[0]]))}): {shown}",
        )
    sizes = identities[:, 1].astype(np.uint64)
    keys, fields = zip(*(_split_name(name) for name in names)) if names else ((), ())
    field_names = sorted(set(fields))
    field_id = {name: i for i, name in enumerate(field_names)}
    n = len(paths)
    index = {
        "format": "files",
        "keys": list(keys),
        "field_names": field_names,
        "sample_start": np.arange(n + 1, dtype=np.uint32),
        "member_field": np.array([field_id[f] for f in fields], dtype=np.uint16),
        "member_offset": np.zeros(n, np.uint64),
        "member_length": sizes,
        "member_out_length": sizes,
        "member_codec": np.zeros(n, np.uint8),
        "member_crc": np.zeros(n, np.uint32),
    }
    return paths, identities, index


def read_labels_csv(path: str | os.PathLike[str]) -> tuple[list[str], np.ndarray]:
    """The file names and integer labels of a ``filename,label`` CSV (a header row is
    detected and skipped, blank lines ignored). Every bad row is found in one pass and
    reported with its line number: the first few and the count."""
    path = os.fspath(path)
    rows: list[tuple[int, list[str]]] = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv_module.reader(f)
            for row in reader:
                if any(cell.strip() for cell in row):
                    rows.append((reader.line_num, [cell.strip() for cell in row]))
    except (UnicodeDecodeError, csv_module.Error) as e:
        raise located(ShardFormatError, path, 0, f"not a filename,label CSV: {e}") from e
    wrong = [(line, row) for line, row in rows if len(row) != 2]
    if wrong:
        line, row = wrong[0]
        raise located(
            ShardFormatError,
            path,
            0,
            f"not a filename,label CSV: line {line} has {len(row)} fields "
            f"({len(wrong)} such row(s))",
        )
    if rows and not _is_integer(rows[0][1][1]):  # a header row
        rows = rows[1:]
    bad = [
        (line, name, label) for line, (name, label) in rows if not name or not _is_integer(label)
    ]
    if bad:
        shown = ", ".join(f"line {line}: {name!r},{label!r}" for line, name, label in bad[:5])
        raise located(
            ShardFormatError,
            path,
            0,
            f"{len(bad)} row(s) without a file name or an integer label ({shown})",
        )
    return [name for _, (name, _) in rows], np.array([int(row[1]) for _, row in rows], np.int64)


def _is_integer(text: str) -> bool:
    text = text.strip()
    if text and text[0] in "+-":
        text = text[1:]
    return text.isascii() and text.isdigit()


def _split_name(name: str) -> tuple[str, str]:
    """Key and field of a file name, by the same rule as shard members."""
    folder, base = os.path.split(name)
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        stem, ext = base, "bin"
    return (os.path.join(folder, stem) if folder else stem), ext.lower()
