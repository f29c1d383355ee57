// The small op pairs of a Gated DeltaNet layer around the delta rule (the mirror of engines/shared/gated_deltanet.py):
// SiLU after the conv1d, the decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), and the gated RMSNorm
// y = rmsnorm(x) weight silu(z) over each value head's row. Activations and their gradients in any storage format
// (device/storage.py; the elementwise kernels take an invocation per pair of elements, the per-row ones need an even
// row width for 16-bit outputs); the weights' gradients float32, added to. Arithmetic float32.
// Uniform: n = elements (silu), tokens N (decay), rows (gated rmsnorm); h = value heads Hv (decay); d = row width
// D (gated rmsnorm); r0..r1 = the rows one pass of a weight gradient sums (llvmpipe's loop budget); eps.

struct Params {
    n: u32, h: u32, d: u32, r0: u32, r1: u32, eps: f32,
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32, o8: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 64u;

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid.x;
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// log(1 + exp(x)) without overflow
fn softplus(x: f32) -> f32 {
    return max(x, 0.0) + log(1.0 + exp(-abs(x)));
}

fn silu_grad(dy: f32, x: f32) -> f32 {
    let s = sigmoid(x);
    return dy * s * (1.0 + x * (1.0 - s));
}

// ---- silu: 1 y! (n), 2 x (n); backward 1 dx!, 2 dy, 3 x. An invocation per pair of elements. ----
// @tensor 1 s_y read_write
// @tensor 2 s_x read
// @tensor 3 s_z read

@compute @workgroup_size(WG)
fn silu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = 2u * flat(wid, nwg, lid);
    if (i >= p.n) { return; }
    if (i + 1u < p.n) {
        let x = s_x_ld2(p.o2 + i);
        s_y_st2(p.o1 + i, x * vec2<f32>(sigmoid(x.x), sigmoid(x.y)));
    } else {
        let x = s_x_ld(p.o2 + i);
        s_y_st(p.o1 + i, x * sigmoid(x));
    }
}

@compute @workgroup_size(WG)
fn silu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = 2u * flat(wid, nwg, lid);
    if (i >= p.n) { return; }
    if (i + 1u < p.n) {
        let dy = s_x_ld2(p.o2 + i);
        let x = s_z_ld2(p.o3 + i);
        s_y_st2(p.o1 + i, vec2<f32>(silu_grad(dy.x, x.x), silu_grad(dy.y, x.y)));
    } else {
        s_y_st(p.o1 + i, silu_grad(s_x_ld(p.o2 + i), s_z_ld(p.o3 + i)));
    }
}

// ---- decay: 1 g! (N, Hv), 2 beta! (N, Hv), 3 a (N, Hv), 4 b (N, Hv), 5 A_log (Hv,), 6 dt_bias (Hv,). An invocation
// per pair of elements. ----
// @tensor 1 d_g read_write
// @tensor 2 d_beta read_write
// @tensor 3 d_a read
// @tensor 4 d_b read
// @tensor 5 d_alog read
// @tensor 6 d_dtb read

fn decay_g(i: u32, a: f32) -> f32 {
    let h = i % p.h;
    return -exp(d_alog_ld(p.o5 + h)) * softplus(a + d_dtb_ld(p.o6 + h));
}

@compute @workgroup_size(WG)
fn decay_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = 2u * flat(wid, nwg, lid);
    let n = p.n * p.h;
    if (i >= n) { return; }
    if (i + 1u < n) {
        let a = d_a_ld2(p.o3 + i);
        let b = d_b_ld2(p.o4 + i);
        d_g_st2(p.o1 + i, vec2<f32>(decay_g(i, a.x), decay_g(i + 1u, a.y)));
        d_beta_st2(p.o2 + i, vec2<f32>(sigmoid(b.x), sigmoid(b.y)));
    } else {
        d_g_st(p.o1 + i, decay_g(i, d_a_ld(p.o3 + i)));
        d_beta_st(p.o2 + i, sigmoid(d_b_ld(p.o4 + i)));
    }
}

