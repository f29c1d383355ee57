// Generation-time attention of new queries against a KV cache of B sequences (forward only): the mirror
// of reference/ops.py attention_cached_forward. Each query names its cache row and position and sees
// keys 0..position of its own row (causal), so queries of several ragged prompts, or one per row of a
// decoding step, run in one dispatch. attention_cached_forward: one invocation per (query, head), online
// softmax over the cached keys, so any cache length works without a score array. The split pair (split-K,
// for a decoding step's few queries): attention_cached_partial reduces each chunk of `chunk` positions of a
// (query, head) to its unnormalised sum, max and sum of exponentials; attention_cached_combine merges them.
// The online-softmax loop is written out in both passes on purpose: one function returning the accumulator
// (a struct holding it) measured 1.7x slower on llvmpipe (`wgpu-train bench --only decode`, 51 -> 87 ms).
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
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;     // (N, Hq, D)
@group(0) @binding(2) var<storage, read> q: array<f32>;             // (N, Hq, D)
// The cache's storage (attention_decode.kv_source keeps one section): k_at / v_at read one value.
// ---- kv: float32
@group(0) @binding(3) var<storage, read> k_cache: array<f32>;       // (B, max_len, Hkv, D)
@group(0) @binding(4) var<storage, read> v_cache: array<f32>;       // (B, max_len, Hkv, D)
fn k_at(e: u32) -> f32 { return k_cache[e]; }
fn v_at(e: u32) -> f32 { return v_cache[e]; }
// ---- kv: bfloat16
// Two bfloat16 values per u32, element 2w in the low half: a value is its half shifted to the top of an f32.
@group(0) @binding(3) var<storage, read> k_cache: array<u32>;       // (B, max_len, Hkv, D / 2)
@group(0) @binding(4) var<storage, read> v_cache: array<u32>;       // (B, max_len, Hkv, D / 2)
fn bf16_at(w: u32, e: u32) -> f32 { return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (e & 1u) == 1u)); }
fn k_at(e: u32) -> f32 { return bf16_at(k_cache[e >> 1u], e); }
fn v_at(e: u32) -> f32 { return bf16_at(v_cache[e >> 1u], e); }
// ---- end of kv formats
@group(0) @binding(5) var<storage, read> rows: array<i32>;         // (N,) cache row; negative: padding
@group(0) @binding(6) var<storage, read> positions: array<i32>;    // (N,) position within the row

// ---- the split pair: 1 part (N, Hq, splits, D + 2) out / 2 part_in in, the rest as above ----
@group(0) @binding(1) var<storage, read_write> part: array<f32>;
@group(0) @binding(2) var<storage, read> part_in: array<f32>;

const MAX_D: u32 = 256u;

// The positions query i sees, first..last (inclusive) of its row: causal, within the window.
fn seen(i: u32) -> vec2<u32> {
    let last = min(u32(positions[i]), params.max_len - 1u);
    let first = select(0u, last + 1u - params.window, params.window > 0u && last + 1u > params.window);
    return vec2<u32>(first, last);
}

fn padding(i: u32) -> bool {
    return rows[i] < 0 || u32(rows[i]) >= params.batch;
}

fn score(q_off: u32, k_off: u32) -> f32 {
    var s = 0.0;
    for (var c = 0u; c < params.d; c++) { s += q[q_off + c] * k_at(k_off + c); }
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
    let q_off = (i * params.hq + h) * d;
    if (padding(i)) {   // a padding query: zero output, as the reference gives
        for (var c = 0u; c < d; c++) { out[q_off + c] = 0.0; }
        return;
    }
    var acc: array<f32, MAX_D>;
    for (var c = 0u; c < d; c++) { acc[c] = 0.0; }
    var m = -3.4e38;
    var l = 0.0;
    let span = seen(i);
    let base = u32(rows[i]) * params.max_len;
    for (var j = span.x; j <= span.y; j++) {
        let k_off = ((base + j) * params.hkv + kvh) * d;
        let s = score(q_off, k_off);
        let m_new = max(m, s);
        let corr = exp(m - m_new);
        let p = exp(s - m_new);
        l = l * corr + p;
        for (var c = 0u; c < d; c++) { acc[c] = acc[c] * corr + p * v_at(k_off + c); }
        m = m_new;
    }
    for (var c = 0u; c < d; c++) { out[q_off + c] = acc[c] / l; }
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
    let q_off = ih * d;
    let base = u32(rows[i]) * params.max_len;
    var acc: array<f32, MAX_D>;
    for (var c = 0u; c < d; c++) { acc[c] = 0.0; }
    var m = -3.4e38;
    var l = 0.0;
    for (var j = lo; j <= hi; j++) {
        let k_off = ((base + j) * params.hkv + kvh) * d;
        let s = score(q_off, k_off);
        let m_new = max(m, s);
        let corr = exp(m - m_new);
        let p = exp(s - m_new);
        l = l * corr + p;
        for (var c = 0u; c < d; c++) { acc[c] = acc[c] * corr + p * v_at(k_off + c); }
        m = m_new;
    }
    let p_off = idx * (d + 2u);
    for (var c = 0u; c < d; c++) { part[p_off + c] = acc[c]; }
    part[p_off + d] = m;
    part[p_off + d + 1u] = l;
}

@compute @workgroup_size(64)
fn attention_cached_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if (idx >= params.n * params.hq * params.d) { return; }
    let c = idx % params.d;
    let ih = idx / params.d;
    let i = ih / params.hq;
    if (padding(i)) { out[idx] = 0.0; return; }
    let span = seen(i);
    let stride = params.d + 2u;
    let first = span.x / params.chunk;
    let last = span.y / params.chunk;
    var m = -3.4e38;
    for (var s = first; s <= last; s++) { m = max(m, part_in[(ih * params.splits + s) * stride + params.d]); }
    var l = 0.0;
    var acc = 0.0;
    for (var s = first; s <= last; s++) {
        let off = (ih * params.splits + s) * stride;
        let w = exp(part_in[off + params.d] - m);
        l += w * part_in[off + params.d + 1u];
        acc += w * part_in[off + c];
    }
    out[idx] = acc / l;
}
