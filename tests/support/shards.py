"""Shard writers for the tests: the standard ones (tarfile, zipfile), no stand-ins."""

from __future__ import annotations

import io
import os
import tarfile
import zipfile
from collections.abc import Iterable

import numpy as np

Samples = list[tuple[str, dict[str, bytes]]]


def make_samples(n: int, seed: int = 0, size: int = 300) -> Samples:
    """n samples with a 'cls' and a 'raw' field of random bytes and length."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        raw = rng.integers(0, 256, int(rng.integers(1, size)), dtype=np.uint8).tobytes()
        out.append((f"sample{i:06d}", {"cls": str(i % 10).encode(), "raw": raw}))
    return out


def write_tar_members(
    path: str | os.PathLike, members: Iterable[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT
) -> str:
    """A tar of regular files, (name, bytes) in the order given, written by tarfile."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return os.fspath(path)


def write_tar(path: str | os.PathLike, samples: Samples, fmt: int = tarfile.PAX_FORMAT) -> str:
    """A tar of samples, each sample's fields as KEY.FIELD members."""
    members = (
        (f"{key}.{field}", data) for key, fields in samples for field, data in fields.items()
    )
    return write_tar_members(path, members, fmt)


def write_zip(
    path: str | os.PathLike,
    samples: Samples,
    compression: int = zipfile.ZIP_STORED,
    force_zip64: bool = False,
) -> str:
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        for key, fields in samples:
            for field, data in fields.items():
                info = zipfile.ZipInfo(f"{key}.{field}", date_time=(2024, 1, 1, 0, 0, 0))
                info.compress_type = compression
                with zf.open(info, "w", force_zip64=force_zip64) as f:
                    f.write(data)
    return os.fspath(path)


def as_bytes(sample: dict) -> dict[str, bytes]:
    """A stoker sample's fields as plain bytes, for comparison."""
    return {k: bytes(v) for k, v in sample.items() if k != "__key__"}


def assert_matches(ds, samples: Iterable[tuple[str, dict[str, bytes]]]) -> None:
    samples = list(samples)
    assert len(ds) == len(samples)
    got = ds.get_batch(range(len(ds)))
    for sample, (key, fields) in zip(got, samples):
        assert sample["__key__"] == key
        assert as_bytes(sample) == fields
