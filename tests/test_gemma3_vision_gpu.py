"""Gemma 3 with images on the WebGPU engine against the NumPy engine (the oracle, itself checked against
transformers in test_gemma3_vision.py): the tower on the CPU feeding the language model on the GPU; logits, loss,
LoRA gradients and the image rows' gradient, a train step in one submission, greedy generation with an image
through DecodeBatch beside a text row, `chat --backend wgpu` with an image."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import require_adapter
from finetune_helpers import peft_random_b
from test_chat_vision import QUESTION, image_question, run_chat
from test_gemma3_vision_training import chat_vlm  # noqa: F401  (the tiny chat vision model fixture)
from tiny_models import hf_config
from tolerances import assert_close

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil  # noqa: E402

from wgpu_train.engines.generate import DecodeBatch  # noqa: E402
from wgpu_train.engines.protocol import OptimizerParams  # noqa: E402
from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402

BOI, EOI, IMG = 80, 81, 82
SIDE = 42
RUN = [BOI] + [IMG] * 4 + [EOI]


def save_tiny_vision(folder, **text):
    """A tiny Gemma 3 with images (head dim 16: the flash kernels take image blocks; a window of 7 cuts through
    the second image's block; text: more text config) saved in folder, its LoRA on q, v and down in
    folder.parent / "adapter"."""
    vision = tf.SiglipVisionConfig(hidden_size=18, intermediate_size=23, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=SIDE, patch_size=7)
    cfg = tf.Gemma3Config(text_config=hf_config("gemma3", sliding_window=7, head_dim=16, **text).to_dict(),
                          vision_config=vision.to_dict(), boi_token_index=BOI, eoi_token_index=EOI,
                          image_token_index=IMG, mm_tokens_per_image=4)
    torch.manual_seed(0)
    hf = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}).save_pretrained(folder)
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", lora_dropout=0.0)))
    pm.save_pretrained(folder.parent / "adapter")


def load_pair(folder, **load_kw):
    """(NumPy VisionModel, WebGPU VisionModel) of the model save_tiny_vision saved in folder, with its LoRA
    (load_kw: more load_model settings for both)."""
    models = load_vision_model(folder, **load_kw), load_vision_model(folder, backend="wgpu", **load_kw)
    for vm in models:
        vm.model.load_adapter(folder.parent / "adapter")
    return models


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(NumPy VisionModel, WebGPU VisionModel) of save_tiny_vision's model with the same LoRA."""
    require_adapter()
    folder = tmp_path_factory.mktemp("gemma3_vision_gpu")
    save_tiny_vision(folder)
    return load_pair(folder)


def batch():
    """(ids, mask, labels, pixels): row 0 with two images, row 1 with one and right padding."""
    ids = np.array([[5, 6, *RUN, 7, 8, *RUN, 9, 10, 11], [12, *RUN, 13, 14, 15, 16, 17, 18] + [0] * 6])
    mask = np.ones_like(ids)
    mask[1, 13:] = 0
    labels = np.where((mask == 1) & (ids != IMG), ids, -100)
    return ids, mask, labels, np.random.default_rng(4).standard_normal((3, 3, SIDE, SIDE)).astype(np.float32)


def test_logits_loss_gradients_and_image_grad_equal_numpys(pair):
    """The image embeddings scattered over their rows on the device, each image's block bidirectional in the
    forward and the backward: logits, loss, LoRA gradients and image_grad (read back only when asked) equal the
    NumPy engine's; a forward_backward with images is one submission."""
    cpu, gpu = pair
    ids, mask, labels, px = batch()
    real = mask.astype(bool)
    assert_close(gpu.logits(ids, px, mask)[real], cpu.logits(ids, px, mask)[real], "logits_f32", "with images")
    (la, ga), (lb, gb) = (vm.loss_and_grads(ids, labels, px, mask) for vm in (cpu, gpu))
    assert_close(np.float64(lb), la, "loss_f32", "loss with images")
    assert set(ga) == set(gb) and ga
    for name in ga:
        assert_close(gb[name], ga[name], "grads_f32", name)
    engine = gpu.model.engine
    want = cpu.model.engine.image_grad
    assert want.shape == (12, 30) and np.abs(want).max() > 1e-3
    assert_close(engine.image_grad, want, "grads_f32", "image_grad")
    engine.set_images(gpu.image_tokens(ids, px))
    try:
        before = dict(engine.counters)
        seg = mask.astype(np.int32)
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
        engine.forward_backward(gpu._text_ids(ids).astype(np.int32), np.roll(labels, -1, axis=1), seg, pos, 1.0)
        assert engine.counters["submits"] - before["submits"] == 1
        assert engine.counters["readbacks"] - before["readbacks"] == 1      # the loss, not the image rows
    finally:
        engine.set_images(None)


def test_train_step_with_images_equals_numpys(pair):
    """Two micro-batches, each with its own images (ImageTokens at the end of the micro-batch), in one train_step:
    the same loss, norm and updated LoRA as the NumPy engine's step, and one submission per step on the device."""
    cpu, gpu = pair
    ids, mask, labels, px = batch()
    targets = np.roll(labels, -1, axis=1)
    targets[:, -1] = -100
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    hp = OptimizerParams(lr=1e-2)
    out = []
    for vm in pair:
        mbs = [(vm._text_ids(ids[r:r + 1]).astype(np.int32), targets[r:r + 1], mask[r:r + 1].astype(np.int32),
                pos[r:r + 1], vm.image_tokens(ids[r:r + 1], px[:2] if r == 0 else px[2:])) for r in (0, 1)]
        engine = vm.model.engine
        loss, count, norm, applied = engine.train_step(mbs, hp, 1)
        assert applied
        out.append((loss, count, norm, engine.lora_tensors()))
        engine.train_step(mbs, hp, 2)      # (both engines: the tests after this one compare them)
        if vm is gpu:       # the second step, its kernels tuned by the first: one submission
            assert engine.last_step["submits"] == 1
    (la, ca, na, wa), (lb, cb, nb, wb) = out
    assert ca == cb and set(wa) == set(wb)
    assert_close(np.float64(lb), la, "loss_f32", "train_step loss")
    assert_close(np.float64(nb), na, "grads_f32", "train_step norm")
    for path in wa:
        for a, b in zip(wa[path], wb[path]):
            assert_close(b, a, "grads_f32", path)


def test_greedy_generation_with_an_image_through_decode_batch(pair):
    """An image prompt prefilled whole (its block bidirectional in the cached attention) beside a text row in one
    DecodeBatch: each row's greedy tokens equal the NumPy engine's, and VisionModel.generate's too."""
    prompt = np.array([5, *RUN, 6, 7])
    px = batch()[3][:1]
    got = []
    for vm in pair:
        rows = DecodeBatch(vm.model.engine, 2, 32, token_budget=16)
        try:
            ids, tokens = vm.prompt_images(prompt, px)
            rows.add(np.array([9, 10, 11]), 5)
            rows.add(ids, 5, images=tokens)
            out: dict = {}
            while len(rows):
                for t in rows.step():
                    out.setdefault(t.slot, []).append(t.id)
            got.append(out)
        finally:
            rows.close()
        got.append(vm.generate(prompt, px, max_new_tokens=5))
    assert got[0] == got[2] and got[1] == got[3]


def test_chat_with_an_image_on_the_webgpu_engine(chat_vlm, tmp_path, monkeypatch, capsys):  # noqa: F811
    """`chat --backend wgpu` (the tiny chat model's head dim of 14: the scalar per-row attention kernels take its
    image blocks): an image turn answered as the NumPy engine's `generate --image` answers it."""
    _, folder, _ = chat_vlm
    path, want = image_question(folder, tmp_path, capsys)
    answers, _ = run_chat(monkeypatch, capsys, folder, f"/image {path}\n{QUESTION}\n", "--backend", "wgpu")
    assert answers == [want]
