"""Numbered fp32 GEMM variants, each checked against NumPy and then timed side by side with the
adapter's FMA peak (one run, interleaved rounds, best of each: the machines are shared and noisy).

    python benchmarks/gemm_variants.py [--device 0] [--shape 1024x1024x1024] [--rounds 3] [--only v4,v6]

v1-v4 are stand-alone experiments for C = A @ B (row-major, NN) that need M, N multiples of their
tile and K a multiple of 4; v5-v8 are shaders/gemm.wgsl as wgpu_train.engines.webgpu.tuned.gemm dispatches it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from wgpu_train.engines.webgpu.tuned import gemm as G
from wgpu_train.engines.webgpu.tuned import gemm_kernels as GK
from wgpu_train.bench.suite import NAIVE16_SRC
from wgpu_train.engines.webgpu.device.timing import Timer, fma_peak
from wgpu_train.engines.webgpu.device.runtime import get_runtime

HEADER = """
struct Params { M: u32, N: u32, K: u32, pad: u32 };
@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> A: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> B: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> C: array<vec4<f32>>;
"""


def v2_source():
    """v2: 8 x 8 outputs per invocation, 8 x 8 invocations per workgroup (64 x 64 tile), no workgroup
    memory; A read one scalar at a time (each invocation its own rows), B as vec4 along n."""
    return HEADER.replace("var<storage, read> A: array<vec4<f32>>", "var<storage, read> A: array<f32>") + """
@compute @workgroup_size(8, 8)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let n4 = gid.x * 2u;
    let m0 = gid.y * 8u;
    let N4 = P.N / 4u;
    var acc: array<array<vec4<f32>, 2>, 8>;
    for (var k = 0u; k < P.K; k++) {
        let b0 = B[k * N4 + n4];
        let b1 = B[k * N4 + n4 + 1u];
        for (var i = 0u; i < 8u; i++) {
            let a = A[(m0 + i) * P.K + k];
            acc[i][0] = fma(vec4<f32>(a), b0, acc[i][0]);
            acc[i][1] = fma(vec4<f32>(a), b1, acc[i][1]);
        }
    }
    for (var i = 0u; i < 8u; i++) {
        C[(m0 + i) * N4 + n4] = acc[i][0];
        C[(m0 + i) * N4 + n4 + 1u] = acc[i][1];
    }
}
"""


def _unrolled(tm, tn4, wg, subgroup):
    """v3 / v4: a workgroup shares `tm` rows of C, each invocation owns 4 * tn4 columns of them (all
    tm rows), k unrolled by 4, fully unrolled straight-line code. v3 (subgroup False) loads the rows of
    A directly (the same address in every invocation); v4 spreads them over the 8 lanes of a subgroup
    and hands them out with subgroupBroadcast."""
    lines = []
    acc = [[f"acc{i}_{j}" for j in range(tn4)] for i in range(tm)]
    decl = "\n    ".join(f"var {acc[i][j]} = vec4<f32>(0.0);" for i in range(tm) for j in range(tn4))
    if subgroup:
        for r in range(tm // 8):
            lines.append(f"let av{r} = A[(m0 + {8 * r}u + (sid & 7u)) * K4 + k / 4u];")
    for kk in range(4):
        for j in range(tn4):
            lines.append(f"let b{kk}_{j} = B[(k + {kk}u) * N4 + nb + {j}u];")
    for i in range(tm):
        if subgroup:
            lines.append(f"let a{i} = subgroupBroadcast(av{i // 8}, {i % 8}u);")
        else:
            lines.append(f"let a{i} = A[(m0 + {i}u) * K4 + k / 4u];")
        for kk in range(4):
            for j in range(tn4):
                lines.append(f"{acc[i][j]} = fma(vec4<f32>(a{i}.{'xyzw'[kk]}), b{kk}_{j}, {acc[i][j]});")
    stores = "\n    ".join(f"C[(m0 + {i}u) * N4 + nb + {j}u] = {acc[i][j]};" for i in range(tm) for j in range(tn4))
    sid = ", @builtin(subgroup_invocation_id) sid: u32" if subgroup else ""
    body = "\n        ".join(lines)
    return HEADER + f"""
