// Workgroup-tiled GEMM for real GPUs: C[z] = alpha * op(A[z]) @ op(B[z]) (+ bias) (+ C[z] when accumulating),
// with optional split-K for skinny products. Float32 arithmetic, or for float16 A and B float16 arithmetic with
// float32 accumulation (a TileConfig with half: the tiles hold f16, gemm_core.wgsl's f16 core multiplies).
// One source serves every TileConfig: tuned/gemm_source.py rewrites the marked const block and picks the
// entry point and sections.
//
// Layouts (NN, NT, TN, TT, C transposed) are element strides in the uniform, as in gemm.wgsl. A, B and C are
// tensors in any storage format (device/storage.py's markers; A4 / B4 are their vec4 views, which
// gemm_source.tiled_source declares for the formats); BIAS, the split-K partials, H and LB are float32.
// C is stored by pairs of adjacent columns (each invocation owns groups of 4), a word of a 16-bit C at a time.
// Workgroup (x, y, z) = (column tile, row tile, zb * splits + s): consecutive workgroups share a row panel
// of op(A). Each step of k stages a BM x BK tile of op(A), stored transposed (As[k][m]), and a BK x BN tile
// of op(B) (Bs[k][n]) in workgroup memory; an invocation then keeps a TM x TN block of C in registers.
// Its rows are TM / 4 groups of 4 adjacent rows spaced 4 * BM / TM apart (columns likewise, 4 * TX
// apart), so neighbouring invocations read neighbouring vec4s of As / Bs (no bank conflicts) and write
// neighbouring columns of C. Transposing a k-contiguous op(A) into As does conflict on the stores; padded
// rows would not fit 128 x 128 double-buffered tiles in 16 KiB, and stores are few next to the reads.
//
// Entry points: gemm_tiled, gemm_tiled_sg (the subgroup section at the end: fragments of As / Bs shared by
// 2 x 2 quads of lanes), their LoRA variants gemm_tiled_lora / gemm_tiled_lora_sg (below) and
// gemm_splitk_reduce. The global loads are scalar (any strides; the @scalar
// section) or vec4 along each operand's stride-1 dimension (the @vec4 section; preconditions in vec4_ok of
// tuned/gemm_source.py): tiled_source() keeps one of the two, because naga rejects an entry point that uses
// both the scalar and the vec4 view of a binding.
//
// Split-K (P.splits > 1): workgroup z = zb * splits + s sums k in [s * k_split, min(K, (s + 1) * k_split))
// and writes that partial raw to a packed scratch in C: element (m, n) of (zb, s) at
// o4 + ((zb * splits + s) * M + m) * N + n. gemm_splitk_reduce then adds the splits in order s = 0, 1, ...
// (deterministic, no atomics) and applies alpha, bias and accumulate with the real strides of C.
//
// Bounds: tile elements outside op(A) / op(B) or past the split's k range are staged as zero and stores
// outside C are skipped, so any M, N, K >= 1 works.
//
// LoRA term (gemm_tiled_lora*, splits == 1 and batch == 1 only): C = alpha * op(A) op(B) + alpha2 * H LB^T
// (+ bias) (+ C), with H (M, r2) rows ldh apart from o5 in binding 5 and LB (N, r2) rows ldlb apart from o6 in
// binding 6 (a LoRA module's h and B: the term y += scale * h B^T folded into the base GEMM's dispatch).
// After the main k loop the accumulators are scaled by alpha, then a second loop over k2 < r2 stages
// alpha2 * H and LB through the same tiles (scalar loads, single-buffered) into the same accumulators, and
// the epilogue applies 1 instead of alpha: exact for any alpha (alpha = 0 included), one rounding more per
// product of the second term than applying alpha2 to its sum. r2 = 0: no second loop, the same C as
// gemm_tiled up to the order of the alpha multiply (alpha * v either way: bit-identical).

