// Tiled flash attention: causal grouped-query attention with segment (packing) masks and sliding windows,
// forward and backward, as two GEMM-shaped phases per tile (the shape of shaders/gemm.wgsl).
//
// A workgroup owns a block of TQ rows of one (batch, head): queries in the forward and the dq pass, keys of
// one kv head in the dk / dv pass. It walks the other side in tiles of BT = 4 * NI rows; a tile that no row
// of the block may see (before the window, or without a segment id in common: packed rows) is skipped
// whole, so a packed row costs the sum of len^2, not T^2.
//  1. Scores: invocation l owns 4 rows of the tile (keys, or queries in dk / dv) and computes their scores
//     against all TQ block rows: the block rows are the same for the whole workgroup (one address per load),
//     its own 4 rows come as one 4 x 4 matrix per 4 of the head dim, TQ x 4 accumulators in registers.
//     The forward reduces the row maxima across invocations through workgroup memory (online softmax in f32).
//     The probabilities (or dS) go to workgroup memory, a TQ x BT tile.
//  2. Products: invocation l owns TQ / QG block rows x 4 * G4 columns of the output (QG x DG invocations) and
//     adds P (or dS) x the tile's rows: the P tile entries are again one address per load when QG = 1.
// No T x T buffer exists: the forward saves logsumexp, the backward recomputes P per tile. Nothing but the
// P / dS tiles and a few per-row values lives in workgroup memory; llvmpipe pays for every invocation-
// varying load, and these phases keep them to 4 per 4 x TQ x 4 FMAs.
//
// attention_source.source() specialises this text: it rewrites the const block, keeps the @forward, @dq
// or @dkv sections, and writes every line holding `$q` once per block row (TQ), `$c` once per group of 4
// own tile rows (KV), `$o` once per owned output row (TO) and `$g` once per owned column group (G4) (several markers: once per combination), with the
// marker replaced by the index, all on the same line: line numbers stay those of this file.
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
const TQ: u32 = 32u;    // block rows per workgroup
const NI: u32 = 8u;     // invocations per workgroup (a multiple of 4)
const KV: u32 = 2u;     // groups of 4 tile rows per invocation in the score phase
const DG: u32 = 8u;     // column groups of the product phase (QG = NI / DG row groups)
// @flash-config end
const NK: u32 = NI * KV;      // groups of 4 rows per tile
const BT: u32 = 4u * NK;      // tile rows
const NI4: u32 = NI / 4u;
const QG: u32 = NI / DG;      // row groups of the product phase
const TO: u32 = TQ / QG;      // block rows per invocation in the product phase
const G4: u32 = D4 / DG;      // vec4 columns per invocation in the product phase

// P (forward, dk / dv) or dS (dq): [buffer][block row][tile row / 4]. The backward passes alternate two
// buffers, so one barrier per tile suffices; the forward's second barrier makes the first buffer enough.
var<workgroup> tile_p: array<vec4<f32>, TQ * NK * BUFFERS>;
// per block row, one f32 per invocation (maxima, then sums), read back 4 at a time. Scalars, not vec4
// components: a store to one component of a shared vec4 may compile to a read-modify-write of the whole
// vector (HLSL, MSL), which would lose the other invocations' values.
var<workgroup> row_a: array<f32, TQ * NI>;
var<workgroup> row_b: array<f32, TQ * 2u>;          // per block row: rescale and 1 / l (forward)
var<workgroup> range_: vec2<u32>;                   // the first tile and the end of the tiles the block needs

// Query i (reach ri) against keys j (4 of them, segment ids sj) of which those below `end` exist.
fn sees4(i: u32, j: vec4<u32>, si: i32, sj: vec4<i32>, end: u32, ri: u32) -> vec4<bool> {
    return vec4<bool>(j.x < end && sees(i, j.x, si, sj.x, ri), j.y < end && sees(i, j.y, si, sj.y, ri),
                      j.z < end && sees(i, j.z, si, sj.z, ri), j.w < end && sees(i, j.w, si, sj.w, ri));
}

