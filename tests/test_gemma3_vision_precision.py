"""Gemma 3 with images on the WebGPU engine at what a text model trains with (issue 46): bf16 / f16 activations,
bfloat16 / NF4 bases and gradient checkpointing, each against the NumPy engine with the same settings (logits,
loss, LoRA gradients, the image rows' gradient) on test_gemma3_vision_gpu's tiny model."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import require_adapter
from test_gemma3_vision_gpu import batch, load_pair, save_tiny_vision
from tolerances import assert_close

from wgpu_train.engines.protocol import OptimizerParams     # (test_gemma3_vision_gpu skips without torch / peft)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny Gemma 3 with images, its MLP width even (16-bit activations need even widths)."""
    require_adapter()
    path = tmp_path_factory.mktemp("gemma3_vision16") / "model"
    save_tiny_vision(path, intermediate_size=42)
    return path


def _compare(cpu, gpu, kind: str, what: str):
    """Logits, loss, every LoRA gradient and image_grad of the batch with images on both engines, within the
    tolerances <kind>_logits / _loss / _grads (16-bit gradients over the tensor's largest element)."""
    ids, mask, labels, px = batch()
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, px, mask)[real], cpu.logits(ids, px, mask)[real], kind + "_logits", what)
    (la, ga), (lb, gb) = (vm.loss_and_grads(ids, labels, px, mask) for vm in (cpu, gpu))
    assert_close(np.float64(lb), la, kind + "_loss", what + ": loss")
    grads = {**ga, "image_grad": cpu.model.engine.image_grad}
    got = {**gb, "image_grad": gpu.model.engine.image_grad}
    assert set(grads) == set(got) and len(grads) > 1
    for name, want in grads.items():
        top = np.abs(want).max() if kind != "gpu" else 1.0
        assert top > 0
        assert_close(got[name] / top, want / top, kind + "_grads", f"{what}: {name}")
    return got


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_sixteen_bit_activations_with_images_equal_numpys(folder, precision):
    """The image embeddings rounded to the activations' format where the NumPy engine rounds them (set_images),
    scattered over the rows and trained through at 16 bits: the WebGPU engine within the text models' 16-bit
    tolerances of the NumPy engine at the same precision."""
    cpu, gpu = load_pair(folder, precision=precision)
    assert cpu.model.engine.precision == gpu.model.engine.precision == precision
    _compare(cpu, gpu, precision + "_gpu", precision)


@pytest.mark.parametrize("base_dtype", ["nf4", "bfloat16"])
def test_quantized_bases_with_images_equal_numpys(folder, base_dtype):
    """A bfloat16 or NF4 base under the LoRA with images: the same logits, loss and gradients as the NumPy engine
    on the same rounded weights."""
    _compare(*load_pair(folder, base_dtype=base_dtype), "gpu", base_dtype)


def test_gradient_checkpointing_with_images(folder):
    """Gradient checkpointing with images (the first layer's kept input holds the image rows; the recomputed
    forward sees the same blocks), bf16 activations over an NF4 base: the WebGPU engine's gradients and
    image_grad bit for bit those without it, and both within tolerance of the NumPy engine's, which checkpointing
    leaves unchanged."""
    cpu, gpu = load_pair(folder, precision="bf16", base_dtype="nf4")
    plain = _compare(cpu, gpu, "bf16_gpu", "bf16 nf4")
    for vm in (cpu, gpu):
        vm.model.engine.set_gradient_checkpointing(True)
    checkpointed = _compare(cpu, gpu, "bf16_gpu", "bf16 nf4 checkpointed")
    assert any(checkpoint for _, train, checkpoint in gpu.model.engine.buckets.acts)   # it did recompute
    for name, want in plain.items():
        assert_close(checkpointed[name], want, "exact", f"checkpointed {name}")


