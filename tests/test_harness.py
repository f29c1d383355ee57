"""`wgpu-train eval --tasks`: the "wgpu-train" LM of lm_eval's registry against lm_eval's own Hugging Face backend
(hf) on a tiny model, with and without a PEFT adapter, on both engines, over tasks defined here from local files
(multiple choice, generate_until, loglikelihood_rolling); and the command line's results JSON and one-line errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the eval extra")
pytest.importorskip("peft")

from finetune_helpers import WORDS, build_tokenizer, one_line_error  # noqa: E402
from tiny_models import build_model, save_model  # noqa: E402
from tolerances import assert_close  # noqa: E402
from wgpu_train.cli.main import main  # noqa: E402

TASKS = ["tiny_mc", "tiny_gen", "tiny_roll"]
MAX_LENGTH = 24          # short enough that few-shot contexts are cut from the left and rolling windows roll
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Nothing here may reach the network (lm_eval resolves the tasks' data through datasets and the hub client):
    HF_DATASETS_OFFLINE and HF_HUB_OFFLINE for this module's tests and the processes they start, and the values
    those libraries read from the environment when first imported, all restored afterwards."""
    import datasets.config
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            patch.setenv(name, "1")
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _task(folder, name, output_type, files, **fields):
    import yaml

    config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": files}, "test_split": "test",
              "output_type": output_type, **fields}
    if "train" in files:
        config["training_split"] = "train"
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"model", "adapter", "tasks"}: a random Llama with its BPE tokenizer (ChatML template), a PEFT LoRA adapter
    with nonzero B, and a folder of task YAMLs over local JSONL files."""
    import peft

    root = tmp_path_factory.mktemp("harness")
    model_dir = root / "model"
    vocab = build_tokenizer(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    save_model(build_model("llama", seed=3, vocab_size=vocab), model_dir)
    lora = peft.get_peft_model(build_model("llama", seed=3, vocab_size=vocab),
                               peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                               init_lora_weights=False))
    lora.peft_config["default"].base_model_name_or_path = str(model_dir)
    lora.save_pretrained(root / "adapter")

    tasks = root / "tasks"
    tasks.mkdir()
    mc = [{"question": f"after {WORDS[i % 8]} {i}?", "choices": [f"{WORDS[(i + k) % 8]} {i}" for k in range(1, 5)],
           "answer": i % 4} for i in range(10)]
    _task(tasks, "tiny_mc", "multiple_choice",
          {"test": _jsonl(tasks / "mc_test.jsonl", mc[:8]), "train": _jsonl(tasks / "mc_train.jsonl", mc[8:])},
          doc_to_text="{{question}}", doc_to_choice="{{choices}}", doc_to_target="{{answer}}", num_fewshot=1,
          metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}])
    gen = [{"question": f"after {WORDS[i % 8]} {i}?", "answer": f"{WORDS[(i + 1) % 8]} {i}"} for i in range(8)]
    # "z" and "P" come up in this random model's answers: some rows stop at a string, the others at max_gen_toks
    _task(tasks, "tiny_gen", "generate_until",
          {"test": _jsonl(tasks / "gen_test.jsonl", gen[:6]), "train": _jsonl(tasks / "gen_train.jsonl", gen[6:])},
          doc_to_text="{{question}}", doc_to_target="{{answer}}", metric_list=[{"metric": "exact_match"}],
          generation_kwargs={"until": ["z", "P"], "max_gen_toks": 6, "do_sample": False})
    text = [{"text": " ".join(f"after {WORDS[(i + j) % 8]} {j}? {WORDS[(i + j + 1) % 8]} {j}" for j in range(i + 2))}
            for i in range(4)]
    _task(tasks, "tiny_roll", "loglikelihood_rolling", {"test": _jsonl(tasks / "roll_test.jsonl", text)},
          doc_to_text="", doc_to_target="{{text}}", metric_list=[{"metric": "word_perplexity"},
                                                                 {"metric": "bits_per_byte"}])
    # a hub dataset that is in no cache here
    _task(tasks, "tiny_offline", "multiple_choice", {"test": "test.jsonl"}, dataset_path="nobody/no-such-dataset",
          doc_to_text="{{question}}", doc_to_choice="{{choices}}", doc_to_target="{{answer}}")
    return {"model": model_dir, "adapter": root / "adapter", "tasks": tasks}


def _evaluate(tiny, model: str, model_args: dict, tasks=TASKS, chat: bool = False, limit=None,
              max_length=MAX_LENGTH, num_fewshot=None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import wgpu_train.harness.lm  # noqa: F401 - registers "wgpu-train"

    return simple_evaluate(model=model, model_args={**model_args, **({"max_length": max_length} if max_length else {})},
                           tasks=tasks, batch_size=3, apply_chat_template=chat, log_samples=True, limit=limit,
                           num_fewshot=num_fewshot,
                           task_manager=TaskManager(include_path=str(tiny["tasks"]), include_defaults=False))


_HF = {}


def _hf(tiny, adapter: bool, chat: bool = False, tasks=TASKS, limit=None, max_length=MAX_LENGTH) -> dict:
    """lm_eval's hf backend on the same folders (float32 on the CPU), once per setting."""
    key = (adapter, chat, tuple(tasks), limit, max_length)
    if key not in _HF:
        args = {"pretrained": str(tiny["model"]), "dtype": "float32", "device": "cpu"}
        _HF[key] = _evaluate(tiny, "hf", {**args, **({"peft": str(tiny["adapter"])} if adapter else {})},
                             tasks, chat, limit, max_length)
    return _HF[key]


