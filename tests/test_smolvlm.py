"""SmolVLM with images on the NumPy engine against transformers' SmolVLMForConditionalGeneration and PEFT: the image
processor's tiles, the tower and connector's features, logits (causal over image tokens), LoRA gradients on the
language model, greedy generation, the processor's prompt expansion, and the refusals."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from wgpu_train.errors import ConfigError, DataError

from finetune_helpers import peft_random_b
from tiny_models import hf_config
from tolerances import assert_close

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
Image = pytest.importorskip("PIL.Image")

from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil  # noqa: E402
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string  # noqa: E402

from wgpu_train.data.image_tiles import TileSettings  # noqa: E402
from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402
from wgpu_train.models.vision import VisionConfig  # noqa: E402

IMG = 82                # the image token, inside the tiny vocabulary of 83
SIDE = 24               # a tile: a 4 x 4 grid of 6-pixel patches, shuffled 2 x 2 into 4 tokens
SEQ = 4


def tiny_config(arch="smolvlm"):
    vision = dict(hidden_size=18, intermediate_size=23, num_hidden_layers=2, num_attention_heads=2, image_size=SIDE,
                  patch_size=6)
    text = hf_config("llama").to_dict()
    if arch == "idefics3":
        return tf.Idefics3Config(text_config=text, vision_config=vision, scale_factor=2, image_token_id=IMG)
    return tf.SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=2, image_token_id=IMG)


def processor(longest=3 * SIDE, **kw):
    return SmolVLMImageProcessorPil(size={"longest_edge": longest}, max_image_size={"longest_edge": SIDE}, **kw)


def build(folder, arch="smolvlm", seed=0):
    torch.manual_seed(seed)
    cls = tf.Idefics3ForConditionalGeneration if arch == "idefics3" else tf.SmolVLMForConditionalGeneration
    hf = cls(tiny_config(arch)).eval()
    with torch.no_grad():       # the norms start at one, biases at zero: move every tensor
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(folder)
    processor().save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smolvlm")
    hf = build(folder)
    return hf, folder, load_vision_model(folder)


def images(n, seed=0):
    """Odd sizes: a wide one, a tall one, one smaller than a tile (each resized up or down to its tiles)."""
    rng = np.random.default_rng(seed)
    sizes = [(37, 53), (61, 29), (11, 15)]
    return [Image.fromarray(rng.integers(0, 256, (*sizes[i % 3], 3), dtype=np.uint8)) for i in range(n)]


def tile_ids(n_tiles):
    return [IMG] * (SEQ * n_tiles)


def hf_pixels(vm, imgs):
    """Our tiles as transformers' (1, N, C, H, W) pixel_values of one row."""
    return torch.tensor(vm.pixel_values(imgs)[None])


@pytest.mark.parametrize("split,longest", [(True, 3 * SIDE), (False, 3 * SIDE), (True, SIDE)])
def test_tiles_equal_the_processors(split, longest):
    """Odd sizes, up- and down-scaled, wide, tall and smaller than a tile; RGBA over white: the same tiles (and
    rows / cols) as SmolVLMImageProcessor's PIL backend, bit for bit."""
    proc = processor(longest, do_image_splitting=split)
    settings = TileSettings.from_dict(proc.to_dict(), SIDE)
    rng = np.random.default_rng(1)
    for shape in ((37, 53, 3), (61, 29, 3), (11, 15, 3), (100, 100, 3), (19, 41, 4), (500, 23, 3)):
        img = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
        want = proc(images=[[img]], return_tensors="np", return_row_col_info=True)
        got = settings.tiles(img)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want["pixel_values"][0])
        assert settings.grid(img) == (want["rows"][0][0], want["cols"][0][0])


