// Causal grouped-query attention with segment masks, flash-style: one invocation per query row
// streams over the keys it may see with an online softmax (no T x T scores anywhere), keeping its
// q row and output accumulator in registers; the 64 queries of a workgroup share (b, head), so the
// key/value rows they stream are the same cache lines. The forward saves logsumexp for backward.
// Backward: a delta = rowsum(dout * out) pre-pass, dq per query row, and dk/dv per key row of a
// kv head, looping over the query heads of its group and the queries that see it (no atomics).
//
// Layouts: q, out, dq (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse, delta (B, Hq, T);
// segment ids (B, T) i32 with 0 = padding. Query i sees key j when j <= i, i - j < s4 (the sliding
// window; 0 = none) and both share a nonzero segment id; a padding query sees only itself. Query head h
// reads kv head h / (Hq / Hkv). Key loops start (or end) at the window's edge.
// Gemma 3's images (s5 = 1, the scalar kernels only): the segment binding holds after the ids each token's reach
// (the last key it sees: its image block's last position, else itself), then each token's block start
// (attention_common.wgsl): query i's keys run to its reach, key j's queries from its block start.
// Uniform: s0 = B, s1 = T, s2 = Hq, s3 = Hkv, s4 = window, s5 = image blocks; o1..o9 = element offsets of bindings 1..9;
// f0 = softmax scale (1/sqrt(D)); f1 = the scores' soft-cap (0: none). Override D = head dim (<= DMAX).
// q, k, v, out and their gradients are tensors in any storage format (device/storage.py markers; even D and
// offsets for a 16-bit one), arithmetic in f32; a row is stored by pairs (its last element alone for an odd D).
// Each entry point has a *_vec4 twin that reads and writes the (B, T, H, D) tensors four elements at a time
// (their vec4 views); the wrapper uses it when D and those tensors' element offsets are multiples of 4.
// The vec4 kernels give each invocation QPI = 4 consecutive queries (forward, dq) or keys (dk/dv), so
// every k/v (or q/dout) row loaded serves four rows: llvmpipe loads a storage element lane by lane,
// and those loads, not the FMAs, bound the scalar design (2x faster at T=64, D=32). The four rows are
// separate arrays (qv0..qv3, ...) indexed only by the d loop: one array indexed by row and d measured
// no faster than the one-row design (likely left in scratch memory rather than registers). The vec4
// dq pass also computes delta itself, so the vec4 backward is two dispatches.
// @include softcap

// @include params

override D: u32 = 64u;
const DMAX: u32 = 128u;
const D4MAX: u32 = 32u;
const WG: u32 = 64u;
const QPI: u32 = 4u;           // queries (or keys) per invocation in the vec4 kernels
const WGA: u32 = WG / QPI;

// The first key query i may see under the sliding window (0 without one).
fn window_start(i: u32) -> u32 {
    return select(0u, i + 1u - p.s4, p.s4 > 0u && i + 1u > p.s4);
}

// One past the last query that may see key j under the sliding window (t without one).
fn window_end(j: u32, t: u32) -> u32 {
    return select(t, min(t, j + p.s4), p.s4 > 0u);
}

// ---- forward: 1 out out, 2 lse out, 3 q, 4 k, 5 v, 6 segment ids ----
// @tensor 1 f_out read_write
@group(0) @binding(2) var<storage, read_write> f_lse: array<f32>;
// @tensor 3 f_q read
// @tensor 4 f_k read
// @tensor 5 f_v read
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
    var ri = i;                 // the last key it sees
    if (p.s5 != 0u) { ri = u32(f_seg[p.o6 + p.s0 * t + b * t + i]); }
    let qb = p.o3 + ((b * t + i) * hq + h) * D;
    var qv: array<f32, DMAX>;
    var acc: array<f32, DMAX>;
    for (var d = 0u; d < D; d++) {
        qv[d] = f_q_ld(qb + d) * p.f0;
        acc[d] = 0.0;
    }
    var m = -3.0e38;
    var l = 0.0;
    var j0 = window_start(i);
    if (si == 0) { j0 = i; }
    for (var j = j0; j <= ri; j++) {
        if (f_seg[p.o6 + b * t + j] != si) { continue; }
        let kb = ((b * t + j) * hkv + g) * D;
        var s = 0.0;
        for (var d = 0u; d < D; d++) {
            s += qv[d] * f_k_ld(p.o4 + kb + d);
        }
        s = cap_score(s);
        // Branch-free online softmax: neighbouring invocations run in SIMD lanes, where a branch
        // on s > m would execute both sides.
        let mn = max(m, s);
        let corr = exp(m - mn);
        let e = exp(s - mn);
        l = l * corr + e;
        for (var d = 0u; d < D; d++) {
            acc[d] = acc[d] * corr + e * f_v_ld(p.o5 + kb + d);
        }
        m = mn;
    }
    let inv = 1.0 / l;
    let ob = p.o1 + ((b * t + i) * hq + h) * D;
    for (var d = 0u; d + 1u < D; d += 2u) {
        f_out_st2(ob + d, vec2<f32>(acc[d] * inv, acc[d + 1u] * inv));
    }
    if (D % 2u == 1u) { f_out_st(ob + D - 1u, acc[D - 1u] * inv); }
    f_lse[p.o2 + (b * hq + h) * t + i] = m + log(l);
}

