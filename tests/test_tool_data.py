"""Tool-calling conversations in SFT data: the tools column, assistant tool calls and tool results read, rendered
through the real Qwen2.5 / Qwen3 / Llama 3.1 templates TRL ships (ids equal transformers' apply_chat_template with
tools=) and masked as TRL 1.16's SFTTrainer masks them; bad tools refused in one line."""

import json
from pathlib import Path

import numpy as np
import pytest

from bpe import tokenizer_folder, train_bpe
from wgpu_train.data.records import IGNORE_INDEX, Conversation
from wgpu_train.data.sources import load_records
from wgpu_train.data.tokenize import tokenize_dataset, tokenize_example
from wgpu_train.errors import DataError, ToolError
from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.formats.tool_calls import function_schema

transformers = pytest.importorskip("transformers", reason="transformers renders the oracle ids")
ctu = pytest.importorskip("trl.chat_template_utils", reason="TRL's templates are the oracle")

QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
LLAMA = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>", "<|python_tag|>"]
CORPUS = ["the weather in paris is sunny and 21 degrees", '{"name": "weather", "arguments": {"city": "paris"}}',
          "you are a helpful assistant with tools", "what is the weather in paris? add two and three"]


def weather(city: str, days: int = 1) -> str:
    """Get the weather.

    Args:
        city: The city.
        days: How many days.
    """
    return "sunny"


ADD = {"type": "function", "function": {"name": "add", "description": "Adds two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number", "description": "a"},
                                     "b": {"type": "number", "description": "b"}}, "required": ["a", "b"]}}}


def call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


ONE_CALL = [{"role": "user", "content": "what is the weather in paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call("weather", {"city": "paris"})]},
            {"role": "tool", "name": "weather", "content": "sunny, 21 degrees"},
            {"role": "assistant", "content": "it is sunny and 21 degrees in paris."}]
TWO_CALLS = [{"role": "system", "content": "you are a helpful assistant."},
             {"role": "user", "content": "add 2 and 3, and the weather?"},
             {"role": "assistant", "content": "let me check.",
              "tool_calls": [call("add", {"a": 2, "b": 3}), call("weather", {"city": "paris", "days": 2})]},
             {"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "weather", "content": "sunny"},
             {"role": "assistant", "content": "5, and sunny."}, {"role": "user", "content": "thanks"},
             {"role": "assistant", "content": "you are welcome."}]
# Llama 3.1 writes one call per message (its template refuses two)
LLAMA_CHAT = [ONE_CALL[0], {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 2, "b": 3})]},
              {"role": "tool", "name": "add", "content": "5"}, {"role": "assistant", "content": "five."},
              {"role": "user", "content": "and paris?"}] + ONE_CALL[1:]


def _tokenizers(tmp_path, template, specials, eos):
    backend = train_bpe(CORPUS, 400, specials=specials)
    bos = specials[0] if specials is LLAMA else None
    ours = load_tokenizer(tokenizer_folder(tmp_path / "tok", backend, template, eos_token=eos, bos_token=bos))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, eos_token=eos,
                                              bos_token=bos)
    return ours, hf


def _trimmed(mask, ids, hf):
    """A mask with the whitespace-only tokens at each trained run's edges left out: TRL's training templates
    train the newline after each end-of-turn token, which ends a turn here (the model stops before it)."""
    mask = list(mask)
    k = 0
    while k < len(mask):
        if not mask[k]:
            k += 1
            continue
        end = k
        while end < len(mask) and mask[end]:
            end += 1
        for side in (range(k, end), range(end - 1, k - 1, -1)):
            for j in side:
                if hf.decode([ids[j]]).strip():
                    break
                mask[j] = 0
        k = end
    return mask


