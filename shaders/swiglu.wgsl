// The gated MLP activations, elementwise over N*F values: SwiGLU h = silu(gate) * up, GeGLU
// h = gelu_tanh(gate) * up (transformers' gelu_pytorch_tanh) and the plain product h = gate * up (LFM2's gates),
// gelu_tanh alone (gelu_forward / gelu_backward: SigLIP's MLP; with s1 = 1 the exact erf GELU, Qwen's mergers),
// and their gradients. Every tensor in any storage
// format (device/storage.py): one invocation per pair of elements (its last alone when n is odd).
// Uniform: s0 = number of elements; o1..o5 = element offsets of bindings 1..5 (even for 16-bit tensors).

// @include params

// The invocation's first element: twice its flat index over a grid folded into y beyond 65535 workgroups.
fn first(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return 2u * ((wid.y * nwg.x + wid.x) * 256u + lid.x);
}

fn sigmoid(x: f32) -> f32 {
    // exp(-x) overflows to inf for x < -88, which correctly gives 0.
    return 1.0 / (1.0 + exp(-x));
}

// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3); its derivative
// sigmoid(2u) + 2 x sigmoid(2u) sigmoid(-2u) u'. The sigmoid forms keep their relative precision in the
// tails, where 1 - tanh(u)^2 in float32 rounds to 0.
const GELU_C: f32 = 0.7978845608028654;   // sqrt(2 / pi)
const SILU: u32 = 0u;                     // the gate's activation (a forward's or backward's mode)
const GELU: u32 = 1u;
const NONE: u32 = 2u;
const SIGMOID: u32 = 3u;                  // h = up * sigmoid(gate): Qwen3.5's attention output gate
const GELU_ERF: u32 = 4u;                 // h = x Phi(x), Phi by erf: gelu_forward / gelu_backward with s1 = 1

// erf by Abramowitz & Stegun 7.1.26 (absolute error <= 1.5e-7), as engines/numpy/qwen3_vl_tower.erf on the host
fn erf_as(x: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.3275911 * abs(x));
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    return sign(x) * (1.0 - poly * exp(-x * x));
}

// Phi(x), the standard normal's distribution function
fn normal_cdf(x: f32) -> f32 {
    return 0.5 * (1.0 + erf_as(x * 0.7071067811865476));
}

// h of one element: silu(g) * u, gelu_tanh(g) * u or g * u
fn gated(g: f32, u: f32, mode: u32) -> f32 {
    if (mode == NONE) { return g * u; }
    if (mode == SIGMOID) { return u * sigmoid(g); }
    if (mode == GELU_ERF) { return g * normal_cdf(g) * u; }
    if (mode == GELU) {
        let u2 = 2.0 * GELU_C * (g + 0.044715 * g * g * g);
        return g * sigmoid(u2) * u;
    }
    return g * sigmoid(g) * u;
}

// (dgate, dup) of one element
fn grads(dh: f32, g: f32, u: f32, mode: u32) -> vec2<f32> {
    if (mode == NONE) { return vec2<f32>(dh * u, dh * g); }
    if (mode == SIGMOID) {
        let s = sigmoid(g);
        return vec2<f32>(dh * u * s * (1.0 - s), dh * s);
    }
    if (mode == GELU_ERF) {
        let phi = normal_cdf(g);
        return vec2<f32>(dh * u * (phi + g * 0.3989422804014327 * exp(-0.5 * g * g)), dh * (g * phi));
    }
    if (mode == GELU) {
        let u2 = 2.0 * GELU_C * (g + 0.044715 * g * g * g);
        let s = sigmoid(u2);
        let dgelu = s + 2.0 * g * s * sigmoid(-u2) * GELU_C * (1.0 + 3.0 * 0.044715 * g * g);
        return vec2<f32>(dh * u * dgelu, dh * (g * s));
    }
    let s = sigmoid(g);
    return vec2<f32>(dh * u * (s * (1.0 + g * (1.0 - s))), dh * (g * s));
}

// ---- forward: 1 h (out), 2 gate, 3 up ----
// @tensor 1 f_h read_write
// @tensor 2 f_gate read
// @tensor 3 f_up read

