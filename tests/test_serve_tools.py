"""`serve` with OpenAI tools, through the openai client: ask, get a call, send its result, get the answer,
streamed and not; tool_choice (auto, none, required, a named function) and parallel_tool_calls; the 400s. The
model's turns are scripted (a DecodeBatch that writes a fixed answer per prompt), so each test knows what the model
says; the calls parsed from it equal TRL's parse_response of the same tokens."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")
ctu = pytest.importorskip("trl.chat_template_utils")

import wgpu_train.serve.scheduler as scheduler_module  # noqa: E402
from bpe import tokenizer_folder, train_bpe  # noqa: E402
from finetune_helpers import make_model_dir  # noqa: E402
from tiny_models import build_model, save_model  # noqa: E402
from wgpu_train.cli.main import build_parser  # noqa: E402
from wgpu_train.cli.serve import prepare  # noqa: E402
from wgpu_train.engines.generate import Token  # noqa: E402
from wgpu_train.serve.app import build_app  # noqa: E402
from wgpu_train.serve.server import ServerThread  # noqa: E402

QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
        "</tool_response>", "<think>", "</think>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "description": "The city."},
                                                "days": {"type": "integer", "description": "Days ahead."}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "description": "The city."}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "2"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."


def script(prompt: str) -> str:
    """What the scripted model answers after `prompt` (the rendered chat, special tokens included)."""
    if prompt.endswith('"arguments": '):          # tool_choice named get_time: the call's opening prefilled
        return '{"city": "Paris"}}\n</tool_call>'
    if prompt.endswith("<tool_call>\n"):             # tool_choice required
        return CALL[len("<tool_call>\n"):]
    last_turn = prompt.rsplit("<|im_start|>", 2)[-2]
    if "<tool_response>" in last_turn:
        return ANSWER
    if "and the time" in last_turn:
        return "Let me check both.\n" + CALL + "\n" + TIME_CALL
    return "Let me check.\n" + CALL


class ScriptedBatch:
    """DecodeBatch's interface, each row's tokens those of script(its prompt) and the end of turn."""

    prompts: list = []

    def __init__(self, engine, rows, max_len, token_budget=None):
        self.rows, self.reused, self._rows = rows, 0, {}

    def free_slots(self):
        return self.rows - len(self._rows)

    def prefilling(self):
        return 0

    def add(self, prompt, max_new_tokens, sampling=None, stop_token_ids=(), logprobs=None, prompt_logprobs=False,
            adapter=-1, prefix_key=None):
        text = TOK.decode(list(prompt), skip_special_tokens=False)
        ScriptedBatch.prompts.append(text)
        ids = TOK.encode(script(text)) + [TOK.token_to_id("<|im_end|>")]
        slot = min(set(range(self.rows)) - set(self._rows))
        self._rows[slot] = ids[:max_new_tokens]
        return slot

    def remove(self, slot):
        self._rows.pop(slot, None)

    def close(self):
        self._rows.clear()

    def step(self):
        out = []
        for slot, ids in list(self._rows.items()):
            token = ids.pop(0)
            finished = "stop" if not ids and token == TOK.token_to_id("<|im_end|>") else "length" if not ids else None
            out.append(Token(slot, token, finished))
            if not ids:
                self._rows.pop(slot)
        return out


TOK = None


def _serve(model_dir, monkeypatch_batch=True):
    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--backend", "numpy", "--port", "0",
                                      "--served-model-name", "m"])
    scheduler, sock = prepare(args)
    if monkeypatch_batch:
        real = scheduler_module.DecodeBatch
        scheduler_module.DecodeBatch = ScriptedBatch
        try:
            scheduler.start()
        finally:
            scheduler_module.DecodeBatch = real
    else:
        scheduler.start()
    thread = ServerThread(build_app(scheduler), sock).start()
    return SimpleNamespace(url=thread.url, scheduler=scheduler, thread=thread)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    global TOK
    folder = tmp_path_factory.mktemp("tools") / "model"
    backend = train_bpe(["Let me check. It is sunny in Paris.", CALL, TIME_CALL, "what is the weather in Paris?",
                         "and the time"], 400, specials=QWEN)
    tokenizer_folder(folder, backend, ctu.qwen2_5_chat_template, eos_token="<|im_end|>")
    save_model(build_model("llama", vocab_size=backend.get_vocab_size(), max_position_embeddings=2048), folder)
    server = _serve(folder)
    TOK = server.scheduler.tokenizer
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=ctu.qwen2_5_chat_template,
                                              eos_token="<|im_end|>")
    ctu.add_response_schema(hf)
    yield SimpleNamespace(server=server, hf=hf, client=openai.OpenAI(base_url=server.url + "/v1", api_key="x",
                                                                      max_retries=0, timeout=60))
    server.thread.stop()
    server.scheduler.close()


QUESTION = [{"role": "user", "content": "what is the weather in Paris?"}]


def _stream(client, **kw):
    """(content, tool calls as {index: {id, name, arguments}}, finish_reason, the chunks' deltas) of a stream."""
    content, calls, finish, deltas = "", {}, None, []
    for chunk in client.chat.completions.create(model="m", stream=True, **kw):
        delta = chunk.choices[0].delta
        deltas.append(delta)
        content += delta.content or ""
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            slot["id"] = call.id or slot["id"]
            if call.function is not None:
                slot["name"] = call.function.name or slot["name"]
                slot["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish, deltas


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_tool_flow(served, stream):
    """Ask with tools, get a call (its arguments typed by the tool's schema: "2" -> 2 for an integer), send the
    tool's result, get the answer; the prompt of the second request is transformers' render of the conversation;
    the call equals TRL's parse_response of the model's tokens."""
    client, hf = served.client, served.hf
    if stream:
        content, calls, finish, deltas = _stream(client, messages=QUESTION, tools=[WEATHER])
        at = next(k for k, d in enumerate(deltas) if d.tool_calls)
        first = deltas[at]
        assert first.tool_calls[0].function.name == "get_weather" and first.tool_calls[0].function.arguments == ""
        # the content before the call streamed as it came, in several pieces, before the call
        assert "".join(d.content or "" for d in deltas[:at]) == content and sum(bool(d.content) for d in deltas) > 1
        call = calls[0]
    else:
        r = client.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER])
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        got = r.choices[0].message.tool_calls
        assert len(got) == 1
        call = {"id": got[0].id, "name": got[0].function.name, "arguments": got[0].function.arguments}
    assert finish == "tool_calls" and content == "Let me check." and call["id"].startswith("call_")
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "days": 2}
    prompt = ScriptedBatch.prompts[-1]
    trl = ctu.parse_response(hf, hf.encode("Let me check.\n" + CALL + "<|im_end|>", add_special_tokens=False),
                             prefix=hf.encode(prompt, add_special_tokens=False), tools=[WEATHER])
    assert trl["content"] == content
    assert trl["tool_calls"][0]["function"] == {"name": call["name"], "arguments": json.loads(call["arguments"])}

    messages = QUESTION + [{"role": "assistant", "content": content, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 degrees"}]
    if stream:
        answer, calls, finish, deltas = _stream(client, messages=messages, tools=[WEATHER])
        assert not calls and sum(bool(d.content) for d in deltas) > 1     # an answer without calls streams live
    else:
        r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
        answer, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert r.choices[0].message.tool_calls is None
    assert (answer, finish) == (ANSWER, "stop")
    rendered = [dict(m) for m in messages]
    rendered[1]["tool_calls"] = [{"type": "function", "function": {"name": "get_weather",
                                                                   "arguments": json.loads(call["arguments"])}}]
    rendered[2]["name"] = "get_weather"
    assert ScriptedBatch.prompts[-1] == hf.apply_chat_template(rendered, tools=[WEATHER], add_generation_prompt=True,
                                                               tokenize=False)


def test_tool_choice_and_parallel_calls(served):
    client = served.client
    two = [{"role": "user", "content": "the weather and the time in Paris?"}]
    r = client.chat.completions.create(model="m", messages=two, tools=[WEATHER, TIME])
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    r = client.chat.completions.create(model="m", messages=two, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    _, calls, finish, _ = _stream(client, messages=two, tools=[WEATHER, TIME])
    assert [calls[k]["name"] for k in sorted(calls)] == ["get_weather", "get_time"] and finish == "tool_calls"
    assert len({calls[0]["id"], calls[1]["id"]}) == 2
    # required: the call's opening written after the generation prompt; the model writes the rest
    r = client.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER], tool_choice="required")
    assert ScriptedBatch.prompts[-1].endswith("<|im_start|>assistant\n<tool_call>\n")
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather" and r.choices[0].message.content is None
    # a named function: its name written too
    r = client.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert ScriptedBatch.prompts[-1].endswith('<tool_call>\n{"name": "get_time", "arguments": ')
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == [
        ("get_time", {"city": "Paris"})]
    # none: the tools rendered, nothing parsed
    r = client.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert '"name": "get_weather"' in ScriptedBatch.prompts[-1]


def test_bad_tool_requests_get_400s(served, tmp_path):
    client = served.client
    for kw, param in [(dict(tools=[{"type": "retrieval"}]), "tools[0]"),
                      (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0]"),
                      (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
                       "tool_choice"),
                      (dict(tool_choice="required"), "tool_choice"),
                      (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
                      (dict(tools=[WEATHER], logprobs=True), "logprobs")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=QUESTION, **kw)
        assert err.value.body["param"] == param, kw
    bad_args = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        client.chat.completions.create(model="m", messages=bad_args, tools=[WEATHER])
    # a model whose template has no tool support (the ChatML fallback drops tool calls)
    plain = _serve(make_model_dir(tmp_path / "plain"), monkeypatch_batch=False)
    try:
        other = openai.OpenAI(base_url=plain.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="does not support tools") as err:
            other.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER])
        assert err.value.status_code == 400 and err.value.body["code"] == "tools_not_supported"
    finally:
        plain.thread.stop()
        plain.scheduler.close()


