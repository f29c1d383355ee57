"""LFM2-VL (Lfm2VlForConditionalGeneration) with images on the NumPy engine against transformers 5.25 and PEFT: the
image processor's pixel_values, masks and spatial shapes (tiles and thumbnail) and its prompt expansion, logits,
LoRA gradients on the language model, greedy generation, `finetune` on TRL's vision records and `generate --image`,
and the refusals (the tower's LoRA among them). WebGPU: test_lfm2_vl_wgpu.py."""
from __future__ import annotations

import copy
import hashlib
import json

import numpy as np
import pytest

from wgpu_train.errors import ConfigError, DataError, WgpuTrainError

from bpe import tokenizer_folder, train_bpe
from finetune_helpers import peft_random_b
from tolerances import assert_close

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
Image = pytest.importorskip("PIL.Image")

from wgpu_train.data.lfm2_images import Lfm2ImageSettings  # noqa: E402
from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402
from wgpu_train.models.vision import VisionConfig  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<|image_start|>", "<|image_end|>",
            "<|img_thumbnail|>", *[f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)]]
IMAGE = 3                  # <image>
# LFM2-VL's chat template, its image and text parts (ChatML; tools left out)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}<image>{% elif c.type == 'text' %}{{ c.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["user what colour is it? assistant red blue green", "describe the picture and this squares"]
# the processor: 8-pixel patches, 32-pixel tiles (4 x 4 patches, 4 tokens), 2 to 8 tokens an image, 2 to 4 tiles
PROCESSOR = dict(encoder_patch_size=8, tile_size=32, min_image_tokens=2, max_image_tokens=8, min_tiles=2, max_tiles=4,
                 image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.4])
SIZES = ((41, 57), (23, 90), (13, 11), (200, 170), (64, 128))   # odd sizes; the last two tile (2 x 2, 1 x 2)
# sha256 of transformers 5.25's Lfm2VlProcessor output for each of SIZES (sample_images(0)): pixel_values, mask and
# spatial_shapes bytes, and the text its <image> became; recorded with torchvision 0.29.1, which CI lacks (the
# test compares with the live processor where torchvision imports)
DIGESTS = {"41x57": "9c00e69d24f624f0", "23x90": "c08077aa2a5e1583", "13x11": "b95a2bbaa24357aa",
           "200x170": "d185909036738ca1", "64x128": "22ef29a864e6ded5"}


def tiny_config(vocab: int):
    vision = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, patch_size=8,
                  num_patches=16, vision_use_head=False)
    text = dict(vocab_size=vocab, hidden_size=48, intermediate_size=61, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, layer_types=["conv", "full_attention", "conv"],
                block_multiple_of=8, eos_token_id=2, pad_token_id=0)
    return tf.Lfm2VlConfig(vision_config=vision, text_config=text, image_token_id=IMAGE, projector_hidden_size=36,
                           downsample_factor=2)


def make_folder(folder):
    """A tiny random LFM2-VL saved with its tokenizer and preprocessor_config.json; transformers' twin returned."""
    tok = train_bpe(CORPUS, 200, SPECIALS)
    tokenizer_folder(folder, tok, TEMPLATE, eos_token="<|im_end|>")
    torch.manual_seed(0)
    hf = tf.Lfm2VlForConditionalGeneration(tiny_config(tok.get_vocab_size())).eval()
    with torch.no_grad():       # the norms start at one, biases at zero: move every tensor
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Lfm2VlImageProcessor",
                                                                 **PROCESSOR}))
    return hf


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lfm2_vl")
    hf = make_folder(folder)
    return hf, folder, load_vision_model(folder)


def sample_images(seed=0, sizes=SIZES):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)) for s in sizes]


def digest(pixels, mask, shapes, text) -> str:
    parts = (np.asarray(pixels, np.float32), np.asarray(mask, np.int32), np.asarray(shapes, np.int64))
    return hashlib.sha256(b"".join(p.tobytes() for p in parts) + text.encode()).hexdigest()[:16]


