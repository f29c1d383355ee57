// Register-blocked flash attention for CPU adapters (llvmpipe): causal grouped-query attention with segment
// (packing) masks and sliding windows, forward and backward, without workgroup memory or barriers.
//
// An invocation owns R consecutive rows of one (batch, head) (queries in the forward and the dq pass, keys
// of one kv head in the dk / dv pass), each kept whole in registers (D / 4 vec4 values, written out one by
// one: WGSL arrays indexed by a loop variable end up in memory on llvmpipe, where every such access is a
// loop over the SIMD lanes). The workgroup walks the other side in tiles of BT rows,
// TK rows at a time, with the same bounds for every invocation, so each k / v (or q / dout) element it reads
// is one address for the whole workgroup. A tile that no row of the block may see (before the window, or
// without a segment id in common: packed rows) is skipped whole, so a packed row costs the sum of len^2.
// Online softmax in f32; the forward saves logsumexp; the backward recomputes P (no T x T buffer).
//
// attention_source.source() rewrites the const block, keeps the @forward, @dq or @dkv sections, and writes
// every line holding `$r` once per row of the invocation, `$k` once per row of a chunk and `$d` once per vec4
// of the head dim (several markers: once per combination), the marker replaced by the index, on one line.
//
// Layouts: q, att (the output), dq, dout (B, T, Hq, D); k, v, dk, dv (B, T, Hkv, D); lse, delta (B, Hq, T);
// segment ids (B, T) i32, 0 = padding. Query i sees key j when j <= i, i - j < window (s4; 0 = none) and both
// share a nonzero segment id; a padding query sees only itself. Query head h reads kv head h / (Hq / Hkv).
// With image blocks (s5 = 1, attention_common.wgsl) j <= i becomes j <= i's reach: the tiles run to the block's
// last reach, and in the dk / dv pass from its first key's block start.
// Uniform: s0 = B, s1 = T, s2 = Hq, s3 = Hkv, s4 = window; o<n> = element offset of binding n; f0 = softmax
// scale; f1 = the scores' soft-cap (0: none). q, k, v, att and their gradients in any storage format, through
// attention_common.wgsl's vec4 accessors (arithmetic in f32).

// @flash-config begin
const D4: u32 = 16u;    // head dim / 4
const R: u32 = 8u;      // rows per invocation
const NI: u32 = 8u;     // invocations per workgroup
const TK: u32 = 4u;     // rows of the other side per step
const BT: u32 = 32u;    // rows per tile (the skipping granularity; a multiple of TK)
// @flash-config end
const BR: u32 = R * NI; // rows per workgroup

// Whether the tile [a, e) holds rows that rows [r0, r1) of the block (segment ranges blk) may pair with: a
// segment id in common, or the block's own rows when it has padding (a padding row sees only itself).
fn tile_needed(b: u32, blk: vec3<i32>, r0: u32, r1: u32, a: u32, e: u32) -> bool {
    return overlap(blk, seg_range(b, a, e)) || (blk.z != 0 && a < r1 && e > r0);
}

// ==== forward (its bindings: shaders/attention_common.wgsl) ====
// @forward begin

@compute @workgroup_size(NI)
fn attention_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    // @setup queries BR
    let i$r = min(q0 + lid * R + $ru, t - 1u);
    let si$r = seg_at(b * t + i$r);
    let ri$r = reach(b, i$r);
    let qb$r = ((b * t + i$r) * p.s2 + h) * D4;
    let q$r_$d = q_at(qb$r + $du) * p.f0;
    var o$r_$d = vec4<f32>(0.0);
    var m$r = -3.0e38;
    var l$r = 0.0;
    let blk = seg_range(b, q0, qend);
    let kfirst = window_start(q0);
    let kstop = reach(b, qend - 1u) + 1u;
    for (var kt = kfirst - kfirst % BT; kt < kstop; kt += BT) {
        let kend = min(kt + BT, kstop);
        if (!tile_needed(b, blk, q0, qend, kt, kend)) { continue; }
        for (var j = kt; j < kend; j += TK) {
            let jk$k = min(j + $ku, t - 1u);
            let sk$k = seg_at(b * t + jk$k);
            let kb$k = ((b * t + jk$k) * p.s3 + g) * D4;
            let kk$k_$d = k_at(kb$k + $du);
            var s$r_$k = vec4<f32>(0.0);
            s$r_$k += q$r_$d * kk$k_$d;
            let sc$r_$k = select(-3.0e38, cap_score(hsum(s$r_$k)), j + $ku < kend && sees(i$r, j + $ku, si$r, sk$k, ri$r));
            var mx$r = m$r;
            mx$r = max(mx$r, sc$r_$k);
            let cr$r = exp(m$r - mx$r);
            let e$r_$k = select(0.0, exp(sc$r_$k - mx$r), sc$r_$k > -1.0e38);
            l$r = l$r * cr$r;
            l$r += e$r_$k;
            m$r = mx$r;
            let vv$k_$d = v_at(kb$k + $du);
            o$r_$d = o$r_$d * cr$r;
            o$r_$d += e$r_$k * vv$k_$d;
        }
    }
    if (q0 + lid * R + $ru < t) { att_set(qb$r + $du, o$r_$d / l$r); }
    if (q0 + lid * R + $ru < t) { lse_set((b * p.s2 + h) * t + i$r, m$r + log(l$r)); }
}
// @forward end

