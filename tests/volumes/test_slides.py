"""Patches of tiled TIFF and pyramidal slides written by tifffile: byte for byte what
tifffile reads (JPEG within a decoder's rounding), for every compression stoker decodes,
both byte orders, BigTIFF, strips, planes and pyramid levels; the bad files named."""

from __future__ import annotations

import numpy as np
import pytest

import stoker

tifffile = pytest.importorskip("tifffile")
pytest.importorskip("imagecodecs")
torch = pytest.importorskip("torch")


def rgb_image(shape, seed=0):
    """A smooth RGB picture with some texture (JPEG keeps it close)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[: shape[0], : shape[1]]
    base = np.stack([(x * 3) % 256, (y * 2) % 256, ((x + y) * 1) % 256], axis=-1)
    return np.clip(base + rng.integers(-8, 9, base.shape), 0, 255).astype(np.uint8)


def slide_loader(path, patch=64, batch=4, level=0, sampler=None, n=6, **kw):
    volumes = stoker.Volumes([{"id": "slide", "image": str(path)}], spatial_dims=2, level=level)
    return stoker.PatchLoader(
        volumes,
        patch,
        batch,
        sampler=sampler or stoker.UniformSampler(),
        patches_per_subject=n,
        **kw,
    )


def channels_first(image):
    return image if image.ndim == 2 else np.moveaxis(image, -1, 0)


def check(loader, truth, atol=0):
    """Every patch equals the truth's slice (channels last in `truth`)."""
    seen = 0
    for batch in loader:
        for b in range(len(batch["location"])):
            y, x = (int(v) for v in batch["location"][b])
            p = loader.patch_size
            want = np.zeros((*p, *truth.shape[2:]), truth.dtype)
            ys, xs = (
                slice(max(y, 0), min(y + p[0], truth.shape[0])),
                slice(max(x, 0), min(x + p[1], truth.shape[1])),
            )
            want[ys.start - y : ys.stop - y, xs.start - x : xs.stop - x] = truth[ys, xs]
            got = batch["image"][b].numpy()
            want = channels_first(want).reshape(got.shape)
            if atol:
                assert np.abs(got.astype(int) - want.astype(int)).max() <= atol
            else:
                np.testing.assert_array_equal(got, want)
            seen += 1
    return seen


LOSSLESS = {
    "none": {},
    "deflate": {"compression": "zlib"},
    "deflate+predictor": {"compression": "zlib", "predictor": True},
    "zstd": {"compression": "zstd"},
}


@pytest.mark.parametrize("options", LOSSLESS.values(), ids=LOSSLESS.keys())
@pytest.mark.parametrize("layout", ["tiled", "bigtiff", "big-endian", "stripped", "planes"])
def test_lossless_tiles_are_exact(tmp_path, options, layout):
    image = rgb_image((300, 410))
    if layout == "big-endian":
        image = image.astype(np.uint16) * 257
    kw = dict(options)
    if layout != "stripped":
        kw["tile"] = (64, 96) if layout != "planes" else (32, 32)
    else:
        kw["rowsperstrip"] = 37
    if layout == "bigtiff":
        kw["bigtiff"] = True
    if layout == "big-endian":
        kw["byteorder"] = ">"
    if layout == "planes":
        kw["planarconfig"] = "separate"
        image_to_write = np.moveaxis(image, -1, 0)
        kw["photometric"] = "rgb"
    else:
        image_to_write = image
        kw["photometric"] = "rgb"
    path = tmp_path / "slide.tif"
    tifffile.imwrite(path, image_to_write, **kw)
    assert np.array_equal(
        np.moveaxis(tifffile.imread(path), 0, -1) if layout == "planes" else tifffile.imread(path),
        image,
    )
    assert check(slide_loader(path, patch=(70, 50), n=8), image) == 8
    grid = slide_loader(path, patch=(128, 128), sampler=stoker.GridSampler(overlap=0))
    assert check(grid, image) > 0


