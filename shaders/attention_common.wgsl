// Helpers shared by the flash attention kernels (shaders/attention_regs.wgsl, shaders/attention_tiles.wgsl):
// attention_src.source() appends this text to each of them (WGSL declarations may come in any order, so the
// kernel file keeps its own line numbers; a compiler message past its last line points into this file).
// The uniform: s0 = B, s1 = T, s2 = Hq, s3 = Hkv, s4 = window; o<n> = element offset of binding n; f0 = the
// softmax scale. Each kernel defines seg_at(x): segment id x of its segment ids binding.

struct Params {
    s0: u32, s1: u32, s2: u32, s3: u32, s4: u32, s5: u32, s6: u32, s7: u32,
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32, o8: u32,
    o9: u32, o10: u32, o11: u32, o12: u32,
    f0: f32, f1: f32, f2: f32, f3: f32,
}

@group(0) @binding(0) var<uniform> p: Params;

const NONE: i32 = 2147483647;

// The first key query i may see under the sliding window (0 without one).
fn window_start(i: u32) -> u32 {
    return select(0u, i + 1u - p.s4, p.s4 > 0u && i + 1u > p.s4);
}

// One past the last query that may see key j under the sliding window (t without one).
fn window_end(j: u32, t: u32) -> u32 {
    return select(t, min(t, j + p.s4), p.s4 > 0u);
}

// Query i sees key j (si, sj: their segment ids).
fn sees(i: u32, j: u32, si: i32, sj: i32) -> bool {
    return j <= i && (p.s4 == 0u || i - j < p.s4) && sj == si && (si != 0 || j == i);
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
