"""Qwen3-VL with videos (frame lists; a video file through PyAV where installed) on the NumPy engine against
transformers: the video processor's pixel_values_videos and video_grid_thw, the processor's timestamped placeholder
expansion, the tower over t > 1 grids (attention within each frame group), logits with a video and with an image
and a video, LoRA gradients, greedy generation, `finetune` on video records and `generate --video`, the refusals."""
from __future__ import annotations

import copy
import json
import types

import numpy as np
import pytest

from wgpu_train.errors import DataError

from finetune_helpers import peft_random_b
from tolerances import assert_close
from test_qwen3_vl import END, PAD, START, VIDEO_CONFIG, hf_inputs, images, span, vlm  # noqa: F401  (its fixture)

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
Image = pytest.importorskip("PIL.Image")

from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: E402

from wgpu_train.data.qwen_videos import QwenVideoSettings, Video  # noqa: E402

VIDEO = 6       # <|video_pad|>


def frames(n, size=(29, 35), seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)) for _ in range(n)]


def reference_video(frame_list, cfg):
    """The video processor's pixel_values_videos and video_grid_thw: the processor itself where torchvision is
    installed (the class needs it; the shared environment has none); else its steps without it: its
    smart_resize and patchify (their source), the resize torchvision calls (torch's antialiased bicubic on
    uint8) and its fused rescale and normalise."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        proc = Qwen3VLVideoProcessor(**cfg)
        out = proc(videos=[frame_list], do_sample_frames=False, return_tensors="np")
        return out["pixel_values_videos"], out["video_grid_thw"]
    x = torch.from_numpy(np.stack([np.asarray(f) for f in frame_list])).permute(0, 3, 1, 2).contiguous()
    h, w = hf_function("smart_resize")(len(frame_list), x.shape[2], x.shape[3], 2, 16,
                                       cfg["size"]["shortest_edge"], cfg["size"]["longest_edge"])
    x = torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    mean, std = (torch.tensor(cfg[k]) * (1.0 / (1 / 255)) for k in ("image_mean", "image_std"))
    x = (x.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
    patches, t, gh, gw = hf_function("patchify")(None, x[None], 8, 2, 2)
    return patches[0].numpy(), np.array([[t, gh, gw]])


def hf_function(name: str):
    """A function of transformers' video_processing_qwen3_vl.py (smart_resize, or the processor's patchify
    method), its own source run here: without torchvision the module's names cannot be reached."""
    import ast
    import inspect
    import math

    source = (inspect.getfile(tf).removesuffix("__init__.py") + "models/qwen3_vl/video_processing_qwen3_vl.py")
    tree = ast.parse(open(source).read())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    scope = {"math": math, "torch": torch}
    exec(compile(ast.Module([node], []), source, "exec"), scope)
    return scope[name]


def test_video_pixel_values_equal_the_processors(vlm):
    """Odd frame sizes (rounded, scaled down past the clip's max pixels and up past its min, a side under a merge
    block scaled up first) and odd frame counts (the last frame repeated to fill the temporal patch): the
    processor's pixel_values_videos and video_grid_thw, bit for bit."""
    _, _, vm = vlm
    settings = vm.settings.video
    assert settings == QwenVideoSettings.from_dict(VIDEO_CONFIG, vm.vision)
    for n, size in ((3, (29, 35)), (5, (61, 45)), (4, (20, 90)), (3, (9, 13))):
        clip = frames(n, size, seed=n)
        want_pixels, want_grid = reference_video(clip, VIDEO_CONFIG)
        pixels, grid = settings.patches(Video(tuple(clip)))
        np.testing.assert_array_equal(pixels, want_pixels)
        np.testing.assert_array_equal([grid], want_grid)
        assert settings.grid(Video(tuple(clip))) == grid


