"""The workgroup-tiled GEMM (shaders/gemm_tiled.wgsl, specialised by wgpu_train.engines.webgpu.tuned.gemm_source)
against NumPy in float64, on every adapter present: layouts, ragged edges, batches, epilogue options,
offsets, every TileConfig, and split-K with its reduce pass. The subgroup configs run on every adapter
with the `subgroup` feature, both through their lane exchanges and through their fallback; on the others
the plain configs' source (subgroup section blanked) must compile."""
from __future__ import annotations

import re

import numpy as np
import pytest

from wgpu_train.engines.webgpu.tuned import gemm_source as T
from wgpu_train.engines.webgpu.device.launch import params_format, parse_params
from wgpu_train.engines.webgpu.device.runtime import shader_path, shader_text

# As tests/test_gemm.py: fp32 rounding grows like eps * sqrt(K); a wrong or missing term is O(1).
PARAMS = parse_params(shader_path(T.SHADER).read_text())   # the uniform's (name, type) fields, as launch packs them
ACCUMULATE, BIAS = 1, 2                                       # Params.flags bits
RTOL = 1e-5
ATOL_PER_SQRT_K = 1e-5

SCALAR = T.TileConfig(32, 32, 16, 4, 4)                 # small tiles: cheap on llvmpipe
VEC4 = T.TileConfig(32, 32, 16, 4, 4, vec4=True)
DB = T.TileConfig(64, 64, 8, 4, 4, double_buffer=True)
SG = T.TileConfig(32, 32, 16, 4, 4, subgroups=True)
SG_V4 = T.TileConfig(32, 32, 16, 4, 4, vec4=True, subgroups=True)
SG_DB = T.TileConfig(64, 64, 8, 4, 4, double_buffer=True, subgroups=True)
ODD_SHAPES = [(1, 1, 1), (3, 17, 65), (17, 3, 127), (65, 127, 3), (127, 65, 17), (3, 127, 1), (127, 1, 65),
              (1, 65, 127), (65, 17, 17), (1, 17, 3)]   # every pair of 1, 3, 17, 65, 127 somewhere


def _idx(off, sm, sn, z_stride, batch, rows, cols):
    """Flat element indices (batch, rows, cols) of a strided matrix view."""
    z = np.arange(batch)[:, None, None]
    return off + z * z_stride + np.arange(rows)[None, :, None] * sm + np.arange(cols)[None, None, :] * sn