def test_grayscale_and_sixteen_bit(tmp_path):
    image = (rgb_image((200, 260))[..., 0].astype(np.uint16) * 251).astype(np.uint16)
    path = tmp_path / "gray.tif"
    tifffile.imwrite(path, image, tile=(64, 64), compression="zlib")
    loader = slide_loader(path, patch=48, sampler=stoker.GridSampler(overlap=0))
    assert check(loader, image) > 0
    batch = next(iter(slide_loader(path, patch=48)))
    assert batch["image"].shape == (4, 1, 48, 48)


@pytest.mark.parametrize("photometric", ["ycbcr", "rgb"])
def test_jpeg_tiles_match_tifffile(tmp_path, photometric):
    image = rgb_image((512, 640))
    path = tmp_path / "jpeg.tif"
    # tifffile converts RGB to YCbCr by default; JPEG's colour space RGB stores RGB, as
    # Aperio's .svs does (photometric 2)
    options = (
        {"photometric": "rgb", "compressionargs": {"outcolorspace": "rgb"}}
        if photometric == "rgb"
        else {}
    )
    tifffile.imwrite(path, image, tile=(256, 256), compression="jpeg", **options)
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        assert page.compression == 7
        assert page.photometric == (2 if photometric == "rgb" else 6)
        decoded = page.asarray()
    # The same tiles, decoded by libjpeg-turbo both times, equal: a patch that needs only a
    # part of a tile decodes only that part (cropped and skipped), to the same values.
    assert check(slide_loader(path, patch=100, n=24), decoded) == 24
    assert check(slide_loader(path, patch=(37, 300), n=8, seed=3), decoded) == 8
    assert np.abs(decoded.astype(int) - image.astype(int)).mean() < 8


@pytest.mark.parametrize("subsampling", [(2, 2), (2, 1), (1, 1)], ids=["420", "422", "444"])
def test_parts_of_jpeg_tiles_equal_whole_decodes(tmp_path, subsampling):
    # A patch's part of a tile is decoded alone: columns cropped (with a margin, as a crop's
    # edge is upsampled without its neighbours) and rows skipped (with none: libjpeg decodes
    # the rows above that upsampling reads). Thin and small patches at many offsets, from
    # every chroma subsampling, must equal tifffile's whole-tile decodes.
    image = rgb_image((700, 900), seed=sum(subsampling))
    path = tmp_path / "jpeg.tif"
    tifffile.imwrite(path, image, tile=(256, 256), compression="jpeg", subsampling=subsampling)
    decoded = tifffile.imread(path)
    for k, patch in enumerate([24, (5, 300), (300, 7), 200]):
        assert check(slide_loader(path, patch=patch, n=120, seed=k), decoded) == 120


@pytest.mark.parametrize("kind", ["420", "422", "444", "grey"])
def test_later_decodes_of_a_jpeg_tile_start_at_its_marks(tmp_path, kind):
    # A decode of a tile marks where each MCU's entropy data starts; a later decode of it
    # restores the mark before the first MCU it needs, and steps over the MCUs of the
    # columns it crops away (where the earlier decodes went that far; else it decodes on
    # from the last mark). Epoch after epoch of thin, small and large patches at every
    # offset must equal tifffile's whole-tile decodes, and the marks must have been used,
    # as must stoker's own decoder for the MCUs between a mark and the first one needed.
    works, before, skimmed = stoker._core.jpeg_entropy_marks()
    assert works, "the marks did not pass their check against this libjpeg"
    image = rgb_image((600, 700), seed=7)
    options = {"subsampling": {"420": (2, 2), "422": (2, 1), "444": (1, 1)}.get(kind, (2, 2))}
    if kind == "grey":
        image, options = image[..., 1].copy(), {}
    path = tmp_path / f"{kind}.tif"
    tifffile.imwrite(path, image, tile=(128, 256), compression="jpeg", **options)
    decoded = tifffile.imread(path)
    for k, patch in enumerate([(3, 250), (250, 5), 40, 150]):
        loader = slide_loader(path, patch=patch, n=60, seed=k)
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert check(loader, decoded) == 60
    _, stepped_over, skimmed_after = stoker._core.jpeg_entropy_marks()
    assert stepped_over > before and skimmed_after > skimmed


