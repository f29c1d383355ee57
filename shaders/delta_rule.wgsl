// The chunked gated delta rule (Gated DeltaNet), forward and backward, its single-token step and the q / k
// l2norm: the mirror of engines/shared/delta_rule.py, whose docstring derives every formula used here (the UT form
// inside a chunk, the scan of the state over chunks, the hand-derived backward). The source builder
// (tuned/delta_rule_source.py) prepends C (chunk), DK, DV, KS (invocations sharing one state column), CB (state
// columns per scan workgroup) and DKS = ceil(DK / KS).
//
// Layouts: q, k (B, T, Hk, DK); v, out, dout (B, T, Hv, DV); g, beta (B, T, Hv); a state (DK, DV) per (row, value
// head); states (B, Hv, N, DK, DV): the state entering each chunk. Value head h reads key head h / rep. A dispatch
// may cover a range of whole key-head groups (the wrappers' passes over heads bind every tensor at its first head):
// p.hk and p.hv count the heads it covers, p.hks and p.hvs are the (B, T, H, D) tensors' head strides. bh is
// b * Hv + h; "position" t is chunk c's row i: t = c C + i, positions T..N C - 1 are the last chunk's padding.
// Every chunk-local quantity lives in one float32 scratch binding (sc), in regions whose element offsets are the
// r_* fields; the wrappers size them (delta_rule_kernels.scratch_layout). No float atomics: every sum runs in a
// fixed order. Loops are bounded by the C / DK / DV constants or by Params, so the wrappers can count llvmpipe's
// loop iterations (a scan dispatch covers chunks c0..c1 only).

struct Params {
    b: u32, t: u32, hk: u32, hv: u32, n: u32, rep: u32, flags: u32, c0: u32,
    c1: u32, t0: u32, t1: u32, r_fl: u32, r_gt: u32, r_r0: u32, r_r1: u32, r_r2: u32,
    r_r3: u32, r_wv: u32, r_wk: u32, r_u: u32, r_du: u32, r_ds: u32, r_p3: u32, r_dq: u32,
    r_dk: u32, r_dg: u32, r_al: u32, scale: f32, eps: f32, hks: u32, hvs: u32,
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32, o8: u32, o9: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> sc: array<f32>;
@group(0) @binding(2) var<storage, read_write> w2: array<f32>;
@group(0) @binding(3) var<storage, read_write> w3: array<f32>;
// @tensor 4 t4 read
// @tensor 5 t5 read
// @tensor 6 t6 read
// @tensor 7 t7 read
// @tensor 8 t8 read
@group(0) @binding(9) var<storage, read> seg: array<i32>;

const WG: u32 = 64u;
const HAS_SEG: u32 = 1u;
const HAS_INIT: u32 = 2u;

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid.x;
}

// ---- addressing ------------------------------------------------------------------------------------------------
// Loops index rows from these bases (no integer division inside a loop: llvmpipe scalarises it per lane). A chunk's
// padded tail reads the last real position's row (clamped): every term it enters is masked by a zero decay, beta
// or a, so only finite values matter there.
fn tk(c: u32, i: u32) -> u32 {                             // chunk c's row i as a position of the sequence
    return min(c * C + i, p.t - 1u);
}
fn qk_at(b: u32, t: u32, kh: u32) -> u32 {                 // row base of q / k (B, T, Hk, DK), key head kh
    return ((b * p.t + t) * p.hks + kh) * DK;
}
fn v_at(b: u32, t: u32, h: u32, j: u32) -> u32 {           // v / out / dout (B, T, Hv, DV)
    return ((b * p.t + t) * p.hvs + h) * DV + j;
}
fn gb_at(b: u32, t: u32, h: u32) -> u32 {                  // g / beta (B, T, Hv)
    return (b * p.t + t) * p.hvs + h;
}
fn st_at(bh: u32, c: u32, d: u32, j: u32) -> u32 {         // states (B, Hv, N, DK, DV)
    return ((bh * p.n + c) * DK + d) * DV + j;
}
fn cc_at(bh: u32, c: u32, i: u32, j: u32) -> u32 {         // a (C, C) region entry, per (bh, chunk)
    return ((bh * p.n + c) * C + i) * C + j;
}
fn pos(bh: u32, c: u32, i: u32) -> u32 {                   // (bh, position) in the (B, Hv, N C, ...) regions
    return bh * p.n * C + c * C + i;
}

