"""The SigLIP vision tower and projector on the WebGPU engine (engines/webgpu/vision_tower.py) against the NumPy
tower (the oracle, itself checked against transformers in test_gemma3_vision.py / test_smolvlm.py): Gemma 3's
projector and SmolVLM's pixel shuffle, tiny configs (hidden 32, 2 layers, 28x28 images, patch 14 or 7); its ops
(LayerNorm with bias, gelu_tanh) against NumPy's."""
from __future__ import annotations

import json

import numpy as np
import pytest

from test_gemma3_vision import vlm  # noqa: F401  (the tiny Gemma 3 vision model fixture)
from test_gemma3_vision_training import chat_vlm  # noqa: F401  (the tiny chat vision model fixture)
from tolerances import assert_close

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.errors import DeviceError
from wgpu_train.engines.numpy.vision_tower import VisionTower, gelu_forward, layernorm_forward
from wgpu_train.engines.webgpu import vision_tower, vision_tower_ops
from wgpu_train.engines.webgpu.tuned.adapter_traits import min_workgroup
from wgpu_train.engines.webgpu.vision_tower import GpuVisionTower
from wgpu_train.models.vision import VisionConfig, tensor_shapes


def tiny(scale_factor=0, patch=14):
    """A tiny tower: hidden 32 (2 heads of 16), 2 layers, 28x28 images; Gemma 3's projector (4 tokens of a 4x4
    grid at patch 7) or SmolVLM's shuffle by scale_factor (2: a 2x2 grid to one token)."""
    m = 1 if scale_factor else 4
    return VisionConfig(hidden_size=32, intermediate_size=40, num_layers=2, num_heads=2, num_channels=3,
                        image_size=28, patch_size=patch, layer_norm_eps=1e-6, mm_tokens_per_image=m,
                        text_hidden_size=24, image_token_id=5, boi_token_id=6, eoi_token_id=7,
                        scale_factor=scale_factor)


def weights(vc, seed=0):
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 0.5) + (name.endswith("norm.weight")
                   or "layer_norm" in name and name.endswith(".weight"))).astype(np.float32)
            for name, shape in tensor_shapes(vc).items()}


@pytest.mark.parametrize("scale_factor, patch", [(0, 7), (2, 14)], ids=["gemma3", "smolvlm"])
def test_tower_equals_the_numpy_tower(rt, scale_factor, patch):
    vc = tiny(scale_factor, patch)
    w = weights(vc)
    pixels = np.random.default_rng(1).standard_normal((3, 3, 28, 28)).astype(np.float32)
    expected = VisionTower(vc, w)(pixels)
    got = GpuVisionTower(rt, vc, w)(pixels)
    assert got.shape == expected.shape == (3, vc.mm_tokens_per_image, vc.text_hidden_size)
    assert_close(got, expected, "vision_tower_gpu")
    assert_close(GpuVisionTower(rt, vc, w)(pixels[1:2]), expected[1:2], "vision_tower_gpu", "one image alone")


