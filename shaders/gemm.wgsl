// Register-blocked GEMM without workgroup memory, float32 arithmetic:
//   C[z] = alpha * op(A[z]) @ op(B[z]) (+ bias) (+ C[z] when accumulating), z = workgroup_id.z.
// Every layout (NN, NT, TN, TT, C written transposed) is a set of element strides in the uniform, so
// one pipeline serves them all; tuned/gemm_kernels.py picks the entry point and override constants once per shape.
// A, B and C are tensors in any storage format (device/storage.py's markers; the `@tensor4` ones are their
// vec4 views, which gemm_kernels.register_source declares for the formats); BIAS is float32.
//
// Tiling: a workgroup owns TM = 32 (or 8) rows and 8 * WG columns of C; an invocation keeps all TM rows
// x 8 columns of its own (up to 64 vec4 accumulators). Its columns are two groups of 4 adjacent columns,
// n0 + 4 * lane + c and n0 + 4 * WG + 4 * lane + c (c < 4), so vec4 loads of B and stores of C stay
// contiguous and neighbouring lanes touch neighbouring addresses. It stores C by pairs of adjacent columns
// (vec4s in gemm_v4*), so a 16-bit C is written a word, two elements, at a time; a 16-bit C is never stored
// transposed here (gemm_kernels gives it no swapped candidate).
//
// Why this shape: on llvmpipe/lavapipe every invocation-varying buffer load is a scalar loop over the
// SIMD lanes, so the number of load instructions, not FMAs, bounds the speed, and each vec4 load costs
// little more than a scalar one. Per 4 steps of k an invocation loads its own 4 x 8 slice of op(B)
// (8 vec4) and issues 1024 FMAs; the 32 x 4 slice of op(A) is the same for the whole workgroup.
// The *_sg entry points spread that A slice over the first 8 lanes of each subgroup (4 vec4 each) and
// hand it out with subgroupBroadcast (a register extract on llvmpipe); the others load it directly.
//
// Entry points: gemm / gemm_sg take any strides and sizes (scalar loads, pair stores where C's rows allow);
// gemm_v4 / gemm_v4_sg need each matrix contiguous and 4-aligned along one dimension (see tuned/gemm_kernels.py) and
// move vec4s, with A_KVEC (op(A) contiguous along k, else along m), B_NVEC (op(B) along n, else k) and
// C_NVEC (C along n, else m). Override constants: WG (invocations per workgroup), TM (32 or 8).
// Workgroups are numbered (row tile, column tile, batch) so consecutive ones share a panel of B.
// Bounds: out-of-range rows/columns are clamped on load (always valid memory) and skipped on store;
// steps of k past K read A as zero. So any M, N, K >= 1 works.

// o1..o4: element offsets of bindings 1..4 (A, B, BIAS, C), as engines/webgpu/device/launch.py's uniform ABI names them.
struct Params {
    M: u32, N: u32, K: u32, flags: u32,          // flags: 1 = accumulate into C, 2 = add bias
    o1: u32, a_sm: u32, a_sk: u32, a_sz: u32,    // op(A) element (m, k) of batch z: o1 + m*a_sm + k*a_sk + z*a_sz
    o2: u32, b_sk: u32, b_sn: u32, b_sz: u32,    // op(B) element (k, n)
    o4: u32, c_sm: u32, c_sn: u32, c_sz: u32,    // C element (m, n)
    o3: u32, bias_sm: u32, bias_sn: u32, alpha: f32, // bias element for C (m, n): o3 + m*sm + n*sn
};

@group(0) @binding(0) var<uniform> P: Params;
// Scalar (A_ld, ...) and vec4 (A_ld4, ...) views of the same bindings; an entry point uses one of them.
// @tensor 1 A read
// @tensor4 1 A read
// @tensor 2 B read
// @tensor4 2 B read
@group(0) @binding(3) var<storage, read> BIAS: array<f32>;
// @tensor 4 C read_write
// @tensor4 4 C read_write

