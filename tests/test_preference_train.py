"""Preference runs end to end (training/preference_trainer.py): precomputed reference log-probabilities equal the
ones scored with every step, resume is bit-exact, gradient accumulation equals one batch, DoRA and LoRA+ train,
the command line and its one-line refusals of bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest

from wgpu_train.adapters.files import read_adapter
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.training.config import TrainConfig
from wgpu_train.training.preference_trainer import REFERENCE_FILE, PreferenceTrainer

from finetune_helpers import make_model_dir, one_line_error, write_jsonl
from tolerances import assert_close

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]


def pairs(n: int, offset: int = 0) -> list[dict]:
    return [{"prompt": f"after {WORDS[i % 8]} {i}?", "chosen": f" {WORDS[(i + 1) % 8]} {i}",
             "rejected": f" {WORDS[(i + 3) % 8]} {i}"} for i in range(offset, offset + n)]


def unpaired(n: int) -> list[dict]:
    return [{"prompt": p["prompt"], "completion": p["chosen"] if i % 3 else p["rejected"], "label": bool(i % 3)}
            for i, p in enumerate(pairs(n))]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref_train")
    model = make_model_dir(root / "model")
    for name, rows in (("pairs", pairs(12)), ("valid", pairs(4, 100)), ("unpaired", unpaired(12))):
        (root / name).mkdir()
        write_jsonl(root / name / "train.jsonl", rows)
    write_jsonl(root / "pairs" / "valid.jsonl", pairs(4, 100))
    (root / "pairs_sft").mkdir()
    write_jsonl(root / "pairs_sft" / "train.jsonl", [{"prompt": p["prompt"], "completion": p["chosen"]}
                                                     for p in pairs(12)])
    (root / "seen").mkdir()         # validation pairs drawn from the training pairs: what training must improve
    write_jsonl(root / "seen" / "train.jsonl", pairs(8))
    write_jsonl(root / "seen" / "valid.jsonl", pairs(4))
    return root, model


def config(workspace, out, data="pairs", **kw) -> TrainConfig:
    root, model = workspace
    base = dict(model=str(model), data=str(root / data), out=str(out), backend="numpy", no_progress=True, lr=1e-2,
                eval_generate=False, log_every=1, objective="dpo", batch_size=2, max_steps=4, valid_split=0.0,
                lr_schedule="constant")
    base.update(kw)
    return TrainConfig(**base)


def adapter(folder):
    return read_adapter(folder)[1]


def metric_rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("objective, data", [("dpo", "pairs"), ("kto", "unpaired")])
def test_precomputed_reference_equals_the_one_scored_each_step(workspace, tmp_path, objective, data):
    """--precompute-ref-log-probs (kept in the run folder) gives the losses and adapter of the adapter switched
    off at every step, up to the summation order of other batch shapes."""
    live = finetune(config(workspace, tmp_path / "live", data=data, objective=objective))
    pre = finetune(config(workspace, tmp_path / "pre", data=data, objective=objective, precompute_ref_log_probs=True))
    assert (live["objective"]["reference"], pre["objective"]["reference"]) == ("adapter off", "precomputed")
    assert (tmp_path / "pre" / REFERENCE_FILE).is_file() and not (tmp_path / "live" / REFERENCE_FILE).exists()
    a, b = metric_rows(tmp_path / "live"), metric_rows(tmp_path / "pre")
    assert_close([r["loss"] for r in b], [r["loss"] for r in a], "preference_paths")
    for k, v in adapter(tmp_path / "live").items():
        assert_close(adapter(tmp_path / "pre")[k], v, "preference_paths", k)


@pytest.mark.parametrize("kw", [dict(), dict(precompute_ref_log_probs=True), dict(objective="kto", data="unpaired"),
                                dict(objective="orpo", lora_dropout=0.0)])
def test_resume_is_bit_exact(workspace, tmp_path, kw):
    full = finetune(config(workspace, tmp_path / "full", save_every=2, keep_checkpoints=0, **kw))
    resumed = finetune(config(workspace, tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoints" /
                                                                            "step-000002"), **kw))
    assert resumed["steps"] == full["steps"] == 4
    a, b = adapter(tmp_path / "full"), adapter(tmp_path / "resumed")
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    steps = [r for r in metric_rows(tmp_path / "resumed") if "grad_norm" in r]
    full_steps = [r for r in metric_rows(tmp_path / "full") if "grad_norm" in r]
    assert [r["loss"] for r in steps] == [r["loss"] for r in full_steps][2:]


def test_resume_keeps_the_starting_adapter_as_reference(workspace, tmp_path):
    """A run that continues an adapter (--adapter-path) scores against that adapter, also after a resume."""
    finetune(config(workspace, tmp_path / "start", objective="sft", max_steps=2, data="pairs_sft"))
    kw = dict(adapter_path=str(tmp_path / "start"), keep_checkpoints=0)
    full = finetune(config(workspace, tmp_path / "full", save_every=2, **kw))
    assert full["objective"]["reference"] == "starting adapter"
    kw.pop("adapter_path")
    resumed = finetune(config(workspace, tmp_path / "resumed",
                              resume=str(tmp_path / "full" / "checkpoints" / "step-000002"), **kw))
    assert resumed["objective"]["reference"] == "starting adapter"
    a, b = adapter(tmp_path / "full"), adapter(tmp_path / "resumed")
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_gradient_accumulation_equals_one_batch(workspace, tmp_path):
    """Two micro-batches of 2 pairs make the step of one batch of 4 (the loss is the mean over the step's pairs)."""
    one = finetune(config(workspace, tmp_path / "one", batch_size=4, max_steps=2))
    two = finetune(config(workspace, tmp_path / "two", batch_size=2, grad_accum=2, max_steps=2))
    assert one["steps"] == two["steps"] == 2
    for k, v in adapter(tmp_path / "one").items():
        assert_close(adapter(tmp_path / "two")[k], v, "preference_paths", k)


@pytest.mark.parametrize("kw", [dict(dora=True), dict(loraplus_lr_ratio=8.0), dict(gradient_checkpointing=True),
                                dict(method="full", precompute_ref_log_probs=True, lr=1e-3)])
def test_variants_train_and_lower_the_loss(workspace, tmp_path, kw):
    summary = finetune(config(workspace, tmp_path / "run", max_steps=6, data="seen", **kw))
    steps = [r for r in metric_rows(tmp_path / "run") if "grad_norm" in r]
    assert len(steps) == 6      # each step draws other pairs: its training loss is noisy; the validation pairs
    assert summary["valid_loss_after"] < summary["valid_loss_before"] - 0.01, summary["valid_loss_after"]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert key in steps[0], key


def test_gpu_engine_trains_as_the_numpy_engine(workspace, tmp_path, default_rt):
    runs = {b: finetune(config(workspace, tmp_path / b, backend=b, max_steps=3)) for b in ("numpy", "wgpu")}
    for k, v in adapter(tmp_path / "numpy").items():
        assert_close(adapter(tmp_path / "wgpu")[k], v, "gpu_params_after_steps_lr1e-2", k)
    assert runs["wgpu"]["backend"] == "wgpu"


def test_valid_metrics_and_summary(workspace, tmp_path):
    summary = finetune(config(workspace, tmp_path / "run", max_steps=4))
    valid = [r for r in metric_rows(tmp_path / "run") if r.get("split") == "valid"]
    assert len(valid) == 2 and valid[0]["rewards/accuracies"] == 0.0       # the policy starts as its reference
    assert summary["objective"]["reward_accuracy"]["after"] == valid[-1]["rewards/accuracies"]
    assert summary["objective"]["name"] == "dpo" and summary["n_train"] == 12


@pytest.mark.parametrize("argv, match", [
    (["--objective", "dpo", "--data", "{root}/unpaired"], "unpaired"),
    (["--objective", "kto", "--data", "{root}/unpaired", "--ref-adapter", "{root}/nope"], "nope"),
    (["--objective", "simpo", "--ref-adapter", "{root}/model"], "needs no reference model"),
    (["--objective", "orpo", "--precompute-ref-log-probs"], "needs no reference model"),
    (["--objective", "dpo", "--method", "full"], "needs --precompute-ref-log-probs"),
    (["--objective", "dpo", "--pack"], "leave out --pack"),
    (["--objective", "dpo", "--dpo-loss", "sigmoid", "--label-smoothing", "0.1"], "label_smoothing applies to"),
    (["--objective", "ppo"], "invalid choice"),
    (["--ref-adapter", "{root}/model"], "give --objective"),
    (["--truncation-mode", "keep_end"], "give --objective"),
    (["--beta", "0.3"], "give --objective"),
    (["--objective", "kto", "--data", "{root}/unpaired", "--batch-size", "1"], "at least 2"),
    (["--objective", "kto", "--data", "{root}/unpaired", "--truncation-mode", "keep_end"], "keep_start only"),
])
def test_bad_input_is_one_line(workspace, capsys, tmp_path, argv, match):
    root, model = workspace
    base = ["finetune", "--model", str(model), "--data", str(root / "pairs"), "--backend", "numpy", "--out",
            str(tmp_path / "out"), "--max-steps", "1"]
    one_line_error(capsys, base + [a.format(root=root) for a in argv], match)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("objective, data, seq", [("dpo", "pairs", 3), ("kto", "unpaired", 2)])
def test_every_pair_truncated_away_is_one_line(workspace, capsys, tmp_path, objective, data, seq):
    root, model = workspace
    one_line_error(capsys, ["finetune", "--model", str(model), "--data", str(root / data), "--backend", "numpy",
                            "--objective", objective, "--max-seq-len", str(seq), "--out", str(tmp_path / "out")],
                   "left after tokenization", after_log=True)


def test_kto_labels_are_checked_after_truncation(workspace, capsys, tmp_path):
    """Truncation that drops every undesirable example (their prompts fill --max-seq-len) is refused."""
    root, model = workspace
    rows = [dict(r, prompt=r["prompt"] + " please" * 30) if not r["label"] else r for r in unpaired(9)]
    (tmp_path / "long").mkdir()
    write_jsonl(tmp_path / "long" / "train.jsonl", rows)
    one_line_error(capsys, ["finetune", "--model", str(model), "--data", str(tmp_path / "long"), "--backend",
                            "numpy", "--objective", "kto", "--max-seq-len", "24", "--out", str(tmp_path / "out")],
                   "desirable", after_log=True)


def test_resume_refuses_another_objective_setting(workspace, tmp_path):
    from wgpu_train.errors import ConfigError

    finetune(config(workspace, tmp_path / "run", save_every=2, keep_checkpoints=0))
    with pytest.raises(ConfigError, match=r"beta 0.1 -> 0.5"):
        finetune(config(workspace, tmp_path / "run", beta=0.5, resume=str(tmp_path / "run" / "checkpoints" /
                                                                              "step-000002")))


def test_kto_needs_both_labels(workspace, capsys, tmp_path):
    root, model = workspace
    (tmp_path / "one").mkdir()
    write_jsonl(tmp_path / "one" / "train.jsonl", [dict(r, label=True) for r in unpaired(6)])
    one_line_error(capsys, ["finetune", "--model", str(model), "--data", str(tmp_path / "one"), "--backend", "numpy",
                            "--objective", "kto", "--out", str(tmp_path / "out")], "desirable")


def test_command_line_run(workspace, tmp_path, capsys):
    from wgpu_train.cli.main import main

    root, model = workspace
    code = main(["finetune", "--model", str(model), "--data", str(root / "pairs"), "--backend", "numpy",
                 "--objective", "simpo", "--beta", "2.0", "--max-steps", "3", "--out", str(tmp_path / "out"),
                 "--no-progress", "--batch-size", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "valid simpo loss" in out and "reward accuracy" in out, out
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
