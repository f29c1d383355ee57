"""Every WGSL op kernel, forward and backward, against the NumPy reference evaluated in float64, on
every adapter present: odd sizes, GQA, padding and packed segments, element offsets and row chunks."""
from __future__ import annotations

import numpy as np
import pytest

from tolerances import assert_close
from wgpu_train.engines.webgpu.tuned import attention_kernels
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu import attention as A
from wgpu_train.engines.numpy import ops, optim

F32 = np.float32


def rng(seed):
    return np.random.default_rng(seed)


def run(rt, record):
    """Record with a fresh Recorder and submit once."""
    rec = rt.recorder()
    record(rec)
    rec.submit()


def padded(rt, a, lead=0, tail=5, dtype=None):
    """A buffer holding `lead` junk elements, then a, then `tail` junk: (buffer, element offset)."""
    a = np.ascontiguousarray(a, dtype=dtype or a.dtype).ravel()
    junk = np.full(lead + a.size + tail, 7, dtype=a.dtype)
    junk[lead:lead + a.size] = a
    return (rt.upload(junk), lead)


def read(rt, t, n, dtype=np.float32):
    buf, off = t if isinstance(t, tuple) else (t, 0)
    return rt.read(buf, dtype, (n,), offset=off * 4)


# ---- elementwise ----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 17, 1000])
def test_elementwise(rt, n):
    g = rng(n)
    a, b = g.standard_normal(n).astype(F32), g.standard_normal(n).astype(F32)
    ta, tb = padded(rt, a, 3), padded(rt, b, 11)
    y, y2 = (rt.buffer(4 * (n + 9)), 9), rt.buffer(4 * n)
    acc = padded(rt, b, 1)
    run(rt, lambda r: (K.add(r, y, ta, tb, n), K.add_inplace(r, acc, ta, n, alpha=-0.5),
                       K.scale(r, y2, ta, 3.0, n)))
    assert_close(read(rt, y, n), a.astype(np.float64) + b, "k_elementwise", "add")
    assert_close(read(rt, acc, n), b - 0.5 * a.astype(np.float64), "k_elementwise", "add_inplace")
    assert_close(read(rt, y2, n), 3.0 * a.astype(np.float64), "k_elementwise", "scale")
    run(rt, lambda r: (K.add(r, y, y, tb, n), K.scale(r, y2, y2, -2.0, n)))       # in-place forms
    assert_close(read(rt, y, n), a.astype(np.float64) + 2 * b.astype(np.float64), "k_elementwise", "y += b")
    assert_close(read(rt, y2, n), -6.0 * a.astype(np.float64), "k_elementwise", "y *= s")
    c, f = rt.buffer(4 * (n + 2)), rt.buffer(4 * n)
    run(rt, lambda r: (K.copy(r, (c, 2), ta, n), K.fill(r, f, -1.25, n)))
    assert_close(read(rt, (c, 2), n), a, "exact", "copy")
    assert_close(read(rt, f, n), np.full(n, -1.25), "exact", "fill")
    with pytest.raises(ValueError, match="shares its buffer"):
        K.add(rt.recorder(), (ta[0], 0), ta, tb, 1)


# ---- swiglu ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["swiglu", "geglu", "mul"])
@pytest.mark.parametrize("n", [1, 17, 1003])
def test_gated_activation(rt, kind, n):
    """swiglu / geglu / mul (LFM2's plain gate) against the NumPy ops, with saturated gates both ways (sigmoid,
    tanh); swiglu's backward in place too."""
    g = rng({"swiglu": 100, "geglu": 200, "mul": 300}[kind] + n)
    gate = (g.standard_normal(n) * 4).astype(F32)
    gate[:3] = [-100.0, 100.0, 0.0][: min(3, n)]
    up, dh = g.standard_normal(n).astype(F32), g.standard_normal(n).astype(F32)
    tg, tu, tdh = padded(rt, gate, 1), padded(rt, up, 2), padded(rt, dh, 0)
    h, dgate, dup = rt.buffer(4 * n), rt.buffer(4 * n), rt.buffer(4 * n)
    forward, backward = getattr(K, kind + "_forward"), getattr(K, kind + "_backward")
    run(rt, lambda r: (forward(r, h, tg, tu, n), backward(r, dgate, dup, tdh, tg, tu, n)))
    g64, u64, d64 = gate.astype(np.float64), up.astype(np.float64), dh.astype(np.float64)
    assert_close(rt.read(h, F32, (n,)), getattr(ops, kind + "_forward")(g64, u64), "k_swiglu", "h")
    want_dg, want_du = getattr(ops, kind + "_backward")(d64, g64, u64)
    assert_close(rt.read(dgate, F32, (n,)), want_dg, "k_swiglu", "dgate")
    assert_close(rt.read(dup, F32, (n,)), want_du, "k_swiglu", "dup")
    if kind == "swiglu":
        run(rt, lambda r: K.swiglu_backward(r, tg, tu, tdh, tg, tu, n))             # in place
        assert_close(read(rt, tg, n), want_dg, "k_swiglu", "dgate in place")
        assert_close(read(rt, tu, n), want_du, "k_swiglu", "dup in place")


