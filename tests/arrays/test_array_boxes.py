"""Boxes (patches) of chunked arrays read by ShardReader.read_boxes_into: byte-exact
against numpy slicing for Zarr and HDF5 arrays (compressed, edge chunks, missing chunks,
F order, big-endian), each chunk read once per batch and served by the chunk cache
after; and the TIFF tile filters (JPEG with and without shared tables, deflate with
the horizontal predictor) against tifffile's own decoding."""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest

import stoker
import stoker._core as _core
from stoker.arrays.hdf5 import hdf5_arrays

F = _core.ChunkFilter
MISSING = np.uint64(2**64 - 1)


def _strides(extent, itemsize, fortran=False):
    """Byte strides of a C-order (or F-order) buffer of `extent`."""
    strides, step = [0] * len(extent), itemsize
    axes = range(len(extent)) if fortran else reversed(range(len(extent)))
    for d in axes:
        strides[d] = step
        step *= extent[d]
    return strides


def read_boxes(layouts, dtypes, boxes, reader=None, fortran=False):
    """Each (array, start, extent) of `boxes` read in one batch, as numpy arrays, and
    the PendingRead (for bytes_read)."""
    reader = reader or _core.ShardReader(2)
    files = _core.FileTable([], arrays=list(layouts))
    offsets, strides, at = [], [], 0
    for a, _, extent in boxes:
        item = dtypes[a].itemsize
        offsets.append(at)
        strides.append(_strides(extent, item, fortran))
        at += -(-int(np.prod(extent)) * item // 8) * 8
    dest = np.full(at + 8, 0xAB, np.uint8)  # the sentinel past the end must survive
    pending = reader.read_boxes_into(
        dest,
        files,
        np.array([b[0] for b in boxes], np.uint32),
        np.array([b[1] for b in boxes], np.int64),
        np.array([b[2] for b in boxes], np.int64),
        np.array(offsets, np.int64),
        np.array(strides, np.int64),
    )
    pending.wait()
    assert (dest[at:] == 0xAB).all()
    out = [
        np.ndarray(tuple(b[2]), dtypes[b[0]], buffer=dest, offset=o, strides=tuple(s))
        for b, o, s in zip(boxes, offsets, strides)
    ]
    return out, pending


def random_boxes(rng, shape, n, array=0):
    boxes = []
    for _ in range(n):
        start = [int(rng.integers(0, s)) for s in shape]
        extent = [int(rng.integers(1, s - b + 1)) for s, b in zip(shape, start)]
        boxes.append((array, start, extent))
    return boxes


def check(boxes, got, arrays):
    for (a, start, extent), box in zip(boxes, got):
        want = arrays[a][tuple(slice(b, b + e) for b, e in zip(start, extent))]
        np.testing.assert_array_equal(box, want, err_msg=f"box {start} + {extent}")


# -- Zarr ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["v3 zstd", "v3 gzip transposed", "v2 F order"])
def test_zarr_boxes(tmp_path, variant):
    zarr = pytest.importorskip("zarr")
    codecs = pytest.importorskip("zarr.codecs")
    from stoker.arrays.zarr import zarr_arrays

    rng = np.random.default_rng(1)
    shape, chunks = (23, 29, 17), (8, 7, 6)  # every axis has an edge chunk
    data = rng.integers(-(2**15), 2**15, shape).astype(np.int16)
    path = str(tmp_path / "v.zarr")
    kw: dict = {"shape": shape, "chunks": chunks, "dtype": "int16", "fill_value": -7}
    if variant == "v3 gzip transposed":
        kw["compressors"] = codecs.GzipCodec(level=1)
        kw["filters"] = [codecs.TransposeCodec(order=(2, 0, 1))]
    elif variant == "v2 F order":
        kw.update(zarr_format=2, order="F")
    z = zarr.create_array(store=path, **kw)
    z[:] = data
    # A chunk never written (its file removed) reads as the fill value.
    name = "1.2.0" if variant.startswith("v2") else os.path.join("c", "1", "2", "0")
    os.remove(os.path.join(path, name))
    expected = zarr.open_array(path, mode="r")[:]
    assert (expected[8:16, 14:21, 0:6] == -7).all()

    _, fields = zarr_arrays(path, None)
    layout = fields[0].layout
    boxes = random_boxes(rng, shape, 40)
    boxes.append((0, [0, 0, 0], list(shape)))  # the whole array
    boxes.append((0, [8, 14, 0], [8, 7, 6]))  # the missing chunk exactly
    boxes.append((0, [22, 28, 16], [1, 1, 1]))  # the last element, in an edge chunk
    for fortran in (False, True):
        got, _ = read_boxes([layout], [np.dtype(np.int16)], boxes, fortran=fortran)
        check(boxes, got, [expected])


# -- HDF5 ---------------------------------------------------------------------------


DTYPES = ["u1", "<i2", ">i4", "<f4", ">f8", "<u8"]


def test_hdf5_boxes_several_dtypes(tmp_path):
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(2)
    path = str(tmp_path / "v.h5")
    shape, chunks = (19, 26, 11), (5, 6, 7)
    arrays = {}
    with h5py.File(path, "w") as f:
        for i, code in enumerate(DTYPES):
            dtype = np.dtype(code)
            values = rng.integers(0, 250, shape) if dtype.kind == "u" else rng.normal(0, 1e3, shape)
            arrays[code] = values.astype(dtype)
            f.create_dataset(
                f"d{i}",
                data=arrays[code],
                chunks=chunks,
                shuffle=True,
                compression="gzip",
                fletcher32=i % 2 == 1,
            )
    _, fields = hdf5_arrays(path, None)
    by_name = {fl.name: fl for fl in fields}
    layouts = [by_name[f"d{i}"].layout for i in range(len(DTYPES))]
    assert all(layout is not None for layout in layouts)
    assert any(layout.byteswap for layout in layouts)
    dtypes = [np.dtype(c).newbyteorder("=") for c in DTYPES]
    boxes = []
    for a in range(len(DTYPES)):  # one batch of boxes of several arrays
        boxes += random_boxes(rng, shape, 8, array=a)
    got, _ = read_boxes(layouts, dtypes, boxes)
    check(boxes, got, [arrays[c] for c in DTYPES])


def test_boxes_share_chunks_and_the_cache(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = str(tmp_path / "v.h5")
    data = np.arange(40 * 40 * 40, dtype=np.float32).reshape(40, 40, 40)
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=data, chunks=(20, 20, 20), shuffle=True, compression="gzip")
    _, fields = hdf5_arrays(path, None)
    layout = fields[0].layout
    stored = layout.stored_bytes
    reader = _core.ShardReader(3)
    # Eight boxes inside chunk (0, 0, 0): one read of its stored bytes.
    rng = np.random.default_rng(3)
    boxes = []
    for _ in range(8):
        start = [int(s) for s in rng.integers(0, 15, 3)]
        boxes.append((0, start, [int(rng.integers(1, 20 - s + 1)) for s in start]))
    got, pending = read_boxes([layout], [data.dtype], boxes, reader)
    check(boxes, got, [data])
    first_chunk = stored // 8
    assert 0 < pending.bytes_read() < 2 * first_chunk
    # The next batch finds the chunk in the cache: nothing read.
    got, pending = read_boxes([layout], [data.dtype], boxes, reader)
    check(boxes, got, [data])
    assert pending.bytes_read() == 0
    # A box across every chunk reads each once; without the cache, every chunk again.
    whole = [(0, [0, 0, 0], [40, 40, 40]), (0, [10, 10, 10], [20, 20, 20])]
    reader.chunk_cache_bytes = 0
    got, pending = read_boxes([layout], [data.dtype], whole, reader)
    check(whole, got, [data])
    assert pending.bytes_read() == stored


def _twelve_chunks(tmp_path, seed: int):
    """(data, layout) of an HDF5 dataset of 12 gzip chunks of 64 KiB, ~768 KiB in all."""
    h5py = pytest.importorskip("h5py")
    path = str(tmp_path / "v.h5")
    data = np.random.default_rng(seed).integers(0, 1 << 30, (48, 64, 64), dtype=np.int32)
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=data, chunks=(4, 64, 64), compression="gzip")
    _, fields = hdf5_arrays(path, None)
    return data, fields[0].layout


