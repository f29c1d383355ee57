"""`wgpu-train serve` through the real openai client, on a tiny model with two tiny adapters: chat and completions,
streamed and not, each answer equal to greedy generation with its adapter (interleaved requests, batched);
stop strings, seeds, usage and the SSE framing; the API key; OpenAI-style 4xx errors; a client leaving
mid-stream; a burst past the queue limit; the server answering correctly after every fault; and bad input
refused in one line before serving."""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import wgpu_train as wt  # noqa: E402
from conftest import require_adapter  # noqa: E402
from finetune_helpers import build_tokenizer, one_line_error  # noqa: E402
from serve_helpers import KEY, NAMES, QUESTIONS, Reference, ask, expected, save_adapter, served_files  # noqa: E402
from tiny_models import build_model, edit_config, save_model  # noqa: E402
from wgpu_train.cli.commands import prompt_ids  # noqa: E402
from wgpu_train.cli.main import build_parser  # noqa: E402
from wgpu_train.cli.serve import prepare  # noqa: E402
from wgpu_train.errors import AdapterError, ConfigError  # noqa: E402
from wgpu_train.formats.tokenizer import load_tokenizer  # noqa: E402
from wgpu_train.serve.adapters import parse_adapter_spec  # noqa: E402
from wgpu_train.serve.app import build_app  # noqa: E402
from wgpu_train.serve.server import ServerThread  # noqa: E402
from wgpu_train.serve.text_stream import TextStream  # noqa: E402

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return served_files(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def ref(files):
    return Reference(files)


def _args(*argv):
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture(scope="module")
def server(files):
    """The CLI's server (every check, the model and both adapters loaded by `prepare`) on an ephemeral port."""
    args = _args("--model", str(files.model), "--adapter", f"a={files.a}", "--adapter", f"b={files.b}",
                 "--served-model-name", "base", "--backend", "numpy", "--port", "0", "--api-key", KEY,
                 "--max-queue", "16", "--max-batch", "4")
    scheduler, sock = prepare(args)
    scheduler.start()
    thread = ServerThread(build_app(scheduler, args.api_key), sock).start()
    yield SimpleNamespace(url=thread.url, scheduler=scheduler)
    thread.stop()
    scheduler.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def slow(server, monkeypatch):
    """slow(seconds): each engine call of generation takes that much longer (requests pile up in the queue)."""
    engine = server.scheduler.model.engine

    def set_delay(seconds: float):
        inner = type(engine).forward_rows

        def forward_rows(*a, **kw):
            time.sleep(seconds)
            return inner(engine, *a, **kw)
        monkeypatch.setattr(engine, "forward_rows", forward_rows)
    return set_delay


def assert_serves(client, ref):
    """The server still answers correctly: one chat per served model."""
    for name in NAMES:
        assert ask(client, "chat", name, QUESTIONS[0], temperature=0) == ref.chat(name, QUESTIONS[0])


def test_models_are_the_base_and_each_adapter(client):
    assert [m.id for m in client.models.list().data] == ["base", "a", "b"]
    assert client.models.retrieve("a").id == "a"


def test_interleaved_requests_equal_greedy_generation_with_their_adapter(client, server, ref, slow):
    """Chat and completions, streamed and not, over the base and two adapters in interleaved order, sent at once:
    the worker runs them in one batch (the adapters in a bank, no switch), and every answer is the greedy
    generation of the generate path, token for token (text, count and finish reason)."""
    slow(0.01)
    kinds = ("chat", "chat_stream", "text", "text_stream")
    plan = [(kinds[i % 4], NAMES[i % 3], QUESTIONS[i % 4]) for i in range(12)]
    before = dict(server.scheduler.stats, switches=server.scheduler.registry.switches)
    with ThreadPoolExecutor(len(plan)) as pool:
        answers = list(pool.map(lambda p: ask(client, *p, temperature=0), plan))
    for (kind, name, prompt), got in zip(plan, answers):
        assert got == expected(ref, kind, name, prompt), (kind, name, prompt)
    assert len({a[0] for a in answers}) > 3                     # the adapters changed the answers
    stats = server.scheduler.stats
    assert stats["jobs"] - before["jobs"] == 12
    assert stats["largest_batch"] >= 3                                                    # some were batched
    assert server.scheduler.mixed and server.scheduler.registry.switches == before["switches"]


def test_stop_strings_seeds_and_top_k(client, ref):
    text, _, _ = ref.chat("a", QUESTIONS[1], 10)
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = text[:text.find(stop)]
    for kind in ("chat", "chat_stream"):
        got, _, finish = ask(client, kind, "a", QUESTIONS[1], temperature=0, stop=[stop, "never seen"])
        assert (got, finish) == (cut, "stop"), kind
    sampled = ask(client, "chat", "b", QUESTIONS[2], temperature=0.9, seed=11)
    assert sampled == ref.chat("b", QUESTIONS[2], temperature=0.9, seed=11)
    assert sampled == ask(client, "chat_stream", "b", QUESTIONS[2], temperature=0.9, seed=11)
    greedy = ref.text("base", QUESTIONS[3])
    assert ask(client, "text", "base", QUESTIONS[3], temperature=1.5, extra_body={"top_k": 1}) == greedy
    assert ask(client, "text", "base", QUESTIONS[3], temperature=1.5, top_p=1e-6) == greedy


def test_server_sent_events_are_openai_chunks(server, ref):
    """The raw stream: `data: {json}` events separated by blank lines, the role first, `usage` null on every
    chunk with choices, then a usage chunk without choices, then `data: [DONE]`."""
    body = {"model": "b", "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 10,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    text, count, finish = ref.chat("b", QUESTIONS[0])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == text
    assert chunks[-2]["choices"][0]["finish_reason"] == finish
    prompt = len(prompt_ids(ref.tok, QUESTIONS[0]))
    assert chunks[-1]["usage"] == {"prompt_tokens": prompt, "completion_tokens": count,
                                   "total_tokens": prompt + count}


def test_the_api_key_is_checked_on_every_request(server, client, ref):
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for path in ("/v1/models", "/v1/nothing"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert_serves(client, ref)


def test_bad_requests_get_openai_errors(server, client, ref):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="c", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    refusals = [({"temperature": "hot"}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
                ({"messages": []}, "messages"), ({"n": 0}, "n"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
                ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                ({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"5": 1}}, "logit_bias"),
                ({"response_format": {"type": "json_object"}}, "response_format"),
                ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
                ({"messages": [{"role": "user", "content": "word " * 200}]}, "messages"),     # past 128 positions
                ({"max_tokens": 500}, "max_tokens")]                                         # the answer would be
    for change, param in refusals:
        body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], **change}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**body)
        assert e.value.status_code == 400 and e.value.body["param"] == param, change
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="base", prompt=[1, 2, 100000])
    assert "vocabulary" in e.value.body["message"]
    auth = {"Authorization": f"Bearer {KEY}"}
    for method, path, content, status in [("POST", "/v1/chat/completions", b'{"model": ', 400),
                                          ("POST", "/v1/completions", b"[1, 2]", 400),
                                          ("GET", "/v1/nothing", None, 404), ("POST", "/v1/models", b"{}", 405)]:
        r = httpx.request(method, server.url + path, content=content, headers=auth)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, path
    lone = [("/v1/chat/completions", b'{"model": "a", "messages": [{"role": "user", "content": "\\ud800"}]}'),
            ("/v1/completions", b'{"model": "base", "prompt": "red \\udfff"}')]
    for path, body in lone:
        r = httpx.post(server.url + path, content=body, headers=auth)        # a lone surrogate is no text
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text
    with pytest.raises(openai.BadRequestError) as e:         # past the queue limit alone: a 503 would never pass
        client.completions.create(model="base", prompt=["red"] * 17, max_tokens=1)
    assert e.value.body["code"] == "too_many_prompts" and "at most 16" in e.value.body["message"]
    assert_serves(client, ref)