@pytest.mark.parametrize("n, c, groups", [(1, 5, 1), (13, 37, 1), (7, 30, 3)])
def test_sigmoid_gate(rt, n, c, groups):
    """Qwen2-MoE's gated shared expert, y = sigmoid(g) x, and its backward (dg a sum over each row), at offsets,
    saturated gates both ways; groups 3: LFM3's gate per head of c / 3 columns."""
    g = rng(300 + n)
    x, dy = (g.standard_normal((n, c)).astype(F32) for _ in range(2))
    gate = (g.standard_normal((n, groups)) * 3).astype(F32)
    gate[0, 0] = -100.0
    tx, tg, tdy = padded(rt, x, 3), padded(rt, gate, 1), padded(rt, dy, 2)
    y, dx, dg = rt.buffer(4 * n * c), rt.buffer(4 * n * c), rt.buffer(4 * n * groups)
    run(rt, lambda r: (K.sigmoid_gate_forward(r, y, tx, tg, n, c, groups=groups),
                       K.sigmoid_gate_backward(r, dx, dg, tdy, tx, tg, n, c, groups=groups)))
    x64, g64, dy64 = x.astype(np.float64), gate.astype(np.float64), dy.astype(np.float64)
    assert_close(rt.read(y, F32, (n, c)), ops.sigmoid_gate_forward(x64, g64), "k_swiglu", "y")
    want_dx, want_dg = ops.sigmoid_gate_backward(dy64, x64, g64)
    assert_close(rt.read(dx, F32, (n, c)), want_dx, "k_swiglu", "dx")
    assert_close(rt.read(dg, F32, (n, groups)), want_dg, "k_swiglu", "dg")


def test_softcap(rt):
    x = (rng(7).standard_normal(1001) * 20).astype(F32)
    x[:2] = [-1e4, 1e4]                                    # far past the clamp: exactly -cap / cap
    tx, y = padded(rt, x, 3), rt.buffer(4 * x.size)
    run(rt, lambda r: K.softcap_forward(r, y, tx, 30.0, x.size))
    want = ops.softcap_forward(x.astype(np.float64), 30.0)
    assert_close(rt.read(y, F32, x.shape), want, "k_swiglu", "softcap")
    run(rt, lambda r: K.softcap_forward(r, tx, tx, 30.0, x.size))                  # in place
    assert_close(read(rt, tx, x.size), want, "k_swiglu", "softcap in place")


# ---- rmsnorm --------------------------------------------------------------------------------

@pytest.fixture(params=["auto", "workgroup"])
def rms_layout(request, monkeypatch):
    """The adapter's own choice (one invocation per row on CPU adapters), then one workgroup per
    row forced: GPUs take that path for large C, so it is checked here too."""
    if request.param == "workgroup":
        monkeypatch.setattr(K, "RMS_ROW_MAX_C", 0)
        monkeypatch.setattr(K, "RMS_ROW_MAX_C_CPU", 0)
    return request.param


# lead: element offsets of x, weight, dy, rstd, dweight, y, dx; multiples of 4 allow the vec4 entry points.
@pytest.mark.parametrize("N,C,lead", [(1, 8, "odd"), (3, 17, "odd"), (65, 127, "odd"), (40, 300, "odd"),
                                      (70000, 3, "odd"), (700, 8, "four"), (300, 17, "four"),
                                      (70, 128, "four"), (70, 128, "odd"), (33, 896, "four"), (5, 8192, "four")])
def test_rmsnorm(rt, rms_layout, N, C, lead):
    g = rng(N * 1000 + C)
    x = (g.standard_normal((N, C)) * 2).astype(F32)
    w = (1 + 0.3 * g.standard_normal(C)).astype(F32)
    dy = g.standard_normal((N, C)).astype(F32)
    eps = 1e-6
    lx, lw, ldy, lr, ldw, ly, ldx = (5, 1, 3, 2, 4, 0, 0) if lead == "odd" else (4, 8, 12, 1, 3, 4, 8)
    tx, tw, tdy = padded(rt, x, lx), padded(rt, w, lw), padded(rt, dy, ldy)
    y, rstd, dx = (rt.buffer(4 * (N * C + ly)), ly), (rt.buffer(4 * (N + lr)), lr), (rt.buffer(4 * (N * C + ldx)), ldx)
    dw = (rt.upload(np.full(C + ldw, 0.5, F32)), ldw)
    scratch = rt.buffer(4 * K.rmsnorm_scratch_size(N, C))
    run(rt, lambda r: (K.rmsnorm_forward(r, y, rstd, tx, tw, N, C, eps),
                       K.rmsnorm_backward(r, dx, dw, tdy, tx, tw, rstd, N, C, scratch)))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want_y, want_rstd = ops.rmsnorm_forward(x64, w64, eps)
    assert_close(read(rt, y, N * C).reshape(N, C), want_y, "k_rmsnorm", "y")
    assert_close(read(rt, rstd, N), want_rstd, "k_rmsnorm", "rstd")
    want_dx, want_dw = ops.rmsnorm_backward(dy.astype(np.float64), x64, w64, want_rstd)
    assert_close(read(rt, dx, N * C).reshape(N, C), want_dx, "k_rmsnorm", "dx")
    assert_close(read(rt, dw, C), want_dw, "k_rmsnorm_dweight", "dweight")
    if N < 100:   # accumulate adds to dweight; dweight=None skips it
        run(rt, lambda r: (K.rmsnorm_backward(r, dx, dw, tdy, tx, tw, rstd, N, C, scratch, accumulate=True),
                           K.rmsnorm_backward(r, dx, None, tdy, tx, tw, rstd, N, C, None)))
        assert_close(read(rt, dw, C), 2 * want_dw, "k_rmsnorm_dweight", "accumulated dweight")


