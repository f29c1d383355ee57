"""Pipeline stages on the WebGPU engine (engines/webgpu/stage.py) against one WebGPU process: steps of S = 2 and 3
stages under GPipe and 1F1B on the tiny Llama, Qwen3 and Gemma 3 (fp32, bf16 over an NF4 base, f16 with DoRA,
gradient checkpointing, a tied embedding trained on both end stages), generation through the stages, and the
embedded default trained through 2 stages as Ray actors, each on its own adapter (`--device 0,0`)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import require_adapter
from test_pipeline import LAYER_TYPES, _micro_batches, assert_same_generation
from test_pipeline_runs import _run_config, _step_losses
from tiny_models import build_model, save_model
from tolerances import assert_close
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.adapters.files import read_adapter
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.distributed.pipeline_engine import LocalStages, PipelineEngine
from wgpu_train.engines.loading import load_model, load_stage
from wgpu_train.engines.model import Model
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.models.stage_plan import plan_stages

EVEN = dict(intermediate_size=42)      # 16-bit activations on the WebGPU engine need even widths


def _staged(folder, stages: int, schedule: str = "1f1b", device=None, **kw):
    """One process and a PipelineEngine over `stages` WebGPU stages of the same folder and settings."""
    one = load_model(folder, "wgpu", device=device, **kw)
    plan = plan_stages(one.config.num_hidden_layers, stages, tied=one.config.tie_word_embeddings)
    runner = LocalStages([load_stage(folder, plan, s, "wgpu", device=device, **kw) for s in range(stages)])
    return one, Model(one.config, PipelineEngine(runner, plan, schedule), folder)


def _same_steps(one, staged, steps: int = 3, micro: int = 3):
    """`steps` optimizer steps of `micro` micro-batches on both: the same losses, token counts and finite flags,
    the norms and the trained tensors close (pipeline_wgpu)."""
    hp = OptimizerParams(lr=1e-2, max_grad_norm=0.5, weight_decay=0.01)
    for step in range(1, steps + 1):
        batches = _micro_batches(step, micro)
        expected = one.engine.train_step(batches, hp, step)
        got = staged.engine.train_step(batches, hp, step)
        assert got[1] == expected[1] and got[3] == expected[3], (got, expected)
        assert_close(np.array(got[::2]), np.array(expected[::2]), "pipeline_wgpu", f"step {step}'s loss and norm")
    mine, theirs = staged.engine.trainable(), one.engine.trainable()
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], "pipeline_wgpu", k)
    assert max(float(np.abs(theirs[k]).max()) for k in theirs if k.endswith("lora_B")) > 1e-3      # it trained


def test_wgpu_stages_equal_one_process_on_each_adapter(tmp_path, rt):
    """2 stages under GPipe (every micro-batch's activations held by the first stage at once, each in buckets and
    a dropout slot of its own) with LoRA dropout, on every adapter present; the forward-only scores too."""
    folder = save_model(build_model("llama", num_hidden_layers=3), tmp_path / "llama")
    one, staged = _staged(folder, 2, "gpipe", device=str(rt.info.index), precision="fp32")
    lora = LoraConfig(r=4, target_modules=("q_proj", "v_proj", "down_proj"), dropout=0.1)
    for model in (one, staged):
        model.add_lora(lora, seed=3)
    _same_steps(one, staged)
    ids, targets, seg, pos = _micro_batches(9, 1)[0]
    assert staged.engine.loss(ids, targets, seg, pos) == one.engine.loss(ids, targets, seg, pos)
    assert_close(staged.engine.token_losses(ids, targets, seg, pos, reference=True),
                 one.engine.token_losses(ids, targets, seg, pos, reference=True), "exact", "token losses")
    assert_close(staged.engine.logits(ids, seg, pos), one.engine.logits(ids, seg, pos), "exact", "logits")
    first = staged.engine.runner.stages[0]
    assert first.counters["boundary_bytes_sent"] > 0 and len(first._spare) == 2     # 3 micro-batches held at once


@pytest.mark.parametrize("arch,stages,settings", [
    ("qwen3", 3, dict(precision="bf16", base_dtype="nf4", checkpointing=True)),
    ("gemma3", 2, dict(precision="f16", dora=True)),
    ("qwen3", 2, dict(precision="fp32", tied_embedding=True))])
def test_wgpu_stages_compose_equal_one_process(tmp_path, default_rt, arch, stages, settings):
    """bf16 activations over an NF4 base with gradient checkpointing on 3 stages; DoRA with f16 activations and
    loss scaling (every stage unscales and updates its scaler alike); a tied embedding trained on both end
    stages as one (modules_to_save with ensure_weight_tying: its gradients summed)."""
    settings = dict(settings)
    kw = {"layer_types": LAYER_TYPES} if arch == "gemma3" else {}
    folder = save_model(build_model(arch, num_hidden_layers=3, **EVEN, **kw), tmp_path / arch)
    checkpointing, dora, tied = (settings.pop(k, False) for k in ("checkpointing", "dora", "tied_embedding"))
    one, staged = _staged(folder, stages, **settings)
    lora = LoraConfig(r=4, target_modules=("q_proj", "v_proj", "down_proj"), use_dora=dora,
                      modules_to_save=("embed_tokens",) if tied else (), ensure_weight_tying=tied)
    for model in (one, staged):
        model.add_lora(lora, seed=3)
        model.engine.set_gradient_checkpointing(checkpointing)
    _same_steps(one, staged, steps=2, micro=2)
    if settings["precision"] == "f16":
        assert staged.engine.loss_scaler.state_dict() == one.engine.loss_scaler.state_dict()


def test_generation_through_wgpu_stages_equals_one_process(tmp_path, default_rt):
    """Greedy and sampled generation of ragged prompts, each stage keeping its layers' KV cache on its device."""
    folder = save_model(build_model("gemma3", num_hidden_layers=3, layer_types=LAYER_TYPES), tmp_path / "gemma3")
    assert_same_generation(*_staged(folder, 3, precision="fp32"))