@pytest.mark.parametrize("scale_factor, patch", [(0, 7), (2, 14)], ids=["gemma3", "smolvlm"])
def test_lora_forward_and_backward_equal_the_numpy_towers(rt, scale_factor, patch):
    """LoRA on some of the encoder's linears (B random: every path carries gradient; ranks and scales differing by
    module, as rank / alpha patterns make them): the embeddings and the LoRA gradients from a random embeddings'
    gradient equal the NumPy tower's forward and backward."""
    vc = tiny(scale_factor, patch)
    w = weights(vc, seed=4)
    rng = np.random.default_rng(6)
    cpu = VisionTower(vc, w)
    for k, path in enumerate(cpu.modules()[::2] + [cpu.modules()[-1]]):   # q, v, fc1 of each layer, the last fc2
        out_f, in_f = w[path + ".weight"].shape
        r = 2 + k % 3
        cpu.lora[path] = (rng.uniform(-0.3, 0.3, (r, in_f)).astype(np.float32),
                          rng.standard_normal((out_f, r)).astype(np.float32) * 0.3, 2.5 - 0.2 * k)
    pixels = rng.standard_normal((2, 3, 28, 28)).astype(np.float32)
    want, _ = cpu.forward(pixels)
    dout = rng.standard_normal(want.shape).astype(np.float32)
    exact = VisionTower(vc, w, np.float64)          # the gradients' oracle: float64, so the error is the GPU's
    exact.lora = {p: (a.astype(np.float64), b.astype(np.float64), s) for p, (a, b, s) in cpu.lora.items()}
    want_grads = exact.backward(dout.astype(np.float64), exact.forward(pixels.astype(np.float64))[1])
    gpu = GpuVisionTower(rt, vc, w)
    got, gcache = gpu.forward(pixels, cpu.lora)
    assert_close(got, want, "vision_tower_gpu", "with LoRA")
    got_grads = gpu.backward(dout, gcache)
    assert set(got_grads) == set(want_grads) and len(want_grads) == 2 * 7
    for name, g in want_grads.items():      # in units of the tensor's largest element
        top = np.abs(g).max()
        assert_close(got_grads[name] / top, g / top, "vision_tower_gpu_grads", name)
    assert_close(gpu(pixels), want, "vision_tower_gpu", "a call takes the LoRA set")
    gpu.set_lora({})
    assert_close(gpu(pixels), VisionTower(vc, w)(pixels), "vision_tower_gpu", "frozen again: no LoRA")
    with pytest.raises(ValueError, match="last forward with LoRA"):     # its buffers now hold the frozen call's
        gpu.backward(dout, gcache)
    rt.max_binding, binding = 4 * vision_tower.image_elements(vc), rt.max_binding     # one image's, no more
    try:
        with pytest.raises(DeviceError, match="2 images at once.*fewer images per micro-batch"):
            gpu.forward(pixels, cpu.lora)
    finally:
        rt.max_binding = binding


def test_images_in_chunks_equal_one_batch(rt, monkeypatch):
    """A scratch budget of two images' activations: three images go in two chunks (two submissions), the same
    embeddings as the NumPy tower's."""
    vc = tiny(0, 7)
    w = weights(vc, seed=3)
    pixels = np.random.default_rng(5).standard_normal((3, 3, 28, 28)).astype(np.float32)
    monkeypatch.setattr(vision_tower, "SCRATCH_BYTES", 2 * 4 * vision_tower.scratch_elements(vc))
    tower, sizes = GpuVisionTower(rt, vc, w), []
    forward = tower._submit_forward
    monkeypatch.setattr(tower, "_submit_forward", lambda px, keep: sizes.append(len(px)) or forward(px, keep))
    assert_close(tower(pixels), VisionTower(vc, w)(pixels), "vision_tower_gpu", "in chunks")
    assert sizes == [2, 1]


@pytest.mark.parametrize("c", [24, 300])
@pytest.mark.parametrize("layout", ["row", "workgroup"])
def test_layernorm_and_gelu_equal_numpy(rt, c, layout, monkeypatch):
    """LayerNorm with bias (the row-per-invocation entry, and the workgroup-per-row one: rmsnorm's row threshold
    set to 0) and gelu_tanh against NumPy's."""
    if layout == "workgroup":
        monkeypatch.setattr(vision_tower_ops, "rms_row_max_c", lambda rt: 0)
    rng = np.random.default_rng(2)
    n = 5
    x = (rng.standard_normal((n, c)) * 3 + 1).astype(np.float32)
    w, b = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    bufs = [rt.upload(a.reshape(-1)) for a in (x, w, b)]
    y, g = rt.buffer(x.nbytes), rt.buffer(x.nbytes)
    rec = rt.recorder()
    vision_tower_ops.layernorm_forward(rec, y, bufs[0], bufs[1], bufs[2], n, c, 1e-6)
    vision_tower_ops.gelu_forward(rec, g, bufs[0], n * c - 1)      # an odd count: the last element alone
    rec.submit()
    assert_close(rt.read(y, np.float32, (n, c)), layernorm_forward(x, w, b, 1e-6)[0], "vision_tower_gpu")
    assert_close(rt.read(g, np.float32, (n * c,))[:-1], gelu_forward(x.reshape(-1)[:-1]), "vision_tower_gpu")


