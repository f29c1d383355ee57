// The grouped-expert GEMMs' weight W (binding 3) packed as MXFP4 (tuned/moe_source.py splices this in place of W's
// tensor markers): one u32 buffer holding a checkpoint's blocks as stored, two e2m1 values a byte (element i in byte
// i / 2, the low nibble first: byte j of a word holds elements 2j and 2j + 1), then from word P.w_abs the e8m0
// scales, one byte per 32 elements (four to a word, the first in the low byte). A value is decoded in registers
// (e2m1 * 2^(scale - 127), exact), never written back: w_ld (one element) and w_ld4 (4, i % 4 == 0, one word, one
// scale) as the storage formats' accessors. A scale byte of 0 decodes as 0 (2^-127 is below f32's normal range).
@group(0) @binding(3) var<storage, read> wq: array<u32>;

// e2m1 for 4 codes, built as f32 bits: sign (bit 3), exponent (bits 2..1, bias 1), mantissa (bit 0); exponent 0 is
// the subnormal 0 or 0.5.
fn e2m1(q: vec4<u32>) -> vec4<f32> {
    let e = (q >> vec4<u32>(1u)) & vec4<u32>(3u);
    let m = q & vec4<u32>(1u);
    let normal = ((e + vec4<u32>(126u)) << vec4<u32>(23u)) | (m << vec4<u32>(22u));
    let bits = select(m * vec4<u32>(126u << 23u), normal, e != vec4<u32>(0u));
    return bitcast<vec4<f32>>(bits | ((q & vec4<u32>(8u)) << vec4<u32>(28u)));
}

fn w_scale(i: u32) -> f32 {
    let s = (wq[P.w_abs + (i >> 7u)] >> (((i >> 5u) & 3u) * 8u)) & 255u;
    return bitcast<f32>(s << 23u);
}

fn w_ld(i: u32) -> f32 {
    let q = (wq[i >> 3u] >> (((i >> 1u) & 3u) * 8u + (i & 1u) * 4u)) & 15u;
    return e2m1(vec4<u32>(q)).x * w_scale(i);
}

fn w_ld4(i: u32) -> vec4<f32> {
    let shifts = select(vec4<u32>(0u, 4u, 8u, 12u), vec4<u32>(16u, 20u, 24u, 28u), (i & 4u) != 0u);
    return e2m1((vec4<u32>(wq[i >> 3u]) >> shifts) & vec4<u32>(15u)) * w_scale(i);
}
