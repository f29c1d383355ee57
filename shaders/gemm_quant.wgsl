// GEMM with a frozen weight stored as bfloat16, float16 or as 4-bit NF4 codes, accumulated in f32:
//   C (+)= A @ op(W) (+ bias),  A (M, K) row-major (pitch lda),  C (M, N) (pitch ldc),
//   op(W) = W^T ("nt", the forward x @ W.T: K = cols of W, N = its rows) or W ("nn", the backward
//   dy @ W: K = rows of W, N = its cols). W is one row chunk (rows x cols, row-major, flattened from
//   element 0 of its buffer). NF4 weights are dequantised in registers (code * absmax), never to memory.
//   A (x or dy) and C (y or dx) are activations, each float32, bfloat16 or float16 (tensor markers,
//   device/storage.py; A's vec4 view, A_ld4, is storage.views'); C is stored by pairs of adjacent
//   columns (a 16-bit C needs o4, ldc even); the bias is float32.
//
// The file has sections per weight format (a section names the formats it serves); tuned/quant_source.py builds
// each pipeline's source by blanking the sections of other formats, and the subgroup kernels on devices
// without subgroups. No format needs
// shader-f16: float16 values are read as u32 words of two and decoded with unpack2x16float (core WGSL).
// Each format defines binding 2 (the weights), Raw8 with raw8(e) (what one load brings: elements
// e..e+7, e % 8 == 0), dec4(raw, h) (its elements 4h..4h+3 as f32) and w4(e0, e1, e2, e3) (any 4).
//   float16: binding 2 holds the f16 values (IEEE binary16, little-endian), read as u32 words of two.
//   bfloat16: the same with bfloat16 values (the top halves of f32s), decoded by a shift.
//   nf4:     binding 2 holds the bitsandbytes byte stream as u32 words (little-endian: byte j of a word
//            holds elements 2j (high nibble) and 2j + 1 (low nibble) of its 8); binding 5 the f32
//            absmax of each 64-element block of the flattened weight (blocks cross rows).
//   nf4-dq:  the same codes; binding 5 the absmax values double-quantised (8-bit indices into a code
//            table, a second-level absmax per 256 blocks, an offset), rebuilt by absmax(block).
//
// Tiling as in gemm.wgsl (a workgroup owns TM rows x 8 * WG columns of C, no workgroup memory; the
// *_sg kernel hands the A slice out by subgroupBroadcast), except that an invocation's 8 columns are
// adjacent: one NF4 word (or 16 bytes of f16) holds 8 weights along n in the nn layout and 8 along k in
// the nt layout, so each load feeds 8 weights. Each weight is decoded once per workgroup (row tile) and
// used in TM FMAs: on llvmpipe the NF4 select tree costs ~25% of the FMA work at TM = 32.
// qgemm_fast needs A 4-aligned (o1, lda % 4 == 0) and, for nt, K % 8 == 0, for nn, N % 8 == 0 (any K);
// qgemm takes any shape (a weight load per element: for odd test shapes, not for speed).

struct Params {
    M: u32, N: u32, K: u32, flags: u32,          // flags: 1 = accumulate into C, 2 = add bias
    o1: u32, lda: u32, o4: u32, ldc: u32,        // A (m, k) at o1 + m * lda + k; C (m, n) at o4 + m * ldc + n
    o3: u32, cols: u32, row0: u32, rows: u32,    // o3: bias offset; cols: row length of W; row0/rows: embed_gather only
};

@group(0) @binding(0) var<uniform> P: Params;
// @tensor 1 A read
// @tensor4 1 A read
@group(0) @binding(3) var<storage, read> BIAS: array<f32>;
// @tensor 4 C read_write

override WG: u32 = 32u;          // invocations per workgroup
override TM: u32 = 32u;          // rows of C per workgroup: 32, or 8 for skinny products
override NT: bool = true;        // op(W) = W^T (else W)

