"""The grouped-expert kernel family (mixtures of experts): the routing, grouping, combine and elementwise kernels of
shaders/moe.wgsl, the router's load-balancing loss of shaders/moe_balance.wgsl, the grouped GEMMs (one dispatch over
every expert's row blocks: the dense register-blocked GEMM of shaders/moe_gemm_register.wgsl where its vec4 loads
apply, the portable scalar one of shaders/moe_gemm.wgsl anywhere; tile and block a tuned choice) and the experts'
summed outer products (LoRA and weight gradients: split-K over an expert's rows plus an ordered reduction, or one
pass per expert; a tuned choice). The op wrappers are in engines/webgpu/moe.py; each problem here checks its
candidates against a NumPy product on the device. (Over 450 lines on purpose: the family's kernel descriptors and
its two tuned problems with their candidates, which share the grid and the binding layout.)"""
from __future__ import annotations

import math

import numpy as np

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import Kernel, flat_grid, prepare
from wgpu_train.engines.webgpu.device.operands import split
from wgpu_train.engines.webgpu.tuned.adapter_traits import is_cpu, min_workgroup, use_subgroups
from wgpu_train.engines.webgpu.tuned.attention_kernels import CPU_LOOP_BUDGET
from wgpu_train.engines.webgpu.tuned.family import Family
from wgpu_train.engines.webgpu.tuned.gemm_tolerance import ROUNDOFF
from wgpu_train.engines.webgpu.tuned import moe_source
from wgpu_train.engines.webgpu.tuned import moe_packed
from wgpu_train.engines.webgpu.tuned.moe_packed import FORMATS, mxfp4_upload, nf4_upload, packed_format
from wgpu_train.engines.webgpu.tuned.moe_source import WG, GemmConfig, gemm_source
from wgpu_train.engines.shared.quant import nf4_dequantize, nf4_quantize
from wgpu_train.formats.mxfp4 import Mxfp4

BLOCK = 256                       # pairs per block of the counting sort (shaders/moe.wgsl BLOCK)
GEMM_CONFIGS = (GemmConfig(4, 4), GemmConfig(8, 2), GemmConfig(2, 4), GemmConfig(1, 4), GemmConfig(4, 1))
REGISTER_TMS = (32, 16, 8)        # sorted rows per block of the register-blocked grouped GEMM
REGISTER_WGS = (16, 32, 64)       # its invocations per workgroup (8 columns each, or 4 and their up columns)
SPLITS = (64, 256)                # sorted rows per tile of the split-K outer products
LOOP_MARGIN = 16                  # iterations kept free of llvmpipe's budget


def _plain(entry: str, bindings: str) -> Kernel:
    return Kernel("moe", entry, bindings, invocations=WG)


