"""Qwen3-VL's images in: transformers' Qwen2VLImageProcessor (its PIL backend, which Qwen3-VL's processor uses):
smart_resize to whole merged patches within min / max pixels, rescale, normalise, then the patches flattened in
merge-block order with the still image repeated over temporal_patch_size, to its exact pixel_values and
image_grid_thw; and the prompt each image's placeholder becomes (<|image_pad|> once per merged patch), and each
video's (data/qwen_videos: a timestamp and a run of <|video_pad|> per temporal patch group)."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from wgpu_train.data.images import RESAMPLES, normalised, open_image, to_rgb
from wgpu_train.data.qwen_videos import QwenVideoSettings, Video, as_video
from wgpu_train.errors import ConfigError, DataError

_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class QwenImageSettings:
    """What a Qwen2-VL / Qwen3-VL preprocessor_config.json says: the patch, temporal patch and merge sizes, the
    pixel range smart_resize keeps an image in (min_pixels, max_pixels: size's shortest_edge / longest_edge),
    PIL's resample filter, the rescale factor and the per-channel mean and std; video: the model's video
    preprocessing (data/qwen_videos.QwenVideoSettings; None: the model takes no videos)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    resample: int = 3
    rescale_factor: float = 1 / 255
    mean: tuple = _CLIP_MEAN
    std: tuple = _CLIP_STD
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    video: QwenVideoSettings | None = None
    video_refused: str = ""         # why the model's video preprocessing is not supported (only videos refused)

    @classmethod
    def from_dict(cls, raw: dict, vision, source: str = "preprocessor_config.json") -> QwenImageSettings:
        """From a preprocessor_config.json's fields (Qwen2VLImageProcessor's defaults where left out; the patch
        sizes default to the tower's, `vision` a models/qwen3_vl.Qwen3VLVision, and must equal them)."""
        size = raw.get("size") or {}
        sizes = {"patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
                 "merge_size": vision.spatial_merge_size}
        got = {k: int(raw.get(k, d)) for k, d in sizes.items()}
        wrong = next((k for k in sizes if got[k] != sizes[k]), None)
        if wrong:
            raise ConfigError(f"{source}: {wrong} {got[wrong]} is not the vision tower's {sizes[wrong]}")
        resample = int(raw.get("resample", 3))
        if resample not in RESAMPLES:
            raise ConfigError(f"{source}: unknown resample {resample}")
        low = int(raw.get("min_pixels", size.get("shortest_edge", 56 * 56)))
        high = int(raw.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280)))
        if not 0 < low <= high:
            raise ConfigError(f"{source}: the pixel range {low} to {high} (size's shortest_edge, longest_edge) is "
                              f"empty")
        mean, std = (tuple(float(v) for v in raw.get(k, d)) for k, d in (("image_mean", _CLIP_MEAN),
                                                                         ("image_std", _CLIP_STD)))
        return cls(*got.values(), low, high, resample, float(raw.get("rescale_factor", 1 / 255)), mean, std,
                   bool(raw.get("do_resize", True)), bool(raw.get("do_rescale", True)),
                   bool(raw.get("do_normalize", True)))

    @classmethod
    def from_folder(cls, folder, vision) -> QwenImageSettings:
        """A model folder's preprocessor_config.json, or the defaults where it has none; its videos' from its
        video_preprocessor_config.json (or the video processor's defaults)."""
        path = Path(folder) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        settings = cls.from_dict(raw, vision, str(path))
        try:
            return dataclasses.replace(settings, video=QwenVideoSettings.from_folder(folder, vision))
        except ConfigError as e:        # images still run; a video is refused with this line
            return dataclasses.replace(settings, video_refused=str(e))

    @property
    def factor(self) -> int:
        """An image's sides are made multiples of this: a merge block of patches."""
        return self.patch_size * self.merge_size

    def resized(self, height: int, width: int) -> tuple:
        """(height, width) after smart_resize, or as it is without do_resize."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels) if self.do_resize else \
            (height, width)

    def grid(self, image, where: str = "image") -> tuple:
        """(1, rows, cols) of patches of an image (anything open_image takes), from its size alone."""
        width, height = open_image(image, where).size
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def tokens(self, image, where: str = "image") -> int:
        """The image tokens an image takes in the text: its merged patches."""
        _, rows, cols = self.grid(image, where)
        return rows * cols // self.merge_size ** 2

    def patches(self, image, where: str = "image") -> tuple:
        """One image -> (its patches (rows * cols, C * temporal * patch^2) float32 in merge-block order, each
        the still image repeated over temporal_patch_size, (1, rows, cols)), as the processor's."""
        img = to_rgb(open_image(image, where))
        h, w = self.resized(img.height, img.width)
        if self.do_resize:
            img = img.resize((w, h), resample=self.resample)
        x = normalised(np.moveaxis(np.asarray(img), -1, 0), self)                    # (C, H, W)
        p, m, c = self.patch_size, self.merge_size, x.shape[0]
        rows, cols = h // p, w // p
        if rows % m or cols % m:
            raise DataError(f"{where}: {h} x {w} pixels are not whole merge blocks of {m} x {m} patches of {p}")
        x = x.reshape(c, rows // m, m, p, cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, p, p)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], self.temporal_patch_size, p, p))
        return np.ascontiguousarray(x.reshape(rows * cols, -1), np.float32), (1, rows, cols)

    def batch(self, images, where: str = "record") -> tuple:
        """Images, and videos (data/qwen_videos.Video) among them, in order -> (pixel_values (total patches,
        patch dim) float32, their grids (N, 3) int64: image_grid_thw's and video_grid_thw's rows in that order)."""
        out = [self.video_settings(where).patches(im, f"{where}: video {i}") if isinstance(im, Video) else
               self.patches(im, f"{where}: image {i}") for i, im in enumerate(images)]
        dim = 3 * self.temporal_patch_size * self.patch_size ** 2
        if not out:
            return np.zeros((0, dim), np.float32), np.zeros((0, 3), np.int64)
        return np.concatenate([p for p, _ in out]), np.array([g for _, g in out], np.int64)


    def video_settings(self, where: str = "record") -> QwenVideoSettings:
        """The video preprocessing; a model built without it (or whose video_preprocessor_config.json is not
        supported) refused in one line."""
        if self.video is None:
            why = self.video_refused or "no video preprocessing"
            raise DataError(f"{where}: videos are not supported here ({why})")
        return self.video


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple:
    """(height, width) made multiples of `factor`, their product within [min_pixels, max_pixels], the aspect
    ratio kept as nearly as may be (transformers' smart_resize); an aspect ratio over 200 refused."""
    if max(height, width) / min(height, width) > 200:
        raise DataError(f"an image of {width} x {height} pixels: its aspect ratio is over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor)
                                                                            * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass(frozen=True)
class QwenImageSpan:
    """How an image stands in Qwen3-VL's text (data/vision_records' span protocol): the chat template writes
    <|vision_start|><|image_pad|><|vision_end|>, and the processor repeats <|image_pad|> once per merged patch
    of the image (its size gives the count). A video's: the template writes
    <|vision_start|><|video_pad|><|vision_end|>, which the processor replaces by `<t seconds>`, <|vision_start|>,
    <|video_pad|> once per merged patch of a frame group and <|vision_end|>, for each temporal patch group."""

    start: str
    image: str
    end: str
    settings: QwenImageSettings
    video: str = ""

    @property
    def placeholder(self) -> str:
        return self.image

    @property
    def video_placeholder(self) -> str:
        """What the chat template writes for a video."""
        return self.start + self.video + self.end

    @property
    def token_names(self) -> tuple:
        """The tokens of an image's or a video's run (never trained)."""
        return self.start, self.image, self.end, *((self.video,) if self.video else ())

    def as_video(self, value, where: str = "video") -> Video:
        """A record's video (frames, a folder of them, or a video file) as a data/qwen_videos.Video, its frames
        read once here (a frame that cannot be decoded, or of another size, refused naming `where`)."""
        video = as_video(value, self.settings.video_settings(where), where)
        self.settings.video_settings(where).grid(video, where)
        return video

    def expansion(self, image) -> str:
        """The text an image (a path, bytes or a PIL image) takes in place of its placeholder, or a Video in
        place of video_placeholder."""
        if isinstance(image, Video):
            video = self.settings.video_settings()
            run = self.start + self.video * video.tokens_per_group(image) + self.end
            t = video.grid(image)[0]
            return "".join(f"<{s:.1f} seconds>{run}" for s in image.timestamps(video.temporal_patch_size)[:t])
        if isinstance(image, np.ndarray):
            raise DataError("Qwen3-VL takes images as files, bytes or PIL images (their size gives the tokens), "
                            "not pixel arrays")
        return self.image * self.settings.tokens(image)

    @classmethod
    def from_tokenizer(cls, tokenizer, vision, settings: QwenImageSettings) -> QwenImageSpan:
        """From the model's token ids (`vision` a models/qwen3_vl.Qwen3VLVision); a tokenizer without them
        refused in one line."""
        ids = (vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id)
        names = [tokenizer.backend.id_to_token(i) for i in ids]
        if None in names:
            raise DataError(f"the tokenizer has no token for the image ids {ids} of the model's config")
        video = tokenizer.backend.id_to_token(vision.video_token_id) if vision.video_token_id >= 0 else None
        return cls(*names, settings, video or "")
