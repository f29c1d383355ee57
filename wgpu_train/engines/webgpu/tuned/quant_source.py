"""Workgroup-tiled GEMMs with a frozen float16 / NF4 weight (shaders/gemm_quant_tiled.wgsl): the GPU-class
candidates next to gemm_quant.wgsl's register-blocked ones, for C (M, N) (+)= A (M, K) @ op(W chunk)
(+ bias), layouts "nt" (forward) and "nn" (backward) as in quant.py.

The kernel takes the same tensors and Params as the register-blocked one (quant_kernels.QProblem) (bindings "A W BIAS C!" plus
ABSMAX or STATS CODE; fields M, N, K, flags, lda, ldc, cols), and any shape, offset and pitch. Each
TileConfig is one specialisation: its sizes length private arrays, which WGSL allows only for const
expressions, so qtiled_source() rewrites the template's marked const block (with NT, the layout) and
appends gemm_quant.wgsl's format sections for the weight's format, so that both GEMMs decode a weight
with the same WGSL. cfg.vec4 is not used (A is read with scalar loads); cfg.double_buffer is, and cfg.half
(float16 arithmetic, gemm_core.wgsl, as in the float GEMM) for a float16 weight and a float16 A only.
"""
from __future__ import annotations

import re
from functools import lru_cache

from wgpu_train.engines.webgpu.device.launch import DEFAULT_LIMITS, Kernel
from wgpu_train.engines.webgpu.tuned.gemm_source import (TileConfig, core, fits, kernel_features, workgroup_bytes,
                                                            workgroup_size)

SHADER = "gemm_quant_tiled"
ENTRY = "qgemm_tiled"
FORMAT_SHADER = "gemm_quant"         # whose format sections are appended
FORMATS = ("bfloat16", "float16", "nf4", "nf4-dq")
BINDINGS = {"bfloat16": "A W BIAS C!", "float16": "A W BIAS C!", "nf4": "A W BIAS C! ABSMAX",
            "nf4-dq": "A W BIAS C! STATS CODE"}
LAYOUTS = ("nt", "nn")
# The format sections as tuned/quant.py's _source reads them: a section starts at a line beginning with
# the format mark followed by the formats it serves, and ends at the next such line or the end mark.
_FORMAT_MARK, _END_MARK = "// ---- format: ", "// ---- end of formats"
_BEGIN, _END = "// @tile-config begin", "// @tile-config end"
_DECODERS = ("fn raw8(", "fn dec4(", "alias Raw8")   # what each format must define for the template

# Each within WebGPU's default limits (16 KiB of workgroup storage, 256 invocations); BK a multiple of 8
# (whole NF4 words along k in nt), BN too (whole words along n in nn).
QTILE_CONFIGS = (
    TileConfig(64, 64, 16, 8, 4),                       # 128 invocations, 8 KiB
    TileConfig(128, 64, 16, 8, 8),                      # 128 invocations, 12 KiB
    TileConfig(32, 32, 16, 4, 4),                       # 64 invocations, 4 KiB: small products
    TileConfig(64, 64, 8, 4, 4),                        # 256 invocations, 4 KiB
    TileConfig(64, 64, 16, 8, 4, double_buffer=True),   # 128 invocations, 16 KiB
)
# Float16 arithmetic, for a float16 weight and a float16 A only (where the adapter has `shader-f16`)
QTILE_HALF_CONFIGS = (
    TileConfig(64, 64, 16, 8, 4, half=True),            # 128 invocations, 4 KiB
    TileConfig(128, 64, 16, 8, 8, half=True),           # 128 invocations, 6 KiB
)


def _check(fmt: str, cfg: TileConfig):
    if fmt not in FORMATS:
        raise ValueError(f"quantised tiled GEMM formats are {FORMATS}, not {fmt!r}")
    if cfg.bk % 8 or cfg.bn % 8:
        raise ValueError(f"{cfg.name}: the quantised tiled GEMM needs BK and BN multiples of 8 (whole 8-weight groups)")
    if cfg.half and fmt != "float16":
        raise ValueError(f"{cfg.name}: float16 arithmetic takes a float16 weight, not {fmt} (converting it would "
                         "round it)")


