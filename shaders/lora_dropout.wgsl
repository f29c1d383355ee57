// LoRA dropout on the LoRA branch input: a counter-based hash mask that engines/numpy/ops.py's
// dropout_mask reproduces bit for bit. The seed of each module and micro-batch is read from a
// storage buffer written with the batch, so nothing is rebuilt per step. x and y in any storage format
// (device/storage.py): one invocation per pair of elements (its last alone when n is odd).

struct Params {
    n: u32,            // elements
    seed_slot: u32,    // index of this module's seed in `seeds`
    threshold: u32,    // p * 2^24: drop when (hash >> 8) < threshold
    inv_keep: f32,     // 1 / (1 - p)
}

@group(0) @binding(0) var<uniform> params: Params;
// @tensor 1 y read_write
// @tensor 2 x read
@group(0) @binding(3) var<storage, read> seeds: array<u32>;

fn pcg_hash(v: u32) -> u32 {
    let s = v * 747796405u + 2891336453u;
    let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
    return (w >> 22u) ^ w;
}

// The mask of element i under the module's hashed seed h
fn keep_scale(i: u32, h: u32) -> f32 {
    let u = pcg_hash(i ^ h);
    return select(0.0, params.inv_keep, (u >> 8u) >= params.threshold);
}

// The invocation's first element: twice its flat index over a grid folded into y beyond 65535 workgroups.
fn first(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return 2u * (gid.x + gid.y * nwg.x * 256u);
}

// y = x * mask
@compute @workgroup_size(256)
fn lora_dropout_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = first(gid, nwg);
    if (i >= params.n) { return; }
    let h = pcg_hash(seeds[params.seed_slot]);
    if (i + 1u < params.n) {
        y_st2(i, x_ld2(i) * vec2<f32>(keep_scale(i, h), keep_scale(i + 1u, h)));
    } else {
        y_st(i, x_ld(i) * keep_scale(i, h));
    }
}

// dx += dy * mask (y is dx, x is dy): the gradient flows only through kept elements
@compute @workgroup_size(256)
fn lora_dropout_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = first(gid, nwg);
    if (i >= params.n) { return; }
    let h = pcg_hash(seeds[params.seed_slot]);
    if (i + 1u < params.n) {
        y_st2(i, y_ld2(i) + x_ld2(i) * vec2<f32>(keep_scale(i, h), keep_scale(i + 1u, h)));
    } else {
        y_st(i, y_ld(i) + x_ld(i) * keep_scale(i, h));
    }
}
