"""Gemma 3 with images on the NumPy engine against transformers' Gemma3ForConditionalGeneration and PEFT: the
processor's pixel_values, the tower and projector's image features, logits with the images' bidirectional blocks,
LoRA gradients on the language model, greedy generation, and the refusals (training: test_gemma3_vision_training.py)."""
from __future__ import annotations

import copy
import io

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

from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil  # noqa: E402

from wgpu_train.data.images import ImageSettings, open_image, pixel_values  # noqa: E402
from wgpu_train.engines.vision_model import VisionModel, load_vision_model  # noqa: E402
from wgpu_train.models.vision import VisionConfig, image_blocks  # noqa: E402

BOI, EOI, IMG = 80, 81, 82      # inside the tiny vocabulary of 83
SIDE = 42                       # a 6 x 6 grid of 7-pixel patches, pooled 3 x 3 into 4 tokens


def tiny_config(**top):
    vision = tf.SiglipVisionConfig(hidden_size=18, intermediate_size=23, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=SIDE, patch_size=7)
    fields = dict(boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMG, mm_tokens_per_image=4)
    fields.update(top)
    # a sliding window of 7 cuts through the second image's block: the block's bidirectional reach stays inside it
    return tf.Gemma3Config(text_config=hf_config("gemma3", sliding_window=7).to_dict(), vision_config=vision.to_dict(),
                           **fields)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    torch.manual_seed(0)
    hf = tf.Gemma3ForConditionalGeneration(tiny_config()).eval()
    with torch.no_grad():       # the projector's weight starts at zero, the norms at one: move every tensor
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("gemma3_vision")
    hf.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}).save_pretrained(folder)
    return hf, folder, load_vision_model(folder)


def image_run():
    return [BOI] + [IMG] * 4 + [EOI]


def two_image_batch():
    """(ids, mask, token_type_ids) (2, 19): row 0 with two images, row 1 with one and right padding."""
    row0 = [5, 6, *image_run(), 7, 8, *image_run(), 9, 10, 11]
    row1 = [12, *image_run(), 13, 14, 15, 16, 17, 18] + [0] * 6
    ids = np.array([row0, row1])
    mask = np.ones_like(ids)
    mask[1, 13:] = 0
    return ids, mask, (ids == IMG).astype(np.int64)


def images(n, seed=0):
    rng = np.random.default_rng(seed)
    sizes = [(37, 53), (61, 29), (45, 45)]
    return [Image.fromarray(rng.integers(0, 256, (*sizes[i % 3], 3), dtype=np.uint8)) for i in range(n)]


def hf_out(model, ids, mask, pixels, labels=None, token_types=True, image_id=IMG):
    kw = {"token_type_ids": torch.tensor((ids == image_id).astype(np.int64))} if token_types else {}
    if labels is not None:
        kw["labels"] = torch.tensor(labels)
    return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels),
                 **kw)


@pytest.mark.parametrize("mode,shape", [("RGB", (37, 53, 3)), ("RGBA", (19, 41, 4)), ("L", (33, 17)), ("P", (50, 23))])
def test_pixel_values_equal_the_processors(mode, shape, tmp_path):
    """Odd sizes, transparency over white, grey and palette images, from a PIL image, a path, bytes and a hub
    dataset's dict: the same pixel_values as transformers' Gemma3ImageProcessor (PIL backend), bit for bit."""
    proc = Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE})
    arr = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    img = Image.fromarray(arr, "L").convert("P") if mode == "P" else Image.fromarray(arr, mode)
    want = proc(images=[img], return_tensors="np")["pixel_values"][0]
    settings = ImageSettings.from_dict(proc.to_dict(), SIDE)
    img.save(tmp_path / "x.png")
    data = (tmp_path / "x.png").read_bytes()
    for source in (img, tmp_path / "x.png", str(tmp_path / "x.png"), data, {"bytes": data, "path": None}):
        got = pixel_values(source, settings)
        assert got.dtype == np.float32 and got.shape == (3, SIDE, SIDE)
        np.testing.assert_array_equal(got, want)


def test_undecodable_image_is_refused(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match="cannot decode") as e:
        open_image(tmp_path / "bad.png", "row 3: image 0")
    assert "\n" not in str(e.value) and "row 3" in str(e.value)
    with pytest.raises(DataError, match="cannot decode"):
        open_image(tmp_path / "missing.png")


