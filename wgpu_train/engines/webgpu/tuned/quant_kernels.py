"""The GEMM with a frozen float16 / NF4 weight as the tuner sees it: one product (QProblem) and its candidates,
register-blocked (shaders/gemm_quant.wgsl, shaped for llvmpipe) and workgroup-tiled (quant_source.py, shaped
for GPUs); tune.choose picks one per shape, weight format and adapter, as for the float32 GEMM. A float16 weight
times a float16 A also has tiled candidates in float16 arithmetic where the adapter has `shader-f16`, as the float
GEMM (adapter_traits.f16_arithmetic)."""
from __future__ import annotations

import functools

import numpy as np

from wgpu_train.engines.webgpu.tuned import quant_source as QT
from wgpu_train.engines.shared.quant import StorageDtype
from wgpu_train.engines.webgpu.tuned.adapter_traits import f16_operands, is_cpu, min_workgroup, use_subgroups
from wgpu_train.engines.webgpu.tuned.gemm_kernels import WG_CHOICES
from wgpu_train.engines.webgpu.tuned.gemm_tolerance import arithmetic_slack, gemm_tolerance
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.tuned.family import Family
from wgpu_train.engines.webgpu.device.launch import Kernel, bind, prepare
from wgpu_train.engines.webgpu.device.operands import split

_F32 = 4

TM_CHOICES = (8, 32)      # rows of C per workgroup of the register kernels
MIXED_FORMATS = (((1, "bf16"), (4, "f16")), ((1, "f16"), (4, "bf16")))   # A's and C's, in all_kernels


@functools.lru_cache(maxsize=None)
def qgemm_kernel(fmt: str, entry: str, wg: int, tm: int, nt: bool, subgroups: bool = False,
                 formats: tuple = ()) -> Kernel:
    """The kernel of one register-blocked quantised-GEMM entry point for weights stored as fmt; formats: its
    16-bit tensors' (binding, format) pairs (QProblem.bound_formats), which A's vec4 view is declared for."""
    return Kernel(QT.REGISTER_SHADER, entry, QT.BINDINGS[fmt], (("NT", nt), ("TM", tm), ("WG", wg)),
                  source=(QT.register_source, fmt, subgroups, formats), invocations=wg,
                  features=("subgroup",) if subgroups else (), formats=formats)


