"""Images through `serve` (OpenAI image_url parts: data: URLs and file:// paths) on a tiny Gemma 3 vision model,
the NumPy engine: the openai client's answer equals `generate --image`'s, text rows batched beside image rows (in
one process and over 2 pipeline stages), and the 400s (an undecodable image, a remote URL without
--allow-remote-images, a model without images)."""
from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from test_gemma3_vision import images  # noqa: E402
from test_gemma3_vision_training import chat_vlm  # noqa: E402,F401  (the tiny chat vision model fixture)
from test_pipeline_commands import in_process  # noqa: E402,F401  (the stages in this process)

KEY = "sk-vision"
QUESTION = "what colour is it?"


def start_server(folder, *extra):
    """(Scheduler, ServerThread) serving the model in folder on the NumPy engine as `default`, started."""
    from wgpu_train.cli.main import build_parser
    from wgpu_train.cli.serve import prepare
    from wgpu_train.serve.app import build_app
    from wgpu_train.serve.server import ServerThread

    args = build_parser().parse_args(["serve", "--model", str(folder), "--backend", "numpy", "--port", "0",
                                      "--api-key", KEY, "--max-batch", "4", "--served-model-name", "default", *extra])
    scheduler, sock = prepare(args)
    scheduler.start()
    return scheduler, ServerThread(build_app(scheduler, KEY), sock).start()


@pytest.fixture(scope="module")
def served(chat_vlm, tmp_path_factory):  # noqa: F811
    _, folder, _ = chat_vlm
    root = tmp_path_factory.mktemp("served_images")
    paths = []
    for i, img in enumerate(images(2, seed=9)):
        paths.append(root / f"x{i}.png")
        img.save(paths[-1])
    scheduler, thread = start_server(folder)
    yield SimpleNamespace(url=thread.url, scheduler=scheduler, folder=folder, paths=paths)
    thread.stop()
    scheduler.close()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def generated(folder, path, capsys, tokens: int = 5) -> str:
    """`generate --image`'s greedy answer (the reference)."""
    from wgpu_train.cli.main import main

    assert main(["generate", "--model", str(folder), "--prompt", QUESTION, "--image", str(path),
                 "--max-new-tokens", str(tokens), "--backend", "numpy"]) == 0
    return capsys.readouterr().out.removesuffix("\n")


def ask(client, url: str | None, tokens: int = 5, text: str = QUESTION):
    content = [{"type": "text", "text": text}] if url is None else \
        [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": content}],
                                       max_tokens=tokens, temperature=0)
    return r.choices[0].message.content


def test_an_image_answer_equals_generate_image(served, client, capsys):
    """A data: URL and a file:// path of one image: `generate --image`'s answer, token for token; the usage
    counts the image's tokens in the prompt."""
    for path in served.paths:
        want = generated(served.folder, path, capsys)
        assert want.strip()
        assert ask(client, data_url(path)) == want
        assert ask(client, path.resolve().as_uri()) == want
    r = client.chat.completions.create(model="default", max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(served.paths[0])}},
                                     {"type": "text", "text": QUESTION}]}])
    assert r.usage.prompt_tokens > 4 + 2        # the image's 4 tokens and its begin / end markers at least
    chunks = client.chat.completions.create(model="default", max_tokens=5, temperature=0, stream=True, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(served.paths[1])}},
                                     {"type": "text", "text": QUESTION}]}])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_image_rows_batch_with_text_rows(served, client, capsys):
    """Two image requests and two text requests at once: each answer is the one it gets alone (the rows share
    the batch's steps)."""
    wants = [generated(served.folder, p, capsys) for p in served.paths]
    alone = [ask(client, None, text=t) for t in ("describe the picture", "no picture here")]
    served.scheduler.stats["largest_batch"] = 0
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, client, data_url(p)) for p in served.paths] + \
                  [pool.submit(ask, client, None, 5, t) for t in ("describe the picture", "no picture here")]
        got = [f.result() for f in futures]
    assert got == wants + alone
    assert served.scheduler.stats["largest_batch"] >= 2


def test_served_as_pipeline_stages_images_answer_as_one_process(served, client, in_process):  # noqa: F811
    """`serve --pipeline-stages 2` (the stages in this process): image requests (a data: URL, a file:// path)
    batched beside text requests answer as the one-process server does, token for token."""
    from wgpu_train.cli.adapter_settings import close_stages

    asks = [(data_url(served.paths[0]), QUESTION), (served.paths[1].resolve().as_uri(), QUESTION),
            (None, "describe the picture")]
    wants = [ask(client, url, 5, text) for url, text in asks]
    scheduler, thread = start_server(served.folder, "--pipeline-stages", "2")
    try:
        assert scheduler.vision is not None and len(in_process) == 1
        staged = openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(asks)) as pool:
            got = [f.result() for f in [pool.submit(ask, staged, url, 5, text) for url, text in asks]]
        assert got == wants and scheduler.stats["largest_batch"] >= 2
    finally:
        thread.stop()
        scheduler.close()
        close_stages(scheduler.model)


