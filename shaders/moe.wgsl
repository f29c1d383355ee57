// Mixture of experts on the device, the kernels around the grouped GEMMs (moe_gemm.wgsl): the router's top-k and
// its backward, the routed (token, slot) pairs grouped by expert by a counting sort (no atomics, stable in token
// order), each pair's skinny LoRA product, the swiglu of a pair's gate / up and its backward, the per-pair weight
// gradient, the weighted combine back to token order, and the experts' summed outer products (LoRA and weight
// gradients) as split-K partials plus an ordered reduction. The mirror of engines/shared/moe.py. No float
// atomics anywhere: every sum runs in a fixed order, so results do not depend on scheduling.
//
// A pair p = n * k + j is token n's slot j; "sorted rows" are the pairs grouped by expert, offsets (E + 1,) u32
// the first sorted row of each expert (offsets[E] = N k), perm (N k,) u32 the pair at each sorted row.
// s0..s7 / f0: each entry point's header says what they are; o<i>: binding i's element offset (launch fills it).
// @include params

const WG: u32 = 64u;
const BLOCK: u32 = 256u;          // pairs per block of the counting sort

// @tensor 1 t1 read_write
// @tensor 2 t2 read
// @tensor 3 t3 read
@group(0) @binding(4) var<storage, read_write> u4: array<u32>;
@group(0) @binding(5) var<storage, read> i5: array<i32>;
@group(0) @binding(6) var<storage, read> f6: array<f32>;
@group(0) @binding(7) var<storage, read> i7: array<i32>;

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid.x;
}

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

// ---- routing: weights! (N, k) f32 = t1, logits (N, E) = t2, bias (E,) = t3 (where s5 != 0), experts! (N, k) i32
// written through u4. s0 N, s1 E, s2 k, s3 normalize, s4 scoring (0 softmax, 1 sigmoid: LFM2-MoE's), s5 bias,
// f0 scale (routed_scaling_factor; 1 for none). One invocation per token: the softmax's max and sum, then k
// passes, each the largest choice key (the logit for a softmax; sigmoid + bias, which chooses but does not weigh)
// after the previous pick in (descending value, ascending index) order: torch.topk's order. A sigmoid's chosen
// scores are renormalised over their sum plus 1e-6, as transformers'.
fn route_key(base: u32, e: u32) -> f32 {
    let v = t2_ld(base + e);
    if (p.s4 == 0u) {
        return v;
    }
    return sigmoid(v) + select(0.0, t3_ld(p.o3 + e), p.s5 != 0u);
}

@compute @workgroup_size(64)
fn moe_route_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let n = flat(wid, nwg, lid);
    if (n >= p.s0) {
        return;
    }
    let E = p.s1;
    let base = p.o2 + n * E;
    let sig = p.s4 != 0u;
    var m = t2_ld(base);
    for (var e = 1u; e < E; e = e + 1u) {
        m = max(m, t2_ld(base + e));
    }
    var total = 0.0;
    for (var e = 0u; e < E; e = e + 1u) {
        total = total + exp(t2_ld(base + e) - m);
    }
    var prev_v = 0.0;
    var prev_i = -1;
    var chosen = 0.0;
    for (var j = 0u; j < p.s2; j = j + 1u) {
        var best_v = 0.0;
        var best_i = -1;
        for (var e = 0u; e < E; e = e + 1u) {
            let v = route_key(base, e);
            let after = prev_i < 0 || v < prev_v || (v == prev_v && i32(e) > prev_i);
            if (after && (best_i < 0 || v > best_v)) {
                best_v = v;
                best_i = i32(e);
            }
        }
        prev_v = best_v;
        prev_i = best_i;
        let logit = t2_ld(base + u32(best_i));
        let w = select(exp(logit - m) / total, sigmoid(logit), sig);
        chosen = chosen + w;
        t1_st(p.o1 + n * p.s2 + j, w);
        u4[p.o4 + n * p.s2 + j] = u32(best_i);
    }
    let denom = select(1.0, chosen + select(0.0, 1e-6, sig), p.s3 != 0u);
    for (var j = 0u; j < p.s2; j = j + 1u) {
        let i = p.o1 + n * p.s2 + j;
        t1_st(i, t1_ld(i) / denom * p.f0);
    }
}

