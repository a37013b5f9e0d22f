"""TIFF / BigTIFF directories (stoker._core.read_tiff): what the C++ parser finds must be
what tifffile finds in the files it writes, and hand-made hostile files are refused with
ShardFormatError naming the file and the offset."""

from __future__ import annotations

import gc
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Union

import numpy as np
import pytest
import tifffile

import stoker
from stoker import _core
from stoker.errors import ShardFormatError
from tests.support import DATA

SEEDS = sorted((DATA / "tiff-seeds").glob("*.tif"))


def _image(shape: tuple[int, ...], dtype: str = "uint8") -> np.ndarray:
    return np.random.default_rng(0).integers(0, 200, shape).astype(dtype)


def _same_as_tifffile(ours: _core.TiffDirectory, page: tifffile.TiffPage) -> None:
    assert ours.offset == page.offset
    assert (ours.length, ours.width) == (page.imagelength, page.imagewidth)
    assert ours.tiled == page.is_tiled
    if page.is_tiled:
        assert (ours.tile_length, ours.tile_width) == (page.tilelength, page.tilewidth)
    else:
        assert (ours.tile_length, ours.tile_width) == (0, 0)
        assert ours.rows_per_strip == page.rowsperstrip
    assert ours.offsets.dtype == np.uint64 and ours.byte_counts.dtype == np.uint64
    assert ours.offsets.tolist() == list(page.dataoffsets)
    assert ours.byte_counts.tolist() == list(page.databytecounts)
    assert ours.compression == page.compression
    assert ours.photometric == page.photometric
    assert ours.planar_config == page.planarconfig
    assert ours.samples_per_pixel == page.samplesperpixel
    assert ours.bits_per_sample == [page.bitspersample] * page.samplesperpixel
    assert ours.sample_format == page.sampleformat
    assert ours.predictor == page.predictor
    assert ours.new_subfile_type == page.subfiletype
    assert ours.jpeg_tables == (page.jpegtables or b"")
    assert ours.description == page.description
    assert ours.big_endian == (page.parent.byteorder == ">")
    assert ours.big_tiff == page.parent.is_bigtiff
    assert [d.offset for d in ours.sub_directories] == list(page.subifds or ())


def _check_file(path: Path) -> list[_core.TiffDirectory]:
    ours = _core.read_tiff(str(path))
    with tifffile.TiffFile(path) as tif:
        pages = list(tif.pages)
        assert len(ours) == len(pages)
        for directory, page in zip(ours, pages):
            _same_as_tifffile(directory, page)
            for sub, offset in zip(directory.sub_directories, page.subifds or ()):
                tif.filehandle.seek(offset)  # where TiffPage reads its IFD
                _same_as_tifffile(sub, tifffile.TiffPage(tif, index=0))
    return ours


# -- files tifffile writes ------------------------------------------------------------


def test_tiled_uncompressed(tmp_path):
    path = tmp_path / "tiled.tif"
    tifffile.imwrite(path, _image((70, 50, 3)), tile=(32, 16))
    (d,) = _check_file(path)
    assert d.tiled and (d.width, d.length, d.tile_width, d.tile_length) == (50, 70, 16, 32)
    assert len(d.offsets) == 4 * 3  # ceil(50 / 16) * ceil(70 / 32)
    assert d.byte_counts.tolist() == [32 * 16 * 3] * 12
    assert d.ycbcr_subsampling == (2, 2)


def test_tiled_deflate(tmp_path):
    path = tmp_path / "zlib.tif"
    tifffile.imwrite(path, _image((48, 48), "uint16"), tile=(16, 16), compression="zlib")
    (d,) = _check_file(path)
    assert d.compression == 8 and d.bits_per_sample == [16] and len(d.offsets) == 9


def test_tiled_jpeg_with_tables(tmp_path):
    path = tmp_path / "jpeg.tif"
    tables = b"\xff\xd8\xff\xdb\x00\x43\x00" + bytes(range(64)) + b"\xff\xd9"
    tifffile.imwrite(
        path,
        _image((32, 48, 3)),
        tile=(16, 16),
        compression="jpeg",
        photometric="rgb",
        jpegtables=tables,
    )
    (d,) = _check_file(path)
    assert d.compression == 7 and d.jpeg_tables == tables and len(d.offsets) == 6


