"""Frozen base weights in float16 and NF4: the NumPy quantiser against the published NF4 table (and
bitsandbytes when importable), the GPU GEMMs on odd shapes against NumPy with the dequantised weights,
the engines against each other, the memory figures, and training with each base dtype."""
from __future__ import annotations

import json

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.webgpu.tuned import gemm_kernels as GK
from wgpu_train.engines.webgpu.tuned import quant_kernels as QK
from wgpu_train.engines.webgpu.tuned import quant as Q
from wgpu_train.engines.webgpu.tuned import quant_source as QT
from wgpu_train.engines.webgpu.tensors import linear_backward, linear_forward
from wgpu_train.engines.webgpu.memory import base_weight_bytes
from wgpu_train.engines.shared import quant as R

from limits import max_binding
from tolerances import assert_close

# The NF4 data type as printed in the QLoRA paper (Dettmers et al. 2023, appendix E), index order 0..15.
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


# ---- the NumPy reference ------------------------------------------------------------------------

def test_nf4_codes_and_nibble_order():
    """The code table is the published one; index = nearest code of w / absmax; the first element of
    each pair sits in the high nibble (bitsandbytes' packing)."""
    np.testing.assert_array_equal(R.NF4_CODE, np.array(PUBLISHED_NF4, np.float32))
    w = np.zeros(64, np.float32)
    w[:16] = 3.0 * np.array(PUBLISHED_NF4)[::-1]        # indices 15, 14, ..., 0; absmax 3
    w[16] = 3.0 * 0.5                                   # 0.5: nearer 0.4407 (12) than 0.5626 (13)
    w[17] = 3.0 * 0.6                                   # 0.6: nearer 0.5626 (13) than 0.7230 (14)
    packed, absmax = R.nf4_quantize(w)
    assert packed.dtype == np.uint8 and packed.shape == (32,)
    assert absmax.tolist() == [3.0]
    assert packed[:9].tolist() == [0xFE, 0xDC, 0xBA, 0x98, 0x76, 0x54, 0x32, 0x10, 0xCD]
    assert packed[9:].tolist() == [0x77] * 23           # zeros: code 7 (0.0)
    # a value exactly at the midpoint of two codes takes the lower one (bitsandbytes compares with >)
    mid = np.float32((np.float64(R.NF4_CODE[12]) + R.NF4_CODE[13]) / 2)
    assert R.nf4_unpack(R.nf4_quantize(np.r_[np.float32(1.0), mid, np.zeros(62, np.float32)])[0])[1] == 12
    np.testing.assert_array_equal(R.nf4_dequantize(packed, absmax, (64,))[:16], w[:16])


def test_nf4_against_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed: the codes are checked against "
                                                     "the published table in test_nf4_codes_and_nibble_order")
    torch = pytest.importorskip("torch")
    w = np.random.default_rng(0).standard_normal((37, 64)).astype(np.float32)
    try:
        q, state = bnb.functional.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4")
    except Exception as e:  # noqa: BLE001 - bitsandbytes builds without a CPU backend raise various errors
        pytest.skip(f"bitsandbytes cannot quantise on this machine: {e}")
    packed, absmax = R.nf4_quantize(w)
    np.testing.assert_array_equal(q.numpy().reshape(-1), packed)
    np.testing.assert_array_equal(state.absmax.numpy(), absmax)
    np.testing.assert_array_equal(bnb.functional.dequantize_4bit(q, state).numpy(),
                                  R.nf4_dequantize(packed, absmax, w.shape))


