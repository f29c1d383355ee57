"""`wgpu-train eval --tasks NAME[,NAME...]`: lm-evaluation-harness tasks (the optional `eval` extra) on a model and
adapter, with lm_eval's flags, its results table and its results JSON."""
from __future__ import annotations

import argparse
import sys

from wgpu_train.errors import ConfigError
from wgpu_train.cli.options import whole

INSTALL = "pip install 'wgpu-train[eval]'"


def _limit(text: str):
    """--limit as lm_eval takes it: a whole number of documents per task, or a fraction of them below 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if value <= 0 or (value >= 1 and not value.is_integer()):
        raise argparse.ArgumentTypeError(f"must be a whole number of documents or a fraction in (0, 1), got {text}")
    return int(value) if value >= 1 else value


def add_harness_options(p):
    """eval's options for lm_eval's tasks (--batch-size, the model, adapter and backend options are eval's own)."""
    g = p.add_argument_group("lm-evaluation-harness tasks (the eval extra: " + INSTALL + ")")
    g.add_argument("--tasks", default=None, metavar="NAME[,NAME...]",
                   help="run these lm_eval tasks, groups or tags (e.g. hellaswag,arc_easy) instead of --data; data "
                        "comes from the datasets cache, local files or the hub, as lm_eval resolves it. --batch-size "
                        "and the model, adapter, storage and backend options apply; the dataset options do not")
    g.add_argument("--num-fewshot", type=whole(0), default=None, metavar="N",
                   help="examples in each prompt (default: each task's own, else 0)")
    g.add_argument("--limit", type=_limit, default=None, metavar="N",
                   help="only the first N documents of each task, or a fraction of them when N < 1 (for tests)")
    g.add_argument("--apply-chat-template", action="store_true",
                   help="render the prompts with the model's chat template (few-shot examples as turns)")
    g.add_argument("--output-path", default=None, metavar="PATH",
                   help="write lm_eval's results JSON: into PATH/NAME/results_<time>.json (NAME: the adapter's, "
                        "else the model's folder name; a hub id as org__name), or next to PATH.json as "
                        "PATH_<time>.json")
    g.add_argument("--include-path", default=None, metavar="DIR",
                   help="also the task YAML files under DIR (your own tasks)")


HARNESS_ONLY = ("num_fewshot", "limit", "apply_chat_template", "output_path", "include_path")


def refuse_harness_options(args):
    """ConfigError (one line) when an option that only lm_eval's tasks read is given without --tasks."""
    given = [name for name in HARNESS_ONLY if getattr(args, name) is not None and getattr(args, name) is not False]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(f"{flag} applies to lm-evaluation-harness tasks: give --tasks NAME[,NAME...] with it, or "
                          f"leave it out to evaluate --data")


def cmd_harness_eval(args) -> int:
    """Run the tasks of --tasks and print lm_eval's results table."""
    from wgpu_train.adapters.files import adapter_folder
    from wgpu_train.cli.adapter_settings import choose_settings, model_folder

    if args.data:
        raise ConfigError("--data and --tasks are two different evaluations (your dataset's loss, or lm_eval's "
                          "tasks): give one of them")
    names = [n.strip() for n in args.tasks.split(",") if n.strip()]
    if not names:
        raise ConfigError("--tasks names no task")
    try:
        from wgpu_train.harness.run import results_folder_name, results_tables, run_tasks
    except ModuleNotFoundError as e:    # lm_eval or a package it needs (datasets): the extra is not installed
        missing = (e.name or "").split(".")[0]
        if not missing or missing == "wgpu_train":
            raise
        raise ConfigError(f"--tasks runs lm-evaluation-harness, which is not installed (no module {missing}): "
                          f"{INSTALL}") from None
    adapter = adapter_folder(args.adapter_path)
    model_dir = model_folder(args.model, adapter)
    settings = choose_settings({"base_dtype": args.base_dtype, "embed_dtype": args.embed_dtype}, adapter, model_dir)
    model_args = {"pretrained": str(model_dir), **({"peft": str(adapter)} if adapter else {}),
                  "backend": args.backend, "device": args.device, "base_dtype": settings["base_dtype"],
                  "embed_dtype": settings["embed_dtype"]}
    results = run_tasks(model_args, names, batch_size=args.batch_size, num_fewshot=args.num_fewshot,
                        limit=args.limit, apply_chat_template=args.apply_chat_template,
                        output_path=args.output_path, include_path=args.include_path,
                        results_name=results_folder_name(args.adapter_path or args.model or str(model_dir)))
    print(results_tables(results))
    if args.output_path:
        print(f"results JSON written under {args.output_path}", file=sys.stderr)
    return 0
