"""DoRA (PEFT's use_dora) against PEFT and torch autograd: logits, loss and the gradients of A, B and the
magnitudes on the NumPy engine (LoRA dropout included, with PEFT given the same masks), adapters both ways,
the merge; the WebGPU engine against the NumPy engine (gradients, AdamW steps, gradient checkpointing, NF4)."""
from __future__ import annotations

import copy

import numpy as np
import peft
import pytest
import torch

from conftest import require_adapter
from tiny_models import build_model, save_model
from tolerances import assert_close
from wgpu_train.config import LoraConfig, OptimizerParams
from wgpu_train.dora import magnitude_key
from wgpu_train.errors import ConfigError
from wgpu_train.model import load_model
from wgpu_train.reference import ops

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Qwen2 (q/k/v biases: DoRA scales W x, not the bias)."""
    hf = build_model("qwen2", seed=5)
    folder = tmp_path_factory.mktemp("qwen2")
    save_model(hf, folder)
    return hf, folder


def peft_dora(hf, seed=0, dropout=0.0):
    """A PEFT DoRA model on every linear module, B random and the magnitudes moved off their initial norms."""
    cfg = peft.LoraConfig(r=3, lora_alpha=5, lora_dropout=dropout, target_modules=TARGETS, use_dora=True)
    pm = peft.get_peft_model(copy.deepcopy(hf), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    return pm.eval()


def batch():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 83, (2, 9))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    labels = np.where(mask == 1, ids, -100)
    labels[:, :2] = -100
    return ids, labels, mask


def peft_grads(pm, ids, labels, mask):
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    grads = {}
    for n, p in pm.named_parameters():
        if p.requires_grad:
            key = n.replace(".default.", ".")
            grads[key[:-len(".weight")] if "magnitude" in key else key] = p.grad.numpy()
    return out.loss.item(), grads


class FixedMask(torch.nn.Module):
    """PEFT's lora_dropout replaced by the mask the NumPy engine drew."""

    def __init__(self, mask):
        super().__init__()
        self.mask = torch.tensor(mask)

    def forward(self, x):
        return x * self.mask.reshape(x.shape)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_numpy_matches_peft(tiny, tmp_path, dropout):
    """A PEFT DoRA adapter loads here: logits, loss and the gradients of A, B and m equal PEFT's (with
    dropout: PEFT's dropout modules apply the masks this engine drew)."""
    hf, folder = tiny
    pm = peft_dora(hf, seed=1)
    pm.save_pretrained(tmp_path)
    ids, labels, mask = batch()
    model = load_model(folder)
    model.load_adapter(tmp_path, dropout=dropout)
    assert model.lora_config.use_dora
    real = mask.astype(bool)
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    if dropout:
        eng, n = model.engine, ids.size      # dropout_calls still counts the call just made
        for name, module in pm.base_model.model.named_modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                layer, mod = int(name.split(".")[2]), name.rsplit(".", 1)[1]
                m = ops.dropout_mask(eng.dropout_module_seed(layer, mod), (n, module.in_features), dropout)
                module.lora_dropout["default"] = FixedMask(m)
        pm.train()
    theirs_loss, expected = peft_grads(pm, ids, labels, mask)
    assert_close(loss, theirs_loss, "loss_f32", "loss")
    assert set(grads) == set(expected) and len(grads) == 3 * 7 * 2
    for name, g in expected.items():
        assert np.abs(g).max() > 1e-4, name
        assert_close(grads[name], g, "grads_f32", name)


def test_our_adapter_loads_in_peft_and_merges(tiny, tmp_path):
    """Ours in PEFT: the same tensors (use_dora, lora_magnitude_vector) and logits; our merge equals PEFT's
    merge_and_unload."""
    hf, folder = tiny
    model = load_model(folder)
    model.add_lora(LoraConfig(r=3, alpha=5, target_modules="all-linear", use_dora=True), seed=2)
    rng = np.random.default_rng(0)
    current = model.engine.trainable()
    model.engine.set_trainable({k: (0.3 * rng.standard_normal(v.shape) if k.endswith("lora_B") else
                                    v * (1 + 0.2 * rng.standard_normal(v.shape)) if "magnitude" in k else v)
                                for k, v in current.items()})
    model.save_adapter(tmp_path)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    assert pm.peft_config["default"].use_dora
    ours = model.lora_state_dict()
    assert any(k == magnitude_key("model.layers.1.mlp.down_proj") for k in ours)
    for k, v in peft.get_peft_model_state_dict(pm).items():
        assert_close(v.numpy(), ours[k], "exact", k)
    ids, _, mask = batch()
    real = mask.astype(bool)
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32")
    merged = pm.merge_and_unload().state_dict()
    for name, w in model.merged_weights().items():
        if name.endswith("_proj.weight"):
            assert_close(w, merged[name].numpy(), "merged_weights", name)


def test_magnitude_starts_at_the_weight_norm(tiny):
    """add_lora: m = ||W|| per output row (B = 0), as PEFT initialises it; the model's output is unchanged."""
    hf, folder = tiny
    model = load_model(folder)
    ids, _, mask = batch()
    before = model.logits(ids, mask)
    model.add_lora(LoraConfig(r=2, alpha=4, target_modules="q_proj,down_proj", use_dora=True), seed=0)
    w = model.engine.weights()
    for path, m in model._magnitudes().items():
        assert_close(m, np.linalg.norm(w[path + ".weight"].astype(np.float64), axis=1).astype(np.float32), "exact", path)
    assert_close(model.logits(ids, mask), before, "dora_identity", "a fresh DoRA adapter changes nothing")


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_refused_combinations(init):
    with pytest.raises(ConfigError, match="DoRA"):
        LoraConfig(use_dora=True, init=init)
