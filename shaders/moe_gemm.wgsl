// The grouped-expert GEMM (tuned/moe_source.py specialises it): one dispatch over every expert's row blocks. The
// routed pairs are grouped by expert (moe.wgsl's counting sort: offsets (E + 1), perm); a workgroup takes one
// block of RM sorted rows of one expert (blocks numbered expert after expert; a grid sized for the worst case, so
// idle blocks exit at once) and 64 * RN output columns, each invocation RM x RN of them in registers, no workgroup
// memory. out[q, o] = sum_i in[row(q), i] W[e, o, i] (+ scale sum_j hl[q, j] L[e, o, j]) for each pair q of
// expert e, in pair order; the swiglu form computes the gate column o and the up column o + I together and also
// writes h[q, o] = silu(gate) up. Strides make one source serve x W^T (nt) and dy W (nn) layouts. dst (N k, out_f),
// pair order, in any storage format: a 16-bit one is stored by pairs of adjacent columns (LANE 2: an invocation's
// columns come in pairs, so no two invocations write halves of one word).

struct Params {
    experts: u32,     // E
    slots: u32,       // k
    by_token: u32,    // 1: in's rows are tokens (pair q reads row q / k), 0: pairs
    in_f: u32,        // the reduced dimension
    cols: u32,        // output columns computed (I for the swiglu form)
    out_f: u32,       // out's row width (2I for the swiglu form)
    rank: u32,        // LoRA rank (the LoRA form)
    w_e: u32, w_o: u32, w_i: u32,     // W's strides: expert, output column, reduced index
    l_e: u32, l_o: u32, l_j: u32,     // L's strides: expert, output column, rank index
    scale: f32,       // the LoRA scale
    w_abs: u32,       // NF4 experts (moe_nf4.wgsl): the word of W's buffer where the absmax values start
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32, o8: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
// @tensor 1 dst read_write
// @tensor 2 x read
// @tensor 3 w read
@group(0) @binding(4) var<storage, read> offsets: array<u32>;      // (E + 1,)
@group(0) @binding(5) var<storage, read> perm: array<u32>;         // (N k,)
// @lora: hl (N k, r) f32 and L (E stacked) f32 at bindings 6 and 7
// @swiglu: h (N k, I) f32 at binding 8

fn silu_up(gate: f32, up: f32) -> f32 {
    return gate / (1.0 + exp(-gate)) * up;
}

@compute @workgroup_size(64)
fn moe_gemm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let blk = wid.y + wid.z * nwg.y;
    var e = P.experts;
    var row0 = 0u;
    var cum = 0u;
    for (var ex = 0u; ex < P.experts; ex = ex + 1u) {
        let a = offsets[P.o4 + ex];
        let t = (offsets[P.o4 + ex + 1u] - a + RM - 1u) / RM;
        if (e == P.experts && blk < cum + t) {
            e = ex;
            row0 = a + (blk - cum) * RM;
        }
        cum = cum + t;
    }
    if (e == P.experts) {
        return;
    }
    let row1 = offsets[P.o4 + e + 1u] - 1u;
    let c0 = wid.x * 64u * RN + lid.x * LANE;
    let wb = P.o3 + e * P.w_e;
// @body
}