def test_stripped(tmp_path):
    path = tmp_path / "strips.tif"
    tifffile.imwrite(path, _image((50, 30)), rowsperstrip=16)
    (d,) = _check_file(path)
    assert not d.tiled and d.rows_per_strip == 16 and len(d.offsets) == 4


def test_stripped_separate_planes(tmp_path):
    path = tmp_path / "planar.tif"
    tifffile.imwrite(
        path,
        _image((3, 20, 10), "uint16"),
        planarconfig="separate",
        photometric="rgb",
        rowsperstrip=8,
        compression="zlib",
        predictor=True,
    )
    (d,) = _check_file(path)
    assert d.planar_config == 2 and d.predictor == 2
    assert len(d.offsets) == 3 * 3  # three planes of ceil(20 / 8) strips


def test_bigtiff(tmp_path):
    path = tmp_path / "big.tif"
    tifffile.imwrite(path, _image((40, 40, 3)), tile=(16, 16), bigtiff=True)
    (d,) = _check_file(path)
    assert d.big_tiff and not d.big_endian and len(d.offsets) == 9


def test_big_endian(tmp_path):
    path = tmp_path / "be.tif"
    tifffile.imwrite(path, _image((40, 24), "float32"), tile=(16, 16), byteorder=">")
    (d,) = _check_file(path)
    assert d.big_endian and not d.big_tiff and d.sample_format == 3 and d.bits_per_sample == [32]


@pytest.mark.parametrize("bigtiff", [False, True])
@pytest.mark.parametrize("byteorder", ["<", ">"])
def test_pyramid_in_subifds(tmp_path, bigtiff, byteorder):
    path = tmp_path / "pyramid.tif"
    data = _image((128, 96, 3))
    with tifffile.TiffWriter(path, bigtiff=bigtiff, byteorder=byteorder) as tif:
        tif.write(data, subifds=2, tile=(32, 32), compression="zlib")
        tif.write(data[::2, ::2], subfiletype=1, tile=(32, 32), compression="zlib")
        tif.write(data[::4, ::4], subfiletype=1, tile=(16, 16), compression="zlib")
    (top,) = _check_file(path)
    assert [(d.width, d.length) for d in top.sub_directories] == [(48, 64), (24, 32)]
    assert [d.new_subfile_type for d in top.sub_directories] == [1, 1]
    with tifffile.TiffFile(path) as tif:
        levels = tif.series[0].levels
        assert len(levels) == 3
        for ours, level in zip([top, *top.sub_directories], levels):
            assert ours.offsets.tolist() == list(level.pages[0].dataoffsets)


def test_multipage(tmp_path):
    path = tmp_path / "pages.tif"
    with tifffile.TiffWriter(path) as tif:
        for k in range(4):
            tif.write(_image((16 + 8 * k, 16)), description=f"page {k}", tile=(16, 16))
    directories = _check_file(path)
    assert [(d.width, d.length) for d in directories] == [(16, 16), (16, 24), (16, 32), (16, 40)]
    assert directories[2].description == "page 2"


@pytest.mark.parametrize("path", SEEDS, ids=[p.name for p in SEEDS])
def test_fuzz_seeds_read_as_tifffile_reads_them(path):
    assert path.stat().st_size < 16 * 1024
    _check_file(path)


def test_the_seeds_are_there():
    names = {p.name for p in SEEDS}
    assert {"tiled.tif", "stripped.tif", "bigtiff.tif", "big-endian.tif"} <= names
    assert {"subifds.tif", "jpeg-tables.tif"} <= names


def test_columns_are_read_only_and_keep_their_directory_alive(tmp_path):
    path = tmp_path / "t.tif"
    with tifffile.TiffWriter(path) as tif:
        tif.write(_image((64, 64)), subifds=1, tile=(16, 16))
        tif.write(_image((32, 32)), subfiletype=1, tile=(16, 16))
    directories = _core.read_tiff(path)  # an os.PathLike is taken too
    offsets = directories[0].offsets
    sub = directories[0].sub_directories[0]
    with pytest.raises(ValueError):
        offsets[0] = 1
    expected = offsets.tolist()
    del directories
    gc.collect()
    assert offsets.tolist() == expected and sub.width == 32 and len(sub.byte_counts) == 4
    with pytest.raises(AttributeError):
        sub.width = 1  # type: ignore[misc]
    assert "TiffDirectory(offset=" in repr(sub)


def test_a_missing_file_is_a_read_error(tmp_path):
    with pytest.raises(stoker.ReadError):
        _core.read_tiff(str(tmp_path / "absent.tif"))


