"""Qwen3-VL with images on the NumPy engine against transformers' Qwen3VLForConditionalGeneration and PEFT: the
image processor's pixel_values and grids, the tower's merged and DeepStack features, logits with M-RoPE positions
and DeepStack additions, LoRA gradients on the language model, greedy generation, `finetune` on TRL's vision
records and `generate --image`, and the refusals."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from wgpu_train.errors import ConfigError, DataError

from bpe import tokenizer_folder, train_bpe
from finetune_helpers import peft_random_b
from tolerances import assert_close

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
Image = pytest.importorskip("PIL.Image")

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

from wgpu_train.data.qwen_images import QwenImageSettings  # noqa: E402
from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402
from wgpu_train.models.vision import VisionConfig  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
START, END, PAD = 3, 4, 5          # <|vision_start|>, <|vision_end|>, <|image_pad|>
# Qwen3-VL's chat template, its image, video and text parts (tools and thinking left out)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["user what colour is it? assistant red blue green", "describe the picture and this squares"]


def tiny_config(vocab: int):
    vision = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=[1, 0])      # out of order: each merger's features go by block order
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    return tf.Qwen3VLConfig(vision_config=vision, text_config=text, image_token_id=PAD, video_token_id=6,
                            vision_start_token_id=START, vision_end_token_id=END)


# Qwen3VLVideoProcessor's settings for tiny clips (a clip of 256 to 4096 pixels)
VIDEO_CONFIG = {"patch_size": 8, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
                "image_std": [0.5] * 3, "size": {"shortest_edge": 256, "longest_edge": 4096}, "fps": 2.0}


def processor(**kw):
    return Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": 16 * 16 * 4,
                                                               "longest_edge": 48 * 64}, **kw)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_vl")
    tok = train_bpe(CORPUS, 200, SPECIALS)
    tokenizer_folder(folder, tok, TEMPLATE, eos_token="<|im_end|>")
    torch.manual_seed(0)
    hf = tf.Qwen3VLForConditionalGeneration(tiny_config(tok.get_vocab_size())).eval()
    with torch.no_grad():       # the norms start at one, biases at zero: move every tensor
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(folder)
    processor().save_pretrained(folder)
    (folder / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))   # test_qwen3_vl_video.py's
    return hf, folder, load_vision_model(folder)


def images(n, seed=0):
    """Odd sizes: one about 40 x 56, a wide one, a small one (smart_resize rounds, scales down and up)."""
    rng = np.random.default_rng(seed)
    sizes = [(41, 57), (23, 90), (13, 11)]
    return [Image.fromarray(rng.integers(0, 256, (*sizes[i % 3], 3), dtype=np.uint8)) for i in range(n)]


def span(vm, img):
    return [START, *[PAD] * (int(np.prod(vm.pixel_values([img])[1])) // 4), END]


def hf_inputs(vm, ids, imgs):
    pixels, grids = vm.pixel_values(imgs)
    return dict(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids),
                mm_token_type_ids=torch.tensor((np.asarray(ids) == PAD).astype(np.int64)))


def test_pixel_values_equal_the_processors():
    """Odd sizes rounded, scaled down past max_pixels and up past min_pixels, RGBA over white: the processor's
    pixel_values and image_grid_thw, bit for bit."""
    proc = processor(resample=2)
    settings = QwenImageSettings.from_dict(proc.to_dict(), VisionConfig.from_config(tiny_config(90).to_dict()))
    rng = np.random.default_rng(1)
    for shape in ((41, 57, 3), (23, 90, 3), (13, 11, 3), (200, 170, 3), (37, 29, 4)):
        img = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
        want = proc(images=[img], return_tensors="np")
        pixels, grids = settings.batch([img])
        np.testing.assert_array_equal(pixels, want["pixel_values"])
        np.testing.assert_array_equal(grids, want["image_grid_thw"])
    assert settings.resample == 2 and settings.min_pixels == 1024 and settings.max_pixels == 3072


def test_tower_features_equal_transformers(vlm):
    """The tower over two images (patch GEMM, resampled positions, 2-D rotary, attention within each image):
    the merger's and the DeepStack mergers' features equal transformers'."""
    hf, _, vm = vlm
    pixels, grids = vm.pixel_values(images(2))
    with torch.no_grad():
        want = hf.model.visual(torch.tensor(pixels), grid_thw=torch.tensor(grids))
    embeds, deepstack = vm.tower(pixels, grids)
    assert_close(embeds, want.pooler_output.numpy(), "logits_f32", "merged features")
    assert len(deepstack) == 2
    for got, ref in zip(deepstack, want.deepstack_features):
        assert_close(got, ref.numpy(), "logits_f32", "DeepStack features")


