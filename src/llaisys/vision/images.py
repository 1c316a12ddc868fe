"""Untrusted image payloads (raw bytes or ``data:`` URLs) decoded into upright RGB pictures
within limits on bytes and pixels, and a content hash of the decoded pixels."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
import zlib
from dataclasses import dataclass

from PIL import Image, ImageOps

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # Pillow's names of the containers accepted
_EXPECTED = "a PNG, JPEG, WebP, GIF or BMP image"

# What Pillow's decoders raise on a damaged file; zlib/struct/index errors come from plugins
# that parse a broken chunk before checking its length.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one image may cost before it is decoded."""

    max_bytes: int = 20 * 1024 * 1024  # the encoded file (for a data URL: after base64 decoding)
    max_pixels: int = 50_000_000  # width * height as the header states it
    max_side: int = 16384  # the longer of width and height

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_side"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ImageLimits.{name} must be a positive integer, got {value!r}")


class ImageError(ValueError):
    """An image payload refused: the message names what is wrong and what was expected."""


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """The first frame of the encoded image ``data`` as a loaded, upright (EXIF orientation
    applied) RGB PIL image of the header's size (W, H), transparency composited onto white as
    transformers' ``convert_to_rgb`` does. The pixel count is checked from the header before any
    pixel is decoded. ImageError for an unsupported format, a damaged file or a payload over
    ``limits``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"image data must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ImageError(f"empty image payload; expected {_EXPECTED}")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image payload is {len(data)} bytes, more than the limit of {limits.max_bytes} bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # Pillow's own guard fires inside open() on headers far above any sane limit
        raise ImageError(f"image dimensions are too large ({e}); at most {limits.max_pixels} pixels "
                         f"and {limits.max_side} pixels a side are accepted") from None
    except Image.UnidentifiedImageError:
        raise ImageError(f"payload is not {_EXPECTED}") from None
    except _DECODE_ERRORS as e:
        raise ImageError(f"truncated or corrupt image header ({e}); expected {_EXPECTED}") from None
    with image:
        _check_size(image.size, image.format or "image", limits)
        try:
            image.load()
            upright = ImageOps.exif_transpose(image)
            return to_rgb(upright)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ImageError(f"image dimensions are too large ({e})") from None
        except _DECODE_ERRORS as e:
            raise ImageError(f"truncated or corrupt {image.format} image ({e}); expected a complete "
                             f"{_EXPECTED}") from None


def _check_size(size: tuple[int, int], kind: str, limits: ImageLimits) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"{kind} header states an empty size {width}x{height}")
    if max(width, height) > limits.max_side:
        raise ImageError(f"{kind} is {width}x{height}; each side must be at most {limits.max_side} pixels")
    if width * height > limits.max_pixels:
        raise ImageError(f"{kind} is {width}x{height} = {width * height} pixels, more than the limit of "
                         f"{limits.max_pixels} pixels")


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` in mode RGB, exactly as transformers' ``convert_to_rgb`` makes it: an image with
    an alpha band or a transparent palette entry is composited onto opaque white; any other
    mode is converted with Pillow's ``convert("RGB")``. Same size (W, H)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def parse_data_url(url: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """The bytes carried by ``data:image/<type>[;param=value...];base64,<payload>``. The payload's
    decoded size is bounded from its encoded length before decoding. ImageError for another
    scheme, a non-image media type, a payload that is not strict base64, or one over
    ``limits.max_bytes``."""
    if not isinstance(url, str):
        raise TypeError(f"a data URL must be a string, got {type(url).__name__}")
    if url[:5].lower() != "data:":
        raise ImageError(f"not a data URL: expected 'data:image/<type>;base64,<payload>', got {url[:32]!r}")
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ImageError("data URL has no ',' before its payload: expected 'data:image/<type>;base64,<payload>'")
    media_type, *params = [part.strip() for part in header.split(";")]
    if not media_type.lower().startswith("image/") or len(media_type) == len("image/"):
        raise ImageError(f"data URL media type is {media_type or 'missing'!r}; expected image/<type> "
                         f"(image/png, image/jpeg, image/webp, image/gif, image/bmp)")
    if not params or params[-1].lower() != "base64":
        raise ImageError("data URL payload is not base64-encoded: expected ';base64,' before the payload")
    # every 4 characters carry at most 3 bytes; padding takes back up to 2
    bound = (len(payload) + 3) // 4 * 3 - min(len(payload) - len(payload.rstrip("=")), 2)
    if bound > limits.max_bytes:
        raise ImageError(f"data URL payload decodes to about {bound} bytes, more than the limit of "
                         f"{limits.max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data URL payload is not valid base64 ({e}); expected the characters A-Z a-z "
                         f"0-9 + / with '=' padding and no whitespace") from None
    if not data:
        raise ImageError("data URL payload is empty; expected a base64-encoded image")
    return data


def pixel_hash(image: Image.Image) -> str:
    """SHA-256 hex digest of an RGB image's size (W, H) and its H*W*3 uint8 pixels, row-major:
    equal for the same picture whatever container it came in."""
    if image.mode != "RGB":
        raise ValueError(f"pixel_hash needs an RGB image, got mode {image.mode!r}")
    width, height = image.size
    digest = hashlib.sha256(f"rgb:{width}x{height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def image_hash(data: bytes, limits: ImageLimits = ImageLimits()) -> str:
    """SHA-256 hex digest of the picture in ``data`` (its decoded RGB pixels and size, see
    ``pixel_hash``), so a PNG and a lossless WebP of one picture hash alike. It keys the cache of
    vision-encoder outputs and the prefix-cache blocks that hold an image's tokens. ImageError
    as ``decode_image``."""
    return pixel_hash(decode_image(data, limits))