// ---- the router's backward: dlogits! (N, E) = t1, dweights (N, k) = t2, logits (N, E) = t3, experts i5 (N, k),
// dprobs f6 (N, E) where s4 != 0. s0 N, s1 E, s2 k, s3 normalize, s5 scoring (0 softmax, 1 sigmoid), f0 scale.
// One invocation per token: dp = dprobs + the chosen weights' gradient (dweights times the scale) on their scores;
// a softmax's dlogits_e = p_e (dp_e - sum_e' dp_e' p_e'), a sigmoid's dp_e p_e (1 - p_e).
fn route_prob(base: u32, e: u32, m: f32, total: f32) -> f32 {
    let v = t3_ld(base + e);
    return select(exp(v - m) / total, sigmoid(v), p.s5 != 0u);
}

@compute @workgroup_size(64)
fn moe_route_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let n = flat(wid, nwg, lid);
    if (n >= p.s0) {
        return;
    }
    let E = p.s1;
    let k = p.s2;
    let sig = p.s5 != 0u;
    let base = p.o3 + n * E;
    var m = t3_ld(base);
    for (var e = 1u; e < E; e = e + 1u) {
        m = max(m, t3_ld(base + e));
    }
    var total = 0.0;
    for (var e = 0u; e < E; e = e + 1u) {
        total = total + exp(t3_ld(base + e) - m);
    }
    // the renormalisation's backward: dchosen_j = (dw_j - sum_j' dw_j' w_j') / (sum_j' p_j' + eps)
    var chosen = select(0.0, 1e-6, sig);
    var dot_w = 0.0;
    for (var j = 0u; j < k; j = j + 1u) {
        let pj = route_prob(base, u32(i5[p.o5 + n * k + j]), m, total);
        chosen = chosen + pj;
        dot_w = dot_w + t2_ld(p.o2 + n * k + j) * p.f0 * pj;
    }
    let norm = p.s3 != 0u;
    let inv = select(1.0, 1.0 / chosen, norm);
    let shift = select(0.0, dot_w / chosen, norm);       // sum dw_j w_j with w_j = p_j / chosen
    // S = sum_e dp_e p_e (a softmax's alone)
    var s = 0.0;
    for (var j = 0u; j < k; j = j + 1u) {
        let pj = route_prob(base, u32(i5[p.o5 + n * k + j]), m, total);
        s = s + (t2_ld(p.o2 + n * k + j) * p.f0 - shift) * inv * pj;
    }
    if (p.s4 != 0u) {
        for (var e = 0u; e < E; e = e + 1u) {
            s = s + f6[p.o6 + n * E + e] * route_prob(base, e, m, total);
        }
    }
    for (var e = 0u; e < E; e = e + 1u) {
        var dp = 0.0;
        if (p.s4 != 0u) {
            dp = f6[p.o6 + n * E + e];
        }
        for (var j = 0u; j < k; j = j + 1u) {
            if (u32(i5[p.o5 + n * k + j]) == e) {
                dp = dp + (t2_ld(p.o2 + n * k + j) * p.f0 - shift) * inv;
            }
        }
        let pe = route_prob(base, e, m, total);
        t1_st(p.o1 + n * E + e, select(pe * (dp - s), dp * pe * (1.0 - pe), sig));
    }
}

// ---- the counting sort, pass 1: counts u4 (blocks, E) of each block of BLOCK pairs, experts i5 (N k).
// s0 N k, s1 E, s2 blocks. One invocation per (block, expert).
@compute @workgroup_size(64)
fn moe_group_count(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = flat(wid, nwg, lid);
    if (g >= p.s1 * p.s2) {
        return;
    }
    let b = g / p.s1;
    let e = i32(g % p.s1);
    var c = 0u;
    for (var q = b * BLOCK; q < min(b * BLOCK + BLOCK, p.s0); q = q + 1u) {
        c = c + select(0u, 1u, i5[p.o5 + q] == e);
    }
    u4[p.o4 + g] = c;
}

