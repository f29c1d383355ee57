"""LFM3 on the WebGPU engine against the NumPy engine (tests/test_lfm3.py holds that one to transformers and PEFT), on
every adapter present: the per-head sigmoid gate g_proj (the per-row gate kernels over one row per head), sandwich
norms, sliding and full attention with their own RoPE (proportional on the full layers) and the conv layers;
logits, loss and LoRA gradients over a padded batch, an optimizer step in one submission, greedy generation."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from finetune_helpers import padded_batch
from test_lfm3 import LFM3
from tolerances import assert_close
from engine_pair import assert_engines_agree, engine_pair

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import torch
    import transformers as tf

    torch.manual_seed(5)
    hf = tf.AutoModelForCausalLM.from_config(tf.Lfm3Config(**LFM3), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("lfm3_wgpu")
    hf.save_pretrained(out)
    return out


def _pair(folder, rt, **kw):
    """The model on both engines with all-linear LoRA (g_proj, attention, conv, MLP), B random."""
    return engine_pair(folder, rt, wt.LoraConfig(r=3, alpha=7, target_modules="all-linear"), **kw)


def test_lora_logits_loss_gradients_and_a_step_match_numpy(folder, rt):
    ref, gpu = _pair(folder, rt)
    ids, labels, mask = padded_batch(2, 15, 9, 2)
    ids = ids % 83
    assert_engines_agree(ref, gpu, ids, labels, mask, ("self_attn.g_proj.lora_A", "self_attn.q_proj.lora_B", "conv.in_proj.lora_A", "feed_forward.w2"), "lfm3")


def test_greedy_generation_matches_numpy(folder, rt):
    """Past the sliding window (4) through the KV cache and the conv state."""
    ref, gpu = _pair(folder, rt)
    prompt = [5, 17, 3, 40, 22, 8, 9]
    assert gpu.generate(prompt, max_new_tokens=10) == ref.generate(prompt, max_new_tokens=10)


@pytest.mark.parametrize("precision, base_dtype", [("bf16", "bfloat16"), ("f16", "float32")])
def test_sixteen_bit_activations_match_numpy(precision, base_dtype, rt, tmp_path):
    """--precision bf16 / f16 (even widths: 4 heads, an even MLP): the head gate's output and its gradients stored
    in 16 bits by pairs, as the NumPy engine rounds them: the same logits, loss and LoRA gradients within 16-bit
    noise."""
    import torch
    import transformers as tf

    torch.manual_seed(5)
    hf = tf.AutoModelForCausalLM.from_config(tf.Lfm3Config(**{**LFM3, "hidden_size": 40, "num_attention_heads": 4,
                                                              "intermediate_size": 46}),
                                             dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ref, gpu = _pair(tmp_path, rt, precision=precision, base_dtype=base_dtype)
    assert gpu.engine.precision == precision
    ids, labels, mask = padded_batch(2, 15, 9, 2)
    ids = ids % 83
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], f"{precision}_gpu_logits", "lfm3")
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), f"{precision}_gpu_loss", "lfm3")
    for k, g in grads_r.items():
        top = np.abs(g).max()
        assert_close(grads_g[k] / top, g / top, f"{precision}_gpu_grads", f"lfm3: {k}")


def test_full_finetuning_and_batched_generation(folder, rt):
    """Full fine-tuning's gradients (g_proj's and the sandwich norms' among them) as the NumPy engine's; rows of
    different lengths in one generation batch equal each row alone."""
    ref = wt.load_model(folder, backend="numpy")
    gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index))
    prompts = [np.array([5, 17, 3, 40, 22, 8, 9]), np.array([11, 4]), np.array([5, 17, 3, 40, 61, 30, 2, 7, 19])]
    alone = [ref.generate(p, max_new_tokens=6) for p in prompts]
    assert gpu.generate_batch(prompts, max_new_tokens=6) == alone
    for m in (ref, gpu):
        m.set_full_finetune()
    ids, labels, mask = padded_batch(2, 15, 9, 2)
    ids = ids % 83
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", "full")
    assert grads_g.keys() == grads_r.keys() and any("g_proj.weight" in k for k in grads_r)
    assert any("post_operator_norm" in k or "post_ffn_norm" in k for k in grads_r), sorted(grads_r)[:12]
    for k, g in grads_r.items():
        assert_close(grads_g[k], g, "gpu_grads", f"full: {k}")
