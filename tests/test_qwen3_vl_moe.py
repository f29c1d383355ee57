"""Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration) with images on the NumPy engine against transformers and PEFT:
Qwen3-VL's tower, M-RoPE and DeepStack around Qwen3-MoE's layers (top-k renormalised always); logits, LoRA gradients
on the attention and the experts with the router's aux loss, greedy generation, the published checkpoints' (E, in,
out) expert tensors, `finetune` + `generate --image`, `merge` (and `--gguf`: the language model) and `memory` of
Qwen3-VL-30B-A3B's config."""
from __future__ import annotations

import copy
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
                           check_cli_finetune_and_generate, hf_inputs, images, processor, span)
from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402
from wgpu_train.models.config import ModelConfig  # noqa: E402
from wgpu_train.models.moe import router_aux_loss_coef  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# 2 layers of 4 experts, top 2, the second layer's experts at a width of their own; DeepStack into both layers
TEXT = dict(hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, eos_token_id=2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=20, rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                       "mrope_section": [4, 2, 2], "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=8, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[1, 0])
TOKENS = dict(image_token_id=PAD, video_token_id=6, vision_start_token_id=START, vision_end_token_id=END)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The tiny random Qwen3-VL-MoE saved by transformers (its fused experts (E, out, in)) with a tokenizer and the
    processor's config: (transformers' model, folder, NumPy VisionModel)."""
    folder = tmp_path_factory.mktemp("qwen3_vl_moe")
    tok = train_bpe(CORPUS, 200, SPECIALS)
    tokenizer_folder(folder, tok, TEMPLATE, eos_token="<|im_end|>")
    torch.manual_seed(2)
    hf = tf.Qwen3VLMoeForConditionalGeneration(tf.Qwen3VLMoeConfig(
        vision_config=VISION, text_config={**TEXT, "vocab_size": tok.get_vocab_size()}, **TOKENS))
    with torch.no_grad():       # norms start at one, biases at zero: move every tensor
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for layer in hf.model.language_model.layers:      # routers far from a tie: the top 2 are clear
            layer.mlp.gate.weight.mul_(20.0)
    hf.eval().save_pretrained(folder)
    processor().save_pretrained(folder)
    (folder / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    return hf, folder, load_vision_model(folder)


def test_config_and_logits_with_two_images_match_transformers(vlm):
    """Read as Qwen3-MoE's layers (4 experts, top 2, renormalised though the config has no norm_topk_prob) under
    Qwen3-VL's tower with DeepStack; logits of two images of odd sizes, and of an image and a video, within 1e-4 of
    transformers'."""
    hf, folder, vm = vlm
    cfg = vm.model.config
    assert cfg.family == "qwen3_moe" and cfg.wrapper == "Qwen3VLMoeForConditionalGeneration"
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_size, cfg.moe.normalize) == (4, 2, 20, True)
    assert vm.vision.name == "Qwen3-VL" and vm.vision.deepstack_indexes == (1, 0)
    raw = json.loads((folder / "config.json").read_text())     # the aux loss as transformers reads text_config's
    on = ModelConfig.from_dict({**raw, "text_config": {**raw["text_config"], "output_router_logits": True,
                                                       "router_aux_loss_coef": 0.02}})
    assert router_aux_loss_coef(cfg.moe, None) == 0.0 and router_aux_loss_coef(on.moe, None) == 0.02
    imgs = images(2)
    ids = np.array([[7, 8, *span(vm, imgs[0]), 9, 10, *span(vm, imgs[1]), 11, 12, 13]])
    with torch.no_grad():
        want = hf(**hf_inputs(vm, ids, imgs)).logits.numpy()
    assert_close(vm.logits(ids, imgs), want, "logits_f32", "Qwen3-VL-MoE with images")
    from test_qwen3_vl_video import Video, frames, media_inputs, video_span

    video = Video(tuple(frames(5, (30, 22), seed=6)))       # and an image then a video (3 frame groups)
    ids = np.array([[7, *span(vm, imgs[0]), 12, *video_span(vm, video), 13]])
    with torch.no_grad():
        want = hf(**media_inputs(vm, ids, [imgs[0], video])).logits.numpy()
    assert_close(vm.logits(ids, [imgs[0], video]), want, "logits_f32", "Qwen3-VL-MoE with a video")


