// The causal depthwise short convolution (LFM2's conv layers, Qwen3.5's conv1d before its SiLU): forward, the
// input's and the weight's gradients, and the recurrent step over a per-row window state; the mirror of
// engines/shared/short_conv.py. The source builder (tuned/short_conv_source.py) prepends K (the kernel size),
// TILE (positions per invocation of the forward and dx) and WG (invocations per workgroup).
//
// Layouts: x, y, dy, dx (B, T, C); weight (C, K) (the checkpoint's (C, 1, K)); segment ids (B, T) i32, 0 =
// padding (flags bit 0; without it every position is real and one sequence). y[t] = act(z[t]),
// z[t] = sum_j weight[c, j] x[t - (K-1-j)] over the taps whose input lies in t's sequence (same non-zero id);
// act is SiLU when p.act = 1, else the identity. Each invocation owns a pair of channels (c, c + 1), so 16-bit
// outputs are written by whole words (the wrappers ask for an even C then). No float atomics: the weight's
// gradient sums per-block partials (w2) in a fixed order.

struct Params {
    b: u32, t: u32, c: u32, act: u32, flags: u32, rows: u32, nblk: u32, runs: u32, accumulate: u32,
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// @tensor 1 y read_write
@group(0) @binding(2) var<storage, read_write> w2: array<f32>;
@group(0) @binding(3) var<storage, read_write> w3: array<f32>;
// @tensor 4 x read
// @tensor 5 wt read
@group(0) @binding(6) var<storage, read> ids: array<i32>;
// @tensor 7 dy read

const HAS_SEG: u32 = 1u;

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid.x;
}

// the segment id of row b's position t: 0 before the row's start and past its end (never in a window)
fn seg_of(b: u32, t: i32) -> i32 {
    if (t < 0 || t >= i32(p.t)) { return 0; }
    if ((p.flags & HAS_SEG) == 0u) { return 1; }
    return ids[p.o6 + b * p.t + u32(t)];
}

fn at(b: u32, t: i32, c: u32) -> u32 {                 // element (b, t, c) of a (B, T, C) tensor
    return (b * p.t + u32(t)) * p.c + c;
}

fn w_of(c: u32, j: u32) -> f32 {
    return wt_ld(p.o5 + c * K + j);
}

fn act_forward(z: vec2<f32>) -> vec2<f32> {
    if (p.act == 1u) { return z / (vec2<f32>(1.0) + exp(-z)); }
    return z;
}

// d act / dz at z: SiLU's s (1 + z (1 - s)), s = sigmoid(z)
fn act_grad(z: vec2<f32>) -> vec2<f32> {
    let s = vec2<f32>(1.0) / (vec2<f32>(1.0) + exp(-z));
    return s * (vec2<f32>(1.0) + z * (vec2<f32>(1.0) - s));
}

// a pair of outputs at element i of y (channels c, c + 1): one word when C is even
fn store_pair(i: u32, c: u32, v: vec2<f32>) {
    if ((p.c & 1u) == 0u) {
        y_st2(p.o1 + i, v);
    } else {
        y_st(p.o1 + i, v.x);
        if (c + 1u < p.c) { y_st(p.o1 + i + 1u, v.y); }
    }
}

// the taps of channels c, c + 1 in registers (the second 0 past C)
fn taps(c: u32) -> array<vec2<f32>, K> {
    var w: array<vec2<f32>, K>;
    let two = c + 1u < p.c;
    for (var j = 0u; j < K; j = j + 1u) {
        w[j] = vec2<f32>(w_of(c, j), select(0.0, w_of(c + 1u, j), two));
    }
    return w;
}

// x at (b, t) for channels c, c + 1, 0 where id is 0 (outside the row or padding)
fn x_pair(b: u32, t: i32, c: u32, id: i32) -> vec2<f32> {
    if (id == 0) { return vec2<f32>(0.0); }
    let i = p.o4 + at(b, t, c);
    return vec2<f32>(x_ld(i), select(0.0, x_ld(i + 1u), c + 1u < p.c));
}

