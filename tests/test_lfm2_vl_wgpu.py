"""LFM2-VL with images on the WebGPU engine against the NumPy engine (the oracle, itself checked against
transformers in test_lfm2_vl.py): the SigLIP2 tower on the device (engines/webgpu/siglip2_tower.py: features and
LoRA gradients against the NumPy tower's, tiles of two shapes in one batch), the language model (short convolutions
and attention) on the device taking its image embeddings (with LoRA on it, its backward from the device's image-row
gradient); logits, loss, LoRA gradients and greedy generation; `finetune --backend wgpu` as --backend numpy."""
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
    assert gpu.model.backend == "wgpu" and gpu.device_tower is not None     # the tower on the device too
    assert_close(gpu.logits(ids, imgs, mask)[real], cpu.logits(ids, imgs, mask)[real], "gpu_logits", "with images")
    (la, ga), (lb, gb) = (vm.loss_and_grads(ids, labels, imgs, mask) for vm in (cpu, gpu))
    assert_close(np.float64(lb), la, "gpu_loss", "loss with images")
    assert set(ga) == set(gb) and any("vision_tower" in k for k in ga)
    for name in ga:
        assert_close(gb[name], ga[name], "gpu_grads", name)
    prompt = np.array(rows[0][:-2])
    assert gpu.generate(prompt, imgs[:1], max_new_tokens=6) == cpu.generate(prompt, imgs[:1], max_new_tokens=6)


def test_device_tower_features_and_lora_gradients_equal_numpys(pair, monkeypatch):
    """The device tower against the NumPy tower (float32 both) over a tiled image's 2 x 2 tiles, its thumbnail and a
    small image (tiles of several shapes in one batch): the frozen features (one submission; in chunks of tiles that
    fit a smaller binding; a binding too small for any tile: the NumPy tower), the features with LoRA, and the LoRA
    gradients of a random tokens' gradient of a loss's scale."""
    from wgpu_train.engines.webgpu import siglip2_tower

    _, gpu = pair
    device, tower = gpu.device_tower, gpu.tower
    pixels = gpu.pixel_values(sample_images(4, [(200, 170), (13, 11)]))
    sizes = [r * c for r, c in np.asarray(pixels[2]).tolist()]
    assert len(set(sizes)) >= 2
    lora, tower.lora = tower.lora, {}
    try:
        want, calls = tower(pixels), device.calls
        assert_close(device(pixels), want, "vision_tower_gpu", "frozen features")
        assert device.calls == calls + 1
        width = device.rt.max_binding // (4 * max(sizes))          # a chunk holds the largest tile's patches
        monkeypatch.setattr(siglip2_tower, "row_width", lambda vc: width)
        assert_close(device(pixels), want, "vision_tower_gpu", "frozen features in chunks")
        assert device.calls - calls - 1 > 1
        monkeypatch.setattr(siglip2_tower, "row_width", lambda vc: device.rt.max_binding)
        calls = device.calls
        assert_close(device(pixels), want, "vision_tower_gpu", "frozen features on the NumPy tower")
        assert device.calls == calls
        monkeypatch.undo()
    finally:
        tower.lora = lora
    got, cache = device.forward(pixels)
    want, want_cache = tower.forward(pixels)
    assert cache.get("device") and got.shape == want.shape == (tower.tokens(pixels[2]), tower.vc.text_hidden_size)
    assert_close(got, want, "vision_tower_gpu", "features with LoRA")
    dout = np.random.default_rng(0).standard_normal(want.shape).astype(np.float32) * 0.05
    grads, expected = device.backward(dout, cache), tower.backward(dout, want_cache)
    assert set(grads) == set(expected) and len(expected) == 2 * len(tower.lora)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def test_cli_finetune_with_tower_lora_on_wgpu_equals_numpy(vlm, tmp_path, capsys):  # noqa: F811
    """`finetune --data` of TRL's vision records on LFM2-VL with --backend wgpu, LoRA on the tower's encoder too
    (the device tower's forward and backward): each step's loss and the adapter after 2 steps equal the NumPy
    engine's run of the same records."""
    import json

    from test_gemma3_vision_training import write_vision_data
    from test_lfm2_vl import records
    from wgpu_train.cli.main import main
    from wgpu_train.formats.safetensors import read_safetensors

    require_adapter()
    _, folder, _ = vlm
    data = write_vision_data(tmp_path / "data", records())
    losses, adapters = [], []
    for backend in ("numpy", "wgpu"):
        out = tmp_path / backend
        assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", backend, "--max-steps",
                     "2", "--batch-size", "2", "--lr", "3e-3", "--lora-targets", "in_proj,q_proj,vision_tower",
                     "--no-progress", "--valid-split", "0", "--log-every", "1", "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert ("on the device" if backend == "wgpu" else "NumPy, on the CPU") in err
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                       if '"loss"' in line])
        adapters.append(read_safetensors(out / "adapter_model.safetensors"))
    assert len(losses[0]) == 2
    assert_close(np.array(losses[1]), np.array(losses[0]), "gpu_loss", "finetune losses")
    assert set(adapters[0]) == set(adapters[1]) and any("vision_tower" in k for k in adapters[0])
    for k, want in adapters[0].items():
        assert_close(adapters[1][k], want, "lfm2_tower_params_after_steps", k)
