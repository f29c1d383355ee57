"""The Gated DeltaNet layer's small op kernels (engines/webgpu/gated_deltanet.py, tuned/gated_deltanet_kernels.py)
against the reference (engines/shared/gated_deltanet.py, float64 on the same inputs) on every adapter present:
silu, the decay with A_log's and dt_bias' gradients, the gated RMSNorm with its weight's gradient; float32 and
bfloat16 activations; odd sizes (an odd element count's lone tail, an odd row width in float32), and the weight
gradients added to what the buffers held."""
from __future__ import annotations

import numpy as np
import pytest

from tolerances import assert_close
from wgpu_train.engines.shared import gated_deltanet as ref
from wgpu_train.engines.webgpu import gated_deltanet as W
from wgpu_train.engines.webgpu.device import storage


def _up(rt, x, fmt):
    """x rounded to fmt (as its buffer holds it) and its buffer."""
    x = storage.rounded(x.astype(np.float32), fmt).reshape(x.shape)
    return x, storage.upload(rt, x.reshape(-1), fmt)


def _out(rt, n, fmt):
    return storage.set_format(rt.buffer(storage.nbytes(n, fmt)), fmt)


def _read(rt, buf, shape, fmt=None):
    return storage.read(rt, buf, int(np.prod(shape))).reshape(shape)


def _check(actual, want, fmt, what):
    if fmt == "f32":
        assert_close(actual, want, "k_gated_deltanet", what)
    else:
        assert_close(actual, storage.rounded(want.astype(np.float32), fmt).reshape(want.shape),
                     "k_gated_deltanet_bf16", what)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_silu_pair(rt, fmt):
    rng = np.random.default_rng(1)
    n = 301                                  # odd: the last invocation's lone element
    x, xb = _up(rt, 3 * rng.standard_normal(n), fmt)
    dy, dyb = _up(rt, rng.standard_normal(n), fmt)
    y, dx = _out(rt, n, fmt), _out(rt, n, fmt)
    rec = rt.recorder()
    W.silu_forward(rec, y, xb, n)
    W.silu_backward(rec, dx, dyb, xb, n)
    rec.submit()
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    _check(_read(rt, y, (n,), fmt), ref.silu_forward(x64), fmt, f"silu {fmt}")
    _check(_read(rt, dx, (n,), fmt), ref.silu_backward(dy64, x64), fmt, f"silu dx {fmt}")
    rt.release(xb, dyb, y, dx)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_decay_pair(rt, fmt):
    rng = np.random.default_rng(2)
    N, H = 37, 3                             # N H odd
    a, ab = _up(rt, 2 * rng.standard_normal((N, H)), fmt)
    b, bb = _up(rt, 2 * rng.standard_normal((N, H)), fmt)
    dg, dgb = _up(rt, rng.standard_normal((N, H)), fmt)
    dbeta, dbetab = _up(rt, rng.standard_normal((N, H)), fmt)
    a_log, dt_bias = rng.uniform(-1, 1, H).astype(np.float32), rng.standard_normal(H).astype(np.float32)
    wa, wd = rt.upload(a_log), rt.upload(dt_bias)
    before = rng.standard_normal((2, H)).astype(np.float32)       # the gradients are added to
    ga, gd = rt.upload(before[0]), rt.upload(before[1])
    g, beta, da, db = (_out(rt, N * H, fmt) for _ in range(4))
    rec = rt.recorder()
    W.decay_forward(rec, g, beta, ab, bb, wa, wd, N, H)
    W.decay_backward(rec, da, db, ga, gd, dgb, dbetab, ab, bb, wa, wd, N, H)
    rec.submit()
    f64 = [x.astype(np.float64) for x in (a, b, a_log, dt_bias)]
    want_g, want_beta = ref.decay_forward(*f64)
    want = ref.decay_backward(dg.astype(np.float64), dbeta.astype(np.float64), *f64)
    _check(_read(rt, g, (N, H), fmt), want_g, fmt, f"g {fmt}")
    _check(_read(rt, beta, (N, H), fmt), want_beta, fmt, f"beta {fmt}")
    _check(_read(rt, da, (N, H), fmt), want[0], fmt, f"da {fmt}")
    _check(_read(rt, db, (N, H), fmt), want[1], fmt, f"db {fmt}")
    assert_close(rt.read(ga, np.float32, (H,)), before[0] + want[2], "k_gated_deltanet_sum", f"dA_log {fmt}")
    assert_close(rt.read(gd, np.float32, (H,)), before[1] + want[3], "k_gated_deltanet_sum", f"ddt_bias {fmt}")
    rt.release(ab, bb, dgb, dbetab, wa, wd, ga, gd, g, beta, da, db)


