// Helpers shared by the flash attention kernels (shaders/attention_regs.wgsl, shaders/attention_tiles.wgsl):
// attention_source.source() appends this text to each of them (WGSL declarations may come in any order, so the
// kernel file keeps its own line numbers).
// The uniform: s0 = B, s1 = T, s2 = Hq, s3 = Hkv, s4 = window, s5 = 1 with image blocks (below); o<n> = element
// offset of binding n; f0 = the softmax scale; f1 = the scores' soft-cap (0: none). The bindings of each pass are in its section below (source() keeps the pass's own), the
// same in both kernels, so one Kernel binding list serves both.
// @include softcap

// @include params

const NONE: i32 = 2147483647;

// The first key query i may see under the sliding window (0 without one).
fn window_start(i: u32) -> u32 {
    return select(0u, i + 1u - p.s4, p.s4 > 0u && i + 1u > p.s4);
}

// One past the last query that may see key j under the sliding window (t without one).
fn window_end(j: u32, t: u32) -> u32 {
    return select(t, min(t, j + p.s4), p.s4 > 0u);
}

// Gemma 3's images (s5 = 1): the tokens of an image block see each other both ways, so the segment ids' binding
// holds (B, T) more i32 after them, each token's reach (the last key it may see: its block's last position, or
// itself), then (B, T) more, each token's block start (the first query that sees it). Blocks are runs of
// positions, so the reach and the block start never decrease along a row. Without images (s5 = 0): the token.
fn reach(b: u32, i: u32) -> u32 {
    if (p.s5 == 0u) { return i; }
    return u32(seg_at(p.s0 * p.s1 + b * p.s1 + i));
}

fn block_start(b: u32, j: u32) -> u32 {
    if (p.s5 == 0u) { return j; }
    return u32(seg_at(2u * p.s0 * p.s1 + b * p.s1 + j));
}

// Query i sees key j (si, sj: their segment ids; ri: i's reach): causal or within i's image block, within the
// window (a key after the query always is), in the same segment.
fn sees(i: u32, j: u32, si: i32, sj: i32, ri: u32) -> bool {
    return j <= ri && (p.s4 == 0u || j + p.s4 > i) && sj == si && (si != 0 || j == i);
}

fn hsum(a: vec4<f32>) -> f32 { return (a.x + a.y) + (a.z + a.w); }

// (min, max) of the nonzero segment ids at positions [a, e) of batch row b, and 1 in z when one is 0
// (padding). Every invocation reads the same ids: one address per load for the workgroup.
fn seg_range(b: u32, a: u32, e: u32) -> vec3<i32> {
    var lo = NONE;
    var hi = -NONE;
    var pad = 0;
    let base = b * p.s1;
    for (var x = a; x < e; x++) {
        let s = seg_at(base + x);
        if (s == 0) { pad = 1; } else { lo = min(lo, s); hi = max(hi, s); }
    }
    return vec3<i32>(lo, hi, pad);
}

// Whether two blocks' nonzero segment ranges overlap (a segment id may be in both).
fn overlap(a: vec3<i32>, c: vec3<i32>) -> bool {
    return max(a.x, c.x) <= min(a.y, c.y);
}

// The backward's statistics share one binding (WebGPU's default limit is 8 storage buffers per stage): lse
// (B, Hq, T) at the binding's offset, then delta = rowsum(dout * out) (B, Hq, T).
fn stats_rows() -> u32 { return p.s0 * p.s2 * p.s1; }

