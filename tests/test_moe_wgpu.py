"""Mixtures of experts on the WebGPU engine against the NumPy engine (tests/test_moe_models.py holds that one to
transformers and PEFT), on every adapter present and the four MoE families of tiny_models.build_moe: logits, loss
and every LoRA gradient (the experts' and the router's included, by PEFT's keys), optimizer steps in one submission
each, greedy generation through the KV cache, full fine-tuning's expert gradients, bfloat16 expert storage, the
memory estimate against what the engine allocates, the router's aux loss, and 16-bit activations."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from finetune_helpers import padded_batch
from tiny_models import MOE_ARCHS, build_moe, save_model
from tolerances import assert_close
from wgpu_train.errors import ConfigError
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.shared.labels import shift_labels
from engine_pair import engine_pair

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

VOCAB = 61      # tiny_models' vocabulary is larger: ids below it are valid


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_model(build_moe(request.param, seed=3), folder)
    return request.param, folder


def _batch():
    ids, labels, mask = padded_batch(5, 9, 6, 2)
    return ids % VOCAB, np.where(labels >= 0, labels % VOCAB, labels), mask


def _micro_batches(ids, labels, mask, rows):
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    return [(ids[r:r + rows].astype(np.int32), shift_labels(labels[r:r + rows]), mask[r:r + rows].astype(np.int32),
             pos[r:r + rows].copy()) for r in range(0, ids.shape[0], rows)]


def _pair(folder, rt, lora=True, **kw):
    """The model on both engines; with lora, all-linear (attention, router, experts, shared expert) with B random."""
    return engine_pair(folder, rt, wt.LoraConfig(r=3, alpha=7, target_modules="all-linear") if lora else None, **kw)


def _same_loss_and_grads(ref, gpu, what: str, expert_keys: str):
    ids, labels, mask = _batch()
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", what)
    assert grads_g.keys() == grads_r.keys() and any(expert_keys in k for k in grads_r)
    for k, g in grads_r.items():
        assert np.abs(g).max() > 0, k
        assert_close(grads_g[k], g, "gpu_grads", f"{what}: {k}")


def test_lora_logits_loss_gradients_and_steps_match_numpy(moe, rt):
    """LoRA on every linear module and on the experts: the same logits, loss and gradients (PEFT's keys, the experts'
    nested pairs included); then three optimizer steps of two micro-batches, clipped, each one submission and one
    readback on the GPU, with the same losses, norms and adapter after."""
    arch, folder = moe
    ref, gpu = _pair(folder, rt)
    ids, labels, mask = _batch()
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], "gpu_logits", arch)
    _same_loss_and_grads(ref, gpu, arch, ".mlp.experts.base_layer.lora_A")
    # eps 1e-5: the router's LoRA B row of an expert that no token chooses gets a gradient of float32 cancellation
    # noise (about 1e-9, apart on the two engines), which AdamW's default eps of 1e-8 would turn into updates of
    # lr / 10 apart (measured 7e-5 after three steps on Qwen3-MoE); 1e-5 keeps that under 1e-6
    hp = OptimizerParams(lr=1e-3, max_grad_norm=0.5, eps=1e-5)
    micro = _micro_batches(ids, labels, mask, 3)
    for step in (1, 2, 3):
        loss_r, count_r, norm_r, _ = ref.engine.train_step(micro, hp, step)
        loss_g, count_g, norm_g, applied = gpu.engine.train_step(micro, hp, step)
        assert applied and count_g == count_r
        assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", f"{arch} step {step}")
        assert_close(np.float64(norm_g), np.float64(norm_r), "gpu_loss", f"{arch} grad norm, step {step}")
        assert gpu.engine.last_step["submits"] == 1 and gpu.engine.last_step["readbacks"] == 1
    after_r, after_g = ref.lora_state_dict(), gpu.lora_state_dict()
    assert any("experts" in k for k in after_r)
    for k, v in after_r.items():
        assert_close(after_g[k], v, "gpu_params_after_steps", f"{arch}: {k}")


def test_greedy_generation_matches_numpy(moe, rt):
    """Generation through the KV cache (prefill, then a token at a time, the route per token) with the adapter."""
    arch, folder = moe
    ref, gpu = _pair(folder, rt)
    prompt = [3, 17, 5, 40, 22, 9]
    want = ref.generate(prompt, max_new_tokens=8)
    assert gpu.generate(prompt, max_new_tokens=8) == want, arch


def test_gradient_checkpointing_gives_the_same_gradients(rt, tmp_path):
    """A Qwen2-MoE layer recomputed in the backward (route, experts, shared expert): bit-identical gradients."""
    save_model(build_moe("qwen2_moe", seed=4), tmp_path)
    _, plain = _pair(tmp_path, rt)
    _, ckpt = _pair(tmp_path, rt)
    ckpt.set_gradient_checkpointing(True)
    ids, labels, mask = _batch()
    loss_p, grads_p = plain.loss_and_grads(ids, labels, mask)
    loss_c, grads_c = ckpt.loss_and_grads(ids, labels, mask)
    assert loss_c == loss_p and grads_c.keys() == grads_p.keys()
    for k in grads_p:
        np.testing.assert_array_equal(grads_c[k], grads_p[k], err_msg=k)


def test_full_finetuning_trains_the_experts(rt, tmp_path):
    """Full fine-tuning of a Qwen3-MoE with a dense layer: every weight's gradient, the experts' 3-D tensors and the
    router's included, and a step moves the experts as the NumPy engine does."""
    save_model(build_moe("qwen3_moe", seed=6), tmp_path)
    ref, gpu = _pair(tmp_path, rt, lora=False)
    for m in (ref, gpu):
        m.set_full_finetune()
    _same_loss_and_grads(ref, gpu, "full fine-tuning", "mlp.experts.gate_up_proj")
    ids, labels, mask = _batch()
    hp = OptimizerParams(lr=1e-3)
    micro = _micro_batches(ids, labels, mask, 6)
    ref.engine.train_step(micro, hp, 1)
    gpu.engine.train_step(micro, hp, 1)
    assert gpu.engine.last_step["submits"] == 1
    name = "model.layers.2.mlp.experts.down_proj"     # layer 1 is dense
    assert_close(gpu.engine.trainable()[name], ref.engine.trainable()[name], "gpu_params_after_steps", name)


