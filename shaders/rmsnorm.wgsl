// RMSNorm over the last axis of x (N, C): forward y, rstd; backward dx; dweight by a two-pass
// reduction (per-row-block partial sums, then a sum over blocks; no atomics, deterministic); at the end, the vision
// tower's LayerNorm forward (with a bias) and its backward's dx.
// Two layouts for the row kernels, chosen by the wrapper from C (engines/webgpu/kernels.py):
// - *_row / *_row4: one invocation per row, no workgroup memory and no barriers (barriers are
//   expensive on llvmpipe); _row4 reads vec4s and needs C % 4 == 0 and 4-aligned offsets.
// - rmsnorm_forward / rmsnorm_backward: one 64-wide workgroup per row, for large C.
// x, y, dy and dx in any storage format (device/storage.py; 16-bit ones with even C and even offsets), written
// by pairs of elements; rstd, the weight, dweight and its partial sums float32. The vec4 entry points
// (_row4, _partial4v) read float32 only: on 16-bit tensors the scalar ones load a word per pair of elements.
// Uniform: s0 = N rows, s1 = C, s2 = rows per block, s3 = number of row blocks, s4 = accumulate dweight,
// s5 = accumulate dx (dx += the gradient, rounded once); o1..o5 = element offsets of bindings 1..5; f0 = eps;
// f1 = offset added to the weight (Gemma's 1 + w).

// @include params

const WG: u32 = 64u;

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
// @tensor 1 f_y read_write
@group(0) @binding(2) var<storage, read_write> f_rstd: array<f32>;
// @tensor 3 f_x read
@group(0) @binding(4) var<storage, read> f_w: array<f32>;

// y[j], y[j + 1] of a row (j alone as the row's last element, odd C) from its rstd r
fn forward_pair(yb: u32, xb: u32, j: u32, c: u32, r: f32) {
    if (j + 1u < c) {
        let w = vec2<f32>(f_w[p.o4 + j], f_w[p.o4 + j + 1u]) + vec2<f32>(p.f1);
        f_y_st2(yb + j, (f_x_ld2(xb + j) * r) * w);
    } else {
        f_y_st(yb + j, (f_x_ld(xb + j) * r) * (f_w[p.o4 + j] + p.f1));
    }
}

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
        let v = f_x_ld(xb + j);
        ss += v * v;
    }
    let r = 1.0 / sqrt(wg_sum(ss, lid) / f32(c) + p.f0);
    let yb = p.o1 + row * c;
    for (var j = 2u * lid; j < c; j += 2u * WG) {
        forward_pair(yb, xb, j, c, r);
    }
    if (lid == 0u) {
        f_rstd[p.o2 + row] = r;
    }
}

// ---- backward dx: 1 dx (N, C) out, 2 dy (N, C), 3 x (N, C), 4 weight (C,), 5 rstd (N,) ----
// @tensor 1 b_dx read_write
// @tensor 2 b_dy read
// @tensor 3 b_x read
@group(0) @binding(4) var<storage, read> b_w: array<f32>;
@group(0) @binding(5) var<storage, read> b_rstd: array<f32>;

// dx[j], dx[j + 1] of a row (j alone as the row's last element, odd C) from its rstd r and
// k = mean(dy (w + offset) xhat); added to dx when s5 = 1
fn backward_pair(ob: u32, db: u32, xb: u32, j: u32, c: u32, r: f32, k: f32) {
    if (j + 1u < c) {
        let w = vec2<f32>(b_w[p.o4 + j], b_w[p.o4 + j + 1u]) + vec2<f32>(p.f1);
        let xhat = b_x_ld2(xb + j) * r;
        var v = r * (b_dy_ld2(db + j) * w - xhat * k);
        if (p.s5 != 0u) { v += b_dx_ld2(ob + j); }
        b_dx_st2(ob + j, v);
    } else {
        let xhat = b_x_ld(xb + j) * r;
        var v = r * (b_dy_ld(db + j) * (b_w[p.o4 + j] + p.f1) - xhat * k);
        if (p.s5 != 0u) { v += b_dx_ld(ob + j); }
        b_dx_st(ob + j, v);
    }
}

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
        dot += (b_dy_ld(db + j) * (b_w[p.o4 + j] + p.f1)) * (b_x_ld(xb + j) * r);
    }
    let k = wg_sum(dot, lid) / f32(c);
    let ob = p.o1 + row * c;
    for (var j = 2u * lid; j < c; j += 2u * WG) {
        backward_pair(ob, db, xb, j, c, r, k);
    }
}