// ---- forward: y! (t1) <- x (t4), weight (t5), ids (segments). One invocation per (b, tile of TILE positions,
// channel pair), the last K inputs and their ids in registers (each input loaded once). ----------------------------
@compute @workgroup_size(WG)
fn sc_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    let pairs = (p.c + 1u) / 2u;
    let tiles = (p.t + TILE - 1u) / TILE;
    if (idx >= p.b * tiles * pairs) { return; }
    let c = 2u * (idx % pairs);
    let b = idx / pairs / tiles;
    let t0 = i32((idx / pairs % tiles) * TILE);
    let w = taps(c);
    var xs: array<vec2<f32>, K>;                            // xs[j]: the input K-1-j positions back
    var ids: array<i32, K>;
    for (var j = 0u; j + 1u < K; j = j + 1u) {
        let s = t0 - i32(K - 1u - j);
        ids[j] = seg_of(b, s);
        xs[j] = x_pair(b, s, c, ids[j]);
    }
    for (var i = 0u; i < TILE; i = i + 1u) {
        let t = t0 + i32(i);
        if (t >= i32(p.t)) { break; }
        let id = seg_of(b, t);
        ids[K - 1u] = id;
        xs[K - 1u] = x_pair(b, t, c, id);
        var z = vec2<f32>(0.0);
        for (var j = 0u; j < K; j = j + 1u) {
            if (id != 0 && ids[j] == id) { z = fma(w[j], xs[j], z); }
        }
        store_pair(at(b, t, c), c, act_forward(z));
        for (var j = 0u; j + 1u < K; j = j + 1u) {
            xs[j] = xs[j + 1u];
            ids[j] = ids[j + 1u];
        }
    }
}

// ---- dx: dx! (t1) <- dy (t7), x (t4, for SiLU's z), weight (t5), ids. dx[s] = sum over lags of dz[s + lag]
// weight[K-1-lag] where s and s + lag share a sequence. Invocations as the forward's: each walks positions
// t0 .. t0 + TILE + K - 2, the inputs (for z) and the dz of the last K positions in registers. -----------------------
@compute @workgroup_size(WG)
fn sc_backward_dx(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    let pairs = (p.c + 1u) / 2u;
    let tiles = (p.t + TILE - 1u) / TILE;
    if (idx >= p.b * tiles * pairs) { return; }
    let c = 2u * (idx % pairs);
    let b = idx / pairs / tiles;
    let t0 = i32((idx / pairs % tiles) * TILE);
    let two = c + 1u < p.c;
    let w = taps(c);
    var xs: array<vec2<f32>, K>;                            // the inputs of the last K positions (SiLU's z)
    var dz: array<vec2<f32>, K>;                            // dz of the last K positions
    var ids: array<i32, K>;
    if (p.act == 1u) {
        for (var j = 0u; j + 1u < K; j = j + 1u) {
            let s = t0 - i32(K - 1u - j);
            ids[j] = seg_of(b, s);
            xs[j] = x_pair(b, s, c, ids[j]);
        }
    }
    let last = min(t0 + i32(TILE + K - 1u), i32(p.t) + i32(K - 1u));
    for (var t = t0; t < last; t = t + 1) {
        let id = seg_of(b, t);
        ids[K - 1u] = id;
        var g = vec2<f32>(0.0);
        if (id != 0) {
            let i = p.o7 + at(b, t, c);
            g = vec2<f32>(dy_ld(i), select(0.0, dy_ld(i + 1u), two));
        }
        if (p.act == 1u) {
            xs[K - 1u] = x_pair(b, t, c, id);
            var z = vec2<f32>(0.0);
            for (var j = 0u; j < K; j = j + 1u) {
                if (id != 0 && ids[j] == id) { z = fma(w[j], xs[j], z); }
            }
            g = g * act_grad(z);
        }
        dz[K - 1u] = g;
        let s = t - i32(K - 1u);                            // the output: dz[lag] is at s + lag
        if (s >= t0) {
            let sid = ids[0];
            var d = vec2<f32>(0.0);
            for (var lag = 0u; lag < K; lag = lag + 1u) {
                if (sid != 0 && ids[lag] == sid) { d = fma(dz[lag], w[K - 1u - lag], d); }
            }
            store_pair(at(b, s, c), c, d);
        }
        for (var j = 0u; j + 1u < K; j = j + 1u) {
            xs[j] = xs[j + 1u];
            dz[j] = dz[j + 1u];
            ids[j] = ids[j + 1u];
        }
    }
}

