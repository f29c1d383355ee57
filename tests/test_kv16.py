"""A bfloat16 KV cache for generation (kv_dtype): the cache write's bits against NumPy's bfloat16 rounding, each
cached-attention pass over a bfloat16 cache, the GPU engine against the NumPy engine with the same rounding (logits
of each decoding step, greedy tokens), half the cache's bytes, and one-line refusals."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from tolerances import assert_close
from wgpu_train.cli.main import main
from wgpu_train.errors import ConfigError
from wgpu_train.engines.generate import generate
from wgpu_train.engines.numpy import ops
from wgpu_train.engines.shared.quant import bfloat16_bits, bfloat16_values
from wgpu_train.engines.webgpu import attention as A
from wgpu_train.engines.webgpu.tuned import decode_kernels, tune

from finetune_helpers import make_model_dir
from tiny_models import build_model, edit_config, save_model

F32 = np.float32


def _bf16(x):
    return bfloat16_values(bfloat16_bits(x)).reshape(np.shape(x))


def _run(rt, record):
    rec = rt.recorder()
    record(rec)
    rec.submit()


def test_cache_write_rounds_to_nearest_even(rt):
    """The bfloat16 write stores NumPy's (torch's) bfloat16 bits of every new key and value, ties to even, NaN and
    overflow included; padding tokens and the rest of the cache stay untouched."""
    batch, max_len, hkv, d = 2, 5, 2, 6
    tokens = [(1, 3), (0, 0), (-1, 0), (0, 4)]
    n = len(tokens)
    rows, pos = (np.array(c, np.int32) for c in zip(*tokens))
    g = np.random.default_rng(0)
    k_new, v_new = g.standard_normal((2, n, hkv, d)).astype(F32)
    # ties (low half exactly 0x8000, both parities of the kept bit), NaN, a value past bfloat16's largest finite
    k_new.reshape(-1)[:5] = np.array([0x3F808000, 0x3F818000, 0x7FC00001, 0x7F7FFFFF, 0x80000001],
                                     np.uint32).view(F32)
    old = g.integers(0, 2**32, (2, batch, max_len, hkv, d // 2), dtype=np.uint64).astype(np.uint32)   # words
    tk, tv, tkn, tvn, tr, tp = (rt.upload(a) for a in (old[0], old[1], k_new, v_new, rows, pos))
    _run(rt, lambda r: A.kv_cache_write(r, tk, tv, tkn, tvn, tr, tp, n, batch, max_len, hkv, d, "bfloat16"))
    for t, new, before in ((tk, k_new, old[0]), (tv, v_new, old[1])):
        want = before.copy().view(np.uint16).reshape(batch, max_len, hkv, d)
        keep = rows >= 0
        want[rows[keep], pos[keep]] = bfloat16_bits(new[keep]).reshape(-1, hkv, d)
        got = rt.read(t, np.uint32, before.shape).view(np.uint16).reshape(batch, max_len, hkv, d)
        assert np.array_equal(got, want)


@pytest.mark.parametrize("kernel", ["decode/single", "decode/split32"])
def test_attention_passes_over_a_bfloat16_cache(rt, kernel):
    """Each pass reads the bfloat16 cache as the float32 values of its bits: equal to the NumPy op over the
    rounded cache within float32's tolerance (the same as over a float32 cache)."""
    batch, max_len, hq, hkv, d = 2, 97, 3, 1, 10
    tokens = [(1, 96), (0, 64), (-1, 0)]
    n = len(tokens)
    rows, pos = (np.array(c, np.int32) for c in zip(*tokens))
    g = np.random.default_rng(1)
    q = g.standard_normal((n, hq, d)).astype(F32)
    kc, vc = g.standard_normal((2, batch, max_len, hkv, d)).astype(F32)
    want = ops.attention_cached_forward(*(x.astype(np.float64) for x in (q, _bf16(kc), _bf16(vc))), rows, pos)
    out = rt.upload(np.full(q.shape, 7.0, F32))
    scratch = rt.buffer(4 * decode_kernels.scratch_elements(n, hq, d))
    words = [bfloat16_bits(x).view(np.uint32) for x in (kc, vc)]               # (batch, max_len, hkv, d / 2)
    tq, tk, tv, tr, tp = (rt.upload(a) for a in (q, *words, rows, pos))
    with tune.pinned(kernel):
        _run(rt, lambda r: A.attention_cached_forward(r, out, tq, tk, tv, tr, tp, n, batch, max_len, hq, hkv, d,
                                                      scratch=scratch, kv_dtype="bfloat16"))
    assert_close(rt.read(out, F32, q.shape), want, "k_attention", kernel)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny random Llama (vocabulary 83, head dim 10)."""
    return save_model(build_model("llama", seed=1), tmp_path_factory.mktemp("llama"))


def _step_logits(engine, prompt, steps):
    """Logits (steps + 1, V) of a prefill and `steps` greedy decoding steps on a fresh cache of the engine."""
    kv = engine.new_kv_cache(1, len(prompt) + steps)
    out = [engine.forward_cached(np.asarray(prompt)[None], kv)[0]]
    for _ in range(steps):
        out.append(engine.forward_cached(np.array([[int(np.argmax(out[-1]))]]), kv)[0])
    engine.free_kv_cache(kv)
    return np.stack(out)


def test_engines_agree_with_a_bfloat16_cache(tiny, rt):
    """The GPU engine's bfloat16 cache against the NumPy engine rounding at the same point: logits of the prefill
    and of each decoding step, and greedy tokens identical; the rounding is real (the float32 cache differs)."""
    prompt, steps = [5, 17, 3, 40, 22, 9], 12
    ref = wt.load_model(tiny, backend="numpy", kv_dtype="bfloat16").engine
    gpu = wt.load_model(tiny, backend="wgpu", device=str(rt.info.index), kv_dtype="bfloat16").engine
    ref32 = wt.load_model(tiny, backend="numpy").engine
    want, got, full = (_step_logits(e, prompt, steps) for e in (ref, gpu, ref32))
    print(f"{rt.info.backend}: max |logit| difference, GPU bf16 cache vs NumPy bf16 {np.abs(got - want).max():.3g}, "
          f"vs NumPy float32 cache {np.abs(got - full).max():.3g}")
    assert_close(got, want, "kv16_logits", "bf16 cache, each step")
    assert np.abs(want - full).max() > 1e-5      # a cache left in float32 would not pass this
    assert generate(gpu, prompt, 16) == generate(ref, prompt, 16)


def test_bfloat16_cache_takes_half_the_bytes(tiny, rt):
    """The cache's GPU buffers (keys and values of every layer) hold half the bytes of float32's."""
    def cache_bytes(kv_dtype):
        engine = wt.load_model(tiny, backend="wgpu", device=str(rt.info.index), kv_dtype=kv_dtype).engine
        kv = engine.new_kv_cache(3, 64)
        size = sum(b.size for b in [*kv["k"].values(), *kv["v"].values()])
        engine.free_kv_cache(kv)
        return size

    f32, bf16 = cache_bytes("float32"), cache_bytes("bfloat16")
    print(f"{rt.info.backend}: KV cache of 3 x 64 positions, 2 layers: {f32} bytes float32, {bf16} bytes bfloat16")
    assert f32 == 2 * 2 * 3 * 64 * 10 * 4 and bf16 * 2 == f32


def test_refusals(tiny, tmp_path):
    """A dtype not offered, and bfloat16 for an odd head dim (two values share a 4-byte word), are one-line
    ConfigErrors."""
    with pytest.raises(ConfigError, match="kv_dtype must be one of float32, bfloat16"):
        wt.load_model(tiny, kv_dtype="float16")
    odd = save_model(build_model("llama", seed=0), tmp_path / "odd")
    edit_config(odd, head_dim=7)        # refused before any weight is read
    with pytest.raises(ConfigError, match="even head dim") as e:
        wt.load_model(odd, kv_dtype="bfloat16")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_kv_dtype_option(capsys, command):
    """generate, chat and serve take --kv-dtype float32 | bfloat16; anything else is a usage error."""
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and "--kv-dtype" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main([command, "--kv-dtype", "float16"])
    assert e.value.code == 2 and "--kv-dtype: invalid choice: 'float16'" in capsys.readouterr().err


def test_generate_passes_kv_dtype_to_the_engine(tmp_path, monkeypatch, capsys):
    """`wgpu-train generate --kv-dtype bfloat16` answers, with its engine's cache in bfloat16."""
    from wgpu_train.engines import loading

    engines = []
    load = loading.load_model

    def recording_load(*a, **k):
        m = load(*a, **k)
        engines.append(m.engine)
        return m

    monkeypatch.setattr(loading, "load_model", recording_load)
    model_dir = make_model_dir(tmp_path / "model")
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--max-new-tokens", "4",
                 "--backend", "numpy", "--kv-dtype", "bfloat16"]) == 0
    assert [e.kv_dtype for e in engines] == ["bfloat16"]


def test_lm_eval_model_takes_kv_dtype(tmp_path, default_rt):
    """lm_eval's wgpu-train model (model_args kv_dtype=bfloat16) answers generate_until over a bfloat16 cache, the
    same greedy text on the GPU engine as on the NumPy one."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from wgpu_train.harness.lm import WgpuTrainLM

    model_dir = make_model_dir(tmp_path / "model")
    texts = []
    for backend in ("numpy", "wgpu"):
        lm = WgpuTrainLM(pretrained=str(model_dir), backend=backend, batch_size=2, kv_dtype="bfloat16")
        assert lm.model.engine.kv_dtype == "bfloat16"
        texts.append(lm.generate_until([Instance("generate_until", {}, (f"after red {i}?", {"max_gen_toks": 8}), i)
                                        for i in range(3)], disable_tqdm=True))
    assert texts[0] == texts[1] and all(texts[0])
