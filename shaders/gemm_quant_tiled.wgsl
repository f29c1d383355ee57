// Workgroup-tiled GEMM for real GPUs with a frozen weight stored as bfloat16, float16 or NF4 (gemm_quant.wgsl's
// formats), accumulated in f32 (float32 arithmetic, or float16 arithmetic for a float16 weight and A: gemm_core):
//   C (+)= A @ op(W) (+ bias),  A (M, K) row-major (pitch lda),  C (M, N) (pitch ldc), A and C each
//   float32 or 16-bit (as in gemm_quant.wgsl: C stored by pairs of columns),
//   op(W) = W^T ("nt", the forward x @ W.T: K = cols of W, N = the chunk's rows) or W ("nn", the backward
//   dy @ W: K = the chunk's rows, N = cols). W is one row chunk (rows x cols, row-major, from element 0 of
//   its buffer), as tuned/quant.py's QuantMatrix stores it.
//
// This file is a template: tuned/quant_source.py rewrites the marked const block (tile sizes and NT) and
// appends gemm_quant.wgsl's format sections for the weight's format (bindings 2, 5 and 6, raw8 and dec4),
// so that both GEMMs decode the same bytes with the same code. Lines of this file keep their numbers.
//
// Tiling as gemm_tiled.wgsl: workgroup (x, y) owns the BM x BN tile of C at column x * BN, row y * BM.
// Each step of k stages a BM x BK tile of A (stored transposed, As[k][m]) and a BK x BN tile of op(W)
// (Bs[k][n]) in workgroup memory; an invocation keeps TM x TN outputs in registers, its rows TM / 4 groups
// of 4 adjacent rows spaced 4 * BM / TM apart (columns likewise, 4 * TX apart), so that neighbouring
// invocations read neighbouring vec4s of As / Bs.
// The weight tile is decoded while it is staged: an invocation loads 8 consecutive elements of one row of
// W (nt: 8 steps of k at one column n; nn: 8 columns at one k), decodes them to f32 and stores them in Bs (as
// Elem: f16 in float16 arithmetic, exact for the float16 weights it takes).
// So each weight is decoded once per workgroup and used by BM rows of A, and no f32 copy of W exists in
// global memory. When cols % 8 == 0 each group is one raw8 load (one NF4 word and its absmax, or 16 bytes
// of f16); otherwise a group may straddle two (w8). A is read with scalar loads (any offset and pitch).
// Tile elements outside A / op(W) are staged as zero and stores outside C are skipped: any M, N, K >= 1.
// One entry point, qgemm_tiled (the decoders only read binding 2 through raw8's view: naga rejects an
// entry point that uses two views of one binding, such as float16's H2 and H8).

struct Params {
    M: u32, N: u32, K: u32, flags: u32,          // flags: 1 = accumulate into C, 2 = add bias
    o1: u32, lda: u32, o4: u32, ldc: u32,        // A (m, k) at o1 + m * lda + k; C (m, n) at o4 + m * ldc + n
    o3: u32, cols: u32, row0: u32, rows: u32,    // o3: bias offset; cols: row length of W; row0/rows: the appended
                                                 // float16 section's embed_gather only
};

@group(0) @binding(0) var<uniform> P: Params;
// @tensor 1 A read
@group(0) @binding(3) var<storage, read> BIAS: array<f32>;
// @tensor 4 C read_write

// @tile-config begin: quant_tiled.qtiled_source() rewrites these lines in place (one per name)
const BM: u32 = 64u;    // rows of C per workgroup
const BN: u32 = 64u;    // columns of C per workgroup (a multiple of 8)
const BK: u32 = 16u;    // steps of k per staged tile (a multiple of 8: whole NF4 words in nt)
const TM: u32 = 8u;     // rows of C per invocation (a multiple of 4)
const TN: u32 = 4u;     // columns of C per invocation (a multiple of 4)
const NBUF: u32 = 1u;   // 2: double-buffered tiles
const NT: bool = true;  // op(W) = W^T (else W)
alias Elem = f32;       // the tiles' element type: f16 for f16 arithmetic (gemm_core.wgsl; float16 weights only)
// @tile-config end

const TX: u32 = BN / TN;                  // invocations along n
const WG: u32 = (BM / TM) * TX;           // invocations per workgroup
const SA: u32 = (BM * BK + 4u * WG - 1u) / (4u * WG);   // staging vec4s per invocation for A (4 loads each)
const G8: u32 = BN * BK / 8u;             // 8-element weight groups per tile
const SW: u32 = (G8 + WG - 1u) / WG;      // weight groups per invocation
const GK: u32 = BK / 8u;                  // nt: groups along k per column of the tile
const GN: u32 = BN / 8u;                  // nn: groups along n per row of the tile
const AROW: u32 = BM / 4u;                // vec4 pitch of a k row of As (the names gemm_core.wgsl reads)
const BROW: u32 = BN / 4u;                // of Bs
const ABUF: u32 = AROW * BK;              // vec4s per buffer of As (an A tile)
const BBUF: u32 = BROW * BK;              // of Bs (a weight tile)

