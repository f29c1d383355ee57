"""The float GEMMs with 16-bit activations (bfloat16 / float16 tensors, device/storage.py): the linear and LoRA op
pairs, each GEMM family forced through the tuner's pinning, split-K, the fused LoRA epilogue, the vec4 kernels and
the tuner's own check, on every adapter, against NumPy in float64 from the same rounded inputs with the output
rounded once. Each tensor's format is its own, so the mixed cases give every binding of every kernel both formats;
the shapes are shared between tests so that few kernels compile (seconds each on llvmpipe)."""
from __future__ import annotations

import numpy as np
import pytest

from wgpu_train.engines.webgpu import lora as L
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.tensors import Matrix, linear_backward, linear_forward
from wgpu_train.engines.webgpu.tuned import gemm as G
from wgpu_train.engines.webgpu.tuned import gemm_kernels as GK
from wgpu_train.engines.webgpu.tuned import tune

from limits import max_binding
from tolerances import assert_close

N, IN, OUT, R = 6, 30, 42, 4          # tokens, widths (even, not multiples of 4), LoRA rank
PAD = 2                               # elements around each output (4 for the vec4 kernels), kept untouched


def rounded(values, fmt: str) -> np.ndarray:
    """values (any float array) as a tensor of format fmt holds them, float64."""
    v = np.asarray(values, np.float64).astype(np.float32)
    return storage.from_words(storage.to_words(v, fmt), v.size, fmt).reshape(v.shape).astype(np.float64)


class Tensors:
    """Random host tensors rounded to their formats, their GPU buffers, and outputs placed PAD elements into a
    buffer of sentinels."""

    def __init__(self, rt, seed: int):
        self.rt, self.rng, self.bufs = rt, np.random.default_rng(seed), []

    def input(self, shape, fmt: str):
        """(host values, buffer) of a random tensor in format fmt."""
        v = rounded(self.rng.standard_normal(shape), fmt)
        self.bufs.append(storage.upload(self.rt, v, fmt, "test16 input"))
        return v, self.bufs[-1]

    def output(self, shape, fmt: str, initial=None, pad: int = PAD):
        """A (buffer, pad) view holding initial (default zeros), between pad sentinels 7.0 on each side."""
        n = int(np.prod(shape))
        full = np.full(n + 2 * pad, 7.0, np.float32)
        full[pad:pad + n] = 0.0 if initial is None else np.asarray(initial, np.float32).reshape(-1)
        self.bufs.append(storage.upload(self.rt, full, fmt, "test16 output"))
        return (self.bufs[-1], pad)

    def read(self, view, shape) -> np.ndarray:
        """The tensor's values; asserts its neighbours kept their sentinels."""
        n, pad = int(np.prod(shape)), view[1]
        full = storage.read(self.rt, view[0], n + 2 * pad)
        assert (full[:pad] == 7.0).all() and (full[pad + n:] == 7.0).all(), "wrote outside the tensor"
        return full[pad:pad + n].reshape(shape)

    def release(self):
        self.rt.release(*self.bufs)


def check(got, exact, fmt: str, what: str):
    """got (stored in fmt) against the exact result rounded once to fmt."""
    assert_close(got, rounded(exact, fmt), f"k_gemm16_{fmt}", what)


def run(rt, fn):
    rec = rt.recorder()
    fn(rec)
    rec.submit()


# a candidate of each family (pinned by name prefix): small tiles, cheap to compile on llvmpipe
PINS = {"register": "register", "tiled": "tiled/t32x32x16_4x4", "splitk": "splitk4/t32x32x16_4x4"}


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_linear_forward_backward(rt, fmt):
    """linear_forward over a weight in three row chunks (each writes its columns of y at an offset, into an
    accumulated y), then linear_backward: dx (accumulated) from a 16-bit dy, dW and dbias (float32) reading the
    16-bit dy and x. Every activation in one format, as the engine keeps them."""
    t = Tensors(rt, 1)
    x, xb = t.input((N, IN), fmt)
    w = t.rng.standard_normal((OUT, IN)).astype(np.float32)
    bias = t.rng.standard_normal(OUT).astype(np.float32)
    y0 = rounded(t.rng.standard_normal((N, OUT)), fmt)
    dy, dyb = t.input((N, OUT), fmt)
    dx0 = rounded(t.rng.standard_normal((N, IN)), fmt)
    with max_binding(rt, 16 * IN * 4 + 256):            # weight chunks of 16 rows: columns 0, 16, 32 of y
        chunked = Matrix(rt, OUT, IN, "test16.w", w)
    assert len(chunked.chunks) == 3
    wm, dwm = Matrix(rt, OUT, IN, "test16.w1", w), Matrix(rt, OUT, IN, "test16.dw", np.zeros_like(w))
    biasb, dbias = rt.upload(bias), rt.upload(np.zeros(OUT, np.float32))
    y, dx = t.output((N, OUT), fmt, y0), t.output((N, IN), fmt, dx0)
    try:
        run(rt, lambda rec: (linear_forward(rec, y, xb, chunked, biasb, N, accumulate=True),
                             linear_backward(rec, dx, dwm, dbias, dyb, xb, wm, N, accumulate_dx=True)))
        w64 = w.astype(np.float64)
        check(t.read(y, (N, OUT)), y0 + x @ w64.T + bias, fmt, "y")
        check(t.read(dx, (N, IN)), dx0 + dy @ w64, fmt, "dx")
        check(dwm.read(rt), dy.T @ x, "f32", "dW")
        check(rt.read(dbias, np.float32, (OUT,)), dy.sum(0), "f32", "dbias")
    finally:
        t.release()
        rt.release(biasb, dbias, *(b for m in (chunked, wm, dwm) for b, _, _ in m.chunks))