@pytest.mark.parametrize("N,C,lead", [(3, 17, "odd"), (70, 128, "four")])
def test_rmsnorm_offset(rt, rms_layout, N, C, lead):
    """Gemma's norms scale by 1 + weight: the offset in the forward and in dx; dweight is the same."""
    g = rng(N + C)
    x, dy = (g.standard_normal((N, C)) * 2).astype(F32), g.standard_normal((N, C)).astype(F32)
    w = (0.3 * g.standard_normal(C)).astype(F32)
    lx = 5 if lead == "odd" else 4
    tx, tw, tdy = padded(rt, x, lx), padded(rt, w, 1 if lead == "odd" else 8), padded(rt, dy, lx)
    y, rstd, dx = rt.buffer(4 * N * C), rt.buffer(4 * N), rt.buffer(4 * N * C)
    dw = rt.buffer(4 * C)
    scratch = rt.buffer(4 * K.rmsnorm_scratch_size(N, C))
    run(rt, lambda r: (K.rmsnorm_forward(r, y, rstd, tx, tw, N, C, 1e-6, offset=1.0),
                       K.rmsnorm_backward(r, dx, dw, tdy, tx, tw, rstd, N, C, scratch, offset=1.0)))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want_y, want_rstd = ops.rmsnorm_forward(x64, w64, 1e-6, 1.0)
    assert_close(rt.read(y, F32, (N, C)), want_y, "k_rmsnorm", "y")
    want_dx, want_dw = ops.rmsnorm_backward(dy.astype(np.float64), x64, w64, want_rstd, 1.0)
    assert_close(rt.read(dx, F32, (N, C)), want_dx, "k_rmsnorm", "dx")
    assert_close(rt.read(dw, F32, (C,)), want_dw, "k_rmsnorm_dweight", "dweight")


# ---- rope -----------------------------------------------------------------------------------

def _inv_freq(D, theta=10000.0):
    return (1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)).astype(F32)


@pytest.mark.parametrize("B,T,H,D,max_pos,rotary,scale,per_pair", [
    (1, 1, 1, 2, 1, 0, 1.0, False), (2, 17, 3, 8, 64, 0, 1.0, False), (1, 33, 2, 10, 4096, 0, 1.0, False),
    (2, 9, 3, 10, 64, 6, 1.53, False), (1, 5, 2, 16, 4096, 12, 0.8, False),   # partial rotary under a scale
    (2, 7, 2, 16, 300, 0, 1.0, True), (1, 6, 3, 10, 64, 6, 1.0, True)])       # each pair's position (M-RoPE)
