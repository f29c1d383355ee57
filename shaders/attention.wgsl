// Causal grouped-query attention with segment masks, flash-style: one invocation per query row
// streams over the keys it may see with an online softmax (no T x T scores anywhere), keeping its
// q row and output accumulator in registers; the 64 queries of a workgroup share (b, head), so the
// key/value rows they stream are the same cache lines. The forward saves logsumexp for backward.
// Backward: a delta = rowsum(dout * out) pre-pass, dq per query row, and dk/dv per key row of a
// kv head, looping over the query heads of its group and the queries that see it (no atomics).
//
// Layouts: q, out, dq (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse, delta (B, Hq, T);
// segment ids (B, T) i32 with 0 = padding. Query i sees key j when j <= i and both share a nonzero
// segment id; a padding query sees only itself. Query head h reads kv head h / (Hq / Hkv).
// Uniform: s0 = B, s1 = T, s2 = Hq, s3 = Hkv; o1..o9 = element offsets of bindings 1..9;
// f0 = softmax scale (1/sqrt(D)). Override D = head dim (<= DMAX).
// Each entry point has a *_vec4 twin that reads and writes the (B, T, H, D) tensors as vec4 (2.5x
// faster on llvmpipe); the wrapper uses it when D and those tensors' element offsets are multiples of 4.

struct Params {
    s0: u32, s1: u32, s2: u32, s3: u32, s4: u32, s5: u32, s6: u32, s7: u32,
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32, o8: u32,
    o9: u32, o10: u32, o11: u32, o12: u32,
    f0: f32, f1: f32, f2: f32, f3: f32,
}

override D: u32 = 64u;
const DMAX: u32 = 128u;
const D4MAX: u32 = 32u;
const WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: Params;

// ---- forward: 1 out out, 2 lse out, 3 q, 4 k, 5 v, 6 segment ids ----
@group(0) @binding(1) var<storage, read_write> f_out: array<f32>;
@group(0) @binding(2) var<storage, read_write> f_lse: array<f32>;
@group(0) @binding(3) var<storage, read> f_q: array<f32>;
@group(0) @binding(4) var<storage, read> f_k: array<f32>;
@group(0) @binding(5) var<storage, read> f_v: array<f32>;
@group(0) @binding(6) var<storage, read> f_seg: array<i32>;

@compute @workgroup_size(WG)
fn attention_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = p.s1;
    let i = wid.x * WG + lid.x;
    if (i >= t) { return; }
    let h = wid.y;
    let b = wid.z;
    let hq = p.s2;
    let hkv = p.s3;
    let g = h / (hq / hkv);
    let si = f_seg[p.o6 + b * t + i];
    let qb = p.o3 + ((b * t + i) * hq + h) * D;
    var qv: array<f32, DMAX>;
    var acc: array<f32, DMAX>;
    for (var d = 0u; d < D; d++) {
        qv[d] = f_q[qb + d] * p.f0;
        acc[d] = 0.0;
    }
    var m = -3.0e38;
    var l = 0.0;
    var j0 = 0u;
    if (si == 0) { j0 = i; }
    for (var j = j0; j <= i; j++) {
        if (f_seg[p.o6 + b * t + j] != si) { continue; }
        let kb = ((b * t + j) * hkv + g) * D;
        var s = 0.0;
        for (var d = 0u; d < D; d++) {
            s += qv[d] * f_k[p.o4 + kb + d];
        }
        // Branch-free online softmax: neighbouring invocations run in SIMD lanes, where a branch
        // on s > m would execute both sides.
        let mn = max(m, s);
        let corr = exp(m - mn);
        let e = exp(s - mn);
        l = l * corr + e;
        for (var d = 0u; d < D; d++) {
            acc[d] = acc[d] * corr + e * f_v[p.o5 + kb + d];
        }
        m = mn;
    }
    let inv = 1.0 / l;
    let ob = p.o1 + ((b * t + i) * hq + h) * D;
    for (var d = 0u; d < D; d++) {
        f_out[ob + d] = acc[d] * inv;
    }
    f_lse[p.o2 + (b * hq + h) * t + i] = m + log(l);
}

// ---- backward pre-pass: 1 delta out, 2 dout, 3 out ----
@group(0) @binding(1) var<storage, read_write> d_delta: array<f32>;
@group(0) @binding(2) var<storage, read> d_dout: array<f32>;
@group(0) @binding(3) var<storage, read> d_out: array<f32>;