def test_embedded_default_through_wgpu_stages_as_ray_actors(tmp_path, default_rt):
    """`finetune --backend wgpu --pipeline-stages 2 --device 0,0`: two Ray actors, each opening the adapter in its
    own process and reading only its tensors, end with one WebGPU process's step losses and adapter."""
    pytest.importorskip("ray", reason="Ray is the test extra's (pip install -e '.[test]')")
    require_adapter()
    device = str(default_rt.info.index)
    finetune(_run_config(tmp_path / "one", backend="wgpu", device=device, precision="fp32"))
    summary = finetune(_run_config(tmp_path / "staged", backend="wgpu", device=f"{device},{device}",
                                   precision="fp32", pipeline_stages=2))
    assert summary["pipeline"]["ray"] is True and summary["pipeline"]["stages"] == 2
    assert "stage 1 (layers" in summary["device"] and summary["backend"] == "wgpu"
    got, expected = _step_losses(tmp_path / "staged"), _step_losses(tmp_path / "one")
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert_close([loss for _, loss in got], [loss for _, loss in expected], "pipeline_wgpu", "step losses")
    mine, theirs = read_adapter(tmp_path / "staged")[1], read_adapter(tmp_path / "one")[1]
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], "pipeline_wgpu", k)
    saved = json.loads((tmp_path / "staged" / "train_config.json").read_text())
    assert saved["backend"] == "wgpu" and saved["pipeline_stages"] == 2


