// RMSNorm over the last axis of x (N, C): forward y, rstd; backward dx (one workgroup per row) and
// dweight by a two-pass reduction (per-row-block partial sums, then a sum over blocks; no atomics).
// Uniform: s0 = N rows, s1 = C, s2 = rows per block, s3 = number of row blocks, s4 = accumulate dweight;
// o1..o5 = element offsets of bindings 1..5; f0 = eps.

struct Params {
    s0: u32, s1: u32, s2: u32, s3: u32, s4: u32, s5: u32, s6: u32, s7: u32,
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32, o8: u32,
    o9: u32, o10: u32, o11: u32, o12: u32,
    f0: f32, f1: f32, f2: f32, f3: f32,
}

const WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: Params;

var<workgroup> red: array<f32, WG>;

// Sum of one value per invocation. One barrier to publish, then every invocation adds all WG
// values in the same order (same result everywhere, deterministic): cheaper than a log2(WG)
// barrier tree on llvmpipe, where barriers are expensive.
fn wg_sum(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    var s = 0.0;
    for (var k = 0u; k < WG; k++) {
        s += red[k];
    }
    workgroupBarrier();
    return s;
}

// ---- forward: 1 y (N, C) out, 2 rstd (N,) out, 3 x (N, C), 4 weight (C,) ----
@group(0) @binding(1) var<storage, read_write> f_y: array<f32>;
@group(0) @binding(2) var<storage, read_write> f_rstd: array<f32>;
@group(0) @binding(3) var<storage, read> f_x: array<f32>;
@group(0) @binding(4) var<storage, read> f_w: array<f32>;

@compute @workgroup_size(WG)
fn rmsnorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid3: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.s0) { return; }
    let lid = lid3.x;
    let c = p.s1;
    let xb = p.o3 + row * c;
    var ss = 0.0;
    for (var j = lid; j < c; j += WG) {
        let v = f_x[xb + j];
        ss += v * v;
    }
    let r = 1.0 / sqrt(wg_sum(ss, lid) / f32(c) + p.f0);
    let yb = p.o1 + row * c;
    for (var j = lid; j < c; j += WG) {
        f_y[yb + j] = (f_x[xb + j] * r) * f_w[p.o4 + j];
    }
    if (lid == 0u) {
        f_rstd[p.o2 + row] = r;
    }
}

// ---- backward dx: 1 dx (N, C) out, 2 dy (N, C), 3 x (N, C), 4 weight (C,), 5 rstd (N,) ----
@group(0) @binding(1) var<storage, read_write> b_dx: array<f32>;
@group(0) @binding(2) var<storage, read> b_dy: array<f32>;
@group(0) @binding(3) var<storage, read> b_x: array<f32>;
@group(0) @binding(4) var<storage, read> b_w: array<f32>;
@group(0) @binding(5) var<storage, read> b_rstd: array<f32>;

@compute @workgroup_size(WG)
fn rmsnorm_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_id) lid3: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.s0) { return; }
    let lid = lid3.x;
    let c = p.s1;
    let r = b_rstd[p.o5 + row];
    let xb = p.o3 + row * c;
    let db = p.o2 + row * c;
    var dot = 0.0;
    for (var j = lid; j < c; j += WG) {
        dot += (b_dy[db + j] * b_w[p.o4 + j]) * (b_x[xb + j] * r);
    }
    let k = wg_sum(dot, lid) / f32(c);
    let ob = p.o1 + row * c;
    for (var j = lid; j < c; j += WG) {
        let xhat = b_x[xb + j] * r;
        b_dx[ob + j] = r * (b_dy[db + j] * b_w[p.o4 + j] - xhat * k);
    }
}

// ---- dweight pass 1: 1 partials (blocks, C) out, 2 dy (N, C), 3 x (N, C), 4 rstd (N,) ----
// One invocation per (column, row block): coalesced over columns, s2 rows each.
@group(0) @binding(1) var<storage, read_write> w_part: array<f32>;
@group(0) @binding(2) var<storage, read> w_dy: array<f32>;
@group(0) @binding(3) var<storage, read> w_x: array<f32>;
@group(0) @binding(4) var<storage, read> w_rstd: array<f32>;

@compute @workgroup_size(WG)
fn rmsnorm_backward_partial(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let col = gid.x;
    let c = p.s1;
    if (col >= c) { return; }
    let blk = wid.y;
    let r0 = blk * p.s2;
    let r1 = min(p.s0, r0 + p.s2);
    var s = 0.0;
    for (var r = r0; r < r1; r++) {
        s += w_dy[p.o2 + r * c + col] * (w_x[p.o3 + r * c + col] * w_rstd[p.o4 + r]);
    }
    w_part[p.o1 + blk * c + col] = s;
}

// ---- dweight pass 2: 1 dweight (C,) out (or +=, s4 = 1), 2 partials (blocks, C) ----
@group(0) @binding(1) var<storage, read_write> s_dw: array<f32>;
@group(0) @binding(2) var<storage, read> s_part: array<f32>;

@compute @workgroup_size(WG)
fn rmsnorm_backward_weight(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    let c = p.s1;
    if (col >= c) { return; }
    var s = 0.0;
    for (var b = 0u; b < p.s3; b++) {
        s += s_part[p.o2 + b * c + col];
    }
    if (p.s4 != 0u) {
        s += s_dw[p.o1 + col];
    }
    s_dw[p.o1 + col] = s;
}
