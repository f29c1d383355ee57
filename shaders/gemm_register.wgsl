// The register-blocked GEMMs' accumulator code, shared by gemm.wgsl (float32 B) and gemm_quant.wgsl (a frozen
// 16-bit or NF4 W) and appended to them by their `// @include gemm_register` line: the rank-4 FMA update of a row
// of accumulators and, in the epilogue, the pick of a row's accumulators. Both declare
// `alias Acc = array<vec4<f32>, 64>`: acc[2 * row + j], row `row` of 32, column group j (4 columns) of 2.

// c + b * a as a chain of fused multiply-adds: b's column i is row k + i of the B slice.
fn rank4(c: vec4<f32>, a: vec4<f32>, b: mat4x4<f32>) -> vec4<f32> {
    let c1 = fma(b[0], vec4<f32>(a.x), c);
    let c2 = fma(b[1], vec4<f32>(a.y), c1);
    let c3 = fma(b[2], vec4<f32>(a.z), c2);
    return fma(b[3], vec4<f32>(a.w), c3);
}

// Row `row` += a (its 4 values of k) times the 4 x 8 B slice (b0: columns 0..3, b1: columns 4..7).
fn update_row(acc: ptr<function, Acc>, row: u32, a: vec4<f32>, b0: mat4x4<f32>, b1: mat4x4<f32>) {
    (*acc)[2u * row] = rank4((*acc)[2u * row], a, b0);
    (*acc)[2u * row + 1u] = rank4((*acc)[2u * row + 1u], a, b1);
}

// acc[2r + j] for a row r known only at run time (j constant), through a tree of selects: indexing the
// accumulator array with a run-time row would move it to memory, and unrolling 32 rows of stores (each a lane
// loop on llvmpipe) makes the pipeline take ~20x longer to compile.
fn pick(acc: ptr<function, Acc>, r: u32, j: u32) -> vec4<f32> {
    let s0_0 = select((*acc)[0u + j], (*acc)[2u + j], (r & 1u) != 0u);
    let s0_1 = select((*acc)[4u + j], (*acc)[6u + j], (r & 1u) != 0u);
    let s0_2 = select((*acc)[8u + j], (*acc)[10u + j], (r & 1u) != 0u);
    let s0_3 = select((*acc)[12u + j], (*acc)[14u + j], (r & 1u) != 0u);
    let s0_4 = select((*acc)[16u + j], (*acc)[18u + j], (r & 1u) != 0u);
    let s0_5 = select((*acc)[20u + j], (*acc)[22u + j], (r & 1u) != 0u);
    let s0_6 = select((*acc)[24u + j], (*acc)[26u + j], (r & 1u) != 0u);
    let s0_7 = select((*acc)[28u + j], (*acc)[30u + j], (r & 1u) != 0u);
    let s0_8 = select((*acc)[32u + j], (*acc)[34u + j], (r & 1u) != 0u);
    let s0_9 = select((*acc)[36u + j], (*acc)[38u + j], (r & 1u) != 0u);
    let s0_10 = select((*acc)[40u + j], (*acc)[42u + j], (r & 1u) != 0u);
    let s0_11 = select((*acc)[44u + j], (*acc)[46u + j], (r & 1u) != 0u);
    let s0_12 = select((*acc)[48u + j], (*acc)[50u + j], (r & 1u) != 0u);
    let s0_13 = select((*acc)[52u + j], (*acc)[54u + j], (r & 1u) != 0u);
    let s0_14 = select((*acc)[56u + j], (*acc)[58u + j], (r & 1u) != 0u);
    let s0_15 = select((*acc)[60u + j], (*acc)[62u + j], (r & 1u) != 0u);
    let s1_0 = select(s0_0, s0_1, (r & 2u) != 0u);
    let s1_1 = select(s0_2, s0_3, (r & 2u) != 0u);
    let s1_2 = select(s0_4, s0_5, (r & 2u) != 0u);
    let s1_3 = select(s0_6, s0_7, (r & 2u) != 0u);
    let s1_4 = select(s0_8, s0_9, (r & 2u) != 0u);
    let s1_5 = select(s0_10, s0_11, (r & 2u) != 0u);
    let s1_6 = select(s0_12, s0_13, (r & 2u) != 0u);
    let s1_7 = select(s0_14, s0_15, (r & 2u) != 0u);
    let s2_0 = select(s1_0, s1_1, (r & 4u) != 0u);
    let s2_1 = select(s1_2, s1_3, (r & 4u) != 0u);
    let s2_2 = select(s1_4, s1_5, (r & 4u) != 0u);
    let s2_3 = select(s1_6, s1_7, (r & 4u) != 0u);
    let s3_0 = select(s2_0, s2_1, (r & 8u) != 0u);
    let s3_1 = select(s2_2, s2_3, (r & 8u) != 0u);
    return select(s3_0, s3_1, (r & 16u) != 0u);
}
