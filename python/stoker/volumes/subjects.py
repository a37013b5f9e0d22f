"""Subjects: each one or more arrays on one grid (an image and its label), as MONAI's data
lists hold them."""

from __future__ import annotations

import csv
import glob
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from stoker._process import usable_cores
from stoker.errors import ReadError, UsageError, located
from stoker.volumes.arrays import (
    VOLUME_SUFFIXES,
    VolumeArray,
    check_same_space,
    is_volume_path,
)
from stoker.volumes.opening import open_volume_array


class Volumes:
    """Subjects whose arrays patches are read from.

    Each subject is a dict of arrays by key, as in MONAI's data lists: ``{"image":
    "ct_001.nii.gz", "label": "seg_001.nii.gz"}``. An array is a ``.npy``, ``.nii`` or
    ``.nii.gz`` file; a Zarr array or an HDF5 dataset (``"ct_001.zarr:/image"``,
    ``"ct_001.h5:/image"``, or the store alone when it holds one array); or a TIFF
    (``.tif``, ``.tiff``, ``.svs``: tiled or stripped, a pyramid's level chosen by
    `level`). Values that are not arrays (an ``"id"``, an age) are kept as the subject's
    metadata. Every subject has the same keys. Headers are read when the Volumes are
    made: shapes and affines are checked then, and an error names the subject and the
    file.

    A ``.nii.gz`` is inflated once into the node cache (``cache_dir``) when the Volumes
    are made (a volume a core), and patches are read from that copy. Chunked arrays and
    tiled images are read by chunk or tile: a patch decodes only those it touches.

    Args:
        subjects: A list of such dicts; or the path of a CSV file whose header names the
            keys (relative paths are relative to the CSV's folder).
        spatial_dims: 3 for volumes, 2 for images; patch sizes must have as many.
        cache_dir: The node cache (default ``$STOKER_CACHE``, else ``~/.cache/stoker``).
        affine_tolerance: How far two arrays' affines may differ, per element.
        level: The pyramid level of TIFF arrays (0: full resolution); other arrays have
            one level.

    Raises:
        UsageError: Subjects with other keys, arrays of one subject on different grids.
        ShardFormatError: A file that is not what its name says, or truncated.
        ReadError: A file that cannot be read.
    """

    def __init__(
        self,
        subjects: Sequence[Mapping[str, Any]] | str | os.PathLike[str],
        *,
        spatial_dims: int = 3,
        cache_dir: str | os.PathLike[str] | None = None,
        affine_tolerance: float = 1e-3,
        level: int = 0,
    ) -> None:
        if isinstance(subjects, (str, os.PathLike)):
            subjects = _read_csv(os.fspath(subjects))
        rows = [dict(s) for s in subjects]
        if not rows:
            raise UsageError("Volumes: no subjects")
        if spatial_dims not in (2, 3):
            raise UsageError(f"Volumes(spatial_dims={spatial_dims}): 2 or 3")
        self.spatial_dims = spatial_dims
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self.keys = tuple(k for k, v in rows[0].items() if is_volume_path(v))
        if not self.keys:
            raise UsageError(
                f"Volumes: the first subject names no array file (one of {VOLUME_SUFFIXES}): "
                f"{rows[0]}"
            )
        for i, row in enumerate(rows):
            keys = tuple(k for k, v in row.items() if is_volume_path(v))
            if set(keys) != set(self.keys):
                raise UsageError(
                    f"subject {_name(row, i)} has arrays {sorted(keys)}, the first subject "
                    f"{sorted(self.keys)}: every subject needs the same keys"
                )
        opened = _open_arrays(
            [os.fspath(row[k]) for row in rows for k in self.keys],
            spatial_dims,
            self.cache_dir,
            level,
        )
        self.metadata: list[dict[str, Any]] = []
        self.arrays: list[dict[str, VolumeArray]] = []
        for i, row in enumerate(rows):
            arrays = dict(zip(self.keys, opened[i * len(self.keys) : (i + 1) * len(self.keys)]))
            check_same_space(_name(row, i), arrays, affine_tolerance)
            self.arrays.append(arrays)
            self.metadata.append({k: v for k, v in row.items() if k not in self.keys})

    @classmethod
    def from_folders(cls, folders: Mapping[str, str | os.PathLike[str]], **options: Any) -> Volumes:
        """Subjects paired by file name across folders: ``from_folders({"image":
        "imagesTr", "label": "labelsTr"})`` pairs ``imagesTr/x.nii.gz`` with
        ``labelsTr/x.nii.gz`` (the Medical Segmentation Decathlon's layout). Names found
        in only some folders are an error naming them."""
        found: dict[str, dict[str, str]] = {}
        for key, folder in folders.items():
            for path in sorted(glob.glob(os.path.join(os.fspath(folder), "*"))):
                name = os.path.basename(path)
                if name.startswith(".") or not is_volume_path(path):
                    continue
                found.setdefault(name, {})[key] = path
        missing = {
            n: sorted(set(folders) - set(d)) for n, d in found.items() if len(d) < len(folders)
        }
        if missing:
            some = ", ".join(f"{n} (no {', '.join(k)})" for n, k in sorted(missing.items())[:5])
            raise UsageError(f"Volumes.from_folders: files without a partner: {some}")
        if not found:
            raise UsageError(f"Volumes.from_folders: no array files in {dict(folders)}")
        return cls([{"id": _stem(n), **d} for n, d in sorted(found.items())], **options)

    @classmethod
    def from_monai(cls, datalist: Sequence[Mapping[str, Any]], **options: Any) -> Volumes:
        """From a MONAI data list (``load_decathlon_datalist``'s result, or the list of
        dicts given to ``monai.data.Dataset``)."""
        return cls(datalist, **options)

    @classmethod
    def from_torchio(cls, subjects: Iterable[Any], **options: Any) -> Volumes:
        """From a TorchIO ``SubjectsDataset`` (or a list of ``tio.Subject``): each
        subject's images by their paths (``image.path``), the other entries as metadata."""
        rows = []
        for subject in subjects:
            items = subject.items() if hasattr(subject, "items") else dict(subject).items()
            row: dict[str, Any] = {}
            for key, value in items:
                path = getattr(value, "path", None)
                if path is not None:
                    if isinstance(path, (list, tuple)):
                        raise UsageError(
                            f"Volumes.from_torchio: {key!r} is an image of several files; "
                            "stoker reads one file per array"
                        )
                    row[key] = os.fspath(path)
                elif not hasattr(value, "data"):
                    row[key] = value
            rows.append(row)
        return cls(rows, **options)

    def __len__(self) -> int:
        return len(self.arrays)

    def __iter__(self) -> Iterator[dict[str, VolumeArray]]:
        return iter(self.arrays)

    def spatial_shape(self, subject: int) -> tuple[int, ...]:
        """The spatial shape of a subject's arrays (in patch order)."""
        return self.arrays[subject][self.keys[0]].spatial_shape

    def affine(self, subject: int) -> np.ndarray | None:
        """The subject's 4x4 voxel-to-world matrix, where its files have one."""
        for key in self.keys:
            if self.arrays[subject][key].affine is not None:
                return self.arrays[subject][key].affine
        return None

    def name(self, subject: int) -> str:
        """How errors and batches name a subject: its ``id``, else its number."""
        return _name(self.metadata[subject], subject)

    def files(self) -> list[str]:
        """Every file patches are read from, in order (subject by subject, key by key)."""
        return [self.arrays[i][k].data_path for i in range(len(self)) for k in self.keys]


