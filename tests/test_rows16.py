"""16-bit tensors in the decoder layer's row-wise and elementwise kernels: rmsnorm (both layouts, Gemma's offset),
rope (partial rotary widths, odd and even half widths, in place), swiglu / geglu, LoRA dropout and DoRA, forward
and backward with bfloat16, float16 and mixed formats, against the NumPy reference in float64 on the same rounded
inputs with its output rounded once to the format; the neighbours of every written range stay untouched."""
from __future__ import annotations

import numpy as np
import pytest

from wgpu_train.engines.numpy import ops
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.device import storage

from tolerances import assert_close

JUNK = 7.0     # what the neighbours of a tensor hold, before and after


def rounded(values, fmt):
    """values as format fmt stores them (float64)."""
    v = np.asarray(values, np.float32)
    return storage.from_words(storage.to_words(v, fmt), v.size, fmt).reshape(v.shape).astype(np.float64)


def draw(g, shape, fmt, scale=1.0):
    """Random values that format fmt holds exactly (float64)."""
    return rounded(g.standard_normal(shape) * scale, fmt)


def put(rt, values, fmt, lead=2):
    """(buffer, lead): values in format fmt from element `lead` on (even for 16-bit formats, as the engine places
    them), between neighbours holding JUNK."""
    values = np.asarray(values, np.float32).ravel()
    data = np.full(lead + values.size + 2, JUNK, np.float32)
    data[lead:lead + values.size] = values
    return storage.upload(rt, data, fmt), lead


def get(rt, t, n):
    """The n values of tensor t = (buffer, lead) (float64), after checking that its neighbours still hold JUNK."""
    buf, lead = t
    data = storage.read(rt, buf, lead + n + 2).astype(np.float64)
    assert (data[:lead] == JUNK).all() and (data[lead + n:] == JUNK).all(), "a neighbour of the tensor changed"
    return data[lead:lead + n]


def run(rt, record):
    rec = rt.recorder()
    record(rec)
    rec.submit()


def tol(fmt, f32_name):
    """The tolerance of an output stored in fmt: the kernel's float32 entry, plus a unit of the 16-bit format."""
    return f32_name if fmt == "f32" else f"k16_{fmt}"


# ---- rmsnorm --------------------------------------------------------------------------------

@pytest.fixture(params=["row", "workgroup"])
def rms_layout(request, monkeypatch):
    """Both layouts on every adapter: one invocation per row (CPU adapters' choice at every width, GPUs' up to 256),
    then one workgroup per row (GPUs' above)."""
    limit = 1 << 30 if request.param == "row" else 0
    monkeypatch.setattr(K, "RMS_ROW_MAX_C", limit)
    monkeypatch.setattr(K, "RMS_ROW_MAX_C_CPU", limit)
    return request.param


# formats of x, y, dy, dx; width 32 and offsets 4: the float32 case takes the vec4 kernels (accumulating dx there
# too), the mixed case would were its formats ignored
RMS_CASES = [((fmt,) * 4, n, c, offset, 2) for fmt in ("bf16", "f16") for n, c, offset in [(5, 30, 0.0), (4, 42, 1.0)]]
RMS_CASES += [(("bf16", "f16", "f32", "bf16"), 3, 32, 0.0, 4), (("f32",) * 4, 3, 32, 0.0, 4)]


