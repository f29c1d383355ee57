"""`wgpu-train bench --only serve`: the server on the embedded model, through HTTP: N concurrent greedy streamed
requests against the same N one at a time (the throughput ratio, which batching earns), and the time to the
first token of each, unloaded and under the concurrent load."""
from __future__ import annotations

import http.client
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from wgpu_train.errors import ConfigError


def _prompts(n: int) -> list:
    """n completion prompts in the embedded model's pretraining form `copy: a b c ... ->`, each copying the word
    lists of six records of the embedded dataset: answers of about 20 tokens (a word each) before its EOS."""
    from wgpu_train.training.config import default_data_dir

    lines = (default_data_dir() / "train.jsonl").read_text().splitlines()[:6 * n]
    words = [json.loads(line)["messages"][0]["content"].split(": ", 1)[1] for line in lines]
    return ["copy: " + " ".join(words[6 * i:6 * i + 6]) + " ->" for i in range(n)]


def _stream(port: int, prompt: str, max_tokens: int) -> tuple:
    """(seconds to the first text, seconds in all, completion tokens) of one streamed greedy completion."""
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {response.read()[:200]!r}")
    first, tokens = None, 0
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[len(b"data: "):])
        if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
            first = time.perf_counter() - started
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - started
    conn.close()
    return (total if first is None else first), total, tokens


def _round(port: int, prompts: list, max_tokens: int, concurrent: bool) -> dict:
    started = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(prompts)) as pool:
            runs = list(pool.map(lambda p: _stream(port, p, max_tokens), prompts))
    else:
        runs = [_stream(port, p, max_tokens) for p in prompts]
    wall = time.perf_counter() - started
    tokens = sum(r[2] for r in runs)
    return {"seconds": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
            "ttft_median_s": round(statistics.median(r[0] for r in runs), 4)}


def bench_serve(rt, n: int = 8, max_tokens: int = 24) -> dict:
    """n greedy requests of max_tokens one at a time, then all at once, on the embedded model on `rt`'s adapter
    (the same answers both ways: greedy); {"skipped": why} without the serve extra."""
    from wgpu_train.serve.server import require_extra

    try:
        require_extra()
    except ConfigError as e:
        return {"skipped": str(e)}
    from wgpu_train.engines.loading import load_model
    from wgpu_train.formats.tokenizer import load_tokenizer
    from wgpu_train.serve.adapters import AdapterRegistry
    from wgpu_train.serve.app import build_app
    from wgpu_train.serve.scheduler import Scheduler
    from wgpu_train.serve.server import ServerThread, bind
    from wgpu_train.training.config import default_model_dir

    model_dir = default_model_dir()
    model = load_model(model_dir, backend="wgpu", device=str(rt.info.index))
    scheduler = Scheduler(model, AdapterRegistry(model, "default"), load_tokenizer(model_dir), max_queue=n,
                          max_batch=n)
    scheduler.start()
    server = ServerThread(build_app(scheduler), bind("127.0.0.1", 0)).start()
    port = int(server.url.rsplit(":", 1)[1])
    prompts = _prompts(n)
    try:
        _round(port, prompts, 4, concurrent=True)            # warm-up: kernels compiled, the tuner's shapes timed
        _stream(port, prompts[0], 4)
        one = _round(port, prompts, max_tokens, concurrent=False)
        batched = scheduler.stats["steps"]
        together = _round(port, prompts, max_tokens, concurrent=True)
        batches = scheduler.stats["steps"] - batched
    finally:
        server.stop()
        scheduler.close()
    return {"adapter": rt.info.describe(), "model": "embedded", "requests": n, "max_tokens": max_tokens,
            "one_at_a_time": one, "concurrent": {**together, "steps": batches},
            "throughput_ratio": round(together["tokens_per_s"] / max(one["tokens_per_s"], 1e-12), 2)}