def _open_arrays(
    paths: list[str], spatial_dims: int, cache_dir: str | None, level: int
) -> list[VolumeArray]:
    """Every array's layout, opened on a thread a core: a .nii.gz is inflated then, with the
    GIL released, so 16 volumes of 34 MB open in a second on 2 cores rather than in
    several. The error raised is the first array's in order, as it would be one by one."""
    if len(paths) == 1:
        return [open_volume_array(paths[0], spatial_dims, cache_dir, level)]
    pool = ThreadPoolExecutor(min(len(paths), usable_cores()), thread_name_prefix="stoker-open")
    try:
        futures = [pool.submit(open_volume_array, p, spatial_dims, cache_dir, level) for p in paths]
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after an error, start no more


def _stem(name: str) -> str:
    """A file name without its array suffix: ``case_001.nii.gz`` is ``case_001``."""
    lower = name.lower()
    for suffix in sorted(VOLUME_SUFFIXES, key=len, reverse=True):  # .nii.gz before .nii
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _name(row: Mapping[str, Any], index: int) -> str:
    value = row.get("id", row.get("subject"))
    return repr(value) if value is not None else f"#{index}"


def _read_csv(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise located(
            ReadError, path, 0, f"cannot read the subjects' CSV: {e.strerror or e}"
        ) from e
    base = os.path.dirname(os.path.abspath(path))
    return [
        {
            k: (os.path.join(base, v) if is_volume_path(v) and not os.path.isabs(v) else v)
            for k, v in row.items()
        }
        for row in rows
    ]
