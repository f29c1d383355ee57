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
    from wgpu_train.models.config import ModelConfig

    hf = tf.Gemma3ForConditionalGeneration(tiny_config())
    # SigLIP's pooling head (vision_use_head, on in this tiny config) is no part of Gemma 3's path: never loaded
    want = sum(p.numel() for n, p in hf.named_parameters()
               if ("vision_tower" in n or "multi_modal_projector" in n) and ".head." not in n)
    one = memory(capsys, folder, "--batch-size", "2")
    v = one["vision"]
    assert v["tower_parameters"] == want and v["tower_weights"] == 4 * want
    assert v["images"] == 2 and v["image_tokens_per_row"] == 4 + 2 and not v["tower_lora"]
    four = memory(capsys, folder, "--batch-size", "2", "--images-per-row", "2")["vision"]
    # frozen: one image through the tower at a time, so only the embeddings kept grow with the images
    assert four["images"] == 4 and v["tower_activations"] < four["tower_activations"] < 2 * v["tower_activations"]
    tower = memory(capsys, folder, "--batch-size", "2", "--lora-targets", "q_proj,fc1")["vision"]
    assert tower["tower_lora"] and tower["tower_activations"] > 2 * v["tower_activations"]
    assert tower["tower_lora_state"] == 16 * tower["tower_lora_parameters"]    # float32 tensor, gradient, moments
    import peft

    pm = peft.get_peft_model(hf, peft.LoraConfig(r=8, target_modules=r".*vision_tower.*\.fc1", rank_pattern={"fc1": 2}))
    patterned = memory(capsys, folder, "--batch-size", "2", "--lora-targets", "q_proj,fc1", "--lora-rank-pattern",
                       "fc1=2")
    assert patterned["vision"]["tower_lora_parameters"] == sum(p.numel() for n, p in pm.named_parameters()
                                                               if "lora_" in n and ".head." not in n) > 0
    assert tower["tower_lora_parameters"] == 4 * patterned["vision"]["tower_lora_parameters"]
    tower4 = memory(capsys, folder, "--batch-size", "2", "--lora-targets", "q_proj,fc1", "--images-per-row", "2")
    assert tower4["vision"]["tower_activations"] == 2 * tower["tower_activations"]  # the images at once
    text = memory(capsys, folder, "--batch-size", "2", "--images-per-row", "0")
    assert one["total"] - text["total"] == v["tower_activations"] + v["image_inputs"]
    c = ModelConfig.from_folder(folder).hidden_size       # the image tokens' rows and blocks, embeddings, gradient
    assert v["image_inputs"] == 4 * (2 * 4 + 3 * 2 * 64 + 2 * 2 * 4 * c) and text["vision"]["image_inputs"] == 0
    from wgpu_train.cli.main import main

    assert main(["memory", "--model", str(folder), "--max-seq-len", "64", "--lora-targets", "q_proj,qkv"]) == 2
    assert "qkv is not a module of this model's vision tower" in capsys.readouterr().err   # Qwen's name


def test_pipeline_stages_count_their_image_inputs(folder, capsys):
    """`memory --pipeline-stages 2` with images: the first stage holds each micro-batch's image embeddings and
    their gradient (float32 here), every stage the image tokens' rows and the blocks of every token, for each
    micro-batch in flight (GPipe: all of a step's); in each stage's total; none without images."""
    from wgpu_train.models.config import ModelConfig

    c = ModelConfig.from_folder(folder).hidden_size
    args = ("--batch-size", "2", "--pipeline-stages", "2", "--pipeline-micro-batches", "3", "--pipeline-schedule",
            "gpipe")
    out = memory(capsys, folder, *args, "--images-per-row", "2")
    n, tokens = 2 * 2 * 4, 2 * 64               # 2 rows of 2 images of 4 tokens; 2 rows of 64 tokens
    first, later = out["stages"]
    assert later["image_inputs"] == 1 * (n + 3 * tokens) * 4         # the last stage: one micro-batch in flight
    assert first["image_inputs"] == 3 * ((n + 3 * tokens) * 4 + 2 * n * c * 4)
    text = memory(capsys, folder, *args, "--images-per-row", "0")
    for stage, bare in zip(out["stages"], text["stages"]):
        assert stage["total"] - bare["total"] == stage["image_inputs"] and bare["image_inputs"] == 0
    from wgpu_train.cli.main import main

    assert main(["memory", "--model", str(folder), "--max-seq-len", "64", "--backend", "numpy",
                 "--pipeline-stages", "2"]) == 0
    assert "image inputs" in capsys.readouterr().out


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


def test_pan_and_scan_counts_the_most_crops(folder, tmp_path, capsys):
    """With do_pan_and_scan each image is counted with pan_and_scan_max_num_crops crops beside it (each its own
    boi, tokens and eoi), and the output says the processor's sentences around them are not counted."""
    import shutil

    from wgpu_train.cli.main import main

    shutil.copy(folder / "config.json", tmp_path / "config.json")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"do_pan_and_scan": True,
                                                                   "pan_and_scan_max_num_crops": 3}))
    plain = memory(capsys, folder, "--batch-size", "2")["vision"]
    v = memory(capsys, tmp_path, "--batch-size", "2")["vision"]
    assert plain["crops"] == 0 and v["crops"] == 3 and v["tokens_per_image"] == 4 * (4 + 2)
    assert v["tower_activations"] > plain["tower_activations"]
    assert main(["memory", "--model", str(tmp_path), "--max-seq-len", "64", "--backend", "numpy"]) == 0
    assert "pan-and-scan: each image counted with the most crops, 3" in capsys.readouterr().out


def test_the_tower_activations_match_a_measured_peak(tmp_path):
    """The estimate of the tower's peak against tracemalloc's over the NumPy tower's forward: frozen (one image
    at a time) and keeping every layer for LoRA's backward (the images at once), on a tower of 256 patches where
    the attention scores and the layers' activations both weigh."""
    import tracemalloc

    import numpy as np

    from tiny_models import hf_config
    from tolerances import TOLERANCES
    from wgpu_train.engines.vision_model import load_vision_model
    from wgpu_train.models.vision import tower_activation_values

    vision = tf.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=112, patch_size=7)
    cfg = tf.Gemma3Config(text_config=hf_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                          boi_token_index=80, eoi_token_index=81, image_token_index=82, mm_tokens_per_image=16)
    tf.Gemma3ForConditionalGeneration(cfg).save_pretrained(tmp_path)
    vm = load_vision_model(tmp_path)
    pixels = np.random.default_rng(0).normal(size=(2, 3, 112, 112)).astype(np.float32)
    rtol = TOLERANCES["vision_tower_memory"].rtol
    for trained, run in ((False, vm.tower), (True, lambda px: vm.tower.forward(px, keep=True))):
        run(pixels)
        tracemalloc.start()
        try:
            run(pixels)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        estimate = 4 * tower_activation_values(vm.vision, 2, trained)
        print(f"trained {trained}: estimate {estimate} bytes, tracemalloc peak {peak}")
        assert abs(estimate - peak) <= rtol * peak, (trained, estimate, peak)