# the pinned families' product: C (N, IN) = alpha op(A) op(B) + bias + C, op(A) = A^T (A: (K, N), as dy^T in a
# weight gradient), with K = 520 (skinny, so split-K applies); its formats mixed
FAMILY_PRODUCT = dict(K=520, fa="f16", fb="bf16", fc="bf16")


@pytest.mark.parametrize("family", ["register", "tiled", "splitk"])
def test_each_family_pinned(rt, family):
    """FAMILY_PRODUCT through gemm.gemm with each family pinned (the tuner's pinning): 16-bit A, B and C, scalar
    loads; split-K's passes keep their partials float32 and the reduce writes the 16-bit C by pairs."""
    t = Tensors(rt, 2)
    K, fa, fb, fc = FAMILY_PRODUCT.values()
    a, ab = t.input((K, N), fa)
    b, bb = t.input((K, IN), fb)
    bias, biasb = t.input(IN, "f32")
    c0 = rounded(t.rng.standard_normal((N, IN)), fc)
    c = t.output((N, IN), fc, c0)
    with tune.pinned(PINS[family]):
        assert tune.choose(rt, G.gemm_problem(rt, c, ab, bb, N, IN, K, "tn", bias=biasb)).family == family
        run(rt, lambda rec: G.gemm(rec, c, ab, bb, N, IN, K, "tn", alpha=0.5, bias=biasb, accumulate=True))
    try:
        check(t.read(c, (N, IN)), c0 + 0.5 * a.T @ b + bias, fc, family)
    finally:
        t.release()


def test_lora_forward_backward(rt):
    """h = x A^T (float32 from a 16-bit x); the base linear plus the B term into a 16-bit y as two steps whichever
    family the tuner pins (y rounded after the base output, as engines/numpy rounds it, then after the sum:
    the tiled family's fused epilogue is for a float32 y); lora_backward
    from a 16-bit dy: dB, dA (float32, accumulated) and dx += dh A rounded once after the sum. Mixed: bfloat16
    x and dy, float16 y and dx."""
    fx, fy = "bf16", "f16"
    t = Tensors(rt, 3)
    s = 0.75
    x, xb = t.input((N, IN), fx)
    w = t.rng.standard_normal((OUT, IN)).astype(np.float32)
    a, ab = t.input((R, IN), "f32")
    b, bb = t.input((OUT, R), "f32")
    bias, biasb = t.input(OUT, "f32")
    y0 = rounded(t.rng.standard_normal((N, OUT)), fy)
    dy, dyb = t.input((N, OUT), fx)
    dx0 = rounded(t.rng.standard_normal((N, IN)), fy)
    ga0, gb0 = t.rng.standard_normal((R, IN)), t.rng.standard_normal((OUT, R))
    wm = Matrix(rt, OUT, IN, "test16.w", w)
    h, dh = t.output((N, R), "f32"), t.output((N, R), "f32")
    ys = {family: t.output((N, OUT), fy, y0) for family in ("tiled", "register")}
    dx, ga, gb = t.output((N, IN), fy, dx0), t.output((R, IN), "f32", ga0), t.output((OUT, R), "f32", gb0)
    try:
        run(rt, lambda rec: L.lora_a_forward(rec, h, xb, ab, N, IN, R))
        for family, y in ys.items():
            with tune.pinned(PINS[family]):
                run(rt, lambda rec: L.linear_lora_forward(rec, y, xb, wm, biasb, N, h, R, bb, s, R, accumulate=True))
        run(rt, lambda rec: L.lora_backward(rec, dx, ga, gb, dyb, xb, h, ab, bb, s, N, IN, OUT, R, dh,
                                            accumulate_grads=True))
        h64 = x @ a.T
        check(t.read(h, (N, R)), h64, "f32", "h")
        base, term = x @ w.astype(np.float64).T + bias, s * h64 @ b.T
        for family, y in ys.items():
            check(t.read(y, (N, OUT)), rounded(y0 + base, fy) + term, fy, f"two-step y ({family})")
        dhs = s * dy @ b
        check(t.read(dx, (N, IN)), dx0 + dhs @ a, fy, "dx")
        check(t.read(ga, (R, IN)), ga0 + dhs.T @ x, "f32", "dA")
        check(t.read(gb, (OUT, R)), gb0 + s * dy.T @ h64, "f32", "dB")
    finally:
        t.release()
        rt.release(*(buf for buf, _, _ in wm.chunks))