def video_span(vm, video, first=20):
    """A video's tokens as the processor lays them out, a (made-up) timestamp token before each frame group."""
    t, h, w = vm.pixel_values([video])[1][0]
    return [tok for g in range(t) for tok in (first + g, START, *[VIDEO] * (h * w // 4), END)]


def media_inputs(vm, ids, media):
    """transformers' inputs for ids whose image and video runs take `media` (images and Videos) in order."""
    imgs = [m for m in media if not isinstance(m, Video)]
    vids = [m for m in media if isinstance(m, Video)]
    out = dict(hf_inputs(vm, ids, imgs)) if imgs else dict(input_ids=torch.tensor(ids))
    if vids:
        pixels, grids = vm.pixel_values(vids)
        out.update(pixel_values_videos=torch.tensor(pixels), video_grid_thw=torch.tensor(grids))
    ids = np.asarray(ids)
    out["mm_token_type_ids"] = torch.tensor(np.where(ids == PAD, 1, np.where(ids == VIDEO, 2, 0)))
    return out


def test_tower_over_video_grids_equals_get_video_features(vlm):
    """Two videos (t = 2 and 3 frame groups): the merger's and DeepStack features equal get_video_features'
    (attention within each frame group; over the whole clip they would differ)."""
    hf, _, vm = vlm
    pixels, grids = vm.pixel_values([Video(tuple(frames(3))), Video(tuple(frames(5, (21, 40), seed=2)))])
    assert grids[:, 0].tolist() == [2, 3]
    with torch.no_grad():
        want = hf.model.get_video_features(torch.tensor(pixels), torch.tensor(grids))
    embeds, deepstack = vm.tower(pixels, grids)
    assert_close(embeds, torch.cat(want.pooler_output).numpy(), "logits_f32", "video features")
    for got, ref in zip(deepstack, want.deepstack_features):
        assert_close(got, torch.cat(ref).numpy(), "logits_f32", "video DeepStack features")
    whole, _ = vm.tower(pixels[:32], np.array([[1, 4, 8]]))     # the first clip's patches as one image
    assert np.abs(whole - embeds[:8]).max() > 1e-3


def test_logits_with_a_video_and_with_an_image_and_a_video(vlm):
    """A video alone, then an image then a video in one row: logits within 1e-4 of transformers (each frame
    group a run of its own on M-RoPE's t, h, w; the DeepStack features in the row's order)."""
    hf, _, vm = vlm
    video, img = Video(tuple(frames(3, seed=4))), images(1, seed=4)[0]
    for media, ids in (([video], [7, *video_span(vm, video), 9, 10]),
                       ([img, video], [7, *span(vm, img), 8, *video_span(vm, video), 11])):
        ids = np.array([ids])
        with torch.no_grad():
            want = hf(**media_inputs(vm, ids, media)).logits.numpy()
        assert_close(vm.logits(ids, media), want, "logits_f32", f"with {len(media)} media")


def test_lora_gradients_and_generation_with_a_video_match(vlm):
    """LoRA on the language model with a video and an image in a row: loss and gradients equal PEFT's; greedy
    generation after a video prompt equals transformers' token for token."""
    hf, folder, _ = vlm
    from wgpu_train.engines.vision_model import load_vision_model

    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|v_proj)", lora_dropout=0.0)))
    vm = load_vision_model(folder)
    video, img = Video(tuple(frames(5, (30, 22), seed=6))), images(1, seed=6)[0]
    ids = np.array([[7, *video_span(vm, video), 12, *span(vm, img), 13, 14]])
    labels = np.where(np.isin(ids, (PAD, VIDEO, START, END)), -100, ids)
    out = pm(**media_inputs(vm, ids, [video, img]), labels=torch.tensor(labels))
    out.loss.backward()
    pm.save_pretrained(folder.parent / "video_adapter")
    vm.model.load_adapter(folder.parent / "video_adapter")
    loss, grads = vm.loss_and_grads(ids, labels, [video, img])
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "loss with a video")
    for n, p in pm.named_parameters():
        if p.requires_grad:
            key = n.replace(".default", "").replace("model.language_model.", "model.")
            assert_close(grads[key], p.grad.numpy(), "grads_f32", key)
    prompt = np.array([7, *video_span(vm, video), 9])
    with torch.no_grad():
        want = hf.generate(**media_inputs(vm, prompt[None], [video]), max_new_tokens=6, min_new_tokens=6,
                           do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    fresh = load_vision_model(folder)
    assert fresh.generate(prompt, [video], max_new_tokens=6) == want


def test_tower_lora_gradients_with_a_video_equal_peft(vlm, tmp_path):
    """LoRA on the tower (every block's and merger's linears, DeepStack's too) and the language model, a video
    then an image in a row: the tower's backward through each frame group's attention: loss and every gradient
    equal PEFT's."""
    from test_qwen3_vl_tower_lora import TARGETS, peft_key
    from wgpu_train.engines.vision_model import load_vision_model

    hf, folder, _ = vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=TARGETS, lora_dropout=0.0)))
    vm = load_vision_model(folder)
    video, img = Video(tuple(frames(5, (30, 22), seed=7))), images(1, seed=7)[0]
    ids = np.array([[7, *video_span(vm, video), 12, *span(vm, img), 13, 14]])
    labels = np.where(np.isin(ids, (PAD, VIDEO, START, END)), -100, ids)
    out = pm(**media_inputs(vm, ids, [video, img]), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {peft_key(n): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    pm.save_pretrained(tmp_path / "peft")
    vm.load_adapter(tmp_path / "peft")
    loss, grads = vm.loss_and_grads(ids, labels, [video, img])
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "loss with a video and tower LoRA")
    assert set(grads) == set(expected) and any(".visual.blocks." in k for k in grads)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def video_records(clip_paths):
    return [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                       {"type": "text", "text": "what colour?"}]},
                          {"role": "assistant", "content": "red"}], "images": ["red.png"], "videos": [clip_paths]},
            {"messages": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "and this"}]},
                          {"role": "assistant", "content": "blue"}], "videos": [clip_paths[::-1]]}]


