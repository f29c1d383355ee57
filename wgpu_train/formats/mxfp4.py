"""MXFP4 tensors (OCP microscaling FP4, as gpt-oss checkpoints store their experts): `<name>_blocks` uint8 (..., G,
16), two e2m1 values a byte (the low nibble first), and `<name>_scales` uint8 (..., G), one e8m0 exponent (bias
127) per block of 32 values; dequantised on reading, exactly, to float32 (..., G * 32), as transformers 5's
integrations/mxfp4.py dequantises them, or kept packed (a frozen expert tensor: engines/shared/quant.kept_packed),
its experts decoded one at a time where they are used; and quantize, the OCP MX v1.0 quantiser (--base-dtype mxfp4)."""
from __future__ import annotations

import numpy as np

from wgpu_train.errors import ConfigError, ModelFileError
from wgpu_train.formats.safetensors import Derived

# e2m1: sign, two exponent bits, one mantissa bit
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
BLOCK = 32                  # values per shared scale
E2M1_EMAX = 2               # the exponent of e2m1's largest normal value (6 = 1.5 * 2^2)
# the midpoints between consecutive e2m1 magnitudes (codes 0..7); a value on one rounds to the even code
_MIDPOINTS = (FP4_VALUES[:7] + FP4_VALUES[1:8]) / 2
QUANT_CHUNK = 1 << 16       # blocks quantize converts at a time (2M values: 8 MiB of float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks (..., G, 16) uint8, scales (..., G) uint8 -> float32 (..., G * 32): each nibble's e2m1 value times
    2^(scale - 127)."""
    values = np.empty((*blocks.shape[:-1], 32), np.float32)                   # (..., G, 32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


def quantize(values: np.ndarray, name: str = "a tensor") -> tuple[np.ndarray, np.ndarray]:
    """values (..., K) float, K a multiple of 32 -> (blocks (..., K / 32, 16) uint8, scales (..., K / 32) uint8), as
    the OCP MX v1.0 spec (section 6.3) converts: per block of 32, the shared scale 2^X with X = floor(log2(amax)) - 2
    (e2m1's largest exponent), clamped to e8m0's [-127, 127] (a zero block: X = 0, scale byte 127), each value / 2^X
    rounded to the nearest e2m1 (ties to the even code), saturating at +-6; the sign kept (-0 for a negative value
    that rounds to 0). (triton_kernels, which transformers quantises with, rounds X up to ceil(log2(amax / 6))
    instead, so that nothing saturates.) ConfigError naming `name` when K is no multiple of 32 or a value is not
    finite. Converted QUANT_CHUNK blocks at a time, so a large expert tensor needs little scratch."""
    values = np.asarray(values)
    if values.ndim < 1 or values.shape[-1] % BLOCK:
        raise ConfigError(f"{name} {tuple(values.shape)}: MXFP4 quantises rows in blocks of {BLOCK} values; its last "
                          f"dimension is no multiple of {BLOCK}")
    x = values.reshape(-1, BLOCK)                                                         # (n_blocks, 32)
    blocks, scales = np.empty((x.shape[0], BLOCK // 2), np.uint8), np.empty(x.shape[0], np.uint8)
    for b0 in range(0, x.shape[0], QUANT_CHUNK):
        blocks[b0:b0 + QUANT_CHUNK], scales[b0:b0 + QUANT_CHUNK] = _quantize_blocks(
            x[b0:b0 + QUANT_CHUNK].astype(np.float32), name)
    return blocks.reshape(*values.shape[:-1], -1, BLOCK // 2), scales.reshape(*values.shape[:-1], -1)


def _quantize_blocks(x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """quantize's conversion of (n, 32) float32 values -> (blocks (n, 16), scales (n,))."""
    if not np.all(np.isfinite(x)):
        raise ConfigError(f"{name} has non-finite values, which MXFP4 cannot store")
    amax = np.max(np.abs(x), axis=1)                                                      # (n,)
    exponent = np.frexp(amax)[1] - 1 - E2M1_EMAX             # floor(log2(amax)) - 2, exact (frexp: m in [0.5, 1))
    exponent = np.where(amax > 0, np.clip(exponent, -127, 127), 0).astype(np.int32)
    # exact: a power of two, the block's amax then in [4, 8) (or below, clamped), the rest at worst subnormal (< 0.25)
    scaled = np.abs(np.ldexp(x, -exponent[:, None]))                                      # (n, 32) float32
    code = np.zeros(x.shape, np.uint8)
    for threshold, even_above in zip(_MIDPOINTS, (False, True) * 4):
        # a value on the midpoint between codes i and i + 1 goes to the even one: up when i is odd
        code += (scaled >= threshold) if even_above else (scaled > threshold)
    code |= np.signbit(x).view(np.uint8) << 3
    return code[:, 0::2] | (code[:, 1::2] << 4), (exponent + 127).astype(np.uint8)        # the low nibble first


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
