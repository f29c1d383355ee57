"""The chunked gated delta rule's kernel family (shaders/delta_rule.wgsl): the forward and backward dispatch plans of
one candidate (a chunk of 16, 32 or 64 positions and a spread of the scans' (Dk, Dv) state over invocations), the
tuner's problem (timed on the forward, checked against engines/shared/delta_rule.py), the scratch layout, and the
plain kernels (the single-token step, the l2norm pair). The op wrappers are engines/webgpu/delta_rule.py.

Plan of one forward: runs (segment starts per row), gamma (the chunk-local cumulative log-decay, run tags, masked
beta), gram (L and (Q K^T) o E per chunk), solve (W_v, W_k by forward substitution), the scan over chunks (the
only sequential part: writes every chunk's entering state and U = W_v - W_k S0), output. The backward recomputes
runs .. solve and U from the stored states, then dU's state-free part, the reverse scan (dS per chunk, dU), the
back substitution (dR), the (C, C) gradients, the per-(position, key dim) gradients, the per-position ones, dg's
reverse cumulative sum per chunk, and the key heads' sums over their groups (in order: no float atomics).

llvmpipe ends every loop of an invocation after 65535 iterations in all, silently: on CPU adapters a scan dispatch
covers only as many chunks as fit (scan_chunks), the runs kernel as many positions; every other kernel loops
O(C + Dk + Dv) times per invocation.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import Kernel, flat_grid, prepare
from wgpu_train.engines.webgpu.device.operands import split
from wgpu_train.engines.webgpu.tuned import delta_rule_source as src
from wgpu_train.engines.webgpu.tuned.adapter_traits import is_cpu
from wgpu_train.engines.webgpu.tuned.attention_kernels import CPU_LOOP_BUDGET
from wgpu_train.engines.webgpu.tuned.delta_rule_source import ScanConfig
from wgpu_train.engines.webgpu.tuned.family import Family

WG = 64                      # invocations per workgroup of the parallel kernels (shaders/delta_rule.wgsl WG)
CHUNKS = (64, 32, 16)
CPU_SCANS = (ScanConfig(1, 8), ScanConfig(1, 32))                     # private: no workgroup memory, no barrier
GPU_SCANS = (ScanConfig(8, 32), ScanConfig(4, 32), ScanConfig(1, 64))  # state rows spread over 8 / 4 lanes
LOOP_MARGIN = 64             # iterations kept free of llvmpipe's budget
RUNS_PASS = 32768            # positions per pass of the runs kernel
GPU_SCAN_CHUNKS = 512        # chunks per scan dispatch on GPUs (a long dispatch trips watchdogs)
HAS_SEG, HAS_INIT = 1, 2
MAX_DIM = 256                # head dims up to this (the scans' register arrays)
FORWARD_REGIONS = ("fl", "gt", "r0", "r1", "wv", "wk", "u")
BACKWARD_REGIONS = FORWARD_REGIONS + ("r2", "r3", "du", "ds", "p3", "dq", "dk", "dg", "al")


def n_chunks(T: int, chunk: int) -> int:
    return -(-int(T) // int(chunk))


def region_sizes(B: int, T: int, Hv: int, Dk: int, Dv: int, chunk: int) -> dict:
    """Elements of each scratch region (float32 words) for chunk `chunk`; the shader names them r_<region>."""
    bh, tp = B * Hv, n_chunks(T, chunk) * chunk
    cc = bh * tp * chunk
    return {"fl": B * tp + B, "gt": 3 * bh * tp, "r0": cc, "r1": cc, "wv": bh * tp * Dv, "wk": bh * tp * Dk,
            "u": bh * tp * Dv, "r2": cc, "r3": cc, "du": bh * tp * Dv, "ds": bh * n_chunks(T, chunk) * Dk * Dv,
            "p3": 3 * bh * tp * Dk, "dq": bh * tp * Dk, "dk": bh * tp * Dk, "dg": 2 * bh * tp,
            "al": bh * n_chunks(T, chunk) * Dk}


def scratch_layout(B: int, T: int, Hv: int, Dk: int, Dv: int, chunk: int, backward: bool) -> dict:
    """{r_<region>: element offset} of the forward's (or the backward's) regions, and "size": the elements in all."""
    sizes = region_sizes(B, T, Hv, Dk, Dv, chunk)
    out, at = {}, 0
    for name in BACKWARD_REGIONS if backward else FORWARD_REGIONS:
        out[f"r_{name}"] = at
        at += sizes[name]
    out["size"] = at
    return out


@functools.lru_cache(maxsize=None)
def kernel(entry: str, bindings: str, chunk: int, dk: int, dv: int, scan: ScanConfig = ScanConfig(1, WG)) -> Kernel:
    """One entry point of shaders/delta_rule.wgsl built for these constants (scan: the scans' spread; the other
    entry points run WG invocations a workgroup)."""
    scans = entry.startswith("dr_scan")
    return Kernel("delta_rule", entry, bindings, source=(src.source, chunk, dk, dv, scan.ks, scan.cb),
                  invocations=scan.invocations if scans else WG, workgroup_bytes=scan.workgroup_bytes if scans else 0)


# (entry, bindings) of each kernel: sc is the scratch, w2 / w3 outputs, t4..t8 inputs, seg the segment ids
RUNS = ("dr_runs", "sc! _ _ _ _ _ _ _ seg")
GAMMA = ("dr_gamma", "sc! _ _ _ _ _ g beta")
GRAM = ("dr_gram", "sc! _ _ q k")
SOLVE = ("dr_solve", "sc! _ _ _ k v")
SCAN = ("dr_scan", "sc! states! final_state! _ k _ initial_state")
OUTPUT = ("dr_output", "sc out! _ q _ _ states")
U = ("dr_u", "sc! _ _ _ _ _ states")
DU0 = ("dr_du0", "sc! _ _ _ _ _ dout")
SCAN_BACK = ("dr_scan_back", "sc! _ d_initial_state! q k _ dout")
SOLVE_BACK = ("dr_solve_back", "sc!")
DGRAM = ("dr_dgram", "sc! _ _ _ k _ dout")
DQK = ("dr_dqk", "sc! _ _ q k _ dout states")
DTOK = ("dr_dtok", "sc! dv! dbeta! q k v")
DG = ("dr_dg", "sc! dg!")
GROUP = ("dr_group", "sc dq! dk!")
STEP = ("dr_step", "_ out! state! q k v g beta")
L2NORM_FORWARD = ("l2norm_forward", "_ y! inv_norm! x")
L2NORM_BACKWARD = ("l2norm_backward", "_ dx! _ dy y inv_norm")
CHUNKED = (RUNS, GAMMA, GRAM, SOLVE, SCAN, OUTPUT, U, DU0, SCAN_BACK, SOLVE_BACK, DGRAM, DQK, DTOK, DG, GROUP)


def plain_kernel(spec: tuple, dk: int, dv: int = 1) -> Kernel:
    """The step (dk, dv: the head dims) or an l2norm kernel (dk: the vector's length)."""
    return kernel(*spec, 1, dk, dv)


def zeros(rt):
    """One float32 zero: the binding of an absent initial state or segment ids (the flags tell the kernels)."""
    return rt.memo("delta_rule.zero", lambda r: r.upload(np.zeros(4, np.float32), "delta_rule.zero"))


class DeltaRuleProblem:
    """One chunked gated delta rule over a batch as the kernels see it (the op wrappers' tensors by name: out,
    final_state, states, q, k, v, g, beta, scratch, initial_state, segments, and for the backward dq, dk, dv, dg,
    dbeta, d_initial_state, dout), sizes, and the chunk the caller sized its states for (None: any; the tuner then
    picks the chunk too). Hk and Hv count the heads it covers; head_strides (key, value): the (B, T, H, D) tensors'
    heads where those are views of a range of whole key-head groups (the wrappers' passes over heads), else Hk, Hv."""

    def __init__(self, rt, tensors: dict, B, T, Hk, Hv, Dk, Dv, chunk=None, head_strides=None):
        self.rt, self.t = rt, tensors
        self.B, self.T, self.Hk, self.Hv, self.Dk, self.Dv = B, T, Hk, Hv, Dk, Dv
        self.chunk = chunk
        self.hks, self.hvs = head_strides or (Hk, Hv)
        self.formats = {n: storage.format_of(split(t)[0]) for n, t in tensors.items() if n in ("q", "k", "v", "g", "beta")}

    @property
    def flops(self) -> float:
        """The forward's work at chunk 64: the intra-chunk products (Q K^T, K K^T, the substitution, the output's
        (Q K^T) U) and the state's (W_k S0, K^T U, Q S0)."""
        c = 64
        return 2.0 * self.B * self.Hv * self.T * (c * self.Dk + c * (self.Dk + self.Dv) / 2 + c * self.Dv / 2
                                                 + 3 * self.Dk * self.Dv)

    def describe(self) -> str:
        return (f"gated delta rule B{self.B} T{self.T} H{self.Hk}/{self.Hv} Dk{self.Dk} Dv{self.Dv}"
                + (f" chunk {self.chunk}" if self.chunk else ""))

    def signature(self) -> tuple:
        return ("delta_rule", self.B, self.T, self.Hk, self.Hv, self.Dk, self.Dv, self.chunk,
                tuple(sorted(self.formats.items())))

    def key(self) -> str:
        """The tuner's key: rows bucket (next power of two of B T), heads, dims, chunk (or any), formats."""
        bucket = 1 << max(0, (self.B * self.T - 1).bit_length())
        kinds = set(self.formats.values()) - {"f32"}
        return (f"delta_rule bt{bucket} h{self.Hk}/{self.Hv} dk{self.Dk} dv{self.Dv} chunk{self.chunk or 'any'}"
                + ("" if not kinds else " " + ",".join(f"{n}:{f}" for n, f in sorted(self.formats.items()))))

    def candidates(self) -> list:
        return candidates(self)

    def tolerance(self, want: np.ndarray, cand=None) -> float:
        """float32 against the float64 reference: sums of C + Dk terms per intra-chunk product, the substitution's
        C rows, the state carried over the chunks (each chunk's error decays with the state)."""
        return 2e-5 * math.sqrt(64 + self.Dk + self.Dv) * (1 + float(np.max(np.abs(want))))

    def replica(self, rng):
        """This shape on random inputs (l2-normalised q and k, g in (-1, 0), beta in (0, 1), one segment per row):
        (problem, out's buffer, zeros, the reference's out, buffers to release), scratch and states sized for the
        largest any candidate needs."""
        from wgpu_train.engines.shared import delta_rule as ref

        B, T, Hk, Hv, Dk, Dv = self.B, self.T, self.Hk, self.Hv, self.Dk, self.Dv
        q = ref.l2norm_forward(rng.standard_normal((B, T, Hk, Dk)))[0]
        k = ref.l2norm_forward(rng.standard_normal((B, T, Hk, Dk)))[0]
        v = rng.standard_normal((B, T, Hv, Dv))
        g = -rng.uniform(0.0, 1.0, (B, T, Hv))
        beta = rng.uniform(0.0, 1.0, (B, T, Hv))
        inputs = dict(q=q, k=k, v=v, g=g, beta=beta)
        inputs = {n: storage.rounded(x.astype(np.float32), self.formats.get(n, "f32")).reshape(x.shape)
                  for n, x in inputs.items()}
        want = ref.gated_delta_rule_forward(*(inputs[n].astype(np.float64) for n in ("q", "k", "v", "g", "beta")),
                                            self.chunk or min(CHUNKS))[0]
        chunks = (self.chunk,) if self.chunk else CHUNKS
        scratch = max(scratch_layout(B, T, Hv, Dk, Dv, c, False)["size"] for c in chunks)
        states = max(B * Hv * n_chunks(T, c) * Dk * Dv for c in chunks)
        t = {n: storage.upload(self.rt, x.reshape(-1), self.formats.get(n, "f32"), "tune operand")
             for n, x in inputs.items()}
        t["out"] = self.rt.buffer(4 * B * T * Hv * Dv, "tune result")
        t["final_state"] = self.rt.buffer(4 * B * Hv * Dk * Dv, "tune result")
        t["states"] = self.rt.buffer(4 * states, "tune scratch")
        t["scratch"] = self.rt.buffer(4 * scratch, "tune scratch")
        rep = DeltaRuleProblem(self.rt, t, B, T, Hk, Hv, Dk, Dv, self.chunk)
        return rep, t["out"], np.zeros(want.size, np.float32), want.reshape(-1), list(t.values())


def candidates(p: DeltaRuleProblem) -> list:
    """Every (chunk, scan spread) that runs p on its device, the default first: on CPU adapters the private scans
    (chunk 16 first: on lavapipe the fastest of the three at the bench's shapes, benchmarks/README.md), on GPUs the
    shared ones (chunk 64 first, a guess until a GPU measures them) then the private. A spread applies while its workgroup
    memory and invocations fit the adapter (the portable ones fit WebGPU's defaults)."""
    if not (0 < p.Dk <= MAX_DIM and 0 < p.Dv <= MAX_DIM):
        raise ValueError(f"the gated delta rule's kernels take head dims 1..{MAX_DIM}, got {p.Dk} x {p.Dv}")
    cpu = is_cpu(p.rt)
    chunks = (p.chunk,) if p.chunk else ((16, 32, 64) if cpu else CHUNKS)
    scans = CPU_SCANS + GPU_SCANS if cpu else GPU_SCANS + CPU_SCANS
    out = [Chunked(c, s) for c in chunks for s in scans]
    return [c for c in out if c.applies(p)]


def _dispatch(p, spec, chunk, scan, groups, tensors: dict, **params):
    k = kernel(*spec, chunk, p.Dk, p.Dv, scan) if spec in (SCAN, SCAN_BACK) else kernel(*spec, chunk, p.Dk, p.Dv)
    pipeline, resources = prepare(p.rt, k, [tensors[n] for n in k.names], **params)
    return pipeline, resources, groups


class Chunked:
    """A candidate: chunk C and the scans' ScanConfig; its forward and backward dispatch plans."""

    def __init__(self, chunk: int, scan: ScanConfig):
        self.chunk, self.scan = chunk, scan
        self.name = f"delta_rule/c{chunk}/{scan.name}"
        self.family = "shared" if scan.ks > 1 else "private"

    def applies(self, p: DeltaRuleProblem) -> bool:
        k = kernel(*SCAN, self.chunk, p.Dk, p.Dv, self.scan)
        fits = k.supported(p.rt) and self.scan.ks <= p.Dk
        return fits and (not is_cpu(p.rt) or self.scan_chunks(p) >= 1)

    def loop_iterations(self, p: DeltaRuleProblem, chunks: int) -> int:
        """A scan invocation's loop iterations over `chunks` chunks, as llvmpipe counts them (each loop its
        iterations and one more): the state's load and store, then per chunk its rows' two passes and the sum."""
        rows, c = self.scan.rows(p.Dk), self.chunk
        per_row = 2 * (rows + 1) + (self.scan.ks + 1 if self.scan.ks > 1 else 0) + 1
        per_chunk = 1 + 2 * (rows + 1) + (c + 1) + c * per_row
        return 2 * (rows + 1) + chunks * per_chunk + 1

    def scan_chunks(self, p: DeltaRuleProblem) -> int:
        """Chunks per scan dispatch: within llvmpipe's budget on CPU adapters, GPU_SCAN_CHUNKS elsewhere."""
        if not is_cpu(p.rt):
            return GPU_SCAN_CHUNKS
        one = self.loop_iterations(p, 1) - self.loop_iterations(p, 0)
        return (CPU_LOOP_BUDGET - LOOP_MARGIN - self.loop_iterations(p, 0)) // one

    def _common(self, p: DeltaRuleProblem, backward: bool):
        """(tensors by binding name, Params, the dispatches shared by both passes: runs .. solve)."""
        B, T, Hk, Hv, Dk, Dv, C = p.B, p.T, p.Hk, p.Hv, p.Dk, p.Dv, self.chunk
        n = n_chunks(T, C)
        layout = scratch_layout(B, T, Hv, Dk, Dv, C, backward)
        zero = (zeros(p.rt), 1)
        bh, tp = B * Hv, n * C
        last = B * T - 1             # the views' spans: to the last (row, position)'s last head covered
        keys, values, heads = (last * p.hks + Hk) * Dk, (last * p.hvs + Hv) * Dv, last * p.hvs + Hv
        sizes = {"q": keys, "k": keys, "v": values, "g": heads, "beta": heads, "out": values, "dout": values,
                 "states": bh * n * Dk * Dv, "final_state": bh * Dk * Dv, "initial_state": bh * Dk * Dv,
                 "d_initial_state": bh * Dk * Dv, "segments": B * T, "dq": keys, "dk": keys, "dv": values,
                 "dg": heads, "dbeta": heads, "scratch": layout["size"]}
        tensors = {name: (t, sizes[name]) if t is not None else zero for name, t in p.t.items() if name in sizes}
        tensors["sc"] = tensors.pop("scratch")
        tensors["seg"] = tensors.pop("segments", zero)
        tensors.setdefault("initial_state", zero)
        tensors.setdefault("d_initial_state", zero)
        has_init = p.t.get("initial_state") is not None or p.t.get("d_initial_state") is not None
        flags = HAS_SEG * int(p.t.get("segments") is not None) + HAS_INIT * int(has_init)
        params = dict(b=B, t=T, hk=Hk, hv=Hv, hks=p.hks, hvs=p.hvs, n=n, rep=Hv // Hk, flags=flags,
                      scale=1.0 / math.sqrt(Dk), **{name: v for name, v in layout.items() if name != "size"})
        d = functools.partial(_dispatch, p, chunk=C, scan=self.scan, tensors=tensors)
        out = [d(RUNS, groups=flat_grid(-(-B // WG)), t0=t0, t1=min(tp, t0 + RUNS_PASS), **params)
               for t0 in range(0, tp, RUNS_PASS)]
        out.append(d(GAMMA, groups=flat_grid(-(-(bh * n) // WG)), **params))
        out.append(d(GRAM, groups=flat_grid(-(-(bh * n * C * C) // WG)), **params))
        out.append(d(SOLVE, groups=flat_grid(-(-(bh * n * (Dv + Dk)) // WG)), **params))
        return d, params, out

    def _scans(self, d, spec, p, params, reverse: bool) -> list:
        n, step = params["n"], self.scan_chunks(p)
        groups = (p.B * p.Hv * -(-p.Dv // self.scan.cb),)
        ranges = [(c0, min(n, c0 + step)) for c0 in range(0, n, step)]
        return [d(spec, groups=groups, **{**params, "c0": c0, "c1": c1})
                for c0, c1 in (reversed(ranges) if reverse else ranges)]

    def dispatches(self, p: DeltaRuleProblem) -> list:
        """The forward: out, final_state, states (and the forward's scratch regions)."""
        d, params, out = self._common(p, backward=False)
        out += self._scans(d, SCAN, p, params, reverse=False)
        out.append(d(OUTPUT, groups=flat_grid(-(-(p.B * p.Hv * p.T * p.Dv) // WG)), **params))
        return out

    def backward_dispatches(self, p: DeltaRuleProblem) -> list:
        """The backward: dq, dk, dv, dg, dbeta (and d_initial_state where given) from dout and the stored states."""
        d, params, out = self._common(p, backward=True)
        bh, n, C, Dk, Dv = p.B * p.Hv, params["n"], self.chunk, p.Dk, p.Dv
        out.append(d(U, groups=flat_grid(-(-(bh * n * C * Dv) // WG)), **params))
        out.append(d(DU0, groups=flat_grid(-(-(bh * n * C * Dv) // WG)), **params))
        out += self._scans(d, SCAN_BACK, p, params, reverse=True)
        out.append(d(SOLVE_BACK, groups=flat_grid(-(-(bh * n * Dv) // WG)), **params))
        out.append(d(DGRAM, groups=flat_grid(-(-(bh * n * C * C) // WG)), **params))
        out.append(d(DQK, groups=flat_grid(-(-(bh * n * C * Dk) // WG)), **params))
        out.append(d(DTOK, groups=flat_grid(-(-(bh * n * C) // WG)), **params))
        out.append(d(DG, groups=flat_grid(-(-(bh * n) // WG)), **params))
        out.append(d(GROUP, groups=flat_grid(-(-(p.B * p.T * p.Hk * Dk) // WG)), **params))
        return out


def all_kernels(dims=((128, 128), (12, 20))) -> list[Kernel]:
    """Every kernel descriptor of the family at these head dims (Qwen3-Next's and a small odd pair), every chunk
    and scan spread (the binding-limit and Tint checks go through them)."""
    out = []
    for dk, dv in dims:
        for c in CHUNKS:
            for scan in CPU_SCANS + GPU_SCANS:
                out += [kernel(*spec, c, dk, dv, scan) for spec in (SCAN, SCAN_BACK)]
            out += [kernel(*spec, c, dk, dv) for spec in CHUNKED if spec not in (SCAN, SCAN_BACK)]
        out += [plain_kernel(STEP, dk, dv), plain_kernel(L2NORM_FORWARD, dk), plain_kernel(L2NORM_BACKWARD, dk)]
    return out


FAMILY = Family("delta_rule", shaders=("delta_rule",), modules=(__file__, src.__file__), all_kernels=all_kernels,
                benches=("linear_attention",))