def test_finetune_losses_equal_the_cpu_towers(chat_vlm, tmp_path, default_rt, monkeypatch):
    """finetune on the WebGPU engine with images: the frozen tower on the device (it runs, for every batch) gives the
    losses and the adapter of the same run with the tower on the CPU."""
    from test_gemma3_vision_training import vision_records, write_vision_data

    import wgpu_train
    from wgpu_train.engines import vision_model
    from wgpu_train.formats.safetensors import read_safetensors

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    calls = []
    monkeypatch.setattr(GpuVisionTower, "record_forward", lambda self, *a, f=GpuVisionTower.record_forward, **kw:
                        calls.append(1) or f(self, *a, **kw))
    runs = {}
    for where in ("device", "cpu"):
        if where == "cpu":
            monkeypatch.setattr(vision_model, "runs_on_device", lambda rt, vc: False)
        out = tmp_path / where
        summary = wgpu_train.finetune(model=str(folder), data=str(data), out=str(out), backend="wgpu",
                                      device=str(default_rt.info.index), max_steps=3, batch_size=2, lr=1e-2,
                                      lora_targets=("q_proj", "v_proj"), no_progress=True, valid_split=0.0,
                                      log_every=1)
        assert summary["steps"] == 3
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[where] = ([r["loss"] for r in rows if "loss" in r and "split" not in r],
                       read_safetensors(out / "adapter_model.safetensors"))
        if where == "device":
            assert calls, "the device tower ran"
            calls.clear()
    assert not calls, "the CPU run kept off the device tower"
    (loss_d, ad_d), (loss_c, ad_c) = runs["device"], runs["cpu"]
    assert len(loss_d) == 3 and set(ad_d) == set(ad_c)
    assert_close(np.array(loss_d), np.array(loss_c), "loss_f32", "losses with the tower on the device")
    for name in ad_c:
        assert_close(ad_d[name], ad_c[name], "gpu_params_after_steps_lr1e-2", name)