def test_prompt_expansion_equals_the_processors():
    """The text each image takes: transformers' get_image_prompt_string for the processor's rows and cols."""
    from wgpu_train.data.image_tiles import TiledImageSpan

    grids = []
    for longest in (3 * SIDE, SIDE):        # the second: every image one tile, the global image alone
        settings = TileSettings.from_dict(processor(longest).to_dict(), SIDE)
        span = TiledImageSpan("<image>", "<fake_token_around_image>", "<global-img>", SEQ, settings)
        for img in images(3):
            rows, cols = settings.grid(img)
            grids.append((rows, cols))
            assert span.expansion(img) == get_image_prompt_string(rows, cols, SEQ, "<fake_token_around_image>",
                                                                  "<image>", "<global-img>")
    assert grids == [(3, 3), (3, 2), (3, 3), (0, 0), (0, 0), (0, 0)]


def test_image_features_equal_transformers(vlm):
    """The tower (patch GEMM, positions, bidirectional layers, post-layernorm) and the connector (pixel shuffle,
    projection) equal get_image_features on whole tiles."""
    hf, _, vm = vlm
    px = np.random.default_rng(2).standard_normal((3, 3, SIDE, SIDE)).astype(np.float32)
    with torch.no_grad():
        want = hf.model.get_image_features(torch.tensor(px[None])).pooler_output[0].numpy()
    assert_close(vm.tower(px).reshape(-1, want.shape[-1]), want, "logits_f32", "image features")


def test_logits_with_images_match_transformers(vlm):
    """Two images (their tiles) in one row: logits within 1e-4 of transformers (causal over the image tokens)."""
    hf, _, vm = vlm
    imgs = images(2)
    first, second = (len(vm.pixel_values([im])) for im in imgs)
    ids = np.array([[5, 6, *tile_ids(first), 7, 8, *tile_ids(second), 9, 10]])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), pixel_values=hf_pixels(vm, imgs)).logits.numpy()
    got = vm.logits(ids, imgs)
    assert_close(got, want, "logits_f32", "with images")


def test_lora_gradients_with_images_match_peft(vlm):
    """LoRA on the language model (the tower frozen): loss and every LoRA gradient equal PEFT's autograd, the
    adapter read from PEFT's files on SmolVLM (model.text_model)."""
    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*text_model.*\.(q_proj|v_proj|down_proj)", lora_dropout=0.0)))
    imgs = images(1, seed=3)
    vm = load_vision_model(folder)
    n = len(vm.pixel_values(imgs))
    ids = np.array([[3, 4, *tile_ids(n), 11, 12, 13, 14, 15]])
    labels = np.where(ids != IMG, ids, -100)
    out = pm(input_ids=torch.tensor(ids), pixel_values=hf_pixels(vm, imgs), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default", "").replace("model.text_model.", "model."): p.grad.numpy()
                for n, p in pm.named_parameters() if p.requires_grad}
    adapter = folder.parent / "smolvlm_adapter"
    pm.save_pretrained(adapter)
    vm.model.load_adapter(adapter)
    loss, grads = vm.loss_and_grads(ids, labels, imgs)
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "loss with images")
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def test_tower_lora_gradients_and_adapter_match_peft(vlm, tmp_path):
    """LoRA on the tower's encoder, the connector's projection and the language model (PEFT's names on SmolVLM:
    model.vision_model, model.connector.modality_projection.proj): loss and every gradient equal PEFT's; our adapter
    loads in PEFT to its logits."""
    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, lora_dropout=0.0,
        target_modules=r".*(text_model.*\.(q_proj|v_proj)|vision_model.*\.(q_proj|out_proj|fc1|fc2)|"
                       r"connector\.modality_projection\.proj)")), 4)
    imgs = images(2, seed=8)
    vm = load_vision_model(folder)
    n = len(vm.pixel_values(imgs))
    ids = np.array([[3, *tile_ids(n), 11, 12, 13, 14]])
    labels = np.where(ids != IMG, ids, -100)
    out = pm(input_ids=torch.tensor(ids), pixel_values=hf_pixels(vm, imgs), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default", "").replace("model.text_model.", "model."): p.grad.numpy()
                for n, p in pm.named_parameters() if p.requires_grad}
    assert any("vision_model" in k for k in expected)
    assert "base_model.model.model.connector.modality_projection.proj.lora_A.weight" in expected
    pm.save_pretrained(tmp_path / "peft")
    vm.load_adapter(tmp_path / "peft")
    loss, grads = vm.loss_and_grads(ids, labels, imgs)
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "loss with the tower's LoRA")
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)
    vm.save_adapter(tmp_path / "ours")
    again = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    with torch.no_grad():
        want = again(input_ids=torch.tensor(ids), pixel_values=hf_pixels(vm, imgs)).logits.numpy()
        first = pm(input_ids=torch.tensor(ids), pixel_values=hf_pixels(vm, imgs)).logits.numpy()
    assert_close(want, first, "logits_f32", "our adapter in PEFT")
    assert_close(vm.logits(ids, imgs), want, "logits_f32", "the tower's LoRA applied")


