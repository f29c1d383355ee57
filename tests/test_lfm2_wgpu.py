"""LFM2 on the WebGPU engine against the NumPy engine (tests/test_lfm2.py holds that one to transformers and PEFT), on
every adapter present: logits, loss and the LoRA gradients (in_proj / out_proj of the conv layers among them) over
a padded batch, optimizer steps in one submission each, gradient checkpointing, full fine-tuning's convolution
weights, greedy generation through the per-row window state, batched and continuous generation equal to each row
alone (a freed row's state restarting), and backend auto treating LFM2 as a dense model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import wgpu_train as wt
from finetune_helpers import padded_batch
from tolerances import assert_close
from wgpu_train.engines.generate import DecodeBatch
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.shared.labels import shift_labels
from engine_pair import engine_pair

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# tests/test_lfm2.py's sizes but an even hidden size (16-bit activations need even widths)
LFM2 = dict(vocab_size=83, hidden_size=30, intermediate_size=61, num_hidden_layers=4, num_attention_heads=3,
            num_key_value_heads=1, max_position_embeddings=64, norm_eps=1e-5, conv_L_cache=3,
            layer_types=["conv", "full_attention", "conv", "conv"], block_multiple_of=7, block_ffn_dim_multiplier=1.3,
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import transformers as tf

    torch.manual_seed(3)
    hf = tf.AutoModelForCausalLM.from_config(tf.Lfm2Config(**LFM2), dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("lfm2_wgpu")
    hf.save_pretrained(out)
    return out


def _pair(folder, rt, lora=True, **kw):
    """The model on both engines; with lora, all-linear (the conv layers' in_proj / out_proj included), B random."""
    return engine_pair(folder, rt, wt.LoraConfig(r=3, alpha=7, target_modules="all-linear") if lora else None, **kw)


def _batch():
    """Two rows of 15 tokens (five windows of 3), the second padded."""
    return padded_batch(2, 15, 9, 2)


def _same_loss_and_grads(ref, gpu, what: str, key: str):
    ids, labels, mask = _batch()
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", what)
    assert grads_g.keys() == grads_r.keys() and any(key in k for k in grads_r)
    for k, g in grads_r.items():
        assert_close(grads_g[k], g, "gpu_grads", f"{what}: {k}")


def test_lora_logits_loss_gradients_and_steps_match_numpy(folder, rt):
    """The same logits, loss and LoRA gradients; then two optimizer steps of two micro-batches, each one submission
    and one readback, with the same losses and adapter after."""
    ref, gpu = _pair(folder, rt)
    ids, labels, mask = _batch()
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], "gpu_logits", "lfm2")
    _same_loss_and_grads(ref, gpu, "lfm2 lora", ".conv.in_proj.lora_A")
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    micro = [(ids[r:r + 1].astype(np.int32), shift_labels(labels[r:r + 1]), mask[r:r + 1].astype(np.int32),
              pos[r:r + 1].copy()) for r in range(2)]
    hp = OptimizerParams(lr=1e-3, eps=1e-5)
    for step in (1, 2):
        loss_r, _, norm_r, _ = ref.engine.train_step(micro, hp, step)
        loss_g, _, norm_g, applied = gpu.engine.train_step(micro, hp, step)
        assert applied
        assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", f"step {step}")
        assert_close(np.float64(norm_g), np.float64(norm_r), "gpu_loss", f"grad norm, step {step}")
        assert gpu.engine.last_step["submits"] == 1 and gpu.engine.last_step["readbacks"] == 1
    after_r, after_g = ref.lora_state_dict(), gpu.lora_state_dict()
    for k, v in after_r.items():
        assert_close(after_g[k], v, "gpu_params_after_steps", k)


def test_gradient_checkpointing_gives_the_same_gradients(folder, rt):
    """The conv layers recomputed in the backward: bit-identical loss and gradients."""
    _, plain = _pair(folder, rt)
    _, ckpt = _pair(folder, rt)
    ckpt.set_gradient_checkpointing(True)
    ids, labels, mask = _batch()
    loss_p, grads_p = plain.loss_and_grads(ids, labels, mask)
    loss_c, grads_c = ckpt.loss_and_grads(ids, labels, mask)
    assert loss_c == loss_p and grads_c.keys() == grads_p.keys()
    for k in grads_p:
        np.testing.assert_array_equal(grads_c[k], grads_p[k], err_msg=k)


def test_full_finetuning_trains_the_convolutions(folder, rt):
    """Every weight's gradient, the convolutions' (C, 1, K) weights among them, as the NumPy engine's."""
    ref, gpu = _pair(folder, rt, lora=False)
    for m in (ref, gpu):
        m.set_full_finetune()
    _same_loss_and_grads(ref, gpu, "full fine-tuning", "conv.conv.weight")