// The backward's statistics share one binding (WebGPU's default limit is 8 storage buffers per stage): lse
// (B, Hq, T) at its offset, then delta = rowsum(dout * out) (B, Hq, T).
fn stats_rows() -> u32 { return p.s0 * p.s2 * p.s1; }

// ---- backward pre-pass: 1 statistics (delta out), 2 dout, 3 out ----
@group(0) @binding(1) var<storage, read_write> d_stats: array<f32>;
// @tensor 2 d_dout read
// @tensor 3 d_out read

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
        s += d_dout_ld(p.o2 + rb + d) * d_out_ld(p.o3 + rb + d);
    }
    d_stats[p.o1 + stats_rows() + (b * hq + h) * t + i] = s;
}

// ---- backward dq: 1 dq out, 2 dout, 3 q, 4 k, 5 v, 6 statistics (lse, delta), 7 segment ids ----
// @tensor 1 q_dq read_write
// @tensor 2 q_dout read
// @tensor 3 q_q read
// @tensor 4 q_k read
// @tensor 5 q_v read
@group(0) @binding(6) var<storage, read> q_stats: array<f32>;
@group(0) @binding(7) var<storage, read> q_seg: array<i32>;

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
    let si = q_seg[p.o7 + b * t + i];
    var ri = i;
    if (p.s5 != 0u) { ri = u32(q_seg[p.o7 + p.s0 * t + b * t + i]); }
    let rb = ((b * t + i) * hq + h) * D;
    let lse = q_stats[p.o6 + (b * hq + h) * t + i];
    let delta = q_stats[p.o6 + stats_rows() + (b * hq + h) * t + i];
    var qv: array<f32, DMAX>;
    var dov: array<f32, DMAX>;
    var dq: array<f32, DMAX>;
    for (var d = 0u; d < D; d++) {
        qv[d] = q_q_ld(p.o3 + rb + d) * p.f0;
        dov[d] = q_dout_ld(p.o2 + rb + d);
        dq[d] = 0.0;
    }
    var j0 = window_start(i);
    if (si == 0) { j0 = i; }
    for (var j = j0; j <= ri; j++) {
        if (q_seg[p.o7 + b * t + j] != si) { continue; }
        let kb = ((b * t + j) * hkv + g) * D;
        var s = 0.0;
        var dp = 0.0;
        for (var d = 0u; d < D; d++) {
            s += qv[d] * q_k_ld(p.o4 + kb + d);
            dp += dov[d] * q_v_ld(p.o5 + kb + d);
        }
        let cs = cap_score(s);
        let ds = exp(cs - lse) * (dp - delta) * cap_slope(cs);
        for (var d = 0u; d < D; d++) {
            dq[d] += ds * q_k_ld(p.o4 + kb + d);
        }
    }
    let ob = p.o1 + rb;
    for (var d = 0u; d + 1u < D; d += 2u) {
        q_dq_st2(ob + d, vec2<f32>(dq[d] * p.f0, dq[d + 1u] * p.f0));
    }
    if (D % 2u == 1u) { q_dq_st(ob + D - 1u, dq[D - 1u] * p.f0); }
}

