"""llaisys.vision.images: decoding within limits, data URLs and the pixel hash. The RGB a
picture decodes to is what transformers' ``convert_to_rgb`` makes of Pillow's decode."""
from __future__ import annotations

import base64
import io
import struct
import time
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from llaisys.vision.images import ImageError, ImageLimits, decode_image, image_hash, parse_data_url, pixel_hash


def pixels(height: int = 23, width: int = 31, seed: int = 0, channels: int = 3) -> np.ndarray:
    return np.random.default_rng([seed, height, width]).integers(0, 256, (height, width, channels), dtype=np.uint8)


def encode(image: Image.Image | np.ndarray, fmt: str, **options) -> bytes:
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def reference_rgb(data: bytes) -> np.ndarray:
    """Pillow's decode put through transformers' convert_to_rgb."""
    return convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)


def png_with_size(width: int, height: int) -> bytes:
    """A real 1x1 PNG whose IHDR is patched to claim width x height (CRC fixed up)."""
    data = bytearray(encode(pixels(1, 1), "PNG"))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.mark.parametrize("fmt,options", [("PNG", {}), ("BMP", {}), ("WEBP", {"lossless": True}), ("JPEG", {}),
                                         ("WEBP", {"quality": 80}), ("GIF", {})])
def test_decodes_formats_to_rgb(fmt: str, options: dict):
    source = pixels()
    data = encode(source, fmt, **options)
    image = decode_image(data)
    assert image.mode == "RGB" and image.size == (31, 23)
    decoded = np.asarray(image)
    np.testing.assert_array_equal(decoded, reference_rgb(data))
    if fmt in ("PNG", "BMP") or options.get("lossless"):
        np.testing.assert_array_equal(decoded, source)


def test_animated_gif_gives_first_frame():
    red = Image.new("RGB", (8, 6), (255, 0, 0))
    blue = Image.new("RGB", (8, 6), (0, 0, 255))
    data = encode(red, "GIF", save_all=True, append_images=[blue], duration=100, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    assert np.all(np.asarray(decode_image(data)) == [255, 0, 0])


def test_alpha_is_composited_on_white():
    rgba = pixels(9, 12, channels=4)
    rgba[0, 0] = (10, 20, 30, 0)  # fully transparent: white
    rgba[0, 1] = (10, 20, 30, 255)  # opaque: itself
    data = encode(Image.fromarray(rgba, "RGBA"), "PNG")
    decoded = np.asarray(decode_image(data))
    np.testing.assert_array_equal(decoded, reference_rgb(data))
    assert tuple(decoded[0, 0]) == (255, 255, 255) and tuple(decoded[0, 1]) == (10, 20, 30)


def test_transparent_palette_entry_is_white():
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    palette.putpixel((0, 0), 0)
    data = encode(palette, "PNG", transparency=0)
    decoded = np.asarray(decode_image(data))
    np.testing.assert_array_equal(decoded, reference_rgb(data))
    assert tuple(decoded[0, 0]) == (255, 255, 255) and tuple(decoded[1, 1]) == (200, 10, 10)


def test_transparent_rgb_colour_is_white():
    """A PNG tRNS colour turns those pixels white in transformers' convert_to_rgb, so here too."""
    source = pixels(6, 5)
    source[2, 3] = (1, 2, 3)
    data = encode(source, "PNG", transparency=(1, 2, 3))
    decoded = np.asarray(decode_image(data))
    np.testing.assert_array_equal(decoded, reference_rgb(data))
    assert tuple(decoded[2, 3]) == (255, 255, 255) and tuple(decoded[0, 0]) == tuple(source[0, 0])


def test_grayscale_becomes_rgb():
    gray = pixels(5, 7)[..., 0]
    decoded = np.asarray(decode_image(encode(Image.fromarray(gray, "L"), "PNG")))
    np.testing.assert_array_equal(decoded, np.repeat(gray[..., None], 3, axis=-1))


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(pixels(10, 20), "JPEG", exif=exif)
    image = decode_image(data)
    assert image.size == (10, 20)
    np.testing.assert_array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(data)).transpose(
        Image.Transpose.ROTATE_270).convert("RGB")))


