"""LFM2-MoE (Lfm2MoeForCausalLM: LFM2's conv / attention layers, dense MLPs first, then sigmoid-routed experts with a
choosing expert_bias) on the NumPy engine against transformers 5 and PEFT: the config read and its refusals, the
sigmoid route op pair against autograd, logits, LoRA gradients on the experts (target_parameters), attention and
conv, full fine-tuning gradients, adapters both ways, all-linear as PEFT's, the hub's per-expert layout, greedy generation (the WebGPU engine's: test_lfm2_moe_wgpu.py)."""
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
from wgpu_train.engines.loading import load_model
from wgpu_train.engines.shared.moe import moe_route_backward, moe_route_forward
from wgpu_train.errors import ConfigError
from wgpu_train.formats.safetensors import read_safetensors, write_safetensors
from wgpu_train.models.config import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# odd sizes; layer 0 dense (intermediate_size 45 as it is), layers 1-2 sparse (5 experts of 23, top 2)
LFM2_MOE = dict(vocab_size=83, hidden_size=30, intermediate_size=45, moe_intermediate_size=23, num_hidden_layers=3,
                num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64, norm_eps=1e-5,
                conv_L_cache=3, layer_types=["conv", "full_attention", "conv"], num_dense_layers=1, num_experts=5,
                num_experts_per_tok=2, routed_scaling_factor=1.7, tie_word_embeddings=False, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
TARGETS = ["in_proj", "q_proj", "out_proj", "w1"]
EXPERTS = ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]


def build(seed: int = 3, **change):
    """A tiny random LFM2-MoE (eager attention) with every weight and the expert biases random."""
    import transformers as tf

    torch.manual_seed(seed)
    # the experts' eager loop: torch's grouped GEMM needs 16-byte strides, which these odd sizes do not have
    hf = tf.AutoModelForCausalLM.from_config(tf.Lfm2MoeConfig(**{**LFM2_MOE, **change}), dtype=torch.float32,
                                             attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.5 * torch.randn_like(b))       # large enough to change which experts are chosen
    return hf.eval()


@pytest.fixture(scope="module")
def lfm2_moe(tmp_path_factory):
    """The model saved to a folder, and a PEFT adapter with random B on both layer kinds, a dense MLP and every
    expert."""
    hf = build()
    folder = tmp_path_factory.mktemp("lfm2_moe")
    hf.save_pretrained(folder / "model")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=3, lora_alpha=5, target_modules=TARGETS, target_parameters=EXPERTS)), 1)
    pm.save_pretrained(folder / "adapter")
    return hf, pm, folder


def test_config_reads_dense_and_sparse_layers_and_the_sigmoid_router(lfm2_moe):
    hf, _, folder = lfm2_moe
    cfg = ModelConfig.from_folder(folder / "model")
    moe = cfg.moe
    assert cfg.family == "lfm2_moe" and cfg.conv_layers == (True, False, True) and cfg.qk_norm
    assert cfg.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features == 45    # no LFM2 adjustment
    assert moe.sparse == (False, True, True) and (moe.num_experts, moe.top_k, moe.expert_size) == (5, 2, 23)
    assert (moe.scoring, moe.expert_bias, moe.scaling, moe.normalize, moe.block) == ("sigmoid", True, 1.7, True,
                                                                                     "feed_forward")
    assert cfg.layer_modules(0) == ("conv.in_proj", "conv.out_proj", "feed_forward.w1", "feed_forward.w3",
                                    "feed_forward.w2")
    assert cfg.layer_modules(1) == ("q_proj", "k_proj", "v_proj", "out_proj", "feed_forward.gate")


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 6}, "'num_experts_per_tok' \\(6\\) is larger than 'num_experts' \\(5\\)"),
    ({"num_dense_layers": -1}, "field 'num_dense_layers' must be an integer >= 0"),
    ({"routed_scaling_factor": 0}, "field 'routed_scaling_factor' must be a positive number"),
    ({"conv_bias": True}, "field 'conv_bias' is true"),
])
def test_unsupported_configs_are_one_line(change, message):
    raw = {**LFM2_MOE, "architectures": ["Lfm2MoeForCausalLM"], **change}
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("normalize", [True, False])
def test_sigmoid_route_matches_transformers_router_and_autograd(normalize):
    """The op pair against Lfm2MoeTopKRouter's forward (weights and choice, with the bias choosing) and torch
    autograd's gradient of the logits, in float64: only the chosen experts' logits get one."""
    import transformers as tf
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter

    rng = np.random.default_rng(1)
    logits, bias, dw = rng.normal(size=(7, 5)), rng.normal(size=5), rng.normal(size=(7, 2))
    router = Lfm2MoeTopKRouter(tf.Lfm2MoeConfig(**{**LFM2_MOE, "norm_topk_prob": normalize})).double()
    with torch.no_grad():
        router.weight.copy_(torch.eye(5, 30, dtype=torch.float64))
    hidden = torch.zeros(7, 30, dtype=torch.float64)
    hidden[:, :5] = torch.tensor(logits)
    hidden.requires_grad_(True)
    _, want_w, want_e = router(hidden, torch.tensor(bias))
    weights, experts = moe_route_forward(logits, 2, normalize, "sigmoid", bias, 1.7)
    assert np.array_equal(experts, want_e.numpy())
    assert_close(weights, want_w.detach().numpy(), "route_f64", "weights")
    (want_w * torch.tensor(dw)).sum().backward()
    dlogits = moe_route_backward(dw, logits, experts, normalize, None, "sigmoid", 1.7)
    assert_close(dlogits, hidden.grad.numpy()[:, :5], "route_f64", "dlogits")
    assert np.count_nonzero(dlogits, axis=1).max() == 2