@compute @workgroup_size({wg})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32{sid}) {{
    let N4 = P.N / 4u;
    let K4 = P.K / 4u;
    let m0 = wid.y * {tm}u;
    let nb = (wid.x * {wg}u + li) * {tn4}u;
    {decl}
    for (var k = 0u; k < P.K; k += 4u) {{
        {body}
    }}
    {stores}
}}
"""


def _register(rt, c, a, b, M, N, K, subgroups, vec4):
    """The register kernel of shaders/gemm.wgsl that the llvmpipe tiling picks for C = A @ B, forced."""
    p = G.gemm_problem(rt, c, a, b, M, N, K, "nn")
    return GK.register_candidate(p, subgroups, vec4).dispatches(p)[0]


class Variant:
    def __init__(self, name, doc, make, needs_subgroups=False):
        self.name, self.doc, self.make, self.needs_subgroups = name, doc, make, needs_subgroups


def _standalone(rt, name, source, entry, tile_m, tile_n, groups_fn):
    def make(c, a, b, M, N, K):
        if M % tile_m or N % tile_n or K % 4:
            return None
        p = rt.pipeline(f"gemm_variant_{name}", entry, source=source)
        return p, [rt.uniform("<4I", M, N, K, 0), a, b, c], groups_fn(M, N)
    return make


def variants(rt):
    out = [
        Variant("v1", "naive: 16x16 tiles of A and B in workgroup memory, 1 output per invocation",
                lambda c, a, b, M, N, K: (rt.pipeline("bench_gemm_naive16", "gemm_naive16", source=NAIVE16_SRC),
                                          [rt.uniform("<4I", M, N, K, 0), a, b, c], (-(-N // 16), -(-M // 16), 1))),
        Variant("v2", "8x8 per invocation, no workgroup memory, A scalar per invocation, B vec4",
                _standalone(rt, "v2", v2_source(), "main", 64, 64, lambda M, N: (N // 64, M // 64, 1))),
        Variant("v3", "32 rows per workgroup x 8 columns per invocation, A vec4 at workgroup-uniform addresses",
                _standalone(rt, "v3", _unrolled(32, 2, 32, False), "main", 32, 256,
                            lambda M, N: (N // 256, M // 32, 1))),
        Variant("v4", "as v3, A spread over subgroup lanes and read back with subgroupBroadcast",
                _standalone(rt, "v4", _unrolled(32, 2, 32, True), "main", 32, 256,
                            lambda M, N: (N // 256, M // 32, 1)),
                needs_subgroups=True),
        Variant("v5", "shaders/gemm.wgsl gemm (any strides: scalar loads, A direct)",
                lambda c, a, b, M, N, K: _register(rt, c, a, b, M, N, K, False, False)),
        Variant("v6", "shaders/gemm.wgsl gemm_sg (any strides: scalar loads, A by subgroup broadcast)",
                lambda c, a, b, M, N, K: _register(rt, c, a, b, M, N, K, True, False),
                needs_subgroups=True),
        Variant("v7", "shaders/gemm.wgsl gemm_v4 (vec4 loads and stores, A direct)",
                lambda c, a, b, M, N, K: _register(rt, c, a, b, M, N, K, False, True)),
        Variant("v8", "shaders/gemm.wgsl gemm_v4_sg (vec4, A by subgroup broadcast): the default on lavapipe",
                lambda c, a, b, M, N, K: _register(rt, c, a, b, M, N, K, True, True),
                needs_subgroups=True),
    ]
    return [v for v in out if not v.needs_subgroups or GK.use_subgroups(rt)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="adapter index or name (default: the preferred one)")
    ap.add_argument("--shape", default="1024x1024x1024", help="MxNxK")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (best is kept)")
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    args = ap.parse_args(argv)
    rt = get_runtime(args.device)
    timer = Timer(rt)
    M, N, K = (int(x) for x in args.shape.lower().split("x"))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((K, N), dtype=np.float32)
    want = a @ b
    ab, bb, cb = rt.upload(a), rt.upload(b), rt.buffer(M * N * 4)
    chosen = [v for v in variants(rt) if args.only is None or v.name in args.only.split(",")]
    ready = []
    for v in chosen:
        d = v.make(cb, ab, bb, M, N, K)
        if d is None:
            print(f"{v.name}: skipped (shape not a multiple of its tile)")
            continue
        rec = rt.recorder()
        rec.clear(cb)
        rec.submit()
        t0 = time.perf_counter()
        rec = rt.recorder()
        rec.dispatch(*d)
        rec.submit()
        got = rt.read(cb, np.float32, (M, N))
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        if not err < 1e-4:
            raise SystemExit(f"{v.name} is wrong: max relative error {err:.2e}")
        print(f"{v.name}: correct (max rel err {err:.1e}), first run incl. compile {time.perf_counter() - t0:.2f}s",
              flush=True)
        ready.append((v, d))
    best = {v.name: 0.0 for v, _ in ready}
    peak = 0.0
    flops = 2.0 * M * N * K
    for r in range(args.rounds):
        peak = max(peak, fma_peak(rt, timer))
        for v, d in ready:
            slow = v.name == "v1"
            t = timer.time([d], repeats=1 if slow else 3, budget_s=1.0)
            best[v.name] = max(best[v.name], flops / t / 1e9)
        print(f"round {r + 1}: peak {peak:.1f} " + " ".join(f"{k} {g:.1f}" for k, g in best.items()), flush=True)
    print(f"\nadapter: {rt.info.describe()}; shape {M}x{N}x{K}; timing: "
          f"{'timestamp-query' if timer.use_ts else 'wall-clock'}; best of {args.rounds} rounds")
    print(f"FMA peak: {peak:.1f} GFLOP/s")
    naive = best.get("v1")
    print("| variant | GFLOP/s | of peak | vs v1 | description |\n|---|---|---|---|---|")
    for v, _ in ready:
        g = best[v.name]
        vs = f"{g / naive:.1f}x" if naive else "-"
        print(f"| {v.name} | {g:.1f} | {100 * g / peak:.0f}% | {vs} | {v.doc} |")


if __name__ == "__main__":
    main()
