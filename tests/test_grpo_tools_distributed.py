"""GRPO with tools on data-parallel workers (threads with an in-process collective) and through pipeline stages (in
this process), equal to one process: the completions.jsonl of every row (the turns and the prompts as the other
workers' environments reset them), the tools/* metrics and the environment's reward over all rollouts, the losses
and the adapter; tools as --tool / --environment specs and as Python objects; a checkpoint of a reused generation
resumed with its reset prompts; bad tools on workers or stages are one line before anything starts. A random
model's turns are made tool calls by ray_faults.called_parse's rule."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from finetune_helpers import make_model_dir, one_line_error, write_jsonl
from ray_faults import called_parse
from test_data_parallel import run_threads
from test_pipeline_objectives import _grid
from tolerances import assert_close
from wgpu_train.adapters.files import read_adapter
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.distributed.pipeline_trainer import finetune_pipeline
from wgpu_train.errors import ConfigError
from wgpu_train.training.config import TrainConfig
from wgpu_train.training.grpo_trainer import COMPLETIONS_FILE
from wgpu_train.training.tools_demo import TOOL_TEMPLATE
from wgpu_train.training.tools_rollouts import ToolRollouts

SPECS = dict(tool="test_grpo_tools_distributed:add", environment="test_grpo_tools_distributed:Counter")
METRICS = ("tools/call_frequency", "tools/failure_frequency", "rewards/Counter/mean", "reward", "reward_std",
           "completions/mean_length", "kl")


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    if b == 3:
        raise ValueError("b 3")
    return a + b


class Counter:
    """An environment: reset appends an observation to the prompt; bump is its tool; its reward is the count."""

    def __init__(self):
        self.count = 0

    def reset(self, **kwargs):
        self.count = 0
        return " Count."

    def bump(self, k: int) -> int:
        """Count up.

        Args:
            k: How much.
        """
        self.count += k % 7
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


def tool_workspace(root):
    """(root, model): the tiny model with the tool demo's chat template (ChatML with tools) and more end-of-turn ids
    in its generation config (a random model's turns end early, leaving room for tool results), and 8
    conversational prompts."""
    model = make_model_dir(root / "model")
    (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, *range(100, 300, 9)]}))
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
    write_jsonl(root / "prompts.jsonl", [{"prompt": [{"role": "user", "content": f"after {w} {i}?"}]}
                                         for i, w in enumerate(words)])
    return root, model


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return tool_workspace(tmp_path_factory.mktemp("grpo_tools_distributed"))


@pytest.fixture
def calls(monkeypatch):
    monkeypatch.setattr(ToolRollouts, "parse", called_parse(ToolRollouts.parse))


def _config(workspace, out, **kw) -> TrainConfig:
    """3 steps of 8 completions (2 prompts x 4), 2 rounds of tools at most, beta > 0 and num_iterations 2."""
    root, model = workspace
    base = dict(model=str(model), data=str(root / "prompts.jsonl"), out=str(out), backend="numpy", no_progress=True,
                lr=2e-2, log_every=1, objective="grpo", batch_size=4, grad_accum=2, max_steps=3, valid_split=0.0,
                num_generations=4, max_completion_length=40, beta=0.1, num_iterations=2, temperature=0.8,
                eval_generate=False, seed=3, save_every=0, lora_dropout=0.0, max_tool_calling_iterations=2)
    base.update(kw)
    return TrainConfig(**base)


def _steps(out) -> list:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]


@pytest.fixture(scope="module")
def one_process(workspace):
    return one_process_run(workspace)


def one_process_run(workspace):
    """(out, summary): one process's run with the tools as specs, checked for what its rollouts did."""
    out = workspace[0] / "one"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ToolRollouts, "parse", called_parse(ToolRollouts.parse))
        summary = finetune(_config(workspace, out, save_every=1, **SPECS))
    rows = [json.loads(line) for line in (out / COMPLETIONS_FILE).read_text().splitlines()]
    tools = [[m for m in r["turns"] if m["role"] == "tool"] for r in rows]
    # the rule's calls happened: both tools, a failure, two rounds in a row, the environment's observation
    assert {m["name"] for t in tools for m in t} == {"add", "bump"}
    assert any("error" in m["content"] for t in tools for m in t) and max(map(len, tools)) == 2
    assert any(len([m for m in r["turns"] if m["role"] == "assistant"]) == 3 for r in rows)
    assert all(r["prompt"][-1]["content"].endswith(" Count.") for r in rows)
    steps = _steps(out)
    assert all(s["tools/call_frequency"] > 0 for s in steps) and any(s["tools/failure_frequency"] > 0 for s in steps)
    assert any(s["rewards/Counter/mean"] > 0 for s in steps) and any(s["loss"] != 0 for s in steps)
    return out, summary


def _assert_same_run(out, one, summary, one_summary, tolerance="pipeline_numpy"):
    """completions.jsonl byte for byte (every row's prompt, turns and rewards), each step's metrics and loss, the
    tokens counted (reset prompts, tool results left out) and the adapter, within `tolerance`."""
    assert (out / COMPLETIONS_FILE).read_text() == (one / COMPLETIONS_FILE).read_text()
    mine, theirs = _steps(out), _steps(one)
    assert len(mine) == len(theirs) == 3
    for key in METRICS + ("loss",):
        assert_close([r[key] for r in mine], [r[key] for r in theirs], tolerance, key)
    assert summary["tokens"] == one_summary["tokens"] and summary["steps"] == one_summary["steps"] == 3
    _assert_same_adapter(out, one, tolerance)


