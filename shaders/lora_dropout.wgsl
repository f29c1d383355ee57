// LoRA dropout on the LoRA branch input: a counter-based hash mask that reference/ops.py's
// dropout_mask reproduces bit for bit. The seed of each module and micro-batch is read from a
// storage buffer written with the batch, so nothing is rebuilt per step.

struct Params {
    n: u32,            // elements
    seed_slot: u32,    // index of this module's seed in `seeds`
    threshold: u32,    // p * 2^24: drop when (hash >> 8) < threshold
    inv_keep: f32,     // 1 / (1 - p)
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> seeds: array<u32>;

fn pcg_hash(v: u32) -> u32 {
    let s = v * 747796405u + 2891336453u;
    let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
    return (w >> 22u) ^ w;
}

fn keep_scale(i: u32) -> f32 {
    let u = pcg_hash(i ^ pcg_hash(seeds[params.seed_slot]));
    return select(0.0, params.inv_keep, (u >> 8u) >= params.threshold);
}

// y = x * mask
@compute @workgroup_size(256)
fn lora_dropout_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= params.n) { return; }
    y[i] = x[i] * keep_scale(i);
}

// dx += dy * mask (y is dx, x is dy): the gradient flows only through kept elements
@compute @workgroup_size(256)
fn lora_dropout_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= params.n) { return; }
    y[i] = y[i] + x[i] * keep_scale(i);
}