@lru_cache(maxsize=None)
def format_sections(fmt: str) -> str:
    """The text of gemm_quant.wgsl's format sections that serve fmt (the weight bindings and decoders),
    in file order."""
    from wgpu_train.engines.webgpu.device.runtime import shader_path

    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}")
    out, section = [], None
    for line in shader_path(FORMAT_SHADER).read_text().split("\n"):
        if line.startswith(_FORMAT_MARK):
            section = {w for w in line[len(_FORMAT_MARK):].split() if not w.startswith("-")}
        elif line.startswith(_END_MARK):
            section = None
        if section is not None and fmt in section:
            out.append(line)
    text = "\n".join(out)
    missing = [d for d in _DECODERS if d not in text]
    if missing:
        raise ValueError(f"{FORMAT_SHADER}.wgsl: the {fmt} sections lack {', '.join(missing)}")
    return text


@lru_cache(maxsize=1)
def _template() -> str:
    from wgpu_train.engines.webgpu.device.runtime import shader_text

    return shader_text(SHADER)        # with gemm_core.wgsl and gemm_quant_store.wgsl appended


@lru_cache(maxsize=None)
def qtiled_source(fmt: str, cfg: TileConfig, nt: bool) -> str:
    """gemm_quant_tiled.wgsl specialised for cfg and the layout (nt: op(W) = W^T), with gemm_quant.wgsl's
    sections for fmt appended (the template's lines keep their numbers)."""
    _check(fmt, cfg)
    src = _template()
    start, end = src.index(_BEGIN), src.index(_END)
    block = src[start:end]
    values = {"BM": f"{cfg.bm}u", "BN": f"{cfg.bn}u", "BK": f"{cfg.bk}u", "TM": f"{cfg.tm}u", "TN": f"{cfg.tn}u",
              "NBUF": "2u" if cfg.double_buffer else "1u", "NT": "true" if nt else "false"}
    for name, value in values.items():
        block, n = re.subn(rf"(const {name}: \w+ = )\w+;", rf"\g<1>{value};", block)
        if n != 1:
            raise ValueError(f"{SHADER}.wgsl: expected one 'const {name}' in the tile-config block")
    return core(src[:start] + block + src[end:], cfg.half) + "\n" + format_sections(fmt) + "\n"


def qtiled_kernel(fmt: str, cfg: TileConfig, nt: bool) -> Kernel:
    """The kernel for weights stored as fmt, tile cfg and layout nt (True: "nt", False: "nn")."""
    _check(fmt, cfg)
    return Kernel(SHADER, ENTRY, BINDINGS[fmt], source=(qtiled_source, fmt, cfg, bool(nt)),
                  invocations=workgroup_size(cfg), workgroup_bytes=workgroup_bytes(cfg), features=kernel_features(cfg))


def qtiled_groups(cfg: TileConfig, M: int, N: int) -> tuple:
    """Workgroups (x, y, 1) = (column tiles, row tiles, 1)."""
    return (-(-int(N) // cfg.bn), -(-int(M) // cfg.bm), 1)


def qtiled_applies(cfg: TileConfig, fmt: str, layout: str, M: int, N: int, K: int, lda: int = 0, a_off: int = 0,
                   limits: dict | None = None, features=()) -> bool:
    """Whether cfg can run this product on an adapter with these limits (wgpu's names; missing ones default
    to WebGPU's): the kernel takes any shape, offset and pitch, so only the workgroup limits and the grid
    size matter (lda and a_off are accepted for the autotuner's uniform call and do not restrict); a float16-
    arithmetic cfg needs a float16 weight and "shader-f16" among the features (its A's format: the caller's)."""
    if fmt not in FORMATS or layout not in LAYOUTS or cfg.bk % 8 or cfg.bn % 8 or min(M, N, K) < 1:
        return False
    if cfg.half and fmt != "float16":
        return False
    lim = {**DEFAULT_LIMITS, **(limits or {})}
    max_groups = lim.get("max-compute-workgroups-per-dimension", 65535)
    return fits(cfg, lim, features) and max(qtiled_groups(cfg, M, N)) <= max_groups
