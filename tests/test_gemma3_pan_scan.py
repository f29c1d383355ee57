"""Gemma 3's pan-and-scan (do_pan_and_scan): a wide, a tall and a small image's crops and pixel_values, the records'
placeholders expanded as Gemma3Processor expands them, and logits and LoRA gradients with a wide image's crops
against transformers + PEFT (the tiny chat model of test_gemma3_vision_training.py)."""
from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

from wgpu_train.errors import ConfigError, DataError

from finetune_helpers import peft_random_b
from test_gemma3_vision import SIDE, Image, Gemma3ImageProcessorPil, image_blocks, load_vision_model, peft, torch
from test_gemma3_vision_training import chat_vlm  # noqa: F401  (the tiny chat vision model fixture)
from tolerances import assert_close

PAN = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=10, pan_and_scan_max_num_crops=4,
           pan_and_scan_min_ratio_to_activate=1.2)
# (height, width): wide 4 crops (the last cut at the edge), tall 2 (cut too), small none (a crop under 10 pixels)
SIZES = {"wide": ((20, 75), 4), "tall": ((61, 29), 2), "small": ((9, 31), 0)}


def picture(kind: str, seed: int = 0):
    (h, w), _ = SIZES[kind]
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def pan_settings():
    from wgpu_train.data.images import ImageSettings

    return ImageSettings.from_dict(Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}, **PAN).to_dict(), SIDE)


def test_crops_and_pixel_values_equal_the_processors():
    """Each image then its crops, resized, rescaled and normalised: the processor's pixel_values bit for bit, and
    its num_crops from the image's size alone; the refusals in one line."""
    from wgpu_train.data.images import ImageSettings

    proc = Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}, **PAN)
    settings = pan_settings()
    pics = [picture(kind, i) for i, kind in enumerate(SIZES)]
    want = proc(images=pics, return_tensors="np")
    assert want["num_crops"].tolist() == [n for _, n in SIZES.values()]
    assert [settings.n_crops(p) for p in pics] == [n for _, n in SIZES.values()]
    got = settings.batch(pics)
    assert got.shape == (1 + 4 + 1 + 2 + 1, 3, SIDE, SIDE)
    np.testing.assert_array_equal(got, want["pixel_values"])
    assert ImageSettings.from_dict({}, SIDE).crop_boxes(20, 75) == []          # off: no crops
    with pytest.raises(ConfigError, match="at least 1") as e:
        ImageSettings.from_dict({**PAN, "pan_and_scan_max_num_crops": 0}, SIDE)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="without do_resize"):
        ImageSettings.from_dict({**PAN, "do_resize": False}, SIDE)
    with pytest.raises(DataError, match="leaves its last crop empty"):       # the processor's crop would be empty
        ImageSettings.from_dict({**PAN, "pan_and_scan_min_crop_size": 1}, SIDE).crop_boxes(1, 5)
    with pytest.raises(DataError, match="not pixel arrays"):
        settings.n_crops(np.zeros((3, SIDE, SIDE), np.float32))


@pytest.fixture(scope="module")
def pan_folder(chat_vlm, tmp_path_factory):  # noqa: F811
    """The tiny chat model's folder with pan-and-scan turned on in its preprocessor_config.json (and room for its
    crops' runs and sentences, which the tiny tokenizer spells in short pieces: RoPE has no table to outgrow)."""
    _, folder, _ = chat_vlm
    out = tmp_path_factory.mktemp("gemma3_pan_scan") / "model"
    shutil.copytree(folder, out)
    raw = json.loads((out / "preprocessor_config.json").read_text())
    (out / "preprocessor_config.json").write_text(json.dumps({**raw, **PAN}))
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 512
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def record(kinds: list):
    return {"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it?"}]},
        {"role": "assistant", "content": "red"},
        *([{"role": "user", "content": [{"type": "text", "text": "and this"}] + [{"type": "image"}] * (len(kinds) - 1)},
           {"role": "assistant", "content": "blue"}] if len(kinds) > 1 else [])],
        "images": [picture(k, i) for i, k in enumerate(kinds)]}


