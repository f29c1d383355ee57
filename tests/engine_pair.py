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