// ---- a chunk's decays, from the gamma region: (gamma, tag, masked beta) per position, tag = 2 run + real, where run
// counts the starts of new segment runs inside the chunk up to the position -----------------------------------------
fn gamma_of(bh: u32, c: u32, i: u32) -> f32 { return sc[p.r_gt + 3u * pos(bh, c, i)]; }
fn tag_of(bh: u32, c: u32, i: u32) -> u32 { return bitcast<u32>(sc[p.r_gt + 3u * pos(bh, c, i) + 1u]); }
fn beta_of(bh: u32, c: u32, i: u32) -> f32 { return sc[p.r_gt + 3u * pos(bh, c, i) + 2u]; }

// a_i: the decay from the chunk's start, 0 unless i is real and in the run the state entered with
fn a_of(bh: u32, c: u32, i: u32) -> f32 {
    return select(0.0, exp(gamma_of(bh, c, i)), tag_of(bh, c, i) == 1u);
}
// e_i: the decay to the chunk's end, 0 unless i is real and in the run the state leaves with
fn e_of(bh: u32, c: u32, i: u32) -> f32 {
    let tag = tag_of(bh, c, i);
    let last = tag_of(bh, c, C - 1u) >> 1u;
    return select(0.0, exp(gamma_of(bh, c, C - 1u) - gamma_of(bh, c, i)), (tag & 1u) == 1u && (tag >> 1u) == last);
}
// a_C: the whole chunk's decay, 0 when a run starts inside it
fn a_last_of(bh: u32, c: u32) -> f32 {
    return select(0.0, exp(gamma_of(bh, c, C - 1u)), (tag_of(bh, c, C - 1u) >> 1u) == 0u);
}
// E[i, j] for j <= i in one run (both real), else 0
fn decay_of(bh: u32, c: u32, i: u32, j: u32) -> f32 {
    let ti = tag_of(bh, c, i);
    return select(0.0, exp(gamma_of(bh, c, i) - gamma_of(bh, c, j)), j <= i && (ti & 1u) == 1u && ti == tag_of(bh, c, j));
}
fn k_row(b: u32, c: u32, kh: u32, i: u32) -> u32 {       // element 0 of k at chunk c's row i, in t5
    return p.o5 + qk_at(b, tk(c, i), kh);
}
fn q_row(b: u32, c: u32, kh: u32, i: u32) -> u32 {       // element 0 of q at chunk c's row i, in t4 (unscaled)
    return p.o4 + qk_at(b, tk(c, i), kh);
}

// ---- runs: sc! (flags (B, N C) u32 at r_fl: bit 0 real, bit 1 starts a run; then B u32 carries), seg (B, T) i32 --
// One invocation per row over positions t0..t1 (a pass; the carry holds the last real id before t0, 0 for none).
@compute @workgroup_size(WG)
fn dr_runs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = flat(wid, nwg, lid);
    if (b >= p.b) { return; }
    let carry = p.r_fl + p.b * p.n * C + b;
    var last = select(0, bitcast<i32>(sc[carry]), p.t0 > 0u);
    for (var t = p.t0; t < p.t1; t = t + 1u) {
        var flag = 0u;
        if (t < p.t) {
            var id = 1;
            if ((p.flags & HAS_SEG) != 0u) { id = seg[p.o9 + b * p.t + t]; }
            if (id != 0) {
                flag = select(1u, 3u, last != 0 && id != last);
                last = id;
            }
        }
        sc[p.r_fl + b * p.n * C + t] = bitcast<f32>(flag);
    }
    sc[carry] = bitcast<f32>(last);
}

// ---- gamma: sc! (the gamma region at r_gt), g (t7), beta (t8). One invocation per (bh, chunk). -----------------
@compute @workgroup_size(WG)
fn dr_gamma(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * p.n) { return; }
    let c = idx % p.n;
    let bh = idx / p.n;
    let b = bh / p.hv;
    let h = bh % p.hv;
    var gamma = 0.0;
    var run = 0u;
    for (var i = 0u; i < C; i = i + 1u) {
        let t = c * C + i;
        let flag = bitcast<u32>(sc[p.r_fl + b * p.n * C + t]);
        let real = flag & 1u;
        run = run + (flag >> 1u);
        var beta = 0.0;
        if (real == 1u) {
            gamma = gamma + t7_ld(p.o7 + gb_at(b, t, h));
            beta = t8_ld(p.o8 + gb_at(b, t, h));
        }
        let at = p.r_gt + 3u * pos(bh, c, i);
        sc[at] = gamma;
        sc[at + 1u] = bitcast<f32>(2u * run + real);
        sc[at + 2u] = beta;
    }
}

