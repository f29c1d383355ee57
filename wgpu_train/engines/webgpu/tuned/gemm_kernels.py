"""The GEMM kernel families and their candidates for one problem: register-blocked (shaders/gemm.wgsl, shaped
for llvmpipe), workgroup-tiled (shaders/gemm_tiled.wgsl, shaped for GPUs) and split-K over the tiled kernel
(skinny products). tune.py times the candidates; `candidates(p)` lists them best guess first.

A, B and C may each be float32, bfloat16 or float16 (their buffers' storage formats, device/storage.py), the
arithmetic float32; bias, split-K partials and the LoRA term's H and LB are float32. A 16-bit C is written a
word (two elements) at a time, so it needs contiguous rows of even width, an even pitch and offset (Problem
checks), and a candidate that stores pairs of adjacent columns: every tiled and split-K one (an invocation owns
groups of 4 columns) and the unswapped register ones (a swap stores C transposed: Register.applies).

Where A and B are both float16 and the adapter has `shader-f16`, tiled candidates in float16 arithmetic join
(TileConfig.half; gemm_core.wgsl: f16 products summed over 4 steps of k, accumulated in float32), checked by the
tuner with their own bound (gemm_tolerance.f16_arithmetic_slack) and chosen only where they are faster: as torch's
allow_fp16_reduced_precision_reduction, on by default; WGPU_TRAIN_F16_ARITHMETIC=0 leaves them out."""
from __future__ import annotations

import functools
import itertools

import numpy as np

from wgpu_train.engines.webgpu.tuned import adapter_traits, gemm_source as src
from wgpu_train.engines.webgpu.tuned import gemm_tolerance as gemm_tolerance_module
from wgpu_train.engines.webgpu.tuned.gemm_tolerance import arithmetic_slack, gemm_tolerance
from wgpu_train.engines.webgpu.tuned.adapter_traits import (SUBGROUP_PROBE, f16_operands, is_cpu, min_workgroup,
                                                            use_subgroups)
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.tuned.family import Family
from wgpu_train.engines.webgpu.device.launch import Kernel, bind, prepare, tensor_formats
from wgpu_train.engines.webgpu.device.operands import split

TM = 32                    # rows of C per workgroup of the register kernels, TM_CHOICES for skinny products
TM_CHOICES = (8, 32)
TN = 8                     # columns of C per invocation of the register kernels
WG_CHOICES = (8, 16, 32, 64)
L2_PANEL_BYTES = 256 * 1024   # the slice of B one workgroup streams should stay in a core's L2 (llvmpipe)
SPLITS = (4, 16, 64)       # split-K factors tried for skinny products
MIXED_FORMATS = (((1, "bf16"), (2, "f16"), (4, "bf16")), ((1, "f16"), (2, "bf16"), (4, "f16")))   # all_kernels
_F32 = 4


# ---- the problem ---------------------------------------------------------------------------------

def _extent(batch, stride, rows, row_pitch, cols, col_pitch):
    """Number of elements from the first to the last one touched, inclusive."""
    return (batch - 1) * stride + (rows - 1) * row_pitch + (cols - 1) * col_pitch + 1


def _no_bias(rt):
    """A float32 buffer bound where a GEMM has no bias (unread there; A may be 16-bit, the bias binding not)."""
    return rt.memo("gemm.no_bias", lambda r: r.buffer(16, "gemm.no_bias"))