def test_tiny_temperatures_and_top_p_0_answer_greedily(client, ref):
    """A temperature whose division overflows (5e-324) samples the softmax's limit, the argmax, as top_p 0 (the
    smallest nucleus: one token) does, as OpenAI's API accepts both (0 <= top_p <= 1)."""
    greedy = ref.text("base", QUESTIONS[3])
    assert ask(client, "text", "base", QUESTIONS[3], temperature=5e-324, seed=3) == greedy
    assert ask(client, "text", "base", QUESTIONS[3], temperature=1.5, top_p=0, seed=3) == greedy


def _long_prompt(ref) -> list:
    """Completion prompt ids whose greedy answer on the base runs 100 tokens without a stop token."""
    for seed in range(20):
        ids = np.random.default_rng(seed).integers(3, 80, 6).tolist()
        if ref.answer("base", ids, 100)[2] == "length":
            return ids
    pytest.fail("no prompt of the tiny model runs 100 tokens without stopping")


def test_a_client_leaving_mid_stream_stops_its_generation(server, client, ref, slow):
    ids = _long_prompt(ref)
    slow(0.02)                          # 100 tokens would take 2 s
    stats = server.scheduler.stats
    before = dict(stats)
    body = {"model": "base", "prompt": ids, "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
    _wait_for(lambda: stats["cancelled"] > before["cancelled"])
    assert stats["cancelled"] == before["cancelled"] + 1
    assert stats["tokens"] - before["tokens"] < 50           # it stopped well before its 100 tokens
    before = dict(stats)                                     # a client that waits for a whole answer, then leaves
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3,
                   headers={"Authorization": f"Bearer {KEY}"})
    _wait_for(lambda: stats["cancelled"] > before["cancelled"])
    assert stats["tokens"] - before["tokens"] < 50
    assert_serves(client, ref)