def test_pixel_values_and_expansion_equal_the_processors(vlm):
    """Odd sizes resized (smart resize up and down) and two that tile (2 x 2 and 1 x 2 tiles and a thumbnail):
    pixel_values, pixel_attention_mask, spatial_shapes and the text <image> becomes, bit for bit the processor's
    (torch's antialiased uint8 resize reproduced); without torchvision, their recorded digests."""
    _, folder, vm = vlm
    settings = Lfm2ImageSettings.from_dict(PROCESSOR, 8)
    span = vm.image_span(load_tokenizer(folder))
    ours = {}
    for size, img in zip(SIZES, sample_images()):
        ours[f"{size[0]}x{size[1]}"] = digest(*settings.batch([img]), span.expansion(img))
    assert settings.layout(200, 170)[0] == (2, 2) and settings.layout(64, 128)[0] == (1, 2)
    try:
        import torchvision  # noqa: F401
    except ImportError:
        assert ours == DIGESTS
        return
    proc = tf.Lfm2VlProcessor(tf.Lfm2VlImageProcessor(**PROCESSOR), tf.AutoTokenizer.from_pretrained(folder))
    want = {}
    for size, img in zip(SIZES, sample_images()):
        out = proc(images=[img], text="<image>", return_tensors="np", add_special_tokens=False)
        text = proc.tokenizer.decode(out["input_ids"][0])
        want[f"{size[0]}x{size[1]}"] = digest(out["pixel_values"], out["pixel_attention_mask"],
                                              out["spatial_shapes"], text)
    assert ours == want == DIGESTS


def load_tokenizer(folder):
    from wgpu_train.formats.tokenizer import load_tokenizer as load

    return load(folder)


def hf_inputs(vm, ids, imgs):
    pixels, mask, shapes = vm.pixel_values(imgs)
    out = dict(pixel_values=torch.tensor(pixels), pixel_attention_mask=torch.tensor(mask),
               spatial_shapes=torch.tensor(shapes))
    return out if ids is None else {"input_ids": torch.tensor(ids), **out}


@pytest.fixture(scope="module")
def spans(vlm):
    """span(img) -> the ids of an image's expansion in the model's tokenizer."""
    _, folder, vm = vlm
    tok = load_tokenizer(folder)
    span = vm.image_span(tok)
    return lambda img: tok.encode(span.expansion(img))


def test_tower_and_logits_with_images_match_transformers(vlm, spans):
    """A resized image and one of 2 x 2 tiles and a thumbnail, text between and after: the projected features and
    the logits within 1e-4 of transformers' (the position grid resized per tile, the padding never attended)."""
    hf, _, vm = vlm
    imgs = sample_images(1, [(41, 57), (200, 170)])
    pixels = vm.pixel_values(imgs)
    with torch.no_grad():
        feats = hf.model.get_image_features(**hf_inputs(vm, None, imgs)).pooler_output
    assert_close(vm.tower(pixels), torch.cat(feats).numpy(), "logits_f32", "projected features")
    ids = np.array([[7, 8, *spans(imgs[0]), 9, 10, *spans(imgs[1]), 11, 12]])
    with torch.no_grad():
        want = hf(**hf_inputs(vm, ids, imgs)).logits.numpy()
    assert_close(vm.logits(ids, imgs), want, "logits_f32", "with images")