var<workgroup> As: array<vec4<Elem>, NBUF * ABUF>;   // [buffer][k][m / 4]
var<workgroup> Bs: array<vec4<Elem>, NBUF * BBUF>;   // [buffer][k][n / 4], decoded

// 8 decoded weights: lo elements 0..3, hi 4..7 of a group.
struct W8 { lo: vec4<f32>, hi: vec4<f32> };

// The next tiles on their way to workgroup memory. A slot l holds A tile elements (4l + c) * WG + lid,
// c < 4; w[s] holds weight group s * WG + lid.
struct Stage {
    a: array<vec4<f32>, SA>,
    w: array<W8, SW>,
};

alias Acc = array<vec4<f32>, TM * TN / 4u>;   // acc[i * TN / 4 + h]: row i, column group h

var<private> lid: u32;
var<private> tx: u32;
var<private> ty: u32;
var<private> m0: u32;          // first row of this workgroup's tile
var<private> n0: u32;          // first column

fn setup(wid: vec3<u32>, local: u32) {
    lid = local;
    tx = local % TX;
    ty = local / TX;
    n0 = wid.x * BN;
    m0 = wid.y * BM;
}

// (k, n) in the weight tile of group g's first element: nt groups run along k, nn groups along n.
fn g_pos(g: u32) -> vec2<u32> {
    if (NT) {
        return vec2<u32>(8u * (g % GK), g / GK);
    }
    return vec2<u32>(g / GN, 8u * (g % GN));
}

// The group's 8 elements are 8 consecutive elements of one row of W, from element e of the chunk on;
// col is e's column in W (nt: k, nn: n; every row has P.cols elements). valid: the group's row of W exists
// (nt: n < N, nn: k < K) and it starts inside the row; its elements past the row's end are staged as zero
// (belt and braces: they meet only zeros of A in nt and columns never stored in nn).
struct Group { e: u32, col: u32, valid: bool };

fn group_at(k: u32, n: u32) -> Group {
    if (NT) {
        return Group(n * P.cols + k, k, n < P.N && k < P.K);
    }
    return Group(k * P.cols + n, n, k < P.K && n < P.N);
}

// The group's 8 weights. When it is one raw8 (e % 8 == 0 and whole: always when cols % 8 == 0), one load
// and two dec4. Otherwise it straddles two raw8 groups: both are decoded and the 8 wanted values picked
// by shifting the 16 by e % 8 (a tree of selects: no indexing of private arrays). Either way every value
// comes from gemm_quant.wgsl's dec4, so both GEMMs decode a weight to the same f32.
fn w8(k: u32, n: u32) -> W8 {
    let g = group_at(k, n);
    if (!g.valid) {
        return W8(vec4<f32>(0.0), vec4<f32>(0.0));
    }
    let s = g.e & 7u;
    if (s == 0u && g.col + 8u <= P.cols) {
        let r = raw8(g.e);
        return W8(dec4(r, false), dec4(r, true));
    }
    // the second group holds the row's elements past the first one's end, if any (else it is the first
    // again, whose values then land only on masked positions): both inside the chunk's buffer
    let ga = g.e - s;
    let gb = (g.e - g.col + min(g.col + 7u, P.cols - 1u)) & ~7u;
    let ra = raw8(ga);
    let rb = raw8(gb);
    let q0 = dec4(ra, false);
    let q1 = dec4(ra, true);
    let q2 = dec4(rb, false);
    let q3 = dec4(rb, true);
    let b4 = (s & 4u) != 0u;
    let b2 = (s & 2u) != 0u;
    let b1 = (s & 1u) != 0u;
    let x0 = select(q0, q1, b4);                     // values 4 * b4 .. of the 16
    let x1 = select(q1, q2, b4);
    let x2 = select(q2, q3, b4);
    let y0 = select(x0, vec4<f32>(x0.zw, x1.xy), b2);  // then 2 * b2 further
    let y1 = select(x1, vec4<f32>(x1.zw, x2.xy), b2);
    let y2 = select(x2.x, x2.z, b2);
    let z0 = select(y0, vec4<f32>(y0.yzw, y1.x), b1);  // then b1 further: values s .. s + 7
    let z1 = select(y1, vec4<f32>(y1.yzw, y2), b1);
    let c0 = vec4<u32>(g.col) + vec4<u32>(0u, 1u, 2u, 3u);
    let c1 = c0 + vec4<u32>(4u);
    return W8(select(vec4<f32>(0.0), z0, c0 < vec4<u32>(P.cols)), select(vec4<f32>(0.0), z1, c1 < vec4<u32>(P.cols)));
}

// ---- staging: scalar loads of A (consecutive invocations along k), weight groups decoded --------------