alias Acc = array<vec4<f32>, 64>;  // acc[2 * row + j]: row `row`, columns n0 + 4j .. n0 + 4j + 3

var<private> m0: u32;            // first row of this workgroup
var<private> n0: u32;            // first of this invocation's 8 adjacent columns

fn setup(wid: vec3<u32>, lid: u32) {
    m0 = wid.x * TM;
    n0 = (wid.y * WG + lid) * 8u;
}

// ---- the FMA core (gemm_register.wgsl's rank4, update_row) --------------------------------------------------

// @include gemm_register

// Element index in the chunk of op(W) (k, n).
fn w_at(k: u32, n: u32) -> u32 {
    if (NT) {
        return n * P.cols + k;
    }
    return k * P.cols + n;
}

// ---- qgemm: any shape -------------------------------------------------------------------------

// Row m of A at k..k+3, zero past K.
fn a_row(m: u32, k: u32) -> vec4<f32> {
    let r = P.o1 + min(m, P.M - 1u) * P.lda;
    let kl = P.K - 1u;
    return vec4<f32>(select(0.0, A_ld(r + min(k, kl)), k < P.K),
                     select(0.0, A_ld(r + min(k + 1u, kl)), k + 1u < P.K),
                     select(0.0, A_ld(r + min(k + 2u, kl)), k + 2u < P.K),
                     select(0.0, A_ld(r + min(k + 3u, kl)), k + 3u < P.K));
}

// op(W) row k (clamped) at columns c..c+3 (clamped).
fn w_row4(k: u32, c: u32) -> vec4<f32> {
    let kk = min(k, P.K - 1u);
    let nl = P.N - 1u;
    return w4(w_at(kk, min(c, nl)), w_at(kk, min(c + 1u, nl)), w_at(kk, min(c + 2u, nl)), w_at(kk, min(c + 3u, nl)));
}

fn update8_generic(acc: ptr<function, Acc>, r0: u32, k: u32, b0: mat4x4<f32>, b1: mat4x4<f32>) {
    let m = m0 + r0;
    update_row(acc, r0, a_row(m, k), b0, b1);
    update_row(acc, r0 + 1u, a_row(m + 1u, k), b0, b1);
    update_row(acc, r0 + 2u, a_row(m + 2u, k), b0, b1);
    update_row(acc, r0 + 3u, a_row(m + 3u, k), b0, b1);
    update_row(acc, r0 + 4u, a_row(m + 4u, k), b0, b1);
    update_row(acc, r0 + 5u, a_row(m + 5u, k), b0, b1);
    update_row(acc, r0 + 6u, a_row(m + 6u, k), b0, b1);
    update_row(acc, r0 + 7u, a_row(m + 7u, k), b0, b1);
}

@compute @workgroup_size(WG)
fn qgemm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    setup(wid, lid);
    var acc: Acc;
    for (var k = 0u; k < P.K; k += 4u) {
        let b0 = mat4x4<f32>(w_row4(k, n0), w_row4(k + 1u, n0), w_row4(k + 2u, n0), w_row4(k + 3u, n0));
        let c1 = n0 + 4u;
        let b1 = mat4x4<f32>(w_row4(k, c1), w_row4(k + 1u, c1), w_row4(k + 2u, c1), w_row4(k + 3u, c1));
        update8_generic(&acc, 0u, k, b0, b1);
        if (TM > 8u) {
            update8_generic(&acc, 8u, k, b0, b1);
            update8_generic(&acc, 16u, k, b0, b1);
            update8_generic(&acc, 24u, k, b0, b1);
        }
    }
    store_all(&acc);
}

// ---- qgemm_fast: 8 weights per load, used in two halves of 4 steps of k ---------------------------

