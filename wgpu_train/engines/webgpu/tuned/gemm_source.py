"""The GEMM family's source builders: the register-blocked kernels' (shaders/gemm.wgsl, register_source) and the
configurations and source specialisation of the workgroup-tiled GEMM (shaders/gemm_tiled.wgsl, tiled_source).

Each TileConfig is one candidate kernel for the autotuner. The tile sizes also size private (register)
arrays, whose lengths WGSL requires to be const expressions (override constants are rejected there), so
tiled_source() rewrites the marked const block of the .wgsl text in place (line numbers stay those of the
file), and keeps one of each pair of marked sections: the scalar or the vec4 global loads (cfg.vec4), and the
plain or the subgroup multiply with its entry point (cfg.subgroups; entry_point()), and the float32 or float16
core of gemm_core.wgsl (cfg.half: f16 tiles and f16 products summed over 4 steps of k, accumulated in float32;
core()). Without subgroups the module then compiles on adapters without the `subgroup` feature (naga rejects a
module using a subgroup builtin there, even in an unused entry point), and without half on those without
`shader-f16`.

Storage formats: A, B and C are tensors (device/storage.py's `// @tensor` markers, which launch expands for
the buffers' formats), read and written as vec4s through their `// @tensor4` views (storage.views, declared for
the formats a kernel is built for). The register GEMM (gemm.wgsl) uses the same views.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import DEFAULT_LIMITS
from wgpu_train.engines.webgpu.device.runtime import shader_path, shader_text

SHADER = "gemm_tiled"
REGISTER_SHADER = "gemm"
_SG_MARKER = "// ---- subgroup kernels"      # where gemm.wgsl's subgroup section begins (it runs to its end)
REDUCE_ENTRY = "gemm_splitk_reduce"
REDUCE_WG = 256
SUBGROUP_FEATURE = "subgroup"
F16_FEATURE = "shader-f16"
SG_PAD = 4                    # vec4s of padding per k row of As / Bs in the subgroup kernels (see the .wgsl)
_BEGIN, _END = "// @tile-config begin", "// @tile-config end"
# sections tiled_source() keeps or blanks: the subgroup or plain multiply and entry point, scalar or vec4 loads
_SG, _PLAIN = ("// @subgroups begin", "// @subgroups end"), ("// @plain begin", "// @plain end")
_SCALAR, _VEC4 = ("// @scalar begin", "// @scalar end"), ("// @vec4 begin", "// @vec4 end")
_CORES = {False: ("// @f32-core begin", "// @f32-core end"), True: ("// @f16-core begin", "// @f16-core end")}
_ELEM = re.compile(r"^(alias Elem = )f32;", re.M)


@dataclass(frozen=True)
class TileConfig:
    """A BM x BN tile of C per workgroup, BK steps of k per staged tile, TM x TN outputs per invocation."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int
    vec4: bool = False            # vec4 global loads (the @vec4 section; see vec4_ok)
    double_buffer: bool = False   # two sets of tiles, one barrier per step
    subgroups: bool = False       # 2 x 2 quads of lanes share fragments (gemm_tiled_sg; needs_subgroups)
    half: bool = False            # float16 tiles and arithmetic, float32 accumulation (float16 A and B only)

    def __post_init__(self):
        if self.tm % 4 or self.tn % 4 or self.bk % 4 or self.bm % self.tm or self.bn % self.tn:
            raise ValueError(f"{self.name}: TM, TN and BK must be multiples of 4 dividing BM, BN")
        if self.subgroups and ((self.bm // self.tm) % 2 or (self.bn // self.tn) % 2):
            raise ValueError(f"{self.name}: the subgroup kernel needs an even number of invocations along "
                             "m and n (BM / TM, BN / TN): it pairs them in 2 x 2 quads")
        if self.half and self.subgroups:
            raise ValueError(f"{self.name}: no subgroup kernel in float16 arithmetic (its shuffles are float32)")

    @property
    def name(self) -> str:
        return (f"t{self.bm}x{self.bn}x{self.bk}_{self.tm}x{self.tn}" + ("_v4" if self.vec4 else "")
                + ("_db" if self.double_buffer else "") + ("_sg" if self.subgroups else "")
                + ("_f16" if self.half else ""))

    def __str__(self) -> str:     # kernel labels and module names
        return self.name


def _both(bm, bn, bk, tm, tn, double_buffer=False, subgroups=False, half=False):
    return [TileConfig(bm, bn, bk, tm, tn, v, double_buffer, subgroups, half) for v in (False, True)]


# All fit WebGPU's default limits (16 KiB of workgroup storage, 256 invocations).
TILED_CONFIGS = (
    _both(64, 64, 8, 4, 4)                          # 256 invocations, 4 KiB
    + _both(64, 64, 8, 4, 4, double_buffer=True)    # 8 KiB
    + _both(64, 64, 16, 8, 4)                       # 128 invocations, 8 KiB
    + _both(128, 64, 16, 8, 8)                      # 128 invocations, 12 KiB
    + _both(128, 128, 8, 8, 8)                      # 256 invocations, 8 KiB: the classic SGEMM tile
    + _both(128, 128, 8, 8, 8, double_buffer=True)  # 16 KiB
    + _both(64, 64, 16, 8, 8)                       # 64 invocations, 8 KiB
    + _both(64, 64, 16, 8, 8, double_buffer=True)   # 16 KiB
    + _both(32, 32, 16, 4, 4)                       # 64 invocations, 4 KiB: small products
    # 2 x 2 quads share fragments through subgroup shuffles (only where the adapter has `subgroup`; fits())
    + _both(128, 128, 8, 8, 8, subgroups=True)      # 256 invocations, 9 KiB
    + _both(64, 64, 8, 4, 4, double_buffer=True, subgroups=True)   # 256 invocations, 10 KiB: 4x4 reads
    + _both(64, 64, 16, 8, 8, subgroups=True)       # 64 invocations, 10 KiB
)

# Float16 arithmetic, for float16 A and B only (where the adapter has `shader-f16`; fits()): f16 tiles take half
# the workgroup memory, so BK doubles within the same bytes.
HALF_CONFIGS = (
    _both(64, 64, 16, 8, 4, half=True)              # 128 invocations, 4 KiB
    + _both(128, 128, 16, 8, 8, half=True)          # 256 invocations, 8 KiB
    + _both(128, 128, 16, 8, 8, double_buffer=True, half=True)   # 16 KiB
)


def workgroup_size(cfg: TileConfig) -> int:
    """Invocations per workgroup (all along x)."""
    return (cfg.bm // cfg.tm) * (cfg.bn // cfg.tn)


def _pad(cfg: TileConfig) -> int:
    return SG_PAD if cfg.subgroups else 0


def element_bytes(cfg: TileConfig) -> int:
    """Bytes of one element of the tiles: 2 in float16 arithmetic, else 4."""
    return 2 if cfg.half else 4


def workgroup_bytes(cfg: TileConfig) -> int:
    """Workgroup storage: the A and B tiles (k rows padded for the subgroup kernels), twice when
    double-buffered."""
    return element_bytes(cfg) * (cfg.bm + cfg.bn + 8 * _pad(cfg)) * cfg.bk * (2 if cfg.double_buffer else 1)


def needs_subgroups(cfg: TileConfig) -> bool:
    """Whether cfg's kernel (and any module built from tiled_source(cfg)) needs the `subgroup` feature."""
    return cfg.subgroups


def kernel_features(cfg: TileConfig) -> tuple:
    """The optional WebGPU features cfg's module needs, as launch.Kernel.features takes them."""
    return ((SUBGROUP_FEATURE,) if cfg.subgroups else ()) + ((F16_FEATURE,) if cfg.half else ())


def fits(cfg: TileConfig, limits: dict, features=()) -> bool:
    """Whether the adapter's limits (wgpu's limit names; missing ones default to WebGPU's) and features
    (e.g. Runtime.features) allow cfg. A subgroup config needs "subgroup" among the features given, a half one
    "shader-f16", so a caller that passes none never gets either."""
    lim = {**DEFAULT_LIMITS, **(limits or {})}
    wg = workgroup_size(cfg)
    return (all(f in (features or ()) for f in kernel_features(cfg))
            and workgroup_bytes(cfg) <= lim["max-compute-workgroup-storage-size"]
            and wg <= lim["max-compute-invocations-per-workgroup"] and wg <= lim["max-compute-workgroup-size-x"])


def entry_point(cfg: TileConfig) -> str:
    return "gemm_tiled" + ("_sg" if cfg.subgroups else "")


def lora_entry_point(cfg: TileConfig) -> str:
    """The entry point adding the second term alpha2 * H LB^T (bindings 5 and 6; splits == 1, batch == 1)."""
    return "gemm_tiled_lora" + ("_sg" if cfg.subgroups else "")


@lru_cache(maxsize=None)
def register_source(subgroups: bool, formats: tuple = ()) -> str:
    """gemm.wgsl, without its subgroup section for devices without the feature, the files it includes appended
    (gemm_store.wgsl), its vec4 views declared for the 16-bit tensors' (binding, format) pairs `formats`
    (storage.views)."""
    own, full = shader_path(REGISTER_SHADER).read_text(), shader_text(REGISTER_SHADER)
    text = own if subgroups else own[:own.index(_SG_MARKER)]
    return storage.views(text + full[len(own):], formats)


@lru_cache(maxsize=1)
def _template() -> str:
    return shader_text(SHADER)        # with the files it includes appended: gemm_core.wgsl, gemm_store.wgsl


def blank(src: str, begin: str, end: str) -> str:
    """src with the lines from the one holding `begin` through the one holding `end` left empty (line numbers
    kept): how a source builder drops a marked section (this family's and the grouped-expert GEMMs')."""
    start = src.rindex("\n", 0, src.index(begin)) + 1
    stop = src.index("\n", src.index(end, start))
    return src[:start] + "\n" * src.count("\n", start, stop) + src[stop:]



def tile_constants(src: str, cfg: TileConfig, shader: str = SHADER) -> str:
    """A tiled template's text (shader: its name, for messages) with the constants of its marked tile-config block
    (one `const <NAME>: u32 = ...u;` line each of BM, BN, BK, TM, TN, NBUF, PAD) set for cfg, in place."""
    start, end = src.index(_BEGIN), src.index(_END)
    block = src[start:end]
    values = {"BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk, "TM": cfg.tm, "TN": cfg.tn,
              "NBUF": 2 if cfg.double_buffer else 1, "PAD": _pad(cfg)}
    for name, value in values.items():
        block, n = re.subn(rf"(const {name}: u32 = )\d+u;", rf"\g<1>{value}u;", block)
        if n != 1:
            raise ValueError(f"{shader}.wgsl: expected one 'const {name}: u32' in the tile-config block")
    return src[:start] + block + src[end:]


def core(src: str, half: bool) -> str:
    """A tiled template's text (gemm_tiled.wgsl or gemm_quant_tiled.wgsl, gemm_core.wgsl appended) with the
    lines of the float32 or (half) the float16 arithmetic kept, the other's blanked (every such section), and its
    tiles' element type set to match."""
    if half:
        src, n = _ELEM.subn(r"\g<1>f16;", src)
        if n != 1:
            raise ValueError("a tiled GEMM template must declare its tiles' element type once: alias Elem = f32;")
    begin, end = _CORES[not half]
    while begin in src:
        src = blank(src, begin, end)
    return src


def tiled_source(cfg: TileConfig, formats=None) -> str:
    """The WGSL text specialised for cfg (same line count as the file). Without cfg.subgroups the
    subgroup section is blanked, so the module compiles on any adapter (its gemm_splitk_reduce too).
    formats: the 16-bit tensors' (binding, format) pairs a launch.Kernel is built for (storage.views); None for a
    float32 module to compile as it is."""
    src = tile_constants(_template(), cfg)
    src = core(blank(src, *(_PLAIN if cfg.subgroups else _SG)), cfg.half)
    return storage.views(blank(src, *(_SCALAR if cfg.vec4 else _VEC4)), formats)


def _aligned(*values) -> bool:
    return all(v % 4 == 0 for v in values)


def vec4_ok(M, N, K, batch, o1, a_sm, a_sk, a_sz, o2, b_sk, b_sn, b_sz) -> bool:
    """Whether the vec4 loads apply: op(A) contiguous along k (preferred, as the kernel decides) or m,
    op(B) along n (preferred) or k, with that dimension's size, the other stride, the offset and (for
    batch > 1) the batch stride all multiples of 4."""
    za, zb = (a_sz, b_sz) if batch > 1 else (0, 0)
    if a_sk == 1:
        a_ok = _aligned(K, a_sm, o1, za)
    elif a_sm == 1:
        a_ok = _aligned(M, a_sk, o1, za)
    else:
        return False
    if b_sn == 1:
        b_ok = _aligned(N, b_sk, o2, zb)
    elif b_sk == 1:
        b_ok = _aligned(K, b_sn, o2, zb)
    else:
        return False
    return a_ok and b_ok


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def k_split(cfg: TileConfig, K: int, splits: int) -> int:
    """k per split for `splits` splits of K: a multiple of BK (the last split may be short or empty)."""
    return _cdiv(_cdiv(K, splits), cfg.bk) * cfg.bk


def groups(cfg: TileConfig, M: int, N: int, batch: int = 1, splits: int = 1, max_dim: int = 65535) -> tuple:
    """Workgroups (x, y, z) = (column tiles, row tiles, batch * splits) of a gemm_tiled* dispatch."""
    g = (_cdiv(N, cfg.bn), _cdiv(M, cfg.bm), batch * max(splits, 1))
    if max(g) > max_dim:
        raise ValueError(f"{cfg.name}: {g} workgroups exceed {max_dim} per dimension")
    return g


def reduce_groups(M: int, N: int, batch: int = 1, max_dim: int = 65535) -> tuple:
    """Workgroups (x, y, 1) covering M * N * batch invocations of gemm_splitk_reduce, folded into y: an (M, N)
    output takes reduce_groups(M, (N + 1) // 2, batch), one invocation per pair of columns."""
    n = _cdiv(M * N * batch, REDUCE_WG)
    gx = min(n, max_dim)
    return (gx, _cdiv(n, gx), 1)
