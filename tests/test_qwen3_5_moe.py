"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, and the language model of Qwen3_5MoeForConditionalGeneration, the hub's
class of Qwen3.5-35B-A3B): Gated DeltaNet and gated attention layers, each followed by routed experts and a shared
expert behind a sigmoid gate, on the NumPy engine against transformers 5 and PEFT: logits, loss, LoRA gradients on
the experts and both layer kinds, greedy generation, and the multimodal checkpoint's text model."""
from __future__ import annotations

import copy

import numpy as np
import peft
import pytest
import torch

from finetune_helpers import padded_batch, peft_random_b
from test_qwen3_5 import QWEN3_5, _randomise
from tolerances import assert_close
from wgpu_train.engines.loading import load_model
from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

EXPERTS = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=11, shared_expert_intermediate_size=9)
TARGETS = dict(target_modules=["in_proj_qkv", "in_proj_b", "q_proj", "shared_expert_gate"],
               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def test_logits_gradients_and_generation_match_transformers_and_peft(tmp_path):
    import transformers as tf

    torch.manual_seed(7)
    text = {k: v for k, v in QWEN3_5.items() if k != "intermediate_size"}
    hf = _randomise(tf.AutoModelForCausalLM.from_config(tf.Qwen3_5MoeTextConfig(**text, **EXPERTS),
                                                        dtype=torch.float32, attn_implementation="eager",
                                                        experts_implementation="eager"))
    hf.save_pretrained(tmp_path / "model")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=3, lora_alpha=5, **TARGETS)), 2)
    pm.save_pretrained(tmp_path / "adapter")
    ids, labels, mask = padded_batch(3, 40, 30, 2)
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    model = load_model(tmp_path / "model", backend="numpy")
    moe = model.config.moe
    assert model.config.family == "qwen3_5_moe" and moe.sparse == (True,) * 3 and moe.normalize
    assert moe.shared_expert_size == 9
    model.load_adapter(tmp_path / "adapter")
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], out.logits.detach().numpy()[real], "hybrid_moe_logits_f32", "logits")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected) and any("experts.base_layer.lora_A" in k for k in grads)
    assert any("shared_expert_gate" in k for k in grads)
    for name, g in expected.items():
        assert_close(grads[name], g, "delta_rule_grads_f32", name)
    prompt = [5, 17, 3, 40, 22, 8]
    with torch.no_grad():
        want = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                           eos_token_id=None)[0, len(prompt):].tolist()
    assert model.generate(prompt, max_new_tokens=6) == want


def test_the_multimodal_checkpoints_language_model(tmp_path):
    """Qwen3_5MoeForConditionalGeneration as the hub ships it (model.language_model.*, a vision tower that is not
    read): the same text logits as transformers' whole class."""
    import transformers as tf

    torch.manual_seed(8)
    text = {k: v for k, v in QWEN3_5.items() if k != "intermediate_size"}
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=30)
    hf = _randomise(tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(
        text_config={**text, **EXPERTS}, vision_config=vision)))
    hf.set_experts_implementation("eager")     # torch's grouped GEMM needs 16-byte strides these sizes lack
    hf.save_pretrained(tmp_path / "model")
    model = load_model(tmp_path / "model", backend="numpy")
    assert model.config.wrapper == "Qwen3_5MoeForConditionalGeneration" and model.config.moe.num_experts == 5
    ids = np.random.default_rng(2).integers(3, 83, (1, 20))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids)).logits.numpy()
    assert_close(model.logits(ids, np.ones_like(ids)), want, "hybrid_moe_logits_f32", "logits")


def test_top_k_above_the_expert_count_is_one_line():
    raw = {**QWEN3_5, **EXPERTS, "num_experts_per_tok": 6, "architectures": ["Qwen3_5MoeForCausalLM"]}
    with pytest.raises(ConfigError, match="'num_experts_per_tok' \\(6\\) is larger than 'num_experts' \\(5\\)"):
        ModelConfig.from_dict(raw)
