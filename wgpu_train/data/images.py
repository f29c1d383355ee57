"""Images in: Pillow's decoding of paths, bytes and hub-dataset images, and the preprocessing of transformers'
Gemma3ImageProcessor (its PIL backend: RGB over white, pan-and-scan's crops, resize, rescale, normalise) to the
same pixel_values (SmolVLM's tiles: data/image_tiles.py)."""
from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
from pathlib import Path

import numpy as np

from wgpu_train.errors import ConfigError, DataError

RESAMPLES = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}   # PIL's numbering


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("images need Pillow: pip install 'wgpu-train[vision]'") from None
    return Image


@dataclasses.dataclass(frozen=True)
class ImageSettings:
    """What the processor's preprocessor_config.json says of one image: the size (height, width) it is resized
    to, PIL's resample filter (its number), the rescale factor, and the per-channel mean and std; pan_and_scan:
    Gemma 3's crops of wide and tall images (do_pan_and_scan), with the processor's min_crop_size, max_num_crops
    and min_ratio (to activate)."""

    height: int
    width: int
    resample: int = 2
    rescale_factor: float = 1 / 255
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    pan_and_scan: bool = False
    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio: float = 1.2

    @classmethod
    def from_dict(cls, raw: dict, image_size: int, source: str = "preprocessor_config.json") -> ImageSettings:
        """From a preprocessor_config.json's fields (transformers' Gemma 3 defaults where left out; the size
        defaults to the vision tower's image_size; pan-and-scan's, Gemma3Processor's where null)."""
        size = raw.get("size") or {"height": image_size, "width": image_size}
        if "height" not in size or "width" not in size:
            raise ConfigError(f"{source}: not supported: size {size} (a fixed height and width only)")
        resample = int(raw.get("resample", 2))
        if resample not in RESAMPLES:
            raise ConfigError(f"{source}: unknown resample {resample}")
        mean, std = (tuple(float(v) for v in raw.get(k, (0.5,) * 3)) for k in ("image_mean", "image_std"))
        pan = bool(raw.get("do_pan_and_scan"))
        crop, most, ratio = (d if raw.get(f"pan_and_scan_{k}") is None else raw[f"pan_and_scan_{k}"] for k, d in (
            ("min_crop_size", 256), ("max_num_crops", 4), ("min_ratio_to_activate", 1.2)))
        if pan and min(int(crop), int(most)) < 1:
            raise ConfigError(f"{source}: pan_and_scan_min_crop_size and pan_and_scan_max_num_crops must be at "
                              f"least 1, got {crop} and {most}")
        if pan and not raw.get("do_resize", True):
            raise ConfigError(f"{source}: not supported: do_pan_and_scan without do_resize (the crops' sizes differ)")
        return cls(int(size["height"]), int(size["width"]), resample, float(raw.get("rescale_factor", 1 / 255)),
                   mean, std, bool(raw.get("do_resize", True)), bool(raw.get("do_rescale", True)),
                   bool(raw.get("do_normalize", True)), pan, int(crop), int(most), float(ratio))

    @classmethod
    def from_folder(cls, folder, image_size: int) -> ImageSettings:
        """A model folder's preprocessor_config.json, or the defaults where it has none."""
        path = Path(folder) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        return cls.from_dict(raw, image_size, str(path))

    def batch(self, images, where: str = "record") -> np.ndarray:
        """Images -> (N, 3, height, width) float32 (pixel_batch): N the images, each followed by its crops."""
        return pixel_batch(images, self, where)

    def crop_boxes(self, height: int, width: int) -> list:
        """Pan-and-scan's crops of an image of (height, width), as Gemma3ImageProcessor.pan_and_scan cuts them:
        [(left, top, right, bottom)] row-major, cut at the image's edge; [] where pan-and-scan is off, the image
        is not wide (or tall) enough by min_ratio, or a crop would be under min_crop_size."""
        if not self.pan_and_scan:
            return []
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio:
            return []
        n = min(self.max_num_crops, max(2, min(int(math.floor(long / self.min_crop_size)),
                                               int(math.floor(long / short + 0.5)))))
        cols, rows = (n, 1) if width >= height else (1, n)
        w, h = math.ceil(width / cols), math.ceil(height / rows)
        if min(w, h) < self.min_crop_size:
            return []
        if (cols - 1) * w >= width or (rows - 1) * h >= height:     # the processor's last crop would be empty
            raise DataError(f"pan-and-scan: an image of {width} x {height} leaves its last crop empty "
                            f"(pan_and_scan_min_crop_size {self.min_crop_size} is too small for it)")
        return [(x, y, min(x + w, width), min(y + h, height))
                for y, x in itertools.product(range(0, rows * h, h), range(0, cols * w, w))]

    def n_crops(self, image, where: str = "image") -> int:
        """How many crops pan-and-scan cuts of an image (anything open_image takes), from its size alone; a pixel
        array (preprocessed already) is refused where pan-and-scan is on."""
        if not self.pan_and_scan:
            return 0
        if isinstance(image, np.ndarray):
            raise DataError(f"{where}: with pan-and-scan (do_pan_and_scan) images are files, bytes or PIL images "
                            f"(their size gives the crops), not pixel arrays")
        width, height = open_image(image, where).size
        return len(self.crop_boxes(height, width))


