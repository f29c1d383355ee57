"""Qwen3.5 and Qwen3-Next (Gated DeltaNet linear attention between gated full-attention layers) on the WebGPU engine
against the NumPy engine (tests/test_qwen3_5.py holds that one to transformers and PEFT), on every adapter present:
logits, loss and every LoRA gradient on a padded batch of 150 tokens (crossing the delta rule's chunks of 16 to 64),
LoRA on both layer kinds' modules (Qwen3.5's four in-projections, Qwen3-Next's two fused ones); optimizer steps in
one submission each; gradient checkpointing; full fine-tuning's gradients of A_log, dt_bias, the conv1d and the
gated norm; greedy generation through the recurrent state, one row and a batch of rows."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from finetune_helpers import padded_batch
from test_qwen3_5 import build
from tolerances import assert_close
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.shared.labels import shift_labels
from wgpu_train.errors import ConfigError
from engine_pair import engine_pair

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TARGETS = {"qwen3_5": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "v_proj",
                       "down_proj"],
           "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "o_proj", "up_proj"],
           "qwen3_next_moe": ["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj"],     # experts: test_moe_wgpu
           "qwen3_5_moe": ["in_proj_qkv", "in_proj_b", "q_proj", "shared_expert_gate"]}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param).save_pretrained(folder)
    return request.param, folder


def _pair(folder, rt, kind=None, **kw):
    """The model on both engines; with kind, LoRA on its TARGETS with B random."""
    return engine_pair(folder, rt, wt.LoraConfig(r=3, alpha=7, target_modules=TARGETS[kind]) if kind else None, **kw)


def _same_loss_and_grads(ref, gpu, what, batch, must_have: str):
    loss_r, grads_r = ref.loss_and_grads(*batch)
    loss_g, grads_g = gpu.loss_and_grads(*batch)
    assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", what)
    assert grads_g.keys() == grads_r.keys() and any(must_have in k for k in grads_r)
    for k, g in grads_r.items():
        assert_close(grads_g[k], g, "gpu_grads", f"{what}: {k}")
    return grads_g


def test_lora_logits_loss_gradients_and_steps_match_numpy(model, rt):
    """150 tokens, row 1 padded from 101; then two optimizer steps of two micro-batches, one submission each."""
    kind, folder = model
    ref, gpu = _pair(folder, rt, kind)
    ids, labels, mask = padded_batch(3, 150, 101, 3)
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], "gpu_hybrid_logits", kind)
    _same_loss_and_grads(ref, gpu, kind, (ids, labels, mask), ".linear_attn.in_proj_")
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    micro = [(ids[r:r + 1].astype(np.int32), shift_labels(labels[r:r + 1]), mask[r:r + 1].astype(np.int32),
              pos[r:r + 1].copy()) for r in range(2)]
    hp = OptimizerParams(lr=1e-3, max_grad_norm=0.5)
    for step in (1, 2):
        loss_r, count_r, norm_r, _ = ref.engine.train_step(micro, hp, step)
        loss_g, count_g, norm_g, applied = gpu.engine.train_step(micro, hp, step)
        assert applied and count_g == count_r
        assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", f"{kind} step {step}")
        assert_close(np.float64(norm_g), np.float64(norm_r), "gpu_hybrid_grad_norm", f"{kind} grad norm, step {step}")
        assert gpu.engine.last_step["submits"] == 1 and gpu.engine.last_step["readbacks"] == 1
    after_r, after_g = ref.lora_state_dict(), gpu.lora_state_dict()
    for k, v in after_r.items():
        assert_close(after_g[k], v, "gpu_hybrid_params_after_steps", f"{kind}: {k}")


def test_gradient_checkpointing_gives_the_same_gradients(model, rt):
    """Each linear-attention layer's forward rerun in the backward (its delta rule's states with it)."""
    kind, folder = model
    _, plain = _pair(folder, rt, kind)
    _, ckpt = _pair(folder, rt, kind)
    ckpt.set_gradient_checkpointing(True)
    batch = padded_batch(4, 40, 30, 2)
    loss_p, grads_p = plain.loss_and_grads(*batch)
    loss_c, grads_c = ckpt.loss_and_grads(*batch)
    assert loss_c == loss_p and grads_c.keys() == grads_p.keys()
    for k in grads_p:
        np.testing.assert_array_equal(grads_c[k], grads_p[k], err_msg=k)


def test_full_finetuning_gradients_match_numpy(rt, tmp_path):
    """Every weight's gradient, A_log's, dt_bias', the conv1d's and the gated norm's among them."""
    build("qwen3_5").save_pretrained(tmp_path)
    ref, gpu = _pair(tmp_path, rt)
    for m in (ref, gpu):
        m.set_full_finetune()
    grads = _same_loss_and_grads(ref, gpu, "full fine-tuning", padded_batch(2, 70, 40, 2), ".linear_attn.A_log")
    for name in ("model.layers.0.linear_attn.dt_bias", "model.layers.2.linear_attn.conv1d.weight",
                 "model.layers.2.linear_attn.norm.weight"):
        assert np.abs(grads[name]).max() > 1e-4, name