def test_bfloat16_experts(rt, tmp_path):
    """--base-dtype bfloat16 stores the experts as bfloat16 (half the bytes, counted so by the memory estimate); both
    engines compute with the same rounded experts."""
    save_model(build_moe("mixtral", seed=8), tmp_path)
    ref, gpu = _pair(tmp_path, rt, base_dtype="bfloat16")
    from wgpu_train.engines.webgpu.device import storage
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert storage.format_of(gpu.engine.w[name]) == "bf16"
    ids, labels, mask = _batch()
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], "gpu_logits", "bf16 experts")
    _same_loss_and_grads(ref, gpu, "bf16 experts", ".mlp.experts.base_layer.lora_A")
    est = wt.estimate_memory(gpu.config, 1, 16, lora=gpu.lora_config, base_dtype="bfloat16")
    assert est["weights"] == gpu.engine.base_weight_bytes
    f32 = wt.estimate_memory(gpu.config, 1, 16, lora=gpu.lora_config)
    expert_elements = sum(np.prod(s) for k, s in gpu.engine.shapes.items() if ".mlp.experts." in k)
    assert f32["weights"] - est["weights"] >= 2 * expert_elements


def _allocated(acts) -> int:
    """Bytes of a bucket's activation buffers and MoE scratch, each counted once."""
    bufs = {id(b): b for layer in acts.layers.values() for b in layer.values()}
    batch_inputs = ("ids", "segments", "positions", "targets", "head_index")
    bufs.update({id(v): v for k, v in vars(acts).items() if hasattr(v, "destroy") and k not in batch_inputs})
    bufs.update({id(b): b for b in acts.moe.buffers()})
    return sum(b.size for b in bufs.values())


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_memory_estimate_is_the_allocation(arch, rt, tmp_path):
    """The estimate's weights (every expert), activations (each layer's own kind, the routed pairs at their worst
    case) and MoE scratch are what the engine allocates, with and without gradient checkpointing."""
    save_model(build_moe(arch, seed=2), tmp_path)
    _, gpu = _pair(tmp_path, rt)
    ids, labels, mask = _batch()
    lora = gpu.lora_config
    for checkpointing in (False, True):
        gpu.set_gradient_checkpointing(checkpointing)
        gpu.loss_and_grads(ids, labels, mask)
        acts = gpu.engine._activations(*ids.shape, train=True)
        est = wt.estimate_memory(gpu.config, *ids.shape, lora=lora, gradient_checkpointing=checkpointing)
        assert est["activations"] + est["logits"] == _allocated(acts), checkpointing
        assert est["weights"] == gpu.engine.base_weight_bytes
    sparse = [i for i in range(gpu.config.num_hidden_layers) if gpu.config.is_sparse(i)]
    assert "moe_gu" in acts.layers[sparse[0]] or checkpointing