def open_image(image, where: str = "image"):
    """A PIL image from a path, bytes, a hub dataset's {"bytes": ..., "path": ...} or a PIL image; an image that
    cannot be read or decoded raises DataError naming `where`."""
    pil = _pil()
    if isinstance(image, pil.Image):
        return image
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    try:
        if isinstance(image, (bytes, bytearray)):
            out = pil.open(io.BytesIO(image))
        elif isinstance(image, (str, Path)):
            out = pil.open(Path(image))
        else:
            raise DataError(f"{where}: an image must be a path, bytes or a PIL image, got {type(image).__name__}")
        out.load()
    except (OSError, ValueError, pil.DecompressionBombError) as e:
        raise DataError(f"{where}: cannot decode the image: {e}") from None
    return out


def image_bytes(image, where: str = "image") -> bytes:
    """The bytes that identify an image's content (a resume's data fingerprint): a file's or the given bytes, a
    PIL image's mode, size and pixels, an array's; a file that cannot be read raises DataError naming `where`."""
    pil = _pil()
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, (str, Path)):
        try:
            return Path(image).read_bytes()
        except OSError as e:
            raise DataError(f"{where}: cannot read the image: {e}") from None
    if isinstance(image, pil.Image):
        return f"{image.mode} {image.size}".encode() + image.tobytes()
    if isinstance(image, np.ndarray):
        return f"{image.dtype} {image.shape}".encode() + np.ascontiguousarray(image).tobytes()
    raise DataError(f"{where}: an image must be a path, bytes or a PIL image, got {type(image).__name__}")


def to_rgb(image):
    """RGB as transformers converts it: transparency composited over white."""
    pil = _pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return pil.alpha_composite(pil.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def pixel_values(image, settings: ImageSettings, where: str = "image") -> np.ndarray:
    """One image (anything open_image takes) -> (3, height, width) float32, as the processor's pixel_values (the
    image itself, without pan-and-scan's crops: image_pixels)."""
    return _resized(to_rgb(open_image(image, where)), settings)


def image_pixels(image, settings: ImageSettings, where: str = "image") -> np.ndarray:
    """One image -> (1 + crops, 3, height, width) float32: the image, then pan-and-scan's crops of it in order
    (settings.crop_boxes), each resized, rescaled and normalised, as the processor's pixel_values."""
    img = to_rgb(open_image(image, where))
    crops = [img.crop(box) for box in settings.crop_boxes(img.height, img.width)]
    return np.stack([_resized(im, settings) for im in [img, *crops]])


def _resized(img, settings: ImageSettings) -> np.ndarray:
    """An RGB PIL image -> (3, height, width) float32, resized (where the settings say) and normalised."""
    if settings.do_resize:
        img = img.resize((settings.width, settings.height), resample=settings.resample)
    return normalised(np.moveaxis(np.asarray(img), -1, 0), settings)


def normalised(x, settings: ImageSettings) -> np.ndarray:
    """(3, H, W) uint8 -> float32 rescaled and normalised as the processor's NumPy steps do it."""
    if settings.do_rescale:
        x = (x.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    x = x.astype(np.float32)
    if settings.do_normalize:
        mean, std = (np.asarray(v, np.float32)[:, None, None] for v in (settings.mean, settings.std))
        x = (x - mean) / std
    return x


def pixel_batch(images, settings: ImageSettings, where: str = "record") -> np.ndarray:
    """Images -> (N, 3, height, width) float32, each image followed by its pan-and-scan crops (N may be 0)."""
    rows = [image_pixels(im, settings, f"{where}: image {i}") for i, im in enumerate(images)]
    return np.concatenate(rows) if rows else np.zeros((0, 3, settings.height, settings.width), np.float32)
