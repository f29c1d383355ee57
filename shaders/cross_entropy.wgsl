// Fused softmax cross-entropy over a chunk of logit rows (n_rows, V): forward writes per-row loss
// (0 on ignored rows), logsumexp and a valid flag (1.0 / 0.0) with one 256-wide workgroup per row;
// softmax_entropy_forward each row's entropy from those logits and lse; cross_entropy_reduce sums loss and valid flags into [loss_sum, count]; backward writes
// dlogits = grad_scale * weight[row] * (softmax - onehot) on counted rows and 0 on ignored rows.
// A target is counted when 0 <= target < V (IGNORE_INDEX -100 and anything out of range are ignored).
// Uniform: s0 = rows in this chunk, s1 = V, s2 = the row weights' stride (1: a weight per row, a preference
// objective's coefficients; 0: one weight, 1.0, for every row), s3 = rows to reduce; o1..o6 = element offsets
// of bindings 1..6 (the wrapper folds the chunk's row offset into them); f0 = grad scale multiplier; f1 = the
// logits' soft-cap (their backward's factor; 0: none).

// @include params

const WG: u32 = 256u;
const NEG: f32 = -3.0e38;

var<workgroup> red_m: array<f32, WG>;
var<workgroup> red_s: array<f32, WG>;

fn counted(t: i32) -> bool {
    return t >= 0 && u32(t) < p.s1;
}

// The backward's factor for logits soft-capped at f1 (Gemma 2's final_logit_softcapping; 0: none), from
// the capped logit y: d(cap tanh(x / cap)) / dx = 1 - (y / cap)^2.
fn cap_slope(y: f32) -> f32 {
    if (p.f1 == 0.0) { return 1.0; }
    let r = y / p.f1;
    return 1.0 - r * r;
}

// ---- forward: 1 loss (rows,) out, 2 lse (rows,) out, 3 valid (rows,) out, 4 logits (rows, V), 5 targets i32 ----
@group(0) @binding(1) var<storage, read_write> f_loss: array<f32>;
@group(0) @binding(2) var<storage, read_write> f_lse: array<f32>;
@group(0) @binding(3) var<storage, read_write> f_valid: array<f32>;
@group(0) @binding(4) var<storage, read> f_logits: array<f32>;
@group(0) @binding(5) var<storage, read> f_tgt: array<i32>;

@compute @workgroup_size(WG)
fn cross_entropy_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid3: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.s0) { return; }
    let lid = lid3.x;
    let v = p.s1;
    let base = p.o4 + row * v;
    // Per-invocation online logsumexp over a strided slice of the row: one pass over the logits.
    var m = NEG;
    var s = 0.0;
    for (var j = lid; j < v; j += WG) {
        let x = f_logits[base + j];
        if (x > m) {
            s = s * exp(m - x) + 1.0;
            m = x;
        } else {
            s += exp(x - m);
        }
    }
    red_m[lid] = m;
    red_s[lid] = s;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w = w / 2u) {
        if (lid < w) {
            let m2 = red_m[lid + w];
            let s2 = red_s[lid + w];
            let m1 = red_m[lid];
            let s1 = red_s[lid];
            let mm = max(m1, m2);
            red_m[lid] = mm;
            red_s[lid] = s1 * exp(m1 - mm) + s2 * exp(m2 - mm);
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        let lse = red_m[0] + log(red_s[0]);
        let t = f_tgt[p.o5 + row];
        var loss = 0.0;
        var valid = 0.0;
        if (counted(t)) {
            loss = lse - f_logits[base + u32(t)];
            valid = 1.0;
        }
        f_loss[p.o1 + row] = loss;
        f_lse[p.o2 + row] = lse;
        f_valid[p.o3 + row] = valid;
    }
}

// ---- entropy: 1 entropy (rows,) out, 2 logits (rows, V), 3 lse (rows,) ----
// The entropy of each row's softmax, sum_j p_j (lse - x_j) (a metric: GRPO's "entropy"), from the forward's
// logits and lse; o2 and o3 point at the chunk's first row, as the forward's bindings do.
@group(0) @binding(1) var<storage, read_write> e_out: array<f32>;
@group(0) @binding(2) var<storage, read> e_logits: array<f32>;
@group(0) @binding(3) var<storage, read> e_lse: array<f32>;

