"""The source builders of the GEMMs with a frozen bfloat16 / float16 / NF4 weight: the register-blocked kernels
(shaders/gemm_quant.wgsl, register_source) and the workgroup-tiled ones (shaders/gemm_quant_tiled.wgsl,
qtiled_source), for C (M, N) (+)= A (M, K) @ op(W chunk) (+ bias), layouts "nt" (forward) and "nn" (backward)
as in quant.py; also the 16-bit embedding gather of gemm_quant.wgsl.

Both kernels take the same tensors and Params (quant_kernels.QProblem) (bindings "A W BIAS C!" plus
ABSMAX or STATS CODE; fields M, N, K, flags, lda, ldc, cols), and any shape, offset and pitch. gemm_quant.wgsl
holds one section per weight format (its bindings and decoders); register_source blanks the other formats'
(and the subgroup kernels on devices without the feature). Each tiled TileConfig is one specialisation: its
sizes length private arrays, which WGSL allows only for const expressions, so qtiled_source() rewrites the
template's marked const block (with NT, the layout) and appends gemm_quant.wgsl's format sections for the
weight's format, so that both GEMMs decode a weight with the same WGSL. cfg.vec4 is not used (A is read with
scalar loads); cfg.double_buffer is, and cfg.half (float16 arithmetic, gemm_core.wgsl, as in the float GEMM)
for a float16 weight and a float16 A only. Line numbers of the files are kept, so shader errors point at them.
"""
from __future__ import annotations

import re
from functools import lru_cache

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import DEFAULT_LIMITS, Kernel
from wgpu_train.engines.webgpu.device.runtime import shader_path, shader_text
from wgpu_train.engines.webgpu.tuned.gemm_source import (TileConfig, core, fits, kernel_features, workgroup_bytes,
                                                            workgroup_size)

SHADER = "gemm_quant_tiled"
ENTRY = "qgemm_tiled"
REGISTER_SHADER = "gemm_quant"       # the register-blocked kernels, whose format sections the tiled ones append
FORMATS = ("bfloat16", "float16", "nf4", "nf4-dq")
HALF_FORMATS = ("bfloat16", "float16")     # 2 bytes a value, no per-block statistics
BINDINGS = {"bfloat16": "A W BIAS C!", "float16": "A W BIAS C!", "nf4": "A W BIAS C! ABSMAX",
            "nf4-dq": "A W BIAS C! STATS CODE"}
LAYOUTS = ("nt", "nn")
# A format section starts at a line beginning with the format mark followed by the formats it serves, and ends at
# the next such line or the end mark.
_FORMAT_MARK, _END_MARK = "// ---- format: ", "// ---- end of formats"
_SG_MARK, _SG_END = "// ---- subgroup kernels", "// ---- end of subgroup kernels"
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


def _sections(lines: list[str]):
    """(line, the formats of the section it lies in, or None outside the format sections) of each line."""
    section = None
    for line in lines:
        if line.startswith(_FORMAT_MARK):
            section = {w for w in line[len(_FORMAT_MARK):].split() if not w.startswith("-")}
        elif line.startswith(_END_MARK):
            section = None
        yield line, section


@lru_cache(maxsize=None)
def _register_template(fmt: str, subgroups: bool) -> str:
    out, in_sg = [], False
    for line, section in _sections(shader_text(REGISTER_SHADER).split("\n")):   # gemm_quant_store.wgsl appended
        if line.startswith(_SG_END):
            in_sg = False
        elif line.startswith(_SG_MARK):
            in_sg = True
        drop = (section is not None and fmt not in section) or (in_sg and not subgroups)
        out.append("" if drop else line)
    return "\n".join(out)


def register_source(fmt: str, subgroups: bool, formats: tuple = ()) -> str:
    """gemm_quant.wgsl with the sections of other formats and the subgroup kernels (devices without the
    feature) blanked, and A's vec4 view declared for the 16-bit tensors' (binding, format) pairs `formats`
    (storage.views)."""
    return storage.views(_register_template(fmt, bool(subgroups)), formats)


@lru_cache(maxsize=None)
def embed_gather_kernel(fmt: str) -> Kernel:
    """The embedding gather of a 16-bit vocabulary (HALF_FORMATS)."""
    return Kernel(REGISTER_SHADER, "embed_gather", "IDS W OUT!", source=(register_source, fmt, False), invocations=64)


@lru_cache(maxsize=None)
def format_sections(fmt: str) -> str:
    """The text of gemm_quant.wgsl's format sections that serve fmt (the weight bindings and decoders),
    in file order."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}")
    lines = shader_path(REGISTER_SHADER).read_text().split("\n")
    text = "\n".join(line for line, section in _sections(lines) if section is not None and fmt in section)
    missing = [d for d in _DECODERS if d not in text]
    if missing:
        raise ValueError(f"{REGISTER_SHADER}.wgsl: the {fmt} sections lack {', '.join(missing)}")
    return text


@lru_cache(maxsize=1)
def _template() -> str:
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