def test_nf4_double_quant_against_bitsandbytes():
    """Double quantisation as bitsandbytes' quantize_4bit(compress_statistics=True) does it: the same codes,
    the same 8-bit table bit for bit, offset and second-level absmax within float32 rounding of a mean;
    the 8-bit indices equal but where bitsandbytes' quantiser is not exactly nearest (a neighbour)."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed: test_nf4_double_quant checks "
                                                     "the format's own bounds")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((300, 130)) * rng.uniform(0.01, 2, (300, 1))).astype(np.float32)
    try:
        q, state = bnb.functional.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4",
                                                compress_statistics=True)
    except Exception as e:  # noqa: BLE001 - bitsandbytes builds without a CPU backend raise various errors
        pytest.skip(f"bitsandbytes cannot quantise on this machine: {e}")
    packed, dq = R.nf4_quantize(w, double_quant=True)
    q = q.numpy().reshape(-1)                       # bitsandbytes does not pad the last block's bytes
    np.testing.assert_array_equal(q, packed[:q.size])
    np.testing.assert_array_equal(state.state2.code.numpy(), dq.code)
    assert state.state2.blocksize == R.DQ_BLOCK
    np.testing.assert_allclose(state.offset.item(), dq.offset, rtol=1e-6)
    np.testing.assert_allclose(state.state2.absmax.numpy(), dq.absmax2, rtol=1e-6)
    theirs = state.absmax.numpy().astype(np.int64)
    assert np.mean(theirs == dq.q) > 0.99 and np.all(np.abs(theirs - dq.q) <= 1)
    same = np.repeat(theirs == dq.q, 64)[:w.size].reshape(w.shape)
    np.testing.assert_allclose(bnb.functional.dequantize_4bit(torch.from_numpy(q), state).numpy()[same],
                               R.nf4_dequantize(packed, dq, w.shape)[same], rtol=1e-5, atol=1e-6)


def test_nf4_round_trip_error_bound():
    """Every element rounds to the nearest code of its block: |w - deq| <= absmax * NF4_MAX_HALF_GAP, on a
    shape whose blocks cross rows and whose last block is padded; zero blocks stay zero."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((37, 43)) * rng.uniform(0.01, 3, (37, 1))).astype(np.float32)
    w[5] = 0.0
    w.reshape(-1)[128:192] = 0.0                        # a whole zero block (absmax 0)
    w[20, 7] = 40.0                                     # an outlier takes its block's whole range
    packed, absmax = R.nf4_quantize(w)
    assert packed.size == -(-w.size // 64) * 32 and absmax.size == -(-w.size // 64)
    deq = R.nf4_dequantize(packed, absmax, w.shape)
    block_absmax = np.repeat(absmax, 64)[:w.size].reshape(w.shape)
    err = np.abs(w - deq)
    assert np.all(err <= block_absmax * R.NF4_MAX_HALF_GAP * (1 + 1e-6) + 1e-30)
    # nearest: no other code is closer (up to float32 rounding of w / absmax)
    x = np.divide(w, block_absmax, out=np.zeros_like(w), where=block_absmax > 0).reshape(-1, 1)
    dist = np.abs(x - R.NF4_CODE[None, :])
    chosen = R.nf4_unpack(packed)[:w.size]
    assert np.all(dist[np.arange(w.size), chosen] <= dist.min(axis=1) + 1e-6)
    assert np.all(deq[5] == 0) and absmax[2] == 0 and np.all(deq.reshape(-1)[128:192] == 0)
    assert deq[20, 7] == 40.0
    assert R.NF4_MAX_HALF_GAP == pytest.approx((1.0 - 0.6961928009986877) / 2)


def test_nf4_double_quant():
    """Double quantisation: the absmax values (mean subtracted) in 8 bits on bitsandbytes' signed dynamic
    map, blocks of 256; the weight error grows only by the absmax error."""
    code = R.dynamic_map()
    assert code.shape == (256,) and np.all(np.diff(code) >= 0) and code[-1] == 1.0 and 0.0 in code
    assert np.abs(code).max() <= 1.0 and code.min() < -0.99
    rng = np.random.default_rng(2)
    w = rng.standard_normal((300, 130)).astype(np.float32)        # 610 blocks: 3 second-level blocks
    packed, plain = R.nf4_quantize(w)
    packed2, dq = R.nf4_quantize(w, double_quant=True)
    np.testing.assert_array_equal(packed2, packed)               # the codes use the exact absmax
    assert dq.q.dtype == np.uint8 and dq.q.size == plain.size and dq.absmax2.size == 3
    assert dq.offset == pytest.approx(plain.mean(), rel=1e-6)
    rebuilt = R.dequantize_absmax(dq)
    absmax_err = np.abs(rebuilt - plain)
    gap = float(np.max(np.diff(code.astype(np.float64)))) / 2
    assert np.all(absmax_err <= np.repeat(dq.absmax2, 256)[:plain.size] * gap * (1 + 1e-5) + 1e-7)
    assert absmax_err.max() < 0.01 * plain.max()
    err = np.abs(w - R.nf4_dequantize(packed2, dq, w.shape))
    bound = (np.repeat(plain, 64)[:w.size] * R.NF4_MAX_HALF_GAP + np.repeat(absmax_err, 64)[:w.size]).reshape(w.shape)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-7)