def test_rope(rt, B, T, H, D, max_pos, rotary, scale, per_pair):
    g = rng(T * D)
    N = B * T
    x = (g.standard_normal((B, T, H, D)) * 2).astype(F32)
    pos = g.integers(0, max_pos, (B, T, (rotary or D) // 2) if per_pair else (B, T)).astype(np.int32)
    pos.flat[-1] = max_pos - 1
    inv = _inv_freq(rotary or D)
    tx, tp, tf = padded(rt, x, 1), padded(rt, pos, 3), padded(rt, inv, 2)
    y, dx = rt.buffer(4 * x.size), rt.buffer(4 * x.size)
    rope = dict(scale=scale, rotary=rotary, per_pair=per_pair)
    run(rt, lambda r: (K.rope_forward(r, y, tx, tp, tf, N, H, D, **rope),
                       K.rope_backward(r, dx, tx, tp, tf, N, H, D, **rope)))
    x64, inv64 = x.astype(np.float64), inv.astype(np.float64)
    tol = "k_rope" if max_pos > 64 else "k_rope_small"
    want_y, want_dx = ops.rope_forward(x64, pos, inv64, scale), ops.rope_backward(x64, pos, inv64, scale)
    if rotary:
        assert np.array_equal(want_y[..., rotary:], x64[..., rotary:])     # the dims past `rotary` pass through
    assert_close(rt.read(y, F32, x.shape), want_y, tol, "forward")
    assert_close(rt.read(dx, F32, x.shape), want_dx, tol, "backward")
    run(rt, lambda r: K.rope_forward(r, tx, tx, tp, tf, N, H, D, **rope))                # in place
    assert_close(read(rt, tx, x.size).reshape(x.shape), want_y, tol, "forward in place")
    run(rt, lambda r: K.rope_backward(r, tx, tx, tp, tf, N, H, D, **rope))               # and back
    assert_close(read(rt, tx, x.size).reshape(x.shape), ops.rope_backward(want_y, pos, inv64, scale), tol,
                 "backward of forward (x, the rotated dims times scale^2)")


# ---- split ----------------------------------------------------------------------------------

@pytest.mark.parametrize("N,widths", [(1, (3,)), (7, (12, 4, 4)), (33, (43, 43))])
def test_split(rt, N, widths):
    """split_forward gives each block of columns, split_backward puts the blocks back side by side; odd
    offsets on every tensor."""
    g = rng(N)
    x = g.standard_normal((N, sum(widths))).astype(F32)
    tx = padded(rt, x, 3)
    parts = [padded(rt, np.zeros((N, w), F32), 1 + j) for j, w in enumerate(widths)]
    run(rt, lambda r: K.split_forward(r, parts, tx, N, widths))
    want = ops.split_forward(x, widths)
    for j, (t, w) in enumerate(zip(parts, widths)):
        assert np.array_equal(read(rt, t, N * w).reshape(N, w), want[j]), j
    dys = [g.standard_normal((N, w)).astype(F32) for w in widths]
    tdys = [padded(rt, d, 2 + j) for j, d in enumerate(dys)]
    dx = padded(rt, np.zeros_like(x), 5)
    run(rt, lambda r: K.split_backward(r, dx, tdys, N, widths))
    assert np.array_equal(read(rt, dx, x.size).reshape(x.shape), ops.split_backward(dys))


# ---- attention ------------------------------------------------------------------------------

def _segments(kind, B, T, g):
    seg = np.ones((B, T), np.int32)
    if kind == "padded":          # right padding of different lengths, one row fully real
        for b in range(1, B):
            seg[b, max(1, T - 5 * b):] = 0
    elif kind == "packed":        # several samples per row, then padding; one row starts padded
        for b in range(B):
            cuts = np.sort(g.choice(np.arange(1, T), size=min(3, T - 1), replace=False))
            ids = np.searchsorted(cuts, np.arange(T), side="right") + 1
            seg[b] = ids
            seg[b, T - T // 6:] = 0
        if B > 1:
            seg[1, :2] = 0
    return seg


ATT_CASES = [  # B, T, Hq, Hkv, D, segments, offsets: "aligned" (multiples of 4: vec4 path when D % 4 == 0) or "odd"
    (1, 1, 2, 2, 8, "none", "aligned"),
    (2, 3, 4, 2, 8, "none", "odd"),
    (2, 17, 3, 1, 6, "padded", "aligned"),
    (2, 65, 4, 2, 8, "packed", "aligned"),
    (2, 65, 4, 2, 8, "packed", "odd"),
    (1, 300, 3, 1, 4, "packed", "aligned"),
    (3, 70, 4, 2, 12, "padded", "aligned"),   # vec4: whole groups of 4 padding queries/keys, T % 4 == 2
    (1, 5, 2, 1, 128, "padded", "aligned"),
    (1, 5, 2, 1, 128, "padded", "odd"),
]


# sliding windows (the window = 1 edge, one shorter than T, one longer than T) on scalar and vec4 paths
ATT_WINDOW_CASES = [(2, 17, 3, 1, 6, "padded", "aligned", 5), (2, 65, 4, 2, 8, "packed", "aligned", 9),
                    (2, 65, 4, 2, 8, "packed", "odd", 9), (3, 70, 4, 2, 12, "padded", "aligned", 1),
                    (1, 33, 2, 2, 8, "none", "aligned", 64)]


# soft-capped scores (Gemma 2): the per-row scalar kernels (odd offsets, head dim 6) and the vec4 ones
ATT_SOFTCAP_CASES = [(2, 17, 3, 1, 6, "padded", "odd", 5, 1.5), (2, 65, 4, 2, 8, "packed", "aligned", 0, 1.5)]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,kind,offsets,window,softcap",
                         [c + (0, 0.0) for c in ATT_CASES] + [c + (0.0,) for c in ATT_WINDOW_CASES] + ATT_SOFTCAP_CASES,
                         ids=[f"T{c[1]}-{c[2]}x{c[3]}-D{c[4]}-{c[5]}-{c[6]}" for c in ATT_CASES]
                         + [f"T{c[1]}-D{c[4]}-{c[5]}-{c[6]}-window{c[7]}" for c in ATT_WINDOW_CASES]
                         + [f"T{c[1]}-D{c[4]}-{c[5]}-{c[6]}-softcap" for c in ATT_SOFTCAP_CASES])
def test_attention(rt, B, T, Hq, Hkv, D, kind, offsets, window, softcap):
    g = rng(T * 7 + D)
    q = g.standard_normal((B, T, Hq, D)).astype(F32)
    k = g.standard_normal((B, T, Hkv, D)).astype(F32)
    v = g.standard_normal((B, T, Hkv, D)).astype(F32)
    dout = g.standard_normal((B, T, Hq, D)).astype(F32)
    seg = _segments(kind, B, T, g)
    q64, k64, v64 = q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)
    want_out, want_lse = ops.attention_forward(q64, k64, v64, seg, window, softcap)
    want_dq, want_dk, want_dv = ops.attention_backward(dout.astype(np.float64), q64, k64, v64, want_out, want_lse, seg,
                                                       window, softcap)

    lead = [4, 8, 0, 4, 12] if offsets == "aligned" else [3, 1, 0, 2, 5]
    tq, tk, tv, ts, tdo = (padded(rt, a, n) for a, n in zip((q, k, v, seg, dout), lead))
    out, lse = (rt.buffer(4 * (q.size + 8)), lead[1]), rt.buffer(4 * B * Hq * T)
    problem = attention_kernels.AttentionProblem(rt, "forward", dict(out=out, lse=lse, q=tq, k=tk, v=tv,
                                                                      segment_ids=ts), B, T, Hq, Hkv, D, window)
    assert problem.aligned == (D % 4 == 0 and offsets == "aligned")
    dq, dkv = rt.buffer(4 * q.size), rt.buffer(4 * 2 * k.size)       # dk and dv share one buffer
    dk, dv = (dkv, 0), (dkv, k.size)
    scratch = rt.buffer(4 * A.attention_scratch_size(B, T, Hq))
    run(rt, lambda r: (A.attention_forward(r, out, lse, tq, tk, tv, ts, B, T, Hq, Hkv, D, window, softcap),
                       A.attention_backward(r, dq, dk, dv, tdo, tq, tk, tv, out, lse, ts, B, T, Hq, Hkv, D, scratch,
                                            window, softcap)))
    assert_close(read(rt, out, q.size).reshape(q.shape), want_out, "k_attention", "out")
    assert_close(rt.read(lse, F32, (B, Hq, T)), want_lse, "k_attention_lse", "lse")
    assert_close(rt.read(dq, F32, q.shape), want_dq, "k_attention_grad", "dq")
    assert_close(read(rt, dk, k.size).reshape(k.shape), want_dk, "k_attention_grad", "dk")
    assert_close(read(rt, dv, k.size).reshape(k.shape), want_dv, "k_attention_grad", "dv")


# ---- cross-entropy --------------------------------------------------------------------------

@pytest.mark.parametrize("N,V", [(1, 3), (7, 65), (20, 1000)])
def test_cross_entropy(rt, N, V):
    g = rng(N + V)
    logits = (g.standard_normal((N, V)) * 3).astype(F32)
    logits[0, :] += 40.0                                    # large logits must not overflow
    tgt = g.integers(0, V, N).astype(np.int32)
    tgt[1::3] = ops.IGNORE_INDEX
    l64 = logits.astype(np.float64)
    want_sum, want_count, want_lse = ops.cross_entropy_forward(l64, tgt)
    scale = 1.0 / max(1, want_count)
    want_dl = ops.cross_entropy_backward(l64, tgt, want_lse, scale)

    # rows in two chunks, each in its own buffer (the second at an element offset), as the engine does
    split = N // 2
    chunks = [(0, split, padded(rt, logits[:split], 0)), (split, N - split, padded(rt, logits[split:], 5))]
    tt = padded(rt, tgt, 1)
    loss, lse, valid = rt.buffer(4 * N), (rt.buffer(4 * (N + 3)), 3), rt.buffer(4 * N)
    result = (rt.buffer(4 * 10), 8)
    sbuf = padded(rt, np.array([scale], F32), 2)
    douts = [rt.buffer(4 * max(1, n) * V) for _, n, _ in chunks]

    def record(r):
        for (r0, n, tl), d in zip(chunks, douts):
            K.cross_entropy_forward(r, loss, lse, valid, tl, tt, n, V, row_offset=r0)
        K.cross_entropy_reduce(r, result, loss, valid, N)
        for (r0, n, tl), d in zip(chunks, douts):
            K.cross_entropy_backward(r, d, tl, tt, lse, sbuf, n, V, row_offset=r0)
    run(rt, record)
    valid_rows = tgt != ops.IGNORE_INDEX
    picked = l64[np.arange(N), np.where(valid_rows, tgt, 0)]
    assert_close(rt.read(loss, F32, (N,)), np.where(valid_rows, want_lse - picked, 0.0), "k_cross_entropy", "row loss")
    assert_close(read(rt, lse, N), want_lse, "k_cross_entropy", "lse")
    assert_close(rt.read(valid, F32, (N,)), valid_rows.astype(np.float64), "exact", "valid")
    s, c = read(rt, result, 2)
    assert_close(s, want_sum, "k_cross_entropy_sum", "loss sum")
    assert c == want_count
    got_dl = np.concatenate([rt.read(d, F32, (n, V)) for (_, n, _), d in zip(chunks, douts) if n])
    assert_close(got_dl, want_dl, "k_cross_entropy_grad", "dlogits")
    # the entropy of each row's softmax (GRPO's metric), from the forward's lse, by chunks as the engine does
    entropy = rt.buffer(4 * N)
    run(rt, lambda r: [K.softmax_entropy_forward(r, entropy, tl, lse, n, V, row_offset=r0) for r0, n, tl in chunks])
    probs = np.exp(l64 - want_lse[:, None])
    assert_close(ops.softmax_entropy_forward(l64, want_lse), -(probs * np.log(probs)).sum(axis=1), "k_cross_entropy",
                 "the reference's entropy against -sum p log p")
    assert_close(rt.read(entropy, F32, (N,)), ops.softmax_entropy_forward(l64, want_lse), "k_cross_entropy",
                 "entropy")

    # soft-capped logits (Gemma 2): dlogits with respect to the uncapped ones
    for (r0, n, tl), d in zip(chunks, douts):
        run(rt, lambda r: K.cross_entropy_backward(r, d, tl, tt, lse, sbuf, n, V, row_offset=r0, softcap=45.0))
    got_capped = np.concatenate([rt.read(d, F32, (n, V)) for (_, n, _), d in zip(chunks, douts) if n])
    assert_close(got_capped, ops.cross_entropy_backward(l64, tgt, want_lse, scale, 45.0), "k_cross_entropy_grad",
                 "dlogits, soft-capped")
    assert not np.allclose(got_capped, want_dl)      # row 0's logits near 40 make the cap's factor matter
    # a Python float scale, in place over the logits chunk
    r0, n, tl = chunks[1]
    run(rt, lambda r: K.cross_entropy_backward(r, tl, tl, tt, lse, 2.0, n, V, row_offset=r0))
    want2 = ops.cross_entropy_backward(l64[r0:], tgt[r0:], want_lse[r0:], 2.0)
    assert_close(read(rt, tl, n * V).reshape(n, V), want2, "k_cross_entropy_grad", "dlogits in place")


# ---- embedding ------------------------------------------------------------------------------

@pytest.mark.parametrize("N,V,C", [(1, 3, 1), (40, 50, 17)])
def test_embedding(rt, N, V, C):
    g = rng(N * V)
    w = g.standard_normal((V, C)).astype(F32)
    ids = g.integers(0, V, N).astype(np.int32)
    ids[: N // 2] = ids[N // 2:][: N // 2]                  # many repeated ids
    dout = g.standard_normal((N, C)).astype(F32)
    want_out = ops.embedding_forward(ids, w)
    want_dw = ops.embedding_backward(dout.astype(np.float64), ids, V)
    tids, tdo = padded(rt, ids, 1), padded(rt, dout, 2)
    scratch = rt.buffer(4 * K.embedding_scratch_size(N))

    # the vocabulary split into two chunks in separate buffers, the second at an element offset
    cut = V // 2 + (V > 1)
    chunks = [(0, cut, padded(rt, w[:cut], 0)), (cut, V - cut, padded(rt, w[cut:], 3))]
    out = (rt.buffer(4 * (N * C + 1)), 1)
    dws = [(rt.upload(np.full(max(1, n) * C + 5, 9.0, F32)), 5) for _, n, _ in chunks]

    def record(r):
        for (r0, n, tw), dw in zip(chunks, dws):
            if n:
                K.embedding_forward(r, out, tids, tw, N, C, n, row_offset=r0)
                K.embedding_backward(r, dw, tdo, tids, N, C, n, scratch, row_offset=r0)
    run(rt, record)
    assert_close(read(rt, out, N * C).reshape(N, C), want_out, "exact", "forward")
    for (r0, n, _), dw in zip(chunks, dws):
        if n:
            assert_close(read(rt, dw, n * C).reshape(n, C), want_dw[r0:r0 + n], "k_embedding_grad", f"dweight rows {r0}..")
    r0, n, _ = chunks[0]
    run(rt, lambda r: K.embedding_backward(r, dws[0], tdo, tids, N, C, n, scratch, row_offset=r0, accumulate=True))
    assert_close(read(rt, dws[0], n * C).reshape(n, C), 2 * want_dw[:n], "k_embedding_grad", "accumulated")


# ---- optimizer ------------------------------------------------------------------------------

def test_grad_norm_and_adamw(rt):
    g = rng(5)
    sizes = [1, 17, 1000]
    grads = [(g.standard_normal(n) * 0.7).astype(F32) for n in sizes]
    params = [g.standard_normal(n).astype(F32) for n in sizes]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    max_norm = 1.0

    # all parameters and moments in one flat buffer each, tensors at element offsets
    offs = np.cumsum([0] + sizes[:-1]) + 3
    total = int(offs[-1] + sizes[-1])
    flat_p = np.zeros(total, F32)
    for o, p in zip(offs, params):
        flat_p[o:o + p.size] = p
    pbuf, mbuf, vbuf = rt.upload(flat_p), rt.buffer(4 * total), rt.buffer(4 * total)
    gbufs = [padded(rt, gr, i) for i, gr in enumerate(grads)]
    partials, result = (rt.buffer(4 * 12), 7), (rt.buffer(4 * 12), 8)

    ref_p = [p.astype(np.float64) for p in params]
    ref_m = [np.zeros(n) for n in sizes]
    ref_v = [np.zeros(n) for n in sizes]
    for step in (1, 2, 3):
        scale = 1.0 if step == 2 else 1.7 * step            # clipping active on steps 1 and 3
        gs = [gr * np.float32(scale) for gr in grads]
        for gb, gr in zip(gbufs, gs):
            rt.write(gb[0], gr, gb[1] * 4)

        def record(r):
            for i, (gb, n) in enumerate(zip(gbufs, sizes)):
                K.grad_norm_partial(r, partials, i, gb, n)
            K.grad_norm_finalize(r, result, partials, len(sizes), max_norm)
            for o, gb, n in zip(offs, gbufs, sizes):
                K.adamw_update(r, (pbuf, int(o)), gb, (mbuf, int(o)), (vbuf, int(o)), n, step=step,
                               scale_buf=result, **hp)
        run(rt, record)
        norm = optim.grad_norm([x.astype(np.float64) for x in gs])
        clip = optim.clip_scale(norm, max_norm)
        got = read(rt, result, 3)
        assert_close(got[0], norm, "k_grad_norm", f"norm step {step}")
        assert_close(got[1], clip, "k_grad_norm", f"clip scale step {step}")
        assert got[2] == 1.0
        for i in range(len(sizes)):
            optim.adamw_update(ref_p[i], gs[i].astype(np.float64), ref_m[i], ref_v[i], step=step, grad_scale=clip, **hp)
        got_p = rt.read(pbuf, F32, (total,))
        for o, n, want in zip(offs, sizes, ref_p):
            assert_close(got_p[o:o + n], want, "k_adamw", f"param step {step}")
        assert_close(rt.read(mbuf, F32, (total,))[offs[-1]:], ref_m[-1], "k_adamw", f"m step {step}")

    # a non-finite norm flags the step and leaves params and moments untouched
    before = [rt.read(b, F32, (total,)) for b in (pbuf, mbuf, vbuf)]
    bad = grads[1].copy()
    bad[3] = np.nan
    rt.write(gbufs[1][0], bad, gbufs[1][1] * 4)

    def record_bad(r):
        for i, (gb, n) in enumerate(zip(gbufs, sizes)):
            K.grad_norm_partial(r, partials, i, gb, n)
        K.grad_norm_finalize(r, result, partials, len(sizes), 0.0)
        for o, gb, n in zip(offs, gbufs, sizes):
            K.adamw_update(r, (pbuf, int(o)), gb, (mbuf, int(o)), (vbuf, int(o)), n, step=4, scale_buf=result, **hp)
    run(rt, record_bad)
    assert read(rt, result, 3)[2] == 0.0
    for b, want in zip((pbuf, mbuf, vbuf), before):
        assert_close(rt.read(b, F32, (total,)), want, "exact", "unchanged after a non-finite norm")

    # max_norm <= 0 means no clipping; accumulate adds into a slot; scale_buf=None means scale 1
    for gb, gr in zip(gbufs, grads):
        rt.write(gb[0], gr, gb[1] * 4)
    run(rt, lambda r: (K.grad_norm_partial(r, partials, 0, gbufs[2], sizes[2]),
                       K.grad_norm_partial(r, partials, 0, gbufs[1], sizes[1], accumulate=True),
                       K.grad_norm_finalize(r, result, partials, 1, -1.0)))
    norm = optim.grad_norm([grads[2], grads[1]])
    got = read(rt, result, 3)
    assert_close(got[0], norm, "k_grad_norm", "accumulated slot")
    assert got[1] == 1.0 and got[2] == 1.0
    p1 = rt.upload(params[2])
    m1, v1 = rt.buffer(4 * sizes[2]), rt.buffer(4 * sizes[2])
    run(rt, lambda r: K.adamw_update(r, p1, gbufs[2], m1, v1, sizes[2], step=1, **hp))
    want = params[2].astype(np.float64)
    optim.adamw_update(want, grads[2].astype(np.float64), np.zeros(sizes[2]), np.zeros(sizes[2]), step=1, **hp)
    assert_close(rt.read(p1, F32, (sizes[2],)), want, "k_adamw", "without scale_buf")


def test_adamw_hyperparameter_ring_overflow(rt):
    """More distinct AdamW hyper-parameter sets in one recording than the ring holds is refused,
    rather than silently overwriting a row that recording still reads."""
    p, gr, m, v = (rt.buffer(16) for _ in range(4))
    rec = rt.recorder()
    with pytest.raises(RuntimeError, match="hyper-parameter sets"):
        for s in range(K.HPARAM_ROWS + 1):
            K.adamw_update(rec, p, gr, m, v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, step=1000 + s)


# ---- the engine's helper shaders --------------------------------------------------------------

@pytest.mark.parametrize("n,p", [(1, 0.5), (1000, 0.1), (3001, 0.9)])
def test_lora_dropout(rt, n, p):
    g = rng(n)
    x, dy = g.standard_normal(n).astype(F32), g.standard_normal(n).astype(F32)
    seeds = np.array([7, 123456789, 42], np.uint32)
    dx0 = g.standard_normal(n).astype(F32)
    tx, tdy, ts, tdx = rt.upload(x), rt.upload(dy), rt.upload(seeds), rt.upload(dx0)
    y = rt.buffer(4 * n)
    run(rt, lambda r: (K.lora_dropout_forward(r, y, tx, ts, 1, p, n), K.lora_dropout_backward(r, tdx, tdy, ts, 1, p, n)))
    mask = ops.dropout_mask(int(seeds[1]), (n,), p)
    assert_close(rt.read(y, F32, (n,)), x.astype(np.float64) * mask, "k_elementwise", "dropout forward")
    assert_close(rt.read(tdx, F32, (n,)), dx0 + dy.astype(np.float64) * mask, "k_elementwise", "dropout backward")
    if n > 100:
        assert abs((mask == 0).mean() - p) < 0.05


# a KV cache of `batch` rows; tokens as (row, position); row -1 is a padding token
CACHED_CASES = {
    "one row, one query": (1, 9, [(0, 0)], 2, 1, 8),
    "decode step, GQA": (3, 45, [(2, 40), (0, 7), (1, 44)], 4, 2, 6),
    "ragged prefill with padding": (3, 12, [(1, p) for p in range(5)] + [(0, p) for p in range(9)] + [(-1, 0)],
                                    3, 3, 16),
}


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("case", list(CACHED_CASES))
def test_kv_cache_write_and_attention_cached(rt, case, window):
    batch, max_len, tokens, hq, hkv, d = CACHED_CASES[case]
    n = len(tokens)
    g = rng(n)
    rows, pos = (np.array(c, np.int32) for c in zip(*tokens))
    q = g.standard_normal((n, hq, d)).astype(F32)
    k_new, v_new = g.standard_normal((2, n, hkv, d)).astype(F32)
    kc, vc = g.standard_normal((2, batch, max_len, hkv, d)).astype(F32)   # earlier keys and values
    want_k, want_v = kc.astype(np.float64), vc.astype(np.float64)
    ops.kv_cache_write(want_k, want_v, k_new.astype(np.float64), v_new.astype(np.float64), rows, pos)
    want = ops.attention_cached_forward(q.astype(np.float64), want_k, want_v, rows, pos, window)
    out = rt.buffer(4 * q.size)
    tk, tv, tq, tkn, tvn, tr, tp = (rt.upload(a) for a in (kc, vc, q, k_new, v_new, rows, pos))
    run(rt, lambda r: (A.kv_cache_write(r, tk, tv, tkn, tvn, tr, tp, n, batch, max_len, hkv, d),
                       A.attention_cached_forward(r, out, tq, tk, tv, tr, tp, n, batch, max_len, hq, hkv, d, window)))
    assert_close(rt.read(tk, F32, kc.shape), want_k, "exact", "k_cache")
    assert_close(rt.read(tv, F32, vc.shape), want_v, "exact", "v_cache")
    assert_close(rt.read(out, F32, q.shape), want, "k_attention", "cached")
    if rows[-1] < 0:
        assert not want[-1].any()


# decoding steps over long rows (the split passes need 2 or more chunks of 32 positions): (batch, max_len,
# tokens as (row, position), hq, hkv, d); row -1 is padding
DECODE_CASES = {
    "GQA, a padding row": (3, 300, [(0, 299), (2, 150), (1, 31), (-1, 0)], 4, 2, 16),
    "head dim 10": (2, 97, [(1, 96), (0, 64)], 3, 1, 10),
}


@pytest.mark.parametrize("kernel", ["decode/single", "decode/split32", "decode/split64"])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (40, 0.0), (0, 2.0)])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_attention_cached_passes(rt, case, window, softcap, kernel):
    """Each pass of attention_cached_forward (decode_kernels: the single one, the split ones with their
    chunks) against the NumPy op: windows, soft-caps, rows of any length, chunks a row only partly fills."""
    from wgpu_train.engines.webgpu.tuned import decode_kernels, tune

    batch, max_len, tokens, hq, hkv, d = DECODE_CASES[case]
    n = len(tokens)
    g = rng(max_len + n)
    rows, pos = (np.array(c, np.int32) for c in zip(*tokens))
    q = g.standard_normal((n, hq, d)).astype(F32)
    kc, vc = g.standard_normal((2, batch, max_len, hkv, d)).astype(F32)
    want = ops.attention_cached_forward(*(x.astype(np.float64) for x in (q, kc, vc)), rows, pos, window, softcap)
    out = rt.upload(np.full(q.shape, 7.0, F32))         # junk: padding rows must be written as zeros
    scratch = rt.buffer(4 * decode_kernels.scratch_elements(batch, hq, d))
    tq, tk, tv, tr, tp = (rt.upload(a) for a in (q, kc, vc, rows, pos))
    problem = decode_kernels.DecodeProblem(rt, {}, n, batch, max_len, hq, hkv, d, window, softcap,
                                             decode_kernels.scratch_elements(batch, hq, d))
    assert kernel in [c.name for c in problem.candidates()]
    with tune.pinned(kernel):
        run(rt, lambda r: A.attention_cached_forward(r, out, tq, tk, tv, tr, tp, n, batch, max_len, hq, hkv, d,
                                                     window, softcap, scratch))
    assert_close(rt.read(out, F32, q.shape), want, "k_attention", kernel)
    assert not rt.read(out, F32, q.shape)[rows < 0].any()