// ---- decay backward: 1 da! (N, Hv), 2 db! (N, Hv), 3 dg, 4 dbeta, 5 a, 6 b, 7 A_log, 8 dt_bias. An invocation per
// pair. da = -exp(A_log) sigmoid(a + dt_bias) dg, db = dbeta beta (1 - beta). ----
// @tensor 1 e_da read_write
// @tensor 2 e_db read_write
// @tensor 3 e_dg read
// @tensor 4 e_dbeta read
// @tensor 5 e_a read
// @tensor 6 e_b read
// @tensor 7 e_alog read
// @tensor 8 e_dtb read

fn decay_da(i: u32, dg: f32, a: f32) -> f32 {
    let h = i % p.h;
    return -exp(e_alog_ld(p.o7 + h)) * sigmoid(a + e_dtb_ld(p.o8 + h)) * dg;
}

fn decay_db(dbeta: f32, b: f32) -> f32 {
    let s = sigmoid(b);
    return dbeta * s * (1.0 - s);
}

@compute @workgroup_size(WG)
fn decay_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = 2u * flat(wid, nwg, lid);
    let n = p.n * p.h;
    if (i >= n) { return; }
    if (i + 1u < n) {
        let dg = e_dg_ld2(p.o3 + i);
        let dbeta = e_dbeta_ld2(p.o4 + i);
        let a = e_a_ld2(p.o5 + i);
        let b = e_b_ld2(p.o6 + i);
        e_da_st2(p.o1 + i, vec2<f32>(decay_da(i, dg.x, a.x), decay_da(i + 1u, dg.y, a.y)));
        e_db_st2(p.o2 + i, vec2<f32>(decay_db(dbeta.x, b.x), decay_db(dbeta.y, b.y)));
    } else {
        e_da_st(p.o1 + i, decay_da(i, e_dg_ld(p.o3 + i), e_a_ld(p.o5 + i)));
        e_db_st(p.o2 + i, decay_db(e_dbeta_ld(p.o4 + i), e_b_ld(p.o6 + i)));
    }
}

// ---- decay's weight gradients, added to: 1 dA_log! (Hv,) f32, 2 ddt_bias! (Hv,) f32, 3 dg (N, Hv), 4 a, 5 A_log,
// 6 dt_bias. An invocation per head, summing tokens r0..r1 in order. ----
@group(0) @binding(1) var<storage, read_write> w_dalog: array<f32>;
@group(0) @binding(2) var<storage, read_write> w_ddtb: array<f32>;
// @tensor 3 w_dg read
// @tensor 4 w_a read
// @tensor 5 w_alog read
// @tensor 6 w_dtb read

@compute @workgroup_size(WG)
fn decay_weight_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    let h = flat(wid, nwg, lid);
    if (h >= p.h) { return; }
    let ea = exp(w_alog_ld(p.o5 + h));
    let dtb = w_dtb_ld(p.o6 + h);
    var sa = 0.0;
    var sb = 0.0;
    for (var t = p.r0; t < p.r1; t = t + 1u) {
        let x = w_a_ld(p.o4 + t * p.h + h) + dtb;
        let dg = w_dg_ld(p.o3 + t * p.h + h);
        sa = sa - dg * ea * softplus(x);
        sb = sb - dg * ea * sigmoid(x);
    }
    w_dalog[p.o1 + h] = w_dalog[p.o1 + h] + sa;
    w_ddtb[p.o2 + h] = w_ddtb[p.o2 + h] + sb;
}

// ---- gated rmsnorm: 1 y! (rows, D), 2 x, 3 z (rows, D), 4 weight (D,). An invocation per row. ----
// @tensor 1 n_y read_write
// @tensor 2 n_x read
// @tensor 3 n_z read
// @tensor 4 n_w read