def test_what_the_webgpu_engine_refuses_for_a_mixture_of_experts(rt, tmp_path):
    """16-bit activations where an expert width or count is odd (auto resolves to fp32 there)."""
    save_model(build_moe("olmoe", seed=1), tmp_path)
    with pytest.raises(ConfigError, match="needs even widths .*num_experts 5"):
        wt.load_model(tmp_path, backend="wgpu", device=str(rt.info.index), precision="bf16")
    from wgpu_train.engines.loading import precision_choice
    cfg = wt.ModelConfig.from_folder(tmp_path)
    assert precision_choice("auto", "wgpu", cpu_adapter=False, cfg=cfg)[0] == "fp32"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_router_aux_loss_matches_numpy(arch, rt, tmp_path):
    """The router's load-balancing loss on the device (the padded batch's real tokens alone): the same loss and
    LoRA gradients (the routers' and the experts') as the NumPy engine (held to transformers in test_moe_models),
    the same with gradient checkpointing (each layer counted once), and steps of two micro-batches with the same
    losses, aux_loss and adapter, each still one submission and one readback."""
    save_model(build_moe(arch, seed=11), tmp_path)
    ref, gpu = _pair(tmp_path, rt)
    ids, labels, mask = _batch()
    assert not mask.all()                   # padding, which the aux loss leaves out
    _, plain = gpu.loss_and_grads(ids, labels, mask)
    for m in (ref, gpu):
        m.engine.set_router_aux_loss(0.3)
    _same_loss_and_grads(ref, gpu, f"{arch} aux loss", ".mlp.experts.base_layer.lora_A")
    loss_a, grads_a = gpu.loss_and_grads(ids, labels, mask)
    router = next(k for k in grads_a if ".mlp.gate.lora_A" in k)
    assert np.abs(plain[router] - grads_a[router]).max() > 1e-4       # the aux term reached the router
    gpu.set_gradient_checkpointing(True)
    loss_c, grads_c = gpu.loss_and_grads(ids, labels, mask)
    gpu.set_gradient_checkpointing(False)
    assert loss_c == loss_a
    for k in grads_a:
        np.testing.assert_array_equal(grads_c[k], grads_a[k], err_msg=k)
    hp = OptimizerParams(lr=1e-3, max_grad_norm=0.5, eps=1e-5)     # eps: test_lora_logits_loss_gradients_and_steps
    micro = _micro_batches(ids, labels, mask, 3)
    for step in (1, 2):
        loss_r, _, norm_r, _ = ref.engine.train_step(micro, hp, step)
        loss_g, _, norm_g, applied = gpu.engine.train_step(micro, hp, step)
        assert applied and gpu.engine.last_aux_loss > 0
        assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", f"{arch} step {step}")
        assert_close(np.float64(gpu.engine.last_aux_loss), np.float64(ref.engine.last_aux_loss), "gpu_loss",
                     f"{arch} aux_loss, step {step}")
        assert_close(np.float64(norm_g), np.float64(norm_r), "gpu_loss", f"{arch} grad norm, step {step}")
        assert gpu.engine.last_step["submits"] == 1 and gpu.engine.last_step["readbacks"] == 1
    after_r, after_g = ref.lora_state_dict(), gpu.lora_state_dict()
    for k, v in after_r.items():
        assert_close(after_g[k], v, "gpu_params_after_steps", f"{arch}: {k}")
    gpu.engine.set_router_aux_loss(0.0)
    gpu.engine.train_step(micro, hp, 3)
    assert gpu.engine.last_aux_loss is None