def test_greedy_generation_matches_numpy(model, rt):
    """Through each row's recurrent state (the conv window and the delta rule's state) and the full-attention layer's
    KV cache, with the adapter: a prefill of 70 tokens (the chunked form from the row's state, crossing chunks), then
    a token at a time (the recurrent step); and two rows of different lengths decoded together."""
    kind, folder = model
    ref, gpu = _pair(folder, rt, kind)
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 83, 70)]
    assert gpu.generate(prompt, max_new_tokens=6) == ref.generate(prompt, max_new_tokens=6)
    prompts = [[5, 17, 3, 40, 22, 8, 9], [11, 4, 60], [7, 7, 30, 2]]
    lengths = [5, 2, 4]             # rows leave at different steps: the decoding rows' slots stop following each other
    assert gpu.generate_batch(prompts, max_new_tokens=lengths) == ref.generate_batch(prompts, max_new_tokens=lengths)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_bfloat16_activations_match_numpy(kind, rt, tmp_path):
    """bfloat16 activations (even widths: 4 value heads of 4), the NumPy engine rounding at the same points: the
    l2norm's and the delta rule's float32 results rounded into the layer's bfloat16 buffers; logits, loss, LoRA
    gradients, the memory estimate covering the allocation; then greedy generation. An odd value head dim is refused
    in one line, and auto picks bf16 on GPUs."""
    import torch
    import transformers as tf
    from test_precision_gpu import _check
    from test_qwen3_5 import QWEN3_5
    from wgpu_train.engines.loading import precision_choice
    from wgpu_train.models.config import ModelConfig

    even = {**QWEN3_5, "hidden_size": 32, "intermediate_size": 44, "linear_value_head_dim": 4}
    torch.manual_seed(5)
    config = tf.Qwen3NextConfig(**even, num_experts=0) if kind == "qwen3_next" else tf.Qwen3_5TextConfig(**even)
    hf = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():   # build()'s 0.3 randn amplifies a rounding boundary's flip to 0.1 on logits; 0.15 does not
        for name, p in hf.named_parameters():
            p.copy_((0.5 if "A_log" in name else 0.0) + 0.15 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ref, gpu = _pair(tmp_path, rt, kind, precision="bf16")
    _check(ref, gpu, *padded_batch(3, 80, 60, 3), "bf16_gpu")
    from test_engine import _allocated
    acts = gpu.engine._activations(3, 80, train=True)
    own = sum(b.size for holder in (gpu.engine.layers, acts) for b in holder._dn_buffers.values())
    est = wt.estimate_memory(gpu.config, 3, 80, lora=gpu.lora_config, precision="bf16")
    assert _allocated(acts) + own <= est["activations"] + est["logits"]
    prompt = [5, 17, 3, 40, 22, 8]
    assert gpu.generate(prompt, max_new_tokens=5) == ref.generate(prompt, max_new_tokens=5)
    cfg = ModelConfig.from_folder(tmp_path)
    assert precision_choice("auto", "wgpu", cpu_adapter=False, cfg=cfg)[0] == "bf16"
    odd = tmp_path / "odd"
    build(kind).save_pretrained(odd)                # test_qwen3_5's: 4 value heads of 5
    with pytest.raises(ConfigError, match="linear_value_head_dim 5") as err:
        wt.load_model(odd, backend="wgpu", device=str(rt.info.index), precision="bf16")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["qwen3_next_moe", "qwen3_5_moe"])