@compute @workgroup_size(WG)
fn attention_backward_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = p.s1;
    let i = wid.x * WG + lid.x;
    if (i >= t) { return; }
    let h = wid.y;
    let b = wid.z;
    let hq = p.s2;
    let rb = ((b * t + i) * hq + h) * D;
    var s = 0.0;
    for (var d = 0u; d < D; d++) {
        s += d_dout[p.o2 + rb + d] * d_out[p.o3 + rb + d];
    }
    d_delta[p.o1 + (b * hq + h) * t + i] = s;
}

// ---- backward dq: 1 dq out, 2 dout, 3 q, 4 k, 5 v, 6 lse, 7 delta, 8 segment ids ----
@group(0) @binding(1) var<storage, read_write> q_dq: array<f32>;
@group(0) @binding(2) var<storage, read> q_dout: array<f32>;
@group(0) @binding(3) var<storage, read> q_q: array<f32>;
@group(0) @binding(4) var<storage, read> q_k: array<f32>;
@group(0) @binding(5) var<storage, read> q_v: array<f32>;
@group(0) @binding(6) var<storage, read> q_lse: array<f32>;
@group(0) @binding(7) var<storage, read> q_delta: array<f32>;
@group(0) @binding(8) var<storage, read> q_seg: array<i32>;

@compute @workgroup_size(WG)
fn attention_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = p.s1;
    let i = wid.x * WG + lid.x;
    if (i >= t) { return; }
    let h = wid.y;
    let b = wid.z;
    let hq = p.s2;
    let hkv = p.s3;
    let g = h / (hq / hkv);
    let si = q_seg[p.o8 + b * t + i];
    let rb = ((b * t + i) * hq + h) * D;
    let lse = q_lse[p.o6 + (b * hq + h) * t + i];
    let delta = q_delta[p.o7 + (b * hq + h) * t + i];
    var qv: array<f32, DMAX>;
    var dov: array<f32, DMAX>;
    var dq: array<f32, DMAX>;
    for (var d = 0u; d < D; d++) {
        qv[d] = q_q[p.o3 + rb + d] * p.f0;
        dov[d] = q_dout[p.o2 + rb + d];
        dq[d] = 0.0;
    }
    var j0 = 0u;
    if (si == 0) { j0 = i; }
    for (var j = j0; j <= i; j++) {
        if (q_seg[p.o8 + b * t + j] != si) { continue; }
        let kb = ((b * t + j) * hkv + g) * D;
        var s = 0.0;
        var dp = 0.0;
        for (var d = 0u; d < D; d++) {
            s += qv[d] * q_k[p.o4 + kb + d];
            dp += dov[d] * q_v[p.o5 + kb + d];
        }
        let ds = exp(s - lse) * (dp - delta);
        for (var d = 0u; d < D; d++) {
            dq[d] += ds * q_k[p.o4 + kb + d];
        }
    }
    for (var d = 0u; d < D; d++) {
        q_dq[p.o1 + rb + d] = dq[d] * p.f0;
    }
}

// ---- backward dk, dv: 1 dk out, 2 dv out, 3 dout, 4 q, 5 k, 6 v, 7 lse, 8 delta, 9 segment ids ----
// One invocation per (b, kv head, key j): sums over the Hq/Hkv query heads of the group and the
// queries i >= j that see key j, so each dk/dv row has exactly one writer.
@group(0) @binding(1) var<storage, read_write> k_dk: array<f32>;
@group(0) @binding(2) var<storage, read_write> k_dv: array<f32>;
@group(0) @binding(3) var<storage, read> k_dout: array<f32>;
@group(0) @binding(4) var<storage, read> k_q: array<f32>;
@group(0) @binding(5) var<storage, read> k_k: array<f32>;
@group(0) @binding(6) var<storage, read> k_v: array<f32>;
@group(0) @binding(7) var<storage, read> k_lse: array<f32>;
@group(0) @binding(8) var<storage, read> k_delta: array<f32>;
@group(0) @binding(9) var<storage, read> k_seg: array<i32>;