def test_live_content_holds_back_what_may_open_a_call():
    from wgpu_train.formats.tool_calls import FORMATS
    from wgpu_train.serve.tool_calls import ToolPlan, ToolRequest, live_content

    request = ToolRequest((WEATHER,), "auto", True)
    qwen = ToolPlan(request, FORMATS["qwen"], "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "", True)
    assert [live_content(qwen, t) for t in (" Let me", "Let me check.\n<tool", "Let me check.\n<tool_call>\n{",
                                            "a <think>b", "a <tho")] == ["Let me", "Let me check.", "Let me check.",
                                                                         "a", "a <tho"]
    assert live_content(ToolPlan(request, FORMATS["qwen"], qwen.prompt, "<tool_call>\n", True), "{") == ""
    assert live_content(ToolPlan(request, FORMATS["qwen"], qwen.prompt + "<think>\n", "", True), "hmm") == ""
    assert live_content(ToolPlan(request, FORMATS["gpt_oss"], "<|start|>assistant", "", True), "hi") == ""
    llama = ToolPlan(request, FORMATS["llama3"], "<|start_header_id|>assistant<|end_header_id|>\n\n", "", True)
    assert live_content(llama, 'Sure {"na') == "Sure" and live_content(llama, "Sure {x}") == "Sure {x}"
