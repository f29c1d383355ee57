"""One model on the NumPy engine (the oracle) and on a WebGPU adapter, with the same LoRA whose B matrices are
random (a fresh adapter's are zero, which would leave the A gradients untested): the pair the *_wgpu tests compare."""
from __future__ import annotations

import numpy as np

import wgpu_train as wt


def engine_pair(folder, rt, lora: wt.LoraConfig | None = None, **kw):
    """(the NumPy engine's Model, the WebGPU engine's on rt's adapter) of the model in `folder`, load_model's `kw`
    on both; with `lora`, its adapter on both (seed 5), B drawn from N(0, 0.1)."""
    ref = wt.load_model(folder, backend="numpy", **kw)
    gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index), **kw)
    if lora is not None:
        ref.add_lora(lora, seed=5)
        rng = np.random.default_rng(1)
        modules = {p: (a, rng.normal(0, 0.1, b.shape).astype(np.float32))
                   for p, (a, b) in ref.engine.lora_tensors().items()}
        ref._set_lora(lora, modules, seed=5)
        gpu._set_lora(lora, ref.engine.lora_tensors(), seed=5)
    return ref, gpu


def assert_engines_agree(ref, gpu, ids, labels, mask, parts, what: str):
    """The pair's logits on the real tokens, loss and every LoRA gradient within the gpu_* tolerances (the
    gradients' names include each of `parts`, so the modules meant are adapted), then one optimizer step: the
    same loss, in one submission on the WebGPU engine."""
    from tolerances import assert_close
    from wgpu_train.engines.protocol import OptimizerParams
    from wgpu_train.engines.shared.labels import shift_labels

    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], "gpu_logits", what)
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", what)
    assert grads_g.keys() == grads_r.keys()
    for part in parts:
        assert any(part in k for k in grads_r), part
    for k, g in grads_r.items():
        assert_close(grads_g[k], g, "gpu_grads", f"{what}: {k}")
    micro = [(ids.astype(np.int32), shift_labels(labels), mask.astype(np.int32),
              np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy())]
    hp = OptimizerParams(lr=1e-3, eps=1e-5)
    loss_r, _, _, _ = ref.engine.train_step(micro, hp, 1)
    loss_g, _, _, applied = gpu.engine.train_step(micro, hp, 1)
    assert applied and gpu.engine.last_step["submits"] == 1
    assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", f"{what}: step")
