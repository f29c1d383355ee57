"""Packed experts on the GPU for the grouped-expert GEMMs: an MoE layer's expert tensor as NF4 (quantised here) or
MXFP4 (a checkpoint's blocks and scales as stored) in one buffer (shaders/moe_nf4.wgsl's and moe_mxfp4.wgsl's
layouts, decoded inside the GEMMs), its size, and the mark that tells its format and where its scales start."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.shared.quant import NF4_BLOCK, dequantize_absmax, nf4_dequantize, nf4_quantize
from wgpu_train.formats.mxfp4 import Mxfp4, dequantize

PACKED_ATTRIBUTE = "wgpu_train_packed"     # on a packed expert buffer: (its format, the word where its scales start)
FORMATS = ("nf4", "mxfp4")                 # the shaders' names: shaders/moe_<format>.wgsl


def packed_format(buf) -> tuple[str, int] | None:
    """(format, the word where its scales start) of a packed expert buffer (nf4_upload, mxfp4_upload); None for a
    buffer in a storage format (device/storage.py)."""
    return getattr(buf, PACKED_ATTRIBUTE, None)


def _marked(rt, words: list, fmt: str, label: str):
    buf = rt.upload(np.concatenate(words), label)
    setattr(buf, PACKED_ATTRIBUTE, (fmt, int(words[0].size)))
    return buf


def nf4_upload(rt, values: np.ndarray, double_quant: bool = False, label: str = ""):
    """An MoE layer's experts (E, out, in) as NF4 (engines/shared/quant.py's quantisation of the whole flattened
    tensor, nf4-dq with double-quantised absmax values) in one u32 buffer, shaders/moe_nf4.wgsl's layout: the
    codes (8 a word), then each block's f32 absmax as the reference dequantises it (so nf4-dq's are 4 bytes a
    block here, not 1)."""
    packed, absmax = nf4_quantize(values, double_quant=double_quant)
    words = np.ascontiguousarray(packed).view(np.uint32)
    scales = np.ascontiguousarray(dequantize_absmax(absmax), np.float32).view(np.uint32)
    return _marked(rt, [words, scales], "nf4", label)


def _padded(data: np.ndarray) -> np.ndarray:
    """uint8 bytes padded with zeros to whole u32 words, as words."""
    flat = np.ascontiguousarray(data, np.uint8).reshape(-1)
    return np.concatenate([flat, np.zeros(-flat.size % 4, np.uint8)]).view(np.uint32)


def mxfp4_upload(rt, tensor: Mxfp4, label: str = ""):
    """An MoE layer's experts (E, out, in) packed as MXFP4 (formats/mxfp4.py) in one u32 buffer, shaders/
    moe_mxfp4.wgsl's layout: the blocks' bytes as stored (element i in byte i / 2, the low nibble first), then the
    e8m0 scales, one byte per 32 elements (padded to a word)."""
    return _marked(rt, [_padded(tensor.blocks), _padded(tensor.scales)], "mxfp4", label)


def nf4_bytes(elements: int) -> int:
    """Bytes of nf4_upload's buffer for that many expert weights: 32 bytes of codes and a 4-byte absmax a block."""
    return -(-int(elements) // NF4_BLOCK) * (NF4_BLOCK // 2 + 4)


def mxfp4_bytes(elements: int) -> int:
    """Bytes of mxfp4_upload's buffer for that many expert weights (a multiple of 32): half a byte each, and a
    scale byte per 32, each part padded to a word."""
    return 4 * (-(-int(elements) // 8) + -(-int(elements) // 128))


def packed_read(rt, buf, shape) -> np.ndarray:
    """The float32 values (shape) a packed expert buffer holds, as the GEMMs decode them."""
    fmt, at = packed_format(buf)
    words = rt.read(buf, np.uint32, (buf.size // 4,))
    if fmt == "mxfp4":
        n = int(np.prod(shape))
        blocks = words[:at].view(np.uint8)[:n // 2].reshape(*shape[:-1], shape[-1] // 32, 16)
        return dequantize(blocks, words[at:].view(np.uint8)[:n // 32].reshape(*shape[:-1], shape[-1] // 32))
    return nf4_dequantize(words[:at].view(np.uint8), words[at:].view(np.float32), shape)