def choose_tiling(M: int, N: int, min_wg: int = 8) -> tuple[int, int]:
    """(tm, wg) of the register kernels: rows of C per workgroup (8 or 32; an 8-row tile costs twice per row,
    as in gemm_kernels.py) and invocations per workgroup (8 * wg columns): least padded work, then up to 16
    workgroups (to feed every core), then the widest workgroup. Measured on llvmpipe."""
    best = None
    for tm in TM_CHOICES:
        for wg in WG_CHOICES:
            if wg < min_wg and wg != WG_CHOICES[-1]:
                continue
            tiles_m, tiles_n = -(-M // tm), -(-N // (8 * wg))
            cost = tiles_m * tm * (32 // tm) ** 0.5 * tiles_n * 8 * wg
            key = (cost, -min(tiles_m * tiles_n, 16), -tm, -wg)
            if best is None or key < best[0]:
                best = (key, tm, wg)
    return best[1], best[2]


class QProblem:
    """C (M, N) (+)= A (M, K) @ op(W chunk) (+ bias (N,)): layout "nt" (op = transpose: K = w.cols, N = the
    chunk's rows) or "nn" (K = the chunk's rows, N = w.cols); A and C row pitches lda, ldc. A and C (the
    activations) are float32, bfloat16 or float16 as their buffers say (storage.format_of: a_fmt, c_fmt); the
    kernels are specialised for them at launch, and a 16-bit C needs an even offset and pitch (pair stores)."""

    alpha = 1.0

    def __init__(self, rt, c, a, w, chunk: int, layout: str, M: int, bias=None, accumulate=False, lda=None,
                 ldc=None):
        if layout not in QT.LAYOUTS:
            raise ValueError(f"quantised GEMM layouts are nt and nn, not {layout!r}")
        self.rt, self.c, self.a, self.w, self.chunk, self.layout = rt, c, a, w, chunk, layout
        self.bias, self.accumulate, self.M = bias, bool(accumulate), int(M)
        n = w.chunks[chunk][2]
        self.N, self.K = (n, w.cols) if layout == "nt" else (w.cols, n)
        self.lda = int(lda if lda is not None else self.K)
        self.ldc = int(ldc if ldc is not None else self.N)
        if self.lda < self.K or self.ldc < self.N:
            raise ValueError(f"qgemm: lda={self.lda} / ldc={self.ldc} shorter than a row ({self.K} / {self.N})")
        self.a_ext, self.c_ext = (self.M - 1) * self.lda + self.K, (self.M - 1) * self.ldc + self.N
        self.a_fmt, self.c_fmt = storage.format_of(split(a)[0]), storage.format_of(split(c)[0])
        self.a_off = bind(rt, a, self.a_ext, "qgemm A", True)[1]
        self.c_off = bind(rt, c, self.c_ext, "qgemm C", True)[1]
        if self.c_fmt != "f32" and (self.c_off % 2 or (self.M > 1 and self.ldc % 2)):
            raise ValueError(f"qgemm: a {self.c_fmt} C is stored by pairs: its offset {self.c_off} and pitch "
                             f"{self.ldc} must be even")

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K

    @property
    def format_tag(self) -> str:
        """A's and C's storage formats, "" when both are float32 (the keys of float32 problems unchanged)."""
        return "" if self.a_fmt == self.c_fmt == "f32" else f" a:{self.a_fmt} c:{self.c_fmt}"

    @property
    def bound_formats(self) -> tuple:
        """(binding, format) of the 16-bit tensors the kernels get: A at 1, C at 4 (the rest are float32)."""
        return tuple((b, f) for b, f in ((1, self.a_fmt), (4, self.c_fmt)) if f != "f32")

    def describe(self) -> str:
        return f"{self.w.dtype} {self.layout} {self.M}x{self.N}x{self.K}{self.format_tag}"

    def tensors(self) -> list:
        buf = self.w.chunks[self.chunk][0]
        # without a bias, the weight's buffer stands in (float32 as the bias is, whatever A's format)
        out = [(self.a, self.a_ext), (buf, buf.size // _F32),
               (self.bias, self.N) if self.bias is not None else (buf, 1), (self.c, self.c_ext)]
        if self.w.absmax:
            out.append((self.w.absmax[self.chunk], self.w.absmax[self.chunk].size // _F32))
        if self.w.code_buffer is not None:
            out.append((self.w.code_buffer, 256))
        return out

    def params(self) -> dict:
        flags = (1 if self.accumulate else 0) | (2 if self.bias is not None else 0)
        return dict(M=self.M, N=self.N, K=self.K, flags=flags, lda=self.lda, ldc=self.ldc, cols=self.w.cols)

    def candidates(self) -> list:
        return qcandidates(self)

    def signature(self) -> tuple:
        """Everything the candidates and their kernels depend on (not the buffers)."""
        return ("qgemm", self.w.dtype, self.layout, self.M, self.N, self.K, self.lda, self.ldc, self.a_off % 4,
                self.w.cols, self.a_fmt, self.c_fmt)

    def key(self) -> str:
        bucket = 1 << max(0, (self.M - 1).bit_length())
        aligned = self.a_off % 4 == 0 and self.lda % 4 == 0
        return (f"qgemm {self.w.dtype} {self.layout} m{bucket} n{self.N} k{self.K} {'a4' if aligned else 'any'}"
                + self.format_tag + (" f16a" if self.f16_arithmetic_offered else ""))

    def tolerance(self, want: np.ndarray, cand=None) -> float:
        """The largest error a correct candidate (cand: the one checked, for its arithmetic) may show on a replica
        whose exact result is `want` (its operands: replica() keeps them)."""
        return gemm_tolerance(self.alpha, self.K, want, self.c_fmt) + arithmetic_slack(cand, self)

    @property
    def f16_arithmetic_offered(self) -> bool:
        """Whether float16-arithmetic candidates may run this product: a float16 weight times a float16 A."""
        return self.w.dtype is StorageDtype.FLOAT16 and f16_operands(self.rt, self.a_fmt)

    def replica(self, rng):
        """(problem, C buffer, C's initial values, its expected values, buffers to release): this geometry on a
        fresh random weight of the chunk's shape and random A and C in their formats (offsets kept modulo 64
        elements; A and C's values those their formats hold)."""
        rt, w = self.rt, self.w
        rows = w.chunks[self.chunk][2]
        # a weight of w's own class (quant.QuantMatrix; quant.py imports this module, not the reverse)
        wq = type(w)(rt, rng.standard_normal((rows, w.cols)).astype(np.float32), w.dtype, "tune weight")
        a = storage.rounded(rng.standard_normal(self.a_off % 64 + self.a_ext), self.a_fmt)
        c0 = storage.rounded(rng.standard_normal(self.c_off % 64 + self.c_ext), self.c_fmt)
        bias = rng.standard_normal(self.N).astype(np.float32)
        bufs = [storage.upload(rt, a, self.a_fmt, "tune operand"), storage.upload(rt, c0, self.c_fmt, "tune operand"),
                rt.upload(bias, "tune operand")]
        q = QProblem(rt, (bufs[1], self.c_off % 64), (bufs[0], self.a_off % 64), wq, 0, self.layout, self.M,
                     bufs[2] if self.bias is not None else None, self.accumulate, self.lda, self.ldc)
        deq = wq.read(rt).astype(np.float64)
        rows_a = a[q.a_off + np.arange(q.M)[:, None] * q.lda + np.arange(q.K)[None, :]].astype(np.float64)
        val = rows_a @ (deq.T if self.layout == "nt" else deq)
        q.operands, q.f16_slack = (rows_a, deq.T if self.layout == "nt" else deq), None
        if self.bias is not None:
            val += bias
        want = c0.astype(np.float64)
        idx = q.c_off + np.arange(q.M)[:, None] * q.ldc + np.arange(q.N)[None, :]
        want[idx] = val + (want[idx] if self.accumulate else 0.0)
        return q, bufs[1], c0, want, bufs + [b for b, _, _ in wq.chunks] + wq.absmax


class QRegister:
    """A register-blocked candidate (gemm_quant.wgsl): qgemm_fast(_sg) where the shapes allow, else qgemm."""

    family = "qregister"

    def __init__(self, tm: int, wg: int, subgroups: bool, fast=None):
        self.tm, self.wg, self.subgroups, self.fast = tm, wg, subgroups, fast
        self.name = f"qregister/{'sg' if subgroups else 'portable'}/wg{wg}_tm{tm}" + (
            "" if fast is None else ("_fast" if fast else "_any"))

    def dispatches(self, p: QProblem) -> list:
        nt = p.layout == "nt"
        can_fast = p.a_off % 4 == 0 and p.lda % 4 == 0 and (p.K % 8 == 0 if nt else p.N % 8 == 0)
        if self.fast and not can_fast:
            raise ValueError(f"qgemm_fast cannot run {p.describe()} lda={p.lda} a_off={p.a_off}")
        fast = can_fast if self.fast is None else self.fast
        sg = fast and self.subgroups
        entry = ("qgemm_fast_sg" if sg else "qgemm_fast") if fast else "qgemm"
        k = qgemm_kernel(p.w.dtype, entry, self.wg, self.tm, nt, sg, p.bound_formats)
        pipeline, resources = prepare(p.rt, k, p.tensors(), **p.params())
        return [(pipeline, resources, (-(-p.M // self.tm), -(-p.N // (8 * self.wg)), 1))]


class QTiled:
    """A workgroup-tiled candidate (quant_source.py): the weight decoded into workgroup memory tile by tile."""

    def __init__(self, cfg):
        self.cfg, self.half = cfg, cfg.half
        self.family = "qtiled-f16" if cfg.half else "qtiled"      # its own family: fast mode times it too
        self.name = f"qtiled/{cfg.name}"

    def applies(self, p: QProblem) -> bool:
        if self.half and not p.f16_arithmetic_offered:
            return False
        return QT.qtiled_applies(self.cfg, p.w.dtype, p.layout, p.M, p.N, p.K, p.lda, p.a_off, p.rt.limits,
                                 p.rt.features)

    def dispatches(self, p: QProblem) -> list:
        k = QT.qtiled_kernel(p.w.dtype, self.cfg, p.layout == "nt")
        pipeline, resources = prepare(p.rt, k, p.tensors(), **p.params())
        return [(pipeline, resources, QT.qtiled_groups(self.cfg, p.M, p.N))]


def register_candidate(p: QProblem, fast=None, subgroups=None) -> QRegister:
    """The register kernel the llvmpipe-measured tiling picks (fast / subgroups forced when given)."""
    tm, wg = choose_tiling(p.M, p.N, min_workgroup(p.rt))
    return QRegister(tm, wg, use_subgroups(p.rt) if subgroups is None else bool(subgroups), fast)


def qcandidates(p: QProblem) -> list:
    """Every candidate for p, the default first: the register kernel on CPU adapters, on GPUs the tiled
    kernel in float32 arithmetic with the most output tiles per the biggest tile (an unmeasured guess)."""
    tiles = [QTiled(cfg) for cfg in QT.QTILE_CONFIGS + QT.QTILE_HALF_CONFIGS]
    tiles = sorted((c for c in tiles if c.applies(p)),
                   key=lambda c: (c.half, -(-p.M // c.cfg.bm) * -(-p.N // c.cfg.bn) < 128, -(c.cfg.bm * c.cfg.bn),
                                  c.cfg.double_buffer))
    reg = [register_candidate(p)]
    return reg + tiles if is_cpu(p.rt) else tiles + reg


def all_kernels() -> list[Kernel]:
    """Every kernel descriptor this family can launch (the binding-limit and Tint checks go through them): each in
    float32, and each source and entry point with A and C in two mixes of 16-bit formats (MIXED_FORMATS; one tile
    config, whose 16-bit code the others share), the float16-arithmetic configs with a float16 weight and A (C
    float32 or float16), and the embedding gather into either 16-bit format."""
    entries = (("qgemm", False), ("qgemm_fast", False), ("qgemm_fast_sg", True))
    out = [qgemm_kernel(fmt, entry, wg, tm, nt, sg) for fmt in QT.FORMATS for entry, sg in entries
           for wg in WG_CHOICES for tm in TM_CHOICES for nt in (False, True)]
    out += [qgemm_kernel(fmt, entry, 8, 32, nt, sg, f) for fmt in QT.FORMATS for entry, sg in entries
            for nt in (False, True) for f in MIXED_FORMATS]
    out += [QT.qtiled_kernel(fmt, cfg, nt) for fmt in QT.FORMATS for cfg in QT.QTILE_CONFIGS for nt in (False, True)]
    out += [QT.qtiled_kernel("float16", cfg, nt).with_formats(((1, "f16"),) + c) for cfg in QT.QTILE_HALF_CONFIGS
            for nt in (False, True) for c in ((), ((4, "f16"),))]
    out += [QT.qtiled_kernel(fmt, QT.QTILE_CONFIGS[0], nt).with_formats(f) for fmt in QT.FORMATS
            for nt in (False, True) for f in MIXED_FORMATS]
    gathers = [QT.embed_gather_kernel(fmt) for fmt in QT.HALF_FORMATS]
    return out + gathers + [k.with_formats(((3, out_fmt),)) for k in gathers for out_fmt in ("bf16", "f16")]


FAMILY = Family("quant", shaders=(QT.REGISTER_SHADER, QT.SHADER), modules=(__file__, QT.__file__),
                all_kernels=all_kernels, benches=("gemm_quant",))