fn forward(i: u32, mode: u32) {
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        let g = f_gate_ld2(p.o2 + i);
        let u = f_up_ld2(p.o3 + i);
        f_h_st2(p.o1 + i, vec2<f32>(gated(g.x, u.x, mode), gated(g.y, u.y, mode)));
    } else {
        f_h_st(p.o1 + i, gated(f_gate_ld(p.o2 + i), f_up_ld(p.o3 + i), mode));
    }
}

@compute @workgroup_size(256)
fn swiglu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    forward(first(wid, nwg, lid), SILU);
}

@compute @workgroup_size(256)
fn geglu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    forward(first(wid, nwg, lid), GELU);
}

// ---- gelu alone (the vision towers' MLPs): 1 h (out), 2 gate; h = gelu_tanh(gate), or the erf GELU (s1 = 1) ----
@compute @workgroup_size(256)
fn gelu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    let mode = select(GELU, GELU_ERF, p.s1 == 1u);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        let g = f_gate_ld2(p.o2 + i);
        f_h_st2(p.o1 + i, vec2<f32>(gated(g.x, 1.0, mode), gated(g.y, 1.0, mode)));
    } else {
        f_h_st(p.o1 + i, gated(f_gate_ld(p.o2 + i), 1.0, mode));
    }
}

// ---- gelu alone's backward: 1 dx (out), 2 dy, 3 x; dx = dy gelu_tanh'(x) (the erf GELU's with s1 = 1) ----
// @tensor 1 gb_dx read_write
// @tensor 2 gb_dy read
// @tensor 3 gb_x read

@compute @workgroup_size(256)
fn gelu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    let mode = select(GELU, GELU_ERF, p.s1 == 1u);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        let dy = gb_dy_ld2(p.o2 + i);
        let x = gb_x_ld2(p.o3 + i);
        gb_dx_st2(p.o1 + i, vec2<f32>(grads(dy.x, x.x, 1.0, mode).x, grads(dy.y, x.y, 1.0, mode).x));
    } else {
        gb_dx_st(p.o1 + i, grads(gb_dy_ld(p.o2 + i), gb_x_ld(p.o3 + i), 1.0, mode).x);
    }
}

// ---- backward: 1 dgate (out), 2 dup (out), 3 dh, 4 gate, 5 up ----
// @tensor 1 b_dgate read_write
// @tensor 2 b_dup read_write
// @tensor 3 b_dh read
// @tensor 4 b_gate read
// @tensor 5 b_up read

fn backward(i: u32, mode: u32) {
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        let dh = b_dh_ld2(p.o3 + i);
        let g = b_gate_ld2(p.o4 + i);
        let u = b_up_ld2(p.o5 + i);
        let d0 = grads(dh.x, g.x, u.x, mode);
        let d1 = grads(dh.y, g.y, u.y, mode);
        b_dgate_st2(p.o1 + i, vec2<f32>(d0.x, d1.x));
        b_dup_st2(p.o2 + i, vec2<f32>(d0.y, d1.y));
    } else {
        let d = grads(b_dh_ld(p.o3 + i), b_gate_ld(p.o4 + i), b_up_ld(p.o5 + i), mode);
        b_dgate_st(p.o1 + i, d.x);
        b_dup_st(p.o2 + i, d.y);
    }
}

@compute @workgroup_size(256)
fn swiglu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    backward(first(wid, nwg, lid), SILU);
}

@compute @workgroup_size(256)
fn geglu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    backward(first(wid, nwg, lid), GELU);
}

@compute @workgroup_size(256)
fn mul_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    forward(first(wid, nwg, lid), NONE);
}

@compute @workgroup_size(256)
fn sigmoid_gate_elems_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                              @builtin(local_invocation_id) lid: vec3<u32>) {
    forward(first(wid, nwg, lid), SIGMOID);
}

@compute @workgroup_size(256)
fn sigmoid_gate_elems_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                               @builtin(local_invocation_id) lid: vec3<u32>) {
    backward(first(wid, nwg, lid), SIGMOID);
}

@compute @workgroup_size(256)
fn mul_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    backward(first(wid, nwg, lid), NONE);
}

