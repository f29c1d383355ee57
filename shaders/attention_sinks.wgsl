// gpt-oss's attention sinks around any attention kernel (the mirror of engines/shared/attention.py's
// attention_sink_forward / attention_sink_backward): a sink is a key whose logit is sinks[h] and whose value is 0,
// so it only adds exp(sinks[h]) to each row's softmax denominator. The forward rescales the kernel's output and
// logsumexp in place (out * exp(lse - lse'), lse' = logaddexp(lse, sink)); the backward kernels then read the
// true probabilities from lse' unchanged, and the sinks' gradient is -sum_rows exp(sink - lse') delta, from the
// backward's statistics (lse', then delta = rowsum(dout * out)).
// s0 = B, s1 = T, s2 = Hq, s3 = D, s4 accumulate (the backward); o<n>: binding n's element offset.
// @include params

// forward: 1 out (B, T, Hq, D) any storage format, 2 lse (B, Hq, T) f32, 3 sinks (Hq,) f32.
// backward: 1 dsinks (Hq,) f32, 2 stats (lse (B, Hq, T), then delta (B, Hq, T)) f32, 3 sinks (Hq,) f32.
// @tensor 1 out read_write
@group(0) @binding(2) var<storage, read_write> stats: array<f32>;
@group(0) @binding(3) var<storage, read> sinks: array<f32>;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

// One invocation per (b, t, h) row, its elements by pairs (a 16-bit out has an even D).
@compute @workgroup_size(64)
fn attention_sink_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = (wid.y * nwg.x + wid.x) * WG + lid.x;      // (b, t, h) in out's order
    if (row >= p.s0 * p.s1 * p.s2) { return; }
    let h = row % p.s2;
    let bt = row / p.s2;
    let at = p.o2 + ((bt / p.s1) * p.s2 + h) * p.s1 + bt % p.s1;
    let lse = stats[at];
    let sink = sinks[p.o3 + h];
    let top = max(lse, sink);
    let lse_new = top + log(exp(lse - top) + exp(sink - top));
    let factor = exp(lse - lse_new);
    stats[at] = lse_new;
    let base = p.o1 + row * p.s3;
    for (var c = 0u; c + 1u < p.s3; c += 2u) { out_st2(base + c, factor * out_ld2(base + c)); }
    if ((p.s3 & 1u) == 1u) { out_st(base + p.s3 - 1u, factor * out_ld(base + p.s3 - 1u)); }
}

// One workgroup per head: each invocation sums a strided share of the head's B T rows, then a tree in a fixed
// order (no float atomics: the same sum whatever the schedule). dsinks[h] (+)= the total.
@compute @workgroup_size(64)
fn attention_sink_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let h = wid.x;
    let rows = p.s0 * p.s1;
    let all = p.s0 * p.s2 * p.s1;
    let sink = sinks[p.o3 + h];
    var acc = 0.0;
    for (var r = lid.x; r < rows; r += WG) {
        let at = ((r / p.s1) * p.s2 + h) * p.s1 + r % p.s1;
        acc -= exp(sink - stats[p.o2 + at]) * stats[p.o2 + all + at];
    }
    partial[lid.x] = acc;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w >>= 1u) {
        if (lid.x < w) { partial[lid.x] += partial[lid.x + w]; }
        workgroupBarrier();
    }
    if (lid.x == 0u) {
        let prior = select(0.0, out_ld(p.o1 + h), p.s4 != 0u);
        out_st(p.o1 + h, prior + partial[0]);
    }
}