override WG: u32 = 32u;          // invocations per workgroup
override A_KVEC: bool = true;    // gemm_v4*: op(A) rows contiguous along k (else columns along m)
override B_NVEC: bool = true;    // gemm_v4*: op(B) rows contiguous along n (else columns along k)
override C_NVEC: bool = true;    // gemm_v4*: C rows contiguous along n (else columns along m)
override TM: u32 = 32u;          // rows of C per workgroup: 32, or 8 for skinny products (M <= 8)

alias Acc = array<vec4<f32>, 64>;  // acc[2 * row + j]: row `row`, column group j of this invocation

var<private> a_base: u32;        // o1 of this batch
var<private> b_base: u32;
var<private> m0: u32;            // first row of this workgroup
var<private> n0: u32;            // first column of this invocation: n0 + c and n0 + 4 * WG + c
var<private> b_col: array<u32, 8>; // gemm, gemm_v4 (B along k): b_base + n * b_sn of the 8 columns (clamped)

// Workgroup (x, y, z) = (row tile, column tile, batch): consecutive workgroups share a panel of B.
fn setup(wid: vec3<u32>, lid: u32) {
    a_base = P.o1 + wid.z * P.a_sz;
    b_base = P.o2 + wid.z * P.b_sz;
    m0 = wid.x * TM;
    n0 = wid.y * WG * 8u + 4u * lid;
    let nl = P.N - 1u;
    let n1 = n0 + 4u * WG;
    b_col = array<u32, 8>(b_base + min(n0, nl) * P.b_sn, b_base + min(n0 + 1u, nl) * P.b_sn,
                          b_base + min(n0 + 2u, nl) * P.b_sn, b_base + min(n0 + 3u, nl) * P.b_sn,
                          b_base + min(n1, nl) * P.b_sn, b_base + min(n1 + 1u, nl) * P.b_sn,
                          b_base + min(n1 + 2u, nl) * P.b_sn, b_base + min(n1 + 3u, nl) * P.b_sn);
}

// ---- the FMA core -----------------------------------------------------------------------------

// rank4 and update_row: gemm_register.wgsl.
// @include gemm_register

// Rows r0..r0+3 from the A slice given by k: w_i holds the 4 rows at k + i.
fn update4_t(acc: ptr<function, Acc>, r0: u32, w0: vec4<f32>, w1: vec4<f32>, w2: vec4<f32>, w3: vec4<f32>,
             b0: mat4x4<f32>, b1: mat4x4<f32>) {
    update_row(acc, r0, vec4<f32>(w0.x, w1.x, w2.x, w3.x), b0, b1);
    update_row(acc, r0 + 1u, vec4<f32>(w0.y, w1.y, w2.y, w3.y), b0, b1);
    update_row(acc, r0 + 2u, vec4<f32>(w0.z, w1.z, w2.z, w3.z), b0, b1);
    update_row(acc, r0 + 3u, vec4<f32>(w0.w, w1.w, w2.w, w3.w), b0, b1);
}

// ---- loads: scalar (any strides) --------------------------------------------------------------

// 4 consecutive k of row m of op(A), zero where k >= K.
fn load_a_row(m: u32, k: u32) -> vec4<f32> {
    let r = a_base + min(m, P.M - 1u) * P.a_sm;
    let kl = P.K - 1u;
    return vec4<f32>(select(0.0, A_ld(r + min(k, kl) * P.a_sk), k < P.K),
                     select(0.0, A_ld(r + min(k + 1u, kl) * P.a_sk), k + 1u < P.K),
                     select(0.0, A_ld(r + min(k + 2u, kl) * P.a_sk), k + 2u < P.K),
                     select(0.0, A_ld(r + min(k + 3u, kl) * P.a_sk), k + 3u < P.K));
}