# -- hand-made files ------------------------------------------------------------------

# Entry values: a list of integers (packed as the type says) or raw bytes, or a function
# of the IFDs' offsets that gives either (to point at another IFD).
Values = Union[Sequence[int], bytes, Callable[[list], Union[Sequence[int], bytes]]]
Ifd = dict[int, tuple[int, Values]]
FORMATS = {1: "B", 2: "B", 3: "H", 4: "I", 7: "B", 11: "f", 13: "I", 16: "Q", 18: "Q"}
DATA_AT = 16  # where `data` goes: after the header (BigTIFF's is 16 bytes)


def build(
    ifds: list[Ifd],
    *,
    big: bool = False,
    order: str = "<",
    data: bytes = bytes(range(64)),
    links: Callable[[list[int]], list[int]] | None = None,
    first: int | None = None,
) -> bytes:
    """A TIFF of `ifds`, laid out as header, `data`, then each IFD with its values after it.
    `links` gives each IFD's next-IFD offset from all the IFDs' offsets (default: a chain);
    `first` overrides the header's first IFD offset."""
    offsets: list[int] = [0] * len(ifds)
    for _ in range(2):  # the second pass knows where every IFD is
        out = bytearray(DATA_AT) + data
        nexts: list[int] = []
        field = 8 if big else 4
        for k, ifd in enumerate(ifds):
            out += b"\0" * (len(out) % 2)
            offsets[k] = len(out)
            values_at = len(out) + (8 if big else 2) + len(ifd) * (20 if big else 12) + field
            entries, blob = bytearray(), bytearray()
            for tag, (kind, values) in sorted(ifd.items()):
                v = values(offsets) if callable(values) else values
                raw = (
                    v
                    if isinstance(v, bytes)
                    else b"".join(struct.pack(order + FORMATS[kind], x) for x in v)
                )
                if len(raw) <= field:
                    stored = raw.ljust(field, b"\0")
                else:
                    stored = struct.pack(order + ("Q" if big else "I"), values_at + len(blob))
                    blob += raw + b"\0" * (len(raw) % 2)
                entries += (
                    struct.pack(order + ("HHQ" if big else "HHI"), tag, kind, len(v)) + stored
                )
            out += struct.pack(order + ("Q" if big else "H"), len(ifd)) + entries
            nexts.append(len(out))
            out += b"\0" * field
            out += blob
        targets = links(offsets) if links else [*offsets[1:], 0]
        for at, target in zip(nexts, targets):
            out[at : at + field] = struct.pack(order + ("Q" if big else "I"), target)
        start = offsets[0] if first is None else first
        magic = b"II" if order == "<" else b"MM"
        if big:
            out[:16] = magic + struct.pack(order + "HHHQ", 43, 8, 0, start)
        else:
            out[:8] = magic + struct.pack(order + "HI", 42, start)
    return bytes(out)


