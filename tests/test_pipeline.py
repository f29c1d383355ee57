"""Pipeline stages (distributed/pipeline_*.py, models/stage_plan.py, engines/numpy/stage.py): stage plans by hand and
balanced, each stage reading only its tensors, each stage's memory, and S = 2 or 3 stages with M micro-batches under
GPipe and 1F1B equal to one process (step losses and adapters) on the tiny Llama, Qwen3 and Gemma 3, in this process
and as Ray actors; checkpoints gathered into one process's format, resumed with another S; bad input in one line."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import wgpu_train
from finetune_helpers import one_line_error
from tiny_models import build_model, save_model
from tolerances import assert_close
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.adapters.files import read_adapter
from wgpu_train.distributed.data_parallel import DataParallelTrainer
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.distributed.pipeline_engine import LocalStages, PipelineEngine, stage_ops
from wgpu_train.distributed.pipeline_trainer import DataParallelPipelineTrainer, finetune_pipeline
from wgpu_train.engines.loading import load_model, load_stage
from wgpu_train.engines.model import Model
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.resources import balanced_stages, estimate_memory, stage_memory
from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig
from wgpu_train.models.stage_plan import parse_stage_layers, plan_stages
from wgpu_train.training.config import TrainConfig, default_model_dir
from wgpu_train.training.preference_trainer import PreferenceTrainer

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


# ---- stage plans --------------------------------------------------------------------------------------------

def test_stage_layers_by_hand():
    assert parse_stage_layers("0-1, 2,3-5", 6) == (range(0, 2), range(2, 3), range(3, 6))
    for text, what in (("0-1,1-3", "layer 1 is in two stages"), ("0-1,3", "layer 2 is in no stage"),
                       ("0-4", "the model has layers 0-3"), ("2-3,0-1", "out of order"), ("a-b", "FIRST-LAST")):
        with pytest.raises(ConfigError, match=what):
            parse_stage_layers(text, 4)
    with pytest.raises(ConfigError, match="names 2 stages, --pipeline-stages 3"):
        plan_stages(4, 3, "0-1,2-3")


def test_balanced_stages_weigh_the_embedding_and_head():
    assert plan_stages(4, 2).stages == (range(0, 2), range(2, 4))
    # a head as heavy as two layers moves the cut: the last stage takes one layer
    head = lambda k, a, b: b - a + (2 if k == 1 else 0)          # noqa: E731
    assert plan_stages(4, 2, stage_cost=head).stages == (range(0, 3), range(3, 4))
    with pytest.raises(ConfigError, match="more than the model's 4 layers"):
        plan_stages(4, 5)
    cfg = ModelConfig.from_folder(default_model_dir())
    assert balanced_stages(cfg, 2, None, 4, 64).describe() == "0-1,2-3"


def test_schedules_run_each_micro_batch_once_backwards_in_order():
    for schedule in ("gpipe", "1f1b"):
        for s_count, m in ((2, 1), (3, 4), (4, 2)):
            ops = stage_ops(schedule, s_count, m)
            assert ops[-1] == [("L", j) for j in range(m)]
            for s, stage in enumerate(ops[:-1]):
                assert [j for k, j in stage if k == "F"] == list(range(m))
                assert [j for k, j in stage if k == "B"] == list(range(m))
                held = max(sum(1 for k, j in stage[:i + 1] if k == "F") - sum(1 for k, j in stage[:i + 1] if k == "B")
                           for i in range(len(stage)))
                assert held == (m if schedule == "gpipe" else min(m, s_count - s))


# ---- loading and memory -------------------------------------------------------------------------------------

def _file_bytes(folder) -> dict:
    """name -> its bytes in model.safetensors, from the header alone."""
    raw = (folder / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])       # an untied head, a tied one
def test_a_stage_reads_only_its_tensors(tmp_path, arch):
    folder = save_model(build_model(arch, num_hidden_layers=3), tmp_path / arch)
    sizes = _file_bytes(folder)
    plan = plan_stages(3, 3, tied=arch == "qwen3")
    read = []
    for s in range(3):
        engine = load_stage(folder, plan, s, precision="fp32")
        layer = f"model.layers.{s}."
        mine = {k for k in sizes if k.startswith(layer)}
        mine |= {"model.embed_tokens.weight"} if s == 0 or (s == 2 and arch == "qwen3") else set()
        mine |= {"model.norm.weight"} | ({"lm_head.weight"} if arch == "llama" else set()) if s == 2 else set()
        assert set(engine.weights()) == mine
        assert engine.weights_bytes_read == sum(sizes[k] for k in mine)
        read.append(engine.weights_bytes_read)
    tied_copy = sizes["model.embed_tokens.weight"] if arch == "qwen3" else 0
    assert sum(read) == sum(sizes.values()) + tied_copy


def test_stage_memory_adds_up_to_the_whole(tmp_path):
    cfg = ModelConfig.from_folder(default_model_dir())
    lora = LoraConfig(r=8)
    whole = estimate_memory(cfg, 4, 64, lora)
    stages = stage_memory(cfg, plan_stages(4, 2), 4, 64, lora, micro_batches=1)
    for key in ("weights", "trainable_state", "logits"):
        assert sum(s[key] for s in stages) == whole[key], key
    # the layers' activations split between the stages; each holds the shared buffers of a layer's backward
    assert whole["activations"] < sum(s["activations"] for s in stages) < 2 * whole["activations"]
    gpipe = stage_memory(cfg, plan_stages(4, 2), 4, 64, lora, micro_batches=4, schedule="gpipe")
    f1b = stage_memory(cfg, plan_stages(4, 2), 4, 64, lora, micro_batches=4, schedule="1f1b")
    assert [s["in_flight"] for s in gpipe] == [4, 4] and [s["in_flight"] for s in f1b] == [2, 1]
    assert f1b[0]["activations"] < gpipe[0]["activations"]


def test_memory_command_prints_each_stage(capsys):
    from wgpu_train.cli.main import main

    assert main(["memory", "--pipeline-stages", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [s["layers"] for s in result["stages"]] == ["0-1", "2-3"]
    for stage in result["stages"]:
        assert {"weights", "trainable_state", "activations", "logits", "total"} <= set(stage)
    assert sum(s["weights"] for s in result["stages"]) == result["weights"]      # untied: no copy
    one_line_error(capsys, ["memory", "--pipeline-stages", "5"], "more than the model's 4 layers")
    one_line_error(capsys, ["memory", "--stage-layers", "0-2,2-3"], "layer 2 is in two stages")


# ---- equal to one process -----------------------------------------------------------------------------------

def _micro_batches(seed: int, m: int, vocab: int = 83):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(m):
        ids = rng.integers(0, vocab, (2, 9)).astype(np.int32)
        targets = rng.integers(0, vocab, (2, 9)).astype(np.int64)
        targets[0, :3] = -100
        seg = np.ones_like(ids)
        seg[1, 7:] = 0
        targets[1, 7:] = -100
        out.append((ids, targets, seg, np.broadcast_to(np.arange(9, dtype=np.int32), ids.shape).copy()))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("stages,schedule,precision,base", [(2, "gpipe", "fp32", "float32"),
                                                            (3, "1f1b", "fp32", "float32"),
                                                            (3, "gpipe", "bf16", "nf4")])
def test_stages_equal_one_process(tmp_path, arch, stages, schedule, precision, base):
    """Three steps of three micro-batches (LoRA dropout on, the norm clipped; an NF4 base with bf16 activations):
    the same step losses, token counts and norms, and the same adapter and AdamW moments."""
    kw = {"layer_types": LAYER_TYPES} if arch == "gemma3" else {}
    folder = save_model(build_model(arch, num_hidden_layers=3, **kw), tmp_path / arch)
    lora = LoraConfig(r=4, target_modules=("q_proj", "v_proj", "down_proj"), dropout=0.1)
    one = load_model(folder, "numpy", base_dtype=base, precision=precision)
    one.add_lora(lora, seed=3)
    plan = plan_stages(3, stages, tied=one.config.tie_word_embeddings)
    engine = PipelineEngine(LocalStages([load_stage(folder, plan, s, base_dtype=base, precision=precision)
                                         for s in range(stages)]), plan, schedule)
    Model(one.config, engine, folder).add_lora(lora, seed=3)
    hp = OptimizerParams(lr=1e-2, max_grad_norm=0.5, weight_decay=0.01)
    for step in range(1, 4):
        micro = _micro_batches(step, 3)
        expected = one.engine.train_step(micro, hp, step)
        got = engine.train_step(micro, hp, step)
        assert got[:2] == expected[:2] and got[3] == expected[3], (got, expected)
        assert_close(got[2], expected[2], "pipeline_numpy", f"step {step}'s norm")
    mine, theirs = engine.trainable(), one.engine.trainable()
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], "pipeline_numpy", k)
    moments = engine.optimizer_state()
    for k, (m, v) in one.engine.optimizer_state().items():
        assert_close(moments[k][0], m, "pipeline_numpy", k + " (first moment)")
        assert_close(moments[k][1], v, "pipeline_numpy", k + " (second moment)")
    assert max(float(np.abs(theirs[k]).max()) for k in theirs if k.endswith("lora_B")) > 1e-3      # it trained
    ids, targets, seg, pos = _micro_batches(9, 1)[0]
    assert_close(engine.loss(ids, targets, seg, pos)[0], one.engine.loss(ids, targets, seg, pos)[0],
                 "pipeline_numpy", "a forward-only loss")
    assert_close(engine.token_losses(ids, targets, seg, pos, reference=True),
                 one.engine.token_losses(ids, targets, seg, pos, reference=True), "pipeline_numpy", "token losses")


@pytest.mark.parametrize("arch,trained", [("llama", ("embed_tokens", "lm_head", False)),
                                           ("qwen3", ("lm_head", False)), ("qwen3", ("embed_tokens", True)),
                                           ("qwen3", "full"), ("gemma3", ("embed_tokens", True))])
def test_trained_embedding_and_head_through_stages_equal_one_process(tmp_path, arch, trained):
    """modules_to_save (an untied model's embedding on the first stage and head on the last; a tied model's head
    untied on the last; a tied copy trained as one on both end stages, its gradients summed) and full
    fine-tuning (every stage's weights, the tied embedding as one): one process's steps and tensors."""
    kw = {"layer_types": LAYER_TYPES} if arch == "gemma3" else {}
    folder = save_model(build_model(arch, num_hidden_layers=3, **kw), tmp_path / arch)
    one = load_model(folder, "numpy", precision="fp32")
    plan = plan_stages(3, 3, tied=one.config.tie_word_embeddings)
    engine = PipelineEngine(LocalStages([load_stage(folder, plan, s, precision="fp32") for s in range(3)]), plan)
    staged = Model(one.config, engine, folder)
    for model in (one, staged):
        if trained == "full":
            model.set_full_finetune()
        else:
            model.add_lora(LoraConfig(r=4, target_modules=("q_proj", "v_proj"), modules_to_save=trained[:-1],
                                      ensure_weight_tying=trained[-1]), seed=3)
    # a tied embedding trained as one sums its two stages' gradients in another order than one process
    tol = "pipeline_tied_sum" if plan.tied and (trained == "full" or trained[-1]) else "pipeline_numpy"
    hp = OptimizerParams(lr=1e-2, max_grad_norm=0.5, weight_decay=0.01)
    for step in range(1, 4):
        micro = _micro_batches(step, 2)
        expected = one.engine.train_step(micro, hp, step)
        got = engine.train_step(micro, hp, step)
        assert got[1] == expected[1] and got[3] == expected[3], (got, expected)
        assert_close(np.array(got[::2]), np.array(expected[::2]), tol, f"step {step}'s loss and norm")
    mine, theirs = engine.trainable(), one.engine.trainable()
    assert sorted(mine) == sorted(theirs) and ("model.embed_tokens.weight" in theirs or "lm_head.weight" in theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], tol, k)
    if plan.tied and "model.embed_tokens.weight" in theirs and "lm_head.weight" not in theirs:
        # trained as one: the last stage's copy (its head) took the same updates as the first's
        head = engine.runner.stages[2].weights()["model.embed_tokens.weight"]
        assert_close(head, mine["model.embed_tokens.weight"], "exact", "the last stage's tied head")


class CountingStages(LocalStages):
    """LocalStages that note the base weights the driver fetches."""

    def __init__(self, stages):
        super().__init__(stages)
        self.fetched = []

    def call(self, s: int, method: str, *args, returns: int = 1):
        if method == "weight":
            self.fetched.append(args[0])
        return super().call(s, method, *args, returns=returns)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dora_in_f16_through_stages_equals_one_process(tmp_path, arch):
    """DoRA (each module's magnitude starts from its weight, fetched from the stage that holds it alone) with f16
    activations and dynamic loss scaling (the last stage scales the loss, every stage unscales and updates its
    scaler alike) on 2 stages: one process's steps, scale and adapter."""
    kw = {"layer_types": LAYER_TYPES} if arch == "gemma3" else {}
    folder = save_model(build_model(arch, num_hidden_layers=3, **kw), tmp_path / arch)
    lora = LoraConfig(r=4, target_modules=("q_proj", "v_proj", "down_proj"), use_dora=True)
    one = load_model(folder, "numpy", precision="f16")
    one.add_lora(lora, seed=3)
    plan = plan_stages(3, 2, tied=one.config.tie_word_embeddings)
    runner = CountingStages([load_stage(folder, plan, s, precision="f16") for s in range(2)])
    engine = PipelineEngine(runner, plan)
    Model(one.config, engine, folder).add_lora(lora, seed=3)
    # the driver read the DoRA modules' weights alone, not the model
    assert sorted(runner.fetched) == sorted(p + ".weight" for p in lora.modules(one.config))
    hp = OptimizerParams(lr=1e-2, max_grad_norm=0.5)
    for step in range(1, 4):
        micro = _micro_batches(step, 2)
        expected = one.engine.train_step(micro, hp, step)
        got = engine.train_step(micro, hp, step)
        assert got[:2] == expected[:2] and got[3] == expected[3], (got, expected)
    assert engine.loss_scaler.state_dict() == one.engine.loss_scaler.state_dict()
    mine, theirs = engine.trainable(), one.engine.trainable()
    assert any(k.endswith("lora_magnitude_vector") for k in theirs) and sorted(mine) == sorted(theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], "pipeline_numpy", k)


# ---- whole runs: the Trainer over stages ----------------------------------------------------------------------

def _run_config(out, **kw) -> TrainConfig:
    """The embedded default, cut short: 4 steps of 2 micro-batches of 2 rows, LoRA dropout on, no validation."""
    base = dict(out=str(out), backend="numpy", no_progress=True, eval_generate=False, log_every=1, max_steps=4,
                batch_size=2, grad_accum=2, lora_dropout=0.1, lr=1e-2, save_every=2, valid_split=0.0,
                lora_targets="q_proj,v_proj,down_proj", max_eval_samples=0)
    base.update(kw)
    return TrainConfig(**base)


def _step_losses(out) -> list:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "lr" in r]


