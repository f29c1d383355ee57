// Writes the new tokens' keys and values into a layer's KV cache of B sequences (its rows): each token
// names its cache row and position, so one dispatch prefills several ragged prompts packed together or
// advances every row by one token, and the uniform stays the same at every decoding step.
// The mirror of reference/ops.py kv_cache_write. The cache stores float32 or bfloat16 (a section below each).

struct Params {
    n: u32,           // new tokens
    stride: u32,      // elements per cached position: Hkv * D
    max_len: u32,     // positions per cache row
    batch: u32,       // cache rows
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(3) var<storage, read> k_new: array<f32>;         // (N, Hkv, D)
@group(0) @binding(4) var<storage, read> v_new: array<f32>;         // (N, Hkv, D)
@group(0) @binding(5) var<storage, read> rows: array<i32>;          // (N,) cache row; negative: padding, not written
@group(0) @binding(6) var<storage, read> positions: array<i32>;     // (N,) position within the row

// The cache's storage (attention_decode.kv_source keeps one section): a cache word holds PER_WORD values;
// k_word(e) / v_word(e) is the cache word of values e.. of k_new / v_new.
// ---- kv: float32
@group(0) @binding(1) var<storage, read_write> k_cache: array<f32>;   // (B, max_len, Hkv, D)
@group(0) @binding(2) var<storage, read_write> v_cache: array<f32>;   // (B, max_len, Hkv, D)
const PER_WORD: u32 = 1u;
fn k_word(e: u32) -> f32 { return k_new[e]; }
fn v_word(e: u32) -> f32 { return v_new[e]; }
// ---- kv: bfloat16
// Two bfloat16 values per u32 (element 2w in the low half, as little-endian bytes); D is even, so a word
// never spans two positions and one invocation writes both halves of it.
@group(0) @binding(1) var<storage, read_write> k_cache: array<u32>;   // (B, max_len, Hkv, D / 2)
@group(0) @binding(2) var<storage, read_write> v_cache: array<u32>;   // (B, max_len, Hkv, D / 2)
const PER_WORD: u32 = 2u;
// x rounded to bfloat16 bits: nearest, ties to even; NaN stays NaN, quietened (numpy/quant.py bfloat16_bits)
fn bf16_bits(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) { return (u >> 16u) | 0x40u; }
    return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}
fn k_word(e: u32) -> u32 { return bf16_bits(k_new[e]) | (bf16_bits(k_new[e + 1u]) << 16u); }
fn v_word(e: u32) -> u32 { return bf16_bits(v_new[e]) | (bf16_bits(v_new[e + 1u]) << 16u); }
// ---- end of kv formats

// k_cache[rows[i], positions[i]] = k_new[i], v_cache likewise; rows or positions out of range are skipped.
// One invocation per cache word.
@compute @workgroup_size(64)
fn kv_cache_write(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = (wid.y * nwg.x + wid.x) * 64u + lid.x;   // the flat grid folds into y beyond 65535 workgroups
    let stride = params.stride;
    let e = idx * PER_WORD;
    if (e >= params.n * stride) { return; }
    let i = e / stride;
    let row = rows[i];
    let pos = positions[i];
    if (row < 0 || u32(row) >= params.batch || pos < 0 || u32(pos) >= params.max_len) { return; }
    let dst = ((u32(row) * params.max_len + u32(pos)) * stride + e % stride) / PER_WORD;
    k_cache[dst] = k_word(e);
    v_cache[dst] = v_word(e);
}
