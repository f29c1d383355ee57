"""LoRA on Qwen3-VL's and Qwen3.5's vision tower on the NumPy engine (issue 46) against PEFT: the blocks' qkv, proj,
linear_fc1 / linear_fc2 and the mergers' (DeepStack's too) beside the language model's LoRA: loss and every LoRA
gradient equal PEFT's autograd, the saved adapter loads in PeftModel with the same logits; --lora-targets naming
the tower's modules trains from the CLI."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from wgpu_train.errors import ConfigError

from finetune_helpers import peft_random_b
from tolerances import assert_close

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("PIL.Image")

from test_qwen3_vl import PAD, hf_inputs, images, records, span, vlm  # noqa: E402,F401
from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402
from wgpu_train.models.vision import split_targets  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TARGETS = r".*(language_model.*\.(q_proj|v_proj)|visual.*\.(qkv|attn\.proj|linear_fc1|linear_fc2))"


def peft_key(name: str) -> str:
    return name.replace(".default", "").replace("model.language_model.", "model.")


def check_against_peft(hf, folder, tmp_path, imgs, rows, rank=2, alpha=5):
    """PEFT's LoRA on the language model and the whole tower (B random), loaded from its files: our loss and
    every gradient equal its autograd's; our saved adapter's logits in PeftModel equal ours."""
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0)))
    vm = load_vision_model(folder)
    width = max(map(len, rows))
    ids = np.array([r + [0] * (width - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = np.where((ids != PAD) & (mask == 1), ids, -100)
    out = pm(**hf_inputs(vm, ids, imgs), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {peft_key(n): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    assert any(".visual.merger." in k for k in expected) and any(".attn.qkv." in k for k in expected)
    pm.save_pretrained(tmp_path / "peft")
    vm.load_adapter(tmp_path / "peft")
    loss, grads = vm.loss_and_grads(ids, labels, imgs, attention_mask=mask)
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "loss with tower LoRA")
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)
    vm.save_adapter(tmp_path / "ours")
    ours = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    with torch.no_grad():
        want = ours(**hf_inputs(vm, ids[:1, :len(rows[0])], imgs[:2])).logits.numpy()
        plain = hf(**hf_inputs(vm, ids[:1, :len(rows[0])], imgs[:2])).logits.numpy()
    got = vm.logits(ids[:1, :len(rows[0])], imgs[:2])
    assert_close(got, want, "logits_f32", "saved adapter in PeftModel")
    assert np.abs(got - plain).max() > 1e-3         # the adapter changes them


def test_qwen3_vl_tower_lora_gradients_and_adapter_equal_peft(vlm, tmp_path):
    """Qwen3-VL: the DeepStack mergers' gradients come from the language model's image rows at their layers."""
    hf, folder, vm = vlm
    imgs = images(3, seed=3)
    rows = [[7, *span(vm, imgs[0]), 11, 12, *span(vm, imgs[1]), 13, 14], [8, 9, *span(vm, imgs[2]), 15]]
    check_against_peft(hf, folder, tmp_path, imgs, rows)


def test_qwen3_5_tower_lora_gradients_and_adapter_equal_peft(tmp_path):
    """Qwen3.5: the tower without DeepStack beside the hybrid language model."""
    from test_qwen3_5_vision import build

    folder = tmp_path / "model"
    hf = build(folder)
    vm = load_vision_model(folder)
    imgs = images(3, seed=4)
    rows = [[7, *span(vm, imgs[0]), 11, *span(vm, imgs[1]), 13], [8, 9, *span(vm, imgs[2]), 15]]
    check_against_peft(hf, folder, tmp_path, imgs, rows)


def test_split_targets_names_qwen_tower_modules():
    assert split_targets("q_proj,v_proj,qkv,attn.proj,linear_fc2") == ("q_proj,v_proj",
                                                                      ("qkv", "attn.proj", "linear_fc2"))
    assert split_targets(["q_proj", "visual", "visual.merger.linear_fc1"]) == (["q_proj"],
                                                                              ("blocks", "merger.linear_fc1"))
    with pytest.raises(ConfigError, match="not the patch embedding"):
        split_targets("q_proj,visual.patch_embed.proj")
