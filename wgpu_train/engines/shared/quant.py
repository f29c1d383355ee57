"""Frozen base weights in bfloat16, float16 or 4-bit NF4 (QLoRA), as torch and bitsandbytes store them: round,
quantise, dequantise, and the rounding the NumPy engine applies at load so that its math equals the GPU's up to
summation order; and MXFP4 experts, a checkpoint's (gpt-oss) kept packed as stored while they are frozen, or any MoE
model's quantised to it at load (--base-dtype mxfp4: formats/mxfp4.quantize; the other weights bfloat16).

bfloat16 is the top half of a float32: stored by rounding the low half to nearest, ties to even (torch's
conversion), read back by a shift. It keeps float32's range, so any float32 weight can be stored in it.

NF4 (Dettmers et al. 2023, "QLoRA", appendix E; bitsandbytes `quantize_4bit(quant_type="nf4")`):
- the weight is flattened in row-major order and cut into blocks of 64 elements; the last block is padded
  with zeros, so blocks cross rows when the row length is not a multiple of 64;
- each block stores absmax = max |w| (float32) and, per element, the index of the NF4 code nearest to
  w * (1 / absmax) (ties at a midpoint go to the lower code, like bitsandbytes' decision tree);
- two 4-bit indices per byte, the FIRST element of each pair in the HIGH nibble (bitsandbytes:
  `packed = q[2i] << 4 | q[2i + 1]`);
- dequantised value = NF4_CODE[index] * absmax, one float32 multiply.
Double quantisation (bitsandbytes `compress_statistics=True`) stores the absmax values themselves in 8 bits:
their mean is subtracted (the offset), then they are quantised blockwise (blocks of 256) to the nearest value
of bitsandbytes' signed dynamic 8-bit map with one float32 absmax per block; absmax = code8[q] * absmax2 + offset.
The base dtype "nf4-dq" stores weights so (bitsandbytes' `bnb_4bit_use_double_quant`): ~4.13 bits per weight
instead of 4.5.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from wgpu_train.engines.protocol import NamedValue
from wgpu_train.formats.mxfp4 import Mxfp4, quantize
from wgpu_train.formats.safetensors import bfloat16_bits, bfloat16_values  # noqa: F401 - the engines take it from here


class StorageDtype(NamedValue):
    """How frozen weights are stored (--base-dtype, --embed-dtype), one value from check_dtypes on, with its
    traits. A str, so it compares with, prints, hashes and serialises as its name; AUTO is resolved by
    check_dtypes."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    NF4 = "nf4"
    NF4_DQ = "nf4-dq"          # NF4 with double-quantised absmax values
    # an MoE layer's experts as e2m1 blocks with an e8m0 scale per 32 (formats/mxfp4.py), kept so while frozen
    # (kept_packed): a checkpoint's own bytes, or, as a base dtype, quantised at load with every other weight bfloat16
    MXFP4 = "mxfp4"

    @property
    def resolved(self) -> bool:
        """Not AUTO: a storage an engine can use."""
        return self is not StorageDtype.AUTO

    @property
    def rounds(self) -> bool:
        """Stored other than as float32: rounded or quantised, so frozen (LoRA only)."""
        return self is not StorageDtype.FLOAT32

    @property
    def sixteen_bit(self) -> bool:
        return self in (StorageDtype.BFLOAT16, StorageDtype.FLOAT16)

    @property
    def nf4(self) -> bool:
        """4-bit NormalFloat blocks (QLoRA), with or without double quantisation."""
        return self in (StorageDtype.NF4, StorageDtype.NF4_DQ)

    @property
    def double_quant(self) -> bool:
        return self is StorageDtype.NF4_DQ

    @property
    def mxfp4(self) -> bool:
        return self is StorageDtype.MXFP4


