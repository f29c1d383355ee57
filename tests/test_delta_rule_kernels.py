"""The gated delta rule's kernel family (engines/webgpu/delta_rule.py, tuned/delta_rule_kernels.py) against the
reference (engines/shared/delta_rule.py, float64 on the same inputs), on every adapter present and every candidate
(chunks 16, 32, 64 x each scan spread): the forward and backward at T = 150 with packed and padded rows, grouped
key heads and an initial state; T shorter than the chunk; the scans and the runs pass split across dispatches as
llvmpipe's loop budget splits long sequences; a batch past the max storage binding recorded by rows, or by key
heads, bit-equal to one pass; 16-bit inputs; the single-token step; the l2norm pair. Tiny head dims (12 x 20)
keep it fast."""
from __future__ import annotations

import numpy as np
import pytest

from tolerances import assert_close
from wgpu_train.errors import DeviceError
from wgpu_train.engines.shared import delta_rule as ref
from wgpu_train.engines.webgpu import delta_rule as W
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.tuned import delta_rule_kernels as DK
from wgpu_train.engines.webgpu.tuned import tune

DIM_K, DIM_V = 12, 20
CANDIDATES = [f"delta_rule/c{c}/{s.name}" for c in DK.CHUNKS for s in DK.CPU_SCANS + DK.GPU_SCANS]
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


def _inputs(rng, B, T, Hk, Hv, fmt="f32"):
    """q, k (l2-normalised), v, g (log-decays in (-0.5, 0)), beta, dout, initial state: float32, the 16-bit ones
    rounded to fmt as their buffers hold them."""
    def rounded(x, f="f32"):
        return storage.rounded(x.astype(np.float32), f).reshape(x.shape)

    return dict(q=rounded(ref.l2norm_forward(rng.standard_normal((B, T, Hk, DIM_K)))[0], fmt),
                k=rounded(ref.l2norm_forward(rng.standard_normal((B, T, Hk, DIM_K)))[0], fmt),
                v=rounded(rng.standard_normal((B, T, Hv, DIM_V)), fmt),
                g=rounded(-rng.uniform(0.0, 0.5, (B, T, Hv)), fmt), beta=rounded(rng.uniform(0.0, 1.0, (B, T, Hv)), fmt),
                dout=rounded(rng.standard_normal((B, T, Hv, DIM_V))),
                initial_state=rounded(0.3 * rng.standard_normal((B, Hv, DIM_K, DIM_V))))


