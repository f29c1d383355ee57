// Rotary position embedding in Hugging Face's half-rotation layout on x (N = B*T, H, D): of each head's
// leading R dims the pair (d, d + R/2) rotates by positions[n] * inv_freq[d], times f0 (longrope's
// attention factor); the other D - R dims pass through (partial rotary). The backward is the rotation
// by the opposite angle. One invocation per (row, head, pair); *_inplace variants overwrite binding 1.
// Uniform: s0 = N rows, s1 = H, s2 = D, s3 = R/2; o1..o4 = element offsets of bindings 1..4; f0 = scale.

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

// cos and sin of pos * inv_freq, the angle formed in f32 as Hugging Face does. The angle is first
// reduced to [-pi, pi] (Cody-Waite, 2*pi split so that k * TWO_PI_HI is exact for k < 2^15):
// GPU sin/cos are only accurate near zero and positions reach thousands of radians.
fn cos_sin(pos: i32, inv_freq: f32) -> vec2<f32> {
    let a = f32(pos) * inv_freq;
    let k = round(a * 0.15915494309189535);
    let r = (a - k * 6.28125) - k * 0.0019353071795864769;
    return vec2<f32>(cos(r), sin(r)) * p.f0;
}

struct Slot { row: u32, base: u32, d: u32, half: u32, ok: bool }

fn slot(i: u32) -> Slot {
    let half = p.s3;
    let d = i % half;
    let nh = i / half;
    let row = nh / p.s1;
    return Slot(row, nh * p.s2, d, half, row < p.s0);
}

// ---- out of place: 1 y (N, H, D) out, 2 x (N, H, D), 3 positions (N,) i32, 4 inv_freq (R/2,) ----
@group(0) @binding(1) var<storage, read_write> o_y: array<f32>;
@group(0) @binding(2) var<storage, read> o_x: array<f32>;
@group(0) @binding(3) var<storage, read> o_pos: array<i32>;
@group(0) @binding(4) var<storage, read> o_freq: array<f32>;

fn rotate_out(i: u32, sign: f32) {
    let s = slot(i);
    if (!s.ok) { return; }
    let cs = cos_sin(o_pos[p.o3 + s.row], o_freq[p.o4 + s.d]);
    let sn = sign * cs.y;
    let x1 = o_x[p.o2 + s.base + s.d];
    let x2 = o_x[p.o2 + s.base + s.d + s.half];
    o_y[p.o1 + s.base + s.d] = x1 * cs.x - x2 * sn;
    o_y[p.o1 + s.base + s.d + s.half] = x2 * cs.x + x1 * sn;
    // this pair's share of the dims that pass through: R + d, R + d + R/2, ...
    for (var j = 2u * s.half + s.d; j < p.s2; j = j + s.half) {
        o_y[p.o1 + s.base + j] = o_x[p.o2 + s.base + j];
    }
}

@compute @workgroup_size(256)
fn rope_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    rotate_out(flat(wid, nwg, lid), 1.0);
}

@compute @workgroup_size(256)
fn rope_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    rotate_out(flat(wid, nwg, lid), -1.0);
}

// ---- in place: 1 x (N, H, D) in/out, 2 positions (N,) i32, 3 inv_freq (R/2,) ----
@group(0) @binding(1) var<storage, read_write> i_x: array<f32>;
@group(0) @binding(2) var<storage, read> i_pos: array<i32>;
@group(0) @binding(3) var<storage, read> i_freq: array<f32>;

fn rotate_in(i: u32, sign: f32) {
    let s = slot(i);
    if (!s.ok) { return; }
    let cs = cos_sin(i_pos[p.o2 + s.row], i_freq[p.o3 + s.d]);
    let sn = sign * cs.y;
    let x1 = i_x[p.o1 + s.base + s.d];
    let x2 = i_x[p.o1 + s.base + s.d + s.half];
    i_x[p.o1 + s.base + s.d] = x1 * cs.x - x2 * sn;
    i_x[p.o1 + s.base + s.d + s.half] = x2 * cs.x + x1 * sn;
}

@compute @workgroup_size(256)
fn rope_forward_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_id) lid: vec3<u32>) {
    rotate_in(flat(wid, nwg, lid), 1.0);
}

@compute @workgroup_size(256)
fn rope_backward_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    rotate_in(flat(wid, nwg, lid), -1.0);
}
