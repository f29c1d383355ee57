"""Timing dispatches on the device (Timer: timestamp queries where the adapter has them, else the wall clock)
and the adapter's fp32 FMA peak: what the tuner and the benchmarks measure with."""
from __future__ import annotations

import time

import numpy as np


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
            usage = wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC
            self.resolve = rt.device.create_buffer(size=16, usage=usage)

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
            ts = rt.read(self.resolve, np.uint64, (2,))
            dt = (int(ts[1]) - int(ts[0])) * 1e-9
            if dt > 0:
                return dt
        rt.read(self._sync, np.float32, (1,))  # waits for the submitted work
        return time.perf_counter() - t0

    def time(self, dispatches, repeats: int = 3, budget_s: float = 2.0, warmup=None) -> float:
        """Best seconds for one run of `dispatches` [(pipeline, resources, (gx, gy, gz))], after a warm-up
        run of `warmup` (default: the same dispatches; [] for none), which also pays the shader JIT
        compilation of software adapters. The machines are shared and noisy, so the minimum is the fairest estimate
        of what the kernel can do."""
        start = time.perf_counter()
        best = float("inf")
        if warmup is None or warmup:
            self._run_once(dispatches if warmup is None else warmup)
        for _ in range(repeats):
            best = min(best, self._run_once(dispatches))
            if time.perf_counter() - start > budget_s:
                break
        return best


def groups(g) -> tuple:
    """A workgroup count as (gx, gy, gz)."""
    g = tuple(int(x) for x in (g if isinstance(g, (tuple, list)) else (g,)))
    return g + (1,) * (3 - len(g))


# ---- FMA peak ----------------------------------------------------------------------------------

FMA_ITERS = 256        # loop trips per invocation (passed to shaders/bench_fma.wgsl in its uniform)
FMA_CHAINS = 8         # independent vec4 chains per invocation (8 * 4 lanes of FMA in flight)


def fma_peak(rt, timer: Timer | None = None, invocations: int = 64 * 1024) -> float:
    """The adapter's fp32 FMA throughput in GFLOP/s (2 flops per FMA), from many independent chains."""
    timer = timer or Timer(rt)
    p = rt.pipeline("bench_fma", "fma_peak")
    out = rt.buffer(invocations * 16, "bench.fma_out")
    params = rt.uniform("<I", FMA_ITERS)
    t = timer.time([(p, [params, out], groups(invocations // 64))], repeats=5, budget_s=0.5)
    flops = invocations * FMA_ITERS * FMA_CHAINS * 4 * 2
    return flops / t / 1e9
