"""TrainConfig on the command line: one option per field with its help text, a TOML file of the same keys,
and their resolution (command line > TOML > a resumed run's settings > the embedded recipe > defaults)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path

from wgpu_train.errors import ConfigError


def _unwrap(tp):
    """(base type, optional) of an annotation such as `int | None`."""
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _parse_value(base, optional: bool, name: str):
    # a str-valued enum (Precision) is read as its name: the option's choices check it, TrainConfig parses it
    convert = str if issubclass(base, str) else base

    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {base.__name__} value: {text!r}") from None
    parse.__name__ = base.__name__  # argparse names the type in its messages
    return parse


def add_train_config_options(p):
    """One option per TrainConfig field, with its help text; unset options stay out of the namespace."""
    from wgpu_train.training.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        base, optional = _unwrap(hints[f.name])
        text = f.metadata["help"].replace("%", "%%")
        if base is bool:
            if f.default is True:
                text += " (default: on)"
            action = "store_true" if f.name.startswith("no_") else argparse.BooleanOptionalAction
            p.add_argument(flag, action=action, default=argparse.SUPPRESS, help=text)
            continue
        if f.default is not None and f.name not in ("model", "data"):
            text += f" (default: {f.default})"
        choices = f.metadata.get("choices")
        metavar = None if choices else {"model": "DIR", "data": "PATH", "out": "DIR", "resume": "DIR"}.get(
            f.name, base.__name__.upper())
        p.add_argument(flag, type=_parse_value(base, optional, f.name), default=argparse.SUPPRESS,
                       choices=choices, metavar=metavar, help=text,
                       **({"action": JoinRepeated} if f.name in ("data", "reward", "tool") else {}))


class JoinRepeated(argparse.Action):
    """A repeated option's values joined with commas (--data a --data b -> "a,b")."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if before is None else f"{before},{values}")


def load_toml_config(path) -> dict:
    """TrainConfig values from a TOML file (keys are field names, '-' or '_'); unknown keys or wrong types
    raise ConfigError naming the key."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    from wgpu_train.training.config import TrainConfig

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
    hints = typing.get_type_hints(TrainConfig)
    out = {}
    spelled = {}                                  # field name -> the key that gave it
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in hints:
            raise ConfigError(f"{path}: unknown key '{key}' (the keys are the options of wgpu-train finetune)")
        if name in spelled:
            raise ConfigError(f"{path}: '{spelled[name]}' and '{key}' are the same key; give it once")
        spelled[name] = key
        base, _ = _unwrap(hints[name])
        base = str if issubclass(base, str) else base       # a str-valued enum (Precision): its name
        if name in ("lora_targets", "data", "modules_to_save") and isinstance(value, list) and \
                all(isinstance(v, str) for v in value):
            value = ",".join(value)
        if name == "lora_layers" and (isinstance(value, int) and not isinstance(value, bool) or
                                      isinstance(value, list) and all(isinstance(v, int) for v in value)):
            value = str(value) if isinstance(value, int) else ",".join(map(str, value)) + ","   # a list: indices
        if name in ("lora_rank_pattern", "lora_alpha_pattern") and isinstance(value, dict):
            value = json.dumps(value)      # a TOML table: pattern = value
        ok = (isinstance(value, bool) if base is bool else
              isinstance(value, int) and not isinstance(value, bool) if base is int else
              isinstance(value, (int, float)) and not isinstance(value, bool) if base is float else
              isinstance(value, str))
        if not ok:
            raise ConfigError(f"{path}: key '{key}' must be {'a ' + base.__name__ if base is not int else 'an int'}, "
                              f"got {type(value).__name__} {value!r}")
        out[name] = float(value) if base is float else value
    return out


def resolve_train_config(args: argparse.Namespace):
    """TrainConfig from the command line > TOML file (--config) > with --resume, the resumed run's settings
    (config.resumed_settings: its train_config.json but how it was started; --out then defaults to the run's
    folder) > the embedded recipe (only for the default run: no --model, --data or --adapter-path) > defaults.

    --epochs given (command line or TOML) without --max-steps drops a max_steps that comes from the run or the
    recipe, since max_steps would override it; when both are given, max_steps wins (TrainConfig's meaning)
    and a note on stderr says so."""
    from wgpu_train.training.config import TrainConfig, default_run_values, resumed_settings
    from wgpu_train.training.objectives import objective_class

    given = load_toml_config(args.config) if getattr(args, "config", None) else {}
    given.update((f.name, getattr(args, f.name)) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name))
    run = resumed_settings(given["resume"]) if given.get("resume") else {}
    default_run = all(given.get(k) is None and run.get(k) is None for k in ("model", "data", "adapter_path"))
    objective = given.get("objective") or run.get("objective") or "sft"
    # the tool demo (an objective that takes --tool or --environment, given one) has a recipe of its own
    tools = "tool" in objective_class(objective).options and (given.get("tool") or given.get("environment"))
    recipe = objective + ("_tools" if tools else "")
    recipe = "images_demo" if given.get("images_demo") or run.get("images_demo") else recipe    # its own, too
    lower = {**(default_run_values(recipe) if default_run else {}), **run}
    if "epochs" in given:
        if "max_steps" not in given:
            lower.pop("max_steps", None)
        elif given["max_steps"] is not None:
            print(f"note: max_steps {given['max_steps']} overrides epochs {given['epochs']} (both given; "
                  f"epochs is ignored when max_steps is set)", file=sys.stderr)
    return TrainConfig(**{**lower, **given})
