"""Qwen3-VL with images on the WebGPU engine against the NumPy engine (the oracle, itself checked against
transformers in test_qwen3_vl.py): RoPE by each pair's M-RoPE position and the DeepStack features added on the
device; logits, loss, LoRA gradients, a train step in one submission, greedy generation (each new token at its
M-RoPE position, through DecodeBatch too), `generate --image --backend wgpu` and logits with a video."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from conftest import require_adapter
from finetune_helpers import peft_random_b
from test_qwen3_vl import PAD, hf_inputs, images, span, vlm  # noqa: F401  (the tiny Qwen3-VL fixture)
from tolerances import assert_close

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from wgpu_train.engines.protocol import OptimizerParams  # noqa: E402
from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402
from wgpu_train.models.vision import tower_lora_key  # noqa: E402


@pytest.fixture(scope="module")
def pair(vlm):  # noqa: F811
    """(NumPy VisionModel, WebGPU VisionModel) of the tiny Qwen3-VL with the same PEFT LoRA (random B) on q, v
    and down, and the folder."""
    require_adapter()
    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", lora_dropout=0.0)))
    pm.save_pretrained(folder.parent / "wgpu_adapter")
    models = load_vision_model(folder), load_vision_model(folder, backend="wgpu")
    for vm in models:
        vm.model.load_adapter(folder.parent / "wgpu_adapter")
    return (*models, folder)


def batch(vm):
    """(ids, mask, labels, images): row 0 with two images, row 1 with one and right padding."""
    imgs = images(3, seed=3)
    rows = [[7, *span(vm, imgs[0]), 11, 12, *span(vm, imgs[1]), 13, 14], [8, 9, *span(vm, imgs[2]), 15]]
    width = max(map(len, rows))
    ids = np.array([r + [0] * (width - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask, np.where((ids != PAD) & (mask == 1), ids, -100), imgs


def test_logits_loss_and_gradients_equal_numpys(pair):
    """M-RoPE positions per rotated pair and DeepStack on the first two layers, forward and backward on the
    device: logits, loss, every LoRA gradient, the image rows' and the DeepStack features' gradients (read back when
    asked) equal the NumPy engine's; without the positions or the features
    the logits would differ."""
    cpu, gpu, _ = pair
    ids, mask, labels, imgs = batch(cpu)
    real = mask.astype(bool)
    want = cpu.logits(ids, imgs, mask)
    assert_close(gpu.logits(ids, imgs, mask)[real], want[real], "gpu_logits", "with images")
    (la, ga), (lb, gb) = (vm.loss_and_grads(ids, labels, imgs, mask) for vm in (cpu, gpu))
    assert_close(np.float64(lb), la, "gpu_loss", "loss with images")
    assert set(ga) == set(gb) and ga
    for name in ga:
        assert_close(gb[name], ga[name], "gpu_grads", name)
    deep, got = cpu.model.engine.deepstack_grad, gpu.model.engine.deepstack_grad     # read back when asked
    assert sorted(got) == sorted(deep) == [0, 1] and np.abs(deep[0]).max() > 0
    for k in deep:
        assert_close(got[k], deep[k], "gpu_grads", f"DeepStack features' gradient {k}")
    assert_close(gpu.model.engine.image_grad, cpu.model.engine.image_grad, "gpu_grads", "image_grad")
    tokens, engine = gpu.image_tokens(ids, imgs), gpu.model.engine
    for broken in ({"positions": None}, {"deepstack": ()}):
        engine.set_images(dataclasses.replace(tokens, **broken))
        try:
            other = gpu.model.logits(gpu._text_ids(ids), mask)
        finally:
            engine.set_images(None)
        assert np.abs(other - want)[real].max() > 1e-3


def test_tower_lora_gradients_equal_numpys(pair):
    """LoRA (random B) on every block's and merger's linear of the tower beside the language model's: the device
    tower's forward, the engine's image rows' and DeepStack features' gradients, the device tower's backward: the
    loss and every gradient, the tower's included, equal the NumPy engine's and tower's."""
    cpu, gpu, _ = pair
    ids, mask, labels, imgs = batch(cpu)
    rng = np.random.default_rng(11)
    tensors = {}
    for path in cpu.tower.modules():
        out_f, in_f = cpu.tower.w[path + ".weight"].shape
        for w, shape in (("A", (2, in_f)), ("B", (out_f, 2))):
            tensors[tower_lora_key(path, w, cpu.vision)] = rng.standard_normal(shape).astype(np.float32) * 0.1
    try:
        for vm in (cpu, gpu):
            vm.set_tower_lora(tensors, 2.5)
        (la, ga), (lb, gb) = (vm.loss_and_grads(ids, labels, imgs, mask) for vm in (cpu, gpu))
        assert gpu.device_tower.calls and sum(".visual." in k for k in ga) == 2 * len(cpu.tower.modules())
    finally:
        for vm in (cpu, gpu):
            vm.tower.lora = {}
    assert_close(np.float64(lb), la, "gpu_loss", "loss with tower LoRA")
    assert set(ga) == set(gb)
    for name in ga:
        assert_close(gb[name], ga[name], "gpu_grads", name)