// ---- gram: sc! (L = strictly lower (diag(beta) K K^T) o E at r_r0, (Q K^T) o E at r_r1), q (t4), k (t5). One
// invocation per (bh, chunk, i, j). -----------------------------------------------------------------------------
@compute @workgroup_size(WG)
fn dr_gram(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * p.n * C * C) { return; }
    let j = idx % C;
    let i = (idx / C) % C;
    let c = (idx / (C * C)) % p.n;
    let bh = idx / (C * C * p.n);
    let b = bh / p.hv;
    let h = bh % p.hv;
    let e = decay_of(bh, c, i, j);
    var kk = 0.0;
    var qk = 0.0;
    if (e != 0.0) {
        let kh = h / p.rep;
        let ki = k_row(b, c, kh, i);
        let kj = k_row(b, c, kh, j);
        let qi = q_row(b, c, kh, i);
        for (var d = 0u; d < DK; d = d + 1u) {
            let k_j = t5_ld(kj + d);
            kk = fma(t5_ld(ki + d), k_j, kk);
            qk = fma(t4_ld(qi + d), k_j, qk);
        }
        qk = qk * p.scale;
    }
    sc[p.r_r0 + cc_at(bh, c, i, j)] = select(0.0, beta_of(bh, c, i) * kk * e, j < i);
    sc[p.r_r1 + cc_at(bh, c, i, j)] = qk * e;
}

// ---- solve: sc! (W_v (N C, DV) at r_wv, W_k (N C, DK) at r_wk, per bh), k (t5), v (t6). One invocation per (bh,
// chunk, column of [V | K]): (I + L) X = diag(beta) V, or diag(beta a) K, by forward substitution. ------------------
@compute @workgroup_size(WG)
fn dr_solve(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * p.n * (DV + DK)) { return; }
    let col = idx % (DV + DK);
    let c = (idx / (DV + DK)) % p.n;
    let bh = idx / ((DV + DK) * p.n);
    let b = bh / p.hv;
    let h = bh % p.hv;
    let is_v = col < DV;
    let d = col - select(DV, 0u, is_v);
    let width = select(DK, DV, is_v);
    let base = select(p.r_wk, p.r_wv, is_v);
    for (var i = 0u; i < C; i = i + 1u) {
        let t = c * C + i;
        var x = 0.0;
        if (is_v) {
            x = beta_of(bh, c, i) * t6_ld(p.o6 + v_at(b, tk(c, i), h, d));
        } else {
            x = beta_of(bh, c, i) * a_of(bh, c, i) * t5_ld(k_row(b, c, h / p.rep, i) + d);
        }
        let lrow = p.r_r0 + cc_at(bh, c, i, 0u);
        let xcol = base + pos(bh, c, 0u) * width + d;
        for (var j = 0u; j < i; j = j + 1u) {
            x = x - sc[lrow + j] * sc[xcol + j * width];
        }
        sc[base + pos(bh, c, i) * width + d] = x;
    }
}

// ---- the scans: a workgroup holds CB state columns of one (bh), each column spread over KS invocations (DKS rows
// each, in registers); with KS > 1 the column's dot products are reduced through workgroup memory. ---------------
var<workgroup> red: array<f32, KS * CB>;

// the sum over the KS invocations of a column of each one's part (every invocation gets it; barriers in uniform
// control flow: every invocation of the workgroup calls this)
fn column_sum(part: f32, ks: u32, col: u32) -> f32 {
    // @column_sum
}

