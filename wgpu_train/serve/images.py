"""A chat request's images (OpenAI image_url parts): data: URLs of base64 images and file:// local paths, a remote
http(s) URL only where the server allows it (--allow-remote-images); decoded and preprocessed as the served
vision model's processor does (Gemma 3's images, SmolVLM's tiles), each failure a 400 naming the image."""
from __future__ import annotations

import base64
import binascii
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from wgpu_train.errors import DataError
from wgpu_train.serve.api_error import ApiError

REMOTE_TIMEOUT_S = 10           # a remote image's fetch, where allowed
REMOTE_MAX_BYTES = 20 << 20     # a remote image's largest size, where allowed


def _refused(index: int, why: str, code: str = "invalid_image") -> ApiError:
    return ApiError(400, f"image {index}: {why}", "messages", code)


def image_source(url: str, index: int, allow_remote: bool = False):
    """An image_url's image as open_image takes it: bytes (a data: URL, a fetched remote one) or a Path (file://)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise _refused(index, "a data: URL must hold a base64 image (data:image/png;base64,...)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise _refused(index, "the data: URL's base64 does not decode") from None
    if scheme == "file":
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise _refused(index, f"file:// URLs name this machine's files, not {parsed.netloc}'s")
        path = Path(urllib.request.url2pathname(parsed.path))
        if not path.is_file():
            raise _refused(index, f"no such file: {path}")
        return path
    if scheme in ("http", "https"):
        if not allow_remote:
            raise _refused(index, "remote image URLs are not fetched by this server (it serves without "
                                  "--allow-remote-images): send a data: URL or a file:// path", "remote_image_refused")
        try:
            with urllib.request.urlopen(url, timeout=REMOTE_TIMEOUT_S) as reply:   # noqa: S310 (http(s) only)
                data = reply.read(REMOTE_MAX_BYTES + 1)
        except OSError as e:
            raise _refused(index, f"cannot fetch {url}: {e}") from None
        if len(data) > REMOTE_MAX_BYTES:
            raise _refused(index, f"{url} is over {REMOTE_MAX_BYTES >> 20} MiB")
        return data
    raise _refused(index, f"unsupported image URL scheme {scheme or url[:20]!r}: data:, file:// (or http(s) with "
                          f"--allow-remote-images)")


def request_images(urls, allow_remote: bool = False) -> list:
    """The request's image URLs -> their decoded images (PIL), in order; a URL refused or an image that does not
    decode is a 400 naming it."""
    from wgpu_train.data.images import open_image

    out = []
    for i, url in enumerate(urls):
        try:
            out.append(open_image(image_source(url, i, allow_remote), f"image {i}"))
        except DataError as e:
            raise ApiError(400, str(e), "messages", "invalid_image") from None
    return out


def request_pixels(images, vision) -> np.ndarray:
    """Decoded images -> pixel_values as the served VisionModel's processor gives them: (N, C, H, W) float32, N
    the images (Gemma 3) or all their tiles (SmolVLM: each image's size gives its grid); a failure is a 400."""
    try:
        return vision.pixel_values(images, "request")
    except DataError as e:
        raise ApiError(400, str(e), "messages", "invalid_image") from None
