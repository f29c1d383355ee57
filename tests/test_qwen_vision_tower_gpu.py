"""Qwen3-VL's and Qwen3.5's vision tower on the WebGPU engine (engines/webgpu/qwen_vision_tower.py) against the NumPy
tower (the oracle, itself checked against transformers in test_qwen3_vl.py / test_qwen3_5_vision.py) on their tiny
models: merged and DeepStack features, images in chunks and one refused to the NumPy tower; the erf GELU entry; the
tower's LoRA forward and its gradients."""
from __future__ import annotations

import numpy as np
import pytest

import test_qwen3_5_vision as q35
from test_qwen3_vl import images, span, vlm  # noqa: F401  (the tiny Qwen3-VL fixture)
from tolerances import assert_close

from wgpu_train.engines.numpy.qwen3_vl_tower import gelu_erf_backward, gelu_erf_forward
from wgpu_train.engines.vision_model import load_vision_model
from wgpu_train.engines.webgpu import qwen_vision_tower, vision_tower_ops
from wgpu_train.engines.webgpu.qwen_vision_tower import GpuQwenTower


@pytest.fixture(scope="module")
def vlm35(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_tower_gpu")
    q35.build(folder)
    return load_vision_model(folder)


def test_erf_gelu_equals_numpy(rt):
    """gelu_forward / gelu_backward with erf against the NumPy tower's exact GELU (an odd count: the last alone),
    and not the tanh GELU's values."""
    rng = np.random.default_rng(3)
    n = 301
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    dy = rng.standard_normal(n).astype(np.float32)
    xb, dyb = rt.upload(x), rt.upload(dy)
    y, dx = rt.buffer(x.nbytes), rt.buffer(x.nbytes)
    rec = rt.recorder()
    vision_tower_ops.gelu_forward(rec, y, xb, n, erf=True)
    vision_tower_ops.gelu_backward(rec, dx, dyb, xb, n, erf=True)
    rec.submit()
    got = rt.read(y, np.float32, (n,))
    assert_close(got, gelu_erf_forward(x), "qwen_tower_gpu")
    assert_close(rt.read(dx, np.float32, (n,)), gelu_erf_backward(dy, x), "qwen_tower_gpu")
    rec = rt.recorder()
    vision_tower_ops.gelu_forward(rec, y, xb, n)
    rec.submit()
    assert np.abs(rt.read(y, np.float32, (n,)) - got).max() > 1e-4


def check(vm, n_images, rt):
    pixels, grids = vm.pixel_values(images(n_images))
    tower = GpuQwenTower(rt, vm.tower)
    got, deepstack = tower(pixels, grids)
    want, want_deepstack = vm.tower(pixels, grids)
    assert_close(got, want, "qwen_tower_gpu", "merged features")
    assert len(deepstack) == len(want_deepstack)
    for a, b in zip(deepstack, want_deepstack):
        assert_close(a, b, "qwen_tower_gpu", "DeepStack features")
    return tower, pixels, grids, want


def test_qwen3_vl_features_equal_numpys(vlm, rt):  # noqa: F811
    """Three images of three sizes (attention within each, the 2-D rotary, the resampled positions): the merged
    and both DeepStack features (mergers out of block order) equal the NumPy tower's."""
    check(vlm[2], 3, rt)


def test_qwen3_5_features_equal_numpys(vlm35, rt):
    """Qwen3.5's tower (no DeepStack): the merged features equal the NumPy tower's."""
    check(vlm35, 2, rt)


def test_chunks_and_an_image_too_big_for_a_binding(vlm, rt, monkeypatch):  # noqa: F811
    """A binding that holds the first image's patches (48): it alone, then the other two (24 each) together, two
    submissions; then one too small for any:
    the NumPy tower runs them (no device forward), the features the same."""
    vm = vlm[2]
    pixels, grids = vm.pixel_values(images(3))
    first = int(np.prod(grids[0]))
    width = rt.max_binding // (4 * first)
    monkeypatch.setattr(qwen_vision_tower, "row_width", lambda tower: width)
    tower = GpuQwenTower(rt, vm.tower)
    want = vm.tower(pixels, grids)
    got = tower(pixels, grids)
    assert [int(np.prod(g)) for g in grids] == [48, 24, 24] and tower.calls == 2
    assert_close(got[0], want[0], "qwen_tower_gpu", "in chunks")
    for a, b in zip(got[1], want[1]):
        assert_close(a, b, "qwen_tower_gpu", "DeepStack in chunks")
    monkeypatch.setattr(qwen_vision_tower, "row_width", lambda tower: rt.max_binding)
    tower.calls = 0
    got = tower(pixels, grids)
    assert tower.calls == 0
    assert_close(got[0], want[0], "qwen_tower_gpu", "on the NumPy tower")


def test_attach_vision_runs_the_tower_on_the_device(vlm):  # noqa: F811
    """A WebGPU Qwen3-VL loads with the device tower, which runs (its counter) for logits with two images; they
    equal the NumPy tower's run on the same language model; with LoRA on the tower too."""
    _, folder, _ = vlm
    vm = load_vision_model(folder, backend="wgpu")
    assert isinstance(vm.device_tower, GpuQwenTower)
    imgs = images(2)
    ids = np.array([[7, 8, *span(vm, imgs[0]), 9, *span(vm, imgs[1]), 11, 12]])
    got = vm.logits(ids, imgs)
    assert vm.device_tower.calls == 1
    device, vm.device_tower = vm.device_tower, None
    assert_close(got, vm.logits(ids, imgs), "qwen_tower_gpu", "logits, device tower against the NumPy tower")
    vm.device_tower = device
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 32)).astype(np.float32), rng.standard_normal((96, 2)).astype(np.float32)
    vm.set_tower_lora({"base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight": a,
                       "base_model.model.model.visual.blocks.0.attn.qkv.lora_B.weight": b}, 1.0)
    lora = vm.logits(ids, imgs)
    assert vm.device_tower is device and device.calls == 2 and np.abs(lora - got).max() > 1e-3
    vm.device_tower = None
    assert_close(lora, vm.logits(ids, imgs), "qwen_tower_gpu", "logits with tower LoRA, device against NumPy tower")