def test_train_step_with_images_equals_numpys(pair):
    """Two micro-batches, each with its own images, in one train_step (gradient checkpointing on the device: the
    recomputed layers keep the DeepStack sums): the same loss, norm and updated LoRA as the NumPy engine's step,
    in one submission."""
    cpu, gpu, _ = pair
    ids, mask, labels, imgs = batch(cpu)
    targets = np.roll(labels, -1, axis=1)
    targets[:, -1] = -100
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    hp = OptimizerParams(lr=1e-2)
    out = []
    for vm in (cpu, gpu):
        mbs = [(vm._text_ids(ids[r:r + 1]).astype(np.int32), targets[r:r + 1], mask[r:r + 1].astype(np.int32),
                pos[r:r + 1], vm.image_tokens(ids[r:r + 1], imgs[:2] if r == 0 else imgs[2:])) for r in (0, 1)]
        engine = vm.model.engine
        if vm is gpu:
            engine.set_gradient_checkpointing(True)
        try:
            loss, count, norm, applied = engine.train_step(mbs, hp, 1)
            assert applied
            out.append((loss, count, norm, engine.lora_tensors()))
            engine.train_step(mbs, hp, 2)      # (both engines: the tests after this one compare them)
            if vm is gpu:       # the second step, its kernels tuned by the first: one submission
                assert engine.last_step["submits"] == 1
        finally:
            if vm is gpu:
                engine.set_gradient_checkpointing(False)
    (la, ca, na, wa), (lb, cb, nb, wb) = out
    assert ca == cb and set(wa) == set(wb)
    assert_close(np.float64(lb), la, "gpu_loss", "train_step loss")
    assert_close(np.float64(nb), na, "gpu_grads", "train_step norm")
    for path in wa:
        for a, b in zip(wa[path], wb[path]):
            assert_close(b, a, "gpu_grads", path)


def test_greedy_generation_equals_numpys(pair):
    """The prompt prefilled with its images, then each new token at its M-RoPE position past the images' longer
    sides (not its cache row): the NumPy engine's greedy tokens (which are transformers')."""
    cpu, gpu, _ = pair
    imgs = images(2, seed=5)
    ids = np.array([7, *span(cpu, imgs[0]), 8, *span(cpu, imgs[1]), 9])
    want = cpu.generate(ids, imgs, max_new_tokens=8)
    assert gpu.generate(ids, imgs, max_new_tokens=8) == want


def test_cli_generate_image_on_wgpu(pair, tmp_path, capsys):
    """`generate --image --backend wgpu` answers as `--backend numpy`, and so does backend auto."""
    from wgpu_train.cli.main import main

    _, _, folder = pair
    path = tmp_path / "x.png"
    images(1, seed=9)[0].save(path)
    answers = []
    for backend in ("numpy", "wgpu", "auto"):
        assert main(["generate", "--model", str(folder), "--prompt", "what colour?", "--image", str(path),
                     "--max-new-tokens", "4", "--backend", backend]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] == answers[2] and answers[0].strip()


