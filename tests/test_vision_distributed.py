"""Images beyond one process and one adapter file: the image files in a resume's data fingerprint, data-parallel
workers (threads) with images equal to one process, LoRA on the vision tower from the CLI's --lora-targets."""
from __future__ import annotations

import json

import numpy as np
import pytest

import wgpu_train
from wgpu_train.errors import ConfigError

from test_gemma3_vision import Image, open_image
from test_gemma3_vision_training import chat_vlm, vision_records, write_vision_data  # noqa: F401  (chat_vlm: fixture)


def _run_kw(folder, data, **kw):
    base = dict(model=str(folder), data=str(data), backend="numpy", batch_size=2, lr=1e-2, valid_split=0.0,
                lora_targets=("q_proj", "v_proj"), no_progress=True, log_every=1)
    return base | kw


# ---- the resume fingerprint covers the image files ------------------------------------------------------------

def test_fingerprint_hashes_the_image_files(tmp_path):
    from wgpu_train.data.batching import BatchStream, Example

    for k, colour in enumerate(((255, 0, 0), (0, 0, 255))):
        Image.new("RGB", (6, 5), colour).save(tmp_path / f"{k}.png")
    ids, labels = np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int64)

    def fingerprint(*images):
        return BatchStream([Example(ids, labels, images=list(images))], 1, 0).fingerprint()
    first = fingerprint(str(tmp_path / "0.png"))
    assert first == fingerprint(str(tmp_path / "0.png")) == fingerprint({"bytes": (tmp_path / "0.png").read_bytes()})
    assert first != fingerprint(str(tmp_path / "1.png")) and first != fingerprint()
    assert fingerprint(open_image(str(tmp_path / "0.png"))) != fingerprint(open_image(str(tmp_path / "1.png")))


def test_a_changed_image_file_refuses_the_resume(chat_vlm, tmp_path):
    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    kw = _run_kw(folder, data, out=str(tmp_path / "run"))
    wgpu_train.finetune(max_steps=1, **kw)
    open_image(str(tmp_path / "data" / "1_0.png")).transpose(0).save(tmp_path / "data" / "1_0.png")   # mirrored
    with pytest.raises(ConfigError, match="the training data changed since the checkpoint .*image files") as e:
        wgpu_train.finetune(max_steps=2, resume=str(tmp_path / "run"), **kw)
    assert "\n" not in str(e.value)