// Queries i (4 of them, segment ids si, reaches ri) of which those below `end` exist, against key j.
fn seen4(i: vec4<u32>, j: u32, si: vec4<i32>, sj: i32, end: u32, ri: vec4<u32>) -> vec4<bool> {
    return vec4<bool>(i.x < end && sees(i.x, j, si.x, sj, ri.x), i.y < end && sees(i.y, j, si.y, sj, ri.y),
                      i.z < end && sees(i.z, j, si.z, sj, ri.z), i.w < end && sees(i.w, j, si.w, sj, ri.w));
}

fn hmax(a: vec4<f32>) -> f32 { return max(max(a.x, a.y), max(a.z, a.w)); }

// acc + sum_i a[i] * m[i] (m's columns).
fn rank4(acc: vec4<f32>, a: vec4<f32>, m: mat4x4<f32>) -> vec4<f32> {
    return acc + a.x * m[0] + a.y * m[1] + a.z * m[2] + a.w * m[3];
}

// [first, end) of the tiles (starts at a multiple of BT) that rows [r0, r1) of batch row b need, searched
// from lo to hi: the first and the last tile that may share a segment id with the block (or, with padding
// in the block, hold its own rows: a padding row sees only itself). Tiles between them are walked too (any
// rows sharing an id, packed rows are contiguous) and masked. Made uniform for the workgroup's barriers.
fn tile_range(lid: u32, b: u32, r0: u32, r1: u32, lo: u32, hi: u32) -> vec2<u32> {
    if (lid == 0u) {
        let blk = seg_range(b, r0, r1);
        var first = hi;
        var end = lo;
        for (var x = lo - lo % BT; x < hi; x += BT) {
            let e = min(x + BT, hi);
            if (overlap(blk, seg_range(b, x, e)) || (blk.z != 0 && x < r1 && e > r0)) {
                first = min(first, x);
                end = e;
            }
        }
        range_ = vec2<u32>(first, end);
    }
    return workgroupUniformLoad(&range_);
}

// Four consecutive entries of row_a, from x.
fn row4(x: u32) -> vec4<f32> {
    return vec4<f32>(row_a[x], row_a[x + 1u], row_a[x + 2u], row_a[x + 3u]);
}

// The 4 tile rows of group c of invocation lid in the tile that starts at `start`.
fn own_rows(start: u32, lid: u32, c: u32) -> vec4<u32> {
    return vec4<u32>(start + 4u * (lid * KV + c)) + vec4<u32>(0u, 1u, 2u, 3u);
}

// ==== forward (its bindings: shaders/attention_common.wgsl) ====
// @forward begin
const BUFFERS: u32 = 1u;