struct Params {
    M: u32, N: u32, K: u32, flags: u32,            // flags: 1 = accumulate into C, 2 = add bias
    o1: u32, a_sm: u32, a_sk: u32, a_sz: u32,      // op(A) element (m, k) of batch z: o1 + m*a_sm + k*a_sk + z*a_sz
    o2: u32, b_sk: u32, b_sn: u32, b_sz: u32,      // op(B) element (k, n) of batch z
    o4: u32, c_sm: u32, c_sn: u32, c_sz: u32,      // C element (m, n) of batch z
    o3: u32, bias_sm: u32, bias_sn: u32, alpha: f32, // bias element for C (m, n): o3 + m*bias_sm + n*bias_sn
    k_split: u32, splits: u32, batch: u32, pad0: u32, // split-K: k per split (a multiple of BK), splits
    r2: u32, ldh: u32, ldlb: u32, alpha2: f32,     // gemm_tiled_lora*: rank of the second term, pitches, scale
    o5: u32, o6: u32, pad1: u32, pad2: u32,        // H element (m, k2): o5 + m*ldh + k2; LB (n, k2): o6 + n*ldlb + k2
};

@group(0) @binding(0) var<uniform> P: Params;
// @tensor 1 A read
// @tensor4 1 A read
@group(0) @binding(1) var<storage, read> PART: array<f32>;      // gemm_splitk_reduce: the partials
// @tensor 2 B read
// @tensor4 2 B read
@group(0) @binding(3) var<storage, read> BIAS: array<f32>;
// @tensor 4 C read_write
@group(0) @binding(5) var<storage, read> H: array<f32>;        // gemm_tiled_lora*: H (M, r2)
@group(0) @binding(6) var<storage, read> LB: array<f32>;       // gemm_tiled_lora*: LB (N, r2)

// @tile-config begin: gemm_source.tiled_source() rewrites these lines in place (one per name)
const BM: u32 = 64u;    // rows of C per workgroup
const BN: u32 = 64u;    // columns of C per workgroup
const BK: u32 = 8u;     // steps of k per staged tile (a multiple of 4)
const TM: u32 = 4u;     // rows of C per invocation (a multiple of 4)
const TN: u32 = 4u;     // columns of C per invocation (a multiple of 4)
const NBUF: u32 = 1u;   // 2: double-buffered tiles
const PAD: u32 = 0u;    // vec4s of padding after each k row of As and Bs (4 for the subgroup kernels)
alias Elem = f32;       // the tiles' element type: f16 for f16 arithmetic (gemm_core.wgsl)
// @tile-config end

const TX: u32 = BN / TN;                 // invocations along n
const WG: u32 = (BM / TM) * TX;          // invocations per workgroup
const AV: u32 = BM * BK / 4u;            // vec4s per A tile
const BV: u32 = BN * BK / 4u;
const AROW: u32 = BM / 4u + PAD;         // vec4 pitch of a k row of As
const BROW: u32 = BN / 4u + PAD;
const ABUF: u32 = AROW * BK;             // vec4s per buffer of As
const BBUF: u32 = BROW * BK;
const SA: u32 = (AV + WG - 1u) / WG;     // vec4 staging registers per invocation for the A tile
const SB: u32 = (BV + WG - 1u) / WG;

var<workgroup> As: array<vec4<Elem>, NBUF * ABUF>;   // [buffer][k][m / 4], rows AROW apart
var<workgroup> Bs: array<vec4<Elem>, NBUF * BBUF>;   // [buffer][k][n / 4], rows BROW apart

// The next tiles on their way from global memory to workgroup memory. Slot l of a scalar load holds
// elements (4l + c) * WG + lid, c < 4, of the tile; of a vec4 load, vec4 l * WG + lid.
struct Stage {
    a: array<vec4<f32>, SA>,
    b: array<vec4<f32>, SB>,
};

alias Acc = array<vec4<f32>, TM * TN / 4u>;   // acc[i * TN / 4 + h]: row i, column group h

var<private> lid: u32;
var<private> tx: u32;
var<private> ty: u32;
var<private> m0: u32;          // first row of this workgroup's tile
var<private> n0: u32;          // first column
var<private> a_base: u32;      // o1 + zb * a_sz
var<private> b_base: u32;      // o2 + zb * b_sz

