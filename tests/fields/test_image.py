"""stoker.Image(): JPEG and PNG members decoded, cropped and resized by the reader's threads,
checked pixel by pixel against Pillow's decode and resize."""

from __future__ import annotations

import io
import logging
import pickle
import struct
import tarfile
import zipfile
import zlib

import numpy as np
import pytest

import stoker
from stoker import _core
from tests.support.shards import write_tar_members

PIL = pytest.importorskip("PIL.Image", reason="Pillow is the reference decoder")
from PIL import ImageFilter  # noqa: E402

pytestmark = pytest.mark.skipif(not _core.image_support(), reason="built without image support")

# Tolerances against Pillow (decode, then resize with its BILINEAR filter and the same box):
# decoding at full scale gives the same pixels (at most 1 apart, from rounding); decoding a
# JPEG at 1/2, 1/4 or 1/8 scale in the DCT (a crop at least twice the output) is a different
# but equally valid reduction, held to a mean difference and a peak signal-to-noise ratio.
EXACT = 1
SCALED_MEAN = 2.0
SCALED_PSNR = 32.0


def photo(height: int = 375, width: int = 500, seed: int = 0) -> np.ndarray:
    """A smooth, photo-like RGB image: blurred blobs over gradients (noise would decode unlike
    a photograph)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    for _ in range(12):
        cy, cx, r = rng.integers(0, height), rng.integers(0, width), rng.integers(10, 80)
        mask = (y - cy) ** 2 + (x - cx) ** 2 < r * r
        base[mask] = rng.integers(0, 256, 3)
    img = PIL.fromarray(base.astype(np.uint8)).filter(ImageFilter.GaussianBlur(2))
    return np.asarray(img)


def encoded(image: PIL.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def png_by_hand(pixels: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG (Pillow writes none in RGB): big-endian samples, filter 0 on each row."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    height, width = pixels.shape[:2]
    rows = pixels.astype(">u2").reshape(height, -1).tobytes()
    stride = len(rows) // height
    raw = b"".join(b"\0" + rows[i * stride : (i + 1) * stride] for i in range(height))
    header = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def reference(data: bytes) -> np.ndarray:
    return np.asarray(PIL.open(io.BytesIO(data)).convert("RGB"))


def target(size=(96, 128), crop="none", **kw):
    return stoker.Image(size=size, crop=crop, layout="NHWC", **kw)


def pillow_resized(pixels: np.ndarray, size, box) -> np.ndarray:
    h, w = size
    return np.asarray(PIL.fromarray(pixels).resize((w, h), PIL.BILINEAR, box=box))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


RGB = photo()
FORMATS = {
    "jpeg baseline 4:2:0": lambda: encoded(PIL.fromarray(RGB), "JPEG", quality=90),
    "jpeg 4:4:4": lambda: encoded(PIL.fromarray(RGB), "JPEG", quality=95, subsampling=0),
    "jpeg progressive": lambda: encoded(PIL.fromarray(RGB), "JPEG", quality=85, progressive=True),
    "jpeg grayscale": lambda: encoded(PIL.fromarray(RGB).convert("L"), "JPEG", quality=90),
    "jpeg cmyk": lambda: encoded(PIL.fromarray(RGB).convert("CMYK"), "JPEG", quality=90),
    "png rgb": lambda: encoded(PIL.fromarray(RGB), "PNG"),
    "png rgba": lambda: encoded(PIL.fromarray(RGB).convert("RGBA"), "PNG"),
    "png grayscale": lambda: encoded(PIL.fromarray(RGB).convert("L"), "PNG"),
    "png grayscale+alpha": lambda: encoded(PIL.fromarray(RGB).convert("LA"), "PNG"),
    "png palette": lambda: encoded(PIL.fromarray(RGB).convert("P"), "PNG"),
    "png palette+transparency": lambda: encoded(
        PIL.fromarray(RGB).convert("P"), "PNG", transparency=3
    ),
    "png 1-bit": lambda: encoded(PIL.fromarray(RGB).convert("1"), "PNG"),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("size", [(375, 500), (300, 400), (120, 160), (64, 64)])
def test_whole_image_resized_matches_pillow(name, size):
    data = FORMATS[name]()
    ref = reference(data)
    out = _core.decode_image(data, target(size).target)
    want = pillow_resized(ref, size, (0, 0, ref.shape[1], ref.shape[0]))
    scaled = ref.shape[0] >= 2 * size[0] and ref.shape[1] >= 2 * size[1]
    diff = np.abs(out.astype(int) - want)
    if scaled and name.startswith("jpeg"):
        assert diff.mean() <= SCALED_MEAN and psnr(out, want) >= SCALED_PSNR
    else:
        assert diff.max() <= EXACT, (name, size, diff.max())


@pytest.mark.parametrize("name", ["jpeg baseline 4:2:0", "jpeg progressive", "png rgb"])
def test_random_crops_match_pillow_on_the_same_box(name):
    data = FORMATS[name]()
    ref = reference(data)
    image = target((112, 112), "random", flip=True)
    for seed in range(40):
        x0, y0, x1, y1, flip = _core.image_box(ref.shape[1], ref.shape[0], image.target, seed)
        out = _core.decode_image(data, image.target, seed)
        want = pillow_resized(ref, (112, 112), (x0, y0, x1, y1))
        if flip:
            want = want[:, ::-1]
        diff = np.abs(out.astype(int) - want)
        if name.startswith("jpeg") and x1 - x0 >= 224 and y1 - y0 >= 224:
            assert diff.mean() <= SCALED_MEAN and psnr(out, want) >= SCALED_PSNR, seed
        else:
            assert diff.max() <= EXACT, (seed, diff.max())


def test_random_crop_boxes_follow_the_rules():
    image = stoker.Image(size=224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip=True)
    flips = 0
    for seed in range(500):
        x0, y0, x1, y1, flip = _core.image_box(500, 375, image.target, seed)
        w, h = x1 - x0, y1 - y0
        assert x0 >= 0 and x1 <= 500 and y0 >= 0 and y1 <= 375
        assert w == int(w) and h == int(h)
        area = w * h / (500 * 375)
        # Rounding the sides to whole pixels moves area and ratio a little past the bounds.
        assert 0.07 <= area <= 1.0 and 0.7 <= w / h <= 1.4
        flips += flip
    assert 200 < flips < 300
    # No try fits a 10:1 strip at half its area or more: then the whole height, cut to the
    # widest allowed ratio, centred.
    wide = stoker.Image(size=224, scale=(0.5, 1.0))
    assert _core.image_box(1000, 100, wide.target, 0)[:4] == (433.0, 0.0, 566.0, 100.0)


def test_center_crop_is_the_evaluation_transform():
    data = FORMATS["png rgb"]()
    ref = reference(data)
    out = _core.decode_image(data, target((224, 224), "center").target)
    # Resize the shorter side to 256 and cut 224 from the middle: one box of the source.
    factor = 256 / 375
    side = 224 / factor
    box = ((500 - side) / 2, (375 - side) / 2, (500 + side) / 2, (375 + side) / 2)
    assert np.abs(out.astype(int) - pillow_resized(ref, (224, 224), box)).max() <= EXACT


@pytest.mark.parametrize(
    "mode,options",
    [
        ("RGB", {"quality": 90}),
        ("RGB", {"quality": 95, "subsampling": 0}),
        ("RGB", {"quality": 85, "progressive": True}),
        ("L", {"quality": 90}),
        ("CMYK", {"quality": 90}),
    ],
    ids=["4:2:0", "4:4:4", "progressive", "grayscale", "cmyk"],
)
def test_jpeg_rows_of_every_alignment_decode_as_pillow_does(mode, options):
    # Rows that would start on a 16-byte boundary are decoded into spare rows and copied
    # (libjpeg-turbo stores such rows around the cache): widths whose rows start at every
    # offset, and widths of a multiple of 16 bytes, whose rows all do or none do.
    for width in [*range(1, 41), 48, 63, 64, 96, 100, 128, 171, 256, 500]:
        data = encoded(PIL.fromarray(RGB[:37, :width]).convert(mode), "JPEG", **options)
        out = _core.decode_rgb(data)
        diff = np.abs(out.astype(int) - reference(data))
        assert out.shape == (37, width, 3) and diff.max() <= EXACT, (width, diff.max())


@pytest.mark.parametrize("color_type,channels", [(2, 3), (0, 1)])
def test_16_bit_pngs_keep_their_high_byte(color_type, channels):
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 65536, (40, 50, channels), dtype=np.uint16)
    data = png_by_hand(pixels if channels == 3 else pixels[..., 0], color_type)
    out = _core.decode_rgb(data)
    want = np.broadcast_to((pixels >> 8).astype(np.uint8), (40, 50, 3))
    assert np.array_equal(out, want)


def test_layouts_and_flip():
    data = FORMATS["png rgb"]()
    nchw = _core.decode_image(data, stoker.Image(size=(50, 60), crop="none").target)
    nhwc = _core.decode_image(data, target((50, 60)).target)
    assert nchw.shape == (3, 50, 60) and nhwc.shape == (50, 60, 3)
    assert np.array_equal(nchw.transpose(1, 2, 0), nhwc)


# -- through a Loader --------------------------------------------------------------------


@pytest.fixture(scope="module")
def jpeg_shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("jpegs")
    for s in range(3):
        members = []
        for i in range(s * 20, s * 20 + 20):
            img = PIL.fromarray(photo(200 + i, 260 + 2 * i, seed=i))
            members.append((f"{i:04d}.jpg", encoded(img, "JPEG", quality=90)))
            members.append((f"{i:04d}.cls", str(i % 7).encode()))
        write_tar_members(folder / f"shard-{s}.tar", members)
    return sorted(str(p) for p in folder.glob("*.tar"))


def loader(shards, threads=2, **kw):
    image = kw.pop("image", stoker.Image(size=64, crop="random", flip=True))
    return stoker.Loader(
        stoker.Dataset(shards),
        batch_size=8,
        seed=7,
        num_threads=threads,
        fields={"jpg": image, "cls": stoker.Int()},
        **kw,
    )


def epoch(loader_) -> list:
    return [(b["__key__"], b["jpg"].numpy().copy(), b["cls"].numpy().copy()) for b in loader_]


def test_loader_decodes_each_sample_as_decode_image_does(jpeg_shards):
    image = stoker.Image(size=(48, 64), crop="center")
    batches = epoch(loader(jpeg_shards, image=image))
    assert sum(len(k) for k, _, _ in batches) == 60
    keys, pixels, labels = batches[0]
    assert pixels.shape == (8, 3, 48, 64) and pixels.dtype == np.uint8
    with tarfile.open(jpeg_shards[0]) as tar:
        names = {m.name[:-4]: m for m in tar.getmembers() if m.name.endswith(".jpg")}
        for key, got, label in zip(keys, pixels, labels):
            if key in names:
                data = tar.extractfile(names[key]).read()
                assert np.array_equal(got, _core.decode_image(data, image.target))
                assert label == int(key) % 7


def test_augmentation_is_the_same_on_any_thread_count_and_differs_by_epoch(jpeg_shards):
    one, three = loader(jpeg_shards, threads=1), loader(jpeg_shards, threads=3)
    first = epoch(one)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(first, epoch(three)))
    second = epoch(one)
    assert [k for k, _, _ in first] != [k for k, _, _ in second]
    # The same sample is cropped differently in another epoch.
    by_key_1 = {k: p for keys, px, _ in first for k, p in zip(keys, px)}
    by_key_2 = {k: p for keys, px, _ in second for k, p in zip(keys, px)}
    assert sum(not np.array_equal(by_key_1[k], by_key_2[k]) for k in by_key_1) > 50


def test_resume_mid_epoch_is_exact_with_random_crops(jpeg_shards):
    whole = loader(jpeg_shards)
    everything = epoch(whole)
    partial = loader(jpeg_shards)
    it = iter(partial)
    for _ in range(3):
        next(it)
    state = partial.state_dict()
    resumed = loader(jpeg_shards)
    resumed.load_state_dict(state)
    rest = epoch(resumed)
    assert len(rest) == len(everything) - 3
    for (k1, p1, _), (k2, p2, _) in zip(everything[3:], rest):
        assert k1 == k2 and np.array_equal(p1, p2)


def test_deflated_zip_members_decode(tmp_path):
    data = FORMATS["jpeg baseline 4:2:0"]()
    png = FORMATS["png rgb"]()
    with zipfile.ZipFile(tmp_path / "a.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("0.jpg", data)
        z.writestr("1.jpg", png)  # a PNG named .jpg: decoded by what it is, as Pillow does
    image = stoker.Image(size=(30, 40), crop="none")
    ds = stoker.Dataset(str(tmp_path / "a.zip"))
    batch = next(iter(stoker.Loader(ds, batch_size=2, shuffle=False, fields={"jpg": image})))
    assert np.array_equal(batch["jpg"][0].numpy(), _core.decode_image(data, image.target))
    assert np.array_equal(batch["jpg"][1].numpy(), _core.decode_image(png, image.target))


def bomb_jpeg() -> bytes:
    """A small JPEG whose frame header claims 60000 x 60000 pixels."""
    data = bytearray(FORMATS["jpeg baseline 4:2:0"]())
    sof = data.find(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 60000, 60000)
    return bytes(data)


def progressive_bomb() -> bytes:
    """A small progressive JPEG whose frame claims 13000 x 13000 pixels at full chroma: under
    the pixel limit, but its coefficients would need about a gigabyte."""
    data = bytearray(encoded(PIL.fromarray(RGB[:64, :64]), "JPEG", progressive=True, subsampling=0))
    sof = data.find(b"\xff\xc2")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 13000, 13000)
    return bytes(data)


def bomb_png() -> bytes:
    data = bytearray(FORMATS["png rgb"]())
    ihdr = bytearray(data[12:29])  # type and data of IHDR
    ihdr[4:12] = struct.pack(">II", 100000, 100000)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def corrupt_png_crc() -> bytes:
    data = bytearray(FORMATS["png rgb"]())
    idat = data.find(b"IDAT")
    data[idat + 20] ^= 0xFF
    return bytes(data)


BAD = {
    "truncated jpeg": (lambda: FORMATS["jpeg baseline 4:2:0"]()[:3000], "truncated"),
    "corrupt jpeg header": (
        lambda: b"\xff\xd8\xff\xe0" + b"\x00\x10JFIF\x00" + b"\x13" * 400,
        "JPEG: ",
    ),
    "truncated png": (lambda: FORMATS["png rgb"]()[:5000], "PNG: "),
    "png with a bad CRC": (corrupt_png_crc, "PNG: "),
    "zero bytes": (lambda: b"", "empty member"),
    "text named .jpg": (lambda: b"<html>not an image</html>", "not a JPEG or PNG"),
    "jpeg decompression bomb": (bomb_jpeg, "60000 x 60000 pixels, more than"),
    "png decompression bomb": (bomb_png, "100000 x 100000 pixels, more than"),
    "progressive jpeg too big to decode": (progressive_bomb, "more than the 512 MiB"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_images_are_refused_naming_the_member(tmp_path, name):
    make, message = BAD[name]
    good = FORMATS["jpeg baseline 4:2:0"]()
    shard = tmp_path / "bad.tar"
    write_tar_members(shard, [("a.jpg", good), ("b.jpg", make()), ("c.jpg", good)])
    ds = stoker.Dataset(str(shard))
    image = stoker.Image(size=(32, 32), crop="none")
    with pytest.raises(stoker.ShardFormatError, match=message) as caught:
        list(stoker.Loader(ds, batch_size=3, shuffle=False, fields={"jpg": image}))
    error = caught.value
    assert error.path == str(shard) and "field 'jpg' of sample 'b'" in str(error)
    with tarfile.open(shard) as tar:
        assert error.offset == tar.getmember("b.jpg").offset_data


def test_on_error_blank_serves_zeros_counts_and_logs_once(tmp_path, caplog):
    good = FORMATS["jpeg baseline 4:2:0"]()
    write_tar_members(tmp_path / "s.tar", [("a.jpg", good), ("b.jpg", good[:2000]), ("c.jpg", b"")])
    ds = stoker.Dataset(str(tmp_path / "s.tar"))
    image = stoker.Image(size=(32, 32), crop="none", on_error="blank")
    loader_ = stoker.Loader(ds, batch_size=3, shuffle=False, fields={"jpg": image})
    with caplog.at_level(logging.WARNING, logger="stoker.loader"):
        for _ in range(2):
            (batch,) = list(loader_)
    pixels = batch["jpg"].numpy()
    assert pixels[0].any() and not pixels[1].any() and not pixels[2].any()
    assert loader_.stats()["images_blanked"] == 4  # two a pass, two passes
    warned = [r.getMessage() for r in caplog.records if "did not decode" in r.getMessage()]
    assert len(warned) == 2 and "'b'" in warned[0] + warned[1]


def test_a_missing_target_is_a_type_error_not_a_crash():
    with pytest.raises(TypeError):
        _core.decode_image(FORMATS["png rgb"](), None)
    with pytest.raises(TypeError):
        _core.image_box(10, 10, None)


def test_image_arguments_are_checked():
    for bad in (
        {"crop": "middle"},
        {"layout": "CHW"},
        {"on_error": "skip"},
        {"size": (0, 10)},
        {"size": "224"},
        {"scale": (0.5, 0.1)},
        {"ratio": (0, 1)},
    ):
        with pytest.raises(stoker.UsageError):
            stoker.Image(**bad)
    image = stoker.Image(size=32, crop="center", layout="NHWC")
    assert image.size == (32, 32) and image.shape == (32, 32, 3)
    copy = pickle.loads(pickle.dumps(image))
    assert copy == image and copy.target.nbytes == 32 * 32 * 3


# -- stoker pack --image-size ------------------------------------------------------------


def test_pack_image_size_shrinks_jpegs_and_keeps_the_rest(tmp_path, caplog):
    from stoker.tools.pack import pack

    big = encoded(PIL.fromarray(RGB), "JPEG", quality=90)  # 500 x 375
    small = encoded(PIL.fromarray(RGB).resize((200, 150)), "JPEG", quality=90)
    png = FORMATS["png rgb"]()
    broken = big[:600]
    members = [("a.jpg", big), ("b.jpg", small), ("c.jpg", png), ("d.jpg", broken)]
    members += [(f"{k}.cls", b"1") for k in "abcd"]
    write_tar_members(tmp_path / "in.tar", members)
    with caplog.at_level(logging.WARNING, logger="stoker.pack"):
        pack(
            stoker.Dataset(str(tmp_path / "in.tar")),
            str(tmp_path / "out"),
            image_size=256,
            image_quality=85,
            quiet=True,
        )
    out = {s["__key__"]: s for s in stoker.Dataset(str(tmp_path / "out"))}
    shrunk = PIL.open(io.BytesIO(bytes(out["a"]["jpg"])))
    assert shrunk.format == "JPEG" and shrunk.size == (341, 256)
    # Its pixels are the original's, resized: close to Pillow's resize of the same image.
    want = np.asarray(PIL.open(io.BytesIO(big)).convert("RGB").resize((341, 256), PIL.BILINEAR))
    assert np.abs(np.asarray(shrunk).astype(int) - want).mean() < 3
    assert bytes(out["b"]["jpg"]) == small  # already small enough
    assert bytes(out["c"]["jpg"]) == png  # a PNG stays a PNG
    assert bytes(out["d"]["jpg"]) == broken  # kept, with a warning naming it
    assert any("d.jpg" in r.getMessage() for r in caplog.records)
    assert int(bytes(out["a"]["cls"])) == 1


def test_pack_image_size_from_the_command_line(tmp_path):
    import subprocess
    import sys

    write_tar_members(tmp_path / "in.tar", [("a.jpg", encoded(PIL.fromarray(RGB), "JPEG"))])
    command = [
        sys.executable,
        "-m",
        "stoker",
        "pack",
        str(tmp_path / "in.tar"),
        str(tmp_path / "out"),
        "--image-size",
        "100",
        "--quality",
        "80",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    (sample,) = list(stoker.Dataset(str(tmp_path / "out")))
    assert PIL.open(io.BytesIO(bytes(sample["jpg"]))).size == (133, 100)
    for bad in (["--image-size", "0"], ["--quality", "101", "--image-size", "10"]):
        result = subprocess.run([*command[:6], *bad], capture_output=True, text=True)
        assert result.returncode != 0 and "Traceback" not in result.stderr


def test_a_deflated_image_that_claims_to_inflate_past_a_gibibyte_is_refused_unread(tmp_path):
    # Incompressible bytes, so that the claimed size stays within the zip index's ratio check.
    payload = np.random.default_rng(0).integers(0, 256, 1_200_000, dtype=np.uint8).tobytes()
    path = tmp_path / "big.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("0.jpg", payload)
    data = bytearray(path.read_bytes())
    claim = struct.pack("<I", 1_100_000_000)
    data[22:26] = claim  # the local header's uncompressed size
    central = data.rfind(b"PK\x01\x02")
    data[central + 24 : central + 28] = claim  # and the central directory's
    path.write_bytes(bytes(data))
    loader = stoker.Loader(
        stoker.Dataset(str(path)), batch_size=1, fields={"jpg": stoker.Image(size=8, crop="none")}
    )
    with pytest.raises(stoker.ShardFormatError, match="inflates to 1100000000 bytes") as caught:
        next(iter(loader))
    assert caught.value.path == str(path)
