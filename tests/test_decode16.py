"""The decoding family on 16-bit tensors (device/storage.py): the embedding gather and its backward, the loss head's
row gather pair, the KV cache write and the cached attention, with bfloat16 / float16 activations (and mixes of
formats) at element offsets, over both cache dtypes, against the NumPy ops on the same rounded inputs with the
output rounded once; neighbours of every written range stay untouched."""
from __future__ import annotations

import numpy as np
import pytest

from wgpu_train.engines.numpy import ops
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu import attention as A
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.shared.kv_dtype import KvDtype
from wgpu_train.engines.webgpu.tuned import decode_kernels as AD
from wgpu_train.engines.webgpu.tuned import tune

from tolerances import assert_close

JUNK = 7.0          # the neighbours' value (exact in every format)
TAIL = 2            # junk elements after each tensor


def rng(seed):
    return np.random.default_rng(seed)


def rounded(values, fmt: str) -> np.ndarray:
    """values as format fmt stores them (float32)."""
    v = np.asarray(values, np.float32)
    return storage.from_words(storage.to_words(v, fmt), v.size, fmt).reshape(v.shape)


def padded(rt, values, fmt: str, lead: int = 2):
    """(buffer, lead): values, rounded to fmt, between `lead` and TAIL junk elements, in a buffer of format fmt."""
    flat = np.concatenate([np.full(lead, JUNK), np.ravel(values), np.full(TAIL, JUNK)]).astype(np.float32)
    return storage.upload(rt, flat, fmt), lead


def body(rt, t, n: int) -> np.ndarray:
    """The n values of padded tensor t, its junk neighbours checked untouched."""
    buf, lead = t
    got = storage.read(rt, buf, lead + n + TAIL)
    assert (got[:lead] == JUNK).all() and (got[lead + n:] == JUNK).all(), "a write outside the tensor's range"
    return got[lead:lead + n]


def run(rt, record):
    rec = rt.recorder()
    record(rec)
    rec.submit()


# ---- embedding and row gathers ------------------------------------------------------------------

# (output, weight / source): 16-bit rows out of float32 weights (the engine's embedding), a 16-bit row copy (its
# gather of x_final's rows into xf during generation), conversions between formats
@pytest.mark.parametrize("out_fmt, w_fmt", [("bf16", "f32"), ("f16", "f32"), ("bf16", "bf16"), ("f16", "f16"),
                                            ("f16", "bf16"), ("f32", "bf16")])
def test_embedding_forward(rt, out_fmt, w_fmt):
    """The gather by vocabulary chunks (the second at a row offset): rows whose id lies in another chunk are left
    alone until that chunk's call writes them."""
    N, V, C, cut = 7, 9, 30, 4
    g = rng(1)
    w = rounded(g.standard_normal((V, C)), w_fmt)
    ids = np.array([5, 0, 8, 3, 3, 6, 1], np.int32)
    chunks = [(0, cut, padded(rt, w[:cut], w_fmt)), (cut, V - cut, padded(rt, w[cut:], w_fmt, lead=4))]
    out, tids = padded(rt, np.zeros((N, C)), out_fmt), rt.upload(ids)
    want = rounded(ops.embedding_forward(ids, w), out_fmt)
    r0, n, tw = chunks[0]
    run(rt, lambda r: K.embedding_forward(r, out, tids, tw, N, C, n, row_offset=r0))
    got = body(rt, out, N * C).reshape(N, C)
    assert_close(got[ids < cut], want[ids < cut], "exact", "first chunk")
    assert not got[ids >= cut].any()
    r0, n, tw = chunks[1]
    run(rt, lambda r: K.embedding_forward(r, out, tids, tw, N, C, n, row_offset=r0))
    assert_close(body(rt, out, N * C).reshape(N, C), want, "exact", "both chunks")
    rt.release(out[0], tids, *(t[0] for _, _, t in chunks))


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_embedding_backward(rt, fmt):
    """A 16-bit d_res summed in float32 into the float32 weight gradient (a vocabulary chunk at a row offset, then
    accumulated into)."""
    N, V, C, r0 = 12, 9, 30, 2
    g = rng(2)
    ids = np.array([3, 8, 3, 2, 0, 8, 8, 5, 1, 3, 7, 2], np.int32)
    dout = rounded(g.standard_normal((N, C)), fmt)
    want = ops.embedding_backward(dout.astype(np.float64), ids, V)[r0:]
    tdo, tids = padded(rt, dout, fmt), rt.upload(ids)
    dw = padded(rt, np.full((V - r0, C), 3.0), "f32", lead=1)
    scratch = rt.buffer(4 * K.embedding_scratch_size(N))
    run(rt, lambda r: K.embedding_backward(r, dw, tdo, tids, N, C, V - r0, scratch, row_offset=r0))
    assert_close(body(rt, dw, (V - r0) * C).reshape(V - r0, C), want, "k_embedding_grad", "dweight")
    run(rt, lambda r: K.embedding_backward(r, dw, tdo, tids, N, C, V - r0, scratch, row_offset=r0, accumulate=True))
    assert_close(body(rt, dw, (V - r0) * C).reshape(V - r0, C), 2 * want, "k_embedding_grad", "accumulated")
    rt.release(tdo[0], tids, dw[0], scratch)


