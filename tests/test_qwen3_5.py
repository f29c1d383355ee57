"""Qwen3.5 (Qwen3_5ForCausalLM; the text part of Qwen3_5ForConditionalGeneration) and Qwen3-Next (Qwen3NextForCausalLM):
Gated DeltaNet linear attention between gated full-attention layers, on the NumPy engine against transformers 5 (its
torch fallbacks of the delta rule and the conv1d) and PEFT: the config and its refusals, logits, loss and LoRA
gradients at a length crossing chunk boundaries on a padded batch, full fine-tuning gradients (A_log, dt_bias, the
conv weight), adapters both ways, greedy and batched generation through the recurrent state."""
from __future__ import annotations

import copy

import numpy as np
import peft
import pytest
import torch

from finetune_helpers import padded_batch, peft_random_b
from tolerances import assert_close
from wgpu_train.engines.backend_choice import choose_backend
from wgpu_train.engines.loading import load_model
from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# odd sizes: 3 attention heads of 8 (partial RoPE on 4 of them), 2 key heads of 6 and 4 value heads of 5 in the
# linear attention (grouped), a conv kernel of 3
QWEN3_5 = dict(vocab_size=83, hidden_size=30, intermediate_size=43, num_hidden_layers=3, num_attention_heads=3,
               num_key_value_heads=1, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=6, linear_value_head_dim=5,
               linear_conv_kernel_dim=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
               partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "v_proj", "down_proj"]


def _randomise(model):
    """Random weights (transformers' init leaves norms at 0 / 1 and B-like tensors small); A_log kept modest so the
    decay is neither 0 nor 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.5 if "A_log" in name else 0.0) + 0.3 * torch.randn_like(p))
    return model.eval()


def build(kind: str):
    import transformers as tf

    torch.manual_seed(5)
    if kind == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**QWEN3_5, num_experts=0)
    else:
        cfg = tf.Qwen3_5TextConfig(**QWEN3_5)
    return _randomise(tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny random Qwen3.5 saved to a folder, and a PEFT adapter on both layer kinds' modules with random B."""
    hf = build("qwen3_5")
    folder = tmp_path_factory.mktemp("qwen3_5")
    hf.save_pretrained(folder / "model")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=3, lora_alpha=5,
                                                                             target_modules=TARGETS)), 1)
    pm.save_pretrained(folder / "adapter")
    return hf, pm, folder


def test_config_reads_layer_kinds_gate_and_partial_rope(qwen):
    hf, _, folder = qwen
    cfg = ModelConfig.from_folder(folder / "model")
    assert cfg.linear_layers == (True, False, True) and cfg.recurrent and cfg.attn_output_gate
    assert cfg.norm_offset == 1.0 and cfg.qk_norm and cfg.rotary_dim == 4
    spec = cfg.linear_attention
    assert (spec.key_heads, spec.value_heads, spec.key_dim, spec.value_dim, spec.conv_kernel) == (2, 4, 6, 5, 3)
    assert cfg.layer_modules(0)[:5] == ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                                        "linear_attn.in_proj_a", "linear_attn.out_proj")
    assert cfg.linear_shape("q_proj") == tuple(hf.model.layers[1].self_attn.q_proj.weight.shape)


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["linear_attention", "full_attention"]}, "'layer_types' must list a kind for each of the 3"),
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention"]}, "layer kind 'sliding_attention'"),
    ({"linear_num_value_heads": 3}, "'linear_num_value_heads' \\(3\\) must be a multiple"),
    ({"attention_bias": True}, "field 'attention_bias'"),
    ({"hidden_act": "gelu"}, "field 'hidden_act'"),
    ({"architectures": ["Qwen2AudioForConditionalGeneration"]}, "field 'architectures'"),
])
def test_unsupported_configs_are_one_line(change, message):
    raw = {**QWEN3_5, "architectures": ["Qwen3_5ForCausalLM"], **change}
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(err.value)


def test_qwen3_next_with_experts_matches_transformers_and_peft(tmp_path):
    """Qwen3-Next's mixture of experts (a shared expert behind its sigmoid gate, as Qwen2-MoE's) after its linear-
    and full-attention layers, a dense layer among them (mlp_only_layers): logits, LoRA gradients on the experts and
    both layer kinds against PEFT, greedy generation through the recurrent state and the routed experts."""
    import transformers as tf

    torch.manual_seed(6)
    cfg = tf.Qwen3NextConfig(**QWEN3_5, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=11,
                             shared_expert_intermediate_size=9, mlp_only_layers=[1], norm_topk_prob=True)
    hf = _randomise(tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager",
                                                        experts_implementation="eager"))
    hf.save_pretrained(tmp_path / "model")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=3, lora_alpha=5, target_modules=["in_proj_qkvz", "q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])), 2)
    pm.save_pretrained(tmp_path / "adapter")
    ids, labels, mask = padded_batch(3, 40, 30, 2)
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    model = load_model(tmp_path / "model", backend="numpy")
    assert model.config.moe is not None and model.config.moe.sparse == (True, False, True)
    model.load_adapter(tmp_path / "adapter")
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], out.logits.detach().numpy()[real], "hybrid_moe_logits_f32", "logits")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected) and any("experts.base_layer.lora_A" in k for k in grads)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)
    prompt = [5, 17, 3, 40, 22, 8]
    with torch.no_grad():
        want = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                           eos_token_id=None)[0, len(prompt):].tolist()
    assert model.generate(prompt, max_new_tokens=6) == want