// nt: column c's values at k..k+7 are 8 consecutive elements of row c of W, loaded once per 8 steps of k
// (raw_nt) and decoded by halves (half_nt: rows k + 4h .. k + 4h + 3 of op(W) at columns 0..3 in b0 and
// 4..7 in b1; column i of each matrix is one row of op(W)).
struct Raw8x8 { r0: Raw8, r1: Raw8, r2: Raw8, r3: Raw8, r4: Raw8, r5: Raw8, r6: Raw8, r7: Raw8 };

fn raw_nt(k: u32) -> Raw8x8 {
    let nl = P.N - 1u;
    return Raw8x8(raw8(min(n0, nl) * P.cols + k), raw8(min(n0 + 1u, nl) * P.cols + k),
                  raw8(min(n0 + 2u, nl) * P.cols + k), raw8(min(n0 + 3u, nl) * P.cols + k),
                  raw8(min(n0 + 4u, nl) * P.cols + k), raw8(min(n0 + 5u, nl) * P.cols + k),
                  raw8(min(n0 + 6u, nl) * P.cols + k), raw8(min(n0 + 7u, nl) * P.cols + k));
}

struct B4 { b0: mat4x4<f32>, b1: mat4x4<f32> };

fn half_nt(r: Raw8x8, h: bool) -> B4 {
    return B4(transpose(mat4x4<f32>(dec4(r.r0, h), dec4(r.r1, h), dec4(r.r2, h), dec4(r.r3, h))),
              transpose(mat4x4<f32>(dec4(r.r4, h), dec4(r.r5, h), dec4(r.r6, h), dec4(r.r7, h))));
}

// nn: row k + i of op(W) at the 8 columns is 8 consecutive elements of row k + i of W (rows past K clamped).
fn quad_nn(k: u32) -> B4 {
    let kl = P.K - 1u;
    let n = min(n0, P.N - 8u);
    let r0 = raw8(min(k, kl) * P.cols + n);
    let r1 = raw8(min(k + 1u, kl) * P.cols + n);
    let r2 = raw8(min(k + 2u, kl) * P.cols + n);
    let r3 = raw8(min(k + 3u, kl) * P.cols + n);
    return B4(mat4x4<f32>(dec4(r0, false), dec4(r1, false), dec4(r2, false), dec4(r3, false)),
              mat4x4<f32>(dec4(r0, true), dec4(r1, true), dec4(r2, true), dec4(r3, true)));
}

// Row m0 + r of A at k..k+3, zero past K (the vec4 load stays inside the binding: robust access).
fn a4(r: u32, k: u32) -> vec4<f32> {
    let v = A_ld4(P.o1 + min(m0 + r, P.M - 1u) * P.lda + k);
    return select(vec4<f32>(0.0), v, vec4<u32>(k, k + 1u, k + 2u, k + 3u) < vec4<u32>(P.K));
}

// Rows r0..r0+7, unrolled: indexing the accumulators with a loop variable would move them to memory.
fn update8_fast(acc: ptr<function, Acc>, r0: u32, k: u32, b: B4) {
    update_row(acc, r0, a4(r0, k), b.b0, b.b1);
    update_row(acc, r0 + 1u, a4(r0 + 1u, k), b.b0, b.b1);
    update_row(acc, r0 + 2u, a4(r0 + 2u, k), b.b0, b.b1);
    update_row(acc, r0 + 3u, a4(r0 + 3u, k), b.b0, b.b1);
    update_row(acc, r0 + 4u, a4(r0 + 4u, k), b.b0, b.b1);
    update_row(acc, r0 + 5u, a4(r0 + 5u, k), b.b0, b.b1);
    update_row(acc, r0 + 6u, a4(r0 + 6u, k), b.b0, b.b1);
    update_row(acc, r0 + 7u, a4(r0 + 7u, k), b.b0, b.b1);
}

fn step_fast(acc: ptr<function, Acc>, k: u32, b: B4) {
    update8_fast(acc, 0u, k, b);
    if (TM > 8u) {
        update8_fast(acc, 8u, k, b);
        update8_fast(acc, 16u, k, b);
        update8_fast(acc, 24u, k, b);
    }
}

