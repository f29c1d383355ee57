"""Data-parallel fine-tuning on Ray Train, on one small local Ray instance shared by these tests (2 CPUs, no
dashboard, shut down at the end): 2 workers give the adapter of 1 process with the same global batch (NumPy
and WebGPU engines), a worker killed mid-run is restarted from the last checkpoint and the run ends as an
uninterrupted one, a 2-worker checkpoint resumes in 1 process; the bad inputs are one line and exit code 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import wgpu_train
from finetune_helpers import make_data_dir, make_model_dir
from wgpu_train.cli.main import main
from wgpu_train.distributed.ray_driver import finetune_on_ray
from wgpu_train.adapters.files import read_adapter
from wgpu_train.distributed.ray_worker import adapter_for
from wgpu_train.training.trainer import Trainer
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.training.config import TrainConfig

ray = pytest.importorskip("ray", reason="Ray Train is the test extra's (pip install -e '.[test]')")

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The local Ray instance of these tests; yields the folder where a test orders a worker to die
    (tests/ray_faults.py, installed in every Ray worker process)."""
    folder = tmp_path_factory.mktemp("faults")
    path = os.pathsep.join([str(Path(wgpu_train.__file__).resolve().parent.parent), str(HERE)])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "WGPU_TRAIN_TEST_FAULTS": str(folder),
                                       "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")},
                          "worker_process_setup_hook": "ray_faults.install"})
    yield folder
    ray.shutdown()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    return make_model_dir(root / "model"), make_data_dir(root / "data", n_train=16), root


def config(workspace, out, **kw) -> TrainConfig:
    model, data, _ = workspace
    base = dict(model=str(model), data=str(data), out=str(out), backend="numpy", no_progress=True, lr=1e-2,
                eval_generate=False, log_every=1, max_steps=8, batch_size=2, save_every=2, lora_dropout=0.1,
                lora_targets="q_proj,v_proj,down_proj")
    base.update(kw)
    return TrainConfig(**base)


def assert_same_adapter(a, b, atol):
    ta, tb = read_adapter(a)[1], read_adapter(b)[1]
    assert sorted(ta) == sorted(tb)
    worst = max(float(np.abs(ta[k] - tb[k]).max()) for k in ta)
    assert worst <= atol, worst
    assert max(float(np.abs(ta[k]).max()) for k in ta if "lora_B" in k) > 1e-3    # it trained


@pytest.fixture(scope="module")
def two_workers(faults, workspace):
    """An uninterrupted 2-worker run on the NumPy engine (checkpoints every 2 steps), and its summary."""
    out = workspace[2] / "two"
    return out, finetune(config(workspace, out, num_workers=2))


def test_two_workers_equal_one_process_numpy(workspace, two_workers):
    out, summary = two_workers
    one = Trainer(config(workspace, workspace[2] / "one", grad_accum=2)).run()
    assert summary["steps"] == 8 and summary["data_parallel"]["workers"] == 2
    assert summary["trained_tokens"] == one["trained_tokens"]
    assert summary["train_loss_last"] == pytest.approx(one["train_loss_last"], rel=1e-6)
    assert_same_adapter(out, workspace[2] / "one", 1e-6)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004", "step-000006", "step-000008"]


def test_two_worker_checkpoint_resumes_in_one_process(workspace, two_workers):
    out, _ = two_workers
    resumed = Trainer(config(workspace, workspace[2] / "resumed",
                             resume=str(out / "checkpoints" / "step-000004"))).run()
    assert resumed["steps"] == 8 and resumed["resumed_from"].endswith("step-000004")
    assert_same_adapter(workspace[2] / "resumed", out, 1e-6)


def test_a_killed_worker_restarts_from_the_last_checkpoint(faults, workspace, two_workers):
    (faults / "kill-rank1-step5").touch()
    lines = []
    out = workspace[2] / "killed"
    summary = finetune_on_ray(config(workspace, out, num_workers=2, max_failures=1), log=lines.append)
    assert not (faults / "kill-rank1-step5").exists()        # the order was carried out
    assert summary["steps"] == 8
    assert summary["resumed_from"] == str(out / "checkpoints" / "step-000004")
    assert any("resuming at step 4" in line for line in lines), lines
    assert_same_adapter(out, two_workers[0], 1e-6)
    # metrics.jsonl was cut back to the checkpoint: one training row per step
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "grad_norm" in r] == list(range(1, 9))


