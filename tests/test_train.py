"""Tests of the trainer on the NumPy engine: learning, schedules, gradient accumulation, resume equality,
atomic and rotated checkpoints, Ctrl-C, early stopping, output files, configuration errors and evaluation;
gradient checkpointing on the wgpu engine."""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import wgpu_train

from conftest import require_adapter
from finetune_helpers import folder_state, make_data_dir, make_model_dir, write_jsonl
from wgpu_train.training import checkpoint as checkpoint_mod
from wgpu_train.errors import ConfigError, DataError, ModelFileError, WgpuTrainError
from wgpu_train.training.evaluate import exact_match, generation_prompt
from wgpu_train.adapters.files import read_adapter
from wgpu_train.formats.safetensors import read_safetensors
from wgpu_train.training.schedule import LRSchedule
from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.engines.loading import load_model
from wgpu_train.training.checkpoint import find_checkpoint, list_checkpoints
from wgpu_train.training.metrics import plot_losses
from wgpu_train.training.config import resumed_settings as run_settings
from wgpu_train.training.run_folder import RUN_FILES, run_folder
from wgpu_train.data.batching import split_batch
from wgpu_train.engines.webgpu.memory import count_trainable
from wgpu_train.training.trainer import Trainer
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.training.config import INVOCATION_FIELDS, PAD_MULTIPLE, TrainConfig


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    return make_model_dir(root / "model"), make_data_dir(root / "data")


def config(workspace, out, **kw) -> TrainConfig:
    model, data = workspace
    base = dict(model=str(model), data=str(data), out=None if out is None else str(out), backend="numpy",
                no_progress=True, lr=1e-2, max_new_tokens=6, eval_generate=False, log_every=1)
    base.update(kw)
    return TrainConfig(**base)


def adapter_tensors(folder):
    return read_adapter(folder)[1]


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---- schedules and configuration ----------------------------------------------------------------------

def test_schedules():
    const = LRSchedule(1.0, "constant", warmup_steps=4, total_steps=10)
    assert [const.lr_at(s) for s in range(1, 6)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert const.lr_at(10) == 1.0
    lin = LRSchedule(1.0, "linear", warmup_steps=2, total_steps=10)
    assert lin.lr_at(1) == 0.5 and lin.lr_at(2) == 1.0
    assert lin.lr_at(3) == 1.0                      # the first step after warmup trains at the peak
    assert lin.lr_at(7) == pytest.approx(1.0 - 4 / 8)
    assert lin.lr_at(10) == pytest.approx(1 / 8)    # the last step still learns
    cos = LRSchedule(2.0, "cosine", warmup_steps=0, total_steps=5)
    assert [cos.lr_at(s) for s in range(1, 6)] == pytest.approx(
        [2.0 * 0.5 * (1 + math.cos(math.pi * k / 5)) for k in range(5)])
    assert cos.lr_at(3) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 0.4)))
    assert all(cos.lr_at(s) > cos.lr_at(s + 1) for s in range(1, 5))
    with pytest.raises(ConfigError, match="lr_schedule"):
        LRSchedule(1.0, "step")


def test_train_config_fields_have_help_and_validate():
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("help"), f.name
    assert TrainConfig().out is None and TrainConfig().lora_targets == "q_proj,v_proj"
    for bad in (dict(method="qlora"), dict(batch_size=0), dict(lr=0.0), dict(lora_targets="foo_proj"),
                dict(lora_dropout=1.0), dict(valid_split=1.0), dict(max_steps=0), dict(backend="cuda"),
                dict(lr_schedule="step")):
        with pytest.raises(ConfigError):
            TrainConfig(**bad)
    assert {"q_proj", "down_proj", "gate_up_proj", "gate"} <= set(TrainConfig(lora_targets="all-linear").lora_config()
                                                                   .target_modules)      # every family's modules