@compute @workgroup_size(NI)
fn attention_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    // @setup queries TQ
    let last = vec4<u32>(t - 1u);
    let iq$q = min(q0 + $qu, t - 1u);
    let sq$q = seg_at(b * t + iq$q);
    let rq$q = reach(b, iq$q);
    let qr$q = ((b * t + iq$q) * p.s2 + h) * D4;
    var m$q = -3.0e38;
    var l$q = 0.0;
    let og = select(lid / DG, 0u, QG == 1u);   // a constant 0 with one row group: uniform loads of the tiles
    let c0 = (lid % DG) * G4;
    var acc$o_$g = vec4<f32>(0.0);
    let kstop = reach(b, qend - 1u) + 1u;
    let tiles = tile_range(lid, b, q0, qend, window_start(q0), kstop);
    for (var kt = tiles.x; kt < tiles.y; kt += BT) {
        let kend = min(kt + BT, kstop);
        // 1. scores of the block rows against this invocation's 4 * KV keys
        let j$c = own_rows(kt, lid, $cu);
        let jc$c = min(j$c, last);
        let sk$c = vec4<i32>(seg_at(b * t + jc$c.x), seg_at(b * t + jc$c.y), seg_at(b * t + jc$c.z), seg_at(b * t + jc$c.w));
        let kr$c = ((vec4<u32>(b * t) + jc$c) * p.s3 + vec4<u32>(g)) * D4;
        var sv$q_$c = vec4<f32>(0.0);
        for (var d = 0u; d < D4; d++) {
            let kt$c = transpose(mat4x4<f32>(k_at(kr$c.x + d), k_at(kr$c.y + d), k_at(kr$c.z + d), k_at(kr$c.w + d)));
            let qq$q = q_at(qr$q + d);
            sv$q_$c = rank4(sv$q_$c, qq$q, kt$c);
        }
        let ok$q_$c = sees4(iq$q, j$c, sq$q, sk$c, kend, rq$q);
        let sc$q_$c = select(vec4<f32>(-3.0e38), cap_score4(sv$q_$c * p.f0), ok$q_$c);
        var pm$q = -3.0e38;
        pm$q = max(pm$q, hmax(sc$q_$c));
        row_a[$qu * NI + lid] = pm$q;
        workgroupBarrier();
        // online softmax: the block rows' new maxima from every invocation's partial ones
        var mx$q = m$q;
        for (var l = 0u; l < NI4; l++) {
            mx$q = max(mx$q, hmax(row4($qu * NI + 4u * l)));
        }
        let pv$q_$c = select(vec4<f32>(0.0), exp(sc$q_$c - vec4<f32>(mx$q)), ok$q_$c);
        tile_p[$qu * NK + lid * KV + $cu] = pv$q_$c;
        // l: this invocation's part of the row sums (its keys), all against the same maxima
        let cr$q = exp(m$q - mx$q);
        l$q = l$q * cr$q;
        l$q += hsum(pv$q_$c);
        m$q = mx$q;
        if (lid == 0u && QG > 1u) { row_b[$qu] = cr$q; }
        workgroupBarrier();
        // 2. acc = acc * rescale + P V over this invocation's rows and columns (the barrier above also keeps
        // the next tile from writing tile_p and row_a before every invocation is done with this one)
        let co$o = select(row_b[og * TO + $ou], cr$o, QG == 1u);
        acc$o_$g = acc$o_$g * co$o;
        for (var n4 = 0u; n4 < NK; n4++) {
            let kn = kt + 4u * n4;
            if (kn >= kend) { break; }
            let vr = ((vec4<u32>(b * t) + min(vec4<u32>(kn) + vec4<u32>(0u, 1u, 2u, 3u), last)) * p.s3 + vec4<u32>(g)) * D4 + vec4<u32>(c0);
            let vm$g = mat4x4<f32>(v_at(vr.x + $gu), v_at(vr.y + $gu), v_at(vr.z + $gu), v_at(vr.w + $gu));
            let pp$o = tile_p[(og * TO + $ou) * NK + n4];
            acc$o_$g = rank4(acc$o_$g, pp$o, vm$g);
        }
    }
    // the row sums from every invocation's part
    workgroupBarrier();
    row_a[$qu * NI + lid] = l$q;
    workgroupBarrier();
    var sum$q = 0.0;
    for (var l = 0u; l < NI4; l++) {
        sum$q += hsum(row4($qu * NI + 4u * l));
    }
    if (lid == 0u) { row_b[TQ + $qu] = 1.0 / sum$q; }
    if (lid == 0u && q0 + $qu < t) { lse_set((b * p.s2 + h) * t + q0 + $qu, m$q + log(sum$q)); }
    workgroupBarrier();
    let io$o = og * TO + $ou;
    if (q0 + io$o < t) { let inv = row_b[TQ + io$o]; let ob = ((b * t + q0 + io$o) * p.s2 + h) * D4 + c0; att_set(ob + $gu, acc$o_$g * inv); }
}
// @forward end

// ==== dq, delta fused (its bindings: shaders/attention_common.wgsl) ====
// @dq begin
const BUFFERS: u32 = 2u;

