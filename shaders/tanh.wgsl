// Shared WGSL functions, appended to the shaders that name this file in an `// @include tanh` line.

// tanh to float32 precision: the builtin may lose relative precision near 0 (llvmpipe computes
// (exp(2x) - 1) / (exp(2x) + 1)) or overflow for large |x|; a series below 0.25, exp(-2|x|) <= 1 above.
fn tanh_f32(x: f32) -> f32 {
    let a = abs(x);
    if (a < 0.25) {
        let x2 = x * x;
        return x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))));
    }
    let e = exp(-2.0 * a);
    return sign(x) * (1.0 - e) / (1.0 + e);
}

fn tanh4(x: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(tanh_f32(x.x), tanh_f32(x.y), tanh_f32(x.z), tanh_f32(x.w));
}
