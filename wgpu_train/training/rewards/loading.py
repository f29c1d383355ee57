"""--reward specs -> reward functions: a built-in name, an importable module:function, or path.py:function (a file
loaded from its path); --reward-weights checked against them."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np

from wgpu_train.errors import ConfigError
from wgpu_train.training.rewards.builtin import BUILTIN_REWARDS, FORMAT_REWARD, format_reward


@dataclass(frozen=True)
class RewardFunction:
    """A reward function and its name (the built-in's name, or the function's __name__ as TRL names it: metrics
    are rewards/<name>/mean). Called as TRL calls it: f(prompts=..., completions=..., **columns)."""

    name: str
    func: Callable[..., Any]

    def __call__(self, prompts: Sequence, completions: Sequence, **columns: Any) -> Any:
        return self.func(prompts=prompts, completions=completions, **columns)


def error_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _import_module(name: str, spec: str, option: str = "--reward") -> ModuleType:
    """The module `name`, the working folder searched after sys.path: a console script's sys.path lacks it, and
    that is where users keep their reward modules."""
    cwd = str(Path.cwd())
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(f"{option} {spec}: no module named {e.name!r}") from None
        raise ConfigError(f"{option} {spec}: importing {name} failed ({error_line(e)})") from None
    except Exception as e:  # the module's own code failed: anything a user's module raises
        raise ConfigError(f"{option} {spec}: importing {name} failed ({error_line(e)})") from None
    finally:
        if added:
            sys.path.remove(cwd)


def _load_file(where: str, spec: str, option: str = "--reward") -> ModuleType:
    """A Python file loaded from its path, once per process (registered under a name of its resolved path, so
    that two functions of one file share it and the file's own dataclasses and pickling find it)."""
    path = Path(where)
    if not path.is_file():
        raise ConfigError(f"{option} {spec}: no such file {where}")
    resolved = str(path.resolve())
    name = f"wgpu_train_reward_{path.stem}_{hashlib.sha1(resolved.encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # a syntax error or anything the file's code raises
        del sys.modules[name]
        raise ConfigError(f"{option} {spec}: loading {where} failed ({error_line(e)})") from None
    return module


def _load_one(spec: str, pattern: re.Pattern | None) -> RewardFunction:
    if ":" not in spec:
        if spec == FORMAT_REWARD:
            if pattern is None:
                raise ConfigError("--reward format needs --reward-pattern, the regular expression a completion must "
                                  "match")
            return RewardFunction(FORMAT_REWARD, format_reward(pattern))
        if spec in BUILTIN_REWARDS:
            return RewardFunction(spec, BUILTIN_REWARDS[spec])
        names = ", ".join(sorted([*BUILTIN_REWARDS, FORMAT_REWARD]))
        raise ConfigError(f"--reward {spec!r}: not a built-in reward ({names}), module:function or path.py:function")
    func = load_object(spec, "--reward", "function")
    return RewardFunction(getattr(func, "__name__", spec.rpartition(":")[2]), func)


def load_object(spec: str, option: str, what: str = "function"):
    """The callable a "module:name" or "path.py:name" spec names (a function, or a class); ConfigError naming
    `option` when it cannot be imported or is not callable."""
    where, _, attr = spec.rpartition(":")  # rpartition: a Windows path has a colon of its own
    if not where or not attr.isidentifier():
        raise ConfigError(f"{option} {spec!r}: expected module:{what} or path.py:{what}")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _load_file(where, spec, option) if is_file else _import_module(where, spec, option)
    func = getattr(module, attr, None)
    if func is None:
        raise ConfigError(f"{option} {spec}: {where} has no {what} {attr!r}")
    if not callable(func):
        raise ConfigError(f"{option} {spec}: {where}'s {attr!r} is not a {what} (it is {type(func).__name__})")
    return func


def load_rewards(specs: Sequence[str], pattern: str | None = None) -> list[RewardFunction]:
    """The reward functions of --reward specs, in their order. A spec is a built-in name (exact_match,
    word_positions, format: the last needs `pattern`, --reward-pattern, matched with re.fullmatch and re.DOTALL),
    "module:function" (imported; the working folder is searched too) or "path.py:function" (the file loaded
    from its path). A missing module, file or function, a file that fails to load, a bad pattern, a pattern
    without the format reward, or two functions of one name: ConfigError naming it."""
    if not specs:
        raise ConfigError("GRPO needs at least one reward function (--reward)")
    compiled = None
    if pattern is not None:
        if FORMAT_REWARD not in specs:
            raise ConfigError("--reward-pattern is read by the format reward only; add --reward format")
        try:
            compiled = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise ConfigError(f"--reward-pattern {pattern!r} is not a regular expression ({e})") from None
    functions = [_load_one(str(spec), compiled) for spec in specs]
    names = [f.name for f in functions]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"--reward: two reward functions are named {name!r}; each needs a name of its own "
                              "(its metrics are rewards/<name>/mean)")
    return functions


def check_reward_weights(weights: Sequence[float] | None, functions: Sequence[RewardFunction]) -> np.ndarray:
    """The weight of each reward function, (F,) float64: all 1.0 without weights (TRL's default); otherwise one
    finite number per function, in their order (negative weights allowed, as in TRL), else ConfigError."""
    if weights is None:
        return np.ones(len(functions), dtype=np.float64)
    weights = list(weights)
    if len(weights) != len(functions):
        names = ", ".join(f.name for f in functions)
        raise ConfigError(f"--reward-weights gives {len(weights)} weights for {len(functions)} reward functions "
                          f"({names})")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise ConfigError(f"--reward-weights: {w!r} is not a finite number")
    return np.asarray(weights, dtype=np.float64)  # (F,)
