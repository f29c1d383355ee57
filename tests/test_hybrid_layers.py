"""Models whose layers differ in kind, against transformers 5: SmolLM3's NoPE layers (no RoPE on every fourth
layer, or as no_rope_layers says; a sliding window on them where use_sliding_window asks), on the NumPy engine:
logits, LoRA gradients against PEFT, greedy generation through the KV cache."""
from __future__ import annotations

import copy

import numpy as np
import peft
import pytest
import torch

from finetune_helpers import padded_batch, peft_random_b
from tiny_models import save_model
from tolerances import assert_close
from wgpu_train.engines.loading import load_model
from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SMOLLM3 = dict(vocab_size=83, hidden_size=30, intermediate_size=43, num_hidden_layers=5, num_attention_heads=3,
               num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)


def smollm3(seed=0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.SmolLM3Config(**{**SMOLLM3, **overrides})
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=["interval", "listed-sliding"])
def smol(request, tmp_path_factory):
    """Every fourth layer NoPE (the default interval), or no_rope_layers given with a 4-token window on the NoPE
    layers."""
    kw = {} if request.param == "interval" else dict(no_rope_layers=[1, 0, 1, 0, 0], use_sliding_window=True,
                                                      sliding_window=4)
    hf = smollm3(seed=4, **kw)
    folder = tmp_path_factory.mktemp(request.param)
    save_model(hf, folder)
    return hf, folder


def test_config_reads_nope_layers_and_their_windows(smol):
    hf, folder = smol
    cfg = ModelConfig.from_folder(folder)
    assert cfg.rope_layers == tuple(bool(v) for v in hf.config.no_rope_layers)
    sliding = [t == "sliding_attention" for t in hf.config.layer_types]
    assert [cfg.window(i) > 0 for i in range(cfg.num_hidden_layers)] == sliding
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings


def test_logits_lora_gradients_and_generation_match(smol, tmp_path):
    hf, folder = smol
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=3, lora_alpha=5, target_modules=["q_proj", "k_proj", "down_proj"])), 1)
    pm.save_pretrained(tmp_path)
    ids, labels, mask = padded_batch(2, 11, 7, 2)
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    model = load_model(folder, backend="numpy")
    model.load_adapter(tmp_path)
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], out.logits.detach().numpy()[real], "logits_f32", "logits")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)
    prompt = [5, 17, 3, 40, 22, 8, 9]
    with torch.no_grad():
        want = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                           eos_token_id=None)[0, len(prompt):].tolist()
    assert model.generate(prompt, max_new_tokens=8) == want


def test_bad_no_rope_layers_is_one_line():
    raw = {**SMOLLM3, "architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [1, 0]}
    with pytest.raises(ConfigError, match="'no_rope_layers' must list 0 or 1 for each of the 5 layers"):
        ModelConfig.from_dict(raw)


def test_the_webgpu_engine_walks_each_layers_own_plan(smol, rt):
    """NoPE layers on the WebGPU engine: logits, loss and LoRA gradients equal the NumPy engine's, which differ from
    the same weights read with RoPE on every layer."""
    import dataclasses

    from wgpu_train.adapters.config import LoraConfig
    from wgpu_train.engines.loading import model_from_weights

    hf, folder = smol
    ids, labels, mask = padded_batch(2, 11, 7, 2)
    ref = load_model(folder, backend="numpy")
    gpu = load_model(folder, backend="wgpu", device=str(rt.info.index))
    lora = LoraConfig(r=2, alpha=4, target_modules=("q_proj", "k_proj", "o_proj"))
    for m in (ref, gpu):
        m.add_lora(lora, seed=1)
    rng = np.random.default_rng(0)
    pairs = {p: (a, 0.3 * rng.standard_normal(b.shape).astype(np.float32), ref._scales[p], 0.0)
             for p, (a, b) in ref.engine.lora_tensors().items()}
    ref.engine.set_lora(pairs)
    gpu.engine.set_lora(pairs)
    real = mask.astype(bool)
    want = ref.logits(ids, mask)
    assert_close(gpu.logits(ids, mask)[real], want[real], "gpu_logits", "logits")
    loss, grads = ref.loss_and_grads(ids, labels, mask)
    gpu_loss, gpu_grads = gpu.loss_and_grads(ids, labels, mask)
    assert_close(gpu_loss, loss, "gpu_loss", "loss")
    for name, g in grads.items():
        assert_close(gpu_grads[name], g, "gpu_grads", name)
    roped = dataclasses.replace(ref.config, rope_layers=())     # the same weights read as a Llama
    base = load_model(folder, backend="numpy").logits(ids, mask)[real]
    as_llama = model_from_weights(roped, dict(load_model(folder, backend="numpy").engine.weights()), backend="numpy")
    assert np.abs(as_llama.logits(ids, mask)[real] - base).max() > 1e-3
