// Generation-time attention of new queries against a KV cache of B sequences (forward only): the mirror
// of engines/numpy/ops.py attention_cached_forward. Each query names its cache row and position and sees
// keys 0..position of its own row (causal), so queries of several ragged prompts, or one per row of a
// decoding step, run in one dispatch. attention_cached_forward: one invocation per (query, head), online
// softmax over the cached keys, so any cache length works without a score array. The split pair (split-K,
// for a decoding step's few queries): attention_cached_partial reduces each chunk of `chunk` positions of a
// (query, head) to its unnormalised sum, max and sum of exponentials; attention_cached_combine merges them.
// The online-softmax loop is written out in both passes on purpose: one function returning the accumulator
// (a struct holding it) measured 1.7x slower on llvmpipe (`wgpu-train bench --only decode`, 51 -> 87 ms).
// q and out are tensors in any storage format (device/storage.py), and so are the caches (float32 or bfloat16,
// the cache's dtype): out is written by pairs of elements (16-bit formats have even head dims and offsets).
// gpt-oss's attention sinks (where `sinks` is 1): head h's softmax has exp(sinks[h]) in its denominator too, a key
// whose value is zero; the single pass and the combine add it once every position is summed.
// @include tanh

// Rows and positions come from buffers written with the tokens, so the uniform stays the same at every
// decoding step and nothing is created per token.
struct Params {
    n: u32,           // new queries
    max_len: u32,     // positions per cache row
    batch: u32,       // cache rows
    hq: u32,
    hkv: u32,
    d: u32,
    scale: f32,
    window: u32,      // sliding window: only the last `window` positions are seen (0 = all)
    softcap: f32,     // the scaled scores' soft-cap (Gemma 2): softcap * tanh(s / softcap); 0 = none
    chunk: u32,       // the split pair: positions per chunk
    splits: u32,      // and chunks per row (ceil(max_len / chunk))
    sinks: u32,       // 1: binding 7 holds the heads' sink logits (Hq,) f32
    blocks: u32,      // 1: Gemma 3's images, a prefill's image tokens see their whole block (positions, below)
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32,    // element offsets of bindings 1..7
}

@group(0) @binding(0) var<uniform> params: Params;
// @tensor 1 out read_write
// @tensor 2 q read
// @tensor 3 k_cache read
// @tensor 4 v_cache read
// out, q (N, Hq, D); the caches (B, max_len, Hkv, D)
@group(0) @binding(5) var<storage, read> rows: array<i32>;         // (N,) cache row; negative: padding
@group(0) @binding(6) var<storage, read> positions: array<i32>;    // (N,) position within the row, then
// with blocks (N,) more: each query's reach, the last position it sees (its image block's last, else its own)
@group(0) @binding(7) var<storage, read> sink_logits: array<f32>;  // (Hq,) where params.sinks is 1

// ---- the split pair: 1 part (N, Hq, splits, D + 2) out / 2 part_in in, the rest as above ----
@group(0) @binding(1) var<storage, read_write> part: array<f32>;
@group(0) @binding(2) var<storage, read> part_in: array<f32>;

const MAX_D: u32 = 256u;

fn row_of(i: u32) -> i32 {
    return rows[params.o5 + i];
}

// The positions query i sees, first..last (inclusive) of its row: causal (or to its reach), within the window.
fn seen(i: u32) -> vec2<u32> {
    let pos = min(u32(positions[params.o6 + i]), params.max_len - 1u);
    let first = select(0u, pos + 1u - params.window, params.window > 0u && pos + 1u > params.window);
    let last = select(pos, min(u32(positions[params.o6 + params.n + i]), params.max_len - 1u), params.blocks != 0u);
    return vec2<u32>(first, last);
}

// A softmax's running max m and sum l over the positions, and the factor its accumulated values take: with a
// sink, the sum and values rescaled to the larger of m and the sink, the sink's exponential added to the sum.
fn with_sink(h: u32, m: f32, l: f32) -> vec2<f32> {
    if (params.sinks == 0u) { return vec2<f32>(l, 1.0); }
    let s = sink_logits[params.o7 + h];
    let top = max(m, s);
    let corr = exp(m - top);
    return vec2<f32>(l * corr + exp(s - top), corr);
}

fn padding(i: u32) -> bool {
    return row_of(i) < 0 || u32(row_of(i)) >= params.batch;
}

// q_off: q's element index (offset included); e: the cached key's first element (offset excluded)
fn score(q_off: u32, e: u32) -> f32 {
    var s = 0.0;
    let k_off = params.o3 + e;
    for (var c = 0u; c < params.d; c++) { s += q_ld(q_off + c) * k_cache_ld(k_off + c); }
    s *= params.scale;
    if (params.softcap != 0.0) { s = params.softcap * tanh_f32(s / params.softcap); }
    return s;
}

