"""One kernel descriptor (Kernel) and one launch path (launch) for every WGSL kernel of the project.

The uniform ABI, the same in every shader: binding 0 is `var<uniform> ...: Params`, a struct of 4-byte
scalars (u32, i32, f32) packed in declaration order; launch() fills its fields by name and zero-fills the
rest. Bindings 1.. are the kernel's tensors, in the order Kernel.bindings names them. A tensor is a buffer
or a (buffer, element offset) view (operands.py): a buffer that fits one storage binding is bound whole,
with the element offset in the field `o<binding>`; a bigger one is bound as the aligned range that covers
the tensor (min-storage-buffer-offset-alignment), with the remainder in `o<binding>`. A kernel whose
Params has no `o<binding>` field needs that tensor to start on an aligned offset.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import struct
from dataclasses import dataclass

from wgpu_train.errors import DeviceError
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.operands import split
from wgpu_train.engines.webgpu.device.shaders import shader_text

F32 = 4
MAX_GROUPS = 65535           # WebGPU's default max-compute-workgroups-per-dimension
# WebGPU's default limits, which every adapter meets (browsers, GLES devices and many mobile drivers offer no
# more): a kernel within them runs everywhere. A kernel needing more is a tuner candidate with a twin within.
DEFAULT_LIMITS = {"max-storage-buffers-per-shader-stage": 8, "max-compute-invocations-per-workgroup": 256,
                  "max-compute-workgroup-storage-size": 16384, "max-compute-workgroup-size-x": 256,
                  "max-uniform-buffer-binding-size": 65536}
# The WGSL extension each optional feature needs enabled (`enable f16;` always; `enable subgroups;` where the
# compiler takes it: Runtime.wgsl_enables)
EXTENSIONS = {"shader-f16": "f16", "subgroup": "subgroups"}
_SCALARS = {"u32": "I", "i32": "i", "f32": "f"}


@dataclass(frozen=True)
class Kernel:
    """One compute kernel: its WGSL source and entry point, how it is specialised, its bindings and what
    the adapter must offer to run it.

    bindings: names of bindings 1.. in order, a trailing "!" marking those the kernel writes ("y! a b"), "_" a
    binding number it does not use (no tensor is given for it).
    constants: sorted (name, value) override constants. source: () for shaders/<shader>.wgsl as it is, else
    (function, *args) returning the specialised text (the function must be a module-level one).
    invocations / workgroup_bytes: per workgroup, checked against the adapter's limits; features: the
    optional WebGPU features the kernel needs ("subgroup", "shader-f16"). formats: sorted (binding, storage
    format) of its 16-bit tensors (storage.py; launch() sets them from the tensors' buffers)."""

    shader: str
    entry: str
    bindings: str
    constants: tuple = ()
    source: tuple = ()
    invocations: int = 0
    workgroup_bytes: int = 0
    features: tuple = ()
    formats: tuple = ()

    @property
    def slots(self) -> list[int]:
        """The binding numbers the tensors go to, in order."""
        return [i for i, b in enumerate(self.bindings.split(), start=1) if b != "_"]

    @property
    def names(self) -> list[str]:
        return [b.rstrip("!") for b in self.bindings.split() if b != "_"]

    @property
    def written(self) -> list[bool]:
        return [b.endswith("!") for b in self.bindings.split() if b != "_"]

    @property
    def label(self) -> str:
        spec = ",".join(f"{k}={v}" for k, v in self.constants)
        args = ",".join(map(str, self.source[1:]))
        formats = ",".join(f"{b}:{fmt}" for b, fmt in self.formats)
        return (f"{self.shader}.{self.entry}" + (f"[{args}]" if args else "") + (f"({spec})" if spec else "")
                + (f"<{formats}>" if formats else ""))

    def raw(self) -> str:
        """The shader's text, or the source builder's, as written (tensor markers unexpanded)."""
        if self.source:
            fn, *args = self.source
            return fn(*args)
        return shader_text(self.shader)

    def body(self) -> str:
        """raw() with its tensor markers expanded for this kernel's formats (storage.py)."""
        return storage.expand(self.raw(), dict(self.formats))

    def with_formats(self, formats: tuple) -> "Kernel":
        """This kernel for 16-bit tensors at some bindings (sorted (binding, format) pairs, f32 ones left out)."""
        return _with_formats(self, formats) if formats != self.formats else self

    def directives(self, body: str, enables) -> str:
        """The `enable` directives `body` lacks for this kernel's features among `enables` (the extensions the
        compiler takes a directive for)."""
        wanted = [EXTENSIONS[f] for f in self.features if f in EXTENSIONS and EXTENSIONS[f] in enables]
        return "".join(f"enable {e};\n" for e in wanted if not re.search(rf"^\s*enable\s+{e}\s*;", body, re.M))

    def text(self, enables=("f16", "subgroups")) -> str:
        """The WGSL source this kernel compiles where the compiler takes the directives of `enables`."""
        body = self.body()
        return self.directives(body, enables) + body

    @property
    def needs(self) -> dict:
        """The limits this kernel needs ({limit name: value}), of those WebGPU sets a default for."""
        return {"max-storage-buffers-per-shader-stage": len(self.slots),
                "max-compute-invocations-per-workgroup": self.invocations,
                "max-compute-workgroup-storage-size": self.workgroup_bytes}

    def over_limits(self, limits: dict) -> list[str]:
        """The limits this kernel needs more of than `limits` give (a missing limit counts as its default)."""
        return [f"{name} {need} (has {limits.get(name, DEFAULT_LIMITS[name])})" for name, need in self.needs.items()
                if need > limits.get(name, DEFAULT_LIMITS[name])]

    def supported(self, rt) -> bool:
        """Whether the adapter offers this kernel's features and limits."""
        return all(f in rt.features for f in self.features) and not self.over_limits(rt.limits)


@functools.lru_cache(maxsize=None)
def _with_formats(k: Kernel, formats: tuple) -> Kernel:
    return dataclasses.replace(k, formats=formats)


def parse_params(source: str) -> list[tuple[str, str]]:
    """(name, type) of the fields of `struct Params` in a WGSL source, in declaration order."""
    text = re.sub(r"//[^\n]*", "", source)
    m = re.search(r"struct\s+Params\s*\{([^}]*)\}", text)
    if m is None:
        return []
    fields = re.findall(r"(\w+)\s*:\s*(\w+)", m.group(1))
    for name, ty in fields:
        if ty not in _SCALARS:
            raise ValueError(f"Params.{name}: the uniform ABI takes u32, i32 and f32 fields, not {ty}")
    return fields


def params_format(fields) -> str:
    """The struct format packing Params fields [(name, type)] in declaration order."""
    return "<" + "".join(_SCALARS[ty] for _, ty in fields)


class Compiled:
    """A kernel's pipeline and uniform layout on one runtime (Runtime.compiled caches it)."""

    def __init__(self, rt, k: Kernel):
        over = k.over_limits(rt.limits)
        if over:
            raise DeviceError(f"kernel {k.label} needs more than {rt.info.name} offers: {'; '.join(over)}")
        body = k.body()
        directives = k.directives(body, rt.wgsl_enables)
        source = directives + body
        self.fields = parse_params(source)
        self.index = {name: i for i, (name, _) in enumerate(self.fields)}
        self.format = params_format(self.fields)
        self.zero = [0.0 if ty == "f32" else 0 for _, ty in self.fields]
        self.offset_field = [self.index.get(f"o{i}") for i in k.slots]
        self.n_bindings = len(k.bindings.split())
        self.slots, self.names, self.written = k.slots, k.names, k.written
        self.outputs = [j for j, w in enumerate(self.written) if w]
        name = k.shader + (f"[{','.join(map(str, k.source[1:]))}]" if k.source else "") + \
            (f"<{','.join(f'{b}:{fmt}' for b, fmt in k.formats)}>" if k.formats else "")
        # the shader file as it is (no directive added, no tensor marker expanded): cached by name
        plain = not k.source and not directives and body == k.raw()
        self.pipeline = rt.pipeline(name, k.entry, dict(k.constants), source=None if plain else source)


def bind(rt, t, n: int, what: str, whole_ok: bool):
    """(binding resource, element offset within it) of n elements of tensor t, elements of its buffer's storage
    format. whole_ok: the kernel takes an element offset, so a buffer that fits one binding is bound whole (one
    bind group for all its views)."""
    buf, off = split(t)
    size = storage.ELEMENT_BYTES[storage.format_of(buf)]
    end = storage.nbytes(off + max(1, int(n)), storage.format_of(buf))
    if off < 0 or end > buf.size:
        raise ValueError(f"{what}: needs elements [{off}, {off + n}) but its buffer holds {buf.size // size}")
    if whole_ok and buf.size <= rt.max_binding:
        return buf, off
    base = off * size // rt.offset_alignment * rt.offset_alignment
    if end - base > rt.max_binding:
        raise DeviceError(f"{what} spans {end - base} bytes, over this device's max storage binding of "
                          f"{rt.max_binding}; split it into chunks")
    return (buf, base, end - base), off - base // size


def tensor_formats(k: Kernel, tensors) -> tuple:
    """(binding, format) of the 16-bit tensors among k's (tensor, n_elements) pairs: the formats k is specialised
    for (Kernel.with_formats), which the sources with vec4 views need too (storage.views)."""
    return tuple((slot, fmt) for slot, (t, _) in zip(k.slots, tensors)
                 if (fmt := storage.format_of(split(t)[0])) != "f32")


def prepare(rt, k: Kernel, tensors, **params) -> tuple:
    """(pipeline, resources) of one dispatch of kernel k: tensors are (tensor, n_elements) pairs for bindings
    1.. in order; params set fields of its Params by name (the o<i> offsets are filled here). The kernel is
    specialised for the tensors' storage formats (storage.py)."""
    k = k.with_formats(tensor_formats(k, tensors))
    c = rt.compiled(k)
    values = list(c.zero)
    for name, v in params.items():
        i = c.index.get(name)
        if i is None:
            raise TypeError(f"{k.label}: its Params has no field {name!r}")
        values[i] = v
    resources, names, written = [None] * c.n_bindings, c.names, c.written
    if len(tensors) != len(names):
        raise TypeError(f"{k.label} takes {len(names)} tensors ({k.bindings}), got {len(tensors)}")
    for j, (t, n) in enumerate(tensors):
        field = c.offset_field[j]
        try:
            res, rest = bind(rt, t, n, names[j], field is not None)
        except (ValueError, DeviceError) as e:
            raise type(e)(f"{k.label} {e}") from None
        if field is not None:
            values[field] = rest
        elif rest:
            raise ValueError(f"{k.label} {names[j]}: element offset {split(t)[1]} is not a multiple of "
                             f"{rt.offset_alignment // F32} elements, which this kernel needs")
        resources[c.slots[j] - 1] = res
    for j in c.outputs:
        buf = split(tensors[j][0])[0]
        for i, (t, _) in enumerate(tensors):
            if not written[i] and split(t)[0] is buf:
                raise ValueError(f"{k.label}: output {names[j]} shares its buffer with {names[i]}; "
                                 "WebGPU forbids that within one dispatch")
    try:
        uni = rt.uniform(c.format, *values)
    except struct.error as e:
        raise ValueError(f"{k.label}: bad Params value ({e}): {dict(zip(c.index, values))}") from None
    return c.pipeline, [uni] + resources


def launch(rec, k: Kernel, groups, tensors, **params):
    """Record one dispatch of kernel k over `groups` workgroups (see prepare)."""
    pipeline, resources = prepare(rec.rt, k, tensors, **params)
    rec.dispatch(pipeline, resources, groups)


def flat_grid(n_workgroups: int) -> tuple:
    """Workgroup counts for a flat index space of n workgroups (folded into y beyond 65535)."""
    n = max(0, int(n_workgroups))
    if n <= MAX_GROUPS:
        return (n, 1)
    gy = -(-n // MAX_GROUPS)
    return (-(-n // gy), gy)