def test_records_expand_as_gemma3_processor(chat_vlm, pan_folder):  # noqa: F811
    """A record with a wide, a tall and a small image: input_ids (the original's run and one per crop, with the
    processor's sentences), token_type_ids and pixel_values equal Gemma3Processor's with do_pan_and_scan."""
    from wgpu_train.data.vision_records import model_image_span, tokenize_vision_dataset
    from wgpu_train.formats.tokenizer import load_tokenizer

    _, _, proc = chat_vlm
    tok = load_tokenizer(pan_folder)
    vm = load_vision_model(pan_folder)
    span = model_image_span(tok, vm.vision, pan_folder)
    assert span.settings.pan_and_scan and vm.image_span(tok) == span
    rec = record(["wide", "tall", "small"])
    (ex,), stats = tokenize_vision_dataset(tok, [rec], span, 2000)
    text = proc.apply_chat_template(rec["messages"], tokenize=False)
    want = proc(text=[text], images=[rec["images"]], return_tensors="np", **PAN)
    np.testing.assert_array_equal(ex.input_ids, want["input_ids"][0])
    np.testing.assert_array_equal(image_blocks(ex.input_ids[None], 7) >= 0, want["token_type_ids"] == 1)
    assert image_blocks(ex.input_ids[None], 7).max() == 1 + 4 + 1 + 2 + 1 - 1        # a block per crop
    np.testing.assert_array_equal(vm.pixel_values(ex.images), want["pixel_values"])
    assert tok.decode(ex.labels[ex.labels >= 0].tolist(), skip_special_tokens=False) == \
        "red<end_of_turn>blue<end_of_turn>"
    with pytest.raises(DataError, match="pass the images"):
        span.expansion()


def test_logits_and_lora_gradients_with_a_wide_image_match_peft(chat_vlm, pan_folder, tmp_path):  # noqa: F811
    """One wide image's four crops beside it, each its own bidirectional block: logits within 1e-4 of transformers
    and the LoRA gradients PEFT's."""
    from wgpu_train.data.vision_records import model_image_span, tokenize_vision_dataset
    from wgpu_train.formats.tokenizer import load_tokenizer

    hf, _, proc = chat_vlm
    tok = load_tokenizer(pan_folder)
    vm = load_vision_model(pan_folder)
    rec = record(["wide"])
    (ex,), _ = tokenize_vision_dataset(tok, [rec], model_image_span(tok, vm.vision, pan_folder), 2000)
    ids, labels = ex.input_ids[None].astype(np.int64), ex.labels[None]
    want = proc(text=[proc.apply_chat_template(rec["messages"], tokenize=False)], images=[rec["images"]],
                return_tensors="np", **PAN)
    kw = dict(attention_mask=torch.ones(ids.shape, dtype=torch.long), pixel_values=torch.tensor(want["pixel_values"]),
              token_type_ids=torch.tensor(want["token_type_ids"]))
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", lora_dropout=0.0)))
    out = pm(input_ids=torch.tensor(ids), labels=torch.tensor(labels), **kw)
    out.loss.backward()
    pm.save_pretrained(tmp_path / "a")
    vm.model.load_adapter(tmp_path / "a")
    assert_close(vm.logits(ids, ex.images), out.logits.detach().numpy(), "logits_f32", "pan-and-scan logits")
    loss, grads = vm.loss_and_grads(ids, labels, ex.images)
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "pan-and-scan loss")
    expected = {n.replace(".default", "").replace("model.language_model.", "model."): p.grad.numpy()
                for n, p in pm.named_parameters() if p.requires_grad}
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def test_generate_and_chat_with_a_wide_image_answer_as_transformers(chat_vlm, pan_folder, tmp_path,  # noqa: F811
                                                                     monkeypatch, capsys):
    """`generate --image` and `chat`'s /image with a wide image: transformers' greedy answer over the processor's
    pan-and-scan inputs, token for token."""
    from test_chat_vision import QUESTION, run_chat
    from wgpu_train.cli.main import main
    from wgpu_train.formats.tokenizer import load_tokenizer

    hf, _, proc = chat_vlm
    path = tmp_path / "wide.png"
    picture("wide", 9).save(path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    inputs = proc(text=[proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)],
                  images=[[Image.open(path)]], return_tensors="pt", **PAN)
    assert inputs["pixel_values"].shape[0] == 5
    stops = list(load_tokenizer(pan_folder).stop_token_ids)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=5, do_sample=False, eos_token_id=stops,
                          pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    want = load_tokenizer(pan_folder).decode([t for t in out if t not in stops])
    assert len(out) == 5 and want.strip()       # an answer to compare, not an immediate stop
    assert main(["generate", "--model", str(pan_folder), "--prompt", QUESTION, "--image", str(path),
                 "--max-new-tokens", "5", "--backend", "numpy"]) == 0
    assert capsys.readouterr().out == want + "\n"
    answers, _ = run_chat(monkeypatch, capsys, pan_folder, f"/image {path}\n{QUESTION}\n")
    assert answers[0] == want
