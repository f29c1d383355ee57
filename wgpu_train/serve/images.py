"""A chat request's images (OpenAI image_url parts) and Qwen3-VL's videos (video_url parts): data: URLs of base64
images (videos: of a video file, PyAV decoding it) and file:// local paths (videos: a video file or a folder of
frames), a remote http(s) URL only where the server allows it (--allow-remote-images); decoded and preprocessed as
the served vision model's processor does (Gemma 3's images, SmolVLM's tiles), each failure a 400 naming it."""
from __future__ import annotations

import base64
import binascii
import importlib.util
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from wgpu_train.errors import DataError
from wgpu_train.serve.api_error import ApiError

REMOTE_TIMEOUT_S = 10           # a remote image's fetch, where allowed
REMOTE_MAX_BYTES = 20 << 20     # a remote image's largest size, where allowed


def _refused(what: str, index: int, why: str, code: str = "invalid_image") -> ApiError:
    return ApiError(400, f"{what} {index}: {why}", "messages", code)


def image_source(url: str, index: int, allow_remote: bool = False, folder: bool = False):
    """An image_url's image as open_image takes it: bytes (a data: URL, a fetched remote one) or a Path (file://);
    folder: a video_url's (a folder of frames taken too, failures named "video")."""
    what = "video" if folder else "image"
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise _refused(what, index, "a data: URL must hold a base64 image (data:image/png;base64,...)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise _refused(what, index, "the data: URL's base64 does not decode") from None
    if scheme == "file":
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise _refused(what, index, f"file:// URLs name this machine's files, not {parsed.netloc}'s")
        path = Path(urllib.request.url2pathname(parsed.path))
        if not (path.is_file() or folder and path.is_dir()):
            raise _refused(what, index, f"no such file{' or folder' if folder else ''}: {path}")
        return path
    if scheme in ("http", "https"):
        if not allow_remote:
            raise _refused(what, index, f"remote {what} URLs are not fetched by this server (it serves without "
                                        "--allow-remote-images): send a data: URL or a file:// path",
                           "remote_image_refused")
        try:
            with urllib.request.urlopen(url, timeout=REMOTE_TIMEOUT_S) as reply:   # noqa: S310 (http(s) only)
                data = reply.read(REMOTE_MAX_BYTES + 1)
        except OSError as e:
            raise _refused(what, index, f"cannot fetch {url}: {e}") from None
        if len(data) > REMOTE_MAX_BYTES:
            raise _refused(what, index, f"{url} is over {REMOTE_MAX_BYTES >> 20} MiB")
        return data
    raise _refused(what, index, f"unsupported {what} URL scheme {scheme or url[:20]!r}: data:, file:// (or http(s) "
                                f"with --allow-remote-images)")


def request_images(urls, allow_remote: bool = False, as_video=None) -> list:
    """The request's image URLs (and serve/requests.VideoUrl's) -> their decoded images (PIL; videos as
    data/qwen_videos.Video through as_video(value, where), the served model's span's; None: videos refused), in
    order; a URL refused, or an image or video that does not decode, is a 400 naming it."""
    from wgpu_train.data.images import open_image
    from wgpu_train.serve.requests import VideoUrl

    out = []
    for i, url in enumerate(urls):
        try:
            if isinstance(url, VideoUrl):
                out.append(_request_video(url.url, i, allow_remote, as_video))
            else:
                out.append(open_image(image_source(url, i, allow_remote), f"image {i}"))
        except DataError as e:
            raise ApiError(400, str(e), "messages", "invalid_image") from None
    return out


def _request_video(url: str, index: int, allow_remote: bool, as_video):
    """A video_url's video: a file:// frames folder or video file as it is, a data: URL's (or a fetched remote)
    video file written to a temporary file and decoded by PyAV (its frames kept in memory)."""
    if as_video is None:
        raise _refused("video", index, "this model takes no videos (Qwen3-VL and Qwen3.5 do)", "videos_not_supported")
    source = image_source(url, index, allow_remote, folder=True)
    where = f"video (part {index})"
    if isinstance(source, Path):
        return as_video(source, where)
    if importlib.util.find_spec("av") is None:
        raise _refused("video", index, "a video sent as data decodes only where PyAV is installed (pip install av): "
                                       "send a file:// path to a folder of frames", "invalid_video")
    with tempfile.TemporaryDirectory() as tmp:         # PyAV reads the container's format from its bytes
        path = Path(tmp) / "video.mp4"
        path.write_bytes(source)
        return as_video(path, where)


def request_pixels(images, vision) -> np.ndarray:
    """Decoded images -> pixel_values as the served VisionModel's processor gives them: (N, C, H, W) float32, N
    the images (Gemma 3) or all their tiles (SmolVLM: each image's size gives its grid); a failure is a 400."""
    try:
        return vision.pixel_values(images, "request")
    except DataError as e:
        raise ApiError(400, str(e), "messages", "invalid_image") from None