@compute @workgroup_size(WG)
fn attention_backward_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = p.s1;
    let j = wid.x * WG + lid.x;
    if (j >= t) { return; }
    let g = wid.y;
    let b = wid.z;
    let hq = p.s2;
    let hkv = p.s3;
    let rep = hq / hkv;
    let sj = k_seg[p.o9 + b * t + j];
    let kb = ((b * t + j) * hkv + g) * D;
    var kv: array<f32, DMAX>;
    var vv: array<f32, DMAX>;
    var dk: array<f32, DMAX>;
    var dv: array<f32, DMAX>;
    for (var d = 0u; d < D; d++) {
        kv[d] = k_k[p.o5 + kb + d] * p.f0;
        vv[d] = k_v[p.o6 + kb + d];
        dk[d] = 0.0;
        dv[d] = 0.0;
    }
    var i1 = t;
    if (sj == 0) { i1 = j + 1u; }
    for (var i = j; i < i1; i++) {
        if (k_seg[p.o9 + b * t + i] != sj) { continue; }
        for (var r = 0u; r < rep; r++) {
            let h = g * rep + r;
            let rb = ((b * t + i) * hq + h) * D;
            let li = (b * hq + h) * t + i;
            var s = 0.0;
            var dp = 0.0;
            for (var d = 0u; d < D; d++) {
                s += k_q[p.o4 + rb + d] * kv[d];
                dp += k_dout[p.o3 + rb + d] * vv[d];
            }
            let pr = exp(s - k_lse[p.o7 + li]);
            let ds = pr * (dp - k_delta[p.o8 + li]);
            for (var d = 0u; d < D; d++) {
                dv[d] += pr * k_dout[p.o3 + rb + d];
                dk[d] += ds * k_q[p.o4 + rb + d];
            }
        }
    }
    for (var d = 0u; d < D; d++) {
        k_dk[p.o1 + kb + d] = dk[d] * p.f0;
        k_dv[p.o2 + kb + d] = dv[d];
    }
}

// ==== vec4 twins: D % 4 == 0 and offsets of the (B, T, H, D) bindings multiples of 4 elements ====
// (lse, delta and segment ids reuse the scalar bindings above)

@group(0) @binding(1) var<storage, read_write> fv_out: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> fv_q: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> fv_k: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> fv_v: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn attention_forward_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = p.s1;
    let i = wid.x * WG + lid.x;
    if (i >= t) { return; }
    let h = wid.y;
    let b = wid.z;
    let hq = p.s2;
    let hkv = p.s3;
    let g = h / (hq / hkv);
    let n4 = D / 4u;
    let si = f_seg[p.o6 + b * t + i];
    let qb = p.o3 / 4u + ((b * t + i) * hq + h) * n4;
    var qv: array<vec4<f32>, D4MAX>;
    var acc: array<vec4<f32>, D4MAX>;
    for (var d = 0u; d < n4; d++) {
        qv[d] = fv_q[qb + d] * p.f0;
        acc[d] = vec4<f32>(0.0);
    }
    var m = -3.0e38;
    var l = 0.0;
    var j0 = 0u;
    if (si == 0) { j0 = i; }
    for (var j = j0; j <= i; j++) {
        if (f_seg[p.o6 + b * t + j] != si) { continue; }
        let kb = ((b * t + j) * hkv + g) * n4;
        var s4 = vec4<f32>(0.0);
        for (var d = 0u; d < n4; d++) {
            s4 += qv[d] * fv_k[p.o4 / 4u + kb + d];
        }
        let s = (s4.x + s4.y) + (s4.z + s4.w);
        let mn = max(m, s);
        let corr = exp(m - mn);
        let e = exp(s - mn);
        l = l * corr + e;
        for (var d = 0u; d < n4; d++) {
            acc[d] = acc[d] * corr + e * fv_v[p.o5 / 4u + kb + d];
        }
        m = mn;
    }
    let inv = 1.0 / l;
    let ob = p.o1 / 4u + ((b * t + i) * hq + h) * n4;
    for (var d = 0u; d < n4; d++) {
        fv_out[ob + d] = acc[d] * inv;
    }
    f_lse[p.o2 + (b * hq + h) * t + i] = m + log(l);
}

