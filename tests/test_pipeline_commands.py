"""generate, eval, chat and serve through pipeline stages (--pipeline-stages, distributed/pipeline_model.py): the
embedded default through 2 Ray actors prints one process's answer; in this process (LocalStages, the Ray actors'
oracle), with an adapter, chat's answers, eval's numbers and a server switching two adapters one at a time equal
one process's; the stages closed however the command ends; bad input, and Ray missing, in one line."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune_helpers import one_line_error
from serve_helpers import save_adapter
from wgpu_train.cli.main import main
from wgpu_train.distributed import pipeline_model
from wgpu_train.training.config import default_data_dir, default_model_dir

ASK = ["--backend", "numpy", "--max-new-tokens", "6"]
QUESTION = "Reverse the order of these words: kiwi train"


@pytest.fixture
def in_process(monkeypatch):
    """The commands' stages in this process (LocalStages) instead of Ray actors; the stages made, in order."""
    made = []

    def local_runner(*args, **kw):
        runner = real(*args, **{**kw, "local": True})
        made.append(runner)
        return runner

    real = pipeline_model.stage_runner
    monkeypatch.setattr(pipeline_model, "stage_runner", local_runner)
    return made


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A random LoRA of the embedded default (B nonzero: it changes the answers)."""
    return save_adapter(default_model_dir(), tmp_path_factory.mktemp("adapter") / "a", seed=3)


def _run(capsys, argv) -> tuple:
    """(exit code, stdout, stderr) of the CLI's main in this process."""
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_through_two_ray_actors_prints_one_process_answer(capsys):
    argv = ["generate", "--prompt", QUESTION, *ASK]
    code, alone, _ = _run(capsys, argv)
    assert code == 0 and alone.strip()              # the embedded model answers something
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "wgpu_train.cli", *argv, "--pipeline-stages", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == alone
    assert "pipeline: 2 stages (layers 0-1,2-3) as Ray actors" in done.stderr


@pytest.mark.parametrize("split", [["--pipeline-stages", "2"], ["--stage-layers", "0-0,1-3"],
                                   ["--pipeline-stages", "3", "--kv-dtype", "bfloat16"]])
def test_generate_with_an_adapter_through_stages_equals_one_process(capsys, in_process, adapter, split):
    kv = split[split.index("--kv-dtype"):] if "--kv-dtype" in split else []
    argv = ["generate", "--prompt", QUESTION, "--adapter-path", str(adapter), *ASK, *kv]
    code, alone, _ = _run(capsys, argv)
    _, base, _ = _run(capsys, ["generate", "--prompt", QUESTION, *ASK, *kv])
    assert code == 0 and alone != base              # the adapter changes the answer
    code, staged, err = _run(capsys, argv + split)
    assert code == 0 and staged == alone, err
    assert len(in_process) == 1 and in_process[0].stages == []        # closed at the end
    assert f"pipeline: {split[1].count(',') + 1 if split[0] == '--stage-layers' else int(split[1])} stages" in err