def test_float16_rounding_and_which_weights_are_stored_how():
    w = np.random.default_rng(3).standard_normal((5, 7)).astype(np.float32)
    np.testing.assert_array_equal(R.round_to(w, "float16"), w.astype(np.float16).astype(np.float32))
    weights = {"model.layers.0.self_attn.q_proj.weight": w, "model.layers.0.self_attn.q_proj.bias": w[0],
               "model.layers.1.mlp.down_proj.weight": w, "model.embed_tokens.weight": w, "lm_head.weight": w,
               "model.layers.0.input_layernorm.weight": w[0]}
    out = R.round_weights(weights, "nf4", "float16")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        np.testing.assert_array_equal(out[name], R.round_to(w, "nf4"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        np.testing.assert_array_equal(out[name], R.round_to(w, "float16"))
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.input_layernorm.weight"):
        np.testing.assert_array_equal(out[name], w[0])
    with pytest.raises(wt.ConfigError, match="base_dtype must be one of"):
        R.round_weights(weights, "int8")
    with pytest.raises(wt.ConfigError, match="embed_dtype must be one of"):
        R.round_weights(weights, "nf4", "nf4")


def test_storage_dtype_is_parsed_once_with_its_traits():
    """--base-dtype / --embed-dtype are StorageDtype values from TrainConfig and check_dtypes on: their traits
    answer what string checks did, and they still compare, hash and serialise as their names."""
    from wgpu_train.training.config import TrainConfig

    config = TrainConfig(base_dtype="nf4-dq", embed_dtype="bfloat16")
    assert config.base_dtype is R.StorageDtype.NF4_DQ and config.embed_dtype is R.StorageDtype.BFLOAT16
    assert json.loads(json.dumps({"base": config.base_dtype})) == {"base": "nf4-dq"}
    assert f"{config.base_dtype}" == "nf4-dq" and {"nf4-dq": 1}[config.base_dtype] == 1
    assert check_traits() == {"float32": (False, False, False, False), "bfloat16": (True, True, False, False),
                              "float16": (True, True, False, False), "nf4": (True, False, True, False),
                              "nf4-dq": (True, False, True, True), "mxfp4": (True, False, False, False)}
    assert R.check_dtypes("auto", "auto", "bfloat16") == (R.StorageDtype.BFLOAT16,) * 2
    assert R.check_dtypes("mxfp4") == (R.StorageDtype.MXFP4, R.StorageDtype.BFLOAT16)   # as gpt-oss stores it
    assert R.check_dtypes("nf4")[1] is R.StorageDtype.FLOAT16 and not R.StorageDtype.AUTO.resolved
    with pytest.raises(wt.ConfigError, match="embed_dtype must be one of auto, float32, bfloat16, float16, got"):
        TrainConfig(embed_dtype="nf4")


def check_traits() -> dict:
    """Each base dtype's (rounds, sixteen_bit, nf4, double_quant)."""
    return {d: (s.rounds, s.sixteen_bit, s.nf4, s.double_quant) for d in R.BASE_DTYPES for s in [R.StorageDtype(d)]}


def test_bfloat16_rounding_matches_torch():
    """bfloat16 storage rounds as torch's float32 -> bfloat16 conversion does (to nearest, ties to even), over
    every exponent, the ties, subnormals, overflow to inf and NaN; a value already bfloat16 is kept."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    w = (rng.standard_normal(20000) * 2.0 ** rng.integers(-140, 128, 20000)).astype(np.float32)
    ties = ((rng.integers(0, 1 << 16, 64).astype(np.uint32) << 16) | 0x8000).view(np.float32)   # exact halves
    special = np.array([np.inf, -np.inf, np.nan, 3.4e38, -3.39e38, 0.0, -0.0, 1e-40, -1e-45], np.float32)
    w = np.concatenate([w, ties, special])
    ours = R.round_to(w, "bfloat16")
    theirs = torch.from_numpy(w).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(ours.view(np.uint32)[~np.isnan(w)], theirs.view(np.uint32)[~np.isnan(w)])
    assert np.isnan(ours[np.isnan(w)]).all()
    np.testing.assert_array_equal(R.round_to(ours, "bfloat16"), ours)


# ---- the GPU kernels ----------------------------------------------------------------------------

# (M, rows, cols, padded) with W (rows, cols): odd sizes take the any-shape kernel; K % 8 == 0 (nt) or
# N % 8 == 0 (nn) with A 4-aligned take qgemm_fast; `padded` gives A a pitch rounded up to 4 plus 4,
# so that nn runs the fast kernel with K % 4 != 0 (the masked last step).
GEMM_CASES = [(1, 1, 1, 0), (3, 17, 65, 0), (17, 3, 127, 0), (65, 127, 3, 0), (5, 30, 43, 0), (33, 64, 64, 0),
              (40, 24, 72, 0), (9, 13, 8, 1), (20, 37, 64, 1), (70, 9, 16, 1)]


def _kernels(rt):
    """(fast, subgroups) pairs to force: every quantised kernel this device can run."""
    return [(False, False), (True, False)] + ([(True, True)] if GK.use_subgroups(rt) else [])


@pytest.mark.parametrize("fmt", Q.FORMATS)
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_quant_gemm_matches_numpy(rt, fmt, layout):
    """C = A @ op(W) with W stored as fmt equals float64 NumPy on the dequantised W, for every kernel that
    can run each shape (accumulate on, and a padded A pitch where listed)."""
    rng = np.random.default_rng(4)
    cases, ran_fast = [], 0
    for M, rows, cols, padded in GEMM_CASES:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        qm = Q.QuantMatrix(rt, w, fmt, "w")
        wq = R.round_to(w, fmt).astype(np.float64)
        np.testing.assert_array_equal(qm.read(rt), wq)
        assert qm.nbytes == Q.stored_bytes(rows, cols, fmt, rt.max_binding)
        K, N = (cols, rows) if layout == "nt" else (rows, cols)
        lda = (K + 3) // 4 * 4 + 4 if padded else K
        a = rng.standard_normal((M, lda)).astype(np.float32)
        c0 = rng.standard_normal((M, N)).astype(np.float32)
        want = a[:, :K].astype(np.float64) @ (wq.T if layout == "nt" else wq) + c0
        ab = rt.upload(a)
        for fast, sg in _kernels(rt):
            cb = rt.upload(c0)
            try:
                p = QK.QProblem(rt, cb, ab, qm, 0, layout, M, accumulate=True, lda=lda)
                d = QK.register_candidate(p, fast=fast, subgroups=sg).dispatches(p)[0]
            except ValueError:       # qgemm_fast cannot run this shape
                continue
            ran_fast += fast
            cases.append((cb, want, d, (M, N, K, lda, d[0].label)))
    rec = rt.recorder()
    for _, _, d, _ in cases:
        rec.dispatch(*d)
    rec.submit()
    for cb, want, _, what in cases:
        assert_close(rt.read(cb, np.float32, want.shape), want, "k_quant_gemm", f"{fmt} {layout} {what}")
    assert ran_fast >= 5, "the fast kernels were not exercised"


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_quant_linear_over_several_chunks(rt, fmt):
    """engine.linear_forward / linear_backward with a QuantMatrix split into row chunks (a small max storage
    binding): bias and output columns per chunk, dx summed over chunks; the chunk plan is what is allocated."""
    rng = np.random.default_rng(5)
    rows, cols, n = 300, 72, 3
    with max_binding(rt, 4096):
        plan = Q.chunk_plan(rows, cols, fmt, 4096)
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        qm = Q.QuantMatrix(rt, w, fmt, "w")
    assert len(qm.chunks) == len(plan) >= 3 and [c[1:] for c in qm.chunks] == [p[:2] for p in plan]
    assert all(r0 * cols % 64 == 0 and r0 % 8 == 0 for r0, *_ in plan)
    assert qm.nbytes == sum(b.size for b, _, _ in qm.chunks) + sum(b.size for b in qm.absmax)
    wq = R.round_to(w, fmt).astype(np.float64)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    dy = rng.standard_normal((n, rows)).astype(np.float32)
    dx0 = rng.standard_normal((n, cols)).astype(np.float32)
    y, dx = rt.buffer(n * rows * 4), rt.upload(dx0)
    rec = rt.recorder()
    linear_forward(rec, y, rt.upload(x), qm, rt.upload(bias), n)
    linear_backward(rec, dx, None, None, rt.upload(dy), None, qm, n, accumulate_dx=True)
    rec.submit()
    assert_close(rt.read(y, np.float32, (n, rows)), x @ wq.T + bias, "k_quant_gemm", "y")
    assert_close(rt.read(dx, np.float32, (n, cols)), dy @ wq + dx0, "k_quant_gemm", "dx")
    with pytest.raises(ValueError, match="frozen"):
        linear_backward(rt.recorder(), dx, rt.buffer(rows * cols * 4), None, rt.upload(dy), None, qm, n)


@pytest.mark.parametrize("fmt", QT.HALF_FORMATS)
def test_16_bit_embedding_gather(rt, fmt):
    rng = np.random.default_rng(6)
    vocab, c = 40, 6
    w = rng.standard_normal((vocab, c)).astype(np.float32)
    with max_binding(rt, 256):                             # 21 rows a chunk: two chunks of 16 and one of 8
        qm = Q.QuantMatrix(rt, w, fmt, "emb")
    assert len(qm.chunks) == 3
    ids = np.array([0, 39, 17, 16, 15, 3, 39], np.int32)
    out = rt.buffer(ids.size * c * 4)
    rec = rt.recorder()
    Q.embedding_forward(rec, out, rt.upload(ids), qm, ids.size)
    rec.submit()
    assert_close(rt.read(out, np.float32, (ids.size, c)), R.round_to(w, fmt)[ids], "exact")


def test_float16_needs_no_shader_f16(rt, tmp_path):
    """float16 weights are read as u32 pairs (unpack2x16float, core WGSL): no shader enables f16, and a
    float16 base and embedding load and run on every adapter, shader-f16 or not (the OpenGL one has none)."""
    for fmt in Q.FORMATS:
        for sg in (False, True):
            assert "enable f16" not in QT.register_source(fmt, sg)
    w = np.array([[1.0, -2.5, 65504.0], [6.1e-5, -0.0, 3.0e-8]], np.float32)   # max, subnormal, -0
    qm = Q.QuantMatrix(rt, w, "float16", "w")
    want = w.astype(np.float16).astype(np.float32)
    assert qm.nbytes == 16 and qm.read(rt).tobytes() == want.tobytes()
    out = rt.buffer(want.size * 4)                         # the shader's decode of the same bytes
    rec = rt.recorder()
    Q.embedding_forward(rec, out, rt.upload(np.array([1, 0], np.int32)), qm, 2)
    rec.submit()
    np.testing.assert_array_equal(rt.read(out, np.float32, want.shape), want[[1, 0]])
    folder = _tiny_model(tmp_path, "llama")
    gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index), base_dtype="float16",
                        embed_dtype="float16")
    ref = wt.load_model(folder, backend="numpy", base_dtype="float16", embed_dtype="float16")
    assert all(isinstance(gpu.engine.w[k], Q.QuantMatrix) for k in ("model.embed_tokens.weight", "lm_head.weight"))
    ids = np.random.default_rng(0).integers(0, 83, (1, 9))
    assert_close(gpu.logits(ids), ref.logits(ids), "gpu_logits")


# ---- the engines --------------------------------------------------------------------------------

def _tiny_model(root, arch):
    from tiny_models import build_model, save_model

    path = root / arch
    if not path.exists():
        save_model(build_model(arch, seed=1), path)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def folder(request, tmp_path_factory):
    """llama: untied, blocks cross rows (30 x 43); qwen3: tied embedding, q/k norms."""
    return _tiny_model(tmp_path_factory.mktemp("q"), request.param)


def test_a_bfloat16_checkpoint_is_stored_exactly(rt, tmp_path):
    """A bf16 checkpoint under --base-dtype bfloat16 (its embedding and head bfloat16 too, by default): the
    device holds exactly the checkpoint's values (half the bytes of float32), and the logits equal those of
    transformers' float32 model of the same weights."""
    torch = pytest.importorskip("torch")
    from tiny_models import build_model, save_model

    import transformers as tf

    folder = save_model(build_model("llama", seed=4), tmp_path / "bf16", dtype=torch.bfloat16)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index), base_dtype="bfloat16")
    f32 = wt.load_model(folder, backend="wgpu", device=str(rt.info.index))
    theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
    ours = gpu.engine.weights()
    for k, v in ours.items():
        np.testing.assert_array_equal(v, theirs[k], err_msg=k)
    assert (gpu.engine.base_dtype, gpu.engine.embed_dtype) == ("bfloat16", "bfloat16")
    halved = [v.nbytes for k, v in ours.items() if v.ndim == 2]          # linear layers, embedding, head
    saved = f32.engine.base_weight_bytes - gpu.engine.base_weight_bytes     # each buffer padded to 16 bytes
    assert sum(halved) // 2 - 16 * len(halved) < saved <= sum(halved) // 2
    assert gpu.engine.base_weight_bytes == base_weight_bytes(gpu.config, "bfloat16", "auto", rt.max_binding)["total"]
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, (2, 9))
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    assert_close(gpu.logits(ids), want, "gpu_logits")