// Pass 2, one workgroup: u4 is the grouping's scratch, (blocks, E) counts then the offsets (E + 1,) at element
// s3. Each block's count of an expert becomes the exclusive prefix over earlier blocks (in place), each expert's
// total goes to offsets[e + 1], then one invocation turns the totals into the exclusive offsets, expert by expert.
// s0 N k, s1 E, s2 blocks, s3 the offsets' element index.
@compute @workgroup_size(64)
fn moe_group_offsets(@builtin(local_invocation_id) lid: vec3<u32>) {
    let E = p.s1;
    for (var e = lid.x; e < E; e = e + WG) {
        var run = 0u;
        for (var b = 0u; b < p.s2; b = b + 1u) {
            let i = p.o4 + b * E + e;
            let c = u4[i];
            u4[i] = run;
            run = run + c;
        }
        u4[p.o4 + p.s3 + e + 1u] = run;
    }
    storageBarrier();
    workgroupBarrier();
    if (lid.x == 0u) {
        let o = p.o4 + p.s3;
        u4[o] = 0u;
        for (var e = 0u; e < E; e = e + 1u) {
            u4[o + e + 1u] = u4[o + e + 1u] + u4[o + e];
        }
    }
}

// Pass 3: perm u4 (N k): each pair's sorted row = its expert's offset + earlier blocks' count of its expert +
// earlier pairs of its own block with the same expert; experts i5 (N k), prefix counts and offsets i7 (as
// pass 2 left them: the blocks' prefixes, then the offsets at element s3). s0 N k, s1 E. Pairs routed to an
// expert outside 0..E-1 are left out (counted by no expert).
@compute @workgroup_size(64)
fn moe_group_scatter(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let q = flat(wid, nwg, lid);
    if (q >= p.s0) {
        return;
    }
    let e = i5[p.o5 + q];
    if (e < 0 || u32(e) >= p.s1) {
        return;
    }
    let b = q / BLOCK;
    var rank = 0u;
    for (var r = b * BLOCK; r < q; r = r + 1u) {
        rank = rank + select(0u, 1u, i5[p.o5 + r] == e);
    }
    let row = u32(i7[p.o7 + p.s3 + u32(e)]) + u32(i7[p.o7 + b * p.s1 + u32(e)]) + rank;
    u4[p.o4 + row] = q;
}

// ---- a skinny LoRA product per pair: out! (N k, r) = t1, in = t2 (rows: tokens when s4 != 0, else pairs),
// m = t3 (E stacked matrices), experts i5 (N k). out[q, j] = f0 * sum_i in[row(q), i] m[e * s5 + j * s6 + i * s7]
// for e = experts[q]. s0 N k, s1 in, s2 r, s3 k (slots), s4 by token. One invocation per (pair, j).
@compute @workgroup_size(64)
fn moe_lora_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = flat(wid, nwg, lid);
    if (g >= p.s0 * p.s2) {
        return;
    }
    let q = g / p.s2;
    let j = g % p.s2;
    let e = i5[p.o5 + q];
    var acc = 0.0;
    if (e >= 0) {
        let row = select(q, q / p.s3, p.s4 != 0u);
        let xb = p.o2 + row * p.s1;
        let mb = p.o3 + u32(e) * p.s5 + j * p.s6;
        for (var i = 0u; i < p.s1; i = i + 1u) {
            acc = acc + t2_ld(xb + i) * t3_ld(mb + i * p.s7);
        }
    }
    t1_st(p.o1 + g, p.f0 * acc);
}

// ---- the gated activation of a pair's gate / up projections (a row of 2I in gate_up): SwiGLU, silu(gate) * up,
// over rows of the gate's I then the up's I (f1 = 0), or gpt-oss's clamped SwiGLU over interleaved rows (gate 2i,
// up 2i + 1; f1 its limit > 0, f0 its alpha): the gate clamped above at the limit, the up within +-limit, then
// (up + 1) gate sigmoid(alpha gate). moe_swiglu, moe_swiglu_backward and moe_dweights take it by these fields.
fn glu_at(row: u32, i: u32) -> vec2<u32> {        // (gate, up) element indices of h's element i
    if (p.f1 != 0.0) { return vec2<u32>(row + 2u * i, row + 2u * i + 1u); }
    return vec2<u32>(row + i, row + p.s1 + i);
}

fn glu(gate: f32, up: f32) -> f32 {
    if (p.f1 == 0.0) { return gate * sigmoid(gate) * up; }
    let g = min(gate, p.f1);
    return (clamp(up, -p.f1, p.f1) + 1.0) * g * sigmoid(p.f0 * g);
}