# even widths and expert counts (16-bit activations are stored by pairs)
EVEN = {"qwen3_moe": dict(num_experts=6, moe_intermediate_size=18, intermediate_size=22),
        "mixtral": dict(num_local_experts=6, intermediate_size=18)}


@pytest.mark.parametrize("arch, precision, base_dtype", [("qwen3_moe", "bf16", "bfloat16"),
                                                         ("mixtral", "f16", "float32")])
def test_sixteen_bit_activations_match_numpy(arch, precision, base_dtype, rt, tmp_path):
    """--precision bf16 / f16: the router's logits, the experts' outputs and gate / up projections and their
    gradients stored in 16 bits at the NumPy engine's rounding points (experts in bfloat16 too on Qwen3-MoE):
    the same logits, loss and LoRA gradients (the experts' and the router's) within 16-bit noise, the aux loss
    on; a step is one submission; the memory estimate is the allocation."""
    save_model(build_moe(arch, seed=5, **EVEN[arch]), tmp_path)
    ref, gpu = _pair(tmp_path, rt, precision=precision, base_dtype=base_dtype)
    assert gpu.engine.precision == precision
    acts = gpu.engine._activations(5, 9, train=True)
    from wgpu_train.engines.webgpu.device import storage
    sparse = next(i for i in range(gpu.config.num_hidden_layers) if gpu.config.is_sparse(i))
    assert storage.format_of(acts.layers[sparse]["moe_gu"]) == precision
    for m in (ref, gpu):
        m.engine.set_router_aux_loss(0.05)
    ids, labels, mask = _batch()
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], f"{precision}_gpu_logits", arch)
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_g), np.float64(loss_r), f"{precision}_gpu_loss", arch)
    assert grads_g.keys() == grads_r.keys() and any(".mlp.experts.lora_A" in k for k in grads_r)
    for k, g in grads_r.items():
        top = np.abs(g).max()
        assert top > 0, k
        assert_close(grads_g[k] / top, g / top, f"{precision}_gpu_grads", f"{arch}: {k}")
    micro = _micro_batches(ids, labels, mask, 3)
    _, _, _, applied = gpu.engine.train_step(micro, OptimizerParams(lr=1e-3), 1)
    assert applied and gpu.engine.last_step["submits"] == 1 and gpu.engine.last_aux_loss > 0
    est = wt.estimate_memory(gpu.config, *ids.shape, lora=gpu.lora_config, base_dtype=base_dtype,
                             precision=precision)
    assert est["activations"] + est["logits"] == _allocated(gpu.engine._activations(*ids.shape, train=True))


