"""Tests of GRPO's rewards: the built-ins on standard and conversational completions, --reward specs loaded
(built-in, module:function, path.py:function) with one line for each that cannot be, TRL's own reward functions
called as TRL calls them, None -> NaN, and one RewardError line naming the function and the step for each failure."""

import logging
import math
import sys

import numpy as np
import pytest
from wgpu_train.errors import ConfigError, RewardError
from wgpu_train.training.rewards import (RewardFunction, RewardState, check_reward_weights, completion_text,
                                         compute_rewards, load_rewards)

A = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731  TRL's conversational completion


def _one(spec, completions, pattern=None, **columns):
    (function,) = load_rewards([spec], pattern)
    return function([""] * len(completions), completions, **columns)


# ---------------------------------------------------------------------------------------------------------------
# the built-ins

@pytest.mark.parametrize("wrap", [str, A], ids=["standard", "conversational"])
def test_exact_match(wrap):
    completions = [wrap(" 4\n"), wrap("5"), wrap("4"), wrap("four"), wrap("x")]
    answer = ["4", "4", None, None, None]
    solution = ["5", None, " 4 ", None, None]
    assert _one("exact_match", completions, answer=answer, solution=solution) == [1.0, 0.0, 1.0, None, None]
    assert _one("exact_match", [wrap("4"), wrap("4.0")], answer=[4, 4]) == [1.0, 0.0]   # str() of other types
    assert _one("exact_match", [wrap("4")]) == [None]   # no column at all


def test_format_matches_the_whole_stripped_text_across_lines():
    pattern = r"<think>.*?</think>\s*<answer>.*?</answer>"
    completions = ["<think>a\nb</think>\n<answer>4</answer>\n", A(" <think>x</think><answer>4</answer>"),
                   "<think>x</think><answer>4</answer> and more", "<answer>4</answer>"]
    assert _one("format", completions, pattern) == [1.0, 1.0, 0.0, 0.0]


def test_format_agrees_with_trl_think_format_reward():
    from trl.rewards import think_format_reward

    completions = [A("<think>\nreasoning.\n</think>\nanswer."), A("<think>\nreasoning.\nanswer."),
                   A("<think>a</think><think>b</think>"), A("no tags"), A("<think></think>")]
    ours = _one("format", completions, r"<think>(?!.*<think>)(.*?)</think>.*")
    assert ours == think_format_reward(completions)


@pytest.mark.parametrize("wrap", [str, A], ids=["standard", "conversational"])
def test_word_positions(wrap):
    cases = [("moon fox red", "moon fox red", 1.0), ("moon fox red", " moon  fox\nred ", 1.0),
             ("moon fox red", "moon red fox", 1 / 3), ("moon fox red", "red fox moon", 1 / 3),
             ("moon fox red", "moon fox", 2 / 3), ("moon fox red", "moon fox red cat", 3 / 4),
             ("moon fox red", "", 0.0), ("", "", 1.0), ("", "cat", 0.0), ("moon fox", "fox moon", 0.0)]
    got = _one("word_positions", [wrap(c) for _, c, _ in cases], answer=[a for a, _, _ in cases])
    assert got == pytest.approx([r for _, _, r in cases])
    assert _one("word_positions", [wrap("a b")], answer=[None], solution=["a c"]) == [0.5]
    assert _one("word_positions", [wrap("a b")], answer=[None]) == [None]


def test_completion_text():
    assert completion_text(" x ") == " x " and completion_text(A("y")) == "y"
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]) == "b"
    with pytest.raises(TypeError, match="a completion is a string or a list of messages, got int"):
        completion_text(3)


# ---------------------------------------------------------------------------------------------------------------
# loading

