"""gpt-oss against transformers 5 and PEFT 0.21 on a tiny random GptOssForCausalLM (odd sizes, sliding and full
layers in alternation, YaRN RoPE, clamps that bite): logits, full fine-tuning gradients (the attention sinks, the
router's and experts' biases), LoRA on the attention, the router and the experts in PEFT's format (loss,
gradients, the adapter both ways, merging), greedy generation over the KV cache, an MXFP4 checkpoint against its
dequantised twin, YaRN's frequencies, and what is refused in one line."""
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
from wgpu_train.errors import ConfigError, ModelFileError
from wgpu_train.formats.mxfp4 import FP4_VALUES
from wgpu_train.formats.safetensors import read_safetensors, write_safetensors
from wgpu_train.models.config import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ROUTER = "mlp.router.weight"
# YaRN over a 16-position original context with a fractional ramp over the 3 rotated pairs of a head of 6
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 4.0, "beta_slow": 0.5, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 900.0}


def gpt_oss_config(**overrides):
    """A tiny gpt-oss config: 3 layers (sliding, full, sliding, window 3), 5 experts of 13, 2 per token, a
    swiglu_limit small enough that both clamps bite on these weights."""
    import transformers as tf

    kw = dict(vocab_size=61, hidden_size=22, intermediate_size=13, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=6, num_local_experts=5, num_experts_per_tok=2, sliding_window=3,
              max_position_embeddings=64, swiglu_limit=0.8, rope_parameters=dict(YARN), eos_token_id=None)
    kw.update(overrides)
    return tf.GptOssConfig(**kw)


def build_gpt_oss(seed: int = 0, **overrides):
    """A tiny random GptOssForCausalLM (float32, eager attention and experts), norms near 1, router, sinks and
    biases random."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(gpt_oss_config(**overrides), dtype=torch.float32,
                                                attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            big = any(k in name for k in ("norm", "router", "sinks", "bias"))
            p.copy_((1.0 if "norm" in name else 0.0) + (0.3 if big else 0.15) * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = build_gpt_oss(seed=3)
    folder = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(folder)
    return hf, folder


def batch():
    ids, labels, mask = padded_batch(5, 9, 6, 2)
    return ids % 61, np.where(labels >= 0, labels % 61, labels), mask


def hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def test_config_reads_gpt_oss(tiny):
    _, folder = tiny
    cfg = ModelConfig.from_folder(folder)
    assert cfg.family == "gpt_oss" and cfg.attention_sinks and cfg.attention_bias
    assert cfg.layer_windows == (3, 0, 3)
    assert cfg.moe.router == "router" and cfg.moe.biases and cfg.moe.swiglu == (1.702, 0.8) and cfg.moe.normalize
    assert cfg.linear_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "router")
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scale == pytest.approx(0.1 * np.log(4.0) + 1.0)


def test_logits_match_transformers(tiny):
    hf, folder = tiny
    ids, _, mask = batch()
    model = load_model(folder, backend="numpy")
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], hf_logits(hf, ids, mask)[real], "logits_f32", "gpt-oss")


def test_the_clamps_bite(tiny):
    """The test model's gate and up projections cross swiglu_limit on both sides, so the clamps' gradients are
    checked by the tests below rather than passed over."""
    hf, _ = tiny
    ids, _, mask = batch()
    seen = []
    experts = hf.model.layers[0].mlp.experts
    hook = experts.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    hf_logits(hf, ids, mask)
    hook.remove()
    with torch.no_grad():
        gu = torch.einsum("nc,eci->eni", seen[0], experts.gate_up_proj) + experts.gate_up_proj_bias[:, None]
    assert (gu[..., 0::2] > 0.8).any() and (gu[..., 1::2] > 0.8).any() and (gu[..., 1::2] < -0.8).any()


def test_full_finetune_gradients_match_autograd(tiny):
    """Every weight's gradient against torch autograd: the attention sinks', the router's and the experts'
    biases', the experts' (ours keep them (E, out, in): transformers' transposed)."""
    hf, folder = tiny
    ids, labels, mask = batch()
    ref = copy.deepcopy(hf)
    out = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    model = load_model(folder, backend="numpy")
    model.set_full_finetune()
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected)
    for name, g in expected.items():
        mine = grads[name].transpose(0, 2, 1) if name.endswith(("gate_up_proj", "down_proj")) else grads[name]
        assert np.abs(g).max() > 1e-6, name
        assert_close(mine, g, "grads_f32", name)


