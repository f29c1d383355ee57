"""Configurations and source specialisation of the workgroup-tiled GEMM (shaders/gemm_tiled.wgsl).

Each TileConfig is one candidate kernel for the autotuner. The tile sizes also size private (register)
arrays, whose lengths WGSL requires to be const expressions (override constants are rejected there), so
tiled_source() rewrites the marked const block of the .wgsl text in place (line numbers stay those of the
file); cfg.vec4 chooses the entry point (entry_point()). The uniform is PARAMS_FIELDS packed with
PARAMS_FORMAT.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from .runtime import shader_path

SHADER = "gemm_tiled"
REDUCE_ENTRY = "gemm_splitk_reduce"
REDUCE_WG = 256
PARAMS_FIELDS = ("M", "N", "K", "flags", "o1", "a_sm", "a_sk", "a_sz", "o2", "b_sk", "b_sn", "b_sz",
                 "o4", "c_sm", "c_sn", "c_sz", "o3", "bias_sm", "bias_sn", "alpha",
                 "k_split", "splits", "batch", "pad0")
PARAMS_FORMAT = "<19If4I"     # every field 4 bytes; alpha the only f32
FLAG_ACCUMULATE = 1
FLAG_BIAS = 2
# WebGPU's default limits, for a limits dict that lacks a key
DEFAULT_LIMITS = {"max-compute-workgroup-storage-size": 16384, "max-compute-invocations-per-workgroup": 256,
                  "max-compute-workgroup-size-x": 256}
_BEGIN, _END = "// @tile-config begin", "// @tile-config end"


@dataclass(frozen=True)
class TileConfig:
    """A BM x BN tile of C per workgroup, BK steps of k per staged tile, TM x TN outputs per invocation."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int
    vec4: bool = False            # vec4 global loads (gemm_tiled_v4; see vec4_ok)
    double_buffer: bool = False   # two sets of tiles, one barrier per step

    def __post_init__(self):
        if self.tm % 4 or self.tn % 4 or self.bk % 4 or self.bm % self.tm or self.bn % self.tn:
            raise ValueError(f"{self.name}: TM, TN and BK must be multiples of 4 dividing BM, BN")

    @property
    def name(self) -> str:
        return (f"t{self.bm}x{self.bn}x{self.bk}_{self.tm}x{self.tn}" + ("_v4" if self.vec4 else "")
                + ("_db" if self.double_buffer else ""))


def _both(bm, bn, bk, tm, tn, double_buffer=False):
    return [TileConfig(bm, bn, bk, tm, tn, v, double_buffer) for v in (False, True)]


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
)


def workgroup_size(cfg: TileConfig) -> int:
    """Invocations per workgroup (all along x)."""
    return (cfg.bm // cfg.tm) * (cfg.bn // cfg.tn)


def workgroup_bytes(cfg: TileConfig) -> int:
    """Workgroup storage: the A and B tiles, twice when double-buffered."""
    return 4 * (cfg.bm + cfg.bn) * cfg.bk * (2 if cfg.double_buffer else 1)


def fits(cfg: TileConfig, limits: dict) -> bool:
    """Whether the adapter's limits (wgpu's limit names; missing ones default to WebGPU's) allow cfg."""
    lim = {**DEFAULT_LIMITS, **(limits or {})}
    wg = workgroup_size(cfg)
    return (workgroup_bytes(cfg) <= lim["max-compute-workgroup-storage-size"]
            and wg <= lim["max-compute-invocations-per-workgroup"] and wg <= lim["max-compute-workgroup-size-x"])


def entry_point(cfg: TileConfig) -> str:
    return "gemm_tiled_v4" if cfg.vec4 else "gemm_tiled"


@lru_cache(maxsize=1)
def _template() -> str:
    return shader_path(SHADER).read_text()


def tiled_source(cfg: TileConfig) -> str:
    """The WGSL text specialised for cfg (same line count as the file)."""
    src = _template()
    start, end = src.index(_BEGIN), src.index(_END)
    block = src[start:end]
    values = {"BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk, "TM": cfg.tm, "TN": cfg.tn,
              "NBUF": 2 if cfg.double_buffer else 1}
    for name, value in values.items():
        block, n = re.subn(rf"(const {name}: u32 = )\d+u;", rf"\g<1>{value}u;", block)
        if n != 1:
            raise ValueError(f"{SHADER}.wgsl: expected one 'const {name}: u32' in the tile-config block")
    return src[:start] + block + src[end:]


def _aligned(*values) -> bool:
    return all(v % 4 == 0 for v in values)


def vec4_ok(M, N, K, batch, o1, a_sm, a_sk, a_sz, o2, b_sk, b_sn, b_sz) -> bool:
    """Whether gemm_tiled_v4 applies: op(A) contiguous along k (preferred, as the kernel decides) or m,
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
    """Workgroups (x, y, 1) of gemm_splitk_reduce: one invocation per element of C, folded into y."""
    n = _cdiv(M * N * batch, REDUCE_WG)
    gx = min(n, max_dim)
    return (gx, _cdiv(n, gx), 1)
