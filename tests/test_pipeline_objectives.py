"""Objectives through pipeline stages (distributed/pipeline_engine.py) equal to one process: GRPO (its
TokenObjective computed by the last stage; beta > 0, num_iterations 2; local stages, and Ray actors once), GSPO
(scored, then trained), a --ref-adapter reference scored by the same stages (GRPO's and DPO's), and DPO and GRPO
on a 2 x 2 grid of data-parallel workers of 2 stages."""
from __future__ import annotations

import json

import numpy as np
import pytest

import wgpu_train as wt
from finetune_helpers import make_model_dir, write_jsonl
from test_grpo_train import length_reward, prompts
from test_data_parallel import run_threads
from test_pipeline_runs import TwoPasses, _assert_same_adapter, _step_losses
from tolerances import assert_close
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.distributed.pipeline_trainer import PipelineStages, finetune_pipeline, pipeline_config
from wgpu_train.errors import ConfigError
from wgpu_train.training.config import TrainConfig
from wgpu_train.training.grpo_trainer import COMPLETIONS_FILE

TIMINGS = ("tokens_per_s", "seconds")     # the rows' clock readings


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_objectives")
    model = make_model_dir(root / "model")
    (root / "grpo").mkdir()
    write_jsonl(root / "grpo" / "train.jsonl", prompts(8))
    _reference_adapter(model, root / "ref")
    return root, model


def _reference_adapter(model_dir, folder, **lora_kw):
    """A --ref-adapter unlike the runs' own (r 4 on every linear, B random: it moves the log-probabilities)."""
    ref = wt.load_model(model_dir, backend="numpy")
    lora = wt.LoraConfig(r=4, alpha=8, target_modules="all-linear", **lora_kw)
    ref.add_lora(lora, seed=1)
    rng = np.random.default_rng(7)
    ref._set_lora(lora, {p: (a, rng.normal(0, 0.2, b.shape).astype(np.float32))
                         for p, (a, b) in ref.engine.lora_tensors().items()}, seed=1)
    ref.save_adapter(folder)