# (x, out): the loss head's rows gathered out of xf and their gradient scattered back, in any mix of formats
@pytest.mark.parametrize("x_fmt, out_fmt", [("bf16", "bf16"), ("f16", "f16"), ("bf16", "f16"), ("f32", "bf16"),
                                            ("f16", "f32")])
def test_row_gather_pair(rt, x_fmt, out_fmt):
    """Forward: out = x[rows], rounded to out's format. Backward: dx (x's format) = dout (out's) at rows, zero
    elsewhere; accumulating, dx + dout summed in float32 and rounded once."""
    x_rows, N, C = 9, 5, 42
    g = rng(3)
    x = rounded(g.standard_normal((x_rows, C)), x_fmt)
    rows = np.array([7, 2, 0, 5, 8], np.int32)
    tx, trows, out = padded(rt, x, x_fmt), rt.upload(rows), padded(rt, np.zeros((N, C)), out_fmt, lead=4)
    run(rt, lambda r: K.row_gather_forward(r, out, tx, trows, N, C, x_rows))
    assert_close(body(rt, out, N * C).reshape(N, C), rounded(ops.row_gather_forward(x, rows), out_fmt), "exact",
                 "forward")
    dout = rounded(g.standard_normal((N, C)), out_fmt)
    d0 = rounded(g.standard_normal((x_rows, C)), x_fmt)
    tdo, dx = padded(rt, dout, out_fmt), padded(rt, d0, x_fmt)
    run(rt, lambda r: K.row_gather_backward(r, dx, tdo, trows, N, C, x_rows))
    first = rounded(ops.row_gather_backward(dout, rows, x_rows), x_fmt)
    assert_close(body(rt, dx, x_rows * C).reshape(x_rows, C), first, "exact", "backward")
    run(rt, lambda r: K.row_gather_backward(r, dx, tdo, trows, N, C, x_rows, accumulate=True))
    want = first.copy()
    want[rows] += dout                  # the stored gradient plus the same one again, in float32
    assert_close(body(rt, dx, x_rows * C).reshape(x_rows, C), rounded(want, x_fmt), "exact", "accumulated")
    rt.release(tx[0], trows, out[0], tdo[0], dx[0])


# ---- the KV cache write and the cached attention ------------------------------------------------

