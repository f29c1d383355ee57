"""Kernel benchmarks for `wgpu-train bench`: each figure is reported next to the adapter's own fp32 FMA
peak measured in the same run (and GEMM also next to a naive shared-memory kernel), never alone.

Kernel families register a function in BENCHES: `fn(rt, ctx) -> list[dict]`, where each dict has at least
"name", "shape" and "gflops" (or "gbps"); `run_bench` adds "fraction_of_peak". `ctx` carries the
measured peak ("fma_peak_gflops") and anything one bench wants to share with a later one.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from . import gemm as _gemm

BENCHES: dict[str, Callable] = {}


def register(name: str):
    """Decorator: add a bench function under `name` (run in registration order; `only` filters by prefix)."""
    def deco(fn):
        BENCHES[name] = fn
        return fn
    return deco


# ---- timing ------------------------------------------------------------------------------------

class Timer:
    """Times a recorded sequence of dispatches on the device: timestamp queries around one compute pass
    when the adapter has them, else the wall clock of submit + a tiny readback (which includes the
    ~0.2 ms submit/readback overhead, so wall-clock figures are lower bounds on kernel speed)."""

    def __init__(self, rt):
        self.rt = rt
        wgpu = rt.wgpu
        self.use_ts = rt.has_timestamps
        self._sync = rt.buffer(4, "bench.sync")
        if self.use_ts:
            self.qs = rt.device.create_query_set(type="timestamp", count=2)
            self.resolve = rt.device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)

    def _run_once(self, dispatches) -> float:
        rt = self.rt
        enc = rt.device.create_command_encoder()
        kw = {}
        if self.use_ts:
            kw["timestamp_writes"] = {"query_set": self.qs, "beginning_of_pass_write_index": 0,
                                      "end_of_pass_write_index": 1}
        cp = enc.begin_compute_pass(**kw)
        for pipeline, resources, groups in dispatches:
            cp.set_pipeline(pipeline)
            cp.set_bind_group(0, rt.bind_group(pipeline, resources))
            cp.dispatch_workgroups(*groups)
        cp.end()
        if self.use_ts:
            enc.resolve_query_set(self.qs, 0, 2, self.resolve, 0)
        t0 = time.perf_counter()
        rt.queue.submit([enc.finish()])
        if self.use_ts:
            ts = np.frombuffer(rt.queue.read_buffer(self.resolve), dtype=np.uint64)
            dt = (int(ts[1]) - int(ts[0])) * 1e-9
            if dt > 0:
                return dt
        rt.queue.read_buffer(self._sync)  # waits for the submitted work
        return time.perf_counter() - t0

    def time(self, dispatches, repeats: int = 3, budget_s: float = 2.0) -> float:
        """Best seconds for one run of `dispatches` [(pipeline, resources, (gx, gy, gz))], after a warm-up
        run (which also pays shader JIT compilation on software adapters). The machines are shared
        and noisy, so the minimum is the fairest estimate of what the kernel can do."""
        start = time.perf_counter()
        best = float("inf")
        self._run_once(dispatches)
        for _ in range(repeats):
            best = min(best, self._run_once(dispatches))
            if time.perf_counter() - start > budget_s:
                break
        return best


def _groups(g):
    g = tuple(int(x) for x in (g if isinstance(g, (tuple, list)) else (g,)))
    return g + (1,) * (3 - len(g))


# ---- FMA peak ----------------------------------------------------------------------------------

FMA_ITERS = 256        # loop trips per invocation; keep in step with shaders/bench_fma.wgsl's uniform
FMA_CHAINS = 8         # independent vec4 chains per invocation (8 * 4 lanes of FMA in flight)


def fma_peak(rt, timer: Timer | None = None, invocations: int = 64 * 1024) -> float:
    """The adapter's fp32 FMA throughput in GFLOP/s (2 flops per FMA), from many independent chains."""
    timer = timer or Timer(rt)
    p = rt.pipeline("bench_fma", "fma_peak")
    out = rt.buffer(invocations * 16, "bench.fma_out")
    params = rt.uniform("<I", FMA_ITERS)
    t = timer.time([(p, [params, out], _groups(invocations // 64))], repeats=3)
    flops = invocations * FMA_ITERS * FMA_CHAINS * 4 * 2
    return flops / t / 1e9


# ---- GEMM --------------------------------------------------------------------------------------

GEMM_SHAPES = [(1024, 1024, 1024), (512, 576, 64), (512, 64, 576), (512, 1536, 576)]  # (M, N, K)


def _gemm_case(rt, timer, layout, m, n, k, rng):
    a_shape = (m, k) if layout[0] == "n" else (k, m)
    b_shape = (k, n) if layout[1] == "n" else (n, k)
    a = rng.standard_normal(a_shape, dtype=np.float32)
    b = rng.standard_normal(b_shape, dtype=np.float32)
    ab, bb, cb = rt.upload(a), rt.upload(b), rt.buffer(m * n * 4)
    plan = _gemm.plan(rt, m, n, k, layout=layout)
    dispatches = [(plan.pipeline, plan.resources(cb, ab, bb, None), plan.groups)]
    t = timer.time(dispatches)
    # check after timing so the result is that of the timed kernel
    got = rt.read(cb, np.float32, (m, n))
    want = (a if layout[0] == "n" else a.T) @ (b if layout[1] == "n" else b.T)
    err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
    rt.release(ab, bb, cb)
    return t, err


def _naive_case(rt, timer, m, n, k, rng):
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    ab, bb, cb = rt.upload(a), rt.upload(b), rt.buffer(m * n * 4)
    p = rt.pipeline("bench_gemm_naive", "gemm_naive16")
    params = rt.uniform("<4I", m, n, k, 0)
    t = timer.time([(p, [params, ab, bb, cb], ((n + 15) // 16, (m + 15) // 16, 1))], repeats=1)
    got = rt.read(cb, np.float32, (m, n))
    want = a @ b
    err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
    rt.release(ab, bb, cb)
    return t, err


@register("gemm")
def bench_gemm(rt, ctx) -> list[dict]:
    timer = ctx["timer"]
    rng = np.random.default_rng(0)
    out = []
    naive = {}
    for (m, n, k) in GEMM_SHAPES:
        flops = 2.0 * m * n * k
        t, err = _naive_case(rt, timer, m, n, k, rng)
        naive[(m, n, k)] = flops / t / 1e9
        out.append({"name": "gemm_naive16", "shape": f"{m}x{n}x{k}", "gflops": naive[(m, n, k)],
                    "ms": t * 1e3, "max_rel_err": err})
        for layout in ("nn", "nt", "tn"):
            t, err = _gemm_case(rt, timer, layout, m, n, k, rng)
            g = flops / t / 1e9
            out.append({"name": f"gemm_{layout}", "shape": f"{m}x{n}x{k}", "gflops": g, "ms": t * 1e3,
                        "vs_naive": g / naive[(m, n, k)], "max_rel_err": err})
    return out


# ---- driver ------------------------------------------------------------------------------------

def run_bench(rt, only: str | None = None) -> dict:
    """Measure the FMA peak, then every registered bench whose name starts with `only` (all if None).

    Returns {"adapter": {"name", "backend"}, "fma_peak_gflops", "timing", "kernels": [...]}, each kernel
    entry with "fraction_of_peak" (gflops / peak) where it reports gflops.
    """
    timer = Timer(rt)
    peak = fma_peak(rt, timer)
    ctx = {"timer": timer, "fma_peak_gflops": peak}
    kernels = []
    for name, fn in BENCHES.items():
        if only and not name.startswith(only) and not only.startswith(name):
            continue
        for entry in fn(rt, ctx):
            if only and not entry["name"].startswith(only) and not name.startswith(only):
                continue
            if "gflops" in entry:
                entry["fraction_of_peak"] = entry["gflops"] / peak
            kernels.append(entry)
    return {"adapter": {"name": rt.info.name, "backend": rt.info.backend},
            "fma_peak_gflops": peak,
            "timing": "timestamp-query" if timer.use_ts else "wall-clock",
            "kernels": kernels}


def format_table(result: dict) -> str:
    """A plain-text table of a run_bench result (for the CLI without --json)."""
    lines = [f"adapter: {result['adapter']['name']} ({result['adapter']['backend']}), timing: {result.get('timing', '?')}",
             f"fp32 FMA peak: {result['fma_peak_gflops']:.1f} GFLOP/s",
             f"{'kernel':<16} {'shape':<16} {'GFLOP/s':>9} {'of peak':>8} {'vs naive':>9}"]
    for e in result["kernels"]:
        rate = e.get("gflops", e.get("gbps", float("nan")))
        frac = e.get("fraction_of_peak")
        vs = e.get("vs_naive")
        lines.append(f"{e['name']:<16} {e['shape']:<16} {rate:>9.2f} "
                     f"{'' if frac is None else f'{100 * frac:.0f}%':>8} {'' if vs is None else f'{vs:.1f}x':>9}")
    return "\n".join(lines)