def test_webgpu_engine_matches_numpy_with_images(vlm, rt, tmp_path):
    """The language model on the WebGPU engine (the frozen tower on the device; SmolVLM's image tokens plain causal,
    each its own one-token block): logits with two images' tiles, a LoRA loss and gradients, and greedy generation
    equal the NumPy engine's."""
    hf, folder, cpu = vlm
    gpu = load_vision_model(folder, backend="wgpu", device=str(rt.info.index))
    assert gpu.device_tower is not None
    imgs = images(2)
    first, second = (len(cpu.pixel_values([im])) for im in imgs)
    ids = np.array([[5, 6, *tile_ids(first), 7, 8, *tile_ids(second), 9, 10]])
    assert_close(gpu.logits(ids, imgs), cpu.logits(ids, imgs), "gpu_logits", "SmolVLM with images")
    assert gpu.generate(ids[0], imgs, max_new_tokens=6) == cpu.generate(ids[0], imgs, max_new_tokens=6)
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*text_model.*\.(q_proj|v_proj)", lora_dropout=0.0)))
    pm.save_pretrained(tmp_path / "adapter")
    labels = np.where(ids != IMG, ids, -100)
    got = {}
    for name, vm in (("numpy", load_vision_model(folder)), ("wgpu", gpu)):
        vm.model.load_adapter(tmp_path / "adapter")
        got[name] = vm.loss_and_grads(ids, labels, imgs)
    (loss_c, grads_c), (loss_g, grads_g) = got["numpy"], got["wgpu"]
    assert_close(np.float64(loss_g), np.float64(loss_c), "gpu_loss", "SmolVLM loss with images")
    assert set(grads_g) == set(grads_c) and grads_c
    for name, g in grads_c.items():
        assert_close(grads_g[name], g, "gpu_grads", name)


def test_connector_lora_on_the_device_tower_equals_numpy(vlm, rt, tmp_path):
    """LoRA on the connector's projection (and an encoder module) beside the WebGPU language model, the tower on the
    device: loss, gradients (the connector's and the encoder's) and logits the NumPy engine's."""
    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, lora_dropout=0.0,
        target_modules=r".*(text_model.*\.q_proj|vision_model.*\.fc1|connector\.modality_projection\.proj)")), 4)
    pm.save_pretrained(tmp_path / "adapter")
    imgs = images(1, seed=5)
    cpu, gpu = load_vision_model(folder), load_vision_model(folder, backend="wgpu", device=str(rt.info.index))
    n = len(cpu.pixel_values(imgs))
    ids = np.array([[5, *tile_ids(n), 9, 10]])
    labels = np.where(ids != IMG, ids, -100)
    got = {}
    for name, vm in (("numpy", cpu), ("wgpu", gpu)):
        vm.load_adapter(tmp_path / "adapter")
        got[name] = vm.loss_and_grads(ids, labels, imgs)
    assert gpu.device_tower is not None
    (loss_c, grads_c), (loss_g, grads_g) = got["numpy"], got["wgpu"]
    assert_close(np.float64(loss_g), np.float64(loss_c), "gpu_loss", "loss with the connector's LoRA")
    assert "base_model.model.model.connector.modality_projection.proj.lora_B.weight" in grads_c
    assert set(grads_g) == set(grads_c)
    for name, g in grads_c.items():
        assert_close(grads_g[name], g, "gpu_grads", name)
    assert_close(gpu.logits(ids, imgs), cpu.logits(ids, imgs), "gpu_logits", "logits with the connector's LoRA")

