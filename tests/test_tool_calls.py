"""formats/tool_calls.py against its oracles: transformers' get_json_schema, TRL 1.16's supports_tool_calling, and
TRL's parse_response (transformers' parser with TRL's response templates) on many generated model outputs, with the
real chat templates TRL ships (no download)."""

import enum
import json
import random
from pathlib import Path
from typing import Any, Literal, Optional, Union

import pytest

from bpe import train_bpe
from wgpu_train.errors import ToolError
from wgpu_train.formats.tool_calls import (function_schema, parse_response, supports_tools, tool_call_format,
                                           tool_schemas)

transformers = pytest.importorskip("transformers", reason="transformers is the oracle")
ctu = pytest.importorskip("trl.chat_template_utils", reason="TRL's templates and parser are the oracle")
TRL_TEMPLATES = Path(ctu.__file__).parent / "chat_templates"


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


def weather(city: str, days: int = 1, unit: Unit = Unit.C) -> str:
    """Get the weather forecast
    for a city.

    Args:
        city: The city, e.g. "Paris"
            (no country).
        days (int): How many days.
        unit: The unit.

    Returns:
        The forecast.
    """
    return city


def mixed(a: list[int], b: dict[str, float], c: Optional[Union[int, str]], d: tuple[int, str], e: Literal["x", 2],
          f: int | list[str] | None = None, g: Any = 0, h: bool = False) -> dict:
    """Many kinds of hint.

    Args:
        a: ints
        b: floats by name
        c: an int or a string
        d: a pair
        e: a literal (choices: ["x", 2])
        f: ints or strings
        g: anything
        h: a flag
    Raises:
        ValueError: never
    """


class Calc:
    def add(self, x: float, y: float = 0.0):
        """Add two numbers.

        Args:
            x: The first.
            y: The second.
        """
        return x + y


@pytest.mark.parametrize("fn", [weather, mixed, Calc().add], ids=["weather", "mixed", "method"])
def test_function_schema_is_transformers(fn):
    assert function_schema(fn) == transformers.utils.get_json_schema(fn)


def _no_doc(x: int):
    return x


def _no_hint(x):
    """Args:
        x: a number
    """


def _undescribed(x: int, y: int):
    """Adds.

    Args:
        x: a number
    """


@pytest.mark.parametrize("fn,says", [(_no_doc, "no docstring"), (_no_hint, "no type hint"),
                                     (_undescribed, "no description of argument y")])
def test_function_schema_refuses_in_one_line(fn, says):
    with pytest.raises(ToolError, match=says) as err:
        function_schema(fn)
    assert "\n" not in str(err.value)


def test_tool_schemas_reads_lists_json_and_functions():
    schema = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    assert tool_schemas([schema, weather]) == [schema, function_schema(weather)]
    assert tool_schemas(json.dumps([schema])) == [schema] == tool_schemas(json.dumps(schema))
    assert tool_schemas([json.dumps(schema)]) == [schema]
    for bad, says in [("[1, 2]", "tools\\[0\\]"), ("{not json", "not valid JSON"), (5, "must be a list"),
                      ([{"function": {"description": "x"}}], "needs a function name"),
                      ([{"name": "f", "parameters": "x"}], "parameters must be")]:
        with pytest.raises(ToolError, match=says):
            tool_schemas(bad)


def _hf(template: str, specials: list[str], eos: str):
    backend = train_bpe(CORPUS, 320, specials=specials)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, eos_token=eos,
                                                bos_token=specials[0])


CORPUS = ["the weather in paris is sunny and 21 degrees, let me check", "tool call function parameter think",
          '{"name": "weather", "arguments": {"city": "paris", "days": 3}}']
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"]
GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>",
                "</think>"]
GPT_OSS_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                    "<|return|>", "<|call|>", "<|constrain|>"]


def test_supports_tools_is_trls_on_every_shipped_template():
    """supports_tools says what TRL's supports_tool_calling says of each template TRL ships; tool_call_format knows
    the syntax of each one TRL has a response template for among the families parsed here."""
    hf = _hf(None, QWEN_SPECIALS, "<|im_end|>")
    known = {"qwen2_5": "qwen", "qwen3": "qwen", "qwen3_instruct_2507": "qwen", "qwen3_5_nothink": "qwen3_5",
             "qwen3_5_think": "qwen3_5", "qwen3_6": "qwen3_5", "llama3_1": "llama3", "llama3_2": "llama3",
             "gptoss": "gpt_oss", "glm4moe": "glm4_moe"}
    for path in sorted(TRL_TEMPLATES.glob("*.jinja")):
        template = path.read_text(encoding="utf-8")
        hf.chat_template = template
        assert supports_tools(template) == ctu.supports_tool_calling(hf), path.name
        if path.stem in known:
            assert tool_call_format(template).name == known[path.stem], path.name
    assert tool_call_format(ctu.llama3_chat_template) is None  # Llama 3's first template drops tool calls


TOOLS = [weather, {"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": {
    "type": "object", "properties": {
    "a": {"type": "number"}, "b": {"type": ["integer", "null"]}, "flag": {"type": "boolean"},
    "items": {"type": "array"}, "note": {"type": "string"}}}}}]
VALUES = {"city": ['"paris"', '"21"', '""'], "days": ["3", '"3"', '"3.0"', '"x"'], "a": ["2.5", '"2"', '"2.5e1"'],
          "b": ["null", '"7"', '"None"'], "flag": ["true", '"true"', '"0"'], "items": ["[1, 2]", '"[1, 2]"'],
          "note": ['"7"', "7"]}


