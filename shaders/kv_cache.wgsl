// Appends the new tokens' keys and values to a layer's KV cache at the rows their positions name,
// so the same dispatch (and uniform) serves every decoding step.

struct Params {
    tq: u32,
    row: u32,         // elements per cache row: Hkv * D
    max_len: u32,
}

@group(0) @binding(0) var<storage, read_write> k_cache: array<f32>;   // (max_len, Hkv, D)
@group(0) @binding(1) var<storage, read_write> v_cache: array<f32>;
@group(0) @binding(2) var<storage, read> k_new: array<f32>;         // (Tq, Hkv, D)
@group(0) @binding(3) var<storage, read> v_new: array<f32>;
@group(0) @binding(4) var<storage, read> positions: array<i32>;
@group(0) @binding(5) var<uniform> params: Params;

// k_cache[positions[i]] = k_new[i], v_cache likewise: append the new tokens' keys and values to the cache
@compute @workgroup_size(64)
fn kv_cache_write(@builtin(global_invocation_id) gid: vec3<u32>) {
    let idx = gid.x;
    let row = params.row;
    if (idx >= params.tq * row) { return; }
    let i = idx / row;
    let c = idx % row;
    let dst = u32(positions[i]) * row + c;
    if (u32(positions[i]) >= params.max_len) { return; }
    k_cache[dst] = k_new[idx];
    v_cache[dst] = v_new[idx];
}
