"""gpt-oss on the WebGPU engine against the NumPy engine (tests/test_gpt_oss.py holds that one to transformers and
PEFT), on every adapter present, a tiny random model (sliding and full layers, YaRN, clamps that bite): logits, loss
and the LoRA gradients (attention, the router with its bias, every expert through target_parameters) over a padded
batch, an optimizer step in one submission, full fine-tuning's gradients (the sinks and the experts' biases
included, with gradient checkpointing, and the memory estimate), greedy generation over the KV cache, bf16
activations and bfloat16 / NF4 weights, MXFP4 experts kept packed, and backend auto no longer setting it aside."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from finetune_helpers import padded_batch
from test_gpt_oss import build_gpt_oss
from tolerances import assert_close
from wgpu_train.engines.backend_choice import choose_backend
from wgpu_train.models.config import ModelConfig
from engine_pair import assert_engines_agree, engine_pair

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SIZES = dict(hidden_size=64, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt_oss_wgpu")
    build_gpt_oss(seed=5, **SIZES).save_pretrained(out)
    return out


def _batch():
    ids, labels, mask = padded_batch(2, 14, 9, 2)
    return ids % 61, np.where(labels >= 0, labels % 61, labels), mask


def _pair(folder, rt, **kw):
    """The model on both engines with LoRA on q_proj, o_proj, the router and every expert, B random."""
    config = wt.LoraConfig(r=3, alpha=7, target_modules=["q_proj", "o_proj", "router"],
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return engine_pair(folder, rt, config, **kw)


def test_lora_logits_loss_gradients_and_a_step_match_numpy(folder, rt):
    ref, gpu = _pair(folder, rt)
    ids, labels, mask = _batch()
    assert_engines_agree(ref, gpu, ids, labels, mask, ("experts.base_layer.lora_A", "experts.lora_B", "q_proj.lora_A", "o_proj.lora_B", "router.lora_A"), "gpt-oss")


def test_full_finetuning_trains_the_sinks_and_biases_as_numpy(folder, rt):
    """Every weight's gradient as the NumPy engine's: the attention sinks, the router's and the experts' biases; the
    same with gradient checkpointing; the memory estimate is the allocation (the experts' staged scratch counted)."""
    from test_moe_wgpu import _allocated

    ref = wt.load_model(folder, backend="numpy")
    gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index))
    for m in (ref, gpu):
        m.set_full_finetune()
    ids, labels, mask = _batch()
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", "full")
    assert grads_g.keys() == grads_r.keys()
    for part in ("self_attn.sinks", "experts.gate_up_proj_bias", "experts.down_proj_bias", "mlp.router.bias"):
        assert any(k.endswith(part) for k in grads_r), part
    for k, g in grads_r.items():
        assert np.abs(g).max() > 1e-7, k
        assert_close(grads_g[k], g, "gpu_grads", f"full: {k}")
    gpu.set_gradient_checkpointing(True)       # the sinks' forward recomputed with its layer
    loss_c, grads_c = gpu.loss_and_grads(ids, labels, mask)
    assert loss_c == loss_g and all(np.array_equal(grads_c[k], grads_g[k]) for k in grads_g)
    est = wt.estimate_memory(gpu.config, *ids.shape, method="full", gradient_checkpointing=True)
    assert est["activations"] + est["logits"] == _allocated(gpu.engine._activations(*ids.shape, train=True))


def test_greedy_generation_matches_numpy(folder, rt):
    """Over the KV cache: the sinks in the cached passes, the sliding layers' window."""
    ref, gpu = _pair(folder, rt)
    prompt = [5, 17, 3, 40, 22, 8, 9]
    assert gpu.generate(prompt, max_new_tokens=10) == ref.generate(prompt, max_new_tokens=10)


def test_auto_backend_no_longer_sets_gpt_oss_aside(folder):
    assert "gpt-oss" not in choose_backend("auto", cfg=ModelConfig.from_folder(folder)).reason