@pytest.mark.parametrize("subsampling", [(2, 2), (1, 1)])
def test_jpeg_tiles_with_tables_of_their_own_and_long_codes_decode_alike_with_marks(
    tmp_path, subsampling
):
    # Optimized Huffman tables give each tile tables of its own (32 here), more than a
    # thread keeps built for stoker's entropy decoder (it builds a tile's when it meets them
    # again soon, as each thread does among eight tiles), and noise at quality 100 gives
    # codes longer than its look-up window (up to 15 bits) and the widest magnitudes. The
    # MCUs that decoder skims must leave the decode where libjpeg's would. The patches
    # take less than half of any tile, so each decodes its part afresh (none is kept whole).
    rng = np.random.default_rng(sum(subsampling))
    image = rgb_image((256, 1024), seed=3)
    image[60:200, 100:900] = rng.integers(0, 256, (140, 800, 3), dtype=np.uint8)
    path = tmp_path / "optimized.tif"
    tifffile.imwrite(
        path,
        image,
        tile=(128, 256),
        compression="jpeg",
        compressionargs={"level": 100, "optimize": True},
        subsampling=subsampling,
    )
    decoded = tifffile.imread(path)
    skimmed = stoker._core.jpeg_entropy_marks()[2]
    for k, patch in enumerate([(3, 100), 40, (60, 100)]):
        loader = slide_loader(path, patch=patch, n=60, seed=k)
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert check(loader, decoded) == 60
    assert stoker._core.jpeg_entropy_marks()[2] > skimmed


@pytest.mark.parametrize("corruption", ["garbage", "a restart marker", "an end of image"])
def test_a_jpeg_tile_with_corrupt_entropy_data_decodes_alike_with_marks(tmp_path, corruption):
    # libjpeg steps over corrupt entropy data (padding with zeros) as the usual decoders do;
    # marks are not made past the point it gave up, so later decodes give the same pixels.
    # stoker's own entropy decoder stops where it meets a code it cannot read, and leaves
    # the rest to libjpeg: decodes that skim give what decodes without it give. Tiles with a
    # marker in mid-stream are not skimmed at all (libjpeg-turbo decodes them in ways that
    # hang on how far ahead it had read).
    path = tmp_path / "corrupt.tif"
    image = rgb_image((256, 2048), seed=2)
    tifffile.imwrite(path, image, tile=(128, 256), compression="jpeg")
    with tifffile.TiffFile(path) as tif:
        tiles = list(zip(tif.pages[0].dataoffsets, tif.pages[0].databytecounts))
    data = bytearray(path.read_bytes())
    for offset, count in tiles:
        middle = offset + count // 2
        if corruption == "garbage":  # no 0xFF: codes that lead anywhere
            data[middle : middle + 64] = bytes((b * 37 + 11) % 255 for b in range(64))
        else:  # in mid-stream, where libjpeg stops and pads the rest with zeros
            data[middle : middle + 2] = b"\xff\xd0" if "restart" in corruption else b"\xff\xd9"
    path.write_bytes(bytes(data))
    # (a copy for the decodes that skim: nothing decoded or marked before is found for it)
    skimming = tmp_path / "corrupt-too.tif"
    skimming.write_bytes(bytes(data))

    def epochs(loader):
        out = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            out += [b["image"].clone() for b in loader]
        return out

    grid = dict(patch=48, batch=4, sampler=stoker.GridSampler(overlap=0))
    # (few small patches: a tile's part is decoded alone, from the marks before it, across
    # the corrupt bytes)
    small = dict(patch=40, n=16, seed=3)
    before = stoker._core.allow_jpeg_skim(False)
    try:
        plain = epochs(slide_loader(path, **grid)), epochs(slide_loader(path, **small))
    finally:
        stoker._core.allow_jpeg_skim(before)
    skimmed = stoker._core.jpeg_entropy_marks()[2]
    got = epochs(slide_loader(skimming, **grid)), epochs(slide_loader(skimming, **small))
    for want, have in zip(plain, got):
        assert all(torch.equal(a, b) for a, b in zip(want, have, strict=True))
    after = stoker._core.jpeg_entropy_marks()[2]
    assert after > skimmed if corruption == "garbage" else after == skimmed