def test_greedy_generation_with_an_image_matches_transformers(vlm):
    hf, _, vm = vlm
    img = images(1, seed=5)
    n = len(vm.pixel_values(img))
    ids = np.array([5, *tile_ids(n), 6, 7])
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor(ids[None]), pixel_values=hf_pixels(vm, img), max_new_tokens=6,
                           min_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    assert vm.generate(ids, img, max_new_tokens=6) == want


def test_idefics3_logits_match_transformers(tmp_path):
    """Idefics3ForConditionalGeneration: the same tower, connector and text model under the same names."""
    hf = build(tmp_path, "idefics3", seed=2)
    vm = load_vision_model(tmp_path)
    img = images(1, seed=6)
    n = len(vm.pixel_values(img))
    ids = np.array([[5, *tile_ids(n), 6, 7]])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), pixel_values=hf_pixels(vm, img)).logits.numpy()
    assert_close(vm.logits(ids, img), want, "logits_f32", "Idefics3 with an image")


def test_refusals_in_one_line(vlm):
    _, folder, vm = vlm
    raw = json.loads((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match="scale_factor 3 does not divide"):
        VisionConfig.from_config({**raw, "scale_factor": 3})
    with pytest.raises(ConfigError, match="max_image_size"):
        TileSettings.from_dict({"max_image_size": {"longest_edge": 2 * SIDE}}, SIDE)
    with pytest.raises(ConfigError, match="not a linear module of the vision tower's encoder"):
        vm.set_tower_lora({"base_model.model.model.vision_model.encoder.layers.0.layer_norm1.lora_A.weight":
                           np.zeros(1)}, 1.0)
    ids = np.array([[5, *tile_ids(2), 6]])
    with pytest.raises(DataError, match="8 image placeholder tokens for 10 image tiles of 4 tokens each") as e:
        vm.logits(ids, images(1))
    assert "\n" not in str(e.value)


def test_memory_counts_the_tower_and_the_largest_images_tiles(vlm, capsys):
    """`memory`: the tower's and the connector's weights as transformers builds them; an image's tokens those of
    the largest grid at the longest edge (3 x 3 tiles and the global one, two markers each and the global one's
    third, a newline a row and one before the global image)."""
    from wgpu_train.cli.main import main

    hf, folder, _ = vlm
    want = sum(p.numel() for n, p in hf.named_parameters() if "vision_model" in n or "connector" in n)
    assert main(["memory", "--model", str(folder), "--backend", "numpy", "--max-seq-len", "128", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)["vision"]
    assert v["tower_parameters"] == want
    assert v["tokens_per_image"] == 10 * (SEQ + 2) + 1 + 3 + 1 and not v["tower_lora"]
    assert main(["memory", "--model", str(folder), "--backend", "numpy", "--max-seq-len", "128", "--lora-targets",
                 "q_proj,connector", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vision"]["tower_lora"]
    assert main(["memory", "--model", str(folder), "--max-seq-len", "64"]) == 2
    assert "no room for text" in capsys.readouterr().err


def test_split_targets_names_the_connector_as_peft_does():
    """connector, model.connector.modality_projection.proj, modality_projection.proj: the connector's projection
    (after the encoder's modules); Gemma 3's projector (a parameter) refused with that reason."""
    from wgpu_train.models.vision import split_targets

    for entry in ("connector", "model.connector.modality_projection.proj", "modality_projection.proj"):
        assert split_targets(f"q_proj,{entry},fc1") == ("q_proj", ("mlp.fc1", "modality_projection.proj"))
    for entry in ("mm_input_projection", "multi_modal_projector", "connector.norm"):
        with pytest.raises(ConfigError, match="not Gemma 3's projector \\(a parameter PEFT's target_modules cannot"):
            split_targets(f"q_proj,{entry}")
