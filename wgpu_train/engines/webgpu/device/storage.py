"""Storage formats of tensors on the GPU: float32, or bfloat16 / float16 packed two to a 32-bit word, and the WGSL
accessors through which a kernel reads and writes a tensor whatever its format.

A buffer's format is set once, when the engine allocates it (set_format), and every dispatch that binds it gets
the kernel's variant for it: launch() specialises the kernel by its tensors' formats (Kernel.formats), and the
kernel's source declares each such tensor by a marker line instead of a `var<storage>` declaration:

    // @tensor <binding> <name> <read|read_write>

which expand() turns into the binding's declaration and its accessors, for element indices i (offsets included):

    <name>_ld(i) -> f32                 one element
    <name>_ld2(i) -> vec2<f32>          elements i, i + 1 (i even)
    <name>_st2(i, v: vec2<f32>)         elements i, i + 1 (i even)
    <name>_st(i, v: f32)                one element; in a 16-bit format a read-modify-write of its word, so only
                                        where no other invocation of the dispatch writes that word's other half
                                        (an odd tail)

A kernel that reads or writes a tensor by vec4s declares a view of it, `// @tensor4 <binding> <name> <access>`,
which a source builder turns into declarations for the formats its kernel is built for (views()): <name>4, the
binding as array<vec4<f32>> (float32) or array<vec2<u32>> (16-bit: a vec4 is two words), with <name>_ld4(i) and,
when writable, <name>_st4(i, v) at element indices i that are multiples of 4.

A 16-bit tensor is written by pairs: two halves of one word must be written by one invocation (WebGPU has no
16-bit stores without shader-f16, and two invocations writing halves of one word would race), so a kernel that
takes 16-bit outputs stores pairs with _st2, at even element indices, and the engine gives 16-bit tensors even
widths and even offsets (models/config.py refuses 16-bit precisions for a model with an odd width). A 16-bit value is rounded to nearest, ties to even, from float32 by the kernel itself
(WGSL leaves pack2x16float's rounding and its out-of-range results unspecified): f16 values past its range become
inf, as torch and NumPy round them, which the f16 loss scaler then catches. Arithmetic stays float32.
"""
from __future__ import annotations

import re

import numpy as np

FORMATS = ("f32", "bf16", "f16")
ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2}
MARKER = re.compile(r"^[ \t]*// @tensor[ \t]+(\d+)[ \t]+(\w+)[ \t]+(read_write|read)[ \t]*$", re.M)
VIEW = re.compile(r"^[ \t]*// @tensor4[ \t]+(\d+)[ \t]+(\w+)[ \t]+(read_write|read)[ \t]*$", re.M)
_ATTRIBUTE = "wgpu_train_format"

# float32 -> 16-bit rounding and packing, shared by every kernel that stores 16-bit tensors
_ROUNDING = """
// float32 -> bfloat16 bits, round to nearest, ties to even; NaN stays NaN (quietened), overflow becomes inf
fn bf16_bits(v: f32) -> u32 {
    let u = bitcast<u32>(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) { return (u >> 16u) | 0x40u; }
    return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}

fn bf16_unpack2(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}

// float32 -> float16 bits, round to nearest, ties to even: subnormals kept, values from 65520 on become inf,
// NaN stays NaN
fn f16_bits(v: f32) -> u32 {
    let u = bitcast<u32>(v);
    let sign = (u >> 16u) & 0x8000u;
    let a = u & 0x7fffffffu;
    if (a > 0x7f800000u) { return sign | 0x7e00u; }
    if (a >= 0x477ff000u) { return sign | 0x7c00u; }
    if (a >= 0x38800000u) { return sign | ((a + 0xfffu + ((a >> 13u) & 1u) - 0x38000000u) >> 13u); }
    // below float16's smallest normal: a multiple of 2^-24, rounded half to even by round()
    return sign | u32(round(bitcast<f32>(a) * 16777216.0));
}

fn f16_unpack2(w: u32) -> vec2<f32> {
    return unpack2x16float(w);
}
"""


