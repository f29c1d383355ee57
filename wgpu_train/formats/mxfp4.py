"""MXFP4 tensors (OCP microscaling FP4, as gpt-oss checkpoints store their experts): `<name>_blocks` uint8 (..., G,
16), two e2m1 values a byte (the low nibble first), and `<name>_scales` uint8 (..., G), one e8m0 exponent (bias
127) per block of 32 values; dequantised on reading, exactly, to float32 (..., G * 32), as transformers 5's
integrations/mxfp4.py dequantises them, or kept packed (a frozen expert tensor: engines/shared/quant.kept_packed),
its experts decoded one at a time where they are used."""
from __future__ import annotations

import numpy as np

from wgpu_train.errors import ModelFileError
from wgpu_train.formats.safetensors import Derived

# e2m1: sign, two exponent bits, one mantissa bit
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks (..., G, 16) uint8, scales (..., G) uint8 -> float32 (..., G * 32): each nibble's e2m1 value times
    2^(scale - 127)."""
    values = np.empty((*blocks.shape[:-1], 32), np.float32)                   # (..., G, 32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


class Mxfp4(Derived):
    """A checkpoint's MXFP4 tensor, made from its blocks and scales (views of file bytes) when it is read."""

    def __init__(self, blocks: np.ndarray, scales: np.ndarray, name: str, source: str):
        if blocks.ndim < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
            raise ModelFileError(f"{source}: MXFP4 tensor {name}: blocks {tuple(blocks.shape)} and scales "
                                 f"{tuple(scales.shape)} do not match (blocks (..., G, 16), scales (..., G))")
        self.blocks, self.scales = blocks, scales
        self.shape = (*blocks.shape[:-2], blocks.shape[-2] * 32)
        self.nbytes = blocks.nbytes + scales.nbytes

    ndim = property(lambda self: len(self.shape))
    dtype = np.dtype(np.float32)     # what it decodes to

    def values(self, dtype: str = "U8") -> np.ndarray:
        return dequantize(np.asarray(self.blocks), np.asarray(self.scales))

    def __getitem__(self, index) -> np.ndarray:
        """The decoded values of x[index] along the first axis (one expert of an (E, out, in) tensor)."""
        return dequantize(np.asarray(self.blocks[index]), np.asarray(self.scales[index]))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        values = self.values()
        return values if dtype is None else values.astype(dtype)

    def astype(self, dtype) -> np.ndarray:
        """The decoded values in dtype, as an array's astype gives them."""
        return self.values().astype(dtype)

    def in_memory(self) -> "Mxfp4":
        """This tensor with its blocks and scales copied out of the file's mapping."""
        return Mxfp4(np.array(self.blocks, np.uint8), np.array(self.scales, np.uint8), "", "")
