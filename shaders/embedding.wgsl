// Token embedding over a vocabulary row range [row0, row0 + rows) held in one buffer, so that a
// vocabulary split across buffers is handled chunk by chunk (ids outside the range are skipped).
// Forward gathers out[n] = weight[ids[n] - row0]. Backward sums dout rows into dweight without
// atomics: a links pass gives each token the next token with the same id and marks the first
// occurrence; then the first occurrence of each id walks its chain (token order, deterministic).
// The row gather pair (engines/webgpu/kernels.py row_gather_*) reuses the forward on activations (ids = row indices,
// row0 = 0); its backward is a plain scatter dx[rows[n]] = dout[n] of distinct rows.
// The gathered rows, their gradients and the gather's source are tensors in any storage format
// (device/storage.py; the weights float32 or as stored, the weight gradient float32): a kernel that writes rows
// of a tensor writes them by pairs of elements (16-bit formats have even widths and offsets).
// Uniform: s0 = N tokens, s1 = C, s2 = row0 (first vocabulary id here), s3 = rows, s4 = accumulate;
// o1..o4 = element offsets of bindings 1..4.

// @include params

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid.x;
}

// The row of id in this chunk, or -1 when the id lies outside it.
fn local_row(id: i32) -> i32 {
    let r = id - i32(p.s2);
    if (r < 0 || u32(r) >= p.s3) { return -1; }
    return r;
}

// The pair of row elements invocation i covers: (row, first column); pairs of a row: (C + 1) / 2, the last of an
// odd C (float32 only) a single element.
fn pair(i: u32) -> vec2<u32> {
    let pairs = (p.s1 + 1u) / 2u;
    return vec2<u32>(i / pairs, 2u * (i % pairs));
}

// ---- forward: 1 out (N, C) out, 2 ids (N,) i32, 3 weight (rows, C) ----
// @tensor 1 f_out read_write
@group(0) @binding(2) var<storage, read> f_ids: array<i32>;
// @tensor 3 f_w read

// One invocation per pair of row elements.
@compute @workgroup_size(256)
fn embedding_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = p.s1;
    let nc = pair(flat(wid, nwg, lid));
    let n = nc.x;
    let col = nc.y;
    if (n >= p.s0) { return; }
    let r = local_row(f_ids[p.o2 + n]);
    if (r < 0) { return; }
    let src = p.o3 + u32(r) * c + col;
    let dst = p.o1 + n * c + col;
    if (col + 1u < c) {
        f_out_st2(dst, f_w_ld2(src));
    } else {
        f_out_st(dst, f_w_ld(src));
    }
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
// @tensor 2 b_dout read
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
        s += b_dout_ld(p.o2 + u32(m) * c + col);
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
// @tensor 1 g_dx read_write
// @tensor 2 g_dout read
@group(0) @binding(3) var<storage, read> g_rows: array<i32>;

// One invocation per pair of row elements.
@compute @workgroup_size(256)
fn row_gather_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = p.s1;
    let nc = pair(flat(wid, nwg, lid));
    let n = nc.x;
    let col = nc.y;
    if (n >= p.s0) { return; }
    let r = local_row(g_rows[p.o3 + n]);
    if (r < 0) { return; }
    let src = p.o2 + n * c + col;
    let o = p.o1 + u32(r) * c + col;
    if (col + 1u < c) {
        var s = g_dout_ld2(src);
        if (p.s4 != 0u) {
            s += g_dx_ld2(o);
        }
        g_dx_st2(o, s);
    } else {
        var s = g_dout_ld(src);
        if (p.s4 != 0u) {
            s += g_dx_ld(o);
        }
        g_dx_st(o, s);
    }
}
