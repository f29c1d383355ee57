"""LFM2-VL's images in: transformers' Lfm2VlImageProcessor (its torchvision backend) to its exact pixel_values,
pixel_attention_mask and spatial_shapes (smart resize, or tiles plus a thumbnail; torch's antialiased uint8 bilinear
resize, reproduced here; patches padded to max_num_patches), and the prompt each image's placeholder becomes."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from wgpu_train.data.images import open_image, to_rgb
from wgpu_train.errors import ConfigError, DataError

_FIELDS = {"use_image_special_tokens": True, "downsample_factor": 2, "do_image_splitting": True, "min_tiles": 2,
           "max_tiles": 10, "use_thumbnail": True, "min_image_tokens": 64, "max_image_tokens": 256,
           "encoder_patch_size": 16, "tile_size": 512, "max_pixels_tolerance": 2.0, "rescale_factor": 1 / 255,
           "do_rescale": True, "do_normalize": True}
_BILINEAR = 2       # PIL's number, what the processor's resample means


def _axis_weights(size_in: int, size_out: int) -> tuple:
    """torch's antialiased bilinear weights along one axis as its uint8 kernel uses them: (first source index
    (out,), int16 weights (out, K) as int64, their precision in bits)."""
    scale = size_in / size_out
    support = scale if scale >= 1.0 else 1.0
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    k = int(math.ceil(support)) * 2 + 1
    starts, weights = np.zeros(size_out, np.int64), np.zeros((size_out, k))
    for i in range(size_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), size_in)
        w = np.maximum(0.0, 1.0 - np.abs((np.arange(lo, hi) - center + 0.5) * inv))
        starts[i], weights[i, :hi - lo] = lo, w / w.sum() if w.sum() != 0 else w
    precision = 0
    while precision < 22 and int(0.5 + weights.max() * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    return starts, np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int64), precision


def _resize_axis(x: np.ndarray, size_out: int, axis: int) -> np.ndarray:
    """x (H, W, C) uint8 resized along `axis` (0 rows, 1 columns), in torch's integer arithmetic."""
    if x.shape[axis] == size_out:
        return x
    starts, w, precision = _axis_weights(x.shape[axis], size_out)
    # int32 holds the sums: 255 x weights adding up to 2^precision (at most 2^22)
    src = np.moveaxis(x, axis, 0).astype(np.int32)                                    # (in, other, C)
    acc = np.full((size_out, *src.shape[1:]), 1 << (precision - 1), np.int32)
    w = w.astype(np.int32)
    for k in range(w.shape[1]):     # a tap at a time (past a row's last tap its weight is 0)
        acc += w[:, k, None, None] * src[np.minimum(starts + k, len(src) - 1)]
    return np.moveaxis(np.clip(acc >> precision, 0, 255).astype(np.uint8), 0, axis)