@pytest.mark.parametrize("field", ["lr", "weight_decay", "max_grad_norm", "adam_eps", "lora_alpha", "lora_dropout",
                                   "beta1", "beta2", "valid_split"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_numbers_are_refused(field, value):
    with pytest.raises(ConfigError, match=f"^{field} must be a finite number, got"):
        TrainConfig(**{field: value})


def test_lora_alpha_must_be_positive():
    for alpha in (0.0, -16.0):
        with pytest.raises(ConfigError, match="^lora_alpha must be > 0"):
            TrainConfig(lora_alpha=alpha)


def test_warmup_must_end_before_the_last_step(workspace, tmp_path):
    """The schedule refuses a warmup that takes the whole run; the trainer shortens one (a recipe's warmup in a
    run cut short by --max-steps, or one longer than the epochs make) and says so."""
    assert LRSchedule(1.0, "cosine", warmup_steps=9, total_steps=10).lr_at(9) == 1.0
    assert LRSchedule(1.0, "cosine", warmup_steps=0, total_steps=1).lr_at(1) == 1.0
    for warmup in (10, 11):
        with pytest.raises(ConfigError, match=rf"^warmup_steps \({warmup}\) must be below the run's 10 optimizer"):
            LRSchedule(1.0, "cosine", warmup_steps=warmup, total_steps=10)
    # the total comes from the data when only epochs are given (12 samples, 4 per step: 3 steps)
    lines = []
    trainer = Trainer(config(workspace, tmp_path / "out", epochs=1, warmup_steps=3), log=lines.append).setup()
    assert trainer.schedule.warmup_steps == 2 and trainer.schedule.lr_at(3) == pytest.approx(trainer.config.lr)
    assert any("warmup_steps 3 is not below the run's 3 steps: warming up over 2" in line for line in lines)


# ---- one shared run ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shared_run(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "out"
    summary = finetune(config(workspace, out, max_steps=8, eval_every=4, save_every=2, keep_checkpoints=2,
                              eval_generate=True, lora_targets="all-linear", log_every=2))
    return out, summary


def test_loss_decreases(shared_run):
    out, summary = shared_run
    assert summary["valid_loss_after"] < summary["valid_loss_before"] - 0.1
    assert summary["valid_perplexity_after"] == pytest.approx(math.exp(summary["valid_loss_after"]))
    train = [r["loss"] for r in rows(out) if "split" not in r]
    assert np.mean(train[-2:]) < np.mean(train[:2])


def test_output_files(shared_run, workspace):
    out, summary = shared_run
    metrics = rows(out)
    steps = [r for r in metrics if "split" not in r]
    assert [r["step"] for r in steps] == [2, 3, 4, 6, 8]   # every 2 steps, and at the epoch end (step 3)
    for r in steps:
        assert set(r) >= {"step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "submits",
                          "readbacks", "nonfinite_skipped"}
        assert r["loss"] > 0 and r["tokens"] > 0 and r["lr"] > 0
    evals = [r for r in metrics if r.get("split") == "valid"]
    assert [r["step"] for r in evals] == [0, 3, 4, 6, 8]   # before, epoch ends, every 4, end
    assert all(r["perplexity"] == pytest.approx(math.exp(r["loss"])) for r in evals)
    em = [r for r in metrics if r.get("split") == "test"]
    assert [r["step"] for r in em] == [0, 8] and all(r["n"] == 3 for r in em)

    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["stopped"] == "max_steps" and not summary["interrupted"]
    assert summary["tokens"] == steps[-1]["tokens"] and summary["tokens_per_s"] > 0
    assert summary["train_loss_first"] > 0 and summary["train_loss_last"] > 0
    assert summary["backend"] == "numpy" and summary["device"]
    assert set(summary["counters"]) >= {"submits", "readbacks", "nonfinite_skipped"}
    assert summary["exact_match_split"] == "test" and summary["exact_match_n"] == 3
    assert 0.0 <= summary["exact_match_before"] <= 1.0 and 0.0 <= summary["exact_match_after"] <= 1.0
    assert (summary["n_train"], summary["n_valid"], summary["n_test"]) == (12, 4, 3)
    # the memory estimate of the largest micro-batch: batch_size rows of the longest example, padded to 8
    est = summary["memory_estimate"]
    cfg = load_model(workspace[0]).config
    lora = wgpu_train.LoraConfig(r=8, alpha=16, target_modules="all-linear")
    assert est["batch"] == 4 and est["length"] % 8 == 0
    assert {k: v for k, v in est.items() if k not in ("batch", "length")} == \
        wgpu_train.estimate_memory(cfg, est["batch"], est["length"], lora)

    resolved = json.loads((out / "train_config.json").read_text())
    assert resolved["max_steps"] == 8 and resolved["lora_targets"] == "all-linear"
    assert resolved["model"] == str(workspace[0]) and resolved["eval_generate"] is True
    assert set(resolved) == {f.name for f in dataclasses.fields(TrainConfig)} | {"data_format"}
    assert resolved["data_format"] == "completions"

    # the final adapter is PEFT's format and equals the last checkpoint's
    cfg, final = read_adapter(out)
    assert cfg.r == 8 and len(cfg.target_modules) == 7
    last = adapter_tensors(out / "checkpoints" / "step-000008" / "adapter")
    assert final.keys() == last.keys() and all(np.array_equal(final[k], last[k]) for k in final)
    try:
        import matplotlib
    except ImportError:
        assert not (out / "loss.png").exists()
    else:
        assert (out / "loss.png").stat().st_size > 1000


def test_loss_plot(shared_run, tmp_path, monkeypatch):
    # matplotlib is optional: drive plot_losses with a stand-in that records what is drawn
    import types

    drawn = {}

    class Axes:
        def plot(self, xs, ys, *fmt, label):
            drawn[label] = (list(xs), list(ys))

        def __getattr__(self, name):
            return lambda *a, **k: None

    class Figure:
        def __init__(self, **kw):
            pass

        def add_subplot(self):
            return Axes()

        def tight_layout(self):
            pass

        def savefig(self, path, dpi):
            drawn["file"] = path

    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", types.SimpleNamespace(Figure=Figure))
    out, _ = shared_run
    assert plot_losses(out / "metrics.jsonl", tmp_path / "loss.png")
    metrics = rows(out)
    assert drawn["train"] == ([2, 3, 4, 6, 8], [r["loss"] for r in metrics if "split" not in r])
    assert drawn["valid"][0] == [0, 3, 4, 6, 8]
    assert drawn["file"] == tmp_path / "loss.png"
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert plot_losses(out / "metrics.jsonl", tmp_path / "none.png") is False


@pytest.mark.parametrize("installed", [True, False])
def test_a_run_without_matplotlib_says_what_to_install(workspace, tmp_path, monkeypatch, installed):
    """loss.png is optional: without matplotlib the run says so in one line naming the extra; with it (a
    stand-in figure here), it draws the file and says nothing of it."""
    import types

    class Figure:
        def __init__(self, **kw):
            pass

        def add_subplot(self):
            return types.SimpleNamespace(**{n: lambda *a, **k: None for n in
                                            ("plot", "set_xlabel", "set_ylabel", "legend", "grid")})

        def tight_layout(self):
            pass

        def savefig(self, path, dpi):
            Path(path).write_bytes(b"png")

    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib") if installed else None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", types.SimpleNamespace(Figure=Figure) if installed else None)
    lines = []
    out = tmp_path / "run"
    Trainer(config(workspace, out, max_steps=1), log=lines.append).run()
    said = [line for line in lines if "loss.png" in line]
    if installed:
        assert said == [] and (out / "loss.png").read_bytes() == b"png"
    else:
        assert said == ["loss.png skipped: matplotlib is not installed (pip install 'wgpu-train[plot]')"]
        assert not (out / "loss.png").exists()


def test_keep_checkpoints(shared_run):
    out, _ = shared_run
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000006", "step-000008"]
    ckpt = root / "step-000006"
    assert {p.name for p in ckpt.iterdir()} == {"adapter", "optimizer.safetensors", "trainer_state.json"}
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["data"]["epoch"] == 1 and state["data"]["position"] == 3
    assert state["schedule"]["next_step"] == 7 and state["engine"]["dropout_calls"] == 6
    moments = read_safetensors(ckpt / "optimizer.safetensors")
    assert len(moments) == 2 * 2 * 7 * 2     # (A, B) x 7 modules x 2 layers, each with exp_avg and exp_avg_sq
    assert find_checkpoint(out) == root / "step-000008"


# ---- gradient accumulation -----------------------------------------------------------------------------

def test_grad_accum_equals_full_batch(workspace, tmp_path):
    # Each step draws batch_size * grad_accum samples, so both runs see the same samples; the engine
    # normalises by the trained tokens of the whole step. A large epsilon keeps Adam's update linear in the
    # gradient, so summation-order rounding cannot flip the sign of a tiny component.
    kw = dict(max_steps=3, adam_eps=1e-3, lr_schedule="constant", valid_split=0.0)
    one = finetune(config(workspace, tmp_path / "one", batch_size=4, grad_accum=1, **kw))
    two = finetune(config(workspace, tmp_path / "two", batch_size=2, grad_accum=2, **kw))
    assert one["tokens"] == two["tokens"] and one["trained_tokens"] == two["trained_tokens"]
    assert two["train_loss_first"] == pytest.approx(one["train_loss_first"], rel=1e-6)
    a, b = adapter_tensors(tmp_path / "one"), adapter_tensors(tmp_path / "two")
    moved = [k for k in a if np.abs(a[k]).max() > 0]
    assert moved
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-7)