def _trl_completion_masks(hf, chat, tools):
    """The union of TRL's prompt-completion masks of each assistant turn (its SFTTrainer's completion_mask: what
    follows the common prefix of the prompt with the generation prompt and of prompt + completion)."""
    whole = hf.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=True)["input_ids"]
    mask = [0] * len(whole)
    for i, m in enumerate(chat):
        if m["role"] == "assistant":
            prompt = hf.apply_chat_template(chat[:i], tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
            upto = hf.apply_chat_template(chat[:i + 1], tools=tools, tokenize=True, return_dict=True)["input_ids"]
            assert list(upto) == list(whole[:len(upto)])  # the template keeps earlier turns as they were
            n = next((k for k, (a, b) in enumerate(zip(prompt, upto)) if a != b), min(len(prompt), len(upto)))
            mask[n:len(upto)] = [1] * (len(upto) - n)
    return mask


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3_training", "llama3_1"])
def test_tool_conversations_render_and_mask_as_trl(tmp_path, family):
    """Ids equal transformers' apply_chat_template(messages, tools=...) of the template; the trained tokens are the
    assistant turns with their tool calls and end-of-turn tokens, not the tool results nor system / user text: TRL's
    assistant mask of its training template (Qwen2.5, and Qwen3's training template used as the model's own) or
    its completion masks (Llama 3.1, which TRL has no training template of), less the newline after each turn."""
    name = family.removesuffix("_training")
    template = getattr(ctu, f"{family}_chat_template")
    specials, eos, chats = (LLAMA, "<|eot_id|>", [LLAMA_CHAT]) if name == "llama3_1" else (
        QWEN, "<|im_end|>", [ONE_CALL, TWO_CALLS])
    ours, hf = _tokenizers(tmp_path, template, specials, eos)
    training = getattr(ctu, f"{name}_training_chat_template", None)
    for chat in chats:
        for tools in ([weather, ADD], [function_schema(weather), ADD]):
            ex = tokenize_example(ours, Conversation(chat, tools=tools), 4096)
            want = hf.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=True)["input_ids"]
            assert ex.input_ids.tolist() == list(want)
            if training is not None:
                out = hf.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True, chat_template=training)
                assert list(out["input_ids"]) == list(want)
                trl_mask = list(out["assistant_masks"])
            else:
                trl_mask = _trl_completion_masks(hf, chat, tools)
            got = (ex.labels != IGNORE_INDEX).astype(int).tolist()
            assert got == _trimmed(trl_mask, list(want), hf)
            trained = hf.decode(ex.input_ids[ex.labels != IGNORE_INDEX], skip_special_tokens=False)
            assert "weather" in trained and "sunny, 21" not in trained and "what is" not in trained


def test_original_qwen3_template_renders_tools_as_transformers(tmp_path):
    """Qwen3's own template (which drops past thinking, so TRL swaps in its training template for masks): ids equal
    transformers'; the tool call and both answers are trained, the tool result is not."""
    ours, hf = _tokenizers(tmp_path, ctu.qwen3_chat_template, QWEN, "<|im_end|>")
    ex = tokenize_example(ours, Conversation(TWO_CALLS, tools=[weather, ADD]), 4096)
    assert ex.input_ids.tolist() == list(hf.apply_chat_template(TWO_CALLS, tools=[weather, ADD], tokenize=True,
                                                                return_dict=True)["input_ids"])
    trained = hf.decode(ex.input_ids[ex.labels != IGNORE_INDEX], skip_special_tokens=False)
    assert trained.startswith("let me check.\n<tool_call>\n") and "sunny<" not in trained
    assert trained.endswith("you are welcome.<|im_end|>")