def test_logits_loss_and_lora_gradients_match_peft(qwen):
    """A padded batch of 150 tokens (chunks of 64: three, the last partial; row 1 padded from 101) through an adapter
    on both layer kinds' modules."""
    _, pm, folder = qwen
    ids, labels, mask = padded_batch(2, 150, 101, 3)
    pm.zero_grad()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    model = load_model(folder / "model", backend="numpy")
    model.load_adapter(folder / "adapter")
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], out.logits.detach().numpy()[real], "logits_f32", "logits")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected) and any(".linear_attn.in_proj_a." in k for k in grads)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_full_finetune_gradients_match_autograd(kind, tmp_path):
    """Every weight's gradient (A_log, dt_bias, the conv1d's, the gated norm's among them), on a padded batch of 70
    tokens; Qwen3-Next's fused in-projections (rows interleaved per key head) read as they are."""
    hf = build(kind)
    hf.save_pretrained(tmp_path)
    ids, labels, mask = padded_batch(4, 70, 40, 2)
    hf.zero_grad()
    out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    ours = load_model(tmp_path, backend="numpy")
    ours.set_full_finetune()
    real = mask.astype(bool)
    assert_close(ours.logits(ids, mask)[real], out.logits.detach().numpy()[real], "logits_f32", "logits")
    loss, grads = ours.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    expected = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    assert set(grads) == set(expected)
    for name in ("model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias",
                 "model.layers.2.linear_attn.conv1d.weight", "model.layers.2.linear_attn.norm.weight"):
        assert np.abs(grads[name]).max() > 1e-4, name
    for name, g in grads.items():
        assert_close(g, expected[name], "grads_f32", name)


def test_adapter_saved_by_us_loads_in_peft(qwen, tmp_path):
    hf, _, folder = qwen
    model = load_model(folder / "model", backend="numpy")
    model.load_adapter(folder / "adapter")
    model.save_adapter(tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    ids, _, mask = padded_batch(5, 12, 8, 2)
    with torch.no_grad():
        want = back(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32", "PEFT reading ours")


def test_greedy_generation_matches_transformers(qwen):
    """Through the recurrent state (the conv window and the delta rule's state per row) and the full-attention layer's
    KV cache, with the adapter."""
    _, pm, folder = qwen
    model = load_model(folder / "model", backend="numpy")
    model.load_adapter(folder / "adapter")
    prompt = [5, 17, 3, 40, 22, 8, 9]
    with torch.no_grad():
        want = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                           eos_token_id=None)[0, len(prompt):].tolist()
    assert model.generate(prompt, max_new_tokens=10) == want


def test_batched_generation_equals_each_row_alone(qwen):
    _, _, folder = qwen
    model = load_model(folder / "model", backend="numpy")
    prompts = [np.array([5, 17, 3, 40, 22, 8, 9]), np.array([11, 4]), np.array([5, 17, 3, 40, 61, 30, 2, 7, 19])]
    alone = [model.generate(p, max_new_tokens=6) for p in prompts]
    assert model.generate_batch(prompts, max_new_tokens=6) == alone
    kv = model.engine.new_kv_cache(2, 16)
    assert kv["state"][0]["linear_attn.state"].shape == (2, 4, 6, 5)
    assert kv["state"][0]["linear_attn.conv1d.weight"].shape == (2, 2, 44) and 1 not in kv["state"]


def test_backend_auto_treats_qwen3_5_as_a_dense_model(qwen):
    """The WebGPU engine records the Gated DeltaNet layers (tests/test_qwen3_5_wgpu.py): auto's rule no longer sends
    Qwen3.5 to NumPy for them."""
    _, _, folder = qwen
    from wgpu_train.engines.webgpu.device import runtime

    choice = choose_backend("auto", cfg=ModelConfig.from_folder(folder / "model"))
    assert "linear-attention" not in choice.reason
    assert choice.engine == ("wgpu" if runtime.has_adapter() else "numpy")     # tests take the adapter (conftest.py)


def test_the_multimodal_checkpoints_language_model(tmp_path):
    """Qwen3_5ForConditionalGeneration (the hub's layout, model.language_model.*): a PEFT adapter with random B on its
    language model's modules of both layer kinds (a regular expression on model.language_model) gives the same text
    logits here; the adapter we save back loads in PEFT on the whole class; the vision tower is not read."""
    import transformers as tf

    torch.manual_seed(6)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=30)
    hf = _randomise(tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=QWEN3_5, vision_config=vision)))
    hf.save_pretrained(tmp_path / "model")
    regex = r"model\.language_model\.layers\.\d+\.(?:linear_attn\.in_proj_qkv|linear_attn\.out_proj|self_attn\.q_proj)"
    pm = peft_random_b(peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=regex)), 3)
    pm.save_pretrained(tmp_path / "adapter")
    model = load_model(tmp_path / "model", backend="numpy")
    assert model.config.wrapper == "Qwen3_5ForConditionalGeneration" and not model.config.tie_word_embeddings
    model.load_adapter(tmp_path / "adapter")
    ids = np.random.default_rng(2).integers(3, 83, (1, 20))
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids)).logits.numpy()
    assert_close(model.logits(ids, np.ones_like(ids)), want, "logits_f32", "logits")
    model.save_adapter(tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(pm.get_base_model(), tmp_path / "ours", adapter_name="ours").eval()
    back.set_adapter("ours")
    with torch.no_grad():
        again = back(input_ids=torch.tensor(ids)).logits.numpy()
    assert_close(again, want, "logits_f32", "PEFT reading ours")
