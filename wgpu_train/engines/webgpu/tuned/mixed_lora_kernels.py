"""The mixed-adapter LoRA product of serving (shaders/mixed_lora.wgsl): each row of a batch its own adapter out of
one module's bank (engines/shared/mixed_lora.py), one kernel per module. The tiled candidates reduce a row's h
in workgroup memory once for 128 * OUT_PER outputs (more outputs each: fewer reductions; fewer: more workgroups
in flight); the private ones compute h per invocation without barriers (which llvmpipe runs slowly), where
an invocation's loops fit llvmpipe's budget on CPU adapters. The tuner picks by measurement, checking each
against the NumPy reference."""
from __future__ import annotations

import math

import numpy as np

from wgpu_train.engines.shared.mixed_lora import BankModule, mixed_lora_forward
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import Kernel, flat_grid, prepare
from wgpu_train.engines.webgpu.device.operands import split
from wgpu_train.engines.webgpu.tuned.attention_kernels import CPU_LOOP_BUDGET
from wgpu_train.engines.webgpu.tuned.family import Family
from wgpu_train.engines.webgpu.tuned.gemm_kernels import is_cpu

WG = 64                       # the shader's workgroup size
MAX_RANK = 256                # the shader's workgroup array of h
OUTPUTS = (1, 4, 8)           # pairs of outputs per invocation of the tiled candidates
PRIVATE_OUTPUTS = (16, 64)    # outputs per invocation of the private ones (even: a 16-bit y's words whole)
LOOP_MARGIN = 16              # iterations kept free of llvmpipe's budget


def _kernel(out_per: int, private: bool = False) -> Kernel:
    if private:
        return Kernel("mixed_lora", "mixed_lora_private", "y! x a_bank b_bank scales adapters",
                      (("OUT_PER", out_per),), invocations=WG)
    return Kernel("mixed_lora", "mixed_lora_forward", "y! x a_bank b_bank scales adapters",
                  (("OUT_PER", out_per),), invocations=WG, workgroup_bytes=4 * (WG + MAX_RANK))


