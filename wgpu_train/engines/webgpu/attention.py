"""The attention op wrappers of the WebGPU engine, with the names and argument order of engines/numpy/ops.py:
attention_forward / attention_backward over a training step's rows (the tuner's choice among
tuned/attention_kernels.py's candidates), and generation's cache: kv_cache_write and attention_cached_forward
(tuned/decode_kernels.py). kernels.py's conventions hold: the Recorder first, then outputs, inputs, sizes."""
from __future__ import annotations

from wgpu_train.engines.shared.kv_dtype import KvDtype
from wgpu_train.engines.webgpu.device.launch import flat_grid, launch
from wgpu_train.engines.webgpu.kernels import copy
from wgpu_train.engines.webgpu.tuned import attention_kernels, decode_kernels, tune


def _att_check(T, Hq, Hkv, D):
    if not 0 < D <= attention_kernels.MAX_HEAD_DIM:
        raise ValueError(f"attention supports head dims 1..{attention_kernels.MAX_HEAD_DIM}, got {D}")
    if Hkv <= 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")


def _attention(rec, pass_, tensors, B, T, Hq, Hkv, D, window, softcap, blocks):
    _att_check(T, Hq, Hkv, D)
    if B * T <= 0:
        return
    p = attention_kernels.AttentionProblem(rec.rt, pass_, tensors, B, T, Hq, Hkv, D, window, softcap, blocks)
    for d in tune.choose(rec.rt, p).dispatches(p):
        rec.dispatch(*d)


def attention_forward(rec, out, lse, q, k, v, segment_ids, B, T, Hq, Hkv, D, window=0, softcap=0.0, sinks=None,
                      blocks=False):
    """Causal GQA attention with segments: q, out (B, T, Hq, D); k, v (B, T, Hkv, D);
    segment_ids (B, T) i32 (0 = padding); lse (B, Hq, T) saved for the backward. window > 0: query i sees
    only keys j with i - j < window (sliding-window attention); softcap > 0: the scaled scores become
    softcap * tanh(s / softcap) (Gemma 2). q, k, v and out may each be float32, bfloat16 or float16 (their
    buffers' storage formats; a 16-bit one needs an even D and an even element offset), lse is float32. The
    kernel is the tuner's choice among attention_kernels' candidates, tuned per storage formats. sinks (Hq,) f32
    or None: gpt-oss's, applied to the kernel's result (attention_sink_forward). blocks=True (Gemma 3's images):
    segment_ids is attention_kernels.extents' (3, B, T), each image block's tokens seeing each other both ways."""
    _attention(rec, "forward", dict(out=out, lse=lse, q=q, k=k, v=v, segment_ids=segment_ids),
               B, T, Hq, Hkv, D, window, softcap, blocks)
    if sinks is not None:
        attention_sink_forward(rec, out, lse, sinks, B, T, Hq, D)