def test_vec4_kernels(rt):
    """The vec4 kernels (sizes and offsets multiples of 4) on 16-bit A, B and C: the register kernel with op(A)
    along k and op(B) along k (nt), then op(A) along m and op(B) along n (tn), and the tiled one (tn), with its
    subgroup variant where the adapter has subgroups."""
    pins = ["tiled/t32x32x16_4x4_v4"] + ["tiled/t64x64x16_8x8_v4_sg"] * ("subgroup" in rt.features)
    t = Tensors(rt, 5)
    a1, a1b = t.input((8, 32), "f16")
    b1, b1b = t.input((40, 32), "bf16")
    c10 = rounded(t.rng.standard_normal((8, 40)), "bf16")
    a2, a2b = t.input((32, 12), "bf16")
    b2, b2b = t.input((32, 40), "f16")
    c1 = t.output((8, 40), "bf16", c10, pad=4)
    c2, *tiled = (t.output((12, 40), "f16", pad=4) for _ in range(1 + len(pins)))
    for c, a, b, M, layout in ((c1, a1b, b1b, 8, "nt"), (c2, a2b, b2b, 12, "tn")):
        p = G.gemm_problem(rt, c, a, b, M, 40, 32, layout)
        assert "gemm_v4" in GK.register_candidate(p).dispatches(p)[0][0].label
    with tune.pinned("register"):
        run(rt, lambda rec: (G.gemm(rec, c1, a1b, b1b, 8, 40, 32, "nt", accumulate=True),
                             G.gemm(rec, c2, a2b, b2b, 12, 40, 32, "tn")))
    for pin, c in zip(pins, tiled):
        with tune.pinned(pin):
            assert tune.choose(rt, G.gemm_problem(rt, c, a2b, b2b, 12, 40, 32, "tn")).name == pin
            run(rt, lambda rec: G.gemm(rec, c, a2b, b2b, 12, 40, 32, "tn"))
    try:
        check(t.read(c1, (8, 40)), c10 + a1 @ b1.T, "bf16", "nt")
        check(t.read(c2, (12, 40)), a2.T @ b2, "f16", "tn")
        for pin, c in zip(pins, tiled):
            check(t.read(c, (12, 40)), a2.T @ b2, "f16", pin)
    finally:
        t.release()


def test_tuner_checks_16_bit_candidates(rt):
    """A 16-bit problem has its own tuner key (never a float32 shape's choice), and measure() checks candidates
    on a replica in the same formats against the tolerance of the output's format (FAMILY_PRODUCT's)."""
    K, fa, fb, fc = FAMILY_PRODUCT.values()
    a = storage.set_format(rt.buffer(storage.nbytes(K * N, fa)), fa)
    b = storage.set_format(rt.buffer(storage.nbytes(K * IN, fb)), fb)
    c = storage.set_format(rt.buffer(storage.nbytes(N * IN, fc)), fc)
    plain = rt.buffer(4 * K * IN)
    try:
        p = G.gemm_problem(rt, c, a, b, N, IN, K, "tn")
        f32 = G.gemm_problem(rt, plain, plain, plain, N, IN, K, "tn")
        assert p.key() == f32.key() + f" {fa}/{fb}/{fc}" and p.signature() != f32.signature()
        cands = [next(cand for cand in GK.candidates(p) if cand.name.startswith(PINS[family]))
                 for family in ("register", "tiled")]
        results = tune.measure(rt, p, cands)
        assert set(results) == {cand.name for cand in cands} and None not in results.values(), results
    finally:
        rt.release(a, b, c, plain)


def test_16_bit_output_needs_pairs(rt):
    """A 16-bit C is written a word at a time: an odd width, pitch or offset is refused, and the register family
    offers no swapped candidate (it would store C transposed); the float32 C takes any."""
    buf = rt.buffer(4 * 4096)
    c16 = storage.set_format(rt.buffer(4 * 4096), "bf16")
    try:
        for kw in (dict(N=31), dict(ldc=33), dict(offset=1)):
            n = kw.get("N", 30)
            with pytest.raises(ValueError, match="pairs"):
                G.gemm_problem(rt, at(c16, kw.get("offset", 0)), buf, buf, 6, n, 8, "nt", ldc=kw.get("ldc"))
        G.gemm_problem(rt, at(buf, 1), buf, buf, 6, 31, 8, "nt", ldc=33)
        skinny = G.gemm_problem(rt, c16, buf, buf, 200, 2, 8, "nt")    # the register family may store C^T
        regs = [c for c in GK.candidates(skinny) if c.family == "register"]
        assert regs and not any(c.swap for c in regs)
        assert any(c.swap for c in GK.candidates(G.gemm_problem(rt, buf, buf, buf, 200, 2, 8, "nt")))
        with pytest.raises(ValueError, match="never swapped"):
            GK.Register(True, 8, 8, False).dispatches(skinny)
    finally:
        rt.release(buf, c16)