// Forward scan: sc! (U (N C, DV) at r_u written), states! (w2), final_state! (w3), k (t5), initial_state (t7).
// Chunks c0..c1 of this dispatch: the state entering c0 is initial_state (or 0) when c0 = 0, else states[c0]
// (written by the dispatch before); the state leaving c1 - 1 goes to states[c1], or final_state after the last.
@compute @workgroup_size(KS * CB)
fn dr_scan(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let lid = lid3.x;
    let ks = lid / CB;
    let groups = (DV + CB - 1u) / CB;
    let bh = wid.x / groups;
    let j = (wid.x % groups) * CB + lid % CB;
    let b = bh / p.hv;
    let h = bh % p.hv;
    let live = j < DV;
    let jj = min(j, DV - 1u);
    let kh = h / p.rep;
    var s: array<f32, DKS>;
    var sn: array<f32, DKS>;
    for (var r = 0u; r < DKS; r = r + 1u) {
        let d = min(ks * DKS + r, DK - 1u);
        var v = 0.0;
        if (p.c0 > 0u) {
            v = w2[p.o2 + st_at(bh, p.c0, d, jj)];
        } else if ((p.flags & HAS_INIT) != 0u) {
            v = t7_ld(p.o7 + (bh * DK + d) * DV + jj);
        }
        s[r] = select(0.0, v, ks * DKS + r < DK);
    }
    for (var c = p.c0; c < p.c1; c = c + 1u) {
        let al = a_last_of(bh, c);
        for (var r = 0u; r < DKS; r = r + 1u) {
            let d = ks * DKS + r;
            if (live && d < DK) { w2[p.o2 + st_at(bh, c, d, j)] = s[r]; }
            sn[r] = al * s[r];
        }
        for (var i = 0u; i < C; i = i + 1u) {
            let row = pos(bh, c, i);
            var part = 0.0;
            for (var r = 0u; r < DKS; r = r + 1u) {
                part = fma(sc[p.r_wk + row * DK + min(ks * DKS + r, DK - 1u)], s[r], part);
            }
            let u = sc[p.r_wv + row * DV + jj] - column_sum(part, ks, lid % CB);
            if (live && ks == 0u) { sc[p.r_u + row * DV + j] = u; }
            let eu = e_of(bh, c, i) * u;
            let krow = k_row(b, c, kh, i);
            for (var r = 0u; r < DKS; r = r + 1u) {
                let d = ks * DKS + r;
                if (d < DK) { sn[r] = fma(t5_ld(krow + d), eu, sn[r]); }   // rows past DK stay 0
            }
        }
        for (var r = 0u; r < DKS; r = r + 1u) { s[r] = sn[r]; }
    }
    for (var r = 0u; r < DKS; r = r + 1u) {
        let d = ks * DKS + r;
        if (live && d < DK) {
            if (p.c1 < p.n) {
                w2[p.o2 + st_at(bh, p.c1, d, j)] = s[r];
            } else {
                w3[p.o3 + (bh * DK + d) * DV + j] = s[r];
            }
        }
    }
}

// ---- output: out! (w2), sc (U at r_u, (Q K^T) o E at r_r1), q (t4), states (t7). One invocation per (bh, position,
// column j): O = diag(a) Q S0 + ((Q K^T) o E) U. -------------------------------------------------------------------
@compute @workgroup_size(WG)
fn dr_output(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * p.t * DV) { return; }
    let j = idx % DV;
    let t = (idx / DV) % p.t;
    let bh = idx / (DV * p.t);
    let b = bh / p.hv;
    let h = bh % p.hv;
    let c = t / C;
    let i = t % C;
    var o = 0.0;
    let a = a_of(bh, c, i);
    if (a != 0.0) {
        let qi = q_row(b, c, h / p.rep, i);
        let s0 = p.o7 + st_at(bh, c, 0u, j);
        for (var d = 0u; d < DK; d = d + 1u) {
            o = fma(t4_ld(qi + d), t7_ld(s0 + d * DV), o);
        }
        o = o * a * p.scale;
    }
    let qrow = p.r_r1 + cc_at(bh, c, i, 0u);
    let ucol = p.r_u + pos(bh, c, 0u) * DV + j;
    for (var l = 0u; l <= i; l = l + 1u) {
        o = fma(sc[qrow + l], sc[ucol + l * DV], o);
    }
    w2[p.o2 + v_at(b, t, h, j)] = o;
}

// ---- backward: U = W_v - W_k S0 again, from the stored states. sc! (U at r_u), states (t7). One invocation per
// (bh, chunk position, column). -----------------------------------------------------------------------------------
@compute @workgroup_size(WG)
fn dr_u(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * p.n * C * DV) { return; }
    let j = idx % DV;
    let i = (idx / DV) % C;
    let c = (idx / (DV * C)) % p.n;
    let bh = idx / (DV * C * p.n);
    let row = pos(bh, c, i);
    var u = sc[p.r_wv + row * DV + j];
    let s0 = p.o7 + st_at(bh, c, 0u, j);
    for (var d = 0u; d < DK; d = d + 1u) {
        u = u - sc[p.r_wk + row * DK + d] * t7_ld(s0 + d * DV);
    }
    sc[p.r_u + row * DV + j] = u;
}

fn do_row(b: u32, c: u32, h: u32, i: u32) -> u32 {       // element 0 of dout at chunk c's row i, in t7
    return p.o7 + v_at(b, tk(c, i), h, 0u);
}