def pyramid(path, image, levels=3, subifds=True, **kw):
    """A pyramid as tifffile documents it: level 0 with SubIFDs, each lower level halved
    (or, subifds=False, the levels as pages of the main chain, as .svs files keep them)."""
    pages = [image]
    for _ in range(levels - 1):
        pages.append(pages[-1][::2, ::2].copy())
    with tifffile.TiffWriter(path, bigtiff=False) as tif:
        if subifds:
            tif.write(pages[0], tile=(64, 64), subifds=levels - 1, photometric="rgb", **kw)
            for level in pages[1:]:
                tif.write(level, tile=(64, 64), subfiletype=1, photometric="rgb", **kw)
        else:
            tif.write(pages[0], tile=(64, 64), photometric="rgb", **kw)
            tif.write(pages[0][::16, ::16].copy(), photometric="rgb")  # a stripped thumbnail
            for level in pages[1:]:
                tif.write(level, tile=(64, 64), subfiletype=1, photometric="rgb", **kw)
    return pages


@pytest.mark.parametrize("subifds", [True, False], ids=["subifds", "svs-like"])
def test_pyramid_levels(tmp_path, subifds):
    image = rgb_image((512, 768))
    path = tmp_path / "pyramid.tif"
    pages = pyramid(path, image, subifds=subifds, compression="zlib")
    for level, truth in enumerate(pages):
        loader = slide_loader(path, patch=40, level=level, n=4)
        assert loader.volumes.spatial_shape(0) == truth.shape[:2]
        assert check(loader, truth) == 4
    with pytest.raises(stoker.UsageError, match="level=3.*0: 768x512"):
        slide_loader(path, level=3)


def test_label_balanced_patches_of_a_slide(tmp_path):
    image = rgb_image((256, 256))
    mask = np.zeros((256, 256), np.uint8)
    mask[100:140, 30:60] = 1
    tifffile.imwrite(tmp_path / "s.tif", image, tile=(64, 64), compression="zlib")
    tifffile.imwrite(tmp_path / "m.tif", mask, tile=(64, 64), compression="zlib")
    volumes = stoker.Volumes(
        [{"image": str(tmp_path / "s.tif"), "label": str(tmp_path / "m.tif")}], spatial_dims=2
    )
    loader = stoker.PatchLoader(
        volumes, 32, 8, sampler=stoker.LabelSampler("label", ratio=(1, 0)), patches_per_subject=16
    )
    for batch in loader:
        assert (batch["label"][:, 0, 16, 16] == 1).all()
        for b in range(8):
            y, x = (int(v) for v in batch["location"][b])
            np.testing.assert_array_equal(
                batch["image"][b].numpy(), np.moveaxis(image[y : y + 32, x : x + 32], -1, 0)
            )


def test_stats_count_the_tiles_read(tmp_path):
    image = rgb_image((1024, 1024))
    path = tmp_path / "s.tif"
    tifffile.imwrite(path, image, tile=(128, 128))
    loader = slide_loader(path, patch=128, batch=1, sampler=stoker.GridSampler(overlap=0))
    next(iter(loader))
    stats = loader.stats()
    assert stats["bytes_read"] == 128 * 128 * 3  # one tile of the 64