def test_remote_images_with_the_flag(served, capsys, monkeypatch):
    """--allow-remote-images: an http URL fetched (from a server on 127.0.0.1, no network), the same answer;
    one that fails to fetch is a 400."""
    import http.server
    import threading

    from wgpu_train.serve.app import build_app
    from wgpu_train.serve.server import ServerThread, bind

    monkeypatch.setenv("no_proxy", "127.0.0.1")     # urllib's fetch goes straight to the local file server
    path = served.paths[0]
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: http.server.SimpleHTTPRequestHandler(
        *a, directory=str(path.parent)))
    threading.Thread(target=files.serve_forever, daemon=True).start()
    app = ServerThread(build_app(served.scheduler, KEY, allow_remote_images=True), bind("127.0.0.1", 0)).start()
    try:
        remote = openai.OpenAI(base_url=app.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        base = f"http://127.0.0.1:{files.server_address[1]}/"
        assert ask(remote, base + path.name) == generated(served.folder, path, capsys)
        with pytest.raises(openai.BadRequestError) as e:
            ask(remote, base + "missing.png")
        assert e.value.code == "invalid_image" and "cannot fetch" in e.value.message
    finally:
        app.stop()
        files.shutdown()


@pytest.mark.parametrize("url, code, words", [
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG broken").decode(), "invalid_image", "cannot decode"),
    ("data:image/png;base64,@@@", "invalid_image", "base64 does not decode"),
    ("https://example.com/cat.png", "remote_image_refused", "--allow-remote-images"),
    ("file:///no/such/image.png", "invalid_image", "no such file"),
    ("ftp://example.com/cat.png", "invalid_image", "unsupported image URL scheme"),
])
def test_bad_images_are_400s(client, url, code, words):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, url)
    assert e.value.status_code == 400 and e.value.code == code and words in e.value.message


def test_a_model_without_images_refuses_them(served, client, monkeypatch):
    """A model served without a vision tower (text-only): a 400 naming it."""
    monkeypatch.setattr(served.scheduler, "vision", None)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, data_url(served.paths[0]))
    assert e.value.code == "images_not_supported" and "takes no images" in e.value.message


def test_decode_batch_prefills_images_whole(chat_vlm):  # noqa: F811
    """DecodeBatch with an image row among text rows, the prefill budget smaller than the image's prompt: each
    row's greedy tokens equal VisionModel.generate's / the text model's alone."""
    from wgpu_train.data.images import pixel_batch
    from wgpu_train.engines.generate import DecodeBatch
    from wgpu_train.engines.vision_model import load_vision_model

    _, folder, _ = chat_vlm
    vm = load_vision_model(folder)
    vc = vm.vision
    prompt = [2, 9, vc.boi_token_id, *[vc.image_token_id] * vc.mm_tokens_per_image, vc.eoi_token_id, 11, 12]
    pixels = pixel_batch(images(1, seed=3), vm.settings)
    want_image = vm.generate(prompt, pixels, 4)
    want_text = vm.model.generate([2, 13, 14], max_new_tokens=4)
    batch = DecodeBatch(vm.model.engine, 3, 32, token_budget=4)
    text_slot = batch.add([2, 13, 14], 4)
    ids, tokens = vm.prompt_images(prompt, pixels)
    image_slot = batch.add(ids, 4, images=tokens)
    out = {text_slot: [], image_slot: []}
    while len(batch):
        for t in batch.step():
            out[t.slot].append(t.id)
    batch.close()
    assert out[image_slot] == want_image and out[text_slot] == want_text
    assert vm.model.engine.images is None


def test_image_parts_and_refusals_in_requests():
    """parse_chat keeps the parts in order ({"type": "image"} where an image_url was) and the URLs (with tools too:
    tests/test_grpo_tools_vision.py serves them)."""
    from wgpu_train.serve.api_error import ApiError
    from wgpu_train.serve.requests import parse_chat

    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:x;base64,AA=="}},
        {"type": "text", "text": "b"}]}, {"role": "assistant", "content": "c"}]})
    assert req.images == ("data:x;base64,AA==",)
    assert req.messages[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image"},
                                          {"type": "text", "text": "b"}]
    assert req.messages[1]["content"] == "c"
    assert parse_chat({"model": "m", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                       "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
                       }).images == ("x",)
    with pytest.raises(ApiError, match="only text and image_url parts"):
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})