def _compare(ours: dict, hf: dict, tasks=TASKS) -> float:
    """Assert our answers equal hf's (log-likelihoods within their tolerance); the largest log-likelihood difference."""
    worst = 0.0
    for task in tasks:
        mine, theirs = ours["samples"][task], hf["samples"][task]
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in theirs]
        if task == "tiny_gen":
            assert [s["resps"] for s in mine] == [s["resps"] for s in theirs]
        else:
            ll_mine = np.array([r[0][0] if task == "tiny_mc" else r[0] for s in mine for r in s["resps"]])
            ll_theirs = np.array([r[0][0] if task == "tiny_mc" else r[0] for s in theirs for r in s["resps"]])
            assert_close(ll_mine, ll_theirs, "harness_loglikelihood", f"{task} log-likelihoods")
            worst = max(worst, float(np.abs(ll_mine - ll_theirs).max()))
            if task == "tiny_mc":
                assert [r[0][1] for s in mine for r in s["resps"]] == [r[0][1] for s in theirs for r in s["resps"]]
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in hf["results"][task]:
                assert ours["results"][task][metric] == hf["results"][task][metric], (task, metric)
    print(f"max |log-likelihood - hf's|: {worst:.2e}")
    return worst


@pytest.mark.parametrize("adapter", [False, True], ids=["base", "adapter"])
def test_numpy_engine_matches_lm_evals_hf_backend(tiny, adapter):
    args = {"pretrained": str(tiny["model"]), "backend": "numpy"}
    ours = _evaluate(tiny, "wgpu-train", {**args, **({"peft": str(tiny["adapter"])} if adapter else {})})
    _compare(ours, _hf(tiny, adapter))


@pytest.mark.parametrize("adapter", [False, True], ids=["base", "adapter"])
def test_wgpu_engine_matches_lm_evals_hf_backend(tiny, adapter, rt):
    args = {"pretrained": str(tiny["model"]), "backend": "wgpu", "device": str(rt.info.index)}
    ours = _evaluate(tiny, "wgpu-train", {**args, **({"peft": str(tiny["adapter"])} if adapter else {})})
    _compare(ours, _hf(tiny, adapter))


def test_a_tokenizer_adding_bos_matches_lm_evals_hf_backend(tiny, tmp_path):
    """A Llama-like tokenizer whose post-processor adds <s>: our log-likelihoods of the multiple-choice task (an
    empty few-shot context too) equal lm_eval's hf backend's, which encodes the same way (numpy engine)."""
    model_dir = tmp_path / "bos_model"
    vocab = build_tokenizer(model_dir, bos=True)
    save_model(build_model("llama", seed=4, vocab_size=vocab), model_dir)
    for shots in (0, 1):
        args = {"pretrained": str(model_dir)}
        ours = _evaluate(tiny, "wgpu-train", {**args, "backend": "numpy"}, ["tiny_mc"], num_fewshot=shots)
        hf = _evaluate(tiny, "hf", {**args, "dtype": "float32", "device": "cpu"}, ["tiny_mc"], num_fewshot=shots)
        _compare(ours, hf, ["tiny_mc"])