// The k range of this workgroup's split; workgroup_id only, so the loop around the barriers stays uniform.
fn k_range(z: u32) -> vec2<u32> {
    if (P.splits <= 1u) {
        return vec2<u32>(0u, P.K);
    }
    let k0 = (z % P.splits) * P.k_split;
    return vec2<u32>(k0, min(P.K, k0 + P.k_split));
}

fn setup(wid: vec3<u32>, local: u32) {
    lid = local;
    tx = local % TX;
    ty = local / TX;
    n0 = wid.x * BN;
    m0 = wid.y * BM;
    let zb = wid.z / max(P.splits, 1u);
    a_base = P.o1 + zb * P.a_sz;
    b_base = P.o2 + zb * P.b_sz;
}

// @scalar begin: tiled_source() keeps this section for a config without vec4 (else the @vec4 one)
// ---- scalar global loads: consecutive invocations take consecutive elements along the stride-1
// dimension (k first when a_sk == 1, else m; n first when b_sn == 1, else k) -------------------

// (m, k) in the A tile of tile element e.
fn a_pos(e: u32) -> vec2<u32> {
    if (P.a_sk == 1u) {
        return vec2<u32>(e / BK, e % BK);
    }
    return vec2<u32>(e % BM, e / BM);
}

// (k, n) in the B tile of tile element e.
fn b_pos(e: u32) -> vec2<u32> {
    if (P.b_sn == 1u) {
        return vec2<u32>(e / BN, e % BN);
    }
    return vec2<u32>(e % BK, e / BK);
}

fn stage_load(st: ptr<function, Stage>, k0: u32, k_end: u32) {
    for (var l = 0u; l < SA; l++) {
        var v = vec4<f32>(0.0);
        for (var c = 0u; c < 4u; c++) {
            let e = (4u * l + c) * WG + lid;
            let p = a_pos(e);
            let m = m0 + p.x;
            let k = k0 + p.y;
            if (e < 4u * AV && m < P.M && k < k_end) {
                v[c] = A_ld(a_base + m * P.a_sm + k * P.a_sk);
            }
        }
        (*st).a[l] = v;
    }
    for (var l = 0u; l < SB; l++) {
        var v = vec4<f32>(0.0);
        for (var c = 0u; c < 4u; c++) {
            let e = (4u * l + c) * WG + lid;
            let p = b_pos(e);
            let k = k0 + p.x;
            let n = n0 + p.y;
            if (e < 4u * BV && n < P.N && k < k_end) {
                v[c] = B_ld(b_base + k * P.b_sk + n * P.b_sn);
            }
        }
        (*st).b[l] = v;
    }
}

fn stage_put(st: ptr<function, Stage>, buf: u32) {
    for (var l = 0u; l < SA; l++) {
        for (var c = 0u; c < 4u; c++) {
            let e = (4u * l + c) * WG + lid;
            if (e < 4u * AV) {
                let p = a_pos(e);
                As[buf * ABUF + p.y * AROW + p.x / 4u][p.x % 4u] = Elem((*st).a[l][c]);
            }
        }
    }
    for (var l = 0u; l < SB; l++) {
        for (var c = 0u; c < 4u; c++) {
            let e = (4u * l + c) * WG + lid;
            if (e < 4u * BV) {
                let p = b_pos(e);
                Bs[buf * BBUF + p.x * BROW + p.y / 4u][p.y % 4u] = Elem((*st).b[l][c]);
            }
        }
    }
}

// @scalar end
// @vec4 begin
// ---- vec4 global loads: 4 consecutive elements along the stride-1 dimension, whose size, offset, pitch
// and batch stride are multiples of 4 (so a vec4 is wholly inside or wholly outside the matrix) -------

// (m, k) of the first element of A tile vec4 v: 4 k's when a_sk == 1, else 4 m's.
fn a_pos4(v: u32) -> vec2<u32> {
    if (P.a_sk == 1u) {
        return vec2<u32>(v / (BK / 4u), 4u * (v % (BK / 4u)));
    }
    return vec2<u32>(4u * (v % (BM / 4u)), v / (BM / 4u));
}

