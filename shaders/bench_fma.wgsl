// Peak fp32 FMA throughput of an adapter, the yardstick every kernel benchmark is reported against.
// Each invocation runs 8 independent vec4 FMA chains (32 lanes of FMA in flight) so that neither the
// FMA latency nor memory limits the rate; the result is stored so nothing is optimised away.

struct Params {
    iters: u32,
};

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;

@compute @workgroup_size(64)
fn fma_peak(@builtin(global_invocation_id) gid: vec3<u32>) {
    let x = f32(gid.x & 255u) * 1e-3;
    var a0 = vec4<f32>(x, x + 0.1, x + 0.2, x + 0.3);
    var a1 = a0 + 1.0;
    var a2 = a0 + 2.0;
    var a3 = a0 + 3.0;
    var a4 = a0 + 4.0;
    var a5 = a0 + 5.0;
    var a6 = a0 + 6.0;
    var a7 = a0 + 7.0;
    // a contraction towards 1 / (1 - m) * c keeps every value finite for any iteration count
    let m = vec4<f32>(0.999);
    let c = vec4<f32>(0.001);
    for (var i = 0u; i < P.iters; i++) {
        a0 = fma(a0, m, c);
        a1 = fma(a1, m, c);
        a2 = fma(a2, m, c);
        a3 = fma(a3, m, c);
        a4 = fma(a4, m, c);
        a5 = fma(a5, m, c);
        a6 = fma(a6, m, c);
        a7 = fma(a7, m, c);
    }
    out[gid.x] = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
}