// Rows k..k+3 of op(B) in this invocation's columns 4j..4j+3 (column i of the result is row k + i).
fn load_b_scalar(k: u32, j: u32) -> mat4x4<f32> {
    let kl = P.K - 1u;
    let c0 = b_col[4u * j];
    let c1 = b_col[4u * j + 1u];
    let c2 = b_col[4u * j + 2u];
    let c3 = b_col[4u * j + 3u];
    let r0 = min(k, kl) * P.b_sk;
    let r1 = min(k + 1u, kl) * P.b_sk;
    let r2 = min(k + 2u, kl) * P.b_sk;
    let r3 = min(k + 3u, kl) * P.b_sk;
    return mat4x4<f32>(vec4<f32>(B_ld(r0 + c0), B_ld(r0 + c1), B_ld(r0 + c2), B_ld(r0 + c3)),
                       vec4<f32>(B_ld(r1 + c0), B_ld(r1 + c1), B_ld(r1 + c2), B_ld(r1 + c3)),
                       vec4<f32>(B_ld(r2 + c0), B_ld(r2 + c1), B_ld(r2 + c2), B_ld(r2 + c3)),
                       vec4<f32>(B_ld(r3 + c0), B_ld(r3 + c1), B_ld(r3 + c2), B_ld(r3 + c3)));
}

// ---- loads: vec4 ------------------------------------------------------------------------------

// A_KVEC: row m of op(A) at k..k+3 (K % 4 == 0, so never past K).
fn load_a4_k(m: u32, k: u32) -> vec4<f32> {
    return A_ld4(a_base + min(m, P.M - 1u) * P.a_sm + k);
}

// !A_KVEC: rows m..m+3 of op(A) at k (M % 4 == 0), zero where k >= K.
fn load_a4_m(m: u32, k: u32) -> vec4<f32> {
    let v = A_ld4(a_base + min(k, P.K - 1u) * P.a_sk + min(m, P.M - 4u));
    return select(vec4<f32>(0.0), v, k < P.K);
}

// B_NVEC: rows k..k+3 of op(B) at columns n..n+3 (N % 4 == 0).
fn load_b4_n(k: u32, n: u32) -> mat4x4<f32> {
    let kl = P.K - 1u;
    let c = b_base + min(n, P.N - 4u);
    return mat4x4<f32>(B_ld4(c + min(k, kl) * P.b_sk), B_ld4(c + min(k + 1u, kl) * P.b_sk),
                       B_ld4(c + min(k + 2u, kl) * P.b_sk), B_ld4(c + min(k + 3u, kl) * P.b_sk));
}

// !B_NVEC: rows k..k+3 of op(B) at this invocation's columns 4j..4j+3 (K % 4 == 0).
fn load_b4_k(k: u32, j: u32) -> mat4x4<f32> {
    return transpose(mat4x4<f32>(B_ld4(b_col[4u * j] + k), B_ld4(b_col[4u * j + 1u] + k),
                                 B_ld4(b_col[4u * j + 2u] + k), B_ld4(b_col[4u * j + 3u] + k)));
}

fn load_b4(k: u32, j: u32) -> mat4x4<f32> {
    if (B_NVEC) {
        return load_b4_n(k, n0 + 4u * WG * j);
    }
    return load_b4_k(k, j);
}

// ---- direct A (no subgroups) ------------------------------------------------------------------

fn update8_direct(acc: ptr<function, Acc>, r0: u32, k: u32, b0: mat4x4<f32>, b1: mat4x4<f32>) {
    let m = m0 + r0;
    update_row(acc, r0, load_a_row(m, k), b0, b1);
    update_row(acc, r0 + 1u, load_a_row(m + 1u, k), b0, b1);
    update_row(acc, r0 + 2u, load_a_row(m + 2u, k), b0, b1);
    update_row(acc, r0 + 3u, load_a_row(m + 3u, k), b0, b1);
    update_row(acc, r0 + 4u, load_a_row(m + 4u, k), b0, b1);
    update_row(acc, r0 + 5u, load_a_row(m + 5u, k), b0, b1);
    update_row(acc, r0 + 6u, load_a_row(m + 6u, k), b0, b1);
    update_row(acc, r0 + 7u, load_a_row(m + 7u, k), b0, b1);
}