@pytest.mark.parametrize("kernel", ["decode/single", "decode/split32"])
@pytest.mark.parametrize("window", [0, 20])
def test_attention_cached_image_blocks(default_rt, window, kernel):
    """A prefill with Gemma 3's images (decode_kernels.with_reaches): an image block's queries see the whole
    block, the others stay causal, within the window, in each pass; two rows, one block longer than the window."""
    from wgpu_train.engines.webgpu.tuned import decode_kernels, tune

    rt = default_rt
    batch, max_len, hq, hkv, d = 2, 80, 2, 1, 16
    rows = np.array([0] * 60 + [1] * 5 + [-1], np.int32)
    pos = np.array(list(range(60)) + list(range(30, 35)) + [0], np.int32)
    blocks = np.full(rows.size, -1, np.int32)
    blocks[10:40], blocks[61:64] = 0, 0       # block 0 of each row: the rows' blocks are apart
    g = rng(5)
    q = g.standard_normal((rows.size, hq, d)).astype(F32)
    kc, vc = g.standard_normal((2, batch, max_len, hkv, d)).astype(F32)
    want = ops.attention_cached_forward(*(x.astype(np.float64) for x in (q, kc, vc)), rows, pos, window, 0.0,
                                        blocks=blocks)
    out = rt.upload(np.full(q.shape, 7.0, F32))
    scratch = rt.buffer(4 * decode_kernels.scratch_elements(rows.size, hq, d))
    tq, tk, tv, tr, tp = (rt.upload(a) for a in (q, kc, vc, rows, decode_kernels.with_reaches(pos, blocks, rows)))
    with tune.pinned(kernel):
        run(rt, lambda r: A.attention_cached_forward(r, out, tq, tk, tv, tr, tp, rows.size, batch, max_len, hq, hkv,
                                                     d, window, 0.0, scratch, blocks=True))
    assert_close(rt.read(out, F32, q.shape), want, "k_attention", kernel)
    rt.release(out, scratch, tq, tk, tv, tr, tp)


