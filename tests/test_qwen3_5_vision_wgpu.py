"""Qwen3.5 with images on the WebGPU engine against the NumPy engine (the oracle, itself checked against transformers
in test_qwen3_5_vision.py): the hybrid language model's Gated DeltaNet layers over the image tokens' embeddings and
its gated full attention's partial rotary by each pair's M-RoPE position; logits, loss, LoRA gradients (the
linear-attention projections too) and greedy generation through the recurrent state."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import require_adapter
from finetune_helpers import peft_random_b
from test_qwen3_5_vision import LINEAR, span, vlm  # noqa: F401,F811  (the tiny Qwen3.5 fixture)
from test_qwen3_vl import PAD, images
from tolerances import assert_close

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402


@pytest.fixture(scope="module")
def pair(vlm):  # noqa: F811
    """(NumPy VisionModel, WebGPU VisionModel) of the tiny Qwen3.5 with the same PEFT LoRA (random B)."""
    require_adapter()
    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=LINEAR, lora_dropout=0.0)))
    pm.save_pretrained(folder.parent / "wgpu_adapter")
    models = load_vision_model(folder), load_vision_model(folder, backend="wgpu")
    for vm in models:
        vm.model.load_adapter(folder.parent / "wgpu_adapter")
    return models


def test_logits_loss_and_gradients_equal_numpys(pair):
    """Two rows (two images, then one with right padding): logits, loss and every LoRA gradient equal the NumPy
    engine's; without the M-RoPE positions the device's logits would differ."""
    cpu, gpu = pair
    imgs = images(3, seed=3)
    rows = [[7, *span(cpu, imgs[0]), 11, 12, *span(cpu, imgs[1]), 13, 14], [8, 9, *span(cpu, imgs[2]), 15]]
    width = max(map(len, rows))
    ids = np.array([r + [0] * (width - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = np.where((ids != PAD) & (mask == 1), ids, -100)
    real = mask.astype(bool)
    want = cpu.logits(ids, imgs, mask)
    assert_close(gpu.logits(ids, imgs, mask)[real], want[real], "gpu_logits", "with images")
    (la, ga), (lb, gb) = (vm.loss_and_grads(ids, labels, imgs, mask) for vm in (cpu, gpu))
    assert_close(np.float64(lb), la, "gpu_loss", "loss with images")
    assert set(ga) == set(gb) and any("in_proj_qkv" in name for name in ga)
    for name in ga:
        assert_close(gb[name], ga[name], "gpu_grads", name)
    engine, tokens = gpu.model.engine, gpu.image_tokens(ids, imgs)
    engine.set_images(tokens.__class__(tokens.blocks, tokens.embeds))      # the same images at plain positions
    try:
        other = gpu.model.logits(gpu._text_ids(ids), mask)
    finally:
        engine.set_images(None)
    assert np.abs(other - want)[real].max() > 1e-3


def test_greedy_generation_equals_numpys(pair):
    """The prompt prefilled with its images (the Gated DeltaNet state over them), then each new token at its M-RoPE
    position: the NumPy engine's greedy tokens (which are transformers')."""
    cpu, gpu = pair
    imgs = images(2, seed=5)
    ids = np.array([7, *span(cpu, imgs[0]), 8, *span(cpu, imgs[1]), 9])
    want = cpu.generate(ids, imgs, max_new_tokens=8)
    assert gpu.generate(ids, imgs, max_new_tokens=8) == want


def test_tower_lora_gradients_beside_webgpu_equal_numpys(vlm):  # noqa: F811
    """LoRA on Qwen3.5's tower (no DeepStack: its gradient is the image rows' alone, which the WebGPU engine gives
    back) beside the language model's, the tower's forward and backward on the device: the loss and every gradient,
    the tower's too, equal the NumPy engine's; then a train_step with the tower inside the engine's step (one
    submission on WebGPU): its loss, norm and the tower's LoRA after it equal the NumPy engine's."""
    require_adapter()
    import wgpu_train
    from wgpu_train.data.batching import Example
    from wgpu_train.engines.protocol import OptimizerParams
    from wgpu_train.models.vision import tower_lora_key

    _, folder, _ = vlm
    cpu, gpu = load_vision_model(folder), load_vision_model(folder, backend="wgpu")
    rng = np.random.default_rng(11)
    tensors = {}
    for path in cpu.tower.modules()[::2]:
        out_f, in_f = cpu.tower.w[path + ".weight"].shape
        tensors[tower_lora_key(path, "A", cpu.vision)] = rng.uniform(-0.3, 0.3, (2, in_f)).astype(np.float32)
        tensors[tower_lora_key(path, "B", cpu.vision)] = (0.3 * rng.standard_normal((out_f, 2))).astype(np.float32)
    imgs = images(2, seed=3)
    ids = np.array([[7, *span(cpu, imgs[0]), 11, 12, *span(cpu, imgs[1]), 13, 14]])
    out = []
    for vm in (cpu, gpu):
        vm.set_tower_lora({k: v.copy() for k, v in tensors.items()}, 2.5)
        vm.model.add_lora(wgpu_train.LoraConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj")), seed=0)
        out.append(vm.loss_and_grads(ids, ids, imgs))
    (la, ga), (lb, gb) = out
    assert gpu.device_tower.calls == 1
    assert_close(np.float64(lb), la, "gpu_loss", "loss")
    assert set(ga) == set(gb) and sum(".visual." in k for k in ga) == len(tensors)
    for name in ga:
        assert_close(gb[name], ga[name], "gpu_grads", name)
    steps = [vm.train_step([[Example(ids[0], ids[0], images=imgs)]], OptimizerParams(lr=1e-2), 1) for vm in (cpu, gpu)]
    assert gpu.in_step and gpu.model.engine.last_step["submits"] == 1 and all(s[3] for s in steps)
    assert_close(np.float64(steps[1][0]), steps[0][0], "gpu_loss", "train_step loss")
    assert_close(np.float64(steps[1][2]), steps[0][2], "gpu_grads", "train_step norm")
    tc, tg = (vm.tower_trainable() for vm in (cpu, gpu))
    for name in tc:
        assert np.abs(tc[name] - tensors[tower_lora_key(*name.rsplit(".lora_", 1), cpu.vision)]).max() > 0, name
        assert_close(tg[name], tc[name], "gpu_params_after_steps_lr1e-2", name)