// ---- backward: dU's part that does not depend on the state's gradient, ((Q K^T) o E)^T dO. sc! (at r_du),
// dout (t7). One invocation per (bh, chunk position, column). --------------------------------------------------------
@compute @workgroup_size(WG)
fn dr_du0(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * p.n * C * DV) { return; }
    let j = idx % DV;
    let i = (idx / DV) % C;
    let c = (idx / (DV * C)) % p.n;
    let bh = idx / (DV * C * p.n);
    let b = bh / p.hv;
    let h = bh % p.hv;
    var du = 0.0;
    let qcol = p.r_r1 + cc_at(bh, c, 0u, i);
    let drow = do_row(b, c, h, 0u) + j;
    let stride = p.hvs * DV;
    let last = min(C, p.t - c * C);
    for (var l = i; l < last; l = l + 1u) {
        du = fma(sc[qcol + l * C], t7_ld(drow + l * stride), du);
    }
    sc[p.r_du + pos(bh, c, i) * DV + j] = du;
}

// Backward scan: sc! (dU completed in place at r_du; dS_C, the gradient of the state leaving each chunk, at r_ds
// (B, Hv, N, DK, DV)), d_initial_state! (w3), q (t4), k (t5), dout (t7). Chunks c1 - 1 down to c0: the gradient
// leaving c1 - 1 is 0 when c1 = N, else dS_C[c1 - 1] (written by the dispatch before); the one entering c0 goes to
// dS_C[c0 - 1], or d_initial_state when c0 = 0 (and an initial state was given).
@compute @workgroup_size(KS * CB)
fn dr_scan_back(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let lid = lid3.x;
    let ks = lid / CB;
    let groups = (DV + CB - 1u) / CB;
    let bh = wid.x / groups;
    let j = (wid.x % groups) * CB + lid % CB;
    let b = bh / p.hv;
    let h = bh % p.hv;
    let live = j < DV;
    let jj = min(j, DV - 1u);
    let kh = h / p.rep;
    var s: array<f32, DKS>;
    var sn: array<f32, DKS>;
    for (var r = 0u; r < DKS; r = r + 1u) {
        let d = min(ks * DKS + r, DK - 1u);
        var v = 0.0;
        if (p.c1 < p.n) { v = sc[p.r_ds + st_at(bh, p.c1 - 1u, d, jj)]; }
        s[r] = select(0.0, v, ks * DKS + r < DK);
    }
    for (var cc = p.c1; cc > p.c0; cc = cc - 1u) {
        let c = cc - 1u;
        let al = a_last_of(bh, c);
        for (var r = 0u; r < DKS; r = r + 1u) {
            let d = ks * DKS + r;
            if (live && d < DK) { sc[p.r_ds + st_at(bh, c, d, j)] = s[r]; }
            sn[r] = al * s[r];
        }
        for (var i = 0u; i < C; i = i + 1u) {
            let row = pos(bh, c, i);
            let krow = k_row(b, c, kh, i);
            var part = 0.0;
            for (var r = 0u; r < DKS; r = r + 1u) {
                part = fma(t5_ld(krow + min(ks * DKS + r, DK - 1u)), s[r], part);
            }
            part = part * e_of(bh, c, i);
            let du = sc[p.r_du + row * DV + jj] + column_sum(part, ks, lid % CB);
            if (live && ks == 0u) { sc[p.r_du + row * DV + j] = du; }
            let dq = a_of(bh, c, i) * p.scale * t7_ld(do_row(b, c, h, i) + jj);
            let qrow = q_row(b, c, kh, i);
            for (var r = 0u; r < DKS; r = r + 1u) {
                let d = ks * DKS + r;
                if (d < DK) { sn[r] = sn[r] + t4_ld(qrow + d) * dq - sc[p.r_wk + row * DK + d] * du; }
            }
        }
        for (var r = 0u; r < DKS; r = r + 1u) { s[r] = sn[r]; }
    }
    for (var r = 0u; r < DKS; r = r + 1u) {
        let d = ks * DKS + r;
        if (live && d < DK) {
            if (p.c0 > 0u) {
                sc[p.r_ds + st_at(bh, p.c0 - 1u, d, j)] = s[r];
            } else if ((p.flags & HAS_INIT) != 0u) {
                w3[p.o3 + (bh * DK + d) * DV + j] = s[r];
            }
        }
    }
}

