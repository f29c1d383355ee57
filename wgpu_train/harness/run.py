"""lm_eval's tasks run on the "wgpu-train" model: names checked (an unknown one with lm_eval's close names), task
data resolved as lm_eval resolves it (a dataset missing offline in one line), the results JSON written as lm_eval
writes it (in a folder named after the model or adapter), and its results table."""
from __future__ import annotations

import contextlib
import difflib
import functools
import os
import subprocess
from pathlib import Path

import lm_eval.evaluator
from datasets.exceptions import DatasetNotFoundError
from lm_eval import simple_evaluate
from lm_eval.loggers import EvaluationTracker
from lm_eval.loggers.utils import get_commit_from_path
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table, sanitize_model_name

import wgpu_train.harness.lm  # noqa: F401 - registers the "wgpu-train" model
from wgpu_train.errors import ConfigError, DataError

MODEL_NAME = "wgpu-train"


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None = None) -> TaskManager:
    """lm_eval's TaskManager over its own tasks and those under include_path; it reads some fifteen thousand task
    configs (seconds), so a process builds it once per include_path."""
    return TaskManager(include_path=include_path)


def check_task_names(manager: TaskManager, names: list[str]):
    """ConfigError naming the first task, group or tag that lm_eval does not know, with its close names."""
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, manager.all_tasks, n=5)
            hint = f"close names: {', '.join(close)}" if close else "`lm_eval ls tasks` lists them"
            raise ConfigError(f"lm_eval has no task {name!r} ({hint})")


def load_tasks(manager: TaskManager, names: list[str]) -> list:
    """The Task and Group objects of `names` (a tag gives its tasks), their data loaded as lm_eval loads it: from
    local files, the datasets cache, or the hub. A dataset that cannot be had is a DataError."""
    objects = []
    for name in names:
        try:
            loaded = manager.load(name)
        except (ConnectionError, DatasetNotFoundError, FileNotFoundError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"task {name}: its data cannot be loaded ({first}); offline, a hub dataset must be in "
                            f"the datasets cache") from None
        objects += [loaded["groups"][name]] if name in loaded["groups"] else list(loaded["tasks"].values())
    return objects


def results_folder_name(model: str) -> str:
    """The folder lm_eval's results JSON goes into under an output folder, for a model or adapter as the user
    named it: a local folder's own name (lm_eval would make `../runs/out` into `..__runs__out`), a hub id as lm_eval
    names it (org__name)."""
    path = Path(model)
    if path.exists():
        return path.resolve().name or "model"
    return sanitize_model_name(model)


def _commit_quietly() -> str | None:
    """lm_eval's get_git_commit_hash (the commit of the repository the evaluation runs in, for its results JSON)
    with git's stderr discarded: outside a repository, git's "fatal: not a git repository" is no error of ours."""
    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, check=True)  # noqa: S607
        return done.stdout.decode().strip()
    except (subprocess.CalledProcessError, OSError):
        return get_commit_from_path(os.getcwd())


@contextlib.contextmanager
def _quiet_git():
    """simple_evaluate with _commit_quietly in place of lm_eval's commit look-up, restored afterwards."""
    loud = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = _commit_quietly
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = loud


def run_tasks(model_args: dict, names: list[str], batch_size: int = 8, num_fewshot: int | None = None,
              limit: int | float | None = None, apply_chat_template: bool = False, output_path: str | None = None,
              include_path: str | None = None, log_samples: bool = False, results_name: str | None = None) -> dict:
    """lm_eval's results of the tasks `names` on the "wgpu-train" model built from model_args (WgpuTrainLM's
    arguments). With output_path, the results JSON is written there as lm_eval writes it (a folder gets
    <results_name>/results_<time>.json, by default lm_eval's name of the model; a path ending in .json gets
    <name>_<time>.json beside it)."""
    manager = task_manager(include_path)
    check_task_names(manager, names)
    tasks = load_tasks(manager, names)
    tracker = EvaluationTracker(output_path=output_path) if output_path else None
    with _quiet_git():
        results = simple_evaluate(model=MODEL_NAME, model_args=model_args, tasks=tasks, batch_size=batch_size,
                                  num_fewshot=num_fewshot, limit=limit, apply_chat_template=apply_chat_template,
                                  task_manager=manager, evaluation_tracker=tracker, log_samples=log_samples)
    if tracker is not None:
        if results_name:
            tracker.general_config_tracker.model_name_sanitized = results_name
        samples = results.pop("samples", None)
        tracker.save_results_aggregated(results=results, samples=samples)
        if samples is not None:
            results["samples"] = samples
    return results


def results_tables(results: dict) -> str:
    """lm_eval's markdown table of the tasks' metrics, and of the groups' when there are groups."""
    tables = [make_table(results)]
    if results.get("groups"):
        tables.append(make_table(results, "groups"))
    return "\n".join(tables)