class Case:
    """One product with its host data, uniform fields and expected output buffer.

    layout: op(A), op(B) letters as in gemm.py ("t": stored transposed); pad: extra elements per row
    (pitch) of A, B, C; offs: o1, o2, o3, o4; bias: None, "row" (one N-vector) or "full" (an M x N
    matrix); c_trans: C stored column-major (c_sm = 1)."""

    def __init__(self, rng, M, N, K, layout="nn", batch=1, pad=(0, 0, 0), offs=(0, 0, 0, 0), b_bcast=False,
                 c_trans=False, alpha=1.0, bias=None, accumulate=False):
        self.M, self.N, self.K, self.batch = M, N, K, batch
        o1, o2, o3, o4 = offs
        if layout[0] == "n":
            lda = K + pad[0]
            a_sm, a_sk, a_rows = lda, 1, M
        else:
            lda = M + pad[0]
            a_sm, a_sk, a_rows = 1, lda, K
        if layout[1] == "n":
            ldb = N + pad[1]
            b_sk, b_sn, b_rows = ldb, 1, K
        else:
            ldb = K + pad[1]
            b_sk, b_sn, b_rows = 1, ldb, N
        ldc = (M if c_trans else N) + pad[2]
        c_sm, c_sn = (1, ldc) if c_trans else (ldc, 1)
        a_sz = a_rows * lda + 4 * (pad[0] > 0)
        b_sz = 0 if b_bcast else b_rows * ldb + 4 * (pad[1] > 0)
        c_sz = (N if c_trans else M) * ldc + 4 * (pad[2] > 0)
        bias_sm, bias_sn = {None: (0, 0), "row": (0, 1), "full": (N, 1)}[bias]
        # NaN everywhere outside op(A) and op(B), so a term read past K (0 * NaN) shows up in C
        a_idx, b_idx = _idx(o1, a_sm, a_sk, a_sz, batch, M, K), _idx(o2, b_sk, b_sn, b_sz, batch, K, N)
        self.a = np.full(o1 + batch * a_sz + 3, np.nan, np.float32)
        self.a[a_idx] = rng.standard_normal(a_idx.shape)
        self.b = np.full(o2 + max(batch * b_sz, b_rows * ldb) + 3, np.nan, np.float32)
        self.b[b_idx] = rng.standard_normal(b_idx.shape)
        self.bias = rng.standard_normal(o3 + M * N + 3).astype(np.float32)
        self.c = rng.standard_normal(o4 + batch * c_sz + 5).astype(np.float32)
        flags = (ACCUMULATE if accumulate else 0) | (BIAS if bias else 0)
        self.fields = dict(M=M, N=N, K=K, flags=flags, o1=o1, a_sm=a_sm, a_sk=a_sk, a_sz=a_sz,
                           o2=o2, b_sk=b_sk, b_sn=b_sn, b_sz=b_sz, o4=o4, c_sm=c_sm, c_sn=c_sn, c_sz=c_sz,
                           o3=o3, bias_sm=bias_sm, bias_sn=bias_sn, alpha=alpha, k_split=0, splits=1,
                           batch=batch)
        opa, opb = self.a.astype(np.float64)[a_idx], self.b.astype(np.float64)[b_idx]
        out = alpha * (opa @ opb)
        if bias:
            out += self.bias.astype(np.float64)[_idx(o3, bias_sm, bias_sn, 0, 1, M, N)]
        self.c_idx = _idx(o4, c_sm, c_sn, c_sz, batch, M, N)
        if accumulate:
            out += self.c[self.c_idx]
        self.want = out

    def vec4_ok(self):
        f = self.fields
        return T.vec4_ok(self.M, self.N, self.K, self.batch, f["o1"], f["a_sm"], f["a_sk"], f["a_sz"],
                         f["o2"], f["b_sk"], f["b_sn"], f["b_sz"])

    def uniform(self, rt, **changes):
        f = {**self.fields, **changes}
        return rt.uniform(params_format(PARAMS), *(f.get(name, 0) for name, _ in PARAMS))

    def upload(self, rt):
        self.bufs = [rt.upload(x) for x in (self.a, self.b, self.bias, self.c)]
        return self.bufs

    def check(self, rt, what, c_buf=None):
        got = rt.read(c_buf or self.bufs[3], np.float32, self.c.shape)
        try:
            np.testing.assert_allclose(got[self.c_idx], self.want, rtol=RTOL,
                                       atol=ATOL_PER_SQRT_K * np.sqrt(self.K))
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
        outside = np.ones(got.shape, bool)
        outside[self.c_idx] = False
        assert np.array_equal(got[outside], self.c[outside]), f"{what}: wrote outside C"
        return got[self.c_idx]


QUADS_ON = "const QUADS: bool = true;"
FALLBACK_READS = ("a2[g] = As[a0 + ka2 + g * (BM / TM)];", "b2[h] = Bs[b0 + kb2 + h * TX];")
LANE_ORDER = "    return index;\n"
# index -> the index the kernel uses: other mappings of invocations to subgroup lanes than lavapipe's
# (whose lane is index % 8). Bits 0 and 1 swapped: each quad holds a block 4b .. 4b+3 in another order
# (not an xor of the lane's), so the exchange runs. Bits 1 and 2 swapped: quads hold {0, 1, 4, 5}, ...,
# straddling blocks, so setup_sg must refuse the exchange, and the lane % 4 of a block repeats.
ORDERS = {"swap01": "(index & ~3u) | ((index & 1u) << 1u) | ((index >> 1u) & 1u)",
          "swap12": "(index & ~7u) | (index & 1u) | ((index & 2u) << 1u) | ((index >> 1u) & 2u)"}


def _source(cfg, quads=True, sabotage_fallback=False, order=None):
    """tiled_source(cfg); quads=False forces the subgroup kernels' fallback (no lane exchange);
    sabotage_fallback makes that fallback read zeros, so only the lane exchange can give right results;
    order: a key of ORDERS."""
    src = T.tiled_source(cfg)
    if order:
        assert src.count(LANE_ORDER) == 1
        src = src.replace(LANE_ORDER, f"    return {ORDERS[order]};\n")
    if not quads:
        assert src.count(QUADS_ON) == 1
        src = src.replace(QUADS_ON, QUADS_ON.replace("true", "false"))
    if sabotage_fallback:
        for line in FALLBACK_READS:
            assert src.count(line) == 1
            src = src.replace(line, line.split(" = ")[0] + " = vec4<f32>(0.0);")
    return src


