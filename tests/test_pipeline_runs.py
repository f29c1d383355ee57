"""Whole runs through pipeline stages (distributed/pipeline_trainer.py, pipeline_ray.py): the embedded default
through 2 stages equal to one process, a checkpoint resumed with another S or in one process, an adapter continued
with exact match through the stages, 2 Ray actors equal to one process (each reading its own tensors), a killed
stage restarting from the last checkpoint, DPO and KTO through stages, a 2 x 2 grid of data-parallel workers of
2 stages (threads, and Ray Train), the stages on a placement group's bundles; bad input (a stage over its device's
memory, a cluster that cannot hold the stages) in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import wgpu_train
from finetune_helpers import make_model_dir, one_line_error, write_jsonl
from test_data_parallel import run_threads
from test_pipeline import file_bytes
from tolerances import assert_close
from wgpu_train.adapters.files import read_adapter
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.distributed.pipeline_trainer import PipelineStages, finetune_pipeline, pipeline_config
from wgpu_train.errors import ConfigError, DeviceError
from wgpu_train.models.stage_plan import plan_stages
from wgpu_train.training.config import TrainConfig, default_model_dir
from wgpu_train.training.preference_trainer import PreferenceTrainer


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
    # balanced by memory: under GPipe the first stage holds both micro-batches' buckets, the last one at a time
    assert staged["stages"] == 2 and staged["layers"] == "0-0,1-3" and staged["micro_batches"] == 2
    assert sum(staged["weights_bytes_read"]) == sum(file_bytes(default_model_dir()).values())    # untied


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
    code = (f"from wgpu_train.distributed.dispatch import finetune\nfrom test_pipeline_runs import _run_config\n"
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
    sizes = file_bytes(default_model_dir())
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


# ---- 2-D: data-parallel workers, each with its pipeline --------------------------------------------------------

def test_two_workers_of_two_stages_equal_two_workers(tmp_path):
    """A 2 x 2 grid (2 data-parallel workers, each a pipeline of 2 stages, its stages' gradients all-reduced as
    one flat array) against 2 data-parallel workers of one process each, on the same global batch: the same step
    losses and adapter (the all-reduce sums each element alike, whatever the order of the tensors)."""
    kw = dict(num_workers=2, grad_accum=1, save_every=0)
    run_threads(_run_config(tmp_path / "dp", **kw), 2)
    grid = run_threads(pipeline_config(_run_config(tmp_path / "grid", pipeline_stages=2, **kw)), 2,
                       placement=lambda rank: PipelineStages(local=True))
    assert grid[0]["pipeline"]["stages"] == 2 and grid[0]["data_parallel"]["workers"] == 2
    assert _step_losses(tmp_path / "grid") == _step_losses(tmp_path / "dp")
    _assert_same_adapter(tmp_path / "grid", tmp_path / "dp")


def test_two_workers_of_two_stages_on_ray_train_equal_one_process(tmp_path, one_thread):
    """The 2 x 2 grid on Ray Train: 2 workers (ray_worker.py), each through 2 stage actors on the bundles of its
    own placement group: one process's step losses and adapter, bit for bit (BLAS on one thread on both sides;
    2 workers of one micro-batch sum their gradients as one process sums its 2 micro-batches')."""
    out = tmp_path / "grid"
    summary = finetune(_run_config(out, num_workers=2, grad_accum=1, pipeline_stages=2, save_every=0))
    assert summary["pipeline"]["ray"] is True and summary["pipeline"]["stages"] == 2
    assert summary["data_parallel"]["workers"] == 2
    assert _step_losses(out) == _step_losses(one_thread)
    _assert_same_adapter(out, one_thread)