def test_image_features_equal_transformers(vlm):
    """The tower (patch GEMM, positions, bidirectional layers, post-layernorm) and the projector (pool, soft-embedding
    norm, projection) equal get_image_features."""
    hf, _, vm = vlm
    px = np.random.default_rng(2).standard_normal((3, 3, SIDE, SIDE)).astype(np.float32)
    with torch.no_grad():
        want = hf.model.get_image_features(torch.tensor(px)).pooler_output.numpy()
    assert_close(vm.tower(px), want, "logits_f32", "image features")


def test_logits_with_images_match_transformers(vlm):
    """Two images in one row, one in a padded row: logits within 1e-4 of transformers with token_type_ids (the
    images' bidirectional blocks); without the blocks transformers' logits differ, so the mask is tested."""
    hf, _, vm = vlm
    ids, mask, _ = two_image_batch()
    px = vm.pixel_values(images(3))
    real = mask.astype(bool)
    with torch.no_grad():
        want = hf_out(hf, ids, mask, px).logits.numpy()
        causal = hf_out(hf, ids, mask, px, token_types=False).logits.numpy()
    got = vm.logits(ids, images(3), mask)
    assert_close(got[real], want[real], "logits_f32", "with images")
    assert np.abs(causal[real] - want[real]).max() > 1e-2


def test_lora_gradients_with_images_match_peft(vlm):
    """LoRA on the language model (the tower frozen): loss and every LoRA gradient equal PEFT's autograd."""
    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", lora_dropout=0.0)))
    ids, mask, _ = two_image_batch()
    labels = np.where((mask == 1) & (ids != IMG), ids, -100)
    px = np.random.default_rng(4).standard_normal((3, 3, SIDE, SIDE)).astype(np.float32)
    out = hf_out(pm, ids, mask, px, labels)
    out.loss.backward()
    expected = {n.replace(".default", "").replace("model.language_model.", "model."): p.grad.numpy()
                for n, p in pm.named_parameters() if p.requires_grad}
    vm = load_vision_model(folder)
    adapter = folder.parent / "vision_adapter"
    pm.save_pretrained(adapter)
    vm.model.load_adapter(adapter)
    loss, grads = vm.loss_and_grads(ids, labels, px, mask)
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "loss with images")
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def test_greedy_generation_with_an_image_matches_transformers(vlm):
    hf, _, vm = vlm
    ids = np.array([5, *image_run(), 6, 7])
    img = images(1, seed=5)
    px = vm.pixel_values(img)
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor(ids[None]), pixel_values=torch.tensor(px),
                           token_type_ids=torch.tensor((ids[None] == IMG).astype(np.int64)), max_new_tokens=6,
                           min_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    assert vm.generate(ids, img, max_new_tokens=6) == want


def test_placeholder_image_count_mismatch_is_refused(vlm):
    _, _, vm = vlm
    ids, mask, _ = two_image_batch()
    with pytest.raises(DataError, match="12 image placeholder tokens for 2 images") as e:
        vm.logits(ids, images(2), mask)
    assert "\n" not in str(e.value)
    assert vm.model.engine.images is None


def test_image_blocks_and_refusals():
    ids = np.array([[1, IMG, IMG, 2, IMG, 3], [IMG, IMG, IMG, 4, 5, 6]])
    np.testing.assert_array_equal(image_blocks(ids, IMG), [[-1, 0, 0, -1, 1, -1], [0, 0, 0, -1, -1, -1]])
    raw = tiny_config().to_dict()
    with pytest.raises(ConfigError, match="does not pool"):
        VisionConfig.from_config({**raw, "mm_tokens_per_image": 25,
                                  "architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(ConfigError, match="not supported for LlamaForCausalLM"):
        VisionConfig.from_config({"architectures": ["LlamaForCausalLM"]})


def test_an_engine_without_set_images_is_refused_in_one_line():
    class OtherModel:               # what VisionModel reads of a Model on an engine that takes no images
        backend, engine = "other", object()
    with pytest.raises(ConfigError, match="images do not run on the other engine") as e:
        VisionModel(OtherModel(), None, None, None)
    assert "\n" not in str(e.value)


def test_bytes_io_roundtrip_keeps_pixels():
    """A JPEG's bytes decode as Pillow decodes its file (the `images` column may hold either)."""
    buf = io.BytesIO()
    images(1)[0].save(buf, "JPEG")
    settings = ImageSettings(SIDE, SIDE)
    np.testing.assert_array_equal(pixel_values(buf.getvalue(), settings),
                                  pixel_values(Image.open(io.BytesIO(buf.getvalue())), settings))