def _rows(out) -> list:
    """metrics.jsonl without its clock readings."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMINGS)} for r in rows]


# ---- GRPO: the last stage computes the TokenObjective's weights ------------------------------------------------

def _grpo_config(workspace, out, **kw) -> TrainConfig:
    """4 steps of 2 micro-batches of 4 completions (2 prompts x 4 generations a step), beta > 0 (the reference:
    the same stages with the adapter off) and num_iterations 2 (the second step of a generation has a ratio)."""
    root, model = workspace
    base = dict(model=str(model), data=str(root / "grpo"), out=str(out), backend="numpy", no_progress=True,
                lr=2e-2, log_every=1, objective="grpo", batch_size=4, grad_accum=2, max_steps=4, valid_split=0.0,
                lr_schedule="constant", num_generations=4, max_completion_length=6, reward=None, beta=0.1,
                num_iterations=2, temperature=0.8, eval_generate=False, seed=3, save_every=0)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def grpo_one_process(workspace):
    out = workspace[0] / "grpo_one"
    finetune(_grpo_config(workspace, out), reward_funcs=[length_reward])
    return out


def _assert_same_grpo_run(out, one, entropy: bool = True):
    """completions.jsonl byte for byte, the metrics (the global norm within pipeline_numpy; without `entropy`,
    out's rows lack it) and the adapter."""
    assert (out / COMPLETIONS_FILE).read_bytes() == (one / COMPLETIONS_FILE).read_bytes()
    mine, theirs = _rows(out), _rows(one)
    if not entropy:
        assert not any("entropy" in r for r in mine)
        theirs = [{k: v for k, v in r.items() if k != "entropy"} for r in theirs]
    norms = [np.array([r.pop("grad_norm") for r in rows if "grad_norm" in r]) for rows in (mine, theirs)]
    assert_close(norms[0], norms[1], "pipeline_numpy", "the global norm, summed per stage then across them")
    assert mine == theirs
    steps = [r for r in theirs if "lr" in r]
    assert len(steps) == 4 and len(norms[1]) == 4 and all("kl" in r and ("entropy" in r) == entropy for r in steps)
    assert steps[1]["kl"] > 0            # the reference differs from the policy once it trained
    _assert_same_adapter(out, one)


def test_grpo_through_stages_equals_one_process(workspace, tmp_path, grpo_one_process):
    """GRPO on 2 local stages: the completions (sampled through the stages), the metrics (entropy and KL among
    them) and the adapter of one process."""
    summary = finetune_pipeline(_grpo_config(workspace, tmp_path / "staged", pipeline_stages=2),
                                local=True, reward_funcs=[length_reward])
    assert summary["pipeline"]["layers"] == "0-0,1-1"
    _assert_same_grpo_run(tmp_path / "staged", grpo_one_process)


def test_gspo_through_stages_scores_then_trains_as_one_process(workspace, tmp_path):
    """GSPO's sequence level through 2 local stages, which take no host function mid-step: the policy scored, then
    the weighted step; one process's completions, metrics (but the entropy, which its one-pass step logs) and
    adapter."""
    kw = dict(importance_sampling_level="sequence")
    finetune(_grpo_config(workspace, tmp_path / "one", **kw), reward_funcs=[length_reward])
    finetune_pipeline(_grpo_config(workspace, tmp_path / "staged", pipeline_stages=2, **kw), local=True,
                      reward_funcs=[length_reward])
    _assert_same_grpo_run(tmp_path / "staged", tmp_path / "one", entropy=False)


def test_grpo_with_a_ref_adapter_through_stages_equals_one_process(workspace, tmp_path, grpo_one_process):
    """--ref-adapter (the KL's reference: the stages score with it held beside the policy's adapter; one process
    loads a second model): one process's completions, metrics and adapter, and a KL unlike the adapter-off
    reference's."""
    kw = dict(ref_adapter=str(workspace[0] / "ref"))
    finetune(_grpo_config(workspace, tmp_path / "one", **kw), reward_funcs=[length_reward])
    finetune_pipeline(_grpo_config(workspace, tmp_path / "staged", pipeline_stages=2, **kw), local=True,
                      reward_funcs=[length_reward])
    _assert_same_grpo_run(tmp_path / "staged", tmp_path / "one")
    kl = [r["kl"] for r in _rows(tmp_path / "staged") if "kl" in r]
    assert min(abs(a - b) for a, b in zip(kl, (r["kl"] for r in _rows(grpo_one_process) if "kl" in r))) > 1e-3


# ---- DPO: data-parallel workers, each through its own stages ---------------------------------------------------

def _dpo_config(workspace, out, **kw) -> TrainConfig:
    """DPO on 12 pairs: 3 steps of 2 micro-batches of 2 pairs (the reference the adapter switched off)."""
    root, model = workspace
    data = root / "dpo"
    if not data.exists():
        words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
        data.mkdir()
        write_jsonl(data / "train.jsonl", [{"prompt": f"after {words[i % 8]} {i}?",
                                            "chosen": f" {words[(i + 1) % 8]} {i}",
                                            "rejected": f" {words[(i + 3) % 8]} {i}"} for i in range(12)])
    base = dict(model=str(model), data=str(data), out=str(out), backend="numpy", no_progress=True, lr=1e-2,
                eval_generate=False, log_every=1, objective="dpo", batch_size=2, grad_accum=2, max_steps=3,
                valid_split=0.0, lr_schedule="constant", save_every=0)
    base.update(kw)
    return TrainConfig(**base)


def _grid(cfg: TrainConfig) -> list:
    """2 data-parallel ranks as threads of this process, each through its own 2 local pipeline stages."""
    return run_threads(pipeline_config(cfg), 2, placement=lambda rank: PipelineStages(local=True))


def test_dpo_on_two_workers_of_two_stages_equals_two_workers(workspace, tmp_path):
    """DPO on a 2 x 2 grid (2 data-parallel workers, each through 2 local stages; both score the step's rows, then
    train the weighted micro-batches) against 2 data-parallel workers of one process each: the same step losses,
    metrics and adapter."""
    kw = dict(num_workers=2, grad_accum=1)
    run_threads(_dpo_config(workspace, tmp_path / "dp", **kw), 2)
    grid = _grid(_dpo_config(workspace, tmp_path / "grid", pipeline_stages=2, **kw))
    assert grid[0]["pipeline"]["stages"] == 2 and grid[0]["data_parallel"]["workers"] == 2
    assert _rows(tmp_path / "grid") == _rows(tmp_path / "dp")
    assert [s for s, _ in _step_losses(tmp_path / "grid")] == [1, 2, 3]
    _assert_same_adapter(tmp_path / "grid", tmp_path / "dp")


def test_dpo_with_a_ref_adapter_through_stages_equals_one_process(workspace, tmp_path):
    """DPO with --ref-adapter on 2 local stages (the reference precomputed by the same stages, the adapter held
    beside the policy's) against one process that loads it on a second model and scores, then trains, as the
    stages do: the same step losses and adapter; and step losses unlike those of the adapter-off reference."""
    kw = dict(ref_adapter=str(workspace[0] / "ref"))
    TwoPasses(_dpo_config(workspace, tmp_path / "one", **kw)).run()
    summary = finetune_pipeline(_dpo_config(workspace, tmp_path / "staged", pipeline_stages=2, **kw), local=True)
    assert summary["objective"]["reference"] == "precomputed"
    staged, one = (np.array([v for _, v in _step_losses(tmp_path / n)]) for n in ("staged", "one"))
    assert_close(staged, one, "pipeline_numpy", "DPO's step losses with --ref-adapter")
    _assert_same_adapter(tmp_path / "staged", tmp_path / "one")
    TwoPasses(_dpo_config(workspace, tmp_path / "off")).run()
    assert np.abs(staged - np.array([v for _, v in _step_losses(tmp_path / "off")])).max() > 1e-3


def test_grpo_through_ray_actors_equals_one_process(workspace, tmp_path, grpo_one_process):
    """GRPO on 2 Ray actors (each objective crosses to the last stage's process with its micro-batch; the log-
    probabilities and entropies come back with the losses): one process's completions, metrics and adapter. The
    tiny model's products give the same bits on one BLAS thread (Ray's workers) as on two (measured)."""
    pytest.importorskip("ray", reason="Ray is the test extra's (pip install -e '.[test]')")
    summary = finetune_pipeline(_grpo_config(workspace, tmp_path / "ray", pipeline_stages=2),
                                reward_funcs=[length_reward])
    assert summary["pipeline"]["ray"]
    _assert_same_grpo_run(tmp_path / "ray", grpo_one_process)


def test_grpo_on_two_workers_of_two_stages_equals_two_workers(workspace, tmp_path):
    """GRPO on a 2 x 2 grid (each worker samples and trains its whole groups through its own 2 stages) against 2
    data-parallel workers of one process each: the same completions, metrics and adapter."""
    kw = dict(num_workers=2, grad_accum=1, batch_size=4, reward="test_grpo_train:length_reward")
    run_threads(_grpo_config(workspace, tmp_path / "dp", **kw), 2)
    _grid(_grpo_config(workspace, tmp_path / "grid", pipeline_stages=2, **kw))
    _assert_same_grpo_run(tmp_path / "grid", tmp_path / "dp")


def test_a_reference_adapter_that_changes_base_weights_is_refused_through_stages(workspace, tmp_path):
    """A --ref-adapter with modules_to_save (a trained copy of the head) would replace a base weight on its
    stage: refused in one line, naming it."""
    _reference_adapter(workspace[1], tmp_path / "saves_head", modules_to_save=("lm_head",))
    config = _dpo_config(workspace, tmp_path / "staged", pipeline_stages=2, ref_adapter=str(tmp_path / "saves_head"))
    with pytest.raises(ConfigError, match="saves_head changes base weights") as e:
        finetune_pipeline(config, local=True)
    assert "\n" not in str(e.value)