// (k, n) of the first element of B tile vec4 v: 4 n's when b_sn == 1, else 4 k's.
fn b_pos4(v: u32) -> vec2<u32> {
    if (P.b_sn == 1u) {
        return vec2<u32>(v / (BN / 4u), 4u * (v % (BN / 4u)));
    }
    return vec2<u32>(4u * (v % (BK / 4u)), v / (BK / 4u));
}

fn stage_load(st: ptr<function, Stage>, k0: u32, k_end: u32) {
    for (var l = 0u; l < SA; l++) {
        let v = l * WG + lid;
        let p = a_pos4(v);
        let m = m0 + p.x;
        let k = k0 + p.y;
        var x = vec4<f32>(0.0);
        if (v < AV && m < P.M && k < k_end) {
            x = A_ld4(a_base + m * P.a_sm + k * P.a_sk);
        }
        (*st).a[l] = x;
    }
    for (var l = 0u; l < SB; l++) {
        let v = l * WG + lid;
        let p = b_pos4(v);
        let k = k0 + p.x;
        let n = n0 + p.y;
        var x = vec4<f32>(0.0);
        if (v < BV && n < P.N && k < k_end) {
            x = B_ld4(b_base + k * P.b_sk + n * P.b_sn);
        }
        (*st).b[l] = x;
    }
}

fn stage_put(st: ptr<function, Stage>, buf: u32) {
    for (var l = 0u; l < SA; l++) {
        let v = l * WG + lid;
        if (v < AV) {
            let p = a_pos4(v);
            let x = (*st).a[l];
            if (P.a_sk == 1u) {
                let i = buf * ABUF + p.y * AROW + p.x / 4u;
                As[i][p.x % 4u] = Elem(x.x);
                As[i + AROW][p.x % 4u] = Elem(x.y);
                As[i + 2u * AROW][p.x % 4u] = Elem(x.z);
                As[i + 3u * AROW][p.x % 4u] = Elem(x.w);
            } else {
                As[buf * ABUF + p.y * AROW + p.x / 4u] = vec4<Elem>(x);
            }
        }
    }
    for (var l = 0u; l < SB; l++) {
        let v = l * WG + lid;
        if (v < BV) {
            let p = b_pos4(v);
            let x = (*st).b[l];
            if (P.b_sn == 1u) {
                Bs[buf * BBUF + p.x * BROW + p.y / 4u] = vec4<Elem>(x);
            } else {
                let i = buf * BBUF + p.x * BROW + p.y / 4u;
                Bs[i][p.y % 4u] = Elem(x.x);
                Bs[i + BROW][p.y % 4u] = Elem(x.y);
                Bs[i + 2u * BROW][p.y % 4u] = Elem(x.z);
                Bs[i + 3u * BROW][p.y % 4u] = Elem(x.w);
            }
        }
    }
}

// @vec4 end

// ---- the FMA core, multiply(acc, buf): gemm_core.wgsl, float32 or float16 arithmetic (TileConfig.half)
// @include gemm_core

// ---- epilogue -----------------------------------------------------------------------------------

// C (m, n) and (m, n + 1) of batch zb = alpha * v (+ bias) (+ C), with C's own strides (gemm_store.wgsl's
// store_pair: one word of a 16-bit C), the second skipped past N.
// @include gemm_store
fn finish(zb: u32, m: u32, n: u32, v: vec2<f32>, alpha: f32) {
    store_pair(P.o4 + zb * P.c_sz + m * P.c_sm + n * P.c_sn, m, n, v, alpha);
}