def test_lora_forward_and_gradients_equal_numpys(vlm, rt, monkeypatch):  # noqa: F811
    """LoRA (random A and B) on every block's and merger's linear: the device forward's features and its
    backward's LoRA gradients (from the merged and both DeepStack features' gradients) equal the NumPy tower's; a
    second forward and backward reuse the buffers (none allocated), and __call__ takes the LoRA too; images over a
    binding run on the NumPy tower (its cache)."""
    from wgpu_train.engines.numpy.qwen3_vl_tower import Qwen3VLTower

    vm = vlm[2]
    tower = Qwen3VLTower(vm.tower.vc, vm.tower.w)
    rng = np.random.default_rng(5)
    for path in tower.modules():
        out_f, in_f = tower.w[path + ".weight"].shape
        tower.lora[path] = (rng.standard_normal((2, in_f)).astype(np.float32) * 0.2,
                            rng.standard_normal((out_f, 2)).astype(np.float32) * 0.2, 2.5)
    pixels, grids = vm.pixel_values(images(3))
    gpu = GpuQwenTower(rt, tower)
    gpu.set_lora(tower.lora)        # packed on the device (the engine's optimizer's order)
    for run in range(2):
        got = gpu.forward(pixels, grids)
        want = tower.forward(pixels, grids)
        assert_close(got[0], want[0], "qwen_tower_gpu", "merged features with LoRA")
        for a, b in zip(got[1], want[1]):
            assert_close(a, b, "qwen_tower_gpu", "DeepStack features with LoRA")
        # the features' gradients of a loss's scale: the LoRA gradients' largest entries 0.03..0.2, as grads_f32's
        dout = rng.standard_normal(want[0].shape).astype(np.float32) * 1e-3
        ddeep = [rng.standard_normal(d.shape).astype(np.float32) * 1e-3 for d in want[1]]
        grads, expected = gpu.backward(dout, ddeep, got[2]), tower.backward(dout, ddeep, want[2])
        assert set(grads) == set(expected) and len(expected) == 2 * len(tower.modules())
        for name, g in expected.items():
            assert_close(grads[name], g, "grads_f32", name)
        if run == 0:
            kept = {name: b for name, (b, _) in gpu._scratch.items()}
    assert {name: b for name, (b, _) in gpu._scratch.items()} == kept
    called = gpu(pixels, grids)
    assert_close(called[0], want[0], "qwen_tower_gpu", "__call__ with LoRA")
    monkeypatch.setattr(qwen_vision_tower, "row_width", lambda tower: rt.max_binding)
    calls = gpu.calls
    merged, _, cache = gpu.forward(pixels, grids)
    assert gpu.calls == calls and "device" not in cache and "blocks" in cache
    np.testing.assert_array_equal(merged, want[0])