BASE_DTYPES = tuple(d.value for d in StorageDtype if d is not StorageDtype.AUTO)
# auto: as the checkpoint stores its weights (config.json's torch_dtype: bfloat16 or float16, else float32), and
# float32 for full fine-tuning, which trains them
BASE_CHOICES = ("auto",) + BASE_DTYPES
CHECKPOINT_STORAGE = {"bfloat16": StorageDtype.BFLOAT16, "float16": StorageDtype.FLOAT16}
EMBED_DTYPES = ("float32", "bfloat16", "float16")
# auto: the base's own storage over a float32 or bfloat16 base, bfloat16 over an MXFP4 one (as gpt-oss's
# checkpoints store it), float16 over a float16 / NF4 one (QLoRA's 16-bit embedding)
EMBED_CHOICES = ("auto",) + EMBED_DTYPES
# an MoE layer's 3-D expert tensors (E, out, in) by the ends of their names (models/weights.expert_path)
EXPERT_TENSORS = (".experts.gate_up_proj", ".experts.down_proj")
NF4_BLOCK = 64          # weights per absmax
F16_MAX = 65504.0       # the largest finite float16
DQ_BLOCK = 256          # absmax values per second-level absmax (double quantisation)

# The 16 NF4 values as published (QLoRA appendix E, and bitsandbytes' NF4 table), in index order 0..15.
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=np.float32)
# The largest rounding error of a normalised value in [-1, 1]: half the widest gap (between 0.723 and 1).
NF4_MAX_HALF_GAP = float(np.max(np.diff(NF4_CODE.astype(np.float64))) / 2)


class DoubleQuant(NamedTuple):
    """Double-quantised absmax values: absmax[b] = code[q[b]] * absmax2[b // 256] + offset (all float32)."""

    q: np.ndarray          # (n_blocks,) uint8 indices into code
    absmax2: np.ndarray    # (ceil(n_blocks / 256),) float32
    offset: np.float32     # the mean of the absmax values
    code: np.ndarray       # (256,) float32, sorted: bitsandbytes' signed dynamic map


