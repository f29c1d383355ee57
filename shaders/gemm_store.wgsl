// The pair store the float GEMMs end with (gemm.wgsl's register kernels; gemm_tiled.wgsl's tiled kernels and
// split-K reduction), appended to them by their `// @include gemm_store` line. Both Params name C's column
// stride and width (c_sn, N), the flags and the bias's offset and strides (o3, bias_sm, bias_sn) alike; BIAS is
// float32, C a tensor in any storage format (device/storage.py's accessors C_ld, C_ld2, C_st, C_st2).

// alpha * v (+ bias) at (m, n) of C.
fn scaled(m: u32, n: u32, v: f32, alpha: f32) -> f32 {
    var out = alpha * v;
    if ((P.flags & 2u) != 0u) {
        out += BIAS[P.o3 + m * P.bias_sm + n * P.bias_sn];
    }
    return out;
}

// C at element i, (m, n), and i + c_sn, (m, n + 1) = alpha * v (+ bias) (+ C), the second skipped past N: one
// pair store where C's rows are contiguous (a 16-bit C's always are, each pair a word: gemm_kernels.Problem
// checks), else one by one.
fn store_pair(i: u32, m: u32, n: u32, v: vec2<f32>, alpha: f32) {
    let acc = (P.flags & 1u) != 0u;
    var out = vec2<f32>(scaled(m, n, v.x, alpha), 0.0);
    if (n + 1u < P.N) {
        out.y = scaled(m, n + 1u, v.y, alpha);
        if (P.c_sn == 1u) {
            if (acc) {
                out += C_ld2(i);
            }
            C_st2(i, out);
            return;
        }
        if (acc) {
            out.y += C_ld(i + P.c_sn);
        }
        C_st(i + P.c_sn, out.y);
    }
    if (acc) {
        out.x += C_ld(i);
    }
    C_st(i, out.x);
}