ROUTE_FORWARD = _plain("moe_route_forward", "weights! logits bias experts!")
ROUTE_BACKWARD = _plain("moe_route_backward", "dlogits! dweights logits _ experts dprobs")
GROUP_COUNT = _plain("moe_group_count", "_ _ _ group! experts")
GROUP_OFFSETS = _plain("moe_group_offsets", "_ _ _ group!")
GROUP_SCATTER = _plain("moe_group_scatter", "_ _ _ perm! experts _ group")
LORA_ROWS = _plain("moe_lora_rows", "out! x m _ experts")
SWIGLU = _plain("moe_swiglu", "h! gate_up bias _ experts")
SWIGLU_BACKWARD = _plain("moe_swiglu_backward", "dgate_up! dh gate_up _ _ weights")
DWEIGHTS = _plain("moe_dweights", "dweights! dh gate_up")
COMBINE = _plain("moe_combine", "y! out bias _ experts weights")
BIAS = _plain("moe_bias", "out! src bias _ experts")               # gpt-oss's expert biases, and their gradients
BIAS_DWEIGHTS = _plain("moe_bias_dweights", "dweights! dy bias _ experts")
BIAS_BACKWARD = _plain("moe_bias_backward", "grad! src _ _ perm weights offsets")
OUTER = _plain("moe_outer", "part! u v _ perm weights offsets")
OUTER_REDUCE = _plain("moe_outer_reduce", "out! part _ _ _ _ offsets")
# the router's load-balancing loss (shaders/moe_balance.wgsl)
BALANCE_PROBS = Kernel("moe_balance", "moe_balance_probs", "probs! logits _ _ segments", invocations=WG)
BALANCE_PARTIAL = Kernel("moe_balance", "moe_balance_partial", "part! probs _ _ experts _ segments", invocations=WG)
BALANCE_REDUCE = Kernel("moe_balance", "moe_balance_reduce", "stats! part", invocations=WG)
BALANCE_LOSS = Kernel("moe_balance", "moe_balance_loss", "loss! stats", invocations=WG)
BALANCE_DPROBS = Kernel("moe_balance", "moe_balance_dprobs", "dprobs! stats _ _ segments", invocations=WG)
BALANCE_BLOCK = 256               # tokens per block of its partial sums (shaders/moe_balance.wgsl BLOCK)
PLAIN = (ROUTE_FORWARD, ROUTE_BACKWARD, GROUP_COUNT, GROUP_OFFSETS, GROUP_SCATTER, LORA_ROWS, SWIGLU,
         SWIGLU_BACKWARD, DWEIGHTS, COMBINE, BIAS, BIAS_DWEIGHTS, BIAS_BACKWARD, OUTER, OUTER_REDUCE, BALANCE_PROBS,
         BALANCE_PARTIAL, BALANCE_REDUCE, BALANCE_LOSS, BALANCE_DPROBS)


