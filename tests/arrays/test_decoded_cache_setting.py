"""stoker.set_decoded_cache_bytes: the process's readers, those made later, and processes
started later (through STOKER_DECODED_CACHE_BYTES) take the limit; a wrong one is a
UsageError naming what was given."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import stoker
from stoker import _process
from tests.support import REPO

VARIABLE = _process.DECODED_CACHE_VARIABLE


def test_readers_made_before_and_after_take_the_limit(decoded_cache_restored, tmp_path):
    h5py = pytest.importorskip("h5py")
    path = str(tmp_path / "v.h5")
    data = np.arange(64 * 1024, dtype=np.int32).reshape(64, 1024)
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=data, chunks=(8, 1024), compression="gzip")
    before = _process.shared_reader()
    stoker.set_decoded_cache_bytes(0)  # nothing kept: every chunk read again
    assert before.chunk_cache_bytes == 0
    assert _process.shared_reader(1).chunk_cache_bytes == 0  # made after
    assert os.environ[VARIABLE] == "0"
    ds = stoker.Dataset(path)
    loader = stoker.Loader(ds, batch_size=16, fields={"v": stoker.Raw((1024,), "int32")})
    read = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        rows = np.concatenate([b["v"].numpy() for b in loader])
        assert sorted(map(int, rows[:, 0])) == list(range(0, 64 * 1024, 1024))
        read.append(loader.stats()["bytes_read"])
    assert read[1] - read[0] >= 0.8 * read[0]  # the second epoch read its chunks again
    stoker.set_decoded_cache_bytes(64 << 20)
    assert before.chunk_cache_bytes == 64 << 20


@pytest.mark.parametrize("limit", [-1, 1.5, True, "64M"])
def test_a_limit_that_is_not_a_whole_number_of_bytes_is_refused(decoded_cache_restored, limit):
    with pytest.raises(stoker.UsageError, match="whole number of bytes"):
        stoker.set_decoded_cache_bytes(limit)


def test_a_process_started_later_takes_it_from_the_environment():
    script = "from stoker import _process; print(_process.shared_reader().chunk_cache_bytes)"
    env = {**os.environ, VARIABLE: str(32 << 20)}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 32 << 20
    env[VARIABLE] = "lots"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode != 0
    assert "STOKER_DECODED_CACHE_BYTES is a whole number of bytes, not 'lots'" in out.stderr
