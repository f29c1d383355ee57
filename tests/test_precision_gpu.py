"""16-bit training on the WebGPU engine: bf16 / f16 activations against the NumPy engine with the same rounding
points (logits, loss, LoRA gradients on every family's tiny model; DoRA, modules_to_save, gradient checkpointing),
the memory estimate against the allocation, f16's overflow in the forward, f16's loss scaler skipping an
overflowing step, and the refusals."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.errors import ConfigError

from tiny_models import build_model, in_arch, save_model
from tolerances import assert_close

torch = pytest.importorskip("torch")

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]
EVEN = dict(intermediate_size=42)      # 16-bit activations need even widths (43 elsewhere in the tests)


@pytest.fixture(scope="module", params=ARCHS)
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param + "16")
    save_model(build_model(request.param, seed=2, **EVEN), path)
    return path


def _batch(seed=3, vocab=83):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (2, 13))
    mask = np.ones_like(ids)
    mask[1, 10:] = 0
    labels = ids.copy()
    labels[:, :3] = -100
    labels[mask == 0] = -100
    return ids, labels, mask


def _pair(path, rt, precision, lora=None, **load_kw):
    """The model on both engines in one precision (load_kw: more load_model settings for both), with the same
    LoRA (B random, so every gradient flows)."""
    ref = wt.load_model(path, backend="numpy", precision=precision, **load_kw)
    gpu = wt.load_model(path, backend="wgpu", device=str(rt.info.index), precision=precision, **load_kw)
    assert ref.engine.precision == gpu.engine.precision == precision
    if lora is not None:
        ref.add_lora(lora, seed=5)
        rng = np.random.default_rng(7)
        modules = {p: (a, rng.normal(0, 0.1, b.shape).astype(np.float32))
                   for p, (a, b) in ref.engine.lora_tensors().items()}
        ref._set_lora(lora, modules, seed=5)
        gpu._set_lora(lora, ref.engine.lora_tensors(), seed=5)
    return ref, gpu


def _lora(path, **kw):
    arch = wt.ModelConfig.from_folder(path).family
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return wt.LoraConfig(target_modules=in_arch(arch, targets), **{"r": 3, "alpha": 6, **kw})


def _check(ref, gpu, ids, labels, mask, tolerances):
    """Logits, loss and every gradient of gpu against ref, within the tolerances <tolerances>_logits, _loss and
    _grads: each gradient's differences as a fraction of its largest element."""
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], f"{tolerances}_logits")
    loss_ref, grads_ref = ref.loss_and_grads(ids, labels, mask)
    loss_gpu, grads_gpu = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_gpu), np.float64(loss_ref), f"{tolerances}_loss")
    assert set(grads_gpu) == set(grads_ref) and grads_ref
    for k in grads_ref:
        top = np.abs(grads_ref[k]).max()
        assert top > 0, k
        assert_close(grads_gpu[k] / top, grads_ref[k] / top, f"{tolerances}_grads", k)


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_logits_loss_and_lora_gradients_match_numpy(folder, rt, precision):
    if precision == "f16" and folder.name.split("16")[0] not in ("llama", "gemma3", "phi3"):
        pytest.skip("f16 on three families (the suite's time): f16 stores through the same kernels as bf16")
    ref, gpu = _pair(folder, rt, precision, _lora(folder))
    _check(ref, gpu, *_batch(), f"{precision}_gpu")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama16")
    save_model(build_model("llama", seed=4, **EVEN), path)
    return path


def test_activations_are_16_bit_buffers_and_the_estimate_is_the_allocation(llama, rt):
    from test_engine import _allocated

    lora = _lora(llama, dropout=0.1)
    _, gpu = _pair(llama, rt, "bf16", lora)
    ids, labels, mask = _batch()
    gpu.loss_and_grads(ids, labels, mask)
    acts = gpu.engine._activations(*ids.shape, train=True)
    layer = acts.layers[0]
    assert storage.format_of(layer["x_in"]) == "bf16" and storage.format_of(acts.logits) == "f32"
    assert storage.format_of(layer["rstd1"]) == "f32" and storage.format_of(acts.d_res) == "bf16"
    est = {p: wt.estimate_memory(gpu.config, ids.shape[0], ids.shape[1], lora=lora, precision=p)
           for p in ("fp32", "bf16")}
    assert est["bf16"]["activations"] + est["bf16"]["logits"] == _allocated(acts)
    # smaller, though not half: this tiny model's float32 LoRA inputs (dropout) weigh as much as its activations
    assert est["bf16"]["activations"] < 0.7 * est["fp32"]["activations"]