// (d glu / d gate, d glu / d up); a clamp passes the gradient where the value lies within it, bounds included
fn glu_grad(gate: f32, up: f32) -> vec2<f32> {
    if (p.f1 == 0.0) {
        let s = sigmoid(gate);
        return vec2<f32>(up * (s * (1.0 + gate * (1.0 - s))), gate * s);
    }
    let g = min(gate, p.f1);
    let u = clamp(up, -p.f1, p.f1);
    let s = sigmoid(p.f0 * g);
    return vec2<f32>(select(0.0, (u + 1.0) * (s + p.f0 * g * s * (1.0 - s)), gate <= p.f1),
                     select(0.0, g * s, up >= -p.f1 && up <= p.f1));
}

// gpt-oss's expert biases where s5 != 0: bias[e, c] (bias (E, width) = t3) of pair q's expert e (experts i5 (N k),
// s6 E), else 0. moe_swiglu, moe_bias and moe_combine take it by these fields.
fn pair_bias(q: u32, c: u32, width: u32) -> f32 {
    if (p.s5 == 0u) {
        return 0.0;
    }
    let e = u32(i5[p.o5 + q]);
    return select(0.0, t3_ld(p.o3 + e * width + c), e < p.s6);
}

// ---- h! (N k, I) = t1 from gate_up (N k, 2I) = t2 (plus pair_bias): the gated activation (glu). s0 N k, s1 I,
// f0 / f1 glu's.
@compute @workgroup_size(64)
fn moe_swiglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = flat(wid, nwg, lid);
    if (g >= p.s0 * p.s1) {
        return;
    }
    let q = g / p.s1;
    let at = glu_at(0u, g % p.s1);
    let row = p.o2 + q * 2u * p.s1;
    t1_st(p.o1 + g, glu(t2_ld(row + at.x) + pair_bias(q, at.x, 2u * p.s1),
                        t2_ld(row + at.y) + pair_bias(q, at.y, 2u * p.s1)));
}

// ---- dgate_up! (N k, 2I) = t1 from dh_raw (N k, I) = t2 (the gradient on h before the pair's weight), gate_up
// (N k, 2I) = t3, weights f6 (N k). s0 N k, s1 I, f0 / f1 glu's. dh = weight * dh_raw through glu (float32 dgate_up:
// its elements stored one at a time).
@compute @workgroup_size(64)
fn moe_swiglu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = flat(wid, nwg, lid);
    if (g >= p.s0 * p.s1) {
        return;
    }
    let q = g / p.s1;
    let at = glu_at(q * 2u * p.s1, g % p.s1);
    let grad = f6[p.o6 + q] * t2_ld(p.o2 + g) * glu_grad(t3_ld(p.o3 + at.x), t3_ld(p.o3 + at.y));
    t1_st(p.o1 + at.x, grad.x);
    t1_st(p.o1 + at.y, grad.y);
}

// ---- dweights! (N k) = t1: dy[n] . out[q] = dh_raw[q] . h[q], dh_raw (N k, I) = t2, gate_up (N k, 2I) = t3.
// s0 N k, s1 I, f0 / f1 glu's. One invocation per two pairs (stored together: a 16-bit dweights), each sum in index
// order.
fn dweight(q: u32) -> f32 {
    var acc = 0.0;
    for (var i = 0u; i < p.s1; i = i + 1u) {
        let at = glu_at(p.o3 + q * 2u * p.s1, i);
        acc = acc + t2_ld(p.o2 + q * p.s1 + i) * glu(t3_ld(at.x), t3_ld(at.y));
    }
    return acc;
}

@compute @workgroup_size(64)
fn moe_dweights(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let q = 2u * flat(wid, nwg, lid);
    if (q >= p.s0) {
        return;
    }
    if (q + 1u < p.s0) {
        t1_st2(p.o1 + q, vec2<f32>(dweight(q), dweight(q + 1u)));
    } else {
        t1_st(p.o1 + q, dweight(q));
    }
}