def test_experts_after_both_layer_kinds_match_numpy(kind, rt, tmp_path):
    """Qwen3-Next's routed and shared experts (a dense layer among them) and Qwen3.5-MoE's (every layer) after both
    layer kinds: logits, loss, LoRA gradients on the in-projections and the attention, and greedy generation, as
    the NumPy engine."""
    import torch
    import transformers as tf
    from test_qwen3_5 import QWEN3_5, _randomise

    torch.manual_seed(6)
    experts = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=11, shared_expert_intermediate_size=9)
    if kind == "qwen3_next_moe":
        cfg = tf.Qwen3NextConfig(**QWEN3_5, **experts, mlp_only_layers=[1], norm_topk_prob=True)
    else:
        cfg = tf.Qwen3_5MoeTextConfig(**{k: v for k, v in QWEN3_5.items() if k != "intermediate_size"}, **experts)
    _randomise(tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager",
                                                   experts_implementation="eager")).save_pretrained(tmp_path)
    ref, gpu = _pair(tmp_path, rt, kind)
    ids, labels, mask = padded_batch(3, 150, 101, 3)
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], "gpu_hybrid_logits", kind)
    _same_loss_and_grads(ref, gpu, kind, (ids, labels, mask), ".linear_attn.in_proj_")
    prompt = [5, 17, 3, 40, 22, 8]
    assert gpu.generate(prompt, max_new_tokens=6) == ref.generate(prompt, max_new_tokens=6)


def test_memory_estimate_covers_the_allocation(model, rt):
    """The estimate's activations hold what the engine allocates: the bucket's and the delta rule's own buffers
    (its states per linear layer, or one set with gradient checkpointing; the scratch), the latter counted at the
    chunk that needs the most; without them the estimate would fall short."""
    from test_engine import _allocated

    kind, folder = model
    _, gpu = _pair(folder, rt, kind)
    ids, labels, mask = padded_batch(4, 40, 30, 2)
    for checkpointing in (False, True):
        gpu.set_gradient_checkpointing(checkpointing)
        gpu.loss_and_grads(ids, labels, mask)
        acts = gpu.engine._activations(*ids.shape, train=True)
        own = sum(b.size for holder in (gpu.engine.layers, acts) for b in holder._dn_buffers.values())
        est = wt.estimate_memory(gpu.config, *ids.shape, lora=gpu.lora_config, gradient_checkpointing=checkpointing)
        assert _allocated(acts) < est["activations"] + est["logits"], checkpointing
        assert _allocated(acts) + own <= est["activations"] + est["logits"], checkpointing
        gpu.engine.layers._dn_buffers.clear()
        acts._dn_buffers.clear()


def test_generation_row_blocks():
    """A decoding batch's rows of one token whose slots and tokens follow each other make one step dispatch; a prefill
    is a block of its own; a row whose tokens are not consecutive in the call is refused."""
    from wgpu_train.engines.webgpu.gated_deltanet_layers import _row_blocks

    runs = [(0, np.array([0]), 5), (1, np.array([1]), 3), (2, np.array([2]), 4), (4, np.array([3]), 1),
            (5, np.array([4, 5, 6]), 0), (6, np.array([7]), 2), (7, np.array([8]), 2)]
    assert _row_blocks(runs) == [(0, 0, -3), (4, 3, -1), (5, 4, 3), (6, 7, -2)]
    with pytest.raises(ValueError, match="row 3's tokens must be consecutive"):
        _row_blocks([(3, np.array([0, 2]), 0)])


