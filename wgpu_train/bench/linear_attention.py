"""`bench --only linear_attention`: the chunked gated delta rule (engines/webgpu/delta_rule.py, forward + backward)
against the tuned full attention kernels (engines/webgpu/attention.py) on the same heads, side by side in one run
at growing T: the delta rule's time per token stays flat (its cost is linear in T) while attention's grows with T.
Each is checked against its NumPy reference at the first T before anything is timed."""
from __future__ import annotations

import numpy as np

from wgpu_train.bench.checks import Capture, max_rel_err
from wgpu_train.engines.shared import delta_rule as ref
from wgpu_train.engines.webgpu import attention as A
from wgpu_train.engines.webgpu import delta_rule as W

B, H, D = 1, 4, 64               # 4 heads of 64 (value heads = key heads = attention heads), one row
LENGTHS = (512, 2048, 8192)
CHECK_T = 512


def _inputs(rng, T):
    q, k = (ref.l2norm_forward(rng.standard_normal((B, T, H, D)))[0].astype(np.float32) for _ in range(2))
    return dict(q=q, k=k, v=rng.standard_normal((B, T, H, D)).astype(np.float32),
                g=-rng.uniform(0.0, 0.5, (B, T, H)).astype(np.float32),
                beta=rng.uniform(0.0, 1.0, (B, T, H)).astype(np.float32),
                dout=rng.standard_normal((B, T, H, D)).astype(np.float32))


def _delta(rt, bufs, T, chunk):
    """The delta rule's forward and backward dispatches, and its output buffers (out, dq)."""
    n = {"out": B * T * H * D, "final": B * H * D * D, "states": W.states_size(B, T, H, D, D, chunk),
         "scratch": W.scratch_size(B, T, H, D, D, chunk), "dq": B * T * H * D, "dk": B * T * H * D,
         "dv": B * T * H * D, "dg": B * T * H, "dbeta": B * T * H}
    o = {name: rt.buffer(4 * size) for name, size in n.items()}
    rec = Capture(rt)
    ins = [bufs[x] for x in ("q", "k", "v", "g", "beta")]
    W.gated_delta_rule_forward(rec, o["out"], o["final"], o["states"], *ins, chunk, B, T, H, H, D, D, o["scratch"])
    W.gated_delta_rule_backward(rec, o["dq"], o["dk"], o["dv"], o["dg"], o["dbeta"], None, bufs["dout"], *ins,
                                o["states"], chunk, B, T, H, H, D, D, o["scratch"])
    return rec.dispatches, o


def _attention(rt, bufs, seg, T):
    o = {name: rt.buffer(4 * B * T * H * D) for name in ("out", "dq", "dk", "dv")}
    o["lse"], o["scratch"] = rt.buffer(4 * B * H * T), rt.buffer(4 * A.attention_scratch_size(B, T, H))
    rec = Capture(rt)
    A.attention_forward(rec, o["out"], o["lse"], bufs["q"], bufs["k"], bufs["v"], seg, B, T, H, H, D)
    A.attention_backward(rec, o["dq"], o["dk"], o["dv"], bufs["dout"], bufs["q"], bufs["k"], bufs["v"], o["out"],
                         o["lse"], seg, B, T, H, H, D, o["scratch"])
    return rec.dispatches, o


def _run(rt, dispatches):
    rec = rt.recorder()
    for d in dispatches:
        rec.dispatch(*d)
    rec.submit()


def bench_linear_attention(rt, ctx) -> list[dict]:
    """Per T: the delta rule's forward + backward (the tuner's chunk and scan) and causal attention's (the tuner's
    flash kernel) on B = 1, 4 heads of 64. "vs_attention" is attention's time over the delta rule's; "us_per_token"
    the delta rule's time per token (flat when its cost is linear in T), "growth" its time over the first T's
    divided by T's ratio to the first (1.0: linear)."""
    from wgpu_train.engines.numpy import ops

    timer = ctx["timer"]
    rng = np.random.default_rng(11)
    out, first = [], {}
    for T in LENGTHS:
        x = _inputs(rng, T)
        bufs = {name: rt.upload(a) for name, a in x.items()}
        seg = rt.upload(np.ones((B, T), np.int32))
        chunk = W.delta_rule_chunk(rt, B, T, H, H, D, D, backward=True)
        delta, d_out = _delta(rt, bufs, T, chunk)
        att, a_out = _attention(rt, bufs, seg, T)
        try:
            if T == CHECK_T:
                f64 = {name: a.astype(np.float64) for name, a in x.items()}
                args = [f64[n] for n in ("q", "k", "v", "g", "beta")]
                want, _, states = ref.gated_delta_rule_forward(*args, chunk)
                want_dq = ref.gated_delta_rule_backward(f64["dout"], *args, states, chunk)[0]
                want_att, lse = ops.attention_forward(f64["q"], f64["k"], f64["v"], np.ones((B, T), np.int32))
                _run(rt, delta)
                _run(rt, att)
                err = max(max_rel_err(rt.read(d_out["out"], np.float32, want.shape), want),
                          max_rel_err(rt.read(d_out["dq"], np.float32, want_dq.shape), want_dq),
                          max_rel_err(rt.read(a_out["out"], np.float32, want_att.shape), want_att))
                if not err < 1e-4:
                    raise AssertionError(f"linear_attention bench T={T}: a wrong result (max rel err {err:.2e})")
            t_delta = timer.time(delta, repeats=2, budget_s=2.0)
            t_att = timer.time(att, repeats=2, budget_s=2.0)
            first = first or {"T": T, "delta": t_delta, "attention": t_att}
            shape = f"T{T}x{H}xD{D}"
            out.append({"name": "linear_attention", "shape": shape, "kernel": f"delta rule fwd+bwd, chunk {chunk}",
                        "ms": t_delta * 1e3, "vs_attention": t_att / t_delta, "us_per_token": t_delta / T * 1e6,
                        "growth": t_delta / first["delta"] / (T / first["T"]), "dispatches": len(delta)})
            out.append({"name": "linear_attention", "shape": shape, "kernel": "attention fwd+bwd (flash)",
                        "ms": t_att * 1e3, "us_per_token": t_att / T * 1e6,
                        "growth": t_att / first["attention"] / (T / first["T"]), "dispatches": len(att)})
        finally:
            rt.release(*bufs.values(), seg, *d_out.values(), *a_out.values())
        ctx["sample_peak"]()
    return out