@pytest.mark.parametrize("formats,N,C,offset,lead", RMS_CASES)
def test_rmsnorm(rt, rms_layout, formats, N, C, offset, lead):
    """y and rstd, then dx and dweight (float32 from 16-bit inputs), then dx accumulated (one rounding of the sum);
    offset 1: Gemma's norms."""
    fx, fy, fdy, fdx = formats
    g = np.random.default_rng(N * C)
    x, dy, dx0 = draw(g, (N, C), fx, 2.0), draw(g, (N, C), fdy), draw(g, (N, C), fdx)
    w = (1.0 - offset + 0.3 * g.standard_normal(C)).astype(np.float32).astype(np.float64)
    tx, tdy, tw = put(rt, x, fx, lead), put(rt, dy, fdy, lead), rt.upload(w.astype(np.float32))
    y, dx = put(rt, np.zeros(N * C), fy, lead), put(rt, dx0, fdx, lead)
    rstd, dw, scratch = rt.buffer(4 * N), rt.buffer(4 * C), rt.buffer(4 * K.rmsnorm_scratch_size(N, C))
    run(rt, lambda r: (K.rmsnorm_forward(r, y, rstd, tx, tw, N, C, 1e-6, offset),
                       K.rmsnorm_backward(r, dx, dw, tdy, tx, tw, rstd, N, C, scratch, offset=offset)))
    want_y, want_rstd = ops.rmsnorm_forward(x, w, 1e-6, offset)
    assert_close(get(rt, y, N * C), rounded(want_y, fy).ravel(), tol(fy, "k_rmsnorm"), "y")
    assert_close(rt.read(rstd, np.float32, (N,)), want_rstd, "k_rmsnorm", "rstd")
    want_dx, want_dw = ops.rmsnorm_backward(dy, x, w, want_rstd, offset)
    assert_close(get(rt, dx, N * C), rounded(want_dx, fdx).ravel(), tol(fdx, "k_rmsnorm"), "dx")
    assert_close(rt.read(dw, np.float32, (C,)), want_dw, "k_rmsnorm_dweight", "dweight")
    before = get(rt, dx, N * C)
    run(rt, lambda r: K.rmsnorm_backward(r, dx, None, tdy, tx, tw, rstd, N, C, None, offset=offset,
                                         accumulate_dx=True))
    assert_close(get(rt, dx, N * C), rounded(before + want_dx.ravel(), fdx), tol(fdx, "k_rmsnorm"), "dx accumulated")


# ---- rope -----------------------------------------------------------------------------------

def _inv_freq(rotary, theta=10000.0):
    return (1.0 / theta ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary)).astype(np.float32)


@pytest.mark.parametrize("fx,fy", [("bf16", "bf16"), ("f16", "f16"), ("bf16", "f16")])
@pytest.mark.parametrize("D,rotary", [(14, 0), (12, 0), (14, 6), (10, 8)])
def test_rope(rt, fx, fy, D, rotary):
    """Half widths 7 and 3 (odd: a 16-bit word holds parts of two rotation pairs, so a head per invocation) and 6
    and 4 (even: two pairs per invocation); partial widths 6 and 8 pass the other dims through, under longrope's
    scale; the backward; in place when the formats agree. Positions < 64 (k_rope_small's float32 part)."""
    N, H = 6, 3
    g = np.random.default_rng(D * 10 + rotary)
    x = draw(g, (1, N, H, D), fx, 2.0)
    pos = g.integers(0, 64, (1, N)).astype(np.int32)
    inv, scale = _inv_freq(rotary or D), 0.8 if rotary else 1.0
    tx, tp, tf = put(rt, x, fx), rt.upload(pos), rt.upload(inv)
    y, dx = put(rt, np.zeros(x.size), fy), put(rt, np.zeros(x.size), fy)
    run(rt, lambda r: (K.rope_forward(r, y, tx, tp, tf, N, H, D, scale, rotary),
                       K.rope_backward(r, dx, tx, tp, tf, N, H, D, scale, rotary)))
    inv64 = inv.astype(np.float64)
    want_y, want_dx = ops.rope_forward(x, pos, inv64, scale), ops.rope_backward(x, pos, inv64, scale)
    assert_close(get(rt, y, x.size), rounded(want_y, fy).ravel(), tol(fy, "k_rope_small"), "forward")
    assert_close(get(rt, dx, x.size), rounded(want_dx, fy).ravel(), tol(fy, "k_rope_small"), "backward")
    if fx == fy:
        run(rt, lambda r: K.rope_forward(r, tx, tx, tp, tf, N, H, D, scale, rotary))
        rotated = get(rt, tx, x.size)
        assert_close(rotated, rounded(want_y, fx).ravel(), tol(fx, "k_rope_small"), "forward in place")
        run(rt, lambda r: K.rope_backward(r, tx, tx, tp, tf, N, H, D, scale, rotary))
        back = ops.rope_backward(rotated.reshape(x.shape), pos, inv64, scale)
        assert_close(get(rt, tx, x.size), rounded(back, fx).ravel(), tol(fx, "k_rope_small"), "backward in place")