def _need_subgroups(rt, cfg=None):
    if (cfg is None or cfg.subgroups) and "subgroup" not in rt.features:
        pytest.skip(f"{rt.info.describe()} lacks the subgroup feature the *_sg kernels need")


def _pipeline(rt, cfg, **variant):
    tag = "".join(f":{k}={v}" for k, v in sorted(variant.items()))
    return rt.pipeline("gemm_tiled:" + cfg.name + tag, T.entry_point(cfg), source=_source(cfg, **variant))


def _run(rt, cfg, cases, **variant):
    """Dispatch every case with cfg (variant: see _source) in one submit, then check each."""
    _need_subgroups(rt, cfg)
    pipeline = _pipeline(rt, cfg, **variant)
    rec = rt.recorder()
    for case in cases:
        if cfg.vec4:
            assert case.vec4_ok(), "test bug: vec4 config on a shape it does not apply to"
        a, b, bias, c = case.upload(rt)
        rec.dispatch(pipeline, [case.uniform(rt), a, b, bias, c], T.groups(cfg, case.M, case.N, case.batch))
    rec.submit()
    for case in cases:
        case.check(rt, f"{cfg.name} {variant} {case.fields}")


def _reduce(rt, uniform, partials, bias, c, groups):
    """gemm_splitk_reduce binds 0, 1, 3, 4 (it never reads B), so its bind group is built here by
    binding number; Runtime.bind_group numbers resources consecutively."""
    pipeline = rt.pipeline("gemm_tiled:reduce", T.REDUCE_ENTRY, source=_source(SCALAR))
    entries = [{"binding": i, "resource": {"buffer": buf, "offset": 0, "size": buf.size}}
               for i, buf in ((0, uniform), (1, partials), (3, bias), (4, c))]
    bg = rt.device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)
    enc = rt.device.create_command_encoder()
    p = enc.begin_compute_pass()
    p.set_pipeline(pipeline)
    p.set_bind_group(0, bg)
    p.dispatch_workgroups(*groups)
    p.end()
    rt.queue.submit([enc.finish()])


# ---- the Python side ------------------------------------------------------------------------------

