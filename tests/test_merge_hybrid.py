"""merge of the hybrid families (LFM2's short convolutions, Qwen3.5 and Qwen3-Next's Gated DeltaNet, SmolLM3's NoPE
layers, Qwen3.5's multimodal class with its vision tower carried untouched): the merged folder holds PEFT's
merge_and_unload tensors and loads in transformers with its logits."""
from __future__ import annotations

import copy

import numpy as np
import peft
import pytest
import torch

from finetune_helpers import peft_random_b
from test_hybrid_layers import SMOLLM3
from test_lfm2 import LFM2
from test_qwen3_5 import QWEN3_5, _randomise
from tolerances import assert_close
from wgpu_train.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# each family's config and the modules of all its layer kinds that the adapter covers (PEFT reads Qwen3-Next's MLP
# names as its experts' even without experts, so its adapter stays on the attention of both kinds)
CASES = {
    "lfm2": ("Lfm2Config", LFM2, ["in_proj", "out_proj", "q_proj", "w2"]),
    "qwen3_5": ("Qwen3_5TextConfig", QWEN3_5, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                                               "q_proj", "down_proj"]),
    "qwen3_next": ("Qwen3NextConfig", {**QWEN3_5, "num_experts": 0}, ["in_proj_qkvz", "in_proj_ba", "out_proj",
                                                                      "k_proj", "o_proj"]),
    "smollm3": ("SmolLM3Config", SMOLLM3, ["q_proj", "v_proj", "o_proj", "gate_proj"]),
}


def build_hybrid(kind: str, seed: int = 7):
    """A tiny random model of `kind` (eager attention, float32, norms and A_log away from their inits)."""
    import transformers as tf

    torch.manual_seed(seed)
    cls, kw, _ = CASES[kind]
    cfg = getattr(tf, cls)(**kw)
    return _randomise(tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager"))


def peft_merged(hf, targets, root, seed=1, **lora):
    """Save `hf` and a PEFT adapter on `targets` (random B; `lora`: more LoraConfig fields) under root; returns
    (model, adapter, PEFT's merged model)."""
    hf.save_pretrained(root / "model")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=3, lora_alpha=5,
                                                                             target_modules=targets, **lora)), seed)
    pm.save_pretrained(root / "adapter")
    return root / "model", root / "adapter", pm.merge_and_unload().eval()


def assert_same_model(merged_folder, want, ids, cls=None, **load):
    """The merged folder holds the tensors `want` (PEFT's merged model) saves, in the same layout, within float32
    rounding, and gives its logits in transformers."""
    import transformers as tf
    from safetensors.torch import load_file

    cls = cls or tf.AutoModelForCausalLM
    got = cls.from_pretrained(merged_folder, dtype=torch.float32, attn_implementation="eager", **load).eval()
    want.save_pretrained(merged_folder.parent / "peft-merged")
    stored = load_file(str(merged_folder / "model.safetensors"))
    expected = load_file(str(merged_folder.parent / "peft-merged" / "model.safetensors"))
    assert set(stored) == set(expected)
    for name, value in stored.items():
        assert_close(value.float().numpy(), expected[name].float().numpy(), "merged_weights", name)
    with torch.no_grad():
        assert_close(got(input_ids=ids).logits.numpy(), want(input_ids=ids).logits.numpy(), "logits_f32", "logits")


@pytest.mark.parametrize("kind", list(CASES))
def test_merge_equals_peft_merge_and_unload(tmp_path, kind):
    model, adapter, want = peft_merged(build_hybrid(kind), CASES[kind][2], tmp_path)
    out = tmp_path / "merged"
    assert main(["merge", "--model", str(model), "--adapter-path", str(adapter), "--out", str(out)]) == 0
    ids = torch.tensor(np.random.default_rng(0).integers(3, 83, (1, 19)))
    assert_same_model(out, want, ids)


def test_merge_of_the_multimodal_qwen3_5_carries_its_vision_tower(tmp_path):
    """Qwen3_5ForConditionalGeneration (model.language_model.*): the merged folder is the same class, the vision
    tower's tensors byte for byte the base's, the language model's PEFT's merge."""
    import transformers as tf
    from safetensors.torch import load_file

    torch.manual_seed(6)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=30)
    hf = _randomise(tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=QWEN3_5, vision_config=vision)))
    regex = r"model\.language_model\.layers\.\d+\.(?:linear_attn\.in_proj_qkv|linear_attn\.out_proj|self_attn\.q_proj)"
    model, adapter, want = peft_merged(hf, regex, tmp_path)
    out = tmp_path / "merged"
    assert main(["merge", "--model", str(model), "--adapter-path", str(adapter), "--out", str(out)]) == 0
    base, stored = load_file(str(model / "model.safetensors")), load_file(str(out / "model.safetensors"))
    visual = [k for k in base if "visual" in k]
    assert visual and all(torch.equal(base[k], stored[k]) for k in visual)
    ids = torch.tensor(np.random.default_rng(0).integers(3, 83, (1, 19)))
    assert_same_model(out, want, ids, tf.Qwen3_5ForConditionalGeneration)


@pytest.mark.parametrize("cls", ["Qwen3NextConfig", "Qwen3_5MoeTextConfig"])
def test_merge_with_experts_equals_peft_merge_and_unload(tmp_path, cls):
    """Qwen3-Next and Qwen3.5-MoE with routed experts and a shared expert: LoRA on both layer kinds and on the
    experts (PEFT's target_parameters), merged as PEFT merges it."""
    import transformers as tf

    torch.manual_seed(9)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=11, shared_expert_intermediate_size=9)
    text = {k: v for k, v in QWEN3_5.items() if k != "intermediate_size"}
    hf = _randomise(tf.AutoModelForCausalLM.from_config(getattr(tf, cls)(**text, **experts), dtype=torch.float32,
                                                        attn_implementation="eager", experts_implementation="eager"))
    targets = ["in_proj_qkvz" if cls == "Qwen3NextConfig" else "in_proj_qkv", "q_proj"]
    model, adapter, want = peft_merged(hf, targets, tmp_path,
                                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    out = tmp_path / "merged"
    assert main(["merge", "--model", str(model), "--adapter-path", str(adapter), "--out", str(out)]) == 0
    ids = torch.tensor(np.random.default_rng(0).integers(3, 83, (1, 19)))
    assert_same_model(out, want, ids, experts_implementation="eager")
