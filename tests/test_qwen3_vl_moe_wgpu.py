"""Qwen3-VL-MoE with images on the WebGPU engine against the NumPy engine (the oracle, itself checked against
transformers in test_qwen3_vl_moe.py): the grouped expert GEMMs beside M-RoPE positions and DeepStack on the device;
logits, one train step with LoRA on the attention and the experts and the router's aux loss, greedy generation
after it."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import require_adapter
from finetune_helpers import peft_random_b
from test_qwen3_vl_moe import ATTENTION, EXPERTS, vlm  # noqa: F401  (the tiny Qwen3-VL-MoE fixture)
from test_qwen3_vl import PAD, images, span
from tolerances import assert_close

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from wgpu_train.engines.protocol import OptimizerParams  # noqa: E402
from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402


def test_logits_and_train_step_with_images_equal_numpys(vlm):  # noqa: F811
    """The same PEFT adapter (q / k / v / o and the experts, B random) on both engines: logits of a padded batch of
    two rows with three images, then one train_step of two micro-batches with the aux loss at 0.01: the same loss,
    gradient norm and updated LoRA tensors; then the same greedy tokens for a prompt with two images."""
    require_adapter()
    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=ATTENTION, target_parameters=EXPERTS, lora_dropout=0.0)), 7)
    pm.save_pretrained(folder.parent / "wgpu_moe_adapter")
    cpu, gpu = load_vision_model(folder), load_vision_model(folder, backend="wgpu")
    assert gpu.model.backend == "wgpu" and gpu.model.config.moe.num_experts == 4
    for vm in (cpu, gpu):
        vm.model.load_adapter(folder.parent / "wgpu_moe_adapter")
    imgs = images(3, seed=3)
    rows = [[7, *span(cpu, imgs[0]), 11, 12, *span(cpu, imgs[1]), 13, 14], [8, 9, *span(cpu, imgs[2]), 15]]
    width = max(map(len, rows))
    ids = np.array([r + [0] * (width - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, imgs, mask)[real], cpu.logits(ids, imgs, mask)[real], "gpu_logits", "with images")
    targets = np.roll(np.where((ids != PAD) & real, ids, -100), -1, axis=1)
    targets[:, -1] = -100
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), ids.shape)
    out = []
    for vm in (cpu, gpu):
        mbs = [(vm._text_ids(ids[r:r + 1]).astype(np.int32), targets[r:r + 1], mask[r:r + 1].astype(np.int32),
                pos[r:r + 1], vm.image_tokens(ids[r:r + 1], imgs[:2] if r == 0 else imgs[2:])) for r in (0, 1)]
        vm.model.engine.set_router_aux_loss(0.01)
        loss, count, norm, applied = vm.model.engine.train_step(mbs, OptimizerParams(lr=1e-2), 1)
        assert applied
        out.append((loss, count, norm, vm.model.engine.lora_tensors()))
    (la, ca, na, wa), (lb, cb, nb, wb) = out
    assert ca == cb and set(wa) == set(wb) and any("experts" in p for p in wa)
    assert_close(np.float64(lb), la, "gpu_loss", "train_step loss")
    assert_close(np.float64(nb), na, "gpu_grads", "train_step norm")
    for path in wa:
        for a, b in zip(wa[path], wb[path]):
            assert_close(b, a, "gpu_grads", path)
    prompt = np.array([7, *span(cpu, imgs[0]), 8, *span(cpu, imgs[1]), 9])     # the updated adapters: same answers
    assert gpu.generate(prompt, imgs[:2], max_new_tokens=6) == cpu.generate(prompt, imgs[:2], max_new_tokens=6)
