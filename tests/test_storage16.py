"""16-bit tensor storage on the GPU (engines/webgpu/device/storage.py): the kernels' float32 -> bfloat16 / float16
rounding equals NumPy's bit for bit (ties, subnormals, overflow, NaN), and the elementwise kernels give the same
numbers in every format, converting between formats in a copy."""
from __future__ import annotations

import numpy as np
import pytest

from wgpu_train.engines.shared.quant import F16_MAX
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import Kernel, prepare
from wgpu_train.engines.webgpu.device.operands import at

from tolerances import assert_close

FORMATS = ["f32", "bf16", "f16"]


def edge_values() -> np.ndarray:
    """Values at the roundings' edges: ties both ways, float16's subnormals and overflow, bfloat16's overflow,
    signed zeros, infinities, NaN, plus random ones over float32's range."""
    rng = np.random.default_rng(0)
    f16_edges = [65504.0, 65519.99, 65520.0, 65536.0, 6.1035156e-05, 6.0e-05, 5.96e-08, 2.98e-08, 2.99e-08,
                 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -11 + 2.0 ** -20]
    bf16_edges = [1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3.3895314e38, 3.4028235e38, 1e-40, -1e-40]
    special = [0.0, -0.0, np.inf, -np.inf, np.nan]
    values = np.array(f16_edges + bf16_edges + special, np.float32)
    values = np.concatenate([values, -values])
    randoms = (rng.standard_normal(2000) * np.exp(rng.uniform(-30, 30, 2000))).astype(np.float32)
    return np.concatenate([values, randoms]).astype(np.float32)


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_kernel_rounding_equals_numpys_bit_for_bit(rt, fmt):
    x = edge_values()
    src = rt.upload(x, "x")
    out = storage.set_format(rt.buffer(storage.nbytes(x.size, fmt), "y"), fmt)
    rec = rt.recorder()
    K.copy(rec, out, src, x.size)
    rec.submit()
    got = np.frombuffer(rt.read_bytes(out, 0, out.size), np.uint32)
    want = storage.to_words(x, fmt)
    nan = np.isnan(x)
    got_h, want_h = got.view(np.uint16)[:x.size], want.view(np.uint16)[:x.size]
    # NaN: any NaN of the format (the payload is the compiler's); everything else bit for bit
    assert np.array_equal(got_h[~nan], want_h[~nan])
    assert np.isnan(storage.from_words(got, x.size, fmt)[nan]).all()
    rt.release(src, out)


def test_float16_overflow_is_inf_not_the_largest_value():
    """What the kernels rely on: past 65520 the float16 value is inf, which the f16 loss scaler catches."""
    words = storage.to_words(np.array([65519.0, 65520.0, -1e6], np.float32), "f16")
    assert storage.from_words(words, 3, "f16").tolist() == [F16_MAX, np.inf, -np.inf]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 7, 600])
def test_elementwise_kernels_in_every_format(rt, fmt, n):
    """add, add_inplace, scale, softcap, copy, fill and the fused projection's columns on 16-bit tensors at even
    offsets, against NumPy on the same rounded inputs with the output rounded once; odd n stores the last element
    alone (read-modify-write of its word)."""
    rng = np.random.default_rng(n)
    a, b = (storage.from_words(storage.to_words(rng.standard_normal(n + 4), fmt), n + 4, fmt) for _ in range(2))

    def rounded(v):
        return storage.from_words(storage.to_words(v, fmt), v.size, fmt)

    def buf(values):
        return storage.upload(rt, values, fmt)

    ta, tb, y = buf(a), buf(b), buf(np.zeros(n + 4, np.float32))
    rec = rt.recorder()
    K.add(rec, at(y, 2), at(ta, 2), at(tb, 2), n)
    rec.submit()
    got = storage.read(rt, y, n + 4)
    assert_close(got[2:2 + n], rounded(a[2:2 + n] + b[2:2 + n]), "exact")
    assert got[:2].tolist() == [0, 0] and (got[2 + n:] == 0).all()           # neighbours untouched
    rec = rt.recorder()
    K.add_inplace(rec, at(y, 2), at(ta, 2), n, alpha=0.5)
    rec.submit()
    assert_close(storage.read(rt, at(y, 2), n), rounded(rounded(a[2:2 + n] + b[2:2 + n]) + np.float32(0.5) * a[2:2 + n]),
                 "exact")
    for fn, want in [(lambda r: K.scale(r, y, ta, 3.0, n), rounded(np.float32(3.0) * a[:n])),
                     (lambda r: K.softcap_forward(r, y, ta, 2.0, n), None),
                     (lambda r: K.copy(r, y, tb, n), b[:n]),
                     (lambda r: K.fill(r, y, 1.0 / 3.0, n), rounded(np.full(n, 1.0 / 3.0, np.float32)))]:
        rec = rt.recorder()
        fn(rec)
        rec.submit()
        got = storage.read(rt, y, n)
        if want is None:     # tanh is the shader's own: within float32's tanh error, then rounded
            want = rounded((2.0 * np.tanh(a[:n].astype(np.float64) / 2.0)).astype(np.float32))
            assert np.abs(got - want).max() <= 2.0 * np.abs(want).max() * (2.0 ** -7 if fmt != "f32" else 1e-6)
        else:
            assert_close(got, want, "exact")
    rt.release(ta, tb, y)


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_fused_columns_in_16_bits(rt, fmt):
    """split's kernels (a fused projection's part out and its gradient back) on 16-bit tensors of even widths."""
    rows, widths = 5, [6, 4, 4]
    rng = np.random.default_rng(1)
    fused = storage.from_words(storage.to_words(rng.standard_normal(rows * 14), fmt), rows * 14, fmt)
    src, parts = storage.upload(rt, fused, fmt), [storage.upload(rt, np.zeros(rows * w, np.float32), fmt)
                                                   for w in widths]
    rec = rt.recorder()
    K.split_forward(rec, parts, src, rows, widths)
    rec.submit()
    starts = np.cumsum([0] + widths)
    for part, w, s in zip(parts, widths, starts):
        assert_close(storage.read(rt, part, rows * w), fused.reshape(rows, 14)[:, s:s + w].reshape(-1), "exact")
    back = storage.upload(rt, np.zeros(rows * 14, np.float32), fmt)
    rec = rt.recorder()
    K.split_backward(rec, back, parts, rows, widths)
    rec.submit()
    assert_close(storage.read(rt, back, rows * 14), fused, "exact")
    rt.release(src, back, *parts)


def test_a_kernel_without_a_16_bit_variant_refuses_a_16_bit_tensor(rt):
    """A 16-bit tensor bound where a kernel declares no tensor marker is a bug caught at record time, not garbage
    (bench_fma's output is a plain float32 binding)."""
    x = storage.upload(rt, np.ones(64, np.float32), "bf16")
    with pytest.raises(ValueError, match="no 16-bit variant"):
        prepare(rt, Kernel("bench_fma", "fma_peak", "out!"), [(x, 64)])
    rt.release(x)
