"""`bench --only engines`: tokens/s of one LoRA step on every engine present (the NumPy engine, each WebGPU
adapter) for the embedded default and a SmolLM2-135M-shaped model, as ratios against the NumPy engine measured in
the same run, and the engine `backend="auto"` picks for each."""
from __future__ import annotations

import numpy as np

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.assets import default_model_dir
from wgpu_train.bench.pretune import SMOL135
from wgpu_train.bench.training import random_batch, random_weights, timed
from wgpu_train.engines.loading import load_model, model_from_weights
from wgpu_train.engines.backend_choice import choose_backend
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.webgpu.device import runtime
from wgpu_train.models.config import ModelConfig

# (name, batch rows, tokens per row, timed steps): the embedded recipe's batch; the 2 x 256 for 135M
CASES = (("embedded default", 16, 48, 4), ("135M-shaped", 2, 256, 2))


def _case_config(name: str) -> ModelConfig:
    if name == "embedded default":
        return ModelConfig.from_folder(default_model_dir())
    return ModelConfig.from_dict(dict(SMOL135), "SmolLM2-135M-shaped")


def _case_model(name: str, backend: str, device):
    if name == "embedded default":
        return load_model(default_model_dir(), backend=backend, device=device)
    cfg = _case_config(name)
    return model_from_weights(cfg, random_weights(cfg, np.random.default_rng(0)), backend, device)


def _tokens_per_s(model, rows: int, seq: int, steps: int) -> float:
    """Median tokens/s of LoRA (r=8, all linear layers) steps on a fixed random batch, after a warm-up step."""
    model.add_lora(LoraConfig(r=8, alpha=16, target_modules="all-linear"), seed=0)
    micro = random_batch(model.config, rows, seq, np.random.default_rng(1))
    hp = OptimizerParams(lr=1e-4, max_grad_norm=1.0)
    walls = timed(lambda i: model.engine.train_step(micro, hp, i + 1), steps)
    return rows * seq / float(np.median(walls))


def bench_engines(cases=CASES) -> dict:
    """For each case: tokens/s on every engine, each as a ratio to the NumPy engine's, the fastest, and auto's
    choice (the engine, and for WebGPU the adapter it opens) with its reason."""
    adapters = runtime.devices()
    out = {"adapters": [a.describe() for a in adapters], "cases": []}
    for name, rows, seq, steps in cases:
        speeds = {"numpy": _tokens_per_s(_case_model(name, "numpy", None), rows, seq, steps)}
        for a in adapters:
            speeds[a.describe()] = _tokens_per_s(_case_model(name, "wgpu", str(a.index)), rows, seq, steps)
        choice = choose_backend("auto", None, _case_config(name))
        auto = "numpy" if choice.engine == "numpy" else runtime.choose_adapter(choice.device).describe()
        out["cases"].append({"case": name, "batch": f"{rows}x{seq}", "tokens_per_s": speeds,
                             "vs_numpy": {k: v / speeds["numpy"] for k, v in speeds.items()},
                             "fastest": max(speeds, key=speeds.get), "auto": auto, "auto_reason": choice.reason})
    return out