@compute @workgroup_size(WG)
fn qgemm_fast(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    setup(wid, lid);
    var acc: Acc;
    if (NT) {   // K % 8 == 0
        for (var k = 0u; k < P.K; k += 8u) {
            let r = raw_nt(k);
            step_fast(&acc, k, half_nt(r, false));
            step_fast(&acc, k + 4u, half_nt(r, true));
        }
    } else {
        for (var k = 0u; k < P.K; k += 4u) {
            step_fast(&acc, k, quad_nn(k));
        }
    }
    store_all(&acc);
}

// ---- epilogue (gemm_register.wgsl's pick: the row's accumulators through a tree of selects) -----------------

// Columns n, n + 1 (n even) of row c_row (gemm_quant_store.wgsl's store_pair), none past N.
// @include gemm_quant_store
fn store2(c_row: u32, n: u32, v: vec2<f32>) {
    if (n < P.N) {
        store_pair(c_row + n, n, v);
    }
}

fn store_all(acc: ptr<function, Acc>) {
    for (var r = 0u; r < TM; r++) {
        let m = m0 + r;
        if (m >= P.M) {
            break;
        }
        let c_row = P.o4 + m * P.ldc;
        let v0 = pick(acc, r, 0u);
        let v1 = pick(acc, r, 1u);
        store2(c_row, n0, v0.xy);
        store2(c_row, n0 + 2u, v0.zw);
        store2(c_row, n0 + 4u, v1.xy);
        store2(c_row, n0 + 6u, v1.zw);
    }
}

// ---- subgroup kernels (blanked by tuned/quant_source.py when the device lacks the subgroup feature) ------
// As gemm.wgsl's *_sg kernels: lane i < 8 of each subgroup loads row r0 + i of the A slice, every lane
// reads it back with subgroupBroadcast (8x fewer A loads per invocation).

fn update8_sg(acc: ptr<function, Acc>, r0: u32, a: vec4<f32>, b: B4) {
    update_row(acc, r0, subgroupBroadcast(a, 0u), b.b0, b.b1);
    update_row(acc, r0 + 1u, subgroupBroadcast(a, 1u), b.b0, b.b1);
    update_row(acc, r0 + 2u, subgroupBroadcast(a, 2u), b.b0, b.b1);
    update_row(acc, r0 + 3u, subgroupBroadcast(a, 3u), b.b0, b.b1);
    update_row(acc, r0 + 4u, subgroupBroadcast(a, 4u), b.b0, b.b1);
    update_row(acc, r0 + 5u, subgroupBroadcast(a, 5u), b.b0, b.b1);
    update_row(acc, r0 + 6u, subgroupBroadcast(a, 6u), b.b0, b.b1);
    update_row(acc, r0 + 7u, subgroupBroadcast(a, 7u), b.b0, b.b1);
}

fn step_sg(acc: ptr<function, Acc>, lane: u32, k: u32, b: B4) {
    update8_sg(acc, 0u, a4(lane, k), b);
    if (TM > 8u) {
        let a1 = a4(8u + lane, k);
        let a2 = a4(16u + lane, k);
        let a3 = a4(24u + lane, k);
        update8_sg(acc, 8u, a1, b);
        update8_sg(acc, 16u, a2, b);
        update8_sg(acc, 24u, a3, b);
    }
}

@compute @workgroup_size(WG)
fn qgemm_fast_sg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
                 @builtin(subgroup_invocation_id) sid: u32) {
    setup(wid, lid);
    let lane = sid & 7u;
    var acc: Acc;
    if (NT) {
        for (var k = 0u; k < P.K; k += 8u) {
            let r = raw_nt(k);
            step_sg(&acc, lane, k, half_nt(r, false));
            step_sg(&acc, lane, k + 4u, half_nt(r, true));
        }
    } else {
        for (var k = 0u; k < P.K; k += 4u) {
            step_sg(&acc, lane, k, quad_nn(k));
        }
    }
    store_all(&acc);
}
// ---- end of subgroup kernels