def test_split_batch_trims_padding(workspace, tmp_path):
    trainer = Trainer(config(workspace, tmp_path / "unused", batch_size=2, grad_accum=2)).setup()
    batch, _ = trainer.next_batch()
    parts = split_batch(batch, 2, PAD_MULTIPLE)
    assert [p.input_ids.shape[0] for p in parts] == [2, 2]
    assert sum(p.n_tokens for p in parts) == batch.n_tokens
    for p in parts:
        t = p.input_ids.shape[1]
        used = int(np.flatnonzero(p.attention_mask.any(axis=0))[-1]) + 1
        assert t % 8 == 0 or t == batch.input_ids.shape[1]   # lengths come in multiples of 8
        assert t - used < 8                                    # and no more padding than that
    # the parameter count in the log comes from shapes; it matches the engine's tensors
    n = sum(v.size for v in trainer.engine.trainable().values())
    assert count_trainable(trainer.model.config, trainer.config.lora_config()) == n
    full = load_model(workspace[0])
    full.set_full_finetune()
    assert count_trainable(full.config, None) == sum(v.size for v in full.engine.trainable().values())


def test_gradient_checkpointing_gives_the_same_adapter(workspace, tmp_path):
    """On the wgpu engine the recomputed activations are bit-identical, so is the trained adapter."""
    require_adapter()
    kw = dict(backend="wgpu", max_steps=2, batch_size=2, grad_accum=2, lora_dropout=0.1, lora_targets="all-linear",
              valid_split=0.0)
    plain = Trainer(config(workspace, tmp_path / "plain", **kw))
    ckpt = Trainer(config(workspace, tmp_path / "ckpt", gradient_checkpointing=True, **kw))
    summaries = plain.run(), ckpt.run()
    assert ckpt.engine.gradient_checkpointing and not plain.engine.gradient_checkpointing
    assert summaries[1]["train_loss_last"] == summaries[0]["train_loss_last"]
    a, b = adapter_tensors(tmp_path / "plain"), adapter_tensors(tmp_path / "ckpt")
    assert a.keys() == b.keys() and any(np.abs(a[k]).max() > 0 for k in a if "lora_B" in k)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert json.loads((tmp_path / "ckpt" / "train_config.json").read_text())["gradient_checkpointing"] is True


# ---- resume ------------------------------------------------------------------------------------------------

def test_resume_equals_uninterrupted(workspace, tmp_path):
    # dropout, warmup + cosine, weight decay, accumulation and an epoch boundary inside each half
    kw = dict(max_steps=8, batch_size=2, grad_accum=2, lora_dropout=0.2, lr_schedule="cosine", warmup_steps=2,
              weight_decay=0.05, keep_checkpoints=0)
    full = finetune(config(workspace, tmp_path / "full", save_every=4, **kw))
    ckpt = tmp_path / "full" / "checkpoints" / "step-000004"
    resumed = finetune(config(workspace, tmp_path / "resumed", resume=str(ckpt), **kw))
    assert resumed["resumed_from"] == str(ckpt) and resumed["steps"] == 8
    assert resumed["tokens"] == full["tokens"]
    a, b = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert resumed["valid_loss_after"] == full["valid_loss_after"]
    # the resumed run carried the history of the first half
    assert resumed["valid_loss_before"] == full["valid_loss_before"]
    assert resumed["train_loss_first"] == full["train_loss_first"]


def test_n_steps_then_resume_n_more(workspace, tmp_path):
    kw = dict(lr_schedule="constant", lora_dropout=0.1)
    whole = tmp_path / "whole"
    finetune(config(workspace, whole, max_steps=6, **kw))
    finetune(config(workspace, tmp_path / "half", max_steps=3, **kw))
    # resume from the output folder: its newest checkpoint
    finetune(config(workspace, tmp_path / "half", max_steps=6, resume=str(tmp_path / "half"), **kw))
    a, b = adapter_tensors(whole), adapter_tensors(tmp_path / "half")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert len([r for r in rows(tmp_path / "half") if "split" not in r]) == 6   # metrics appended