def test_stages_sit_on_the_bundles_of_one_placement_group(tmp_path, capsys):
    """On a local Ray of 2 CPUs: 2 stages sit each on its bundle of one PACK placement group, removed on close; a
    group the cluster can never hold is refused in one line at once (a resource no node has; more CPUs than it
    has), and one whose resources other work holds, after a bounded wait; a user error a stage raises comes back
    as its own line."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    from wgpu_train.distributed.pipeline_ray import RayStages
    from wgpu_train.distributed.stage_placement import reserve_stages

    path = os.pathsep.join([str(Path(wgpu_train.__file__).parents[1]), str(Path(__file__).parent)])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        stages = RayStages(default_model_dir(), plan_stages(4, 2, None), "float32", "auto", "fp32")
        group = stages.group
        table = placement_group_table(group)
        assert table["strategy"] == "PACK" and list(table["bundles"].values()) == [{"CPU": 1.0}] * 2
        assert [stages.attr(s, "weights_bytes_read") > 0 for s in range(2)] == [True, True]
        # an actor on a bundle takes a thousandth of that bundle's own resource
        seated = [f"bundle_group_{s}_{group.id.hex()}" for s in range(2)]
        assert _soon(lambda: [ray.available_resources().get(k) for k in seated] == [999.999] * 2)
        # a user error in a stage, e.g. a buffer over its device's binding limit: its own one line
        with pytest.raises(DeviceError, match="^over the binding limit$"):
            stages.get(ray.remote(num_cpus=0)(_refuse).remote())
        stages.close()
        assert placement_group_table(group)["state"] == "REMOVED"
        run = ["finetune", "--backend", "numpy", "--out", str(tmp_path / "x"), "--max-steps", "1", "--no-progress"]
        one_line_error(capsys, run + ["--pipeline-stages", "2", "--stage-resources", "CPU=1,widget=1"],
                       "which no node of the Ray cluster has", after_log=True)
        one_line_error(capsys, run + ["--pipeline-stages", "3"], "need CPU=3, and the Ray cluster has CPU=2",
                       after_log=True)
        held = placement_group([{"CPU": 2}])
        assert held.wait(30)
        started = time.perf_counter()
        with pytest.raises(ConfigError, match="did not free 2 bundles of CPU=1 .* within 1 s"):
            reserve_stages(ray, 2, {"CPU": 1}, wait_s=1)
        assert time.perf_counter() - started < 15
    finally:
        ray.shutdown()


def _refuse():
    raise DeviceError("over the binding limit")


def _soon(check, seconds: float = 10) -> bool:
    """Whether check() holds within `seconds` (Ray's resource view lags its scheduling)."""
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


# ---- bad input: one line, exit 2 -------------------------------------------------------------------------------

def test_bad_pipeline_options_are_one_line(tmp_path, capsys):
    run = ["finetune", "--backend", "numpy", "--out", str(tmp_path / "x"), "--max-steps", "1", "--no-progress"]
    one_line_error(capsys, run + ["--pipeline-micro-batches", "2"], "give --pipeline-stages")
    one_line_error(capsys, run + ["--pipeline-stages", "2", "--pipeline-micro-batches", "3", "--grad-accum", "2"],
                   "give one")
    one_line_error(capsys, run + ["--pipeline-stages", "5"], "more than the model's 4 layers", after_log=True)
    one_line_error(capsys, run + ["--stage-layers", "0-1,3"], "layer 2 is in no stage", after_log=True)
    one_line_error(capsys, run + ["--pipeline-stages", "3", "--device", "0,1"], "2 devices for 3 pipeline stages",
                   after_log=True)
    one_line_error(capsys, run + ["--pipeline-stages", "2", "--device-memory", "1MiB"],
                   "pipeline stage 0 (layers 0-1) needs an estimated", after_log=True)     # before any stage loads
    one_line_error(capsys, run + ["--pipeline-stages", "2", "--device-memory", "1GiB,1GiB,1GiB"],
                   "lists 3 sizes for 2 pipeline stages", after_log=True)
    one_line_error(capsys, run + ["--pipeline-stages", "2", "--device-memory", "12 parsecs"], "is not a size",
                   after_log=True)
    one_line_error(capsys, run + ["--device-memory", "1GiB"], "give --pipeline-stages")
    one_line_error(capsys, run + ["--pipeline-stages", "2", "--stage-resources", "GPU"], "give NAME=AMOUNT pairs",
                   after_log=True)
