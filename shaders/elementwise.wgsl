// Elementwise helpers over flat fp32 ranges (one invocation per element, 256 per workgroup).
// Uniform: s0 = n elements; o1..o3 = element offsets of bindings 1..3; f0 = the scalar (alpha, s or value).
// @include tanh

struct Params {
    s0: u32, s1: u32, s2: u32, s3: u32, s4: u32, s5: u32, s6: u32, s7: u32,
    o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32, o8: u32,
    o9: u32, o10: u32, o11: u32, o12: u32,
    f0: f32, f1: f32, f2: f32, f3: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> a: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;

// Grids wider than 65535 workgroups fold into y; the flat index is rebuilt here.
fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid.x;
}

// y (rows, s1) = columns s3 .. s3 + s1 of a (rows, s2): a fused projection's part (s0 = rows * s1)
@compute @workgroup_size(256)
fn columns_get(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    y[p.o1 + i] = a[p.o2 + (i / p.s1) * p.s2 + p.s3 + i % p.s1];
}

// columns s3 .. s3 + s1 of y (rows, s2) = a (rows, s1): the part's gradient into the fused one's
@compute @workgroup_size(256)
fn columns_put(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    y[p.o1 + (i / p.s1) * p.s2 + p.s3 + i % p.s1] = a[p.o2 + i];
}

// y = a + b
@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    y[p.o1 + i] = a[p.o2 + i] + b[p.o3 + i];
}

// y += alpha * a
@compute @workgroup_size(256)
fn add_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    y[p.o1 + i] = y[p.o1 + i] + p.f0 * a[p.o2 + i];
}

// y = s * a
@compute @workgroup_size(256)
fn scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    y[p.o1 + i] = p.f0 * a[p.o2 + i];
}

// y *= s
@compute @workgroup_size(256)
fn scale_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    y[p.o1 + i] = p.f0 * y[p.o1 + i];
}

// y = s * tanh(a / s): soft-capping (Gemma 2's logits)
@compute @workgroup_size(256)
fn softcap_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    y[p.o1 + i] = p.f0 * tanh_f32(a[p.o2 + i] / p.f0);
}

// y = s * tanh(y / s)
@compute @workgroup_size(256)
fn softcap_forward_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    y[p.o1 + i] = p.f0 * tanh_f32(y[p.o1 + i] / p.f0);
}

// y = a (a compute-pass copy: unlike copy_buffer_to_buffer it does not end the pass)
@compute @workgroup_size(256)
fn copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    y[p.o1 + i] = a[p.o2 + i];
}

// y = value
@compute @workgroup_size(256)
fn fill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    y[p.o1 + i] = p.f0;
}