def _json_args(rng, name):
    keys = ["city", "days"] if name == "weather" else ["a", "b", "flag", "items", "note"]
    picked = [k for k in keys if rng.random() < 0.7]
    return "{" + ", ".join(f'"{k}": {rng.choice(VALUES[k])}' for k in picked) + "}"


def _qwen_call(rng):
    name = rng.choice(["weather", "add", "unknown"])
    args = _json_args(rng, name)
    body = rng.choice([f'{{"name": "{name}", "arguments": {args}}}', f'{{"name": "{name}", "arguments": {args}',
                       f'{{"arguments": {args}}}', f'{{"name": "{name}"}}', '"just text"',
                       f'{{"name": "{name}", "arguments": {json.dumps(args)}}}'])
    return f"<tool_call>\n{body}\n</tool_call>"


def _xml_value(raw):
    return raw[1:-1] if raw.startswith('"') else raw


def _qwen3_5_call(rng):
    name = rng.choice(["weather", "add"])
    keys = ["city", "days"] if name == "weather" else ["a", "b", "flag", "items", "note"]
    params = "".join(f"<parameter={k}>\n{_xml_value(rng.choice(VALUES[k]))}\n</parameter>\n"
                     for k in keys if rng.random() < 0.7)
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _glm_call(rng):
    name = rng.choice(["weather", "add"])
    keys = ["city", "days"] if name == "weather" else ["a", "b", "flag", "items", "note"]
    params = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_xml_value(rng.choice(VALUES[k]))}</arg_value>\n"
                     for k in keys if rng.random() < 0.7)
    return f"<tool_call>{name}\n{params}</tool_call>"


def _llama_call(rng):
    name = rng.choice(["weather", "add"])
    return rng.choice([f'{{"name": "{name}", "parameters": {_json_args(rng, name)}}}',
                       f'{{"name": "{name}", "parameters": {_json_args(rng, name)}'])


def _gpt_oss_call(rng):
    name = rng.choice(["weather", "add"])
    return (f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>"
            f"{rng.choice([_json_args(rng, name), '{bad'])}<|call|>")


FAMILIES = {  # template: (specials, eos, a call, the end of the turn, thinking)
    "qwen2_5": (QWEN_SPECIALS, "<|im_end|>", _qwen_call, "<|im_end|>", ""),
    "qwen3": (QWEN_SPECIALS, "<|im_end|>", _qwen_call, "<|im_end|>", "<think>\nlet me check\n</think>\n\n"),
    "qwen3_5_think": (QWEN_SPECIALS, "<|im_end|>", _qwen3_5_call, "<|im_end|>", "let me check\n</think>\n\n"),
    "glm4moe": (GLM_SPECIALS, "<|endoftext|>", _glm_call, "<|user|>", "<think>let me check</think>"),
    "llama3_1": (LLAMA_SPECIALS, "<|eot_id|>", _llama_call, "<|eot_id|>", ""),
    "gptoss": (GPT_OSS_SPECIALS, "<|return|>", _gpt_oss_call, "", "<|channel|>analysis<|message|>hmm<|end|>"),
}


def _outputs(rng, call, end, thinking, n):
    texts = []
    for _ in range(n):
        calls = [call(rng) for _ in range(rng.choice([0, 1, 1, 2]))]
        before = rng.choice(["", "", "let me check", "the weather\n", " "])
        after = rng.choice(["", "", " done", "\n"])
        text = (thinking if rng.random() < 0.4 else "") + before + "\n".join(calls) + after
        if end == "":  # gpt-oss: a final answer when no call
            text += "" if calls else "<|channel|>final<|message|>" + rng.choice(["it is 21", ""]) + "<|return|>"
        else:
            text += rng.choice([end, end, ""])
        texts.append(text or "ok")  # TRL's parse_response takes no ids for a batch of none
    return texts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parse_response_is_trls(family):
    """Generated outputs (no call, one, two, malformed JSON, calls without a name, text around them, thinking,
    arguments written as the wrong JSON type, no end of turn), parsed from their text as TRL parses their token ids
    after the prompt, arguments typed by the tools."""
    specials, eos, call, end, thinking = FAMILIES[family]
    template = getattr(ctu, f"{family}_chat_template")
    hf = _hf(template, specials, eos)
    ctu.add_response_schema(hf)
    fmt = tool_call_format(template)
    skipped = [t.content for t in hf.added_tokens_decoder.values() if t.special]
    prompt = hf.apply_chat_template([{"role": "user", "content": "weather?"}], tools=TOOLS,
                                    add_generation_prompt=True, tokenize=False)
    prompt_ids = hf.encode(prompt, add_special_tokens=False)
    kinds = set()
    for text in _outputs(random.Random(family), call, end, thinking, 60):
        ids = hf.encode(text, add_special_tokens=False)
        for tools in (TOOLS, None):
            want = ctu.parse_response(hf, ids, prefix=prompt_ids, tools=tools)
            got = parse_response(hf.decode(ids, skip_special_tokens=False), fmt, tools, prefix=prompt,
                                 eos_token=hf.eos_token, special_tokens=skipped)
            assert got == want, text
        kinds.add(len(want.get("tool_calls", [])))
    assert kinds >= {0, 1}  # the generated outputs hold calls that parse, and outputs that are text
