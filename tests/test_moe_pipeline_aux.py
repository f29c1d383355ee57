"""The router's aux loss through pipeline stages (issue 43): on a tiny Qwen3-MoE with LoRA on the router, the
attention and the experts, stages in this process equal one process: the aux loss, the gradients (the router's
through the whole forward's load-balancing statistics) and the adapter after a few steps; splits where every stage
holds sparse layers, where the middle one holds only a dense one, and where the last holds none (f16's loss scaling,
full fine-tuning: the router's own weight trained); on the NumPy engine and WebGPU (gradient checkpointing too); whole
finetune runs with grad accumulation through 2 stages in this process and as Ray actors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from finetune_helpers import build_tokenizer, make_data_dir
from test_pipeline import _micro_batches
from tiny_models import build_moe, save_model
from tolerances import assert_close
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.adapters.files import read_adapter
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.distributed.pipeline_engine import LocalStages, PipelineEngine
from wgpu_train.distributed.pipeline_trainer import finetune_pipeline
from wgpu_train.engines.loading import load_model, load_stage
from wgpu_train.engines.model import Model
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.models.stage_plan import plan_stages
from wgpu_train.training.config import TrainConfig

LORA = LoraConfig(r=3, target_modules=("q_proj", "gate"),
                  target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
COEF = 0.3          # large enough that the aux term moves the router's gradient well above the tolerances


def _pair(folder, stage_layers: str, schedule: str, backend: str = "numpy", full: bool = False, **kw):
    """One process and a PipelineEngine over the stages of `stage_layers`, LoRA (LORA, same seed) on both (full:
    every weight trained instead), the router's aux loss on at COEF."""
    one = load_model(folder, backend, **kw)
    plan = plan_stages(one.config.num_hidden_layers, stage_layers.count(",") + 1, stage_layers,
                       tied=one.config.tie_word_embeddings)
    runner = LocalStages([load_stage(folder, plan, s, backend, **kw) for s in range(len(plan))])
    staged = Model(one.config, PipelineEngine(runner, plan, schedule), folder)
    for model in (one, staged):
        if full:
            model.set_full_finetune()
        else:
            model.add_lora(LORA, seed=3)
        model.engine.set_router_aux_loss(COEF)
    return one, staged


def _same_steps(one, staged, tolerance: str, steps: int = 3, micro: int = 2):
    """`steps` optimizer steps of `micro` micro-batches: the same losses, token counts, aux losses and norms, and
    the same adapter after them."""
    hp = OptimizerParams(lr=1e-2, max_grad_norm=0.5)
    for step in range(1, steps + 1):
        batches = _micro_batches(step, micro, vocab=61)
        expected = one.engine.train_step(batches, hp, step)
        got = staged.engine.train_step(batches, hp, step)
        assert got[1] == expected[1] and got[3] == expected[3], (got, expected)
        assert one.engine.last_aux_loss > 0 and staged.engine.last_aux_loss is not None
        assert_close(np.array([got[0], got[2], staged.engine.last_aux_loss]),
                     np.array([expected[0], expected[2], one.engine.last_aux_loss]), tolerance,
                     f"step {step}'s loss, norm and aux loss")
    mine, theirs = staged.engine.trainable(), one.engine.trainable()
    assert sorted(mine) == sorted(theirs) and any(".mlp.gate." in k for k in theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], tolerance, k)


def test_full_fine_tuning_with_the_aux_loss_through_stages_equals_one_process(tmp_path):
    """Every weight trained (the routers' own, as a trained base weight), 2 stages that both route: two steps
    equal one process's."""
    folder = save_model(build_moe("qwen3_moe", seed=4, vocab_size=61), tmp_path / "moe")
    one, staged = _pair(folder, "0,1-2", "1f1b", full=True, precision="fp32")
    _same_steps(one, staged, "pipeline_tied_sum", steps=2)      # its tied embedding trained on both end stages


@pytest.mark.parametrize("stage_layers,dense,schedule,precision", [
    ("0,1-2", [1], "gpipe", "fp32"),        # both stages route
    ("0,1-2", [1], "1f1b", "f16"),          # the aux loss's gradient loss-scaled as the token loss's
    ("0,1,2", [1], "1f1b", "fp32"),         # the middle stage routes none
    ("0-1,2", [2], "1f1b", "fp32")])        # the last one routes none