def test_configs_fit_default_limits():
    names = [c.name for c in T.TILED_CONFIGS]
    assert len(set(names)) == len(names)
    assert sum(c.double_buffer for c in T.TILED_CONFIGS) >= 2 and any(c.vec4 for c in T.TILED_CONFIGS)
    sg = [c for c in T.TILED_CONFIGS if c.subgroups]
    assert any(c.vec4 for c in sg) and not all(c.vec4 for c in sg)
    for cfg in T.TILED_CONFIGS:
        assert T.fits(cfg, {}, features={"subgroup", "timestamp-query"}), cfg.name
        assert T.fits(cfg, {}) == T.fits(cfg, {}, features=("timestamp-query",)) == (not cfg.subgroups)
        assert T.workgroup_size(cfg) == (cfg.bm // cfg.tm) * (cfg.bn // cfg.tn) <= 256
        assert T.needs_subgroups(cfg) == cfg.subgroups == cfg.name.endswith("_sg")
        assert T.kernel_features(cfg) == (("subgroup",) if cfg.subgroups else ())
        assert T.entry_point(cfg) == "gemm_tiled" + "_sg" * cfg.subgroups
    big = T.TileConfig(128, 128, 8, 8, 8, double_buffer=True)
    assert big.name == "t128x128x8_8x8_db" and T.workgroup_bytes(big) == 16384
    assert not T.fits(big, {"max-compute-workgroup-storage-size": 16383})
    assert not T.fits(T.TileConfig(64, 64, 8, 4, 4), {"max-compute-invocations-per-workgroup": 128})
    assert not T.fits(T.TileConfig(64, 64, 8, 4, 4), {"max-compute-workgroup-size-x": 128})
    assert not T.fits(T.TileConfig(128, 64, 16, 8, 8, double_buffer=True), {})
    with pytest.raises(ValueError):
        T.TileConfig(64, 64, 8, 3, 4)
    # the subgroup kernels pad each k row of As and Bs by 16 floats and pair invocations in 2 x 2 quads
    assert T.workgroup_bytes(T.TileConfig(128, 128, 8, 8, 8, subgroups=True)) == 4 * (128 + 16) * 8 * 2
    assert not T.fits(T.TileConfig(128, 128, 8, 8, 8, double_buffer=True, subgroups=True), {}, ("subgroup",))
    T.TileConfig(32, 32, 8, 4, 8, subgroups=True)         # 8 x 4 invocations: pairs
    with pytest.raises(ValueError):
        T.TileConfig(32, 24, 8, 4, 8, subgroups=True)     # 3 along n: cannot pair


def test_tiled_source_rewrites_only_the_config_block():
    """tiled_source keeps the line count of the file with gemm_core.wgsl appended, rewrites only the const block
    (and, for float16 arithmetic, the tiles' element type), and keeps exactly one of each pair of sections
    (scalar / vec4 loads, plain / subgroup multiply, float32 / float16 core) unchanged, blanking the other."""
    text = shader_text(T.SHADER)
    assert text.startswith(shader_path(T.SHADER).read_text()) and "@f16-core begin" in text
    lines = text.splitlines()

    def section(name):       # the lines of every `@name begin` .. `@name end` section
        at = [i for i, x in enumerate(lines) if f"@{name} begin" in x or f"@{name} end" in x]
        assert len(at) % 2 == 0 and at, name
        return [i for first, last in zip(at[::2], at[1::2]) for i in range(first, last + 1)]

    sections = {name: section(name) for name in ("scalar", "vec4", "plain", "subgroups", "f32-core", "f16-core")}
    assert not re.search(r"subgroup[A-Z_]", "\n".join(lines[:sections["subgroups"][0]]))
    for vec4, subgroups, half in [(v, s, False) for v in (False, True) for s in (False, True)] + [(True, False, True)]:
        src = T.tiled_source(T.TileConfig(128, 64, 16, 8, 4, vec4, double_buffer=True, subgroups=subgroups, half=half))
        assert src.count("\n") == text.count("\n")
        consts = dict(re.findall(r"const (BM|BN|BK|TM|TN|NBUF|PAD): u32 = (\d+)u;", src))
        assert consts == {"BM": "128", "BN": "64", "BK": "16", "TM": "8", "TN": "4", "NBUF": "2",
                          "PAD": "4" if subgroups else "0"}
        out = src.splitlines()
        blanked = {"vec4" if not vec4 else "scalar", "subgroups" if not subgroups else "plain",
                   "f32-core" if half else "f16-core"}
        for name, rows in sections.items():
            want = [""] * len(rows) if name in blanked else [lines[i] for i in rows]
            assert [out[i] for i in rows] == want, (name, vec4, subgroups, half)
        inside = {i for rows in sections.values() for i in rows}
        changed = [i for i, (x, y) in enumerate(zip(lines, out)) if x != y and i not in inside]
        # BM, TN, BK, NBUF (and PAD; and Elem) differ from the file's defaults
        assert len(changed) == 4 + subgroups + half
        assert ("alias Elem = f16;" in src) == half and ("alias Elem = f32;" in src) != half
        if not subgroups:
            assert not re.search(r"subgroup[A-Z_]|quad[A-Z]", src)
        if not half:
            assert "f16" not in re.sub(r"//[^\n]*", "", src)     # compiles without shader-f16


def test_vec4_ok_and_groups():
    # nt, packed: A along k, B along k
    assert T.vec4_ok(8, 12, 16, 1, 0, 16, 1, 0, 0, 1, 16, 0)
    assert not T.vec4_ok(8, 12, 15, 1, 0, 15, 1, 0, 0, 1, 15, 0)     # K odd
    assert not T.vec4_ok(8, 12, 16, 1, 2, 16, 1, 0, 0, 1, 16, 0)     # A offset
    assert not T.vec4_ok(8, 12, 16, 2, 0, 16, 1, 130, 0, 1, 16, 0)   # batch stride
    assert T.vec4_ok(8, 12, 16, 1, 0, 16, 1, 130, 0, 1, 16, 0)       # ... irrelevant for one batch
    # tn: A along m (M must be aligned), B along n
    assert T.vec4_ok(8, 12, 3, 1, 0, 1, 8, 0, 0, 12, 1, 0)
    assert not T.vec4_ok(6, 12, 3, 1, 0, 1, 6, 0, 0, 12, 1, 0)
    assert not T.vec4_ok(8, 12, 3, 1, 0, 2, 8, 0, 0, 12, 1, 0)       # no stride-1 dimension
    cfg = T.TileConfig(64, 32, 8, 4, 4)
    assert T.groups(cfg, 65, 33, 2, 3) == (2, 2, 6)
    with pytest.raises(ValueError):
        T.groups(cfg, 64 * 65536, 32)
    assert T.k_split(cfg, 37, 3) == 16 and T.k_split(cfg, 64, 2) == 32
    assert T.reduce_groups(100, 1000, 2) == (782, 1, 1)
    gx, gy, _ = T.reduce_groups(1 << 13, 1 << 13, 1)
    assert gx == 65535 and gx * gy * 256 >= 1 << 26 and (gx * (gy - 1)) * 256 < 1 << 26


# ---- the kernel -----------------------------------------------------------------------------------

# (config, _source variant): the plain kernel, the subgroup kernel, and the subgroup kernel's fallback
VARIANTS = [(SCALAR, {}), (SG, {}), (SG, {"quads": False})]


def _vid(v):
    return v.name if isinstance(v, T.TileConfig) else ("fallback" if v == {"quads": False} else "-")


@pytest.mark.parametrize("cfg, variant", VARIANTS, ids=_vid)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
def test_layouts_odd_sizes(rt, layout, cfg, variant):
    rng = np.random.default_rng(1)
    _run(rt, cfg, [Case(rng, M, N, K, layout) for M, N, K in ODD_SHAPES], **variant)


@pytest.mark.parametrize("cfg", T.TILED_CONFIGS, ids=lambda c: c.name)
def test_every_config(rt, cfg):
    """Several tiles with ragged edges (aligned to 4 for vec4), both vec4 directions of each operand
    (nt: A and B along k; tn: A along m, B along n)."""
    rng = np.random.default_rng(2)
    ragged = (4, 12, 4) if cfg.vec4 else (3, 5, 1)
    M, N, K = 2 * cfg.bm + ragged[0], cfg.bn + ragged[1], 3 * cfg.bk + ragged[2]
    _run(rt, cfg, [Case(rng, M, N, K, "nt"), Case(rng, N, M, K, "tn")])


@pytest.mark.parametrize("cfg, variant", [(SCALAR, {}), (VEC4, {}), (DB, {}), (SG, {}), (SG_V4, {}),
                                          (SG_DB, {}), (SG_V4, {"quads": False})], ids=_vid)
def test_epilogue_offsets_batches(rt, cfg, variant):
    """alpha, bias (a row vector and a full matrix), accumulate, C transposed, nonzero offsets, padded
    pitches, batch strides and a B shared by every batch (stride 0)."""
    rng = np.random.default_rng(3)
    M, N, K = (36, 44, 40) if cfg.vec4 else (37, 43, 41)
    offs = (8, 4, 3, 12) if cfg.vec4 else (3, 5, 7, 1)
    pad = (4, 8, 3) if cfg.vec4 else (1, 3, 2)
    cases = [Case(rng, M, N, K, "nt", alpha=-0.75, bias="row", accumulate=True, offs=offs),
             Case(rng, M, N, K, "tn", bias="full", c_trans=True, offs=offs),
             Case(rng, M, N, K, "nn", batch=3, pad=pad, b_bcast=True, accumulate=True, alpha=0.5),
             Case(rng, M, N, K, "tt", batch=2, pad=pad, offs=offs, c_trans=True, bias="row")]
    _run(rt, cfg, cases, **variant)


@pytest.mark.parametrize("cfg", [SCALAR, VEC4, DB, SG, SG_V4], ids=lambda c: c.name)
def test_split_k(rt, cfg):
    """Split-K with 2 and 3 splits (K not a multiple of k_split; one case with an empty last split),
    then the reduce pass, equal to the unsplit kernel and to NumPy; the reduce grid folded into y."""
    rng = np.random.default_rng(4)
    long_k = 3 * cfg.bk + (4 if cfg.vec4 else 5)
    m_small, n_small, m_batched = (4, 8, 8) if cfg.vec4 else (5, 7, 9)
    shapes = [(8, 24, long_k, "tn", 2, {}),
              (12, 20, long_k, "nt", 3, dict(alpha=-1.5, bias="row", accumulate=True)),
              (m_small, n_small, cfg.bk + 4, "nn", 3, dict(c_trans=True)),   # the third split is empty
              (m_batched, 40, long_k, "tt", 2, dict(batch=2, offs=(4, 8, 1, 4), bias="full"))]
    _need_subgroups(rt, cfg)
    pipeline = _pipeline(rt, cfg)
    rec = rt.recorder()
    runs = []
    for M, N, K, layout, splits, kw in shapes:
        case = Case(rng, M, N, K, layout, **kw)
        assert case.vec4_ok() or not cfg.vec4
        a, b, bias, c = case.upload(rt)
        unsplit = rt.upload(case.c)
        rec.dispatch(pipeline, [case.uniform(rt), a, b, bias, unsplit], T.groups(cfg, M, N, case.batch))
        ks = T.k_split(cfg, K, splits)
        assert K % ks != 0
        part_off = 5
        partials = rt.upload(np.full(part_off + case.batch * splits * M * N + 3, np.nan, np.float32))
        u1 = case.uniform(rt, k_split=ks, splits=splits, o4=part_off)
        rec.dispatch(pipeline, [u1, a, b, bias, partials], T.groups(cfg, M, N, case.batch, splits))
        runs.append((case, unsplit, partials, case.uniform(rt, k_split=ks, splits=splits, o1=part_off)))
    rec.submit()
    for case, _, partials, u2 in runs:
        groups = T.reduce_groups(case.M, case.N, case.batch, max_dim=2 if case.batch > 1 else 65535)
        assert case.batch == 1 or groups[1] > 1, "the batched case should fold the reduce grid into y"
        _reduce(rt, u2, partials, case.bufs[2], case.bufs[3], groups)
    for case, unsplit, _, _ in runs:
        what = f"{cfg.name} split {case.fields}"
        split = case.check(rt, what)
        whole = case.check(rt, what + " unsplit", unsplit)
        np.testing.assert_allclose(split, whole, rtol=RTOL, atol=ATOL_PER_SQRT_K * np.sqrt(case.K))


# ---- the subgroup section -----------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [SG, SG_V4, SG_DB], ids=lambda c: c.name)
def test_quads_exchange_here(rt, cfg):
    """With the fallback's own reads of the second row replaced by zeros, the results can only be right if
    every workgroup took the lane exchange: this adapter's quads pass setup_sg's check, and the exchanged
    fragments are the right ones."""
    rng = np.random.default_rng(5)
    M, N, K = 2 * cfg.bm + 4, cfg.bn + 12, 3 * cfg.bk + 4
    _run(rt, cfg, [Case(rng, M, N, K, "nt"), Case(rng, N, M, K, "tn")], sabotage_fallback=True)


@pytest.mark.parametrize("cfg", [SG, SG_V4], ids=lambda c: c.name)
def test_other_lane_mappings(rt, cfg):
    """WebGPU leaves the mapping of invocations to lanes open (ORDERS): with each quad's invocations in
    another order the exchange still runs and is right; with quads straddling blocks of 4, setup_sg must
    refuse the exchange (a sabotaged fallback then gives wrong results) and the fallback is right."""
    rng = np.random.default_rng(6)
    M, N, K = 2 * cfg.bm + 4, cfg.bn + 12, 3 * cfg.bk + 4
    _run(rt, cfg, [Case(rng, M, N, K, "nt"), Case(rng, N, M, K, "tn")], order="swap01", sabotage_fallback=True)
    _run(rt, cfg, [Case(rng, M, N, K, "tn"), Case(rng, N, M, K, "nt")], order="swap12")
    with pytest.raises(AssertionError, match="Mismatched"):
        _run(rt, cfg, [Case(rng, M, N, K, "nt")], order="swap12", sabotage_fallback=True)


def test_plain_source_compiles_without_subgroups(rt):
    """On an adapter without `subgroup`, every plain config's module (its reduce pass too) compiles from the
    file with the subgroup section blanked; the unblanked file does not (why tiled_source blanks it)."""
    if "subgroup" in rt.features:
        pytest.skip(f"{rt.info.describe()} has the subgroup feature; this checks adapters without it")
    for cfg in T.TILED_CONFIGS:
        if not cfg.subgroups:
            rt.pipeline("gemm_tiled:" + cfg.name, T.entry_point(cfg), source=T.tiled_source(cfg))
            rt.pipeline("gemm_tiled:" + cfg.name, T.REDUCE_ENTRY, source=T.tiled_source(cfg))
    with pytest.raises(Exception, match="(?i)subgroup"):
        rt.pipeline("gemm_tiled:unblanked", "gemm_tiled", source=T.tiled_source(SG))