def _segments(B, T):
    """Row 0 packed: three runs with a padding gap between two of them; row 1 left-padded then two runs; further
    rows one run."""
    seg = np.ones((B, T), np.int32)
    seg[0, T // 3:T // 2] = 2
    seg[0, T // 2:T // 2 + 5] = 0
    seg[0, T // 2 + 5:] = 3
    if B > 1:
        seg[1, :T // 5] = 0
        seg[1, 2 * T // 3:] = 4
    return seg


def _case(rt, pin, B, T, Hk, Hv, chunk, init=True, segments=True, fmt="f32", seed=0):
    """Forward then backward of one case, recorded with one candidate pinned, against the reference; the outputs and
    gradients read back, by name."""
    names = [c.name for c in DK.DeltaRuleProblem(rt, {}, B, T, Hk, Hv, DIM_K, DIM_V, chunk).candidates()]
    assert any(name.startswith(pin) for name in names), f"{pin} is not among {names}"
    rng = np.random.default_rng(seed)
    x = _inputs(rng, B, T, Hk, Hv, fmt)
    seg = _segments(B, T) if segments else None
    f64 = {n: a.astype(np.float64) for n, a in x.items()}
    s0 = f64["initial_state"] if init else None
    args = [f64[n] for n in ("q", "k", "v", "g", "beta")]
    want_out, want_final, want_states = ref.gated_delta_rule_forward(*args, chunk, s0, seg)
    want_grads = ref.gated_delta_rule_backward(f64["dout"], *args, want_states, chunk, s0, seg)
    bufs = {n: storage.upload(rt, a.reshape(-1), fmt if n in ("q", "k", "v", "g", "beta") else "f32")
            for n, a in x.items()}
    seg_buf = rt.upload(seg) if segments else None
    out = {"out": rt.buffer(4 * want_out.size), "final_state": rt.buffer(4 * want_final.size),
           "states": rt.buffer(4 * W.states_size(B, T, Hv, DIM_K, DIM_V, chunk)),
           "scratch": rt.buffer(4 * W.scratch_size(B, T, Hv, DIM_K, DIM_V, chunk))}
    grads = {n: rt.upload(np.full(g.shape, np.nan, np.float32)) for n, g in zip(GRADS, want_grads)}
    before = dict(rt.counters)
    with tune.pinned(pin):
        rec = rt.recorder()
        W.gated_delta_rule_forward(rec, out["out"], out["final_state"], out["states"], *(bufs[n] for n in
                                   ("q", "k", "v", "g", "beta")), chunk, B, T, Hk, Hv, DIM_K, DIM_V, out["scratch"],
                                   bufs["initial_state"] if init else None, seg_buf)
        W.gated_delta_rule_backward(rec, *(grads[n] for n in GRADS[:5]), grads.get("d_initial_state"), bufs["dout"],
                                    *(bufs[n] for n in ("q", "k", "v", "g", "beta")), out["states"], chunk, B, T, Hk,
                                    Hv, DIM_K, DIM_V, out["scratch"], seg_buf)
    assert rt.counters["submits"] == before["submits"] and rt.counters["readbacks"] == before["readbacks"]
    rec.submit()
    what = f"{pin} T={T} chunk {chunk}"
    got = {}
    for name, want in (("out", want_out), ("final_state", want_final), ("states", want_states)):
        got[name] = rt.read(out[name], np.float32, want.shape)
        assert_close(got[name], want, "k_delta_rule", f"{name}, {what}")
    for name, want in zip(GRADS, want_grads):
        got[name] = rt.read(grads[name], np.float32, want.shape)
        assert_close(got[name], want, "k_delta_rule", f"{name}, {what}")
    rt.release(*bufs.values(), *out.values(), *grads.values(), *([seg_buf] if segments else []))
    return got


@pytest.mark.parametrize("pin", CANDIDATES)
def test_every_candidate_packed_and_padded_rows(rt, pin):
    """T = 150 over chunks of 16 to 64 (a partial last chunk), two value heads per key head, an initial state,
    a packed row (three runs, a padding gap) and a left-padded one."""
    chunk = int(pin.split("/")[1][1:])
    _case(rt, pin, 2, 150, 2, 4, chunk)


@pytest.mark.parametrize("chunk", DK.CHUNKS)
def test_shorter_than_a_chunk(rt, chunk):
    """T = 40 (one partial chunk at 64), no segments, no initial state, as many key as value heads."""
    _case(rt, f"delta_rule/c{chunk}", 1, 40, 3, 3, chunk, init=False, segments=False, seed=1)


def test_long_sequences_split_across_dispatches(rt, monkeypatch):
    """The scans covering one or two chunks a dispatch and the runs pass 40 positions (what llvmpipe's loop budget
    does to long sequences): the states handed from dispatch to dispatch, both ways, and the runs' carry."""
    pin = "delta_rule/c16/ks1x8"
    monkeypatch.setattr(DK, "RUNS_PASS", 40)
    monkeypatch.setattr(DK, "GPU_SCAN_CHUNKS", 2)
    monkeypatch.setattr(DK, "CPU_LOOP_BUDGET", DK.Chunked(16, DK.CPU_SCANS[0]).loop_iterations(
        DK.DeltaRuleProblem(rt, {}, 2, 150, 2, 4, DIM_K, DIM_V), 2) + DK.LOOP_MARGIN)
    p = DK.DeltaRuleProblem(rt, {}, 2, 150, 2, 4, DIM_K, DIM_V, 16)
    assert DK.Chunked(16, DK.CPU_SCANS[0]).scan_chunks(p) == 2
    _case(rt, pin, 2, 150, 2, 4, 16, seed=2)


def _binding_for(B, T, Hv, chunk):
    """A max storage binding that holds B rows' (of Hv value heads) backward scratch and states, and no more."""
    return 4 * max(W.scratch_size(B, T, Hv, DIM_K, DIM_V, chunk), W.states_size(B, T, Hv, DIM_K, DIM_V, chunk)) + 256


def test_rows_recorded_in_passes_past_the_max_binding(rt, monkeypatch):
    """A max storage binding that holds one row's backward scratch (Qwen3-Next's at a few hundred tokens a row is past
    128 MiB): three packed and padded rows recorded a row or two at a time, the same results."""
    monkeypatch.setattr(rt, "max_binding", _binding_for(1, 150, 4, 16))
    assert W.pass_shape(rt, 3, 150, 2, 4, DIM_K, DIM_V, 16) == (1, 4)
    assert W.pass_shape(rt, 3, 150, 2, 4, DIM_K, DIM_V, 16, backward=False) in ((1, 4), (2, 4))
    _case(rt, "delta_rule/c16/ks1x8", 3, 150, 2, 4, 16, seed=4)


@pytest.mark.parametrize("fmt,init", [("f32", True), ("bf16", False)])
def test_heads_recorded_in_passes_past_the_max_binding(rt, monkeypatch, fmt, init):
    """A max storage binding under one row's scratch but over one key head's (two value heads): each of two packed
    and padded rows (T = 150, not a multiple of the chunk) recorded a key head at a time, the outputs, states and
    every gradient bit-equal to the one-pass run's (every sum in the same order), the one-pass run against the
    reference too; a binding under one key head's refused in one line."""
    pin, chunk = "delta_rule/c16/ks1x8", 16
    whole = _case(rt, pin, 2, 150, 3, 6, chunk, init=init, fmt=fmt, seed=5)
    monkeypatch.setattr(rt, "max_binding", _binding_for(1, 150, 2, chunk))
    assert W.pass_shape(rt, 2, 150, 3, 6, DIM_K, DIM_V, chunk) == (1, 2)
    split = _case(rt, pin, 2, 150, 3, 6, chunk, init=init, fmt=fmt, seed=5)
    for name, want in whole.items():
        assert np.array_equal(split[name], want), f"{name} differs from the one-pass run's"
    with pytest.raises(DeviceError, match="one sequence of 300 tokens needs .* for one key head") as err:
        W.pass_shape(rt, 1, 300, 3, 6, DIM_K, DIM_V, chunk)
    assert "\n" not in str(err.value)


def test_head_passes_are_whole_and_even_key_head_groups(default_rt, monkeypatch):
    """Eight key heads of two value heads each where three key heads fit a binding: passes of three, three and
    two key heads (six value heads each at most), never a group split."""
    monkeypatch.setattr(default_rt, "max_binding", _binding_for(1, 100, 6, 32))
    assert W.pass_shape(default_rt, 4, 100, 8, 16, DIM_K, DIM_V, 32) == (1, 6)
    monkeypatch.setattr(default_rt, "max_binding", _binding_for(1, 100, 8, 32))
    assert W.pass_shape(default_rt, 4, 100, 8, 16, DIM_K, DIM_V, 32) == (1, 8)


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_sixteen_bit_inputs(rt, fmt):
    """q, k, v, g and beta stored in 16 bits (the reference on the same rounded values), arithmetic float32."""
    _case(rt, "delta_rule/c32", 2, 70, 1, 2, 32, fmt=fmt, seed=3)


def test_every_cpu_scan_fits_llvmpipes_loop_budget_at_qwen3_next_sizes(default_rt):
    """At Qwen3-Next's heads (16 key, 32 value, 128 x 128) and T = 8192 each scan dispatch a CPU adapter records
    stays within 65535 loop iterations, and covers the whole sequence."""
    p = DK.DeltaRuleProblem(default_rt, {}, 1, 8192, 16, 32, 128, 128)
    for chunk in DK.CHUNKS:
        for scan in DK.CPU_SCANS + DK.GPU_SCANS:
            cand = DK.Chunked(chunk, scan)
            step = cand.scan_chunks(p)
            if default_rt.info.adapter_type == "CPU":
                assert 1 <= step and cand.loop_iterations(p, step) <= DK.CPU_LOOP_BUDGET - DK.LOOP_MARGIN, cand.name
                assert cand.loop_iterations(p, step + 1) > DK.CPU_LOOP_BUDGET - DK.LOOP_MARGIN, cand.name


def test_step_token_by_token(rt):
    """Five tokens of the recurrent step from a non-zero state, grouped key heads, against the reference's step;
    the state replaced in place."""
    rng = np.random.default_rng(4)
    B, Hk, Hv = 3, 2, 4
    state = (0.3 * rng.standard_normal((B, Hv, DIM_K, DIM_V))).astype(np.float32)
    want_state = state.astype(np.float64)
    state_buf, out_buf = rt.upload(state), rt.buffer(4 * B * Hv * DIM_V)
    for step in range(5):
        x = _inputs(rng, B, 1, Hk, Hv)
        tok = {n: x[n][:, 0] for n in ("q", "k", "v", "g", "beta")}
        want_out, want_state = ref.gated_delta_rule_step(*(tok[n].astype(np.float64) for n in tok), want_state)
        bufs = [rt.upload(tok[n]) for n in ("q", "k", "v", "g", "beta")]
        rec = rt.recorder()
        W.gated_delta_rule_step(rec, out_buf, state_buf, *bufs, B, Hk, Hv, DIM_K, DIM_V)
        rec.submit()
        assert_close(rt.read(out_buf, np.float32, want_out.shape), want_out, "k_delta_rule", f"out, token {step}")
        assert_close(rt.read(state_buf, np.float32, want_state.shape), want_state, "k_delta_rule",
                     f"state, token {step}")
        rt.release(*bufs)
    rt.release(state_buf, out_buf)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_l2norm_pair(rt, fmt):
    rng = np.random.default_rng(5)
    N, D = 37, DIM_K
    x = storage.rounded(rng.standard_normal((N, D)).astype(np.float32), fmt).reshape(N, D)
    dy = rng.standard_normal((N, D)).astype(np.float32)
    want_y, want_inv = ref.l2norm_forward(x.astype(np.float64))
    want_dx = ref.l2norm_backward(dy.astype(np.float64), want_y, want_inv)
    xb, dyb = storage.upload(rt, x.reshape(-1), fmt), rt.upload(dy)
    y, inv, dx = rt.buffer(4 * N * D), rt.buffer(4 * N), rt.buffer(4 * N * D)
    rec = rt.recorder()
    W.l2norm_forward(rec, y, inv, xb, N, D)
    W.l2norm_backward(rec, dx, dyb, y, inv, N, D)
    rec.submit()
    assert_close(rt.read(y, np.float32, (N, D)), want_y, "k_l2norm", f"y {fmt}")
    assert_close(rt.read(inv, np.float32, (N,)), want_inv, "k_l2norm", f"inv_norm {fmt}")
    assert_close(rt.read(dx, np.float32, (N, D)), want_dx, "k_l2norm", f"dx {fmt}")
    rt.release(xb, dyb, y, inv, dx)


def test_bad_arguments_raise_one_line(default_rt):
    rec = default_rt.recorder()
    buf = default_rt.buffer(64)
    with pytest.raises(ValueError, match="chunks"):
        W.gated_delta_rule_forward(rec, buf, buf, buf, buf, buf, buf, buf, buf, 48, 1, 4, 1, 1, 4, 4, buf)
    with pytest.raises(ValueError, match="multiple of key heads"):
        W.gated_delta_rule_forward(rec, buf, buf, buf, buf, buf, buf, buf, buf, 16, 1, 4, 2, 3, 4, 4, buf)
    default_rt.release(buf)
