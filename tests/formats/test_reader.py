"""ShardReader on its own: whole batches of byte ranges into one buffer."""

import os
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest

import stoker
from stoker import _core
from tests.support.concurrency import run_in_fork, run_in_threads


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


def test_read_into_holds_the_buffer_export(files):
    table, blobs = files
    dest = bytearray(1000)
    pending = stoker.ShardReader(2).read_into(dest, table, [0], [10], [300], [0])
    with pytest.raises(BufferError):
        dest.extend(b"x")  # would move the memory the threads write into
    pending.wait()
    dest.extend(b"x")  # released once the batch is read
    assert bytes(dest[:300]) == blobs[0][10:310]


def test_crc_checked_on_stored_pieces_when_asked(files):
    table, blobs = files
    reader = stoker.ShardReader(2)
    crc = zlib.crc32(blobs[1][0:100])
    ok = reader.read(
        table, [1, 1], [0, 100], [100, 100], [0, 100], 200, crcs=[crc, 0], check_crc=[True, False]
    ).wait()
    assert bytes(ok[:100]) == blobs[1][:100]
    with pytest.raises(stoker.ShardFormatError, match="CRC-32 mismatch"):
        reader.read(
            table,
            [1, 1],
            [0, 100],
            [100, 100],
            [0, 100],
            200,
            crcs=[crc ^ 1, 0],
            check_crc=[True, False],
        ).wait()


def test_wait_without_a_finite_timeout(files):
    table, _ = files
    for timeout in (float("inf"), float("nan"), 1e300):
        stoker.ShardReader(1).read(table, [0], [0], [10], [0], 10).wait(timeout=timeout)


def test_missing_file(tmp_path, files):
    table = _core.FileTable([str(tmp_path / "nope.bin")])
    with pytest.raises(stoker.ReadError, match=r"nope\.bin: offset 0: cannot open") as err:
        _read(stoker.ShardReader(2), table, [0], [0], [10])
    assert isinstance(err.value, OSError) and err.value.errno == 2


def test_directory_is_not_a_file(tmp_path):
    table = _core.FileTable([str(tmp_path)])
    with pytest.raises(stoker.ReadError, match="is a directory"):
        _read(stoker.ShardReader(1), table, [0], [0], [10])


_CTRL_C_SCRIPT = """
import os, signal, sys, threading, time
import numpy as np
import stoker

# Shells start background jobs with SIGINT ignored, and Python then leaves it so.
signal.signal(signal.SIGINT, signal.default_int_handler)
path = sys.argv[1]
with open(path, "wb") as f:
    f.truncate(8 << 20)
table = stoker.FileTable([path])
n = 100_000  # 100,000 reads of 4 MiB: minutes of work, unless interrupted
pending = stoker.ShardReader(1).read(
    table, np.zeros(n, np.uint32), np.zeros(n, np.uint64), np.full(n, 4 << 20, np.uint64),
    np.zeros(n, np.uint64), 4 << 20)
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
start = time.monotonic()
try:
    pending.wait()
    print("finished without interruption")
    sys.exit(1)
except KeyboardInterrupt:
    elapsed = time.monotonic() - start
    pending.cancel()
    try:
        pending.wait()
    except stoker.StokerError as e:
        assert "cancelled" in str(e), e
    print(f"interrupted after {elapsed:.2f}s")
    sys.exit(0 if elapsed < 2 else 1)
"""