fn update8_direct_v4(acc: ptr<function, Acc>, r0: u32, k: u32, b0: mat4x4<f32>, b1: mat4x4<f32>) {
    let m = m0 + r0;
    if (A_KVEC) {
        update_row(acc, r0, load_a4_k(m, k), b0, b1);
        update_row(acc, r0 + 1u, load_a4_k(m + 1u, k), b0, b1);
        update_row(acc, r0 + 2u, load_a4_k(m + 2u, k), b0, b1);
        update_row(acc, r0 + 3u, load_a4_k(m + 3u, k), b0, b1);
        update_row(acc, r0 + 4u, load_a4_k(m + 4u, k), b0, b1);
        update_row(acc, r0 + 5u, load_a4_k(m + 5u, k), b0, b1);
        update_row(acc, r0 + 6u, load_a4_k(m + 6u, k), b0, b1);
        update_row(acc, r0 + 7u, load_a4_k(m + 7u, k), b0, b1);
    } else {
        update4_t(acc, r0, load_a4_m(m, k), load_a4_m(m, k + 1u), load_a4_m(m, k + 2u), load_a4_m(m, k + 3u), b0, b1);
        update4_t(acc, r0 + 4u, load_a4_m(m + 4u, k), load_a4_m(m + 4u, k + 1u), load_a4_m(m + 4u, k + 2u),
                  load_a4_m(m + 4u, k + 3u), b0, b1);
    }
}

// ---- epilogue ---------------------------------------------------------------------------------
// A loop over the 32 rows, fetching the row's accumulators through a tree of selects: indexing the
// accumulator array with a run-time row would move it to memory, and unrolling 32 rows of stores
// (each a lane loop on llvmpipe) makes the pipeline take ~20x longer to compile.

// pick(acc, r, j): gemm_register.wgsl.
// C = alpha * v (+ bias) (+ C) at (m, n) and (m, n + 1) of row c_row (gemm_store.wgsl's store_pair), none past N.
// @include gemm_store
fn store2(c_row: u32, m: u32, n: u32, v: vec2<f32>) {
    if (n < P.N) {
        store_pair(c_row + n * P.c_sn, m, n, v, P.alpha);
    }
}

fn store_all(acc: ptr<function, Acc>, z: u32) {
    let n1 = n0 + 4u * WG;
    for (var r = 0u; r < TM; r++) {
        let m = m0 + r;
        if (m >= P.M) {
            break;
        }
        let c_row = P.o4 + z * P.c_sz + m * P.c_sm;
        let v0 = pick(acc, r, 0u);
        let v1 = pick(acc, r, 1u);
        store2(c_row, m, n0, v0.xy);
        store2(c_row, m, n0 + 2u, v0.zw);
        store2(c_row, m, n1, v1.xy);
        store2(c_row, m, n1 + 2u, v1.zw);
    }
}

// gemm_v4*: the epilogue with vec4 accesses of C (N % 4 == 0 along n, M % 4 == 0 along m).

// bias at (m, n .. n+3), or at (m .. m+3, n) when along_m (zero without a bias).
fn bias4(m: u32, n: u32, along_m: bool) -> vec4<f32> {
    if ((P.flags & 2u) == 0u) {
        return vec4<f32>(0.0);
    }
    let s = select(P.bias_sn, P.bias_sm, along_m);
    let i = P.o3 + m * P.bias_sm + n * P.bias_sn;
    return vec4<f32>(BIAS[i], BIAS[i + s], BIAS[i + 2u * s], BIAS[i + 3u * s]);
}

// C at elements i .. i+3 (i a multiple of 4) = alpha * v + bias (+ C).
fn store4(i: u32, v: vec4<f32>, bias: vec4<f32>) {
    var out = fma(vec4<f32>(P.alpha), v, bias);
    if ((P.flags & 1u) != 0u) {
        out += C_ld4(i);
    }
    C_st4(i, out);
}

// !C_NVEC: rows m .. m+3 of column n (skipped past N).
fn store_col4(c_col: u32, m: u32, n: u32, v: vec4<f32>) {
    if (n < P.N) {
        store4(c_col + n * P.c_sn, v, bias4(m, n, true));
    }
}