def test_bfloat16_storage_is_bit_for_bit_float32_storage(rt, tmp_path):
    """bf16 -> f32 is exact, so a bf16 checkpoint stored as bfloat16 (half the bytes) gives, bit for bit, the
    logits, loss and LoRA gradients of the same checkpoint stored as float32, on both engines."""
    torch = pytest.importorskip("torch")
    from tiny_models import build_model, save_model

    folder = save_model(build_model("llama", seed=4), tmp_path / "bf16", dtype=torch.bfloat16)
    ids = np.random.default_rng(1).integers(0, 83, (2, 9))
    lora = wt.LoraConfig(r=4, target_modules="all-linear")
    for backend in ("numpy", "wgpu"):
        device = {"device": str(rt.info.index)} if backend == "wgpu" else {}
        half, full = (wt.load_model(folder, backend=backend, base_dtype=d, **device) for d in ("bfloat16", "float32"))
        np.testing.assert_array_equal(half.logits(ids), full.logits(ids), err_msg=backend)
        for m in (half, full):
            m.add_lora(lora, seed=1)
        (loss_h, grads_h), (loss_f, grads_f) = half.loss_and_grads(ids, ids), full.loss_and_grads(ids, ids)
        assert loss_h == loss_f, backend
        for k in grads_f:
            np.testing.assert_array_equal(grads_h[k], grads_f[k], err_msg=f"{backend} {k}")