def test_bench_compares_a_moe_step_with_a_dense_one(rt, monkeypatch):
    """bench --only moe's step rows (bench/moe.bench_moe_step, on smaller models here): the dense model has the
    MoE's active weights per token (its MLP top-k expert widths wide), both steps are one submission, and the
    ratio is the two tokens/s measured in the run."""
    from wgpu_train.bench import moe as bench
    monkeypatch.setenv("WGPU_TRAIN_MAX_SUBMIT_S", "1000")      # a loaded machine would split a slow step
    monkeypatch.setattr(bench, "STEP_LAYERS", {**bench.STEP_LAYERS, "hidden_size": 32, "head_dim": 8,
                                               "vocab_size": 64})
    monkeypatch.setattr(bench, "STEP_BATCH", (1, 16))
    monkeypatch.setattr(bench, "STEP_EXPERT_SIZE", 16)
    moe_cfg, dense_cfg = bench.step_models()
    assert dense_cfg.moe is None and dense_cfg.intermediate_size == moe_cfg.moe.top_k * moe_cfg.moe.expert_size
    rows = bench.bench_moe_step(rt, steps=1)
    assert [r["submits_per_step"] for r in rows] == [1, 1]
    assert rows[0]["moe_vs_dense"] == pytest.approx(rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"])


def test_finetune_with_the_aux_loss_on_the_webgpu_engine(rt, tmp_path):
    """finetune --backend wgpu --router-aux-loss-coef: the WebGPU engine runs it (no longer refused) and logs
    aux_loss each step, as the NumPy engine does."""
    import json
    from finetune_helpers import build_tokenizer, make_data_dir
    from wgpu_train.cli.main import main

    model_dir = tmp_path / "model"
    vocab = build_tokenizer(model_dir)
    save_model(build_moe("mixtral", seed=7, vocab_size=vocab), model_dir)
    data = make_data_dir(tmp_path / "data")
    out = tmp_path / "out"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--max-steps", "2",
                 "--lora-targets", "q_proj", "--lora-target-parameters", "mlp.experts.down_proj",
                 "--router-aux-loss-coef", "0.02", "--backend", "wgpu", "--device", str(rt.info.index),
                 "--no-progress", "--log-every", "1"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "grad_norm" in r]
    assert len(steps) == 2 and all(r["aux_loss"] > 0 for r in steps)
    assert json.loads((out / "summary.json").read_text())["backend"] == "wgpu"


@pytest.mark.parametrize("base_dtype, precision", [("nf4", "fp32"), ("nf4-dq", "fp32"), ("nf4", "bf16")])
def test_nf4_experts(base_dtype, precision, rt, tmp_path):
    """--base-dtype nf4 / nf4-dq quantises the experts too (the whole flattened tensor, as the NumPy engine
    rounds them), held as NF4 on the GPU (about 4.5 bits a weight, counted so by the memory estimate) and decoded
    inside the grouped GEMMs: the same logits, loss and LoRA gradients as the NumPy engine (with bfloat16
    activations too); the weights read back are the NumPy engine's."""
    save_model(build_moe("qwen3_moe", seed=9, **(EVEN["qwen3_moe"] if precision != "fp32" else {})), tmp_path)
    ref, gpu = _pair(tmp_path, rt, base_dtype=base_dtype, precision=precision)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    elements = int(np.prod(gpu.engine.shapes[name]))
    assert gpu.engine.w[name].size <= elements * 0.6 + 64
    np.testing.assert_array_equal(gpu.engine._weight(name), ref.engine.w[name])
    assert len(np.unique(ref.engine.w[name].reshape(-1)[:64])) <= 16    # a block's NF4 values, not float32 ones
    ids, labels, mask = _batch()
    real = mask.astype(bool)
    if precision == "fp32":
        assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], "gpu_logits", base_dtype)
        _same_loss_and_grads(ref, gpu, base_dtype, ".mlp.experts.base_layer.lora_A")
    else:
        assert_close(gpu.logits(ids, mask)[real], ref.logits(ids, mask)[real], f"{precision}_gpu_logits")
        loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
        loss_g, grads_g = gpu.loss_and_grads(ids, labels, mask)
        assert_close(np.float64(loss_g), np.float64(loss_r), f"{precision}_gpu_loss")
        for k, g in grads_r.items():
            top = np.abs(g).max()
            assert_close(grads_g[k] / top, g / top, f"{precision}_gpu_grads", k)
    est = wt.estimate_memory(gpu.config, 1, 16, lora=gpu.lora_config, base_dtype=base_dtype)
    assert est["weights"] == gpu.engine.base_weight_bytes