def _assert_same_adapter(out, reference):
    mine, theirs = read_adapter(out)[1], read_adapter(reference)[1]
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], "pipeline_numpy", k)
    assert max(float(np.abs(theirs[k]).max()) for k in theirs if "lora_B" in k) > 1e-3      # it trained


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline") / "one"
    finetune(_run_config(out))
    return out


def test_embedded_default_through_stages_equals_one_process(tmp_path, one_process):
    out = tmp_path / "staged"
    summary = finetune_pipeline(_run_config(out, pipeline_stages=2, grad_accum=1, pipeline_micro_batches=2,
                                            pipeline_schedule="gpipe"), local=True)
    assert _step_losses(out) == _step_losses(one_process)
    _assert_same_adapter(out, one_process)
    assert json.loads((out / "train_config.json").read_text())["grad_accum"] == 2
    staged = summary["pipeline"]
    assert staged["stages"] == 2 and staged["layers"] == "0-1,2-3" and staged["micro_batches"] == 2
    assert sum(staged["weights_bytes_read"]) == sum(_file_bytes(default_model_dir()).values())    # untied


def test_a_checkpoint_resumes_with_another_number_of_stages(tmp_path, one_process):
    """Four steps on 2 stages (checkpoints at 2 and 4); from its step-2 checkpoint the last two steps on 3 stages,
    or in one process: the step losses and adapter of one uninterrupted process either way (a checkpoint holds
    every stage's LoRA and AdamW state, in one process's format)."""
    out = tmp_path / "run"
    finetune_pipeline(_run_config(out, pipeline_stages=2), local=True)
    _assert_same_adapter(out, one_process)
    step2 = out / "checkpoints" / "step-000002"
    for name, stages in (("three", 3), ("one", None)):
        folder = tmp_path / name
        config = _run_config(folder, resume=str(step2), pipeline_stages=stages)
        finetune_pipeline(config, local=True) if stages else finetune(config)
        assert _step_losses(folder) == _step_losses(one_process)[2:]
        _assert_same_adapter(folder, one_process)