@group(0) @binding(1) var<storage, read_write> qv_dq: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> qv_dout: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> qv_q: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> qv_k: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> qv_v: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn attention_backward_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = p.s1;
    let i = wid.x * WG + lid.x;
    if (i >= t) { return; }
    let h = wid.y;
    let b = wid.z;
    let hq = p.s2;
    let hkv = p.s3;
    let g = h / (hq / hkv);
    let n4 = D / 4u;
    let si = q_seg[p.o8 + b * t + i];
    let rb = ((b * t + i) * hq + h) * n4;
    let lse = q_lse[p.o6 + (b * hq + h) * t + i];
    let delta = q_delta[p.o7 + (b * hq + h) * t + i];
    var qv: array<vec4<f32>, D4MAX>;
    var dov: array<vec4<f32>, D4MAX>;
    var dq: array<vec4<f32>, D4MAX>;
    for (var d = 0u; d < n4; d++) {
        qv[d] = qv_q[p.o3 / 4u + rb + d] * p.f0;
        dov[d] = qv_dout[p.o2 / 4u + rb + d];
        dq[d] = vec4<f32>(0.0);
    }
    var j0 = 0u;
    if (si == 0) { j0 = i; }
    for (var j = j0; j <= i; j++) {
        if (q_seg[p.o8 + b * t + j] != si) { continue; }
        let kb = ((b * t + j) * hkv + g) * n4;
        var s4 = vec4<f32>(0.0);
        var dp4 = vec4<f32>(0.0);
        for (var d = 0u; d < n4; d++) {
            s4 += qv[d] * qv_k[p.o4 / 4u + kb + d];
            dp4 += dov[d] * qv_v[p.o5 / 4u + kb + d];
        }
        let s = (s4.x + s4.y) + (s4.z + s4.w);
        let dp = (dp4.x + dp4.y) + (dp4.z + dp4.w);
        let ds = exp(s - lse) * (dp - delta);
        for (var d = 0u; d < n4; d++) {
            dq[d] += ds * qv_k[p.o4 / 4u + kb + d];
        }
    }
    for (var d = 0u; d < n4; d++) {
        qv_dq[p.o1 / 4u + rb + d] = dq[d] * p.f0;
    }
}

@group(0) @binding(1) var<storage, read_write> kv_dk: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> kv_dv: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> kv_dout: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> kv_q: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> kv_k: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> kv_v: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn attention_backward_dkv_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = p.s1;
    let j = wid.x * WG + lid.x;
    if (j >= t) { return; }
    let g = wid.y;
    let b = wid.z;
    let hq = p.s2;
    let hkv = p.s3;
    let rep = hq / hkv;
    let n4 = D / 4u;
    let sj = k_seg[p.o9 + b * t + j];
    let kb = ((b * t + j) * hkv + g) * n4;
    var kv: array<vec4<f32>, D4MAX>;
    var vv: array<vec4<f32>, D4MAX>;
    var dk: array<vec4<f32>, D4MAX>;
    var dv: array<vec4<f32>, D4MAX>;
    for (var d = 0u; d < n4; d++) {
        kv[d] = kv_k[p.o5 / 4u + kb + d] * p.f0;
        vv[d] = kv_v[p.o6 / 4u + kb + d];
        dk[d] = vec4<f32>(0.0);
        dv[d] = vec4<f32>(0.0);
    }
    var i1 = t;
    if (sj == 0) { i1 = j + 1u; }
    for (var i = j; i < i1; i++) {
        if (k_seg[p.o9 + b * t + i] != sj) { continue; }
        for (var r = 0u; r < rep; r++) {
            let h = g * rep + r;
            let rb = ((b * t + i) * hq + h) * n4;
            let li = (b * hq + h) * t + i;
            var s4 = vec4<f32>(0.0);
            var dp4 = vec4<f32>(0.0);
            for (var d = 0u; d < n4; d++) {
                s4 += kv_q[p.o4 / 4u + rb + d] * kv[d];
                dp4 += kv_dout[p.o3 / 4u + rb + d] * vv[d];
            }
            let s = (s4.x + s4.y) + (s4.z + s4.w);
            let dp = (dp4.x + dp4.y) + (dp4.z + dp4.w);
            let pr = exp(s - k_lse[p.o7 + li]);
            let ds = pr * (dp - k_delta[p.o8 + li]);
            for (var d = 0u; d < n4; d++) {
                dv[d] += pr * kv_dout[p.o3 / 4u + rb + d];
                dk[d] += ds * kv_q[p.o4 / 4u + rb + d];
            }
        }
    }
    for (var d = 0u; d < n4; d++) {
        kv_dk[p.o1 / 4u + kb + d] = dk[d] * p.f0;
        kv_dv[p.o2 / 4u + kb + d] = dv[d];
    }
}
