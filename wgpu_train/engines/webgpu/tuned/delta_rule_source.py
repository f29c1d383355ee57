"""The chunked gated delta rule's source builder (shaders/delta_rule.wgsl): the chunk C, the head dims DK and DV,
and how a scan spreads the (DK, DV) state over invocations (ScanConfig: KS invocations share one state column,
reducing its dot products through workgroup memory when KS > 1; CB columns per workgroup), each a constant of one
builder."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from wgpu_train.engines.webgpu.device.shaders import shader_text

SUM_MARK = "    // @column_sum"
# KS = 1: the column is the invocation's own, no workgroup memory and no barrier (llvmpipe's form)
PRIVATE_SUM = "    return part;"
# KS > 1: every part published, then each invocation adds the KS parts of its column in the same order
SHARED_SUM = """    red[ks * CB + col] = part;
    workgroupBarrier();
    var total = 0.0;
    for (var r = 0u; r < KS; r = r + 1u) { total = total + red[r * CB + col]; }
    workgroupBarrier();
    return total;"""
RED_DECL = "var<workgroup> red: array<f32, KS * CB>;"


@dataclass(frozen=True)
class ScanConfig:
    """KS invocations per state column (each holding ceil(DK / KS) of its rows in registers), CB columns per
    workgroup: KS = 1 is the private form (no barrier), KS > 1 the shared one (two barriers per position)."""

    ks: int
    cb: int

    @property
    def name(self) -> str:
        return f"ks{self.ks}x{self.cb}"

    @property
    def invocations(self) -> int:
        return self.ks * self.cb

    @property
    def workgroup_bytes(self) -> int:
        return 4 * self.ks * self.cb if self.ks > 1 else 0

    def rows(self, dk: int) -> int:
        """State rows per invocation."""
        return -(-dk // self.ks)


@functools.lru_cache(maxsize=None)
def source(chunk: int, dk: int, dv: int, ks: int, cb: int) -> str:
    """shaders/delta_rule.wgsl for chunk C, head dims DK x DV and the scans' KS x CB spread (a Kernel's source:
    launch expands its tensor markers for q, k, v, g, beta's storage formats)."""
    text = shader_text("delta_rule").replace(SUM_MARK, SHARED_SUM if ks > 1 else PRIVATE_SUM)
    if ks == 1:
        text = text.replace(RED_DECL, "")
    consts = dict(C=chunk, DK=dk, DV=dv, KS=ks, CB=cb, DKS=-(-dk // ks))
    return "".join(f"const {name}: u32 = {v}u;\n" for name, v in consts.items()) + text
