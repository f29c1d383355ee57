"""gpt-oss's kernel variants on the WebGPU engine against the reference ops (engines/shared): attention sinks around
every attention candidate (forward, backward and the sinks' own gradient) and in each cached-attention pass, and the
experts with biases and the clamped SwiGLU (gate / up rows interleaved), forward and backward."""
from __future__ import annotations

import numpy as np
import pytest

from tolerances import assert_close
from wgpu_train.engines.shared import attention as ops
from wgpu_train.engines.webgpu import attention as A
from wgpu_train.engines.webgpu.tuned import attention_kernels as AK
from wgpu_train.engines.webgpu.tuned import decode_kernels, tune

F32 = np.float32


def test_sink_ops_compose_to_attention_with_sinks():
    """The engine's decomposition: attention without sinks, then attention_sink_forward, is attention with them;
    attention_sink_backward is attention_backward's dsinks (tests/test_gpt_oss.py holds that to torch autograd)."""
    g = np.random.default_rng(0)
    q, k, v = g.standard_normal((1, 5, 4, 3)), g.standard_normal((1, 5, 2, 3)), g.standard_normal((1, 5, 2, 3))
    seg, sinks, dout = np.array([[1, 1, 1, 2, 0]]), g.standard_normal(4), g.standard_normal((1, 5, 4, 3))
    dout[:, 4] = 0      # the padding query's (a loss never reaches it)
    want = ops.attention_forward(q, k, v, seg, sinks=sinks)
    got = ops.attention_sink_forward(*ops.attention_forward(q, k, v, seg), sinks)
    for a, b in zip(got, want):
        assert_close(a, b, "route_f64", "sinks forward")
    delta = np.einsum("bihd,bihd->bhi", dout, want[0])
    assert_close(ops.attention_sink_backward(delta, want[1], sinks),
                 ops.attention_backward(dout, q, k, v, *want, seg, sinks=sinks)[3], "route_f64", "dsinks")


@pytest.mark.parametrize("name", [AK.REGS_CONFIGS[0].name, AK.TILES_CONFIGS[0].name, "rows/vec4", "rows/scalar"])
def test_attention_with_sinks_every_family(default_rt, name):
    """Forward (out, lse), backward (dq, dk, dv) and dsinks (+= onto a prior value) with sinks, packed rows with
    padding and a sliding window, each family pinned."""
    rt = default_rt
    B, T, Hq, Hkv, D, window = 2, 13, 4, 2, 8, 5
    g = np.random.default_rng(1)
    q, dout = (g.standard_normal((B, T, Hq, D)).astype(F32) for _ in range(2))
    k, v = (g.standard_normal((B, T, Hkv, D)).astype(F32) for _ in range(2))
    sinks = g.standard_normal(Hq).astype(F32)
    seg = np.array([[1] * 7 + [2] * 6, [1] * 10 + [0] * 3], np.int32)
    x64 = [x.astype(np.float64) for x in (q, k, v)]
    out_w, lse_w = ops.attention_forward(*x64, seg, window, sinks=sinks.astype(np.float64))
    dq_w, dk_w, dv_w, ds_w = ops.attention_backward(dout.astype(np.float64), *x64, out_w, lse_w, seg, window,
                                                    sinks=sinks.astype(np.float64))
    if name not in [c.name for c in AK.AttentionProblem(rt, "forward", {n: rt.buffer(16) for n in AK.BIG[:4]} |
                                                        {"lse": rt.buffer(16), "segment_ids": rt.buffer(16)},
                                                        B, T, Hq, Hkv, D, window).candidates()]:
        pytest.skip(f"{name} does not run this shape on {rt.info.name}")
    tq, tk, tv, tdo, ts, tsink = (rt.upload(x) for x in (q, k, v, dout, seg, sinks))
    out, dq, dk, dv = rt.buffer(q.nbytes), rt.buffer(q.nbytes), rt.buffer(k.nbytes), rt.buffer(k.nbytes)
    lse, scratch = rt.buffer(4 * B * Hq * T), rt.buffer(4 * A.attention_scratch_size(B, T, Hq))
    dsinks = rt.upload(np.full(Hq, 0.5, F32))
    with tune.pinned(name):
        rec = rt.recorder()
        A.attention_forward(rec, out, lse, tq, tk, tv, ts, B, T, Hq, Hkv, D, window, 0.0, tsink)
        A.attention_backward(rec, dq, dk, dv, tdo, tq, tk, tv, out, lse, ts, B, T, Hq, Hkv, D, scratch, window, 0.0,
                             tsink, dsinks)
        rec.submit()
    assert_close(rt.read(out, F32, q.shape), out_w, "k_attention", f"{name} out")
    assert_close(rt.read(lse, F32, (B, Hq, T)), lse_w, "k_attention_lse", f"{name} lse")
    for buf, want, what in ((dq, dq_w, "dq"), (dk, dk_w, "dk"), (dv, dv_w, "dv")):
        assert_close(rt.read(buf, F32, want.shape), want, "k_attention_grad", f"{name} {what}")
    assert_close(rt.read(dsinks, F32, (Hq,)), ds_w + 0.5, "k_attention_grad", f"{name} dsinks")
    rt.release(tq, tk, tv, tdo, ts, tsink, out, dq, dk, dv, lse, scratch, dsinks)