def test_decode_batch_rows_follow_m_rope_on_the_device(pair):
    """Two image rows and a text row in one DecodeBatch on the device (the M-RoPE positions of a call's tokens
    side by side, the DeepStack features of both prompts): each row's tokens equal the NumPy engine's."""
    from test_serve_qwen3_vl import decode_rows

    cpu, gpu, _ = pair
    imgs = images(3, seed=5)
    rows = [([7, *span(cpu, imgs[0]), 8, *span(cpu, imgs[1]), 9], imgs[:2]), ([7, 8, 9, 13], None),
            ([10, *span(cpu, imgs[2]), 11, 12], imgs[2:])]
    assert decode_rows(gpu, rows, budget=64) == decode_rows(cpu, rows, budget=64)


def test_bf16_activations_with_images_equal_numpys(pair):
    """bf16 activations: the DeepStack features rounded to bf16 where the NumPy engine rounds them, added in
    float32 and stored once; logits, loss and LoRA gradients within the text models' bf16 tolerances of the NumPy
    engine at bf16."""
    _, _, folder = pair
    cpu, gpu = (load_vision_model(folder, backend=b, precision="bf16") for b in ("numpy", "wgpu"))
    for vm in (cpu, gpu):
        vm.model.load_adapter(folder.parent / "wgpu_adapter")
    ids, mask, labels, imgs = batch(cpu)
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, imgs, mask)[real], cpu.logits(ids, imgs, mask)[real], "bf16_gpu_logits", "bf16")
    (la, ga), (lb, gb) = (vm.loss_and_grads(ids, labels, imgs, mask) for vm in (cpu, gpu))
    assert_close(np.float64(lb), la, "bf16_gpu_loss", "bf16 loss")
    assert set(ga) == set(gb) and ga
    for name, want in ga.items():
        top = np.abs(want).max()
        assert_close(gb[name] / top, want / top, "bf16_gpu_grads", name)


def test_cli_finetune_with_images_on_wgpu_equals_numpy(pair, tmp_path, capsys):
    """`finetune --data` of TRL's vision records on Qwen3-VL with --backend wgpu, LoRA on the tower's blocks and
    mergers too (the device tower's forward and backward, the DeepStack features' gradients from the device): each
    step's loss and the adapter after 3 steps equal the NumPy engine's run of the same records."""
    import json

    from test_gemma3_vision_training import write_vision_data
    from test_qwen3_vl import records
    from wgpu_train.cli.main import main
    from wgpu_train.formats.safetensors import read_safetensors

    _, _, folder = pair
    data = write_vision_data(tmp_path / "data", records())
    losses, adapters = [], []
    for backend in ("numpy", "wgpu"):
        out = tmp_path / backend
        assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", backend, "--max-steps",
                     "3", "--batch-size", "2", "--lr", "1e-2", "--lora-targets", "q_proj,v_proj,qkv,linear_fc2",
                     "--no-progress", "--valid-split", "0", "--log-every", "1", "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert ("on the device" if backend == "wgpu" else "NumPy, on the CPU") in err
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                       if '"loss"' in line])
        adapters.append(read_safetensors(out / "adapter_model.safetensors"))
    assert len(losses[0]) == 3
    assert_close(np.array(losses[1]), np.array(losses[0]), "gpu_loss", "finetune losses")
    assert set(adapters[0]) == set(adapters[1]) and sum(".visual." in k for k in adapters[0]) == 14
    for k, want in adapters[0].items():
        assert_close(adapters[1][k], want, "qwen_tower_params_after_steps", k)


def test_logits_with_a_video_equal_numpys(pair):
    """A video (5 frames: 3 frame groups, the device tower's attention within each) then an image in a row: the
    WebGPU engine's logits, its tower on the device where it runs there, equal the NumPy engine's."""
    from test_qwen3_vl_video import Video, frames, video_span

    cpu, gpu, _ = pair
    video, img = Video(tuple(frames(5, (30, 22), seed=6))), images(1, seed=6)[0]
    ids = np.array([[7, *video_span(cpu, video), 12, *span(cpu, img), 13]])
    assert gpu.device_tower is not None
    assert_close(gpu.logits(ids, [video, img]), cpu.logits(ids, [video, img]), "gpu_logits", "with a video")


