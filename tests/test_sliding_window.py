"""Sliding-window attention (Mistral's `sliding_window`, Qwen2's `use_sliding_window` with
`max_window_layers`): the NumPy engine against transformers (logits, full fine-tuning gradients), the
WebGPU engine against the NumPy engine (logits, LoRA gradients, greedy generation through the KV cache)."""
from __future__ import annotations

import copy

import numpy as np
import pytest

import wgpu_train as wt

from tiny_models import build_model, save_model
from tolerances import assert_close

torch = pytest.importorskip("torch")

T = 21                     # longer than every window below
# (architecture, config changes, per-layer windows the config must give)
CASES = {"mistral": ("mistral", dict(sliding_window=5), (5, 5)),
         "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), (0, 4))}


ARCH_OF: dict = {}         # the test folder's name -> its architecture


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, changes, windows = CASES[request.param]
    hf = build_model(arch, seed=6, **changes)
    path = tmp_path_factory.mktemp(request.param + "-window")
    save_model(hf, path)
    ARCH_OF[path.name] = arch
    return path, hf, windows


def _batch():
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 83, (2, T))
    mask = np.ones_like(ids)
    mask[1, 15:] = 0
    labels = np.where(mask == 1, ids, -100)
    labels[:, :3] = -100
    return ids, mask, labels


def test_windows_read_from_the_config(case):
    path, _, windows = case
    assert wt.load_model(path, backend="numpy").config.layer_windows == windows


def test_numpy_engine_matches_transformers(case):
    path, hf, _ = case
    ids, mask, labels = _batch()
    model = wt.load_model(path, backend="numpy")
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids)).logits.numpy()
    got = model.logits(ids)
    assert_close(got, want, "logits_f32", "windowed logits")
    full = build_model(ARCH_OF[path.name], seed=6)     # the same weights without a window: it must matter here
    with torch.no_grad():
        assert np.abs(full(input_ids=torch.tensor(ids)).logits.numpy() - want).max() > 1e-2
    ref = copy.deepcopy(hf)
    out = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    model.set_full_finetune()
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    for name, p in ref.named_parameters():
        assert_close(grads[name], p.grad.numpy(), "grads_f32", name)


def test_wgpu_engine_matches_numpy(case, rt):
    path, _, _ = case
    ids, mask, labels = _batch()
    lora = wt.LoraConfig(r=3, alpha=6, target_modules="all-linear")
    ref = wt.load_model(path, backend="numpy")
    gpu = wt.load_model(path, backend="wgpu", device=str(rt.info.index))
    ref.add_lora(lora, seed=4)
    rng = np.random.default_rng(1)
    modules = {p: (a, rng.normal(0, 0.1, b.shape).astype(np.float32)) for p, (a, b) in ref.engine.lora_tensors().items()}
    ref._set_lora(lora, modules, seed=4)
    gpu._set_lora(lora, ref.engine.lora_tensors(), seed=4)
    assert_close(gpu.logits(ids, mask), ref.logits(ids, mask), "gpu_logits", "logits")
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss")
    for k in grads_r:
        assert_close(grads_g[k], grads_r[k], "gpu_grads", k)
    prompt = ids[0, :6]
    assert gpu.generate(prompt, max_new_tokens=12) == ref.generate(prompt, max_new_tokens=12)


def test_head_dim_beyond_the_attention_kernels_is_refused(rt, tmp_path):
    """A head_dim over what the WebGPU attention kernels hold: one ConfigError naming the field."""
    hf = build_model("qwen3", seed=1, head_dim=130, num_attention_heads=2, num_key_value_heads=1)
    save_model(hf, tmp_path)
    with pytest.raises(wt.ConfigError, match="field 'head_dim' \\(130\\)"):
        wt.load_model(tmp_path, backend="wgpu", device=str(rt.info.index))
    assert wt.load_model(tmp_path, backend="numpy").config.head_dim == 130