def test_a_run_continues_an_adapter_and_scores_exact_match_through_stages(tmp_path, one_process):
    """--adapter-path (the adapter one_process wrote) through 2 stages, with exact match before and after (greedy
    generation through the stages): one process's losses, adapter and exact match."""
    kw = dict(model=str(default_model_dir()), adapter_path=str(one_process), max_steps=2, eval_generate=True,
              max_eval_samples=3, max_new_tokens=8)
    one = finetune(_run_config(tmp_path / "one", **kw))
    staged = finetune_pipeline(_run_config(tmp_path / "staged", pipeline_stages=2, **kw), local=True)
    assert _step_losses(tmp_path / "staged") == _step_losses(tmp_path / "one")
    _assert_same_adapter(tmp_path / "staged", tmp_path / "one")
    for key in ("exact_match_before", "exact_match_after"):
        assert staged[key] is not None and staged[key] == one[key], key


@pytest.fixture(scope="module")
def one_thread(tmp_path_factory):
    """The run of one_process with BLAS on one thread (in a subprocess), as Ray's workers run it
    (OMP_NUM_THREADS=1): on more threads BLAS sums a GEMM in another order."""
    pytest.importorskip("ray", reason="Ray is the test extra's (pip install -e '.[test]')")
    reference = tmp_path_factory.mktemp("pipeline") / "one_thread"
    code = (f"from wgpu_train.distributed.dispatch import finetune\nfrom test_pipeline import _run_config\n"
            f"finetune(_run_config({str(reference)!r}))")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(wgpu_train.__file__).parents[1]), str(Path(__file__).parent)])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    return reference