def test_logits_with_images_match_transformers(vlm):
    """Two images in a row, text between and after: logits within 1e-4 of transformers (M-RoPE's 3-D positions,
    the text after an image counting on from its longer side, DeepStack on the first two layers); without the
    positions or the DeepStack features they would differ."""
    hf, _, vm = vlm
    imgs = images(2)
    ids = np.array([[7, 8, *span(vm, imgs[0]), 9, 10, *span(vm, imgs[1]), 11, 12, 13]])
    with torch.no_grad():
        want = hf(**hf_inputs(vm, ids, imgs)).logits.numpy()
    assert_close(vm.logits(ids, imgs), want, "logits_f32", "with images")
    tokens = vm.image_tokens(ids, imgs)
    for broken in ({"positions": None}, {"deepstack": ()}):
        import dataclasses
        vm.model.engine.set_images(dataclasses.replace(tokens, **broken))
        try:
            other = vm.model.logits(vm._text_ids(ids))
        finally:
            vm.model.engine.set_images(None)
        assert np.abs(other - want).max() > 1e-3


def test_lora_gradients_with_images_match_peft(vlm):
    """LoRA on the language model (the tower frozen), a batch of two rows, one right-padded: loss and every LoRA
    gradient equal PEFT's autograd, the adapter read from PEFT's files (model.language_model)."""
    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", lora_dropout=0.0)))
    vm = load_vision_model(folder)
    imgs = images(3, seed=3)
    rows = [[7, *span(vm, imgs[0]), 11, 12, *span(vm, imgs[1]), 13, 14], [8, 9, *span(vm, imgs[2]), 15]]
    width = max(map(len, rows))
    ids = np.array([r + [0] * (width - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = np.where((ids != PAD) & (mask == 1), ids, -100)
    out = pm(**hf_inputs(vm, ids, imgs), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default", "").replace("model.language_model.", "model."): p.grad.numpy()
                for n, p in pm.named_parameters() if p.requires_grad}
    pm.save_pretrained(folder.parent / "qwen3_vl_adapter")
    vm.model.load_adapter(folder.parent / "qwen3_vl_adapter")
    loss, grads = vm.loss_and_grads(ids, labels, imgs, attention_mask=mask)
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "loss with images")
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def test_greedy_generation_with_images_matches_transformers(vlm):
    """The prompt prefilled with its images, then each new token at its M-RoPE position (past the images' longer
    sides, not its cache row): transformers' greedy tokens."""
    hf, _, vm = vlm
    imgs = images(2, seed=5)
    ids = np.array([7, *span(vm, imgs[0]), 8, *span(vm, imgs[1]), 9])
    with torch.no_grad():
        want = hf.generate(**hf_inputs(vm, ids[None], imgs), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert vm.generate(ids, imgs, max_new_tokens=8) == want



def test_two_pipeline_stages_give_one_process_loss_gradients_and_answers(vlm):
    """The language model as 2 NumPy pipeline stages: every stage takes the images' M-RoPE positions and the stage
    holding a DeepStack layer its features, in training and in generation's prefill (stage_rows) and decode: one
    process's loss, LoRA gradients and greedy tokens, also in a DecodeBatch (serve's) beside a text row."""
    import wgpu_train
    from wgpu_train.distributed.pipeline_model import inference_plan, pipeline_model
    from wgpu_train.engines.generate import DecodeBatch
    from wgpu_train.engines.vision_model import attach_vision
    from wgpu_train.models.config import ModelConfig

    _, folder, _ = vlm
    cfg = ModelConfig.from_folder(folder)
    staged = attach_vision(pipeline_model(folder, cfg, inference_plan(cfg, 2, None), backend="numpy", local=True),
                           folder)
    one = load_vision_model(folder)
    for vm in (staged, one):
        vm.model.add_lora(wgpu_train.LoraConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj")), seed=3)
    imgs = images(2, seed=3)
    ids = np.array([[7, *span(one, imgs[0]), 11, 12, *span(one, imgs[1]), 13, 14]])
    (loss_s, grads_s), (loss_1, grads_1) = (vm.loss_and_grads(ids, ids, imgs) for vm in (staged, one))
    assert_close(np.float64(loss_s), loss_1, "pipeline_numpy", "loss")
    for k in grads_1:
        assert_close(grads_s[k], grads_1[k], "pipeline_numpy", k)
    answers = [vm.generate(ids[0, :-2], imgs, max_new_tokens=6) for vm in (staged, one)]
    assert answers[0] == answers[1] and len(answers[0]) == 6
    # serve's continuous batching over the stages: the image row (its M-RoPE shift in every decode step) beside a
    # text row, each one process's answer alone
    batch = DecodeBatch(staged.model.engine, 2, 48)
    text = batch.add([7, 11, 12], 6)
    prompt, tokens = staged.prompt_images(ids[0, :-2], imgs)
    row = batch.add(prompt, 6, images=tokens)
    out = {text: [], row: []}
    while len(batch):
        for t in batch.step():
            out[t.slot].append(t.id)
    batch.close()
    assert out[row] == answers[1] and out[text] == one.model.generate([7, 11, 12], max_new_tokens=6)
    staged.model.engine.close()

def records():
    red, blue = Image.new("RGB", (57, 41), (255, 0, 0)), Image.new("RGB", (40, 56), (0, 0, 255))
    return [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images": [red]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "and this"}, {"type": "image"}]},
                          {"role": "assistant", "content": "blue"}], "images": [blue]}]


def test_records_expand_as_the_processor_does(vlm):
    """TRL's vision records: each <|image_pad|> of the chat template repeated once per merged patch, as Qwen3-VL's
    processor expands it from image_grid_thw; labels on the assistant's tokens only."""
    from wgpu_train.data.vision_records import model_image_span, tokenize_vision_dataset
    from wgpu_train.formats.tokenizer import load_tokenizer

    _, folder, vm = vlm
    tok = load_tokenizer(folder)
    hf_tok = tf.AutoTokenizer.from_pretrained(folder)
    (examples, stats), recs = tokenize_vision_dataset(tok, records(), model_image_span(tok, vm.vision, folder),
                                                      400), records()
    assert stats.n_examples == 2
    for ex, rec in zip(examples, recs):
        text = hf_tok.apply_chat_template(rec["messages"], tokenize=False)
        grids = processor()(images=rec["images"], return_tensors="np")["image_grid_thw"]
        parts = text.split("<|image_pad|>")
        text = parts[0] + "".join("<|image_pad|>" * int(g.prod() // 4) + p for g, p in zip(grids, parts[1:]))
        np.testing.assert_array_equal(ex.input_ids, hf_tok(text)["input_ids"])
        assert not set(ex.labels[ex.labels >= 0].tolist()) & {START, END, PAD}


def test_cli_finetune_and_generate_with_images(vlm, tmp_path, capsys):
    """`finetune --data` of TRL's vision records on Qwen3-VL (the NumPy engine): the loss falls and the adapter
    loads in PEFT; `generate --image` with it gives transformers' greedy answer with the same adapter."""
    hf, folder, _ = vlm
    check_cli_finetune_and_generate(hf, folder, tmp_path, capsys, "q_proj,v_proj", span, hf_inputs)


def check_cli_finetune_and_generate(hf, folder, tmp_path, capsys, targets: str, span, hf_inputs):
    """`finetune --data` of records() on the Qwen-style model in `folder` (hf: transformers' twin) with LoRA on
    `targets`, 6 steps on the NumPy engine: the loss falls and the adapter loads in PEFT; `generate --image` with it
    gives transformers' greedy answer (span / hf_inputs: the model's test helpers)."""
    from test_gemma3_vision_training import write_vision_data
    from wgpu_train.cli.main import main
    from wgpu_train.formats.tokenizer import load_tokenizer

    data = write_vision_data(tmp_path / "data", records())
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", "numpy", "--max-steps", "6",
                 "--batch-size", "2", "--lr", "3e-2", "--lora-targets", targets, "--no-progress",
                 "--valid-split", "0", "--log-every", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["images"] == 2
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert losses[-1] < losses[0]
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), out).eval()
    img = records()[0]["images"][0]
    img.save(tmp_path / "red.png")
    tok, hf_tok = load_tokenizer(folder), tf.AutoTokenizer.from_pretrained(folder)
    vm = load_vision_model(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * (len(span(vm, img)) - 2))
    ids = np.array([hf_tok(text)["input_ids"]])
    with torch.no_grad():
        gen = pm.generate(**hf_inputs(vm, ids, [img]), max_new_tokens=4, do_sample=False,
                          eos_token_id=list(tok.stop_token_ids), pad_token_id=0)[0, ids.shape[1]:].tolist()
    want = tok.decode([t for t in gen if t not in tok.stop_token_ids])
    assert main(["generate", "--model", str(folder), "--adapter", str(out), "--prompt", "what colour?", "--image",
                 str(tmp_path / "red.png"), "--max-new-tokens", "4", "--backend", "numpy"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_refusals_in_one_line(vlm):
    _, folder, vm = vlm
    raw = json.loads((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match="vision_config.hidden_act 'gelu'"):
        VisionConfig.from_config({**raw, "vision_config": {**raw["vision_config"], "hidden_act": "gelu"}})
    with pytest.raises(ConfigError, match="mrope_section"):
        VisionConfig.from_config({**raw, "text_config": {**raw["text_config"], "rope_parameters": {
            "rope_type": "default", "mrope_section": [4, 2, 1]}}})
    with pytest.raises(ConfigError, match="patch_size 14 is not the vision tower's 8"):
        QwenImageSettings.from_dict({"patch_size": 14}, vm.vision)
    with pytest.raises(ConfigError, match="not a linear module of the vision tower's blocks or mergers"):
        vm.set_tower_lora({"base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight":
                           np.zeros((2, 32))}, 1.0)
    img = images(1)
    ids = np.array([[7, START, *[PAD] * 3, END]])
    with pytest.raises(DataError, match="3 image .and video. placeholder tokens for 1 images and videos of 12 "
                                        "tokens in all") as e:
        vm.logits(ids, img)
    assert "\n" not in str(e.value)


def test_auto_takes_the_webgpu_engine(vlm):
    """The WebGPU engine takes M-RoPE positions and DeepStack (test_qwen3_vl_wgpu.py): auto no longer sends
    Qwen3-VL to the NumPy engine for want of support, and a named adapter takes it."""
    from wgpu_train.engines.backend_choice import choose_backend
    from wgpu_train.engines.webgpu.support import unsupported_reason

    _, _, vm = vlm
    assert unsupported_reason(vm.model.config) is None
    choice = choose_backend("auto", cfg=vm.model.config, device="0")
    assert choice.engine == "wgpu" and "Qwen3-VL" not in choice.reason


def test_chat_image_turn_answers_as_generate_image(vlm, tmp_path, monkeypatch, capsys):
    """`chat` with /image on Qwen3-VL answers as `generate --image`."""
    import io

    from wgpu_train.cli.main import main

    _, folder, _ = vlm
    path = tmp_path / "x.png"
    images(1, seed=9)[0].save(path)
    assert main(["generate", "--model", str(folder), "--prompt", "what colour?", "--image", str(path),
                 "--max-new-tokens", "4", "--backend", "numpy"]) == 0
    want = capsys.readouterr().out.removesuffix("\n")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {path}\nwhat colour?\n"))
    assert main(["chat", "--model", str(folder), "--backend", "numpy", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == want


def test_packed_rows_count_positions_per_segment(vlm):
    """Two sequences with images packed in one row (segment ids 1 and 2): each segment's M-RoPE positions count
    from 0 and its logits equal the sequence's alone."""
    _, _, vm = vlm
    imgs = images(2, seed=11)
    first, second = [7, *span(vm, imgs[0]), 8, 9], [10, *span(vm, imgs[1]), 11]
    ids = np.array([first + second])
    seg = np.array([[1] * len(first) + [2] * len(second)], np.int32)
    pos = np.array([list(range(len(first))) + list(range(len(second)))], np.int32)
    engine = vm.model.engine
    engine.set_images(vm.image_tokens(ids, imgs, segments=seg))
    try:
        packed = engine.logits(vm._text_ids(ids).astype(np.int32), seg, pos)
    finally:
        engine.set_images(None)
    alone = np.concatenate([vm.logits(np.array([first]), imgs[:1]), vm.logits(np.array([second]), imgs[1:])], axis=1)
    assert_close(packed, alone, "logits_f32", "packed segments")


def test_memory_counts_the_tower_and_image_tokens(vlm, capsys):
    """`memory` on Qwen3-VL: the tower's weights as transformers builds them, the largest image the processor
    makes (longest_edge 3072 pixels: 12 merged patches and two markers) or what the row leaves it, the tower's
    peak over the step's images within the tracemalloc tolerance of the NumPy tower's, the DeepStack features (and
    their gradients) and M-RoPE positions on the device, all in the total; SigLIP's tower module names refused in one line (LoRA on
    Qwen's tower: test_qwen3_vl_tower_lora.py)."""
    import tracemalloc

    from wgpu_train.cli.main import main
    from tolerances import TOLERANCES

    hf, folder, vm = vlm

    def memory(*extra):
        assert main(["memory", "--model", str(folder), "--backend", "numpy", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    out = memory("--max-seq-len", "128", "--batch-size", "2", "--images-per-row", "2")
    v = out["vision"]
    assert v["tower_parameters"] == sum(p.numel() for n, p in hf.named_parameters() if ".visual." in n)
    assert v["tokens_per_image"] == 14 and v["image_tokens_per_row"] == 28 and v["images"] == 4
    assert not v["images_capped"]
    # the image tokens' rows, every token's blocks and M-RoPE positions, the embeddings, their gradient and the
    # DeepStack features and their gradients of 2 rows of 2 images of 12 tokens (hidden 64, 8 rotated pairs), float32
    n, tokens = 2 * 2 * 12, 2 * 128
    assert v["image_inputs"] == 4 * (n + 3 * tokens + tokens * 8 + n * 64 * (2 + 2 + 2))
    text = memory("--max-seq-len", "128", "--batch-size", "2", "--images-per-row", "0")
    assert out["total"] - text["total"] == v["tower_activations"] + v["image_inputs"] - text["vision"]["image_inputs"]
    # two stages (layer 0 and its DeepStack features on the first, layer 1 and its on the second): every token's
    # M-RoPE positions on both, the embeddings and their gradient on the first
    first, later = memory("--max-seq-len", "128", "--batch-size", "2", "--images-per-row", "2",
                          "--pipeline-stages", "2")["stages"]
    shared = (n + 3 * tokens + tokens * 8) * 4 + 2 * n * 64 * 4      # a DeepStack feature and its gradient each
    assert (first["layers"], later["layers"]) == ("0-0", "1-1")
    assert first["image_inputs"] == shared + 2 * n * 64 * 4 and later["image_inputs"] == shared
    assert first["image_inputs"] + later["image_inputs"] - v["image_inputs"] == (n + 3 * tokens + tokens * 8) * 4
    capped = memory("--max-seq-len", "24", "--images-per-row", "2")["vision"]
    assert capped["images_capped"] and capped["tokens_per_image"] == (23 // 2)
    assert main(["memory", "--model", str(folder), "--max-seq-len", "128", "--lora-targets", "q_proj,fc1"]) == 2
    assert "mlp.fc1 is not a module of Qwen3-VL's vision tower" in capsys.readouterr().err
    big = Image.new("RGB", (64, 48))            # 3072 pixels: the largest image, 48 patches
    pixels, grids = vm.pixel_values([big, big])
    assert int(np.prod(grids, axis=1).sum()) == 2 * 48
    vm.tower(pixels, grids)
    tracemalloc.start()
    try:
        vm.tower(pixels, grids)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    from wgpu_train.models.qwen3_vl import tower_activation_values

    estimate = 4 * tower_activation_values(vm.vision, 2, 48)
    print(f"estimate {estimate} bytes, tracemalloc peak {peak}")
    assert abs(estimate - peak) <= TOLERANCES["vision_tower_memory"].rtol * peak, (estimate, peak)


def test_dpo_with_images_on_two_workers_equals_one_process(vlm, tmp_path):
    """DPO on a TRL vision pair on two data-parallel workers (threads): the step's one micro-batch is cut between
    the workers (the chosen row, the rejected row) with its rows' M-RoPE positions and DeepStack features; the
    adapter after the step is one process's."""
    import wgpu_train
    from test_data_parallel import run_threads
    from test_vision_preference import pref_records, write_pref_data
    from wgpu_train.formats.safetensors import read_safetensors
    from wgpu_train.training.config import TrainConfig

    _, folder, _ = vlm
    data = write_pref_data(tmp_path / "data", pref_records()[:1])
    kw = dict(model=str(folder), data=str(data), backend="numpy", objective="dpo", batch_size=1, max_steps=1,
              lr=1e-2, valid_split=0.0, lora_targets="q_proj,v_proj", no_progress=True, max_seq_len=400)
    assert wgpu_train.finetune(TrainConfig(out=str(tmp_path / "one"), grad_accum=2, **kw))["images"] == 1
    run_threads(TrainConfig(out=str(tmp_path / "two"), num_workers=2, **kw), 2)
    one, two = (read_safetensors(tmp_path / run / "adapter_model.safetensors") for run in ("one", "two"))
    assert set(one) == set(two) and max(float(np.abs(one[k]).max()) for k in one if "lora_B" in k) > 1e-3
    for k in one:
        assert_close(two[k], one[k], "data_parallel_numpy", k)