// ---- format: nf4 nf4-dq -----------------------------------------------------------------------
@group(0) @binding(2) var<storage, read> Q: array<u32>;

// NF4_CODE[q] for 4 indices, through a tree of selects on their bits (no memory access).
fn nf4(q: vec4<u32>) -> vec4<f32> {
    let b0 = (q & vec4<u32>(1u)) != vec4<u32>(0u);
    let b1 = (q & vec4<u32>(2u)) != vec4<u32>(0u);
    let b2 = (q & vec4<u32>(4u)) != vec4<u32>(0u);
    let b3 = (q & vec4<u32>(8u)) != vec4<u32>(0u);
    let s0 = select(vec4<f32>(-1.0), vec4<f32>(-0.6961928009986877), b0);
    let s1 = select(vec4<f32>(-0.5250730514526367), vec4<f32>(-0.39491748809814453), b0);
    let s2 = select(vec4<f32>(-0.28444138169288635), vec4<f32>(-0.18477343022823334), b0);
    let s3 = select(vec4<f32>(-0.09105003625154495), vec4<f32>(0.0), b0);
    let s4 = select(vec4<f32>(0.07958029955625534), vec4<f32>(0.16093020141124725), b0);
    let s5 = select(vec4<f32>(0.24611230194568634), vec4<f32>(0.33791524171829224), b0);
    let s6 = select(vec4<f32>(0.44070982933044434), vec4<f32>(0.5626170039176941), b0);
    let s7 = select(vec4<f32>(0.7229568362236023), vec4<f32>(1.0), b0);
    let t0 = select(s0, s1, b1);
    let t1 = select(s2, s3, b1);
    let t2 = select(s4, s5, b1);
    let t3 = select(s6, s7, b1);
    return select(select(t0, t1, b2), select(t2, t3, b2), b3);
}

// Elements e..e+7 (e % 8 == 0: one word, one block): the word and the block's absmax, decoded by halves.
alias Raw8 = vec2<u32>;

fn raw8(e: u32) -> Raw8 {
    return vec2<u32>(Q[e >> 3u], bitcast<u32>(absmax(e >> 6u)));
}

// Elements 0..3 (h false) or 4..7 (h true) of a raw8.
fn dec4(r: Raw8, h: bool) -> vec4<f32> {
    let shifts = select(vec4<u32>(4u, 0u, 12u, 8u), vec4<u32>(20u, 16u, 28u, 24u), h);
    return nf4((vec4<u32>(r.x) >> shifts) & vec4<u32>(15u)) * bitcast<f32>(r.y);
}

fn nibble(e: u32) -> u32 {
    return (Q[e >> 3u] >> (((e >> 1u) & 3u) * 8u + 4u - (e & 1u) * 4u)) & 15u;
}

fn w4(e0: u32, e1: u32, e2: u32, e3: u32) -> vec4<f32> {
    let q = vec4<u32>(nibble(e0), nibble(e1), nibble(e2), nibble(e3));
    return nf4(q) * vec4<f32>(absmax(e0 >> 6u), absmax(e1 >> 6u), absmax(e2 >> 6u), absmax(e3 >> 6u));
}

// ---- format: nf4 ------------------------------------------------------------------------------
@group(0) @binding(5) var<storage, read> S: array<f32>;

fn absmax(b: u32) -> f32 {
    return S[b];
}

// ---- format: nf4-dq ---------------------------------------------------------------------------
// Binding 5 holds the chunk's double-quantised absmax values as u32 words (tuned/quant.py's layout): the
// offset, the chunk's first block modulo 256, the word where the 8-bit indices start, a spare word, the
// second-level absmax of each 256-block group, then the indices, four per word. Binding 6 is the 8-bit
// code table (256 f32 values, shared by every weight).
@group(0) @binding(5) var<storage, read> D: array<u32>;
@group(0) @binding(6) var<storage, read> CODE8: array<f32>;

