"""The short convolution's kernel family (engines/webgpu/short_conv.py, tuned/short_conv_kernels.py) against the
reference (engines/shared/short_conv.py, float64 on the same inputs), on every adapter present and every candidate:
forward, dx and dw at a length no tile divides, with a packed row (three sequences, two adjacent, a padding gap) and a left-padded
one, an odd channel count, with and without SiLU; the weight gradient's partial sums over several blocks; 16-bit
x / y / dx; the recurrent step over interleaved rows that start and continue."""
from __future__ import annotations

import numpy as np
import pytest

from tolerances import assert_close
from wgpu_train.engines.shared import short_conv as ref
from wgpu_train.engines.webgpu import short_conv as W
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.tuned import short_conv_kernels as SK
from wgpu_train.engines.webgpu.tuned import tune

CANDIDATES = [f"short_conv/t{t}/w{w}" for t, w in dict.fromkeys(SK.CPU_CONFIGS + SK.GPU_CONFIGS)]


def _segments(B, T):
    """Row 0 packed: three sequences, the first two adjacent, a padding gap before the third; row 1 left-padded;
    further rows one sequence."""
    seg = np.ones((B, T), np.int32)
    seg[0, T // 4:T // 2] = 3
    seg[0, T // 2:T // 2 + 3] = 0
    seg[0, T // 2 + 3:] = 2
    if B > 1:
        seg[1, :T // 4] = 0
    return seg


def _silu(z):
    return z / (1 + np.exp(-z))


def _reference(x, w, dy, seg, activation):
    """y, dx, dw of the op with the activation, in float64."""
    z = ref.short_conv_forward(x, w, seg)
    if activation != "silu":
        return (z, *ref.short_conv_backward(dy, x, w, seg))
    s = 1 / (1 + np.exp(-z))
    dz = dy * s * (1 + z * (1 - s))
    return (_silu(z), *ref.short_conv_backward(dz, x, w, seg))


def _case(rt, pin, B, T, C, K, activation=None, fmt="f32", segments=True, seed=0, accumulate=False):
    """Forward then backward, one candidate pinned, against the reference (accumulate: dw added to 0.5s)."""
    rng = np.random.default_rng(seed)
    x = storage.rounded(rng.standard_normal((B, T, C)).astype(np.float32), fmt).reshape(B, T, C)
    w = (0.5 * rng.standard_normal((C, 1, K))).astype(np.float32)
    dy = storage.rounded(rng.standard_normal((B, T, C)).astype(np.float32), fmt).reshape(B, T, C)
    seg = _segments(B, T) if segments else np.ones((B, T), np.int32)
    want_y, want_dx, want_dw = _reference(*(a.astype(np.float64) for a in (x, w, dy)), seg, activation)
    xb, dyb = storage.upload(rt, x.reshape(-1), fmt), storage.upload(rt, dy.reshape(-1), fmt)
    wb, segb = rt.upload(w.reshape(-1)), (rt.upload(seg) if segments else None)
    y, dx = (storage.upload(rt, np.full(B * T * C, np.nan, np.float32), fmt) for _ in range(2))
    dw = rt.upload(np.full(C * K, 0.5 if accumulate else np.nan, np.float32))
    scratch = rt.buffer(4 * W.scratch_size(B, T, C, K))
    before = dict(rt.counters)
    with tune.pinned(pin):
        rec = rt.recorder()
        W.short_conv_forward(rec, y, xb, wb, segb, B, T, C, K, activation)
        W.short_conv_backward(rec, dx, dw, dyb, xb, wb, segb, B, T, C, K, scratch, activation, accumulate)
    assert rt.counters["submits"] == before["submits"] and rt.counters["readbacks"] == before["readbacks"]
    rec.submit()
    what = f"{pin} T={T} C={C} K={K} {activation} {fmt}"
    tol = "k_short_conv" if fmt == "f32" else f"k_short_conv_{fmt}"
    for name, buf, want in (("y", y, want_y), ("dx", dx, want_dx)):
        got = storage.read(rt, buf, want.size).reshape(want.shape)
        want = storage.rounded(want.astype(np.float32), fmt).reshape(want.shape) if fmt != "f32" else want
        assert_close(got, want, tol, f"{name}, {what}")
    assert_close(rt.read(dw, np.float32, want_dw.shape), want_dw + (0.5 if accumulate else 0), "k_short_conv",
                 f"dw, {what}")
    rt.release(xb, dyb, wb, y, dx, dw, scratch, *([segb] if segments else []))


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("pin", CANDIDATES)
def test_every_candidate_packed_and_padded_rows(rt, pin, activation, monkeypatch):
    """T = 37 (no tile divides it), kernel 4, 7 channels (an odd last pair), a packed and a left-padded row; the
    weight gradient in blocks of 8 positions (five per row, the last partial)."""
    monkeypatch.setattr(SK, "ROWS", 8)
    _case(rt, pin, 2, 37, 7, 4, activation)


def test_long_rows_take_longer_blocks(rt, monkeypatch):
    """The weight gradient's blocks grow past ROWS positions where the batch would need more than MAX_BLOCKS."""
    monkeypatch.setattr(SK, "ROWS", 4)
    monkeypatch.setattr(SK, "MAX_BLOCKS", 5)
    assert SK.blocks(2, 37) == (19, 2)
    _case(rt, CANDIDATES[0], 2, 37, 5, 4, "silu", seed=4)


def test_lfm2_kernel_size_no_segments_shorter_than_the_kernel(rt):
    """K = 3 (LFM2's) on rows of 2 positions, no segment ids (every position real); dw added to what it holds."""
    _case(rt, CANDIDATES[0], 3, 2, 6, 3, segments=False, seed=1, accumulate=True)


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_sixteen_bit_activations(rt, fmt):
    """x and dy stored in 16 bits, y and dx written in 16 bits (an even channel count), SiLU; arithmetic float32."""
    _case(rt, CANDIDATES[0], 2, 21, 8, 4, "silu", fmt=fmt, seed=2)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_step_over_interleaved_rows(rt, activation):
    """Three calls of the step: rows starting fresh in a slot that held another row, rows continuing, several
    tokens of one row (a prefill) interleaved with other rows' tokens, against the reference's cached form."""
    rng = np.random.default_rng(3)
    slots, C, K = 3, 5, 4
    w = (0.5 * rng.standard_normal((C, 1, K))).astype(np.float32)
    state = rng.standard_normal((slots, K - 1, C)).astype(np.float32)      # stale: a fresh row must ignore it
    want_state = {}
    wb, sb = rt.upload(w.reshape(-1)), rt.upload(state)
    calls = [[0, 2, 0, 0, 2], [1, 0, 2], [0, 0, 1, 1, 1]]
    starts = [{0: 0, 2: 0}, {1: 0, 0: 4, 2: 2}, {0: 0, 1: 1}]             # row 0 restarts in call 3 (a new row)
    for rows, start in zip(calls, starts):
        rows = np.asarray(rows)
        x = rng.standard_normal((rows.size, C)).astype(np.float32)
        runs = [(slot, np.flatnonzero(rows == slot), start[slot]) for slot in np.unique(rows)]
        want = np.zeros_like(x, np.float64)
        for slot, idx, s in runs:
            before = want_state.get(slot) if s else np.zeros((K - 1, C))
            want[idx], want_state[slot] = ref.short_conv_cached_forward(x[idx].astype(np.float64), before,
                                                                        w.astype(np.float64))
        if activation == "silu":
            want = _silu(want)
        table = W.step_table(runs)
        xb, tb, yb = rt.upload(x), rt.upload(table), rt.buffer(4 * x.size)
        rec = rt.recorder()
        W.short_conv_step(rec, yb, sb, xb, wb, tb, len(runs), rows.size, C, K, activation)
        rec.submit()
        assert_close(rt.read(yb, np.float32, x.shape), want, "k_short_conv", f"y, rows {rows.tolist()}")
        got_state = rt.read(sb, np.float32, state.shape)
        for slot, _, _ in runs:
            assert_close(got_state[slot], want_state[slot], "k_short_conv", f"state of slot {slot}")
        rt.release(xb, tb, yb)
    rt.release(wb, sb)


def test_bad_arguments_raise_one_line(default_rt):
    rec = default_rt.recorder()
    buf = default_rt.buffer(64)
    with pytest.raises(ValueError, match="kernel sizes"):
        W.short_conv_forward(rec, buf, buf, buf, None, 1, 4, 2, SK.MAX_K + 1)
    with pytest.raises(ValueError, match="activation"):
        W.short_conv_forward(rec, buf, buf, buf, None, 1, 4, 2, 3, "gelu")
    with pytest.raises(ValueError, match="scratch"):
        W.short_conv_backward(rec, buf, buf, buf, buf, buf, None, 1, 4, 2, 3)
    default_rt.release(buf)
