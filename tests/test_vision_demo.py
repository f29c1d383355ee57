"""The embedded image demo (`wgpu-train finetune --images-demo`): its pictures and records, the shipped tiny Gemma 3
vision model and tokenizer, and a short run through the CLI with exact match before and after."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("PIL", reason="the image demo draws its pictures with Pillow (the vision extra)")


def test_demo_pictures_show_their_answer():
    """Each picture is white with one square whose shade is nearest the answer's colour; the colours are balanced
    and the splits are the same on every call."""
    from wgpu_train.data.vision_demo import COLOURS, demo_records, image_demo_splits

    records = demo_records(0, 25)
    for r in records:
        px = np.asarray(r["images"][0]).reshape(-1, 3).astype(int)
        square = px[(px != 255).any(axis=1)].mean(axis=0)
        nearest = min(COLOURS, key=lambda c: np.abs(np.array(COLOURS[c]) - square).sum())
        assert nearest == r["messages"][1]["content"]
        assert 100 <= len(px) - ((px == 255).all(axis=1)).sum() <= 24 * 24
    assert {r["messages"][1]["content"] for r in records} == set(COLOURS)
    a, b = image_demo_splits(), image_demo_splits()
    assert (len(a.train), len(a.valid), len(a.test)) == (320, 20, 40) and a.format == "vision"
    assert np.array_equal(np.asarray(a.test[3]["images"][0]), np.asarray(b.test[3]["images"][0]))
    assert not np.array_equal(np.asarray(a.train[0]["images"][0]), np.asarray(a.test[0]["images"][0]))


def test_shipped_vision_model_reads_the_demo():
    """The embedded model folder loads as a VisionModel; each record is one image of 4 tokens and the answer one
    trained token plus the end of turn."""
    from wgpu_train.assets import default_vision_model_dir
    from wgpu_train.data.vision_demo import demo_records
    from wgpu_train.data.vision_records import ImageSpan, tokenize_vision_dataset
    from wgpu_train.engines.vision_model import load_vision_model
    from wgpu_train.formats.tokenizer import load_tokenizer

    folder = default_vision_model_dir()
    assert sum(f.stat().st_size for f in folder.iterdir()) < 1 << 20
    vm = load_vision_model(folder)
    tok = load_tokenizer(folder)
    vc = vm.vision
    span = ImageSpan.from_ids(tok, vc.boi_token_id, vc.image_token_id, vc.eoi_token_id, vc.mm_tokens_per_image)
    examples, stats = tokenize_vision_dataset(tok, demo_records(5, 5), span, 48)
    assert stats.n_examples == 5
    for e in examples:
        trained = e.labels[e.labels >= 0]
        assert len(trained) == 2 and tok.decode(trained[:1].tolist()) in ("red", "green", "blue", "yellow", "purple")
        assert int((e.input_ids == vc.image_token_id).sum()) == 4
    embeds = vm.tower(vm.pixel_values([examples[0].images[0], examples[1].images[0]]))
    assert np.abs(embeds[0] - embeds[1]).max() > 1e-2        # the projector is not zero: pictures reach the text


def test_cli_images_demo_runs_and_measures_exact_match(tmp_path, capsys):
    """Three steps of the demo through the CLI (its recipe, on the engine auto chooses): exact match before
    (0%) and after measured on test pictures, the validation loss falls; the run resumes as it was run; --model
    with --images-demo is refused."""
    from wgpu_train.cli.main import main

    out = tmp_path / "demo"
    assert main(["finetune", "--images-demo", "--max-steps", "3", "--max-eval-samples", "5", "--out", str(out),
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "exact match before training: 0.0% of 5 test samples" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["images"] == 340 and summary["exact_match_n"] == 5
    assert summary["valid_loss_after"] < summary["valid_loss_before"]
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["images_demo"] is True and recorded["lr"] == 1e-2 and recorded["data"] is None
    assert main(["finetune", "--resume", str(out), "--max-steps", "4", "--no-progress"]) == 0     # as it was run
    capsys.readouterr()
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    assert main(["finetune", "--images-demo", "--model", str(out), "--out", str(tmp_path / "x")]) == 2
    assert "--images-demo trains the embedded vision model" in capsys.readouterr().err