// ---- backward dk, dv: 1 dk out, 2 dv out, 3 dout, 4 q, 5 k, 6 v, 7 statistics (lse, delta), 8 segment ids ----
// One invocation per (b, kv head, key j): sums over the Hq/Hkv query heads of the group and the
// queries i >= j that see key j, so each dk/dv row has exactly one writer.
// @tensor 1 k_dk read_write
// @tensor 2 k_dv read_write
// @tensor 3 k_dout read
// @tensor 4 k_q read
// @tensor 5 k_k read
// @tensor 6 k_v read
@group(0) @binding(7) var<storage, read> k_stats: array<f32>;
@group(0) @binding(8) var<storage, read> k_seg: array<i32>;

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
    let sj = k_seg[p.o8 + b * t + j];
    let kb = ((b * t + j) * hkv + g) * D;
    var kv: array<f32, DMAX>;
    var vv: array<f32, DMAX>;
    var dk: array<f32, DMAX>;
    var dv: array<f32, DMAX>;
    for (var d = 0u; d < D; d++) {
        kv[d] = k_k_ld(p.o5 + kb + d) * p.f0;
        vv[d] = k_v_ld(p.o6 + kb + d);
        dk[d] = 0.0;
        dv[d] = 0.0;
    }
    var i1 = window_end(j, t);
    if (sj == 0) { i1 = j + 1u; }
    var i0 = j;                 // the first query that sees it
    if (p.s5 != 0u) { i0 = u32(k_seg[p.o8 + 2u * p.s0 * t + b * t + j]); }
    for (var i = i0; i < i1; i++) {
        if (k_seg[p.o8 + b * t + i] != sj) { continue; }
        for (var r = 0u; r < rep; r++) {
            let h = g * rep + r;
            let rb = ((b * t + i) * hq + h) * D;
            let li = (b * hq + h) * t + i;
            var s = 0.0;
            var dp = 0.0;
            for (var d = 0u; d < D; d++) {
                s += k_q_ld(p.o4 + rb + d) * kv[d];
                dp += k_dout_ld(p.o3 + rb + d) * vv[d];
            }
            let cs = cap_score(s);
            let pr = exp(cs - k_stats[p.o7 + li]);
            let ds = pr * (dp - k_stats[p.o7 + stats_rows() + li]) * cap_slope(cs);
            for (var d = 0u; d < D; d++) {
                dv[d] += pr * k_dout_ld(p.o3 + rb + d);
                dk[d] += ds * k_q_ld(p.o4 + rb + d);
            }
        }
    }
    for (var d = 0u; d + 1u < D; d += 2u) {
        k_dk_st2(p.o1 + kb + d, vec2<f32>(dk[d] * p.f0, dk[d + 1u] * p.f0));
        k_dv_st2(p.o2 + kb + d, vec2<f32>(dv[d], dv[d + 1u]));
    }
    if (D % 2u == 1u) {
        k_dk_st(p.o1 + kb + D - 1u, dk[D - 1u] * p.f0);
        k_dv_st(p.o2 + kb + D - 1u, dv[D - 1u]);
    }
}

// ==== vec4 twins: D % 4 == 0 and offsets of the (B, T, H, D) bindings multiples of 4 elements ====
// They read and write the scalar kernels' tensors through vec4 views (`// @tensor4`, storage.views:
// a vec4<f32> in float32, two words in 16 bits): <name>_at(x) is the vec4 x of the tensor from its binding's
// offset, <name>_set(x, value) stores it. The dq pass writes delta and reads out: two bindings of its own.
// @tensor4 1 f_out read_write
// @tensor4 3 f_q read
// @tensor4 4 f_k read
// @tensor4 5 f_v read
fn f_q_at(x: u32) -> vec4<f32> { return f_q_ld4(p.o3 + 4u * x); }
fn f_k_at(x: u32) -> vec4<f32> { return f_k_ld4(p.o4 + 4u * x); }
fn f_v_at(x: u32) -> vec4<f32> { return f_v_ld4(p.o5 + 4u * x); }
fn f_out_set(x: u32, a: vec4<f32>) { f_out_st4(p.o1 + 4u * x, a); }

// Online-softmax step for one query: (m, l) and score s -> (new m, new l, rescale of acc, weight of v).
fn softmax_step(m: f32, l: f32, s: f32, ok: bool) -> vec4<f32> {
    let sm = select(-3.0e38, cap_score(s), ok);
    let mn = max(m, sm);
    let corr = exp(m - mn);
    let e = select(0.0, exp(sm - mn), ok);
    return vec4<f32>(mn, l * corr + e, corr, e);
}