MODULE = '''
def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]

not_a_function = 3
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """my_rewards.py in a folder on sys.path, and the same file in the working folder, which is not on it."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "my_rewards.py").write_text(MODULE)
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "cwd_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path / "cwd"))])
    yield tmp_path
    for name in ("my_rewards", "cwd_rewards"):
        sys.modules.pop(name, None)


def test_load_builtin_module_and_file(reward_module):
    path = reward_module / "lib" / "my_rewards.py"
    functions = load_rewards(["exact_match", "my_rewards:length_reward", "word_positions"])
    assert [f.name for f in functions] == ["exact_match", "length_reward", "word_positions"]
    assert functions[1]([""], ["abc"]) == [3.0]
    (by_path,) = load_rewards([f"{path}:length_reward"])
    assert by_path([""], ["ab"]) == [2.0] and by_path.func is not functions[1].func   # loaded from its path
    (again,) = load_rewards([f"{path}:length_reward"])
    assert again.func is by_path.func   # a file is loaded once
    (cwd,) = load_rewards(["cwd_rewards:length_reward"])   # the working folder is searched, though not on sys.path
    assert cwd([""], ["a"]) == [1.0] and str(reward_module / "cwd") not in sys.path


def test_load_trl_reward_by_module():
    (function,) = load_rewards(["trl.rewards:think_format_reward"])
    assert function.name == "think_format_reward" and function([""], [A("<think>a</think>b")]) == [1.0]


BAD_SPECS = [
    (["nope"], "--reward 'nope': not a built-in reward (exact_match, format, word_positions), module:function or "
               "path.py:function"),
    (["no_such_module_xyz:f"], "--reward no_such_module_xyz:f: no module named 'no_such_module_xyz'"),
    (["no_such_module_xyz.sub:f"], "--reward no_such_module_xyz.sub:f: no module named 'no_such_module_xyz'"),
    (["my_rewards:missing"], "--reward my_rewards:missing: my_rewards has no function 'missing'"),
    (["my_rewards:not_a_function"], "--reward my_rewards:not_a_function: my_rewards's 'not_a_function' is not a "
                                    "function (it is int)"),
    (["missing.py:f"], "--reward missing.py:f: no such file missing.py"),
    (["broken.py:f"], "--reward broken.py:f: loading broken.py failed (ZeroDivisionError: division by zero)"),
    (["bad_import:f"], "--reward bad_import:f: importing bad_import failed (ModuleNotFoundError: No module named "
                       "'not_installed_xyz')"),
    (["syntax.py:f"], "--reward syntax.py:f: loading syntax.py failed (SyntaxError: "),
    (["my_rewards:"], "--reward 'my_rewards:': expected module:function or path.py:function"),
    (["format"], "--reward format needs --reward-pattern"),
    (["exact_match", "exact_match"], "--reward: two reward functions are named 'exact_match'"),
    ([], "GRPO needs at least one reward function (--reward)"),
]


@pytest.mark.parametrize("specs,line", BAD_SPECS, ids=[str(s) for s, _ in BAD_SPECS])
def test_bad_spec_is_one_line_naming_it(reward_module, specs, line):
    (reward_module / "cwd" / "broken.py").write_text("1 / 0\n")
    (reward_module / "cwd" / "syntax.py").write_text("def f(:\n")
    (reward_module / "cwd" / "bad_import.py").write_text("import not_installed_xyz\n")
    with pytest.raises(ConfigError) as e:
        load_rewards(specs)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)
    sys.modules.pop("bad_import", None)


@pytest.mark.parametrize("specs,pattern,line", [
    (["format"], "(unclosed", "--reward-pattern '(unclosed' is not a regular expression (missing ), unterminated"),
    (["exact_match"], "x+", "--reward-pattern is read by the format reward only; add --reward format"),
])
def test_bad_pattern(specs, pattern, line):
    with pytest.raises(ConfigError) as e:
        load_rewards(specs, pattern)
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_reward_weights():
    functions = load_rewards(["exact_match", "word_positions"])
    assert check_reward_weights(None, functions).tolist() == [1.0, 1.0]
    w = check_reward_weights([0.5, -2], functions)
    assert w.dtype == np.float64 and w.tolist() == [0.5, -2.0]
    with pytest.raises(ConfigError, match=r"^--reward-weights gives 1 weights for 2 reward functions "
                                          r"\(exact_match, word_positions\)$"):
        check_reward_weights([1.0], functions)
    for bad in (float("nan"), "1", True):
        with pytest.raises(ConfigError, match="is not a finite number"):
            check_reward_weights([1.0, bad], functions)


# ---------------------------------------------------------------------------------------------------------------
# scoring a step

def test_compute_rewards_passes_what_trl_passes_and_none_is_nan():
    seen = {}

    def record(prompts, completions, **kwargs):
        seen.update(kwargs, prompts=prompts, completions=completions)
        return [None, 0.25, np.float32(2), 1]

    prompts = ["p", "p", "q", "q"]
    completions = ["4", "5", "x", "y"]
    columns = {"answer": ["4", "4", None, None], "level": [1, 1, 2, 2]}
    out = compute_rewards([RewardFunction("record", record)] + load_rewards(["exact_match"]), prompts, completions,
                          columns, step=7, completion_ids=[[1], [2], [3], [4]], max_steps=9)
    assert out.dtype == np.float64 and out.shape == (4, 2)
    np.testing.assert_array_equal(out, [[np.nan, 1.0], [0.25, 0.0], [2.0, np.nan], [1.0, np.nan]])
    assert seen["prompts"] == prompts and seen["completions"] == completions and seen["level"] == [1, 1, 2, 2]
    assert seen["completion_ids"] == [[1], [2], [3], [4]] and seen["trainer_state"] == RewardState(7, 9)
    assert set(seen) == {"prompts", "completions", "answer", "level", "completion_ids", "trainer_state"}


def test_trl_overlong_punishment_reads_completion_ids():
    from trl.rewards import get_soft_overlong_punishment

    trl = RewardFunction("overlong", get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2))
    out = compute_rewards([trl], ["p"] * 3, ["a", "b", "c"], {}, step=0, completion_ids=[[1], [1, 2, 3], [1] * 5])
    assert out[:, 0].tolist() == [0.0, -0.5, -1.0]


def test_a_row_without_any_reward_is_warned(caplog):
    functions = load_rewards(["exact_match", "word_positions"])
    with caplog.at_level(logging.WARNING, logger="wgpu_train"):
        out = compute_rewards(functions, ["p", "q"], [A("4"), A("x")], {"answer": ["4", None]}, step=3)
    assert out[0].tolist() == [1.0, 1.0] and np.isnan(out[1]).all()
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("step 3: every reward function returned None for 1 of 2 completions (the first: "
                              "prompt 'q', completion [{'role': 'assistant', 'content': 'x'}]")


def _raises(prompts, completions, **kwargs):
    raise KeyError("solution")


def _raises_multiline(prompts, completions, **kwargs):
    raise ValueError("first line\nsecond line")


def _reward(values):
    return lambda prompts, completions, **kwargs: values


FAILURES = [
    (_raises, "raised KeyError: 'solution'"),
    (_raises_multiline, "raised ValueError: first line"),
    (_reward([1.0, 2.0]), "returned 2 rewards for 3 completions (one per completion)"),
    (_reward([1.0, math.nan, 0.0]), "returned nan for completion 1; a reward is a finite number or None"),
    (_reward([1.0, 0.0, math.inf]), "returned inf for completion 2"),
    (_reward([1.0, "1", 0.0]), "returned '1' for completion 1"),
    (_reward([1.0, [1.0], 0.0]), "returned [1.0] for completion 1"),
    (_reward(1.0), "returned float, not a list of rewards"),
    (_reward("abc"), "returned str, not a list of rewards"),
    (_reward(None), "returned NoneType, not a list of rewards"),
]


@pytest.mark.parametrize("func,problem", FAILURES, ids=[p for _, p in FAILURES])
def test_failure_is_one_line_naming_function_and_step(func, problem):
    functions = load_rewards(["exact_match"]) + [RewardFunction("my_reward", func)]
    with pytest.raises(RewardError) as e:
        compute_rewards(functions, ["p"] * 3, ["a", "b", "c"], {"answer": ["a", "b", "c"]}, step=12)
    line = str(e.value)
    assert line.startswith("reward function 'my_reward', step 12: ") and problem in line and "\n" not in line, line


def test_a_builtin_given_bad_completions_names_itself():
    with pytest.raises(RewardError, match=r"^reward function 'word_positions', step 0: raised TypeError: a "
                                          r"completion is a string or a list of messages, got int$"):
        compute_rewards(load_rewards(["word_positions"]), ["p"], [3], {"answer": ["a"]}, step=0)
