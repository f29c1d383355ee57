// Writes the new tokens' keys and values into a layer's KV cache of B sequences (its rows): each token
// names its cache row and position, so one dispatch prefills several ragged prompts packed together or
// advances every row by one token, and the uniform stays the same at every decoding step.
// The mirror of engines/numpy/ops.py kv_cache_write. The new keys and values and the caches are tensors in any
// storage format (device/storage.py): the cache's dtype is its format (float32 or bfloat16), rounded here.

struct Params {
    n: u32,           // new tokens
    stride: u32,      // elements per cached position: Hkv * D
    max_len: u32,     // positions per cache row
    batch: u32,       // cache rows
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32,    // element offsets of bindings 1..6
}

@group(0) @binding(0) var<uniform> params: Params;
// @tensor 1 k_cache read_write
// @tensor 2 v_cache read_write
// @tensor 3 k_new read
// @tensor 4 v_new read
// the caches (B, max_len, Hkv, D); k_new, v_new (N, Hkv, D)
@group(0) @binding(5) var<storage, read> rows: array<i32>;          // (N,) cache row; negative: padding, not written
@group(0) @binding(6) var<storage, read> positions: array<i32>;     // (N,) position within the row

// Whether token i is written: its row and position lie inside the cache (a negative row marks padding).
fn kept(i: u32) -> bool {
    let row = rows[params.o5 + i];
    let pos = positions[params.o6 + i];
    return row >= 0 && u32(row) < params.batch && pos >= 0 && u32(pos) < params.max_len;
}

// The cache element (offset excluded) that new element e of a kept token goes to.
fn destination(e: u32) -> u32 {
    let i = e / params.stride;
    let row = u32(rows[params.o5 + i]);
    let pos = u32(positions[params.o6 + i]);
    return (row * params.max_len + pos) * params.stride + e % params.stride;
}

fn put(e: u32) {
    if (kept(e / params.stride)) {
        let t = destination(e);
        k_cache_st(params.o1 + t, k_new_ld(params.o3 + e));
        v_cache_st(params.o2 + t, v_new_ld(params.o4 + e));
    }
}

// k_cache[rows[i], positions[i]] = k_new[i], v_cache likewise; rows or positions out of range are skipped.
// One invocation per pair of new elements (a 16-bit word of the cache: 16-bit formats have even strides and
// offsets); a pair that straddles two tokens (an odd stride, float32 only) is written one by one.
@compute @workgroup_size(64)
fn kv_cache_write(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let e = 2u * ((wid.y * nwg.x + wid.x) * 64u + lid.x);   // the flat grid folds into y beyond 65535 workgroups
    let total = params.n * params.stride;
    if (e >= total) { return; }
    if (e + 1u < total && (e + 1u) % params.stride != 0u) {
        if (kept(e / params.stride)) {
            let t = destination(e);
            k_cache_st2(params.o1 + t, k_new_ld2(params.o3 + e));
            v_cache_st2(params.o2 + t, v_new_ld2(params.o4 + e));
        }
        return;
    }
    put(e);
    if (e + 1u < total) { put(e + 1u); }
}
