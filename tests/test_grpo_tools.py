"""GRPO's tools: a held DecodeBatch row extended after its turn gives the tokens a fresh generation of the whole
conversation gives (its cache row continued, nothing prefilled again); the tool loop's masks, budgets, overlong
roll-back and iteration limit; tools run as TRL runs them; tool and environment specs checked."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from tiny_models import build_model, save_model
from wgpu_train.engines.generate import DecodeBatch, Sampling, generate_batch
from wgpu_train.errors import ConfigError, ToolError
from wgpu_train.training.tools import Toolbox, calculator, check_tool, load_tool, run_tool_calls
from wgpu_train.training.tools_loop import TurnSampler, tool_rollouts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_model(build_model("llama", seed=1), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def model(tiny):
    return wt.load_model(tiny, backend="numpy")


def _extended_row_continues_its_cache(model):
    """Greedy: a row extended with tokens after its first turn gives what generating from the whole sequence
    gives; the cache is not prefilled again (only the last generated token and the new ones are)."""
    prompts = [np.array([3, 9, 4, 7]), np.array([5, 6])]
    batch = DecodeBatch(model.engine, 2, 40)
    slots = [batch.add(p, 4, Sampling(), hold=True) for p in prompts]
    first = {s: [] for s in slots}
    while len(batch):
        for t in batch.step():
            first[t.slot].append(t.id)
    assert len(batch) == 0 and batch.free_slots() == 0        # both held, paused
    appended = [11, 12, 13]
    batch.extend(slots[0], appended, 5)
    assert batch.prefilling() == 1 + len(appended)            # the last generated token and the new ones only
    after = []
    while len(batch):
        after += [t.id for t in batch.step()]
    batch.close()
    whole = np.concatenate([prompts[0], first[slots[0]], appended])
    assert after == generate_batch(model.engine, [whole], 5)[0]


def test_extended_row_continues_its_cache(model):
    _extended_row_continues_its_cache(model)
    with pytest.raises(ValueError):
        DecodeBatch(model.engine, 1, 8).extend(0, [1], 2)


def test_extended_row_continues_its_cache_webgpu(tiny, rt):
    _extended_row_continues_its_cache(wt.load_model(tiny, backend="wgpu", device=str(rt.info.index)))


class ScriptedSampler:
    """Turns given by a script: row -> list of turns; records what resume was given."""

    def __init__(self, script):
        self.script, self.n, self.seen = script, {i: 0 for i in script}, []

    def first(self, budget):
        return [self._next(i, budget) for i in sorted(self.script)]

    def resume(self, rows, appended, budgets):
        self.seen.append((list(rows), [list(a) for a in appended], list(budgets)))
        return [self._next(i, b) for i, b in zip(rows, budgets)]

    def _next(self, i, budget):
        turns = self.script[i]
        out = turns[self.n[i]][:budget] if self.n[i] < len(turns) else []
        self.n[i] += 1
        return out


CALL = 90          # a turn whose last token is CALL calls the tool (the scripted parse's convention)


def _parse(ids, prefix):
    return {"role": "assistant", "content": str(ids),
            **({"tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": ids[0]}}}]}
               if ids[-1] == CALL else {})}


def _add(a: int) -> int:
    """Add one.

    Args:
        a: the number
    """
    if a == 66:
        raise RuntimeError("no 66")
    return a + 1


def test_tool_loop_masks_and_limits():
    script = {0: [[1, 2, 3]],                          # no call
              1: [[5, CALL], [7, 8]],                  # a call, then an answer
              2: [[66, CALL], [9, CALL], [4]],         # a failing call, a second call: the limit of 2 rounds
              3: [[1] * 6 + [CALL], [2]]}              # its tool result would pass max_completion: dropped
    sampler = ScriptedSampler(script)
    suffix = lambda msgs: [50] * len(msgs) + [51]                                # 2 tokens per result
    rows = tool_rollouts(sampler, [[100]] * 4, _parse, suffix, [{"add": _add}] * 4, run_tool_calls,
                         max_completion=8, max_positions=64, max_iterations=2)
    assert rows[0].ids == [1, 2, 3] and rows[0].tool_mask == [1, 1, 1] and rows[0].calls == 0
    assert rows[1].ids == [5, CALL, 50, 51, 7, 8] and rows[1].tool_mask == [1, 1, 0, 0, 1, 1]
    assert [m["role"] for m in rows[1].turns] == ["assistant", "tool", "assistant"]
    assert rows[1].turns[1] == {"role": "tool", "name": "add", "content": "6"}
    assert rows[2].ids == [66, CALL, 50, 51, 9, CALL, 50, 51][:8] and rows[2].failures == 1 and rows[2].calls == 2
    assert rows[2].turns[1]["content"] == "{'error': 'no 66'}"
    # row 2's second round: 4 tokens so far + 2 of the result = 6, budget 2 left; then the limit ends it
    assert sampler.seen[1] == ([2], [[50, 51]], [0])
    assert rows[3].ids == [1] * 6 + [CALL] and rows[3].tool_mask == [1] * 7 and rows[3].calls == 1
    assert rows[3].turns[-1]["role"] == "assistant"                 # rolled back: no tool message kept


def test_run_tool_calls_as_trl():
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}},
             {"type": "function", "function": {"name": "nope", "arguments": {}}},
             {"type": "function", "function": {"name": "add", "arguments": {"b": 2}}}]
    messages, n, failures = run_tool_calls(calls, {"add": _add})
    assert n == 3 and failures == 2
    assert messages[0] == {"role": "tool", "name": "add", "content": "3"}
    assert messages[1]["content"] == "{'error': 'Tool nope not found.'}"
    assert calculator("12 * (3 + 4)") == "84" and calculator("7 / 2") == "3.5"
    with pytest.raises(ValueError):
        calculator("__import__('os')")


def test_specs_checked(tmp_path):
    def bare(x):
        """Doc."""
    def undocumented(x: int):
        pass
    with pytest.raises(ToolError, match="--tool t: tool bare: argument x has no type hint"):
        check_tool(bare, "--tool t")
    with pytest.raises(ToolError, match="no docstring"):
        check_tool(undocumented, "--tool t")
    with pytest.raises(ConfigError, match="no module named"):
        load_tool("no_such_module_xyz:f")
    assert load_tool("calculator") is calculator

    class NoReset:
        def act(self, a: int) -> int:
            """Act.

            Args:
                a: a
            """
            return a
    with pytest.raises(ConfigError, match="no reset"):
        Toolbox([], NoReset)

    class Env(NoReset):
        def reset(self, **kwargs):
            return None

        def get_reward(self):
            return 1.0
    box = Toolbox([calculator], Env)
    assert [t.__name__ for t in box.all_tools()] == ["calculator", "act"] and box.reward_name == "Env"
    envs = box.environments([0, 1, 2])
    assert len({id(e) for e in envs}) == 3 and set(box.rollout_tools(envs[1])) == {"calculator", "act"}


def test_turn_sampler_matches_generate_batch(model):
    """A TurnSampler's first turns are generate_batch's (the same seeds), and a resumed row goes on."""
    prompts = [np.array([3, 9, 4, 7]), np.array([5, 6])]
    s = TurnSampler(model.engine, prompts, 30, temperature=1.0, seeds=[1, 2])
    first = s.first(4)
    assert first == generate_batch(model.engine, prompts, 4, temperature=1.0, seed=[1, 2])
    more = s.resume([1], [[8, 8]], [3])
    s.close()
    assert len(more[0]) == 3


def test_bad_tool_input_is_one_line(tmp_path, capsys):
    """A tool that cannot be imported, a function without type hints or without a docstring, an environment
    without reset, --max-tool-calling-iterations 0 and a chat template without tool support: one line, exit 2, no
    run folder."""
    from finetune_helpers import make_model_dir, one_line_error, write_jsonl

    model = make_model_dir(tmp_path / "model")
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": [{"role": "user", "content": f"add {i}"}]} for i in range(4)])
    (tmp_path / "mytools.py").write_text(
        "def bare(x):\n    \"\"\"Doc.\"\"\"\n\n"
        "def nodoc(x: int) -> int:\n    return x\n\n"
        "def ok(x: int) -> int:\n    \"\"\"Ok.\n\n    Args:\n        x: a number\n    \"\"\"\n    return x\n\n"
        "class NoReset:\n    def act(self, x: int) -> int:\n        \"\"\"Act.\n\n        Args:\n"
        "            x: a number\n        \"\"\"\n        return x\n")
    common = ["finetune", "--model", str(model), "--data", str(tmp_path / "prompts.jsonl"), "--backend", "numpy",
              "--objective", "grpo", "--max-steps", "1", "--no-progress", "--batch-size", "4", "--num-generations",
              "4", "--max-completion-length", "6", "--reward", "exact_match", "--out"]
    tools = str(tmp_path / "mytools.py")
    cases = [(["--tool", "no_such_module_xyz:f"], "no module named 'no_such_module_xyz'"),
             (["--tool", f"{tools}:bare"], "argument x has no type hint"),
             (["--tool", f"{tools}:nodoc"], "no docstring"),
             (["--environment", f"{tools}:NoReset"], "has no reset method"),
             (["--tool", "calculator", "--max-tool-calling-iterations", "0"], "must be at least 1"),
             (["--tool", f"{tools}:ok"], "cannot render tool calls")]
    for i, (extra, match) in enumerate(cases):
        one_line_error(capsys, common + [str(tmp_path / f"run{i}")] + extra, match, after_log=True)
        assert not (tmp_path / f"run{i}").exists()


def test_tool_demo_runs(tmp_path, capsys, monkeypatch):
    """`finetune --objective grpo --tool calculator` with no data: the warm-up (cut to 2 steps here), then GRPO on
    the embedded sums with the tool loop; the last line says the reward and the share of rollouts that called the
    tool, before and after (how much it learns: docs/guides/agents.md)."""
    import json
    import tempfile

    from wgpu_train.cli.main import main
    from wgpu_train.training import tools_demo

    monkeypatch.setattr(tools_demo, "WARMUP_STEPS", 2)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))           # the warm-up's folder
    code = main(["finetune", "--objective", "grpo", "--tool", "calculator", "--backend", "numpy", "--max-steps",
                 "1", "--batch-size", "8", "--num-generations", "4", "--max-completion-length", "16",
                 "--max-eval-samples", "4", "--no-progress", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0 and "; reward " in out and "called a tool" in out, out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["objective"]["tools"] == ["calculator"] and summary["objective"]["rewards"] == ["exact_match"]
    assert summary["tool_share_before"] is not None and summary["tool_share_after"] is not None
    assert "turns" in json.loads((tmp_path / "run" / "completions.jsonl").read_text().splitlines()[0])
    warmed = [p for p in tmp_path.iterdir() if p.name.startswith("wgpu-train-tool-warmup-")]
    assert len(warmed) == 1 and (warmed[0] / "run" / "model.safetensors").is_file()