def test_cached_attention_passes_fit_the_cpu_loop_budget(rt, monkeypatch):
    """On CPU adapters only passes within llvmpipe's loop budget are candidates (past it llvmpipe silently cuts
    the loops: the single pass stops at about 250 positions of head dim 128), the longest ones accepted still
    give the right result here, and rows too long for every pass get one line; on GPUs every pass is a
    candidate, the most chunks first."""
    from wgpu_train.errors import DeviceError
    from wgpu_train.engines.webgpu.tuned import decode_kernels as AD
    from wgpu_train.engines.webgpu.tuned import tune
    from wgpu_train.engines.webgpu.tuned.gemm_kernels import is_cpu

    on_cpu = is_cpu(rt)
    monkeypatch.setattr(AD, "is_cpu", lambda rt: True)

    def problem(length, d=128, n=2):     # n x 32 heads: a workgroup's worth of (query, head) pairs or more
        return AD.DecodeProblem(rt, {}, n, n, length, 32, 8, d, scratch_elems=AD.scratch_elements(n, 32, d))

    def names(p):
        return [c.name for c in p.candidates()]

    assert names(problem(1024))[0] == "decode/split128" and "decode/single" not in names(problem(1024))
    assert names(problem(200))[0] == "decode/single"
    assert names(problem(64 * 128))[0] == "decode/split128"
    with pytest.raises(DeviceError, match="too long for this CPU adapter's loop limit") as info:
        problem(64 * 128 + 1).candidates()
    assert "\n" not in str(info.value)
    longest = max(n for n in range(200, 300) if "decode/single" in names(problem(n)))
    assert 240 < longest < 256
    if on_cpu:     # the edges of the budget, run on this adapter: the single pass and a partial pass of 256
        for p, kernel in ((problem(longest), "decode/single"), (problem(512, d=125), "decode/split256")):
            assert kernel in names(p), kernel
            rep, res, _, want, bufs = p.replica(np.random.default_rng(1))
            with tune.pinned(kernel):
                rec = rt.recorder()
                for dispatch in tune.choose(rt, rep).dispatches(rep):
                    rec.dispatch(*dispatch)
                rec.submit()
            assert_close(rt.read(res, F32, want.shape), want, "k_attention", f"{kernel} at the budget's edge")
            rt.release(*bufs)
    # a decoding step of fewer pairs than a workgroup: the most chunks first on CPU adapters too
    assert names(problem(200, n=1))[0] == "decode/split32"
    monkeypatch.setattr(AD, "is_cpu", lambda rt: False)
    gpu = names(problem(1024))
    assert gpu[0] == "decode/split32" and gpu[-1] == "decode/single" and len(gpu) == 6