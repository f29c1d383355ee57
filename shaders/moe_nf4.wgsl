// The grouped-expert GEMMs' weight W (binding 3) stored as NF4 (tuned/moe_source.py splices this in place of W's
// tensor markers): one u32 buffer holding the bitsandbytes codes of the whole flattened (E, out, in) tensor, eight
// to a word (byte j of a word: elements 2j (high nibble) and 2j + 1 (low nibble)), then from word P.w_abs the f32
// absmax of each block of 64 elements (nf4-dq's double-quantised ones as the reference dequantises them). A value
// is decoded in registers (code * absmax), never written back: w_ld (one element) and w_ld4 (4, i % 4 == 0, one
// block, one word) as the storage formats' accessors.
@group(0) @binding(3) var<storage, read> wq: array<u32>;

// NF4_CODE[q] for 4 indices, through a tree of selects on their bits (gemm_quant.wgsl's decoder).
fn nf4_code(q: vec4<u32>) -> vec4<f32> {
    let b0 = (q & vec4<u32>(1u)) != vec4<u32>(0u);
    let b1 = (q & vec4<u32>(2u)) != vec4<u32>(0u);
    let b2 = (q & vec4<u32>(4u)) != vec4<u32>(0u);
    let b3 = (q & vec4<u32>(8u)) != vec4<u32>(0u);
    let s0 = select(vec4<f32>(-1.0), vec4<f32>(-0.6961928009986877), b0);
    let s1 = select(vec4<f32>(-0.5250730514526367), vec4<f32>(-0.39491748809814453), b0);
    let s2 = select(vec4<f32>(-0.28444138169288635), vec4<f32>(-0.18477343022823334), b0);
    let s3 = select(vec4<f32>(-0.09105003625154495), vec4<f32>(0.0), b0);
    let s4 = select(vec4<f32>(0.07958029955625534), vec4<f32>(0.16093020141124725), b0);
    let s5 = select(vec4<f32>(0.24611230194568634), vec4<f32>(0.33791524171829224), b0);
    let s6 = select(vec4<f32>(0.44070982933044434), vec4<f32>(0.5626170039176941), b0);
    let s7 = select(vec4<f32>(0.7229568362236023), vec4<f32>(1.0), b0);
    return select(select(select(s0, s1, b1), select(s2, s3, b1), b2),
                  select(select(s4, s5, b1), select(s6, s7, b1), b2), b3);
}

fn w_absmax(i: u32) -> f32 {
    return bitcast<f32>(wq[P.w_abs + (i >> 6u)]);
}

fn w_ld(i: u32) -> f32 {
    let q = (wq[i >> 3u] >> (((i >> 1u) & 3u) * 8u + 4u - (i & 1u) * 4u)) & 15u;
    return nf4_code(vec4<u32>(q)).x * w_absmax(i);
}

fn w_ld4(i: u32) -> vec4<f32> {
    let shifts = select(vec4<u32>(4u, 0u, 12u, 8u), vec4<u32>(20u, 16u, 28u, 24u), (i & 4u) != 0u);
    return nf4_code((vec4<u32>(wq[i >> 3u]) >> shifts) & vec4<u32>(15u)) * w_absmax(i);
}
