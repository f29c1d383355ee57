"""Qwen3-VL's images through DecodeBatch and `serve` (the NumPy engine): image rows prefilled whole beside text
rows, each new token at its M-RoPE position (the row's last + 1, not its cache row), answers equal to
VisionModel.generate's and `generate --image`'s, through the openai client too."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from test_qwen3_vl import images, span, vlm  # noqa: F401  (the tiny Qwen3-VL fixture)

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

KEY = "sk-qwen3-vl"
QUESTION = "what colour?"


def decode_rows(vm, rows, budget: int = 6) -> dict:
    """rows [(prompt ids, its images or None)] in one DecodeBatch of a small prefill budget: each row's 6 greedy
    tokens by its slot."""
    from wgpu_train.engines.generate import DecodeBatch

    batch = DecodeBatch(vm.model.engine, len(rows), 96, token_budget=budget)
    slots = []
    for ids, imgs in rows:
        if imgs is None:
            slots.append(batch.add(ids, 6))
        else:
            ids, tokens = vm.prompt_images(ids, imgs)
            slots.append(batch.add(ids, 6, images=tokens))
    out = {s: [] for s in slots}
    try:
        while len(batch):
            for t in batch.step():
                out[t.slot].append(t.id)
    finally:
        batch.close()
    return [out[s] for s in slots]


def test_decode_batch_rows_follow_m_rope(vlm):  # noqa: F811
    """Two image rows (of different images: their M-RoPE shifts differ) and a text row share the steps: each
    row's tokens equal VisionModel.generate's alone (transformers', test_qwen3_vl.py) and the text model's."""
    _, _, vm = vlm
    imgs = images(3, seed=5)
    first = [7, *span(vm, imgs[0]), 8, *span(vm, imgs[1]), 9]
    second = [10, *span(vm, imgs[2]), 11, 12]
    text = [7, 8, 9, 13]
    want = [vm.generate(np.array(first), imgs[:2], max_new_tokens=6),
            vm.generate(np.array(second), imgs[2:], max_new_tokens=6),
            vm.model.generate(text, max_new_tokens=6)]
    assert decode_rows(vm, [(first, imgs[:2]), (text, None), (second, imgs[2:])]) == [want[0], want[2], want[1]]


@pytest.fixture(scope="module")
def served(vlm, tmp_path_factory):  # noqa: F811
    from wgpu_train.cli.main import build_parser
    from wgpu_train.cli.serve import prepare
    from wgpu_train.serve.app import build_app
    from wgpu_train.serve.server import ServerThread

    _, folder, _ = vlm
    root = tmp_path_factory.mktemp("served_qwen3_vl")
    paths = []
    for i, img in enumerate(images(2, seed=9)):
        paths.append(root / f"x{i}.png")
        img.save(paths[-1])
    args = build_parser().parse_args(["serve", "--model", str(folder), "--backend", "numpy", "--port", "0",
                                      "--api-key", KEY, "--max-batch", "4", "--served-model-name", "default"])
    scheduler, sock = prepare(args)
    scheduler.start()
    thread = ServerThread(build_app(scheduler, KEY), sock).start()
    yield SimpleNamespace(url=thread.url, scheduler=scheduler, folder=folder, paths=paths)
    thread.stop()
    scheduler.close()


def test_serve_answers_as_generate_image(served, capsys):
    """image_url parts (file:// paths) of two images asked at once beside a text request: each answer is
    `generate --image`'s for its image."""
    from wgpu_train.cli.main import main

    wants = []
    for path in served.paths:
        assert main(["generate", "--model", str(served.folder), "--prompt", QUESTION, "--image", str(path),
                     "--max-new-tokens", "5", "--backend", "numpy"]) == 0
        wants.append(capsys.readouterr().out.removesuffix("\n"))
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def ask(path):
        content = [{"type": "text", "text": QUESTION}] if path is None else \
            [{"type": "image_url", "image_url": {"url": path.resolve().as_uri()}}, {"type": "text", "text": QUESTION}]
        r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": content}],
                                           max_tokens=5, temperature=0)
        return r.choices[0].message.content

    alone = ask(None)
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(ask, [*served.paths, None]))
    assert got == wants + [alone] and all(w.strip() for w in wants)