def test_the_chunk_cache_grows_to_what_is_read_again(tmp_path):
    """The cache starts at an eighth of its limit (so a first pass touches fresh memory
    for what it needs only) and doubles whenever a chunk it dropped is asked for again,
    until what passes read again fits."""
    data, layout = _twelve_chunks(tmp_path, 5)
    # One thread: with two, a chunk that rows on both threads need may be dropped by one
    # thread's misses before the other asks (the cache is two chunks) and be read twice.
    reader = _core.ShardReader(1)
    reader.chunk_cache_bytes = 1 << 20  # starts at 128 KiB: two chunks
    whole = [(0, [0, 0, 0], [48, 64, 64])]
    reads = []
    for _ in range(6):
        got, pending = read_boxes([layout], [data.dtype], whole, reader)
        check(whole, got, [data])
        reads.append(pending.bytes_read())
    # The first pass reads every chunk; the second (the first misses make the cache grow)
    # most of them again, all but what the two threads' order left in it.
    chunk = layout.stored_bytes // 12
    assert reads[0] == layout.stored_bytes, reads
    assert layout.stored_bytes - 2 * chunk <= reads[1] <= layout.stored_bytes, reads
    assert reads[-1] == 0, reads  # grown to hold every chunk
    assert sorted(reads, reverse=True) == reads