@pytest.mark.parametrize("tower", [False, True])
def test_lora_gradients_with_images_match_peft(vlm, spans, tower, tmp_path):
    """LoRA on the language model's convolutions, attention and feed-forward (the tower frozen, or with LoRA on
    its encoder's q_proj, v_proj and fc2 too), two rows, one right-padded: loss and every LoRA gradient equal
    PEFT's autograd (the tower's back through the projector, the unshuffle and the encoder of each tile), the
    adapter read from PEFT's files; with the tower's, the adapter saved gives PEFT's logits."""
    hf, folder, _ = vlm
    vision = r"|.*vision_tower.*\.(q_proj|v_proj|fc2)" if tower else ""
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(in_proj|q_proj|w2)" + vision, lora_dropout=0.0)))
    vm = load_vision_model(folder)
    imgs = sample_images(3, [(41, 57), (64, 128), (13, 11)])
    rows = [[7, *spans(imgs[0]), 11, 12, *spans(imgs[1]), 13, 14], [8, 9, *spans(imgs[2]), 15]]
    width = max(map(len, rows))
    ids = np.array([r + [0] * (width - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = np.where((ids != IMAGE) & (mask == 1), ids, -100)
    out = pm(**hf_inputs(vm, ids, imgs), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default", "").replace("model.language_model.", "model."): p.grad.numpy()
                for n, p in pm.named_parameters() if p.requires_grad}
    pm.save_pretrained(tmp_path / "adapter")
    vm.load_adapter(tmp_path / "adapter")
    loss, grads = vm.loss_and_grads(ids, labels, imgs, attention_mask=mask)
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "loss with images")
    assert set(grads) == set(expected) and len(grads) == 2 * (2 + 1 + 3) + 2 * 2 * 3 * tower
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)
    if tower:
        vm.save_adapter(tmp_path / "ours")
        ours = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
        with torch.no_grad():
            assert_close(ours(**hf_inputs(vm, ids, imgs)).logits.numpy(), pm.eval()(**hf_inputs(vm, ids, imgs)).logits
                         .numpy(), "logits_f32", "the saved adapter with the tower's LoRA")


def test_greedy_generation_with_images_matches_transformers(vlm, spans):
    """The prompt prefilled with a tiled image and a small one, then a token a step through the convolutions'
    state and the attention's cache: transformers' greedy tokens."""
    hf, _, vm = vlm
    imgs = sample_images(5, [(64, 128), (23, 90)])
    ids = np.array([7, *spans(imgs[0]), 8, *spans(imgs[1]), 9])
    with torch.no_grad():
        want = hf.generate(**hf_inputs(vm, ids[None], imgs), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert vm.generate(ids, imgs, max_new_tokens=8) == want


def records():
    red, blue = Image.new("RGB", (57, 41), (255, 0, 0)), Image.new("RGB", (128, 64), (0, 0, 255))
    return [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images": [red]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "and this"}, {"type": "image"}]},
                          {"role": "assistant", "content": "blue"}], "images": [blue]}]


