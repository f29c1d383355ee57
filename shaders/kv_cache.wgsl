// Writes the new tokens' keys and values into a layer's KV cache of B sequences (its rows): each token
// names its cache row and position, so one dispatch prefills several ragged prompts packed together or
// advances every row by one token, and the uniform stays the same at every decoding step.
// The mirror of reference/ops.py kv_cache_write.

struct Params {
    n: u32,           // new tokens
    stride: u32,      // elements per cached position: Hkv * D
    max_len: u32,     // positions per cache row
    batch: u32,       // cache rows
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> k_cache: array<f32>;   // (B, max_len, Hkv, D)
@group(0) @binding(2) var<storage, read_write> v_cache: array<f32>;   // (B, max_len, Hkv, D)
@group(0) @binding(3) var<storage, read> k_new: array<f32>;         // (N, Hkv, D)
@group(0) @binding(4) var<storage, read> v_new: array<f32>;         // (N, Hkv, D)
@group(0) @binding(5) var<storage, read> rows: array<i32>;          // (N,) cache row; negative: padding, not written
@group(0) @binding(6) var<storage, read> positions: array<i32>;     // (N,) position within the row

// k_cache[rows[i], positions[i]] = k_new[i], v_cache likewise; rows or positions out of range are skipped
@compute @workgroup_size(64)
fn kv_cache_write(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = (wid.y * nwg.x + wid.x) * 64u + lid.x;   // the flat grid folds into y beyond 65535 workgroups
    let stride = params.stride;
    if (idx >= params.n * stride) { return; }
    let i = idx / stride;
    let row = rows[i];
    let pos = positions[i];
    if (row < 0 || u32(row) >= params.batch || pos < 0 || u32(pos) >= params.max_len) { return; }
    let dst = (u32(row) * params.max_len + u32(pos)) * stride + idx % stride;
    k_cache[dst] = k_new[idx];
    v_cache[dst] = v_new[idx];
}