def test_bad_stage_devices_are_one_line(tmp_path, capsys, default_rt):
    """A stage on an adapter that does not exist stops the run with the adapter's own line (raised in its Ray
    actor); stages whose adapters resolved --precision auto differently are refused, and so is a DoRA reference
    adapter."""
    from finetune_helpers import one_line_error
    from wgpu_train.errors import ConfigError

    pytest.importorskip("ray", reason="Ray is the test extra's (pip install -e '.[test]')")
    one_line_error(capsys, ["finetune", "--backend", "wgpu", "--out", str(tmp_path / "x"), "--max-steps", "1",
                            "--no-progress", "--pipeline-stages", "2", "--device", "0,99"],
                   "device index 99 out of range", after_log=True)
    folder = save_model(build_model("llama", num_hidden_layers=2, **EVEN), tmp_path / "llama")
    plan = plan_stages(2, 2)
    stages = [load_stage(folder, plan, s, "wgpu", precision=p) for s, p in enumerate(("fp32", "bf16"))]
    with pytest.raises(ConfigError, match="resolved --precision to fp32, bf16"):
        PipelineEngine(LocalStages(stages), plan)
    dora = {"model.layers.1.self_attn.q_proj": (np.zeros((2, 64), np.float32), np.zeros((64, 2), np.float32), 1.0,
                                                 0.0, np.ones(64, np.float32))}
    with pytest.raises(ConfigError, match="a DoRA --ref-adapter through WebGPU pipeline stages"):
        stages[1].stage_set_reference(dora)


def test_grpo_through_wgpu_stages_equals_one_process(tmp_path, default_rt):
    """GRPO (beta > 0, num_iterations 2: the last stage computes the TokenObjective's weights from its own loss
    head, on the device) through 2 local WebGPU stages, the two steps of one generation: one WebGPU process's
    completions, metrics (KL and entropy among them) and adapter."""
    from test_grpo_train import length_reward, prompts
    from test_pipeline_objectives import _grpo_config, _rows
    from finetune_helpers import make_model_dir, write_jsonl
    from wgpu_train.distributed.pipeline_trainer import finetune_pipeline
    from wgpu_train.training.grpo_trainer import COMPLETIONS_FILE

    model = make_model_dir(tmp_path / "model")
    (tmp_path / "grpo").mkdir()
    write_jsonl(tmp_path / "grpo" / "train.jsonl", prompts(8))
    kw = dict(backend="wgpu", device=str(default_rt.info.index), precision="fp32", max_steps=2)
    finetune(_grpo_config((tmp_path, model), tmp_path / "one", **kw), reward_funcs=[length_reward])
    finetune_pipeline(_grpo_config((tmp_path, model), tmp_path / "staged", pipeline_stages=2, **kw), local=True,
                      reward_funcs=[length_reward])
    one, staged = tmp_path / "one", tmp_path / "staged"
    assert (staged / COMPLETIONS_FILE).read_bytes() == (one / COMPLETIONS_FILE).read_bytes()
    mine, theirs = _rows(staged), _rows(one)
    assert [sorted(r) for r in mine] == [sorted(r) for r in theirs]
    steps = [r for r in theirs if "lr" in r]
    assert len(steps) == 2 and all("kl" in r and "entropy" in r for r in steps) and steps[1]["kl"] > 0
    transfers = ("submits", "readbacks", "bytes_uploaded", "bytes_read")     # each stage submits its own calls
    for got, expected in zip(mine, theirs):
        for k, v in expected.items():
            if k in transfers:
                continue
            if isinstance(v, float):
                assert_close(got[k], v, "pipeline_wgpu", k)
            else:
                assert got[k] == v, k
    a, b = read_adapter(staged)[1], read_adapter(one)[1]
    for k in b:
        assert_close(a[k], b[k], "pipeline_wgpu", k)