def test_cli_finetune_and_generate_with_images(vlm, tmp_path, capsys):
    """`finetune --data` of TRL's vision records on LFM2-VL (the NumPy engine; one image tiles), LoRA on the tower's
    encoder too (`vision_tower`): the loss falls and the adapter loads in PEFT; `generate --image` with it gives
    transformers' greedy answer with the same adapter."""
    from test_gemma3_vision_training import write_vision_data
    from wgpu_train.cli.main import main

    hf, folder, vm = vlm
    data = write_vision_data(tmp_path / "data", records())
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", "numpy", "--max-steps", "6",
                 "--batch-size", "2", "--lr", "3e-2", "--lora-targets", "in_proj,q_proj,w1,vision_tower",
                 "--no-progress",
                 "--valid-split", "0", "--log-every", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["images"] == 2
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert losses[-1] < losses[0]
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), out).eval()
    img = records()[1]["images"][0]
    img.save(tmp_path / "blue.png")
    tok, hf_tok = load_tokenizer(folder), tf.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text.replace("<image>", vm.image_span(tok).expansion(img))
    ids = np.array([hf_tok(text)["input_ids"]])
    with torch.no_grad():
        gen = pm.generate(**hf_inputs(vm, ids, [img]), max_new_tokens=4, do_sample=False,
                          eos_token_id=list(tok.stop_token_ids), pad_token_id=0)[0, ids.shape[1]:].tolist()
    want = tok.decode([t for t in gen if t not in tok.stop_token_ids])
    assert main(["generate", "--model", str(folder), "--adapter", str(out), "--prompt", "what colour?", "--image",
                 str(tmp_path / "blue.png"), "--max-new-tokens", "4", "--backend", "numpy"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_refusals_in_one_line(vlm, spans, tmp_path):
    _, folder, vm = vlm
    raw = json.loads((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match="vision_config.hidden_act 'gelu'"):
        VisionConfig.from_config({**raw, "vision_config": {**raw["vision_config"], "hidden_act": "gelu"}})
    with pytest.raises(ConfigError, match="projector_hidden_act 'relu'"):
        VisionConfig.from_config({**raw, "projector_hidden_act": "relu"})
    with pytest.raises(ConfigError, match="encoder_patch_size 16 is not the vision tower's patch_size 8"):
        Lfm2ImageSettings.from_dict({}, 8)
    with pytest.raises(ConfigError, match="downsample_factor 3 is not the projector's 2"):
        Lfm2ImageSettings.from_dict({**PROCESSOR, "downsample_factor": 3}, 8, factor=2)
    with pytest.raises(ConfigError, match="resample 3 is not supported"):
        Lfm2ImageSettings.from_dict({**PROCESSOR, "resample": 3}, 8)
    hf = vlm[0]
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.q_proj|.*multi_modal_projector\.linear_1")))
    pm.save_pretrained(tmp_path / "projector")
    with pytest.raises(WgpuTrainError, match="multi_modal_projector.linear_1.*outside the language model") as e:
        load_vision_model(folder).load_adapter(tmp_path / "projector")
    assert "\n" not in str(e.value)
    img = sample_images(0, [(41, 57)])
    with pytest.raises(DataError, match="3 image placeholder tokens for images of 6 tokens in all") as e:
        vm.logits(np.array([[7, IMAGE, IMAGE, IMAGE]]), img)
    assert "\n" not in str(e.value)


def test_memory_chat_and_the_towers_lora_from_the_cli(vlm, tmp_path, monkeypatch, capsys):
    """`memory` counts the tower's and projector's weights as transformers builds them and the largest image's
    tokens (4 tiles of 4 tokens and a thumbnail of up to 8, each marked, between start and end: 31), which a
    4-tile image's expansion stays within, and the tower's peak over the largest tile within tracemalloc's
    tolerance (frozen; with LoRA on the tower its kept activations counted); `chat` with /image answers as
    `generate --image`; --lora-targets naming another tower's module refused in one line."""
    import io

    from wgpu_train.cli.main import main

    hf, folder, vm = vlm
    assert main(["memory", "--model", str(folder), "--backend", "numpy", "--json", "--max-seq-len", "128"]) == 0
    v = json.loads(capsys.readouterr().out)["vision"]
    assert v["tower_parameters"] == sum(p.numel() for n, p in hf.named_parameters()
                                        if ".vision_tower." in n or ".multi_modal_projector." in n)
    assert v["tokens_per_image"] == 31 and v["tower_activations"] > 0
    import tracemalloc

    from tolerances import TOLERANCES
    from wgpu_train.models.lfm2_vl import tower_activation_values

    largest = vm.pixel_values([Image.new("RGB", (32, 64))])     # 8 x 4 patches: the largest tile, 32 patches
    assert largest[2].tolist() == [[8, 4]]
    vm.tower(largest)
    tracemalloc.start()
    try:
        vm.tower(largest)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    estimate = 4 * tower_activation_values(vm.vision, 32, 8)
    assert abs(estimate - peak) <= TOLERANCES["vision_tower_memory"].rtol * peak, (estimate, peak)
    wide = Image.new("RGB", (256, 64))
    assert vm.pixel_values([wide])[2].shape[0] == 5
    assert len(load_tokenizer(folder).encode(vm.image_span(load_tokenizer(folder)).expansion(wide))) == 28
    path = tmp_path / "x.png"
    sample_images(9, [(64, 128)])[0].save(path)
    assert main(["generate", "--model", str(folder), "--prompt", "what colour?", "--image", str(path),
                 "--max-new-tokens", "4", "--backend", "numpy"]) == 0
    want = capsys.readouterr().out.removesuffix("\n")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {path}\nwhat colour?\n"))
    assert main(["chat", "--model", str(folder), "--backend", "numpy", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == want
    assert main(["memory", "--model", str(folder), "--json", "--max-seq-len", "128", "--lora-targets",
                 "q_proj,fc1"]) == 0
    trained = json.loads(capsys.readouterr().out)["vision"]
    assert trained["tower_lora"] and trained["tower_activations"] > v["tower_activations"]
    assert main(["memory", "--model", str(folder), "--lora-targets", "q_proj,qkv"]) == 2
    assert "qkv is not a module of LFM2-VL's vision tower" in capsys.readouterr().err


def test_decode_batch_rows_with_images_answer_as_alone(vlm, spans):
    """serve's batching: a row with a tiled image prefilled whole beside a text row in one DecodeBatch (the
    convolutions' state per row): each row's greedy tokens equal its generation alone."""
    from wgpu_train.engines.generate import DecodeBatch

    _, _, vm = vlm
    img = sample_images(7, [(64, 128)])
    with_image, text = np.array([7, 8, *spans(img[0]), 9]), np.array([10, 11, 12])
    batch = DecodeBatch(vm.model.engine, 2, 96, token_budget=6)
    ids, tokens = vm.prompt_images(with_image, img)
    slots = [batch.add(ids, 6, images=tokens), batch.add(text, 6)]
    out = {s: [] for s in slots}
    try:
        while len(batch):
            for t in batch.step():
                out[t.slot].append(t.id)
    finally:
        batch.close()
    assert out[slots[0]] == vm.generate(with_image, img, max_new_tokens=6)
    assert out[slots[1]] == vm.model.generate_batch([text], max_new_tokens=6)[0]


def test_processor_config_json_and_images_without_markers(tmp_path):
    """A folder whose processor_config.json nests the image processor's fields (the hub's newer layout) and sets
    use_image_special_tokens false: the same settings, and the tiled image's text has its tokens alone, as the
    processor's with use_image_special_tokens=False (the digest of its text, recorded as DIGESTS')."""
    import dataclasses

    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Lfm2VlProcessor",
                                                                "use_image_special_tokens": False,
                                                                "image_processor": PROCESSOR}))
    settings = Lfm2ImageSettings.from_folder(tmp_path, 8)
    assert settings == dataclasses.replace(Lfm2ImageSettings.from_dict(PROCESSOR, 8), use_image_special_tokens=False)
    from wgpu_train.data.lfm2_images import Lfm2ImageSpan

    span = Lfm2ImageSpan("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>", settings)
    text = span.expansion(sample_images()[3])
    assert text == "<image>" * (4 * 4 + 6) and settings.largest == (5, 4 * 4 + 8)
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == "668085df3ccd273e"


def test_merge_writes_a_folder_transformers_loads(vlm, spans, tmp_path):
    """`merge` of a PEFT adapter on the language model: transformers loads the merged folder whole (the final norm
    under LFM2's embedding_norm, the tower and projector carried) and its logits with an image equal PEFT's
    merge_and_unload's."""
    from wgpu_train.cli.main import main

    hf, folder, vm = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(in_proj|q_proj|w2)", lora_dropout=0.0)))
    pm.save_pretrained(tmp_path / "adapter")
    assert main(["merge", "--model", str(folder), "--adapter", str(tmp_path / "adapter"),
                 "--out", str(tmp_path / "merged")]) == 0
    merged, info = tf.Lfm2VlForConditionalGeneration.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    img = sample_images(1, [(64, 128)])
    ids = np.array([[7, *spans(img[0]), 9]])
    with torch.no_grad():
        want = pm.merge_and_unload()(**hf_inputs(vm, ids, img)).logits.numpy()
        got = merged.eval()(**hf_inputs(vm, ids, img)).logits.numpy()
    assert_close(got, want, "logits_f32", "merged folder")


def test_serve_answers_as_generate_image(vlm, tmp_path, capsys):
    """`serve` with an image_url part (a file:// path) of an image that tiles: the answer is `generate --image`'s."""
    openai = pytest.importorskip("openai")
    for module in ("starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(module)
    from wgpu_train.cli.main import build_parser, main
    from wgpu_train.cli.serve import prepare
    from wgpu_train.serve.app import build_app
    from wgpu_train.serve.server import ServerThread

    _, folder, _ = vlm
    path = tmp_path / "x.png"
    sample_images(4, [(64, 128)])[0].save(path)
    assert main(["generate", "--model", str(folder), "--prompt", "what colour?", "--image", str(path),
                 "--max-new-tokens", "5", "--backend", "numpy"]) == 0
    want = capsys.readouterr().out.removesuffix("\n")
    args = build_parser().parse_args(["serve", "--model", str(folder), "--backend", "numpy", "--port", "0",
                                      "--api-key", "sk-lfm2-vl", "--served-model-name", "default"])
    scheduler, sock = prepare(args)
    scheduler.start()
    thread = ServerThread(build_app(scheduler, "sk-lfm2-vl"), sock).start()
    try:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="sk-lfm2-vl", max_retries=0, timeout=120)
        content = [{"type": "image_url", "image_url": {"url": path.resolve().as_uri()}},
                   {"type": "text", "text": "what colour?"}]
        r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": content}],
                                           max_tokens=5, temperature=0)
    finally:
        thread.stop()
        scheduler.close()
    assert r.choices[0].message.content == want and want.strip()