fn hsum(a: vec4<f32>) -> f32 { return (a.x + a.y) + (a.z + a.w); }

// Query i sees key j (sj = segment of j, si of i).
fn sees(i: u32, j: u32, si: i32, sj: i32) -> bool {
    return j <= i && (p.s4 == 0u || i - j < p.s4) && sj == si && (si != 0 || j == i);
}

@compute @workgroup_size(WGA)
fn attention_forward_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = p.s1;
    let ia = wid.x * WG + lid.x * QPI;
    if (ia >= t) { return; }
    let il = min(ia + QPI - 1u, t - 1u);
    let h = wid.y;
    let b = wid.z;
    let hq = p.s2;
    let hkv = p.s3;
    let g = h / (hq / hkv);
    let n4 = D / 4u;
    let sb = p.o6 + b * t;
    let s0 = f_seg[sb + ia];
    let s1 = f_seg[sb + min(ia + 1u, il)];
    let s2 = f_seg[sb + min(ia + 2u, il)];
    let s3 = f_seg[sb + il];
    let rs = hq * n4;
    let qb = ((b * t + ia) * hq + h) * n4;
    let q1 = select(qb, qb + rs, ia + 1u <= il);
    let q2 = select(qb, qb + 2u * rs, ia + 2u <= il);
    let q3 = select(qb, qb + 3u * rs, ia + 3u <= il);
    var qv0: array<vec4<f32>, D4MAX>;
    var qv1: array<vec4<f32>, D4MAX>;
    var qv2: array<vec4<f32>, D4MAX>;
    var qv3: array<vec4<f32>, D4MAX>;
    var ac0: array<vec4<f32>, D4MAX>;
    var ac1: array<vec4<f32>, D4MAX>;
    var ac2: array<vec4<f32>, D4MAX>;
    var ac3: array<vec4<f32>, D4MAX>;
    for (var d = 0u; d < n4; d++) {
        qv0[d] = f_q_at(qb + d) * p.f0;
        qv1[d] = f_q_at(q1 + d) * p.f0;
        qv2[d] = f_q_at(q2 + d) * p.f0;
        qv3[d] = f_q_at(q3 + d) * p.f0;
        ac0[d] = vec4<f32>(0.0);
        ac1[d] = vec4<f32>(0.0);
        ac2[d] = vec4<f32>(0.0);
        ac3[d] = vec4<f32>(0.0);
    }
    var st0 = vec4<f32>(-3.0e38, 0.0, 0.0, 0.0);
    var st1 = st0;
    var st2 = st0;
    var st3 = st0;
    // Padding queries see only themselves: start at the first query unless one of them is real.
    let jstart = select(window_start(ia), ia, s0 == 0 && s1 == 0 && s2 == 0 && s3 == 0);
    for (var j = jstart; j <= il; j++) {
        let sj = f_seg[sb + j];
        let kb = ((b * t + j) * hkv + g) * n4;
        var a0 = vec4<f32>(0.0);
        var a1 = vec4<f32>(0.0);
        var a2 = vec4<f32>(0.0);
        var a3 = vec4<f32>(0.0);
        for (var d = 0u; d < n4; d++) {
            let kk = f_k_at(kb + d);
            a0 += qv0[d] * kk;
            a1 += qv1[d] * kk;
            a2 += qv2[d] * kk;
            a3 += qv3[d] * kk;
        }
        st0 = softmax_step(st0.x, st0.y, hsum(a0), sees(ia, j, s0, sj));
        st1 = softmax_step(st1.x, st1.y, hsum(a1), sees(ia + 1u, j, s1, sj));
        st2 = softmax_step(st2.x, st2.y, hsum(a2), sees(ia + 2u, j, s2, sj));
        st3 = softmax_step(st3.x, st3.y, hsum(a3), sees(ia + 3u, j, s3, sj));
        for (var d = 0u; d < n4; d++) {
            let vv = f_v_at(kb + d);
            ac0[d] = ac0[d] * st0.z + st0.w * vv;
            ac1[d] = ac1[d] * st1.z + st1.w * vv;
            ac2[d] = ac2[d] * st2.z + st2.w * vv;
            ac3[d] = ac3[d] * st3.z + st3.w * vv;
        }
    }
    let ob = ((b * t + ia) * hq + h) * n4;
    let lb = p.o2 + (b * hq + h) * t + ia;
    for (var d = 0u; d < n4; d++) { f_out_set(ob + d, ac0[d] / st0.y); }
    f_lse[lb] = st0.x + log(st0.y);
    if (ia + 1u <= il) {
        for (var d = 0u; d < n4; d++) { f_out_set(ob + rs + d, ac1[d] / st1.y); }
        f_lse[lb + 1u] = st1.x + log(st1.y);
    }
    if (ia + 2u <= il) {
        for (var d = 0u; d < n4; d++) { f_out_set(ob + 2u * rs + d, ac2[d] / st2.y); }
        f_lse[lb + 2u] = st2.x + log(st2.y);
    }
    if (ia + 3u <= il) {
        for (var d = 0u; d < n4; d++) { f_out_set(ob + 3u * rs + d, ac3[d] / st3.y); }
        f_lse[lb + 3u] = st3.x + log(st3.y);
    }
}

