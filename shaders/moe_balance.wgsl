// The router's load-balancing loss on the device (transformers' load_balancing_loss_func; the mirror of
// engines/shared/moe.py's load_balancing_counts / _loss / _dprobs): each sparse layer's assignments per expert,
// its probabilities' sums per expert and its real tokens, summed over the layers of a forward into stats
// (2E + 1,) f32 = [counts (E) | probability sums (E) | real tokens]; the loss from them; and the gradient it puts
// on a layer's probabilities. Every sum runs in a fixed order (blocks of tokens, then the blocks in order): no
// float atomics. A token is real where its segment id is not 0 (the attention mask transformers' loss reads).
// s0..s7 / f0: each entry point's header says what they are; o<i>: binding i's element offset (launch fills it).
// @include params

const WG: u32 = 64u;
const BLOCK: u32 = 256u;          // tokens per block of the partial sums

// @tensor 1 t1 read_write
// @tensor 2 t2 read
@group(0) @binding(5) var<storage, read> i5: array<i32>;
@group(0) @binding(7) var<storage, read> i7: array<i32>;

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid.x;
}

// ---- probs! (N, E) f32 = t1: each real token's softmax over its router logits t2 (N, E), 0 for padding;
// segments i5 (N). s0 N, s1 E. One invocation per token.
@compute @workgroup_size(64)
fn moe_balance_probs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let n = flat(wid, nwg, lid);
    if (n >= p.s0) {
        return;
    }
    let E = p.s1;
    let base = p.o2 + n * E;
    var m = t2_ld(base);
    for (var e = 1u; e < E; e = e + 1u) {
        m = max(m, t2_ld(base + e));
    }
    var total = 0.0;
    for (var e = 0u; e < E; e = e + 1u) {
        total = total + exp(t2_ld(base + e) - m);
    }
    let real = select(0.0, 1.0, i5[p.o5 + n] != 0);
    for (var e = 0u; e < E; e = e + 1u) {
        t1_st(p.o1 + n * E + e, real * exp(t2_ld(base + e) - m) / total);
    }
}

// ---- part! (blocks, 2E + 1) f32 = t1: per block of BLOCK tokens, column c < E the real tokens' assignments to
// expert c, E <= c < 2E the sum of probs t2 (N, E) of expert c - E, c = 2E the real tokens; experts i5 (N, k),
// segments i7 (N). s0 N, s1 E, s2 k, s3 blocks. One invocation per (block, column).
@compute @workgroup_size(64)
fn moe_balance_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = flat(wid, nwg, lid);
    let width = 2u * p.s1 + 1u;
    if (g >= width * p.s3) {
        return;
    }
    let b = g / width;
    let c = g % width;
    var acc = 0.0;
    for (var n = b * BLOCK; n < min(b * BLOCK + BLOCK, p.s0); n = n + 1u) {
        if (i7[p.o7 + n] == 0) {
            continue;
        }
        if (c < p.s1) {
            for (var j = 0u; j < p.s2; j = j + 1u) {
                acc = acc + select(0.0, 1.0, i5[p.o5 + n * p.s2 + j] == i32(c));
            }
        } else if (c < 2u * p.s1) {
            acc = acc + t2_ld(p.o2 + n * p.s1 + c - p.s1);
        } else {
            acc = acc + 1.0;
        }
    }
    t1_st(p.o1 + g, acc);
}

// ---- stats! (2E + 1) f32 = t1 (+)= the sum of part t2 (blocks, 2E + 1) over its blocks, in order. s0 2E + 1,
// s1 blocks, s4 accumulate (a layer after the forward's first sparse one). One invocation per column.
@compute @workgroup_size(64)
fn moe_balance_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = flat(wid, nwg, lid);
    if (c >= p.s0) {
        return;
    }
    var acc = 0.0;
    if (p.s4 != 0u) {
        acc = t1_ld(p.o1 + c);
    }
    for (var b = 0u; b < p.s1; b = b + 1u) {
        acc = acc + t2_ld(p.o2 + b * p.s0 + c);
    }
    t1_st(p.o1 + c, acc);
}

// ---- loss! (1,) f32 = t1: E sum_e (counts_e / rows) (probability sums_e / rows) of stats t2 (2E + 1), 0 before
// any real token. s1 E. One invocation.
@compute @workgroup_size(64)
fn moe_balance_loss(@builtin(local_invocation_id) lid: vec3<u32>) {
    if (lid.x != 0u) {
        return;
    }
    let E = p.s1;
    let rows = t2_ld(p.o2 + 2u * E);
    var acc = 0.0;
    for (var e = 0u; e < E; e = e + 1u) {
        acc = acc + (t2_ld(p.o2 + e) / rows) * (t2_ld(p.o2 + E + e) / rows);
    }
    t1_st(p.o1, select(0.0, f32(E) * acc, rows > 0.0));
}

// ---- dprobs! (N, E) f32 = t1: the gradient of f0 times the loss on one layer's probabilities, from stats t2
// (2E + 1): f0 E counts_e / max(rows, 1)^2 on each real token (segments i5 (N)), 0 on padding (the assignments
// are constants: top-k has no gradient). s0 N, s1 E. One invocation per element.
@compute @workgroup_size(64)
fn moe_balance_dprobs(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = flat(wid, nwg, lid);
    if (g >= p.s0 * p.s1) {
        return;
    }
    let n = g / p.s1;
    let e = g % p.s1;
    let rows = max(t2_ld(p.o2 + 2u * p.s1), 1.0);
    let real = select(0.0, 1.0, i5[p.o5 + n] != 0);
    t1_st(p.o1 + g, real * p.f0 * f32(p.s1) * t2_ld(p.o2 + e) / (rows * rows));
}
