"""Continuous batching in `wgpu-train serve`: a burst of requests of mixed adapters (in one bank), sampling
settings and arrival times answers each as the same request sent alone, on the NumPy engine and on each adapter
present, and so does one over an adapter that cannot join a bank (batches of one adapter); a client that leaves
frees its row (the occupancy gauge) while bad requests are still refused; n, logprobs, echo and penalties against
references computed without the server; /health and /metrics; the embedded model served as `default`."""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

import wgpu_train as wt

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
prometheus = pytest.importorskip("prometheus_client.parser")

from finetune_helpers import one_line_error  # noqa: E402
from serve_helpers import KEY, QUESTIONS, Reference, ask, save_adapter, served_files  # noqa: E402
from tolerances import assert_close  # noqa: E402
from wgpu_train.cli.commands import prompt_ids  # noqa: E402
from wgpu_train.cli.main import build_parser  # noqa: E402
from wgpu_train.cli.serve import prepare  # noqa: E402
from wgpu_train.serve.app import build_app  # noqa: E402
from wgpu_train.serve.server import ServerThread  # noqa: E402
from wgpu_train.training.config import default_model_dir  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return served_files(tmp_path_factory.mktemp("batching"))


@pytest.fixture(scope="module")
def ref(files):
    return Reference(files)


@contextlib.contextmanager
def serving(files, *options):
    """The CLI's server over the tiny model and both adapters, at most 4 rows in its batch."""
    args = build_parser().parse_args(["serve", "--model", str(files.model), "--adapter", f"a={files.a}",
                                      "--adapter", f"b={files.b}", "--served-model-name", "base", "--port", "0",
                                      "--api-key", KEY, "--max-batch", "4", *options])
    scheduler, sock = prepare(args)
    scheduler.start()
    thread = ServerThread(build_app(scheduler, args.api_key), sock).start()
    try:
        yield SimpleNamespace(url=thread.url, scheduler=scheduler,
                              client=openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0,
                                                   timeout=120))
    finally:
        thread.stop()
        scheduler.close()


@pytest.fixture(scope="module")
def server(files):
    with serving(files, "--backend", "numpy") as s:
        yield s


def slow_down(scheduler, monkeypatch, seconds: float):
    """Each engine call of the running batch takes `seconds` longer, so that requests overlap in it."""
    engine = scheduler.model.engine
    inner = type(engine).forward_rows

    def forward_rows(*a, **kw):
        time.sleep(seconds)
        return inner(engine, *a, **kw)
    monkeypatch.setattr(engine, "forward_rows", forward_rows)