def test_truncated_image_is_refused():
    data = encode(pixels(64, 64), "PNG")
    with pytest.raises(ImageError, match="truncated or corrupt PNG image"):
        decode_image(data[: len(data) // 2])
    jpeg = encode(pixels(64, 64), "JPEG")
    with pytest.raises(ImageError, match="truncated or corrupt JPEG image"):
        decode_image(jpeg[: len(jpeg) - 200])
    with pytest.raises(ImageError, match="truncated or corrupt image header"):
        decode_image(jpeg[:100])


def test_every_cut_of_every_format_is_an_image_error():
    """Damaged files raise ImageError, never another exception."""
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):
        data = encode(pixels(16, 16), fmt)
        for cut in range(0, len(data) - 16, max(1, len(data) // 60)):
            with pytest.raises(ImageError):
                decode_image(data[:cut])


def test_non_images_are_refused():
    with pytest.raises(ImageError, match="payload is not a PNG, JPEG, WebP, GIF or BMP image"):
        decode_image(np.random.default_rng(0).bytes(4000))
    with pytest.raises(ImageError, match="not a PNG, JPEG"):
        decode_image(encode(pixels(), "TIFF"))  # Pillow reads it, but it is not accepted
    with pytest.raises(ImageError, match="empty image payload"):
        decode_image(b"")
    with pytest.raises(TypeError, match="image data must be bytes, got str"):
        decode_image("iVBORw0KGgo=")  # type: ignore[arg-type]


def test_too_many_bytes():
    data = encode(pixels(), "BMP")
    with pytest.raises(ImageError, match=f"image payload is {len(data)} bytes, more than the limit of 1000 bytes"):
        decode_image(data, ImageLimits(max_bytes=1000))


@pytest.mark.parametrize("width,height,message", [
    (10_000, 6_000, "PNG is 10000x6000 = 60000000 pixels, more than the limit of 50000000 pixels"),
    (20_000, 10, "PNG is 20000x10; each side must be at most 16384 pixels"),
    (100_000, 100_000, "image dimensions are too large"),
])
def test_huge_header_is_refused_before_decoding(width: int, height: int, message: str):
    data = png_with_size(width, height)
    assert len(data) < 100
    start = time.perf_counter()
    with pytest.raises(ImageError, match=message):
        decode_image(data)
    assert time.perf_counter() - start < 1.0


def test_limits_apply_to_the_header():
    data = png_with_size(300, 200)
    with pytest.raises(ImageError, match="300x200 = 60000 pixels, more than the limit of 59999"):
        decode_image(data, ImageLimits(max_pixels=59_999))
    with pytest.raises(ImageError, match="each side must be at most 299"):
        decode_image(data, ImageLimits(max_side=299))
    with pytest.raises(ValueError, match="ImageLimits.max_side must be a positive integer, got 0"):
        ImageLimits(max_side=0)


def test_pillow_bomb_warning_raised_as_error_is_an_image_error():
    """Under ``-W error`` Pillow's DecompressionBombWarning is an exception: it comes out as ImageError."""
    data = png_with_size(10_000, 10_000)  # above Pillow's warning threshold, below its error one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ImageError, match="too large"):
            decode_image(data, ImageLimits(max_pixels=200_000_000))


# ---------------------------------------------------------------- data URLs

def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_data_url_round_trip():
    data = encode(pixels(), "PNG")
    assert parse_data_url(data_url(data)) == data
    assert parse_data_url(data_url(data, "IMAGE/JPEG").replace("data:", "DATA:")) == data
    assert parse_data_url(f"data:image/png;name=a.png;base64,{base64.b64encode(data).decode()}") == data
    np.testing.assert_array_equal(np.asarray(decode_image(parse_data_url(data_url(data)))), pixels())


@pytest.mark.parametrize("url,message", [
    ("https://example.com/a.png", "not a data URL: expected 'data:image/<type>;base64,<payload>'"),
    ("data:text/plain;base64,aGVsbG8=", "media type is 'text/plain'; expected image/<type>"),
    ("data:;base64,aGVsbG8=", "media type is 'missing'"),
    ("data:image/;base64,aGVsbG8=", "media type is 'image/'"),
    ("data:image/png,%89PNG", "payload is not base64-encoded"),
    ("data:image/png;base64", "has no ',' before its payload"),
    ("data:image/png;base64,@@@@", "payload is not valid base64"),
    ("data:image/png;base64,aGVs bG8=", "payload is not valid base64"),
    ("data:image/png;base64,aGVsbG8", "payload is not valid base64"),
    ("data:image/png;base64,", "payload is empty"),
])
def test_bad_data_urls(url: str, message: str):
    with pytest.raises(ImageError, match=message):
        parse_data_url(url)


def test_data_url_size_is_checked_before_decoding():
    # not base64 either: the size check must come first to report the size
    url = "data:image/png;base64," + "@" * 4000
    with pytest.raises(ImageError, match="decodes to about 3000 bytes, more than the limit of 2999 bytes"):
        parse_data_url(url, ImageLimits(max_bytes=2999))
    exact = base64.b64encode(b"x" * 3000).decode()
    assert len(parse_data_url(f"data:image/png;base64,{exact}", ImageLimits(max_bytes=3000))) == 3000
    padded = base64.b64encode(b"x" * 2999).decode()  # ends in '='
    assert len(parse_data_url(f"data:image/png;base64,{padded}", ImageLimits(max_bytes=2999))) == 2999


# ---------------------------------------------------------------- hashing

def test_hash_is_of_the_pixels_not_the_container():
    source = pixels(17, 29, seed=7)
    png, webp, bmp = encode(source, "PNG"), encode(source, "WEBP", lossless=True), encode(source, "BMP")
    assert len({png, webp, bmp}) == 3
    assert image_hash(png) == image_hash(webp) == image_hash(bmp)
    assert len(image_hash(png)) == 64
    changed = source.copy()
    changed[3, 4, 1] ^= 1
    assert image_hash(encode(changed, "PNG")) != image_hash(png)


def test_hash_includes_the_size():
    flat = pixels(1, 12, seed=8)
    assert image_hash(encode(flat, "PNG")) != image_hash(encode(flat.reshape(3, 4, 3), "PNG"))
    assert pixel_hash(Image.fromarray(flat)) == image_hash(encode(flat, "PNG"))
    with pytest.raises(ValueError, match="needs an RGB image, got mode 'L'"):
        pixel_hash(Image.new("L", (2, 2)))