def _wait_for(condition, seconds: float = 5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_burst_past_the_queue_limit_gets_503(server, client, ref, slow, monkeypatch):
    slow(0.02)
    monkeypatch.setattr(server.scheduler, "max_queue", 2)

    def one(i):
        try:
            return ask(client, "chat", "a", QUESTIONS[i % 4], temperature=0)
        except openai.InternalServerError as e:
            return e
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and all(e.status_code == 503 and e.response.headers["retry-after"] == "1"
                           and e.body["code"] == "queue_full" for e in refused)
    answered = [(i, r) for i, r in enumerate(results) if not isinstance(r, Exception)]
    assert answered and all(r == ref.chat("a", QUESTIONS[i % 4]) for i, r in answered)
    monkeypatch.undo()
    assert_serves(client, ref)


def test_adapters_switch_without_their_files_and_the_base_comes_back(files, tmp_path):
    """Model.prepare_adapter / use_adapter / remove_adapter, as the server switches: a plain adapter and one with
    modules_to_save (trained copies of base weights) attached in turn from memory give load_adapter's logits,
    and remove_adapter gives the fresh base's."""
    ids = np.arange(3, 15)[None]
    fresh = wt.load_model(files.model, backend="numpy")
    saved = wt.load_model(files.model, backend="numpy")
    saved.add_lora(wt.LoraConfig(r=2, alpha=4, target_modules=["q_proj"], modules_to_save=("lm_head",)), seed=1)
    head = saved.engine.trainable()["lm_head.weight"]
    saved.engine.set_trainable({"lm_head.weight": head + 0.5 * np.random.default_rng(0).normal(size=head.shape)})
    saved.save_adapter(tmp_path / "copies")
    model = wt.load_model(files.model, backend="numpy")
    prepared = {"a": model.prepare_adapter(files.a), "copies": model.prepare_adapter(tmp_path / "copies")}
    for name in ("copies", "a", "copies"):
        model.use_adapter(prepared[name])
        loaded = wt.load_model(files.model, backend="numpy")
        loaded.load_adapter(files.a if name == "a" else tmp_path / "copies")
        assert np.array_equal(model.logits(ids), loaded.logits(ids)), name
        assert not np.allclose(model.logits(ids), fresh.logits(ids)), name
    model.remove_adapter()
    assert model.lora_config is None and np.array_equal(model.logits(ids), fresh.logits(ids))


def test_text_stream_holds_back_what_may_start_a_stop_string(ref):
    ids = ref.tok.encode("red cat blue moon")
    stream = TextStream(ref.tok, ["blue m", "cat x"])
    pieces = [stream.push(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == "red cat " and stream.stopped
    assert all("blue" not in p for p in pieces)


def test_bad_input_is_refused_in_one_line_before_serving(files, capsys, monkeypatch):
    base = ["serve", "--model", str(files.model), "--backend", "numpy", "--port", "0"]
    assert parse_adapter_spec("org/adapter") == parse_adapter_spec("org/adapter=org/adapter")
    for spec, match in [("=x", "must start with"), ("a=", "no adapter folder"), ("just_a_dir", "give it a name"),
                        (f"a={files.root / 'missing'}", "not found"), (f"base={files.a}", "the name is taken")]:
        extra = ["--served-model-name", "base"] if spec.startswith("base=") else []
        one_line_error(capsys, base + ["--adapter", spec] + extra, match)
    one_line_error(capsys, base + ["--adapter", f"a={files.a}", "--adapter", f"a={files.b}"], "given twice")
    # an adapter of another base: the same shapes (its tensors would load) but another RoPE base
    other = save_model(build_model("llama", seed=3, vocab_size=wt.load_model(files.model).config.vocab_size),
                       files.root / "other")
    edit_config(other, rope_theta=123.0)
    foreign = save_adapter(other, files.root / "foreign", 7)
    capsys.readouterr()
    one_line_error(capsys, base + ["--adapter", f"f={foreign}"], "was trained on")
    # an adapter of another shape, its base not on this machine: the shapes refuse it
    small = save_model(build_model("llama", seed=3, hidden_size=24, vocab_size=300), files.root / "small")
    misfit = save_adapter(small, files.root / "misfit", 7)
    raw = json.loads((misfit / "adapter_config.json").read_text())
    (misfit / "adapter_config.json").write_text(json.dumps({**raw, "base_model_name_or_path": "/elsewhere/model"}))
    capsys.readouterr()
    one_line_error(capsys, base + ["--adapter", f"m={misfit}"], "does not match the model")
    for key in ("", " "):                   # prepare, not main: a regression would serve, not hang the test
        with pytest.raises(ConfigError, match="^--api-key is empty: ") as e:
            prepare(_args(*base[1:], "--api-key", key))
        assert "\n" not in str(e.value)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        one_line_error(capsys, base[:-1] + [port], "in use")
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    one_line_error(capsys, base, "pip install 'wgpu-train[serve]'")


def _with_base(adapter, out, base: str):
    """A copy of an adapter folder whose adapter_config.json records `base` as its base model."""
    shutil.copytree(adapter, out)
    raw = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**raw, "base_model_name_or_path": base}))
    return out


