"""The examples and the main job, run as a user runs them: the default fine-tune of the embedded model
(its numbers are the product's promise), then generation, merging and a fine-tune of a model folder."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_adapter

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run(args, cwd, timeout=900):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The main job on the wgpu backend: examples/quickstart.py is `wgpu-train finetune` with no option."""
    require_adapter()
    work = tmp_path_factory.mktemp("quickstart")
    out = run([EXAMPLES / "quickstart.py", "--out", work / "out", "--backend", "wgpu"], cwd=work, timeout=1200)
    return work / "out", out


def test_default_run_learns_the_task(default_run):
    out, stdout = default_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "wgpu"
    assert summary["exact_match_before"] <= 0.10, summary
    assert summary["exact_match_after"] >= 0.80, summary
    assert summary["valid_perplexity_after"] < summary["valid_perplexity_before"]
    assert (out / "adapter_model.safetensors").is_file() and (out / "metrics.jsonl").is_file()
    # the answer printed at the end is the reversed word list
    assert stdout.strip().splitlines()[-1].strip() == "-> moon fox red", stdout[-500:]


def test_generate_example_answers(default_run, tmp_path):
    out, _ = default_run
    text = run([EXAMPLES / "generate.py", "--adapter", out, "--prompt", "Reverse the order of these words: cat sun",
                "--backend", "wgpu"], cwd=tmp_path)
    assert text.strip() == "sun cat"


def test_merge_example_matches_adapter(default_run, tmp_path):
    out, _ = default_run
    text = run([EXAMPLES / "merge_and_export.py", "--adapter", out, "--out", tmp_path / "merged"], cwd=tmp_path)
    assert (tmp_path / "merged" / "model.safetensors").is_file() and (tmp_path / "merged" / "tokenizer.json").is_file()
    diff = float(text.strip().rsplit(" ", 1)[-1])
    assert diff < 1e-4


def test_finetune_hf_model_example(tmp_path):
    from wgpu_train.assets import default_data_dir, default_model_dir

    args = [EXAMPLES / "finetune_hf_model.py", "--model", default_model_dir(), "--data", default_data_dir(),
            "--out", tmp_path / "adapter", "--max-steps", "2", "--backend", "numpy", "--max-seq-len", "64"]
    text = run(args, cwd=tmp_path)
    assert "2 steps" in text and (tmp_path / "adapter" / "adapter_config.json").is_file()
    # a second run into the same folder is refused, unless asked to replace the first
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "already holds a run" in proc.stderr
    # ... and QLoRA: the base stored as nf4-dq
    assert "2 steps" in run(args + ["--overwrite", "--base-dtype", "nf4-dq", "--embed-dtype", "float16"], cwd=tmp_path)
    summary = json.loads((tmp_path / "adapter" / "summary.json").read_text())
    assert (summary["base_dtype"], summary["embed_dtype"]) == ("nf4-dq", "float16")