@compute @workgroup_size(NI)
fn attention_backward_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    // @setup queries TQ
    let last = vec4<u32>(t - 1u);
    let iq$q = min(q0 + $qu, t - 1u);
    let sq$q = seg_at(b * t + iq$q);
    let rq$q = reach(b, iq$q);
    let qr$q = ((b * t + iq$q) * p.s2 + h) * D4;
    let lse$q = lse_at((b * p.s2 + h) * t + iq$q);
    // delta = rowsum(dout * out), also saved for the dk / dv pass
    var e$q = vec4<f32>(0.0);
    for (var d = 0u; d < D4; d++) {
        e$q += dout_at(qr$q + d) * att_at(qr$q + d);
    }
    let dl$q = hsum(e$q);
    if (lid == 0u && q0 + $qu < t) { delta_set((b * p.s2 + h) * t + q0 + $qu, dl$q); }
    let og = select(lid / DG, 0u, QG == 1u);
    let c0 = (lid % DG) * G4;
    var acc$o_$g = vec4<f32>(0.0);
    var buf = 0u;
    let kstop = reach(b, qend - 1u) + 1u;
    let tiles = tile_range(lid, b, q0, qend, window_start(q0), kstop);
    for (var kt = tiles.x; kt < tiles.y; kt += BT) {
        let kend = min(kt + BT, kstop);
        // 1. dS = P * (dP - delta) of the block rows against this invocation's 4 * KV keys
        let j$c = own_rows(kt, lid, $cu);
        let jc$c = min(j$c, last);
        let sk$c = vec4<i32>(seg_at(b * t + jc$c.x), seg_at(b * t + jc$c.y), seg_at(b * t + jc$c.z), seg_at(b * t + jc$c.w));
        let kr$c = ((vec4<u32>(b * t) + jc$c) * p.s3 + vec4<u32>(g)) * D4;
        var sv$q_$c = vec4<f32>(0.0);
        var dp$q_$c = vec4<f32>(0.0);
        for (var d = 0u; d < D4; d++) {
            let kt$c = transpose(mat4x4<f32>(k_at(kr$c.x + d), k_at(kr$c.y + d), k_at(kr$c.z + d), k_at(kr$c.w + d)));
            let vt$c = transpose(mat4x4<f32>(v_at(kr$c.x + d), v_at(kr$c.y + d), v_at(kr$c.z + d), v_at(kr$c.w + d)));
            let qq$q = q_at(qr$q + d);
            let dd$q = dout_at(qr$q + d);
            sv$q_$c = rank4(sv$q_$c, qq$q, kt$c);
            dp$q_$c = rank4(dp$q_$c, dd$q, vt$c);
        }
        let ok$q_$c = sees4(iq$q, j$c, sq$q, sk$c, kend, rq$q);
        let cs$q_$c = cap_score4(sv$q_$c * p.f0);
        tile_p[buf + $qu * NK + lid * KV + $cu] = select(vec4<f32>(0.0), exp(cs$q_$c - vec4<f32>(lse$q)) * (dp$q_$c - vec4<f32>(dl$q)) * cap_slope4(cs$q_$c), ok$q_$c);
        workgroupBarrier();
        // 2. dq += dS K over this invocation's rows and columns
        for (var n4 = 0u; n4 < NK; n4++) {
            let kn = kt + 4u * n4;
            if (kn >= kend) { break; }
            let kr = ((vec4<u32>(b * t) + min(vec4<u32>(kn) + vec4<u32>(0u, 1u, 2u, 3u), last)) * p.s3 + vec4<u32>(g)) * D4 + vec4<u32>(c0);
            let km$g = mat4x4<f32>(k_at(kr.x + $gu), k_at(kr.y + $gu), k_at(kr.z + $gu), k_at(kr.w + $gu));
            let ds$o = tile_p[buf + (og * TO + $ou) * NK + n4];
            acc$o_$g = rank4(acc$o_$g, ds$o, km$g);
        }
        buf ^= TQ * NK;
    }
    let io$o = og * TO + $ou;
    if (q0 + io$o < t) { let ob = ((b * t + q0 + io$o) * p.s2 + h) * D4 + c0; dq_set(ob + $gu, acc$o_$g * p.f0); }
}
// @dq end

// ==== dk, dv (their bindings: shaders/attention_common.wgsl) ====
// One workgroup per block of keys of one kv head: sums over the query heads of its group and the queries
// that see each key, so every dk / dv row has exactly one writer (no atomics).
// @dkv begin
const BUFFERS: u32 = 2u;

var<workgroup> tile_ds: array<vec4<f32>, TQ * NK * BUFFERS>;  // dS: [buffer][key][query / 4]