def test_checkpointed_train_step_with_images(folder):
    """A train step of two micro-batches, each with its own images (its own slot's buffers, which the backward's
    recomputed forward reads again), bf16 over NF4 with gradient checkpointing: the same loss and norm as the
    NumPy engine's, and the WebGPU engine's updated LoRA bit for bit that of the same step without it."""
    ids, mask, labels, px = batch()
    targets = np.roll(labels, -1, axis=1)
    targets[:, -1] = -100
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    out = {}
    for checkpointing in (False, True):
        for vm in load_pair(folder, precision="bf16", base_dtype="nf4"):
            engine = vm.model.engine
            engine.set_gradient_checkpointing(checkpointing)
            mbs = [(vm._text_ids(ids[r:r + 1]).astype(np.int32), targets[r:r + 1], mask[r:r + 1].astype(np.int32),
                    pos[r:r + 1], vm.image_tokens(ids[r:r + 1], px[:2] if r == 0 else px[2:])) for r in (0, 1)]
            loss, count, norm, applied = engine.train_step(mbs, OptimizerParams(lr=1e-2), 1)
            assert applied
            out[checkpointing, vm.model.backend] = (loss / count, norm, engine.lora_tensors())
    for checkpointing in (False, True):
        (la, na, _), (lb, nb, _) = out[checkpointing, "numpy"], out[checkpointing, "wgpu"]
        assert_close(np.float64(lb), la, "bf16_gpu_loss", f"train_step loss (checkpointing {checkpointing})")
        assert_close(np.float64(nb), na, "bf16_gpu_grads", f"train_step norm (checkpointing {checkpointing})")
    plain, checkpointed = out[False, "wgpu"][2], out[True, "wgpu"][2]
    assert set(plain) == set(checkpointed)
    for path in plain:
        for a, b in zip(plain[path], checkpointed[path]):
            assert_close(b, a, "exact", f"checkpointed step {path}")


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_tower_in_the_step_at_sixteen_bits_equals_numpys(folder, precision):
    """VisionModel.train_step of two micro-batches with their images at 16-bit activations, the SigLIP tower inside
    the engine's step (TowerImages): a step with the tower frozen, then 2 with LoRA on it too (f16: the loss
    scaler's scale on the image rows' gradient, unscaled with the engine's before the one global norm). On WebGPU
    each step is one submission; its loss and norm, and both adapters after the steps, within the 16-bit
    tolerances of the NumPy engine's at the same precision."""
    from wgpu_train.data.batching import Example
    from wgpu_train.engines.webgpu.tuned.adapter_traits import min_workgroup
    from wgpu_train.models.vision import tower_lora_key

    ids, mask, labels, px = batch()
    n = int(mask[1].sum())
    micro = [[Example(ids[0], labels[0], images=list(px[:2]))], [Example(ids[1, :n], labels[1, :n], images=[px[2]])]]
    hp = OptimizerParams(lr=1e-3, max_grad_norm=1.0)
    out = {}
    for vm in load_pair(folder, precision=precision):
        engine = vm.model.engine
        if vm.model.backend == "wgpu":      # the adapter's one-time GEMM probe (its own submissions) first
            min_workgroup(engine.rt)
        steps = [vm.train_step(micro, hp, 1)]
        if vm.model.backend == "wgpu":
            assert engine.last_step["submits"] == 1, "the frozen tower's step: one submission"
        rng = np.random.default_rng(3)
        tensors = {}
        for path in vm.tower.modules()[::2]:
            out_f, in_f = vm.tower.w[path + ".weight"].shape
            tensors[tower_lora_key(path, "A", vm.vision)] = rng.uniform(-0.3, 0.3, (2, in_f)).astype(np.float32)
            tensors[tower_lora_key(path, "B", vm.vision)] = (0.3 * rng.standard_normal((out_f, 2))).astype(np.float32)
        vm.set_tower_lora(tensors, 2.5)
        for step in (2, 3):
            steps.append(vm.train_step(micro, hp, step))
            if vm.model.backend == "wgpu":
                assert engine.last_step["submits"] == 1, f"step {step}: one submission"
        assert all(applied for *_, applied in steps)
        out[vm.model.backend] = (steps, {k: v.copy() for k, v in vm.tower_trainable().items()},
                                 vm.model.lora_state_dict())
    (steps_c, tower_c, lm_c), (steps_g, tower_g, lm_g) = out["numpy"], out["wgpu"]
    for j, ((loss_c, count_c, norm_c, _), (loss_g, count_g, norm_g, _)) in enumerate(zip(steps_c, steps_g)):
        assert count_g == count_c
        assert_close(np.float64(loss_g / count_g), loss_c / count_c,
                     precision + "_gpu_loss" if j == 0 else "sixteen_bit_loss_after_steps", f"step {j + 1} loss")
        assert_close(np.float64(norm_g), norm_c, precision + "_gpu_grads", f"step {j + 1} norm")
    assert set(tower_g) == set(tower_c) and set(lm_g) == set(lm_c)
    for name, want in {**tower_c, **lm_c}.items():
        got = tower_g[name] if name in tower_g else lm_g[name]
        assert_close(got, want, "sixteen_bit_params_after_steps", name)

