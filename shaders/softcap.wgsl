// Soft-capping of the scaled attention scores (Gemma 2) for the attention shaders that include it, whose
// uniform's f1 is the cap (0 for none): cap * tanh(s / cap), and its derivative.
// @include tanh

fn cap_score(s: f32) -> f32 {
    if (p.f1 == 0.0) { return s; }
    return p.f1 * tanh_f32(s / p.f1);
}

// The cap's derivative at the score whose capped value is c: 1 - tanh^2 = 1 - (c / cap)^2 (no second tanh).
fn cap_slope(c: f32) -> f32 {
    if (p.f1 == 0.0) { return 1.0; }
    let r = c / p.f1;
    return 1.0 - r * r;
}

fn cap_score4(s: vec4<f32>) -> vec4<f32> {
    if (p.f1 == 0.0) { return s; }
    return p.f1 * tanh4(s / p.f1);
}

fn cap_slope4(c: vec4<f32>) -> vec4<f32> {
    if (p.f1 == 0.0) { return vec4<f32>(1.0); }
    let r = c / p.f1;
    return 1.0 - r * r;
}