def _burst_plan(ref) -> list:
    """(kind, model, question, sampling) of 12 requests: greedy, seeded samples (temperature, top-p, top-k),
    penalties and a stop string met, over the base and both adapters."""
    text = ref.chat("a", QUESTIONS[1], 10)[0]
    stop = text[2:4]
    settings = [dict(temperature=0), dict(temperature=0.9, seed=11), dict(temperature=0, stop=[stop]),
                dict(temperature=1.3, top_p=0.8, seed=5), dict(temperature=0, frequency_penalty=1.5),
                dict(temperature=1.1, seed=3, extra_body={"top_k": 5}), dict(temperature=0.7, seed=2,
                                                                            presence_penalty=1.0),
                dict(temperature=0, presence_penalty=-0.5)]
    kinds = ("chat", "text_stream", "chat_stream", "text")
    models = ("base", "a", "a", "b")
    plan = [(kinds[i % 4], models[i % 4], QUESTIONS[(i + i // 4) % 4], settings[i % 8]) for i in range(12)]
    plan[2] = ("chat_stream", "a", QUESTIONS[1], settings[2])         # the stop string comes from that answer
    return plan


def _burst_equals_alone(server, ref, monkeypatch):
    plan = _burst_plan(ref)
    for name in ("base", "a", "b"):          # warm: the kernels of every shape compiled, the tuner's timed
        ask(server.client, "text", name, QUESTIONS[0], 12, temperature=0)
    slow_down(server.scheduler, monkeypatch, 0.01)
    stats = server.scheduler.stats
    before = dict(stats)

    def staggered(i):
        time.sleep(0.04 * i)
        kind, name, question, sampling = plan[i]
        return ask(server.client, kind, name, question, 12, **sampling)
    with ThreadPoolExecutor(len(plan)) as pool:
        burst = list(pool.map(staggered, range(len(plan))))
    assert stats["joined"] > before["joined"]          # some joined a batch already running
    assert stats["largest_batch"] >= 3
    alone = [ask(server.client, kind, name, question, 12, **sampling) for kind, name, question, sampling in plan]
    assert burst == alone
    assert alone[2][2] == "stop" and len({a[0] for a in alone}) > 6
    return alone


def test_a_burst_answers_each_request_as_alone_on_the_numpy_engine(server, ref, monkeypatch):
    """Greedy requests, seeded samples, penalties and a stop string, over three models, arriving 40 ms apart
    while each step takes at least 10 ms: each answer (text, token count, finish reason) equals the same request
    sent alone, and the greedy ones the generate path's answer."""
    alone = _burst_equals_alone(server, ref, monkeypatch)
    plan = _burst_plan(ref)
    assert alone[0] == ref.chat(plan[0][1], plan[0][2], 12)


def test_a_burst_answers_each_request_as_alone_on_webgpu(files, ref, rt, monkeypatch):
    with serving(files, "--backend", "wgpu", "--device", str(rt.info.index)) as server:
        _burst_equals_alone(server, ref, monkeypatch)


def _metrics(url: str) -> dict:
    """{(name, labels as a sorted tuple): value} of every sample /metrics gives (without the API key)."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in prometheus.text_string_to_metric_families(r.text) for s in family.samples}


def _long_prompt(ref) -> list:
    """Completion prompt ids whose greedy answer on the base runs 100 tokens without a stop token."""
    for seed in range(20):
        ids = np.random.default_rng(seed).integers(3, 80, 6).tolist()
        if ref.answer("base", ids, 100)[2] == "length":
            return ids
    pytest.fail("no prompt of the tiny model runs 100 tokens without stopping")


def test_a_client_leaving_frees_its_row_and_bad_requests_are_refused_meanwhile(server, ref, monkeypatch):
    slow_down(server.scheduler, monkeypatch, 0.02)
    running = ("wgpu_train_serve_batch_rows_running", ())
    cancelled = ("wgpu_train_serve_requests_total", (("finish_reason", "cancelled"), ("model", "base")))
    before = _metrics(server.url).get(cancelled, 0.0)
    body = {"model": "base", "prompt": _long_prompt(ref), "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
            lines = r.iter_lines()          # kept open: closing the iterator would close the connection
            events = 0
            while events < 3:
                events += next(lines).startswith("data: ")
            assert _metrics(server.url)[running] == 1
            started = time.monotonic()
            bad = httpx.post(server.url + "/v1/completions", json={**body, "top_p": 3}, headers=AUTH)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
            assert time.monotonic() - started < 1.0       # not behind the running answer's 2 s
            assert _metrics(server.url)[running] == 1
    deadline = time.monotonic() + 5
    while _metrics(server.url)[running] and time.monotonic() < deadline:
        time.sleep(0.01)
    after = _metrics(server.url)
    assert after[running] == 0 and after[cancelled] == before + 1
    assert server.scheduler._batch.free_slots() == 4


def test_health_and_metrics_answer_without_the_key(server, ref):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert httpx.get(server.url + "/v1/models").status_code == 401
    before = _metrics(server.url)
    ask(server.client, "chat", "b", QUESTIONS[0], temperature=0)
    after = _metrics(server.url)
    text, count, finish = ref.chat("b", QUESTIONS[0])

    def grew(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)
    assert grew("wgpu_train_serve_requests_total", (("finish_reason", finish), ("model", "b"))) == 1
    assert grew("wgpu_train_serve_generation_tokens_total") == count
    assert grew("wgpu_train_serve_time_to_first_token_seconds_count") == 1
    assert grew("wgpu_train_serve_time_per_output_token_seconds_count") == count - 1
    assert after[("wgpu_train_serve_batch_rows", ())] == 4 and after[("wgpu_train_serve_queue_length", ())] == 0


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_echo_and_logprobs_of_completions_are_the_models(server, ref):
    """echo with logprobs (what lm-eval's local-completions sends): the prompt's tokens with the log-probabilities
    of a whole forward pass of the model (the first token none), then the answer's token, in OpenAI's shape."""
    ids = ref.tok.encode("after moon 6? moon 6")
    r = server.client.completions.create(model="a", prompt=ids, max_tokens=1, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = _log_softmax(ref.models["a"].logits(np.array(ids)[None])[0])          # (T, V)
    assert_close(np.array(lp.token_logprobs[1:-1]), expected[np.arange(len(ids) - 1), ids[1:]], "serve_logprobs",
                 "the prompt's log-probabilities")
    new = ref.answer("a", ids, 1)[0]
    assert choice.text == ref.tok.decode(ids, skip_special_tokens=False) + new
    every = ids + ref.models["a"].generate(ids, max_new_tokens=1)
    texts = [ref.tok.decode([t], skip_special_tokens=False) for t in every]
    assert lp.tokens == [f"token_id:{t}" if "\ufffd" in x else x for t, x in zip(every, texts)]
    assert all(len(top) == 2 and max(top.values()) >= lp.token_logprobs[i + 1] - 1e-9
               for i, top in enumerate(lp.top_logprobs[1:]))
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())            # greedy: the likeliest
    assert lp.text_offset == [0] + np.cumsum([len(t) for t in lp.tokens[:-1]]).tolist()


def test_chat_logprobs_follow_the_text_and_the_stream(server, ref):
    kw = dict(model="base", messages=[{"role": "user", "content": QUESTIONS[2]}], max_tokens=10, temperature=0,
              logprobs=True, top_logprobs=3)
    r = server.client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == ref.chat("base", QUESTIONS[2])[0]
    new = ref.models["base"].generate(prompt_ids(ref.tok, QUESTIONS[2]), max_new_tokens=10)
    texts = [(t, ref.tok.decode([t], skip_special_tokens=False)) for t in new if t not in ref.stops]
    assert [e.token for e in content] == [f"token_id:{t}" if "\ufffd" in x else x for t, x in texts]
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob and
               e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob and
               (e.bytes is None or bytes(e.bytes).decode() == e.token) for e in content)
    streamed = [e for chunk in server.client.chat.completions.create(**kw, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # the stream reused the first answer's prompt prefix (other matrix shapes): the same numbers but for last bits
    assert_close(np.array([e.logprob for e in streamed]), np.array([e.logprob for e in content]), "serve_logprobs",
                 "streamed logprobs")


def test_n_choices_draw_from_consecutive_seeds(server):
    kw = dict(model="b", prompt=QUESTIONS[1], max_tokens=8, temperature=1.2)
    r = server.client.completions.create(n=3, seed=40, **kw)
    alone = [server.client.completions.create(seed=40 + j, **kw) for j in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    two = server.client.chat.completions.create(model="a", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                n=2, temperature=0, max_tokens=6)
    assert two.choices[0].message.content == two.choices[1].message.content


@pytest.mark.parametrize("presence, frequency", [(0.0, 1.5), (1.2, 0.0), (-0.8, 0.6)])
def test_penalties_are_openais(server, ref, presence, frequency):
    """Greedy with penalties equals a loop over whole forward passes that subtracts frequency x count + presence
    from the logits of every token generated so far, then takes the likeliest."""
    ids = ref.tok.encode(QUESTIONS[3])
    model, seq, counts = ref.models["base"], list(ids), {}
    for _ in range(12):
        logits = model.logits(np.array(seq)[None])[0, -1].astype(np.float64)        # (V,)
        for t, c in counts.items():
            logits[t] -= frequency * c + presence
        tok = int(np.argmax(logits))
        seq.append(tok)
        counts[tok] = counts.get(tok, 0) + 1
        if tok in ref.stops:
            break
    want = ref.tok.decode([t for t in seq[len(ids):] if t not in ref.stops])
    r = server.client.completions.create(model="base", prompt=ids, max_tokens=12, temperature=0,
                                         presence_penalty=presence, frequency_penalty=frequency)
    assert r.choices[0].text == want and r.usage.completion_tokens == len(seq) - len(ids)
    plain = ref.answer("base", ids, 12)[0]
    assert want != plain or frequency == 0


def test_the_embedded_model_is_served_as_default(tmp_path):
    """With no --model, an adapter trained on the embedded model serves it as `default`, as the README says."""
    adapter = save_adapter(default_model_dir(), tmp_path / "embedded", 1)
    scheduler, sock = prepare(build_parser().parse_args(["serve", "--adapter", f"mine={adapter}", "--backend",
                                                         "numpy", "--port", "0"]))
    sock.close()
    assert scheduler.registry.names() == ["default", "mine"]
    scheduler, sock = prepare(build_parser().parse_args(["serve", "--backend", "numpy", "--port", "0"]))
    sock.close()
    assert scheduler.registry.names() == ["default"]


def test_a_model_length_past_the_positions_is_one_line(files, ref, capsys):
    one_line_error(capsys, ["serve", "--model", str(files.model), "--backend", "numpy", "--port", "0",
                            "--max-model-len", "100000"], "--max-model-len 100000: the model has 128 positions")
    with serving(files, "--backend", "numpy", "--max-model-len", "40") as server:
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(model="base", prompt=list(range(3, 40)), max_tokens=5)
        assert e.value.body["code"] == "context_length_exceeded" and "40 tokens" in e.value.body["message"]
        assert ask(server.client, "text", "base", QUESTIONS[0], temperature=0) == ref.text("base", QUESTIONS[0])


def test_an_adapter_that_cannot_join_a_bank_runs_in_batches_of_its_own(files, ref, tmp_path, monkeypatch):
    """An adapter with modules_to_save (a trained copy of lm_head) changes the model beyond a LoRA term: the
    server serves its adapters one at a time, each batch of one adapter, switching between them (another
    adapter's requests wait at most PATIENCE steps), and every answer still equals the request alone."""
    saved = wt.load_model(files.model, backend="numpy")
    saved.add_lora(wt.LoraConfig(r=2, alpha=4, target_modules=["q_proj"], modules_to_save=("lm_head",)), seed=1)
    head = saved.engine.trainable()["lm_head.weight"]
    saved.engine.set_trainable({"lm_head.weight": head + 0.5 * np.random.default_rng(0).normal(size=head.shape)})
    saved.save_adapter(tmp_path / "copies")
    args = build_parser().parse_args(["serve", "--model", str(files.model), "--adapter", f"a={files.a}",
                                      "--adapter", f"copies={tmp_path / 'copies'}", "--served-model-name", "base",
                                      "--backend", "numpy", "--port", "0", "--api-key", KEY, "--max-batch", "4"])
    scheduler, sock = prepare(args)
    scheduler.start()
    thread = ServerThread(build_app(scheduler, args.api_key), sock).start()
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    try:
        assert not scheduler.mixed
        slow_down(scheduler, monkeypatch, 0.01)
        plan = [("base", QUESTIONS[0]), ("copies", QUESTIONS[1]), ("a", QUESTIONS[2]), ("copies", QUESTIONS[3]),
                ("a", QUESTIONS[0]), ("base", QUESTIONS[1])]

        def staggered(i):
            time.sleep(0.03 * i)
            return ask(client, "text", *plan[i], 10, temperature=0)
        with ThreadPoolExecutor(len(plan)) as pool:
            burst = list(pool.map(staggered, range(len(plan))))
        assert scheduler.registry.switches >= 3
        assert burst == [ask(client, "text", *p, 10, temperature=0) for p in plan]
        assert burst[0] == ref.text("base", QUESTIONS[0]) and burst[2] == ref.text("a", QUESTIONS[2])
    finally:
        thread.stop()
        scheduler.close()


def test_streamed_echo_logprobs_and_choices_equal_the_whole_answer(server, ref):
    kw = dict(model="b", prompt=ref.tok.encode(QUESTIONS[1]), max_tokens=5, temperature=0.8, seed=3, n=2, echo=True,
              logprobs=1)
    whole = server.client.completions.create(**kw)
    texts, logprobs = ["", ""], [[], []]
    for chunk in server.client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            logprobs[c.index] += c.logprobs.token_logprobs if c.logprobs else []
    assert texts == [c.text for c in whole.choices] and texts[0].startswith(ref.tok.decode(kw["prompt"]))
    assert logprobs == [c.logprobs.token_logprobs for c in whole.choices]
    assert sum(map(len, logprobs)) == 2 * len(kw["prompt"]) + whole.usage.completion_tokens   # every token's


def test_a_prompt_sent_again_reuses_its_prefix(server, ref):
    """The same question to the same adapter twice: the second finds all but its prompt's last token in a free
    row's cache (the prefix_reused_tokens counter), and answers the same; another adapter reuses none of it."""
    reused = ("wgpu_train_serve_prefix_reused_tokens_total", ())
    prompt = prompt_ids(ref.tok, QUESTIONS[3])
    first = ask(server.client, "chat", "a", QUESTIONS[3], temperature=0)
    before = _metrics(server.url)[reused]
    assert ask(server.client, "chat", "a", QUESTIONS[3], temperature=0) == first == ref.chat("a", QUESTIONS[3])
    assert _metrics(server.url)[reused] - before == len(prompt) - 1
    before = _metrics(server.url)[reused]
    ask(server.client, "text", "b", "zz " + QUESTIONS[2], temperature=0)
    assert _metrics(server.url)[reused] == before


def test_a_failing_step_answers_500_and_the_server_serves_on(server, ref, monkeypatch):
    engine = server.scheduler.model.engine
    inner = type(engine).forward_rows
    calls = []

    def fails_once(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return inner(engine, *a, **kw)
    monkeypatch.setattr(engine, "forward_rows", fails_once)
    with pytest.raises(openai.InternalServerError) as e:
        ask(server.client, "chat", "a", QUESTIONS[0], temperature=0)
    assert "internal error during generation (RuntimeError)" in e.value.body["message"]
    assert ask(server.client, "chat", "a", QUESTIONS[0], temperature=0) == ref.chat("a", QUESTIONS[0])
    assert _metrics(server.url)[("wgpu_train_serve_batch_rows_running", ())] == 0
    assert server.scheduler._batch.free_slots() == 4