// ---- the bindings of each pass -------------------------------------------------------------------------------
// The activations (q, k, v, att = the attention output, and their gradients) are tensors in any storage format:
// a `// @tensor` marker (device/storage.py) and a `// @tensor4` vec4 view of it (storage.views:
// one vec4<f32> in float32, two words in 16 bits, at element offsets that are multiples of 4). <name>_at(x) is
// the vec4 x of the tensor (elements 4x .. 4x + 3 from its binding's offset), <name>_set(x, value) stores it.
// seg_at(x): segment id x; lse_at, delta_at / delta_set: statistic x (float32).
// @forward begin
// forward's bindings: 1 att, 2 lse, 3 q, 4 k, 5 v, 6 segment ids
// @tensor 1 att read_write
// @tensor4 1 att read_write
@group(0) @binding(2) var<storage, read_write> lse_: array<f32>;
// @tensor 3 q read
// @tensor4 3 q read
// @tensor 4 k read
// @tensor4 4 k read
// @tensor 5 v read
// @tensor4 5 v read
@group(0) @binding(6) var<storage, read> seg_: array<i32>;
fn seg_at(x: u32) -> i32 { return seg_[p.o6 + x]; }
fn lse_set(x: u32, value: f32) { lse_[p.o2 + x] = value; }
fn q_at(x: u32) -> vec4<f32> { return q_ld4(p.o3 + 4u * x); }
fn k_at(x: u32) -> vec4<f32> { return k_ld4(p.o4 + 4u * x); }
fn v_at(x: u32) -> vec4<f32> { return v_ld4(p.o5 + 4u * x); }
fn att_set(x: u32, a: vec4<f32>) { att_st4(p.o1 + 4u * x, a); }
// @forward end
// @dq begin
// dq's bindings (delta fused): 1 dq, 2 dout, 3 q, 4 k, 5 v, 6 statistics (lse, delta out),
// 7 segment ids, 8 att
// @tensor 1 dq read_write
// @tensor4 1 dq read_write
// @tensor 2 dout read
// @tensor4 2 dout read
// @tensor 3 q read
// @tensor4 3 q read
// @tensor 4 k read
// @tensor4 4 k read
// @tensor 5 v read
// @tensor4 5 v read
@group(0) @binding(6) var<storage, read_write> stats_: array<f32>;
@group(0) @binding(7) var<storage, read> seg_: array<i32>;
// @tensor 8 att read
// @tensor4 8 att read
fn seg_at(x: u32) -> i32 { return seg_[p.o7 + x]; }
fn lse_at(x: u32) -> f32 { return stats_[p.o6 + x]; }
fn delta_set(x: u32, value: f32) { stats_[p.o6 + stats_rows() + x] = value; }
fn dout_at(x: u32) -> vec4<f32> { return dout_ld4(p.o2 + 4u * x); }
fn q_at(x: u32) -> vec4<f32> { return q_ld4(p.o3 + 4u * x); }
fn k_at(x: u32) -> vec4<f32> { return k_ld4(p.o4 + 4u * x); }
fn v_at(x: u32) -> vec4<f32> { return v_ld4(p.o5 + 4u * x); }
fn att_at(x: u32) -> vec4<f32> { return att_ld4(p.o8 + 4u * x); }
fn dq_set(x: u32, a: vec4<f32>) { dq_st4(p.o1 + 4u * x, a); }
// @dq end
// @dkv begin
// dk, dv's bindings: 1 dk, 2 dv, 3 dout, 4 q, 5 k, 6 v, 7 statistics (lse, delta), 8 segment ids
// @tensor 1 dk read_write
// @tensor4 1 dk read_write
// @tensor 2 dv read_write
// @tensor4 2 dv read_write
// @tensor 3 dout read
// @tensor4 3 dout read
// @tensor 4 q read
// @tensor4 4 q read
// @tensor 5 k read
// @tensor4 5 k read
// @tensor 6 v read
// @tensor4 6 v read
@group(0) @binding(7) var<storage, read> stats_: array<f32>;
@group(0) @binding(8) var<storage, read> seg_: array<i32>;
fn seg_at(x: u32) -> i32 { return seg_[p.o8 + x]; }
fn lse_at(x: u32) -> f32 { return stats_[p.o7 + x]; }
fn delta_at(x: u32) -> f32 { return stats_[p.o7 + stats_rows() + x]; }
fn dout_at(x: u32) -> vec4<f32> { return dout_ld4(p.o3 + 4u * x); }
fn q_at(x: u32) -> vec4<f32> { return q_ld4(p.o4 + 4u * x); }
fn k_at(x: u32) -> vec4<f32> { return k_ld4(p.o5 + 4u * x); }
fn v_at(x: u32) -> vec4<f32> { return v_ld4(p.o6 + 4u * x); }
fn dk_set(x: u32, a: vec4<f32>) { dk_st4(p.o1 + 4u * x, a); }
fn dv_set(x: u32, a: vec4<f32>) { dv_st4(p.o2 + 4u * x, a); }
// @dkv end
