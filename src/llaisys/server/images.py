"""Where a request's images come from, and their limits: each image part's URL turned into a
decoded RGB picture, or a 400 naming the part and what is wrong.

- ``data:image/<type>;base64,...``: the bytes in the request, decoded with
  ``vision.images.parse_data_url``;
- ``http://`` / ``https://``: refused unless the URL's host is one of ``--allowed-image-hosts``
  (matched exactly). A server that fetched any URL a client names could be made to request
  addresses only it can reach (server-side request forgery), so nothing is fetched by default;
  a listed host is fetched directly (no proxy), its redirects refused (one could point
  anywhere), within ``FETCH_TIMEOUT_S`` and the byte limit;
- any other scheme (``file:``, ``ftp:`` ...): refused.

The bytes are then decoded by ``vision.images.decode_image`` within ``--max-image-bytes`` and
``--max-image-pixels`` (checked from the header before any pixel is decoded). This runs in the
request builder's worker thread, never on the event loop.
"""
from __future__ import annotations

import http.client
import logging
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..vision.images import ImageError, ImageLimits, decode_image, parse_data_url
from .errors import APIError, bad_request

if TYPE_CHECKING:
    from .options import ServerOptions

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0  # the whole fetch of one image from an allowed host
_CHUNK = 1 << 16


def image_limits(options: ServerOptions) -> ImageLimits:
    """What one image may cost on this server (--max-image-bytes, --max-image-pixels)."""
    return ImageLimits(max_bytes=options.max_image_bytes, max_pixels=options.max_image_pixels)


def load_image(url: str, param: str, options: ServerOptions) -> Any:
    """The picture ``url`` names (a data: URL, or an http(s) URL on an allowed host), decoded
    into an RGB PIL image (W, H) within the server's limits. A 400 APIError naming ``param``
    (the image part's field, ``messages[1].content[0]``) for anything refused: a scheme or host
    not allowed, a fetch that fails, a payload that is not a whole image or is over a limit."""
    limits = image_limits(options)
    data = _image_bytes(url, param, options, limits)
    try:
        return decode_image(data, limits)
    except ImageError as exc:
        raise bad_request(f"{param}: {exc}", param=param, code="invalid_image") from None
    except Exception as exc:  # noqa: BLE001  (a decoder's failure on hostile bytes is the payload's fault)
        log.warning("an image payload failed to decode: %s: %s", type(exc).__name__, exc)
        raise bad_request(f"{param}: the image could not be decoded ({type(exc).__name__}); send a complete PNG, "
                          "JPEG, WebP, GIF or BMP image", param=param, code="invalid_image") from None


def _image_bytes(url: str, param: str, options: ServerOptions, limits: ImageLimits) -> bytes:
    """The encoded image ``url`` carries or names; 400 for what is refused."""
    scheme = url.partition(":")[0].strip().lower() if ":" in url else ""
    try:
        if scheme == "data":
            return parse_data_url(url, limits)
        if scheme in ("http", "https"):
            _check_host(url, param, options.allowed_image_hosts)
            return fetch(url, limits.max_bytes)
    except ImageError as exc:
        raise bad_request(f"{param}: {exc}", param=param, code="invalid_image") from None
    shown = f"{scheme}:" if scheme else repr(url[:40])
    raise bad_request(f"{param}: the image URL {shown} is not accepted; send the image inline as a data: URL "
                      "(data:image/png;base64,...)" + (", or an http(s) URL on an allowed host" if
                                                      options.allowed_image_hosts else ""),
                      param=param, code="invalid_image_url")


def _check_host(url: str, param: str, allowed: tuple[str, ...]) -> None:
    """400 unless ``url``'s host is one of ``allowed`` (none: no URL is fetched)."""
    if not allowed:
        raise bad_request(f"{param}: this server does not fetch image URLs (a client could make it request "
                          "addresses only the server reaches: server-side request forgery); send the image inline "
                          "as a data: URL (data:image/png;base64,...), or start the server with "
                          "--allowed-image-hosts HOST[,HOST] to fetch from those hosts",
                          param=param, code="image_url_not_allowed")
    try:
        host = (urlsplit(url).hostname or "").rstrip(".")
    except ValueError:
        host = ""
    if not host:
        raise bad_request(f"{param}: the image URL {url[:60]!r} names no host", param=param,
                          code="invalid_image_url")
    if host not in allowed:
        raise bad_request(f"{param}: the host {host[:100]!r} is not one this server fetches images from "
                          f"(--allowed-image-hosts: {', '.join(allowed)}); send the image as a data: URL",
                          param=param, code="image_url_not_allowed")


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: its target was not checked against the allowed hosts."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        fp.close()
        raise ImageError(f"the image URL answered with a redirect ({code}) to {newurl[:100]!r}; redirects are not "
                         "followed: send the final URL of the image")


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _RefuseRedirects())


def fetch(url: str, max_bytes: int, timeout: float = FETCH_TIMEOUT_S) -> bytes:
    """The body of ``url`` (http or https, its host already allowed), read directly (no proxy)
    within ``timeout`` seconds in all and at most ``max_bytes``. ImageError for a redirect, an
    error status, a body over the limit, a timeout or a failed connection."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"Accept": "image/*", "User-Agent": "llaisys"})
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise ImageError(f"the image URL's body is {int(length)} bytes, more than the limit of {max_bytes} "
                                 "bytes")
            chunks, total = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise ImageError(f"fetching the image URL took more than {timeout:g} s")
                chunk = response.read(min(_CHUNK, max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > max_bytes:
                    raise ImageError(f"the image URL's body is more than the limit of {max_bytes} bytes")
    except ImageError:
        raise
    except urllib.error.HTTPError as exc:
        raise ImageError(f"fetching the image URL failed: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise ImageError(f"fetching the image URL failed: {exc.reason}") from None
    except (TimeoutError, OSError, http.client.HTTPException, ValueError) as exc:
        raise ImageError(f"fetching the image URL failed: {type(exc).__name__}: {exc}") from None
    return b"".join(chunks)


def refuse_images(model_name: str, param: str) -> APIError:
    """The 400 of an image part sent to a model without a vision encoder."""
    return bad_request(f"{param}: the model {model_name} has no vision encoder; it takes text only (send no images)",
                       param=param, code="images_not_supported")
