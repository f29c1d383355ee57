"""finetune --adapter-path: training continues from an existing PEFT adapter with its settings and a fresh
optimizer; contradicting options and a resume beside it are refused in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from finetune_helpers import make_data_dir, make_model_dir
from wgpu_train.cli.main import main
from wgpu_train.formats.safetensors import read_safetensors

RUN = ["--backend", "numpy", "--no-progress", "--lr-schedule", "constant", "--warmup-steps", "0", "--batch-size", "2",
       "--lora-rank", "4", "--lora-targets", "q_proj,v_proj,o_proj"]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A 4-step run: its output folder (the adapter to continue), and the model and data folders."""
    root = tmp_path_factory.mktemp("continue")
    model, data = make_model_dir(root / "model"), make_data_dir(root / "data")
    out = root / "first"
    assert main(["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--max-steps", "4",
                 *RUN]) == 0
    return out, model, data


def _adapter(folder):
    return read_safetensors(folder / "adapter_model.safetensors")


def test_continued_training_starts_from_the_adapter(first, tmp_path, capsys):
    start, model, data = first
    base = ["finetune", "--model", str(model), "--data", str(data), "--adapter-path", str(start),
            "--backend", "numpy", "--no-progress", "--lr-schedule", "constant", "--warmup-steps", "0",
            "--batch-size", "2"]
    four, eight = tmp_path / "four", tmp_path / "eight"
    assert main(base + ["--out", str(four), "--max-steps", "4"]) == 0
    assert main(base + ["--out", str(eight), "--max-steps", "8", "--save-every", "4", "--keep-checkpoints", "0"]) == 0
    first_summary = json.loads((start / "summary.json").read_text())
    summary = json.loads((four / "summary.json").read_text())
    # the continued run begins where the adapter ended: its loss before training is the first run's after
    assert summary["valid_loss_before"] == pytest.approx(first_summary["valid_loss_after"], rel=1e-6)
    assert summary["continued_from"] == str(start) and summary["resumed_from"] is None
    config = json.loads((four / "train_config.json").read_text())
    assert (config["lora_rank"], config["lora_targets"]) == (4, "q_proj,v_proj,o_proj") and "adapter_path" in config
    # 4 continued steps are the first 4 of 8 continued steps (same adapter, fresh optimizer, same data order)
    got, want = _adapter(four), _adapter(eight / "checkpoints" / "step-000004" / "adapter")
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
    assert not all(np.array_equal(got[k], _adapter(start)[k]) for k in got)
    # a continued run resumes like any other (its settings are the adapter's)
    assert main(["finetune", "--resume", str(eight / "checkpoints" / "step-000004"), "--out", str(eight),
                 "--no-progress"]) == 0
    assert json.loads((eight / "summary.json").read_text())["steps"] == 8
    capsys.readouterr()


@pytest.mark.parametrize("extra,match", [
    (["--lora-rank", "16"], "--lora-rank 16 contradicts the adapter's r=4"),
    (["--lora-targets", "q_proj"], "--lora-targets q_proj contradicts the adapter's target_modules=q_proj,v_proj,o_proj"),
    (["--method", "full"], "adapter_path continues a LoRA adapter"),
])
def test_contradictions_are_refused(first, tmp_path, capsys, extra, match):
    start, model, data = first
    code = main(["finetune", "--model", str(model), "--data", str(data), "--adapter-path", str(start),
                 "--out", str(tmp_path / "x"), "--backend", "numpy", "--no-progress", *extra])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and match in err[0], err
    assert not (tmp_path / "x").exists()


def test_the_adapters_base_model_without_model(first, tmp_path):
    start, model, data = first
    out = tmp_path / "nomodel"
    assert main(["finetune", "--data", str(data), "--adapter-path", str(start), "--out", str(out), "--max-steps", "1",
                 "--backend", "numpy", "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["model"] == str(model)


def test_resume_beside_adapter_path_is_refused(first, tmp_path, capsys):
    start, model, data = first
    code = main(["finetune", "--adapter-path", str(start), "--resume", str(start), "--backend", "numpy"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "give one" in err[0], err
