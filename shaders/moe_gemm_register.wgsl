// The grouped-expert GEMM as the register-blocked dense GEMM of gemm.wgsl over one expert's row block (tuned/
// moe_source.register_source specialises it): the same FMA core (gemm_register.wgsl: an invocation keeps TM rows x
// 8 columns in 64 vec4 accumulators, rank-4 updates), the same vec4 loads of the weight and the same subgroup
// broadcast of the row slice, with the weight pointer chosen by the block's expert and the rows gathered through
// the counting sort's perm. out[q, o] = sum_i in[row(q), i] W[e, o, i] (+ scale sum_j hl[q, j] L[e, o, j]) for each
// pair q of expert e, in pair order, as moe_gemm.wgsl (whose Params and bindings this shares); dst in any storage
// format (its vec4 view: 16-bit outputs stored four at a time, two words).
//
// Why this shape: on llvmpipe every invocation-varying load is a scalar loop over the SIMD lanes, so load
// instructions bound the speed (gemm.wgsl's header). Per 4 steps of k an invocation loads 8 vec4 of W (its two
// groups of 4 columns) and, with subgroups, one vec4 of x per 8 rows (lane i < 8 loads row i, every lane takes it by
// subgroupBroadcast); moe_gemm.wgsl loaded RM + RN scalars per step for RM x RN FMAs.
//
// Columns: group 0 is columns c0 .. c0 + 3 (c0 = 4 * (lane + WG * column tile)); group 1 is c0 + 4 WG in the plain
// form, and in the swiglu form the up columns c0 + cols of the same outputs, so an invocation holds each output's
// gate and up and writes h = silu(gate) up itself.
// W: B_KVEC (the nt layout, x W^T: W contiguous along the reduced index) loads 4 columns' vec4s along k and
// transposes them; else (nn, dy W: contiguous along the output column) 4 rows' vec4s along n. Needs in_f, cols,
// out_f and W's strides multiples of 4 and x, W, out and h 4-aligned (moe_kernels.RegisterGemm.applies); the
// LoRA term (rank steps after the main loop) takes scalar loads, any rank.
// Grid: x (+ z) = row blocks (blocks numbered expert after expert, consecutive ones sharing an expert's W panel;
// a grid sized for the worst case, idle blocks exit at once), y = column tiles. Rows past the expert's last are
// clamped on load and skipped on store.

