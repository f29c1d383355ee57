// Generation-time attention of new queries against a KV cache of B sequences (forward only): the mirror
// of reference/ops.py attention_cached_forward. Each query names its cache row and position and sees
// keys 0..position of its own row (causal), so queries of several ragged prompts, or one per row of a
// decoding step, run in one dispatch. One invocation per (query, head), online softmax over the cached
// keys, so any cache length works without a score array.
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
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;     // (N, Hq, D)
@group(0) @binding(2) var<storage, read> q: array<f32>;             // (N, Hq, D)
@group(0) @binding(3) var<storage, read> k_cache: array<f32>;       // (B, max_len, Hkv, D)
@group(0) @binding(4) var<storage, read> v_cache: array<f32>;       // (B, max_len, Hkv, D)
@group(0) @binding(5) var<storage, read> rows: array<i32>;         // (N,) cache row; negative: padding
@group(0) @binding(6) var<storage, read> positions: array<i32>;    // (N,) position within the row

const MAX_D: u32 = 256u;

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
    let row = rows[i];
    if (row < 0 || u32(row) >= params.batch) {   // a padding query: zero output, as the reference gives
        for (var c = 0u; c < d; c++) { out[q_off + c] = 0.0; }
        return;
    }
    var acc: array<f32, MAX_D>;
    for (var c = 0u; c < d; c++) { acc[c] = 0.0; }
    var m = -3.4e38;
    var l = 0.0;
    let last = min(u32(positions[i]), params.max_len - 1u);
    let base = u32(row) * params.max_len;
    let first = select(0u, last + 1u - params.window, params.window > 0u && last + 1u > params.window);
    for (var j = first; j <= last; j++) {
        let k_off = ((base + j) * params.hkv + kvh) * d;
        var s = 0.0;
        for (var c = 0u; c < d; c++) { s += q[q_off + c] * k_cache[k_off + c]; }
        s *= params.scale;
        if (params.softcap != 0.0) { s = params.softcap * tanh_f32(s / params.softcap); }
        let m_new = max(m, s);
        let corr = exp(m - m_new);
        let p = exp(s - m_new);
        l = l * corr + p;
        for (var c = 0u; c < d; c++) { acc[c] = acc[c] * corr + p * v_cache[k_off + c]; }
        m = m_new;
    }
    for (var c = 0u; c < d; c++) { out[q_off + c] = acc[c] / l; }
}
