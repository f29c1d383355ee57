"""Every attention candidate on this adapter at one T, forward + backward, each checked against the NumPy
reference: its largest error (relative to each output's magnitude), first run (compile included) and GFLOP/s
(the causal work 6 T^2 D Hq over the time). The per-candidate table in benchmarks/README.md comes from it.

    python tools/attention_candidates.py 512            # one causal row, B = 1, 9 / 3 heads, D = 64
    python tools/attention_candidates.py 512 packed     # the row packed with 8 equal segments
    python tools/attention_candidates.py 512 causal regs/r8   # only the candidates whose name holds regs/r8
    PASSES=1 python tools/attention_candidates.py 512   # and the time of each pass
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from wgpu_train.engines.webgpu.tuned import attention_kernels as AK
from wgpu_train.engines.webgpu.device.timing import Timer
from wgpu_train.engines.webgpu.device.runtime import get_runtime
from wgpu_train.engines.numpy import ops

B, HQ, HKV, D = 1, 9, 3, 64


def main(argv):
    T = int(argv[1]) if len(argv) > 1 else 512
    packed = len(argv) > 2 and argv[2] == "packed"
    only = argv[3] if len(argv) > 3 else ""
    rt = get_runtime()
    rng = np.random.default_rng(0)
    q, dout = (rng.standard_normal((B, T, HQ, D)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, T, HKV, D)).astype(np.float32) for _ in range(2))
    seg = ((np.arange(T) // (T // 8) + 1)[None] if packed else np.ones((B, T))).astype(np.int32)
    x64 = [x.astype(np.float64) for x in (q, k, v)]
    out, lse = ops.attention_forward(*x64, seg)
    want = (out, lse) + tuple(ops.attention_backward(dout.astype(np.float64), *x64, out, lse, seg))
    inputs = dict(q=q, k=k, v=v, dout=dout, out=out.astype(np.float32), lse=lse.astype(np.float32))
    bufs = {name: rt.upload(x) for name, x in inputs.items()}
    bufs["segment_ids"] = rt.upload(seg)
    results = {name: rt.buffer(4 * w.size) for name, w in zip(("o", "l", "dq", "dk", "dv"), want)}
    stats = rt.upload(np.concatenate([lse.ravel(), np.zeros(lse.size)]).astype(np.float32))   # lse, then delta
    fw = AK.AttentionProblem(rt, "forward", dict(q=bufs["q"], k=bufs["k"], v=bufs["v"],
                                                 segment_ids=bufs["segment_ids"], out=results["o"],
                                                 lse=results["l"]), B, T, HQ, HKV, D)
    bw = AK.AttentionProblem(rt, "backward", dict(bufs, dq=results["dq"], dk=results["dk"], dv=results["dv"],
                                                  stats=stats), B, T, HQ, HKV, D)
    timer = Timer(rt)
    for c in fw.candidates():
        if only and only not in c.name:
            continue
        started = time.time()
        dispatches = c.dispatches(fw) + c.dispatches(bw)
        rec = rt.recorder()
        for d in dispatches:
            rec.dispatch(*d)
        rec.submit()
        err = max(float(np.max(np.abs(rt.read(b, np.float32, w.shape) - w)) / (1 + np.max(np.abs(w))))
                  for b, w in zip(results.values(), want))
        first = time.time() - started
        t = timer.time(dispatches, repeats=2, budget_s=2.0)
        line = f"{c.name:24s} err {err:.1e}  first run {first:5.1f} s  {6 * T * T * D * HQ / t / 1e9:6.2f} GFLOP/s"
        if os.environ.get("PASSES"):
            passes = [("fwd", c.dispatches(fw))] + [(f"bwd{i}", [d]) for i, d in enumerate(c.dispatches(bw))]
            line += "  " + " ".join(f"{n} {timer.time(d, repeats=2, budget_s=2.0) * 1e3:.1f} ms" for n, d in passes)
        print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv)
