"""LFM2 (Lfm2ForCausalLM: double-gated short convolutions between GQA attention layers) on the NumPy engine against
transformers 5 and PEFT: the config read and its refusals, the convolution op over packed segments, logits, loss,
LoRA and full fine-tuning gradients, adapters both ways, greedy generation through the per-row recurrent state,
batched and continuous generation equal to each row alone."""
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
from wgpu_train.engines.generate import DecodeBatch
from wgpu_train.engines.loading import load_model
from wgpu_train.engines.shared.short_conv import short_conv_backward, short_conv_forward
from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig
from wgpu_train.models.weights import FINAL_NORM, final_norm_name

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# odd sizes; the block_* rule gives the MLP 2/3 of 61 = 40, times 1.3 = 52, rounded up to a multiple of 7: 56
LFM2 = dict(vocab_size=83, hidden_size=30, intermediate_size=61, num_hidden_layers=4, num_attention_heads=3,
            num_key_value_heads=1, max_position_embeddings=64, norm_eps=1e-5, conv_L_cache=3,
            layer_types=["conv", "full_attention", "conv", "conv"], block_multiple_of=7, block_ffn_dim_multiplier=1.3,
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TARGETS = ["in_proj", "out_proj", "q_proj", "w2"]     # both layer kinds' modules, the conv's and attention's out_proj


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """A tiny random LFM2 (eager attention) saved to a folder, and a PEFT adapter on it with random B."""
    import transformers as tf

    torch.manual_seed(3)
    hf = tf.AutoModelForCausalLM.from_config(tf.Lfm2Config(**LFM2), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
    hf.eval()
    folder = tmp_path_factory.mktemp("lfm2")
    hf.save_pretrained(folder / "model")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=3, lora_alpha=5,
                                                                             target_modules=TARGETS)), 1)
    pm.save_pretrained(folder / "adapter")
    return hf, pm, folder


def test_config_reads_layer_kinds_and_the_feed_forward_width(lfm2):
    hf, _, folder = lfm2
    cfg = ModelConfig.from_folder(folder / "model")
    assert cfg.conv_layers == (True, False, True, True) and cfg.conv_kernel == 3 and cfg.recurrent
    assert cfg.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features == 56
    assert cfg.rms_norm_eps == 1e-5 and cfg.qk_norm and not cfg.tie_word_embeddings
    assert cfg.layer_modules(0) == ("conv.in_proj", "conv.out_proj", "feed_forward.w1", "feed_forward.w3",
                                    "feed_forward.w2")
    assert cfg.layer_modules(1)[:4] == ("q_proj", "k_proj", "v_proj", "out_proj")


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["conv", "full_attention"]}, "'layer_types' must list a kind for each of the 4 layers"),
    ({"layer_types": ["conv", "sliding_attention", "conv", "conv"]}, "layer kind 'sliding_attention'"),
    ({"conv_bias": True}, "field 'conv_bias' is true"),
    ({"architectures": ["Lfm2VlForConditionalGeneration"]}, "a Lfm2VlForConditionalGeneration config needs a "
                                                            "'text_config' object"),   # LFM2-VL: test_lfm2_vl.py
])
def test_unsupported_configs_are_one_line(change, message):
    raw = {**LFM2, "architectures": ["Lfm2ForCausalLM"], **change}
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(err.value)


def test_short_conv_over_packed_segments_equals_each_alone():
    """The op pair over two rows (three packed sequences; a padded one) against torch's depthwise Conv1d on each
    sequence alone, with autograd's gradients of the input and the weight, in float64."""
    rng = np.random.default_rng(0)
    x, w, dy = rng.normal(size=(2, 11, 5)), rng.normal(size=(5, 1, 4)), rng.normal(size=(2, 11, 5))
    segments = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]])
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    want = torch.zeros_like(tx)
    for b, s in zip(*np.nonzero(np.diff(segments, prepend=-1, axis=1) != 0)):     # each sequence's start
        if segments[b, s] == 0:
            continue
        end = s + int(np.sum(segments[b] == segments[b, s]))
        piece = tx[b, s:end].T[None]                                            # (1, C, n)
        out = torch.nn.functional.conv1d(piece, tw, padding=3, groups=5)[0, :, :end - s]
        want = want.index_put((torch.tensor([b]), torch.arange(s, end)), out.T)
    (want * torch.tensor(dy)).sum().backward()
    real = segments != 0
    y = short_conv_forward(x, w, segments)
    assert_close(y[real], want.detach().numpy()[real], "short_conv_f64", "y")
    dx, dw = short_conv_backward(np.where(real[..., None], dy, 0), x, w, segments)
    assert_close(dx, tx.grad.numpy(), "short_conv_f64", "dx")
    assert_close(dw, tw.grad.numpy(), "short_conv_f64", "dweight")