@pytest.mark.parametrize("precision", ["fp32", "f16"])
def test_tower_in_the_step_equals_numpys(vlm, precision):  # noqa: F811
    """VisionModel.train_step of two micro-batches with their images, Qwen3-VL's tower inside the engine's step
    (TowerImages: the forward into the step's embeddings and DeepStack features, the LoRA's backward from both
    gradients, the tower's LoRA in the engine's optimizer): a step with the tower frozen, then 2 with LoRA on it
    (f16: the loss scaler's scale on both gradients, unscaled with the engine's). On WebGPU each step is one
    submission; the loss and norm of each step and both adapters after them equal the NumPy engine's. (AdamW's eps
    1e-2: a first step moves each element by lr times its gradient's sign, which f16's roundings flip for the
    tiny tower's near-zero gradient elements on either engine, NumPy's f16 against its fp32 too.)"""
    from wgpu_train.data.batching import Example
    from wgpu_train.engines.webgpu.tuned.adapter_traits import min_workgroup

    from wgpu_train.adapters.config import LoraConfig

    require_adapter()
    _, folder, base = vlm
    ids, mask, labels, imgs = batch(base)
    n = int(mask[1].sum())
    micro = [[Example(ids[0], labels[0], images=imgs[:2])], [Example(ids[1, :n], labels[1, :n], images=imgs[2:])]]
    hp = OptimizerParams(lr=1e-3, max_grad_norm=1.0, eps=1e-2)
    rng = np.random.default_rng(5)
    out = {}
    for backend in ("numpy", "wgpu"):
        vm = load_vision_model(folder, backend=backend, precision=precision)
        engine = vm.model.engine
        assert vm.in_step and (backend == "numpy" or vm.device_tower is not None)
        if backend == "wgpu":       # the adapter's one-time GEMM probe (its own submissions) first
            min_workgroup(engine.rt)
        vm.model.add_lora(LoraConfig(r=2, alpha=4, target_modules=("q_proj", "down_proj")), seed=3)
        steps = [vm.train_step(micro, hp, 1)]
        if backend == "wgpu":
            assert engine.last_step["submits"] == 1, "the frozen tower's step: one submission"
        tensors = {}
        for path in vm.tower.modules()[::2]:
            out_f, in_f = vm.tower.w[path + ".weight"].shape
            tensors[tower_lora_key(path, "A", vm.vision)] = rng.uniform(-0.3, 0.3, (2, in_f)).astype(np.float32)
            tensors[tower_lora_key(path, "B", vm.vision)] = (0.3 * rng.standard_normal((out_f, 2))).astype(np.float32)
        rng = np.random.default_rng(5)      # the same tensors on both engines
        vm.set_tower_lora(tensors, 2.5)
        for step in (2, 3):
            steps.append(vm.train_step(micro, hp, step))
            if backend == "wgpu":
                assert engine.last_step["submits"] == 1, f"step {step}: one submission"
        assert all(applied for *_, applied in steps)
        out[backend] = (steps, {k: v.copy() for k, v in vm.tower_trainable().items()}, vm.model.lora_state_dict())
    (steps_c, tower_c, lm_c), (steps_g, tower_g, lm_g) = out["numpy"], out["wgpu"]
    kind = "gpu" if precision == "fp32" else "f16_gpu"
    for j, ((loss_c, count_c, norm_c, _), (loss_g, count_g, norm_g, _)) in enumerate(zip(steps_c, steps_g)):
        assert count_g == count_c
        assert_close(np.float64(loss_g / count_g), loss_c / count_c,
                     kind + "_loss" if j == 0 or precision == "fp32" else "sixteen_bit_loss_after_steps",
                     f"step {j + 1} loss")
        assert_close(np.float64(norm_g), norm_c, kind + "_grads", f"step {j + 1} norm")
    assert set(tower_g) == set(tower_c) and tower_c and set(lm_g) == set(lm_c)
    moved = {k for k in tower_c if not np.array_equal(tower_c[k], tensors[tower_lora_key(*k.rsplit(".lora_", 1),
                                                                                           vm.vision)])}
    assert moved == set(tower_c), "every tower LoRA tensor trained"
    for name, want in {**tower_c, **lm_c}.items():
        got = tower_g[name] if name in tower_g else lm_g[name]
        assert_close(got, want, "gpu_params_after_steps" if precision == "fp32" else "sixteen_bit_params_after_steps",
                     name)