fn store_all_v4(acc: ptr<function, Acc>, z: u32) {
    let n1 = n0 + 4u * WG;
    let c_base = P.o4 + z * P.c_sz;
    if (C_NVEC) {
        for (var r = 0u; r < TM; r++) {
            let m = m0 + r;
            if (m >= P.M) {
                break;
            }
            let c_row = c_base + m * P.c_sm;
            if (n0 < P.N) {
                store4(c_row + n0, pick(acc, r, 0u), bias4(m, n0, false));
            }
            if (n1 < P.N) {
                store4(c_row + n1, pick(acc, r, 1u), bias4(m, n1, false));
            }
        }
    } else {
        for (var r = 0u; r < TM; r += 4u) {
            let m = m0 + r;
            if (m >= P.M) {
                break;
            }
            let x0 = pick(acc, r, 0u);
            let x1 = pick(acc, r + 1u, 0u);
            let x2 = pick(acc, r + 2u, 0u);
            let x3 = pick(acc, r + 3u, 0u);
            let y0 = pick(acc, r, 1u);
            let y1 = pick(acc, r + 1u, 1u);
            let y2 = pick(acc, r + 2u, 1u);
            let y3 = pick(acc, r + 3u, 1u);
            // column c of rows m .. m+3 is component c of the four row vectors
            let c_col = c_base + m;
            store_col4(c_col, m, n0, vec4<f32>(x0.x, x1.x, x2.x, x3.x));
            store_col4(c_col, m, n0 + 1u, vec4<f32>(x0.y, x1.y, x2.y, x3.y));
            store_col4(c_col, m, n0 + 2u, vec4<f32>(x0.z, x1.z, x2.z, x3.z));
            store_col4(c_col, m, n0 + 3u, vec4<f32>(x0.w, x1.w, x2.w, x3.w));
            store_col4(c_col, m, n1, vec4<f32>(y0.x, y1.x, y2.x, y3.x));
            store_col4(c_col, m, n1 + 1u, vec4<f32>(y0.y, y1.y, y2.y, y3.y));
            store_col4(c_col, m, n1 + 2u, vec4<f32>(y0.z, y1.z, y2.z, y3.z));
            store_col4(c_col, m, n1 + 3u, vec4<f32>(y0.w, y1.w, y2.w, y3.w));
        }
    }
}

// ---- entry points without subgroups -----------------------------------------------------------

@compute @workgroup_size(WG)
fn gemm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    setup(wid, lid);
    var acc: Acc;
    for (var k = 0u; k < P.K; k += 4u) {
        let b0 = load_b_scalar(k, 0u);
        let b1 = load_b_scalar(k, 1u);
        update8_direct(&acc, 0u, k, b0, b1);
        if (TM > 8u) {
            update8_direct(&acc, 8u, k, b0, b1);
            update8_direct(&acc, 16u, k, b0, b1);
            update8_direct(&acc, 24u, k, b0, b1);
        }
    }
    store_all(&acc, wid.z);
}

@compute @workgroup_size(WG)
fn gemm_v4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    setup(wid, lid);
    var acc: Acc;
    for (var k = 0u; k < P.K; k += 4u) {
        let b0 = load_b4(k, 0u);
        let b1 = load_b4(k, 1u);
        update8_direct_v4(&acc, 0u, k, b0, b1);
        if (TM > 8u) {
            update8_direct_v4(&acc, 8u, k, b0, b1);
            update8_direct_v4(&acc, 16u, k, b0, b1);
            update8_direct_v4(&acc, 24u, k, b0, b1);
        }
    }
    store_all_v4(&acc, wid.z);
}

// ---- subgroup kernels (removed from the source when the device lacks the subgroup feature) ----
// They need subgroups of at least 8 lanes (tuned/gemm_kernels.py checks once per device): lane i < 8 of every
// subgroup loads part of the A slice, and every lane reads it back with subgroupBroadcast.