fn store(acc: ptr<function, Acc>, z: u32, alpha: f32) {
    for (var i = 0u; i < TM; i++) {
        let m = m0 + (i / 4u) * (4u * BM / TM) + 4u * ty + i % 4u;
        if (m < P.M) {
            for (var h = 0u; h < TN / 4u; h++) {
                let v = (*acc)[i * (TN / 4u) + h];
                for (var c = 0u; c < 4u; c += 2u) {
                    let n = n0 + h * (4u * TX) + 4u * tx + c;
                    let pair = select(v.xy, v.zw, c == 2u);
                    if (n < P.N) {
                        if (P.splits > 1u) {     // the float32 partials (gemm_kernels' scratch), packed
                            let j = P.o4 + (z * P.M + m) * P.N + n;
                            C_st(j, pair.x);
                            if (n + 1u < P.N) {
                                C_st(j + 1u, pair.y);
                            }
                        } else {
                            finish(z, m, n, pair, alpha);
                        }
                    }
                }
            }
        }
    }
}

// ---- the main loop, shared by the entry points. Single-buffered: two barriers per tile. Double-buffered:
// the next tile's global loads are issued before the multiply and land in the other buffer after it,
// whose last readers passed the previous barrier: one barrier. ---------------------------------------

fn tile_loop(acc: ptr<function, Acc>, kr: vec2<u32>, fast: bool) {
    var st: Stage;
    stage_load(&st, kr.x, kr.y);
    stage_put(&st, 0u);
    workgroupBarrier();
    var buf = 0u;
    for (var k0 = kr.x; k0 < kr.y; k0 += BK) {
        let more = k0 + BK < kr.y;
        if (NBUF == 2u) {
            if (more) {
                stage_load(&st, k0 + BK, kr.y);
            }
            stage_multiply(acc, buf, fast);
            buf ^= 1u;
            if (more) {
                stage_put(&st, buf);
            }
        } else {
            stage_multiply(acc, 0u, fast);
            workgroupBarrier();
            if (more) {
                stage_load(&st, k0 + BK, kr.y);
                stage_put(&st, 0u);
            }
        }
        workgroupBarrier();
    }
}

// ---- the LoRA term of gemm_tiled_lora*: after the main loop (whose last barrier every invocation passed,
// so buffer 0 is free) acc = alpha * acc, then k2 < r2 in steps of BK through buffer 0 of As / Bs: elements
// of alpha2 * H (m, k2) as As[k2][m] and of LB (n, k2) as Bs[k2][n], k2 fastest over consecutive
// invocations (both are k2-contiguous); zero outside M, N or r2. Two barriers a step: r2 is a LoRA rank. ----

fn lora_put(k0: u32) {
    for (var l = 0u; l < (BM * BK + WG - 1u) / WG; l++) {
        let e = l * WG + lid;
        if (e < BM * BK) {
            let i = e / BK;
            let k = e % BK;
            let m = m0 + i;
            var v = 0.0;
            if (m < P.M && k0 + k < P.r2) {
                v = P.alpha2 * H[P.o5 + m * P.ldh + k0 + k];
            }
            As[k * AROW + i / 4u][i % 4u] = Elem(v);
        }
    }
    for (var l = 0u; l < (BN * BK + WG - 1u) / WG; l++) {
        let e = l * WG + lid;
        if (e < BN * BK) {
            let j = e / BK;
            let k = e % BK;
            let n = n0 + j;
            var v = 0.0;
            if (n < P.N && k0 + k < P.r2) {
                v = LB[P.o6 + n * P.ldlb + k0 + k];
            }
            Bs[k * BROW + j / 4u][j % 4u] = Elem(v);
        }
    }
}

fn lora_loop(acc: ptr<function, Acc>, fast: bool) {
    for (var j = 0u; j < TM * TN / 4u; j++) {
        (*acc)[j] = P.alpha * (*acc)[j];
    }
    for (var k0 = 0u; k0 < P.r2; k0 += BK) {
        lora_put(k0);
        workgroupBarrier();
        stage_multiply(acc, 0u, fast);
        workgroupBarrier();
    }
}

// @plain begin: tiled_source() keeps this section for a config without subgroups (else @subgroups)
fn stage_multiply(acc: ptr<function, Acc>, buf: u32, fast: bool) {
    multiply(acc, buf);
}