@pytest.mark.parametrize("base,embed", [("bfloat16", "auto"), ("float16", "float32"), ("nf4", "float32"),
                                        ("nf4-dq", "float16")])
def test_engines_agree_with_quantised_base(folder, rt, base, embed):
    """wgpu vs NumPy with the same stored weights: dequantised weights equal exactly; logits, loss and
    every LoRA gradient as close as with float32 weights; memory as planned."""
    pytest.importorskip("torch")
    ref = wt.load_model(folder, backend="numpy", base_dtype=base, embed_dtype=embed)
    gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index), base_dtype=base, embed_dtype=embed)
    full = wt.load_model(folder, backend="numpy")
    gw, rw, fw = gpu.engine.weights(), ref.engine.weights(), full.engine.weights()
    for k in rw:
        assert_close(gw[k], rw[k], "exact", k)
    assert any(not np.array_equal(rw[k], fw[k]) for k in rw), "the base weights were not rounded"
    assert gpu.engine.base_weight_bytes == base_weight_bytes(gpu.config, base, embed, rt.max_binding)["total"]
    lora = wt.LoraConfig(r=3, alpha=7, target_modules="all-linear")
    ref.add_lora(lora, seed=5)
    rng = np.random.default_rng(2)
    modules = {p: (a, rng.normal(0, 0.1, b.shape).astype(np.float32))
               for p, (a, b) in ref.engine.lora_tensors().items()}
    ref._set_lora(lora, modules, seed=5)
    gpu._set_lora(lora, ref.engine.lora_tensors(), seed=5)
    ids = np.random.default_rng(0).integers(0, 83, (2, 13))
    labels = ids.copy()
    labels[:, :3] = -100
    assert_close(gpu.logits(ids), ref.logits(ids), "gpu_logits")
    loss_ref, grads_ref = ref.loss_and_grads(ids, labels)
    loss_gpu, grads_gpu = gpu.loss_and_grads(ids, labels)
    assert_close(np.float64(loss_gpu), np.float64(loss_ref), "gpu_loss")
    assert set(grads_gpu) == set(grads_ref)
    for k in grads_ref:
        assert_close(grads_gpu[k], grads_ref[k], "gpu_grads", k)
    assert gpu.generate([1, 2, 3], max_new_tokens=4) == ref.generate([1, 2, 3], max_new_tokens=4)