def attention_sink_forward(rec, out, lse, sinks, B, T, Hq, D):
    """out (B, T, Hq, D) (any storage format; a 16-bit one with an even D) and lse (B, Hq, T) f32 of an attention
    without sinks become those with sinks (Hq,) f32, in place: one invocation per row."""
    if B * T > 0:
        launch(rec, attention_kernels.SINK_FORWARD, flat_grid(-(-B * T * Hq // 64)),
               [(out, B * T * Hq * D), (lse, B * Hq * T), (sinks, Hq)], s0=B, s1=T, s2=Hq, s3=D)


def attention_sink_backward(rec, dsinks, stats, sinks, B, T, Hq, accumulate=True):
    """dsinks (Hq,) f32 (+= where accumulate) of the sinks from attention_backward's statistics `stats` (its
    scratch: lse with the sinks' term, then delta, each (B, Hq, T)): one workgroup per head, a fixed-order sum."""
    if B * T > 0:
        launch(rec, attention_kernels.SINK_BACKWARD, (Hq, 1, 1), [(dsinks, Hq), (stats, 2 * B * Hq * T), (sinks, Hq)],
               s0=B, s1=T, s2=Hq, s4=int(accumulate))


def attention_scratch_size(B, T, Hq):
    """Elements of scratch attention_backward needs: the statistics lse and delta = rowsum(dout * out), each
    (B, Hq, T), back to back (one binding: WebGPU's default limit is 8 storage buffers per stage); float32 in
    every precision."""
    return 2 * B * Hq * T


def attention_backward(rec, dq, dk, dv, dout, q, k, v, out, lse, segment_ids, B, T, Hq, Hkv, D, scratch, window=0,
                       softcap=0.0, sinks=None, dsinks=None, blocks=False):
    """dq (B, T, Hq, D), dk, dv (B, T, Hkv, D) of attention_forward from its out and lse, with lse copied to
    scratch and delta beside it (at least attention_scratch_size(B, T, Hq) elements): dq per query block, then
    dk and dv per key block summing over the query heads of its group (no atomics). dq, dk, dv, dout, q, k, v
    and out in any storage format, as attention_forward's tensors; lse and scratch float32; blocks as there. With
    sinks (their term already in lse and out: attention_forward's), dsinks (Hq,) f32 += their gradient where
    given."""
    if B * T > 0:
        copy(rec, scratch, lse, B * Hq * T)
    _attention(rec, "backward", dict(dq=dq, dk=dk, dv=dv, dout=dout, q=q, k=k, v=v, out=out,
                                     segment_ids=segment_ids, stats=scratch), B, T, Hq, Hkv, D, window, softcap,
               blocks)
    if sinks is not None and dsinks is not None:
        attention_sink_backward(rec, dsinks, scratch, sinks, B, T, Hq)


def attention_cached_forward(rec, out, q, k_cache, v_cache, rows, positions, n, batch, max_len, hq, hkv, d,
                             window=0, softcap=0.0, scratch=None, kv_dtype=KvDtype.FLOAT32, sinks=None, blocks=False):
    """New queries against a KV cache of `batch` rows: q, out (n, hq, d), each in any storage format; caches
    (batch, max_len, hkv, d) stored as kv_dtype (float32, or bfloat16 two per 4-byte word: their buffers take
    its storage format, decode_kernels.cache_tensor);
    rows, positions (n,) i32: query i sees positions 0..positions[i] of cache row rows[i] (a negative row
    marks padding: its output is zero), only the last `window` of them when window > 0; scores soft-capped
    at softcap when it is not 0. scratch: a buffer of decode_kernels.scratch_elements(queries, hq, d) floats
    for the split passes of calls of up to `queries` queries (None: the single pass); the pass is the tuner's
    choice (decode_kernels.py). Any element offsets (even for 16-bit tensors). sinks (hq,) f32 or None: gpt-oss's
    sink logits in each head's denominator. blocks=True (a prefill with Gemma 3's images): positions holds (n,)
    more after them, each query's reach (the last position it sees: its image block's last, else its own)."""
    if n <= 0:
        return
    if d > 256 or hkv <= 0 or hq % hkv:
        raise ValueError(f"attention_cached_forward: head dim {d} (<= 256), heads {hq}/{hkv}")
    room = scratch.size // 4 if scratch is not None else 0
    tensors = dict(out=out, q=q, k_cache=decode_kernels.cache_tensor(k_cache, kv_dtype),
                   v_cache=decode_kernels.cache_tensor(v_cache, kv_dtype), rows=rows, positions=positions,
                   part=scratch, part_in=scratch, sinks=sinks if sinks is not None else positions)   # unread without
    p = decode_kernels.DecodeProblem(rec.rt, tensors, n, batch, max_len, hq, hkv, d, window, softcap, room,
                                     kv_dtype, sinks is not None, blocks)
    for dispatch in tune.choose(rec.rt, p).dispatches(p):
        rec.dispatch(*dispatch)


def kv_cache_write(rec, k_cache, v_cache, k_new, v_new, rows, positions, n, batch, max_len, hkv, d,
                   kv_dtype=KvDtype.FLOAT32):
    """k_cache / v_cache (batch, max_len, hkv, d) at [rows[i], positions[i]] = k_new[i] / v_new[i] (n, hkv, d):
    writes one layer's new keys and values (each in any storage format), rounded to the caches' kv_dtype
    (bfloat16: to nearest even, two per 4-byte word, so d must be even; the caches' buffers take its storage
    format, decode_kernels.cache_tensor); tokens whose row or position lies outside the cache (a negative row
    marks padding) write nothing. Any element offsets (even for 16-bit tensors); one invocation per pair of new
    elements."""
    if n <= 0:
        return
    if KvDtype.parse(kv_dtype).packed and d % 2:
        raise ValueError(f"kv_cache_write: a {kv_dtype} cache needs an even head dim, not {d}")
    cache, new = batch * max_len * hkv * d, n * hkv * d
    launch(rec, decode_kernels.CACHE_WRITE, flat_grid(-(-new // 128)),
           [(decode_kernels.cache_tensor(k_cache, kv_dtype), cache),
            (decode_kernels.cache_tensor(v_cache, kv_dtype), cache), (k_new, new), (v_new, new), (rows, n),
            (positions, n)],
           n=int(n), stride=int(hkv * d), max_len=int(max_len), batch=int(batch))