class MixedLoraProblem:
    """One mixed_lora_forward call: y (n, out) += the LoRA term of each row's adapter; x (n, in); a bank of k
    adapters padded to `rank`; adapters (n,) i32. tensors: y, x, a_bank, b_bank, scales, adapters ({} for a
    shape alone, its y and x float32: what a benchmark makes its replica of)."""

    def __init__(self, rt, tensors: dict, n: int, in_f: int, out_f: int, rank: int, k: int):
        if not 0 < rank <= MAX_RANK:
            raise ValueError(f"mixed_lora_forward: a bank of rank {rank} (1..{MAX_RANK})")
        self.rt, self.t = rt, tensors
        self.n, self.in_f, self.out_f, self.rank, self.k = int(n), int(in_f), int(out_f), int(rank), int(k)
        self.y_fmt, self.x_fmt = (storage.format_of(split(tensors[name])[0]) if name in tensors else "f32"
                                  for name in ("y", "x"))

    @property
    def flops(self) -> float:
        return 2.0 * self.n * self.rank * (self.in_f + self.out_f)

    def describe(self) -> str:
        return f"mixed lora n{self.n} in{self.in_f} out{self.out_f} r{self.rank} k{self.k}"

    def signature(self) -> tuple:
        return ("mixed_lora", self.n, self.in_f, self.out_f, self.rank, self.k, self.y_fmt, self.x_fmt)

    def key(self) -> str:
        """The tuner's key: rows (next power of two), features and the padded rank."""
        bucket = 1 << max(0, (self.n - 1).bit_length())
        fmt = "" if self.y_fmt == self.x_fmt == "f32" else f" y:{self.y_fmt} x:{self.x_fmt}"
        return f"mixed lora n{bucket} in{self.in_f} out{self.out_f} r{self.rank}{fmt}"

    def candidates(self) -> list:
        """The tiled candidates whose tile is not much larger than the module's outputs, the most outputs first
        (the fewest reductions of h), and the private ones, on CPU adapters within llvmpipe's loop budget. The
        default (untuned) first: the tiled ones on GPUs, and on CPU adapters where a tile of 16 outputs an
        invocation applies (out > 512; on llvmpipe about 2x private64's speed at 896 -> 896), else the private
        ones, the most outputs first (3-10x the tiled ones' speed there at 128 and 352 outputs)."""
        tiles = [Tile(c) for c in sorted(OUTPUTS, reverse=True) if c == 1 or WG * c < self.out_f]
        cpu = is_cpu(self.rt)
        private = [Private(c) for c in sorted(PRIVATE_OUTPUTS, reverse=True)
                   if not cpu or Private(c).loop_iterations(self) <= CPU_LOOP_BUDGET - LOOP_MARGIN]
        return private + tiles if cpu and tiles[0].out_per < max(OUTPUTS) else tiles + private

    def tolerance(self, want: np.ndarray, cand=None) -> float:
        """The largest error a correct candidate may make: float32 sums of in and rank terms."""
        return 1e-6 * math.sqrt(self.in_f * self.rank) * 8 * (1 + float(np.max(np.abs(want))))

    def replica(self, rng):
        """(problem, y buffer, its initial values, its expected values, buffers to release): this shape on a
        random bank of k adapters (the last with half the rank: padded) and rows spread over them and none."""
        n, k = self.n, self.k
        ranks = np.full(k, self.rank)
        ranks[-1] = max(1, self.rank // 2)
        a = np.zeros((k, self.rank, self.in_f), np.float32)
        b = np.zeros((k, self.out_f, self.rank), np.float32)
        for j, r in enumerate(ranks):
            a[j, :r] = rng.standard_normal((r, self.in_f))
            b[j, :, :r] = rng.standard_normal((self.out_f, r))
        module = BankModule(a, b, rng.uniform(0.5, 2.0, k).astype(np.float32), ranks)
        rows = (np.arange(n) % (k + 1) - 1).astype(np.int32)                     # -1 (none), 0, .. k-1
        x = storage.rounded(rng.standard_normal(n * self.in_f), self.x_fmt)
        y0 = storage.rounded(rng.standard_normal(n * self.out_f), self.y_fmt)
        want = y0.astype(np.float64) + mixed_lora_forward(x.reshape(n, self.in_f).astype(np.float64), module,
                                                          rows).ravel()
        bufs = [storage.upload(self.rt, y0, self.y_fmt, "tune result"),
                storage.upload(self.rt, x, self.x_fmt, "tune operand"),
                *(self.rt.upload(v, "tune operand") for v in (a, b, module.scales, rows))]
        rep = MixedLoraProblem(self.rt, dict(zip(("y", "x", "a_bank", "b_bank", "scales", "adapters"), bufs)),
                               n, self.in_f, self.out_f, self.rank, k)
        return rep, bufs[0], y0, want, bufs


class Tile:
    """A workgroup per (row, 128 * out_per outputs), out_per pairs an invocation."""

    family = "tile"

    def __init__(self, out_per: int):
        self.out_per, self.name = out_per, f"mixed_lora/out{out_per}"

    def dispatches(self, p: MixedLoraProblem) -> list:
        return _dispatches(p, _kernel(self.out_per), (-(-p.out_f // (2 * WG * self.out_per)), p.n))


class Private:
    """An invocation per (row, out_per outputs), its h its own."""

    family = "private"

    def __init__(self, out_per: int):
        self.out_per, self.name = out_per, f"mixed_lora/private{out_per}"

    def loop_iterations(self, p: MixedLoraProblem) -> int:
        """Per invocation at most, as llvmpipe counts them (each loop its iterations and one more)."""
        return p.rank * (p.in_f + 1) + 1 + self.out_per * (p.rank + 1) + 1

    def dispatches(self, p: MixedLoraProblem) -> list:
        chunks = -(-p.out_f // self.out_per)
        return _dispatches(p, _kernel(self.out_per, private=True), flat_grid(-(-(p.n * chunks) // WG)))


def _dispatches(p: MixedLoraProblem, k: Kernel, groups: tuple) -> list:
    sizes = {"y": p.n * p.out_f, "x": p.n * p.in_f, "a_bank": p.k * p.rank * p.in_f,
             "b_bank": p.k * p.out_f * p.rank, "scales": p.k, "adapters": p.n}
    pipeline, resources = prepare(p.rt, k, [(p.t[name], sizes[name]) for name in k.names], n=p.n, in_f=p.in_f,
                                  out_f=p.out_f, rank=p.rank)
    return [(pipeline, resources, groups)]


def all_kernels() -> list[Kernel]:
    """Every kernel descriptor of the family (the binding-limit and Tint checks go through them)."""
    return [_kernel(c) for c in OUTPUTS] + [_kernel(c, private=True) for c in PRIVATE_OUTPUTS]


FAMILY = Family("mixed_lora", shaders=("mixed_lora",), modules=(__file__,), all_kernels=all_kernels,
                benches=("mixed_lora",))