@compute @workgroup_size(WG)
fn gemm_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) local: u32) {
    setup(wid, local);
    var acc: Acc;
    tile_loop(&acc, k_range(wid.z), false);
    store(&acc, wid.z, P.alpha);
}

// C = alpha * op(A) op(B) + alpha2 * H LB^T (+ bias) (+ C): see "LoRA term" at the top.
@compute @workgroup_size(WG)
fn gemm_tiled_lora(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) local: u32) {
    setup(wid, local);
    var acc: Acc;
    tile_loop(&acc, vec2<u32>(0u, P.K), false);
    lora_loop(&acc, false);
    store(&acc, 0u, 1.0);
}
// @plain end

// One invocation per pair of columns (n, n + 1) of a row of C (n even; alone at an odd N's last column), so a
// 16-bit C is written by words; workgroups beyond 65535 fold into y (gemm_source.reduce_groups).
@compute @workgroup_size(256)
fn gemm_splitk_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) local: u32) {
    let i = (wid.y * nwg.x + wid.x) * 256u + local;
    let pairs = (P.N + 1u) / 2u;
    let mp = P.M * pairs;
    if (i >= mp * P.batch) {
        return;
    }
    let zb = i / mp;
    let m = (i % mp) / pairs;
    let n = 2u * (i % pairs);
    let second = n + 1u < P.N;
    var sum = vec2<f32>(0.0);
    for (var s = 0u; s < P.splits; s++) {
        let j = P.o1 + ((zb * P.splits + s) * P.M + m) * P.N + n;
        sum += vec2<f32>(PART[j], select(0.0, PART[j + select(0u, 1u, second)], second));
    }
    finish(zb, m, n, sum, P.alpha);
}

// @subgroups begin: gemm_source.tiled_source() blanks this section for a config without subgroups (naga
// rejects a whole module that uses a subgroup builtin on a device without the feature, even unused).
//
// gemm_tiled_sg: the same tiles, staging and epilogue, but each read of As / Bs in the
// multiply serves two invocations. The invocations 4b .. 4b+3 form a 2 x 2 block of the TX x TY grid
// (q = 0..3: x = q & 1 along n, y = q >> 1 along m). The x pair shares its rows of C, so its A fragment;
// the y pair shares its columns, so its B fragment. For each pair of k rows (k, k+1), an invocation reads
// its fragments of row k + d only, d = x ^ y, and receives those of row k + 1 - d from its x partner (A)
// and its y partner (B) with subgroupShuffleXor by 1 and 2: half the workgroup-memory reads of gemm_tiled,
// for TM + TN floats exchanged per invocation and pair of rows. Xor by 1 or 2 stays inside a quad, which
// GPUs exchange cheaply (AMD: DPP quad permutes; Intel: register regions; Apple: quad shuffles; NVIDIA:
// shfl, about the cost of a shared load, so about even there). Unmeasured on GPUs: the autotuner decides.
// The two rows a quad reads lie BM (or BN) floats apart, a multiple of 32 banks of 4 bytes; PAD = 4 vec4s
// puts odd rows 16 banks away so the quad's reads do not conflict.
//
// Width-free: only quads (subgroup lanes 4j .. 4j+3, present in every subgroup of 4 or more lanes) exchange
// values, and an invocation's quad index q is its subgroup_invocation_id % 4. setup_sg checks that every
// quad is complete and holds the four invocations 4b .. 4b+3 (in any order), which WebGPU does not promise
// (subgroups may be partial; the mapping of local_invocation_index to lanes is unspecified). If any quad
// of the workgroup fails, the whole workgroup takes the fallback: q = local % 4 and each invocation reads
// both rows from workgroup memory itself; both paths compute the same products.

const QUADS: bool = true;   // false forces the fallback (the tests run it on adapters whose quads pass)

var<workgroup> quad_bad: atomic<u32>;
var<workgroup> quad_fast: u32;
var<private> qd: u32;           // d = x ^ y: which row of each pair of k rows this invocation reads

// The index the kernel goes by; the tests substitute permutations (other mappings of invocations to lanes).
fn lane_order(index: u32) -> u32 {
    return index;
}