// dq with the delta pre-pass fused in: 1 dq out, 2 dout, 3 q, 4 k, 5 v, 6 statistics (lse, delta out),
// 7 segment ids, 8 out. Four consecutive queries per invocation share each loaded k and v row.
@group(0) @binding(6) var<storage, read_write> qv_stats: array<f32>;
// @tensor 8 q_out read
// @tensor4 1 q_dq read_write
// @tensor4 2 q_dout read
// @tensor4 3 q_q read
// @tensor4 4 q_k read
// @tensor4 5 q_v read
// @tensor4 8 q_out read
fn q_dout_at(x: u32) -> vec4<f32> { return q_dout_ld4(p.o2 + 4u * x); }
fn q_q_at(x: u32) -> vec4<f32> { return q_q_ld4(p.o3 + 4u * x); }
fn q_k_at(x: u32) -> vec4<f32> { return q_k_ld4(p.o4 + 4u * x); }
fn q_v_at(x: u32) -> vec4<f32> { return q_v_ld4(p.o5 + 4u * x); }
fn q_out_at(x: u32) -> vec4<f32> { return q_out_ld4(p.o8 + 4u * x); }
fn q_dq_set(x: u32, a: vec4<f32>) { q_dq_st4(p.o1 + 4u * x, a); }

@compute @workgroup_size(WGA)
fn attention_backward_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = p.s1;
    let ia = wid.x * WG + lid.x * QPI;
    if (ia >= t) { return; }
    let il = min(ia + QPI - 1u, t - 1u);
    let h = wid.y;
    let b = wid.z;
    let hq = p.s2;
    let hkv = p.s3;
    let g = h / (hq / hkv);
    let n4 = D / 4u;
    let sb = p.o7 + b * t;
    let s0 = q_seg[sb + ia];
    let s1 = q_seg[sb + min(ia + 1u, il)];
    let s2 = q_seg[sb + min(ia + 2u, il)];
    let s3 = q_seg[sb + il];
    let rs = hq * n4;
    let r0 = ((b * t + ia) * hq + h) * n4;
    let r1 = select(r0, r0 + rs, ia + 1u <= il);
    let r2 = select(r0, r0 + 2u * rs, ia + 2u <= il);
    let r3 = select(r0, r0 + 3u * rs, ia + 3u <= il);
    let lb = (b * hq + h) * t;
    let lse0 = qv_stats[p.o6 + lb + ia];
    let lse1 = qv_stats[p.o6 + lb + min(ia + 1u, il)];
    let lse2 = qv_stats[p.o6 + lb + min(ia + 2u, il)];
    let lse3 = qv_stats[p.o6 + lb + il];
    let db = p.o6 + stats_rows() + lb;
    var qv0: array<vec4<f32>, D4MAX>;
    var qv1: array<vec4<f32>, D4MAX>;
    var qv2: array<vec4<f32>, D4MAX>;
    var qv3: array<vec4<f32>, D4MAX>;
    var do0: array<vec4<f32>, D4MAX>;
    var do1: array<vec4<f32>, D4MAX>;
    var do2: array<vec4<f32>, D4MAX>;
    var do3: array<vec4<f32>, D4MAX>;
    var dq0: array<vec4<f32>, D4MAX>;
    var dq1: array<vec4<f32>, D4MAX>;
    var dq2: array<vec4<f32>, D4MAX>;
    var dq3: array<vec4<f32>, D4MAX>;
    var kr: array<vec4<f32>, D4MAX>;
    var e0 = vec4<f32>(0.0);
    var e1 = vec4<f32>(0.0);
    var e2 = vec4<f32>(0.0);
    var e3 = vec4<f32>(0.0);
    for (var d = 0u; d < n4; d++) {
        qv0[d] = q_q_at(r0 + d) * p.f0;
        qv1[d] = q_q_at(r1 + d) * p.f0;
        qv2[d] = q_q_at(r2 + d) * p.f0;
        qv3[d] = q_q_at(r3 + d) * p.f0;
        do0[d] = q_dout_at(r0 + d);
        do1[d] = q_dout_at(r1 + d);
        do2[d] = q_dout_at(r2 + d);
        do3[d] = q_dout_at(r3 + d);
        e0 += do0[d] * q_out_at(r0 + d);
        e1 += do1[d] * q_out_at(r1 + d);
        e2 += do2[d] * q_out_at(r2 + d);
        e3 += do3[d] * q_out_at(r3 + d);
        dq0[d] = vec4<f32>(0.0);
        dq1[d] = vec4<f32>(0.0);
        dq2[d] = vec4<f32>(0.0);
        dq3[d] = vec4<f32>(0.0);
    }
    // delta = rowsum(dout * out), also saved for the dk/dv pass.
    let dl0 = hsum(e0);
    let dl1 = hsum(e1);
    let dl2 = hsum(e2);
    let dl3 = hsum(e3);
    qv_stats[db + ia] = dl0;
    if (ia + 1u <= il) { qv_stats[db + ia + 1u] = dl1; }
    if (ia + 2u <= il) { qv_stats[db + ia + 2u] = dl2; }
    if (ia + 3u <= il) { qv_stats[db + ia + 3u] = dl3; }
    let jstart = select(window_start(ia), ia, s0 == 0 && s1 == 0 && s2 == 0 && s3 == 0);
    for (var j = jstart; j <= il; j++) {
        let sj = q_seg[sb + j];
        let kb = ((b * t + j) * hkv + g) * n4;
        var a0 = vec4<f32>(0.0);
        var a1 = vec4<f32>(0.0);
        var a2 = vec4<f32>(0.0);
        var a3 = vec4<f32>(0.0);
        var c0 = vec4<f32>(0.0);
        var c1 = vec4<f32>(0.0);
        var c2 = vec4<f32>(0.0);
        var c3 = vec4<f32>(0.0);
        for (var d = 0u; d < n4; d++) {
            let kk = q_k_at(kb + d);
            let vv = q_v_at(kb + d);
            kr[d] = kk;
            a0 += qv0[d] * kk;
            a1 += qv1[d] * kk;
            a2 += qv2[d] * kk;
            a3 += qv3[d] * kk;
            c0 += do0[d] * vv;
            c1 += do1[d] * vv;
            c2 += do2[d] * vv;
            c3 += do3[d] * vv;
        }
        let cs0 = cap_score(hsum(a0));
        let ds0 = select(0.0, exp(cs0 - lse0) * (hsum(c0) - dl0) * cap_slope(cs0), sees(ia, j, s0, sj));
        let cs1 = cap_score(hsum(a1));
        let ds1 = select(0.0, exp(cs1 - lse1) * (hsum(c1) - dl1) * cap_slope(cs1), sees(ia + 1u, j, s1, sj));
        let cs2 = cap_score(hsum(a2));
        let ds2 = select(0.0, exp(cs2 - lse2) * (hsum(c2) - dl2) * cap_slope(cs2), sees(ia + 2u, j, s2, sj));
        let cs3 = cap_score(hsum(a3));
        let ds3 = select(0.0, exp(cs3 - lse3) * (hsum(c3) - dl3) * cap_slope(cs3), sees(ia + 3u, j, s3, sj));
        for (var d = 0u; d < n4; d++) {
            let kk = kr[d];
            dq0[d] += ds0 * kk;
            dq1[d] += ds1 * kk;
            dq2[d] += ds2 * kk;
            dq3[d] += ds3 * kk;
        }
    }
    for (var d = 0u; d < n4; d++) { q_dq_set(r0 + d, dq0[d] * p.f0); }
    if (ia + 1u <= il) { for (var d = 0u; d < n4; d++) { q_dq_set(r1 + d, dq1[d] * p.f0); } }
    if (ia + 2u <= il) { for (var d = 0u; d < n4; d++) { q_dq_set(r2 + d, dq2[d] * p.f0); } }
    if (ia + 3u <= il) { for (var d = 0u; d < n4; d++) { q_dq_set(r3 + d, dq3[d] * p.f0); } }
}