def test_adapters_recording_different_hub_bases_are_refused(files, tmp_path, capsys):
    """Over a local folder naming no hub repository: adapters recording two different hub bases are refused; one
    recording a hub base is served with a warning line naming it. Over a folder whose config.json's
    _name_or_path names a repository, an adapter recording another is refused."""
    plain = _with_base(files.a, tmp_path / "plain", "Qwen/Qwen2.5-0.5B")
    instruct = _with_base(files.b, tmp_path / "instruct", "Qwen/Qwen2.5-0.5B-Instruct")
    base = ["serve", "--model", str(files.model), "--backend", "numpy", "--port", "0"]
    # prepare, not main: a regression would serve, not hang the test (the CLI prints these errors in one line)
    with pytest.raises(AdapterError, match="adapters p and i were trained on different base models"):
        prepare(_args(*base[1:], "--adapter", f"p={plain}", "--adapter", f"i={instruct}"))
    scheduler, sock = prepare(_args(*base[1:], "--adapter", f"p={plain}", "--adapter", f"q={plain}"))
    sock.close()
    assert scheduler.registry.names() == [str(files.model), "p", "q"]
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and all(w.startswith("warning: adapter ") and "Qwen/Qwen2.5-0.5B;" in w
                                      for w in warnings), warnings
    named = tmp_path / "named"
    shutil.copytree(files.model, named)
    config = json.loads((named / "config.json").read_text())
    (named / "config.json").write_text(json.dumps({**config, "_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}))
    with pytest.raises(AdapterError, match=f"was trained on Qwen/Qwen2.5-0.5B, not on the served model {named} "
                                           r"\(Qwen/Qwen2.5-0.5B-Instruct\)"):
        prepare(_args("--model", str(named), "--backend", "numpy", "--port", "0", "--adapter", f"p={plain}"))


def test_completion_prompts_start_with_bos_once(tmp_path):
    """A tokenizer whose post-processor adds <s>: a text prompt is BOS then its text, as transformers' tokenizer
    encodes it; chat prompts carry the template's BOS once too."""
    from transformers import AutoTokenizer
    from wgpu_train.serve.prompts import PromptStyle, chat_prompt_ids, completion_prompt_ids

    build_tokenizer(tmp_path, bos=True)
    tok, hf = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    ids = completion_prompt_ids(tok, "after red 1?", tok.vocab_size)
    assert ids == hf("after red 1?").input_ids and ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert completion_prompt_ids(tok, [5, 6], tok.vocab_size) == [5, 6]          # ids are taken as given
    chat = chat_prompt_ids(tok, [{"role": "user", "content": "after red 1?"}], PromptStyle())
    assert chat[0] == tok.bos_token_id and chat.count(tok.bos_token_id) == 1


def test_urls_of_ipv6_hosts_have_brackets():
    from wgpu_train.serve.server import url_of

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        assert url_of(sock) == f"http://127.0.0.1:{sock.getsockname()[1]}"
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    with socket.socket(socket.AF_INET6) as sock:
        try:
            sock.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback on this machine")
        assert url_of(sock) == f"http://[::1]:{sock.getsockname()[1]}"


def test_the_serve_bench_runs(default_rt):
    """`bench --only serve`'s measurement, small: every round generates the same greedy tokens (the adapters'
    B is zero), the mixed burst runs its adapters in one batch (no switch, as many submits a step as one adapter's), and the ratios
    it reports are those of its figures."""
    from wgpu_train.bench.serve import bench_serve

    result = bench_serve(default_rt, n=3, max_tokens=4)
    rounds = [result[k] for k in ("one_at_a_time", "mixed_burst", "single_adapter_burst")]
    assert rounds[0]["tokens"] == rounds[1]["tokens"] == rounds[2]["tokens"] > 0
    burst = result["mixed_burst"]
    assert result["adapters_in_one_batch"] and burst["adapter_switches"] == 0
    single = result["single_adapter_burst"]
    assert burst["submits"] * single["steps"] == single["submits"] * burst["steps"] > 0    # submits a step alike
    assert result["ttft_p50_vs_alone"] == round(rounds[1]["ttft_p50_s"] / rounds[0]["ttft_p50_s"], 2)
    assert result["mixed_vs_single"] == round(rounds[1]["tokens_per_s"] / rounds[2]["tokens_per_s"], 2)


def _read_lines(stream, lines: queue.Queue):
    for line in stream:
        lines.put(line)


def test_the_cli_serves_on_the_wgpu_backend(files, ref):
    """`wgpu-train serve --backend wgpu` in a process of its own: the base and an adapter answer as greedy
    generation does; Ctrl-C (SIGINT) shuts it down, exit code 130 as for every command, no traceback."""
    require_adapter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p)}
    proc = subprocess.Popen([sys.executable, "-m", "wgpu_train.cli", "serve", "--model", str(files.model),
                             "--adapter", f"a={files.a}", "--served-model-name", "base", "--backend", "wgpu",
                             "--port", "0", "--log-level", "warning"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True).start()
        deadline, url = time.monotonic() + 120, None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line.startswith("serving "):
                assert "(wgpu)" in line
                url = line.split(" at ")[1].split(",")[0]
        assert url, "the server did not start"
        local = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        for name in ("a", "base"):
            for kind in ("chat", "text_stream"):
                assert ask(local, kind, name, QUESTIONS[0], temperature=0) == expected(ref, kind, name, QUESTIONS[0])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130          # uvicorn shut down, then the CLI's Ctrl-C exit
        time.sleep(0.2)
        rest = "".join(lines.queue)
        assert "Traceback" not in rest and rest.strip().endswith("interrupted"), rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
