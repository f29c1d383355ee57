// The FMA core of the workgroup-tiled GEMMs (gemm_tiled.wgsl, gemm_quant_tiled.wgsl), appended to them by their
// `// @include gemm_core` line: multiply(acc, buf) adds the products of the staged tiles in buffer `buf` to an
// invocation's TM x TN accumulators. The template defines the tiles As ([buffer][k][m / 4], rows AROW vec4s
// apart, ABUF per buffer) and Bs ([buffer][k][n / 4], BROW, BBUF) of vec4<Elem>, BM, BN, BK, TM, TN, TX, Acc
// and the invocation's tx / ty. One multiply serves both arithmetics; the source builder (gemm_source.core)
// keeps the lines of one of them (the f32-core or the f16-core sections) and blanks the other's:
//
// - float32 arithmetic (Elem = f32, KC = 1): one fused multiply-add per product into the f32 accumulators.
// - float16 arithmetic (Elem = f16, the shader-f16 extension; only for f16 operands, whose values the tiles
//   hold exactly): the products of KC = 4 consecutive steps of k are multiplied and summed in f16 by
//   multiply-adds from zero, each rounded to f16 (WGSL lets fma round its product too: lavapipe does), and each
//   such partial sum is added to the f32 accumulators. GPUs with packed f16 ALUs (AMD, Intel Arc, Apple) do two
//   f16 FMAs per f32 FMA slot and hold the fragments in half the registers; the f32 accumulation keeps the
//   error of a K-long sum to about KC units of f16 roundoff times the products' magnitudes
//   (gemm_kernels.f16_arithmetic_slack) instead of K. A product or partial past f16's range (65504) becomes
//   inf even where float32 arithmetic stays finite: a narrower range, which training's f16 loss scaler meets as
//   an overflow (the step skipped, the scale halved).
//
// Loops have constant trip counts and indices once unrolled, so the accumulators and the fragments of As / Bs
// stay in registers. Rows 4g .. 4g+3 times column group h go to sum[(4g + r) * TN / 4 + h], r < 4.

// KC: steps of k summed before each accumulation; Sum: what the products are summed into
// @f32-core begin
const KC: u32 = 1u;    // the products go straight to the accumulators
alias Sum = Acc;       // (naga takes an equal array type spelt differently for another type)
// @f32-core end
// @f16-core begin
const KC: u32 = 4u;    // summed in f16 over 4 steps, then added to the accumulators (BK is a multiple of 4)
alias Sum = array<vec4<f16>, TM * TN / 4u>;
// @f16-core end

// sum += the products of one step of k: a (rows, 4 per vec4) times b (columns, 4 per vec4).
fn update(sum: ptr<function, Sum>, a: array<vec4<Elem>, TM / 4u>, b: array<vec4<Elem>, TN / 4u>) {
    for (var g = 0u; g < TM / 4u; g++) {
        for (var h = 0u; h < TN / 4u; h++) {
            let j = g * TN + h;
            (*sum)[j] = fma(vec4<Elem>(a[g].x), b[h], (*sum)[j]);
            (*sum)[j + TN / 4u] = fma(vec4<Elem>(a[g].y), b[h], (*sum)[j + TN / 4u]);
            (*sum)[j + TN / 2u] = fma(vec4<Elem>(a[g].z), b[h], (*sum)[j + TN / 2u]);
            (*sum)[j + 3u * TN / 4u] = fma(vec4<Elem>(a[g].w), b[h], (*sum)[j + 3u * TN / 4u]);
        }
    }
}

fn multiply(acc: ptr<function, Acc>, buf: u32) {
    let a0 = buf * ABUF + ty;
    let b0 = buf * BBUF + tx;
    for (var k0 = 0u; k0 < BK; k0 += KC) {
        // @f16-core begin
        // zeroed here for each chunk: left to its declaration, naga (wgpu 0.32, lavapipe) kept the last chunk's sums
        var part: Sum;
        for (var j = 0u; j < TM * TN / 4u; j++) {
            part[j] = vec4<f16>(0.0);
        }
        // @f16-core end
        for (var k = k0; k < k0 + KC; k++) {
            var a: array<vec4<Elem>, TM / 4u>;
            var b: array<vec4<Elem>, TN / 4u>;
            for (var g = 0u; g < TM / 4u; g++) {
                a[g] = As[a0 + k * AROW + g * (BM / TM)];
            }
            for (var h = 0u; h < TN / 4u; h++) {
                b[h] = Bs[b0 + k * BROW + h * TX];
            }
            // @f32-core begin
            update(acc, a, b);
            // @f32-core end
            // @f16-core begin
            update(&part, a, b);
            // @f16-core end
        }
        // @f16-core begin
        for (var j = 0u; j < TM * TN / 4u; j++) {
            (*acc)[j] += vec4<f32>(part[j]);
        }
        // @f16-core end
    }
}