@pytest.mark.parametrize("variant", ["full", "dora", "modules_to_save", "checkpointing"])
def test_variants_match_numpy_in_bf16(llama, rt, variant):
    """Full fine-tuning (every weight's gradient), DoRA, a trained lm_head copy, gradient checkpointing."""
    kw = {"dora": dict(use_dora=True), "modules_to_save": dict(modules_to_save=["lm_head"])}.get(variant, {})
    ref, gpu = _pair(llama, rt, "bf16", None if variant == "full" else _lora(llama, **kw))
    if variant == "full":
        ref.set_full_finetune()
        gpu.set_full_finetune()
    if variant == "checkpointing":
        gpu.set_gradient_checkpointing(True)
    _check(ref, gpu, *_batch(8), "bf16_gpu")


def test_f16_overflow_in_the_forward_names_the_layer(tmp_path, rt):
    """An up projection scaled past float16's range: the step stops with one line naming the layer whose output
    overflowed, as on the NumPy engine, and suggests bf16; bf16 trains the same model."""
    from safetensors.numpy import load_file, save_file

    save_model(build_model("llama", seed=4, **EVEN), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"] *= 1e6
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids, labels, mask = _batch()
    for precision in ("f16", "bf16"):
        gpu = wt.load_model(tmp_path, backend="wgpu", device=str(rt.info.index), precision=precision)
        gpu.add_lora(_lora(tmp_path), seed=1)
        if precision == "f16":
            with pytest.raises(ConfigError, match=r"overflow float16 in layer 1 .*--precision bf16"):
                _one_step(gpu, ids, labels)
        else:
            assert np.isfinite(_one_step(gpu, ids, labels)[0])


def _one_step(model, ids, labels, step=1):
    from wgpu_train.engines.shared.labels import shift_labels
    from wgpu_train.engines.protocol import OptimizerParams

    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    batch = [(ids.astype(np.int32), shift_labels(labels), np.ones_like(ids, np.int32), pos)]
    return model.engine.train_step(batch, OptimizerParams(lr=1e-3), step)


def test_f16_overflow_skips_the_step_and_halves_the_scale(llama, rt):
    """f16's loss scaler on the WebGPU engine, as test_precision.py checks it on the NumPy engine: a loss scale of
    2^40 overflows the float16 gradients, so the step is skipped (LoRA tensors and AdamW moments untouched), the
    scale halves and the skip is counted; clean steps then grow the scale back."""
    from wgpu_train.engines.protocol import LossScaler

    gpu = wt.load_model(llama, backend="wgpu", device=str(rt.info.index), precision="f16")
    gpu.add_lora(_lora(llama), seed=1)
    engine = gpu.engine
    ids, labels, _ = _batch()
    assert engine.loss_scaler.scale == 2.0 ** 16 and _one_step(gpu, ids, labels)[3], "a clean first step"
    before = {k: v.copy() for k, v in engine.trainable().items()}
    moments = engine.optimizer_state()
    engine.loss_scaler.scale = 2.0 ** 40
    loss_sum, count, norm, applied = _one_step(gpu, ids, labels, 2)
    assert not applied and not np.isfinite(norm) and np.isfinite(loss_sum) and count > 0
    assert engine.loss_scaler.scale == 2.0 ** 39 and engine.counters["nonfinite_skipped"] == 1
    for k, v in engine.trainable().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    for k, (m, v) in engine.optimizer_state().items():
        np.testing.assert_array_equal(m, moments[k][0], err_msg=k)
        np.testing.assert_array_equal(v, moments[k][1], err_msg=k)
    engine.loss_scaler = LossScaler(init_scale=2.0 ** 8, growth_interval=2)
    assert [_one_step(gpu, ids, labels, s)[3] for s in (2, 3, 4)] == [True] * 3
    assert engine.loss_scaler.scale == 2.0 ** 9 and engine.loss_scaler.growth_tracker == 1


def test_odd_widths_are_refused_in_16_bits(tmp_path, rt):
    save_model(build_model("llama", seed=4), tmp_path)       # intermediate_size 43
    with pytest.raises(ConfigError, match="--precision bf16 on the WebGPU engine needs even widths .*"
                                          "intermediate_size 43"):
        wt.load_model(tmp_path, backend="wgpu", device=str(rt.info.index), precision="bf16")
    assert wt.load_model(tmp_path, backend="numpy", precision="bf16").engine.precision == "bf16"
    # auto would pick bf16 on a GPU: fp32 for this model, saying why
    from wgpu_train.engines.loading import precision_choice

    cfg = wt.ModelConfig.from_folder(tmp_path)
    assert precision_choice("auto", "wgpu", False, cfg) == ("fp32", "auto: this model has an odd width, which "
                                                             "16-bit activations cannot store")