// ---- backward: dR = (I + L)^-T dU by back substitution, in place at r_du. sc!. One invocation per (bh, chunk,
// column). ---------------------------------------------------------------------------------------------------------
@compute @workgroup_size(WG)
fn dr_solve_back(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * p.n * DV) { return; }
    let j = idx % DV;
    let c = (idx / DV) % p.n;
    let bh = idx / (DV * p.n);
    for (var ii = C; ii > 0u; ii = ii - 1u) {
        let i = ii - 1u;
        var x = sc[p.r_du + pos(bh, c, i) * DV + j];
        let lcol = p.r_r0 + cc_at(bh, c, 0u, i);
        let xcol = p.r_du + pos(bh, c, 0u) * DV + j;
        for (var l = i + 1u; l < C; l = l + 1u) {
            x = x - sc[lcol + l * C] * sc[xcol + l * DV];
        }
        sc[p.r_du + pos(bh, c, i) * DV + j] = x;
    }
}

// ---- backward: the (C, C) gradients, sc! (over L at r_r0: dL o E; over (Q K^T) o E at r_r1: d(Q K^T); at r_r2:
// dE o E; at r_r3: dL o K K^T o E, dbeta's first term), k (t5), dout (t7). One invocation per (bh, chunk, i, j). -
@compute @workgroup_size(WG)
fn dr_dgram(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * p.n * C * C) { return; }
    let j = idx % C;
    let i = (idx / C) % C;
    let c = (idx / (C * C)) % p.n;
    let bh = idx / (C * C * p.n);
    let b = bh / p.hv;
    let h = bh % p.hv;
    let e = decay_of(bh, c, i, j);
    var dl = 0.0;
    var db = 0.0;
    var kk = 0.0;
    if (e != 0.0) {
        let urow = p.r_u + pos(bh, c, j) * DV;
        let rrow = p.r_du + pos(bh, c, i) * DV;
        let drow = do_row(b, c, h, i);
        for (var v = 0u; v < DV; v = v + 1u) {
            let u = sc[urow + v];
            dl = fma(sc[rrow + v], u, dl);
            db = fma(t7_ld(drow + v), u, db);
        }
        let ki = k_row(b, c, h / p.rep, i);
        let kj = k_row(b, c, h / p.rep, j);
        for (var d = 0u; d < DK; d = d + 1u) {
            kk = fma(t5_ld(ki + d), t5_ld(kj + d), kk);
        }
    }
    dl = select(0.0, -dl, j < i);
    let at = cc_at(bh, c, i, j);
    let x = db * sc[p.r_r1 + at] + dl * sc[p.r_r0 + at];
    sc[p.r_r0 + at] = dl * e;
    sc[p.r_r1 + at] = db * e;
    sc[p.r_r2 + at] = x;
    sc[p.r_r3 + at] = dl * kk * e;
}

// ---- backward: per (bh, position, key dim d): the value head's dq (unscaled) at r_dq and dk at r_dk (B, Hv, N C,
// DK), and d(diag(a) Q), d(diag(beta a) K), d(diag(e) K) at r_p3 ((B, Hv, N C, 3, DK)), for the scalars of dtok; at
// a chunk's position 0 also sum_j S0[d, j] dS_C[d, j] at r_al ((B, Hv, N, DK)). sc!, q (t4), k (t5), dout (t7),
// states (t8). ------------------------------------------------------------------------------------------------------
@compute @workgroup_size(WG)
fn dr_dqk(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * p.n * C * DK) { return; }
    let d = idx % DK;
    let i = (idx / DK) % C;
    let c = (idx / (DK * C)) % p.n;
    let bh = idx / (DK * C * p.n);
    let b = bh / p.hv;
    let h = bh % p.hv;
    let row = pos(bh, c, i);
    var d_qa = 0.0;
    var d_kba = 0.0;
    var d_ke = 0.0;
    var al = 0.0;
    let srow = st_at(bh, c, d, 0u);
    let drow = do_row(b, c, h, i);
    for (var v = 0u; v < DV; v = v + 1u) {
        let s0 = t8_ld(p.o8 + srow + v);
        let ds = sc[p.r_ds + srow + v];
        d_qa = fma(t7_ld(drow + v), s0, d_qa);
        d_kba = d_kba - sc[p.r_du + row * DV + v] * s0;
        d_ke = fma(sc[p.r_u + row * DV + v], ds, d_ke);
        al = fma(s0, ds, al);
    }
    let a = a_of(bh, c, i);
    let beta = beta_of(bh, c, i);
    var dq = a * d_qa;
    var dk = d_ke * e_of(bh, c, i) + d_kba * beta * a;
    let kh = h / p.rep;
    let k0 = k_row(b, c, kh, 0u) + d;
    let q0 = q_row(b, c, kh, 0u) + d;
    let stride = p.hks * DK;
    let last = min(C, p.t - c * C);           // rows past T: zero (Q K^T) o E and L columns
    let row_i = cc_at(bh, c, i, 0u);
    let col_i = cc_at(bh, c, 0u, i);
    var dkq = 0.0;
    for (var l = 0u; l < last; l = l + 1u) {
        let kl = t5_ld(k0 + l * stride);
        dq = fma(sc[p.r_r1 + row_i + l], kl, dq);
        dkq = fma(sc[p.r_r1 + col_i + l * C], t4_ld(q0 + l * stride), dkq);
        dk = fma(beta * sc[p.r_r0 + row_i + l] + beta_of(bh, c, l) * sc[p.r_r0 + col_i + l * C], kl, dk);
    }
    dk = fma(dkq, p.scale, dk);
    sc[p.r_dq + row * DK + d] = dq;
    sc[p.r_dk + row * DK + d] = dk;
    sc[p.r_p3 + (row * 3u) * DK + d] = d_qa;
    sc[p.r_p3 + (row * 3u + 1u) * DK + d] = d_kba;
    sc[p.r_p3 + (row * 3u + 2u) * DK + d] = d_ke;
    if (i == 0u) { sc[p.r_al + (bh * p.n + c) * DK + d] = al; }
}

