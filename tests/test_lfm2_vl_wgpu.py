"""LFM2-VL with images on the WebGPU engine against the NumPy engine (the oracle, itself checked against
transformers in test_lfm2_vl.py): the language model (short convolutions and attention) on the device takes the
image embeddings of the NumPy SigLIP2 tower (with LoRA on it, its backward from the device's image-row gradient);
logits, loss, LoRA gradients and greedy generation."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import require_adapter
from finetune_helpers import peft_random_b
from test_lfm2_vl import IMAGE, sample_images, spans, vlm  # noqa: F401  (the tiny LFM2-VL fixture)
from tolerances import assert_close

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402


@pytest.fixture(scope="module")
def pair(vlm):  # noqa: F811
    """(NumPy VisionModel, WebGPU VisionModel) of the tiny LFM2-VL with the same PEFT LoRA (random B) on the
    convolutions' in_proj, q_proj and w2, and on the tower encoder's q_proj and fc2 (the tower's LoRA on the CPU)."""
    require_adapter()
    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(in_proj|q_proj|w2)|.*vision_tower.*\.(q_proj|fc2)",
        lora_dropout=0.0)))
    pm.save_pretrained(folder.parent / "wgpu_lfm2_vl_adapter")
    models = load_vision_model(folder), load_vision_model(folder, backend="wgpu")
    for vm in models:
        vm.load_adapter(folder.parent / "wgpu_lfm2_vl_adapter")
    return models


def test_logits_loss_gradients_and_generation_equal_numpys(pair, spans):  # noqa: F811
    """Two rows (a tiled image and a small one; one right-padded): logits, loss and every LoRA gradient on the
    device equal the NumPy engine's (the tower's LoRA gradients from the device's image-row gradient too); greedy
    tokens after a prompt with an image too."""
    cpu, gpu = pair
    imgs = sample_images(3, [(64, 128), (13, 11)])
    rows = [[7, *spans(imgs[0]), 11, 12, 13], [8, 9, *spans(imgs[1]), 15]]
    width = max(map(len, rows))
    ids = np.array([r + [0] * (width - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = np.where((ids != IMAGE) & (mask == 1), ids, -100)
    real = mask.astype(bool)
    assert gpu.model.backend == "wgpu" and gpu.device_tower is None     # the tower stays on the CPU
    assert_close(gpu.logits(ids, imgs, mask)[real], cpu.logits(ids, imgs, mask)[real], "gpu_logits", "with images")
    (la, ga), (lb, gb) = (vm.loss_and_grads(ids, labels, imgs, mask) for vm in (cpu, gpu))
    assert_close(np.float64(lb), la, "gpu_loss", "loss with images")
    assert set(ga) == set(gb) and any("vision_tower" in k for k in ga)
    for name in ga:
        assert_close(gb[name], ga[name], "gpu_grads", name)
    prompt = np.array(rows[0][:-2])
    assert gpu.generate(prompt, imgs[:1], max_new_tokens=6) == cpu.generate(prompt, imgs[:1], max_new_tokens=6)
