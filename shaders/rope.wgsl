// Rotary position embedding in Hugging Face's half-rotation layout on x (N = B*T, H, D): of each head's
// leading R dims the pair (d, d + R/2) rotates by positions[n] * inv_freq[d] (with s6 = 1 positions is
// (N, R/2), each pair's own: positions[n, d], Qwen3-VL's M-RoPE), times f0 (longrope's attention factor);
// the other D - R dims pass through (partial rotary). The backward is the rotation by the opposite angle.
// *_inplace variants overwrite binding 1. x and y in any storage format (device/storage.py; 16-bit ones
// with even D and even offsets), written by pairs of elements.
// One invocation per (row, head, two adjacent pairs d, d + 1 with d even): with R/2 even it alone writes the
// 16-bit words (d, d + 1) and (d + R/2, d + R/2 + 1). With R/2 odd those words straddle two invocations' pairs,
// so 16-bit tensors take one invocation per (row, head) instead (s5 = 1), element by element.
// Uniform: s0 = N rows, s1 = H, s2 = D, s3 = R/2, s4 = invocations per head, s5 = whole heads,
// s6 = positions per pair;
// o1..o4 = element offsets of bindings 1..4; f0 = scale.

// @include params

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

// The pair (x1, x2) rotated by the angle of cs = (cos, sin) * scale, its sine's sign flipped by sign = -1.
fn turn(x1: f32, x2: f32, cs: vec2<f32>, sign: f32) -> vec2<f32> {
    let sn = sign * cs.y;
    return vec2<f32>(x1 * cs.x - x2 * sn, x2 * cs.x + x1 * sn);
}

struct Slot { row: u32, base: u32, d: u32, half: u32, ok: bool }

// The index in positions of row's pair d: the row's one position, or with s6 its pair's own
fn at_pair(row: u32, d: u32) -> u32 {
    return select(row, row * p.s3 + d, p.s6 != 0u);
}

fn slot(i: u32) -> Slot {
    let nh = i / p.s4;
    let row = nh / p.s1;
    return Slot(row, nh * p.s2, 2u * (i % p.s4), p.s3, row < p.s0);
}

// ---- out of place: 1 y (N, H, D) out, 2 x (N, H, D), 3 positions (N,) or (N, R/2) i32, 4 inv_freq (R/2,) ----
// @tensor 1 o_y read_write
// @tensor 2 o_x read
@group(0) @binding(3) var<storage, read> o_pos: array<i32>;
@group(0) @binding(4) var<storage, read> o_freq: array<f32>;

fn o_cs(row: u32, d: u32) -> vec2<f32> {
    return cos_sin(o_pos[p.o3 + at_pair(row, d)], o_freq[p.o4 + d]);
}

// y = x over the pairs of dims from j0 on, every step-th pair: dims that pass through
fn pass_out(yb: u32, xb: u32, j0: u32, step: u32) {
    for (var j = j0; j < p.s2; j += step) {
        if (j + 1u < p.s2) {
            o_y_st2(yb + j, o_x_ld2(xb + j));
        } else {
            o_y_st(yb + j, o_x_ld(xb + j));
        }
    }
}

fn rotate_out(i: u32, sign: f32) {
    let s = slot(i);
    if (!s.ok) { return; }
    let yb = p.o1 + s.base;
    let xb = p.o2 + s.base;
    if (p.s5 != 0u) {
        for (var d = 0u; d < s.half; d++) {
            let v = turn(o_x_ld(xb + d), o_x_ld(xb + d + s.half), o_cs(s.row, d), sign);
            o_y_st(yb + d, v.x);
            o_y_st(yb + d + s.half, v.y);
        }
        pass_out(yb, xb, 2u * s.half, 2u);
        return;
    }
    let d = s.d;
    if (d + 1u < s.half) {
        let x1 = o_x_ld2(xb + d);
        let x2 = o_x_ld2(xb + d + s.half);
        let a = turn(x1.x, x2.x, o_cs(s.row, d), sign);
        let b = turn(x1.y, x2.y, o_cs(s.row, d + 1u), sign);
        o_y_st2(yb + d, vec2<f32>(a.x, b.x));
        o_y_st2(yb + d + s.half, vec2<f32>(a.y, b.y));
    } else {
        let a = turn(o_x_ld(xb + d), o_x_ld(xb + d + s.half), o_cs(s.row, d), sign);
        o_y_st(yb + d, a.x);
        o_y_st(yb + d + s.half, a.y);
    }
    // this invocation's share of the pairs of dims that pass through: from R + d, every s4-th pair
    pass_out(yb, xb, 2u * s.half + d, 2u * p.s4);
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

// ---- in place: 1 x (N, H, D) in/out, 2 positions (N,) or (N, R/2) i32, 3 inv_freq (R/2,) ----
// @tensor 1 i_x read_write
@group(0) @binding(2) var<storage, read> i_pos: array<i32>;
@group(0) @binding(3) var<storage, read> i_freq: array<f32>;

fn i_cs(row: u32, d: u32) -> vec2<f32> {
    return cos_sin(i_pos[p.o2 + at_pair(row, d)], i_freq[p.o3 + d]);
}

fn rotate_in(i: u32, sign: f32) {
    let s = slot(i);
    if (!s.ok) { return; }
    let xb = p.o1 + s.base;
    if (p.s5 != 0u) {
        for (var d = 0u; d < s.half; d++) {
            let v = turn(i_x_ld(xb + d), i_x_ld(xb + d + s.half), i_cs(s.row, d), sign);
            i_x_st(xb + d, v.x);
            i_x_st(xb + d + s.half, v.y);
        }
        return;
    }
    let d = s.d;
    if (d + 1u < s.half) {
        let x1 = i_x_ld2(xb + d);
        let x2 = i_x_ld2(xb + d + s.half);
        let a = turn(x1.x, x2.x, i_cs(s.row, d), sign);
        let b = turn(x1.y, x2.y, i_cs(s.row, d + 1u), sign);
        i_x_st2(xb + d, vec2<f32>(a.x, b.x));
        i_x_st2(xb + d + s.half, vec2<f32>(a.y, b.y));
    } else {
        let a = turn(i_x_ld(xb + d), i_x_ld(xb + d + s.half), i_cs(s.row, d), sign);
        i_x_st(xb + d, a.x);
        i_x_st(xb + d + s.half, a.y);
    }
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
