// The pair store the frozen-weight GEMMs end with (gemm_quant.wgsl's register kernels, gemm_quant_tiled.wgsl's
// tiled ones), appended to them by their `// @include gemm_quant_store` line: their Params and bindings are the
// same (N, flags, the bias offset o3; BIAS float32, C a tensor in any storage format).

// C at element i, columns n and n + 1 (n even) of its row, = v, the bias added, then C's old values (accumulate),
// stored as a pair (one word of a 16-bit C); an odd N's last column alone (a float32 C: 16-bit tensors have even
// widths).
fn store_pair(i: u32, n: u32, v: vec2<f32>) {
    var out = v;
    if ((P.flags & 2u) != 0u) {
        out += vec2<f32>(BIAS[P.o3 + n], BIAS[P.o3 + min(n + 1u, P.N - 1u)]);
    }
    if (n + 1u < P.N) {
        if ((P.flags & 1u) != 0u) {
            out += C_ld2(i);
        }
        C_st2(i, out);
    } else {
        if ((P.flags & 1u) != 0u) {
            out.x += C_ld(i);
        }
        C_st(i, out.x);
    }
}