def test_chat_through_stages_answers_as_one_process(capsys, in_process, monkeypatch, adapter):
    turns = "Reverse the order of these words: red fox\nReverse the order of these words: moon leaf cat\n"
    answers = []
    for split in ([], ["--pipeline-stages", "2"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO(turns))
        code, out, err = _run(capsys, ["chat", "--adapter-path", str(adapter), *ASK, *split])
        assert code == 0, err
        answers.append(out)
    assert answers[0].count("\n") == 2 and answers[1] == answers[0]
    assert in_process[0].stages == []


def test_eval_through_stages_gives_one_process_numbers(capsys, in_process, tmp_path, adapter):
    data = tmp_path / "test.jsonl"
    data.write_text("".join((default_data_dir() / "test.jsonl").read_text().splitlines(keepends=True)[:6]))
    argv = ["eval", "--adapter-path", str(adapter), "--data", str(data), "--json", "--backend", "numpy",
            "--batch-size", "4", "--max-new-tokens", "8"]
    code, alone, _ = _run(capsys, argv)
    code_staged, staged, err = _run(capsys, argv + ["--pipeline-stages", "2", "--stage-layers", "0-2,3-3"])
    assert code == code_staged == 0, err
    alone, staged = json.loads(alone), json.loads(staged)
    assert alone["samples"] == 6 and alone["exact_match_n"] == 6 and alone["loss"] > 0
    assert staged == alone


@pytest.mark.parametrize("argv, match", [
    (["generate", "--prompt", "hi", "--pipeline-stages", "9"], "more than the model's 4 layers"),
    (["generate", "--prompt", "hi", "--stage-layers", "0-1,3-3"], "layer 2 is in no stage"),
    (["generate", "--prompt", "hi", "--pipeline-stages", "2", "--stage-layers", "0-0,1-1,2-3"],
     "names 3 stages, --pipeline-stages 2"),
    (["generate", "--prompt", "hi", "--ray-address", "auto"], "--ray-address joins a Ray cluster"),
    (["generate", "--prompt", "hi", "--pipeline-stages", "2", "--device", "a,b,c"], "lists 3 devices for 2"),
    (["eval", "--tasks", "hellaswag", "--pipeline-stages", "2"], "eval --tasks loads the model in one process"),
    (["eval", "--objective", "dpo", "--pipeline-stages", "2"], "eval --objective loads the model in one process"),
])
def test_bad_stage_options_are_one_line(capsys, in_process, argv, match):
    one_line_error(capsys, [*argv, "--backend", "numpy"], match)
    assert in_process == []             # refused before any stage loads


def test_a_mistake_after_the_stages_load_closes_them(capsys, in_process):
    one_line_error(capsys, ["generate", "--prompt", "red " * 300, "--backend", "numpy", "--no-chat-template",
                            "--pipeline-stages", "2"], "no room for an answer", after_log=True)
    assert len(in_process) == 1 and in_process[0].stages == []


# ---- serve: the base and two adapters switched one at a time on the stages ----------------------------------

def test_serve_through_stages_switches_adapters_one_at_a_time(in_process, adapter, tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from serve_helpers import Reference, ask
    from types import SimpleNamespace
    from wgpu_train.cli.adapter_settings import close_stages
    from wgpu_train.cli.main import build_parser
    from wgpu_train.cli.serve import prepare
    from wgpu_train.serve.app import build_app
    from wgpu_train.serve.server import ServerThread

    other = save_adapter(default_model_dir(), tmp_path / "b", seed=5)
    args = build_parser().parse_args(["serve", "--adapter", f"a={adapter}", "--adapter", f"b={other}",
                                      "--backend", "numpy", "--port", "0", "--pipeline-stages", "2"])
    scheduler, sock = prepare(args)
    scheduler.start()
    thread = ServerThread(build_app(scheduler, None), sock).start()
    try:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=60)
        ref = Reference(SimpleNamespace(model=default_model_dir(), a=adapter, b=other))
        for name, served in (("a", "a"), ("b", "b"), ("base", "default")):
            for kind in ("chat", "text"):
                prompt = QUESTION if kind == "chat" else "reverse: red fox moon ->"
                want = (ref.chat if kind == "chat" else ref.text)(name, prompt, 6)
                assert ask(client, kind, served, prompt, 6, temperature=0) == want, (name, kind)
        assert not scheduler.mixed and scheduler.registry.switches >= 2      # no bank: switched
    finally:
        thread.stop()
        scheduler.close()
        close_stages(scheduler.model)
    assert in_process[0].stages == []


def test_without_ray_stages_are_one_line(capsys, monkeypatch):
    from wgpu_train.distributed import pipeline_ray

    monkeypatch.setattr(pipeline_ray, "ray", None)
    one_line_error(capsys, ["generate", "--prompt", "hi", "--backend", "numpy", "--pipeline-stages", "2"],
                   "Ray is not installed: pip install 'wgpu-train[pipeline]'")