class Problem:
    """One GEMM as the kernels see it: op(A) (m, k) at a_sm, a_sk (a_sz per batch), op(B) (k, n) at b_sk,
    b_sn, C (m, n) at c_sm, c_sn; the element offsets the kernels get (a_off, ...) once the operands are bound;
    formats: the storage formats of A, B and C."""

    def __init__(self, rt, M, N, K, batch, alpha, accumulate, layout, a, a_sm, a_sk, a_sz, b, b_sk, b_sn, b_sz,
                 c, c_sm, c_sn, c_sz, bias):
        self.rt, self.M, self.N, self.K, self.batch = rt, M, N, K, batch
        self.alpha, self.accumulate, self.layout = alpha, accumulate, layout
        self.a_sm, self.a_sk, self.a_sz = a_sm, a_sk, a_sz
        self.b_sk, self.b_sn, self.b_sz = b_sk, b_sn, b_sz
        self.c_sm, self.c_sn, self.c_sz = c_sm, c_sn, c_sz
        ext_a = _extent(batch, a_sz, M, a_sm, K, a_sk)
        ext_b = _extent(batch, b_sz, K, b_sk, N, b_sn)
        ext_c = _extent(batch, c_sz, M, c_sm, N, c_sn)
        self.a, self.b, self.c = (a, ext_a), (b, ext_b), (c, ext_c)
        self.bias = (bias, N) if bias is not None else (_no_bias(rt), 1)   # unread without the bias flag
        self.has_bias = bias is not None
        self.a_off = bind(rt, a, ext_a, "gemm A", True)[1]
        self.b_off = bind(rt, b, ext_b, "gemm B", True)[1]
        self.c_off = bind(rt, c, ext_c, "gemm C", True)[1]
        if bias is not None:
            bind(rt, bias, N, "gemm bias", True)
        self.formats = tuple(storage.format_of(split(t)[0]) for t in (a, b, c))
        if self.formats[2] != "f32" and (c_sn != 1 or N % 2 or c_sm % 2 or self.c_off % 2
                                         or (batch > 1 and c_sz % 2)):
            raise ValueError(f"gemm: a {self.formats[2]} C is written by pairs of elements (words): it needs "
                             f"contiguous rows of even width, an even row pitch, batch stride and offset, not "
                             f"N={N}, pitch {c_sm}, column stride {c_sn}, batch stride {c_sz}, offset {split(c)[1]}")

    @property
    def flags(self) -> int:
        return (1 if self.accumulate else 0) | (2 if self.has_bias else 0)

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K * self.batch

    def describe(self) -> str:
        return f"{self.layout} {self.M}x{self.N}x{self.K}" + (f" x{self.batch}" if self.batch > 1 else "")

    def params(self, swap: bool = False) -> dict:
        """The Params fields of shaders/gemm*.wgsl (swap: for C^T = op(B)^T op(A)^T, operands exchanged)."""
        if not swap:
            return dict(M=self.M, N=self.N, K=self.K, flags=self.flags, a_sm=self.a_sm, a_sk=self.a_sk,
                        a_sz=self.a_sz, b_sk=self.b_sk, b_sn=self.b_sn, b_sz=self.b_sz, c_sm=self.c_sm,
                        c_sn=self.c_sn, c_sz=self.c_sz, bias_sm=0, bias_sn=1, alpha=self.alpha)
        return dict(M=self.N, N=self.M, K=self.K, flags=self.flags, a_sm=self.b_sn, a_sk=self.b_sk,
                    a_sz=self.b_sz, b_sk=self.a_sk, b_sn=self.a_sm, b_sz=self.a_sz, c_sm=self.c_sn,
                    c_sn=self.c_sm, c_sz=self.c_sz, bias_sm=1, bias_sn=0, alpha=self.alpha)

    def tensors(self, swap: bool = False) -> list:
        return [self.b, self.a, self.bias, self.c] if swap else [self.a, self.b, self.bias, self.c]

    def candidates(self) -> list:
        return candidates(self)

    def signature(self) -> tuple:
        """Everything the candidates and their kernels depend on (not the buffers)."""
        return ("gemm", self.M, self.N, self.K, self.batch, self.a_sm, self.a_sk, self.a_sz, self.b_sk, self.b_sn,
                self.b_sz, self.c_sm, self.c_sn, self.c_sz, self.a_off % 4, self.b_off % 4, self.c_off % 4,
                self.layout, self.formats)

    def key(self) -> str:
        """The tuner's key: layout, M bucket (next power of two), N, K, batch, operand alignment, and the formats
        of A, B and C where one is 16-bit (a float32 problem keeps the key it always had), marked where
        float16-arithmetic candidates were offered."""
        bucket = 1 << max(0, (self.M - 1).bit_length())
        aligned = src.vec4_ok(self.M, self.N, self.K, self.batch, self.a_off, self.a_sm, self.a_sk, self.a_sz,
                                self.b_off, self.b_sk, self.b_sn, self.b_sz)
        formats = "" if self.formats == ("f32",) * 3 else " " + "/".join(self.formats)
        # f16a: float16-arithmetic candidates were offered (a choice made without them is not this key's)
        formats += " f16a" if f16_operands(self.rt, *self.formats[:2]) else ""
        return f"gemm {self.layout} m{bucket} n{self.N} k{self.K} b{self.batch} {'v4' if aligned else 'any'}{formats}"

    def tolerance(self, want: np.ndarray, cand=None) -> float:
        """The largest error a correct candidate (cand: the one checked, for its arithmetic) may show on a
        replica whose exact result is `want` (its operands: replica() keeps them)."""
        return gemm_tolerance(self.alpha, self.K, want, self.formats[2]) + arithmetic_slack(cand, self)

    def replica(self, rng):
        """(problem, C buffer, C's initial host values, C's expected values, buffers to release): this
        geometry on fresh random operands in the same formats (offsets kept modulo 64 elements, which keeps
        their alignment); the expected values from the operands as stored."""
        fa, fb, fc = self.formats
        host = [storage.rounded(rng.standard_normal(off % 64 + extent).astype(np.float32), fmt)
                for extent, off, fmt in ((self.a[1], self.a_off, fa), (self.b[1], self.b_off, fb),
                                         (self.N, 0, "f32"), (self.c[1], self.c_off, fc))]
        bufs = [storage.upload(self.rt, x, fmt, "tune operand") for x, fmt in zip(host, (fa, fb, "f32", fc))]
        q = Problem(self.rt, self.M, self.N, self.K, self.batch, self.alpha, self.accumulate, self.layout,
                    (bufs[0], self.a_off % 64), self.a_sm, self.a_sk, self.a_sz, (bufs[1], self.b_off % 64),
                    self.b_sk, self.b_sn, self.b_sz, (bufs[3], self.c_off % 64), self.c_sm, self.c_sn, self.c_sz,
                    bufs[2] if self.has_bias else None)
        a, b, bias, c0 = host
        A = _strided(a.astype(np.float64), q.a_off, q.batch, q.a_sz, q.M, q.a_sm, q.K, q.a_sk)
        B = _strided(b.astype(np.float64), q.b_off, q.batch, q.b_sz, q.K, q.b_sk, q.N, q.b_sn)
        want = c0.astype(np.float64)
        C = _strided(want, q.c_off, q.batch, q.c_sz, q.M, q.c_sm, q.N, q.c_sn)
        val = q.alpha * np.matmul(A, B) + (bias.astype(np.float64)[:q.N] if q.has_bias else 0.0)
        C[...] = val + C if q.accumulate else val    # writes into `want` through the view
        q.operands, q.f16_slack = (A, B), None
        return q, bufs[3], c0, want, bufs