def test_resume_keeps_one_metrics_row_per_step(workspace, tmp_path):
    """Rows written after the checkpoint a run resumes from (and a torn line of a killed run) are dropped."""
    out = tmp_path / "run"
    kw = dict(lr_schedule="constant", log_every=1, keep_checkpoints=0)
    finetune(config(workspace, out, max_steps=6, save_every=2, **kw))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "split"')
    finetune(config(workspace, out, max_steps=6, resume=str(out / "checkpoints" / "step-000004"), **kw))
    steps = [r["step"] for r in rows(out) if "split" not in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_resume_failing_before_its_first_step_changes_nothing(workspace, tmp_path):
    """A resume whose first step fails writes nothing into the run: train_config.json keeps the run's settings,
    not the failed command's, and metrics.jsonl its rows after the checkpoint resumed (bytes and times)."""
    out = tmp_path / "run"
    finetune(config(workspace, out, max_steps=3, save_every=1, lr_schedule="constant"))
    before = folder_state(out)
    trainer = Trainer(config(workspace, out, max_steps=5, lr=3e-2, resume=str(out / "checkpoints" / "step-000001")))
    trainer.setup()

    def failing(*args, **kw):
        raise ConfigError("the device was lost")

    trainer._train_step = failing
    with pytest.raises(ConfigError, match="device was lost"):
        trainer.train()
    assert folder_state(out) == before
    # the first completed step writes them: the resumed run's settings, its metrics cut back to the checkpoint
    finetune(config(workspace, out, max_steps=2, lr=3e-2, lr_schedule="constant",
                 resume=str(out / "checkpoints" / "step-000001")))
    assert json.loads((out / "train_config.json").read_text())["lr"] == 3e-2
    assert [r["step"] for r in rows(out) if "split" not in r] == [1, 2]


def test_loraplus_option(workspace, tmp_path):
    """--loraplus-lr-ratio trains B faster (the engines' LoRA+ is checked against PEFT in test_engine.py); a
    ratio that is not positive, or one with full fine-tuning, is refused."""
    a = finetune(config(workspace, tmp_path / "a", max_steps=2))
    b = finetune(config(workspace, tmp_path / "b", max_steps=2, loraplus_lr_ratio=16.0))
    ta, tb = adapter_tensors(tmp_path / "a"), adapter_tensors(tmp_path / "b")
    key = next(k for k in ta if "lora_B" in k)
    assert a["steps"] == b["steps"] == 2 and np.abs(tb[key]).max() > 2 * np.abs(ta[key]).max()
    with pytest.raises(ConfigError, match="loraplus_lr_ratio must be > 0"):
        TrainConfig(loraplus_lr_ratio=0.0)
    with pytest.raises(ConfigError, match="loraplus_lr_ratio sets the LoRA B matrices' learning rate"):
        TrainConfig(method="full", loraplus_lr_ratio=4.0)


def test_full_finetune_and_resume(workspace, tmp_path):
    kw = dict(method="full", max_steps=2, lr=1e-3, valid_split=0.0)
    a = finetune(config(workspace, tmp_path / "a", save_every=1, **kw))
    assert a["method"] == "full"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "a" / name).is_file()
    assert (tmp_path / "a" / "checkpoints" / "step-000001" / "model" / "model.safetensors").is_file()
    finetune(config(workspace, tmp_path / "b", resume=str(tmp_path / "a" / "checkpoints" / "step-000001"), **kw))
    wa = read_safetensors(tmp_path / "a" / "model.safetensors")
    wb = read_safetensors(tmp_path / "b" / "model.safetensors")
    base = read_safetensors(workspace[0] / "model.safetensors")
    assert not np.array_equal(wa["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)


def test_resume_refuses_a_different_lora(workspace, tmp_path):
    finetune(config(workspace, tmp_path / "a", max_steps=1))
    with pytest.raises(ConfigError, match="LoRA r=8"):
        finetune(config(workspace, tmp_path / "b", max_steps=2, lora_rank=4, resume=str(tmp_path / "a")))
    with pytest.raises(ConfigError, match="no checkpoint"):
        finetune(config(workspace, tmp_path / "c", resume=str(tmp_path)))


def test_base_dtype_auto_stores_the_weights_as_the_checkpoint_does(workspace, tmp_path):
    """The default base_dtype, auto: a bf16 checkpoint's weights stay bfloat16 (its embedding and head too),
    recorded as the run resolved it, so that a resume continues so; a float32 checkpoint stays float32; method
    full trains float32 weights."""
    import torch
    from tiny_models import save_model

    bf16 = tmp_path / "bf16"
    model, _ = workspace
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(model)
    save_model(hf, bf16, dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bf16 / name).write_bytes((model / name).read_bytes())
    assert TrainConfig().base_dtype == "auto"
    summary = finetune(config(workspace, tmp_path / "a", max_steps=1, model=str(bf16)))
    assert (summary["base_dtype"], summary["embed_dtype"]) == ("bfloat16", "bfloat16")
    recorded = json.loads((tmp_path / "a" / "train_config.json").read_text())
    assert recorded["base_dtype"] == "bfloat16"
    summary = finetune(config(workspace, tmp_path / "a", max_steps=2, model=str(bf16), resume=str(tmp_path / "a")))
    assert summary["steps"] == 2 and summary["base_dtype"] == "bfloat16"
    summary = finetune(config(workspace, tmp_path / "b", max_steps=1))
    assert (summary["base_dtype"], summary["embed_dtype"]) == ("float32", "float32")
    summary = finetune(config(workspace, tmp_path / "c", max_steps=1, model=str(bf16), method="full"))
    assert (summary["base_dtype"], summary["embed_dtype"]) == ("float32", "float32")


def test_resume_refuses_other_base_dtypes_and_leaves_the_run_alone(workspace, tmp_path):
    """A checkpoint trained over NF4 base weights continues only over NF4 ones; a refused resume, here into
    its own folder, changes nothing there."""
    run = tmp_path / "a"
    finetune(config(workspace, run, max_steps=1, base_dtype="nf4", embed_dtype="float16"))
    before = folder_state(run)
    with pytest.raises(ConfigError, match="trained over base_dtype nf4, not float32: pass --base-dtype nf4"):
        finetune(config(workspace, run, max_steps=2, base_dtype="float32", embed_dtype="float16", resume=str(run)))
    with pytest.raises(ConfigError, match="trained over embed_dtype float16, not float32"):
        finetune(config(workspace, run, max_steps=2, base_dtype="nf4", embed_dtype="float32", resume=str(run)))
    with pytest.raises(ConfigError, match="LoRA r=8"):
        finetune(config(workspace, run, max_steps=2, base_dtype="nf4", embed_dtype="float16", lora_rank=4,
                        resume=str(run)))
    assert folder_state(run) == before
    summary = finetune(config(workspace, run, max_steps=2, base_dtype="nf4", resume=str(run)))   # embedding: auto
    assert summary["steps"] == 2 and (summary["base_dtype"], summary["embed_dtype"]) == ("nf4", "float16")
    summary = finetune(config(workspace, run, max_steps=3, resume=str(run)))    # base_dtype auto: as it trained
    assert summary["steps"] == 3 and (summary["base_dtype"], summary["embed_dtype"]) == ("nf4", "float16")


def test_resume_without_out_continues_in_the_run_folder(workspace, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # where a default ./wgpu-train-out would appear
    assert TrainConfig().output_dir() == Path("wgpu-train-out")
    assert TrainConfig(resume="r/checkpoints/step-000002").output_dir() == Path("r")
    assert TrainConfig(out="o", resume="r").output_dir() == Path("o")
    run = tmp_path / "my run"
    finetune(config(workspace, run, max_steps=2, save_every=1, keep_checkpoints=0))
    for steps, resume in ((3, run), (4, run / "checkpoints"), (5, run / "checkpoints" / "step-000004")):
        summary = finetune(config(workspace, None, max_steps=steps, resume=str(resume)))
        assert summary["steps"] == steps and summary["output"] == str(run)
        assert json.loads((run / "train_config.json").read_text())["out"] == str(run)   # recorded resolved
    assert not (tmp_path / "wgpu-train-out").exists()
    assert [r["step"] for r in rows(run) if "split" not in r] == [1, 2, 3, 4, 5]
    # a checkpoints/ folder given with --out of its run continues in place too
    summary = finetune(config(workspace, run, max_steps=6, resume=str(run / "checkpoints")))
    assert summary["steps"] == 6 and summary["resumed_from"] == str(run / "checkpoints" / "step-000005")


def test_run_folder_of_each_resume_path(workspace, tmp_path):
    assert run_folder("a/checkpoints/step-000003") == Path("a")
    assert run_folder("a/checkpoints") == Path("a") and run_folder("a") == Path("a")
    # a run whose folder is itself named checkpoints
    run = tmp_path / "checkpoints"
    finetune(config(workspace, run, max_steps=1))
    assert run_folder(run) == run and run_folder(run / "checkpoints") == run
    assert finetune(config(workspace, None, max_steps=2, resume=str(run)))["output"] == str(run)
    # a checkpoint folder outside a run has no run folder to continue in: --out is asked for
    loose = tmp_path / "loose"
    (run / "checkpoints" / "step-000002").rename(loose)
    with pytest.raises(ConfigError, match="outside a run's checkpoints/ folder; pass --out"):
        Trainer(config(workspace, None, max_steps=3, resume=str(loose)))
    assert finetune(config(workspace, tmp_path / "new", max_steps=3, resume=str(loose)))["steps"] == 3


def test_resuming_a_finished_run_is_refused(workspace, tmp_path):
    """A run that reached its end is left as it is: its summary, metrics and adapter stay those of the run."""
    for kw in (dict(max_steps=2), dict(epochs=1)):
        run = tmp_path / f"run-{len(kw)}-{next(iter(kw))}"
        done = finetune(config(workspace, run, **kw))
        before = folder_state(run)
        for resume in (run, run / "checkpoints"):
            with pytest.raises(ConfigError) as e:
                Trainer(config(workspace, None, resume=str(resume), **kw)).setup()
            assert str(e.value) == (f"the run in {run} already finished at step {done['steps']}; raise --max-steps "
                                    f"or --epochs to train further")
        with pytest.raises(ConfigError, match="already finished"):
            finetune(config(workspace, tmp_path / "elsewhere", resume=str(run), **kw))
        assert folder_state(run) == before and not (tmp_path / "elsewhere").exists()


def test_run_settings(workspace, tmp_path):
    """What `wgpu-train finetune --resume DIR` fills unset options from: the run's resolved settings."""
    run = tmp_path / "run"
    finetune(config(workspace, run, max_steps=2, save_every=1, lora_rank=4, lora_targets="all-linear",
                    overwrite=True))
    recorded = json.loads((run / "train_config.json").read_text())
    settings = run_settings(run)
    assert settings == {k: v for k, v in recorded.items() if k not in INVOCATION_FIELDS + ("data_format",)}
    assert {"out", "resume", "ray_address", "device_memory"} <= set(INVOCATION_FIELDS)     # the machines, not the run
    assert settings["lora_rank"] == 4 and settings["model"] == str(workspace[0])
    assert settings["embed_dtype"] == "float32"   # as resolved
    for path in (run / "checkpoints", run / "checkpoints" / "step-000001"):
        assert run_settings(path) == settings
    assert run_settings(tmp_path / "nothing") == {}
    # the settings continue the run: LoRA r=4 on all linear layers, as trained
    summary = finetune(TrainConfig(**{**settings, "max_steps": 3, "resume": str(run), "no_progress": True}))
    assert summary["steps"] == 3 and summary["output"] == str(run)
    (run / "train_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="train_config.json: unreadable run settings"):
        run_settings(run)


def test_config_errors_are_found_before_loading(workspace, tmp_path):
    """Refused as the Trainer is built, before the model (here a folder that does not exist) is read, with one
    line and nothing written."""
    run = tmp_path / "run"
    finetune(config(workspace, run, max_steps=1))
    (tmp_path / "afile").write_text("mine")
    before = folder_state(tmp_path)
    model = str(tmp_path / "no-model")
    cases = [
        (dict(out=tmp_path / "afile"), "is a file"),
        (dict(out=None, resume=str(tmp_path / "missing")), "does not exist"),
        (dict(out=tmp_path / "o", resume=str(tmp_path / "afile")), "does not exist"),
        (dict(out=tmp_path / "o", resume=str(workspace[1])), "no checkpoint"),
        (dict(out=None, resume=str(run), lora_rank=4), "has LoRA r=8, the config says 4"),
        (dict(out=None, resume=str(run), lora_targets="all-linear"), "has LoRA target_modules=q_proj,v_proj"),
        (dict(out=None, resume=str(run), method="full"), "was trained with method=lora, not full"),
        (dict(out=None, resume=str(run), base_dtype="float16"), "over base_dtype float32, not float16"),
        (dict(out=tmp_path / "o", data=str(workspace[1] / "train.jsonl"), valid_split=0.0, early_stop_patience=1),
         "early_stop_patience needs validation data"),
    ]
    for kw, message in cases:
        out = kw.pop("out")
        with pytest.raises(ConfigError, match=message) as e:
            Trainer(config(workspace, out, model=model, max_steps=3, **kw))
        assert "\n" not in str(e.value)
    assert folder_state(tmp_path) == before


# ---- an output folder that holds an earlier run ---------------------------------------------------------

def test_new_run_refuses_an_earlier_run_then_overwrite_and_resume(workspace, tmp_path):
    out = tmp_path / "out"
    finetune(config(workspace, out, max_steps=3, save_every=1, keep_checkpoints=0))
    (out / "notes.txt").write_text("mine")
    before = folder_state(out)
    # refused as the Trainer is built: before the model (here a folder that does not exist) is read
    with pytest.raises(ConfigError) as e:
        Trainer(config(workspace, out, max_steps=2, model=str(tmp_path / "no-model")))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (f"the output folder {out} already holds a run (adapter_config.json, adapter_model.safetensors, "
                   f"checkpoints/, metrics.jsonl, summary.json, train_config.json); pass --overwrite to replace "
                   f"it, --resume {out} to continue it, or choose another --out")
    with pytest.raises(ConfigError, match="already holds a run"):
        finetune(config(workspace, out, max_steps=2))
    assert folder_state(out) == before

    # resume continues it
    summary = finetune(config(workspace, out, max_steps=4, save_every=1, keep_checkpoints=0, resume=str(out)))
    assert summary["steps"] == 4 and summary["resumed_from"] == str(out / "checkpoints" / "step-000003")
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == [f"step-00000{i}" for i in range(1, 5)]

    # overwrite replaces it: the old checkpoints go (and the log says so), unrelated files stay
    lines = []
    summary = Trainer(config(workspace, out, max_steps=2, overwrite=True), log=lines.append).run()
    assert summary["steps"] == 2 and summary["resumed_from"] is None
    assert any("removing 4 checkpoint(s) of an earlier run" in line for line in lines)
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-000002"]
    assert [r["step"] for r in rows(out) if "split" not in r] == [1, 2]
    assert json.loads((out / "train_config.json").read_text())["overwrite"] is True
    assert (out / "notes.txt").read_text() == "mine"


def test_resume_into_a_folder_of_another_run_is_refused(workspace, tmp_path):
    """--resume A --out B continues A's run in B only when B holds no other run (or with overwrite)."""
    finetune(config(workspace, tmp_path / "a", max_steps=2, save_every=1))
    finetune(config(workspace, tmp_path / "b", max_steps=1))
    before = folder_state(tmp_path / "b")
    ckpt = tmp_path / "a" / "checkpoints" / "step-000001"
    for resume in (ckpt, tmp_path / "a"):
        with pytest.raises(ConfigError, match="already holds a run") as e:
            Trainer(config(workspace, tmp_path / "b", max_steps=3, resume=str(resume)))
        assert "--resume" not in str(e.value)
    assert folder_state(tmp_path / "b") == before
    # its own checkpoint, given as a checkpoint folder, continues the run in place
    summary = finetune(config(workspace, tmp_path / "a", max_steps=3, resume=str(ckpt)))
    assert summary["steps"] == 3
    summary = finetune(config(workspace, tmp_path / "b", max_steps=3, resume=str(ckpt), overwrite=True))
    assert summary["steps"] == 3 and summary["resumed_from"] == str(ckpt)
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "checkpoints")] == ["step-000003"]


@pytest.mark.parametrize("name", [*RUN_FILES, "checkpoints/step-000001/trainer_state.json"])
def test_any_trace_of_a_run_counts(workspace, tmp_path, name):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("{}")
    before = folder_state(tmp_path)
    with pytest.raises(ConfigError, match="already holds a run") as e:
        Trainer(config(workspace, tmp_path))
    shown = name.split("/")[0] + ("/" if "/" in name else "")
    assert f"({shown})" in str(e.value)
    assert ("--resume" in str(e.value)) == (shown == "checkpoints/")   # offered only with a checkpoint to resume
    assert folder_state(tmp_path) == before


def test_empty_or_unrelated_output_folder_is_used(workspace, tmp_path):
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert finetune(config(workspace, tmp_path / "empty", max_steps=1))["steps"] == 1
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    (other / "loss.csv").write_text("1,2\n")
    assert finetune(config(workspace, other, max_steps=1))["steps"] == 1
    assert (other / "notes.txt").read_text() == "mine" and (other / "loss.csv").read_text() == "1,2\n"
    assert (other / "summary.json").is_file()


# ---- atomic checkpoints and Ctrl-C -------------------------------------------------------------------

def test_checkpoint_is_atomic(workspace, tmp_path, monkeypatch):
    calls = []
    real = checkpoint_mod.write_optimizer_state

    def crashing(path, state):
        calls.append(path)
        if len(calls) == 2:
            (path.parent / "partial").write_text("half written")
            raise RuntimeError("disk fell off")
        real(path, state)

    monkeypatch.setattr(checkpoint_mod, "write_optimizer_state", crashing)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk fell off"):
        finetune(config(workspace, out, max_steps=6, save_every=2))
    root = out / "checkpoints"
    # the crashed step-4 write left nothing behind; step 2 is whole
    assert [p.name for p in root.iterdir()] == ["step-000002"]
    assert calls[1].parent.name.startswith(".step-000004.tmp")
    survivor = root / "step-000002"
    assert {p.name for p in survivor.iterdir()} == {"adapter", "optimizer.safetensors", "trainer_state.json"}

    # a process killed mid-write leaves only a hidden temporary folder, which is never taken for a checkpoint
    stale = root / ".step-000004.tmp-999"
    stale.mkdir()
    (stale / "trainer_state.json").write_text("{")
    assert list_checkpoints(root) == [survivor] and find_checkpoint(out) == survivor
    monkeypatch.setattr(checkpoint_mod, "write_optimizer_state", real)
    summary = finetune(config(workspace, out, max_steps=6, save_every=2, resume=str(out)))
    assert summary["steps"] == 6 and summary["resumed_from"] == str(survivor)
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000004", "step-000006"]


def test_failed_checkpoint_write_is_one_line(workspace, tmp_path, monkeypatch):
    """A full disk while writing a checkpoint: one line naming the last good checkpoint, which is intact."""
    real = checkpoint_mod.write_optimizer_state
    calls = []

    def full_disk(path, state):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, state)

    monkeypatch.setattr(checkpoint_mod, "write_optimizer_state", full_disk)
    out = tmp_path / "my out"
    with pytest.raises(ConfigError) as e:
        finetune(config(workspace, out, max_steps=6, save_every=2))
    good = out / "checkpoints" / "step-000002"
    assert str(e.value) == (f"cannot write the checkpoint of step 4 in {out / 'checkpoints'}: No space left on "
                            f"device; the last good checkpoint is {good} (resume with --resume '{good}')")
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]
    monkeypatch.setattr(checkpoint_mod, "write_optimizer_state", real)
    assert finetune(config(workspace, None, max_steps=6, save_every=2, resume=str(good)))["steps"] == 6