def test_stages_as_ray_actors_equal_one_process(tmp_path, one_thread):
    out = tmp_path / "ray"
    summary = finetune(_run_config(out, pipeline_stages=2))
    assert summary["pipeline"]["ray"] is True
    assert _step_losses(out) == _step_losses(one_thread)
    _assert_same_adapter(out, one_thread)
    # each actor read its own tensors: its layers' and the embedding (first) or the norm and head (last)
    sizes = _file_bytes(default_model_dir())
    plan = plan_stages(4, 2, summary["pipeline"]["layers"])
    assert summary["pipeline"]["weights_bytes_read"] == [sum(n for k, n in sizes.items() if plan.holds(s, k))
                                                         for s in range(2)]
    # 4 steps x 2 micro-batches of 2 rows: the first stage's outputs, the last's input gradients, float32 (fp32)
    assert all(b > 0 for b in summary["pipeline"]["boundary_bytes_sent"])


def test_a_killed_stage_restarts_from_the_last_checkpoint(tmp_path, one_thread):
    """The last stage's actor killed before its update of step 3: the stages restart from the step-2 checkpoint
    and the run ends with the uninterrupted run's step losses and adapter."""
    import ray

    faults = tmp_path / "faults"
    faults.mkdir()
    path = os.pathsep.join([str(Path(wgpu_train.__file__).parents[1]), str(Path(__file__).parent)])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "WGPU_TRAIN_TEST_FAULTS": str(faults)},
                          "worker_process_setup_hook": "ray_faults.install"})
    try:
        (faults / "kill-layer2-step3").touch()
        out = tmp_path / "killed"
        summary = finetune(_run_config(out, stage_layers="0-1,2-3", max_failures=1))
    finally:
        ray.shutdown()
    assert not (faults / "kill-layer2-step3").exists()       # the order was carried out
    assert summary["resumed_from"] == str(out / "checkpoints" / "step-000002")
    assert _step_losses(out) == _step_losses(one_thread)
    _assert_same_adapter(out, one_thread)