def test_chat_template_prompts_match_lm_evals_hf_backend(tiny):
    tasks = ["tiny_mc", "tiny_gen"]
    ours = _evaluate(tiny, "wgpu-train", {"pretrained": str(tiny["model"]), "backend": "numpy",
                                          "peft": str(tiny["adapter"])}, tasks, chat=True)
    assert "<|im_start|>" in str(ours["samples"]["tiny_mc"][0]["arguments"])
    _compare(ours, _hf(tiny, True, chat=True, tasks=tasks), tasks)


def test_scoring_reads_each_input_once_in_padded_buckets(tiny, monkeypatch):
    from wgpu_train.engines.loading import load_model
    from wgpu_train.errors import ConfigError
    from wgpu_train.harness.scoring import continuation_scores

    model = load_model(tiny["model"], backend="numpy")
    shapes, logits = [], model.logits
    monkeypatch.setattr(model, "logits", lambda ids, mask: shapes.append(ids.shape) or logits(ids, mask))
    context = [5, 9, 11]
    pairs = [(context, [k]) for k in (20, 30, 40)] + [(context + [20], [30, 31])]
    scores = continuation_scores(model, pairs, batch_size=1, max_length=24)
    assert shapes == [(1, 8), (1, 8)]          # the three one-token answers share their input; 8 = PAD_MULTIPLE
    batched = continuation_scores(model, pairs, batch_size=4, max_length=24)
    assert shapes[2:] == [(2, 8)] and [g for _, g in batched] == [g for _, g in scores]
    assert_close([s for s, _ in batched], [s for s, _ in scores], "batched_logits_f32", "batch 4 against batch 1")
    full = logits([context + [20, 30]]).astype(np.float64)[0]                             # (5, V)
    log_probs = full - np.log(np.exp(full).sum(axis=-1, keepdims=True))
    expected = [log_probs[2, k] for k in (20, 30, 40)] + [log_probs[3, 30] + log_probs[4, 31]]
    assert_close([s for s, _ in scores], expected, "batched_logits_f32", "log-likelihoods")
    assert [g for _, g in scores] == [bool(full[2].argmax() == k) for k in (20, 30, 40)] + \
        [bool(full[3].argmax() == 30 and full[4].argmax() == 31)]
    with pytest.raises(ConfigError, match="a continuation of 5 tokens cannot be scored within the model's 4"):
        continuation_scores(model, [(context, [1, 2, 3, 4, 5])], batch_size=1, max_length=4)


def _generate(lm, kwargs: dict, n: int = 6) -> list[str]:
    from lm_eval.api.instance import Instance

    return lm.generate_until([Instance("generate_until", {}, (f"after {WORDS[i % 8]} {i}?", kwargs), i)
                              for i in range(n)], disable_tqdm=True)


def test_rows_end_at_their_stop_string_and_sampling_is_seeded(tiny, monkeypatch):
    from wgpu_train.harness.lm import WgpuTrainLM

    lm = WgpuTrainLM(pretrained=str(tiny["model"]), backend="numpy", batch_size=4)
    made = []                                   # every row's generated ids
    generate_batch = lm.model.generate_batch

    def recorded(*args, **kwargs):
        rows = generate_batch(*args, **kwargs)
        made.extend(rows)
        return rows

    monkeypatch.setattr(lm.model, "generate_batch", recorded)
    until = ["z", "P"]
    greedy = _generate(lm, {"until": until, "max_gen_toks": 12})
    decode = lm.tokenizer.decode
    # a row's tokens end right after the first stop string appears in its text (nothing generated past it)
    stopped = [ids for ids in made if any(s in decode(ids, skip_special_tokens=False) for s in until)]
    assert stopped and all(not any(s in decode(ids[:-1], skip_special_tokens=False) for s in until) for ids in stopped)
    assert all(len(ids) == 12 for ids in made if ids not in stopped and ids[-1] not in lm.tokenizer.stop_token_ids)
    assert all(not any(s in text for s in until) for text in greedy)
    sampled = {"until": until, "max_gen_toks": 12, "do_sample": True, "temperature": 1.5}
    first = _generate(lm, sampled)
    assert first == _generate(lm, sampled) and first != greedy


# ---- the command line ---------------------------------------------------------------------------------------

def _cli(tiny, *extra) -> list[str]:
    return ["eval", "--model", str(tiny["model"]), "--backend", "numpy", "--include-path", str(tiny["tasks"]), *extra]