def test_failed_rewrite_keeps_the_earlier_checkpoint(workspace, tmp_path, monkeypatch):
    trainer = Trainer(config(workspace, tmp_path / "out", max_steps=1)).setup()
    trainer.train()
    root = tmp_path / "out" / "checkpoints"
    before = folder_state(root)
    real = checkpoint_mod.os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".step-000001.tmp"):
            raise OSError(errno.EIO, "I/O error")
        real(src, dst)

    monkeypatch.setattr(checkpoint_mod.os, "rename", rename)
    with pytest.raises(ConfigError, match="I/O error; the last good checkpoint is .*step-000001"):
        trainer.save_checkpoint()    # the same step again: the old one is moved aside, then put back
    assert folder_state(root) == before


def test_ctrl_c_saves_a_checkpoint_and_stops(workspace, tmp_path):
    outside = signal.getsignal(signal.SIGINT)
    lines = []
    out = tmp_path / "my out"
    trainer = Trainer(config(workspace, out, max_steps=10, batch_size=2, eval_every=2), log=lines.append).setup()
    real = trainer.engine.train_step
    calls = []

    def step(*args):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)   # as if the user pressed Ctrl-C during step 3
        return real(*args)

    trainer.engine.train_step = step
    summary = trainer.train()
    assert summary["interrupted"] and summary["stopped"] == "interrupted" and summary["steps"] == 3
    assert len(calls) == 3
    ckpt = out / "checkpoints" / "step-000003"
    assert summary["checkpoint"] == str(ckpt) and summary["adapter_step"] == 3
    assert "interrupted: finishing this step, then saving a checkpoint (Ctrl-C again to abort)" in lines
    assert lines[-1] == f"stopped at step 3; resume with --resume '{ckpt}'"
    # the last evaluation (step 2) is not of the adapter written at step 3
    assert summary["valid_loss_after"] is None and summary["valid_perplexity_after"] is None
    assert (out / "adapter_model.safetensors").is_file()
    assert signal.getsignal(signal.SIGINT) is outside   # restored
    resumed = finetune(config(workspace, out, max_steps=10, batch_size=2, resume=str(out)))
    assert resumed["steps"] == 10 and not resumed["interrupted"]