def _strided(flat: np.ndarray, off, batch, sz, rows, r_stride, cols, c_stride) -> np.ndarray:
    """(batch, rows, cols) view of a flat array with element strides."""
    return np.lib.stride_tricks.as_strided(flat[off:], (batch, rows, cols),
                                           tuple(s * flat.itemsize for s in (sz, r_stride, c_stride)))


# ---- register-blocked family (shaders/gemm.wgsl) ---------------------------------------------------

def vec4_modes(M, N, K, batch, a_off, a_sm, a_sk, a_sz, b_off, b_sk, b_sn, b_sz, c_off, c_sm, c_sn, c_sz):
    """(a_kvec, b_nvec, c_nvec) when all three matrices can be accessed as aligned vec4s (op(A) along
    k or m, op(B) along n or k, C along n or m), else None (the scalar kernel)."""
    def ok(vec_len, pitch, off, sz):
        return vec_len % 4 == 0 and pitch % 4 == 0 and off % 4 == 0 and (batch == 1 or sz % 4 == 0)

    def mode(s_first, len_first, s_second, len_second, off, sz):
        """True: vec4s along the first axis (stride 1 there); False: along the second; None: neither."""
        if s_first == 1 and ok(len_first, s_second, off, sz):
            return True
        if s_second == 1 and ok(len_second, s_first, off, sz):
            return False
        return None

    modes = (mode(a_sk, K, a_sm, M, a_off, a_sz), mode(b_sn, N, b_sk, K, b_off, b_sz),
             mode(c_sn, N, c_sm, M, c_off, c_sz))
    return None if None in modes else modes