def test_aux_loss_through_stages_equals_one_process(tmp_path, stage_layers, dense, schedule, precision):
    """A micro-batch's gradients with the aux loss on (forward_backward: its full weight), the router's LoRA
    among them and moved by the aux term, then three steps of two micro-batches (each its share of the aux loss):
    the stages' equal one process's."""
    folder = save_model(build_moe("qwen3_moe", seed=4, vocab_size=61, mlp_only_layers=dense), tmp_path / "moe")
    one, staged = _pair(folder, stage_layers, schedule, precision=precision)
    ids, targets, seg, pos = _micro_batches(7, 1, vocab=61)[0]
    grads = []
    for engine in (one.engine, staged.engine):
        engine.zero_grads()
        engine.forward_backward(ids, targets, seg, pos, 1.0 / int((targets != -100).sum()))
        grads.append(engine.gradients())
    assert sorted(grads[0]) == sorted(grads[1])
    for k, g in grads[0].items():
        assert_close(grads[1][k], g, "pipeline_numpy", k)
    staged.engine.set_router_aux_loss(0.0)
    staged.engine.zero_grads()
    staged.engine.forward_backward(ids, targets, seg, pos, 1.0 / int((targets != -100).sum()))
    plain = staged.engine.gradients()
    router = [k for k in plain if ".mlp.gate." in k and k.endswith("lora_B")]    # B starts at 0: A has none
    assert router and max(float(np.abs(plain[k] - grads[0][k]).max()) for k in router) > 1e-4
    staged.engine.set_router_aux_loss(COEF)
    _same_steps(one, staged, "pipeline_numpy")


@pytest.mark.parametrize("stage_layers,dense,checkpointing", [("0,1-2", [1], False), ("0-1,2", [2], True)])
def test_aux_loss_through_wgpu_stages_equals_one_process(tmp_path, default_rt, stage_layers, dense, checkpointing):
    """On the WebGPU engine, 2 stages under 1F1B, both routing (the last adds the first's statistics to its own on
    the device before its backward) or, with gradient checkpointing (a backward that recomputes the routing
    counts nothing twice), the last routing none (it hands the first's on): two steps of two micro-batches equal
    one WebGPU process's, aux loss and adapter (the router's LoRA included)."""
    folder = save_model(build_moe("qwen3_moe", seed=4, vocab_size=61, mlp_only_layers=dense), tmp_path / "moe")
    one, staged = _pair(folder, stage_layers, "1f1b", "wgpu", precision="fp32")
    for model in (one, staged):
        model.engine.set_gradient_checkpointing(checkpointing)
    _same_steps(one, staged, "pipeline_wgpu", steps=2)


def _aux_losses(out) -> list:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["aux_loss"]) for r in rows if "grad_norm" in r]


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    """(the runs' settings, the folder of one process's run): a tiny Qwen3-MoE with a tokenizer, finetune with
    --router-aux-loss-coef, LoRA on q_proj, the router and the experts, three steps of two accumulated
    micro-batches."""
    root = tmp_path_factory.mktemp("moe_aux_runs")
    folder = root / "model"
    save_model(build_moe("qwen3_moe", seed=4, vocab_size=build_tokenizer(folder)), folder)
    base = dict(model=str(folder), data=str(make_data_dir(root / "data")), backend="numpy", no_progress=True,
                eval_generate=False, log_every=1, max_steps=3, batch_size=2, lr=1e-2, valid_split=0.0,
                max_eval_samples=0, lora_targets="q_proj,gate", router_aux_loss_coef=COEF,
                lora_target_parameters="mlp.experts.gate_up_proj,mlp.experts.down_proj")
    finetune(TrainConfig(out=str(root / "one"), grad_accum=2, **base))
    return base, root / "one"


def _same_run(out, one):
    """The logged loss and aux_loss of each step and the adapter after them, the router's LoRA included."""
    mine, theirs = _aux_losses(out), _aux_losses(one)
    assert [r[0] for r in mine] == [r[0] for r in theirs] == [1, 2, 3] and all(r[2] > 0 for r in theirs)
    assert_close(np.array(mine)[:, 1:], np.array(theirs)[:, 1:], "pipeline_numpy", "step losses and aux losses")
    mine, theirs = read_adapter(out)[1], read_adapter(one)[1]
    assert sorted(mine) == sorted(theirs) and any(".mlp.gate." in k for k in theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], "pipeline_numpy", k)


def test_a_run_with_grad_accum_through_stages_equals_one_process(tmp_path, one_run):
    """The run through 2 stages in this process (a step's micro-batches the pipeline's) equals one process's
    with grad accumulation: each micro-batch's own aux loss, averaged in the log, its share in the gradient."""
    base, one = one_run
    finetune_pipeline(TrainConfig(out=str(tmp_path / "staged"), stage_layers="0,1-2", pipeline_micro_batches=2,
                                  **base), local=True)
    _same_run(tmp_path / "staged", one)


def test_a_run_through_ray_stages_equals_one_process(tmp_path, one_run):
    """The same run with its 2 stages as Ray actors (the statistics travel as object refs between them)."""
    pytest.importorskip("ray", reason="Ray is the test extra's (pip install -e '.[test]')")
    base, one = one_run
    summary = finetune(TrainConfig(out=str(tmp_path / "ray"), stage_layers="0,1-2", pipeline_micro_batches=2,
                                   **base))
    assert summary["pipeline"]["ray"] is True
    _same_run(tmp_path / "ray", one)
