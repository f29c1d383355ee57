"""The attention kernels on 16-bit tensors (bfloat16 / float16 q, k, v, out and their gradients; float32 statistics):
every family (per-row scalar and vec4, register-blocked and workgroup-tiled flash) forward and backward against the
NumPy reference on the same rounded inputs, its outputs rounded once; a mix of formats; offsets that leave the
neighbours untouched; the tuner's key and its check per format."""
from __future__ import annotations

import numpy as np
import pytest

from wgpu_train.engines.numpy import ops
from wgpu_train.engines.webgpu import attention as A
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.tuned import attention_kernels as AK
from wgpu_train.engines.webgpu.tuned import tune

from tolerances import assert_close

# elements before each tensor: for the scalar kernels any offset for float32, an even one (no multiple of 4) for a
# 16-bit tensor; for the vec4 and flash kernels multiples of 4
LEADS = {False: {"f32": 3, "bf16": 2, "f16": 2}, True: {"f32": 4, "bf16": 4, "f16": 4}}
SENTINEL = 7.0             # the neighbours' value, which no kernel may change


def _rounded(x, fmt):
    """float32 x as a tensor of format fmt holds it."""
    return storage.from_words(storage.to_words(x, fmt), x.size, fmt).reshape(x.shape)


def _packed(B, T):
    """Row 0 one causal sample then padding; row 1 three packed samples then padding."""
    seg = np.ones((B, T), np.int32)
    seg[0, T - 4:] = 0
    if B > 1:
        seg[1] = np.repeat([1, 2, 3, 0], [T // 3, T // 4, T // 4, T - T // 3 - 2 * (T // 4)])
    return seg


def _tensor(rt, values, fmt, lead):
    """values at element offset lead of a buffer of format fmt whose other elements are SENTINEL."""
    flat = np.full(lead + values.size + lead, SENTINEL, np.float32)
    flat[lead:lead + values.size] = values.ravel()
    return (storage.upload(rt, flat, fmt), lead)


def _check(rt, t, want, fmt, what):
    """The tensor t holds want (rounded to fmt) within the format's tolerance, its neighbours untouched."""
    buf, lead = t
    got = storage.read(rt, buf, lead + want.size + lead)
    assert (got[:lead] == SENTINEL).all() and (got[lead + want.size:] == SENTINEL).all(), f"{what}: neighbours"
    assert_close(got[lead:lead + want.size].reshape(want.shape), _rounded(want.astype(np.float32), fmt),
                 f"k_attention16_{fmt}" if fmt != "f32" else "k_attention_grad", what)


def _run(rt, fmts, B, T, Hq, Hkv, D, seg, window=0, softcap=0.0, pin=None, seed=0):
    """Forward, then backward (from the reference's out and lse, as stored) through kernels.attention_*, with the
    candidate `pin` forced when given; fmts: storage format of each (B, T, H, D) tensor (dk and dv share one
    buffer, as in the engine), at offsets LEADS[D % 4 == 0]. Returns the name of the candidate that ran."""
    leads = LEADS[D % 4 == 0]
    g = np.random.default_rng(seed)
    x = {n: _rounded(g.standard_normal((B, T, h, D)).astype(np.float32), fmts[n])
         for n, h in (("q", Hq), ("k", Hkv), ("v", Hkv), ("dout", Hq))}
    x64 = [x[n].astype(np.float64) for n in ("q", "k", "v")]
    out, lse = ops.attention_forward(*x64, seg, window, softcap)
    out16 = _rounded(out.astype(np.float32), fmts["out"])               # out as the forward stores it
    grads = ops.attention_backward(x["dout"].astype(np.float64), *x64, out16.astype(np.float64), lse, seg, window,
                                   softcap)
    t = {n: _tensor(rt, x[n], fmts[n], leads[fmts[n]]) for n in x}
    for n in ("out", "dq"):
        t[n] = _tensor(rt, np.zeros(out.shape, np.float32), fmts[n], leads[fmts[n]])
    dkv = _tensor(rt, np.zeros((2,) + x["k"].shape, np.float32), fmts["dkv"], leads[fmts["dkv"]])
    size = x["k"].size
    ts, tl = rt.upload(seg), rt.buffer(4 * lse.size)
    scratch = rt.buffer(4 * A.attention_scratch_size(B, T, Hq))
    with tune.pinned(pin) if pin else tune.forced_mode("off"):
        rec = rt.recorder()
        A.attention_forward(rec, t["out"], tl, t["q"], t["k"], t["v"], ts, B, T, Hq, Hkv, D, window, softcap)
        rec.submit()
        _check(rt, t["out"], out, fmts["out"], "out")
        assert_close(rt.read(tl, np.float32, lse.shape), lse, "k_attention_lse", "lse")
        stored = _tensor(rt, out16, fmts["out"], leads[fmts["out"]])
        rt.write(tl, lse.astype(np.float32))
        rec = rt.recorder()
        grad = dict(dq=t["dq"], dk=dkv, dv=(dkv[0], dkv[1] + size), dout=t["dout"], q=t["q"], k=t["k"], v=t["v"],
                    out=stored)
        A.attention_backward(rec, *grad.values(), tl, ts, B, T, Hq, Hkv, D, scratch, window, softcap)
        rec.submit()
        problem = AK.AttentionProblem(rt, "backward", dict(grad, segment_ids=ts, stats=scratch), B, T, Hq, Hkv, D,
                                      window, softcap)
        chosen = tune.choose(rt, problem).name
    _check(rt, t["dq"], grads[0], fmts["dq"], "dq")
    _check(rt, dkv, np.stack(grads[1:]), fmts["dkv"], "dk, dv")
    rt.release(ts, tl, scratch, stored[0], dkv[0], *(b for b, _ in t.values()))
    return chosen


def _same(fmt):
    return {n: fmt for n in ("q", "k", "v", "out", "dout", "dq", "dkv")}


MIXED = dict(q="bf16", k="f16", v="f32", out="f16", dout="bf16", dq="f32", dkv="bf16")


@pytest.mark.parametrize("fmt,D", [("bf16", 10), ("f16", 14)])
def test_per_row_kernels_odd_head_dims(rt, fmt, D):
    """Head dims of no multiple of 4: the per-row scalar kernels (pairs stored whole), GQA 4 / 2 on packed rows
    with padding: causal, then a sliding window, then soft-capped scores."""
    seg = _packed(2, 23)
    assert _run(rt, _same(fmt), 2, 23, 4, 2, D, seg) == "rows/scalar"
    _run(rt, _same(fmt), 2, 23, 4, 2, D, seg, window=5, seed=1)
    _run(rt, _same(fmt), 2, 23, 4, 2, D, seg, softcap=1.5, seed=2)


def test_float32_odd_head_dim(rt):
    """float32 rows of odd length: the per-row kernels store the last element of each alone."""
    assert _run(rt, _same("f32"), 1, 9, 2, 1, 5, _packed(1, 9), window=4) == "rows/scalar"


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
@pytest.mark.parametrize("pin,D", [("rows/vec4", 12), ("regs/r8l8k2", 16), ("tiles/q16l16", 16)])
def test_every_family(default_rt, fmt, pin, D):
    """The vec4 per-row kernels and both flash families forced (the flash ones at one head dim: the tiled kernel
    past WebGPU's default workgroup memory has its register-blocked twin, test_portable_wgsl.py): packed rows, a
    window with soft-capped scores (on one adapter, as test_attention.py's test_every_candidate: both software adapters compile WGSL with the same
    llvmpipe, and the 16-bit accessors are the same words on both; test_mixed_formats runs the scalar per-row
    kernels on each)."""
    rt = default_rt
    t = {n: rt.buffer(16) for n in ("q", "k", "v", "out", "lse", "segment_ids")}
    names = [c.name for c in AK.AttentionProblem(rt, "forward", t, 2, 30, 4, 2, D).candidates()]
    rt.release(*t.values())
    if not any(name.startswith(pin) for name in names):
        pytest.skip(f"{pin} does not run head dim {D} on {rt.info.name}")
    seg = _packed(2, 30)
    assert _run(rt, _same(fmt), 2, 30, 4, 2, D, seg, pin=pin).startswith(pin)
    _run(rt, _same(fmt), 2, 30, 4, 2, D, seg, window=9, softcap=1.5, pin=pin, seed=3)


def test_mixed_formats(rt):
    """Every tensor in its own format (bf16, f16 and f32 side by side) in one dispatch: the scalar per-row
    kernels, float32 tensors at odd offsets."""
    assert _run(rt, MIXED, 2, 19, 2, 1, 10, _packed(2, 19), window=6) == "rows/scalar"


def test_mixed_formats_vec4(default_rt):
    """The same with the vec4 per-row kernels (on one adapter, as test_every_family: the OpenGL adapter takes
    half a minute to compile their backward)."""
    assert _run(default_rt, MIXED, 2, 19, 2, 1, 12, _packed(2, 19), window=6, pin="rows/vec4") == "rows/vec4"


def test_the_tuner_keys_and_checks_each_format(default_rt):
    """The key names the formats (float32's unchanged), and the tuner's check on a 16-bit replica (its outputs in
    their format, its statistics in float32) passes the kernels test_every_family compiled."""
    rt = default_rt
    B, T, H, D = 1, 16, 2, 16
    keys = set()
    for fmts in (_same("f32"), _same("bf16"), _same("f16"), MIXED):
        t = {n: storage.set_format(rt.buffer(4 * B * T * H * D + 8), fmts.get(n, fmts["dkv"]))
             for n in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")}
        t.update(lse=rt.buffer(4 * B * H * T), stats=rt.buffer(8 * B * H * T), segment_ids=rt.buffer(4 * B * T))
        forward = {n: t[n] for n in ("out", "lse", "q", "k", "v", "segment_ids")}
        for p in (AK.AttentionProblem(rt, "forward", forward, B, T, H, H, D),
                  AK.AttentionProblem(rt, "backward", {n: x for n, x in t.items() if n != "lse"}, B, T, H, H, D)):
            keys.add(p.key())
            if fmts in (_same("bf16"), _same("f16")):
                cands = [c for c in p.candidates() if c.name.startswith(("regs/r8l8k2", "tiles/q16l16"))]
                checked = tune.measure(rt, p, cands)
                assert "regs/r8l8k2t32" in checked and all(g is not None for g in checked.values()), checked
        rt.release(*t.values())
    assert len(keys) == 8
    assert {"attention backward bt16 h2/2 d16 v4", "attention forward bt16 h2/2 d16 v4 bf16"} <= keys


def test_16_bit_tensors_need_even_head_dims_and_offsets(rt):
    t = {n: rt.buffer(64) for n in ("q", "k", "v", "lse", "segment_ids")}
    t["out"] = storage.set_format(rt.buffer(64), "bf16")
    with pytest.raises(ValueError, match="even head dim"):
        AK.AttentionProblem(rt, "forward", t, 1, 2, 1, 1, 9)
    with pytest.raises(ValueError, match="even element offsets"):
        AK.AttentionProblem(rt, "forward", dict(t, out=(t["out"], 1)), 1, 2, 1, 1, 8)
    at2 = AK.AttentionProblem(rt, "forward", dict(t, out=(t["out"], 2)), 1, 2, 1, 1, 8)
    assert not at2.aligned and [c.name for c in at2.candidates()] == ["rows/scalar"]    # vec4 views: 4 elements
    with pytest.raises(ValueError, match="statistics"):
        AK.AttentionProblem(rt, "forward", dict(t, lse=storage.set_format(rt.buffer(64), "f16")), 1, 2, 1, 1, 8)
    rt.release(*t.values())