def test_bfloat16_activations_and_experts_match_numpy(folder, rt):
    """--precision bf16 with bfloat16 weights: the sinks rescale a 16-bit attention output, the biases go onto
    16-bit gate / up projections; the same logits, loss and LoRA gradients within bfloat16 noise."""
    ref, gpu = _pair(folder, rt, precision="bf16", base_dtype="bfloat16")
    ids, labels, mask = _batch()
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], "bf16_gpu_logits", "gpt-oss")
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), "bf16_gpu_loss", "gpt-oss")
    for k, g in grads_r.items():
        top = np.abs(g).max()
        assert_close(grads_g[k] / top, g / top, "bf16_gpu_grads", f"gpt-oss: {k}")


def test_nf4_experts_match_numpy(folder, rt):
    """--base-dtype nf4 (the experts as the grouped GEMMs decode them, in the staged gate / up path): the same
    logits and LoRA gradients as the NumPy engine on the same NF4 weights."""
    ref, gpu = _pair(folder, rt, base_dtype="nf4")
    ids, labels, mask = _batch()
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], "gpu_logits", "gpt-oss nf4")
    _, grads_r = ref.loss_and_grads(ids, labels, mask)
    _, grads_g = gpu.loss_and_grads(ids, labels, mask)
    for k, g in grads_r.items():
        assert_close(grads_g[k], g, "gpu_grads", f"gpt-oss nf4: {k}")


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """A tiny gpt-oss whose experts are MXFP4 blocks and scales (intermediate 32: the blocks run along it in
    down_proj), config.json saying bfloat16 as the hub's does."""
    from test_gpt_oss import write_mxfp4_pair

    hf = build_gpt_oss(seed=5, **{**SIZES, "intermediate_size": 32})
    return write_mxfp4_pair(tmp_path_factory.mktemp("gpt_oss_mxfp4"), hf, dtype="bfloat16")[1]


def test_mxfp4_experts_match_numpy(mxfp4_folder, rt):
    """base_dtype auto keeps the experts packed on both engines (the grouped GEMMs decode the checkpoint's blocks
    and scales: the gate / up and down products, forward and the backward's input gradients): logits, loss, LoRA
    gradients and a step in one submission as the NumPy engine's, greedy generation token for token, the experts
    read back exactly, in one buffer of their packed size (memory.base_weight_bytes counts them by expert_bytes:
    test_gpt_oss_mxfp4.py)."""
    from wgpu_train.engines.shared.quant import StorageDtype
    from wgpu_train.engines.webgpu.tensors import expert_bytes

    ref, gpu = _pair(mxfp4_folder, rt, base_dtype="auto")
    assert gpu.engine._stored_as("model.layers.0.mlp.experts.gate_up_proj") == "mxfp4"
    ids, labels, mask = _batch()
    assert_engines_agree(ref, gpu, ids, labels, mask, ("experts.base_layer.lora_A", "experts.lora_B", "q_proj.lora_A"),
                         "gpt-oss mxfp4")
    prompt = [5, 17, 3, 40, 22, 8, 9]
    assert gpu.generate(prompt, max_new_tokens=6) == ref.generate(prompt, max_new_tokens=6)
    name = "model.layers.1.mlp.experts.down_proj"
    assert np.array_equal(gpu.engine.weights()[name], np.asarray(ref.engine.weights()[name]))
    packed = gpu.engine.w[name].size          # the one buffer the grouped GEMMs bind: blocks, then scales
    assert packed == 4 * 64 * 32 // 2 + 4 * 64 * 32 // 32 == expert_bytes(4 * 64 * 32, StorageDtype.MXFP4)


def test_mxfp4_experts_with_bfloat16_activations_match_numpy(mxfp4_folder, rt):
    """--precision bf16 over packed MXFP4 experts (16-bit x and out views beside the packed W in the grouped GEMMs):
    logits, loss and LoRA gradients within bfloat16 noise of the NumPy engine's."""
    ref, gpu = _pair(mxfp4_folder, rt, base_dtype="auto", precision="bf16")
    assert gpu.engine._stored_as("model.layers.1.mlp.experts.down_proj") == "mxfp4"
    ids, labels, mask = _batch()
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], "bf16_gpu_logits", "gpt-oss mxfp4")
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), "bf16_gpu_loss", "gpt-oss mxfp4")
    for k, g in grads_r.items():
        top = np.abs(g).max()
        assert_close(grads_g[k] / top, g / top, "bf16_gpu_grads", f"gpt-oss mxfp4: {k}")