// ---- the weight's gradient, part 1: w2! partials (B, nblk, C, K) <- dy, x, weight, ids. One invocation per (b,
// block of p.rows positions, channel pair): sum over its positions t of dz[t] x[t - (K-1-j)] per tap j, the last K
// inputs and ids in registers. ----------------------------------------------------------------------------------
@compute @workgroup_size(WG)
fn sc_backward_dw_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    let pairs = (p.c + 1u) / 2u;
    if (idx >= p.b * p.nblk * pairs) { return; }
    let c = 2u * (idx % pairs);
    let blk = idx / pairs;                                  // b * nblk + block
    let b = blk / p.nblk;
    let t0 = i32((blk % p.nblk) * p.rows);
    let t1 = min(i32(p.t), t0 + i32(p.rows));
    let two = c + 1u < p.c;
    let w = taps(c);
    var xs: array<vec2<f32>, K>;
    var ids: array<i32, K>;
    var acc: array<vec2<f32>, K>;
    for (var j = 0u; j + 1u < K; j = j + 1u) {
        let s = t0 - i32(K - 1u - j);
        ids[j] = seg_of(b, s);
        xs[j] = x_pair(b, s, c, ids[j]);
    }
    for (var t = t0; t < t1; t = t + 1) {
        let id = seg_of(b, t);
        ids[K - 1u] = id;
        xs[K - 1u] = x_pair(b, t, c, id);
        if (id != 0) {
            let i = p.o7 + at(b, t, c);
            var g = vec2<f32>(dy_ld(i), select(0.0, dy_ld(i + 1u), two));
            if (p.act == 1u) {
                var z = vec2<f32>(0.0);
                for (var j = 0u; j < K; j = j + 1u) {
                    if (ids[j] == id) { z = fma(w[j], xs[j], z); }
                }
                g = g * act_grad(z);
            }
            for (var j = 0u; j < K; j = j + 1u) {
                if (ids[j] == id) { acc[j] = fma(g, xs[j], acc[j]); }
            }
        }
        for (var j = 0u; j + 1u < K; j = j + 1u) {
            xs[j] = xs[j + 1u];
            ids[j] = ids[j + 1u];
        }
    }
    for (var j = 0u; j < K; j = j + 1u) {
        w2[p.o2 + (blk * p.c + c) * K + j] = acc[j].x;
        if (two) { w2[p.o2 + (blk * p.c + c + 1u) * K + j] = acc[j].y; }
    }
}

// ---- the weight's gradient, part 2: dw! (w3) (C, K) <- the partials (w2), summed over the B nblk blocks in order;
// added to dw where p.accumulate = 1 (a step's micro-batches). One invocation per (channel, tap). ------------------------------------------------------------------------------
@compute @workgroup_size(WG)
fn sc_backward_dw_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    if (idx >= p.c * K) { return; }
    var total = 0.0;
    let n = p.b * p.nblk;
    for (var r = 0u; r < n; r = r + 1u) { total = total + w2[p.o2 + r * p.c * K + idx]; }
    if (p.accumulate == 1u) { total = w3[p.o3 + idx] + total; }
    w3[p.o3 + idx] = total;
}

// ---- step (generation): y! (t1) (N, C), state! (w2) (slots, K-1, C) float32 in place <- x (t4) (N, C), weight,
// ids: the table of p.runs runs, (slot, first, count, fresh) each, then the tokens' indices into x / y in run order.
// A run is one row's tokens, consecutive positions; fresh = 1 starts it from a zero window. One invocation per
// (run, channel pair), its window in registers. ------------------------------------------------------------------
@compute @workgroup_size(WG)
fn sc_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = flat(wid, nwg, lid);
    let pairs = (p.c + 1u) / 2u;
    if (idx >= p.runs * pairs) { return; }
    let c = 2u * (idx % pairs);
    let r = idx / pairs;
    let two = c + 1u < p.c;
    let slot = u32(ids[p.o6 + 4u * r]);
    let first = u32(ids[p.o6 + 4u * r + 1u]);
    let count = u32(ids[p.o6 + 4u * r + 2u]);
    let fresh = ids[p.o6 + 4u * r + 3u] != 0;
    let w = taps(c);
    var win: array<vec2<f32>, K>;                           // win[j]: the input K-1-j tokens back
    for (var j = 0u; j + 1u < K; j = j + 1u) {
        let s = p.o2 + (slot * (K - 1u) + j) * p.c + c;
        if (!fresh) {
            win[j].x = w2[s];
            if (two) { win[j].y = w2[s + 1u]; }
        }
    }
    for (var i = 0u; i < count; i = i + 1u) {
        let n = u32(ids[p.o6 + 4u * p.runs + first + i]);
        let e = n * p.c + c;
        win[K - 1u] = vec2<f32>(x_ld(p.o4 + e), 0.0);
        if (two) { win[K - 1u].y = x_ld(p.o4 + e + 1u); }
        var z = vec2<f32>(0.0);
        for (var j = 0u; j < K; j = j + 1u) { z = fma(w[j], win[j], z); }
        store_pair(e, c, act_forward(z));
        for (var j = 0u; j + 1u < K; j = j + 1u) { win[j] = win[j + 1u]; }
    }
    for (var j = 0u; j + 1u < K; j = j + 1u) {
        let s = p.o2 + (slot * (K - 1u) + j) * p.c + c;
        w2[s] = win[j].x;
        if (two) { w2[s + 1u] = win[j].y; }
    }
}