struct Params {
    experts: u32,     // E
    slots: u32,       // k
    by_token: u32,    // 1: in's rows are tokens (pair q reads row q / k), 0: pairs
    in_f: u32,        // the reduced dimension
    cols: u32,        // output columns computed (I for the swiglu form)
    out_f: u32,       // out's row width (2I for the swiglu form)
    rank: u32,        // LoRA rank (0: no LoRA term)
    w_e: u32, w_o: u32, w_i: u32,     // W's strides: expert, output column, reduced index
    l_e: u32, l_o: u32, l_j: u32,     // L's strides: expert, output column, rank index
    scale: f32,       // the LoRA scale
    w_abs: u32,       // NF4 experts (moe_nf4.wgsl): the word of W's buffer where the absmax values start
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32, o8: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
// @tensor 1 dst read_write
// @tensor4 1 dst read_write
// @tensor 2 x read
// @tensor4 2 x read
// @tensor 3 w read
// @tensor4 3 w read
@group(0) @binding(4) var<storage, read> offsets: array<u32>;        // (E + 1,)
@group(0) @binding(5) var<storage, read> perm: array<u32>;           // (N k,)
@group(0) @binding(6) var<storage, read> hl: array<f32>;             // (N k, r) LoRA A products (unread: r = 0)
@group(0) @binding(7) var<storage, read> lb: array<f32>;             // L, E stacked (unread: r = 0)
@group(0) @binding(8) var<storage, read_write> h: array<vec4<f32>>;  // (N k, I) the swiglu form's, pair order

override WG: u32 = 32u;          // invocations per workgroup, along the columns
override TM: u32 = 32u;          // rows per block: 8, 16 or 32
override SWIGLU: bool = false;   // group 1 = the up columns, h written
override B_KVEC: bool = true;    // W contiguous along the reduced index (nt), else along the output column (nn)

alias Acc = array<vec4<f32>, 64>;  // acc[2 * row + j]: row `row`, column group j (gemm_register.wgsl)

var<private> e: u32;               // the block's expert
var<private> row0: u32;            // its first sorted row
var<private> row1: u32;            // the expert's last sorted row
var<private> c0: u32;              // group 0's first column
var<private> c1: u32;              // group 1's first column (of W's output columns: + cols for up)
var<private> wcol: array<u32, 8>;  // B_KVEC: W offset of each of the 8 columns (clamped), at reduced index 0
var<private> q: array<u32, 32>;    // the pair of each block row (the last row's past the expert's end)
var<private> xr: array<u32, 32>;   // x's element offset of each block row

// The block numbered blk: (its expert, its first sorted row), the expert E for a block past the last expert's. Of
// uniform values and function variables alone (WGSL's uniformity analysis takes private variables as varying), so
// the subgroup broadcasts may follow the early return of idle blocks.
fn find_block(blk: u32) -> vec2<u32> {
    // by 8 experts a step, the inner loop's trip count a constant, into a function variable: written as one loop
    // of E trips into the private variables, llvmpipe ran the whole kernel up to 25x slower at E = 8 to 24 (not
    // at 28 or more; cause unknown); this form measured fast at E = 8, 24 and 32 (benchmarks/README.md)
    var found = vec2<u32>(P.experts, 0u);
    var cum = 0u;
    for (var e8 = 0u; e8 < P.experts; e8 += 8u) {
        for (var i = 0u; i < 8u; i++) {
            let ex = min(e8 + i, P.experts - 1u);
            let a = offsets[P.o4 + ex];
            let t = select(0u, (offsets[P.o4 + ex + 1u] - a + TM - 1u) / TM, e8 + i < P.experts);
            if (found.x == P.experts && blk < cum + t) {
                found = vec2<u32>(ex, a + (blk - cum) * TM);
            }
            cum += t;
        }
    }
    return found;
}

// The block's rows (expert `found.x` from row `found.y`) and this invocation's columns in column tile `tile`.
fn setup(found: vec2<u32>, tile: u32, lid: u32) {
    e = found.x;
    row0 = found.y;
    row1 = offsets[P.o4 + e + 1u] - 1u;
    for (var r = 0u; r < TM; r++) {
        q[r] = perm[P.o5 + min(row0 + r, row1)];
        xr[r] = P.o2 + select(q[r], q[r] / P.slots, P.by_token != 0u) * P.in_f;
    }
    let groups = select(2u, 1u, SWIGLU);       // column groups of 4 WG columns per tile
    c0 = (tile * groups * WG + lid) * 4u;
    c1 = select(c0 + 4u * WG, c0 + P.cols, SWIGLU);
    let wb = P.o3 + e * P.w_e;
    let up = select(0u, P.cols, SWIGLU);
    for (var i = 0u; i < 4u; i++) {
        wcol[i] = wb + min(c0 + i, P.cols - 1u) * P.w_o;
        wcol[4u + i] = wb + (min(c1 - up + i, P.cols - 1u) + up) * P.w_o;
    }
}

// rank4, update_row, pick: gemm_register.wgsl.
// @include gemm_register

// Steps k .. k+3 of W at group j's 4 columns (column i of the result is step k + i).
fn load_w(k: u32, j: u32) -> mat4x4<f32> {
    if (B_KVEC) {
        return transpose(mat4x4<f32>(w_ld4(wcol[4u * j] + k), w_ld4(wcol[4u * j + 1u] + k),
                                     w_ld4(wcol[4u * j + 2u] + k), w_ld4(wcol[4u * j + 3u] + k)));
    }
    let up = select(0u, P.cols, SWIGLU && j == 1u);
    let c = P.o3 + e * P.w_e + min(select(c0, c1 - up, j == 1u), P.cols - 4u) + up;
    return mat4x4<f32>(w_ld4(c + k * P.w_i), w_ld4(c + (k + 1u) * P.w_i), w_ld4(c + (k + 2u) * P.w_i),
                       w_ld4(c + (k + 3u) * P.w_i));
}

// The LoRA term's steps t .. t+3 of L at group j's columns, zero past the rank (scalar loads).
fn load_l(t: u32, j: u32) -> mat4x4<f32> {
    let up = select(0u, P.cols, SWIGLU && j == 1u);
    let first = select(c0, c1 - up, j == 1u);
    var m: mat4x4<f32>;
    for (var i = 0u; i < 4u; i++) {
        let at = P.o7 + e * P.l_e + min(t + i, P.rank - 1u) * P.l_j;
        let v = vec4<f32>(lb[at + (min(first, P.cols - 1u) + up) * P.l_o],
                          lb[at + (min(first + 1u, P.cols - 1u) + up) * P.l_o],
                          lb[at + (min(first + 2u, P.cols - 1u) + up) * P.l_o],
                          lb[at + (min(first + 3u, P.cols - 1u) + up) * P.l_o]);
        m[i] = select(vec4<f32>(0.0), v, t + i < P.rank);
    }
    return m;
}

// scale * hl at block row r, steps t .. t+3 (zero past the rank).
fn load_hl(r: u32, t: u32) -> vec4<f32> {
    let at = P.o6 + q[r] * P.rank;
    let last = P.rank - 1u;
    let v = vec4<f32>(hl[at + min(t, last)], hl[at + min(t + 1u, last)], hl[at + min(t + 2u, last)],
                      hl[at + min(t + 3u, last)]);
    return P.scale * select(vec4<f32>(0.0), v, vec4<u32>(t, t + 1u, t + 2u, t + 3u) < vec4<u32>(P.rank));
}

fn silu_up(gate: vec4<f32>, up: vec4<f32>) -> vec4<f32> {
    return gate / (1.0 + exp(-gate)) * up;
}

// Every valid row of the block: out (and h) at its pair's row.
fn store_all(acc: ptr<function, Acc>) {
    for (var r = 0u; r < TM; r++) {
        if (row0 + r > row1) {
            break;
        }
        let v0 = pick(acc, r, 0u);
        let v1 = pick(acc, r, 1u);
        let at = P.o1 + q[r] * P.out_f;
        if (c0 < P.cols) {
            dst_st4(at + c0, v0);
            if (SWIGLU) {
                dst_st4(at + c1, v1);
                h[(P.o8 + q[r] * P.cols + c0) >> 2u] = silu_up(v0, v1);
            }
        }
        if (!SWIGLU && c1 < P.cols) {
            dst_st4(at + c1, v1);
        }
    }
}

// @portable begin: moe_source.register_source keeps this section or the @subgroups one
// Rows r0 .. r0+7 (r0 a constant once inlined, so the accumulators stay in registers), each lane loading them all.
fn update8(acc: ptr<function, Acc>, r0: u32, k: u32, b0: mat4x4<f32>, b1: mat4x4<f32>) {
    update_row(acc, r0, x_ld4(xr[r0] + k), b0, b1);
    update_row(acc, r0 + 1u, x_ld4(xr[r0 + 1u] + k), b0, b1);
    update_row(acc, r0 + 2u, x_ld4(xr[r0 + 2u] + k), b0, b1);
    update_row(acc, r0 + 3u, x_ld4(xr[r0 + 3u] + k), b0, b1);
    update_row(acc, r0 + 4u, x_ld4(xr[r0 + 4u] + k), b0, b1);
    update_row(acc, r0 + 5u, x_ld4(xr[r0 + 5u] + k), b0, b1);
    update_row(acc, r0 + 6u, x_ld4(xr[r0 + 6u] + k), b0, b1);
    update_row(acc, r0 + 7u, x_ld4(xr[r0 + 7u] + k), b0, b1);
}

fn update8_lora(acc: ptr<function, Acc>, r0: u32, t: u32, b0: mat4x4<f32>, b1: mat4x4<f32>) {
    update_row(acc, r0, load_hl(r0, t), b0, b1);
    update_row(acc, r0 + 1u, load_hl(r0 + 1u, t), b0, b1);
    update_row(acc, r0 + 2u, load_hl(r0 + 2u, t), b0, b1);
    update_row(acc, r0 + 3u, load_hl(r0 + 3u, t), b0, b1);
    update_row(acc, r0 + 4u, load_hl(r0 + 4u, t), b0, b1);
    update_row(acc, r0 + 5u, load_hl(r0 + 5u, t), b0, b1);
    update_row(acc, r0 + 6u, load_hl(r0 + 6u, t), b0, b1);
    update_row(acc, r0 + 7u, load_hl(r0 + 7u, t), b0, b1);
}

@compute @workgroup_size(WG)
fn moe_gemm_reg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let found = find_block(wid.x + wid.z * nwg.x);
    if (found.x == P.experts) {
        return;
    }
    setup(found, wid.y, lid);
    var acc: Acc;
    for (var k = 0u; k < P.in_f; k += 4u) {
        let b0 = load_w(k, 0u);
        let b1 = load_w(k, 1u);
        update8(&acc, 0u, k, b0, b1);
        if (TM > 8u) {
            update8(&acc, 8u, k, b0, b1);
        }
        if (TM > 16u) {
            update8(&acc, 16u, k, b0, b1);
            update8(&acc, 24u, k, b0, b1);
        }
    }
    for (var t = 0u; t < P.rank; t += 4u) {
        let b0 = load_l(t, 0u);
        let b1 = load_l(t, 1u);
        update8_lora(&acc, 0u, t, b0, b1);
        if (TM > 8u) {
            update8_lora(&acc, 8u, t, b0, b1);
        }
        if (TM > 16u) {
            update8_lora(&acc, 16u, t, b0, b1);
            update8_lora(&acc, 24u, t, b0, b1);
        }
    }
    store_all(&acc);
}
// @portable end
// @subgroups begin
// Rows r0 .. r0+7 when lane i of each subgroup holds row r0 + i's 4 values in `av` (gemm.wgsl's update8_sg).
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