def test_dpo_with_a_ref_adapter_through_wgpu_stages_equals_one_process(tmp_path, default_rt):
    """DPO with --ref-adapter on 2 local WebGPU stages (each holding its layers' part of the reference in buffers
    of its own, switched in while the stages score) against one WebGPU process that loads it on a second model
    and scores, then trains, as the stages do: the same step losses and adapter, unlike those of the
    adapter-off reference."""
    from finetune_helpers import make_model_dir
    from test_pipeline_objectives import _dpo_config, _reference_adapter
    from test_pipeline_runs import TwoPasses
    from wgpu_train.distributed.pipeline_trainer import finetune_pipeline

    workspace = (tmp_path, make_model_dir(tmp_path / "model"))
    _reference_adapter(workspace[1], tmp_path / "ref")
    kw = dict(backend="wgpu", device=str(default_rt.info.index), precision="fp32")
    TwoPasses(_dpo_config(workspace, tmp_path / "one", ref_adapter=str(tmp_path / "ref"), **kw)).run()
    finetune_pipeline(_dpo_config(workspace, tmp_path / "staged", pipeline_stages=2, ref_adapter=str(tmp_path / "ref"),
                                  **kw), local=True)
    staged, one = (np.array([v for _, v in _step_losses(tmp_path / n)]) for n in ("staged", "one"))
    assert_close(staged, one, "pipeline_wgpu", "DPO's step losses with --ref-adapter")
    mine, theirs = read_adapter(tmp_path / "staged")[1], read_adapter(tmp_path / "one")[1]
    for k in theirs:
        assert_close(mine[k], theirs[k], "pipeline_wgpu", k)
    TwoPasses(_dpo_config(workspace, tmp_path / "off", **kw)).run()
    assert np.abs(staged - np.array([v for _, v in _step_losses(tmp_path / "off")])).max() > 1e-3


@pytest.mark.parametrize("schedule,checkpointing", [("gpipe", False), ("1f1b", True)])
def test_each_wgpu_stage_allocates_its_memory_estimate(tmp_path, default_rt, schedule, checkpointing):
    """After a step of 3 micro-batches on 3 stages, each stage's training buckets (one per micro-batch it held at
    once; the final norm's and loss head's buffers on the last stage alone) add up to its `wgpu-train memory
    --pipeline-stages` estimate, byte for byte."""
    from test_engine import _allocated
    from wgpu_train.engines.resources import stage_memory

    folder = save_model(build_model("llama", num_hidden_layers=3), tmp_path / "llama")
    _, staged = _staged(folder, 3, schedule, precision="fp32")
    lora = LoraConfig(r=4, target_modules=("q_proj", "v_proj", "down_proj"), dropout=0.1)
    staged.add_lora(lora, seed=3)
    staged.engine.set_gradient_checkpointing(checkpointing)
    staged.engine.train_step(_micro_batches(1, 3), OptimizerParams(lr=1e-2), 1)
    estimates = stage_memory(staged.config, staged.engine.plan, 2, 9, lora, micro_batches=3, schedule=schedule,
                             gc=checkpointing)
    for stage, est in zip(staged.engine.runner.stages, estimates):
        caches = [stage.buckets] + stage._spare
        allocated = sum(_allocated(acts) for cache in caches for key, acts in cache.acts.items() if key[1])
        assert allocated == est["activations"] + est["logits"], (est["layers"], allocated, est)
    assert [est["in_flight"] for est in estimates] == ([3, 3, 1] if schedule == "gpipe" else [3, 2, 1])


def test_moe_through_wgpu_stages_equals_one_process(tmp_path, default_rt):
    """A Qwen3-MoE (a dense layer among the sparse ones) on 2 stages under 1F1B, LoRA on the experts and on the
    attention: each stage routes its own layers' tokens; losses, norms and trained tensors equal one process's."""
    from tiny_models import build_moe

    folder = save_model(build_moe("qwen3_moe", vocab_size=83), tmp_path / "qwen3_moe")
    one, staged = _staged(folder, 2, precision="fp32")
    lora = LoraConfig(r=3, target_modules=("q_proj",),
                      target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
    for model in (one, staged):
        model.add_lora(lora, seed=3)
    _same_steps(one, staged, steps=2, micro=2)
    assert_same_generation(one, staged)