def test_logits_loss_and_lora_gradients_match_peft(lfm2_moe):
    """A padded batch through PEFT's adapter on attention, conv, a dense MLP and every expert."""
    _, pm, folder = lfm2_moe
    ids, labels, mask = padded_batch(2, 15, 9, 2)
    ids, labels = ids % 83, np.where(labels >= 0, labels % 83, labels)
    pm.zero_grad()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    model = load_model(folder / "model", backend="numpy")
    model.load_adapter(folder / "adapter")
    assert model.lora_config.target_parameters == ("gate_up_proj", "down_proj")
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], out.logits.detach().numpy()[real], "logits_f32", "logits")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected) and any(".feed_forward.experts." in k for k in grads)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def test_full_finetune_gradients_match_autograd(lfm2_moe):
    """Every parameter's gradient (the router's and the experts' among them); expert_bias, a buffer, is not trained."""
    hf, _, folder = lfm2_moe
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


def test_adapters_both_ways_and_all_linear_as_peft(lfm2_moe, tmp_path):
    """Ours saved from PEFT's adapter loads in PEFT with the same logits and feed_forward's target_parameters;
    all-linear takes PEFT 0.21's modules on Lfm2Moe (every nn.Linear but lm_head: not the router, nor the
    experts)."""
    hf, _, folder = lfm2_moe
    model = load_model(folder / "model", backend="numpy")
    model.load_adapter(folder / "adapter")
    model.save_adapter(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert set(saved["target_parameters"]) == set(EXPERTS) and set(saved["target_modules"]) == set(TARGETS)
    back = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    ids, _, mask = padded_batch(5, 12, 8, 2)
    ids = ids % 83
    with torch.no_grad():
        want = back(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32", "PEFT reading ours")

    theirs = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=2, target_modules="all-linear"))
    peft_paths = {n.removeprefix("base_model.model.").split(".lora_A")[0] for n, _ in theirs.named_parameters()
                  if ".lora_A." in n}
    lora = LoraConfig(r=2, alpha=4, target_modules="all-linear")
    mine = model.config
    assert {f"model.layers.{i}.{'self_attn.' if '.' not in m else ''}{m}" for i in range(3)
            for m in lora.targets_in(mine) if m in mine.layer_modules(i)} == peft_paths
    model.add_lora(lora, seed=0)
    model.save_adapter(tmp_path / "all")
    peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "all")       # every key is one PEFT expects


def test_hub_per_expert_layout_reads_the_same(lfm2_moe, tmp_path):
    """The hub's checkpoint (feed_forward.experts.N.w1 / w3 / w2) gives the same logits as transformers' fused one."""
    _, _, folder = lfm2_moe
    fused = read_safetensors(folder / "model" / "model.safetensors")
    hub = {}
    for name, x in fused.items():
        block, _, param = name.rpartition(".experts.")
        if param == "gate_up_proj":
            for e, rows in enumerate(x):
                half = len(rows) // 2
                hub[f"{block}.experts.{e}.w1.weight"], hub[f"{block}.experts.{e}.w3.weight"] = rows[:half], rows[half:]
        elif param == "down_proj":
            hub.update({f"{block}.experts.{e}.w2.weight": w for e, w in enumerate(x)})
        else:
            hub[name] = x
    (tmp_path / "config.json").write_text((folder / "model" / "config.json").read_text())
    write_safetensors(tmp_path / "model.safetensors", hub)
    ids, _, mask = padded_batch(5, 10, 6, 2)
    ids = ids % 83
    a = load_model(folder / "model", backend="numpy").logits(ids, mask)
    b = load_model(tmp_path, backend="numpy").logits(ids, mask)
    assert_close(b, a, "exact", "hub layout")


def test_greedy_generation_matches_transformers(lfm2_moe):
    _, pm, folder = lfm2_moe
    model = load_model(folder / "model", backend="numpy")
    model.load_adapter(folder / "adapter")
    prompt = [5, 17, 3, 40, 22, 8, 9]
    with torch.no_grad():
        want = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                           eos_token_id=None)[0, len(prompt):].tolist()
    assert model.generate(prompt, max_new_tokens=10) == want


def test_the_router_aux_loss_is_refused(lfm2_moe):
    _, _, folder = lfm2_moe
    model = load_model(folder / "model", backend="numpy")
    with pytest.raises(ConfigError, match="sigmoid router has no load-balancing loss"):
        model.engine.set_router_aux_loss(0.01)