def test_embedding_dtype_auto_follows_the_base(folder):
    """embed_dtype "auto" (the default everywhere): the base's own over a float32 or bfloat16 base, bfloat16 over
    mxfp4, float16 over the others."""
    from wgpu_train.engines.shared.quant import check_dtypes

    assert [check_dtypes(b)[1] for b in R.BASE_DTYPES] == ["float32", "bfloat16", "float16", "float16", "float16",
                                                           "bfloat16"]
    assert check_dtypes("nf4", "float32") == ("nf4", "float32")
    model = wt.load_model(folder, backend="numpy", base_dtype="nf4")
    assert (model.engine.base_dtype, model.engine.embed_dtype) == ("nf4", "float16")
    assert wt.TrainConfig(base_dtype="nf4").storage_dtypes() == ("nf4", "float16")
    assert wt.TrainConfig().storage_dtypes("float32") == ("float32", "float32")    # base_dtype auto
    assert wt.TrainConfig().storage_dtypes("bfloat16") == ("bfloat16", "bfloat16")
    assert wt.TrainConfig(method="full").storage_dtypes() == ("float32", "float32")
    cfg = model.config
    assert wt.estimate_memory(cfg, 1, 8, base_dtype="nf4")["weights"] == \
        base_weight_bytes(cfg, "nf4", "float16")["total"] < base_weight_bytes(cfg, "nf4", "float32")["total"]
    with pytest.raises(wt.ConfigError, match="embed_dtype must be one of auto, float32, bfloat16, float16"):
        wt.load_model(folder, backend="numpy", embed_dtype="nf4")