def test_uncompressed_tiles_read_only_the_rows_a_patch_spans(tmp_path):
    # A patch's part of an uncompressed tile is read from its first byte to its last: its
    # rows, whole, not the tile (the part's own bytes plus the rows' other columns).
    image = rgb_image((700, 900))
    path = tmp_path / "raw.tif"
    tifffile.imwrite(path, image, tile=(128, 128))
    loader = slide_loader(path, patch=(100, 90), batch=1, n=20)
    want = 0
    for batch in loader:
        y, x = (int(v) for v in batch["location"][0])
        np.testing.assert_array_equal(
            batch["image"][0].numpy(), np.moveaxis(image[y : y + 100, x : x + 90], -1, 0)
        )
        for ty in range(y // 128, (y + 99) // 128 + 1):
            for tx in range(x // 128, (x + 89) // 128 + 1):
                rows = min(y + 100, (ty + 1) * 128) - max(y, ty * 128)
                cols = min(x + 90, (tx + 1) * 128) - max(x, tx * 128)
                want += ((rows - 1) * 128 + cols) * 3
    assert loader.stats()["bytes_read"] == want
    assert want < 20 * 4 * 128 * 128 * 3 / 2  # about half the tiles' bytes


# -- bad files ---------------------------------------------------------------------------


def test_tiles_past_the_end_of_the_file(tmp_path):
    path = tmp_path / "cut.tif"
    tifffile.imwrite(path, rgb_image((256, 256)), tile=(64, 64))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(stoker.ShardFormatError, match="cut.tif") as e:
        stoker.Volumes([{"image": str(path)}], spatial_dims=2)
    assert "end of the file" in str(e.value)


def test_uncompressed_tiles_cut_short_after_opening_name_the_file(tmp_path):
    # The parts of uncompressed tiles are read from the file's mapping: a file cut shorter
    # after the Volumes were made is a short read naming it, not a SIGBUS.
    path = tmp_path / "cut-later.tif"
    tifffile.imwrite(path, rgb_image((512, 512)), tile=(64, 64))
    loader = slide_loader(path, patch=64, batch=8, sampler=stoker.GridSampler(overlap=0))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(stoker.ShardFormatError, match="cut-later.tif"):
        list(loader)


def test_an_unsupported_compression_is_named_with_the_way_out(tmp_path):
    path = tmp_path / "lzw.tif"
    tifffile.imwrite(path, rgb_image((128, 128)), tile=(64, 64), compression="lzw")
    with pytest.raises(stoker.ShardFormatError, match=r"LZW.*compression 5.*lzw.tif|lzw.tif.*LZW"):
        stoker.Volumes([{"image": str(path)}], spatial_dims=2)
    with pytest.raises(stoker.ShardFormatError, match="compression='jpeg'"):
        stoker.Volumes([{"image": str(path)}], spatial_dims=2)


def test_a_corrupt_tile_names_the_file(tmp_path):
    path = tmp_path / "bad.tif"
    tifffile.imwrite(path, rgb_image((128, 128)), tile=(64, 64), compression="zlib")
    with tifffile.TiffFile(path) as tif:
        offset = tif.pages[0].dataoffsets[1]
    data = bytearray(path.read_bytes())
    data[offset + 2 : offset + 40] = b"\xff" * 38
    path.write_bytes(bytes(data))
    loader = slide_loader(path, patch=64, batch=4, sampler=stoker.GridSampler(overlap=0))
    with pytest.raises(stoker.ShardFormatError, match="bad.tif"):
        list(loader)


def test_a_slide_is_two_dimensional(tmp_path):
    path = tmp_path / "s.tif"
    tifffile.imwrite(path, rgb_image((64, 64)), tile=(32, 32))
    with pytest.raises(stoker.UsageError, match="spatial_dims=2"):
        stoker.Volumes([{"image": str(path)}])


def test_rgb_patches_come_channels_last_without_a_copy(tmp_path):
    import torch

    path = tmp_path / "s.tif"
    image = rgb_image((128, 128))
    tifffile.imwrite(path, image, tile=(64, 64))
    batch = next(iter(slide_loader(path, patch=32, batch=2)))
    assert batch["image"].shape == (2, 3, 32, 32)
    assert batch["image"].is_contiguous(memory_format=torch.channels_last)