@pytest.mark.parametrize("second", [False, True])
def test_ctrl_c_before_the_first_step_leaves_the_folder_as_it_was(workspace, tmp_path, second):
    """Ctrl-C during the evaluation before training (twice: abort) trains nothing and removes what the run
    wrote, so the same command runs again."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    before = folder_state(tmp_path)
    outside = signal.getsignal(signal.SIGINT)
    for out in (tmp_path / "out", tmp_path / "new"):
        lines = []
        trainer = Trainer(config(workspace, out, max_steps=2, eval_generate=True), log=lines.append).setup()
        real = trainer.evaluate

        def evaluate():
            signal.raise_signal(signal.SIGINT)
            if second:
                signal.raise_signal(signal.SIGINT)
            return real()

        trainer.evaluate = evaluate
        trainer.exact_match = lambda: pytest.fail("exact match after Ctrl-C")
        if second:
            with pytest.raises(KeyboardInterrupt):
                trainer.train()
        else:
            summary = trainer.train()
            assert summary["steps"] == 0 and summary["interrupted"] and summary["checkpoint"] is None
            assert summary["adapter_step"] is None and summary["valid_loss_after"] is None
            assert lines[-1] == "interrupted before the first step: nothing trained"
        assert "interrupted: stopping before the first step (Ctrl-C again to abort)" in lines
        assert not any("finishing this step" in line for line in lines)
        assert signal.getsignal(signal.SIGINT) is outside
        assert folder_state(tmp_path) == before
    for out in (tmp_path / "out", tmp_path / "new"):
        assert finetune(config(workspace, out, max_steps=1))["steps"] == 1


def test_ignored_sigint_stays_ignored(workspace, tmp_path):
    """Started with SIGINT ignored (a background job, nohup), the trainer leaves it so, and finds it so after."""
    outside = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert finetune(config(workspace, tmp_path / "run", max_steps=1))["steps"] == 1
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, outside)


def test_nonfinite_step_is_reported(workspace, tmp_path):
    trainer = Trainer(config(workspace, tmp_path / "out", max_steps=3)).setup()
    real = trainer.engine.train_step
    calls = []

    def step(micro, hp, n):
        calls.append(n)
        if n == 2:   # as an engine does when the gradients overflow: no update, counted
            trainer.engine.counters["nonfinite_skipped"] += 1
            return float("nan"), sum(int((t != -100).sum()) for _, t, _, _ in micro), float("inf"), False
        return real(micro, hp, n)

    trainer.engine.train_step = step
    summary = trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if "split" not in r]
    assert [r["nonfinite_skipped"] for r in steps] == [0, 1, 1]
    assert steps[1]["grad_norm"] is None and steps[1]["loss"] is None   # valid JSON, no NaN
    assert summary["counters"]["nonfinite_skipped"] == 1 and summary["steps"] == 3


# ---- early stopping ----------------------------------------------------------------------------------------

def _fake_evaluations(trainer, losses):
    losses = iter(losses)

    def fake_eval():
        v = next(losses)
        return {"loss": v, "perplexity": math.exp(v), "tokens": 10}

    trainer.evaluate = fake_eval


def test_early_stopping(workspace, tmp_path):
    out = tmp_path / "out"
    trainer = Trainer(config(workspace, out, max_steps=20, eval_every=1, early_stop_patience=2, save_every=1,
                             keep_checkpoints=1)).setup()
    _fake_evaluations(trainer, [5.0, 4.0, 3.0, 3.5, 3.2, 1.0, 1.0])   # before, then one per step
    summary = trainer.train()
    # best 3.0 at step 2; steps 3 and 4 do not improve on it -> stop after step 4
    assert summary["stopped"] == "early_stop" and summary["steps"] == 4
    assert summary["best_valid_loss"] == 3.0 and summary["best_step"] == 2
    # the adapter written is the best one, and its checkpoint outlives the rotation
    assert summary["adapter_step"] == 2 and summary["valid_loss_after"] == 3.0
    assert summary["valid_perplexity_after"] == pytest.approx(math.exp(3.0))
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-000002", "step-000004"]
    best, last = (adapter_tensors(out / "checkpoints" / f"step-00000{i}" / "adapter") for i in (2, 4))
    written = adapter_tensors(out)
    assert all(np.array_equal(written[k], best[k]) for k in written)
    assert not all(np.array_equal(written[k], last[k]) for k in written)


def test_early_stopping_counts_the_last_evaluation_and_resumes_with_the_best(workspace, tmp_path):
    out = tmp_path / "out"
    kw = dict(eval_every=1, early_stop_patience=3, save_every=1, keep_checkpoints=1)
    # the evaluation at the end (step 3) is the best: its adapter is written
    trainer = Trainer(config(workspace, tmp_path / "last", max_steps=3, eval_every=2, early_stop_patience=3)).setup()
    _fake_evaluations(trainer, [5.0, 3.0, 2.0])
    summary = trainer.train()
    assert summary["best_step"] == summary["adapter_step"] == 3 and summary["valid_loss_after"] == 2.0

    # best at step 1; the run ends at max_steps before patience runs out: step 1's adapter is written
    trainer = Trainer(config(workspace, out, max_steps=3, **kw)).setup()
    _fake_evaluations(trainer, [5.0, 3.0, 4.0, 4.5])
    summary = trainer.train()
    assert summary["stopped"] == "max_steps" and summary["adapter_step"] == 1
    best = adapter_tensors(out / "checkpoints" / "step-000001" / "adapter")
    assert all(np.array_equal(v, best[k]) for k, v in adapter_tensors(out).items())
    # resumed, the third evaluation without improvement stops it; the best weights come from their checkpoint
    trainer = Trainer(config(workspace, out, max_steps=6, resume=str(out), **kw)).setup()
    _fake_evaluations(trainer, [4.6])
    summary = trainer.train()
    assert summary["stopped"] == "early_stop" and summary["steps"] == 4 and summary["adapter_step"] == 1
    assert all(np.array_equal(v, best[k]) for k, v in adapter_tensors(out).items())
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-000001", "step-000004"]


def test_early_stopping_needs_validation(workspace, tmp_path):
    model, data = workspace
    with pytest.raises(ConfigError, match="validation"):
        Trainer(config(workspace, tmp_path, data=str(data / "train.jsonl"), valid_split=0.0,
                       early_stop_patience=1))
    # a folder without a validation file: found as the data is read, before the weights are loaded
    only = make_data_dir(tmp_path / "only")
    (only / "valid.jsonl").unlink()
    with pytest.raises(ConfigError, match="validation"):
        Trainer(config(workspace, tmp_path / "o", data=str(only), valid_split=0.0, early_stop_patience=1)).setup()
    assert not (tmp_path / "o").exists()


# ---- user errors ------------------------------------------------------------------------------------------

def test_user_errors(workspace, tmp_path, monkeypatch):
    with pytest.raises(DataError, match="no such file"):
        Trainer(config(workspace, tmp_path / "o", data=str(tmp_path / "missing.jsonl"))).setup()
    with pytest.raises(ModelFileError):
        Trainer(config(workspace, tmp_path / "o", model=str(tmp_path))).setup()
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [{"prompt": "a", "completion": "b"}, "{not json"])
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        Trainer(config(workspace, tmp_path / "o", data=str(bad))).setup()
    # no embedded assets (or not yet built): a clear error, not an ImportError
    monkeypatch.setitem(sys.modules, "wgpu_train.assets", None)
    monkeypatch.delattr(wgpu_train, "assets", raising=False)   # `from . import assets` looks here first
    with pytest.raises(ConfigError, match="--model"):
        Trainer(config(workspace, tmp_path / "o", model=None)).setup()
    with pytest.raises(ConfigError, match="--data"):
        Trainer(config(workspace, tmp_path / "o", data=None)).setup()
    with pytest.raises(ConfigError, match="unknown TrainConfig field"):
        finetune(config(workspace, tmp_path / "o"), learning_rate=1.0)


# ---- evaluation -------------------------------------------------------------------------------------------

class _Oracle:
    """A stand-in model that answers each prompt with a fixed text (plus spaces and the stop token)."""

    def __init__(self, tok, answers):
        self.tok, self.answers = tok, answers

    def generate_batch(self, prompts, max_new_tokens, temperature, stop_token_ids):
        return [self._answer(ids, budget, stop_token_ids) for ids, budget in zip(prompts, max_new_tokens)]

    def _answer(self, ids, max_new_tokens, stop_token_ids):
        prompt = self.tok.decode(list(ids), skip_special_tokens=False)
        for question, answer in self.answers.items():
            if question in prompt:
                return (self.tok.encode(f" {answer} \n") + [stop_token_ids[0]])[:max_new_tokens]
        raise AssertionError(prompt)


def test_lines_the_chat_template_refuses_name_their_line_or_are_skipped(workspace, tmp_path):
    """A chat template that raises for some conversations: the run stops at file:line, or with skip_invalid
    trains on the others and counts the refused ones among the skipped lines."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(workspace[0], model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('no system role') }}{% endif %}"
                            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    data = tmp_path / "data"
    rows = [{"prompt": f"after red {i}?", "completion": f"blue {i}"} for i in range(6)]
    rows[3] = {"system": "be brief", "prompt": "after red 3?", "completion": "blue 3"}
    data.mkdir()
    write_jsonl(data / "train.jsonl", rows)
    write_jsonl(data / "valid.jsonl", rows[:2])
    with pytest.raises(WgpuTrainError, match=r"train.jsonl:4: chat template refused the conversation: no system role"):
        finetune(config((model, data), tmp_path / "a", max_steps=1))
    summary = finetune(config((model, data), tmp_path / "b", max_steps=1, skip_invalid=True))
    assert summary["skipped_lines"] == 1 and summary["n_train"] == 5