// ---- backward: per (bh, position): dv! (w2), dbeta! (w3), and at r_dg ((B, Hv, N C, 2)) the log-decay's gradient
// d gamma before the chunk's end terms, and de e. sc!, q (t4), k (t5), v (t6). ---------------------------------------
@compute @workgroup_size(WG)
fn dr_dtok(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * p.n * C) { return; }
    let i = idx % C;
    let c = (idx / C) % p.n;
    let bh = idx / (C * p.n);
    let b = bh / p.hv;
    let h = bh % p.hv;
    let row = pos(bh, c, i);
    let t = c * C + i;
    var da = 0.0;
    var s_kba = 0.0;
    var de = 0.0;
    let krow = k_row(b, c, h / p.rep, i);
    let qrow = q_row(b, c, h / p.rep, i);
    for (var d = 0u; d < DK; d = d + 1u) {
        let kd = t5_ld(krow + d);
        da = fma(sc[p.r_p3 + (row * 3u) * DK + d], p.scale * t4_ld(qrow + d), da);
        s_kba = fma(sc[p.r_p3 + (row * 3u + 1u) * DK + d], kd, s_kba);
        de = fma(sc[p.r_p3 + (row * 3u + 2u) * DK + d], kd, de);
    }
    var x = 0.0;
    var y = 0.0;
    let row_i = cc_at(bh, c, i, 0u);
    let col_i = cc_at(bh, c, 0u, i);
    for (var l = 0u; l < C; l = l + 1u) {
        x = x + sc[p.r_r2 + row_i + l] - sc[p.r_r2 + col_i + l * C];
        y = y + sc[p.r_r3 + row_i + l];
    }
    let beta = beta_of(bh, c, i);
    let a = a_of(bh, c, i);
    let e = e_of(bh, c, i);
    var rv = 0.0;
    if (t < p.t) {
        let vrow = v_at(b, t, h, 0u);
        for (var v = 0u; v < DV; v = v + 1u) {
            let dr = sc[p.r_du + row * DV + v];
            rv = fma(dr, t6_ld(p.o6 + vrow + v), rv);
            w2[p.o2 + vrow + v] = dr * beta;
        }
    }
    if (t < p.t) { w3[p.o3 + gb_at(b, t, h)] = y + rv + s_kba * a; }
    da = da + s_kba * beta;
    sc[p.r_dg + 2u * row] = da * a + x - de * e;
    sc[p.r_dg + 2u * row + 1u] = de * e;
}

// ---- backward: dg! (w2): per (bh, chunk), d gamma's chunk-end terms, then its reverse cumulative sum (gamma is
// the chunk-local cumulative sum of g), 0 on padding. sc!. -----------------------------------------------------------
@compute @workgroup_size(WG)
fn dr_dg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * p.n) { return; }
    let c = idx % p.n;
    let bh = idx / p.n;
    let b = bh / p.hv;
    let h = bh % p.hv;
    var d_a_last = 0.0;
    for (var d = 0u; d < DK; d = d + 1u) { d_a_last = d_a_last + sc[p.r_al + (bh * p.n + c) * DK + d]; }
    var end = d_a_last * a_last_of(bh, c);
    for (var i = 0u; i < C; i = i + 1u) { end = end + sc[p.r_dg + 2u * pos(bh, c, i) + 1u]; }
    var acc = end;
    for (var ii = C; ii > 0u; ii = ii - 1u) {
        let i = ii - 1u;
        acc = acc + sc[p.r_dg + 2u * pos(bh, c, i)];
        let t = c * C + i;
        if (t < p.t) { w2[p.o2 + gb_at(b, t, h)] = select(0.0, acc, (tag_of(bh, c, i) & 1u) == 1u); }
    }
}

