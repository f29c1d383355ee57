// Token embedding over a vocabulary row range [row0, row0 + rows) held in one buffer, so that a
// vocabulary split across buffers is handled chunk by chunk (ids outside the range are skipped).
// Forward gathers out[n] = weight[ids[n] - row0]. Backward sums dout rows into dweight without
// atomics: a links pass gives each token the next token with the same id and marks the first
// occurrence; then the first occurrence of each id walks its chain (token order, deterministic).
// The row gather pair (gpu/kernels.py row_gather_*) reuses the forward on activations (ids = row indices,
// row0 = 0); its backward is a plain scatter dx[rows[n]] = dout[n] of distinct rows.
// Uniform: s0 = N tokens, s1 = C, s2 = row0 (first vocabulary id here), s3 = rows, s4 = accumulate;
// o1..o4 = element offsets of bindings 1..4.

struct Params {
    s0: u32, s1: u32, s2: u32, s3: u32, s4: u32, s5: u32, s6: u32, s7: u32,
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32, o8: u32,
    o9: u32, o10: u32, o11: u32, o12: u32,
    f0: f32, f1: f32, f2: f32, f3: f32,
}

@group(0) @binding(0) var<uniform> p: Params;

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid.x;
}

// The row of id in this chunk, or -1 when the id lies outside it.
fn local_row(id: i32) -> i32 {
    let r = id - i32(p.s2);
    if (r < 0 || u32(r) >= p.s3) { return -1; }
    return r;
}

// ---- forward: 1 out (N, C) out, 2 ids (N,) i32, 3 weight (rows, C) ----
@group(0) @binding(1) var<storage, read_write> f_out: array<f32>;
@group(0) @binding(2) var<storage, read> f_ids: array<i32>;
@group(0) @binding(3) var<storage, read> f_w: array<f32>;

@compute @workgroup_size(256)
fn embedding_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    let c = p.s1;
    if (i >= p.s0 * c) { return; }
    let n = i / c;
    let col = i % c;
    let r = local_row(f_ids[p.o2 + n]);
    if (r < 0) { return; }
    f_out[p.o1 + i] = f_w[p.o3 + u32(r) * c + col];
}

// ---- backward links: 1 links (2N,) i32 out: [next token with the same id or -1 ..., first flag ...], 2 ids ----
@group(0) @binding(1) var<storage, read_write> l_links: array<i32>;
@group(0) @binding(2) var<storage, read> l_ids: array<i32>;

@compute @workgroup_size(256)
fn embedding_backward_links(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                            @builtin(local_invocation_id) lid: vec3<u32>) {
    let n = flat(wid, nwg, lid);
    let count = p.s0;
    if (n >= count) { return; }
    let id = l_ids[p.o2 + n];
    var first = 1;
    if (local_row(id) < 0) { first = 0; }
    for (var m = 0u; m < n && first == 1; m++) {
        if (l_ids[p.o2 + m] == id) { first = 0; }
    }
    var next = -1;
    for (var m = n + 1u; m < count; m++) {
        if (l_ids[p.o2 + m] == id) {
            next = i32(m);
            break;
        }
    }
    l_links[p.o1 + n] = next;
    l_links[p.o1 + count + n] = first;
}

// ---- backward: 1 dweight (rows, C) out (or +=, s4 = 1), 2 dout (N, C), 3 ids, 4 links (2N,) ----
@group(0) @binding(1) var<storage, read_write> b_dw: array<f32>;
@group(0) @binding(2) var<storage, read> b_dout: array<f32>;
@group(0) @binding(3) var<storage, read> b_ids: array<i32>;
@group(0) @binding(4) var<storage, read> b_links: array<i32>;

@compute @workgroup_size(256)
fn embedding_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    let c = p.s1;
    let count = p.s0;
    if (i >= count * c) { return; }
    let n = i / c;
    let col = i % c;
    if (b_links[p.o4 + count + n] == 0) { return; }
    let r = u32(local_row(b_ids[p.o3 + n]));
    var s = 0.0;
    var m = i32(n);
    loop {
        s += b_dout[p.o2 + u32(m) * c + col];
        m = b_links[p.o4 + u32(m)];
        if (m < 0) { break; }
    }
    let o = p.o1 + r * c + col;
    if (p.s4 != 0u) {
        s += b_dw[o];
    }
    b_dw[o] = s;
}

// ---- row gather backward: 1 dx (rows, C) out (or +=, s4 = 1), 2 dout (N, C), 3 rows (N,) i32, distinct ----
@group(0) @binding(1) var<storage, read_write> g_dx: array<f32>;
@group(0) @binding(2) var<storage, read> g_dout: array<f32>;
@group(0) @binding(3) var<storage, read> g_rows: array<i32>;

@compute @workgroup_size(256)
fn row_gather_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    let c = p.s1;
    if (i >= p.s0 * c) { return; }
    let r = local_row(g_rows[p.o3 + i / c]);
    if (r < 0) { return; }
    let o = p.o1 + u32(r) * c + i % c;
    var s = g_dout[p.o2 + i];
    if (p.s4 != 0u) {
        s += g_dx[o];
    }
    g_dx[o] = s;
}
