"""Every attention candidate (the register-blocked and workgroup-tiled flash kernels, the per-row kernels)
against the NumPy reference: grouped heads, packing with padding, sliding windows, head dims 32 to 256,
sequences up to 2048; the candidate lists and the CPU adapters' loop budget."""
from __future__ import annotations

import numpy as np
import pytest

from wgpu_train.errors import DeviceError
from wgpu_train.engines.webgpu.tuned import attention_kernels as AK
from wgpu_train.engines.webgpu.tuned import attention_source as src
from wgpu_train.engines.webgpu import attention as A
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.device.runtime import shader_text
from wgpu_train.engines.numpy import ops

F32 = np.float32


def _packed(B, T, rng):
    """Rows of 1 to 4 samples of random lengths, then padding (segment id 0)."""
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        pos, sid = 0, 1
        while pos < T - 3 and sid <= 4:
            n = int(rng.integers(1, T // 2))
            seg[b, pos:pos + n] = sid
            pos, sid = pos + n, sid + 1
    return seg


def _case(B, T, Hq, Hkv, D, seg, window, seed=0, softcap=0.0, blocks=None):
    g = np.random.default_rng(seed)
    q, dout = (g.standard_normal((B, T, Hq, D)).astype(F32) for _ in range(2))
    k, v = (g.standard_normal((B, T, Hkv, D)).astype(F32) for _ in range(2))
    x64 = [x.astype(np.float64) for x in (q, k, v)]
    out, lse = ops.attention_forward(*x64, seg, window, softcap, blocks=blocks)
    grads = ops.attention_backward(dout.astype(np.float64), *x64, out, lse, seg, window, softcap, blocks=blocks)
    return (q, k, v, dout), (out, lse) + tuple(grads)


def _run(rt, name, B, T, Hq, Hkv, D, seg, window, seed=0, softcap=0.0, blocks=None):
    """Forward and backward through kernels.attention_* with the candidate `name` pinned; the largest error
    relative to each output's magnitude. blocks (B, T): Gemma 3's image blocks, or None."""
    (q, k, v, dout), want = _case(B, T, Hq, Hkv, D, seg, window, seed, softcap, blocks)
    tq, tk, tv, tdo = (rt.upload(x) for x in (q, k, v, dout))
    ts = rt.upload(seg.astype(np.int32) if blocks is None else AK.extents(seg, blocks))
    extra = {} if blocks is None else {"blocks": True}
    out, dq = rt.buffer(q.nbytes), rt.buffer(q.nbytes)
    lse, scratch = rt.buffer(4 * B * Hq * T), rt.buffer(4 * A.attention_scratch_size(B, T, Hq))
    dkv = rt.buffer(2 * k.nbytes)                       # dk and dv share a buffer, as in the engine
    dk, dv = (dkv, 0), (dkv, k.size)
    with tune.pinned(name):
        rec = rt.recorder()
        A.attention_forward(rec, out, lse, tq, tk, tv, ts, B, T, Hq, Hkv, D, window, softcap, **extra)
        A.attention_backward(rec, dq, dk, dv, tdo, tq, tk, tv, out, lse, ts, B, T, Hq, Hkv, D, scratch, window,
                             softcap, **extra)
        rec.submit()
    got = [rt.read(out, F32, q.shape), rt.read(lse, F32, (B, Hq, T)), rt.read(dq, F32, q.shape),
           rt.read(dkv, F32, (2,) + k.shape)[0], rt.read(dkv, F32, (2,) + k.shape)[1]]
    rt.release(tq, tk, tv, tdo, ts, out, dq, lse, scratch, dkv)
    return max(float(np.max(np.abs(a - w)) / (1 + np.max(np.abs(w)))) for a, w in zip(got, want))


def _names(rt, D, T=64, rep=2):
    """The candidates that apply on this adapter to an aligned problem of this shape."""
    t = {n: rt.buffer(16) for n in ("q", "k", "v", "out", "lse", "segment_ids")}
    names = [c.name for c in AK.AttentionProblem(rt, "forward", t, 1, T, rep, 1, D).candidates()]
    rt.release(*t.values())
    return names


ALL = [c.name for c in AK.REGS_CONFIGS + AK.TILES_CONFIGS] + ["rows/vec4", "rows/scalar"]


@pytest.mark.parametrize("name", ALL)
def test_every_candidate(default_rt, name):
    """Each candidate, where it applies, on packed rows with padding (GQA 4 / 2), then with a window, then with
    the scores soft-capped (Gemma 2; a cap of 1.5 bends most of these scores) (on one adapter: both software
    adapters compile WGSL with the same llvmpipe; test_long_sequences runs both)."""
    rt = default_rt
    D = 32 if name.startswith("regs/") or name.startswith("tiles/q16l16") else 64
    if name not in _names(rt, D):
        pytest.skip(f"{name} does not run head dim {D} on {rt.info.name}")
    seg = _packed(2, 150, np.random.default_rng(1))
    if name == "rows/scalar":     # the per-row scalar kernels run only where nothing else does: odd offsets
        pytest.skip("covered by test_kernels.py's odd-offset cases")
    assert _run(rt, name, 2, 150, 4, 2, D, seg, 0) < 2e-5
    assert _run(rt, name, 2, 150, 4, 2, D, seg, 37, seed=1) < 2e-5
    assert _run(rt, name, 2, 150, 4, 2, D, seg, 37, seed=2, softcap=1.5) < 2e-5


BLOCKS = [c.name for c in AK.REGS_CONFIGS + AK.TILES_CONFIGS] + ["rows/scalar"]


@pytest.mark.parametrize("name", BLOCKS)
def test_image_blocks(default_rt, name):
    """Gemma 3's images: each candidate that takes them (the flash kernels, the scalar per-row ones at a head dim
    of 14) with bidirectional image blocks (one across a tile boundary, one longer than the window, one at a
    row's end) in packed rows with padding, without and with a window; the vec4 per-row kernels never take them."""
    rt = default_rt
    D = 32 if name.startswith("regs/") or name.startswith("tiles/q16l16") else 14 if name == "rows/scalar" else 64
    if name not in _names(rt, D):
        pytest.skip(f"{name} does not run head dim {D} on {rt.info.name}")
    seg = np.ones((2, 100), np.int32)
    seg[0, 60:] = 2
    seg[1, 90:] = 0
    blocks = np.full((2, 100), -1, np.int32)
    blocks[0, 20:70 - 10] = 0           # within the first sample, across a tile boundary of 32
    blocks[0, 95:] = 1                  # the second sample's end
    blocks[1, 3:50] = 0                 # longer than the window
    assert _run(rt, name, 2, 100, 4, 2, D, seg, 0, blocks=blocks) < 2e-5
    assert _run(rt, name, 2, 100, 4, 2, D, seg, 37, seed=1, blocks=blocks) < 2e-5
    t = {n: rt.buffer(16) for n in ("q", "k", "v", "out", "lse", "segment_ids")}
    p = AK.AttentionProblem(rt, "forward", t, 1, 64, 2, 1, D, blocks=True)
    assert "rows/vec4" not in [c.name for c in p.candidates()] and p.key().endswith(" blocks")
    rt.release(*t.values())


@pytest.mark.parametrize("D", [64, 80, 128, 256])
def test_default_head_dims(default_rt, D):
    """The untuned choice for each head dim the models have, grouped heads and a window."""
    rt = default_rt
    seg = np.ones((1, 70), np.int32)
    seg[0, 60:] = 0
    name = _names(rt, D)[0]
    assert _run(rt, name, 1, 70, 2, 1, D, seg, 0) < 2e-5, name
    assert _run(rt, name, 1, 70, 2, 1, D, seg, 25) < 2e-5, name


@pytest.mark.parametrize("kind", ["causal", "packed", "window"])
def test_long_sequences(rt, kind):
    """T = 2048 with the adapter's default kernel: one causal row, packed rows, a 512-token window."""
    T = 2048
    seg = _packed(1, T, np.random.default_rng(2)) if kind == "packed" else np.ones((1, T), np.int32)
    name = _names(rt, 64, T, 3)[0]
    assert _run(rt, name, 1, T, 3, 1, 64, seg, 512 if kind == "window" else 0) < 2e-5, name


def test_cpu_loop_budget_drops_the_row_kernels(rt):
    """On a CPU adapter the per-row kernels would pass llvmpipe's 65535 loop iterations at T = 2048 (wrong
    results, silently): they are not candidates there; the flash kernels are."""
    names = _names(rt, 64, 2048, 3)
    if rt.info.adapter_type == "CPU":
        assert "rows/vec4" not in names and names[0].startswith("regs/")
    assert "rows/vec4" in _names(rt, 64, 64, 3)


def test_no_kernel_is_one_clear_error(rt):
    t = {n: rt.buffer(16) for n in ("q", "k", "v", "out", "lse", "segment_ids")}
    with pytest.raises(DeviceError, match="head dim must be a multiple of 4"):
        AK.AttentionProblem(rt, "forward", t, 1, 8, 2, 1, 250).candidates()
    rt.release(*t.values())
    assert AK.supported_head_dim(256) and AK.supported_head_dim(10) and not AK.supported_head_dim(250)
    assert not AK.supported_head_dim(260)


def test_sources_expand_every_marker():
    """The specialised sources hold no marker, one line per template line (then the common helpers), and the
    config block rewritten."""
    for cfg in AK.REGS_CONFIGS[:1] + AK.TILES_CONFIGS[:1]:
        for pass_ in src.PASSES:
            text = src.source(cfg, pass_, 64)
            assert "$" not in text
            own, common = (shader_text(name) for name in (cfg.shader, src.COMMON))
            assert text.count("\n") == own.count("\n") + 1 + common.count("\n")
            assert text.count("@binding(1)") == 1 and text.count("fn seg_at") == 1
            assert "const D4: u32 = 16u;" in text and src.ENTRIES[pass_] in text