// ==== dq, delta fused (its bindings: shaders/attention_common.wgsl) ====
// @dq begin

// Also writes delta = rowsum(dout * out) for the dk / dv pass.
@compute @workgroup_size(NI)
fn attention_backward_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    // @setup queries BR
    let i$r = min(q0 + lid * R + $ru, t - 1u);
    let si$r = seg_at(b * t + i$r);
    let ri$r = reach(b, i$r);
    let qb$r = ((b * t + i$r) * p.s2 + h) * D4;
    let li$r = (b * p.s2 + h) * t + i$r;
    let lse$r = lse_at(li$r);
    let q$r_$d = q_at(qb$r + $du) * p.f0;
    let do$r_$d = dout_at(qb$r + $du);
    var e$r = vec4<f32>(0.0);
    e$r += do$r_$d * att_at(qb$r + $du);
    let dl$r = hsum(e$r);
    if (q0 + lid * R + $ru < t) { delta_set(li$r, dl$r); }
    var dq$r_$d = vec4<f32>(0.0);
    let blk = seg_range(b, q0, qend);
    let kfirst = window_start(q0);
    let kstop = reach(b, qend - 1u) + 1u;
    for (var kt = kfirst - kfirst % BT; kt < kstop; kt += BT) {
        let kend = min(kt + BT, kstop);
        if (!tile_needed(b, blk, q0, qend, kt, kend)) { continue; }
        for (var j = kt; j < kend; j += TK) {
            let jk$k = min(j + $ku, t - 1u);
            let sk$k = seg_at(b * t + jk$k);
            let kb$k = ((b * t + jk$k) * p.s3 + g) * D4;
            let kk$k_$d = k_at(kb$k + $du);
            let vv$k_$d = v_at(kb$k + $du);
            var s$r_$k = vec4<f32>(0.0);
            var c$r_$k = vec4<f32>(0.0);
            s$r_$k += q$r_$d * kk$k_$d;
            c$r_$k += do$r_$d * vv$k_$d;
            let sr$r_$k = hsum(s$r_$k);
            let cs$r_$k = cap_score(sr$r_$k);
            let ds$r_$k = select(0.0, exp(cs$r_$k - lse$r) * (hsum(c$r_$k) - dl$r) * cap_slope(cs$r_$k), j + $ku < kend && sees(i$r, j + $ku, si$r, sk$k, ri$r));
            dq$r_$d += ds$r_$k * kk$k_$d;
        }
    }
    if (q0 + lid * R + $ru < t) { dq_set(qb$r + $du, dq$r_$d * p.f0); }
}
// @dq end

// ==== dk, dv (their bindings: shaders/attention_common.wgsl) ====
// One invocation per R keys of one kv head: sums over the query heads of its group and the queries that see
// each key, so every dk / dv row has exactly one writer (no atomics).
// @dkv begin

@compute @workgroup_size(NI)
fn attention_backward_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    // @setup keys BR
    let j$r = min(k0 + lid * R + $ru, t - 1u);
    let sj$r = seg_at(b * t + j$r);
    let kb$r = ((b * t + j$r) * p.s3 + g) * D4;
    let k$r_$d = k_at(kb$r + $du) * p.f0;
    let v$r_$d = v_at(kb$r + $du);
    var dk$r_$d = vec4<f32>(0.0);
    var dv$r_$d = vec4<f32>(0.0);
    let blk = seg_range(b, k0, kend);
    let iend = window_end(kend - 1u, t);
    let qfirst = block_start(b, k0);
    for (var it = qfirst - qfirst % BT; it < iend; it += BT) {
        let ie = min(it + BT, iend);
        if (!tile_needed(b, blk, k0, kend, it, ie)) { continue; }
        for (var r = 0u; r < rep; r++) {
            let h = g * rep + r;
            let lb = (b * p.s2 + h) * t;
            for (var i = it; i < ie; i += TK) {
                let ik$k = min(i + $ku, t - 1u);
                let si$k = seg_at(b * t + ik$k);
                let ri$k = reach(b, ik$k);
                let qb$k = ((b * t + ik$k) * p.s2 + h) * D4;
                let qq$k_$d = q_at(qb$k + $du);
                let oo$k_$d = dout_at(qb$k + $du);
                let lse$k = lse_at(lb + ik$k);
                let dl$k = delta_at(lb + ik$k);
                var s$r_$k = vec4<f32>(0.0);
                var c$r_$k = vec4<f32>(0.0);
                s$r_$k += k$r_$d * qq$k_$d;
                c$r_$k += v$r_$d * oo$k_$d;
                let sr$r_$k = hsum(s$r_$k);
                let cs$r_$k = cap_score(sr$r_$k);
                let p$r_$k = select(0.0, exp(cs$r_$k - lse$k), i + $ku < ie && sees(i + $ku, j$r, si$k, sj$r, ri$k));
                let ds$r_$k = p$r_$k * (hsum(c$r_$k) - dl$k) * cap_slope(cs$r_$k);
                dv$r_$d += p$r_$k * oo$k_$d;
                dk$r_$d += ds$r_$k * qq$k_$d;
            }
        }
    }
    if (k0 + lid * R + $ru < t) { dk_set(kb$r + $du, dk$r_$d * p.f0); dv_set(kb$r + $du, dv$r_$d); }
}
// @dkv end
