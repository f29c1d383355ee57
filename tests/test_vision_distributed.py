"""Images beyond one process and one adapter file: the image files in a resume's data fingerprint, data-parallel
workers (threads) with images equal to one process, LoRA on the vision tower from the CLI's --lora-targets."""
from __future__ import annotations

import json

import numpy as np
import pytest

import wgpu_train
from wgpu_train.errors import ConfigError

from test_gemma3_vision import Image, open_image
from tolerances import assert_close
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


# ---- data-parallel workers with images ------------------------------------------------------------------------

def _adapter(folder):
    from wgpu_train.formats.safetensors import read_safetensors

    return read_safetensors(folder / "adapter_model.safetensors")


def _losses(folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "split" not in r]


def _assert_same_run(a, b, tolerance):
    ta, tb = _adapter(a), _adapter(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert_close(tb[k], ta[k], tolerance, k)
    assert max(float(np.abs(ta[k]).max()) for k in ta if "lora_B" in k) > 1e-3     # it trained
    assert_close(np.array(_losses(b)), np.array(_losses(a)), tolerance, "losses")
    assert len(_losses(a)) == 3


def test_two_workers_with_images_equal_one_process(chat_vlm, tmp_path):
    """Two data-parallel workers (threads, an in-process collective), each running its rows' images through its
    own tower: the losses and the adapter after 3 steps (LoRA dropout on) are one process's with the whole batch."""
    from test_data_parallel import run_threads
    from wgpu_train.training.config import TrainConfig
    from wgpu_train.training.trainer import Trainer

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records() + vision_records()[:1])     # 4 records
    kw = _run_kw(folder, data, batch_size=1, max_steps=3, lora_dropout=0.1)
    Trainer(TrainConfig(out=str(tmp_path / "one"), grad_accum=2, **kw)).run()
    run_threads(TrainConfig(out=str(tmp_path / "two"), num_workers=2, **kw), 2)
    _assert_same_run(tmp_path / "one", tmp_path / "two", "data_parallel_numpy")