@compute @workgroup_size(NI)
fn attention_backward_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    // @setup keys TQ
    let last = vec4<u32>(t - 1u);
    let jq$q = min(k0 + $qu, t - 1u);
    let sk$q = seg_at(b * t + jq$q);
    let kr$q = ((b * t + jq$q) * p.s3 + g) * D4;
    let og = select(lid / DG, 0u, QG == 1u);
    let c0 = (lid % DG) * G4;
    var dka$o_$g = vec4<f32>(0.0);
    var dva$o_$g = vec4<f32>(0.0);
    let iend = window_end(kend - 1u, t);
    let tiles = tile_range(lid, b, k0, kend, block_start(b, k0), iend);
    var buf = 0u;
    for (var it = tiles.x; it < tiles.y; it += BT) {
        let ie = min(it + BT, iend);
        let i$c = own_rows(it, lid, $cu);
        let ic$c = min(i$c, last);
        let si$c = vec4<i32>(seg_at(b * t + ic$c.x), seg_at(b * t + ic$c.y), seg_at(b * t + ic$c.z), seg_at(b * t + ic$c.w));
        let ri$c = vec4<u32>(reach(b, ic$c.x), reach(b, ic$c.y), reach(b, ic$c.z), reach(b, ic$c.w));
        for (var r = 0u; r < rep; r++) {
            let h = g * rep + r;
            // 1. P and dS of the block's keys against this invocation's 4 * KV queries
            let qr$c = ((vec4<u32>(b * t) + ic$c) * p.s2 + vec4<u32>(h)) * D4;
            let lb = (b * p.s2 + h) * t;
            let lse$c = vec4<f32>(lse_at(lb + ic$c.x), lse_at(lb + ic$c.y), lse_at(lb + ic$c.z), lse_at(lb + ic$c.w));
            let dl$c = vec4<f32>(delta_at(lb + ic$c.x), delta_at(lb + ic$c.y), delta_at(lb + ic$c.z),
                                 delta_at(lb + ic$c.w));
            var sv$q_$c = vec4<f32>(0.0);
            var dp$q_$c = vec4<f32>(0.0);
            for (var d = 0u; d < D4; d++) {
                let qt$c = transpose(mat4x4<f32>(q_at(qr$c.x + d), q_at(qr$c.y + d), q_at(qr$c.z + d), q_at(qr$c.w + d)));
                let ot$c = transpose(mat4x4<f32>(dout_at(qr$c.x + d), dout_at(qr$c.y + d), dout_at(qr$c.z + d), dout_at(qr$c.w + d)));
                let kk$q = k_at(kr$q + d);
                let vv$q = v_at(kr$q + d);
                sv$q_$c = rank4(sv$q_$c, kk$q, qt$c);
                dp$q_$c = rank4(dp$q_$c, vv$q, ot$c);
            }
            let cs$q_$c = cap_score4(sv$q_$c * p.f0);
            let pv$q_$c = select(vec4<f32>(0.0), exp(cs$q_$c - lse$c), seen4(i$c, jq$q, si$c, sk$q, ie, ri$c));
            tile_p[buf + $qu * NK + lid * KV + $cu] = pv$q_$c;
            tile_ds[buf + $qu * NK + lid * KV + $cu] = pv$q_$c * (dp$q_$c - dl$c) * cap_slope4(cs$q_$c);
            workgroupBarrier();
            // 2. dv += P^T dout, dk += dS^T q over this invocation's key rows and columns
            for (var n4 = 0u; n4 < NK; n4++) {
                let qn = it + 4u * n4;
                if (qn >= ie) { break; }
                let w = ((vec4<u32>(b * t) + min(vec4<u32>(qn) + vec4<u32>(0u, 1u, 2u, 3u), last)) * p.s2 + vec4<u32>(h)) * D4 + vec4<u32>(c0);
                let qm$g = mat4x4<f32>(q_at(w.x + $gu), q_at(w.y + $gu), q_at(w.z + $gu), q_at(w.w + $gu));
                let om$g = mat4x4<f32>(dout_at(w.x + $gu), dout_at(w.y + $gu), dout_at(w.z + $gu), dout_at(w.w + $gu));
                let pp$o = tile_p[buf + (og * TO + $ou) * NK + n4];
                let ds$o = tile_ds[buf + (og * TO + $ou) * NK + n4];
                dva$o_$g = rank4(dva$o_$g, pp$o, om$g);
                dka$o_$g = rank4(dka$o_$g, ds$o, qm$g);
            }
            buf ^= TQ * NK;
        }
    }
    let jo$o = og * TO + $ou;
    if (k0 + jo$o < t) { let kb = ((b * t + k0 + jo$o) * p.s3 + g) * D4 + c0; dk_set(kb + $gu, dka$o_$g * p.f0); dv_set(kb + $gu, dva$o_$g); }
}
// @dkv end
