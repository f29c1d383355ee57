"""The SigLIP tower's patches on the host, which both engines' towers take: pixel_values unfolded into the
patch embedding's GEMM operand."""
from __future__ import annotations


def unfold_patches(pixels, patch: int):
    """pixels (N, C, H, W) -> (N, P, C*patch*patch): the non-overlapping patches, row-major over the grid, each
    flattened as the convolution's weight (out, C, kh, kw) is (a 'valid' convolution)."""
    n, c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels[:, :, :gh * patch, :gw * patch].reshape(n, c, gh, patch, gw, patch)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(n, gh * gw, c * patch * patch)
