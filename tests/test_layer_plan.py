"""The declarative layer plan: its backward's write-or-add decisions, its checks, and a plan variant (a
layer without its MLP) walked by both engines, the NumPy one checked against finite differences."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.adapters.files import peft_key
from wgpu_train.models.layer_plan import CARRY, INPUT, OUTPUT, LayerPlan, Op, layer_plan
from wgpu_train.engines.webgpu.memory import activation_plan

from tiny_models import build_model, save_model
from tolerances import assert_close


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A saved tiny Qwen3 (q/k norms: the longest plan)."""
    path = tmp_path_factory.mktemp("qwen3")
    save_model(build_model("qwen3", seed=1), path)
    return path


def _flags(plan) -> dict:
    return {(op.kind, op.param or op.heads): acc for op, acc in zip(plan.ops, plan.accumulate)}


def test_backward_writes_then_adds(qwen3):
    cfg = wt.load_model(qwen3).config
    plan = layer_plan(cfg)
    flags = _flags(plan)
    # h1 feeds q, k and v: v's backward (the first in reverse) writes d_h, k's and q's add to it
    assert flags[("linear", "v_proj")] == (False,)
    assert flags[("linear", "k_proj")] == flags[("linear", "q_proj")] == (True,)
    # the norms' dx adds to the residual stream's gradient; the per-head norms write theirs
    assert flags[("rmsnorm", "input_layernorm.weight")] == (True,)
    assert flags[("rmsnorm", "self_attn.q_norm.weight")] == (False,)
    assert flags[("attention", "")] == (False, False, False)
    assert plan.ops[0].inputs == (INPUT,) and plan.ops[-1].outputs == (OUTPUT,)
    # every activation is written before it is read
    written = {INPUT}
    for op in plan.ops:
        assert set(op.inputs) <= written, op
        written |= set(op.outputs)
    # without q/k norms the plan has neither their ops nor their buffers
    plain = layer_plan(dataclasses.replace(cfg, qk_norm=False))
    assert len(plain.ops) == len(plan.ops) - 2 and "q_pre" not in plain.widths and "dq2" not in plain.grad_widths


def test_fused_projections_are_split(qwen3):
    """Phi-3's plan: one qkv_proj / gate_up_proj GEMM each, then a split op into the parts the rest of the layer
    reads; the split's backward writes the fused gradient, the GEMM's writes d_h alone (nothing else reads h1 or
    h2), and the fused outputs are not kept for the backward (no backward reads them)."""
    cfg = dataclasses.replace(wt.load_model(qwen3).config, architecture="Phi3ForCausalLM", qk_norm=False)
    plan = layer_plan(cfg)
    assert [op.param for op in plan.ops if op.kind == "linear"] == list(cfg.linear_modules) == \
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    splits = [op for op in plan.ops if op.kind == "split"]
    assert [(op.inputs, op.outputs, op.grads_in) for op in splits] == [
        (("qkv",), ("q", "k", "v"), ("d_qkv",)), (("gate_up",), ("gate", "up"), ("d_gate_up",))]
    assert plan.widths["qkv"] == cfg.q_size + 2 * cfg.kv_size == sum(plan.widths[x] for x in ("q", "k", "v"))
    assert plan.widths["gate_up"] == 2 * cfg.intermediate_size
    flags = _flags(plan)
    assert flags[("linear", "qkv_proj")] == flags[("linear", "gate_up_proj")] == (False,)
    assert flags[("split", "")] == (False,)
    assert "qkv" not in plan.saved and "gate_up" not in plan.saved and {"q", "k", "v", "gate", "up"} <= plan.saved


def test_memory_plan_is_the_layer_plan(qwen3):
    cfg = wt.load_model(qwen3).config
    plan = layer_plan(cfg)
    layers, shared = activation_plan(cfg, 2, 8, {}, {}, train=True)
    assert set(layers) == set(range(cfg.num_hidden_layers))
    assert all(layer == {name: 16 * width for name, width in plan.widths.items()} for layer in layers.values())
    assert all(shared[g] == 16 * w for g, w in plan.grad_widths.items())


