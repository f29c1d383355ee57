"""Gemma 3's vision tower on the NumPy engine: the frozen forward of SigLIP-so400m encoder layers (1152 hidden,
4304 intermediate, 16 heads; Gemma 3 4B-27B's tower) over one image's patches, and the projector, next to a
plain float32 GEMM of NumPy's BLAS measured in the same run (the machine's reference), as GFLOP/s and the time
the whole 27-layer tower would take an image.

    python benchmarks/vision_tower.py [--layers 1] [--image-size 896] [--rounds 2]

Random weights (the time does not depend on them); nothing is downloaded.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from wgpu_train.engines.numpy.vision_tower import VisionTower
from wgpu_train.models.vision import VisionConfig, tensor_shapes

HIDDEN, INTER, HEADS, PATCH, TOWER_LAYERS = 1152, 4304, 16, 14, 27


def layer_flops(t: int) -> float:
    """Multiply-adds x 2 of one encoder layer over t patches: q, k, v, out, fc1, fc2, scores and values."""
    return 2.0 * t * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * INTER) + 2.0 * 2 * t * t * HIDDEN


def best(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--image-size", type=int, default=896)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"hidden_size": 2560},
           "vision_config": {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": args.layers,
                             "num_attention_heads": HEADS, "image_size": args.image_size, "patch_size": PATCH}}
    vc = VisionConfig.from_config(raw)
    rng = np.random.default_rng(0)
    tower = VisionTower(vc, {k: (rng.standard_normal(s) * 0.02).astype(np.float32)
                             for k, s in tensor_shapes(vc).items()})
    pixels = rng.standard_normal((1, 3, args.image_size, args.image_size)).astype(np.float32)
    t = vc.patches_per_side ** 2
    a, b = rng.random((t, HIDDEN), np.float32), rng.random((HIDDEN, INTER), np.float32)
    gemm = 2.0 * t * HIDDEN * INTER / best(lambda: a @ b, args.rounds) / 1e9
    seconds = best(lambda: tower(pixels), args.rounds)
    rate = args.layers * layer_flops(t) / seconds / 1e9
    print(f"{args.layers} layer(s) over {t} patches ({args.image_size} px): {seconds:.2f} s, {rate:.1f} GFLOP/s "
          f"({rate / gemm:.0%} of the same run's BLAS GEMM, {gemm:.1f} GFLOP/s); the {TOWER_LAYERS}-layer tower "
          f"~ {seconds / args.layers * TOWER_LAYERS:.0f} s an image")


if __name__ == "__main__":
    main()
