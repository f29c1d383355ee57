"""Qwen3.5 with images (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration) on the NumPy engine
against transformers and PEFT: Qwen3-VL's tower without DeepStack, the hybrid language model (Gated DeltaNet and gated
full attention) taking the images' embeddings and, in its full-attention layers' partial rotary, their M-RoPE
positions: logits, LoRA gradients (linear-attention projections too), greedy generation through the recurrent state,
`finetune` on TRL's vision records and `generate --image`, and the refusals (the WebGPU engine's, in
test_qwen3_5_vision_wgpu.py)."""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

from wgpu_train.errors import ConfigError

from bpe import tokenizer_folder, train_bpe
from finetune_helpers import peft_random_b
from tolerances import assert_close

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("PIL.Image")

from test_qwen3_vl import (CORPUS, END, PAD, SPECIALS, START, TEMPLATE, VIDEO_CONFIG,  # noqa: E402
                           check_cli_finetune_and_generate, images, processor)
from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402
from wgpu_train.models.vision import VisionConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# 3 heads of 16, half of each rotated (4 pairs: t, h, w, t under mrope_section [2, 1, 1]); a Gated DeltaNet layer on
# either side of the full-attention one
TEXT = dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-5, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=6, linear_value_head_dim=5, linear_conv_kernel_dim=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"], pad_token_id=0, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=8, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=48, num_position_embeddings=16)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=10)
TOKENS = dict(image_token_id=PAD, video_token_id=6, vision_start_token_id=START, vision_end_token_id=END)
LINEAR = r".*language_model.*\.(in_proj_qkv|in_proj_z|in_proj_a|out_proj|q_proj|v_proj|down_proj)"


