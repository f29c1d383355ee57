// The LoRA term of a batch whose rows each carry their own adapter (a server's mixed batch, Punica's and S-LoRA's
// per-row gather): y[n] += scales[k] * (x[n] A_k^T) B_k^T for k = adapters[n], from one module's bank of
// adapters (A (K, R, in), B (K, out, R), their ranks padded to R with zeros); a row whose adapter is negative
// takes no term. The mirror of engines/shared/mixed_lora.py mixed_lora_forward. One workgroup per (row, tile
// of 128 * OUT_PER outputs): it reduces h = x[n] A_k^T (R values) in workgroup memory, then each invocation
// adds OUT_PER pairs of outputs, consecutive invocations on consecutive pairs. x and y are tensors in any storage
// format (device/storage.py); the bank is float32.

struct Params {
    n: u32,           // rows (tokens)
    in_f: u32,        // in features
    out_f: u32,       // out features
    rank: u32,        // the bank's padded rank R (at most MAX_RANK)
    o1: u32, o2: u32, // element offsets of y and x
}

@group(0) @binding(0) var<uniform> params: Params;
// @tensor 1 y read_write
// @tensor 2 x read
// y (N, out); x (N, in)
@group(0) @binding(3) var<storage, read> a_bank: array<f32>;      // (K, R, in)
@group(0) @binding(4) var<storage, read> b_bank: array<f32>;      // (K, out, R)
@group(0) @binding(5) var<storage, read> scales: array<f32>;      // (K,)
@group(0) @binding(6) var<storage, read> adapters: array<i32>;    // (N,) each row's adapter; negative: none

override OUT_PER: u32 = 1u;       // pairs of outputs per invocation (the private kernel: outputs, an even count)
const WG: u32 = 64u;
const MAX_RANK: u32 = 256u;

var<workgroup> part: array<f32, 64>;          // one dot product's partial sums
var<workgroup> h: array<f32, MAX_RANK>;       // x[n] A_k^T

@compute @workgroup_size(64)
fn mixed_lora_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = wid.y;                                  // the row; wid.x: the tile of outputs
    let k = adapters[t];
    let kk = u32(max(k, 0));                        // no branch before the barriers: a base row computes, then skips
    let ab = kk * params.rank * params.in_f;
    let xb = params.o2 + t * params.in_f;
    var acc: f32;
    for (var j = 0u; j < params.rank; j = j + 1u) {
        acc = 0.0;
        for (var i = lid.x; i < params.in_f; i = i + WG) {
            acc = acc + x_ld(xb + i) * a_bank[ab + j * params.in_f + i];
        }
        part[lid.x] = acc;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s = s >> 1u) {
            if (lid.x < s) {
                part[lid.x] = part[lid.x] + part[lid.x + s];
            }
            workgroupBarrier();
        }
        if (lid.x == 0u) {
            h[j] = part[0];
        }
        workgroupBarrier();                         // part[0] read before the next j overwrites it
    }
    if (k < 0) {
        return;
    }
    let scale = scales[kk];
    let bb = kk * params.out_f * params.rank;
    var acc1: f32;
    for (var q = 0u; q < OUT_PER; q = q + 1u) {
        // a pair of outputs: a 16-bit y stores two to a word, which one invocation must own
        let o = 2u * ((wid.x * OUT_PER + q) * WG + lid.x);
        if (o < params.out_f) {
            acc = 0.0;
            acc1 = 0.0;
            let two = o + 1u < params.out_f;
            let o1 = select(o, o + 1u, two);
            for (var j = 0u; j < params.rank; j = j + 1u) {
                acc = acc + h[j] * b_bank[bb + o * params.rank + j];
                acc1 = acc1 + h[j] * b_bank[bb + o1 * params.rank + j];
            }
            let e = params.o1 + t * params.out_f + o;
            if (two) {
                y_st2(e, y_ld2(e) + scale * vec2<f32>(acc, acc1));
            } else {                                // an odd width's last output (float32 only)
                y_st(e, y_ld(e) + scale * acc);
            }
        }
    }
}

// The same without workgroup memory or barriers (which llvmpipe runs slowly): one invocation per (row, chunk of
// OUT_PER outputs), numbered row-major over a flat grid so that every lane of a workgroup works, computes its
// row's h itself, then its outputs; for CPU adapters, where an invocation's loops fit.
@compute @workgroup_size(64)
fn mixed_lora_private(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = (wid.y * nwg.x + wid.x) * WG + lid.x;   // the flat grid folds into y beyond 65535 workgroups
    let chunks = (params.out_f + OUT_PER - 1u) / OUT_PER;
    let t = g / chunks;
    if (t >= params.n) {
        return;
    }
    let first = (g % chunks) * OUT_PER;
    let k = adapters[t];
    if (k < 0) {
        return;
    }
    let kk = u32(k);
    let ab = kk * params.rank * params.in_f;
    let xb = params.o2 + t * params.in_f;
    var hp: array<f32, MAX_RANK>;
    var acc: f32;
    for (var j = 0u; j < params.rank; j = j + 1u) {
        acc = 0.0;
        for (var i = 0u; i < params.in_f; i = i + 1u) {
            acc = acc + x_ld(xb + i) * a_bank[ab + j * params.in_f + i];
        }
        hp[j] = acc;
    }
    let scale = scales[kk];
    let bb = kk * params.out_f * params.rank;
    for (var o = first; o < min(first + OUT_PER, params.out_f); o = o + 1u) {
        acc = 0.0;
        for (var j = 0u; j < params.rank; j = j + 1u) {
            acc = acc + hp[j] * b_bank[bb + o * params.rank + j];
        }
        let e = params.o1 + t * params.out_f + o;
        y_st(e, y_ld(e) + scale * acc);
    }
}
