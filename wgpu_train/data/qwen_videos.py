"""Qwen3-VL's and Qwen3.5's videos in: transformers' Qwen3VLVideoProcessor (frames sampled at its fps, resized
together by its smart_resize over the clip, rescaled, normalised, the frame count padded to temporal_patch_size with
the last frame, the patches flattened in merge-block order) to its exact pixel_values_videos and video_grid_thw; the
text a video's placeholder becomes (Qwen3VLProcessor's `<t seconds>` before each temporal patch group)."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from wgpu_train.data.images import open_image, to_rgb
from wgpu_train.errors import ConfigError, DataError

_HALF = (0.5, 0.5, 0.5)     # IMAGENET_STANDARD_MEAN / _STD, the video processor's defaults
_NO_FPS = 24.0              # the frame rate the processor assumes for frames given without one
_VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v", ".gif")


@dataclasses.dataclass(frozen=True)
class Video:
    """A video as its sampled frames (paths, bytes or PIL images, in order), the frame rate of the clip they were
    sampled from (None: frames given as they are, which the processor times at 24 per second) and each frame's
    index in the clip (None: 0, 1, 2, ...)."""

    frames: tuple
    fps: float | None = None
    indices: tuple | None = None

    def timestamps(self, temporal: int) -> list:
        """The time in seconds of each temporal patch group: the mean of its first and last frame's
        (Qwen3VLProcessor._calculate_timestamps, the last frame repeated to fill the last group)."""
        idx = list(self.indices if self.indices is not None else range(len(self.frames)))
        idx += [idx[-1]] * (-len(idx) % temporal)
        fps = self.fps or _NO_FPS
        return [(idx[i] / fps + idx[i + temporal - 1] / fps) / 2 for i in range(0, len(idx), temporal)]


@dataclasses.dataclass(frozen=True)
class QwenVideoSettings:
    """What a video_preprocessor_config.json says (Qwen3VLVideoProcessor's defaults where left out): the patch
    sizes (the tower's), the pixel range of a whole clip (size's shortest_edge / longest_edge), the resample
    filter (bicubic, torchvision's on uint8 frames: bicubic_resize), the rescale factor, mean and std, and the
    frame sampling of a video file (fps, or num_frames; within min_frames and max_frames)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    resample: int = 3
    rescale_factor: float = 1 / 255
    mean: tuple = _HALF
    std: tuple = _HALF
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def from_dict(cls, raw: dict, vision, source: str = "video_preprocessor_config.json") -> QwenVideoSettings:
        """From a video_preprocessor_config.json's fields; the patch sizes must be the tower's (`vision` a
        models/qwen3_vl.Qwen3VLVision)."""
        sizes = {"patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
                 "merge_size": vision.spatial_merge_size}
        got = {k: int(raw.get(k) or d) for k, d in sizes.items()}
        wrong = next((k for k in sizes if got[k] != sizes[k]), None)
        if wrong:
            raise ConfigError(f"{source}: {wrong} {got[wrong]} is not the vision tower's {sizes[wrong]}")
        if raw.get("cap_pixels_per_frame"):
            raise ConfigError(f"{source}: not supported: cap_pixels_per_frame true")
        resample = int(raw.get("resample", 3))
        if resample != 3:
            raise ConfigError(f"{source}: not supported: resample {resample} for videos (bicubic, 3, only)")
        size = raw.get("size") or {}
        low, high = int(size.get("shortest_edge", 128 * 32 * 32)), int(size.get("longest_edge", 32 * 32 * 768))
        if not 0 < low <= high:
            raise ConfigError(f"{source}: the pixel range {low} to {high} (size's shortest_edge, longest_edge) is "
                              f"empty")
        mean, std = (tuple(float(v) for v in (raw.get(k) or _HALF)) for k in ("image_mean", "image_std"))
        num = raw.get("num_frames")
        return cls(*got.values(), low, high, resample, float(raw.get("rescale_factor", 1 / 255)), mean, std,
                   bool(raw.get("do_resize", True)), bool(raw.get("do_rescale", True)),
                   bool(raw.get("do_normalize", True)), None if num else float(raw.get("fps") or 2.0),
                   int(num) if num else None, int(raw.get("min_frames", 4)), int(raw.get("max_frames", 768)))

    @classmethod
    def from_folder(cls, folder, vision) -> QwenVideoSettings:
        """A model folder's video_preprocessor_config.json, or the defaults where it has none."""
        path = Path(folder) / "video_preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        return cls.from_dict(raw, vision, str(path))

    def resized(self, frames: int, height: int, width: int) -> tuple:
        """(height, width) of every frame after the video smart_resize, or as they are without do_resize."""
        if not self.do_resize:
            return height, width
        return video_smart_resize(frames, height, width, self.temporal_patch_size, self.patch_size * self.merge_size,
                                  self.min_pixels, self.max_pixels)

    def _frames(self, video: Video, where: str) -> list:
        if not video.frames:
            raise DataError(f"{where}: a video without frames")
        frames = [to_rgb(open_image(f, f"{where}: frame {i}")) for i, f in enumerate(video.frames)]
        if len({f.size for f in frames}) > 1:
            raise DataError(f"{where}: its frames differ in size ({frames[0].size[0]} x {frames[0].size[1]} and "
                            f"{next(f.size for f in frames if f.size != frames[0].size)})")
        return frames

    def normalised(self, x: np.ndarray) -> np.ndarray:
        """(F, C, H, W) uint8 -> float32 as the processor's fused step: rescale and normalise at once, (x - mean /
        factor) / (std / factor) in float32 (rescaled alone without do_normalize)."""
        x = x.astype(np.float32)
        if not self.do_normalize:
            return x * np.float32(self.rescale_factor) if self.do_rescale else x
        scale = np.float32(1.0 / self.rescale_factor) if self.do_rescale else np.float32(1.0)
        mean, std = (np.asarray(v, np.float32)[:, None, None] * scale for v in (self.mean, self.std))
        return (x - mean) / std

    def grid(self, video: Video, where: str = "video") -> tuple:
        """(t, rows, cols) of a video's patches (t its temporal patch groups), from its frames' count and size (every
        frame read: one that cannot be decoded, or of another size, refused in one line)."""
        n, tp = len(video.frames), self.temporal_patch_size
        first = self._frames(video, where)[0]
        h, w = self.resized(n, first.height, first.width)
        return -(-n // tp), h // self.patch_size, w // self.patch_size

    def tokens_per_group(self, video: Video, where: str = "video") -> int:
        """The video tokens of each temporal patch group: its merged patches."""
        _, rows, cols = self.grid(video, where)
        return rows * cols // self.merge_size ** 2

    def patches(self, video: Video, where: str = "video") -> tuple:
        """One video -> (its patches (t * rows * cols, C * temporal * patch^2) float32: each temporal group's
        merge blocks in order, a patch's temporal_patch_size frames inside it; (t, rows, cols)), as the
        processor's."""
        frames, tp, p, m = self._frames(video, where), self.temporal_patch_size, self.patch_size, self.merge_size
        if len(frames) < tp:
            raise DataError(f"{where}: {len(frames)} frames; a video needs at least temporal_patch_size ({tp})")
        h, w = self.resized(len(frames), frames[0].height, frames[0].width)
        x = np.stack([np.asarray(f) for f in frames])                                       # (F, H, W, C)
        if self.do_resize:
            x = bicubic_resize(x, h, w)
        x = self.normalised(np.moveaxis(x, -1, 1))                                          # (F, C, H, W)
        x = np.concatenate([x, np.repeat(x[-1:], -len(x) % tp, axis=0)])
        t, c, rows, cols = len(x) // tp, x.shape[1], h // p, w // p
        if rows % m or cols % m:
            raise DataError(f"{where}: {h} x {w} pixels are not whole merge blocks of {m} x {m} patches of {p}")
        x = x.reshape(t, tp, c, rows // m, m, p, cols // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return np.ascontiguousarray(x.reshape(t * rows * cols, -1), np.float32), (t, rows, cols)


def _cubic(x, a: float = -0.5):
    """The bicubic filter's weight at distance x (a = -0.5, torch's antialiased one)."""
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1, np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def _resize_weights(n_in: int, n_out: int) -> tuple:
    """(weights (n_out, n_in) int64, their fixed-point bits) of torch's antialiased bicubic along one axis of
    uint8 pixels: the filter stretched by the scale when shrinking, each row normalised to 1, then rounded to
    the most bits that keep the largest weight within int16."""
    scale = n_in / n_out
    support, inv = (2.0 * scale, 1.0 / scale) if scale >= 1 else (2.0, 1.0)
    rows = []
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo, hi = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), n_in)
        w = _cubic((np.arange(lo, hi) - center + 0.5) * inv)
        rows.append((lo, w / w.sum() if w.sum() != 0 else w))
    top, bits = max(float(w.max()) for _, w in rows), 0
    while bits < 22 and int(0.5 + top * (1 << (bits + 1))) < 1 << 15:
        bits += 1
    out = np.zeros((n_out, n_in), np.int64)
    for i, (lo, w) in enumerate(rows):
        v = w * (1 << bits)
        out[i, lo:lo + len(w)] = np.where(v < 0, v - 0.5, v + 0.5).astype(np.int64)    # rounded away from 0
    return out, bits


def _resize_axis(x: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    """x uint8 resized to n_out along `axis` (as it is where that is its size already)."""
    if x.shape[axis] == n_out:
        return x
    weights, bits = _resize_weights(x.shape[axis], n_out)
    y = np.tensordot(np.moveaxis(x.astype(np.int64), axis, -1), weights.T, 1) + (1 << (bits - 1))
    return np.moveaxis(np.clip(y >> bits, 0, 255), -1, axis).astype(np.uint8)


def bicubic_resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """frames (F, H, W, C) uint8 -> (F, height, width, C) uint8 as torchvision's resize (bicubic, antialias) of
    uint8 tensors on the CPU, which the video processor uses: the width first, then the height, each pass
    rounded to uint8 (not PIL's, which differs by a level or more)."""
    return _resize_axis(_resize_axis(frames, width, 2), height, 1)


def video_smart_resize(frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                       max_pixels: int) -> tuple:
    """(height, width) of a clip's frames made multiples of `factor`, the whole clip's pixels (its frame count
    rounded to `temporal`) within [min_pixels, max_pixels] (the video processor's smart_resize: a side under
    `factor` scaled up first)."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise DataError(f"a video of {width} x {height} pixels: its aspect ratio is over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h, w = (max(factor, math.floor(height / beta / factor) * factor),
                max(factor, math.floor(width / beta / factor) * factor))
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def sample_indices(total: int, fps: float | None, settings: QwenVideoSettings) -> np.ndarray:
    """The frames the processor samples of a clip of `total` frames at `fps` (Qwen3VLVideoProcessor.sample_frames:
    settings.fps per second, within min_frames and max_frames and the clip, or settings.num_frames), evenly
    spread from the first to the last."""
    if settings.num_frames is not None:
        n = settings.num_frames
    else:
        n = int(total / (fps or _NO_FPS) * settings.fps)
        n = min(max(n, settings.min_frames), settings.max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int)


def is_video_file(path) -> bool:
    """Whether a path names a video file (by its suffix), which needs PyAV to decode."""
    return Path(path).suffix.lower() in _VIDEO_SUFFIXES


def read_video_file(path, settings: QwenVideoSettings, where: str = "video") -> Video:
    """A video file's frames sampled as the processor samples them (PyAV decodes it); without PyAV, or a file it
    cannot decode, one line."""
    try:
        import av
    except ImportError:
        raise DataError(f"{where}: {path} is a video file; decoding it needs PyAV (pip install av), or give the "
                        f"video as a list of frame images") from None
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            frames = [f.to_image() for f in container.decode(stream)]
            fps = float(stream.average_rate) if stream.average_rate else None
    except (av.error.FFmpegError, OSError, IndexError) as e:
        raise DataError(f"{where}: cannot decode the video {path}: {e}") from None
    if not frames:
        raise DataError(f"{where}: the video {path} has no frames")
    idx = sample_indices(len(frames), fps, settings)
    return Video(tuple(frames[i] for i in idx), fps or _NO_FPS, tuple(int(i) for i in idx))


def as_video(value, settings: QwenVideoSettings, where: str = "video") -> Video:
    """A record's or the CLI's video: a Video, a list of frames (paths, bytes, PIL images), a folder of frame
    images (in name order) or a video file (read_video_file)."""
    if isinstance(value, Video):
        return value
    if isinstance(value, (list, tuple)):
        return Video(tuple(value))
    if isinstance(value, (str, Path)):
        path = Path(value)
        if path.is_dir():
            frames = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
            if not frames:
                raise DataError(f"{where}: the folder {path} holds no frames")
            return Video(tuple(str(p) for p in frames))
        if not path.is_file():
            raise DataError(f"{where}: no such video file or folder of frames: {path}")
        return read_video_file(path, settings, where)
    raise DataError(f"{where}: a video must be a list of frames, a folder of frames or a video file, got "
                    f"{type(value).__name__}")
