"""`wgpu-train bench --only serve`: the server on the embedded model with three LoRA adapters (in one bank: rows of
any of them share a step), through HTTP: a burst of N streamed greedy requests arriving a few milliseconds apart
over the three adapters (mixed) and over one (single), against the same N requests sent one at a time: time to
the first token (p50, p95) against one request alone, tokens/s against one at a time, and mixed against single,
as ratios measured in one run; the engine's submits and steps of each burst."""
from __future__ import annotations

import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from wgpu_train.errors import ConfigError

ADAPTERS = ("a0", "a1", "a2")


def _prompts(n: int) -> list:
    """n completion prompts in the embedded model's pretraining form `copy: a b c ... ->`, each copying the word
    lists of six records of the embedded dataset: answers of about 20 tokens (a word each) before its EOS."""
    from wgpu_train.training.config import default_data_dir

    lines = (default_data_dir() / "train.jsonl").read_text().splitlines()[:6 * n]
    words = [json.loads(line)["messages"][0]["content"].split(": ", 1)[1] for line in lines]
    return ["copy: " + " ".join(words[6 * i:6 * i + 6]) + " ->" for i in range(n)]


def _stream(port: int, model: str, prompt: str, max_tokens: int) -> tuple:
    """(seconds to the first text, seconds in all, completion tokens) of one streamed greedy completion."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
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


def _round(port: int, requests: list, max_tokens: int, stagger_s: float | None) -> dict:
    """requests: (model, prompt) pairs, one at a time (stagger_s None) or each sent stagger_s after the one
    before it, not waiting for answers."""
    runs = [None] * len(requests)

    def one(i):
        runs[i] = _stream(port, *requests[i], max_tokens)
    started = time.perf_counter()
    if stagger_s is None:
        for i in range(len(requests)):
            one(i)
    else:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
        for i, t in enumerate(threads):
            time.sleep(max(0.0, started + i * stagger_s - time.perf_counter()))
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - started
    tokens = sum(r[2] for r in runs)
    ttft = [r[0] for r in runs]
    return {"seconds": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_s": round(statistics.median(ttft), 4), "ttft_p95_s": round(float(np.percentile(ttft, 95)), 4)}


def _adapters(model_dir: Path, folder: Path) -> list:
    """Three rank-8 LoRA adapters of every linear module of the model, saved as PEFT writes them."""
    from wgpu_train.adapters.config import LoraConfig
    from wgpu_train.engines.loading import load_model

    out = []
    for seed, name in enumerate(ADAPTERS):
        model = load_model(model_dir, backend="numpy")
        model.add_lora(LoraConfig(r=8, alpha=16, target_modules="all-linear", init="gaussian"), seed=seed)
        model.save_adapter(folder / name)
        out.append(folder / name)
    return out


def bench_serve(rt, n: int = 16, max_tokens: int = 24, stagger_s: float = 0.02) -> dict:
    """n greedy requests of max_tokens one at a time, then in staggered bursts over three adapters and over one,
    on the embedded model on `rt`'s adapter; {"skipped": why} without the serve extra."""
    from wgpu_train.serve.server import require_extra

    try:
        require_extra()
    except ConfigError as e:
        return {"skipped": str(e)}
    from wgpu_train.engines.loading import load_model
    from wgpu_train.formats.tokenizer import load_tokenizer
    from wgpu_train.serve.adapters import AdapterRegistry
    from wgpu_train.serve.app import build_app
    from wgpu_train.serve.prompts import PromptStyle
    from wgpu_train.serve.scheduler import Scheduler
    from wgpu_train.serve.server import ServerThread, bind
    from wgpu_train.training.config import default_model_dir

    model_dir = default_model_dir()
    model = load_model(model_dir, backend="wgpu", device=str(rt.info.index))
    registry = AdapterRegistry(model, "default")
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in zip(ADAPTERS, _adapters(model_dir, Path(tmp))):
            registry.add(name, folder, PromptStyle())
    scheduler = Scheduler(model, registry, load_tokenizer(model_dir), max_queue=2 * n, max_batch=n)
    scheduler.start()
    server = ServerThread(build_app(scheduler), bind("127.0.0.1", 0)).start()
    port = int(server.url.rsplit(":", 1)[1])
    prompts = _prompts(n)
    mixed = [(ADAPTERS[i % len(ADAPTERS)], p) for i, p in enumerate(prompts)]
    single = [(ADAPTERS[0], p) for p in prompts]
    try:
        _round(port, mixed, 4, stagger_s=0.0)            # warm-up: kernels compiled, the tuner's shapes timed
        _round(port, single, 4, stagger_s=0.0)
        alone = _round(port, mixed, max_tokens, stagger_s=None)
        counters = model.engine.counters
        steps, switches, submits = scheduler.stats["steps"], registry.switches, counters["submits"]
        burst = _round(port, mixed, max_tokens, stagger_s)
        burst.update(steps=scheduler.stats["steps"] - steps, adapter_switches=registry.switches - switches,
                     submits=counters["submits"] - submits)
        steps, submits = scheduler.stats["steps"], counters["submits"]
        one_adapter = _round(port, single, max_tokens, stagger_s)
        one_adapter.update(steps=scheduler.stats["steps"] - steps, submits=counters["submits"] - submits)
    finally:
        server.stop()
        scheduler.close()
    return {"adapter": rt.info.describe(), "model": "embedded, 3 LoRA adapters r=8",
            "adapters_in_one_batch": scheduler.mixed, "requests": n,
            "max_tokens": max_tokens, "stagger_s": stagger_s, "one_at_a_time": alone, "mixed_burst": burst,
            "single_adapter_burst": one_adapter,
            "ttft_p50_vs_alone": round(burst["ttft_p50_s"] / alone["ttft_p50_s"], 2),
            "ttft_p95_vs_alone": round(burst["ttft_p95_s"] / alone["ttft_p50_s"], 2),
            "throughput_vs_one_at_a_time": round(burst["tokens_per_s"] / alone["tokens_per_s"], 2),
            "mixed_vs_single": round(burst["tokens_per_s"] / one_adapter["tokens_per_s"], 2)}