def test_generation_matches_numpy(folder, rt):
    """Greedy tokens through the window state with the adapter; rows of different lengths in one batch; continuous
    batching in two slots with prefill in chunks of three tokens, a third row taking a freed slot (its state
    zeroed), prefix reuse off."""
    ref, gpu = _pair(folder, rt)
    prompts = [np.array([5, 17, 3, 40, 22, 8, 9]), np.array([11, 4]), np.array([5, 17, 3, 40, 61, 30, 2, 7, 19])]
    alone = [ref.generate(p, max_new_tokens=6) for p in prompts]
    assert [gpu.generate(p, max_new_tokens=6) for p in prompts] == alone
    assert gpu.generate_batch(prompts, max_new_tokens=6) == alone
    batch = DecodeBatch(gpu.engine, 2, 24, token_budget=3)
    out, pending = {}, list(enumerate(prompts))
    try:
        while pending or len(batch):
            while pending and batch.free_slots():
                i, p = pending.pop(0)
                out[batch.add(p, 6, prefix_key="same")] = (i, [])
            for token in batch.step():
                out[token.slot][1].append(token.id)
                if token.finished:
                    i, ids = out.pop(token.slot)
                    out[("done", i)] = ids
    finally:
        batch.close()
    assert [out[("done", i)] for i in range(3)] == alone
    assert batch.reused == 0         # rows share a prefix and a key, but a recurrent state holds no prefix


def test_bfloat16_activations_match_numpy(folder, rt):
    """bf16 activations (the convolution's input and output among them) against the NumPy engine's same rounding
    points: logits, loss and each LoRA gradient relative to its largest element. (f16's kernels are the same; this
    model's gain (logits move 0.05 from float32 in f16) puts the attention layers' f16 differences between the
    engines past f16_gpu_logits, as an all-attention model of these sizes does too (0.0065 against 0.011 of f16
    noise), so f16 is left to the kernel tests.)"""
    from test_precision_gpu import _check

    ref, gpu = _pair(folder, rt, precision="bf16")
    _check(ref, gpu, *_batch(), "bf16_gpu")


def test_memory_estimate_is_the_allocation(folder, rt):
    """The estimate's activations are what the engine allocates for LFM2's layers, with and without gradient
    checkpointing."""
    from test_engine import _allocated

    _, gpu = _pair(folder, rt)
    ids, labels, mask = _batch()
    for checkpointing in (False, True):
        gpu.set_gradient_checkpointing(checkpointing)
        gpu.loss_and_grads(ids, labels, mask)
        acts = gpu.engine._activations(*ids.shape, train=True)
        est = wt.estimate_memory(gpu.config, *ids.shape, lora=gpu.lora_config, gradient_checkpointing=checkpointing)
        assert est["activations"] + est["logits"] == _allocated(acts), checkpointing
        assert est["weights"] == gpu.engine.base_weight_bytes


def test_pipeline_stages_equal_one_process(folder, default_rt):
    """Two WebGPU stages (a conv layer and the attention layer on the first, two conv layers on the second): the
    same optimizer steps as one process, and the same generation, each stage keeping its conv layers' states."""
    from test_pipeline import assert_same_generation
    from test_pipeline_wgpu import _same_steps, _staged

    one, staged = _staged(folder, 2, precision="fp32")
    for model in (one, staged):
        model.add_lora(wt.LoraConfig(r=4, target_modules=("in_proj", "out_proj", "q_proj")), seed=3)
    _same_steps(one, staged, steps=2, micro=2)
    assert_same_generation(*_staged(folder, 2, precision="fp32"))


def test_a_convolution_wider_than_the_kernels_is_left_to_the_numpy_engine(rt):
    """A conv_L_cache past the short-convolution kernels' sizes: WgpuEngine refuses it in one line (not a
    kernel's ValueError), backend auto takes the NumPy engine and says why."""
    import transformers as tf
    from wgpu_train.engines.backend_choice import choose_backend
    from wgpu_train.engines.webgpu.engine import WgpuEngine
    from wgpu_train.engines.webgpu.tuned.short_conv_kernels import MAX_K
    from wgpu_train.errors import ConfigError

    raw = {**tf.Lfm2Config(**{**LFM2, "conv_L_cache": MAX_K + 1}).to_dict(), "architectures": ["Lfm2ForCausalLM"]}
    cfg = wt.ModelConfig.from_dict(raw)
    wider = f"field 'conv_L_cache' \\({MAX_K + 1}\\): up to {MAX_K}; use --backend numpy"
    with pytest.raises(ConfigError, match=wider):
        WgpuEngine(cfg, {}, rt)
    choice = choose_backend("auto", None, cfg)
    assert choice.engine == "numpy" and "conv_L_cache" in choice.reason
    narrow = wt.ModelConfig.from_dict({**raw, "conv_L_cache": MAX_K})
    assert choose_backend("auto", None, narrow).reason != choice.reason