def set_format(buf, fmt: str):
    """Mark a buffer as holding a tensor in format fmt (its size is the engine's business: element_bytes)."""
    if fmt not in FORMATS:
        raise ValueError(f"storage format must be one of {FORMATS}, got {fmt!r}")
    setattr(buf, _ATTRIBUTE, fmt)
    return buf


def format_of(buf) -> str:
    """The storage format of a buffer (f32 unless set_format said otherwise)."""
    return getattr(buf, _ATTRIBUTE, "f32")


def nbytes(n: int, fmt: str) -> int:
    """Bytes of n elements in format fmt, rounded up to whole 32-bit words."""
    return -(-int(n) * ELEMENT_BYTES[fmt] // 4) * 4


def markers(text: str) -> dict:
    """{binding: (name, access)} of a source's tensor markers."""
    return {int(b): (name, access) for b, name, access in MARKER.findall(text)}


def _accessors(name: str, fmt: str, writable: bool) -> str:
    if fmt == "f32":
        lines = [f"fn {name}_ld(i: u32) -> f32 {{ return {name}[i]; }}",
                 f"fn {name}_ld2(i: u32) -> vec2<f32> {{ return vec2<f32>({name}[i], {name}[i + 1u]); }}"]
        if writable:
            lines += [f"fn {name}_st(i: u32, v: f32) {{ {name}[i] = v; }}",
                      f"fn {name}_st2(i: u32, v: vec2<f32>) {{ {name}[i] = v.x; {name}[i + 1u] = v.y; }}"]
        return "\n".join(lines)
    kind = fmt      # bf16 / f16: word i >> 1 holds elements i & ~1 (low half) and i | 1 (high half)
    # one element: its half of the word alone (an unpack of both halves costs the compilers of CPU adapters)
    one = ("bitcast<f32>(select(w << 16u, w & 0xffff0000u, (i & 1u) == 1u))" if kind == "bf16"
           else "unpack2x16float(w >> ((i & 1u) * 16u)).x")
    lines = [f"fn {name}_ld2(i: u32) -> vec2<f32> {{ return {kind}_unpack2({name}[i >> 1u]); }}",
             f"fn {name}_ld(i: u32) -> f32 {{ let w = {name}[i >> 1u]; return {one}; }}"]
    if writable:
        lines += [f"fn {name}_st2(i: u32, v: vec2<f32>) {{ {name}[i >> 1u] = {kind}_bits(v.x) | "
                  f"({kind}_bits(v.y) << 16u); }}",
                  f"fn {name}_st(i: u32, v: f32) {{ let w = {name}[i >> 1u]; let h = {kind}_bits(v); "
                  f"{name}[i >> 1u] = select((w & 0xffff0000u) | h, (w & 0xffffu) | (h << 16u), (i & 1u) == 1u); }}"]
    return "\n".join(lines)


def expand(text: str, formats: dict) -> str:
    """text with each tensor marker replaced by its binding's declaration and accessors, in the format
    formats[binding] (f32 where absent), and the rounding functions appended where a 16-bit format is used.
    A format given for a binding the source declares by no marker is a bug: ValueError."""
    found = markers(text)
    stray = sorted(b for b, fmt in formats.items() if fmt != "f32" and b not in found)
    if stray:
        raise ValueError(f"16-bit tensors at bindings {stray}, which the kernel does not declare by a tensor "
                         f"marker (it has no 16-bit variant for them)")
    if not found:
        return text

    def declare(m):
        binding, name, access = int(m.group(1)), m.group(2), m.group(3)
        fmt = formats.get(binding, "f32")
        if fmt not in FORMATS:
            raise ValueError(f"binding {binding}: storage format must be one of {FORMATS}, got {fmt!r}")
        element = "f32" if fmt == "f32" else "u32"
        return (f"@group(0) @binding({binding}) var<storage, {access}> {name}: array<{element}>;\n"
                + _accessors(name, fmt, access == "read_write"))

    out = MARKER.sub(declare, text)
    if any(formats.get(b, "f32") != "f32" for b in found):
        out += "\n" + _ROUNDING
    return out


def _view(binding: int, name: str, access: str, fmt: str) -> list[str]:
    """The declaration and accessors of one vec4 view (see the module docstring)."""
    lines = [f"@group(0) @binding({binding}) var<storage, {access}> {name}4: "
             f"array<{'vec4<f32>' if fmt == 'f32' else 'vec2<u32>'}>;"]
    if fmt == "f32":
        lines.append(f"fn {name}_ld4(i: u32) -> vec4<f32> {{ return {name}4[i >> 2u]; }}")
        if access == "read_write":
            lines.append(f"fn {name}_st4(i: u32, v: vec4<f32>) {{ {name}4[i >> 2u] = v; }}")
        return lines
    lines.append(f"fn {name}_ld4(i: u32) -> vec4<f32> {{ let w = {name}4[i >> 2u]; "
                 f"return vec4<f32>({fmt}_unpack2(w.x), {fmt}_unpack2(w.y)); }}")
    if access == "read_write":
        lines.append(f"fn {name}_st4(i: u32, v: vec4<f32>) {{ {name}4[i >> 2u] = vec2<u32>({fmt}_bits(v.x) | "
                     f"({fmt}_bits(v.y) << 16u), {fmt}_bits(v.z) | ({fmt}_bits(v.w) << 16u)); }}")
    return lines


def views(text: str, formats=None) -> str:
    """text with the vec4 views its `// @tensor4` markers ask for, in formats (sorted (binding, format) pairs of
    its 16-bit tensors, launch.Kernel.formats'), appended on its last line (the markers stay as comments, so line
    numbers stay the file's). formats None: everything float32, the tensors' own declarations (their markers'
    expansion) appended too, for compiling the text as it is; otherwise launch expands those markers for the
    same formats."""
    fmt = dict(formats or ())
    lines = [line for m in VIEW.finditer(text)
             for line in _view(int(m.group(1)), m.group(2), m.group(3), fmt.get(int(m.group(1)), "f32"))]
    if formats is None:
        lines += [line for m in MARKER.finditer(text) for line in expand(m.group(0), {}).split("\n")]
    return text + " ".join(lines)


# ---- host side: the same rounding and packing, for uploads, readbacks and tests ------------------------------

def to_words(values: np.ndarray, fmt: str) -> np.ndarray:
    """float32 values as the bytes of format fmt (uint32 words for 16-bit formats, zero-padded to whole words),
    rounded as the kernels round."""
    from wgpu_train.engines.shared.quant import bfloat16_bits
    v = np.ascontiguousarray(values, np.float32).reshape(-1)
    if fmt == "f32":
        return v
    with np.errstate(over="ignore"):
        half = bfloat16_bits(v) if fmt == "bf16" else v.astype(np.float16).view(np.uint16)
    if half.size % 2:
        half = np.concatenate([half, np.zeros(1, np.uint16)])
    return half.view(np.uint32)


def rounded(values: np.ndarray, fmt: str) -> np.ndarray:
    """float32 values as a tensor of format fmt holds them (flattened)."""
    return from_words(to_words(values, fmt), np.size(values), fmt)


def from_words(words: np.ndarray, n: int, fmt: str) -> np.ndarray:
    """n float32 values from the bytes of format fmt (to_words' inverse)."""
    raw = np.ascontiguousarray(words)
    if fmt == "f32":
        return raw.view(np.float32).reshape(-1)[:n]
    half = raw.view(np.uint16).reshape(-1)[:n]
    if fmt == "bf16":
        return (half.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return half.view(np.float16).astype(np.float32)


def upload(rt, values: np.ndarray, fmt: str, label: str = ""):
    """A new buffer holding float32 `values` in format fmt (rounded as the kernels round), marked with it."""
    return set_format(rt.upload(to_words(values, fmt), label), fmt)


def read(rt, t, n: int) -> np.ndarray:
    """n float32 values of tensor t (a buffer or a (buffer, element offset) view), whatever its buffer's format."""
    from wgpu_train.engines.webgpu.device.operands import split
    buf, off = split(t)
    fmt = format_of(buf)
    size = ELEMENT_BYTES[fmt]
    start = off * size // 4 * 4                       # the word holding the first element
    words = np.frombuffer(rt.read_bytes(buf, start, nbytes(off + n, fmt) - start), np.uint32)
    return from_words(words, off - start // size + n, fmt)[off - start // size:]