def test_full_finetune_refused_with_frozen_base(folder):
    model = wt.load_model(folder, backend="numpy", base_dtype="nf4")
    with pytest.raises(wt.ConfigError, match="full fine-tuning needs float32 weights"):
        model.set_full_finetune()
    with pytest.raises(wt.ConfigError, match="method full .* needs base_dtype and embed_dtype float32"):
        wt.TrainConfig(method="full", base_dtype="float16")
    with pytest.raises(wt.ConfigError, match="base_dtype must be one of"):
        wt.load_model(folder, backend="numpy", base_dtype="int4")


def test_weights_beyond_float16_range_are_refused(rt, tmp_path):
    """A weight with a value float16 cannot hold (it would become inf) is refused at load, naming it, on
    both engines; NF4 stores it (its absmax is float32)."""
    from wgpu_train.formats.safetensors import read_safetensors, write_safetensors

    folder = _tiny_model(tmp_path, "llama")
    tensors = read_safetensors(folder / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][2, 3] = 7.0e4
    write_safetensors(folder / "model.safetensors", tensors)
    for backend, device in (("numpy", None), ("wgpu", str(rt.info.index))):
        with pytest.raises(wt.ConfigError, match=f"{name} has values up to 70000, beyond float16's range"):
            wt.load_model(folder, backend=backend, device=device, base_dtype="float16")
    gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index), base_dtype="nf4", embed_dtype="float16")
    assert gpu.engine.weights()[name][2, 3] == np.float32(7.0e4)


# ---- memory -------------------------------------------------------------------------------------

