// Elementwise helpers over flat ranges of tensors in any storage format (device/storage.py): one invocation per
// pair of elements (its last alone when n is odd), 256 per workgroup.
// Uniform: s0 = n elements; o1..o3 = element offsets of bindings 1..3 (even for 16-bit tensors); f0 = the scalar
// (alpha, s or value).
// @include tanh

// @include params

// @tensor 1 y read_write
// @tensor 2 a read
// @tensor 3 b read

// Grids wider than 65535 workgroups fold into y; the flat index of the invocation is rebuilt here, and its first
// element is twice that.
fn first(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return 2u * ((wid.y * nwg.x + wid.x) * 256u + lid.x);
}

// Element j of a fused projection's part (rows, s1), in the fused tensor (rows, s2) at column s3.
fn fused(j: u32) -> u32 {
    return (j / p.s1) * p.s2 + p.s3 + j % p.s1;
}

// y (rows, s1) = columns s3 .. s3 + s1 of a (rows, s2): a fused projection's part (s0 = rows * s1)
@compute @workgroup_size(256)
fn columns_get(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        y_st2(p.o1 + i, vec2<f32>(a_ld(p.o2 + fused(i)), a_ld(p.o2 + fused(i + 1u))));
    } else {
        y_st(p.o1 + i, a_ld(p.o2 + fused(i)));
    }
}

// columns s3 .. s3 + s1 of y (rows, s2) = a (rows, s1): the part's gradient into the fused one's. A pair whose
// elements land apart (an odd part width, float32 only) is stored one by one.
@compute @workgroup_size(256)
fn columns_put(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    if (i >= p.s0) { return; }
    let d = p.o1 + fused(i);
    if (i + 1u < p.s0 && p.o1 + fused(i + 1u) == d + 1u && (d & 1u) == 0u) {
        y_st2(d, a_ld2(p.o2 + i));
        return;
    }
    y_st(d, a_ld(p.o2 + i));
    if (i + 1u < p.s0) {
        y_st(p.o1 + fused(i + 1u), a_ld(p.o2 + i + 1u));
    }
}

// y = a + b
@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        y_st2(p.o1 + i, a_ld2(p.o2 + i) + b_ld2(p.o3 + i));
    } else {
        y_st(p.o1 + i, a_ld(p.o2 + i) + b_ld(p.o3 + i));
    }
}

// y += alpha * a
@compute @workgroup_size(256)
fn add_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        y_st2(p.o1 + i, y_ld2(p.o1 + i) + p.f0 * a_ld2(p.o2 + i));
    } else {
        y_st(p.o1 + i, y_ld(p.o1 + i) + p.f0 * a_ld(p.o2 + i));
    }
}

// y = s * a
@compute @workgroup_size(256)
fn scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        y_st2(p.o1 + i, p.f0 * a_ld2(p.o2 + i));
    } else {
        y_st(p.o1 + i, p.f0 * a_ld(p.o2 + i));
    }
}

// y *= s
@compute @workgroup_size(256)
fn scale_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        y_st2(p.o1 + i, p.f0 * y_ld2(p.o1 + i));
    } else {
        y_st(p.o1 + i, p.f0 * y_ld(p.o1 + i));
    }
}

fn softcap(v: f32) -> f32 {
    return p.f0 * tanh_f32(v / p.f0);
}

// y = s * tanh(a / s): soft-capping (Gemma 2's logits)
@compute @workgroup_size(256)
fn softcap_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        let v = a_ld2(p.o2 + i);
        y_st2(p.o1 + i, vec2<f32>(softcap(v.x), softcap(v.y)));
    } else {
        y_st(p.o1 + i, softcap(a_ld(p.o2 + i)));
    }
}

// y = s * tanh(y / s)
@compute @workgroup_size(256)
fn softcap_forward_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        let v = y_ld2(p.o1 + i);
        y_st2(p.o1 + i, vec2<f32>(softcap(v.x), softcap(v.y)));
    } else {
        y_st(p.o1 + i, softcap(y_ld(p.o1 + i)));
    }
}

// y = a (a compute-pass copy: unlike copy_buffer_to_buffer it does not end the pass); from one format to another
// it converts
@compute @workgroup_size(256)
fn copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        y_st2(p.o1 + i, a_ld2(p.o2 + i));
    } else {
        y_st(p.o1 + i, a_ld(p.o2 + i));
    }
}

// y = value
@compute @workgroup_size(256)
fn fill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = first(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (i + 1u < p.s0) {
        y_st2(p.o1 + i, vec2<f32>(p.f0));
    } else {
        y_st(p.o1 + i, p.f0);
    }
}