def test_a_restarted_worker_continues_an_adapter_as_recorded(faults, workspace, tmp_path):
    """--adapter-path with the adapter's base as the model and its settings (rank 4, not the default; DoRA, one
    layer, an lm_head copy): the restarted workers take them all from the run's record, as the first ones took
    them from the adapter."""
    Trainer(config(workspace, tmp_path / "adapter", max_steps=2, lora_rank=4, dora=True, lora_layers="1,",
                   modules_to_save="lm_head")).run()
    kw = dict(model=None, adapter_path=str(tmp_path / "adapter"), max_steps=6)
    Trainer(config(workspace, tmp_path / "one", grad_accum=2, **kw)).run()
    (faults / "kill-rank0-step3").touch()
    summary = finetune_on_ray(config(workspace, tmp_path / "two", num_workers=2, **kw), log=lambda line: None)
    assert not (faults / "kill-rank0-step3").exists()
    assert summary["resumed_from"] == str(tmp_path / "two" / "checkpoints" / "step-000002")
    lora = read_adapter(tmp_path / "two")[0]
    assert (lora.r, lora.use_dora, lora.layers_to_transform, lora.modules_to_save) == (4, True, (1,), ("lm_head",))
    assert_same_adapter(tmp_path / "two", tmp_path / "one", 1e-6)


def test_two_workers_equal_one_process_wgpu(faults, workspace, default_rt):
    kw = dict(backend="wgpu", max_steps=8, save_every=0)
    one = Trainer(config(workspace, workspace[2] / "one-wgpu", grad_accum=2, **kw)).run()
    lines = []
    two = finetune_on_ray(config(workspace, workspace[2] / "two-wgpu", num_workers=2, **kw), log=lines.append)
    assert two["backend"] == "wgpu" and two["steps"] == 8
    if adapter_for(None, 0, 2)[1] == 2:        # one adapter of the default kind here (lavapipe in CI)
        assert any(line.startswith("[rank 0] 2 workers of this node share adapter") for line in lines), lines
    assert two["trained_tokens"] == one["trained_tokens"]
    # float32 sums in another order (each worker's half, then the all-reduce) over 8 AdamW steps
    assert_same_adapter(workspace[2] / "two-wgpu", workspace[2] / "one-wgpu", 1e-4)


def test_grpo_with_tools_on_ray_workers_equals_one_process(faults, tmp_path):
    """GRPO with --tool / --environment specs on 2 Ray workers, each rebuilding them and running the tool loop for
    its groups (turns made tool calls by ray_faults.called_parse, ordered in the workers): one process's
    completions, tools/* metrics, environment reward, losses and adapter."""
    from test_grpo_tools_distributed import SPECS, _assert_same_run, _config, one_process_run, tool_workspace

    tools = tool_workspace(tmp_path)
    one, one_summary = one_process_run(tools)
    (faults / "tool-calls").touch()
    try:
        two = finetune_on_ray(_config(tools, tmp_path / "two", num_workers=2, grad_accum=1, **SPECS),
                              log=lambda line: None)
    finally:
        (faults / "tool-calls").unlink()
    _assert_same_run(tmp_path / "two", one, two, one_summary, "data_parallel_numpy")


# ---- bad input: one line, exit code 2 --------------------------------------------------------------------

def _finetune_cli(workspace, out, *extra):
    model, data, _ = workspace
    return main(["finetune", "--model", str(model), "--data", str(data), "--backend", "numpy", "--out", str(out),
                 "--max-steps", "2", "--no-progress", *extra])