fn load_a(st: ptr<function, Stage>, k0: u32) {
    for (var l = 0u; l < SA; l++) {
        var v = vec4<f32>(0.0);
        for (var c = 0u; c < 4u; c++) {
            let e = (4u * l + c) * WG + lid;
            let m = m0 + e / BK;
            let k = k0 + e % BK;
            if (e < BM * BK && m < P.M && k < P.K) {
                v[c] = A_ld(P.o1 + m * P.lda + k);
            }
        }
        (*st).a[l] = v;
    }
}

fn load_w(st: ptr<function, Stage>, k0: u32) {
    for (var s = 0u; s < SW; s++) {
        let g = s * WG + lid;
        var w = W8(vec4<f32>(0.0), vec4<f32>(0.0));
        if (g < G8) {
            let p = g_pos(g);
            w = w8(k0 + p.x, n0 + p.y);
        }
        (*st).w[s] = w;
    }
}

fn put(st: ptr<function, Stage>, buf: u32) {
    for (var l = 0u; l < SA; l++) {
        for (var c = 0u; c < 4u; c++) {
            let e = (4u * l + c) * WG + lid;
            if (e < BM * BK) {
                let m = e / BK;
                As[buf * ABUF + (e % BK) * AROW + m / 4u][m % 4u] = Elem((*st).a[l][c]);
            }
        }
    }
    for (var s = 0u; s < SW; s++) {
        let g = s * WG + lid;
        if (g < G8) {
            let p = g_pos(g);
            let w = (*st).w[s];
            let i = buf * BBUF + p.x * BROW + p.y / 4u;
            if (NT) {      // 8 steps of k at column n: one element in each of 8 rows of Bs
                let j = p.y % 4u;
                Bs[i][j] = Elem(w.lo.x);
                Bs[i + BROW][j] = Elem(w.lo.y);
                Bs[i + 2u * BROW][j] = Elem(w.lo.z);
                Bs[i + 3u * BROW][j] = Elem(w.lo.w);
                Bs[i + 4u * BROW][j] = Elem(w.hi.x);
                Bs[i + 5u * BROW][j] = Elem(w.hi.y);
                Bs[i + 6u * BROW][j] = Elem(w.hi.z);
                Bs[i + 7u * BROW][j] = Elem(w.hi.w);
            } else {       // 8 columns at one k: two adjacent vec4s
                Bs[i] = vec4<Elem>(w.lo);
                Bs[i + 1u] = vec4<Elem>(w.hi);
            }
        }
    }
}

fn load(st: ptr<function, Stage>, k0: u32) {
    load_a(st, k0);
    load_w(st, k0);
}

// ---- the FMA core, multiply(acc, buf): gemm_core.wgsl, float32 or float16 arithmetic (TileConfig.half)
// @include gemm_core

// ---- epilogue: columns n, n + 1 with n even, a pair in one word of a 16-bit C (gemm_quant_store.wgsl, as
// gemm_quant.wgsl's) ----
// @include gemm_quant_store

fn store2(m: u32, n: u32, v: vec2<f32>) {
    store_pair(P.o4 + m * P.ldc + n, n, v);
}

fn store(acc: ptr<function, Acc>) {
    for (var i = 0u; i < TM; i++) {
        let m = m0 + (i / 4u) * (4u * BM / TM) + 4u * ty + i % 4u;
        if (m < P.M) {
            for (var h = 0u; h < TN / 4u; h++) {
                let v = (*acc)[i * (TN / 4u) + h];
                let n = n0 + h * (4u * TX) + 4u * tx;
                if (n < P.N) {
                    store2(m, n, v.xy);
                }
                if (n + 2u < P.N) {
                    store2(m, n + 2u, v.zw);
                }
            }
        }
    }
}

// ---- the entry point. Single-buffered: two barriers per tile. Double-buffered: the next tile's loads
// (and decoding) are issued before the multiply and land in the other buffer after it, whose last readers
// passed the previous barrier: one barrier per tile. ------------------------------------------------

@compute @workgroup_size(WG)
fn qgemm_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) local: u32) {
    setup(wid, local);
    var acc: Acc;
    var st: Stage;
    load(&st, 0u);
    put(&st, 0u);
    workgroupBarrier();
    var buf = 0u;
    for (var k0 = 0u; k0 < P.K; k0 += BK) {
        let more = k0 + BK < P.K;
        if (NBUF == 2u) {
            if (more) {
                load(&st, k0 + BK);
            }
            multiply(&acc, buf);
            buf ^= 1u;
            if (more) {
                put(&st, buf);
            }
        } else {
            multiply(&acc, 0u);
            workgroupBarrier();
            if (more) {
                load(&st, k0 + BK);
                put(&st, 0u);
            }
        }
        workgroupBarrier();
    }
    store(&acc);
}

// ---- gemm_quant.wgsl's format section for this weight format follows (appended by quant_source.py) ----