// ---- gpt-oss's expert biases. moe_bias: out! (N k, W) = t1 = src (N k, W) = t2 plus pair_bias (s5 = 1). s0 N k W,
// s1 W. One invocation per two elements (stored together: a 16-bit out).
fn biased(g: u32) -> f32 {
    return t2_ld(p.o2 + g) + pair_bias(g / p.s1, g % p.s1, p.s1);
}

@compute @workgroup_size(64)
fn moe_bias(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = 2u * flat(wid, nwg, lid);
    if (g >= p.s0) {
        return;
    }
    if (g + 1u < p.s0) {
        t1_st2(p.o1 + g, vec2<f32>(biased(g), biased(g + 1u)));
    } else {
        t1_st(p.o1 + g, biased(g));
    }
}

// moe_bias_dweights: the down bias's share of the route weights' gradient, dweights! (N k) = t1 += dy[n] . bias[e]
// for pair q = n k + j of expert e; dy (N, C) = t2, bias (E, C) = t3, experts i5 (N k). s0 N k, s1 C, s2 k, s3 E.
// One invocation per two pairs, each sum in index order.
fn bias_dweight(q: u32) -> f32 {
    let e = u32(i5[p.o5 + q]);
    var acc = t1_ld(p.o1 + q);
    if (e >= p.s3) {
        return acc;
    }
    for (var c = 0u; c < p.s1; c = c + 1u) {
        acc = acc + t2_ld(p.o2 + (q / p.s2) * p.s1 + c) * t3_ld(p.o3 + e * p.s1 + c);
    }
    return acc;
}

@compute @workgroup_size(64)
fn moe_bias_dweights(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let q = 2u * flat(wid, nwg, lid);
    if (q >= p.s0) {
        return;
    }
    if (q + 1u < p.s0) {
        t1_st2(p.o1 + q, vec2<f32>(bias_dweight(q), bias_dweight(q + 1u)));
    } else {
        t1_st(p.o1 + q, bias_dweight(q));
    }
}

// moe_bias_backward: a bias's gradient, grad! (E, W) f32 = t1 (+)= the sum over expert e's sorted rows of
// (w[q] where s4 != 0) src[row(q)] (rows by token where s3 != 0, else by pair); src = t2, perm i5, weights f6
// (N k), offsets i7 (E + 1). s0 W, s1 E, s2 k, s6 accumulate. One invocation per (e, column), in sorted-row order.
@compute @workgroup_size(64)
fn moe_bias_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = flat(wid, nwg, lid);
    if (g >= p.s0 * p.s1) {
        return;
    }
    let e = g / p.s0;
    let c = g % p.s0;
    var acc = 0.0;
    if (p.s6 != 0u) {
        acc = t1_ld(p.o1 + g);
    }
    for (var r = u32(i7[p.o7 + e]); r < u32(i7[p.o7 + e + 1u]); r = r + 1u) {
        let q = u32(i5[p.o5 + r]);
        let row = select(q, q / p.s2, p.s3 != 0u);
        let w = select(1.0, f6[p.o6 + q], p.s4 != 0u);
        acc = acc + w * t2_ld(p.o2 + row * p.s0 + c);
    }
    t1_st(p.o1 + g, acc);
}

// ---- the combine: y! (N, C) = t1 (+)= sum_j w[n, j] (out[n k + j] + pair_bias) in slot order; out (N k, C) = t2,
// weights f6 (N, k) where s3 != 0 (else 1). s0 N, s1 C, s2 k, s4 accumulate. One invocation per two elements
// (stored together: a 16-bit y).
fn combined(g: u32) -> f32 {
    let n = g / p.s1;
    let c = g % p.s1;
    var acc = 0.0;
    if (p.s4 != 0u) {
        acc = t1_ld(p.o1 + g);
    }
    for (var j = 0u; j < p.s2; j = j + 1u) {
        var w = 1.0;
        if (p.s3 != 0u) {
            w = f6[p.o6 + n * p.s2 + j];
        }
        acc = acc + w * (t2_ld(p.o2 + (n * p.s2 + j) * p.s1 + c) + pair_bias(n * p.s2 + j, c, p.s1));
    }
    return acc;
}

@compute @workgroup_size(64)
fn moe_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = 2u * flat(wid, nwg, lid);
    if (g >= p.s0 * p.s1) {
        return;
    }
    if (g + 1u < p.s0 * p.s1) {
        t1_st2(p.o1 + g, vec2<f32>(combined(g), combined(g + 1u)));
    } else {
        t1_st(p.o1 + g, combined(g));
    }
}

