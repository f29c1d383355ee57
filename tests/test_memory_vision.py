"""`wgpu-train memory` on a Gemma 3 vision model: the tower's and the projector's weights counted as transformers
builds them, the tower's activations over the step's images (more with LoRA on the tower), the image tokens
within --max-seq-len, all in the total."""
from __future__ import annotations

import json

import pytest

from test_gemma3_vision import tiny_config, tf, torch  # noqa: F401  (torch: transformers is importable)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory_vision")
    cfg = tiny_config()
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    cfg.save_pretrained(out)
    return out


def memory(capsys, folder, *extra) -> dict:
    from wgpu_train.cli.main import main

    assert main(["memory", "--model", str(folder), "--backend", "numpy", "--max-seq-len", "64", "--json",
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_tower_is_counted(folder, capsys):
    hf = tf.Gemma3ForConditionalGeneration(tiny_config())
    # SigLIP's pooling head (vision_use_head, on in this tiny config) is no part of Gemma 3's path: never loaded
    want = sum(p.numel() for n, p in hf.named_parameters()
               if ("vision_tower" in n or "multi_modal_projector" in n) and ".head." not in n)
    one = memory(capsys, folder, "--batch-size", "2")
    v = one["vision"]
    assert v["tower_parameters"] == want and v["tower_weights"] == 4 * want
    assert v["images"] == 2 and v["image_tokens_per_row"] == 4 + 2 and not v["tower_lora"]
    four = memory(capsys, folder, "--batch-size", "2", "--images-per-row", "2")["vision"]
    assert four["images"] == 4 and four["tower_activations"] == 2 * v["tower_activations"]
    tower = memory(capsys, folder, "--batch-size", "2", "--lora-targets", "q_proj,fc1")["vision"]
    assert tower["tower_lora"] and tower["tower_activations"] > v["tower_activations"]
    text = memory(capsys, folder, "--batch-size", "2", "--images-per-row", "0")
    assert one["total"] - text["total"] == v["tower_activations"]


def test_image_tokens_over_the_row_and_a_text_model_are_refused(folder, tmp_path, capsys):
    from finetune_helpers import make_model_dir
    from wgpu_train.cli.main import main

    assert main(["memory", "--model", str(folder), "--max-seq-len", "12", "--images-per-row", "2"]) == 2
    assert "2 image(s) a row take 12 tokens, and a row has 12 (--max-seq-len)" in capsys.readouterr().err
    assert main(["memory", "--model", str(folder), "--max-seq-len", "64", "--backend", "numpy", "--batch-size",
                 "3"]) == 0
    out = capsys.readouterr().out
    assert "vision weights" in out and "(3 images of 6 tokens each per step" in out
    assert main(["memory", "--model", str(make_model_dir(tmp_path / "m")), "--images-per-row", "1"]) == 2
    assert "the model takes no images" in capsys.readouterr().err