def test_host_tower_beside_webgpu_honours_the_f16_loss_scaler(vlm, monkeypatch):  # noqa: F811
    """A tower the device cannot hold runs on the host around the engine's passes (VisionModel.in_step False): with
    f16 its step scales the loss gradient, unscales both gradients and skips a non-finite step as the engine's own
    step does: with LoRA on the tower, the step's loss, norm and both adapters equal the NumPy engine's in-step f16
    step; at a loss scale that overflows the backward, the step is skipped, nothing moves and the scale backs off."""
    from wgpu_train.adapters.config import LoraConfig
    from wgpu_train.data.batching import Example
    from wgpu_train.engines.webgpu import qwen_vision_tower

    require_adapter()
    _, folder, base = vlm
    ids, mask, labels, imgs = batch(base)
    n = int(mask[1].sum())
    micro = [[Example(ids[0], labels[0], images=imgs[:2])], [Example(ids[1, :n], labels[1, :n], images=imgs[2:])]]
    hp = OptimizerParams(lr=1e-3, max_grad_norm=1.0, eps=1e-2)      # eps: as test_tower_in_the_step_equals_numpys
    out = {}
    for backend in ("numpy", "wgpu"):
        if backend == "wgpu":
            monkeypatch.setattr(qwen_vision_tower, "runs_on_device", lambda rt, tower: False)
        vm = load_vision_model(folder, backend=backend, precision="f16")
        assert vm.in_step == (backend == "numpy")
        vm.model.add_lora(LoraConfig(r=2, alpha=4, target_modules=("q_proj", "down_proj")), seed=3)
        rng = np.random.default_rng(5)
        tensors = {}
        for path in vm.tower.modules()[::2]:
            out_f, in_f = vm.tower.w[path + ".weight"].shape
            tensors[tower_lora_key(path, "A", vm.vision)] = rng.uniform(-0.3, 0.3, (2, in_f)).astype(np.float32)
            tensors[tower_lora_key(path, "B", vm.vision)] = (0.3 * rng.standard_normal((out_f, 2))).astype(np.float32)
        vm.set_tower_lora(tensors, 2.5)
        step = vm.train_step(micro, hp, 1)
        out[backend] = (step, {k: v.copy() for k, v in vm.tower_trainable().items()}, vm.model.lora_state_dict())
    scaler = vm.model.engine.loss_scaler
    assert scaler is not None and scaler.scale == 2.0 ** 16
    (step_c, tower_c, lm_c), (step_g, tower_g, lm_g) = out["numpy"], out["wgpu"]
    assert step_c[1] == step_g[1] and step_c[3] and step_g[3]
    assert_close(np.float64(step_g[0] / step_g[1]), step_c[0] / step_c[1], "f16_gpu_loss", "loss")
    assert_close(np.float64(step_g[2]), step_c[2], "f16_gpu_grads", "norm")
    for name, want in {**tower_c, **lm_c}.items():
        got = tower_g[name] if name in tower_g else lm_g[name]
        assert_close(got, want, "sixteen_bit_params_after_steps", name)
    scaler.scale = 2.0 ** 60            # the backward's f16 activations overflow
    skipped = vm.train_step(micro, hp, 2)
    assert not skipped[3] and not np.isfinite(skipped[2]) and scaler.scale == 2.0 ** 59
    for name, arr in vm.tower_trainable().items():
        np.testing.assert_array_equal(arr, tower_g[name])
