"""The short convolution's kernel family (shaders/short_conv.wgsl): a candidate's positions per invocation and
workgroup size, its forward and backward dispatch plans (the weight's gradient as per-block partials then their
sum in order: no float atomics), the tuner's problem (timed on the forward, checked against
engines/shared/short_conv.py), and the step kernel of generation. The op wrappers are engines/webgpu/short_conv.py.

llvmpipe ends every loop of an invocation after 65535 iterations in all: the weight gradient's blocks (ROWS
positions or more) and their number per channel stay within it for any T the engine records."""
from __future__ import annotations

import functools

import numpy as np

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import Kernel, flat_grid, prepare
from wgpu_train.engines.webgpu.device.operands import split
from wgpu_train.engines.webgpu.tuned import short_conv_source as src
from wgpu_train.engines.webgpu.tuned.adapter_traits import is_cpu
from wgpu_train.engines.webgpu.tuned.family import Family

MAX_K = 16                   # kernel sizes 1..MAX_K (LFM2's is 3, Qwen3.5's 4)
STEP_WG = 64                 # the step kernel's workgroup
ROWS = 64                    # positions per block of the weight gradient's partial sums (at least)
MAX_BLOCKS = 16384           # blocks per channel the final sum loops over (at most)
# (positions per invocation, workgroup size), the default first: on CPU adapters long tiles (fewer invocations),
# on GPUs one position per invocation in wide workgroups (a guess until a GPU measures them)
CPU_CONFIGS = ((8, 64), (1, 64), (32, 64))
GPU_CONFIGS = ((1, 256), (4, 256), (1, 64), (4, 64))
HAS_SEG = 1
ACTIVATIONS = {None: 0, "silu": 1}


@functools.lru_cache(maxsize=None)
def kernel(entry: str, bindings: str, k: int, tile: int = 1, wg: int = STEP_WG) -> Kernel:
    """One entry point of shaders/short_conv.wgsl built for kernel size k, tile and workgroup size."""
    return Kernel("short_conv", entry, bindings, source=(src.source, k, tile, wg), invocations=wg)


# (entry, bindings) of each kernel: t1 the (B, T, C) output, w2 the partials or the state, w3 the weight's gradient
FORWARD = ("sc_forward", "y! _ _ x weight segments")
BACKWARD_DX = ("sc_backward_dx", "dx! _ _ x weight segments dy")
DW_PARTIAL = ("sc_backward_dw_partial", "_ scratch! _ x weight segments dy")
DW_REDUCE = ("sc_backward_dw_reduce", "_ scratch dw!")
STEP = ("sc_step", "y! state! _ x weight table")


def zeros(rt):
    """One int32 zero: the binding of absent segment ids (the flags tell the kernels)."""
    return rt.memo("short_conv.zero", lambda r: r.upload(np.zeros(4, np.int32), "short_conv.zero"))