// ---- dweight pass 1: 1 partials (blocks, C) out, 2 dy (N, C), 3 x (N, C), 4 rstd (N,) ----
// Entry points rmsnorm_backward_partial4 / _partial4v, below the row kernels.
@group(0) @binding(1) var<storage, read_write> w_part: array<f32>;
// @tensor 2 w_dy read
// @tensor 3 w_x read
@group(0) @binding(4) var<storage, read> w_rstd: array<f32>;

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

// ---- one invocation per row (small C): same bindings as the workgroup versions ----
// Row index over a flat dispatch folded into y beyond 65535 workgroups (kernels._grid).
fn row_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.y * (nwg.x * WG) + gid.x;
}

fn sum4(v: vec4<f32>) -> f32 {
    return (v.x + v.y) + (v.z + v.w);
}

// Scalar loads; four interleaved partial sums keep the rounding close to the vec4 version.
@compute @workgroup_size(WG)
fn rmsnorm_forward_row(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = row_index(gid, nwg);
    if (row >= p.s0) { return; }
    let c = p.s1;
    let xb = p.o3 + row * c;
    var ss = vec4<f32>(0.0);
    var j = 0u;
    for (; j + 4u <= c; j += 4u) {
        let v = vec4<f32>(f_x_ld2(xb + j), f_x_ld2(xb + j + 2u));
        ss += v * v;
    }
    for (; j < c; j++) {
        let v = f_x_ld(xb + j);
        ss.x += v * v;
    }
    let r = 1.0 / sqrt(sum4(ss) / f32(c) + p.f0);
    let yb = p.o1 + row * c;
    for (var k = 0u; k < c; k += 2u) {
        forward_pair(yb, xb, k, c, r);
    }
    f_rstd[p.o2 + row] = r;
}

@compute @workgroup_size(WG)
fn rmsnorm_backward_row(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = row_index(gid, nwg);
    if (row >= p.s0) { return; }
    let c = p.s1;
    let r = b_rstd[p.o5 + row];
    let xb = p.o3 + row * c;
    let db = p.o2 + row * c;
    var dot = vec4<f32>(0.0);
    var j = 0u;
    for (; j + 4u <= c; j += 4u) {
        let w = vec4<f32>(b_w[p.o4 + j], b_w[p.o4 + j + 1u], b_w[p.o4 + j + 2u], b_w[p.o4 + j + 3u]) + vec4<f32>(p.f1);
        let g = vec4<f32>(b_dy_ld2(db + j), b_dy_ld2(db + j + 2u));
        let x = vec4<f32>(b_x_ld2(xb + j), b_x_ld2(xb + j + 2u));
        dot += (g * w) * x;
    }
    for (; j < c; j++) {
        dot.x += (b_dy_ld(db + j) * (b_w[p.o4 + j] + p.f1)) * b_x_ld(xb + j);
    }
    let k = sum4(dot) * r / f32(c);
    let ob = p.o1 + row * c;
    for (var i = 0u; i < c; i += 2u) {
        backward_pair(ob, db, xb, i, c, r, k);
    }
}

// vec4 versions: float32 tensors, C % 4 == 0 and every residual offset (o1..o4; rstd's is scalar) a multiple of 4.
@group(0) @binding(1) var<storage, read_write> f4_y: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> f4_x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> f4_w: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn rmsnorm_forward_row4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = row_index(gid, nwg);
    if (row >= p.s0) { return; }
    let c4 = p.s1 / 4u;
    let xb = p.o3 / 4u + row * c4;
    var ss = vec4<f32>(0.0);
    for (var j = 0u; j < c4; j++) {
        let v = f4_x[xb + j];
        ss += v * v;
    }
    let r = 1.0 / sqrt(sum4(ss) / f32(p.s1) + p.f0);
    let yb = p.o1 / 4u + row * c4;
    let wb = p.o4 / 4u;
    for (var j = 0u; j < c4; j++) {
        f4_y[yb + j] = (f4_x[xb + j] * r) * (f4_w[wb + j] + vec4<f32>(p.f1));
    }
    f_rstd[p.o2 + row] = r;
}

