"""The attention kernel families and their candidates for one problem, timed by the same tuner as the GEMMs
(tune.choose): the flash kernels, register-blocked for CPU adapters (shaders/attention_regs.wgsl) and
workgroup-tiled for GPUs (shaders/attention_tiles.wgsl), and the per-row kernels they replace
(shaders/attention.wgsl: one to four queries per invocation, each with its own key range; the only ones for a
head dim that is not a multiple of 4). `AttentionProblem.candidates()` lists them best guess first.

llvmpipe (lavapipe, and llvmpipe through OpenGL) stops every loop of an invocation once all its loops
together have run 65535 iterations (gallivm's LP_MAX_TGSI_LOOP_ITERATIONS), silently: a kernel past that
budget gives wrong results. So on CPU adapters a candidate applies only while its loop count fits
(`loop_iterations`); the per-row kernels exceed it at T = 2048 (and at a few hundred for scalar head dims
of 60 and more with grouped heads).

Storage formats (device/storage.py): q, k, v, the output and their gradients may each be float32, bfloat16 or
float16 (every kernel reads and writes them through tensor markers, the vec4 kernels through vec4 views of them:
each kernel is built for its tensors' formats; arithmetic in float32); the statistics (lse, delta) are float32.
The formats are part of the tuner's key: each is tuned and checked apart.

Gemma 3's images (blocks): the tokens of an image block see each other both ways. The flash kernels take them as
(B, T) reaches and (B, T) block starts after the segment ids in the same binding (shaders/attention_common.wgsl,
`extents`), the uniform's s5 set; so do the scalar per-row kernels (for a head dim that is not a multiple of 4), not
their vec4 twins.
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.tuned import attention_source as src
from wgpu_train.engines.webgpu.tuned.attention_source import RegsConfig, TilesConfig
from wgpu_train.errors import DeviceError
from wgpu_train.engines.webgpu.tuned.adapter_traits import is_cpu
from wgpu_train.engines.webgpu.tuned.family import Family
from wgpu_train.engines.webgpu.device.launch import Kernel, prepare, tensor_formats
from wgpu_train.engines.webgpu.device.operands import split
from wgpu_train.engines.webgpu.device.runtime import shader_text

ROWS_WG = 64             # queries (or keys) per workgroup of the per-row kernels
ROWS_DMAX = 128          # their register arrays (shaders/attention.wgsl DMAX)

# The flash configurations tried, best guess first. CPU adapters: the register-blocked kernels (measured on
# llvmpipe, benchmarks/README.md; the first that fits a head dim is the untuned choice). GPUs: the
# workgroup-tiled ones, a guess until a GPU measures them: 16 or 32 invocations, fewer than 100 accumulators
# each at head dim 64, within 32 KiB of workgroup memory but for (16, 32, 1, 16).
REGS_CONFIGS = (RegsConfig(8, 8, 2), RegsConfig(8, 8, 1), RegsConfig(4, 8, 2), RegsConfig(2, 8, 1), RegsConfig(1, 8, 1))
TILES_CONFIGS = (TilesConfig(8, 32, 1, 16), TilesConfig(16, 32, 1, 16), TilesConfig(8, 32, 1, 8),
                 TilesConfig(16, 16, 1, 4))
MAX_HEAD_DIM = src.MAX_HEAD_DIM
CPU_LOOP_BUDGET = 65535  # llvmpipe's loop iterations per invocation (module docstring)
BIG = ("out", "q", "k", "v", "dq", "dk", "dv", "dout")      # the (B, T, H, D) tensors, in any storage format
# float32's part of a result's error is bounded as before; a 16-bit result adds its own rounding: at most the unit
# roundoff of its format times its magnitude (8 significant bits in bfloat16, 11 in float16)
UNIT_ROUNDOFF = {"f32": 0.0, "bf16": 2.0 ** -8, "f16": 2.0 ** -11}


def _aligned(D, *tensors) -> bool:
    """Whether the vec4 kernels apply: D and every (B, T, H, D) tensor's element offset divisible by 4 (a vec4
    view is a vec4<f32>, or two words of a 16-bit tensor)."""
    return D % 4 == 0 and all(split(t)[1] % 4 == 0 for t in tensors)


class AttentionProblem:
    """One attention pass as the kernels see it: "forward" (out, lse from q, k, v) or "backward" (dq, dk, dv
    from dout, q, k, v, out and the statistics: lse, then delta written by the first pass, back to back in one
    buffer), with its tensors (kernels.attention_forward's and attention_backward's arguments) and sizes."""

    def __init__(self, rt, pass_: str, tensors: dict, B, T, Hq, Hkv, D, window=0, softcap=0.0, blocks=False):
        self.rt, self.pass_, self.t = rt, pass_, tensors
        self.B, self.T, self.Hq, self.Hkv, self.D, self.window = B, T, Hq, Hkv, D, int(window)
        self.softcap = float(softcap)      # the scores' soft-cap (Gemma 2), 0 for none
        self.blocks = bool(blocks)         # segment_ids holds image blocks' extents too (module docstring)
        big = {n: t for n, t in tensors.items() if n in BIG}
        self.formats = {n: storage.format_of(split(t)[0]) for n, t in big.items()}     # name -> storage format
        self.aligned = _aligned(D, *big.values())
        wide = [n for n in ("lse", "stats") if n in tensors and storage.format_of(split(tensors[n])[0]) != "f32"]
        if wide:
            raise ValueError(f"attention: the statistics ({', '.join(wide)}) must be float32")
        halves = [n for n, fmt in self.formats.items() if fmt != "f32" and (D % 2 or split(big[n])[1] % 2)]
        if halves:      # two invocations would store the halves of one word (storage.py)
            raise ValueError(f"attention: 16-bit tensors ({', '.join(halves)}) need an even head dim (got {D}) and "
                             "even element offsets")

    @property
    def flops(self) -> float:
        """The causal work: 4 T^2 D Hq / 2 forward (QK^T, PV), 8 T^2 D Hq / 2 backward (QK^T, dP, dQ, dK, dV)."""
        return (2.0 if self.pass_ == "forward" else 4.0) * self.T * self.T * self.D * self.Hq * self.B

    def describe(self) -> str:
        return (f"attention {self.pass_} B{self.B} T{self.T} H{self.Hq}/{self.Hkv} D{self.D}"
                + (f" window {self.window}" if self.window else "") + (f" softcap {self.softcap:g}" if self.softcap else "")
                + (" image blocks" if self.blocks else ""))

    def signature(self) -> tuple:
        return ("attention", self.pass_, self.B, self.T, self.Hq, self.Hkv, self.D, self.window, self.softcap,
                self.aligned, tuple(sorted(self.formats.items())), self.blocks)

    def key(self) -> str:
        """The tuner's key: pass, rows bucket (next power of two of B * T), heads, D, window or not, soft-cap or
        not, alignment, then the storage formats unless all are float32 (one word when all are the same), then
        `blocks` with image blocks."""
        bucket = 1 << max(0, (self.B * self.T - 1).bit_length())
        kinds = set(self.formats.values())
        formats = ("" if kinds <= {"f32"} else f" {kinds.pop()}" if len(kinds) == 1 else
                   " " + ",".join(f"{n}:{fmt}" for n, fmt in sorted(self.formats.items())))
        return (f"attention {self.pass_} bt{bucket} h{self.Hq}/{self.Hkv} d{self.D}"
                f"{' window' if self.window else ''}{' softcap' if self.softcap else ''} "
                f"{'v4' if self.aligned else 'any'}{formats}{' blocks' if self.blocks else ''}")

    @property
    def rep(self) -> int:
        return self.Hq // self.Hkv

    def candidates(self) -> list:
        return candidates(self)

    def tolerance(self, want: np.ndarray, cand=None) -> float:
        """The largest error a correct candidate may make on the replica's results (float32 arithmetic over T
        keys, plus the rounding of its 16-bit outputs: the reference is exact, its inputs the rounded ones; every
        candidate's arithmetic is float32, so cand is not read)."""
        outputs = [n for n in ("out", "dq", "dk", "dv") if n in self.formats]
        top = float(np.max(np.abs(want)))
        return 1e-5 * math.sqrt(self.T) * 4 * (1 + top) + max(UNIT_ROUNDOFF[self.formats[n]] for n in outputs) * top

    def replica(self, rng):
        """(problem, result tensors, their initial values, their expected values, buffers to release): this
        shape and these storage formats on fresh random inputs (rounded to their formats), one segment per row
        (with blocks: an image block over the second quarter of each row).
        The results, in the order of the values: the outputs, then the float32 statistics (lse, and delta in the
        backward), in one buffer per run of outputs of one format, as (buffer, elements) pairs."""
        from wgpu_train.engines.shared import attention as ops

        B, T, Hq, Hkv, D, fmt = self.B, self.T, self.Hq, self.Hkv, self.D, self.formats
        q, k, v, dout = (storage.rounded(rng.standard_normal((B, T, h, D)).astype(np.float32), fmt.get(n, "f32"))
                         .reshape(B, T, h, D) for h, n in ((Hq, "q"), (Hkv, "k"), (Hkv, "v"), (Hq, "dout")))
        seg = np.ones((B, T), np.int32)
        blocks = None
        if self.blocks:
            blocks = np.full((B, T), -1, np.int32)
            blocks[:, T // 4:max(T // 2, T // 4 + 1)] = 0
        out, lse = ops.attention_forward(*(x.astype(np.float64) for x in (q, k, v)), seg, self.window, self.softcap,
                                         blocks=blocks)
        inputs = dict(q=q, k=k, v=v)
        if self.pass_ == "forward":
            outputs = dict(out=out, lse=lse)
        else:
            inputs.update(dout=dout, out=storage.rounded(out.astype(np.float32), fmt["out"]).reshape(out.shape))
            grads = ops.attention_backward(dout.astype(np.float64), q.astype(np.float64), k.astype(np.float64),
                                           v.astype(np.float64), inputs["out"].astype(np.float64), lse, seg,
                                           self.window, self.softcap, blocks=blocks)
            delta = np.einsum("bihd,bihd->bhi", dout.astype(np.float64), inputs["out"])
            outputs = dict(dq=grads[0], dk=grads[1], dv=grads[2], stats=np.concatenate([lse.ravel(), delta.ravel()]))
        tensors = {n: storage.upload(self.rt, x, fmt[n], "tune operand") for n, x in inputs.items()}
        tensors["segment_ids"] = self.rt.upload(seg if blocks is None else extents(seg, blocks), "tune operand")
        bufs, results = list(tensors.values()), []
        for f, run in itertools.groupby(outputs.items(), key=lambda item: fmt.get(item[0], "f32")):
            run = list(run)
            size = sum(x.size for _, x in run)
            buf = storage.set_format(self.rt.buffer(storage.nbytes(size, f), "tune result"), f)
            for (name, _), at in zip(run, np.cumsum([0] + [x.size for _, x in run])):
                tensors[name] = (buf, int(at))
            bufs.append(buf)
            results.append((buf, size))
        want = np.concatenate([x.ravel() for x in outputs.values()])
        c0 = np.zeros(want.size, np.float32)
        if self.pass_ == "backward":
            c0[want.size - 2 * lse.size:want.size - lse.size] = lse.ravel()    # the statistics' first half: lse
        rep = AttentionProblem(self.rt, self.pass_, tensors, B, T, Hq, Hkv, D, self.window, self.softcap,
                               self.blocks)
        return rep, results, c0, want, bufs


def _dispatch(p: AttentionProblem, make, groups) -> tuple:
    """(pipeline, resources, groups) of the kernel make(formats) on p's tensors, bound by the kernel's binding
    names, the kernel built for their storage formats (its vec4 views)."""
    big_q, big_kv, rows = p.B * p.T * p.Hq * p.D, p.B * p.T * p.Hkv * p.D, p.B * p.Hq * p.T
    sizes = {"out": big_q, "q": big_q, "dq": big_q, "dout": big_q, "k": big_kv, "v": big_kv, "dk": big_kv,
             "dv": big_kv, "lse": rows, "stats": 2 * rows, "segment_ids": (3 if p.blocks else 1) * p.B * p.T}
    k = make(())
    tensors = [(p.t[n], sizes[n]) for n in k.names]
    k = make(tensor_formats(k, tensors))
    pipeline, resources = prepare(p.rt, k, tensors, s0=p.B, s1=p.T, s2=p.Hq, s3=p.Hkv, s4=p.window,
                                  s5=int(p.blocks), f0=1.0 / math.sqrt(p.D), f1=p.softcap)
    return pipeline, resources, groups


# ---- the per-row family (shaders/attention.wgsl) ------------------------------------------------------

# (pass, vec4) -> (entry, bindings, heads per workgroup row) of each dispatch of the per-row kernels
_ROWS_PASSES = {
    ("forward", False): [("attention_forward", "out! lse! q k v segment_ids", "q")],
    ("forward", True): [("attention_forward_vec4", "out! lse! q k v segment_ids", "q")],
    ("backward", False): [("attention_backward_delta", "stats! dout out", "q"),
                          ("attention_backward", "dq! dout q k v stats segment_ids", "q"),
                          ("attention_backward_dkv", "dk! dv! dout q k v stats segment_ids", "kv")],
    ("backward", True): [("attention_backward_vec4", "dq! dout q k v stats! segment_ids out", "q"),
                         ("attention_backward_dkv_vec4", "dk! dv! dout q k v stats segment_ids", "kv")],
}


@functools.lru_cache(maxsize=None)
def rows_source(formats: tuple = ()) -> str:
    """shaders/attention.wgsl with the vec4 views of its 16-bit tensors' (binding, format) pairs declared."""
    return storage.views(shader_text("attention"), formats)


@functools.lru_cache(maxsize=None)
def _rows_kernel(entry: str, bindings: str, D: int, formats: tuple = ()) -> Kernel:
    return Kernel("attention", entry, bindings, (("D", D),), source=(rows_source, formats), formats=formats)


class Rows:
    """The per-row kernels: each invocation streams the keys (or queries) its own rows may see."""

    family = "rows"

    def __init__(self, vec4: bool):
        self.vec4 = vec4
        self.name = "rows/vec4" if vec4 else "rows/scalar"

    def applies(self, p: AttentionProblem) -> bool:
        return (p.D <= ROWS_DMAX and (p.aligned or not self.vec4) and not (p.blocks and self.vec4)
                and (not is_cpu(p.rt) or self.loop_iterations(p) <= CPU_LOOP_BUDGET))

    def loop_iterations(self, p: AttentionProblem) -> int:
        """Per invocation at most, the dk / dv pass: every query of every head of the group, two loops over D."""
        d = p.D // 4 if self.vec4 else p.D
        return p.T * p.rep * (2 * d + 2) + 2 * d

    def kernels(self, pass_: str, D: int) -> list:
        """(kernel, heads: "q" or "kv") of each dispatch of a pass, in order, for float32 tensors."""
        return [(_rows_kernel(entry, bindings, D), heads) for entry, bindings, heads in _ROWS_PASSES[pass_, self.vec4]]

    def dispatches(self, p: AttentionProblem) -> list:
        tq = -(-p.T // ROWS_WG)
        return [_dispatch(p, functools.partial(_rows_kernel, entry, bindings, p.D),
                          (tq, p.Hq if heads == "q" else p.Hkv, p.B))
                for entry, bindings, heads in _ROWS_PASSES[p.pass_, self.vec4]]


# ---- the flash families (shaders/attention_regs.wgsl, shaders/attention_tiles.wgsl) --------------------

_FLASH_BINDINGS = {"forward": "out! lse! q k v segment_ids",
                   "dq": "dq! dout q k v stats! segment_ids out",
                   "dkv": "dk! dv! dout q k v stats segment_ids"}


@functools.lru_cache(maxsize=None)
def flash_kernel(pass_: str, cfg, D: int, formats: tuple = ()) -> Kernel:
    """One pass of cfg's kernels; formats: its 16-bit tensors' sorted (binding, format) pairs."""
    return Kernel(cfg.shader, src.ENTRIES[pass_], _FLASH_BINDINGS[pass_],
                  source=(src.source, cfg, pass_, D, formats), invocations=cfg.lanes,
                  workgroup_bytes=cfg.workgroup_bytes(pass_), formats=formats)


class Flash:
    """A flash candidate (cfg: attention_source.RegsConfig or TilesConfig): cfg.block rows per workgroup, the
    other side in whole tiles, fully masked tiles skipped."""

    def __init__(self, cfg):
        self.cfg, self.name, self.family = cfg, cfg.name, cfg.name.split("/")[0]

    def applies(self, p: AttentionProblem) -> bool:
        return (p.aligned and self.cfg.fits(p.D)
                and (not is_cpu(p.rt) or self.cfg.loop_iterations(p.T, p.rep, p.D) <= CPU_LOOP_BUDGET)
                and all(flash_kernel(x, self.cfg, p.D).supported(p.rt) for x in src.PASSES))

    def _one(self, p, pass_, heads):
        return _dispatch(p, functools.partial(flash_kernel, pass_, self.cfg, p.D),
                         (-(-p.T // self.cfg.block), heads, p.B))

    def dispatches(self, p: AttentionProblem) -> list:
        if p.pass_ == "forward":
            return [self._one(p, "forward", p.Hq)]
        return [self._one(p, "dq", p.Hq), self._one(p, "dkv", p.Hkv)]


def candidates(p: AttentionProblem) -> list:
    """Every candidate that can run p on its device, the default (untuned) choice first: the flash kernels
    (register-blocked first on CPU adapters, workgroup-tiled first on GPUs), then the per-row kernels."""
    cpu, gpu = [Flash(c) for c in REGS_CONFIGS], [Flash(c) for c in TILES_CONFIGS]
    flash = cpu + gpu if is_cpu(p.rt) else gpu + cpu
    out = [c for c in flash + [Rows(True), Rows(False)] if c.applies(p)]
    if not out:
        if p.D % 4 and p.D > ROWS_DMAX:
            why = "the head dim must be a multiple of 4 above 128"
        elif is_cpu(p.rt):
            why = "its sequences are too long for this CPU adapter's loop limit; use a shorter --max-seq-len or a GPU"
        else:
            why = "its tensors are not 4-aligned and the head dim is over 128"
        raise DeviceError(f"no attention kernel runs {p.describe()} on {p.rt.info.name}: {why}")
    return out


# gpt-oss's sinks around whichever candidate ran (shaders/attention_sinks.wgsl): the forward's rescale of out and
# lse, and the sinks' gradient from the backward's statistics
SINK_FORWARD = Kernel("attention_sinks", "attention_sink_forward", "out! stats! sinks", invocations=64)
SINK_BACKWARD = Kernel("attention_sinks", "attention_sink_backward", "out! stats sinks", invocations=64)
def extents(segment_ids, blocks) -> np.ndarray:
    """The segment ids' binding of a problem with image blocks: segment_ids (B, T), then each token's reach (the
    last position it sees: its block's last, or its own), then each token's block start (its own outside a block),
    (3, B, T) i32. blocks (B, T): a block number per image token (runs of positions), -1 for text."""
    b, t = blocks.shape
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    reach, start = pos.copy(), pos.copy()
    for r in range(b):
        for n in np.unique(blocks[r][blocks[r] >= 0]):
            at = np.flatnonzero(blocks[r] == n)
            reach[r, at], start[r, at] = at[-1], at[0]
    return np.stack([np.asarray(segment_ids, np.int32), reach, start]).astype(np.int32)


def supported_head_dim(D: int) -> bool:
    """Whether some attention kernel takes this head dim (on some device)."""
    return 0 < D <= MAX_HEAD_DIM and (D % 4 == 0 or D <= ROWS_DMAX)


def mixed_formats(k: Kernel) -> list[tuple]:
    """Two mixes of 16-bit formats for kernel k's (B, T, H, D) tensors that together give each of them both
    bfloat16 and float16 (its statistics and segment ids stay float32 and i32)."""
    slots = [slot for slot, name in zip(k.slots, k.names) if name in BIG]
    return [tuple((slot, ("bf16", "f16")[(i + j) % 2]) for i, slot in enumerate(slots)) for j in (0, 1)]


def all_kernels(head_dims=(64, 60, 128, 256), mixed_head_dims=(64,)) -> list[Kernel]:
    """Every kernel descriptor of the attention families at these head dims, each also in two mixes of 16-bit
    formats at mixed_head_dims (mixed_formats) (the binding-limit and Tint checks go through them)."""
    out = [SINK_FORWARD, SINK_FORWARD.with_formats(((1, "bf16"),)), SINK_FORWARD.with_formats(((1, "f16"),)),
           SINK_BACKWARD]
    for D in head_dims:
        mixed = D in mixed_head_dims
        for rows in (Rows(False), Rows(True)):
            if D <= ROWS_DMAX and (D % 4 == 0 or not rows.vec4):
                for k, _ in rows.kernels("forward", D) + rows.kernels("backward", D):
                    out += [k] + [_rows_kernel(k.entry, k.bindings, D, f) for f in mixed_formats(k) if mixed]
        for cfg in REGS_CONFIGS + TILES_CONFIGS:
            for pass_ in src.PASSES if cfg.fits(D) else ():
                k = flash_kernel(pass_, cfg, D)
                out += [k] + [flash_kernel(pass_, cfg, D, f) for f in mixed_formats(k) if mixed]
    return out


FAMILY = Family("attention", shaders=("attention", "attention_regs", "attention_tiles", src.COMMON, "attention_sinks"),
                modules=(__file__, src.__file__), all_kernels=all_kernels, benches=("attention",))