# ---- swiglu, geglu --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
@pytest.mark.parametrize("fg,fu,fo", [("bf16",) * 3, ("f16",) * 3, ("bf16", "f16", "f32"), ("f32", "f32", "bf16")])
@pytest.mark.parametrize("n", [7, 90])
def test_gated_activation(rt, kind, fg, fu, fo, n):
    """h, dgate and dup stored in fo from gate (fg), up and dh (fu), saturated gates both ways; an odd n stores its
    last element alone (its word's other half, a neighbour, untouched); swiglu's backward in place."""
    g = np.random.default_rng(n + len(kind))
    gate, up, dh = draw(g, n, fg, 4.0), draw(g, n, fu), draw(g, n, fu)
    gate[:2] = [-30.0, 30.0]
    tg, tu, tdh = put(rt, gate, fg), put(rt, up, fu), put(rt, dh, fu)
    h, dgate, dup = (put(rt, np.zeros(n), fo) for _ in range(3))
    forward, backward = getattr(K, kind + "_forward"), getattr(K, kind + "_backward")
    run(rt, lambda r: (forward(r, h, tg, tu, n), backward(r, dgate, dup, tdh, tg, tu, n)))
    name = tol(fo, "k_swiglu")
    assert_close(get(rt, h, n), rounded(getattr(ops, kind + "_forward")(gate, up), fo), name, "h")
    want_dg, want_du = getattr(ops, kind + "_backward")(dh, gate, up)
    assert_close(get(rt, dgate, n), rounded(want_dg, fo), name, "dgate")
    assert_close(get(rt, dup, n), rounded(want_du, fo), name, "dup")
    if kind == "swiglu" and fg == fu:
        run(rt, lambda r: K.swiglu_backward(r, tg, tu, tdh, tg, tu, n))
        assert_close(get(rt, tg, n), rounded(want_dg, fg), tol(fg, "k_swiglu"), "dgate in place")
        assert_close(get(rt, tu, n), rounded(want_du, fu), tol(fu, "k_swiglu"), "dup in place")


# ---- LoRA dropout ---------------------------------------------------------------------------

@pytest.mark.parametrize("fx,fdx", [("bf16", "bf16"), ("f16", "f16"), ("f16", "bf16")])
def test_lora_dropout(rt, fx, fdx):
    """The masked LoRA input (float32, as the engine keeps it) from a 16-bit x, exactly; its backward adding into
    a 16-bit dx (one rounding of dx + dy * mask); n odd: the last element alone, its word's other half kept."""
    n, p = 91, 0.3
    g = np.random.default_rng(3)
    x, dy, dx0 = draw(g, n, fx), draw(g, n, "f32"), draw(g, n, fdx)
    seeds = rt.upload(np.array([3, 12345], np.uint32))
    tx, y, tdy, dx = put(rt, x, fx, 0), put(rt, np.zeros(n), "f32", 0), put(rt, dy, "f32", 0), put(rt, dx0, fdx, 0)
    run(rt, lambda r: (K.lora_dropout_forward(r, y, tx, seeds, 1, p, n),
                       K.lora_dropout_backward(r, dx, tdy, seeds, 1, p, n)))
    mask = ops.dropout_mask(12345, (n,), p)
    assert 0 < (mask == 0).sum() < n
    assert_close(get(rt, y, n), x.astype(np.float32) * mask, "exact", "masked input")
    assert_close(get(rt, dx, n), rounded(dx0 + dy * mask, fdx), tol(fdx, "k_elementwise"), "dx += dy * mask")


