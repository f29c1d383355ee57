"""SmolVLM's and Idefics3's image processor (its PIL backend) to the same pixel_values: resize to the longest edge,
then to multiples of the tile size, the tiles plus the global image; and the prompt each image's placeholder
becomes (<fake_token_around_image>, <row_i_col_j>, <global-img>, image_seq_len image tokens a tile)."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from wgpu_train.data.images import ImageSettings, normalised, open_image, to_rgb
from wgpu_train.errors import ConfigError, DataError

_MAX_SIDE = 4096        # the processor's absolute bound on a side after the longest-edge resize


@dataclasses.dataclass(frozen=True)
class TileSettings:
    """What SmolVLM's preprocessor_config.json says: the longest edge an image is resized to (0: not resized),
    the tile side (max_image_size; the vision tower's image_size), whether images are split into tiles, and
    the resample filter, rescale and normalisation (`base`, whose height and width are the tile's)."""

    longest_edge: int
    tile: int
    split: bool
    base: ImageSettings

    @classmethod
    def from_dict(cls, raw: dict, image_size: int, source: str = "preprocessor_config.json") -> TileSettings:
        """From the processor's fields (transformers' SmolVLM defaults where left out: LANCZOS, mean and std 0.5);
        a tile side other than the tower's image_size and a size without longest_edge refused in one line (every
        tile is then tile x tile: do_pad changes nothing)."""
        tile = int((raw.get("max_image_size") or {"longest_edge": image_size}).get("longest_edge", 0))
        if tile != image_size:
            raise ConfigError(f"{source}: not supported: max_image_size {raw.get('max_image_size')} (tiles of the "
                              f"vision tower's image_size {image_size} only)")
        do_resize = bool(raw.get("do_resize", True))
        size = raw.get("size") or {"longest_edge": 4 * tile}
        if do_resize and "longest_edge" not in size:
            raise ConfigError(f"{source}: not supported: size {size} (a longest_edge only)")
        base = ImageSettings.from_dict({"resample": 1, **{k: v for k, v in raw.items() if k != "size"},
                                        "do_pan_and_scan": False}, tile, source)
        return cls(int(size["longest_edge"]) if do_resize else 0, tile, bool(raw.get("do_image_splitting", True)),
                   base)

    @classmethod
    def from_folder(cls, folder, image_size: int) -> TileSettings:
        """A model folder's preprocessor_config.json, or the defaults where it has none."""
        path = Path(folder) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        return cls.from_dict(raw, image_size, str(path))

    @property
    def most_tiles(self) -> tuple:
        """(tiles, rows) of the largest image's grid, the global image among the tiles: a square one at the
        longest edge (at 4096 where images are not resized)."""
        if not self.split:
            return 1, 0
        side = math.ceil((self.longest_edge or _MAX_SIDE) / self.tile)
        return (side * side + 1, side) if side > 1 else (1, 0)

    def sizes(self, height: int, width: int) -> tuple:
        """An image's (height, width) -> ((height, width) after the longest-edge resize, (height, width) in whole
        tiles, (rows, cols) of tiles: (0, 0) for an image that is one tile, the global image alone)."""
        if self.longest_edge:
            height, width = _longest_edge(height, width, self.longest_edge)
        first = (height, width)
        if not self.split:
            return first, (self.tile, self.tile), (0, 0)
        t, aspect = self.tile, width / height
        if width >= height:
            w = math.ceil(width / t) * t
            h = math.ceil(int(w / aspect) / t) * t
        else:
            h = math.ceil(height / t) * t
            w = math.ceil(int(h * aspect) / t) * t
        grid = (h // t, w // t) if h > t or w > t else (0, 0)
        return first, (h, w), grid

    def grid(self, image, where: str = "image") -> tuple:
        """(rows, cols) of an image's tiles (anything open_image takes), from its size alone."""
        width, height = open_image(image, where).size
        return self.sizes(height, width)[2]

    def tiles(self, image, where: str = "image") -> np.ndarray:
        """One image -> its tiles (rows * cols, row-major, then the global image; or the global image alone)
        (n, 3, tile, tile) float32, as the processor's pixel_values of it."""
        img = to_rgb(open_image(image, where))
        first, whole, (rows, cols) = self.sizes(img.height, img.width)
        resample, t = self.base.resample, self.tile
        if self.longest_edge:
            img = img.resize(first[::-1], resample=resample)
        img = img.resize(whole[::-1], resample=resample)
        if rows:
            pixels = np.asarray(img)
            crops = [pixels[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
            img = img.resize((t, t), resample=resample)         # the global image, from the resized one
            crops.append(np.asarray(img))
        else:
            crops = [np.asarray(img)]
        return np.stack([normalised(np.moveaxis(c, -1, 0), self.base) for c in crops])

    def batch(self, images, where: str = "record") -> np.ndarray:
        """Images -> every image's tiles in order (N tiles, 3, tile, tile) float32 (N may be 0)."""
        rows = [self.tiles(im, f"{where}: image {i}") for i, im in enumerate(images)]
        return np.concatenate(rows) if rows else np.zeros((0, 3, self.tile, self.tile), np.float32)


def _longest_edge(height: int, width: int, longest: int) -> tuple:
    """The processor's longest-edge resize: the longer side to `longest` (up or down), the other by the aspect
    ratio, truncated and made even; then both within 4096."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > _MAX_SIDE:
        width, height = _MAX_SIDE, int(_MAX_SIDE / aspect)
    elif height > width and height > _MAX_SIDE:
        height, width = _MAX_SIDE, int(_MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


@dataclasses.dataclass(frozen=True)
class TiledImageSpan:
    """How an image stands in SmolVLM's text (data/vision_records' span protocol, beside Gemma 3's ImageSpan):
    the chat template's placeholder (the image token itself), and what it becomes for an image of rows x cols
    tiles: each tile as <fake_token_around_image><row_r_col_c> and `count` image tokens, a newline after each
    row, then a newline and the global image as <fake_token_around_image><global-img>, its tokens and
    <fake_token_around_image>; an image of one tile only the global part (SmolVLMProcessor's prompt)."""

    image: str
    fake: str
    global_image: str
    count: int
    settings: TileSettings

    @property
    def placeholder(self) -> str:
        return self.image

    @property
    def token_names(self) -> tuple:
        """The tokens an image's run may hold (never trained): the grid's row / column tokens up to 6 x 6 too."""
        return (self.image, self.fake, self.global_image,
                *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))

    def expansion(self, image) -> str:
        """The text an image (a path, bytes or a PIL image: its size gives its tiles) takes in the prompt."""
        if isinstance(image, np.ndarray):
            raise DataError("SmolVLM takes images as files, bytes or PIL images (their size gives the tiles), "
                            "not pixel arrays")
        rows, cols = self.settings.grid(image)
        tile = self.image * self.count
        glob = f"{self.fake}{self.global_image}{tile}{self.fake}"
        if not rows:
            return glob
        grid = "".join("".join(f"{self.fake}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return f"{grid}\n{glob}"

    @classmethod
    def from_tokenizer(cls, tokenizer, image_id: int, count: int, settings: TileSettings) -> TiledImageSpan:
        """From the model's image token id and the tokenizer's <fake_token_around_image> and <global-img>; a
        tokenizer without them refused in one line."""
        image = tokenizer.backend.id_to_token(image_id)
        fake, glob = "<fake_token_around_image>", "<global-img>"
        missing = [t for t in (fake, glob) if tokenizer.token_to_id(t) is None]
        if image is None or missing:
            raise DataError(f"the tokenizer has no {missing[0] if missing else f'token for the image id {image_id}'}"
                            f" (SmolVLM's image tokens)")
        return cls(image, fake, glob, count, settings)