def test_logits_loss_and_lora_gradients_match_peft(lfm2):
    """A padded batch of 15 tokens (five conv windows of 3) through an adapter on both layer kinds' modules."""
    _, pm, folder = lfm2
    ids, labels, mask = padded_batch(2, 15, 9, 2)
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
    assert set(grads) == set(expected) and any(".conv.in_proj." in k for k in grads)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def test_full_finetune_gradients_match_autograd(lfm2):
    """Every weight's gradient, the convolutions' (C, 1, K) weights and the final embedding_norm among them."""
    hf, _, folder = lfm2
    ids, labels, mask = padded_batch(4, 15, 10, 2)
    model = copy.deepcopy(hf)
    model.zero_grad()
    model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)).loss.backward()
    ours = load_model(folder / "model", backend="numpy")
    ours.set_full_finetune()
    _, grads = ours.loss_and_grads(ids, labels, mask)
    cfg = ours.config
    expected = {n: p.grad.numpy() for n, p in model.named_parameters()}
    assert {final_norm_name(cfg) if k == FINAL_NORM else k for k in grads} == set(expected)
    assert np.abs(grads["model.layers.0.conv.conv.weight"]).max() > 1e-3
    for name, g in grads.items():
        assert_close(g, expected[final_norm_name(cfg) if name == FINAL_NORM else name], "grads_f32", name)


def test_adapters_both_ways_and_all_linear_as_peft(lfm2, tmp_path):
    """Ours saved from PEFT's adapter loads in PEFT with the same logits; all-linear takes PEFT 0.21's modules (every
    nn.Linear but lm_head: in_proj, out_proj, q / k / v_proj, w1 / w2 / w3; not the convolution)."""
    hf, pm, folder = lfm2
    model = load_model(folder / "model", backend="numpy")
    model.load_adapter(folder / "adapter")
    model.save_adapter(tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    ids, _, mask = padded_batch(5, 12, 8, 2)
    with torch.no_grad():
        want = back(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32", "PEFT reading ours")
    saved = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert set(saved["target_modules"]) == set(TARGETS)

    theirs = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=2, target_modules="all-linear"))
    peft_paths = {n.removeprefix("base_model.model.").split(".lora_A")[0] for n, _ in theirs.named_parameters()
                  if ".lora_A." in n}
    lora = LoraConfig(r=2, alpha=4, target_modules="all-linear")
    assert set(lora.modules(model.config)) == peft_paths
    model.add_lora(lora, seed=0)
    model.save_adapter(tmp_path / "all")
    saved = json.loads((tmp_path / "all" / "adapter_config.json").read_text())
    assert set(saved["target_modules"]) == set(theirs.peft_config["default"].target_modules)
    peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "all")       # every key is one PEFT expects


def test_greedy_generation_matches_transformers(lfm2):
    """Through the recurrent state (the conv layers' last K-1 inputs per row), with the adapter."""
    _, pm, folder = lfm2
    model = load_model(folder / "model", backend="numpy")
    model.load_adapter(folder / "adapter")
    prompt = [5, 17, 3, 40, 22, 8, 9]
    with torch.no_grad():
        want = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                           eos_token_id=None)[0, len(prompt):].tolist()
    assert model.generate(prompt, max_new_tokens=10) == want


def test_batched_and_continuous_generation_equal_each_row_alone(lfm2):
    """Rows of different lengths in one batch; then continuous batching in two slots with prefill in chunks of
    three tokens (a row's state carried across its chunks), a third row taking a freed slot (its state starts from
    zero), prefix reuse off though rows share a prefix and a key."""
    _, _, folder = lfm2
    model = load_model(folder / "model", backend="numpy")
    prompts = [np.array([5, 17, 3, 40, 22, 8, 9]), np.array([11, 4]), np.array([5, 17, 3, 40, 61, 30, 2, 7, 19])]
    alone = [model.generate(p, max_new_tokens=6) for p in prompts]
    assert model.generate_batch(prompts, max_new_tokens=6) == alone
    batch = DecodeBatch(model.engine, 2, 24, token_budget=3)
    out = {}
    pending = list(enumerate(prompts))
    try:
        while pending or len(batch):
            while pending and batch.free_slots():
                i, p = pending.pop(0)
                out[batch.add(p, 6, prefix_key="same")] = (i, [])
            for token in batch.step():
                out[token.slot][1].append(token.id)
                if token.finished:
                    i, ids = out.pop(token.slot)
                    out[("done", i)] = ids
    finally:
        batch.close()
    assert [out[("done", i)] for i in range(3)] == alone
    assert batch.reused == 0


def test_a_row_must_continue_its_recurrent_state(lfm2):
    _, _, folder = lfm2
    engine = load_model(folder / "model", backend="numpy").engine
    kv = engine.new_kv_cache(2, 16)
    assert kv["state"][0]["conv.conv.weight"].shape == (2, 2, 30) and 1 not in kv["state"]
    engine.forward_rows([5, 6, 7], [0, 0, 0], [0, 1, 2], kv, [2])
    with pytest.raises(ValueError, match="row 0 starts at position 5, but its recurrent state holds 3"):
        engine.forward_rows([8], [0], [5], kv, [0])
    with pytest.raises(ValueError, match="consecutive positions"):
        engine.forward_rows([8, 9], [1, 1], [0, 2], kv, [1])


def test_backend_auto_treats_lfm2_as_a_dense_model(lfm2):
    """The WebGPU engine records LFM2's layers (tests/test_lfm2_wgpu.py): auto's rule no longer sends it to NumPy for
    its convolutions."""
    _, _, folder = lfm2
    from wgpu_train.engines.webgpu.device import runtime

    choice = choose_backend("auto", cfg=ModelConfig.from_folder(folder / "model"))
    assert "short-convolution" not in choice.reason
    assert choice.engine == ("wgpu" if runtime.has_adapter() else "numpy")     # tests take the adapter (conftest.py)