@group(0) @binding(1) var<storage, read_write> b4_dx: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> b4_dy: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> b4_x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> b4_w: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn rmsnorm_backward_row4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = row_index(gid, nwg);
    if (row >= p.s0) { return; }
    let c4 = p.s1 / 4u;
    let r = b_rstd[p.o5 + row];
    let xb = p.o3 / 4u + row * c4;
    let db = p.o2 / 4u + row * c4;
    let wb = p.o4 / 4u;
    var dot = vec4<f32>(0.0);
    for (var j = 0u; j < c4; j++) {
        dot += (b4_dy[db + j] * (b4_w[wb + j] + vec4<f32>(p.f1))) * b4_x[xb + j];
    }
    let k = sum4(dot) * r / f32(p.s1);
    let ob = p.o1 / 4u + row * c4;
    for (var j = 0u; j < c4; j++) {
        let xhat = b4_x[xb + j] * r;
        var v = r * (b4_dy[db + j] * (b4_w[wb + j] + vec4<f32>(p.f1)) - xhat * k);
        if (p.s5 != 0u) { v += b4_dx[ob + j]; }
        b4_dx[ob + j] = v;
    }
}

// ---- dweight pass 1, cheap form: 1 partials (blocks, C) out, 2 dy (N, C), 3 x (N, C), 4 rstd (N,) ----
// One invocation per (row block, 4 consecutive columns), flat index = blk * ceil(C / 4) + quad,
// summing s2 rows: four columns per rstd load and per loop trip. Scalar loads (any C, any offset).
@compute @workgroup_size(WG)
fn rmsnorm_backward_partial4(@builtin(global_invocation_id) gid: vec3<u32>,
                             @builtin(num_workgroups) nwg: vec3<u32>) {
    let c = p.s1;
    let nq = (c + 3u) / 4u;
    let idx = row_index(gid, nwg);
    if (idx >= nq * p.s3) { return; }
    let blk = idx / nq;
    let col = (idx - blk * nq) * 4u;
    let r0 = blk * p.s2;
    let r1 = min(p.s0, r0 + p.s2);
    var s = vec4<f32>(0.0);
    if (col + 4u <= c) {
        for (var r = r0; r < r1; r++) {
            let b = r * c + col;
            let g = vec4<f32>(w_dy_ld2(p.o2 + b), w_dy_ld2(p.o2 + b + 2u));
            let x = vec4<f32>(w_x_ld2(p.o3 + b), w_x_ld2(p.o3 + b + 2u));
            s += g * (x * w_rstd[p.o4 + r]);
        }
    } else {
        for (var r = r0; r < r1; r++) {
            let rs = w_rstd[p.o4 + r];
            for (var k = 0u; col + k < c; k++) {
                let b = r * c + col + k;
                s[k] += w_dy_ld(p.o2 + b) * (w_x_ld(p.o3 + b) * rs);
            }
        }
    }
    let ob = p.o1 + blk * c + col;
    for (var k = 0u; k < 4u && col + k < c; k++) {
        w_part[ob + k] = s[k];
    }
}

// The same with vec4 loads of dy and x (float32, C % 4 == 0, offsets o2, o3 multiples of 4).
@group(0) @binding(2) var<storage, read> w4_dy: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> w4_x: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn rmsnorm_backward_partial4v(@builtin(global_invocation_id) gid: vec3<u32>,
                              @builtin(num_workgroups) nwg: vec3<u32>) {
    let c = p.s1;
    let nq = c / 4u;
    let idx = row_index(gid, nwg);
    if (idx >= nq * p.s3) { return; }
    let blk = idx / nq;
    let q = idx - blk * nq;
    let r0 = blk * p.s2;
    let r1 = min(p.s0, r0 + p.s2);
    var s = vec4<f32>(0.0);
    for (var r = r0; r < r1; r++) {
        let b = r * nq + q;
        s += w4_dy[p.o2 / 4u + b] * (w4_x[p.o3 / 4u + b] * w_rstd[p.o4 + r]);
    }
    let ob = p.o1 + blk * c + q * 4u;
    w_part[ob] = s.x;
    w_part[ob + 1u] = s.y;
    w_part[ob + 2u] = s.z;
    w_part[ob + 3u] = s.w;
}

