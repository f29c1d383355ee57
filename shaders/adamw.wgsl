// AdamW (decoupled weight decay, as torch.optim.AdamW) and the global gradient norm without readback:
// grad_norm_partial writes one tensor's sum of squares into its slot, grad_norm_finalize turns all
// slots into [norm, clip_scale, finite_flag], and adamw_update reads clip_scale and the flag from
// that buffer (no update at all when the flag is 0, i.e. the norm is inf or nan).
// Uniform: s0 = n elements (or slots), s1 = slot, s2 = accumulate; o1..o6 = element offsets of
// bindings 1..6; f0 = max_norm.

// @include params

const WG: u32 = 256u;

var<workgroup> red: array<f32, WG>;

fn flat(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid.x;
}

// Deterministic tree sum over the workgroup; the total ends in red[0].
fn tree_sum(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w = w / 2u) {
        if (lid < w) {
            red[lid] += red[lid + w];
        }
        workgroupBarrier();
    }
    return red[0];
}

// Inf and nan by their bits: WGSL lets compilers assume finite floats, so x != x may fold away.
fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

// ---- update: 1 param, 2 m, 3 v (in/out), 4 grad, 5 hyper-parameters (8,), 6 norm result (3,) ----
// Hyper-parameters: [1 - lr * wd, beta1, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1^t),
// 1 / (1 - beta2^t), eps], formed in float64 on the CPU.
@group(0) @binding(1) var<storage, read_write> u_param: array<f32>;
@group(0) @binding(2) var<storage, read_write> u_m: array<f32>;
@group(0) @binding(3) var<storage, read_write> u_v: array<f32>;
@group(0) @binding(4) var<storage, read> u_grad: array<f32>;
@group(0) @binding(5) var<storage, read> u_hp: array<f32>;
@group(0) @binding(6) var<storage, read> u_norm: array<f32>;

@compute @workgroup_size(WG)
fn adamw_update(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat(wid, nwg, lid);
    if (i >= p.s0) { return; }
    if (u_norm[p.o6 + 2u] == 0.0) { return; }
    let hp = p.o5;
    let g = u_grad[p.o4 + i] * u_norm[p.o6 + 1u];
    let m = u_hp[hp + 1u] * u_m[p.o2 + i] + u_hp[hp + 2u] * g;
    let v = u_hp[hp + 3u] * u_v[p.o3 + i] + u_hp[hp + 4u] * (g * g);
    u_m[p.o2 + i] = m;
    u_v[p.o3 + i] = v;
    let x = u_param[p.o1 + i] * u_hp[hp];
    u_param[p.o1 + i] = x - u_hp[hp + 5u] * m / (sqrt(v * u_hp[hp + 6u]) + u_hp[hp + 7u]);
}

// ---- partial: 1 partials (slots,) out, 2 grad (n,); one slot per workgroup, s1 the first ----
// Workgroup w of the dispatch sums elements w * WG + lid, stepping by the whole grid, so any number of
// workgroups covers the tensor and the sum is the same for the same n (deterministic, no atomics).
@group(0) @binding(1) var<storage, read_write> n_part: array<f32>;
@group(0) @binding(2) var<storage, read> n_grad: array<f32>;

@compute @workgroup_size(WG)
fn grad_norm_partial(@builtin(local_invocation_id) lid3: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) nwg: vec3<u32>) {
    let lid = lid3.x;
    var s = 0.0;
    for (var i = wid.x * WG + lid; i < p.s0; i += nwg.x * WG) {
        let g = n_grad[p.o2 + i];
        s += g * g;
    }
    let total = tree_sum(s, lid);
    if (lid == 0u) {
        let slot = p.o1 + p.s1 + wid.x;
        var out = total;
        if (p.s2 != 0u) {
            out += n_part[slot];
        }
        n_part[slot] = out;
    }
}

// ---- finalize: 1 result [norm, clip_scale, finite_flag] out, 2 partials (slots,); one workgroup ----
@group(0) @binding(1) var<storage, read_write> z_out: array<f32>;
@group(0) @binding(2) var<storage, read> z_part: array<f32>;

@compute @workgroup_size(WG)
fn grad_norm_finalize(@builtin(local_invocation_id) lid3: vec3<u32>) {
    let lid = lid3.x;
    var s = 0.0;
    for (var i = lid; i < p.s0; i += WG) {
        s += z_part[p.o2 + i];
    }
    let total = tree_sum(s, lid);
    if (lid == 0u) {
        let norm = sqrt(total);
        var clip = 1.0;
        var finite = 1.0;
        if (!is_finite(norm)) {
            clip = 0.0;
            finite = 0.0;
        } else if (p.f0 > 0.0) {
            clip = min(1.0, p.f0 / (norm + 1e-6));
        }
        z_out[p.o1] = norm;
        z_out[p.o1 + 1u] = clip;
        z_out[p.o1 + 2u] = finite;
    }
}