@pytest.mark.parametrize("kernel", ["decode/single", "decode/split32"])
def test_cached_attention_with_sinks(default_rt, kernel):
    """Each cached-attention pass with sinks: rows of several lengths, a window, a padding query."""
    rt = default_rt
    batch, max_len, hq, hkv, d, window = 2, 70, 4, 2, 8, 40
    rows, pos = np.array([0, 1, -1, 1], np.int32), np.array([69, 20, 0, 33], np.int32)
    g = np.random.default_rng(2)
    q = g.standard_normal((4, hq, d)).astype(F32)
    kc, vc = g.standard_normal((2, batch, max_len, hkv, d)).astype(F32)
    sinks = (2 * g.standard_normal(hq)).astype(F32)
    want = ops.attention_cached_forward(*(x.astype(np.float64) for x in (q, kc, vc)), rows, pos, window,
                                        sinks=sinks.astype(np.float64))
    out, scratch = rt.buffer(q.nbytes), rt.buffer(4 * decode_kernels.scratch_elements(batch, hq, d))
    tq, tk, tv, tr, tp, tsink = (rt.upload(a) for a in (q, kc, vc, rows, pos, sinks))
    with tune.pinned(kernel):
        rec = rt.recorder()
        A.attention_cached_forward(rec, out, tq, tk, tv, tr, tp, 4, batch, max_len, hq, hkv, d, window, 0.0, scratch,
                                   sinks=tsink)
        rec.submit()
    assert_close(rt.read(out, F32, q.shape), want, "k_attention", kernel)
    rt.release(out, scratch, tq, tk, tv, tr, tp, tsink)