def test_lora_gradients_with_aux_loss_match_peft(vlm):
    """LoRA on q / k / v / o and on the experts (PEFT's target_parameters), the router's aux loss on at 0.3, a
    batch of two rows with three images, one right-padded: the loss and every LoRA gradient equal PEFT's autograd."""
    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=ATTENTION, target_parameters=EXPERTS, lora_dropout=0.0)), 3)
    vm = load_vision_model(folder)
    imgs = images(3, seed=3)
    rows = [[7, *span(vm, imgs[0]), 11, 12, *span(vm, imgs[1]), 13, 14], [8, 9, *span(vm, imgs[2]), 15]]
    width = max(map(len, rows))
    ids = np.array([r + [0] * (width - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = np.where((ids != PAD) & (mask == 1), ids, -100)
    out = pm(**hf_inputs(vm, ids, imgs), attention_mask=torch.tensor(mask), labels=torch.tensor(labels),
             output_router_logits=True)
    (out.loss - 0.001 * out.aux_loss + 0.3 * out.aux_loss).backward()      # coef 0.3: its gradient shows
    expected = {n.replace(".default", "").replace("model.language_model.", "model."): p.grad.numpy()
                for n, p in pm.named_parameters() if p.requires_grad}
    assert any("experts" in n for n in expected) and any("o_proj" in n for n in expected)
    pm.save_pretrained(folder.parent / "qwen3_vl_moe_adapter")
    vm.model.load_adapter(folder.parent / "qwen3_vl_moe_adapter")
    vm.model.engine.set_router_aux_loss(0.3)
    loss, grads = vm.loss_and_grads(ids, labels, imgs, attention_mask=mask)
    assert_close(np.float64(loss), out.loss.item() - 0.001 * out.aux_loss.item(), "loss_f32", "token loss")
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def test_tower_lora_gradients_and_adapter_equal_peft(vlm, tmp_path):
    """LoRA on the tower's blocks and mergers (DeepStack's too) beside q / v of the MoE language model: Qwen3-VL's
    tower LoRA check (test_qwen3_vl_tower_lora.py) on the MoE class."""
    from test_qwen3_vl_tower_lora import check_against_peft

    hf, folder, vm = vlm
    imgs = images(3, seed=3)
    rows = [[7, *span(vm, imgs[0]), 11, 12, *span(vm, imgs[1]), 13, 14], [8, 9, *span(vm, imgs[2]), 15]]
    check_against_peft(hf, folder, tmp_path, imgs, rows)


def test_greedy_generation_with_images_matches_transformers(vlm):
    hf, _, vm = vlm
    imgs = images(2, seed=5)
    ids = np.array([7, *span(vm, imgs[0]), 8, *span(vm, imgs[1]), 9])
    with torch.no_grad():
        want = hf.generate(**hf_inputs(vm, ids[None], imgs), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert vm.generate(ids, imgs, max_new_tokens=8) == want


def test_published_in_out_expert_layout_reads_the_same(vlm, tmp_path):
    """The hub's Qwen3-VL-MoE checkpoints store gate_up_proj (E, hidden, 2I) and down_proj (E, I, hidden): a folder
    written so gives the same logits as transformers 5's layout (transposed on reading, as transformers does), and
    `merge` writes its experts back so (transformers 4.57 and the hub's readers take only that); transformers reads
    the merged folder with PEFT's merge_and_unload logits."""
    import shutil

    from wgpu_train.cli.main import main
    from wgpu_train.formats.safetensors import read_safetensors, write_safetensors

    hf, folder, vm = vlm
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            shutil.copyfile(f, tmp_path / f.name)
    tensors = read_safetensors(folder / "model.safetensors")
    swapped = {k: np.ascontiguousarray(np.swapaxes(v, 1, 2)) if ".mlp.experts." in k else v for k, v in tensors.items()}
    assert swapped["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 40)
    write_safetensors(tmp_path / "model.safetensors", swapped, metadata={"format": "pt"})
    imgs = images(1, seed=2)
    ids = np.array([[7, *span(vm, imgs[0]), 8, 9]])
    assert_close(load_vision_model(tmp_path).logits(ids, imgs), vm.logits(ids, imgs), "logits_f32", "(E, in, out)")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.q_proj", target_parameters=EXPERTS[1:])), 6)
    pm.save_pretrained(tmp_path / "adapter")
    assert main(["merge", "--model", str(tmp_path), "--adapter-path", str(tmp_path / "adapter"), "--out",
                 str(tmp_path / "merged")]) == 0
    merged = read_safetensors(tmp_path / "merged" / "model.safetensors")
    for name in ("gate_up_proj", "down_proj"):
        name = f"model.language_model.layers.1.mlp.experts.{name}"
        assert merged[name].shape == swapped[name].shape
    np.testing.assert_array_equal(merged[name.replace("down", "gate_up")], swapped[name.replace("down", "gate_up")])
    with torch.no_grad():
        want = pm.merge_and_unload()(**hf_inputs(vm, ids, imgs)).logits.numpy()
        got = tf.Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()(
            **hf_inputs(vm, ids, imgs)).logits.numpy()
    assert_close(got, want, "logits_f32", "merged from (E, in, out)")


def test_cli_finetune_and_generate_with_images(vlm, tmp_path, capsys):
    """`finetune --data` of TRL's vision records (LoRA on q_proj, v_proj and the router, which PEFT adapts as a
    parameter beside the language model's regular expression; the NumPy engine): the loss falls, the adapter loads
    in PEFT, and `generate --image` with it gives transformers' greedy answer."""
    hf, folder, _ = vlm
    check_cli_finetune_and_generate(hf, folder, tmp_path, capsys, "q_proj,v_proj,gate", span, hf_inputs)
    saved = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert saved["target_parameters"] == ["gate.weight"] and "gate" not in saved["target_modules"]


def test_memory_of_qwen3_vl_30b_a3b(tmp_path, capsys):
    """`memory` on Qwen3-VL-30B-A3B-Instruct's published config.json: the language model's weights about 30.5 B
    parameters (128 experts of 768 in each of 48 layers) beside the tower's 0.54 B (31.1 B in all, as the model
    card says)."""
    from wgpu_train.cli.main import main

    text = dict(attention_bias=False, attention_dropout=0.0, bos_token_id=151643, decoder_sparse_step=1,
                dtype="bfloat16", eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=2048,
                initializer_range=0.02, intermediate_size=6144, max_position_embeddings=262144, mlp_only_layers=[],
                model_type="qwen3_vl_moe_text", moe_intermediate_size=768, norm_topk_prob=True,
                num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
                num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=5000000, use_cache=True, vocab_size=151936,
                rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"})
    vision = dict(deepstack_visual_indexes=[8, 16, 24], depth=27, hidden_act="gelu_pytorch_tanh", hidden_size=1152,
                  in_channels=3, initializer_range=0.02, intermediate_size=4304, model_type="qwen3_vl_moe",
                  num_heads=16, num_position_embeddings=2304, out_hidden_size=2048, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2)
    raw = dict(architectures=["Qwen3VLMoeForConditionalGeneration"], image_token_id=151655,
               model_type="qwen3_vl_moe", text_config=text, tie_word_embeddings=False, video_token_id=151656,
               vision_config=vision, vision_end_token_id=151653, vision_start_token_id=151652)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["memory", "--model", str(tmp_path), "--max-seq-len", "1024", "--base-dtype",
                 "bfloat16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    print(json.dumps(out)[:2000])
    assert 30.0e9 < out["parameters"] < 31.0e9
    assert 0.53e9 < out["vision"]["tower_parameters"] < 0.54e9          # its 3 DeepStack mergers included
    assert out["total"] > 2 * out["parameters"]


def test_merge_keeps_the_tower_and_gguf_writes_the_language_model(vlm, tmp_path):
    """`merge --gguf` of a PEFT adapter on q_proj and the experts: the merged folder loads in transformers as
    Qwen3VLMoeForConditionalGeneration with PEFT's merge_and_unload logits over an image (the tower carried); the GGUF
    holds the language model alone, as dense Qwen3-VL's does (llama.cpp's qwen3moe: M-RoPE of text tokens is plain
    RoPE), its experts stacked and no tower tensor."""
    gguf = pytest.importorskip("gguf")
    from wgpu_train.cli.main import main

    hf, folder, vm = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.q_proj", target_parameters=EXPERTS)), 5)
    pm.save_pretrained(tmp_path / "adapter")
    merged, out = tmp_path / "merged", tmp_path / "m.gguf"
    assert main(["merge", "--model", str(folder), "--adapter-path", str(tmp_path / "adapter"), "--out", str(merged),
                 "--gguf", str(out), "--gguf-type", "f32"]) == 0
    imgs = images(1, seed=4)
    ids = np.array([[7, *span(vm, imgs[0]), 8, 9]])
    with torch.no_grad():
        want = pm.merge_and_unload()(**hf_inputs(vm, ids, imgs)).logits.numpy()
        got = tf.Qwen3VLMoeForConditionalGeneration.from_pretrained(merged).eval()(**hf_inputs(vm, ids, imgs))
    assert_close(got.logits.numpy(), want, "logits_f32", "merged folder")
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.architecture"].contents() == "qwen3moe"
    names = {t.name for t in reader.tensors}
    assert {"blk.1.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight", "blk.0.attn_q.weight"} <= names
    assert not [n for n in names if n.startswith(("v.", "mm."))]