// Needs subgroups of at least 8 lanes (adapter_traits.use_subgroups): lane i < 8 of each loads rows 8t + i.
@compute @workgroup_size(WG)
fn moe_gemm_reg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32, @builtin(subgroup_invocation_id) sid: u32) {
    let found = find_block(wid.x + wid.z * nwg.x);
    if (found.x == P.experts) {
        return;
    }
    setup(found, wid.y, lid);
    let lane = sid & 7u;
    let x0 = xr[lane];
    let x1 = xr[min(8u + lane, TM - 1u)];
    let x2 = xr[min(16u + lane, TM - 1u)];
    let x3 = xr[min(24u + lane, TM - 1u)];
    var acc: Acc;
    for (var k = 0u; k < P.in_f; k += 4u) {
        let b0 = load_w(k, 0u);
        let b1 = load_w(k, 1u);
        update8_sg(&acc, 0u, x_ld4(x0 + k), b0, b1);
        if (TM > 8u) {
            update8_sg(&acc, 8u, x_ld4(x1 + k), b0, b1);
        }
        if (TM > 16u) {
            update8_sg(&acc, 16u, x_ld4(x2 + k), b0, b1);
            update8_sg(&acc, 24u, x_ld4(x3 + k), b0, b1);
        }
    }
    for (var t = 0u; t < P.rank; t += 4u) {
        let b0 = load_l(t, 0u);
        let b1 = load_l(t, 1u);
        update8_sg(&acc, 0u, load_hl(lane, t), b0, b1);
        if (TM > 8u) {
            update8_sg(&acc, 8u, load_hl(min(8u + lane, TM - 1u), t), b0, b1);
        }
        if (TM > 16u) {
            update8_sg(&acc, 16u, load_hl(min(16u + lane, TM - 1u), t), b0, b1);
            update8_sg(&acc, 24u, load_hl(min(24u + lane, TM - 1u), t), b0, b1);
        }
    }
    store_all(&acc);
}
// @subgroups end