// Rows r0..r0+7 when lane i holds row r0 + i (4 values of k) in `av`.
fn update8_sg(acc: ptr<function, Acc>, r0: u32, av: vec4<f32>, b0: mat4x4<f32>, b1: mat4x4<f32>) {
    update_row(acc, r0, subgroupBroadcast(av, 0u), b0, b1);
    update_row(acc, r0 + 1u, subgroupBroadcast(av, 1u), b0, b1);
    update_row(acc, r0 + 2u, subgroupBroadcast(av, 2u), b0, b1);
    update_row(acc, r0 + 3u, subgroupBroadcast(av, 3u), b0, b1);
    update_row(acc, r0 + 4u, subgroupBroadcast(av, 4u), b0, b1);
    update_row(acc, r0 + 5u, subgroupBroadcast(av, 5u), b0, b1);
    update_row(acc, r0 + 6u, subgroupBroadcast(av, 6u), b0, b1);
    update_row(acc, r0 + 7u, subgroupBroadcast(av, 7u), b0, b1);
}

// Rows r0..r0+7 when lane i holds rows r0 + 4 * (i / 4) + 0..3 at k + i % 4 in `av`.
fn update8_sg_t(acc: ptr<function, Acc>, r0: u32, av: vec4<f32>, b0: mat4x4<f32>, b1: mat4x4<f32>) {
    update4_t(acc, r0, subgroupBroadcast(av, 0u), subgroupBroadcast(av, 1u), subgroupBroadcast(av, 2u),
              subgroupBroadcast(av, 3u), b0, b1);
    update4_t(acc, r0 + 4u, subgroupBroadcast(av, 4u), subgroupBroadcast(av, 5u), subgroupBroadcast(av, 6u),
              subgroupBroadcast(av, 7u), b0, b1);
}

@compute @workgroup_size(WG)
fn gemm_sg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
           @builtin(subgroup_invocation_id) sid: u32) {
    setup(wid, lid);
    let lane = sid & 7u;
    var acc: Acc;
    for (var k = 0u; k < P.K; k += 4u) {
        let av0 = load_a_row(m0 + lane, k);
        let b0 = load_b_scalar(k, 0u);
        let b1 = load_b_scalar(k, 1u);
        update8_sg(&acc, 0u, av0, b0, b1);
        if (TM > 8u) {
            let av1 = load_a_row(m0 + 8u + lane, k);
            let av2 = load_a_row(m0 + 16u + lane, k);
            let av3 = load_a_row(m0 + 24u + lane, k);
            update8_sg(&acc, 8u, av1, b0, b1);
            update8_sg(&acc, 16u, av2, b0, b1);
            update8_sg(&acc, 24u, av3, b0, b1);
        }
    }
    store_all(&acc, wid.z);
}

@compute @workgroup_size(WG)
fn gemm_v4_sg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
              @builtin(subgroup_invocation_id) sid: u32) {
    setup(wid, lid);
    let lane = sid & 7u;
    // A along m: lane i loads rows m0 + 8 * t + 4 * (i / 4) + 0..3 at k + i % 4, for t < 4
    let mt = m0 + 4u * (lane >> 2u);
    let kt = lane & 3u;
    var acc: Acc;
    for (var k = 0u; k < P.K; k += 4u) {
        let b0 = load_b4(k, 0u);
        let b1 = load_b4(k, 1u);
        if (A_KVEC) {
            update8_sg(&acc, 0u, load_a4_k(m0 + lane, k), b0, b1);
            if (TM > 8u) {
                let av1 = load_a4_k(m0 + 8u + lane, k);
                let av2 = load_a4_k(m0 + 16u + lane, k);
                let av3 = load_a4_k(m0 + 24u + lane, k);
                update8_sg(&acc, 8u, av1, b0, b1);
                update8_sg(&acc, 16u, av2, b0, b1);
                update8_sg(&acc, 24u, av3, b0, b1);
            }
        } else {
            update8_sg_t(&acc, 0u, load_a4_m(mt, k + kt), b0, b1);
            if (TM > 8u) {
                let av1 = load_a4_m(mt + 8u, k + kt);
                let av2 = load_a4_m(mt + 16u, k + kt);
                let av3 = load_a4_m(mt + 24u, k + kt);
                update8_sg_t(&acc, 8u, av1, b0, b1);
                update8_sg_t(&acc, 16u, av2, b0, b1);
                update8_sg_t(&acc, 24u, av3, b0, b1);
            }
        }
    }
    store_all_v4(&acc, wid.z);
}
