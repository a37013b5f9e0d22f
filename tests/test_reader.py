"""ShardReader on its own: whole batches of byte ranges into one buffer."""

import os
import threading

import numpy as np
import pytest
import stoker
from stoker import _core


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    blobs = []
    for i in range(5):
        data = rng.integers(0, 256, 200_000 + i, dtype=np.uint8).tobytes()
        (tmp_path / f"f{i}.bin").write_bytes(data)
        blobs.append(data)
    return _core.FileTable([str(tmp_path / f"f{i}.bin") for i in range(5)]), blobs


def _read(reader, table, ids, offsets, lengths):
    lengths = np.asarray(lengths, np.uint64)
    dest = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
    buf = reader.read(table, ids, offsets, lengths, dest, int(lengths.sum())).wait()
    return buf, dest


@pytest.mark.parametrize("threads", [1, 2, 7])
def test_random_ranges(files, threads):
    table, blobs = files
    reader = stoker.ShardReader(threads)
    rng = np.random.default_rng(threads)
    n = 3000
    ids = rng.integers(0, 5, n).astype(np.uint32)
    lengths = rng.integers(0, 5000, n).astype(np.uint64)
    offsets = np.array([rng.integers(0, 200_000 - int(ln) + 1) for ln in lengths], np.uint64)
    buf, dest = _read(reader, table, ids, offsets, lengths)
    for i in range(n):
        o, ln, d = int(offsets[i]), int(lengths[i]), int(dest[i])
        assert bytes(buf[d : d + ln]) == blobs[ids[i]][o : o + ln]


def test_adjacent_overlapping_and_repeated_ranges(files):
    # Neighbouring ranges are merged into one pread: the pieces must still land right.
    table, blobs = files
    reader = stoker.ShardReader(2)
    offsets = [0, 100, 100, 50, 4000, 4100, 190_000, 0]
    lengths = [100, 100, 100, 200, 100, 9000, 10_000, 1]
    ids = [1] * len(offsets)
    buf, dest = _read(reader, table, ids, offsets, lengths)
    for o, ln, d in zip(offsets, lengths, dest.tolist()):
        assert bytes(buf[d : d + ln]) == blobs[1][o : o + ln]


def test_read_into_caller_buffer(files):
    table, blobs = files
    reader = stoker.ShardReader(2)
    dest = np.zeros(1000, np.uint8)
    pending = reader.read_into(dest, table, [0, 2], [10, 20], [300, 400], [0, 500])
    assert pending.wait() is dest
    assert bytes(dest[:300]) == blobs[0][10:310]
    assert bytes(dest[500:900]) == blobs[2][20:420]


def test_missing_file(tmp_path, files):
    table = _core.FileTable([str(tmp_path / "nope.bin")])
    with pytest.raises(stoker.ReadError, match=r"nope\.bin: offset 0: cannot open") as err:
        _read(stoker.ShardReader(2), table, [0], [0], [10])
    assert isinstance(err.value, OSError) and err.value.errno == 2


def test_short_read_never_returns_a_buffer(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 1000)
    table = _core.FileTable([str(path)])
    reader = stoker.ShardReader(2)
    with pytest.raises(stoker.ShardFormatError, match=r"short\.bin: offset 1000: short read"):
        _read(reader, table, [0, 0], [0, 900], [100, 200])


def test_bad_requests(files):
    table, _ = files
    reader = stoker.ShardReader(2)
    with pytest.raises(stoker.StokerError, match="names file 9"):
        reader.read(table, [9], [0], [1], [0], 1)
    with pytest.raises(stoker.StokerError, match="does not fit"):
        reader.read(table, [0], [0], [10], [5], 10)
    with pytest.raises(ValueError, match="offsets has 2 entries"):
        reader.read(table, [0], [0, 1], [1], [0], 1)


def test_open_files_are_bounded(files):
    table, blobs = files
    reader = stoker.ShardReader(2, max_open_files=2)
    for i in range(5):
        buf, _ = _read(reader, table, [i], [0], [10])
        assert bytes(buf) == blobs[i][:10]
    assert reader.open_files() <= 2


def test_many_python_threads(files):
    table, blobs = files
    reader = stoker.ShardReader(2)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(30):
                ids = rng.integers(0, 5, 64).astype(np.uint32)
                offsets = rng.integers(0, 190_000, 64).astype(np.uint64)
                lengths = np.full(64, 4096, np.uint64)
                buf, dest = _read(reader, table, ids, offsets, lengths)
                for i in range(64):
                    o, d = int(offsets[i]), int(dest[i])
                    assert bytes(buf[d : d + 4096]) == blobs[ids[i]][o : o + 4096]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_wait_timeout(files):
    table, _ = files
    pending = stoker.ShardReader(1).read(table, [0], [0], [10], [0], 10)
    pending.wait(timeout=10)
    assert pending.done()


def test_forked_child_gets_its_own_pool(files):
    table, blobs = files
    reader = stoker.ShardReader(2)
    _read(reader, table, [0], [0], [10])  # the parent's threads are running
    pid = os.fork()
    if pid == 0:  # child: must read with fresh threads, not hang on the parent's
        try:
            buf, _ = _read(reader, table, [3], [5], [100])
            os._exit(0 if bytes(buf) == blobs[3][5:105] else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_bench_pread(files):
    table, _ = files
    seconds = _core.bench_pread(table, [0, 1, 2], [0, 0, 0], [4096] * 3, 2)
    assert seconds >= 0