def test_ctrl_c_interrupts_a_long_wait(tmp_path):
    # In its own process, so the SIGINT cannot reach the test runner.
    result = subprocess.run(
        [sys.executable, "-c", _CTRL_C_SCRIPT, str(tmp_path / "big.bin")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interrupted after" in result.stdout


def test_a_file_cut_shorter_after_its_pages_were_read_is_a_short_read(tmp_path):
    # Stored pieces are copied from the file's mapping, whose pages are made present once
    # and then handed out with no system call: a file cut shorter after a first read must
    # still fail as a short read naming it, never kill the process with SIGBUS.
    path = tmp_path / "cut.bin"
    data = bytes(range(256)) * 4096
    path.write_bytes(data)
    table = _core.FileTable([str(path)])
    reader = stoker.ShardReader(2)
    ids, offsets, lengths = [0, 0], [0, 8192], [4096, 4096]  # one run: a gap, two pieces
    for _ in range(2):  # the second time from pages the mapping made present
        buf, _ = _read(reader, table, ids, offsets, lengths)
        assert bytes(buf) == data[:4096] + data[8192:12288]
    os.truncate(path, 6000)
    with pytest.raises(stoker.ShardFormatError, match=r"cut\.bin.*short read"):
        _read(reader, table, ids, offsets, lengths)


def test_short_read_never_returns_a_buffer(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 1000)
    table = _core.FileTable([str(path)])
    reader = stoker.ShardReader(2)
    with pytest.raises(stoker.ShardFormatError, match=r"short\.bin: offset 1000: short read"):
        _read(reader, table, [0, 0], [0, 900], [100, 200])


def test_spans_read_whole_keep_their_boxes(files):
    # read_spans_into: each span read whole, a strided box of it copied to its place by
    # the reader's threads; checked element by element against the file's bytes.
    table, blobs = files
    reader = stoker.ShardReader(2)
    file_ids = [3, 3, 4, 1]
    offsets = [1_000, 9_000, 50, 123_457]
    lengths = [6_000, 6_000, 4_000, 777]
    # box 0: 3 x 5 rows of two 4-byte elements, at strides of 400 and 40 bytes, packed in C
    # order; box 1: every third of 30 elements of 2 bytes, packed.
    extents = [[3, 5, 2], [1, 1, 30]]
    src_strides = [[400, 40, 4], [0, 0, 6]]
    dest_strides = [[40, 8, 4], [0, 0, 2]]
    box_ids = [0, 0, 0, 1]
    places = [0, 240, 480, 720]
    dest = np.full(800, 0xEE, np.uint8)
    reader.read_spans_into(
        dest, table, file_ids, offsets, lengths, places, box_ids,
        np.array(extents), np.array(src_strides), np.array(dest_strides), [4, 2],
    ).wait()  # fmt: skip
    for f, o, n, at, b in zip(file_ids, offsets, lengths, places, box_ids):
        span = blobs[f][o : o + n]
        item = 4 if b == 0 else 2
        expected = bytearray()
        for i in range(extents[b][0]):
            for j in range(extents[b][1]):
                for k in range(extents[b][2]):
                    start = i * src_strides[b][0] + j * src_strides[b][1] + k * src_strides[b][2]
                    expected += span[start : start + item]
        assert bytes(dest[at : at + len(expected)]) == bytes(expected)
    assert bytes(dest[780:]) == b"\xee" * 20  # nothing written past the last box
    with pytest.raises(stoker.StokerError, match="reaches 6001 bytes into a span of 6000"):
        reader.read_spans_into(dest, table, [3], [0], [6000], [0], [0], [[6001]], [[1]], [[1]], [1])
    with pytest.raises(ValueError, match="box_ids"):
        reader.read_spans_into(dest, table, [3], [0], [6000], [0], [1], [[1]], [[1]], [[1]], [1])


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

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(30):
            ids = rng.integers(0, 5, 64).astype(np.uint32)
            offsets = rng.integers(0, 190_000, 64).astype(np.uint64)
            lengths = np.full(64, 4096, np.uint64)
            buf, dest = _read(reader, table, ids, offsets, lengths)
            for i in range(64):
                o, d = int(offsets[i]), int(dest[i])
                assert bytes(buf[d : d + 4096]) == blobs[ids[i]][o : o + 4096]

    run_in_threads(work, 8)


def test_wait_timeout(files):
    table, _ = files
    pending = stoker.ShardReader(1).read(table, [0], [0], [10], [0], 10)
    pending.wait(timeout=10)
    assert pending.done()


def test_forked_child_gets_its_own_pool(files):
    table, blobs = files
    reader = stoker.ShardReader(2)
    _read(reader, table, [0], [0], [10])  # the parent's threads are running

    def child_reads() -> bool:  # with fresh threads, not hanging on the parent's
        buf, _ = _read(reader, table, [3], [5], [100])
        return bytes(buf) == blobs[3][5:105]

    run_in_fork(child_reads, 20, "a child forked after reads")


@pytest.mark.skipif(
    bool(os.environ.get("STOKER_SANITIZED_SITE")),
    reason="gcc 12's ASan runtime holds no allocator lock across fork() (LLVM's does "
    "since 18, llvm-project#75290): a child forked while another thread allocates can "
    "hang in malloc, whatever stoker does; the suite without sanitizers runs this test",
)
def test_fork_while_other_threads_read(files):
    # Locks held by the parent's threads at fork() (fd cache, buffer pool, queue)
    # must not exist in the child's path: fork many times in the middle of reads.
    table, blobs = files
    reader = stoker.ShardReader(2)
    stop = threading.Event()

    def keep_reading(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            n = 64
            ids = rng.integers(0, 5, n).astype(np.uint32)
            offsets = rng.integers(0, 190_000, n).astype(np.uint64)
            _read(reader, table, ids, offsets, np.full(n, 4096))

    readers = [threading.Thread(target=keep_reading, args=(s,)) for s in range(2)]
    for t in readers:
        t.start()
    try:
        for _ in range(25):

            def child_reads() -> bool:
                buf, _ = _read(reader, table, [2, 4], [7, 9], [1000, 1000])
                return (
                    bytes(buf[:1000]) == blobs[2][7:1007] and bytes(buf[1000:]) == blobs[4][9:1009]
                )

            run_in_fork(child_reads, 20, "a child forked during reads")
    finally:
        stop.set()
        for t in readers:
            t.join()


def test_batch_outlives_its_reader(files):
    # Dropping a reader must not block on its batches; whoever waits finishes them.
    table, blobs = files
    rng = np.random.default_rng(0)
    n = 3000
    ids = rng.integers(0, 5, n).astype(np.uint32)
    offsets = rng.integers(0, 190_000, n).astype(np.uint64)
    buf, dest = _read(stoker.ShardReader(1), table, ids, offsets, np.full(n, 4096))
    for i in range(n):
        o, d = int(offsets[i]), int(dest[i])
        assert bytes(buf[d : d + 4096]) == blobs[ids[i]][o : o + 4096]


def test_bench_pread(files):
    table, _ = files
    seconds = _core.bench_pread(table, [0, 1, 2], [0, 0, 0], [4096] * 3, 2)
    assert seconds >= 0


def test_pinned_ring_reuses_only_free_slots(files):
    torch = pytest.importorskip("torch")
    table, blobs = files
    ring = stoker.PinnedRing()

    def address(a):
        return a.__array_interface__["data"][0]

    slot = ring.acquire(4096)
    first = address(slot)
    assert first % 4096 == 0  # page-aligned
    tensor = torch.from_numpy(slot)
    del slot
    assert ring.idle_slots() == 0  # the tensor still views it
    other = ring.acquire(4096)
    assert address(other) != first
    stoker.ShardReader(1).read_into(other, table, [3], [0], [4096], [0]).wait()
    assert bytes(other) == blobs[3][:4096]
    del tensor
    assert ring.idle_slots() == 1
    assert address(ring.acquire(4000)) == first  # reused once nothing views it
    assert not ring.pinned