def group_blocks(pairs: int) -> int:
    """Blocks of the counting sort for N k pairs."""
    return max(1, -(-int(pairs) // BLOCK))


def balance_blocks(tokens: int) -> int:
    """Blocks of the load-balancing loss's partial sums for N tokens."""
    return max(1, -(-int(tokens) // BALANCE_BLOCK))


def group_size(pairs: int, experts: int) -> int:
    """u32 elements of the grouping's scratch: (blocks, E) counts, then the offsets (E + 1)."""
    return group_blocks(pairs) * experts + experts + 1


def max_blocks(rows: int, experts: int, per_block: int) -> int:
    """The most blocks of per_block sorted rows that rows pairs over experts can fill (each expert's last block
    may be partial): the grid's worst case."""
    return (rows + min(experts, rows) * (per_block - 1)) // per_block


def gemm_kernel(cfg: GemmConfig, swiglu: bool, lora: bool, pairs: bool = False, packed: str = "") -> Kernel:
    """The scalar grouped GEMM; pairs: its output stored by pairs of columns (a 16-bit out; cfg.rn even); packed:
    W packed as "nf4" or "mxfp4" (moe_packed.py)."""
    bindings = "out! x w offsets perm" + (" hl lb" if lora else (" _ _" if swiglu else "")) + (" h!" if swiglu else "")
    return Kernel("moe_gemm", "moe_gemm", bindings, source=(gemm_source, cfg.rm, cfg.rn, swiglu, lora, pairs, packed),
                  invocations=WG)


def register_kernel(wg: int, tm: int, subgroups: bool, swiglu: bool, nt: bool, formats: tuple = (),
                    packed: str = "") -> Kernel:
    """The register-blocked grouped GEMM (shaders/moe_gemm_register.wgsl); formats: its 16-bit tensors' (binding,
    format) pairs (out at 1, x at 2, W at 3); packed: W packed as "nf4" or "mxfp4" (moe_packed.py)."""
    constants = {"WG": wg, "TM": tm, "SWIGLU": bool(swiglu), "B_KVEC": bool(nt)}
    return Kernel("moe_gemm_register", "moe_gemm_reg", "out! x w offsets perm hl lb h!",
                  tuple(sorted(constants.items())), source=(moe_source.register_source, subgroups, formats, packed),
                  invocations=wg, features=("subgroup",) if subgroups else (), formats=formats)


def _unused(rt, writable: bool):
    """A float32 buffer bound where a kernel has no such tensor (hl and lb without LoRA, h outside the swiglu form):
    never read or written there; a writable one of its own, as WebGPU forbids one buffer bound both ways at once."""
    name = "moe.unused_rw" if writable else "moe.unused"
    return rt.memo(name, lambda r: r.buffer(16, name))


def _fmt(tensors: dict, name: str) -> str:
    """A tensor's storage format (device/storage.py), or its packed format, "nf4" or "mxfp4" (moe_packed.py)."""
    if name not in tensors:
        return "f32"
    buf = split(tensors[name])[0]
    packed = packed_format(buf)
    return packed[0] if packed else storage.format_of(buf)


def _packed(fmt: str) -> str:
    """W's packed format for the source builders ("" for a storage format)."""
    return fmt if fmt in FORMATS else ""


def _w_elements(p) -> int:
    """Elements of W a grouped GEMM binds: its weights, or a packed buffer's words."""
    return p.t["w"].size // 4 if _packed(p.w_fmt) else p.experts * p.w_out * p.in_f


def _sorted_pairs(experts: np.ndarray, n_experts: int):
    """(offsets (E + 1,), perm (N k,)) of a routing, as the counting sort makes them."""
    flat = experts.reshape(-1)
    perm = np.argsort(flat, kind="stable").astype(np.uint32)
    offsets = np.searchsorted(flat[perm], np.arange(n_experts + 1)).astype(np.uint32)
    return offsets, perm


def _routing(rng, tokens: int, slots: int, n_experts: int) -> np.ndarray:
    """A replica's experts (tokens, slots): distinct per token, expert 0 given none, expert 1 most."""
    experts = np.empty((tokens, slots), np.int32)
    for t in range(tokens):
        pool = [e for e in range(n_experts) if e != 0 or n_experts <= slots]
        pool.sort(key=lambda e: (e != 1, rng.random()))
        experts[t] = pool[:slots]
    return experts


class MoeGemmProblem:
    """One grouped GEMM over the routed pairs (rows = N k, grouped by expert: offsets, perm):
    out[q, o] = sum_i in[row(q), i] W[e, o, i] (+ scale (hl[q] L[e]^T)[o]) for o < cols, in pair order.
    layout "nt": W (E, W_out, in), L (E, W_out, r) (x W^T, the LoRA B); "nn": W (E, in, W_out), L (E, r, W_out)
    (dy W, the LoRA A); W_out = 2 cols for the swiglu form (gate columns, then up; h (rows, cols) written too).
    tensors: out, x, w, offsets, perm, [hl, lb], [h] ({} for a shape alone)."""

    def __init__(self, rt, tensors: dict, rows: int, slots: int, experts: int, in_f: int, cols: int, layout: str,
                 by_token: bool, rank: int = 0, scale: float = 1.0, swiglu: bool = False):
        self.rt, self.t = rt, tensors
        self.rows, self.slots, self.experts = int(rows), int(slots), int(experts)
        self.in_f, self.cols, self.layout, self.by_token = int(in_f), int(cols), layout, bool(by_token)
        self.rank, self.scale, self.swiglu = int(rank), float(scale), bool(swiglu)
        self.w_out = 2 * self.cols if swiglu else self.cols
        self.x_fmt, self.w_fmt, self.out_fmt = _fmt(tensors, "x"), _fmt(tensors, "w"), _fmt(tensors, "out")
        packed = packed_format(split(tensors["w"])[0]) if "w" in tensors else None
        self.w_abs = packed[1] if packed else 0        # the word where a packed W's scales start

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.w_out * (self.in_f + self.rank)

    def describe(self) -> str:
        return (f"moe gemm rows{self.rows} E{self.experts} {self.in_f}->{self.w_out} {self.layout}"
                f"{' swiglu' if self.swiglu else ''}{f' r{self.rank}' if self.rank else ''}")

    def signature(self) -> tuple:
        return ("moe_gemm", self.rows, self.slots, self.experts, self.in_f, self.cols, self.layout, self.by_token,
                self.rank, self.swiglu, self.x_fmt, self.w_fmt, self.out_fmt)

    def key(self) -> str:
        """The tuner's key: rows to the next power of two, the rest exact."""
        bucket = 1 << max(0, (self.rows - 1).bit_length())
        fmt = "" if self.x_fmt == self.w_fmt == self.out_fmt == "f32" else \
            f" x:{self.x_fmt} w:{self.w_fmt}" + ("" if self.out_fmt == "f32" else f" out:{self.out_fmt}")
        return (f"moe gemm rows{bucket} E{self.experts} {self.in_f}->{self.w_out} {self.layout}"
                f"{' swiglu' if self.swiglu else ''}{f' r{self.rank}' if self.rank else ''}{fmt}")

    def candidates(self) -> list:
        """Within llvmpipe's loop budget on CPU adapters: the grouped register-blocked GEMMs where their vec4 loads
        apply (RegisterGemm.applies), the adapter's default first (register_default), then the portable scalar
        register blocks (any shape; 4 x 4 first)."""
        sg = use_subgroups(self.rt)
        first = register_default(self, sg)
        regs = [first] + [RegisterGemm(wg, tm, s) for s in dict.fromkeys((sg, False)) for tm in REGISTER_TMS
                          for wg in REGISTER_WGS if (wg, tm, s) != (first.wg, first.tm, first.subgroups)
                          and wg >= min_workgroup(self.rt)]
        pairs = self.out_fmt != "f32"       # a 16-bit out: the scalar kernels store pairs of columns (rn even)
        cands = [c for c in regs if c.applies(self)] + [GroupedGemm(cfg) for cfg in GEMM_CONFIGS
                                                          if not pairs or cfg.rn % 2 == 0]
        if is_cpu(self.rt):
            cands = [c for c in cands if c.loop_iterations(self) <= CPU_LOOP_BUDGET - LOOP_MARGIN]
        return cands

    def offset(self, name: str) -> int:
        """The element offset of tensor `name` (0 where it is not given: a shape alone)."""
        return split(self.t[name])[1] if name in self.t else 0

    def strides(self) -> dict:
        """W's and L's strides (expert, output column, reduced index) for the layout."""
        if self.layout == "nt":
            w = (self.w_out * self.in_f, self.in_f, 1)
            lo = (self.w_out * self.rank, self.rank, 1)
        else:
            w = (self.in_f * self.w_out, 1, self.w_out)
            lo = (self.rank * self.w_out, 1, self.w_out)
        return dict(w_e=w[0], w_o=w[1], w_i=w[2], l_e=lo[0], l_o=lo[1], l_j=lo[2])

    def tolerance(self, want: np.ndarray, cand=None) -> float:
        """Float32 sums of in_f + rank products (the swiglu's h one rounding more), and a 16-bit out's rounding."""
        top = float(np.max(np.abs(want)))
        return 1e-6 * math.sqrt(self.in_f + self.rank) * 8 * (1 + top) + ROUNDOFF.get(self.out_fmt, 0.0) * top

    def replica(self, rng):
        """(problem, [(buffer, elements)], initial values, expected values, buffers to release) on random
        operands: tokens routed to distinct experts, expert 0 given none."""
        tokens = self.rows // self.slots if self.by_token else self.rows
        experts = _routing(rng, max(1, self.rows // self.slots), self.slots, self.experts).reshape(-1)[:self.rows]
        offsets, perm = _sorted_pairs(experts, self.experts)
        x = storage.rounded(rng.standard_normal(tokens * self.in_f), self.x_fmt).reshape(tokens, self.in_f)
        nt = self.layout == "nt"
        w_shape = (self.experts, self.w_out, self.in_f) if nt else (self.experts, self.in_f, self.w_out)
        w = rng.standard_normal(int(np.prod(w_shape))) / math.sqrt(self.in_f)
        if self.w_fmt == "nf4":
            w_buf = nf4_upload(self.rt, w.reshape(w_shape), label="tune operand")
            w = nf4_dequantize(*nf4_quantize(w), w_shape)
        elif self.w_fmt == "mxfp4":       # random codes, scales near 2^-4 (w_shape[-1] a multiple of 32)
            blocks = rng.integers(0, 256, (*w_shape[:-1], w_shape[-1] // 32, 16), dtype=np.uint8)
            packed = Mxfp4(blocks, rng.integers(121, 125, blocks.shape[:-1], dtype=np.uint8), "w", "tune")
            w_buf, w = mxfp4_upload(self.rt, packed, "tune operand"), packed.values()
        else:
            w = storage.rounded(w, self.w_fmt)
            w_buf = storage.upload(self.rt, w, self.w_fmt, "tune operand")
        w = w.reshape(w_shape)
        rows_in = x[np.arange(self.rows) // self.slots] if self.by_token else x                 # (rows, in)
        wt = w if self.layout == "nt" else w.transpose(0, 2, 1)                                   # (E, W_out, in)
        want = np.einsum("qi,qoi->qo", rows_in.astype(np.float64), wt[experts].astype(np.float64))
        bufs = {"out": storage.upload(self.rt, np.zeros(self.rows * self.w_out, np.float32), self.out_fmt,
                                      "tune result"),
                "x": storage.upload(self.rt, x.reshape(-1), self.x_fmt, "tune operand"),
                "w": w_buf,
                "offsets": self.rt.upload(offsets, "tune operand"), "perm": self.rt.upload(perm, "tune operand")}
        if self.rank:
            hl = rng.standard_normal((self.rows, self.rank)).astype(np.float32)
            l_shape = (self.experts, self.w_out, self.rank) if nt else (self.experts, self.rank, self.w_out)
            lb = rng.standard_normal(l_shape).astype(np.float32)
            lt = lb if self.layout == "nt" else lb.transpose(0, 2, 1)                          # (E, W_out, r)
            want = want + self.scale * np.einsum("qj,qoj->qo", hl.astype(np.float64), lt[experts].astype(np.float64))
            bufs["hl"], bufs["lb"] = self.rt.upload(hl, "tune operand"), self.rt.upload(lb, "tune operand")
        parts, c0 = [(bufs["out"], self.rows * self.w_out)], [np.zeros(self.rows * self.w_out, np.float32)]
        wants = [want.reshape(-1)]
        if self.swiglu:
            bufs["h"] = self.rt.upload(np.zeros(self.rows * self.cols, np.float32), "tune result")
            gate, up = want[:, :self.cols], want[:, self.cols:]
            wants.append((gate / (1 + np.exp(-gate)) * up).reshape(-1))
            parts.append((bufs["h"], self.rows * self.cols))
            c0.append(np.zeros(self.rows * self.cols, np.float32))
        rep = MoeGemmProblem(self.rt, bufs, self.rows, self.slots, self.experts, self.in_f, self.cols, self.layout,
                             self.by_token, self.rank, self.scale, self.swiglu)
        return rep, parts, np.concatenate(c0), np.concatenate(wants), list(bufs.values())


class GroupedGemm:
    """A register block of rm x rn per invocation; the grid: column blocks x the worst case of row blocks."""

    family = "grouped"

    def __init__(self, cfg: GemmConfig):
        self.cfg, self.name = cfg, f"moe_gemm/{cfg.name}"

    def loop_iterations(self, p: MoeGemmProblem) -> int:
        """Per invocation at most, as llvmpipe counts them (each loop its iterations and one more)."""
        return p.experts + 1 + p.in_f + 1 + (p.rank + 1 if p.rank else 0)

    def dispatches(self, p: MoeGemmProblem) -> list:
        k = gemm_kernel(self.cfg, p.swiglu, p.rank > 0, pairs=p.out_fmt != "f32", packed=_packed(p.w_fmt))
        tokens = p.rows // p.slots if p.by_token else p.rows
        sizes = {"out": p.rows * p.w_out, "x": tokens * p.in_f, "w": _w_elements(p), "offsets": p.experts + 1,
                 "perm": p.rows, "hl": p.rows * p.rank, "lb": p.experts * p.w_out * p.rank, "h": p.rows * p.cols}
        pipeline, resources = prepare(p.rt, k, [(p.t[name], sizes[name]) for name in k.names],
                                      experts=p.experts, slots=p.slots, by_token=int(p.by_token), in_f=p.in_f,
                                      cols=p.cols, out_f=p.w_out, rank=p.rank, scale=p.scale, w_abs=p.w_abs,
                                      **p.strides())
        blocks = max_blocks(p.rows, p.experts, self.cfg.rm)
        gy, gz = flat_grid(blocks)
        return [(pipeline, resources, (-(-p.cols // (WG * self.cfg.rn)), gy, gz))]


def register_default(p: MoeGemmProblem, subgroups: bool) -> "RegisterGemm":
    """The register candidate a CPU adapter runs untimed: one column tile where 64 invocations cover the columns
    (8 a lane, or 4 and their up columns), and blocks of 32 rows where experts average at least 32 rows, else 16
    (measured on lavapipe: benchmarks/README.md)."""
    per_lane = 4 if p.swiglu else 8
    wg = next((w for w in REGISTER_WGS if w * per_lane >= p.cols), REGISTER_WGS[-1])
    tm = 32 if p.rows >= 32 * p.experts else 16
    return RegisterGemm(max(wg, min_workgroup(p.rt)), tm, subgroups)


class RegisterGemm:
    """The dense register-blocked GEMM over each block of tm sorted rows of one expert (shaders/
    moe_gemm_register.wgsl): wg invocations of 8 columns (4 and their up columns in the swiglu form), subgroup
    broadcasts of x where the adapter runs them. Grid: the worst case of row blocks x column tiles."""

    family = "register"

    def __init__(self, wg: int, tm: int, subgroups: bool):
        self.wg, self.tm, self.subgroups = wg, tm, subgroups
        self.name = f"moe_gemm/reg_{'sg' if subgroups else 'portable'}_m{tm}_wg{wg}"

    def applies(self, p: MoeGemmProblem) -> bool:
        """Whether the vec4 loads and stores apply: the reduced dimension and the columns multiples of 4 (so every
        stride of x, W, out and h), and x, W, out and h starting on a multiple of 4 elements."""
        return (p.in_f % 4 == 0 and p.cols % 4 == 0
                and all(p.offset(name) % 4 == 0 for name in ("x", "w", "out", "h")))

    def loop_iterations(self, p: MoeGemmProblem) -> int:
        """Per invocation at most, as llvmpipe counts them (each loop its iterations and one more): the expert
        search, the block's rows, the column offsets, the reduction, the LoRA steps (two loads of 4 loops), the
        stores."""
        lora = (-(-p.rank // 4) + 1) * (1 + 2 * 5)
        return p.experts + 1 + 2 * (self.tm + 1) + 5 + p.in_f // 4 + 1 + lora

    def dispatches(self, p: MoeGemmProblem) -> list:
        formats = tuple((b, f) for b, f in ((1, p.out_fmt), (2, p.x_fmt), (3, p.w_fmt))
                        if f != "f32" and not _packed(f))
        k = register_kernel(self.wg, self.tm, self.subgroups, p.swiglu, p.layout == "nt", formats,
                            packed=_packed(p.w_fmt))
        tokens = p.rows // p.slots if p.by_token else p.rows
        lora = p.rank > 0
        tensors = [(p.t["out"], p.rows * p.w_out), (p.t["x"], tokens * p.in_f),
                   (p.t["w"], _w_elements(p)), (p.t["offsets"], p.experts + 1), (p.t["perm"], p.rows),
                   (p.t["hl"], p.rows * p.rank) if lora else (_unused(p.rt, False), 1),
                   (p.t["lb"], p.experts * p.w_out * p.rank) if lora else (_unused(p.rt, False), 1),
                   (p.t["h"], p.rows * p.cols) if p.swiglu else (_unused(p.rt, True), 4)]
        pipeline, resources = prepare(p.rt, k, tensors, experts=p.experts, slots=p.slots, by_token=int(p.by_token),
                                      in_f=p.in_f, cols=p.cols, out_f=p.w_out, rank=p.rank, scale=p.scale,
                                      w_abs=p.w_abs, **p.strides())
        gx, gz = flat_grid(max_blocks(p.rows, p.experts, self.tm))
        tiles = -(-p.cols // (self.wg * (4 if p.swiglu else 8)))
        return [(pipeline, resources, (gx, tiles, gz))]


class MoeOuterProblem:
    """The experts' summed outer products: out[e] (O, Q) (+)= scale * sum over expert e's pairs q of
    (w[q] if weighted) U[row_u(q)]^T V[row_v(q)], rows by token (q // k) where u_token / v_token, else by pair.
    tensors: out (E, O, Q), u, v, perm, weights, offsets, [part: split-K partials, part_size() elements]."""

    def __init__(self, rt, tensors: dict, rows: int, slots: int, experts: int, o: int, q: int, u_token: bool,
                 v_token: bool, weighted: bool, scale: float = 1.0, accumulate: bool = False):
        self.rt, self.t = rt, tensors
        self.rows, self.slots, self.experts, self.o, self.q = int(rows), int(slots), int(experts), int(o), int(q)
        self.u_token, self.v_token, self.weighted = bool(u_token), bool(v_token), bool(weighted)
        self.scale, self.accumulate = float(scale), bool(accumulate)
        self.u_fmt, self.v_fmt = _fmt(tensors, "u"), _fmt(tensors, "v")

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.o * self.q

    def describe(self) -> str:
        return f"moe outer rows{self.rows} E{self.experts} {self.o}x{self.q}"

    def signature(self) -> tuple:
        return ("moe_outer", self.rows, self.slots, self.experts, self.o, self.q, self.u_token, self.v_token,
                self.weighted, "part" in self.t, self.u_fmt, self.v_fmt)

    def key(self) -> str:
        bucket = 1 << max(0, (self.rows - 1).bit_length())
        fmt = "" if self.u_fmt == self.v_fmt == "f32" else f" u:{self.u_fmt} v:{self.v_fmt}"
        return f"moe outer rows{bucket} E{self.experts} {self.o}x{self.q}{'' if 'part' in self.t else ' direct'}{fmt}"

    def part_size(self, per_tile: int = min(SPLITS)) -> int:
        """Elements of the split-K partials with per_tile rows a tile."""
        return max_blocks(self.rows, self.experts, per_tile) * self.o * self.q

    def candidates(self) -> list:
        """Split-K (where a partials buffer is given: any size of problem; 64 rows a tile first on GPUs, 256 on CPU
        adapters, whose few threads want long loops) and one pass per expert (its loop as long as the expert's
        rows: on CPU adapters only where every row fits llvmpipe's budget)."""
        cpu = is_cpu(self.rt)
        splits = [SplitOuter(s) for s in (sorted(SPLITS, reverse=cpu) if "part" in self.t else ())]
        direct = [DirectOuter()] if not cpu or self.rows + self.experts + 2 <= CPU_LOOP_BUDGET - LOOP_MARGIN else []
        if not splits + direct:
            raise ValueError(f"{self.describe()}: too many rows for one pass per expert on this CPU adapter, and no "
                             "split-K partials buffer given")
        return splits + direct

    def tolerance(self, want: np.ndarray, cand=None) -> float:
        """Float32 sums over an expert's rows."""
        return 1e-6 * math.sqrt(self.rows) * 8 * (1 + float(np.max(np.abs(want))))

    def replica(self, rng):
        """This shape on random operands (expert 0 given no rows), with a partials buffer where this has one."""
        experts = _routing(rng, max(1, self.rows // self.slots), self.slots, self.experts).reshape(-1)[:self.rows]
        offsets, perm = _sorted_pairs(experts, self.experts)
        tokens = -(-self.rows // self.slots)
        u = storage.rounded(rng.standard_normal((tokens if self.u_token else self.rows) * self.o), self.u_fmt)
        v = storage.rounded(rng.standard_normal((tokens if self.v_token else self.rows) * self.q), self.v_fmt)
        w = rng.uniform(0.1, 1.0, self.rows).astype(np.float32)
        qs = np.arange(self.rows)
        ur = u.reshape(-1, self.o)[qs // self.slots if self.u_token else qs].astype(np.float64)
        vr = v.reshape(-1, self.q)[qs // self.slots if self.v_token else qs].astype(np.float64)
        if self.weighted:
            ur = ur * w[:, None]
        out0 = rng.standard_normal(self.experts * self.o * self.q).astype(np.float32)
        want = np.zeros((self.experts, self.o, self.q))
        np.add.at(want, experts, self.scale * ur[:, :, None] * vr[:, None, :])
        want = want.reshape(-1) + (out0 if self.accumulate else 0)
        bufs = {"out": self.rt.upload(out0, "tune result"), "u": storage.upload(self.rt, u, self.u_fmt, "tune operand"),
                "v": storage.upload(self.rt, v, self.v_fmt, "tune operand"),
                "perm": self.rt.upload(perm, "tune operand"),
                "weights": self.rt.upload(w, "tune operand"), "offsets": self.rt.upload(offsets, "tune operand")}
        if "part" in self.t:
            bufs["part"] = self.rt.buffer(4 * self.part_size(), "tune scratch")
        rep = MoeOuterProblem(self.rt, bufs, self.rows, self.slots, self.experts, self.o, self.q, self.u_token,
                              self.v_token, self.weighted, self.scale, self.accumulate)
        return rep, bufs["out"], out0, want, list(bufs.values())


def _outer_dispatch(p: MoeOuterProblem, target, per_tile: int, tiles: int, accumulate: bool):
    tokens = -(-p.rows // p.slots)
    sizes = {"u": (tokens if p.u_token else p.rows) * p.o, "v": (tokens if p.v_token else p.rows) * p.q,
             "perm": p.rows, "weights": p.rows, "offsets": p.experts + 1}
    tensors = [(target, tiles * p.o * p.q)] + [(p.t[name], sizes[name]) for name in OUTER.names[1:]]
    flags = int(p.u_token) | 2 * int(p.v_token) | 4 * int(p.weighted)
    pipeline, resources = prepare(p.rt, OUTER, tensors, s0=p.o, s1=p.q, s2=p.experts, s3=p.slots, s4=per_tile,
                                  s5=flags, s6=int(accumulate), f0=p.scale)
    gx, gy = flat_grid(-(-(p.o * p.q) // WG))
    return pipeline, resources, (gx, gy, tiles)


class SplitOuter:
    """Each tile of `per_tile` sorted rows of one expert summed into its partials, then each expert's tiles
    summed in order (no float atomics)."""

    family = "split"

    def __init__(self, per_tile: int):
        self.per_tile, self.name = per_tile, f"moe_outer/split{per_tile}"

    def dispatches(self, p: MoeOuterProblem) -> list:
        tiles = max_blocks(p.rows, p.experts, self.per_tile)
        first = _outer_dispatch(p, p.t["part"], self.per_tile, tiles, False)
        tensors = [(p.t["out"], p.experts * p.o * p.q), (p.t["part"], tiles * p.o * p.q),
                   (p.t["offsets"], p.experts + 1)]
        pipeline, resources = prepare(p.rt, OUTER_REDUCE, tensors, s0=p.o * p.q, s1=p.experts, s4=self.per_tile,
                                      s6=int(p.accumulate))
        return [first, (pipeline, resources, flat_grid(-(-(p.experts * p.o * p.q) // WG)))]


class DirectOuter:
    """One tile per expert holding all its rows, written straight to the output (no partials)."""

    family = "direct"
    name = "moe_outer/direct"

    def dispatches(self, p: MoeOuterProblem) -> list:
        return [_outer_dispatch(p, p.t["out"], 0, p.experts, p.accumulate)]


def all_kernels() -> list[Kernel]:
    """Every kernel descriptor of the family (the binding-limit and Tint checks go through them)."""
    return (list(PLAIN) + [gemm_kernel(cfg, swiglu, lora, pairs, packed) for cfg in GEMM_CONFIGS
                           for swiglu in (False, True) for lora in (False, True) for pairs in (False, True)
                           for packed in ("",) + FORMATS if not pairs or cfg.rn % 2 == 0]
            + [register_kernel(wg, tm, sg, swiglu, nt, packed=packed) for sg in (False, True) for tm in REGISTER_TMS
               for wg in REGISTER_WGS for swiglu, nt in ((False, True), (True, True), (False, False))
               for packed in ("",) + FORMATS])


FAMILY = Family("moe", shaders=("moe", "moe_balance", "moe_gemm", moe_source.REGISTER_SHADER,
                                *moe_source.PACKED_SHADERS.values()),
                modules=(__file__, moe_source.__file__, moe_packed.__file__), all_kernels=all_kernels,
                benches=("moe",))