@compute @workgroup_size(64)
fn attention_cached_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = (wid.y * nwg.x + wid.x) * 64u + lid.x;   // the flat grid folds into y beyond 65535 workgroups
    if (idx >= params.n * params.hq) { return; }
    let i = idx / params.hq;
    let h = idx % params.hq;
    let kvh = h / (params.hq / params.hkv);
    let d = params.d;
    let row_off = (i * params.hq + h) * d;
    let o_off = params.o1 + row_off;
    if (padding(i)) {   // a padding query: zero output, as the reference gives
        for (var c = 0u; c + 1u < d; c += 2u) { out_st2(o_off + c, vec2<f32>(0.0)); }
        if ((d & 1u) == 1u) { out_st(o_off + d - 1u, 0.0); }
        return;
    }
    var acc: array<f32, MAX_D>;
    for (var c = 0u; c < d; c++) { acc[c] = 0.0; }
    var m = -3.4e38;
    var l = 0.0;
    let span = seen(i);
    let base = u32(row_of(i)) * params.max_len;
    let q_off = params.o2 + row_off;
    for (var j = span.x; j <= span.y; j++) {
        let e = ((base + j) * params.hkv + kvh) * d;
        let s = score(q_off, e);
        let m_new = max(m, s);
        let corr = exp(m - m_new);
        let p = exp(s - m_new);
        l = l * corr + p;
        let v_off = params.o4 + e;
        for (var c = 0u; c < d; c++) { acc[c] = acc[c] * corr + p * v_cache_ld(v_off + c); }
        m = m_new;
    }
    let sunk = with_sink(h, m, l);
    let f = sunk.y / sunk.x;
    // by pairs (a 16-bit word at a time), the last element alone for an odd D (float32 only)
    for (var c = 0u; c + 1u < d; c += 2u) { out_st2(o_off + c, vec2<f32>(acc[c] * f, acc[c + 1u] * f)); }
    if ((d & 1u) == 1u) { out_st(o_off + d - 1u, acc[d - 1u] * f); }
}

@compute @workgroup_size(64)
fn attention_cached_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if (idx >= params.n * params.hq * params.splits) { return; }
    let split = idx % params.splits;
    let ih = idx / params.splits;
    let i = ih / params.hq;
    let h = ih % params.hq;
    if (padding(i)) { return; }
    let span = seen(i);
    let lo = max(span.x, split * params.chunk);
    let hi = min(span.y, split * params.chunk + params.chunk - 1u);
    if (lo > hi) { return; }     // a chunk the query does not see: the combine skips it
    let kvh = h / (params.hq / params.hkv);
    let d = params.d;
    let q_off = params.o2 + ih * d;
    let base = u32(row_of(i)) * params.max_len;
    var acc: array<f32, MAX_D>;
    for (var c = 0u; c < d; c++) { acc[c] = 0.0; }
    var m = -3.4e38;
    var l = 0.0;
    for (var j = lo; j <= hi; j++) {
        let e = ((base + j) * params.hkv + kvh) * d;
        let s = score(q_off, e);
        let m_new = max(m, s);
        let corr = exp(m - m_new);
        let p = exp(s - m_new);
        l = l * corr + p;
        let v_off = params.o4 + e;
        for (var c = 0u; c < d; c++) { acc[c] = acc[c] * corr + p * v_cache_ld(v_off + c); }
        m = m_new;
    }
    let p_off = params.o1 + idx * (d + 2u);
    for (var c = 0u; c < d; c++) { part[p_off + c] = acc[c]; }
    part[p_off + d] = m;
    part[p_off + d + 1u] = l;
}

// One invocation per pair of a (query, head)'s elements (its last alone for an odd D, float32 only).
@compute @workgroup_size(64)
fn attention_cached_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    let pairs = (params.d + 1u) / 2u;
    if (idx >= params.n * params.hq * pairs) { return; }
    let c = 2u * (idx % pairs);
    let ih = idx / pairs;
    let i = ih / params.hq;
    let o = params.o1 + ih * params.d + c;
    let both = c + 1u < params.d;
    if (padding(i)) {
        if (both) { out_st2(o, vec2<f32>(0.0)); } else { out_st(o, 0.0); }
        return;
    }
    let span = seen(i);
    let stride = params.d + 2u;
    let first = span.x / params.chunk;
    let last = span.y / params.chunk;
    let part0 = params.o2 + ih * params.splits * stride;
    var m = -3.4e38;
    for (var s = first; s <= last; s++) { m = max(m, part_in[part0 + s * stride + params.d]); }
    var l = 0.0;
    var acc = vec2<f32>(0.0);
    for (var s = first; s <= last; s++) {
        let off = part0 + s * stride;
        let w = exp(part_in[off + params.d] - m);
        l += w * part_in[off + params.d + 1u];
        // element c + 1 is the partial's max where c is the last (an odd D): read, never stored
        acc += w * vec2<f32>(part_in[off + c], part_in[off + c + 1u]);
    }
    let sunk = with_sink(ih % params.hq, m, l);
    let f = sunk.y / sunk.x;
    if (both) { out_st2(o, vec2<f32>(acc.x * f, acc.y * f)); } else { out_st(o, acc.x * f); }
}