# ---- bad input: one line, exit 2 -------------------------------------------------------------------------------

def test_bad_pipeline_options_are_one_line(tmp_path, capsys):
    run = ["finetune", "--backend", "numpy", "--out", str(tmp_path / "x"), "--max-steps", "1", "--no-progress"]
    one_line_error(capsys, run + ["--pipeline-stages", "2", "--num-workers", "2", "--objective", "dpo"],
                   "leave out --num-workers with a preference objective")
    one_line_error(capsys, run + ["--pipeline-micro-batches", "2"], "give --pipeline-stages")
    one_line_error(capsys, run + ["--pipeline-stages", "2", "--pipeline-micro-batches", "3", "--grad-accum", "2"],
                   "give one")
    one_line_error(capsys, run + ["--pipeline-stages", "2", "--backend", "wgpu"], "leave out --backend wgpu")
    one_line_error(capsys, run + ["--pipeline-stages", "5"], "more than the model's 4 layers", after_log=True)
    one_line_error(capsys, run + ["--stage-layers", "0-1,3"], "layer 2 is in no stage", after_log=True)
    one_line_error(capsys, run + ["--pipeline-stages", "3", "--device", "0,1"], "2 devices for 3 pipeline stages",
                   after_log=True)
    one_line_error(capsys, ["generate", "--prompt", "hi", "--pipeline-stages", "2"], "leave out --pipeline-stages")
    with pytest.raises(ConfigError, match="leave out --objective grpo"):
        TrainConfig(pipeline_stages=2, objective="grpo", batch_size=8)


