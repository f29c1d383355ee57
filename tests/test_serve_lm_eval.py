"""lm-evaluation-harness through the server's API: lm_eval's `local-completions` model (log-likelihoods from
echo + logprobs, generations from completions) against `wgpu-train serve` gives the log-likelihoods and the
accuracy that lm_eval's `wgpu-train` model (what `eval --tasks` runs) gives on the same local tasks."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the eval extra")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
pytest.importorskip("tenacity", reason="lm_eval's API models need lm-eval[api]")

from finetune_helpers import WORDS, make_model_dir  # noqa: E402
from serve_helpers import save_adapter  # noqa: E402
from tolerances import assert_close  # noqa: E402
from wgpu_train.cli.main import build_parser  # noqa: E402
from wgpu_train.cli.serve import prepare  # noqa: E402
from wgpu_train.serve.app import build_app  # noqa: E402
from wgpu_train.serve.server import ServerThread  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Nothing here may reach the network: the hub and datasets offline for this module, restored afterwards."""
    import datasets.config
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            patch.setenv(name, "1")
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama with its tokenizer, a random adapter, and a multiple-choice and a generation task over local
    JSONL files."""
    import yaml

    root = tmp_path_factory.mktemp("serve_lm_eval")
    model_dir = make_model_dir(root / "model")
    tasks = root / "tasks"
    tasks.mkdir()
    mc = [{"question": f"after {WORDS[i % 8]} {i}?", "choices": [f"{WORDS[(i + k) % 8]} {i}" for k in range(1, 5)],
           "answer": i % 4} for i in range(10)]
    gen = [{"question": f"after {WORDS[i % 8]} {i}?", "answer": f"{WORDS[(i + 1) % 8]} {i}"} for i in range(6)]
    common = {"dataset_path": "json", "test_split": "test", "doc_to_text": "{{question}}"}
    (tasks / "serve_mc.yaml").write_text(yaml.safe_dump({
        **common, "task": "serve_mc", "output_type": "multiple_choice",
        "dataset_kwargs": {"data_files": {"test": _jsonl(tasks / "mc.jsonl", mc)}}, "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}))
    (tasks / "serve_gen.yaml").write_text(yaml.safe_dump({
        **common, "task": "serve_gen", "output_type": "generate_until",
        "dataset_kwargs": {"data_files": {"test": _jsonl(tasks / "gen.jsonl", gen)}}, "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "exact_match"}],
        "generation_kwargs": {"until": ["z", "P"], "max_gen_toks": 6, "do_sample": False}}))
    return {"model": model_dir, "adapter": save_adapter(model_dir, root / "adapter", 3), "tasks": tasks}


def _evaluate(tiny, model: str, model_args: dict) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import wgpu_train.harness.lm  # noqa: F401 - registers "wgpu-train"

    return simple_evaluate(model=model, model_args=model_args, tasks=["serve_mc", "serve_gen"], batch_size=2,
                           log_samples=True,
                           task_manager=TaskManager(include_path=str(tiny["tasks"]), include_defaults=False))


def test_local_completions_through_the_server_equals_eval_tasks(tiny, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "")
    args = build_parser().parse_args(["serve", "--model", str(tiny["model"]), "--adapter", f"mine={tiny['adapter']}",
                                      "--backend", "numpy", "--port", "0"])
    scheduler, sock = prepare(args)
    scheduler.start()
    thread = ServerThread(build_app(scheduler), sock).start()
    try:
        served = _evaluate(tiny, "local-completions", {
            "base_url": thread.url + "/v1/completions", "model": "mine", "tokenizer_backend": "huggingface",
            "tokenizer": str(tiny["model"]), "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1,
            "max_length": 128})
    finally:
        thread.stop()
        scheduler.close()
    ours = _evaluate(tiny, "wgpu-train", {"pretrained": str(tiny["model"]), "peft": str(tiny["adapter"]),
                                          "backend": "numpy"})
    mine, theirs = ours["samples"]["serve_mc"], served["samples"]["serve_mc"]
    assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in theirs] and len(mine) == 10
    ll_ours = np.array([r[0][0] for s in mine for r in s["resps"]])
    ll_served = np.array([r[0][0] for s in theirs for r in s["resps"]])
    assert_close(ll_served, ll_ours, "harness_loglikelihood", "serve_mc log-likelihoods through the API")
    assert [r[0][1] for s in theirs for r in s["resps"]] == [r[0][1] for s in mine for r in s["resps"]]   # greedy
    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"]["serve_mc"][metric] == ours["results"]["serve_mc"][metric], metric
    assert ([s["resps"] for s in served["samples"]["serve_gen"]] ==
            [s["resps"] for s in ours["samples"]["serve_gen"]])
    assert served["results"]["serve_gen"]["exact_match,none"] == ours["results"]["serve_gen"]["exact_match,none"]