// ---- layernorm forward (the vision tower's, frozen: no statistics kept): 1 y (N, C) out, 2 x (N, C), 3 weight
// (C,), 4 bias (C,), all float32; y = (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(mean((x - mean)^2) + eps),
// the variance over the centred row (two passes, as the NumPy tower). Uniform: s0 = N, s1 = C, f0 = eps.
// layernorm_forward_row: one invocation per row (the rmsnorm row threshold decides, as for rmsnorm);
// layernorm_forward: one workgroup per row.
@group(0) @binding(1) var<storage, read_write> l_y: array<f32>;
@group(0) @binding(2) var<storage, read> l_x: array<f32>;
@group(0) @binding(3) var<storage, read> l_w: array<f32>;
@group(0) @binding(4) var<storage, read> l_b: array<f32>;

@compute @workgroup_size(WG)
fn layernorm_forward_row(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = row_index(gid, nwg);
    if (row >= p.s0) { return; }
    let c = p.s1;
    let xb = p.o2 + row * c;
    var s = 0.0;
    for (var j = 0u; j < c; j++) {
        s += l_x[xb + j];
    }
    let mu = s / f32(c);
    var ss = 0.0;
    for (var j = 0u; j < c; j++) {
        let d = l_x[xb + j] - mu;
        ss += d * d;
    }
    let r = 1.0 / sqrt(ss / f32(c) + p.f0);
    let yb = p.o1 + row * c;
    for (var j = 0u; j < c; j++) {
        l_y[yb + j] = (l_x[xb + j] - mu) * r * l_w[p.o3 + j] + l_b[p.o4 + j];
    }
}

@compute @workgroup_size(WG)
fn layernorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_id) lid3: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.s0) { return; }
    let lid = lid3.x;
    let c = p.s1;
    let xb = p.o2 + row * c;
    var s = 0.0;
    for (var j = lid; j < c; j += WG) {
        s += l_x[xb + j];
    }
    let mu = wg_sum(s, lid) / f32(c);
    var ss = 0.0;
    for (var j = lid; j < c; j += WG) {
        let d = l_x[xb + j] - mu;
        ss += d * d;
    }
    let r = 1.0 / sqrt(wg_sum(ss, lid) / f32(c) + p.f0);
    let yb = p.o1 + row * c;
    for (var j = lid; j < c; j += WG) {
        l_y[yb + j] = (l_x[xb + j] - mu) * r * l_w[p.o3 + j] + l_b[p.o4 + j];
    }
}

// ---- layernorm backward dx (frozen weight and bias: LoRA on the tower's linears trains): 1 dx (N, C) out, 2 dy
// (N, C), 3 x (N, C), 4 weight (C,), all float32; the row's mean and rstd recomputed from x as the forward has them;
// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy weight; s2 = 1 adds it into dx. One invocation per row.
@group(0) @binding(1) var<storage, read_write> lb_dx: array<f32>;
@group(0) @binding(2) var<storage, read> lb_dy: array<f32>;
@group(0) @binding(3) var<storage, read> lb_x: array<f32>;
@group(0) @binding(4) var<storage, read> lb_w: array<f32>;

@compute @workgroup_size(WG)
fn layernorm_backward_row(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = row_index(gid, nwg);
    if (row >= p.s0) { return; }
    let c = p.s1;
    let xb = p.o3 + row * c;
    let db = p.o2 + row * c;
    var s = 0.0;
    for (var j = 0u; j < c; j++) {
        s += lb_x[xb + j];
    }
    let mu = s / f32(c);
    var ss = 0.0;
    for (var j = 0u; j < c; j++) {
        let d = lb_x[xb + j] - mu;
        ss += d * d;
    }
    let r = 1.0 / sqrt(ss / f32(c) + p.f0);
    var mg = 0.0;
    var mgx = 0.0;
    for (var j = 0u; j < c; j++) {
        let g = lb_dy[db + j] * lb_w[p.o4 + j];
        mg += g;
        mgx += g * ((lb_x[xb + j] - mu) * r);
    }
    mg = mg / f32(c);
    mgx = mgx / f32(c);
    let ob = p.o1 + row * c;
    for (var j = 0u; j < c; j++) {
        let g = lb_dy[db + j] * lb_w[p.o4 + j];
        var v = r * (g - mg - ((lb_x[xb + j] - mu) * r) * mgx);
        if (p.s2 != 0u) { v += lb_dx[ob + j]; }
        lb_dx[ob + j] = v;
    }
}