def resize_bilinear(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """(H, W, C) uint8 -> (height, width, C) uint8 as torchvision's resize(antialias=True) of a uint8 tensor gives
    it: the columns first, then the rows, each pass rounded to uint8."""
    return _resize_axis(_resize_axis(x, width, 1), height, 0)


@dataclasses.dataclass(frozen=True)
class Lfm2ImageSettings:
    """What an Lfm2VlImageProcessor's preprocessor_config.json says (its defaults where left out): the encoder's
    patch, the projector's downsampling, tiling (min / max tiles, tile_size, the thumbnail, max_pixels_tolerance),
    the image token range of smart resize, rescale and normalisation; and the processor's use_image_special_tokens
    (the markers around an image's tokens)."""

    use_image_special_tokens: bool = True
    encoder_patch_size: int = 16
    downsample_factor: int = 2
    do_image_splitting: bool = True
    min_tiles: int = 2
    max_tiles: int = 10
    use_thumbnail: bool = True
    min_image_tokens: int = 64
    max_image_tokens: int = 256
    tile_size: int = 512
    max_pixels_tolerance: float = 2.0
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)

    @classmethod
    def from_dict(cls, raw: dict, patch_size: int, source: str = "preprocessor_config.json",
                  factor: int | None = None) -> Lfm2ImageSettings:
        """From preprocessor_config.json's fields; an encoder_patch_size that is not the tower's patch_size, a
        downsample_factor that is not the projector's `factor` (where given), another resample than bilinear, or
        tiles whose patches the projector cannot pair up refused in one line."""
        got = {k: type(d)(raw.get(k, d)) for k, d in _FIELDS.items()}
        if got["encoder_patch_size"] != patch_size:
            raise ConfigError(f"{source}: encoder_patch_size {got['encoder_patch_size']} is not the vision tower's "
                              f"patch_size {patch_size}")
        if factor is not None and got["downsample_factor"] != factor:
            raise ConfigError(f"{source}: downsample_factor {got['downsample_factor']} is not the projector's "
                              f"{factor}")
        if int(raw.get("resample", _BILINEAR)) != _BILINEAR:
            raise ConfigError(f"{source}: resample {raw['resample']} is not supported (bilinear, 2, only)")
        if (got["tile_size"] // patch_size) % got["downsample_factor"]:
            raise ConfigError(f"{source}: a tile of {got['tile_size']} pixels is not whole blocks of "
                              f"{got['downsample_factor']} x {got['downsample_factor']} patches")
        if got["do_image_splitting"] and got["min_tiles"] > got["max_tiles"]:
            raise ConfigError(f"{source}: min_tiles {got['min_tiles']} is over max_tiles {got['max_tiles']}")
        mean, std = (tuple(float(v) for v in raw.get(k, (0.5,) * 3)) for k in ("image_mean", "image_std"))
        return cls(**got, mean=mean, std=std)

    @classmethod
    def from_folder(cls, folder, patch_size: int, factor: int | None = None) -> Lfm2ImageSettings:
        """A model folder's preprocessor_config.json (flat), or its processor_config.json (the image processor's
        fields under image_processor, use_image_special_tokens at the top or there), or the defaults."""
        flat, nested = Path(folder) / "preprocessor_config.json", Path(folder) / "processor_config.json"
        if flat.is_file():
            return cls.from_dict(json.loads(flat.read_text()), patch_size, str(flat), factor)
        raw = json.loads(nested.read_text()) if nested.is_file() else {}
        fields = {**{k: v for k, v in raw.items() if k == "use_image_special_tokens"}, **(raw.get("image_processor")
                                                                                         or {})}
        return cls.from_dict(fields, patch_size, str(nested), factor)

    @property
    def tiles_range(self) -> tuple:
        return (self.min_tiles, self.max_tiles) if self.do_image_splitting else (1, 1)

    @property
    def max_num_patches(self) -> int:
        """Every tile's patches are padded to this many."""
        tile = (self.tile_size // self.encoder_patch_size) ** 2 if self.do_image_splitting else 0
        return max(self.max_image_tokens * self.downsample_factor ** 2, tile)

    @property
    def largest(self) -> tuple:
        """(tiles, tokens) of the largest image the processor makes: max_tiles tiles and the thumbnail, each marked,
        between <|image_start|> and <|image_end|> (unsplit: max_image_tokens tokens; the markers where
        use_image_special_tokens)."""
        marks = int(self.use_image_special_tokens)
        if not self.do_image_splitting:
            return 1, self.max_image_tokens + 2 * marks
        tile = self.tokens((self.tile_size, self.tile_size))
        thumb = self.max_image_tokens + marks if self.use_thumbnail else 0
        return self.max_tiles + self.use_thumbnail, self.max_tiles * (tile + marks) + thumb + 2 * marks

    def smart_resize(self, height: int, width: int) -> tuple:
        """(height, width) whole blocks of downsample_factor patches, their tokens within [min_image_tokens,
        max_image_tokens], the aspect ratio kept as nearly as may be."""
        f = self.encoder_patch_size * self.downsample_factor
        low, high = self.min_image_tokens * f * f, self.max_image_tokens * f * f
        h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
        if h * w > high:
            beta = math.sqrt(height * width / high)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < low:
            beta = math.sqrt(low / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def grid(self, height: int, width: int) -> tuple:
        """(columns, rows) of tiles whose aspect ratio is nearest the image's (the larger area on a tie, where the
        image covers over half of it)."""
        low, high = self.tiles_range
        ratios = sorted(set((w, h) for n in range(low, high + 1) for w in range(1, n + 1) for h in range(1, n + 1)
                            if low <= w * h <= high), key=lambda r: r[0] * r[1])
        aspect, best, best_diff = width / height, (1, 1), float("inf")
        for r in ratios:
            diff = abs(aspect - r[0] / r[1])
            if diff < best_diff:
                best, best_diff = r, diff
            elif diff == best_diff and width * height > 0.5 * self.tile_size ** 2 * r[0] * r[1]:
                best = r
        return best

    def layout(self, height: int, width: int) -> tuple:
        """An image of height x width pixels -> (rows, cols) of tiles ((1, 1): not split), (height, width) of
        the single image or the thumbnail."""
        f = self.encoder_patch_size * self.downsample_factor
        h, w = max(self.encoder_patch_size, round(height / f) * f), max(self.encoder_patch_size, round(width / f) * f)
        large = h * w > self.max_image_tokens * f * f * self.max_pixels_tolerance
        low, high = self.tiles_range
        cols, rows = self.grid(height, width) if large and not low == high == 1 else (1, 1)
        return (rows, cols), self.smart_resize(height, width)

    def tokens(self, size: tuple) -> int:
        """The image tokens of a resized image or thumbnail of `size` (height, width) pixels."""
        p, f = self.encoder_patch_size, self.downsample_factor
        return math.ceil(size[0] // p / f) * math.ceil(size[1] // p / f)

    def tile_images(self, image, where: str = "image") -> list:
        """One image -> its tiles row-major then the thumbnail, or the image resized alone: (h, w, 3) uint8 each."""
        x = np.asarray(to_rgb(open_image(image, where)))
        (rows, cols), (h, w) = self.layout(x.shape[0], x.shape[1])
        if rows == cols == 1:
            return [resize_bilinear(x, h, w)]
        t = self.tile_size
        big = resize_bilinear(x, rows * t, cols * t)
        tiles = [big[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
        return tiles + ([resize_bilinear(x, h, w)] if self.use_thumbnail else [])

    def normalised(self, x: np.ndarray) -> np.ndarray:
        """(H, W, 3) uint8 -> float32, rescale and normalise fused as the torchvision backend does it."""
        x = x.astype(np.float32)
        mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
        if self.do_normalize:
            if self.do_rescale:
                mean, std = mean * np.float32(1.0 / self.rescale_factor), std * np.float32(1.0 / self.rescale_factor)
            return (x - mean) / std
        return x * np.float32(self.rescale_factor) if self.do_rescale else x

    def batch(self, images, where: str = "record") -> tuple:
        """Images -> (pixel_values (tiles, max_num_patches, p * p * 3) float32, pixel_attention_mask (tiles,
        max_num_patches) int32, spatial_shapes (tiles, 2) int64), every image's tiles in order."""
        p, most = self.encoder_patch_size, self.max_num_patches
        tiles = [t for i, im in enumerate(images) for t in self.tile_images(im, f"{where}: image {i}")]
        pixels = np.zeros((len(tiles), most, p * p * 3), np.float32)
        mask = np.zeros((len(tiles), most), np.int32)
        shapes = np.zeros((len(tiles), 2), np.int64)
        for k, tile in enumerate(tiles):
            rows, cols = tile.shape[0] // p, tile.shape[1] // p
            x = self.normalised(tile[:rows * p, :cols * p]).reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4)
            pixels[k, :rows * cols] = x.reshape(rows * cols, -1)                        # (patches, p*p*3)
            mask[k, :rows * cols], shapes[k] = 1, (rows, cols)
        return pixels, mask, shapes


@dataclasses.dataclass(frozen=True)
class Lfm2ImageSpan:
    """How an image stands in LFM2-VL's text (data/vision_records' span protocol): the chat template writes
    <image>, which the processor replaces by <|image_start|>, each tile's <|img_row_r_col_c|> and its image
    tokens, <|img_thumbnail|> and the thumbnail's, <|image_end|> (a single image: its tokens alone between them)."""

    image: str
    start: str
    end: str
    thumbnail: str
    settings: Lfm2ImageSettings

    @property
    def placeholder(self) -> str:
        return self.image

    @property
    def token_names(self) -> tuple:
        """The tokens of an image's run (never trained)."""
        most = self.settings.max_tiles
        return (self.start, self.image, self.end, self.thumbnail,
                *(f"<|img_row_{r}_col_{c}|>" for r in range(1, most + 1) for c in range(1, most + 1)))

    def expansion(self, image) -> str:
        """The text an image (a path, bytes or a PIL image) takes in place of its placeholder."""
        if isinstance(image, np.ndarray):
            raise DataError("LFM2-VL takes images as files, bytes or PIL images (their size gives the tokens), "
                            "not pixel arrays")
        s = self.settings
        marks = s.use_image_special_tokens
        width, height = open_image(image).size
        (rows, cols), size = s.layout(height, width)
        start, end = (self.start, self.end) if marks else ("", "")
        if rows == cols == 1:
            return start + self.image * s.tokens(size) + end
        tile = self.image * s.tokens((s.tile_size, s.tile_size))
        parts = [(f"<|img_row_{r + 1}_col_{c + 1}|>" if marks else "") + tile for r in range(rows) for c in range(cols)]
        thumb = (self.thumbnail if marks else "") + self.image * s.tokens(size) if s.use_thumbnail else ""
        return start + "".join(parts) + thumb + end

    @classmethod
    def from_tokenizer(cls, tokenizer, image_id: int, settings: Lfm2ImageSettings) -> Lfm2ImageSpan:
        """From the model's image token id and the tokenizer's special tokens; a tokenizer without them refused
        in one line."""
        image = tokenizer.backend.id_to_token(image_id)
        names = (image, "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>")
        missing = [n for n in names[1:] if tokenizer.token_to_id(n) is None]
        if image is None or missing:
            raise DataError(f"the tokenizer has no token {missing[0] if missing else image_id} of LFM2-VL's images")
        return cls(*names, settings)
