"""DoRA on hybrid models' layers against PEFT, on the NumPy engine: a tiny LFM2 (the short convolution's in_proj /
out_proj beside attention) and Qwen3.5 (Gated DeltaNet's fused in-projections beside the gated attention):
logits, loss and every gradient (LoRA pairs and magnitudes) of an adapter PEFT saved with random B."""
from __future__ import annotations

import copy

import peft
import pytest
import torch

from finetune_helpers import padded_batch, peft_random_b
from test_hybrid_trl import _model
from tiny_models import save_model
from tolerances import assert_close
from wgpu_train.engines.loading import load_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_5"])
def test_dora_gradients_match_peft(tmp_path, kind):
    hf, targets = _model(kind, 83)
    save_model(hf, tmp_path / "model")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=3, lora_alpha=5, lora_dropout=0.0, target_modules=targets, use_dora=True)), 1)
    pm.save_pretrained(tmp_path / "adapter")
    ids, labels, mask = padded_batch(2, 15, 9, 2)
    pm.zero_grad()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace("_vector.default.weight", "_vector").replace(".default.", "."): p.grad.numpy()
                for n, p in pm.named_parameters() if p.requires_grad}      # a magnitude's name has no ".weight"
    model = load_model(tmp_path / "model", backend="numpy")
    model.load_adapter(tmp_path / "adapter")
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], out.logits.detach().numpy()[real],
                 "hybrid_moe_logits_f32" if kind == "qwen3_5" else "logits_f32", "logits")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected) and any("magnitude" in k for k in grads)
    for name, g in expected.items():
        assert_close(grads[name], g, "delta_rule_grads_f32" if kind == "qwen3_5" else "grads_f32", name)


def test_a_target_the_layers_lack_is_refused_naming_each_kind_of_layer(tmp_path):
    """LFM2 asked for Qwen3.5's linear-attention projection: one line naming which kind of layer has which modules."""
    from wgpu_train.adapters.config import LoraConfig
    from wgpu_train.errors import ConfigError
    from wgpu_train.models.config import ModelConfig

    hf, _ = _model("lfm2", 83)
    save_model(hf, tmp_path)
    with pytest.raises(ConfigError, match=r"in_proj_qkv: Lfm2ForCausalLM's linear modules are, by kind of layer, "
                                          r"conv layers: conv\.in_proj, conv\.out_proj; MLPs: .*; attention layers: "
                                          r"q_proj, k_proj, v_proj, out_proj \(or use all-linear\)$"):
        LoraConfig(r=2, target_modules=("in_proj_qkv",)).targets_in(ModelConfig.from_folder(tmp_path))
