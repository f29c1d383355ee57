"""GRPO's tools with TRL 1.16's GRPOTrainer meanings (`tools`, `environment_factory`): --tool / --environment specs
loaded and checked, the tools of each rollout (an environment instance's public methods after the standalone tools),
and a turn's tool calls run as TRL runs them (a failure's text is the result, and is counted)."""
from __future__ import annotations

import ast
import asyncio
import inspect
import operator
from typing import Callable, Sequence

from wgpu_train.errors import ConfigError, ToolError
from wgpu_train.formats.tool_calls import function_schema
from wgpu_train.training.rewards.loading import RewardFunction, load_object

ENV_SPECIAL = ("reset", "get_reward")      # an environment's methods that are not tools

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers with + - * / // % ** and parentheses.

    Args:
        expression: The expression to evaluate, e.g. "12 * (3 + 4)".
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value,
                                                                                                   bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    result = value(ast.parse(str(expression), mode="eval").body)
    return str(int(result) if isinstance(result, float) and result.is_integer() else result)


BUILTIN_TOOLS = {"calculator": calculator}


def check_tool(fn, where: str) -> Callable:
    """`fn` if its JSON schema can be made (formats/tool_calls.function_schema: type hints on every parameter, a
    docstring describing each), else one ToolError line naming `where`."""
    if not callable(fn):
        raise ConfigError(f"{where}: {getattr(fn, '__name__', repr(fn))} is not a function")
    try:
        function_schema(fn)
    except ToolError as e:
        raise ToolError(f"{where}: {e}") from None
    return fn


def load_tool(spec: str) -> Callable:
    """A --tool spec: a built-in name (calculator), module:function or path.py:function, checked (check_tool)."""
    if ":" not in spec:
        if spec not in BUILTIN_TOOLS:
            raise ConfigError(f"--tool {spec!r}: not a built-in tool ({', '.join(BUILTIN_TOOLS)}), module:function "
                              f"or path.py:function")
        return BUILTIN_TOOLS[spec]
    return check_tool(load_object(spec, "--tool"), f"--tool {spec}")


def load_environment(spec: str):
    """An --environment spec, module:Class or path.py:Class: the class (checked when Toolbox probes it)."""
    return load_object(spec, "--environment", "class")


def environment_tools(instance) -> list:
    """An environment's tools as TRL finds them: its class's public functions but reset and get_reward, by name,
    bound to `instance`."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ENV_SPECIAL and not name.startswith("_")]


class Toolbox:
    """The standalone tools and an environment factory of a GRPO run. Like TRL, one instance is probed at
    construction (it must have reset; its methods are the environment's tools, checked) and kept in a pool that
    grows to a generation's rollouts: each rollout gets its own instance, reset with its record's columns."""

    def __init__(self, tools: Sequence[Callable] = (), environment_factory=None, where: str = "tools"):
        self.tools = [check_tool(t, where) for t in tools]
        self.factory = environment_factory
        self.pool: list = []
        self.reward_name = None       # the environment's class name when it defines get_reward (TRL's column)
        if environment_factory is not None:
            name = getattr(environment_factory, "__name__", repr(environment_factory))
            try:
                instance = environment_factory()
            except Exception as e:  # a user's class may raise anything when built
                raise ConfigError(f"environment {name}: building it failed ({type(e).__name__}: {e})") from None
            cls = type(instance)
            if not callable(getattr(cls, "reset", None)):
                raise ConfigError(f"environment {cls.__name__} has no reset method (TRL calls reset() before each "
                                  f"rollout)")
            for method in environment_tools(instance):
                check_tool(method, f"environment {cls.__name__}")
            if callable(getattr(cls, "get_reward", None)):
                self.reward_name = cls.__name__
            self.pool.append(instance)
        names = [t.__name__ for t in self.all_tools()]
        for n in names:
            if names.count(n) > 1:
                raise ConfigError(f"two tools are named {n!r}; the model calls them by name")

    def __bool__(self) -> bool:
        return bool(self.all_tools())

    def all_tools(self) -> list:
        """The tools a prompt is rendered with: the standalone ones, then the environment's (TRL's order)."""
        return self.tools + (environment_tools(self.pool[0]) if self.pool else [])

    def environments(self, records) -> list | None:
        """One environment instance per rollout of `records` (None without a factory), from the pool (grown as
        needed); reset_prompt resets each."""
        if self.factory is None:
            return None
        while len(self.pool) < len(records):
            self.pool.append(self.factory())
        return self.pool[:len(records)]

    def rollout_tools(self, environment) -> dict:
        """name -> callable: the standalone tools and `environment`'s methods (None: no environment)."""
        methods = environment_tools(environment) if environment is not None else []
        return {t.__name__: t for t in self.tools + methods}

    def reward_function(self) -> RewardFunction | None:
        """The environment's get_reward as a reward function named after its class (TRL's weight 1 column)."""
        if self.reward_name is None:
            return None

        def environment_reward(prompts, completions, environments=None, **kwargs):
            return [e.get_reward() for e in environments]
        return RewardFunction(self.reward_name, environment_reward)


def run_toolbox(config, tools=(), environment_factory=None) -> Toolbox:
    """A run's Toolbox: config.tool's specs, then `tools` (Python functions); config.environment's class or
    environment_factory; a bad one (or an environment given both ways) one line."""
    if environment_factory is not None and config.environment:
        raise ConfigError("give the environment once: environment_factory or --environment")
    return Toolbox([load_tool(t) for t in config.tool_specs()] + list(tools or ()),
                   environment_factory or (load_environment(config.environment) if config.environment else None))


def reset_prompt(prompt: list, environment, record_columns: dict) -> list:
    """A rollout's prompt after its environment's reset(**columns): reset's text (if not None) appended to the last
    message's content, as TRL does (a text part after a content of parts: a prompt with images)."""
    observation = environment.reset(**record_columns)
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]


def run_tool_calls(tool_calls: list, tools: dict) -> tuple[list, int, int]:
    """([tool messages], calls, failures) of one assistant turn's tool_calls, as TRL's _tool_call_loop runs them:
    each result str()-ed, a raised exception's {"error": text} the result and a failure, an unknown tool or a
    call that is not a function a failure too."""
    messages, failures = [], 0
    for call in tool_calls:
        if call.get("type", "function") == "function":
            function = call.get("function", {})
            name = function.get("name")
            try:
                if name not in tools:
                    raise ValueError(f"Tool {name} not found.")
                result = tools[name](**function.get("arguments", {}))
                if inspect.isawaitable(result):
                    result = asyncio.run(_awaited(result))
            except Exception as e:  # a tool may raise anything: its text is the model's result, as in TRL
                failures += 1
                result = {"error": str(e)}
        else:
            failures += 1
            name = call.get("name", "unknown")
            result = {"error": f"Unsupported tool call type: {call['type']}"}
        messages.append({"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)})
    return messages, len(tool_calls), failures


async def _awaited(result):
    return await result