fn rstd_of(row: u32) -> f32 {
    var ss = 0.0;
    for (var j = 0u; j < p.d; j = j + 1u) {
        let x = n_x_ld(p.o2 + row * p.d + j);
        ss = fma(x, x, ss);
    }
    return 1.0 / sqrt(ss / f32(p.d) + p.eps);
}

@compute @workgroup_size(WG)
fn gated_rmsnorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = flat(wid, nwg, lid);
    if (row >= p.n) { return; }
    let r = rstd_of(row);
    for (var j = 0u; j < p.d; j = j + 1u) {
        let i = row * p.d + j;
        let z = n_z_ld(p.o3 + i);
        n_y_st(p.o1 + i, n_x_ld(p.o2 + i) * r * n_w_ld(p.o4 + j) * z * sigmoid(z));
    }
}

// ---- gated rmsnorm backward: 1 dx! (rows, D), 2 dz!, 3 dy, 4 x, 5 z, 6 weight. An invocation per row:
// dz = silu'(z) dy xhat w, dx = rstd (dxhat - xhat mean(dxhat xhat)), dxhat = dy silu(z) w. ----
// @tensor 1 m_dx read_write
// @tensor 2 m_dz read_write
// @tensor 3 m_dy read
// @tensor 4 m_x read
// @tensor 5 m_z read
// @tensor 6 m_w read

@compute @workgroup_size(WG)
fn gated_rmsnorm_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = flat(wid, nwg, lid);
    if (row >= p.n) { return; }
    let base = row * p.d;
    var ss = 0.0;
    for (var j = 0u; j < p.d; j = j + 1u) {
        let x = m_x_ld(p.o4 + base + j);
        ss = fma(x, x, ss);
    }
    let r = 1.0 / sqrt(ss / f32(p.d) + p.eps);
    var dot = 0.0;
    for (var j = 0u; j < p.d; j = j + 1u) {
        let z = m_z_ld(p.o5 + base + j);
        let dxhat = m_dy_ld(p.o3 + base + j) * z * sigmoid(z) * m_w_ld(p.o6 + j);
        dot = fma(dxhat, m_x_ld(p.o4 + base + j) * r, dot);
    }
    let mean = dot / f32(p.d);
    for (var j = 0u; j < p.d; j = j + 1u) {
        let i = base + j;
        let z = m_z_ld(p.o5 + i);
        let w = m_w_ld(p.o6 + j);
        let dy = m_dy_ld(p.o3 + i);
        let xhat = m_x_ld(p.o4 + i) * r;
        m_dz_st(p.o2 + i, silu_grad(dy * xhat * w, z));
        m_dx_st(p.o1 + i, r * (dy * z * sigmoid(z) * w - xhat * mean));
    }
}

// ---- gated rmsnorm's weight gradient, added to: 1 dweight! (D,) f32, 2 dy, 3 x, 4 z (rows, D). An invocation per
// column, summing rows r0..r1 in order (each row's rstd recomputed: D + 1 loads a row). ----
@group(0) @binding(1) var<storage, read_write> v_dw: array<f32>;
// @tensor 2 v_dy read
// @tensor 3 v_x read
// @tensor 4 v_z read

@compute @workgroup_size(WG)
fn gated_rmsnorm_weight_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let col = flat(wid, nwg, lid);
    if (col >= p.d) { return; }
    var acc = 0.0;
    for (var row = p.r0; row < p.r1; row = row + 1u) {
        var ss = 0.0;
        for (var j = 0u; j < p.d; j = j + 1u) {
            let x = v_x_ld(p.o3 + row * p.d + j);
            ss = fma(x, x, ss);
        }
        let i = row * p.d + col;
        let z = v_z_ld(p.o4 + i);
        acc = acc + v_dy_ld(p.o2 + i) * z * sigmoid(z) * v_x_ld(p.o3 + i) / sqrt(ss / f32(p.d) + p.eps);
    }
    v_dw[p.o1 + col] = v_dw[p.o1 + col] + acc;
}