def _read_chunks(reader, layout, data, order) -> int:
    """Each chunk of `order` read alone, a batch each; the bytes read in all."""
    read = 0
    for chunk in order:
        box = [(0, [4 * int(chunk), 0, 0], [4, 64, 64])]
        got, pending = read_boxes([layout], [data.dtype], box, reader)
        check(box, got, [data])
        read += pending.bytes_read()
    return read


def test_the_chunk_cache_stays_small_for_shuffled_passes_over_more_than_its_limit(tmp_path):
    """Shuffled passes over more chunks than the limit holds would find few of them if the
    cache grew (an LRU cache of a fraction f of a shuffled pass finds about f^2/2 of the
    next), and growing costs fresh memory: the cache stays as it started, a chunk."""
    data, layout = _twelve_chunks(tmp_path, 6)
    reader = _core.ShardReader(1)
    reader.chunk_cache_bytes = 384 << 10  # starts at one chunk; six at its limit
    rng = np.random.default_rng(0)
    reads = [_read_chunks(reader, layout, data, rng.permutation(12)) for _ in range(12)]
    # At most the chunk a pass ended with is found again by the next (grown to its limit,
    # the cache would find one or two more, at the price of six chunks of memory).
    assert all(r > layout.stored_bytes * 10 // 12 for r in reads), reads


def test_the_chunk_cache_grows_after_a_long_pass_that_read_nothing_again(tmp_path):
    """A pass that read nothing again (an evaluation over a large source) leaves no mark
    on the next loader's cache: chunks read again and again make it grow all the same."""
    data, layout = _twelve_chunks(tmp_path, 7)
    reader = _core.ShardReader(1)
    reader.chunk_cache_bytes = 256 << 10
    for _ in range(8):  # 96 chunks, none read again while the cache could hold it
        _read_chunks(reader, layout, data, range(12))
    reads = [_read_chunks(reader, layout, data, [0, 1, 2]) for _ in range(40)]
    assert reads[0] > 0
    assert reads[-1] == 0, reads  # grown to hold the three


def test_batches_in_flight_together_read_a_chunk_they_share_once(tmp_path):
    """Box reads submitted together on two threads (a PatchLoader's batches read ahead)
    that all want one chunk: one task reads and decodes it, the others wait for its
    bytes instead of reading it too."""
    h5py = pytest.importorskip("h5py")
    path = str(tmp_path / "one-chunk.h5")
    data = np.random.default_rng(8).integers(0, 1 << 30, (64, 64, 64), dtype=np.int32)
    with h5py.File(path, "w") as f:  # one chunk of 1 MiB, gzip
        f.create_dataset("v", data=data, chunks=(64, 64, 64), compression="gzip")
    _, fields = hdf5_arrays(path, None)
    layout = fields[0].layout
    for attempt in range(4):
        reader = _core.ShardReader(2)
        files = _core.FileTable([], arrays=[layout])
        rng = np.random.default_rng(attempt)
        dests, pendings = [], []
        for _ in range(8):
            start = [int(s) for s in rng.integers(0, 48, 3)]
            dest = np.empty(16**3 * 4, np.uint8)
            pendings.append(
                reader.read_boxes_into(
                    dest,
                    files,
                    np.array([0], np.uint32),
                    np.array([start], np.int64),
                    np.array([[16, 16, 16]], np.int64),
                    np.array([0], np.int64),
                    np.array([[16 * 16 * 4, 16 * 4, 4]], np.int64),
                )
            )
            dests.append((start, dest))
        for pending in pendings:
            pending.wait()
        for (x, y, z), dest in dests:
            want = data[x : x + 16, y : y + 16, z : z + 16]
            np.testing.assert_array_equal(dest.view(np.int32).reshape(16, 16, 16), want)
        assert sum(p.bytes_read() for p in pendings) == layout.stored_bytes


def test_box_of_unfiltered_chunks_reads_the_rows_it_spans(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = str(tmp_path / "v.h5")
    data = np.arange(30 * 30, dtype=np.uint16).reshape(30, 30)
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=data, chunks=(10, 10))
    _, fields = hdf5_arrays(path, None)
    layout = fields[0].layout
    if layout is None:
        pytest.skip("h5py stored the dataset contiguous")
    # From each part's first element to its last: rows 3-7 of chunk (0, 0), columns 4-6,
    # are 4 rows of 10 and 3 elements; the second box is one element in each of four chunks.
    boxes = [(0, [3, 4], [5, 3]), (0, [9, 9], [2, 2])]
    got, pending = read_boxes([layout], [data.dtype], boxes)
    check(boxes, got, [data])
    assert pending.bytes_read() == (4 * 10 + 3) * 2 + 4 * 2
    # Boxes that together reach further than a chunk holds read it whole, once.
    boxes = [(0, [0, 0], [10, 9]), (0, [1, 1], [9, 9])]
    got, pending = read_boxes([layout], [data.dtype], boxes)
    check(boxes, got, [data])
    assert pending.bytes_read() == 10 * 10 * 2


def test_box_errors(tmp_path):
    h5py = pytest.importorskip("h5py")
    path = str(tmp_path / "v.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=np.zeros((10, 12), np.int32), chunks=(4, 4), compression="gzip")
    _, fields = hdf5_arrays(path, None)
    layout = fields[0].layout
    reader = _core.ShardReader(1)
    files = _core.FileTable([], arrays=[layout])
    dest = np.zeros(1000, np.uint8)

    def submit(start, extent, offset=0, strides=(48, 4), array=0):
        return reader.read_boxes_into(
            dest,
            files,
            np.array([array], np.uint32),
            np.array([start], np.int64),
            np.array([extent], np.int64),
            np.array([offset], np.int64),
            np.array([strides], np.int64),
        )

    submit([6, 8], [4, 4]).wait()  # the array's corner: fine
    with pytest.raises(stoker.StokerError, match="not inside the array") as e:
        submit([7, 8], [4, 4])
    assert layout.name in str(e.value)
    with pytest.raises(stoker.StokerError, match="rank"):
        reader.read_boxes_into(
            dest,
            files,
            np.array([0], np.uint32),
            np.zeros((1, 3), np.int64),
            np.ones((1, 3), np.int64),
            np.zeros(1, np.int64),
            np.ones((1, 3), np.int64),
        )
    with pytest.raises(stoker.StokerError, match="does not fit"):
        submit([0, 0], [10, 12], offset=1000 - 480 + 1)
    with pytest.raises(stoker.StokerError, match="does not fit"):
        submit([0, 0], [10, 12], strides=(110, 4))
    with pytest.raises(stoker.StokerError, match="overflow"):
        submit([0, 0], [10, 12], strides=(2**62, 4))
    with pytest.raises(stoker.StokerError, match="array 1"):
        submit([0, 0], [1, 1], array=1)
    with pytest.raises(ValueError, match="negative"):
        submit([-1, 0], [1, 1])
    with pytest.raises(ValueError, match="shape"):
        reader.read_boxes_into(
            dest,
            files,
            np.array([0], np.uint32),
            np.zeros((1, 2), np.int64),
            np.ones((1, 3), np.int64),
            np.zeros(1, np.int64),
            np.ones((1, 2), np.int64),
        )
    # An empty box reads nothing and writes nothing, but must still be inside the array.
    assert submit([3, 3], [0, 5]).wait() is dest
    with pytest.raises(stoker.StokerError, match="not inside the array"):
        submit([3, 13], [0, 5])
    # A box is only ever read_boxes_into's: an ARRAY_BOX code alone names none.
    with pytest.raises(stoker.StokerError, match="without its box"):
        reader.read_into(
            dest,
            files,
            np.zeros(1, np.uint32),
            np.zeros(1, np.uint64),
            np.zeros(1, np.uint64),
            np.zeros(1, np.uint64),
            codecs=np.array([int(_core.Codec.ARRAY_BOX)], np.uint8),
            arrays=np.zeros(1, np.uint32),
        )


# -- TIFF tiles ---------------------------------------------------------------------


def _picture(height, width, seed=0):
    """Smooth RGB with some texture: JPEG keeps it close."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + 2 * y) % 256], -1)
    return np.clip(rgb + rng.integers(-6, 7, rgb.shape), 0, 255).astype(np.uint8)


def _tiff_layout(path, page, steps, tables=None, offsets=None, sizes=None):
    """The page's tiles (or strips) as an ArrayLayout of (rows, columns, samples), or of
    (samples, rows, columns, 1) for planar pages: a pixel of one sample, as the
    predictor's rows are [columns, samples]."""
    samples = page.samplesperpixel
    dtype = page.dtype
    rows, columns = (
        (page.tilelength, page.tilewidth) if page.is_tiled else (page.rowsperstrip, page.imagewidth)
    )
    rows = min(rows, page.imagelength)
    if page.planarconfig == 2:
        shape = (samples, page.imagelength, page.imagewidth, 1)
        chunks = (1, rows, columns, 1)
    else:
        shape = (page.imagelength, page.imagewidth, samples)
        chunks = (rows, columns, samples)
    offsets = np.asarray(page.dataoffsets if offsets is None else offsets, np.uint64)
    sizes = np.asarray(page.databytecounts if sizes is None else sizes, np.uint64)
    n = len(offsets)
    return _core.ArrayLayout(
        f"{path} (page 0)",
        shape,
        chunks,
        dtype.itemsize,
        np.zeros(1, dtype).tobytes(),
        steps,
        [path],
        np.zeros(n, np.uint32),
        offsets,
        sizes,
        np.zeros(n, np.uint32),
        byteswap=page.parent.byteorder == ">" and dtype.itemsize > 1,
        jpeg_tables=page.jpegtables or b"" if tables is None else tables,
        clipped_edge=not page.is_tiled,  # the last strip holds only the rows left
    )


def _assert_jpeg_equal(got, expected):
    """Equal where tifffile decodes with libjpeg-turbo too (the same accurate integer
    DCT and upsampling); else within another decoder's rounding."""
    import imagecodecs

    if "turbo" in imagecodecs.jpeg8_version():
        np.testing.assert_array_equal(got, expected)
    else:
        assert np.abs(got.astype(int) - expected).max() <= 2


def _tifffile_with_jpeg():
    """tifffile, where imagecodecs is there to write JPEG tiles and stoker decodes them."""
    tifffile = pytest.importorskip("tifffile")
    pytest.importorskip("imagecodecs")
    if _core.codec_unavailable(F.JPEG):
        pytest.skip(_core.codec_unavailable(F.JPEG))
    return tifffile


def _jpeg_step(page):
    return (F.JPEG, _core.JPEG_RGB if page.photometric == 2 else _core.JPEG_YCBCR)


@pytest.mark.parametrize("kind", ["ycbcr", "rgb", "grey"])
def test_jpeg_tiles_match_tifffile(tmp_path, kind):
    tifffile = _tifffile_with_jpeg()
    picture = _picture(600, 520)  # edge tiles on both axes
    path = str(tmp_path / f"{kind}.tif")
    if kind == "ycbcr":
        tifffile.imwrite(path, picture, tile=(256, 256), compression="jpeg")
    elif kind == "rgb":  # as Aperio writes them: RGB stored as is
        tifffile.imwrite(
            path,
            picture,
            tile=(256, 256),
            compression="jpeg",
            subsampling=(1, 1),
            compressionargs={"outcolorspace": "rgb"},
        )
    else:
        picture = picture[..., 1].copy()
        tifffile.imwrite(path, picture, tile=(128, 256), compression="jpeg")
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        assert page.photometric == {"ycbcr": 6, "rgb": 2, "grey": 1}[kind]
        expected = page.asarray()
        layout = _tiff_layout(path, page, [_jpeg_step(page)])
    if expected.ndim == 2:
        expected = expected[..., None]
    rng = np.random.default_rng(4)
    boxes = [(0, [0, 0, 0], list(expected.shape))] + random_boxes(rng, expected.shape, 12)
    got, _ = read_boxes([layout], [np.dtype(np.uint8)], boxes)
    _assert_jpeg_equal(got[0], expected)
    for (_, start, extent), box in zip(boxes[1:], got[1:]):
        np.testing.assert_array_equal(
            box, got[0][tuple(slice(b, b + e) for b, e in zip(start, extent))]
        )


def _split_tables(stream):
    """A whole JPEG stream as (its tables as a tables-only stream, the stream without
    them): the abbreviated form TIFF's JPEGTables tag is for."""
    assert stream[:2] == b"\xff\xd8"
    at, tables, rest = 2, b"", b""
    while True:
        marker = stream[at + 1]
        length = int.from_bytes(stream[at + 2 : at + 4], "big")
        segment = stream[at : at + 2 + length]
        if marker in (0xDB, 0xC4):  # DQT, DHT
            tables += segment
        else:
            rest += segment
        at += 2 + length
        if marker == 0xDA:  # SOS: the entropy-coded data follows
            return b"\xff\xd8" + tables + b"\xff\xd9", b"\xff\xd8" + rest + stream[at:]


def test_jpeg_tiles_with_shared_tables(tmp_path):
    tifffile = _tifffile_with_jpeg()
    source = str(tmp_path / "whole.tif")
    picture = _picture(256, 384, seed=5)
    tifffile.imwrite(source, picture, tile=(128, 128), compression="jpeg")
    with tifffile.TiffFile(source) as tif:
        page = tif.pages[0]
        expected = page.asarray()
        with open(source, "rb") as f:
            streams = []
            for offset, size in zip(page.dataoffsets, page.databytecounts):
                f.seek(offset)
                streams.append(f.read(size))
        split = [_split_tables(s) for s in streams]
        tables = split[0][0]
        if any(t != tables for t, _ in split):
            pytest.skip("the writer's tiles do not share their tables")
        # The abbreviated tiles, in a file of their own.
        path = str(tmp_path / "abbreviated.bin")
        offsets, sizes = [], []
        with open(path, "wb") as f:
            f.write(b"\0" * 16)
            for _, tile in split:
                offsets.append(f.tell())
                sizes.append(len(tile))
                f.write(tile)
        layout = _tiff_layout(path, page, [_jpeg_step(page)], tables, offsets, sizes)
    assert layout.jpeg_tables == tables
    assert pickle.loads(pickle.dumps(layout)).jpeg_tables == tables
    got, _ = read_boxes([layout], [np.dtype(np.uint8)], [(0, [0, 0, 0], [256, 384, 3])])
    _assert_jpeg_equal(got[0], expected)
    # Without the tables the tiles do not decode.
    bare = _tiff_layout(path, page, [_jpeg_step(page)], b"", offsets, sizes)
    with pytest.raises(stoker.ShardFormatError, match="JPEG") as e:
        read_boxes([bare], [np.dtype(np.uint8)], [(0, [0, 0, 0], [10, 10, 3])])
    assert path in str(e.value)


@pytest.mark.parametrize(
    ("dtype", "samples", "byteorder", "planar"),
    [
        ("u1", 3, "<", False),
        ("u2", 3, "<", False),
        ("u2", 1, ">", False),
        ("i4", 3, ">", False),
        ("u2", 3, "<", True),
    ],
)
def test_deflate_predictor_tiles_exact(tmp_path, dtype, samples, byteorder, planar):
    tifffile = pytest.importorskip("tifffile")
    pytest.importorskip("imagecodecs")
    rng = np.random.default_rng(6)
    info = np.iinfo(dtype)
    shape = (samples, 150, 170, 1) if planar else (150, 170, samples)
    data = rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)
    # Runs of close values, which differencing is for; the random rest checks the wrap.
    data.reshape(-1)[::3] = np.arange(data.size // 3 + (data.size % 3 > 0)) % 50
    path = str(tmp_path / "p.tif")
    tifffile.imwrite(
        path,
        data[..., 0] if planar or samples == 1 else data,
        tile=(64, 48),
        compression="zlib",
        predictor=True,
        byteorder=byteorder,
        photometric="rgb" if samples == 3 else "minisblack",
        planarconfig="separate" if planar else "contig",
    )
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        assert page.predictor == 2 and page.compression == 8
        expected = page.asarray()
        param = np.dtype(dtype).itemsize
        layout = _tiff_layout(path, page, [(F.HORIZONTAL_PREDICTOR, param), (F.ZLIB, 0)])
    np.testing.assert_array_equal(expected[..., None] if planar or samples == 1 else expected, data)
    boxes = [(0, [0] * len(shape), list(shape))] + random_boxes(rng, shape, 10)
    got, _ = read_boxes([layout], [np.dtype(dtype)], boxes)
    check(boxes, got, [data])


def test_a_jpeg_tile_cut_short_fails_alike_whatever_was_read_of_it_before(tmp_path):
    # A decode of a tile steps over the MCUs beside its part and stops after the last one
    # it uses; a later one starts at the marks earlier decodes left, exactly where a decode
    # from the start would be. Whether a box of a tile cut short fails hangs on where the
    # box ends, not on what was read of the tile before (here: the whole tile, failing).
    tifffile = _tifffile_with_jpeg()
    path = str(tmp_path / "cut.tif")
    tifffile.imwrite(path, _picture(256, 256, seed=3), tile=(256, 256), compression="jpeg")
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        sizes = np.array(page.databytecounts, np.uint64) * 6 // 10
        layout = _tiff_layout(path, page, [_jpeg_step(page)], sizes=sizes)

    def fails(box, reader):
        try:
            read_boxes([layout], [np.dtype(np.uint8)], [box], reader)
        except stoker.ShardFormatError as e:
            assert "truncated JPEG" in str(e) and path in str(e)
            return True
        return False

    # each band of 16 rows, its first 16 columns: on its own, with nothing read before
    bands = [(0, [16 * b, 0, 0], [16, 16, 3]) for b in range(16)]
    alone = [fails(box, _core.ShardReader(1)) for box in bands]
    assert not alone[0] and alone[-1]
    reader = _core.ShardReader(1)
    assert fails((0, [0, 0, 0], [256, 256, 3]), reader)
    assert [fails(box, reader) for box in bands] == alone


def test_corrupt_tiles_name_the_file(tmp_path):
    tifffile = pytest.importorskip("tifffile")
    pytest.importorskip("imagecodecs")
    picture = _picture(256, 256, seed=7)
    jpeg_path, zlib_path = str(tmp_path / "j.tif"), str(tmp_path / "z.tif")
    tifffile.imwrite(zlib_path, picture, tile=(128, 128), compression="zlib", predictor=True)
    with tifffile.TiffFile(zlib_path) as tif:
        page = tif.pages[0]
        sizes = np.array(page.databytecounts, np.uint64)
        sizes[3] //= 2  # the last tile cut short
        steps = [(F.HORIZONTAL_PREDICTOR, 1), (F.ZLIB, 0)]
        truncated = _tiff_layout(zlib_path, page, steps, sizes=sizes)
        offset = page.dataoffsets[3]
    reader = _core.ShardReader(1)
    got, _ = read_boxes([truncated], [np.dtype(np.uint8)], [(0, [0, 0, 0], [128, 256, 3])], reader)
    np.testing.assert_array_equal(got[0], picture[:128])  # the tiles before it are whole
    with pytest.raises(stoker.ShardFormatError) as e:
        read_boxes([truncated], [np.dtype(np.uint8)], [(0, [200, 200, 0], [5, 5, 3])], reader)
    assert zlib_path in str(e.value) and f"offset {offset}" in str(e.value)
    assert "chunk (1, 1, 0)" in str(e.value)

    if _core.codec_unavailable(F.JPEG):
        return
    tifffile.imwrite(jpeg_path, picture, tile=(128, 128), compression="jpeg")
    broken = str(tmp_path / "broken.tif")
    shutil.copy(jpeg_path, broken)
    with tifffile.TiffFile(broken) as tif:
        page = tif.pages[0]
        layout = _tiff_layout(broken, page, [_jpeg_step(page)])
        offset, size = page.dataoffsets[1], page.databytecounts[1]
    with open(broken, "r+b") as f:  # tile (0, 1) overwritten with noise
        f.seek(offset)
        f.write(np.random.default_rng(8).integers(0, 256, size, dtype=np.uint8).tobytes())
    with pytest.raises(stoker.ShardFormatError, match="JPEG") as e:
        read_boxes([layout], [np.dtype(np.uint8)], [(0, [0, 120, 0], [8, 16, 3])])
    assert broken in str(e.value) and f"offset {offset}" in str(e.value)


def test_jpeg_tile_of_another_size_is_refused(tmp_path):
    tifffile = _tifffile_with_jpeg()
    path = str(tmp_path / "j.tif")
    tifffile.imwrite(path, _picture(128, 128), tile=(128, 128), compression="jpeg")
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        offsets, sizes = page.dataoffsets, page.databytecounts
    # The tile said to be 64 x 256: as many bytes, another shape.
    layout = _core.ArrayLayout(
        path, (64, 256, 3), (64, 256, 3), 1, b"\0", [(F.JPEG, 0)], [path],
        np.zeros(1, np.uint32), np.array(offsets, np.uint64), np.array(sizes, np.uint64),
        np.zeros(1, np.uint32),
    )  # fmt: skip
    with pytest.raises(stoker.ShardFormatError, match="128 x 128 pixels") as e:
        read_boxes([layout], [np.dtype(np.uint8)], [(0, [0, 0, 0], [1, 1, 1])])
    assert path in str(e.value)


def test_tile_filter_layouts_checked():
    def layout(steps, itemsize=1, **kw):
        return _core.ArrayLayout(
            "bad", (4, 4, 3), (4, 4, 3), itemsize, b"\0" * itemsize, steps, ["x"],
            np.zeros(1, np.uint32), np.zeros(1, np.uint64), np.ones(1, np.uint64),
            np.zeros(1, np.uint32), **kw,
        )  # fmt: skip

    with pytest.raises(stoker.StokerError, match="8-bit"):
        layout([(F.JPEG, 0)], itemsize=2)
    with pytest.raises(stoker.StokerError, match="colour space"):
        layout([(F.JPEG, 5)])
    with pytest.raises(stoker.StokerError, match="element size"):
        layout([(F.HORIZONTAL_PREDICTOR, 2)])
    with pytest.raises(stoker.StokerError, match="first step"):
        layout([(F.ZLIB, 0), (F.HORIZONTAL_PREDICTOR, 2)], itemsize=2, byteswap=True)
    with pytest.raises(stoker.StokerError, match="without a JPEG step"):
        layout([(F.ZLIB, 0)], jpeg_tables=b"\xff\xd8\xff\xd9")
    ok = layout([(F.JPEG, 1)], jpeg_tables=b"\xff\xd8\xff\xd9")
    assert ok.jpeg_tables == b"\xff\xd8\xff\xd9" and ok.steps == [(F.JPEG, 1)]
    assert isinstance(_core.codec_unavailable(F.JPEG), str)


def test_predictor_by_hand_big_endian_and_planar(tmp_path):
    """The predictor on native values of a big-endian chunk, in both row layouts."""
    import zlib

    rng = np.random.default_rng(9)
    data = rng.integers(0, 2**16, (2, 6, 5, 3), dtype=np.uint16)  # 2 chunks of (6, 5, 3)
    path = str(tmp_path / "chunks.bin")
    offsets, sizes = [], []
    with open(path, "wb") as f:
        for planar in (False, True):
            for chunk in data:
                if planar:  # planes: (3, 6, 5) as 3 chunks of (1, 6, 5, 1)
                    planes = np.moveaxis(chunk, -1, 0)
                    diff = np.diff(planes, axis=-1, prepend=np.zeros((3, 6, 1), np.uint16))
                else:
                    diff = np.diff(chunk, axis=1, prepend=np.zeros((6, 1, 3), np.uint16))
                for part in diff if planar else [diff]:
                    stored = zlib.compress(part.astype(">u2").tobytes())
                    offsets.append(f.tell())
                    sizes.append(len(stored))
                    f.write(stored)

    def layout(shape, chunks, param, first, count):
        return _core.ArrayLayout(
            path, shape, chunks, 2, b"\0\0", [(F.HORIZONTAL_PREDICTOR, param), (F.ZLIB, 0)],
            [path], np.zeros(count, np.uint32), np.array(offsets[first : first + count], np.uint64),
            np.array(sizes[first : first + count], np.uint64), np.zeros(count, np.uint32),
            byteswap=True,
        )  # fmt: skip

    chunky = layout((12, 5, 3), (6, 5, 3), 2, 0, 2)
    got, _ = read_boxes([chunky], [np.dtype(np.uint16)], [(0, [0, 0, 0], [12, 5, 3])])
    np.testing.assert_array_equal(got[0], data.reshape(12, 5, 3))
    # Planes: the chunks in C order over the grid (rows, samples) of (6, 1, 5) chunks.
    planes = np.concatenate([np.moveaxis(c, -1, 0) for c in data], axis=1)[..., None]
    # The file holds chunk 0's three planes, then chunk 1's: grid order (plane, row).
    order = [0, 3, 1, 4, 2, 5]
    planar = _core.ArrayLayout(
        path, (3, 12, 5, 1), (1, 6, 5, 1), 2, b"\0\0",
        [(F.HORIZONTAL_PREDICTOR, 2), (F.ZLIB, 0)], [path],
        np.zeros(6, np.uint32), np.array([offsets[2 + i] for i in order], np.uint64),
        np.array([sizes[2 + i] for i in order], np.uint64), np.zeros(6, np.uint32), byteswap=True,
    )  # fmt: skip
    got, _ = read_boxes([planar], [np.dtype(np.uint16)], [(0, [0, 0, 0, 0], [3, 12, 5, 1])])
    np.testing.assert_array_equal(got[0], planes)


def test_bytes_read_counts_merged_runs(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 400)
    files = _core.FileTable([str(path)])
    dest = np.zeros(300, np.uint8)
    pending = _core.ShardReader(1).read_into(
        dest,
        files,
        np.zeros(3, np.uint32),
        np.array([0, 200, 90_000], np.uint64),  # the first two merge, their gap read too
        np.array([100, 100, 100], np.uint64),
        np.array([0, 100, 200], np.uint64),
    )
    pending.wait()
    assert pending.bytes_read() == 300 + 100


@pytest.mark.parametrize("compression", ["none", "zlib", "zlib+predictor", "jpeg"])
def test_strips_with_a_short_last_strip(tmp_path, compression):
    """TIFF strips: the last holds only the image's remaining rows (clipped_edge)."""
    tifffile = pytest.importorskip("tifffile")
    pytest.importorskip("imagecodecs")
    if compression == "jpeg" and _core.codec_unavailable(F.JPEG):
        pytest.skip(_core.codec_unavailable(F.JPEG))
    picture = _picture(150, 90, seed=10)
    path = str(tmp_path / "s.tif")
    kw: dict = {"rowsperstrip": 32 if compression == "jpeg" else 37, "photometric": "rgb"}
    if compression != "none":
        kw["compression"] = compression.split("+")[0]
        kw["predictor"] = compression.endswith("predictor")
    tifffile.imwrite(path, picture, **kw)
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        assert not page.is_tiled
        expected = page.asarray()
        steps = {
            "none": [],
            "zlib": [(F.ZLIB, 0)],
            "zlib+predictor": [(F.HORIZONTAL_PREDICTOR, 1), (F.ZLIB, 0)],
            "jpeg": [_jpeg_step(page)],
        }[compression]
        layout = _tiff_layout(path, page, steps)
    assert layout.clipped_edge and pickle.loads(pickle.dumps(layout)).clipped_edge
    rng = np.random.default_rng(11)
    boxes = [(0, [0, 0, 0], [150, 90, 3]), (0, [140, 80, 0], [10, 10, 3])]
    boxes += random_boxes(rng, picture.shape, 10)
    got, _ = read_boxes([layout], [np.dtype(np.uint8)], boxes)
    if compression == "jpeg":
        _assert_jpeg_equal(got[0], expected)
        expected = got[0]
    check(boxes, got, [expected])
    # Read as if the last strip were whole, it is too short: refused, not read past.
    whole = _core.ArrayLayout(
        layout.name, layout.shape, layout.chunk_shape, 1, b"\0", layout.steps, layout.paths,
        np.zeros(layout.num_chunks, np.uint32), np.asarray(page.dataoffsets, np.uint64),
        np.asarray(page.databytecounts, np.uint64), np.zeros(layout.num_chunks, np.uint32),
    )  # fmt: skip
    with pytest.raises(stoker.ShardFormatError) as e:
        read_boxes([whole], [np.dtype(np.uint8)], [(0, [149, 0, 0], [1, 1, 1])])
    assert path in str(e.value)