// ---- the experts' summed outer products, split-K: out[e, o, j] = f0 * sum over expert e's sorted rows of
// (w[q] if s5 & 4) U[row_u(q), o] V[row_v(q), j] (rows by token where s5 & 1 (U), s5 & 2 (V), else by pair).
// part! = t1 ((tiles, O, Q); the output itself (E, O, Q) when s4 is 0: one tile per expert, all its rows), U = t2
// (.., O), V = t3 (.., Q), perm i5, weights f6 (N k), offsets i7 (E + 1). s0 O, s1 Q, s2 E, s3 k (slots), s4 rows
// per tile (0: an expert's rows in one), s6 accumulate (s4 = 0 only). Grid: the outputs flat over x, y; tiles in
// z, an expert's tiles after the earlier experts' (idle tiles exit at once).
@compute @workgroup_size(64)
fn moe_outer(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let oq = (wid.y * nwg.x + wid.x) * WG + lid.x;
    let OQ = p.s0 * p.s1;
    var e = p.s2;
    var r0 = 0u;
    var r1 = 0u;
    if (p.s4 == 0u) {
        e = wid.z;
        r0 = u32(i7[p.o7 + e]);
        r1 = u32(i7[p.o7 + e + 1u]);
    } else {
        var cum = 0u;
        for (var ex = 0u; ex < p.s2; ex = ex + 1u) {
            let a = u32(i7[p.o7 + ex]);
            let b = u32(i7[p.o7 + ex + 1u]);
            let t = (b - a + p.s4 - 1u) / p.s4;
            if (e == p.s2 && wid.z < cum + t) {
                e = ex;
                r0 = a + (wid.z - cum) * p.s4;
                r1 = min(r0 + p.s4, b);
            }
            cum = cum + t;
        }
    }
    if (e >= p.s2 || oq >= OQ) {
        return;
    }
    let o = oq / p.s1;
    let j = oq % p.s1;
    let slots = p.s3;
    var acc = 0.0;
    for (var r = r0; r < r1; r = r + 1u) {
        let q = u32(i5[p.o5 + r]);
        let ru = select(q, q / slots, (p.s5 & 1u) != 0u);
        let rv = select(q, q / slots, (p.s5 & 2u) != 0u);
        var u = t2_ld(p.o2 + ru * p.s0 + o);
        if ((p.s5 & 4u) != 0u) {
            u = u * f6[p.o6 + q];
        }
        acc = acc + u * t3_ld(p.o3 + rv * p.s1 + j);
    }
    let at = p.o1 + wid.z * OQ + oq;
    if (p.s4 == 0u && p.s6 != 0u) {
        t1_st(at, t1_ld(at) + p.f0 * acc);
    } else {
        t1_st(at, p.f0 * acc);
    }
}

// ---- the split-K reduction: out! (E, O, Q) = t1 (+)= sum of expert e's tiles of part (tiles, O, Q) = t2, in
// tile order; an expert with no rows gets 0 (or keeps its value). offsets i7 (E + 1). s0 O Q, s1 E, s4 rows per
// tile, s6 accumulate. One invocation per output.
@compute @workgroup_size(64)
fn moe_outer_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = flat(wid, nwg, lid);
    if (g >= p.s0 * p.s1) {
        return;
    }
    let e = g / p.s0;
    let oq = g % p.s0;
    var tile = 0u;
    for (var ex = 0u; ex < e; ex = ex + 1u) {
        tile = tile + (u32(i7[p.o7 + ex + 1u]) - u32(i7[p.o7 + ex]) + p.s4 - 1u) / p.s4;
    }
    let tiles = (u32(i7[p.o7 + e + 1u]) - u32(i7[p.o7 + e]) + p.s4 - 1u) / p.s4;
    var acc = 0.0;
    if (p.s6 != 0u) {
        acc = t1_ld(p.o1 + g);
    }
    for (var t = tile; t < tile + tiles; t = t + 1u) {
        acc = acc + t2_ld(p.o2 + t * p.s0 + oq);
    }
    t1_st(p.o1 + g, acc);
}
