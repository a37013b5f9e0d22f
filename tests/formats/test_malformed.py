"""Hostile shards: every malformed file is refused with ShardFormatError, and random
mutations of valid shards are either read correctly or refused, never read wrong.

The files come from tests/data/make_corpus.py (committed); scripts/fuzz.sh uses the same
files as the seeds of the C++ fuzzer.
"""

from __future__ import annotations

import itertools
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

import stoker
from tests.support import DATA

MALFORMED = sorted((DATA / "malformed").iterdir())
SEEDS = sorted((DATA / "seeds").iterdir())
STORED = int(stoker._core.Codec.STORED)
DEFLATE = int(stoker._core.Codec.DEFLATE)


def open_and_read(path: Path) -> tuple[stoker.Dataset, list[dict]]:
    ds = stoker.Dataset(str(path))
    return ds, ds.get_batch(range(len(ds)))


def test_the_corpus_is_there_and_tiny():
    assert len(MALFORMED) >= 15
    assert {p.suffix for p in MALFORMED} == {".tar", ".zip", ".npy"}
    assert {p.suffix for p in SEEDS} == {".tar", ".zip", ".npy"}
    for path in [*MALFORMED, *SEEDS]:
        assert path.stat().st_size < 64 * 1024, path.name


@pytest.mark.parametrize("path", SEEDS, ids=[p.name for p in SEEDS])
def test_seed_reads(path):
    ds, samples = open_and_read(path)
    check_bytes(ds, samples, path.read_bytes())


@pytest.mark.parametrize("path", MALFORMED, ids=[p.name for p in MALFORMED])
def test_malformed_is_refused(path):
    # Refused when the shard is opened or when its samples are read (a bad CRC, a
    # deflate stream that lies about its size), never served, never another error.
    with pytest.raises(stoker.ShardFormatError) as caught:
        open_and_read(path)
    error = caught.value
    assert isinstance(error, ValueError)
    assert os.path.basename(error.path) == path.name
    assert str(error).startswith(f"{error.path}: offset {error.offset}: ")
    assert 0 <= error.offset <= path.stat().st_size


def check_bytes(ds: stoker.Dataset, samples: list[dict], data: bytes) -> None:
    """Every value a Dataset served is the bytes its index points at in `data`: stored
    members as they are in the file, deflated ones as zlib inflates them."""
    assert len(samples) == len(ds)
    members = ds.gather(np.arange(len(ds), dtype=np.int64))
    bounds = members.bounds
    for s, sample in enumerate(samples):
        assert len(sample) - 1 == bounds[s + 1] - bounds[s]  # "__key__" and one per member
        for row in range(bounds[s], bounds[s + 1]):
            value = sample[ds.fields[int(members.field[row])]]
            got = value.tobytes()
            offset, length = int(members.offset[row]), int(members.length[row])
            assert len(got) == int(members.out[row])
            assert offset + length <= len(data), "index points past the end of the file"
            stored = data[offset : offset + length]
            codec = int(members.codec[row])
            if codec == STORED:
                assert got == stored
            else:
                assert codec == DEFLATE
                assert got == zlib.decompress(stored, -15)


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # not among the test extras everywhere
    given = None


if given is None:

    @pytest.mark.skip(reason="hypothesis is not installed")
    def test_mutated_shards_are_read_right_or_refused():
        pass

else:
    SEED_BYTES = [(p.suffix, p.read_bytes()) for p in SEEDS]
    INTERESTING = [0x00, 0x01, 0x7F, 0x80, 0xFF, ord("0"), ord("7"), ord(" "), ord("\n")]

    @st.composite
    def mutated(draw) -> tuple[str, bytes]:
        """A seed shard with a few byte flips, overwrites, insertions, deletions or a
        truncation applied."""
        suffix, seed = draw(st.sampled_from(SEED_BYTES))
        data = bytearray(seed)
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
            at = draw(st.integers(0, max(len(data) - 1, 0)))
            if kind == "flip" and data:
                data[at] ^= 1 << draw(st.integers(0, 7))
            elif kind == "set" and data:
                data[at] = draw(st.sampled_from(INTERESTING) | st.integers(0, 255))
            elif kind == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=16))
            elif kind == "delete":
                del data[at : at + draw(st.integers(1, 16))]
            elif kind == "truncate":
                del data[at:]
        return suffix, bytes(data)

    names = itertools.count()

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(case=mutated())
    def test_mutated_shards_are_read_right_or_refused(tmp_path, case):
        suffix, data = case
        path = tmp_path / f"mutated-{next(names)}{suffix}"  # a fresh file each time
        path.write_bytes(data)
        try:
            try:
                ds, samples = open_and_read(path)
            except (stoker.ShardFormatError, stoker.ReadError):
                return
            check_bytes(ds, samples, data)
        finally:
            path.unlink()
