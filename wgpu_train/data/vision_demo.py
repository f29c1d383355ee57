"""The embedded image demo's records (`wgpu-train finetune --images-demo`): generated pictures of one coloured square
on white, at a random place and size, each asked "What colour is the square?" in TRL's vision format, the colour's
name the answer; train, valid and test drawn from disjoint seeds."""
from __future__ import annotations

import numpy as np

from wgpu_train.data.sources import DataSplits

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (235, 210, 30),
           "purple": (140, 40, 170)}
QUESTION = "What colour is the square?"
SIDE = 48                                                   # pixels; the processor resizes to the tower's size
DEMO_SPLITS = {"train": (0, 320), "valid": (1, 20), "test": (2, 40)}     # split -> (seed, records)


def square_image(rng: np.random.Generator, colour: str):
    """A SIDE x SIDE PIL image: white, one square of `colour` (10 to 24 pixels a side, its shade jittered) at a
    random place."""
    from PIL import Image

    pixels = np.full((SIDE, SIDE, 3), 255, np.uint8)
    size = int(rng.integers(10, 25))
    y, x = (int(v) for v in rng.integers(0, SIDE - size + 1, 2))
    shade = np.clip(np.array(COLOURS[colour]) + rng.integers(-20, 21, 3), 0, 255)
    pixels[y:y + size, x:x + size] = shade
    return Image.fromarray(pixels, "RGB")


def demo_records(seed: int, n: int) -> list[dict]:
    """n records of seed: a picture of a square and its colour's name, the colours in turn (balanced)."""
    rng = np.random.default_rng([seed, 46])
    names = list(COLOURS)
    out = []
    for i in range(n):
        colour = names[i % len(names)]
        out.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                                 {"role": "assistant", "content": colour}],
                    "images": [square_image(rng, colour)]})
    return out


def image_demo_splits() -> DataSplits:
    """The demo's splits (format "vision"), the same on every call."""
    splits = {split: demo_records(seed, n) for split, (seed, n) in DEMO_SPLITS.items()}
    return DataSplits(splits["train"], splits["valid"], splits["test"], "vision",
                      files={"train": "the embedded image demo"})
