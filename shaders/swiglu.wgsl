// The gated MLP activations, elementwise over N*F values: SwiGLU h = silu(gate) * up and GeGLU
// h = gelu_tanh(gate) * up (transformers' gelu_pytorch_tanh), and their gradients.
// Uniform: s0 = number of elements; o1..o5 = element offsets of bindings 1..5.

struct Params {
    s0: u32, s1: u32, s2: u32, s3: u32, s4: u32, s5: u32, s6: u32, s7: u32,
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32, o8: u32,
    o9: u32, o10: u32, o11: u32, o12: u32,
    f0: f32, f1: f32, f2: f32, f3: f32,
}

@group(0) @binding(0) var<uniform> p: Params;

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid.x;
}

fn sigmoid(x: f32) -> f32 {
    // exp(-x) overflows to inf for x < -88, which correctly gives 0.
    return 1.0 / (1.0 + exp(-x));
}

// ---- forward: 1 h (out), 2 gate, 3 up ----
@group(0) @binding(1) var<storage, read_write> f_h: array<f32>;
@group(0) @binding(2) var<storage, read> f_gate: array<f32>;
@group(0) @binding(3) var<storage, read> f_up: array<f32>;

@compute @workgroup_size(256)
fn swiglu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    let g = f_gate[p.o2 + i];
    f_h[p.o1 + i] = g * sigmoid(g) * f_up[p.o3 + i];
}

// ---- backward: 1 dgate (out), 2 dup (out), 3 dh, 4 gate, 5 up ----
@group(0) @binding(1) var<storage, read_write> b_dgate: array<f32>;
@group(0) @binding(2) var<storage, read_write> b_dup: array<f32>;
@group(0) @binding(3) var<storage, read> b_dh: array<f32>;
@group(0) @binding(4) var<storage, read> b_gate: array<f32>;
@group(0) @binding(5) var<storage, read> b_up: array<f32>;

fn grads(dh: f32, g: f32, u: f32) -> vec2<f32> {
    let s = sigmoid(g);
    return vec2<f32>(dh * u * (s * (1.0 + g * (1.0 - s))), dh * (g * s));
}

@compute @workgroup_size(256)
fn swiglu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    let d = grads(b_dh[p.o3 + i], b_gate[p.o4 + i], b_up[p.o5 + i]);
    b_dgate[p.o1 + i] = d.x;
    b_dup[p.o2 + i] = d.y;
}

// ---- backward in place: 1 gate -> dgate, 2 up -> dup, 3 dh ----
@group(0) @binding(1) var<storage, read_write> i_gate: array<f32>;
@group(0) @binding(2) var<storage, read_write> i_up: array<f32>;
@group(0) @binding(3) var<storage, read> i_dh: array<f32>;

@compute @workgroup_size(256)
fn swiglu_backward_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    let d = grads(i_dh[p.o3 + i], i_gate[p.o1 + i], i_up[p.o2 + i]);
    i_gate[p.o1 + i] = d.x;
    i_up[p.o2 + i] = d.y;
}

// ---- GeGLU: forward 1 h (out), 2 gate, 3 up; backward 1 dgate (out), 2 dup (out), 3 dh, 4 gate, 5 up ----
// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3); its derivative
// sigmoid(2u) + 2 x sigmoid(2u) sigmoid(-2u) u'. The sigmoid forms keep their relative precision in the
// tails, where 1 - tanh(u)^2 in float32 rounds to 0.
const GELU_C: f32 = 0.7978845608028654;   // sqrt(2 / pi)

@compute @workgroup_size(256)
fn geglu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    let g = f_gate[p.o2 + i];
    let u2 = 2.0 * GELU_C * (g + 0.044715 * g * g * g);
    f_h[p.o1 + i] = g * sigmoid(u2) * f_up[p.o3 + i];
}

@compute @workgroup_size(256)
fn geglu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    let g = b_gate[p.o4 + i];
    let dh = b_dh[p.o3 + i];
    let u2 = 2.0 * GELU_C * (g + 0.044715 * g * g * g);
    let s = sigmoid(u2);
    let dgelu = s + 2.0 * g * s * sigmoid(-u2) * GELU_C * (1.0 + 3.0 * 0.044715 * g * g);
    b_dgate[p.o1 + i] = dh * b_up[p.o5 + i] * dgelu;
    b_dup[p.o2 + i] = dh * (g * s);
}