def test_plans_that_cannot_run_are_refused():
    widths, grads = {INPUT: 4, "h": 4}, {CARRY: 4, "d_h": 4}
    read_unwritten = [Op("rmsnorm", (INPUT,), ("h", "r"), ("d_h",), (CARRY,), param="w"),
                      Op("linear", ("h",), (OUTPUT,), ("d_h",), ("d_h",), param="o_proj")]
    with pytest.raises(ValueError, match="reads gradient"):
        LayerPlan.build(read_unwritten, {**widths, "r": 1}, grads)
    never_read = [Op("rmsnorm", (INPUT,), ("h", "r"), ("d_h",), (CARRY,), param="w"),
                  Op("linear", ("h",), (OUTPUT,), (CARRY,), ("d_h",), param="o_proj")]
    with pytest.raises(ValueError, match="unknown"):
        LayerPlan.build(never_read, widths, grads)      # "r" has no width
    with pytest.raises(ValueError, match="never read"):
        LayerPlan.build([Op("linear", ("h",), (OUTPUT,), (CARRY,), ("d_h",), param="o_proj")], widths, grads)
    # what the engines' shared buffers cannot run: the output's writer reading the input (forward-only
    # buckets keep both in one buffer), or needing its own outputs in its backward (checkpointing skips it)
    with pytest.raises(ValueError, match="may not read its input"):
        LayerPlan.build([Op("linear", ("h",), (OUTPUT,), (CARRY,), ("d_h",), param="o_proj", residual=INPUT)],
                        widths, grads)
    with pytest.raises(ValueError, match="own outputs"):
        LayerPlan.build([Op("rmsnorm", ("h",), (OUTPUT, "r"), (CARRY,), ("d_h",), param="w")],
                        {**widths, "r": 1}, grads)
    with pytest.raises(ValueError, match="overwrites h"):
        LayerPlan.build([Op("rmsnorm", (INPUT,), ("h", "r"), ("d_h",), (CARRY,), param="w"),
                         Op("linear", ("h",), ("h",), ("d_h",), ("d_h",), param="q_proj"),
                         Op("scale", ("h",), (OUTPUT,), (CARRY,), ("d_h",))], {**widths, "r": 1}, grads)


def _attention_only(plan) -> LayerPlan:
    """The plan without its MLP: o_proj's output (plus the input), halved, is the layer's output."""
    cut = next(j for j, op in enumerate(plan.ops) if op.param == "o_proj")
    ops = list(plan.ops[:cut + 1]) + [Op("scale", ("x_mid",), (OUTPUT,), (CARRY,), (CARRY,), factor=0.5)]
    used = {x for op in ops for x in op.inputs + op.outputs}
    grads = {g for op in ops for g in op.grads_in + op.grads_out}
    return LayerPlan.build(ops, {k: w for k, w in plan.widths.items() if k in used},
                           {k: w for k, w in plan.grad_widths.items() if k in grads})


def test_a_plan_variant_runs_on_both_engines(qwen3, rt, monkeypatch):
    """Both engines and the memory plan follow the plan they are given: the same losses and LoRA gradients
    for a layer without its MLP, and the NumPy gradients are those of its own loss (finite differences)."""
    lora = wt.LoraConfig(r=2, alpha=4, target_modules="q_proj,v_proj,o_proj")
    ref = wt.load_model(qwen3, backend="numpy", dtype=np.float64)
    gpu = wt.load_model(qwen3, backend="wgpu", device=str(rt.info.index))
    variant = _attention_only(ref.engine.plan)
    monkeypatch.setattr("wgpu_train.engines.webgpu.memory.layer_plan", lambda cfg, layer=0: variant)
    ref.engine.plan = gpu.engine.plan = variant
    ref.add_lora(lora, seed=5)
    rng = np.random.default_rng(3)
    modules = {p: (a, rng.normal(0, 0.2, b.shape)) for p, (a, b) in ref.engine.lora_tensors().items()}
    ref._set_lora(lora, modules, seed=5)
    gpu._set_lora(lora, {p: (a.astype(np.float32), b.astype(np.float32)) for p, (a, b) in modules.items()}, seed=5)
    ids = np.random.default_rng(0).integers(0, 83, (2, 11))
    labels = ids.copy()
    labels[:, :2] = -100
    full = wt.load_model(qwen3, backend="numpy", dtype=np.float64)
    full.add_lora(lora, seed=5)
    full._set_lora(lora, modules, seed=5)
    loss_ref, grads_ref = ref.loss_and_grads(ids, labels)
    assert abs(loss_ref - full.loss_and_grads(ids, labels)[0]) > 1e-3    # the variant is another function
    loss_gpu, grads_gpu = gpu.loss_and_grads(ids, labels)
    assert_close(np.float64(loss_gpu), np.float64(loss_ref), "gpu_loss")
    assert_close(gpu.logits(ids), ref.logits(ids), "gpu_logits")          # forward-only buckets
    for k in grads_ref:
        assert_close(grads_gpu[k], grads_ref[k], "gpu_grads", k)
    # central differences of the float64 loss along one LoRA B entry per module
    for path, (a, b) in modules.items():
        eps, idx = 1e-5, (0, 1)
        losses = []
        for sign in (1, -1):
            bumped = dict(modules)
            b2 = b.copy()
            b2[idx] += sign * eps
            bumped[path] = (a, b2)
            ref._set_lora(lora, bumped, seed=5)
            losses.append(ref.loss_and_grads(ids, labels)[0])
        numeric = (losses[0] - losses[1]) / (2 * eps)
        assert abs(numeric - grads_ref[peft_key(path, "B")][idx]) < 1e-6 + 1e-4 * abs(numeric), path
