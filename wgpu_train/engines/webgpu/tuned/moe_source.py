"""The grouped-expert GEMMs' source builders: the portable scalar kernel (shaders/moe_gemm.wgsl: its register block
of RM sorted rows x RN columns per invocation, the swiglu form and the LoRA term, each a parameter; the loops over
the block's rows and columns unrolled here, so the accumulators stay in registers) and the grouped forms of the
dense GEMM family's kernels (gemm_source.py's pieces): the register-blocked one (shaders/moe_gemm_register.wgsl, with
or without subgroups). Both take packed experts (NF4 or MXFP4: shaders/moe_nf4.wgsl's or moe_mxfp4.wgsl's decoder in
place of W's tensor markers) as a parameter."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.shaders import shader_text
from wgpu_train.engines.webgpu.tuned.gemm_source import blank

WG = 64                   # invocations per workgroup, along the columns


@dataclass(frozen=True)
class GemmConfig:
    """RM sorted rows (one expert's) x RN columns per invocation; a workgroup covers RM rows x 64 * RN columns."""

    rm: int
    rn: int

    @property
    def name(self) -> str:
        return f"r{self.rm}x{self.rn}"


LORA_DECL = """@group(0) @binding(6) var<storage, read> hl: array<f32>;        // (N k, r) LoRA A products
@group(0) @binding(7) var<storage, read> lb: array<f32>;        // L, E stacked"""
LORA_MARK = "// @lora: hl (N k, r) f32 and L (E stacked) f32 at bindings 6 and 7"
SWIGLU_MARK = "// @swiglu: h (N k, I) f32 at binding 8"
SWIGLU_DECL = "@group(0) @binding(8) var<storage, read_write> h: array<f32>;   // (N k, I) pair order"


def _column(j: int, pairs: bool) -> int:
    """Column j's offset from the invocation's first: j WG apart, or in pairs (2 WG apart, then the next one)."""
    return (j // 2) * 2 * WG + j % 2 if pairs else j * WG


def _body(rm: int, rn: int, swiglu: bool, lora: bool, pairs: bool = False) -> str:
    """The kernel's body after the expert's block is found: loads, the reduction, the LoRA term, the stores (by
    pairs of adjacent columns where `pairs`: a 16-bit dst; rn even)."""
    heads = ["g"] + (["u"] if swiglu else [])       # the accumulator sets: gate (or the only one), up
    lines = []
    for i in range(rm):
        lines.append(f"    let q{i} = perm[P.o5 + min(row0 + {i}u, row1)];")
        lines.append(f"    let x{i} = P.o2 + select(q{i}, q{i} / P.slots, P.by_token != 0u) * P.in_f;")
    for j in range(rn):
        lines.append(f"    let col{j} = min(c0 + {_column(j, pairs)}u, P.cols - 1u);")
        lines.append(f"    let w{j} = wb + col{j} * P.w_o;")
        if swiglu:
            lines.append(f"    let v{j} = wb + (col{j} + P.cols) * P.w_o;")
    lines += [f"    var {h}{i}_{j} = 0.0;" for h in heads for i in range(rm) for j in range(rn)]
    lines.append("    for (var k = 0u; k < P.in_f; k = k + 1u) {")
    lines += [f"        let a{i} = x_ld(x{i} + k);" for i in range(rm)]
    for j in range(rn):
        lines.append(f"        let b{j} = w_ld(w{j} + k * P.w_i);")
        if swiglu:
            lines.append(f"        let d{j} = w_ld(v{j} + k * P.w_i);")
    for i in range(rm):
        for j in range(rn):
            lines.append(f"        g{i}_{j} = fma(a{i}, b{j}, g{i}_{j});")
            if swiglu:
                lines.append(f"        u{i}_{j} = fma(a{i}, d{j}, u{i}_{j});")
    lines.append("    }")
    if lora:
        lines.append("    let lbase = e * P.l_e;")
        lines.append("    for (var t = 0u; t < P.rank; t = t + 1u) {")
        lines += [f"        let s{i} = P.scale * hl[P.o6 + q{i} * P.rank + t];" for i in range(rm)]
        for j in range(rn):
            lines.append(f"        let l{j} = lb[P.o7 + lbase + col{j} * P.l_o + t * P.l_j];")
            if swiglu:
                lines.append(f"        let m{j} = lb[P.o7 + lbase + (col{j} + P.cols) * P.l_o + t * P.l_j];")
        for i in range(rm):
            for j in range(rn):
                lines.append(f"        g{i}_{j} = fma(s{i}, l{j}, g{i}_{j});")
                if swiglu:
                    lines.append(f"        u{i}_{j} = fma(s{i}, m{j}, u{i}_{j});")
        lines.append("    }")
    for i in range(rm):
        for j in range(0, rn, 2 if pairs else 1):
            lines.append(f"    if (row0 + {i}u <= row1 && c0 + {_column(j, pairs)}u < P.cols) {{")
            at = f"P.o1 + q{i} * P.out_f + col{j}"
            for acc, up in (("g", ""), ("u", " + P.cols"))[:2 if swiglu else 1]:
                if pairs:
                    lines.append(f"        dst_st2({at}{up}, vec2<f32>({acc}{i}_{j}, {acc}{i}_{j + 1}));")
                else:
                    lines.append(f"        dst_st({at}{up}, {acc}{i}_{j});")
            if swiglu:
                for jj in (j, j + 1) if pairs else (j,):
                    lines.append(f"        h[P.o8 + q{i} * P.cols + col{jj}] = silu_up(g{i}_{jj}, u{i}_{jj});")
            lines.append("    }")
    return "\n".join(lines)


PACKED_SHADERS = {"nf4": "moe_nf4", "mxfp4": "moe_mxfp4"}     # a packed W's format -> its decoder


def _packed_weights(text: str, packed: str) -> str:
    """text with W's tensor markers (binding 3) replaced by the declaration and accessors of the packed format's
    decoder (PACKED_SHADERS); text itself where `packed` is ""."""
    if not packed:
        return text
    text = re.sub(r"^[ \t]*// @tensor4 3 w read[ \t]*\n", "", text, flags=re.M)
    return re.sub(r"^[ \t]*// @tensor 3 w read[ \t]*$", lambda m: shader_text(PACKED_SHADERS[packed]), text,
                  count=1, flags=re.M)


def gemm_source(rm: int, rn: int, swiglu: bool, lora: bool, pairs: bool = False, packed: str = "") -> str:
    """shaders/moe_gemm.wgsl for a register block of rm x rn, in its swiglu or plain form, with or without the
    LoRA term, its output stored by pairs of columns where `pairs` (a 16-bit dst: rn even), W packed as `packed`
    ("nf4", "mxfp4"; "": a storage format) (a Kernel's source: launch expands its other tensor markers for dst's,
    x's and W's storage formats)."""
    text = _packed_weights(shader_text("moe_gemm"), packed)
    text = text.replace("// @body", _body(rm, rn, swiglu, lora, pairs))
    text = text.replace(LORA_MARK, LORA_DECL if lora else "")
    text = text.replace(SWIGLU_MARK, SWIGLU_DECL if swiglu else "")
    return f"const RM: u32 = {rm}u;\nconst RN: u32 = {rn}u;\nconst LANE: u32 = {2 if pairs else 1}u;\n" + text


REGISTER_SHADER = "moe_gemm_register"
_PORTABLE, _SUBGROUPS = ("// @portable begin", "// @portable end"), ("// @subgroups begin", "// @subgroups end")


@lru_cache(maxsize=None)
def register_source(subgroups: bool, formats: tuple = (), packed: str = "") -> str:
    """shaders/moe_gemm_register.wgsl (gemm_register.wgsl appended) with its subgroup or its portable entry point
    kept (naga rejects a module using a subgroup builtin on an adapter without the feature), its vec4 views of dst,
    x and W declared for the 16-bit tensors' (binding, format) pairs `formats` (storage.views), W packed as
    `packed` ("nf4", "mxfp4"; "": a storage format)."""
    text = blank(shader_text(REGISTER_SHADER), *(_PORTABLE if subgroups else _SUBGROUPS))
    return storage.views(_packed_weights(text, packed), formats)
