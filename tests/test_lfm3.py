"""LFM3 (Lfm3ForCausalLM: LFM2's short convolutions beside full and sliding attention layers with per-layer-type RoPE,
q / k norms, a per-head sigmoid gate g_proj and sandwich norms) on the NumPy engine against transformers 5 and PEFT:
the config read and its refusals, logits, LoRA gradients, adapters both ways and all-linear as PEFT's, greedy
generation through the sliding window and the convolution state, the hub's gate_proj name (the WebGPU engine's: test_lfm3_wgpu.py)."""
from __future__ import annotations

import copy
import json

import numpy as np
import peft
import pytest
import torch

from finetune_helpers import padded_batch, peft_random_b
from tolerances import assert_close
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.engines.backend_choice import choose_backend
from wgpu_train.engines.loading import load_model
from wgpu_train.errors import ConfigError
from wgpu_train.formats.safetensors import read_safetensors, write_safetensors
from wgpu_train.models.config import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# odd sizes; transformers' default RoPE blocks (sliding: plain, base 1e4; full: proportional, half the pairs, 1e6)
LFM3 = dict(vocab_size=83, hidden_size=30, intermediate_size=45, num_hidden_layers=4, num_attention_heads=3,
            num_key_value_heads=1, head_dim=10, max_position_embeddings=64, norm_eps=1e-5, conv_L_cache=3,
            sliding_window=4, layer_types=["conv", "sliding_attention", "full_attention", "conv"],
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TARGETS = ["in_proj", "q_proj", "g_proj", "o_proj", "w2"]


@pytest.fixture(scope="module")
def lfm3(tmp_path_factory):
    """A tiny random LFM3 (eager attention) saved to a folder, and a PEFT adapter on it with random B."""
    import transformers as tf

    torch.manual_seed(5)
    hf = tf.AutoModelForCausalLM.from_config(tf.Lfm3Config(**LFM3), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
    hf.eval()
    folder = tmp_path_factory.mktemp("lfm3")
    hf.save_pretrained(folder / "model")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=3, lora_alpha=5,
                                                                             target_modules=TARGETS)), 1)
    pm.save_pretrained(folder / "adapter")
    return hf, pm, folder


def test_config_reads_layer_kinds_rope_and_gates(lfm3):
    hf, _, folder = lfm3
    cfg = ModelConfig.from_folder(folder / "model")
    assert cfg.family == "lfm3" and cfg.conv_layers == (True, False, False, True) and cfg.conv_kernel == 3
    assert cfg.layer_windows == (0, 4, 0, 0) and cfg.local_rope == (False, True, False, False)
    assert cfg.sandwich_norms and cfg.head_gate and cfg.qk_norm and cfg.intermediate_size == 45
    assert cfg.rope_scaling["rope_type"] == "proportional" and cfg.rotary_dim == 0
    for layer in (1, 2):        # the inverse frequencies transformers' rotary embedding holds per layer type
        kind = LFM3["layer_types"][layer]
        want = getattr(hf.model.rotary_emb, f"{kind}_inv_freq").numpy()
        assert_close(cfg.inv_freq(layer), want, "inv_freq", kind)
    assert cfg.layer_modules(2) == ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "feed_forward.w1",
                                    "feed_forward.w3", "feed_forward.w2")


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["conv", "linear_attention", "conv", "conv"]}, "layer kind 'linear_attention'"),
    ({"conv_bias": True}, "field 'conv_bias' is true"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "gives the sliding layers rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "field 'rope_parameters' must hold a RoPE block"),
])
def test_unsupported_configs_are_one_line(change, message):
    raw = {**LFM3, "architectures": ["Lfm3ForCausalLM"], **change}
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(err.value)


def test_logits_loss_and_lora_gradients_match_peft(lfm3):
    """A padded batch of 15 tokens (longer than the window) through an adapter on every layer kind's modules."""
    _, pm, folder = lfm3
    ids, labels, mask = padded_batch(2, 15, 9, 2)
    ids, labels = ids % 83, np.where(labels >= 0, labels % 83, labels)
    pm.zero_grad()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    model = load_model(folder / "model", backend="numpy")
    assert model.backend == "numpy"
    model.load_adapter(folder / "adapter")
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], out.logits.detach().numpy()[real], "logits_f32", "logits")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected) and any(".g_proj." in k for k in grads)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def test_full_finetune_gradients_match_autograd(lfm3):
    """Every weight's gradient: the sandwich norms, g_proj and the convolutions' weights among them."""
    hf, _, folder = lfm3
    ids, labels, mask = padded_batch(4, 12, 8, 2)
    ids, labels = ids % 83, np.where(labels >= 0, labels % 83, labels)
    model = copy.deepcopy(hf)
    model.zero_grad()
    model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)).loss.backward()
    ours = load_model(folder / "model", backend="numpy")
    ours.set_full_finetune()
    _, grads = ours.loss_and_grads(ids, labels, mask)
    expected = {n: p.grad.numpy() for n, p in model.named_parameters()}
    rename = {"model.norm.weight": "model.embedding_norm.weight"}
    assert {rename.get(k, k) for k in grads} == set(expected)
    for name, g in grads.items():
        assert_close(g, expected[rename.get(name, name)], "grads_f32", name)


def test_adapters_both_ways_and_all_linear_as_peft(lfm3, tmp_path):
    hf, _, folder = lfm3
    model = load_model(folder / "model", backend="numpy")
    model.load_adapter(folder / "adapter")
    model.save_adapter(tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    ids, _, mask = padded_batch(5, 12, 8, 2)
    ids = ids % 83
    with torch.no_grad():
        want = back(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32", "PEFT reading ours")
    theirs = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=2, target_modules="all-linear"))
    lora = LoraConfig(r=2, alpha=4, target_modules="all-linear")
    model.add_lora(lora, seed=0)
    assert set(model.lora_state_dict()) == {n.replace(".default.", ".") for n, _ in theirs.named_parameters()
                                            if "lora_" in n}
    model.save_adapter(tmp_path / "all")
    peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "all")       # every key is one PEFT expects


def test_greedy_generation_matches_transformers(lfm3):
    """Past the sliding window, through the conv layers' recurrent state, with the adapter."""
    _, pm, folder = lfm3
    model = load_model(folder / "model", backend="numpy")
    model.load_adapter(folder / "adapter")
    prompt = [5, 17, 3, 40, 22, 8, 9]
    with torch.no_grad():
        want = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                           eos_token_id=None)[0, len(prompt):].tolist()
    assert model.generate(prompt, max_new_tokens=10) == want


def test_hub_gate_proj_name_and_the_backend(lfm3, tmp_path):
    """The hub's checkpoints name g_proj self_attn.gate_proj: read the same; backend auto no longer sets LFM3
    aside."""
    _, _, folder = lfm3
    tensors = read_safetensors(folder / "model" / "model.safetensors")
    write_safetensors(tmp_path / "model.safetensors", {k.replace(".g_proj.", ".gate_proj."): v
                                                       for k, v in tensors.items()})
    (tmp_path / "config.json").write_text((folder / "model" / "config.json").read_text())
    ids, _, mask = padded_batch(5, 10, 6, 2)
    ids = ids % 83
    a = load_model(folder / "model", backend="numpy").logits(ids, mask)
    assert_close(load_model(tmp_path, backend="numpy").logits(ids, mask), a, "exact", "gate_proj")
    choice = choose_backend("auto", cfg=ModelConfig.from_folder(tmp_path))
    assert "attention gate" not in choice.reason