def _torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """float32 values of torch.linspace(start, end, steps): a float32 step, the first half counted up from
    start and the second half down from end, each value one fused multiply-add (exact in float64, then
    rounded once)."""
    i = np.arange(steps, dtype=np.float64)
    a, b = np.float32(start), np.float32(end)
    step = np.float64(np.float32((b - a) / np.float32(max(steps - 1, 1))))
    up = (np.float64(a) + step * i).astype(np.float32)
    down = (np.float64(b) - step * (steps - 1 - i)).astype(np.float32)
    return np.where(i < steps // 2, up, down)


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' `create_dynamic_map` (dynamic tree quantisation, Dettmers 2015): a decimal exponent
    10^-6 .. 10^0 with a linear fraction whose resolution grows with the exponent; plus 0 and 1; sorted.
    Equal to bitsandbytes' table bit for bit: the fractions are spaced as torch.linspace spaces them."""
    data: list = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        bounds = _torch_linspace(0.1, 1.0, items)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        scale = np.float32(10.0 ** (-(max_exponent_bits - 1) + i))
        data += list(scale * means)
        if signed:
            data += list(-scale * means)
    if additional_items > 0:
        bounds = _torch_linspace(0.1, 1.0, additional_items + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        scale = np.float32(10.0 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1))
        data += list(scale * means)
        if signed:
            data += list(-scale * means)
    data += [0.0, 1.0]
    data += [0.0] * (2 ** total_bits - len(data))
    return np.sort(np.array(data, dtype=np.float32))


def _nearest(x: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Index (uint8) of the nearest value of a sorted code of 2^k <= 256 values for each x (ties to the lower
    one): the number of midpoints below x, by a branch-free binary search (twice as fast as searchsorted)."""
    if code.size & (code.size - 1) or code.size > 256:
        raise ValueError("the code must have a power of two values, at most 256")
    mids = ((code[:-1].astype(np.float64) + code[1:]) / 2).astype(np.float32)
    table = np.append(mids, np.float32(np.inf))
    pos = np.zeros(x.shape, np.uint8)
    step = code.size // 2
    while step:
        pos += np.uint8(step) * (table[pos + np.uint8(step - 1)] < x)
        step //= 2
    return pos


def _blocks(flat: np.ndarray, block: int) -> np.ndarray:
    """(n_blocks, block) view of a flat float32 array, the last block padded with zeros."""
    pad = -flat.size % block
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, np.float32)])
    return flat.reshape(-1, block)


def _absmax_quantize(blocks: np.ndarray, code: np.ndarray):
    """Blockwise absmax quantisation of (n_blocks, block) float32 values: (indices, absmax)."""
    absmax = np.max(np.abs(blocks), axis=1)                                    # (n_blocks,)
    with np.errstate(divide="ignore"):
        inv = np.where(absmax > 0, np.float32(1) / absmax, np.float32(0)).astype(np.float32)
    return _nearest(blocks * inv[:, None], code), absmax.astype(np.float32)


def nf4_quantize(w: np.ndarray, double_quant: bool = False):
    """w (any shape) -> (packed, absmax): packed (ceil(w.size / 64) * 32,) uint8 with two codes per byte
    (first element in the high nibble), absmax (n_blocks,) float32 or a DoubleQuant."""
    flat = np.ascontiguousarray(w, dtype=np.float32).reshape(-1)
    idx, absmax = _absmax_quantize(_blocks(flat, NF4_BLOCK), NF4_CODE)
    idx = idx.reshape(-1).astype(np.uint8)
    packed = (idx[0::2] << 4) | idx[1::2]
    if not double_quant:
        return packed, absmax
    offset = np.float32(np.mean(absmax, dtype=np.float64))
    code = dynamic_map(signed=True)
    centred = (absmax - offset).astype(np.float32)
    q, absmax2 = _absmax_quantize(_blocks(centred, DQ_BLOCK), code)
    return packed, DoubleQuant(q.reshape(-1)[:absmax.size].astype(np.uint8), absmax2, offset, code)


def dequantize_absmax(absmax) -> np.ndarray:
    """The float32 absmax values of a quantised weight (plain, or rebuilt from a DoubleQuant)."""
    if isinstance(absmax, DoubleQuant):
        scale = absmax.code[absmax.q] * absmax.absmax2[np.arange(absmax.q.size) // DQ_BLOCK]
        return (scale.astype(np.float32) + absmax.offset).astype(np.float32)
    return np.asarray(absmax, dtype=np.float32)


def nf4_unpack(packed: np.ndarray) -> np.ndarray:
    """The 4-bit indices of packed bytes, in element order: (2 * packed.size,) uint8."""
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty(packed.size * 2, np.uint8)
    out[0::2] = packed >> 4
    out[1::2] = packed & 0x0F
    return out


def nf4_dequantize(packed: np.ndarray, absmax, shape) -> np.ndarray:
    """float32 weights of `shape` from nf4_quantize's (packed, absmax)."""
    n = int(np.prod(shape))
    scale = dequantize_absmax(absmax)
    idx = nf4_unpack(packed)[:n]
    return (NF4_CODE[idx] * scale[np.arange(n) // NF4_BLOCK]).astype(np.float32).reshape(shape)


def float16_values(w: np.ndarray, name: str = "a weight") -> np.ndarray:
    """w rounded to float16; ConfigError when a value lies beyond float16's range (it would become inf)."""
    from wgpu_train.errors import ConfigError

    w = np.asarray(w, dtype=np.float32)
    largest = float(np.max(np.abs(w))) if w.size else 0.0
    if not largest <= F16_MAX:
        raise ConfigError(f"{name} has values up to {largest:.6g}, beyond float16's range ({F16_MAX:g}): store it "
                          f"in another dtype (--base-dtype / --embed-dtype)")
    return w.astype(np.float16)


def round_to(w: np.ndarray, dtype: StorageDtype | str, name: str = "a weight") -> np.ndarray:
    """float32 values of w as stored in `dtype` (float32: unchanged, bfloat16 / float16: rounded, nf4 and
    nf4-dq: quantised, the latter with double-quantised absmax values); `name` labels errors."""
    dtype = StorageDtype(dtype)
    if dtype is StorageDtype.FLOAT32:
        return np.asarray(w, dtype=np.float32)
    if dtype is StorageDtype.BFLOAT16:
        return bfloat16_values(bfloat16_bits(w)).reshape(np.shape(w))
    if dtype is StorageDtype.FLOAT16:
        return float16_values(w, name).astype(np.float32)
    if dtype.nf4:
        packed, absmax = nf4_quantize(w, double_quant=dtype.double_quant)
        return nf4_dequantize(packed, absmax, np.shape(w))
    raise ValueError(f"unknown weight dtype {dtype!r}")


def is_linear_weight(name: str) -> bool:
    """Whether a Hugging Face tensor name is the weight of one of a layer's linear modules (any family's)."""
    from wgpu_train.models.config import KNOWN_LINEAR_MODULES

    return (name.startswith("model.layers.") and name.endswith(".weight")
            and name.rsplit(".", 2)[-2] in KNOWN_LINEAR_MODULES)


def storage_dtype(name: str, ndim: int, base_dtype: StorageDtype, embed_dtype: StorageDtype,
                  packed: str = "") -> StorageDtype:
    """How one tensor is stored: the linear layers' weights and an MoE layer's 3-D expert tensors (NF4 over the
    whole flattened tensor) in base_dtype, the embedding and lm_head in embed_dtype, everything else (norms,
    biases) in float32; expert tensors the checkpoint packs (packed: "mxfp4", ModelConfig.packed_experts) stay
    MXFP4 under a base_dtype that rounds (kept_packed); base_dtype mxfp4: the experts MXFP4, the linear layers'
    weights bfloat16."""
    if ndim == 2 and is_linear_weight(name):
        return StorageDtype.BFLOAT16 if StorageDtype(base_dtype).mxfp4 else base_dtype
    if ndim == 3 and ".experts." in name:
        return StorageDtype.MXFP4 if keeps_packed(packed, base_dtype) else base_dtype
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return embed_dtype
    return StorageDtype.FLOAT32


def parse_dtype(value, option: str, choices: tuple = BASE_CHOICES) -> StorageDtype:
    """value (a name or a StorageDtype) of `option` (base_dtype, embed_dtype) as a StorageDtype among choices;
    ConfigError (one line) naming them otherwise."""
    from wgpu_train.errors import ConfigError

    if isinstance(value, str) and value in choices:
        return StorageDtype(value)
    raise ConfigError(f"{option} must be one of {', '.join(choices)}, got {value!r}")


def check_dtypes(base_dtype: StorageDtype | str, embed_dtype: StorageDtype | str = "auto",
                 checkpoint_dtype: str | None = None, full: bool = False) -> tuple[StorageDtype, StorageDtype]:
    """(base_dtype, embed_dtype) parsed and resolved: base_dtype "auto" as the checkpoint stores its weights
    (`checkpoint_dtype`, ModelConfig.checkpoint_dtype: bfloat16 or float16, else float32; float32 when `full`
    fine-tuning trains them), embed_dtype "auto" the base's own over a float32 or bfloat16 base, else float16;
    ConfigError unless both are supported storage dtypes."""
    base_dtype = parse_dtype(base_dtype, "base_dtype")
    if base_dtype is StorageDtype.AUTO:
        if full:
            base_dtype = StorageDtype.FLOAT32
        elif checkpoint_dtype is None:
            raise ValueError("base_dtype auto is resolved with the checkpoint's dtype (checkpoint_dtype)")
        else:
            base_dtype = CHECKPOINT_STORAGE.get(checkpoint_dtype, StorageDtype.FLOAT32)
    embed_dtype = parse_dtype(embed_dtype, "embed_dtype", EMBED_CHOICES)
    if embed_dtype is StorageDtype.AUTO:
        embed_dtype = StorageDtype.BFLOAT16 if base_dtype.mxfp4 else base_dtype if base_dtype in (
            StorageDtype.FLOAT32, StorageDtype.BFLOAT16) else StorageDtype.FLOAT16
    return base_dtype, embed_dtype


def check_experts_dtype(base_dtype: StorageDtype | str, cfg) -> None:
    """ConfigError (one line) for base_dtype mxfp4 over a model (cfg, a ModelConfig) without MoE experts."""
    from wgpu_train.errors import ConfigError

    if StorageDtype(base_dtype).mxfp4 and cfg.moe is None:
        raise ConfigError(f"{cfg.label}: mxfp4 stores MoE experts; this model has none: use nf4")


def keeps_packed(packed: str, base_dtype: StorageDtype | str) -> bool:
    """Whether experts a checkpoint packs (packed: ModelConfig.packed_experts, "mxfp4" or "") stay packed under
    base_dtype (kept_packed: one that rounds, so frozen)."""
    return packed == "mxfp4" and StorageDtype(base_dtype).rounds


def describe_packed(packed: str, base_dtype: StorageDtype | str) -> str:
    """What becomes of experts the checkpoint packs (packed: ModelConfig.packed_experts), for a run's first lines
    after its storage dtypes: kept so while frozen, else dequantised; plain experts under base_dtype mxfp4:
    quantised to it; "" for other plain experts."""
    if not packed:
        return ("; the MoE experts quantised to MXFP4, the other linear weights bfloat16"
                if StorageDtype(base_dtype).mxfp4 else "")
    return (f"; the experts {packed.upper()} as the checkpoint stores them" if keeps_packed(packed, base_dtype)
            else f"; the experts dequantised from {packed.upper()}")


def kept_packed(weights, name: str, base_dtype: StorageDtype | str) -> Mxfp4 | None:
    """Tensor `name` of `weights` as the checkpoint packs it (a formats/mxfp4.Mxfp4: blocks and scales, out of a
    LazyWeights' stored()) where the engines keep it so: under a base_dtype that rounds (frozen, LoRA). An MXFP4
    value is exact in bfloat16 (auto's storage of gpt-oss), so the math is that of the dequantised tensor in a
    quarter of its bytes, and float16 or NF4 would only round the 4-bit values again. Under base_dtype mxfp4 a
    plain expert tensor is read and quantised (formats/mxfp4.quantize along its rows: ConfigError unless their
    length is a multiple of 32). None otherwise: float32 (full fine-tuning trains the experts) or a tensor stored
    plainly, read dequantised."""
    stored = getattr(weights, "stored", None)
    raw = stored(name) if stored is not None else None
    if isinstance(raw, Mxfp4) and keeps_packed("mxfp4", base_dtype):
        weights.bytes_read += raw.nbytes         # read as stored, not through weights[name]: counted here
        return raw
    if StorageDtype(base_dtype).mxfp4 and name.endswith(EXPERT_TENSORS):     # read once, as the engines would
        return Mxfp4(*quantize(weights[name], name), name, "--base-dtype mxfp4")
    return None


def round_weights(weights: dict, base_dtype: str = "float32", embed_dtype: str = "auto", dtype=np.float32) -> dict:
    """The weights a model computes with when stored as base_dtype / embed_dtype (arrays of dtype; an MXFP4 tensor
    kept packed, in memory, where kept_packed says: its experts decoded, to float32, as they are used)."""
    base_dtype, embed_dtype = check_dtypes(base_dtype, embed_dtype)
    out = {}
    for k in weights:
        packed = kept_packed(weights, k, base_dtype)
        if packed is not None:
            out[k] = packed.in_memory()
        else:
            v = weights[k]
            out[k] = round_to(v, storage_dtype(k, np.ndim(v), base_dtype, embed_dtype), k).astype(dtype)   # a copy
    return out