def test_cli_prints_the_table_and_writes_lm_evals_results_json(tiny, tmp_path, capsys):
    out = tmp_path / "results"
    assert main(_cli(tiny, "--tasks", "tiny_mc,tiny_gen", "--adapter-path", str(tiny["adapter"]), "--limit", "4",
                     "--batch-size", "2", "--output-path", str(out))) == 0
    table = capsys.readouterr().out
    assert "|tiny_mc " in table and "|acc " in table and "|tiny_gen" in table
    written = list(out.rglob("results_*.json"))
    assert len(written) == 1
    results = json.loads(written[0].read_text())
    assert results["config"]["model"] == "wgpu-train" and results["config"]["batch_size"] == 2
    assert results["model_name"] == str(tiny["adapter"])
    assert results["n-samples"]["tiny_mc"] == {"original": 8, "effective": 4}
    hf = _hf(tiny, True, tasks=["tiny_mc", "tiny_gen"], limit=4, max_length=None)   # the model's 128 positions
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_mc", "acc_norm,none"), ("tiny_gen", "exact_match,none")):
        assert results["results"][task][metric] == hf["results"][task][metric]


def test_unknown_task_gets_lm_evals_close_names(tiny, capsys):
    one_line_error(capsys, _cli(tiny, "--tasks", "tiny_mcq"), "lm_eval has no task 'tiny_mcq' (close names: tiny_mc")
    one_line_error(capsys, _cli(tiny, "--tasks", "hellaswg"), "hellaswag")


def test_a_dataset_missing_offline_is_one_line(tiny, capsys):
    one_line_error(capsys, _cli(tiny, "--tasks", "tiny_offline"), "task tiny_offline: its data cannot be loaded")


def test_data_and_tasks_together_are_refused(tiny, capsys):
    one_line_error(capsys, _cli(tiny, "--tasks", "tiny_mc", "--data", str(tiny["tasks"] / "mc_test.jsonl")),
                   "--data and --tasks are two different evaluations")


def test_harness_options_without_tasks_are_refused(tiny, capsys):
    """lm_eval's options given without --tasks (or with --tasks naming nothing) are one line, not ignored."""
    plain = ["eval", "--model", str(tiny["model"]), "--backend", "numpy"]
    for extra in (["--num-fewshot", "0"], ["--limit", "2"], ["--apply-chat-template"],
                  ["--output-path", str(tiny["tasks"] / "out")], ["--include-path", str(tiny["tasks"])]):
        one_line_error(capsys, plain + extra, f"{extra[0]} applies to lm-evaluation-harness tasks")
    one_line_error(capsys, plain + ["--tasks", ""], "--tasks names no task")
    one_line_error(capsys, plain + ["--tasks", " , "], "--tasks names no task")


@pytest.mark.parametrize("missing", ["lm_eval", "datasets"])
def test_tasks_without_the_extra_name_it(tiny, missing):
    """Without lm_eval, or without datasets (which harness/run.py imports before lm_eval), --tasks says which
    extra to install (one line, exit 2)."""
    code = (f"import sys; sys.modules[{missing!r}] = None; from wgpu_train.cli.main import main; "
            f"sys.exit(main({_cli(tiny, '--tasks', 'tiny_mc')!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == (f"error: --tasks runs lm-evaluation-harness, which is not installed (no module {missing}): "
                        f"pip install 'wgpu-train[eval]'")


def test_no_git_noise_and_a_results_folder_named_after_the_adapter(tiny, tmp_path, monkeypatch, capfd):
    """Run outside any git repository with the adapter named by a relative path (../adapter): git's
    `fatal: not a git repository` (lm_eval records the working directory's commit) does not reach stderr, and the
    results JSON goes into a folder named after the adapter's folder, not `..__adapter`."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))      # no repository above it counts either
    relative = os.path.relpath(tiny["adapter"], work)
    assert relative.startswith("..")
    capfd.readouterr()
    assert main(_cli(tiny, "--tasks", "tiny_mc", "--adapter-path", relative, "--limit", "2",
                     "--output-path", "results")) == 0
    err = capfd.readouterr().err
    assert "not a git repository" not in err and "results JSON written under results" in err, err
    written = list((work / "results").rglob("results_*.json"))
    assert [p.parent.relative_to(work / "results").as_posix() for p in written] == [tiny["adapter"].name]
    assert json.loads(written[0].read_text())["git_hash"] is None