def strips(
    width: int = 4, length: int = 8, n: int = 2, kind: int = 4, **extra: tuple[int, Values]
) -> Ifd:
    """A directory of `n` strips of 8 bytes each in `data`."""
    ifd: Ifd = {
        256: (3, [width]),
        257: (3, [length]),
        278: (3, [-(-length // n)]),
        273: (kind, [DATA_AT + 8 * i for i in range(n)]),
        279: (kind, [8] * n),
    }
    ifd.update({int(tag[1:]): value for tag, value in extra.items()})
    return ifd


def write(tmp_path: Path, content: bytes, name: str = "made.tif") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def refused(path: Path, *words: str) -> ShardFormatError:
    with pytest.raises(ShardFormatError) as info:
        _core.read_tiff(str(path))
    message = str(info.value)
    assert str(path) in message and info.value.path == str(path)
    for word in words:
        assert word in message, message
    return info.value


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("kind", [1, 3, 4, 16])  # BYTE, SHORT, LONG, LONG8
@pytest.mark.parametrize("n", [1, 2, 4])  # inline and stored apart, in both offset sizes
def test_integer_types_inline_and_apart(tmp_path, big, order, kind, n):
    ifd = strips(n=n, kind=kind, t258=(3, [8]), t277=(3, [1]), t262=(3, [1]))
    path = write(tmp_path, build([ifd], big=big, order=order))
    (d,) = _core.read_tiff(str(path))
    assert d.offsets.tolist() == [DATA_AT + 8 * i for i in range(n)]
    assert d.byte_counts.tolist() == [8] * n
    assert (d.width, d.length, d.rows_per_strip) == (4, 8, 8 // n)
    assert (d.big_tiff, d.big_endian, d.photometric) == (big, order == ">", 1)


def test_defaults_of_absent_tags(tmp_path):
    ifd = {256: (4, [4]), 257: (4, [8]), 273: (4, [DATA_AT]), 279: (4, [32])}
    (d,) = _core.read_tiff(str(write(tmp_path, build([ifd]))))
    assert d.rows_per_strip == 8 and d.samples_per_pixel == 1 and d.bits_per_sample == [1]
    assert (d.sample_format, d.compression, d.planar_config, d.predictor) == (1, 1, 1, 1)
    assert d.photometric is None and d.new_subfile_type == 0 and d.ycbcr_subsampling == (2, 2)
    assert d.jpeg_tables == b"" and d.description == "" and d.sub_directories == []


def test_descriptions_end_at_nul_and_keep_bytes_that_are_not_utf8(tmp_path):
    ifd = strips(t270=(2, b"caf\xe9 \xc3\xa9\0second\0"), t530=(3, [2, 1]))
    (d,) = _core.read_tiff(str(write(tmp_path, build([ifd]))))
    assert d.description == b"caf\xe9 \xc3\xa9".decode("utf-8", "surrogateescape")
    assert d.ycbcr_subsampling == (2, 1)


@pytest.mark.parametrize("kind", [4, 13, 18])  # LONG, IFD, IFD8
def test_sub_ifds_of_each_type_and_a_chain_from_one(tmp_path, kind):
    big = kind == 18
    # IFD 0 has SubIFDs 1 and 2; IFD 3 is the main chain's second; IFD 3 has one SubIFD,
    # 4, which heads a chain 4 -> 5.
    ifds = [
        strips(t330=(kind, lambda o: [o[1], o[2]])),
        strips(width=2),
        strips(width=1),
        strips(width=3, t330=(kind, lambda o: [o[4]])),
        strips(width=5),
        strips(width=6),
    ]
    links = lambda o: [o[3], o[0] + 1, 0, 0, o[5], 0]  # noqa: E731  (1's next: ignored)
    path = write(tmp_path, build(ifds, big=big, links=links))
    first, second = _core.read_tiff(str(path))
    assert [d.width for d in first.sub_directories] == [2, 1]
    assert second.width == 3 and [d.width for d in second.sub_directories] == [5, 6]


def test_bad_magic(tmp_path):
    refused(write(tmp_path, b"GIF89a" + bytes(64)), "not a TIFF file", "GIF8")
    refused(write(tmp_path, b"II*", "short.tif"), "not a TIFF file")
    bad = bytearray(build([strips()], big=True))
    bad[4] = 4  # BigTIFF with 4-byte offsets
    refused(write(tmp_path, bytes(bad), "offsets.tif"), "BigTIFF")


def test_tile_past_the_end_of_a_truncated_file(tmp_path):
    path = tmp_path / "cut.tif"
    tifffile.imwrite(path, _image((64, 64, 3)), tile=(16, 16))
    with tifffile.TiffFile(path) as tif:
        last = tif.pages[0].dataoffsets[-1]
    content = path.read_bytes()
    path.write_bytes(content[: last + 10])
    error = refused(path, "tile 15 of directory 0", "runs past the end of the file")
    assert error.offset == last
    assert f"({last + 10} bytes)" in str(error)


def test_strip_past_the_end(tmp_path):
    ifd = strips(n=2)
    ifd[279] = (4, [8, 1 << 20])
    error = refused(write(tmp_path, build([ifd])), "strip 1 of directory 0", "past the end")
    assert error.offset == DATA_AT + 8


@pytest.mark.parametrize("size", [1, 2])
def test_ifd_loop(tmp_path, size):
    ifds = [strips() for _ in range(size)]
    path = write(tmp_path, build(ifds, links=lambda o: [*o[1:], o[0]]))
    refused(path, f"directory {size}'s IFD offset", "that of directory 0", "loops")


def test_sub_ifd_pointing_at_its_parent_is_a_loop(tmp_path):
    path = write(tmp_path, build([strips(t330=(13, lambda o: [o[0]]))]))
    refused(path, "SubIFD 0", "loops")


def test_ifd_offset_past_the_end(tmp_path):
    error = refused(write(tmp_path, build([strips()], first=10**6)), "past the end of the file")
    assert error.offset == 4
    path = write(tmp_path, build([strips()], links=lambda o: [10**6]), "next.tif")
    refused(path, "directory 1", "past the end of the file")
    refused(write(tmp_path, build([strips()], first=0), "none.tif"), "no image directory")


def test_ifd_cut_off(tmp_path):
    content = build([strips()])
    refused(write(tmp_path, content[: -(len(content) - DATA_AT - 64 - 10)]), "run past the end")


def test_value_array_past_the_end(tmp_path):
    content = build([strips(n=8)])  # its offsets and byte counts are stored after the IFD
    refused(write(tmp_path, content[:-4]), "StripByteCounts (tag 279)", "run past the end")


def test_counts_that_do_not_match_the_grid(tmp_path):
    ifd = strips(n=2)
    ifd[278] = (3, [3])  # 8 rows in strips of 3 need 3 strips
    refused(write(tmp_path, build([ifd])), "has 2 strip offsets", "needs 3")
    ifd = strips(n=2)
    ifd[279] = (4, [8, 8, 8])
    refused(write(tmp_path, build([ifd]), "counts.tif"), "2 strip offsets but 3 strip byte counts")
    planar = strips(n=2, t277=(3, [3]), t284=(3, [2]))
    refused(write(tmp_path, build([planar]), "planar.tif"), "3 planes", "needs 6")
    tiles = {
        256: (3, [40]),
        257: (3, [20]),
        322: (3, [16]),
        323: (3, [16]),
        324: (4, [DATA_AT] * 4),
        325: (4, [1] * 4),
    }
    refused(write(tmp_path, build([tiles]), "tiles.tif"), "4 tile offsets", "16 x 16 tiles needs 6")
    tiles[324] = (4, [DATA_AT] * 6)
    tiles[325] = (4, [1] * 6)
    (d,) = _core.read_tiff(str(write(tmp_path, build([tiles]), "ok.tif")))
    assert d.tiled and len(d.offsets) == 6


def test_empty_images_and_tiles(tmp_path):
    refused(write(tmp_path, build([strips(width=0)])), "0 x 8 pixels")
    zero_tile = {256: (3, [4]), 257: (3, [4]), 322: (3, [0]), 323: (3, [16])}
    zero_tile.update({324: (4, [DATA_AT]), 325: (4, [1])})
    refused(write(tmp_path, build([zero_tile]), "tile.tif"), "tiles are 0 x 16")
    odd_tile = {**zero_tile, 322: (3, [5])}  # not a multiple of 16: taken
    (d,) = _core.read_tiff(str(write(tmp_path, build([odd_tile]), "odd.tif")))
    assert d.tile_width == 5
    refused(write(tmp_path, build([strips(t278=(3, [0]))]), "rows.tif"), "0 rows per strip")
    no_offsets = strips()
    del no_offsets[273]
    refused(write(tmp_path, build([no_offsets]), "where.tif"), "no StripOffsets")


def test_width_times_length_overflow(tmp_path):
    ifd = strips(n=1, t256=(16, [1 << 40]), t257=(16, [1 << 40]), t278=(16, [1 << 40]))
    refused(write(tmp_path, build([ifd], big=True)), "too large")


def test_wrong_field_types(tmp_path):
    refused(write(tmp_path, build([strips(t256=(11, [0]))])), "ImageWidth (tag 256)", "type 11")


def test_too_many_directories(tmp_path):
    one = strips(n=1)
    content = build([one] * 4097)
    refused(write(tmp_path, content), "more than 4096 image directories")
    (first, *rest) = _core.read_tiff(str(write(tmp_path, build([one] * 4096), "ok.tif")))
    assert len(rest) == 4095


def test_too_many_entries(tmp_path):
    content = bytearray(build([strips()]))
    content[DATA_AT + 64 : DATA_AT + 66] = struct.pack("<H", 5000)
    refused(write(tmp_path, bytes(content)), "5000 entries")


def test_sub_ifds_nested_too_deep(tmp_path):
    depth = 10
    ifds = [strips(t330=(13, lambda o, k=k: [o[k + 1]])) for k in range(depth)] + [strips()]
    path = write(tmp_path, build(ifds, links=lambda o: [0] * len(o)))
    refused(path, "nest more than 8 deep")