// dk, dv: four consecutive keys per invocation share each loaded q and dout row.
// @tensor4 1 k_dk read_write
// @tensor4 2 k_dv read_write
// @tensor4 3 k_dout read
// @tensor4 4 k_q read
// @tensor4 5 k_k read
// @tensor4 6 k_v read
fn k_dout_at(x: u32) -> vec4<f32> { return k_dout_ld4(p.o3 + 4u * x); }
fn k_q_at(x: u32) -> vec4<f32> { return k_q_ld4(p.o4 + 4u * x); }
fn k_k_at(x: u32) -> vec4<f32> { return k_k_ld4(p.o5 + 4u * x); }
fn k_v_at(x: u32) -> vec4<f32> { return k_v_ld4(p.o6 + 4u * x); }
fn k_dk_set(x: u32, a: vec4<f32>) { k_dk_st4(p.o1 + 4u * x, a); }
fn k_dv_set(x: u32, a: vec4<f32>) { k_dv_st4(p.o2 + 4u * x, a); }

@compute @workgroup_size(WGA)
fn attention_backward_dkv_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = p.s1;
    let ja = wid.x * WG + lid.x * QPI;
    if (ja >= t) { return; }
    let jl = min(ja + QPI - 1u, t - 1u);
    let g = wid.y;
    let b = wid.z;
    let hq = p.s2;
    let hkv = p.s3;
    let rep = hq / hkv;
    let n4 = D / 4u;
    let sb = p.o8 + b * t;
    let s0 = k_seg[sb + ja];
    let s1 = k_seg[sb + min(ja + 1u, jl)];
    let s2 = k_seg[sb + min(ja + 2u, jl)];
    let s3 = k_seg[sb + jl];
    let rs = hkv * n4;
    let r0 = ((b * t + ja) * hkv + g) * n4;
    let r1 = select(r0, r0 + rs, ja + 1u <= jl);
    let r2 = select(r0, r0 + 2u * rs, ja + 2u <= jl);
    let r3 = select(r0, r0 + 3u * rs, ja + 3u <= jl);
    var k0: array<vec4<f32>, D4MAX>;
    var k1: array<vec4<f32>, D4MAX>;
    var k2: array<vec4<f32>, D4MAX>;
    var k3: array<vec4<f32>, D4MAX>;
    var v0: array<vec4<f32>, D4MAX>;
    var v1: array<vec4<f32>, D4MAX>;
    var v2: array<vec4<f32>, D4MAX>;
    var v3: array<vec4<f32>, D4MAX>;
    var dk0: array<vec4<f32>, D4MAX>;
    var dk1: array<vec4<f32>, D4MAX>;
    var dk2: array<vec4<f32>, D4MAX>;
    var dk3: array<vec4<f32>, D4MAX>;
    var dv0: array<vec4<f32>, D4MAX>;
    var dv1: array<vec4<f32>, D4MAX>;
    var dv2: array<vec4<f32>, D4MAX>;
    var dv3: array<vec4<f32>, D4MAX>;
    var qr: array<vec4<f32>, D4MAX>;
    var dr: array<vec4<f32>, D4MAX>;
    for (var d = 0u; d < n4; d++) {
        k0[d] = k_k_at(r0 + d) * p.f0;
        k1[d] = k_k_at(r1 + d) * p.f0;
        k2[d] = k_k_at(r2 + d) * p.f0;
        k3[d] = k_k_at(r3 + d) * p.f0;
        v0[d] = k_v_at(r0 + d);
        v1[d] = k_v_at(r1 + d);
        v2[d] = k_v_at(r2 + d);
        v3[d] = k_v_at(r3 + d);
        dk0[d] = vec4<f32>(0.0);
        dk1[d] = vec4<f32>(0.0);
        dk2[d] = vec4<f32>(0.0);
        dk3[d] = vec4<f32>(0.0);
        dv0[d] = vec4<f32>(0.0);
        dv1[d] = vec4<f32>(0.0);
        dv2[d] = vec4<f32>(0.0);
        dv3[d] = vec4<f32>(0.0);
    }
    // Padding keys are seen only by their own query.
    let iend = select(window_end(jl, t), jl + 1u, s0 == 0 && s1 == 0 && s2 == 0 && s3 == 0);
    for (var i = ja; i < iend; i++) {
        let si = k_seg[sb + i];
        let m0 = sees(i, ja, si, s0);
        let m1 = sees(i, ja + 1u, si, s1) && ja + 1u <= jl;
        let m2 = sees(i, ja + 2u, si, s2) && ja + 2u <= jl;
        let m3 = sees(i, ja + 3u, si, s3) && ja + 3u <= jl;
        if (!(m0 || m1 || m2 || m3)) { continue; }
        for (var r = 0u; r < rep; r++) {
            let h = g * rep + r;
            let rb = ((b * t + i) * hq + h) * n4;
            let li = (b * hq + h) * t + i;
            var a0 = vec4<f32>(0.0);
            var a1 = vec4<f32>(0.0);
            var a2 = vec4<f32>(0.0);
            var a3 = vec4<f32>(0.0);
            var c0 = vec4<f32>(0.0);
            var c1 = vec4<f32>(0.0);
            var c2 = vec4<f32>(0.0);
            var c3 = vec4<f32>(0.0);
            for (var d = 0u; d < n4; d++) {
                let qq = k_q_at(rb + d);
                let oo = k_dout_at(rb + d);
                qr[d] = qq;
                dr[d] = oo;
                a0 += qq * k0[d];
                a1 += qq * k1[d];
                a2 += qq * k2[d];
                a3 += qq * k3[d];
                c0 += oo * v0[d];
                c1 += oo * v1[d];
                c2 += oo * v2[d];
                c3 += oo * v3[d];
            }
            let lse = k_stats[p.o7 + li];
            let dl = k_stats[p.o7 + stats_rows() + li];
            let cs0 = cap_score(hsum(a0));
            let p0 = select(0.0, exp(cs0 - lse), m0);
            let cs1 = cap_score(hsum(a1));
            let p1 = select(0.0, exp(cs1 - lse), m1);
            let cs2 = cap_score(hsum(a2));
            let p2 = select(0.0, exp(cs2 - lse), m2);
            let cs3 = cap_score(hsum(a3));
            let p3 = select(0.0, exp(cs3 - lse), m3);
            let ds0 = p0 * (hsum(c0) - dl) * cap_slope(cs0);
            let ds1 = p1 * (hsum(c1) - dl) * cap_slope(cs1);
            let ds2 = p2 * (hsum(c2) - dl) * cap_slope(cs2);
            let ds3 = p3 * (hsum(c3) - dl) * cap_slope(cs3);
            for (var d = 0u; d < n4; d++) {
                let qq = qr[d];
                let oo = dr[d];
                dv0[d] += p0 * oo;
                dv1[d] += p1 * oo;
                dv2[d] += p2 * oo;
                dv3[d] += p3 * oo;
                dk0[d] += ds0 * qq;
                dk1[d] += ds1 * qq;
                dk2[d] += ds2 * qq;
                dk3[d] += ds3 * qq;
            }
        }
    }
    for (var d = 0u; d < n4; d++) { k_dk_set(r0 + d, dk0[d] * p.f0); k_dv_set(r0 + d, dv0[d]); }
    if (ja + 1u <= jl) { for (var d = 0u; d < n4; d++) { k_dk_set(r1 + d, dk1[d] * p.f0); k_dv_set(r1 + d, dv1[d]); } }
    if (ja + 2u <= jl) { for (var d = 0u; d < n4; d++) { k_dk_set(r2 + d, dk2[d] * p.f0); k_dv_set(r2 + d, dv2[d]); } }
    if (ja + 3u <= jl) { for (var d = 0u; d < n4; d++) { k_dk_set(r3 + d, dk3[d] * p.f0); k_dv_set(r3 + d, dv3[d]); } }
}