def _write(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_tools_column_read_from_files(tmp_path):
    """The tools column, a list of schemas or TRL's JSON string of one, reaches the template; a record without
    tools renders without them; openai-style tool calls without content read as content ""."""
    ours, hf = _tokenizers(tmp_path, ctu.qwen2_5_chat_template, QWEN, "<|im_end|>")
    schemas = [function_schema(weather), ADD]
    openai_style = [dict(m, content=None) if m.get("tool_calls") else m for m in ONE_CALL]
    rows = [{"messages": ONE_CALL, "tools": schemas}, {"messages": openai_style, "tools": json.dumps(schemas)},
            {"messages": ONE_CALL[:1] + [{"role": "assistant", "content": "no tools here"}]}]
    records, fmt, _ = load_records(_write(tmp_path / "t.jsonl", rows))
    assert fmt == "chat" and records[0].tools == schemas == records[1].tools and records[2].tools is None
    assert records[1][1]["content"] == "" and records[0].source.endswith(":1")
    examples, stats = tokenize_dataset(ours, records, 4096)
    assert stats.n_examples == 3
    for ex, row in zip(examples, rows):
        tools = row.get("tools")
        want = hf.apply_chat_template(row["messages"], tools=json.loads(tools) if isinstance(tools, str) else tools,
                                      tokenize=True, return_dict=True)["input_ids"]
        assert ex.input_ids.tolist() == list(want)
    np.testing.assert_array_equal(examples[0].input_ids, examples[1].input_ids)


@pytest.mark.parametrize("tools,says", [
    ('{"not": "a list"', "not valid JSON"), ([{"function": {"description": "no name"}}], "needs a function name"),
    ([3], "must be a JSON schema"), ([{"name": "f", "parameters": []}], "parameters must be a JSON schema object")])
def test_bad_tools_column_is_one_line(tmp_path, tools, says):
    path = _write(tmp_path / "bad.jsonl", [{"messages": ONE_CALL, "tools": tools}])
    with pytest.raises(DataError, match=says) as err:
        load_records(path)
    assert "\n" not in str(err.value) and "bad.jsonl:1" in str(err.value)


def test_bad_tool_calls_are_one_line(tmp_path):
    bad = [ONE_CALL[0], {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}]
    with pytest.raises(DataError, match="tool call 0 of message 1"):
        load_records(_write(tmp_path / "b.jsonl", [{"messages": bad}]))


def test_tools_with_a_template_without_tool_support(tmp_path):
    """Llama 3's first template drops tool calls (TRL's supports_tool_calling says no): tools refused in one line
    naming the record; so are tool calls in raw text mode."""
    ours, _ = _tokenizers(tmp_path, ctu.llama3_chat_template, LLAMA, "<|eot_id|>")
    records, _, _ = load_records(_write(tmp_path / "t.jsonl", [{"messages": ONE_CALL, "tools": [ADD]}]))
    with pytest.raises(ToolError, match="t.jsonl:1: the chat template does not render tools") as err:
        tokenize_dataset(ours, records, 4096, skip_invalid=True)
    assert "\n" not in str(err.value)
    qwen, _ = _tokenizers(tmp_path / "q", ctu.qwen2_5_chat_template, QWEN, "<|im_end|>")
    with pytest.raises(ToolError, match="raw text mode"):
        tokenize_example(qwen, Conversation(ONE_CALL), 4096, use_chat_template=False)
    with pytest.raises(ToolError, match="tool weather_no_doc: no docstring"):
        def weather_no_doc(city: str):
            return city
        tokenize_example(qwen, Conversation(ONE_CALL, tools=[weather_no_doc]), 4096)


def test_preference_pairs_render_their_tools(tmp_path):
    """DPO pairs and KTO records with a tools column render it, as TRL 1.16's DPO and KTO trainers do: prompt and
    prompt + answer ids are transformers' renders with tools=; unpairing keeps the tools."""
    from wgpu_train.data.preference_records import unpair_preferences
    from wgpu_train.data.preference_tokenize import tokenize_preferences, tokenize_unpaired

    ours, hf = _tokenizers(tmp_path, ctu.qwen2_5_chat_template, QWEN, "<|im_end|>")
    schemas = [function_schema(weather), ADD]
    rejected = [{"role": "assistant", "content": "I do not know."}]
    row = {"prompt": ONE_CALL[:1], "chosen": ONE_CALL[1:2], "rejected": rejected, "tools": json.dumps(schemas)}
    records, _, _ = load_records(_write(tmp_path / "p.jsonl", [row]), kind="preference")
    assert records[0].tools == schemas
    (ex,), _ = tokenize_preferences(ours, records, None)

    def ids(messages, **kw):
        return list(hf.apply_chat_template(messages, tools=schemas, tokenize=True, return_dict=True, **kw)["input_ids"])
    prompt = ids(ONE_CALL[:1], add_generation_prompt=True)
    assert ex.prompt_ids.tolist() == prompt
    assert prompt + ex.chosen_ids.tolist() == ids(ONE_CALL[:2])
    assert prompt + ex.rejected_ids.tolist() == ids(ONE_CALL[:1] + rejected)
    unpaired = unpair_preferences(records)
    assert [r.tools for r in unpaired] == [schemas, schemas]
    kto, _ = tokenize_unpaired(ours, unpaired, None)
    assert kto[0].prompt_ids.tolist() == prompt and kto[0].completion_ids.tolist() == ex.chosen_ids.tolist()
    llama, _ = _tokenizers(tmp_path / "l", ctu.llama3_chat_template, LLAMA, "<|eot_id|>")
    with pytest.raises(ToolError, match="p.jsonl:1: the chat template does not render tools"):
        tokenize_preferences(llama, records, None)


def test_finetune_refuses_bad_tools_in_one_line(tmp_path, capsys):
    """The command line: a bad tools column, and tools for a model whose template cannot render them (the tiny
    model's ChatML fallback), each exit 2 with one line, no run folder written."""
    from finetune_helpers import make_model_dir, one_line_error

    model = make_model_dir(tmp_path / "model")
    capsys.readouterr()             # transformers' progress bar of writing it
    run = tmp_path / "run"
    bad = _write(tmp_path / "bad.jsonl", [{"messages": ONE_CALL, "tools": [{"function": {}}]}] * 4)
    one_line_error(capsys, ["finetune", "--model", str(model), "--data", str(bad), "--out", str(run),
                            "--backend", "numpy", "--no-progress"], 'bad.jsonl:1: field "tools"')
    good = _write(tmp_path / "good.jsonl", [{"messages": ONE_CALL, "tools": [ADD]}] * 4)
    one_line_error(capsys, ["finetune", "--model", str(model), "--data", str(good), "--out", str(run),
                            "--backend", "numpy", "--no-progress"], "the chat template does not render tools",
                   after_log=True)          # after the line on max_seq_len
    assert not run.exists()


def test_exact_match_asks_with_the_tools(tmp_path):
    """Evaluation's prompt for a tool conversation's last answer renders the record's tools, as training did."""
    from wgpu_train.training.evaluate import generation_prompt

    ours, hf = _tokenizers(tmp_path, ctu.qwen2_5_chat_template, QWEN, "<|im_end|>")
    ids = generation_prompt(ours, Conversation(ONE_CALL, tools=[weather, ADD]))
    assert ids == list(hf.apply_chat_template(ONE_CALL[:3], tools=[weather, ADD], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])