def _peft(hf, targets, parameters, seed=1):
    cfg = peft.LoraConfig(r=3, lora_alpha=7, lora_dropout=0.0, target_modules=targets, target_parameters=parameters)
    return peft_random_b(peft.get_peft_model(copy.deepcopy(hf), cfg), seed)


def test_peft_adapter_on_experts_and_router_loads_here_with_its_gradients(tiny, tmp_path):
    """PEFT's LoRA on the attention, the router (target_parameters mlp.router.weight) and every expert: the same
    loss and the same gradient on every LoRA tensor."""
    hf, folder = tiny
    pm = _peft(hf, ["q_proj", "o_proj"], [*EXPERTS, ROUTER])
    pm.save_pretrained(tmp_path)
    ids, labels, mask = batch()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    model = load_model(folder, backend="numpy")
    model.load_adapter(tmp_path)
    assert model.lora_config.target_parameters == ("gate_up_proj", "down_proj")
    assert "router" in model.lora_config.target_modules
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected)
    assert any(".mlp.router.lora_A" in k for k in grads) and any(".experts.base_layer.lora_B" in k for k in grads)
    for name, g in expected.items():
        assert np.abs(g).max() > 1e-5, name
        assert_close(grads[name], g, "grads_f32", name)


def test_our_adapter_loads_in_peft_and_merges_as_peft(tiny, tmp_path):
    """Our LoRA on the attention, the router and the experts: PEFT loads the adapter with the same tensors and
    logits; merged, it is written in transformers' layout, which transformers reads, equal to PEFT's
    merge_and_unload."""
    import transformers as tf

    hf, folder = tiny
    model = load_model(folder, backend="numpy")
    model.add_lora(LoraConfig(r=2, alpha=5, target_modules=("q_proj", "v_proj"), target_parameters=(*EXPERTS, ROUTER)),
                   seed=2)
    rng = np.random.default_rng(0)
    model.engine.set_lora({p: (a, 0.3 * rng.standard_normal(b.shape).astype(np.float32), model._scales[p], 0.0)
                           for p, (a, b) in model.engine.lora_tensors().items()})
    model.save_adapter(tmp_path / "adapter")
    raw = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert set(raw["target_parameters"]) == {*EXPERTS, ROUTER} and set(raw["target_modules"]) == {"q_proj", "v_proj"}
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter").eval()
    theirs = {n.replace(".default.", "."): p.detach().numpy() for n, p in pm.named_parameters() if "lora_" in n}
    mine = model.lora_state_dict()
    assert set(theirs) == set(mine)
    for k, v in mine.items():
        assert_close(theirs[k], v, "exact", k)
    ids, _, mask = batch()
    real = mask.astype(bool)
    want = hf_logits(pm, ids, mask)
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32", "adapter")
    model.merge_and_save(tmp_path / "merged")
    names = read_safetensors(tmp_path / "merged" / "model.safetensors")
    assert names["model.layers.0.mlp.experts.gate_up_proj"].shape == (5, 22, 26)       # transformers' layout
    merged_hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager",
                                                        experts_implementation="eager").eval()
    with torch.no_grad():
        peft_merged = hf_logits(pm.merge_and_unload(), ids, mask)
    assert_close(hf_logits(merged_hf, ids, mask)[real], peft_merged[real], "merged_logits", "merged in transformers")
    merged = load_model(tmp_path / "merged", backend="numpy")
    assert_close(merged.logits(ids, mask)[real], peft_merged[real], "merged_logits", "merged here")