def test_stages_of_a_1b_shaped_model(tmp_path, capsys):
    """Llama 3.2 1B's shape (16 layers, a tied 128k-row embedding) in bfloat16, 4 micro-batches of 4 x 512 under
    1F1B: the stages' weights add up to the whole plus the tied embedding's second copy; the largest stage falls
    with S, and balancing by memory does no worse than cutting the layers evenly."""
    from wgpu_train.cli.main import main

    shape = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
             "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    args = ["memory", "--model", str(tmp_path), "--batch-size", "4", "--max-seq-len", "512", "--base-dtype",
            "bfloat16", "--pipeline-micro-batches", "4", "--json"]
    largest = []
    embedding = 128256 * 2048 * 2
    for s_count in (2, 3, 4):
        assert main(args + ["--pipeline-stages", str(s_count)]) == 0
        result = json.loads(capsys.readouterr().out)
        stages = result["stages"]
        assert sum(s["weights"] for s in stages) == result["weights"] + embedding
        largest.append(max(s["total"] for s in stages))
        even = ",".join(f"{i * 16 // s_count}-{(i + 1) * 16 // s_count - 1}" for i in range(s_count))
        assert main(args + ["--stage-layers", even]) == 0
        assert largest[-1] <= max(s["total"] for s in json.loads(capsys.readouterr().out)["stages"])
    assert result["total"] > largest[0] > largest[1] > largest[2]


# ---- preference objectives through stages ------------------------------------------------------------------