// Roles of the quad layout; true when every quad of the workgroup may exchange values (workgroup-uniform).
fn setup_sg(wid: vec3<u32>, local: u32, sid: u32) -> bool {
    if (local == 0u) {
        atomicStore(&quad_bad, 0u);   // not zeroed on lavapipe (wgpu 0.32), whatever WebGPU says
    }
    workgroupBarrier();
    let q0 = sid & ~3u;
    let live = subgroupBallot(true);
    let whole = ((live[q0 / 32u] >> (q0 % 32u)) & 15u) == 15u;
    let lead = subgroupShuffle(local, q0);   // indeterminate when lane q0 is inactive, but then !whole
    if (!QUADS || !whole || lead / 4u != local / 4u) {
        atomicOr(&quad_bad, 1u);
    }
    workgroupBarrier();
    if (local == 0u) {
        quad_fast = select(0u, 1u, atomicLoad(&quad_bad) == 0u);
    }
    let fast = workgroupUniformLoad(&quad_fast) == 1u;
    setup(wid, local);
    let q = select(local, sid, fast) % 4u;
    let b = local / 4u;
    tx = 2u * (b % (TX / 2u)) + (q & 1u);
    ty = 2u * (b / (TX / 2u)) + (q >> 1u);
    qd = (q ^ (q >> 1u)) & 1u;
    return fast;
}

// update(acc, a, b): gemm_core.wgsl's (float32 arithmetic: the subgroup kernels have no float16 core)

fn multiply_sg(acc: ptr<function, Acc>, buf: u32, fast: bool) {
    let a0 = buf * ABUF + ty;
    let b0 = buf * BBUF + tx;
    for (var k = 0u; k < BK; k += 2u) {
        let ka = (k + qd) * AROW;
        let kb = (k + qd) * BROW;
        var a: array<vec4<f32>, TM / 4u>;
        var b: array<vec4<f32>, TN / 4u>;
        var a2: array<vec4<f32>, TM / 4u>;   // row k + 1 - d
        var b2: array<vec4<f32>, TN / 4u>;
        for (var g = 0u; g < TM / 4u; g++) {
            a[g] = As[a0 + ka + g * (BM / TM)];
        }
        for (var h = 0u; h < TN / 4u; h++) {
            b[h] = Bs[b0 + kb + h * TX];
        }
        if (fast) {
            for (var g = 0u; g < TM / 4u; g++) {
                a2[g] = subgroupShuffleXor(a[g], 1u);
            }
            for (var h = 0u; h < TN / 4u; h++) {
                b2[h] = subgroupShuffleXor(b[h], 2u);
            }
        } else {
            let ka2 = (k + 1u - qd) * AROW;
            let kb2 = (k + 1u - qd) * BROW;
            for (var g = 0u; g < TM / 4u; g++) {
                a2[g] = As[a0 + ka2 + g * (BM / TM)];
            }
            for (var h = 0u; h < TN / 4u; h++) {
                b2[h] = Bs[b0 + kb2 + h * TX];
            }
        }
        update(acc, a, b);
        update(acc, a2, b2);
    }
}

fn stage_multiply(acc: ptr<function, Acc>, buf: u32, fast: bool) {
    multiply_sg(acc, buf, fast);
}

@compute @workgroup_size(WG)
fn gemm_tiled_sg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) index: u32,
                 @builtin(subgroup_invocation_id) sid: u32) {
    let fast = setup_sg(wid, lane_order(index), sid);
    var acc: Acc;
    tile_loop(&acc, k_range(wid.z), fast);
    store(&acc, wid.z, P.alpha);
}

@compute @workgroup_size(WG)
fn gemm_tiled_lora_sg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) index: u32,
                      @builtin(subgroup_invocation_id) sid: u32) {
    let fast = setup_sg(wid, lane_order(index), sid);
    var acc: Acc;
    tile_loop(&acc, vec2<u32>(0u, P.K), fast);
    lora_loop(&acc, fast);
    store(&acc, 0u, 1.0);
}
// @subgroups end
