// Generation-time attention of new queries against a KV cache (forward only): the mirror of
// reference/ops.py attention_cached_forward. One invocation per (query, head), online softmax over
// the cached keys, so any cache length works without a score array.

// The position of the first new query comes from positions[0] (written with the tokens), so the
// uniform stays the same at every decoding step and nothing is created per token.
struct Params {
    tq: u32,          // new queries
    max_len: u32,     // rows of the cache buffers
    hq: u32,
    hkv: u32,
    d: u32,
    scale: f32,
}

@group(0) @binding(0) var<storage, read_write> out: array<f32>;     // (Tq, Hq, D)
@group(0) @binding(1) var<storage, read> q: array<f32>;             // (Tq, Hq, D)
@group(0) @binding(2) var<storage, read> k_cache: array<f32>;       // (max_len, Hkv, D)
@group(0) @binding(3) var<storage, read> v_cache: array<f32>;       // (max_len, Hkv, D)
@group(0) @binding(4) var<storage, read> positions: array<i32>;    // (Tq,) positions of the new tokens
@group(0) @binding(5) var<uniform> params: Params;

const MAX_D: u32 = 256u;

@compute @workgroup_size(64)
fn attention_cached_forward(@builtin(global_invocation_id) gid: vec3<u32>) {
    let idx = gid.x;
    if (idx >= params.tq * params.hq) { return; }
    let i = idx / params.hq;
    let h = idx % params.hq;
    let kvh = h / (params.hq / params.hkv);
    let d = params.d;
    let q_off = (i * params.hq + h) * d;
    var acc: array<f32, MAX_D>;
    for (var c = 0u; c < d; c++) { acc[c] = 0.0; }
    var m = -3.4e38;
    var l = 0.0;
    let last = u32(positions[i]);
    for (var j = 0u; j <= last; j++) {
        let k_off = (j * params.hkv + kvh) * d;
        var s = 0.0;
        for (var c = 0u; c < d; c++) { s += q[q_off + c] * k_cache[k_off + c]; }
        s *= params.scale;
        let m_new = max(m, s);
        let corr = exp(m - m_new);
        let p = exp(s - m_new);
        l = l * corr + p;
        for (var c = 0u; c < d; c++) { acc[c] = acc[c] * corr + p * v_cache[k_off + c]; }
        m = m_new;
    }
    for (var c = 0u; c < d; c++) { out[q_off + c] = acc[c] / l; }
}