// ---- backward: dq! (w2), dk! (w3) (B, T, Hk, DK): a key head's gradients, the sum over its group of value heads in
// order (dq scaled by 1 / sqrt(DK)). sc. One invocation per (b, t, key head, d). ------------------------------------
@compute @workgroup_size(WG)
fn dr_group(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.t * p.hk * DK) { return; }
    let d = idx % DK;
    let hk = (idx / DK) % p.hk;
    let t = (idx / (DK * p.hk)) % p.t;
    let b = idx / (DK * p.hk * p.t);
    var dq = 0.0;
    var dk = 0.0;
    for (var r = 0u; r < p.rep; r = r + 1u) {
        let row = (b * p.hv + hk * p.rep + r) * p.n * C + t;
        dq = dq + sc[p.r_dq + row * DK + d];
        dk = dk + sc[p.r_dk + row * DK + d];
    }
    let at = qk_at(b, t, hk) + d;
    w2[p.o2 + at] = dq * p.scale;
    w3[p.o3 + at] = dk;
}

// ---- step: out! (w2) (B, Hv, DV), state! (w3) (B, Hv, DK, DV) in place, q (t4), k (t5) (B, Hk, DK), v (t6), g
// (t7), beta (t8) (B, Hv). One token per row: one invocation per (b, h, column j). ----------------------------------
@compute @workgroup_size(WG)
fn dr_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.b * p.hv * DV) { return; }
    let j = idx % DV;
    let bh = idx / DV;
    let h = bh % p.hv;
    let kb = ((bh / p.hv) * p.hk + h / p.rep) * DK;
    let alpha = exp(t7_ld(p.o7 + bh));
    var kv = 0.0;
    for (var d = 0u; d < DK; d = d + 1u) {
        kv = fma(alpha * w3[p.o3 + (bh * DK + d) * DV + j], t5_ld(p.o5 + kb + d), kv);
    }
    let delta = t8_ld(p.o8 + bh) * (t6_ld(p.o6 + bh * DV + j) - kv);
    var o = 0.0;
    for (var d = 0u; d < DK; d = d + 1u) {
        let at = p.o3 + (bh * DK + d) * DV + j;
        let s = fma(t5_ld(p.o5 + kb + d), delta, alpha * w3[at]);
        w3[at] = s;
        o = fma(s, t4_ld(p.o4 + kb + d), o);
    }
    w2[p.o2 + bh * DV + j] = o * p.scale;
}

// ---- l2norm: y! (w2), inv_norm! (w3) (N,) from x (t4) (N, DK), one invocation per vector; and its backward dx! (w2)
// from dy (t4), y (t5), inv_norm (t6). DK is the vector's length here. --------------------------------------------
@compute @workgroup_size(WG)
fn l2norm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let n = flat(wid, nwg, lid);
    if (n >= p.b) { return; }
    var ss = 0.0;
    for (var d = 0u; d < DK; d = d + 1u) {
        let x = t4_ld(p.o4 + n * DK + d);
        ss = fma(x, x, ss);
    }
    let r = 1.0 / sqrt(ss + p.eps);
    for (var d = 0u; d < DK; d = d + 1u) { w2[p.o2 + n * DK + d] = t4_ld(p.o4 + n * DK + d) * r; }
    w3[p.o3 + n] = r;
}

@compute @workgroup_size(WG)
fn l2norm_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let n = flat(wid, nwg, lid);
    if (n >= p.b) { return; }
    var dot = 0.0;
    for (var d = 0u; d < DK; d = d + 1u) { dot = fma(t4_ld(p.o4 + n * DK + d), t5_ld(p.o5 + n * DK + d), dot); }
    let r = t6_ld(p.o6 + n);
    for (var d = 0u; d < DK; d = d + 1u) {
        w2[p.o2 + n * DK + d] = r * (t4_ld(p.o4 + n * DK + d) - t5_ld(p.o5 + n * DK + d) * dot);
    }
}