CACHE_FMT = {kv: kv.storage for kv in KvDtype}


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k_fmt, v_fmt", [("bf16", "bf16"), ("f16", "f16"), ("bf16", "f16")])
def test_kv_cache_write(rt, kv_dtype, k_fmt, v_fmt):
    """16-bit keys and values into either cache: the cache holds them converted to its dtype (a bfloat16 key
    copied, a float16 one rounded to bfloat16); padding tokens and the rest of the cache stay as they were."""
    batch, max_len, hkv, d = 2, 5, 3, 10
    tokens = [(1, 3), (0, 0), (-1, 0), (0, 4), (1, 0)]
    n, cfmt = len(tokens), CACHE_FMT[kv_dtype]
    rows, pos = (np.array(c, np.int32) for c in zip(*tokens))
    g = rng(4)
    k_new, v_new = rounded(g.standard_normal((n, hkv, d)), k_fmt), rounded(g.standard_normal((n, hkv, d)), v_fmt)
    old_k, old_v = (rounded(g.standard_normal((batch, max_len, hkv, d)), cfmt) for _ in range(2))
    tk, tv = padded(rt, old_k, cfmt), padded(rt, old_v, cfmt, lead=6)
    tkn, tvn, tr, tp = padded(rt, k_new, k_fmt, lead=4), padded(rt, v_new, v_fmt), rt.upload(rows), rt.upload(pos)
    run(rt, lambda r: A.kv_cache_write(r, tk, tv, tkn, tvn, tr, tp, n, batch, max_len, hkv, d, kv_dtype))
    want_k, want_v = old_k.copy(), old_v.copy()
    ops.kv_cache_write(want_k, want_v, rounded(k_new, cfmt), rounded(v_new, cfmt), rows, pos)
    size = batch * max_len * hkv * d
    assert_close(body(rt, tk, size).reshape(want_k.shape), want_k, "exact", "k_cache")
    assert_close(body(rt, tv, size).reshape(want_v.shape), want_v, "exact", "v_cache")
    rt.release(tk[0], tv[0], tkn[0], tvn[0], tr, tp)


# decoding steps and a padding token over rows of 70 positions (the split pass: 3 chunks of 32)
CASE = dict(batch=2, max_len=70, tokens=[(1, 69), (0, 40), (-1, 0)], hq=4, hkv=2, d=14)


# (cache dtype, q, out): each 16-bit format read and written, in mixes, over either cache (a kernel compiles for
# seconds on llvmpipe, so the formats share cases)
@pytest.mark.parametrize("kv_dtype, q_fmt, out_fmt", [("float32", "bf16", "f16"), ("bfloat16", "f16", "bf16")])
def test_attention_cached(rt, kv_dtype, q_fmt, out_fmt):
    """A 16-bit q against either cache, out written in its own 16-bit format (padding queries' rows as zeros), by
    the single pass and by the split pair: the NumPy op over the rounded q and cache, rounded once."""
    batch, max_len, hq, hkv, d = (CASE[k] for k in ("batch", "max_len", "hq", "hkv", "d"))
    n, cfmt = len(CASE["tokens"]), CACHE_FMT[kv_dtype]
    rows, pos = (np.array(c, np.int32) for c in zip(*CASE["tokens"]))
    g = rng(5)
    q = rounded(g.standard_normal((n, hq, d)), q_fmt)
    kc, vc = (rounded(g.standard_normal((batch, max_len, hkv, d)), cfmt) for _ in range(2))
    want = rounded(ops.attention_cached_forward(*(x.astype(np.float64) for x in (q, kc, vc)), rows, pos), out_fmt)
    tq, tk, tv = padded(rt, q, q_fmt, lead=4), padded(rt, kc, cfmt), padded(rt, vc, cfmt, lead=6)
    tr, tp = rt.upload(rows), rt.upload(pos)
    scratch = rt.buffer(4 * AD.scratch_elements(n, hq, d))
    for kernel in ("decode/single", "decode/split32"):
        out = padded(rt, np.full(q.shape, 3.0), out_fmt)
        with tune.pinned(kernel):
            run(rt, lambda r: A.attention_cached_forward(r, out, tq, tk, tv, tr, tp, n, batch, max_len, hq, hkv, d,
                                                         scratch=scratch, kv_dtype=kv_dtype))
        got = body(rt, out, q.size).reshape(q.shape)
        assert_close(got, want, f"decode16_attention_{out_fmt}", kernel)
        assert not got[rows < 0].any()
        rt.release(out[0])
    rt.release(tq[0], tk[0], tv[0], tr, tp, scratch)


