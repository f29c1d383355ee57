"""The WebGPU engine on 4-aligned tiny configurations (hidden sizes and head dims multiples of 4 and 16), where
the vec4 and subgroup paths of every kernel family run inside a training step: loss and LoRA gradients equal
the NumPy engine's with each GEMM family pinned (the odd-sized models of test_engine.py never reach them)."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.engines.webgpu.tuned import gemm as G
from wgpu_train.engines.webgpu.tuned import tune

from tiny_models import build_model, save_model
from tolerances import assert_close

pytest.importorskip("torch")

# head_dim 16 (llama: hidden 64, 4 heads) and 64 (qwen2: hidden 128, 2 heads); all sizes multiples of 16
CONFIGS = {"llama-d16": ("llama", dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2)),
           "qwen2-d64": ("qwen2", dict(vocab_size=128, hidden_size=128, intermediate_size=192, num_attention_heads=2,
                                       num_key_value_heads=1))}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def folder(request, tmp_path_factory):
    arch, sizes = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_model(build_model(arch, seed=3, **sizes), path)
    return path


_REFERENCE: dict = {}   # folder -> (LoRA tensors, loss, gradients) of the NumPy engine, shared by the families


def _reference(folder, lora, ids, labels, mask):
    if folder not in _REFERENCE:
        ref = wt.load_model(folder, backend="numpy")
        ref.add_lora(lora, seed=5)
        rng = np.random.default_rng(2)
        modules = {p: (a, rng.normal(0, 0.1, b.shape).astype(np.float32))
                   for p, (a, b) in ref.engine.lora_tensors().items()}
        ref._set_lora(lora, modules, seed=5)
        _REFERENCE[folder] = (ref.engine.lora_tensors(), *ref.loss_and_grads(ids, labels, mask))
    return _REFERENCE[folder]


@pytest.mark.parametrize("family", ["register", "tiled", "splitk"])
def test_aligned_training_step_matches_numpy(folder, rt, family, monkeypatch):
    """A LoRA (all linear layers) loss and gradients with every GEMM of the step run by one family where it
    applies; the vec4 kernels must really run (checked on the engine's first GEMM)."""
    lora = wt.LoraConfig(r=4, alpha=8, target_modules="all-linear")
    ids = np.random.default_rng(0).integers(0, 96, (4, 128))     # 512 tokens: LoRA gradients take split-K
    mask = np.ones_like(ids)
    labels = ids.copy()
    labels[:, :5] = -100
    tensors, loss_ref, grads_ref = _reference(folder, lora, ids, labels, mask)
    gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index))
    gpu._set_lora(lora, tensors, seed=5)
    ran = []
    real = G.gemm_dispatches
    monkeypatch.setattr(G, "gemm_dispatches", lambda *a, **k: ran.append(d := real(*a, **k)) or d)
    with tune.pinned({"splitk": "splitk,tiled"}.get(family, family)):
        loss_gpu, grads_gpu = gpu.loss_and_grads(ids, labels, mask)
    labels_run = {pipeline.label for d in ran for pipeline, _, _ in d}
    assert any("v4" in name for name in labels_run), f"no vec4 GEMM ran: {sorted(labels_run)}"
    if family != "register":
        assert any("gemm_tiled" in name for name in labels_run)
    if family == "splitk":
        assert any("gemm_splitk_reduce" in name for name in labels_run)
    assert_close(np.float64(loss_gpu), np.float64(loss_ref), "gpu_loss")
    for k in grads_ref:
        assert_close(grads_gpu[k], grads_ref[k], "gpu_grads", k)


def test_lora_groups_share_one_a_gemm(folder, rt, monkeypatch):
    """q/k/v and gate/up LoRA run their A matrices as one GEMM each (3 fewer GEMMs per layer forward with
    LoRA on all linear layers); with dropout they do not (each module's input is its own mask)."""
    gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index))
    gpu.add_lora(wt.LoraConfig(r=4, alpha=8, target_modules="all-linear"), seed=1)
    engine = gpu.engine
    assert engine._group_of["k_proj"] == ("q_proj", "k_proj", "v_proj")
    assert engine._group_of["up_proj"] == ("gate_proj", "up_proj") and "o_proj" not in engine._group_of
    calls = []
    real = G.gemm_dispatches
    monkeypatch.setattr(G, "gemm_dispatches", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = np.arange(16).reshape(1, 16) % 90
    gpu.logits(ids)
    layers = engine.cfg.num_hidden_layers
    assert len(calls) == layers * (7 + 4 + 7) + 1          # base, A (2 groups, o, down), B; then the head
    gpu.add_lora(wt.LoraConfig(r=4, alpha=8, target_modules="all-linear", dropout=0.1), seed=1)
    assert gpu.engine._group_of == {}