@pytest.mark.parametrize("pin", ["moe_gemm/r4x4,moe_outer/split64", "moe_gemm/reg_portable_m16,moe_outer/direct"])
def test_experts_with_biases_and_the_clamped_swiglu(default_rt, pin):
    """gpt-oss's experts (interleaved gate / up rows, biases on both, a limit that bites) with LoRA on both
    parameters: y, gate_up_out, dx, the route weights' gradient, the LoRA pairs', the weights' and the biases'
    gradients (full fine-tuning) against the reference in float64; an expert without pairs."""
    from wgpu_train.engines.shared import moe as ref
    from wgpu_train.engines.webgpu import moe

    rt = default_rt
    N, C, I, E, k, R = 11, 20, 6, 4, 2, 3
    g = np.random.default_rng(4)
    experts = np.stack([g.choice(np.arange(1, E), k, replace=False) for _ in range(N)]).astype(np.int32)
    x, dy = g.standard_normal((N, C)), g.standard_normal((N, C))
    weights = g.uniform(0.2, 1.0, (N, k))
    gate_up, down = g.standard_normal((E, 2 * I, C)) / 3, g.standard_normal((E, C, I)) / 3
    gu_bias, dn_bias = g.standard_normal((E, 2 * I)), g.standard_normal((E, C))
    lgu = (g.standard_normal((E, R, C)) * 0.3, g.standard_normal((E, 2 * I, R)) * 0.3, 1.5)
    ldn = (g.standard_normal((E, R, I)) * 0.3, g.standard_normal((E, C, R)) * 0.3, 0.75)
    act = ref.ClampedSwiGLU(1.702, 0.9)
    x, dy, weights, gate_up, down, gu_bias, dn_bias = (a.astype(F32).astype(np.float64) for a in
                                                      (x, dy, weights, gate_up, down, gu_bias, dn_bias))
    lgu, ldn = ((a.astype(F32).astype(np.float64), b.astype(F32).astype(np.float64), s) for a, b, s in (lgu, ldn))
    kw = dict(gate_up_bias=gu_bias, down_bias=dn_bias, activation=act)
    want_y, want_gu = ref.moe_experts_forward(x, weights, experts, gate_up, down, lgu, ldn, **kw)
    clamped = np.concatenate([want_gu[..., 0::2].ravel() > act.limit, np.abs(want_gu[..., 1::2].ravel()) > act.limit])
    assert clamped.any() and not clamped.all(), "the limit must bite on some values and not on others"
    want_dx, want_dw, want_g = ref.moe_experts_backward(dy, x, weights, experts, want_gu, gate_up, down, lgu, ldn,
                                                        need_weight_grad=True, **kw)
    up = (lambda a: rt.upload(np.ascontiguousarray(a, F32)))
    xb, wb, eb, gub, dnb, dyb, gbb, dbb = (up(a) for a in (x, weights, experts.astype(F32), gate_up, down, dy,
                                                             gu_bias, dn_bias))
    rt.write(eb, experts)
    gl, dl = (moe.MoeLora(up(a), up(b), s, R) for a, b, s in (lgu, ldn))
    outs = {n: rt.buffer(4 * size) for n, size in (("y", N * C), ("gu", N * k * 2 * I), ("dx", N * C), ("dw", N * k))}
    grads = {n: up(np.full(w.shape, np.nan)) for n, w in want_g.items()}
    scratch = moe.MoeScratch(rt, N, k, E, C, I, R, staged=True)
    with tune.pinned(pin):
        rec = rt.recorder()
        moe.moe_experts_forward(rec, outs["y"], outs["gu"], xb, wb, eb, gub, dnb, gl, dl, N, k, E, C, I, scratch,
                                gate_up_bias=gbb, down_bias=dbb, activation=act)
        moe.moe_experts_backward(rec, outs["dx"], outs["dw"], grads, dyb, xb, wb, eb, outs["gu"], gub, dnb, gl, dl,
                                 N, k, E, C, I, scratch, gate_up_bias=gbb, down_bias=dbb, activation=act)
        rec.submit()
    assert_close(rt.read(outs["y"], F32, (N, C)), want_y, "moe_experts", f"y {pin}")
    assert_close(rt.read(outs["gu"], F32, (N, k, 2 * I)), want_gu, "moe_experts", f"gate_up_out {pin}")
    assert_close(rt.read(outs["dx"], F32, (N, C)), want_dx, "moe_experts", f"dx {pin}")
    assert_close(rt.read(outs["dw"], F32, (N, k)), want_dw, "moe_experts", f"dweights {pin}")
    assert {"gate_up_bias", "down_bias", "gate_up.lora_A", "down.lora_B"} <= set(want_g)
    for name, w in want_g.items():
        assert_close(rt.read(grads[name], F32, w.shape), w, "moe_experts", f"{name} {pin}")
    scratch.release(rt)
    rt.release(xb, wb, eb, gub, dnb, dyb, gbb, dbb, gl.a, gl.b, dl.a, dl.b, *outs.values(), *grads.values())