@pytest.mark.parametrize("fmt, D", [("f32", 5), ("bf16", 6)])
def test_gated_rmsnorm_pair(rt, fmt, D):
    rng = np.random.default_rng(3)
    N, eps = 43, 1e-5
    x, xb = _up(rt, rng.standard_normal((N, D)), fmt)
    z, zb = _up(rt, 2 * rng.standard_normal((N, D)), fmt)
    dy, dyb = _up(rt, rng.standard_normal((N, D)), fmt)
    w = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    wb = rt.upload(w)
    before = rng.standard_normal(D).astype(np.float32)
    dw = rt.upload(before)
    y, dx, dz = (_out(rt, N * D, fmt) for _ in range(3))
    rec = rt.recorder()
    W.gated_rmsnorm_forward(rec, y, xb, zb, wb, N, D, eps)
    W.gated_rmsnorm_backward(rec, dx, dz, dw, dyb, xb, zb, wb, N, D, eps)
    rec.submit()
    x64, z64, w64 = x.astype(np.float64), z.astype(np.float64), w.astype(np.float64)
    want = ref.gated_rmsnorm_backward(dy.astype(np.float64), x64, z64, w64, eps)
    _check(_read(rt, y, (N, D), fmt), ref.gated_rmsnorm_forward(x64, z64, w64, eps), fmt, f"y {fmt}")
    _check(_read(rt, dx, (N, D), fmt), want[0], fmt, f"dx {fmt}")
    _check(_read(rt, dz, (N, D), fmt), want[1], fmt, f"dz {fmt}")
    assert_close(rt.read(dw, np.float32, (D,)), before + want[2], "k_gated_deltanet_sum", f"dweight {fmt}")
    rt.release(xb, zb, dyb, wb, dw, y, dx, dz)


def test_odd_rows_refused_for_16_bit_outputs(default_rt):
    rec = default_rt.recorder()
    buf = storage.set_format(default_rt.buffer(64), "bf16")
    with pytest.raises(ValueError, match="even row width"):
        W.gated_rmsnorm_forward(rec, buf, buf, buf, buf, 2, 5, 1e-6)
    default_rt.release(buf)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_per_element_sigmoid_gate(rt, fmt):
    """Qwen3.5's attention output gate, y = x sigmoid(g) with a gate per element (kernels.sigmoid_gate_forward's
    per_element form), and its backward, a pair of elements per invocation: 16-bit outputs written by words."""
    from wgpu_train.engines.numpy import ops
    from wgpu_train.engines.webgpu import kernels as K

    rng = np.random.default_rng(4)
    n, c = 7, 6
    x, xb = _up(rt, rng.standard_normal((n, c)), fmt)
    g, gb = _up(rt, 3 * rng.standard_normal((n, c)), fmt)
    dy, dyb = _up(rt, rng.standard_normal((n, c)), fmt)
    y, dx, dg = (_out(rt, n * c, fmt) for _ in range(3))
    rec = rt.recorder()
    K.sigmoid_gate_forward(rec, y, xb, gb, n, c, per_element=True)
    K.sigmoid_gate_backward(rec, dx, dg, dyb, xb, gb, n, c, per_element=True)
    rec.submit()
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    want_dx, want_dg = ops.sigmoid_gate_backward(dy.astype(np.float64), x64, g64)
    _check(_read(rt, y, (n, c)), ops.sigmoid_gate_forward(x64, g64), fmt, f"y {fmt}")
    _check(_read(rt, dx, (n, c)), want_dx, fmt, f"dx {fmt}")
    _check(_read(rt, dg, (n, c)), want_dg, fmt, f"dg {fmt}")
    rt.release(xb, gb, dyb, y, dx, dg)