def write_video_data(folder):
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (57, 41), (255, 0, 0)).save(folder / "red.png")
    names = []
    for i, f in enumerate(frames(3, seed=8)):
        f.save(folder / f"f{i}.png")
        names.append(f"f{i}.png")
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in video_records(names)))
    return folder / "train.jsonl"


def test_records_expand_videos_as_the_processor_does(vlm, tmp_path):
    """TRL-style records with an image and a video (a list of frame files): the chat template's
    <|vision_start|><|video_pad|><|vision_end|> replaced as Qwen3VLProcessor.replace_video_token does
    (`<t seconds>` before each frame group, 24 frames a second for frames given as they are), the image's pads
    as the image processor counts them; video tokens never trained."""
    from wgpu_train.data.vision_records import model_image_span, read_vision_records, tokenize_vision_dataset
    from wgpu_train.formats.tokenizer import load_tokenizer

    _, folder, vm = vlm
    tok, hf_tok = load_tokenizer(folder), tf.AutoTokenizer.from_pretrained(folder)
    recs = read_vision_records(write_video_data(tmp_path))
    examples, stats = tokenize_vision_dataset(tok, recs, model_image_span(tok, vm.vision, folder), 400)
    assert stats.n_examples == 2
    fake = types.SimpleNamespace(video_processor=types.SimpleNamespace(merge_size=2, temporal_patch_size=2),
                                 vision_start_token="<|vision_start|>", video_token="<|video_pad|>",
                                 vision_end_token="<|vision_end|>",
                                 _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a))
    for ex, rec in zip(examples, recs):
        media = [Video(tuple(rec["videos"][0]))] if "images" not in rec else [rec["images"][0],
                                                                               Video(tuple(rec["videos"][0]))]
        _, grids = vm.pixel_values(media)
        text = hf_tok.apply_chat_template(rec["messages"], tokenize=False)
        meta = types.SimpleNamespace(fps=None, frames_indices=list(range(3)))
        video = Qwen3VLProcessor.replace_video_token(fake, {"video_grid_thw": grids[-1:], "video_metadata": [meta]},
                                                     0)
        assert video.startswith("<0.0 seconds><|vision_start|>") and "<0.1 seconds>" in video
        text = text.replace("<|vision_start|><|video_pad|><|vision_end|>", video)
        if len(media) == 2:
            text = text.replace("<|image_pad|>", "<|image_pad|>" * int(grids[0].prod() // 4))
        np.testing.assert_array_equal(ex.input_ids, hf_tok(text)["input_ids"])
        assert not set(ex.labels[ex.labels >= 0].tolist()) & {START, END, PAD, VIDEO}


def test_cli_finetune_on_video_records_and_generate_video(vlm, tmp_path, capsys):
    """`finetune --data` of records with videos (frame files) trains (the loss falls); `generate --video` on a
    folder of frames gives the VisionModel's greedy answer to the same prompt."""
    from wgpu_train.cli.main import main
    from wgpu_train.data.vision_records import vision_prompt_ids
    from wgpu_train.engines.vision_model import load_vision_model
    from wgpu_train.formats.tokenizer import load_tokenizer

    _, folder, _ = vlm
    data = write_video_data(tmp_path / "data")
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", "numpy", "--max-steps", "4",
                 "--batch-size", "2", "--lr", "3e-2", "--lora-targets", "q_proj,v_proj", "--no-progress",
                 "--valid-split", "0", "--log-every", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 4 and losses[-1] < losses[0]
    clip = tmp_path / "clip"
    clip.mkdir()
    for i, f in enumerate(frames(3, seed=8)):
        f.save(clip / f"{i:03d}.png")
    assert main(["generate", "--model", str(folder), "--prompt", "what colour?", "--video", str(clip),
                 "--max-new-tokens", "4", "--backend", "numpy"]) == 0
    got = capsys.readouterr().out
    vm, tok = load_vision_model(folder), load_tokenizer(folder)
    video = vm.image_span(tok).as_video(str(clip))
    ids = vision_prompt_ids(tok, "what colour?", 0, vm.image_span(tok), videos=[video])
    answer = vm.generate(ids, [video], max_new_tokens=4, stop_token_ids=tok.stop_token_ids)
    assert got == tok.decode([t for t in answer if t not in tok.stop_token_ids]) + "\n"


def test_chat_video_turn_answers_as_generate_video(vlm, tmp_path, monkeypatch, capsys):
    """`chat` with /video (a folder of frames) answers as `generate --video`; /video on a missing path is a line on
    stderr and the chat goes on."""
    import io

    from wgpu_train.cli.main import main

    _, folder, _ = vlm
    clip = tmp_path / "clip"
    clip.mkdir()
    for i, f in enumerate(frames(3, seed=9)):
        f.save(clip / f"{i:03d}.png")
    assert main(["generate", "--model", str(folder), "--prompt", "what colour?", "--video", str(clip),
                 "--max-new-tokens", "4", "--backend", "numpy"]) == 0
    want = capsys.readouterr().out.removesuffix("\n")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/video {tmp_path / 'none'}\n/video {clip}\nwhat colour?\n"))
    assert main(["chat", "--model", str(folder), "--backend", "numpy", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.split("\n")[0] == want and f"(video {clip} attached to your next message)" in err
    assert "error: " in err and "no such video file or folder of frames" in err


def test_video_refusals_in_one_line(vlm, tmp_path, monkeypatch):
    """An undecodable frame, frames of two sizes, more video parts than videos, a video longer than --max-seq-len
    for every row, videos where they are not taken, a video file without PyAV: one line each."""
    import builtins

    from wgpu_train.data.vision_records import model_image_span, tokenize_vision_dataset
    from wgpu_train.formats.tokenizer import load_tokenizer

    _, folder, vm = vlm
    tok = load_tokenizer(folder)
    span_ = model_image_span(tok, vm.vision, folder)
    good = frames(2)
    user = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi"}]}
    rec = {"messages": [user, {"role": "assistant", "content": "red"}], "videos": [good]}
    cases = [({**rec, "videos": [[good[0], b"not an image"]]}, "record 0: video 0: frame 1: cannot decode"),
             ({**rec, "videos": [[good[0], frames(1, (30, 30))[0]]]}, "its frames differ in size"),
             ({**rec, "videos": []}, "1 video placeholders for 0 videos"),
             ({**rec, "videos": [str(tmp_path / "clip.mp4")]}, "no such video file")]
    for bad, message in cases:
        with pytest.raises(DataError, match=message) as e:
            tokenize_vision_dataset(tok, [bad], span_, 400)
        assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="every row's image tokens run past --max-seq-len 12"):
        tokenize_vision_dataset(tok, [rec], span_, 12)
    from wgpu_train.data.vision_records import vision_messages

    with pytest.raises(DataError, match="record 3: videos are taken only by supervised records of Qwen3-VL"):
        vision_messages(rec, "record 3")        # a span without videos (Gemma 3's, SmolVLM's), or DPO's records
    (tmp_path / "clip.mp4").write_bytes(b"\0" * 64)
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "av" else real_import(name, *a, **k))
    with pytest.raises(DataError, match="clip.mp4 is a video file; decoding it needs PyAV .pip install av."):
        tokenize_vision_dataset(tok, [{**rec, "videos": [str(tmp_path / "clip.mp4")]}], span_, 400)


def test_video_file_frames_sampled_as_the_processor(vlm, tmp_path):
    """A video file (written and read by PyAV; skipped where PyAV is not installed): the frames sampled at the
    processor's fps (2 a second of a 10 fps clip, np.linspace's rounding) and their timestamps."""
    av = pytest.importorskip("av")
    _, _, vm = vlm
    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(25):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 10, np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    from wgpu_train.data.qwen_videos import read_video_file

    video = read_video_file(path, vm.settings.video)
    assert video.indices == tuple(np.linspace(0, 24, 5).round().astype(int).tolist()) and video.fps == 10
    assert video.timestamps(2) == [(0 + 0.6) / 2, (1.2 + 1.8) / 2, 2.4]


def test_serve_refuses_video_url_parts():
    """serve takes no videos yet: a video_url part is a 400 in one line."""
    from wgpu_train.serve.api_error import ApiError
    from wgpu_train.serve.requests import parse_chat

    with pytest.raises(ApiError, match="only text and image_url parts are supported") as e:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "file:///clip.mp4"}}]}]})
    assert e.value.status == 400 and "\n" not in str(e.value)


def test_an_unsupported_video_config_refuses_videos_only(vlm, tmp_path):
    """A video_preprocessor_config.json this code does not follow (cap_pixels_per_frame) leaves images running
    and refuses a video in one line naming it."""
    import shutil

    from wgpu_train.data.qwen_images import QwenImageSettings

    _, folder, vm = vlm
    shutil.copy(folder / "preprocessor_config.json", tmp_path)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({**VIDEO_CONFIG,
                                                                          "cap_pixels_per_frame": True}))
    settings = QwenImageSettings.from_folder(tmp_path, vm.vision)
    assert settings.batch(images(1))[1].shape == (1, 3)
    with pytest.raises(DataError, match="videos are not supported here .*cap_pixels_per_frame true"):
        settings.batch([Video(tuple(frames(2)))])