def test_all_linear_takes_the_attention_alone_as_peft(tiny):
    """PEFT 0.21's all-linear on gpt-oss resolves to the attention's projections (its router and experts are no
    nn.Linear); ours does the same."""
    hf, folder = tiny
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=2, target_modules="all-linear"))
    theirs = {n.split(".")[-1] for n in pm.peft_config["default"].target_modules}
    cfg = ModelConfig.from_folder(folder)
    lora = LoraConfig(r=2, target_modules="all-linear")
    assert set(lora.targets_in(cfg)) == theirs == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert lora.experts_in(cfg) == () and lora.as_saved(cfg).rank_pattern == {}


def test_greedy_generation_matches_transformers(tiny):
    """Greedy decoding over the KV cache, past the sliding window, token for token against transformers' generate
    (its sinks and sliding layers included)."""
    hf, folder = tiny
    prompt = np.array([5, 17, 33, 2, 41, 8, 19])
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompt[None]), max_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert load_model(folder, backend="numpy").generate(prompt, max_new_tokens=8) == want


def _mxfp4_codes(rng, shape):
    """Random e2m1 codes (..., K) and a power-of-two exponent per block of 32 (biased by 127)."""
    codes = rng.integers(0, 16, shape).astype(np.uint8)
    scales = rng.integers(120, 124, (*shape[:-1], shape[-1] // 32)).astype(np.uint8)
    return codes, scales


def write_mxfp4_pair(out, hf, seed: int = 7, dtype: str = "float32"):
    """Two folders under out of hf (its hidden and intermediate sizes multiples of 32: the blocks run along them)
    with experts made here from known e2m1 codes and exponents: "mxfp4" (blocks and scales, quantization_config
    mxfp4) and "twin" (the same experts dequantised, transformers' layout), config.json's dtype `dtype` (gpt-oss's
    hub checkpoints say bfloat16; then the other weights are rounded to bfloat16 values, as such a checkpoint
    holds them). -> (twin, mxfp4, the twin's state dict, the experts' blocks and scales)."""
    from wgpu_train.formats.safetensors import bfloat16_bits, bfloat16_values

    rng = np.random.default_rng(seed)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    if dtype == "bfloat16":
        state = {k: bfloat16_values(bfloat16_bits(v)).reshape(v.shape) for k, v in state.items()}
    quantised = {}
    cfg = hf.config
    experts, hidden, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    for i in range(cfg.num_hidden_layers):
        for name, rows, k in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            codes, scales = _mxfp4_codes(rng, (experts, rows, k))
            values = FP4_VALUES[codes] * np.exp2(scales.astype(np.float32) - 127).repeat(32, axis=-1)
            key = f"model.layers.{i}.mlp.experts.{name}"
            state[key] = np.ascontiguousarray(values.transpose(0, 2, 1))          # transformers' (E, in, out)
            blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(experts, rows, k // 32, 16)
            quantised[key + "_blocks"], quantised[key + "_scales"] = blocks, scales
    config = {**json.loads(cfg.to_json_string()), "architectures": ["GptOssForCausalLM"], "dtype": dtype}
    for folder, tensors, extra in (("twin", state, {}),
                                   ("mxfp4", {**{k: v for k, v in state.items() if not k.endswith("_proj")},
                                              **quantised}, {"quantization_config": {"quant_method": "mxfp4"}})):
        (out / folder).mkdir()
        write_safetensors(out / folder / "model.safetensors", tensors, metadata={"format": "pt"})
        (out / folder / "config.json").write_text(json.dumps({**config, **extra}))
    return out / "twin", out / "mxfp4", state, quantised


def test_mxfp4_checkpoint_equals_its_dequantised_twin(tmp_path):
    """A checkpoint whose experts are MXFP4 blocks and scales, built here from known e2m1 codes and exponents,
    gives the model of its dequantised twin (transformers' layout) exactly, and transformers' logits with those
    weights; one with a scale tensor missing is refused in one line naming it."""
    hf = build_gpt_oss(seed=4, hidden_size=32, intermediate_size=32)     # the blocks run over hidden and I
    twin, packed, state, quantised = write_mxfp4_pair(tmp_path, hf)
    ids, _, mask = batch()
    mine = load_model(packed, backend="numpy").logits(ids, mask)
    assert_close(mine, load_model(twin, backend="numpy").logits(ids, mask), "exact", "twin")
    with torch.no_grad():
        hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    real = mask.astype(bool)
    assert_close(mine[real], hf_logits(hf, ids, mask)[real], "logits_f32", "mxfp4")
    del quantised["model.layers.1.mlp.experts.down_proj_scales"]
    write_safetensors(packed / "model.safetensors",
                      {**{k: v for k, v in state.items() if not k.endswith("_proj")}, **quantised})
    with pytest.raises(ModelFileError, match="MXFP4 tensor model.layers.1.mlp.experts.down_proj_blocks has no "
                                             "model.layers.1.mlp.experts.down_proj_scales"):
        load_model(packed, backend="numpy")


@pytest.mark.parametrize("params", [
    YARN,
    {**YARN, "truncate": True},
    {**YARN, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096,
     "rope_theta": 150000.0},
    {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5},
    {**YARN, "attention_factor": 1.3},
])
def test_yarn_matches_transformers(params):
    """YaRN's inverse frequencies and attention factor against transformers' _compute_yarn_parameters (head_dim
    64 here, so that the ramp spans many pairs)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = gpt_oss_config(head_dim=64, max_position_embeddings=8192, rope_parameters=dict(params))
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    cfg = ModelConfig.from_dict(json.loads(hf_cfg.to_json_string()) | {"architectures": ["GptOssForCausalLM"]})
    assert cfg.rope_scale == pytest.approx(factor, rel=1e-12)
    # transformers computes them in float32
    assert_close(cfg.inv_freq(0).astype(np.float32), inv.numpy(), "inv_freq", "yarn")


@pytest.mark.parametrize("change, match", [
    ({"attention_dropout": 0.1}, "'attention_dropout' is 0.1; only 0"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'quantization_config' has quant_method"),
    ({"swiglu_limit": -1.0}, "'swiglu_limit' must be a positive number"),
    ({"num_experts_per_tok": 6}, "'num_experts_per_tok' \\(6\\) is larger than 'num_local_experts' \\(5\\)"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "gpt_oss supports 'yarn'"),
])
def test_unsupported_gpt_oss_configs_are_refused_naming_the_field(change, match):
    raw = {**json.loads(gpt_oss_config().to_json_string()), "architectures": ["GptOssForCausalLM"], **change}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_top_k_then_softmax_is_the_renormalised_route():
    """gpt-oss's route (top-k of the logits, a softmax over the k) is moe_route_* with normalize: the same weights
    and experts, and the same gradient on the logits (torch autograd through transformers' form)."""
    from wgpu_train.engines.shared.moe import moe_route_backward, moe_route_forward

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((7, 5))
    dweights = rng.standard_normal((7, 2))
    t = torch.tensor(logits, requires_grad=True)
    top, chosen = torch.topk(t, 2, dim=-1)
    want = torch.softmax(top, dim=-1)
    (want * torch.tensor(dweights)).sum().backward()
    weights, experts = moe_route_forward(logits, 2, True)
    assert np.array_equal(experts, chosen.numpy())
    assert_close(weights, want.detach().numpy(), "route_f64", "weights")
    assert_close(moe_route_backward(dweights, logits, experts, True), t.grad.numpy(), "route_f64", "dlogits")