# ---- DoRA -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fy,fdy", [("bf16", "bf16"), ("f16", "f16"), ("bf16", "f16")])
def test_dora(rt, fy, fdy):
    """y (fy) = c z + bias, and y (+)= (c - 1) z from its stored value, with z, m, rn float32 (LoRA internals and
    the magnitude); the backward's dz and dm (float32) from a 16-bit dy."""
    N, out_f = 5, 30
    g = np.random.default_rng(11)
    z, dy, y0 = draw(g, (N, out_f), "f32"), draw(g, (N, out_f), fdy), draw(g, (N, out_f), fy)
    m, bias, dm0 = 1 + 0.1 * draw(g, out_f, "f32"), draw(g, out_f, "f32"), draw(g, out_f, "f32")
    rn = 1 / (1 + np.abs(draw(g, out_f, "f32")))
    tz, tm, tb = put(rt, z, "f32"), rt.upload(m.astype(np.float32)), rt.upload(bias.astype(np.float32))
    trn, tdy, dm = rt.upload(rn.astype(np.float32)), put(rt, dy, fdy), rt.upload(dm0.astype(np.float32))
    y, y2, dz = put(rt, np.zeros(N * out_f), fy), put(rt, y0, fy), put(rt, np.zeros(N * out_f), "f32")
    run(rt, lambda r: (K.dora_forward(r, y, tz, tm, trn, tb, N, out_f),
                       K.dora_forward(r, y2, tz, tm, trn, None, N, out_f, offset=1.0, accumulate=True),
                       K.dora_backward(r, dz, dm, tdy, tz, tm, trn, N, out_f, offset=1.0)))
    rn32 = rn.astype(np.float32).astype(np.float64)
    assert_close(get(rt, y, N * out_f), rounded(ops.dora_forward(z, m, rn32, bias), fy).ravel(), tol(fy, "k_dora"),
                 "dora_forward")
    assert_close(get(rt, y2, N * out_f), rounded(y0 + ops.dora_forward(z, m, rn32, None, 1.0), fy).ravel(),
                 tol(fy, "k_dora"), "dora_forward, accumulated, offset 1")
    want_dz, want_dm = ops.dora_backward(dy, z, m, rn32, 1.0)
    assert_close(get(rt, dz, N * out_f), want_dz.ravel(), "k_dora", "dz")
    assert_close(rt.read(dm, np.float32, (out_f,)), dm0 + want_dm, "k_dora_sum", "dm (added)")


def test_float32_bindings_refuse_16_bit_tensors(rt):
    """rstd, dweight, the norm's partial sums, DoRA's norm and dz stay float32. Each shares its binding number with a
    16-bit-capable tensor of another entry point of its shader, which launch() cannot tell apart: the wrappers
    refuse a 16-bit one at record time instead of reading its words as floats."""
    half, f = storage.upload(rt, np.zeros(64, np.float32), "bf16"), rt.buffer(256)
    rec = rt.recorder()
    with pytest.raises(ValueError, match="rstd must be float32"):
        K.rmsnorm_forward(rec, f, half, f, f, 2, 8, 1e-6)
    with pytest.raises(ValueError, match="dweight, scratch must be float32"):
        K.rmsnorm_backward(rec, f, half, f, f, f, f, 2, 8, half)
    with pytest.raises(ValueError, match="rnorm must be float32"):
        K.dora_norm(rec, half, f, f, f, f, 1.0, 8, 2)
    with pytest.raises(ValueError, match="dz must be float32"):
        K.dora_backward(rec, half, f, f, f, f, f, 2, 8)