def _assert_same_adapter(out, one, tolerance):
    mine, theirs = read_adapter(out)[1], read_adapter(one)[1]
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], tolerance, k)
    assert max(float(np.abs(theirs[k]).max()) for k in theirs if "lora_B" in k) > 1e-3      # it trained


def test_tools_on_two_workers_equal_one_process(workspace, tmp_path, calls, one_process):
    """Each worker rebuilds the tools and the environment from the specs (or gets the Python objects) and runs
    the tool loop for its whole groups; every row's turns, prompt, calls and failures are gathered, so the
    tools/* metrics and the environment's reward are averaged over all rollouts and rank 0 logs every row."""
    one, one_summary = one_process
    two = run_threads(_config(workspace, tmp_path / "two", num_workers=2, grad_accum=1, **SPECS), 2)
    _assert_same_run(tmp_path / "two", one, two[0], one_summary, tolerance="data_parallel_numpy")
    objects = run_threads(_config(workspace, tmp_path / "objects", num_workers=2, grad_accum=1), 2, tools=[add],
                          environment_factory=Counter)
    _assert_same_run(tmp_path / "objects", one, objects[0], one_summary, tolerance="data_parallel_numpy")
    # step 1's checkpoint holds the generation step 2 reuses, its rows' prompts as the environments reset them
    run_threads(_config(workspace, tmp_path / "resumed", num_workers=2, grad_accum=1,
                        resume=str(one / "checkpoints" / "step-000001"), **SPECS), 2)
    _assert_same_adapter(tmp_path / "resumed", one, "data_parallel_numpy")


def test_tools_through_stages_equal_one_process(workspace, tmp_path, calls, one_process):
    """Rollouts through 2 local pipeline stages (each row held in the stages' KV caches and extended after its
    tool results), the tools as Python objects; and a 2 x 2 grid (2 workers, each through its own 2 stages)."""
    one, one_summary = one_process
    staged = finetune_pipeline(_config(workspace, tmp_path / "staged", pipeline_stages=2), local=True,
                               tools=[add], environment_factory=Counter)
    assert staged["pipeline"]["stages"] == 2
    _assert_same_run(tmp_path / "staged", one, staged, one_summary)
    grid = _grid(_config(workspace, tmp_path / "grid", pipeline_stages=2, num_workers=2, grad_accum=1, **SPECS))
    _assert_same_run(tmp_path / "grid", one, grid[0], one_summary, tolerance="data_parallel_numpy")


def test_tools_through_ray_actor_stages_equal_one_process(workspace, tmp_path, calls, one_process):
    """The rollouts' held rows through 2 stages that are Ray actors (the tools in this process): one process's
    run."""
    pytest.importorskip("ray", reason="Ray is the test extra's (pip install -e '.[test]')")
    one, one_summary = one_process
    staged = finetune_pipeline(_config(workspace, tmp_path / "ray", pipeline_stages=2, **SPECS))
    assert staged["pipeline"]["ray"]
    _assert_same_run(tmp_path / "ray", one, staged, one_summary)


def test_bad_tools_on_workers_and_stages_are_one_line(workspace, tmp_path, capsys):
    """A tool that cannot be imported, one without a docstring and an environment without reset, with
    --num-workers (checked on the driver: Ray is not started) and with --pipeline-stages (checked before the stages
    load): one line, exit 2, no run folder."""
    root, model = workspace
    (tmp_path / "bad_tools.py").write_text(
        "def nodoc(x: int) -> int:\n    return x\n\n"
        "class NoReset:\n    def act(self, x: int) -> int:\n        \"\"\"Act.\n\n        Args:\n"
        "            x: a number\n        \"\"\"\n        return x\n")
    bad = str(tmp_path / "bad_tools.py")
    common = ["finetune", "--model", str(model), "--data", str(root / "prompts.jsonl"), "--backend", "numpy",
              "--objective", "grpo", "--max-steps", "1", "--no-progress", "--batch-size", "4", "--num-generations",
              "4", "--max-completion-length", "6", "--valid-split", "0", "--out"]
    cases = [(["--tool", "no_such_module_xyz:f"], "no module named 'no_such_module_xyz'"),
             (["--tool", f"{bad}:nodoc"], "no docstring"),
             (["--environment", f"{bad}:NoReset"], "has no reset method")]
    for i, (extra, match) in enumerate(cases):
        for where in (["--num-workers", "2"], ["--pipeline-stages", "2"]):
            run = tmp_path / f"run{i}{where[0]}"
            one_line_error(capsys, common + [str(run)] + where + extra, match, after_log=True)
            assert not run.exists()
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()
    with pytest.raises(ConfigError, match="give the environment once"):
        finetune(_config(workspace, tmp_path / "twice", num_workers=2, **SPECS), environment_factory=Counter)
