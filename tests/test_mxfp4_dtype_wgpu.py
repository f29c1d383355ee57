"""--base-dtype mxfp4 on the WebGPU engine against the NumPy engine, on every adapter present: a tiny Qwen3-MoE whose
experts are quantised at load and decoded inside the grouped GEMMs (shaders/moe_mxfp4.wgsl), the other weights
bfloat16: logits, LoRA loss and gradients (the experts', router's and attention's) and one optimizer step in one
submission; the GPU bytes allocated equal the memory estimate's."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from engine_pair import assert_engines_agree, engine_pair
from finetune_helpers import padded_batch
from tiny_models import build_moe, save_model
from wgpu_train.engines.webgpu.memory import base_weight_bytes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_mxfp4_experts_on_webgpu_match_numpy(rt, tmp_path):
    save_model(build_moe("qwen3_moe", seed=3, hidden_size=32, moe_intermediate_size=32), tmp_path)
    ref, gpu = engine_pair(tmp_path, rt, wt.LoraConfig(r=3, alpha=7, target_modules="all-linear"),
                           base_dtype="mxfp4")
    ids, labels, mask = padded_batch(4, 9, 6, 2)
    ids, labels = ids % 61, np.where(labels >= 0, labels % 61, labels)
    assert_engines_agree(ref, gpu, ids, labels, mask, [".mlp.experts.base_layer.lora_A", "q_proj"], "qwen3_moe mxfp4")
    assert gpu.engine.base_weight_bytes == base_weight_bytes(gpu.config, "mxfp4", max_binding=rt.max_binding)["total"]
