// DoRA (PEFT's use_dora): the detached weight norm of each output row, and the op pair that scales a module's
// output by c = m / ||W + s B A|| (engines/numpy/ops.py: dora_norm, dora_forward, dora_backward).
// Bindings 1 and 2 in any storage format (device/storage.py): dora_forward's y, written by pairs of elements, and
// dora_backward's dy; the rest float32 (dora_norm's rn and dora_backward's dz, which one invocation writes per
// element, included).
// Uniform: s0..s7 sizes, o1..o6 element offsets of bindings 1..6, f0..f1 scalars.

// @include params

// @tensor 1 y read_write
// @tensor 2 a read
@group(0) @binding(3) var<storage, read> b: array<f32>;
@group(0) @binding(4) var<storage, read> c: array<f32>;
@group(0) @binding(5) var<storage, read> d: array<f32>;
@group(0) @binding(6) var<storage, read_write> w: array<f32>;

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid.x;
}

// rn (out,) = 1 / sqrt(wn2 + 2 s B_j . Pt[:, j] + s^2 B_j G B_j^T): y = rn, a = wn2 (out,), b = Pt = A W^T (r, out),
// c = G = A A^T (r, r), d = B (out, r); s0 = out, s1 = r, f0 = s. One invocation per output row.
@compute @workgroup_size(256)
fn dora_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let j = flat(wid, nwg, lid);
    let out = p.s0;
    let r = p.s1;
    if (j >= out) { return; }
    var cross = 0.0;
    var quad = 0.0;
    for (var k = 0u; k < r; k++) {
        let bk = d[p.o5 + j * r + k];
        cross += bk * b[p.o3 + k * out + j];
        var gb = 0.0;
        for (var l = 0u; l < r; l++) {
            gb += c[p.o4 + k * r + l] * d[p.o5 + j * r + l];
        }
        quad += bk * gb;
    }
    let s = p.f0;
    y_st(p.o1 + j, 1.0 / sqrt(a_ld(p.o2 + j) + 2.0 * s * cross + s * s * quad));
}

// (m * rn - offset) * z + bias of element i of (N, out)
fn scaled(i: u32) -> f32 {
    let j = i % p.s1;
    var v = (b[p.o3 + j] * c[p.o4 + j] - p.f0) * a_ld(p.o2 + i);
    if (p.s3 != 0u) { v += d[p.o5 + j]; }
    return v;
}

// y (N, out) (+)= (m * rn - offset) * z + bias: a = z (N, out), b = m (out,), c = rn (out,), d = bias (out,);
// s0 = N * out, s1 = out, s2 = accumulate, s3 = has bias, f0 = offset. One invocation per pair of elements.
@compute @workgroup_size(256)
fn dora_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = 2u * flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        var v = vec2<f32>(scaled(i), scaled(i + 1u));
        if (p.s2 != 0u) { v += y_ld2(p.o1 + i); }
        y_st2(p.o1 + i, v);
    } else {
        var v = scaled(i);
        if (p.s2 != 0u) { v += y_ld(p.o1 + i); }
        y_st(p.o1 + i, v);
    }
}

const COLS = 64u;     // output columns per workgroup
const LANES = 4u;     // row lanes per column, summed through workgroup memory
var<workgroup> partial: array<f32, 256>;

// dz (N, out) = (m * rn - offset) * dy; dm (out,) += rn * sum over rows of dy * z: y = dz, a = dy, b = z,
// c = m, d = rn, w = dm; s0 = N, s1 = out, f0 = offset. A workgroup takes 64 columns, 4 lanes of rows each.
@compute @workgroup_size(64, 4)
fn dora_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let n = p.s0;
    let out = p.s1;
    let j = wid.x * COLS + lid.x;
    var acc = 0.0;
    if (j < out) {
        let cj = c[p.o4 + j] * d[p.o5 + j] - p.f0;
        for (var row = lid.y; row < n; row += LANES) {
            let g = a_ld(p.o2 + row * out + j);
            y_st(p.o1 + row * out + j, cj * g);
            acc += g * b[p.o3 + row * out + j];
        }
    }
    partial[lid.y * COLS + lid.x] = acc;
    workgroupBarrier();
    if (lid.y == 0u && j < out) {
        let total = partial[lid.x] + partial[COLS + lid.x] + partial[2u * COLS + lid.x] + partial[3u * COLS + lid.x];
        w[p.o6 + j] += d[p.o5 + j] * total;
    }
}