def blocks(B: int, T: int) -> tuple[int, int]:
    """(positions per block, blocks per row) of the weight gradient's partial sums: at least ROWS positions, at
    most MAX_BLOCKS blocks over the batch (for B <= MAX_BLOCKS)."""
    rows = max(ROWS, -(-T // max(1, MAX_BLOCKS // B)))
    return rows, -(-T // rows)


def scratch_size(B: int, T: int, C: int, K: int) -> int:
    """Elements (float32) of the backward's scratch: the weight gradient's partials (B, blocks, C, K)."""
    return B * blocks(B, T)[1] * C * K


class ShortConvProblem:
    """One short convolution over a batch as the kernels see it (the op wrappers' tensors by name: y, x, weight,
    segments, and for the backward dx, dw, dy, scratch), sizes, the activation (None or "silu") and whether the backward
    adds dw into its buffer."""

    def __init__(self, rt, tensors: dict, B, T, C, K, activation=None, accumulate=False):
        self.rt, self.t = rt, tensors
        self.B, self.T, self.C, self.K, self.activation = B, T, C, K, activation
        self.accumulate = accumulate          # the backward adds dw into what the buffer holds
        self.formats = {n: storage.format_of(split(t)[0]) for n, t in tensors.items()
                        if n in ("x", "y", "dx", "dy") and t is not None}

    @property
    def flops(self) -> float:
        return 2.0 * self.B * self.T * self.C * self.K

    def describe(self) -> str:
        return f"short conv B{self.B} T{self.T} C{self.C} K{self.K}" + (f" {self.activation}" if self.activation else "")

    def signature(self) -> tuple:
        return ("short_conv", self.B, self.T, self.C, self.K, self.activation, tuple(sorted(self.formats.items())))

    def key(self) -> str:
        """The tuner's key: rows bucket (next power of two of B T), channels, kernel size, 16-bit formats."""
        bucket = 1 << max(0, (self.B * self.T - 1).bit_length())
        kinds = {f for f in self.formats.values() if f != "f32"}
        return f"short_conv bt{bucket} c{self.C} k{self.K}" + (f" {','.join(sorted(kinds))}" if kinds else "")

    def candidates(self) -> list:
        return candidates(self)

    def tolerance(self, want: np.ndarray, cand=None) -> float:
        """float32 against the float64 reference: K products per output, a 16-bit output's rounding."""
        rel = 1e-2 if set(self.formats.values()) - {"f32"} else 1e-5
        return rel * (1 + float(np.max(np.abs(want)))) if want.size else 0.0

    def replica(self, rng):
        """This shape on random inputs (one sequence per row): (problem, y's buffer, zeros, the reference's y,
        buffers to release)."""
        from wgpu_train.engines.shared.short_conv import short_conv_forward

        B, T, C, K = self.B, self.T, self.C, self.K
        x = storage.rounded(rng.standard_normal((B, T, C)).astype(np.float32),
                            self.formats.get("x", "f32")).reshape(B, T, C)
        w = rng.standard_normal((C, 1, K)).astype(np.float32)
        want = short_conv_forward(x.astype(np.float64), w.astype(np.float64), np.ones((B, T), np.int32))
        if self.activation == "silu":
            want = want / (1 + np.exp(-want))
        t = {"x": storage.upload(self.rt, x.reshape(-1), self.formats.get("x", "f32"), "tune operand"),
             "weight": self.rt.upload(w.reshape(-1), "tune operand"),
             "y": storage.upload(self.rt, np.zeros(B * T * C, np.float32), self.formats.get("y", "f32"), "tune result")}
        rep = ShortConvProblem(self.rt, t, B, T, C, K, self.activation)
        return rep, t["y"], np.zeros(want.size, np.float32), want.reshape(-1), list(t.values())


def candidates(p: ShortConvProblem) -> list:
    """Every (tile, workgroup) that runs p on its device, the default first (CPU_CONFIGS / GPU_CONFIGS)."""
    if not 1 <= p.K <= MAX_K:
        raise ValueError(f"the short convolution's kernels take kernel sizes 1..{MAX_K}, got {p.K}")
    configs = CPU_CONFIGS + GPU_CONFIGS if is_cpu(p.rt) else GPU_CONFIGS + CPU_CONFIGS
    out = [Tiled(tile, wg) for tile, wg in dict.fromkeys(configs)]
    return [c for c in out if kernel(*FORWARD, p.K, c.tile, c.wg).supported(p.rt)]


class Tiled:
    """A candidate: `tile` consecutive positions of one channel pair per invocation, `wg` invocations per
    workgroup; its forward and backward dispatch plans."""

    def __init__(self, tile: int, wg: int):
        self.tile, self.wg = tile, wg
        self.name = f"short_conv/t{tile}/w{wg}"
        self.family = f"t{tile}"

    def _tensors(self, p: ShortConvProblem) -> tuple[dict, dict]:
        B, T, C, K = p.B, p.T, p.C, p.K
        n = B * T * C
        sizes = {"y": n, "x": n, "dx": n, "dy": n, "weight": C * K, "dw": C * K, "segments": B * T,
                 "scratch": scratch_size(B, T, C, K)}
        tensors = {name: (t, sizes[name]) for name, t in p.t.items() if name in sizes and t is not None}
        tensors.setdefault("segments", (zeros(p.rt), 1))
        params = dict(b=B, t=T, c=C, act=ACTIVATIONS[p.activation], flags=HAS_SEG * int(p.t.get("segments") is not None))
        return tensors, params

    def _dispatch(self, p, spec, n_invocations, tensors, wg=None, **params):
        k = kernel(*spec, p.K, self.tile, wg or self.wg)
        pipeline, resources = prepare(p.rt, k, [tensors[name] for name in k.names], **params)
        return pipeline, resources, flat_grid(-(-n_invocations // (wg or self.wg)))

    def _positions(self, p: ShortConvProblem) -> int:
        """Invocations of the forward and dx: (row, tile, channel pair)."""
        return p.B * -(-p.T // self.tile) * -(-p.C // 2)

    def dispatches(self, p: ShortConvProblem) -> list:
        """The forward: y."""
        tensors, params = self._tensors(p)
        return [self._dispatch(p, FORWARD, self._positions(p), tensors, **params)]

    def backward_dispatches(self, p: ShortConvProblem) -> list:
        """The backward: dx, and dw (through the scratch's partials) where p has a dw."""
        tensors, params = self._tensors(p)
        out = [self._dispatch(p, BACKWARD_DX, self._positions(p), tensors, **params)] if "dx" in tensors else []
        if "dw" in tensors:
            rows, nblk = blocks(p.B, p.T)
            params.update(rows=rows, nblk=nblk, accumulate=int(p.accumulate))
            out.append(self._dispatch(p, DW_PARTIAL, p.B * nblk * -(-p.C // 2), tensors, **params))
            out.append(self._dispatch(p, DW_REDUCE, p.C * p.K, tensors, **params))
        return out


def step_kernel(k: int) -> Kernel:
    return kernel(*STEP, k)


def all_kernels(sizes=(3, 4)) -> list[Kernel]:
    """Every kernel descriptor of the family at LFM2's and Qwen3.5's kernel sizes, every candidate (the
    binding-limit and Tint checks go through them)."""
    out = []
    for k in sizes:
        for tile, wg in dict.fromkeys(CPU_CONFIGS + GPU_CONFIGS):
            out += [kernel(*spec, k, tile, wg) for spec in (FORWARD, BACKWARD_DX, DW_PARTIAL, DW_REDUCE)]
        out.append(step_kernel(k))
    return out


FAMILY = Family("short_conv", shaders=("short_conv",), modules=(__file__, src.__file__), all_kernels=all_kernels)