def test_float32_odd_widths_and_offsets(rt):
    """Float32 tensors keep any width and offset: an odd head dim (the cache write's pairs straddle tokens, the
    passes' last element alone) and an odd row width for the row gathers, at odd element offsets."""
    batch, max_len, hq, hkv, d = 2, 40, 2, 1, 7
    tokens = [(1, 39), (0, 12), (1, 38)]
    n = len(tokens)
    rows, pos = (np.array(c, np.int32) for c in zip(*tokens))
    g = rng(6)
    q, k_new, v_new = (g.standard_normal((n, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    kc, vc = (g.standard_normal((batch, max_len, hkv, d)).astype(np.float32) for _ in range(2))
    want_k, want_v = kc.copy(), vc.copy()
    ops.kv_cache_write(want_k, want_v, k_new, v_new, rows, pos)
    want = ops.attention_cached_forward(*(x.astype(np.float64) for x in (q, want_k, want_v)), rows, pos)
    tk, tv, tkn, tvn = (padded(rt, x, "f32", lead) for x, lead in ((kc, 1), (vc, 3), (k_new, 5), (v_new, 1)))
    tq, tr, tp = padded(rt, q, "f32", lead=3), rt.upload(rows), rt.upload(pos)
    scratch = rt.buffer(4 * AD.scratch_elements(n, hq, d))
    size = batch * max_len * hkv * d
    for kernel in ("decode/single", "decode/split32"):
        out = padded(rt, np.zeros(q.shape), "f32", lead=1)
        with tune.pinned(kernel):
            run(rt, lambda r: (A.kv_cache_write(r, tk, tv, tkn, tvn, tr, tp, n, batch, max_len, hkv, d),
                               A.attention_cached_forward(r, out, tq, tk, tv, tr, tp, n, batch, max_len, hq, hkv, d,
                                                          scratch=scratch)))
        assert_close(body(rt, tk, size).reshape(kc.shape), want_k, "exact", "k_cache")
        assert_close(body(rt, tv, size).reshape(vc.shape), want_v, "exact", "v_cache")
        assert_close(body(rt, out, q.size).reshape(q.shape), want, "k_attention", kernel)
        rt.release(out[0])
    x_rows, N, C = 6, 3, 17
    x, dout = g.standard_normal((x_rows, C)).astype(np.float32), g.standard_normal((N, C)).astype(np.float32)
    idx = np.array([4, 0, 5], np.int32)
    tx, tdo = padded(rt, x, "f32", lead=1), padded(rt, dout, "f32", lead=1)
    tout, dx, ti = padded(rt, np.zeros((N, C)), "f32", lead=3), padded(rt, x, "f32", lead=3), rt.upload(idx)
    run(rt, lambda r: (K.row_gather_forward(r, tout, tx, ti, N, C, x_rows),
                       K.row_gather_backward(r, dx, tdo, ti, N, C, x_rows, accumulate=True)))
    assert_close(body(rt, tout, N * C).reshape(N, C), x[idx], "exact", "row gather")
    want_dx = x.copy()
    want_dx[idx] += dout
    assert_close(body(rt, dx, x_rows * C).reshape(x_rows, C), want_dx, "exact", "row scatter, accumulated")
    rt.release(tk[0], tv[0], tkn[0], tvn[0], tq[0], tr, tp, scratch, tx[0], ti, tout[0], tdo[0], dx[0])


def test_tuner_replica_of_a_bfloat16_cache(rt):
    """The tuner's replica stores its cache in the cache's format: a candidate's check against the reference (the
    one each passes before it is timed) holds."""
    p = AD.DecodeProblem(rt, {}, 2, 2, 64, 2, 1, 10, scratch_elems=AD.scratch_elements(2, 2, 10),
                         kv_dtype="bfloat16")
    rep, res, c0, want, bufs = p.replica(rng(7))
    assert storage.format_of(rep.t["k_cache"]) == "bf16" and storage.format_of(rep.t["v_cache"]) == "bf16"
    with tune.pinned("decode/single"):
        run(rt, lambda r: [r.dispatch(*d) for d in tune.choose(rt, rep).dispatches(rep)])
    assert np.abs(rt.read(res, np.float32, c0.shape) - want).max() <= rep.tolerance(want)
    rt.release(*bufs)
