"""NF4 experts on the GPU for the grouped-expert GEMMs: an MoE layer's expert tensor quantised as NF4 in one buffer
(shaders/moe_nf4.wgsl's layout, decoded inside the GEMMs), its size, and the mark that tells it from a tensor in a
storage format."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.shared.quant import NF4_BLOCK, dequantize_absmax, nf4_dequantize, nf4_quantize

NF4_ATTRIBUTE = "wgpu_train_nf4_absmax"     # on an NF4 expert buffer: the word where its absmax values start


def nf4_absmax_word(buf) -> int | None:
    """The word of an NF4 expert buffer (nf4_upload) where its absmax values start; None for a buffer in a storage
    format (device/storage.py)."""
    return getattr(buf, NF4_ATTRIBUTE, None)


def nf4_upload(rt, values: np.ndarray, double_quant: bool = False, label: str = ""):
    """An MoE layer's experts (E, out, in) as NF4 (engines/shared/quant.py's quantisation of the whole flattened
    tensor, nf4-dq with double-quantised absmax values) in one u32 buffer, shaders/moe_nf4.wgsl's layout: the
    codes (8 a word), then each block's f32 absmax as the reference dequantises it (so nf4-dq's are 4 bytes a
    block here, not 1); marked with where the absmax values start (moe_source.nf4_absmax_word)."""
    packed, absmax = nf4_quantize(values, double_quant=double_quant)
    words = np.ascontiguousarray(packed).view(np.uint32)
    scales = np.ascontiguousarray(dequantize_absmax(absmax), np.float32).view(np.uint32)
    buf = rt.upload(np.concatenate([words, scales]), label)
    setattr(buf, NF4_ATTRIBUTE, int(words.size))
    return buf


def nf4_bytes(elements: int) -> int:
    """Bytes of nf4_upload's buffer for that many expert weights: 32 bytes of codes and a 4-byte absmax a block."""
    return -(-int(elements) // NF4_BLOCK) * (NF4_BLOCK // 2 + 4)


def nf4_read(rt, buf, shape) -> np.ndarray:
    """The float32 values (shape) an NF4 expert buffer holds, as the GEMMs decode them."""
    words = rt.read(buf, np.uint32, (buf.size // 4,))
    at = nf4_absmax_word(buf)
    absmax = words[at:].view(np.float32)
    return nf4_dequantize(words[:at].view(np.uint8), absmax, shape)
