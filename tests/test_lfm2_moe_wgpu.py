"""LFM2-MoE on the WebGPU engine against the NumPy engine (tests/test_lfm2_moe.py holds that one to transformers and
PEFT), on every adapter present: the sigmoid router with its choosing expert_bias and routed_scaling_factor on the
device; logits, loss and the LoRA gradients (experts, attention, conv, dense MLP, router) over a padded batch, an
optimizer step in one submission, greedy generation, and backend auto treating it as any MoE."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from finetune_helpers import padded_batch
from test_lfm2_moe import build
from tolerances import assert_close
from wgpu_train.engines.backend_choice import choose_backend
from wgpu_train.models.config import ModelConfig
from engine_pair import assert_engines_agree, engine_pair

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("lfm2_moe_wgpu")
    build().save_pretrained(out)
    return out


def _pair(folder, rt, **kw):
    """The model on both engines with LoRA on attention, conv, the dense MLP, the router and every expert, B
    random."""
    config = wt.LoraConfig(r=3, alpha=7, target_modules=["in_proj", "out_proj", "q_proj", "w1", "gate"],
                           target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"])
    return engine_pair(folder, rt, config, **kw)


def test_lora_logits_loss_gradients_and_a_step_match_numpy(folder, rt):
    ref, gpu = _pair(folder, rt)
    ids, labels, mask = padded_batch(2, 15, 9, 2)
    ids = ids % 83
    parts = ("experts.base_layer.lora_A", "experts.lora_B", "q_proj.lora_A", "conv.in_proj.lora_B",
             "feed_forward.gate.lora_A", "feed_forward.w1.lora_B")
    assert_engines_agree(ref, gpu, ids, labels, mask, parts, "lfm2-moe")


def test_greedy_generation_matches_numpy(folder, rt):
    ref, gpu = _pair(folder, rt)
    prompt = [5, 17, 3, 40, 22, 8, 9]
    assert gpu.generate(prompt, max_new_tokens=10) == ref.generate(prompt, max_new_tokens=10)


def test_auto_backend_no_longer_sets_the_sigmoid_router_aside(folder):
    assert "sigmoid" not in choose_backend("auto", cfg=ModelConfig.from_folder(folder)).reason


def test_bfloat16_activations_and_experts_match_numpy(rt, tmp_path):
    """--precision bf16 with bfloat16 weights (even widths: 6 experts of 24): the sigmoid route reads 16-bit
    router logits; the same logits, loss and LoRA gradients within bfloat16 noise."""
    build(moe_intermediate_size=24, intermediate_size=46, num_experts=6).save_pretrained(tmp_path)
    ref, gpu = _pair(tmp_path, rt, precision="bf16", base_dtype="bfloat16")
    ids, labels, mask = padded_batch(2, 15, 9, 2)
    ids = ids % 83
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], "bf16_gpu_logits", "lfm2-moe")
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), "bf16_gpu_loss", "lfm2-moe")
    for k, g in grads_r.items():
        top = np.abs(g).max()
        assert_close(grads_g[k] / top, g / top, "bf16_gpu_grads", f"lfm2-moe: {k}")


def test_full_finetuning_checkpointing_and_the_memory_estimate(folder, rt):
    """Full fine-tuning: every weight's gradient as the NumPy engine's, the expert bias (a buffer in transformers)
    not trained; gradient checkpointing gives the same gradients; the memory estimate is the allocation."""
    from test_moe_wgpu import _allocated

    ref = wt.load_model(folder, backend="numpy")
    gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index))
    for m in (ref, gpu):
        m.set_full_finetune()
    ids, labels, mask = padded_batch(2, 15, 9, 2)
    ids = ids % 83
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", "full")
    assert grads_g.keys() == grads_r.keys() and not any("expert_bias" in k for k in grads_g)
    for k, g in grads_r.items():
        assert_close(grads_g[k], g, "gpu_grads", f"full: {k}")
    gpu.set_gradient_checkpointing(True)
    loss_c, grads_c = gpu.loss_and_grads(ids, labels, mask)
    assert loss_c == loss_g and all(np.array_equal(grads_c[k], grads_g[k]) for k in grads_g)
    est = wt.estimate_memory(gpu.config, *ids.shape, method="full", gradient_checkpointing=True)
    assert est["activations"] + est["logits"] == _allocated(gpu.engine._activations(*ids.shape, train=True))