def choose_tiling(M: int, N: int, K: int = 1, batch: int = 1, min_wg: int = 8, b_along_k=(False, False),
                  swaps=(False, True)):
    """(swap, wg, tm) of the register kernels: whether to compute C^T = op(B)^T op(A)^T instead, the
    workgroup size (8 * wg columns) and the rows per workgroup (32, or 8 for products with a side of at
    most 8, e.g. a rank). Measured on llvmpipe; `swaps` limits the orientations considered.

    Workgroups are numbered row tile first, so consecutive workgroups (run at the same time on the
    cores of a CPU adapter) stream the same K x 8*wg panel of B, each invocation its own columns.
    b_along_k[swap] says whether that operand (op(B), or op(A)^T when swapped) is contiguous along k:
    such streams are sequential; the other order reads 4 rows a step, which costs little while the
    panel stays in L2 and halves the speed once it does not.

    Cost: the padded work (so a skinny product is not padded to a wide tile of columns), a row of an
    8-row tile counting sqrt(4) = 2 (it shares each load of B over fewer FMAs), times 1.2 for a B not
    along k, 2 if its panel is also over L2_PANEL_BYTES. Ties go to more workgroups, up to 16 (to feed
    every core), then no swap (C rows stay contiguous), then the widest workgroup (fewer, larger tasks)."""
    best = None
    for swap in swaps:
        m, n = (N, M) if swap else (M, N)
        for tm in TM_CHOICES:
            for wg in WG_CHOICES:
                if wg < min_wg and wg != WG_CHOICES[-1]:
                    continue
                tiles_m, tiles_n = -(-m // tm), -(-n // (TN * wg))
                cost = tiles_m * tm * tiles_n * TN * wg * (TM // tm) ** 0.5
                if not b_along_k[swap]:
                    cost *= 1.2 if K * TN * wg * 4 <= L2_PANEL_BYTES else 2.0
                key = (cost, -min(tiles_m * tiles_n * batch, 16), swap, -tm, -wg)
                if best is None or key < best[0]:
                    best = (key, swap, wg, tm)
    return best[1:]


@functools.lru_cache(maxsize=None)
def register_kernel(wg: int, tm: int, subgroups: bool, vec, formats: tuple = ()) -> Kernel:
    """The register-blocked kernel: vec None for the scalar entry point, else (a_kvec, b_nvec, c_nvec);
    formats: its 16-bit tensors' (binding, format) pairs (launch.tensor_formats)."""
    entry = ("gemm_v4" if vec else "gemm") + ("_sg" if subgroups else "")
    constants = {"WG": wg, "TM": tm}
    if vec:
        constants.update(A_KVEC=bool(vec[0]), B_NVEC=bool(vec[1]), C_NVEC=bool(vec[2]))
    return Kernel("gemm", entry, "A B BIAS C!", tuple(sorted(constants.items())),
                  source=(src.register_source, subgroups, formats), invocations=wg,
                  features=("subgroup",) if subgroups else (), formats=formats)


class Register:
    """A register-blocked candidate: C (or C^T when swap) in tiles of tm rows x 8 * wg columns."""

    family = "register"

    def __init__(self, swap: bool, wg: int, tm: int, subgroups: bool, vec4: bool = True):
        self.swap, self.wg, self.tm, self.subgroups, self.vec4 = swap, wg, tm, subgroups, vec4
        self.name = (f"register/{'sg' if subgroups else 'portable'}/wg{wg}_tm{tm}" + ("_swap" if swap else "")
                     + ("" if vec4 else "_scalar"))

    def applies(self, p: Problem) -> bool:
        """Whether this candidate can store p's C: a 16-bit C only unswapped (the kernel pairs columns, and a
        swap stores C transposed)."""
        return not (self.swap and p.formats[2] != "f32")

    def kernel(self, p: Problem) -> Kernel:
        if not self.applies(p):
            raise ValueError(f"{self.name}: a {p.formats[2]} C is stored by pairs of columns, never swapped")
        q = p.params(self.swap)
        offs = (p.b_off, p.a_off) if self.swap else (p.a_off, p.b_off)
        vec = (vec4_modes(q["M"], q["N"], q["K"], p.batch, offs[0], q["a_sm"], q["a_sk"], q["a_sz"], offs[1],
                          q["b_sk"], q["b_sn"], q["b_sz"], p.c_off, q["c_sm"], q["c_sn"], q["c_sz"])
               if self.vec4 else None)
        k = register_kernel(self.wg, self.tm, self.subgroups, vec)
        return register_kernel(self.wg, self.tm, self.subgroups, vec, tensor_formats(k, p.tensors(self.swap)))

    def dispatches(self, p: Problem) -> list:
        q = p.params(self.swap)
        pipeline, resources = prepare(p.rt, self.kernel(p), p.tensors(self.swap), **q)
        return [(pipeline, resources, (-(-q["M"] // self.tm), -(-q["N"] // (TN * self.wg)), p.batch))]


def register_candidate(p: Problem, subgroups=None, vec4: bool = True, swaps=(False, True)) -> Register:
    """The register kernel choose_tiling picks for p (measured on llvmpipe), subgroups / vec4 forced when given;
    unswapped for a 16-bit C (Register.applies)."""
    rt = p.rt
    if p.formats[2] != "f32":
        swaps = (False,)
    tiling = choose_tiling(p.M, p.N, p.K, p.batch, min_workgroup(rt), (p.b_sk == 1, p.a_sk == 1), swaps)
    return Register(*tiling, use_subgroups(rt) if subgroups is None else subgroups, vec4)


def register_candidates(p: Problem) -> list:
    """The llvmpipe-measured choice (choose_tiling) first, then the best of the other orientation (none for a
    16-bit C, which only the unswapped kernel stores)."""
    first = register_candidate(p)
    if p.formats[2] != "f32":
        return [first]
    return [first, register_candidate(p, swaps=(not first.swap,))]


# ---- workgroup-tiled family and split-K (shaders/gemm_tiled.wgsl) ------------------------------------

@functools.lru_cache(maxsize=None)
def tiled_kernel(cfg, formats: tuple = ()) -> Kernel:
    """gemm_tiled*: formats, its 16-bit tensors' (binding, format) pairs (launch.tensor_formats)."""
    return Kernel("gemm_tiled", src.entry_point(cfg), "A B BIAS C!", source=(src.tiled_source, cfg, formats),
                  invocations=src.workgroup_size(cfg), workgroup_bytes=src.workgroup_bytes(cfg),
                  features=src.kernel_features(cfg), formats=formats)


@functools.lru_cache(maxsize=None)
def tiled_lora_kernel(cfg, formats: tuple = ()) -> Kernel:
    """gemm_tiled_lora*: the tiled kernel plus alpha2 * H LB^T after its k loop (H, LB: bindings 5, 6)."""
    return Kernel("gemm_tiled", src.lora_entry_point(cfg), "A B BIAS C! H LB",
                  source=(src.tiled_source, cfg, formats), invocations=src.workgroup_size(cfg),
                  workgroup_bytes=src.workgroup_bytes(cfg), features=src.kernel_features(cfg), formats=formats)


@functools.lru_cache(maxsize=None)
def _reduce_kernel(cfg, formats: tuple = ()) -> Kernel:
    # from the same source as the pass it reduces (a subgroup config's source keeps its subgroup section)
    return Kernel("gemm_tiled", src.REDUCE_ENTRY, "PARTIALS _ BIAS C!", source=(src.tiled_source, cfg, formats),
                  invocations=src.REDUCE_WG, features=src.kernel_features(cfg), formats=formats)


def _for(make, cfg, tensors: list) -> Kernel:
    """make(cfg)'s kernel (tiled_kernel, ...) for the formats of `tensors`, its (tensor, n) pairs."""
    return make(cfg, tensor_formats(make(cfg), tensors))


def _scratch(rt, elements: int):
    """The split-K partials buffer, grown as needed (one at a time: dispatches in order reuse it)."""
    holder = rt.memo("gemm.splitk_scratch", lambda r: {})
    buf = holder.get("buf")
    if buf is None or buf.size < elements * _F32:
        holder["buf"] = buf = rt.buffer(max(elements, 1 << 16) * _F32, "gemm.splitk_partials")
    return buf


class Tiled:
    """A workgroup-tiled candidate (one TileConfig), with `splits` > 1 for split-K plus a reduction pass."""

    def __init__(self, cfg, splits: int = 1):
        if cfg.half and splits > 1:
            raise ValueError(f"{cfg.name}: no split-K in float16 arithmetic")
        self.cfg, self.splits, self.half = cfg, splits, cfg.half
        # float16 arithmetic is a family of its own, so that the tuner's fast mode times its best guess too
        self.family = "splitk" if splits > 1 else ("tiled-f16" if cfg.half else "tiled")
        self.name = f"splitk{splits}/{cfg.name}" if splits > 1 else f"tiled/{cfg.name}"

    def applies(self, p: Problem) -> bool:
        if not src.fits(self.cfg, p.rt.limits, p.rt.features):
            return False
        if self.half and not f16_operands(p.rt, *p.formats[:2]):
            return False
        if self.cfg.vec4 and not src.vec4_ok(p.M, p.N, p.K, p.batch, p.a_off, p.a_sm, p.a_sk, p.a_sz,
                                               p.b_off, p.b_sk, p.b_sn, p.b_sz):
            return False
        if self.splits > 1:
            if p.K < 2 * self.splits * self.cfg.bk or self.splits * p.batch > 65535:
                return False
            if self.splits * p.batch * p.M * p.N * _F32 > p.rt.max_binding:
                return False
        try:
            src.groups(self.cfg, p.M, p.N, p.batch, self.splits)
        except ValueError:
            return False
        return True

    def dispatches(self, p: Problem) -> list:
        rt, q = p.rt, p.params()
        groups = src.groups(self.cfg, p.M, p.N, p.batch, self.splits)
        if self.splits == 1:
            tensors = p.tensors()
            pipeline, resources = prepare(rt, _for(tiled_kernel, self.cfg, tensors), tensors, k_split=p.K, splits=1,
                                          batch=p.batch, **q)
            return [(pipeline, resources, groups)]
        n_part = self.splits * p.batch * p.M * p.N
        part = _scratch(rt, n_part)
        ks = src.k_split(self.cfg, p.K, self.splits)
        tensors = [p.a, p.b, p.bias, (part, n_part)]
        first = prepare(rt, _for(tiled_kernel, self.cfg, tensors), tensors, k_split=ks, splits=self.splits,
                        batch=p.batch, **q)
        tensors = [(part, n_part), p.bias, p.c]
        second = prepare(rt, _for(_reduce_kernel, self.cfg, tensors), tensors, k_split=ks, splits=self.splits,
                         batch=p.batch, **q)
        return [(*first, groups), (*second, src.reduce_groups(p.M, -(-p.N // 2), p.batch))]

    def lora_applies(self, p: Problem) -> bool:
        """Whether dispatches_with_lora can run p: one pass (no split-K) over one matrix (no batch), float32
        arithmetic (H and LB are float32)."""
        return self.splits == 1 and p.batch == 1 and not self.half

    def dispatches_with_lora(self, p: Problem, h, ldh: int, lb, r2: int, alpha2: float,
                             ldlb: int | None = None) -> list:
        """[(pipeline, resources, groups)] of one dispatch computing C = p.alpha * op(A) op(B) + alpha2 * H LB^T
        (+ bias) (+ C): H (p.M, r2) rows ldh apart and LB (p.N, r2) rows ldlb (default r2) apart, buffers or
        (buffer, element offset) views (a LoRA module's h, possibly its columns of a group's h, and B).
        r2 = 0: p alone, through the same entry point."""
        if not self.lora_applies(p):
            raise ValueError(f"{self.name}: the LoRA term needs splits == 1 and batch == 1, not "
                             f"splits={self.splits}, batch={p.batch}")
        r2, ldh = int(r2), int(ldh)
        ldlb = r2 if ldlb is None else int(ldlb)
        if ldh < r2 or ldlb < r2:
            raise ValueError(f"{self.name}: LoRA pitches ldh={ldh}, ldlb={ldlb} are shorter than r2={r2}")
        ext_h = (p.M - 1) * ldh + r2 if r2 else 1
        ext_lb = (p.N - 1) * ldlb + r2 if r2 else 1
        tensors = p.tensors() + [(h, ext_h), (lb, ext_lb)]
        pipeline, resources = prepare(p.rt, _for(tiled_lora_kernel, self.cfg, tensors), tensors, k_split=p.K,
                                      splits=1, batch=1, r2=r2, ldh=ldh, ldlb=ldlb, alpha2=float(alpha2),
                                      **p.params())
        return [(pipeline, resources, src.groups(self.cfg, p.M, p.N))]


def tiled_candidates(p: Problem) -> list:
    """Every tile configuration that fits, and split-K where the product is skinny (few output tiles, or a K
    much longer than the output's sides): the LoRA gradients (K = tokens) and the head's input gradient
    (K = the vocabulary)."""
    out = [Tiled(cfg) for cfg in src.TILED_CONFIGS + src.HALF_CONFIGS]
    tiles64 = -(-p.M // 64) * -(-p.N // 64) * p.batch
    if (tiles64 < 64 and p.K >= 512) or (tiles64 < 1024 and p.K >= 16 * max(p.M, p.N)):
        small = [cfg for cfg in src.TILED_CONFIGS
                 if not cfg.double_buffer and not cfg.subgroups and cfg.bm * cfg.bn <= 64 * 64]
        out += [Tiled(cfg, s) for s in SPLITS for cfg in small]
    return [c for c in out if c.applies(p)]


def _gpu_rank(p: Problem, c) -> tuple:
    """Best guess first on a GPU, before anything was measured (unmeasured: a guess from the usual shape of
    GPU SGEMMs): float32 arithmetic before float16 (the untuned default stays the exact one), enough output tiles
    to fill the device, then the biggest tile and vec4 loads."""
    cfg = c.cfg
    tiles = -(-p.M // cfg.bm) * -(-p.N // cfg.bn) * p.batch * c.splits
    return (cfg.half, tiles < 128, -(cfg.bm * cfg.bn) if tiles >= 128 else cfg.bm * cfg.bn, not cfg.vec4,
            cfg.double_buffer, c.splits)


def candidates(p: Problem) -> list:
    """Every candidate that can run p on its device, the default (untuned) choice first: on CPU adapters the
    register kernels measured there, on GPUs the tiled kernels (split-K for skinny products)."""
    regs = register_candidates(p)
    tiles = sorted(tiled_candidates(p), key=lambda c: _gpu_rank(p, c))
    if is_cpu(p.rt):
        return regs + tiles
    return tiles + regs


def all_kernels() -> list[Kernel]:
    """Every kernel descriptor this family can launch (the binding-limit and Tint checks go through them): each in
    float32, and each source and entry point in two mixes of 16-bit formats that together give every tensor
    binding both (MIXED_FORMATS); a float16-arithmetic config with float16 A and B, C float32 or float16 (the
    only way it runs: Tiled.applies)."""
    vecs = [None] + list(itertools.product((False, True), repeat=3))
    out = [register_kernel(wg, tm, sg, vec) for wg in WG_CHOICES for tm in TM_CHOICES for sg in (False, True)
           for vec in vecs]
    out += [register_kernel(8, TM, sg, vec, f) for sg in (False, True) for vec in vecs for f in MIXED_FORMATS]
    for cfg in src.TILED_CONFIGS:
        out += [tiled_kernel(cfg), tiled_lora_kernel(cfg), _reduce_kernel(cfg)]
        out += [k(cfg, f) for f in MIXED_FORMATS for k in (tiled_kernel, tiled_lora_kernel)]
        out += [_reduce_kernel(cfg, ((4, fmt),)) for fmt in ("bf16", "f16")]
    out += [tiled_kernel(cfg, ((1, "f16"), (2, "f16")) + c) for cfg in src.HALF_CONFIGS for c in ((), ((4, "f16"),))]
    return out + [SUBGROUP_PROBE]


FAMILY = Family("gemm", shaders=("gemm", "gemm_tiled"),
                modules=(__file__, src.__file__, adapter_traits.__file__, gemm_tolerance_module.__file__),
                all_kernels=all_kernels,
                benches=("gemm", "gemm_candidates"))