def build(folder, moe: bool = False):
    """A tiny random Qwen3.5 (or Qwen3.5-MoE) with its vision tower saved to `folder` with a tokenizer and the
    processor's config; the transformers model."""
    tok = train_bpe(CORPUS, 200, SPECIALS)
    tokenizer_folder(folder, tok, TEMPLATE, eos_token="<|im_end|>")
    text = {**TEXT, "vocab_size": tok.get_vocab_size(), **({} if moe else {"intermediate_size": 40}),
            **(EXPERTS if moe else {})}
    torch.manual_seed(1 if moe else 0)
    cls, cfg = ((tf.Qwen3_5MoeForConditionalGeneration, tf.Qwen3_5MoeConfig) if moe else
                (tf.Qwen3_5ForConditionalGeneration, tf.Qwen3_5Config))
    hf = cls(cfg(vision_config=VISION, text_config=text, **TOKENS))
    with torch.no_grad():       # norms start at one or zero, biases at zero: move every tensor (A_log modest)
        for name, p in hf.named_parameters():
            p.copy_((0.5 if "A_log" in name else 0.0) + 0.3 * torch.randn_like(p))
    hf.eval().save_pretrained(folder)
    processor().save_pretrained(folder)
    (folder / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    return hf


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_vision")
    hf = build(folder)
    return hf, folder, load_vision_model(folder)


def span(vm, img):
    return [START, *[PAD] * (int(np.prod(vm.pixel_values([img])[1])) // 4), END]


def hf_inputs(vm, ids, imgs):
    pixels, grids = vm.pixel_values(imgs)
    return dict(input_ids=torch.tensor(ids), pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grids),
                mm_token_type_ids=torch.tensor((np.asarray(ids) == PAD).astype(np.int64)))


def test_config_tower_and_logits_with_images_match_transformers(vlm):
    """The config read as Qwen3.5's (no DeepStack, mrope_section over the 4 rotated pairs); the tower's merged
    features; logits of two images with text between and after within 1e-4 of transformers, and not without the
    M-RoPE positions (the full-attention layer's partial rotary takes them)."""
    hf, _, vm = vlm
    assert vm.vision.name == "Qwen3.5" and vm.vision.deepstack_indexes == () and vm.vision.mrope_section == (2, 1, 1)
    imgs = images(2)
    pixels, grids = vm.pixel_values(imgs)
    with torch.no_grad():
        tower = hf.model.visual(torch.tensor(pixels), grid_thw=torch.tensor(grids)).pooler_output.numpy()
    embeds, deepstack = vm.tower(pixels, grids)
    assert_close(embeds, tower, "logits_f32", "merged features")
    assert deepstack == []
    ids = np.array([[7, 8, *span(vm, imgs[0]), 9, 10, *span(vm, imgs[1]), 11, 12, 13]])
    with torch.no_grad():
        want = hf(**hf_inputs(vm, ids, imgs)).logits.numpy()
    assert_close(vm.logits(ids, imgs), want, "logits_f32", "with images")
    vm.model.engine.set_images(dataclasses.replace(vm.image_tokens(ids, imgs), positions=None))
    try:
        other = vm.model.logits(vm._text_ids(ids))
    finally:
        vm.model.engine.set_images(None)
    assert np.abs(other - want).max() > 1e-3


def test_logits_with_a_video_and_an_image_match_transformers(vlm):
    """A video (3 frame groups) then an image: Qwen3.5's logits within 1e-4 of transformers (each frame group its
    own run of M-RoPE positions in the full-attention layer), in float64: torch's float32 strays 6.6e-5 from it
    here (the delta rule over the video's tokens), ours 1.4e-5."""
    from test_qwen3_vl_video import Video, frames, media_inputs, video_span

    hf, _, vm = vlm
    video, img = Video(tuple(frames(5, (30, 22), seed=6))), images(1, seed=6)[0]
    ids = np.array([[7, *video_span(vm, video), 12, *span(vm, img), 13]])
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in media_inputs(vm, ids, [video, img]).items()}
    with torch.no_grad():
        want = copy.deepcopy(hf).double()(**inputs).logits.numpy()
    assert_close(vm.logits(ids, [video, img]), want, "logits_f32", "with a video and an image")


def test_lora_gradients_with_images_match_peft(vlm):
    """LoRA on the language model's modules of both layer kinds (the linear attention's in-projections and
    out_proj, the gated attention's q / v, the MLP), a batch of two rows, one right-padded: loss and every LoRA
    gradient equal PEFT's autograd, the adapter read from PEFT's files."""
    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=LINEAR, lora_dropout=0.0)))
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
    assert any("in_proj_qkv" in n for n in expected) and any("q_proj" in n for n in expected)
    pm.save_pretrained(folder.parent / "qwen3_5_vision_adapter")
    vm.model.load_adapter(folder.parent / "qwen3_5_vision_adapter")
    loss, grads = vm.loss_and_grads(ids, labels, imgs, attention_mask=mask)
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "loss with images")
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def test_greedy_generation_with_images_matches_transformers(vlm):
    """The prompt prefilled with its images (the linear-attention layers' recurrent state over the image tokens),
    then each new token at its M-RoPE position: transformers' greedy tokens."""
    hf, _, vm = vlm
    imgs = images(2, seed=5)
    ids = np.array([7, *span(vm, imgs[0]), 8, *span(vm, imgs[1]), 9])
    with torch.no_grad():
        want = hf.generate(**hf_inputs(vm, ids[None], imgs), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert vm.generate(ids, imgs, max_new_tokens=8) == want


def test_packed_rows_restart_positions_and_state_per_segment(vlm):
    """Two sequences with images packed in one row (segment ids 1 and 2): each segment's M-RoPE positions count from
    0 and its linear-attention state starts from zero, so its logits equal the sequence's alone."""
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


def test_moe_logits_and_generation_with_images(tmp_path):
    """Qwen3_5MoeForConditionalGeneration: the same tower and positions, each layer's routed and shared experts:
    logits with an image within 1e-4 of transformers', and its greedy tokens."""
    hf = build(tmp_path, moe=True)
    vm = load_vision_model(tmp_path)
    assert vm.vision.name == "Qwen3.5" and vm.model.config.moe.num_experts == 4
    imgs = images(2, seed=7)
    ids = np.array([[7, *span(vm, imgs[0]), 8, 9, *span(vm, imgs[1]), 10]])
    with torch.no_grad():
        want = hf(**hf_inputs(vm, ids, imgs)).logits.numpy()
        gen = hf.generate(**hf_inputs(vm, ids, imgs), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                          pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert_close(vm.logits(ids, imgs), want, "logits_f32", "MoE with images")
    assert vm.generate(ids[0], imgs, max_new_tokens=5) == gen


def test_cli_finetune_and_generate_with_images(vlm, tmp_path, capsys):
    """`finetune --data` of TRL's vision records on Qwen3.5 (the NumPy engine; LoRA on the linear attention's
    in_proj_qkv and the attention's q_proj): the loss falls and the adapter loads in PEFT; `generate --image` with
    it gives transformers' greedy answer with the same adapter."""
    hf, folder, _ = vlm
    check_cli_finetune_and_generate(hf, folder, tmp_path, capsys, "in_proj_qkv,q_proj", span, hf_inputs)


def test_refusals_in_one_line(vlm):
    """mrope_section must add up to the rotated pairs (partial rotary: 4 of 8 here), and LoRA on a module the tower
    lacks, refused in one line."""
    _, folder, vm = vlm
    raw = json.loads((folder / "config.json").read_text())
    rope = {**raw["text_config"]["rope_parameters"], "mrope_section": [4, 2, 2]}
    with pytest.raises(ConfigError, match=r"mrope_section \[4, 2, 2\] .* rotated pairs of a head \(4\)"):
        VisionConfig.from_config({**raw, "text_config": {**raw["text_config"], "rope_parameters": rope}})

    with pytest.raises(ConfigError, match="not a linear module of the vision tower's blocks or mergers"):
        vm.set_tower_lora({"base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight":
                           np.zeros((2, 32))}, 1.0)