// ---- swiglu backward in place: 1 gate -> dgate, 2 up -> dup, 3 dh ----
// @tensor 1 i_gate read_write
// @tensor 2 i_up read_write
// @tensor 3 i_dh read

@compute @workgroup_size(256)
fn swiglu_backward_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        let dh = i_dh_ld2(p.o3 + i);
        let g = i_gate_ld2(p.o1 + i);
        let u = i_up_ld2(p.o2 + i);
        let d0 = grads(dh.x, g.x, u.x, SILU);
        let d1 = grads(dh.y, g.y, u.y, SILU);
        i_gate_st2(p.o1 + i, vec2<f32>(d0.x, d1.x));
        i_up_st2(p.o2 + i, vec2<f32>(d0.y, d1.y));
    } else {
        let d = grads(i_dh_ld(p.o3 + i), i_gate_ld(p.o1 + i), i_up_ld(p.o2 + i), SILU);
        i_gate_st(p.o1 + i, d.x);
        i_up_st(p.o2 + i, d.y);
    }
}

// ---- a gate per row of x: y = sigmoid(g) x, g one value per row (Qwen2-MoE's shared expert; LFM3's per-head gate
// as one row per head) ----
// Uniform: s0 = rows N, s1 = row width C. 16-bit tensors are written by pairs (storage.py), whatever C's parity.

// forward, an invocation per pair of elements: 1 y (N, C) (out), 2 x (N, C), 3 g (N, 1)
// @tensor 1 g_y read_write
// @tensor 2 g_x read
// @tensor 3 g_g read

@compute @workgroup_size(256)
fn sigmoid_gate_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    let n = p.s0 * p.s1;
    if (i >= n) { return; }
    let y0 = sigmoid(g_g_ld(p.o3 + i / p.s1)) * g_x_ld(p.o2 + i);
    if (i + 1u < n) {
        g_y_st2(p.o1 + i, vec2<f32>(y0, sigmoid(g_g_ld(p.o3 + (i + 1u) / p.s1)) * g_x_ld(p.o2 + i + 1u)));
    } else {
        g_y_st(p.o1 + i, y0);
    }
}

// backward, an invocation per pair of rows (its dg sums over each row, no atomics): 1 dx (N, C) (out), 2 dg (N, 1)
// (out), 3 dy (N, C), 4 x (N, C), 5 g (N, 1). The pair's 2C elements start on an even index: dx by pairs.
// @tensor 1 h_dx read_write
// @tensor 2 h_dg read_write
// @tensor 3 h_dy read
// @tensor 4 h_x read
// @tensor 5 h_g read

@compute @workgroup_size(64)
fn sigmoid_gate_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = 2u * ((wid.y * nwg.x + wid.x) * 64u + lid.x);
    if (row >= p.s0) { return; }
    let rows = min(2u, p.s0 - row);
    let s = vec2<f32>(sigmoid(h_g_ld(p.o5 + row)), sigmoid(h_g_ld(p.o5 + row + rows - 1u)));
    var acc = vec2<f32>(0.0, 0.0);
    let start = row * p.s1;
    let end = start + rows * p.s1;
    for (var i: u32 = start; i < end; i = i + 2u) {
        let r0 = (i - start) / p.s1;                     // 0 or 1: each element's row within the pair
        let dy0 = h_dy_ld(p.o3 + i);
        let dx0 = dy0 * s[r0];
        acc[r0] = acc[r0] + dy0 * h_x_ld(p.o4 + i);
        if (i + 1u < end) {
            let r1 = (i + 1u - start) / p.s1;
            let dy1 = h_dy_ld(p.o3 + i + 1u);
            acc[r1] = acc[r1] + dy1 * h_x_ld(p.o4 + i + 1u);
            h_dx_st2(p.o1 + i, vec2<f32>(dx0, dy1 * s[r1]));
        } else {
            h_dx_st(p.o1 + i, dx0);
        }
    }
    let dg = acc * s * (vec2<f32>(1.0, 1.0) - s);
    if (rows == 2u) {
        h_dg_st2(p.o2 + row, dg);
    } else {
        h_dg_st(p.o2 + row, dg.x);
    }
}