@compute @workgroup_size(WG)
fn softmax_entropy_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_id) lid3: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.s0) { return; }
    let lid = lid3.x;
    let base = p.o2 + row * p.s1;
    let lse = e_lse[p.o3 + row];
    var a = 0.0;
    for (var j = lid; j < p.s1; j += WG) {
        let x = e_logits[base + j];
        a += exp(x - lse) * (lse - x);       // p_j * -log p_j: no cancellation of two large sums
    }
    red_m[lid] = a;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w = w / 2u) {
        if (lid < w) {
            red_m[lid] += red_m[lid + w];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        e_out[p.o1 + row] = red_m[0];
    }
}

// ---- reduce: 1 result [loss_sum, count] out, 2 loss (n,), 3 valid (n,) ----
@group(0) @binding(1) var<storage, read_write> r_out: array<f32>;
@group(0) @binding(2) var<storage, read> r_loss: array<f32>;
@group(0) @binding(3) var<storage, read> r_valid: array<f32>;

@compute @workgroup_size(WG)
fn cross_entropy_reduce(@builtin(local_invocation_id) lid3: vec3<u32>) {
    let lid = lid3.x;
    var a = 0.0;
    var c = 0.0;
    for (var i = lid; i < p.s3; i += WG) {
        a += r_loss[p.o2 + i];
        c += r_valid[p.o3 + i];
    }
    red_m[lid] = a;
    red_s[lid] = c;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w = w / 2u) {
        if (lid < w) {
            red_m[lid] += red_m[lid + w];
            red_s[lid] += red_s[lid + w];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        r_out[p.o1] = red_m[0];
        r_out[p.o1 + 1u] = red_s[0];
    }
}

// ---- backward: 1 dlogits (rows, V) out, 2 logits (rows, V), 3 targets, 4 lse (rows,), 5 grad scale (1,),
// 6 row weights (rows,) or (1,) ----
@group(0) @binding(1) var<storage, read_write> b_dl: array<f32>;
@group(0) @binding(2) var<storage, read> b_logits: array<f32>;
@group(0) @binding(3) var<storage, read> b_tgt: array<i32>;
@group(0) @binding(4) var<storage, read> b_lse: array<f32>;
@group(0) @binding(5) var<storage, read> b_scale: array<f32>;
@group(0) @binding(6) var<storage, read> b_weight: array<f32>;

@compute @workgroup_size(WG)
fn cross_entropy_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let j = wid.x * WG + lid.x;
    let row = wid.y;
    let v = p.s1;
    if (j >= v || row >= p.s0) { return; }
    let t = b_tgt[p.o3 + row];
    var g = 0.0;
    if (counted(t)) {
        let y = b_logits[p.o2 + row * v + j];
        g = exp(y - b_lse[p.o4 + row]);
        if (u32(t) == j) { g -= 1.0; }
        g *= b_scale[p.o5] * b_weight[p.o6 + row * p.s2] * p.f0 * cap_slope(y);
    }
    b_dl[p.o1 + row * v + j] = g;
}

// ---- backward in place: 1 logits -> dlogits (rows, V), 2 targets, 3 lse (rows,), 4 grad scale (1,), 5 row
// weights (rows,) or (1,) ----
@group(0) @binding(1) var<storage, read_write> i_dl: array<f32>;
@group(0) @binding(2) var<storage, read> i_tgt: array<i32>;
@group(0) @binding(3) var<storage, read> i_lse: array<f32>;
@group(0) @binding(4) var<storage, read> i_scale: array<f32>;
@group(0) @binding(5) var<storage, read> i_weight: array<f32>;

@compute @workgroup_size(WG)
fn cross_entropy_backward_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let j = wid.x * WG + lid.x;
    let row = wid.y;
    let v = p.s1;
    if (j >= v || row >= p.s0) { return; }
    let t = i_tgt[p.o2 + row];
    var g = 0.0;
    if (counted(t)) {
        let y = i_dl[p.o1 + row * v + j];
        g = exp(y - i_lse[p.o3 + row]);
        if (u32(t) == j) { g -= 1.0; }
        g *= i_scale[p.o4] * i_weight[p.o5 + row * p.s2] * p.f0 * cap_slope(y);
    }
    i_dl[p.o1 + row * v + j] = g;
}
