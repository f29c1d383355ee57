// A per-token objective's gradient weights (engines/protocol.py TokenObjective, GRPO's loss types at the token
// level), between the loss head's cross-entropy forward and backward over a chunk of rows: from each row's loss
// (-logp, cross_entropy_forward's) and its terms [scale, advantage, old logp, reference logp], the weight
// w = -scale * d(token loss) / d logp that cross_entropy_backward then takes as its row weight. One invocation
// per row (engines/numpy/ops.py token_objective_backward is the reference).
// Uniform: s0 = rows in this chunk; s1 = the policy loss (0 clipped, 1 cispo, 2 sapo); s2 = flags (1: old
// log-probabilities given, else the ratio is 1; 2: the KL term times the ratio); o1..o3 = element offsets of
// bindings 1..3 (the wrapper folds the chunk's row offset into them); f0 = beta (0: no KL term); f1, f2 = the
// loss's parameters (clipped: 1 - epsilon_low, 1 + epsilon_high; cispo: epsilon_high, unused; sapo: the
// temperatures for positive and for other advantages).

// @include params

// ---- backward: 1 weights (rows,) out, 2 loss (rows,), 3 terms (rows, 4) ----
// @tensor 1 b_weight read_write
// @tensor 2 b_loss read
// @tensor 3 b_terms read

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// d(policy loss) / d logp of one token: logp, its importance ratio e^(logp - old), its row's advantage
fn policy_slope(logp: f32, ratio: f32, adv: f32) -> f32 {
    if (p.s1 == 1u) {                       // cispo: the clamped ratio is a constant factor
        return -min(ratio, p.f1) * adv;
    }
    if (p.s1 == 2u) {                       // sapo: a soft gate of the ratio
        var tau = p.f2;
        if (adv > 0.0) { tau = p.f1; }
        let gate = sigmoid(tau * (ratio - 1.0));
        return -4.0 * gate * (1.0 - gate) * ratio * adv;
    }
    // the clipped surrogate -min(ratio A, clip(ratio) A): its gradient flows where the unclipped term is the
    // smaller or equal
    let clipped = clamp(ratio, p.f1, p.f2);
    if (ratio * adv <= clipped * adv) { return -ratio * adv; }
    return 0.0;
}

@compute @workgroup_size(256)
fn token_objective_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                            @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = (wid.y * nwg.x + wid.x) * 256u + lid.x;
    if (row >= p.s0) { return; }
    let t = p.o3 + 4u * row;
    let scale = b_terms_ld(t);
    if (scale == 0.0) {                     // an untrained row: no gradient (its logp may be anything)
        b_weight_st(p.o1 + row, 0.0);
        return;
    }
    let logp = -b_loss_ld(p.o2 + row);
    let adv = b_terms_ld(t + 1u);
    var ratio = 1.0;
    if ((p.s2 & 1u) != 0u) { ratio = exp(logp - b_terms_ld(t + 2u)); }
    var slope = policy_slope(logp, ratio, adv);
    if (p.f0 != 0.0) {                      // beta times the k3 estimate of KL(policy || reference)
        let gap = b_terms_ld(t + 3u) - logp;
        var dkl = 1.0 - exp(gap);
        if ((p.s2 & 2u) != 0u) { dkl = (dkl + exp(gap) - gap - 1.0) * ratio; }
        slope += p.f0 * dkl;
    }
    b_weight_st(p.o1 + row, -scale * slope);
}