def test_tower_lora_gradients_on_webgpu_equal_numpys(vlm, default_rt, monkeypatch):
    """LoRA on the tower's encoder with the language model on WebGPU: the tower's backward runs on the device, and
    the loss and every LoRA gradient (the tower's and the language model's) equal the NumPy engine's."""
    from test_gemma3_vision import IMG, two_image_batch

    from wgpu_train.engines.vision_model import load_vision_model
    from wgpu_train.models.vision import tower_lora_key

    _, folder, _ = vlm
    cpu, gpu = load_vision_model(folder), load_vision_model(folder, backend="wgpu",
                                                            device=str(default_rt.info.index))
    assert gpu.device_tower is not None and cpu.device_tower is None
    rng = np.random.default_rng(7)
    tensors = {}
    for path in cpu.tower.modules()[1::3]:      # k_proj, fc1 of each layer
        out_f, in_f = cpu.tower.w[path + ".weight"].shape
        tensors[tower_lora_key(path, "A", cpu.vision)] = rng.uniform(-0.3, 0.3, (2, in_f)).astype(np.float32)
        tensors[tower_lora_key(path, "B", cpu.vision)] = rng.standard_normal((out_f, 2)).astype(np.float32)
    ids, mask, _ = two_image_batch()
    labels = np.where((mask == 1) & (ids != IMG), ids, -100)
    pixels = np.random.default_rng(8).standard_normal((3, 3, cpu.vision.image_size, cpu.vision.image_size))
    calls = []
    monkeypatch.setattr(GpuVisionTower, "backward", lambda self, d, c, f=GpuVisionTower.backward: calls.append(1)
                        or f(self, d, c))
    got = {}
    for name, vm in (("numpy", cpu), ("wgpu", gpu)):
        vm.set_tower_lora(tensors, 2.5)
        vm.model.add_lora(LoraConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"]), seed=0)
        got[name] = vm.loss_and_grads(ids, labels, pixels.astype(np.float32), attention_mask=mask)
    (loss_c, grads_c), (loss_g, grads_g) = got["numpy"], got["wgpu"]
    assert calls == [1], "the WebGPU run's tower backward ran on the device, once"
    assert_close(np.float64(loss_g), np.float64(loss_c), "gpu_loss", "with LoRA on the tower")
    assert set(grads_g) == set(grads_c) and sum("vision_tower" in k for k in grads_c) == 2 * 4
    for name, g in grads_c.items():
        assert_close(grads_g[name], g, "gpu_grads", name)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
def test_tower_lora_train_step_on_webgpu_equals_numpys(vlm, default_rt, checkpointing):
    """VisionModel.train_step with LoRA on the tower and the language model on WebGPU (the engine's train_step, the
    tower's forward and backward recorded into its one submission, its LoRA in the engine's optimizer): each step's
    loss, count and norm, and both adapters after 2 steps (the second through a data-parallel `reduce`), equal the
    NumPy engine's, with the WebGPU engine's gradient checkpointing too."""
    from test_gemma3_vision import IMG, two_image_batch

    from wgpu_train.data.batching import Example
    from wgpu_train.engines.protocol import OptimizerParams
    from wgpu_train.engines.vision_model import load_vision_model
    from wgpu_train.models.vision import tower_lora_key

    _, folder, _ = vlm
    cpu, gpu = load_vision_model(folder), load_vision_model(folder, backend="wgpu",
                                                            device=str(default_rt.info.index))
    gpu.model.engine.set_gradient_checkpointing(checkpointing)
    rng = np.random.default_rng(11)
    tensors = {}
    for path in cpu.tower.modules()[::2]:
        out_f, in_f = cpu.tower.w[path + ".weight"].shape
        tensors[tower_lora_key(path, "A", cpu.vision)] = rng.uniform(-0.3, 0.3, (2, in_f)).astype(np.float32)
        tensors[tower_lora_key(path, "B", cpu.vision)] = (0.3 * rng.standard_normal((out_f, 2))).astype(np.float32)
    ids, mask, _ = two_image_batch()
    labels = np.where((mask == 1) & (ids != IMG), ids, -100)
    px = np.random.default_rng(12).standard_normal((3, 3, cpu.vision.image_size, cpu.vision.image_size))
    px = px.astype(np.float32)
    n = int(mask[1].sum())
    micro = [[Example(ids[0], labels[0], images=list(px[:2]))], [Example(ids[1, :n], labels[1, :n], images=[px[2]])]]
    hp = OptimizerParams(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)
    got = {}
    for name, vm in (("numpy", cpu), ("wgpu", gpu)):
        vm.set_tower_lora({k: v.copy() for k, v in tensors.items()}, 2.5)     # AdamW updates the arrays it takes
        vm.model.add_lora(LoraConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"]), seed=0)
        reduced = []
        if name == "wgpu":      # the adapter's one-time GEMM probe (its own submissions) before the counted step
            min_workgroup(vm.model.engine.rt)
        steps = [vm.train_step(micro, hp, 1)]
        if name == "wgpu":      # the tower's forwards and backwards inside the engine's step: one submission
            assert vm.model.engine.last_step["submits"] == 1 and vm.model.engine.last_step["readbacks"] == 1
        steps.append(vm.train_step(micro, hp, 2, reduce=lambda flat, total: reduced.append((flat.size, total)) or flat))
        n_lm = sum(a.size + b.size for a, b in vm.model.engine.lora_tensors().values())
        n_tower = sum(t.size for t in vm.tower_trainable().values())
        assert reduced == [(n_lm + n_tower, steps[1][1])], "both LoRAs' gradients went through reduce, in one call"
        got[name] = steps, {k: v.copy() for k, v in vm.tower_trainable().items()}, vm.model.lora_state_dict()
    (steps_c, tower_c, lm_c), (steps_g, tower_g, lm_g) = got["numpy"], got["wgpu"]
    for (loss_c, count_c, norm_c, applied_c), (loss_g, count_g, norm_g, applied_g) in zip(steps_c, steps_g):
        assert applied_c and applied_g and count_g == count_c
        assert_close(np.float64(loss_g), np.float64(loss_c), "gpu_loss", "loss sum")
        assert_close(np.float64(norm_g), np.float64(norm_c), "gpu_loss", "grad norm")
        assert norm_c > hp.max_grad_norm, "the norm clips: the clip scale is exercised"
    assert set(tower_g) == set(tower_c) and set(lm_g) == set(lm_c)
    for name, t in {**tower_c, **lm_c}.items():
        ours = tower_g[name] if name in tower_g else lm_g[name]
        assert_close(ours, t, "gpu_params_after_steps_lr1e-2", name)
    assert any(np.abs(lm_c[k]).max() > 1e-3 for k in lm_c if "lora_B" in k), "the language model's LoRA trained"


def test_finetune_tower_lora_on_webgpu_equals_numpy(chat_vlm, tmp_path, default_rt, capsys):
    """finetune --lora-targets q_proj,v_proj,vision_tower --backend wgpu on the tiny Gemma 3 vision model: the
    losses and the adapter (the tower's LoRA and the language model's, with per-module ranks from
    --lora-rank-pattern and OLoRA's residual base, converted on save) after 3 steps equal --backend numpy's; a
    WebGPU run stopped after 1 step and resumed from its checkpoint gives the uninterrupted one's adapter."""
    from test_gemma3_vision_training import vision_records, write_vision_data

    from wgpu_train.cli.main import main
    from wgpu_train.formats.safetensors import read_safetensors

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    runs = {}

    def finetune(backend, out, steps, *more):
        device = ["--device", str(default_rt.info.index)] if backend == "wgpu" else []
        assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", backend, *device,
                     "--max-steps", str(steps), "--batch-size", "2", "--lr", "1e-2", "--lora-targets",
                     "q_proj,v_proj,vision_tower", "--lora-rank-pattern", "fc1=4,out_proj=2",
                     "--lora-init", "olora",
                     "--no-progress", "--valid-split", "0", "--log-every", "1", "--out", str(out), *more]) == 0
    for backend in ("numpy", "wgpu"):
        out = tmp_path / backend
        finetune(backend, out, 3)
        where = "on the device" if backend == "wgpu" else "NumPy, on the CPU"
        assert f"trainable parameters ({where})" in capsys.readouterr().err
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[backend] = ([r["loss"] for r in rows if "loss" in r and "split" not in r],
                         read_safetensors(out / "adapter_model.safetensors"))
    (loss_c, ad_c), (loss_g, ad_g) = runs["numpy"], runs["wgpu"]
    assert len(loss_g) == 3 and set(ad_g) == set(ad_c) and sum(".vision_tower." in k for k in ad_c) == 2 * 2 * 6
    assert {ad_c[k].shape[0] for k in ad_c if "fc1.lora_A" in k} == {8} and {
        ad_c[k].shape[0] for k in ad_c if "q_proj.lora_A" in k} == {16}      # fc1's from the pattern; 2r converted
    assert_close(np.array(loss_g), np.array(loss_c), "loss_f32", "losses")
    for name in ad_c:
        assert_close(ad_g[name], ad_c[name], "gpu_params_after_steps_lr1e-2", name)
    assert all(np.abs(ad_c[k]).max() > 0 for k in ad_c if ".vision_tower." in k and "lora_B" in k)
    finetune("wgpu", tmp_path / "part", 1)
    finetune("wgpu", tmp_path / "part", 3, "--resume", str(tmp_path / "part"))
    part = read_safetensors(tmp_path / "part" / "adapter_model.safetensors")
    for name in ad_g:
        np.testing.assert_array_equal(part[name], ad_g[name], err_msg=name)