fn absmax(b: u32) -> f32 {
    let q = (D[D[2u] + (b >> 2u)] >> ((b & 3u) * 8u)) & 255u;
    let group = (D[1u] + b) >> 8u;
    return CODE8[q] * bitcast<f32>(D[4u + group]) + bitcast<f32>(D[0u]);
}

// ---- format: bfloat16 -------------------------------------------------------------------------
// A bfloat16 value is the top half of an f32: its bits shifted up.
fn unpack2(u: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(u << 16u), bitcast<f32>(u & 0xffff0000u));
}

// ---- format: float16 --------------------------------------------------------------------------
// unpack2x16float: core WGSL, so float16 weights need no shader-f16.
fn unpack2(u: u32) -> vec2<f32> {
    return unpack2x16float(u);
}

// ---- format: float16 bfloat16 -----------------------------------------------------------------
// The 16-bit values packed two per u32 (element 2i in the low half, as little-endian bytes), decoded by the
// format's unpack2.
@group(0) @binding(2) var<storage, read> H2: array<u32>;
@group(0) @binding(2) var<storage, read> H8: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> IDS: array<i32>;
// @tensor 3 OUT read_write

// Elements e..e+7 (e % 8 == 0), decoded by halves.
alias Raw8 = vec4<u32>;

fn raw8(e: u32) -> Raw8 {
    return H8[e >> 3u];
}

fn dec4(r: Raw8, h: bool) -> vec4<f32> {
    let p = select(r.xy, r.zw, h);
    return vec4<f32>(unpack2(p.x), unpack2(p.y));
}

fn h1(e: u32) -> f32 {
    let v = unpack2(H2[e >> 1u]);
    return select(v.x, v.y, (e & 1u) != 0u);
}

fn w4(e0: u32, e1: u32, e2: u32, e3: u32) -> vec4<f32> {
    return vec4<f32>(h1(e0), h1(e1), h1(e2), h1(e3));
}

// Elements e, e + 1 (one word when e is even).
fn h2(e: u32) -> vec2<f32> {
    if ((e & 1u) == 0u) {
        return unpack2(H2[e >> 1u]);
    }
    return vec2<f32>(h1(e), h1(e + 1u));
}

// Token t's row in the vocabulary chunk, or -1 when its id lies outside the chunk.
fn chunk_row(t: u32) -> i32 {
    let r = IDS[P.o1 + t] - i32(P.row0);
    return select(-1, r, r >= 0 && u32(r) < P.rows);
}

// Embedding rows from a 16-bit vocabulary chunk (embed_gather: bindings 0..3): OUT[o3 + t * cols + c] =
// W[ids[o1 + t] - row0, c] for ids in [row0, row0 + rows); M = tokens; other tokens are left untouched (one call
// per chunk). An invocation per pair of OUT's elements, stored as a pair when both lie in one row (always for a
// 16-bit OUT: its rows are even), else one by one (odd cols, float32 OUT; or the last element of an odd count).
@compute @workgroup_size(64)
fn embed_gather(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = 2u * (gid.y * nwg.x * 64u + gid.x);
    let n = P.M * P.cols;
    if (i >= n) {
        return;
    }
    let t = i / P.cols;
    let c = i % P.cols;
    let r = chunk_row(t);
    if (i + 1u < n && c + 1u < P.cols) {
        if (r >= 0) {
            OUT_st2(P.o3 + i, h2(u32(r) * P.cols + c));
        }
        return;
    }
    if (r >= 0) {
        OUT_st(P.o3 + i, h1(u32(r) * P.cols + c));
    }
    if (i + 1u < n) {
        let r1 = chunk_row(t + 1u);
        if (r1 >= 0) {
            OUT_st(P.o3 + i + 1u, h1(u32(r1) * P.cols));
        }
    }
}
// ---- end of formats