def _one_line(capsys) -> str:
    """The error line: the last of stderr and its only one (log lines of the workers' setup may precede it)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("error")] == err[-1:], err
    assert not any("Traceback" in line for line in err), err
    return err[-1]


@pytest.mark.parametrize("n", ["0", "-1"])
def test_num_workers_below_one(workspace, tmp_path, capsys, n):
    assert _finetune_cli(workspace, tmp_path / "o", "--num-workers", n) == 2
    assert _one_line(capsys) == f"error: num_workers must be at least 1, got {n}"


def test_ray_not_installed_names_the_extra(workspace, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)        # import ray fails as it does without the package
    assert _finetune_cli(workspace, tmp_path / "o", "--num-workers", "2") == 2
    assert "pip install 'wgpu-train[ray]'" in _one_line(capsys)


def test_unreachable_ray_address(workspace, tmp_path, capsys):
    assert _finetune_cli(workspace, tmp_path / "o", "--num-workers", "2", "--ray-address", "127.0.0.1:9") == 2
    assert _one_line(capsys).startswith("error: --ray-address 127.0.0.1:9: no Ray cluster reachable there")


def test_device_list_shorter_than_the_workers(workspace, tmp_path, capsys):
    assert _finetune_cli(workspace, tmp_path / "o", "--num-workers", "3", "--backend", "wgpu",
                         "--device", "0,1") == 2
    assert _one_line(capsys) == ("error: --device lists 2 adapters for 3 workers on a node: list one per worker, "
                                 "or give one adapter for the workers to share")


def test_fewer_samples_per_step_than_workers(faults, workspace, tmp_path, capsys):
    data = make_data_dir(tmp_path / "tiny", n_train=1, n_valid=1, n_test=0)
    model = workspace[0]
    code = main(["finetune", "--model", str(model), "--data", str(data), "--backend", "numpy", "--out",
                 str(tmp_path / "o"), "--max-steps", "2", "--no-progress", "--num-workers", "2",
                 "--max-failures", "0"])
    assert code == 2
    assert _one_line(capsys) == ("error: a step of this run holds 1 sample row(s), fewer than the 2 workers that "
                                 "share it: lower --num-workers, or raise --batch-size or --grad-accum")
    assert not (tmp_path / "o").exists()       # nothing was trained, nothing is left


def test_a_run_without_workers_imports_nothing_of_ray(workspace, tmp_path):
    model, data, _ = workspace
    code = ("import sys; from wgpu_train.distributed.dispatch import finetune; "
            f"finetune(model={str(model)!r}, data={str(data)!r}, out={str(tmp_path / 'o')!r}, backend='numpy', "
            "max_steps=1, no_progress=True, eval_generate=False); "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=str(Path(wgpu_train.__file__).resolve().parent.parent))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]" and (tmp_path / "o" / "summary.json").is_file()


def test_two_workers_equal_one_process_dpo(faults, workspace):
    """A preference objective on two workers (each scores the whole step, trains its half of the weighted
    micro-batches) gives the adapter of one process with the whole batch."""
    root = workspace[2]
    (root / "pairs").mkdir(exist_ok=True)
    rows = [{"prompt": f"after red {i}?", "chosen": f" blue {i}", "rejected": f" moon {i}"} for i in range(16)]
    (root / "pairs" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = dict(data=str(root / "pairs"), objective="dpo", lora_dropout=0.0, valid_split=0.0, max_steps=4,
              save_every=0)
    one = finetune(config(workspace, root / "dpo-one", grad_accum=2, **kw))
    two = finetune(config(workspace, root / "dpo-two", num_workers=2, **kw))
    assert two["data_parallel"]["workers"] == 2 and two["steps"] == one["steps"] == 4
    assert two["train_loss_last"] == pytest.approx(one["train_loss_last"], rel=1e-6)
    assert_same_adapter(root / "dpo-two", root / "dpo-one", 1e-6)


def _length_reward(prompts, completions, **kw):
    return [len(c) / 10 for c in completions]


def test_two_workers_equal_one_process_grpo(faults, workspace):
    """GRPO on two Ray workers (each samples and rewards its own groups; rewards, completions and
    log-probabilities gathered through torch.distributed), with a Python reward function that travels to the
    workers by Ray's pickling: the adapter of one process with the whole batch."""
    root = workspace[2]
    (root / "prompts").mkdir(exist_ok=True)
    rows = [{"prompt": f"after red {i}?"} for i in range(8)]
    (root / "prompts" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = dict(data=str(root / "prompts"), objective="grpo", lora_dropout=0.0, valid_split=0.0, max_steps=2,
              save_every=0, batch_size=4, num_generations=4, max_completion_length=4, beta=0.1)
    one = finetune(config(workspace, root / "grpo-one", grad_accum=2, **kw), reward_funcs=[_length_reward])
    two = finetune(config(workspace, root / "grpo-two", num_workers=2, **kw), reward_funcs=[_length_reward])
    assert two["data_parallel"]["workers"] == 2 and two["steps"] == one["steps"] == 2
    assert two["train_loss_last"] == pytest.approx(one["train_loss_last"], rel=1e-5, abs=1e-7)
    assert_same_adapter(root / "grpo-two", root / "grpo-one", 1e-6)