def test_base_weight_bytes_of_a_half_billion_parameter_model():
    """Qwen2.5-0.5B's dimensions (tied embedding): float16 and bfloat16 halve the bytes; NF4 linear layers take
    0.5 byte per weight + 4 bytes per 64 (absmax); with a float16 embedding the whole is under 0.3x."""
    from wgpu_train.bench.suite import QWEN05

    cfg = ModelConfig(**QWEN05)
    f32 = base_weight_bytes(cfg)
    linear_params = f32["linear"] // 4
    assert f32["total"] == 494_032_768 * 4
    assert base_weight_bytes(cfg, "float16", "float16")["total"] / f32["total"] == pytest.approx(0.5, abs=1e-3)
    bf16 = base_weight_bytes(cfg, "bfloat16")        # embed_dtype auto: a bfloat16 embedding over bfloat16
    assert bf16["linear"] == linear_params * 2 and bf16["embedding"] * 2 == f32["embedding"]
    nf4 = base_weight_bytes(cfg, "nf4", "float16")
    assert nf4["linear"] == pytest.approx(linear_params * (0.5 + 4 / 64), rel=1e-4)
    assert nf4["total"] / f32["total"] <= 0.3
    assert 0.3 < base_weight_bytes(cfg, "nf4", "float32")["total"] / f32["total"] < 0.4
    dq = base_weight_bytes(cfg, "nf4-dq", "float16")     # absmax in 8 bits, + 4 bytes per 256 blocks, + headers
    assert dq["linear"] == pytest.approx(linear_params * (0.5 + 1 / 64 + 4 / 64 / 256), rel=1e-3)
    assert dq["embedding"] == nf4["embedding"] and dq["total"] < nf4["total"]
    est = wt.estimate_memory(cfg, 1, 64, base_dtype="nf4", embed_dtype="float16")
    assert est["weights"] == nf4["total"]
    with pytest.raises(ValueError, match="float32"):
        wt.estimate_memory(cfg, 1, 64, method="full", base_dtype="nf4")


# ---- training -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    """The embedded model and dataset when installed, else the tiny model and toy task of the trainer tests."""
    from wgpu_train.training.config import default_data_dir, default_model_dir

    try:
        return default_model_dir(), default_data_dir(), "embedded"
    except wt.ConfigError:
        from finetune_helpers import make_data_dir, make_model_dir

        root = tmp_path_factory.mktemp("qtrain")
        return make_model_dir(root / "model"), make_data_dir(root / "data", n_train=24), "tiny"


def test_training_loss_with_float16_and_nf4_close_to_float32(train_setup, tmp_path):
    """20 LoRA steps from the same seed on the same batches (wgpu backend where an adapter exists, else
    NumPy): the training loss (mean over the 20 steps, and the last step's) with float16 base weights
    within 2% of float32's; with NF4 within the wider band of quant_train_loss_nf4 (see its reason)."""
    from conftest import ADAPTERS

    model, data, _ = train_setup
    backend = "wgpu" if ADAPTERS else "numpy"
    runs = {}
    for bd in ("float32", "float16", "nf4", "nf4-dq"):
        out = tmp_path / bd
        summary = wt.finetune(wt.TrainConfig(
            model=str(model), data=str(data), out=str(out), backend=backend, base_dtype=bd, embed_dtype="float32",
            max_steps=20, lr=2e-3,
            warmup_steps=5, batch_size=4, max_seq_len=48, lora_rank=8, lora_alpha=16, lora_targets="all-linear",
            eval_generate=False, no_progress=True, log_every=1, seed=0))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses = np.array([r["loss"] for r in rows if "split" not in r and r.get("loss") is not None])
        assert summary["base_dtype"] == bd and summary["backend"] == backend and losses.size == 20
        runs[bd] = (summary, losses)
    ref, ref_losses = runs["float32"]
    assert ref_losses[-5:].mean() < 0.8 * ref_losses[:5].mean(), "float32 did not learn"
    for bd, (summary, losses) in runs.items():
        tol = "quant_train_loss_nf4" if bd.startswith("nf4") else "quant_train_loss_f16"
        assert_close(losses.mean(), ref_losses.mean(), tol, f"{bd}: mean training loss over 20 steps")
        if bd == "float16":
            assert_close(losses[-1], ref_losses[-1], tol, f"{bd}: training loss of step 20")
    assert runs["nf4"][1][0] != ref_losses[0], "NF4 did not change the base weights"
    assert runs["nf4-dq"][1][0] != runs["nf4"][1][0], "double quantisation did not change the absmax values"
    assert runs["nf4-dq"][0]["base_weight_bytes"] < runs["nf4"][0]["base_weight_bytes"] < ref["base_weight_bytes"]