class TwoPasses(PreferenceTrainer):
    """One process's preference run on the pipeline's path: the step's rows scored, then the weighted step."""

    def _one_pass(self) -> bool:
        return False


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_preference_objectives_through_stages_equal_one_process(tmp_path, objective):
    """DPO (pairs; the reference the same stages with the adapter off) and KTO (unpaired, with its KL rows) on 2
    local stages: the step losses and adapter of one process that also scores the step's rows first, then
    trains the weighted micro-batches (where one process scores DPO's pairs inside the step's own forward, float32
    sums differ: 5e-7 in an adapter element after three steps, measured)."""
    from finetune_helpers import make_model_dir, write_jsonl

    model = make_model_dir(tmp_path / "model")
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
    rows = [{"prompt": f"after {words[i % 8]} {i}?", "chosen": f" {words[(i + 1) % 8]} {i}",
             "rejected": f" {words[(i + 3) % 8]} {i}"} for i in range(12)]
    if objective == "kto":
        rows = [{"prompt": r["prompt"], "completion": r["chosen"] if i % 3 else r["rejected"], "label": bool(i % 3)}
                for i, r in enumerate(rows)]
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    kw = dict(model=str(model), data=str(tmp_path / "data"), backend="numpy", no_progress=True, lr=1e-2,
              eval_generate=False, log_every=1, objective=objective, batch_size=2, grad_accum=2, max_steps=3,
              valid_split=0.0, lr_schedule="constant")
    TwoPasses(TrainConfig(out=str(tmp_path / "one"), **kw)).run()
    summary = finetune_pipeline(TrainConfig(out=str(tmp_path / "staged"), pipeline_stages=2, **kw), local=True)
    assert summary["pipeline"]["layers"] == "0-0,1-1"
    steps, losses = zip(*_step_losses(tmp_path / "staged"))
    assert list(steps) == [1, 2, 3]
    assert_close(np.array(losses), np.array([v for _, v in _step_losses(tmp_path / "one")]), "pipeline_numpy",
                 f"{objective}'s step losses")
    _assert_same_adapter(tmp_path / "staged", tmp_path / "one")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_generation_through_stages_equals_one_process(tmp_path, arch):
    """Greedy and sampled generation of ragged prompts (generate_batch: prefill, then a token a step), each stage
    keeping its layers' KV cache: one process's tokens, and the engine protocol's members all there."""
    from wgpu_train.engines.protocol import MEMBERS, PipelineStage

    kw = {"layer_types": LAYER_TYPES} if arch == "gemma3" else {}
    folder = save_model(build_model(arch, num_hidden_layers=3, **kw), tmp_path / arch)
    one = load_model(folder, "numpy", precision="fp32")
    plan = plan_stages(3, 3, tied=one.config.tie_word_embeddings)
    stages = [load_stage(folder, plan, s, precision="fp32") for s in range(3)]
    assert all(isinstance(stage, PipelineStage) for stage in stages)
    engine = PipelineEngine(LocalStages(stages), plan)
    assert [name for name in MEMBERS if not hasattr(engine, name)] == []
    staged = Model(one.config, engine, folder)
    for model in (one, staged):
        model.add_lora(LoraConfig(r=4, target_modules=("q_proj", "v_proj")), seed=3)
        model.engine.set_trainable({k: v + 0.05 for k, v in model.engine.trainable().items()})   # B != 0
    prompts = [np.array(p) for p in ([5, 9, 11, 2, 40], [7, 3], [60, 61, 62])]
    for temperature in (0.0, 0.8):
        expected = one.generate_batch(prompts, max_new_tokens=6, temperature=temperature, seed=4)
        assert staged.generate_batch(prompts, max_new_tokens=6, temperature=temperature, seed=4) == expected


# ---- 2-D: data-parallel workers, each with its pipeline --------------------------------------------------------

class LocalDataParallelPipelineTrainer(DataParallelPipelineTrainer):
    local_stages = True          # each worker's stages in its own thread's process, no Ray


def _run_workers(trainer_class, cfg: TrainConfig, world: int) -> list:
    """Data-parallel ranks as threads of this process (test_data_parallel's ThreadCollective)."""
    import threading

    from test_data_parallel import ThreadCollective

    slots, barrier = [None] * world, threading.Barrier(world, timeout=300)
    out, errors = [None] * world, []

    def work(rank):
        try:
            out[rank] = trainer_class(cfg, ThreadCollective(slots, barrier, rank)).run()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_two_workers_of_two_stages_equal_two_workers(tmp_path):
    """A 2 x 2 grid (2 data-parallel workers, each a pipeline of 2 stages, its stages' gradients all-reduced as
    one flat array) against 2 data-parallel workers of one process each, on the same global batch: the same step
    losses and adapter (the all-reduce sums each element alike, whatever the order of the tensors)."""
    kw = dict(num_workers=2, grad_accum=1, save_every=0)
    _run_workers(DataParallelTrainer, _run_config(tmp_path / "dp", **kw), 2)
    grid = _run_workers(LocalDataParallelPipelineTrainer, _run_config(tmp_path / "grid", pipeline_stages=2, **kw), 2)
    assert grid[0]["pipeline"]["stages"] == 2 and grid[0]["data_parallel"]["workers"] == 2
    assert _step_losses(tmp_path / "grid") == _step_losses(tmp_path / "dp")
    _assert_same_adapter(tmp_path / "grid", tmp_path / "dp")