def test_pipeline_stages_equal_one_process(rt, tmp_path):
    """2 WebGPU stages under GPipe, every micro-batch's forward before the backwards: each micro-batch's delta-rule
    states (72 tokens: several chunks, so they are not the zero initial state) kept in its own bucket, with and
    without gradient checkpointing; then generation through the stages."""
    from test_pipeline import assert_same_generation
    from test_pipeline_wgpu import _staged

    build("qwen3_5").save_pretrained(tmp_path)
    rng = np.random.default_rng(9)
    hp = OptimizerParams(lr=1e-2, max_grad_norm=0.5)
    pos = np.broadcast_to(np.arange(72, dtype=np.int32), (2, 72)).copy()
    for checkpointing in (False, True):
        one, staged = _staged(tmp_path, 2, "gpipe", device=str(rt.info.index))
        for model in (one, staged):
            model.add_lora(wt.LoraConfig(r=4, target_modules=TARGETS["qwen3_5"]), seed=3)
            model.set_gradient_checkpointing(checkpointing)
        for step in (1, 2):
            micro = []
            for _ in range(3):
                ids, labels, mask = padded_batch(int(rng.integers(1 << 30)), 72, 60, 2)
                micro.append((ids.astype(np.int32), shift_labels(labels), mask.astype(np.int32), pos))
            expected, got = one.engine.train_step(micro, hp, step), staged.engine.train_step(micro, hp, step)
            assert got[1] == expected[1] and got[3] == expected[3]
            assert_close(np.array(got[::2]), np.array(expected[::2]), "pipeline_wgpu", f"step {step}")
        mine, theirs = staged.engine.trainable(), one.engine.trainable()
        for k in theirs:
            assert_close(mine[k], theirs[k], "pipeline_wgpu", k)
    assert_same_generation(*_staged(tmp_path, 2, device=str(rt.info.index)))


def _rule_binding(rt, T: int, backward: bool) -> int:
    """A max storage binding that holds the delta rule's scratch and states of one key head (two value heads) of a
    T-token row of build()'s models, and not a whole row's (four)."""
    from wgpu_train.engines.webgpu import delta_rule as DR

    chunk = DR.delta_rule_chunk(rt, 1, T, 2, 4, 6, 5, backward)

    def need(heads):
        return 4 * max(DR.scratch_size(1, T, heads, 6, 5, chunk, backward), DR.states_size(1, T, heads, 6, 5, chunk))

    binding = need(2) + 256
    assert DR.pass_shape(None, 2, T, 2, 4, 6, 5, chunk, backward, binding) == (1, 2)
    return binding


def test_rows_past_the_max_binding_equal_one_pass(rt, tmp_path, monkeypatch):
    """A max storage binding under one row's delta-rule scratch but over one key head's: the forward (logits of a
    right-padded row of 150 tokens, a 150-token prefill then decoding) and, under the backward's binding, the LoRA
    gradients of the fused in-projections and out_proj, then full fine-tuning's (A_log, dt_bias among them),
    recorded a key head at a time: the same as the one-pass run's; the memory estimate still covers the
    allocation."""
    from test_engine import _allocated

    build("qwen3_next").save_pretrained(tmp_path)
    batch = padded_batch(3, 150, 101, 3)
    prompt = [int(t) for t in np.random.default_rng(8).integers(3, 83, 150)]

    def lora():
        return _pair(tmp_path, rt, "qwen3_next")[1]

    def full():
        model = _pair(tmp_path, rt)[1]
        model.set_full_finetune()
        return model

    whole = lora()
    padded = (batch[0][1:], batch[2][1:])         # one row under the forward's binding (the in-projection's width)
    logits, tokens = whole.logits(*padded), whole.generate(prompt, max_new_tokens=3)
    wanted = [lora().loss_and_grads(*batch), full().loss_and_grads(*batch)]
    forward, backward = (_rule_binding(rt, 150, back) for back in (False, True))
    monkeypatch.setattr(rt, "max_binding", forward)
    split = lora()
    np.testing.assert_array_equal(split.logits(*padded), logits)
    assert split.generate(prompt, max_new_tokens=3) == tokens
    monkeypatch.setattr(rt, "max_binding", backward)
    for make, (want_loss, want) in zip((lora, full), wanted):
        split = make()
        got_loss, got = split.loss_and_grads(*batch)
        assert got_loss == want_loss and got.keys() == want.keys()
        assert any(".linear_attn.in_proj_qkvz" in k for k in got) and any(".linear_attn.out_proj" in k for k in got)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert "model.layers.0.linear_attn.A_log" in got and "model.layers.2.linear_attn.dt_bias" in got
    acts = split.engine._activations(*batch[0].shape, train=True)
    own = sum(b.size for holder in (split.engine.layers, acts) for b in holder._dn_buffers.values())
    est = wt.estimate_memory(split.config, *batch[0].shape, method="full", max_binding=rt.max_binding)
    assert _allocated(acts) + own <= est["activations"] + est["logits"]