def test_exact_match_prompts_and_trimming(workspace):
    tok = load_tokenizer(workspace[0])
    records = [[{"role": "user", "content": "q1"}, {"role": "assistant", "content": "right one"}],
               [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "right two"}],
               "plain text records are not asked"]
    ids = generation_prompt(tok, records[1])
    assert tok.decode(ids, skip_special_tokens=False).endswith("q2<|im_end|>\n<|im_start|>assistant\n")
    raw = generation_prompt(tok, records[0], use_chat_template=False)
    assert tok.decode(raw, skip_special_tokens=False) == "q1\n\n"          # raw mode: prompt, blank line
    res = exact_match(_Oracle(tok, {"q1": "right one", "q2": "wrong"}), tok, records, max_new_tokens=32)
    assert (res["correct"], res["n"], res["exact_match"]) == (1, 2, 0.5)
    assert res["samples"][0] == {"prompt": "q1", "reference": "right one", "output": " right one \n", "match": True}
    assert exact_match(_Oracle(tok, {}), tok, ["text only"])["exact_match"] is None


def test_token_budget_batches(workspace, tmp_path):
    """--max-tokens-per-batch: every micro-batch holds at most that many tokens (rows x its padded width),
    each optimizer step takes grad_accum of them, every sample is trained once per epoch, and a resumed run
    equals the uninterrupted one."""
    from wgpu_train.data.batching import BatchStream, token_groups
    from wgpu_train.training.trainer import Trainer

    assert token_groups([5, 5, 4, 9, 2], 12) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    kw = dict(max_steps=6, max_tokens_per_batch=64, grad_accum=2, lr_schedule="constant", keep_checkpoints=0)
    trainer = Trainer(config(workspace, tmp_path / "probe", **kw)).setup()
    stream = trainer.stream
    assert isinstance(stream, BatchStream) and stream.max_tokens == 64
    seen = []
    for batch in stream.epoch_batches(0):
        micro = split_batch(batch, 4, PAD_MULTIPLE, max_tokens=64)
        assert 1 <= len(micro) <= 2
        for m in micro:
            assert m.input_ids.size <= 64 or m.input_ids.shape[0] == 1, m.input_ids.shape
        seen += [tuple(r[r != trainer.pad_id]) for r in batch.input_ids]
    assert len(seen) == len(trainer.train_examples)
    full = finetune(config(workspace, tmp_path / "full", save_every=3, **kw))
    ckpt = tmp_path / "full" / "checkpoints" / "step-000003"
    resumed = finetune(config(workspace, tmp_path / "resumed", resume=str(ckpt), **kw))
    assert resumed["tokens"] == full["tokens"]
    a, b = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "resumed")
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_token_budget_below_the_longest_sample_is_refused(workspace, tmp_path):
    with pytest.raises(ConfigError, match="max_tokens_per_batch \\(4\\) is below the longest training sample"):
        Trainer(config(workspace, tmp_path / "x", max_tokens_per_batch=4)).setup()
    assert not (tmp_path / "x").exists()
