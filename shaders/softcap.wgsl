// Soft-capping of the scaled attention scores (Gemma 2) for the attention shaders that include it, whose
// uniform's f1 is the cap (0 for none): cap * tanh(s / cap), and its derivative.
// @include tanh

fn cap_score(s: f32) -> f32 {
    if (p.f1 == 0.0) { return s; }
    return p.f1 * tanh_f32(s / p.f1);
}

fn cap_grad(s: f32) -> f32 {
    if (p.f1 == 0.0) { return 1.0; }
    let th = tanh_f32(s / p.f1);
    return 1.0 - th * th;
}

fn cap_score4(s: vec4<f32>) -> vec4<f32> {
    if (p.f1 == 0.0) { return s; }
    return p.f1 * tanh4(s / p.f1);
}

fn cap_grad4(s: vec4<f32>) -> vec4<f32> {
    if (p.f1 == 0.0) { return vec4<f32>(1.0); }
    let th = tanh4(s / p.f1);
    return 1.0 - th * th;
}
