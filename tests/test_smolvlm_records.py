"""SmolVLM with images, records and the CLI: TRL's vision records tokenized as SmolVLMProcessor does (its tiles'
prompt, token for token), a train step's LoRA gradients against PEFT, `generate --image` against transformers'
greedy answer, `chat` and `serve` with its images as `generate --image`; what is not supported refused in one line."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from wgpu_train.errors import DataError

from finetune_helpers import peft_random_b
from test_smolvlm import SIDE, Image, images, load_vision_model, peft, processor, tf, tiny_config, torch
from tolerances import assert_close

TEMPLATE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>",
                     "<global-img>", "<image>"] + [f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)]
IMAGE = 5       # <image>'s id


def vision_records():
    red, blue = Image.new("RGB", (30, 20), (255, 0, 0)), Image.new("RGB", (9, 31), (0, 0, 255))
    return [
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
                      {"role": "user", "content": [{"type": "text", "text": "and this"}, {"type": "image"}]},
                      {"role": "assistant", "content": "blue"}], "images": [red, blue]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "describe the picture"},
                                                   {"type": "image"}]},
                      {"role": "assistant", "content": "green squares"}], "images": [images(1, seed=7)[0]]},
        {"messages": [{"role": "user", "content": "no picture here"},
                      {"role": "assistant", "content": "red blue"}], "images": []},
    ]


@pytest.fixture(scope="module")
def chat_vlm(tmp_path_factory):
    """A tiny SmolVLM whose vocabulary is a BPE tokenizer's with SmolVLM's image tokens and its chat template, and
    SmolVLMProcessor's steps over the same files (TransformersProcessor)."""
    from bpe import train_bpe
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    folder = tmp_path_factory.mktemp("smolvlm_chat")
    tok = train_bpe(["User what colour is it? Assistant red blue green", "describe the picture and this squares",
                     "no picture here"], 220, TEMPLATE_SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<end_of_utterance>", "pad_token": "<|endoftext|>",
        "chat_template": DEFAULT_CHAT_TEMPLATE}))
    torch.manual_seed(1)
    cfg = tiny_config()
    cfg.image_token_id = IMAGE
    cfg.text_config.vocab_size = tok.get_vocab_size()
    cfg.text_config.eos_token_id = 2
    cfg.text_config.max_position_embeddings = 512      # a chat's two turns with an image's ten tiles
    hf = tf.SmolVLMForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(folder)
    processor().save_pretrained(folder)
    return hf, folder, TransformersProcessor(folder)


class TransformersProcessor:
    """SmolVLMProcessor's steps for images and text, from transformers' own parts (the processor class itself
    also wants a video processor, which needs torchvision): the image processor's tiles with their rows and cols,
    each <image> of the text replaced by get_image_prompt_string, the tokenizer's ids."""

    def __init__(self, folder):
        self.tokenizer = tf.AutoTokenizer.from_pretrained(folder)
        self.images = processor()

    def apply_chat_template(self, messages, **kw):
        return self.tokenizer.apply_chat_template(messages, **kw)

    def __call__(self, text, images=None, return_tensors="np"):
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        out = {}
        if images:
            px = self.images(images=images, return_tensors=return_tensors, return_row_col_info=True)
            parts = text[0].split("<image>")
            grids = list(zip(px["rows"][0], px["cols"][0]))
            assert len(parts) == len(grids) + 1
            prompts = [get_image_prompt_string(r, c, 4, "<fake_token_around_image>", "<image>", "<global-img>")
                       for r, c in grids]
            text = [parts[0] + "".join(e + p for e, p in zip(prompts, parts[1:]))]
            out["pixel_values"] = px["pixel_values"]
        out["input_ids"] = self.tokenizer(text, return_tensors=return_tensors)["input_ids"]
        return out


def our_examples(folder, max_seq_len=400):
    from wgpu_train.data.vision_records import model_image_span, tokenize_vision_dataset
    from wgpu_train.formats.tokenizer import load_tokenizer
    from wgpu_train.models.vision import VisionConfig

    tok = load_tokenizer(folder)
    vc = VisionConfig.from_config(json.loads((folder / "config.json").read_text()))
    return tokenize_vision_dataset(tok, vision_records(), model_image_span(tok, vc, folder), max_seq_len), tok


def test_records_tokenize_as_the_processor_does(chat_vlm):
    """TRL's vision records: input_ids and pixel_values equal SmolVLMProcessor's over the chat template's text
    (each image its tiles' prompt); labels only on the assistant's turns, never on an image's tokens."""
    _, folder, proc = chat_vlm
    (examples, stats), tok = our_examples(folder)
    assert stats.n_examples == 3 and stats.n_cut_in_image == 0
    vm = load_vision_model(folder)
    for ex, rec in zip(examples, vision_records()):
        text = proc.apply_chat_template(rec["messages"], tokenize=False)
        want = proc(text=[text], images=[rec["images"]] if rec["images"] else None, return_tensors="np")
        np.testing.assert_array_equal(ex.input_ids, want["input_ids"][0])
        if rec["images"]:
            np.testing.assert_array_equal(vm.pixel_values(ex.images), want["pixel_values"][0])
        assert not set(ex.labels[ex.labels >= 0].tolist()) & set(range(3, len(TEMPLATE_SPECIALS)))
    assert (examples[0].input_ids == IMAGE).sum() == 4 * (2 * 3 + 1 + 3 * 1 + 1)    # 2 x 3 and 3 x 1 tiles, globals
    assert tok.decode(examples[0].labels[examples[0].labels >= 0].tolist(), skip_special_tokens=False) == \
        " red<end_of_utterance> blue<end_of_utterance>"


def test_a_row_cut_inside_an_image_is_dropped(chat_vlm):
    _, folder, _ = chat_vlm
    (full, _), _ = our_examples(folder)
    cut_at = int(np.flatnonzero(full[0].input_ids == IMAGE)[-1])      # inside record 0's second image
    (examples, stats), _ = our_examples(folder, max_seq_len=cut_at)
    assert stats.n_cut_in_image == 1 and [len(e.images) for e in examples] == [1, 0]


def test_train_step_with_images_gives_pefts_gradients(chat_vlm, tmp_path):
    """One step over two micro-batches of tokenized records (one without images): the loss and token-weighted
    LoRA gradients equal PEFT's over the whole batch; the step moves the adapter."""
    from wgpu_train.engines.protocol import OptimizerParams

    hf, folder, _ = chat_vlm
    (examples, _), _ = our_examples(folder)
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*text_model.*\.(q_proj|o_proj|up_proj)", lora_dropout=0.0)), 3)
    t = max(len(e.input_ids) for e in examples)
    ids = np.zeros((3, t), np.int64)
    labels = np.full((3, t), -100)
    for i, e in enumerate(examples):
        ids[i, :len(e.input_ids)], labels[i, :len(e.input_ids)] = e.input_ids, e.labels
    vm = load_vision_model(folder)
    tiles = [vm.pixel_values(e.images) for e in examples]
    px = np.zeros((3, max(len(x) for x in tiles), 3, SIDE, SIDE), np.float32)   # the processor's zero padding
    for i, x in enumerate(tiles):
        px[i, :len(x)] = x
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor((ids != 0).astype(np.int64)),
             pixel_values=torch.tensor(px), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default", "").replace("model.text_model.", "model."): p.grad.numpy()
                for n, p in pm.named_parameters() if p.requires_grad}
    pm.save_pretrained(tmp_path / "a")
    vm.model.load_adapter(tmp_path / "a")
    before = {k: v.copy() for k, v in vm.model.lora_state_dict().items()}
    seen = []

    def reduce(flat, total):
        seen.append(flat.copy())
        return flat
    loss_sum, count, _, applied = vm.train_step([examples[:2], examples[2:]], OptimizerParams(lr=1e-3), 1, reduce)
    assert applied and count == int((labels[:, 1:] != -100).sum())
    assert_close(np.float64(loss_sum / count), out.loss.item(), "loss_f32", "step loss")
    shapes = vm.model.engine.gradients()
    offsets = np.cumsum([0] + [g.size for g in shapes.values()])
    grads = vm.model._public_grad_names({k: seen[0][a:b].reshape(g.shape) for (k, g), a, b in
                                         zip(shapes.items(), offsets[:-1], offsets[1:])})
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)
    assert any(np.abs(v - before[k]).max() > 1e-4 for k, v in vm.model.lora_state_dict().items())


def test_adapter_files_load_in_peft(chat_vlm, tmp_path):
    """An adapter of SmolVLM's language model saved by us in PEFT's names (model.text_model): PEFT loads it, and its
    logits with an image equal ours and the original PEFT model's."""
    hf, folder, _ = chat_vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=r".*text_model.*\.(q_proj|down_proj)", lora_dropout=0.0)), 5)
    pm.save_pretrained(tmp_path / "peft")
    vm = load_vision_model(folder)
    vm.model.load_adapter(tmp_path / "peft")
    vm.save_adapter(tmp_path / "ours")
    raw = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert raw["target_modules"].startswith(r"model\.text_model\.layers")
    again = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    img = images(1, seed=4)
    n = len(vm.pixel_values(img))
    ids = np.array([[7, *[IMAGE] * (4 * n), 8, 9]])
    px = torch.tensor(vm.pixel_values(img)[None])
    with torch.no_grad():
        want, first = (m(input_ids=torch.tensor(ids), pixel_values=px).logits.numpy() for m in (again, pm))
    assert_close(want, first, "logits_f32", "PEFT's adapter and ours in PEFT")
    assert_close(vm.logits(ids, img), want, "logits_f32", "adapter in PEFT")


def test_cli_generate_with_an_image_matches_transformers(chat_vlm, tmp_path, capsys):
    """`generate --image`: the processor's prompt (chat template, the image's tiles expanded), transformers'
    greedy answer token for token."""
    from wgpu_train.cli.main import main
    from wgpu_train.formats.tokenizer import load_tokenizer

    hf, folder, proc = chat_vlm
    img = images(1, seed=9)[0]
    img.save(tmp_path / "x.png")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it?"}]}]
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = proc(text=[text], images=[[img]], return_tensors="pt")
    tok = load_tokenizer(folder)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=5, do_sample=False, eos_token_id=list(tok.stop_token_ids),
                          pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    want = tok.decode([t for t in out if t not in tok.stop_token_ids])
    assert want.strip()
    assert main(["generate", "--model", str(folder), "--prompt", "what colour is it?", "--image",
                 str(tmp_path / "x.png"), "--max-new-tokens", "5", "--backend", "numpy"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_cli_finetune_on_smolvlm_images(chat_vlm, tmp_path, capsys):
    """`finetune --data` of TRL's vision records on SmolVLM runs the main Trainer with its tiles' span (the step's
    gradients are checked against PEFT above): every record and image trained, and the adapter it writes loads in
    PEFT with trained B matrices."""
    from test_gemma3_vision_training import write_vision_data
    from wgpu_train.cli.main import main

    hf, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", "numpy", "--max-steps", "2",
                 "--batch-size", "3", "--lr", "1e-2", "--lora-targets", "q_proj,v_proj", "--no-progress",
                 "--valid-split", "0", "--log-every", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["images"] == 3 and summary["n_train"] == 3
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), out)
    assert any(np.abs(p.detach().numpy()).max() > 0 for n, p in pm.named_parameters() if "lora_B" in n)


def test_cli_tower_lora_on_webgpu_equals_numpy(chat_vlm, tmp_path, default_rt, capsys):
    """finetune --lora-targets q_proj,v_proj,vision_model,connector --backend wgpu: SmolVLM's tower (its tiles) with
    LoRA on its encoder and connector on the device gives --backend numpy's losses and adapter after 3 steps."""
    from test_gemma3_vision_training import write_vision_data
    from wgpu_train.cli.main import main
    from wgpu_train.formats.safetensors import read_safetensors

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    runs = {}
    for backend in ("numpy", "wgpu"):
        out = tmp_path / backend
        device = ["--device", str(default_rt.info.index)] if backend == "wgpu" else []
        assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", backend, *device,
                     "--max-steps", "3", "--batch-size", "2", "--lr", "1e-2", "--lora-targets",
                     "q_proj,v_proj,vision_model,connector", "--no-progress", "--valid-split", "0", "--log-every", "1",
                     "--out", str(out)]) == 0
        assert ("(on the device)" in capsys.readouterr().err) == (backend == "wgpu")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[backend] = ([r["loss"] for r in rows if "loss" in r and "split" not in r],
                         read_safetensors(out / "adapter_model.safetensors"))
    (loss_c, ad_c), (loss_g, ad_g) = runs["numpy"], runs["wgpu"]
    assert len(loss_g) == 3 and set(ad_g) == set(ad_c) and sum(".vision_model." in k for k in ad_c) == 2 * 2 * 6
    assert sum(".connector.modality_projection.proj." in k for k in ad_c) == 2
    assert_close(np.array(loss_g), np.array(loss_c), "loss_f32", "losses")
    for name in ad_c:
        assert_close(ad_g[name], ad_c[name], "gpu_params_after_steps_lr1e-2", name)


def test_chat_image_turn_answers_as_generate_image(chat_vlm, tmp_path, monkeypatch, capsys):
    """`chat` with /image on SmolVLM: the first turn generate --image's answer; the next turn the greedy answer to
    the whole conversation, the first image's tiles in it; `serve`'s VisionModel is the same (it takes images)."""
    import io

    from wgpu_train.cli.main import main
    from wgpu_train.cli.vision import vision_of
    from wgpu_train.data.vision_records import vision_chat_ids
    from wgpu_train.formats.tokenizer import load_tokenizer

    _, folder, _ = chat_vlm
    path = tmp_path / "x.png"
    images(1, seed=9)[0].save(path)
    assert main(["generate", "--model", str(folder), "--prompt", "what colour is it?", "--image", str(path),
                 "--max-new-tokens", "5", "--backend", "numpy"]) == 0
    want = capsys.readouterr().out.removesuffix("\n")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {path}\nwhat colour is it?\ndescribe the picture\n"))
    assert main(["chat", "--model", str(folder), "--backend", "numpy", "--max-new-tokens", "5"]) == 0
    answers = capsys.readouterr().out.split("\n")[:-1]       # an answer may hold a carriage return
    assert answers[0] == want and len(answers) == 2
    vm, tok = load_vision_model(folder), load_tokenizer(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it?"}]},
                {"role": "assistant", "content": answers[0]}, {"role": "user", "content": "describe the picture"}]
    ids = vision_chat_ids(tok, messages, 1, vm.image_span(tok), [path])
    new = vm.generate(ids, [path], 5, tuple(tok.stop_token_ids))
    assert answers[1] == tok.decode([t for t in new if t not in tok.stop_token_ids])
    assert vision_of(vm.model, folder) is not None


def test_serve_answers_an_image_as_generate_image(chat_vlm, tmp_path, capsys):
    """`serve` on SmolVLM: the openai client's answer to an image (a data: URL; its tiles expanded by its size)
    equals `generate --image`'s, also with a text request in the same batch; an undecodable image is a 400."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    import base64
    import time
    from concurrent.futures import ThreadPoolExecutor

    from wgpu_train.cli.main import build_parser, main
    from wgpu_train.cli.serve import prepare
    from wgpu_train.serve.app import build_app
    from wgpu_train.serve.server import ServerThread

    _, folder, _ = chat_vlm
    path = tmp_path / "x.png"
    images(1, seed=9)[0].save(path)
    assert main(["generate", "--model", str(folder), "--prompt", "what colour is it?", "--image", str(path),
                 "--max-new-tokens", "5", "--backend", "numpy"]) == 0
    want = capsys.readouterr().out.removesuffix("\n")
    assert want.strip()
    args = build_parser().parse_args(["serve", "--model", str(folder), "--backend", "numpy", "--port", "0",
                                      "--max-batch", "2", "--served-model-name", "default"])
    scheduler, sock = prepare(args)
    thread = ServerThread(build_app(scheduler, None), sock).start()
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def ask(url=None, text="what colour is it?"):
        image = [] if url is None else [{"type": "image_url", "image_url": {"url": url}}]
        r = client.chat.completions.create(model="default", max_tokens=5, temperature=0, messages=[
            {"role": "user", "content": image + [{"type": "text", "text": text}]}])
        return r.choices[0].message.content, r.usage.prompt_tokens

    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    try:
        with ThreadPoolExecutor(2) as pool:     # both queued before the worker starts: one batch takes them
            futures = [pool.submit(ask, url), pool.submit(ask, None, "describe the picture")]
            deadline = time.monotonic() + 60
            while len(scheduler._waiting) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            scheduler.start()
            together = [f.result() for f in futures]
        assert scheduler.stats["largest_batch"] == 2
        answer, prompt_tokens = ask(url)
        assert answer == want and prompt_tokens > 10 * 4        # the image's 3 x 3 tiles and global image
        assert together == [(answer, prompt_tokens), ask(text="describe the picture")]
        with pytest.raises(openai.BadRequestError) as e:
            ask("data:image/png;base64," + base64.b64encode(b"\x89PNG broken").decode())
        assert e.value.status_code == 400 and e.value.code == "invalid_image" and "cannot decode" in e.value.message
    finally:
        thread.stop()
        scheduler.close()


def test_cli_finetune_trains_smolvlms_tower_as_peft_names_it(chat_vlm, tmp_path, capsys):
    """`--lora-targets` naming SmolVLM's tower (vision_model.q_proj, fc1: PEFT's names under model.vision_model) and
    its connector (connector: model.connector.modality_projection.proj): their LoRA trains, and the adapter loads
    in PEFT, whose logits with an image equal ours with it."""
    from test_gemma3_vision_training import write_vision_data
    from wgpu_train.cli.main import main

    hf, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", "numpy", "--max-steps", "2",
                 "--batch-size", "3", "--lr", "1e-2", "--lora-targets",
                 "q_proj,v_proj,vision_model.q_proj,fc1,connector", "--no-progress", "--valid-split", "0", "--out",
                 str(out)]) == 0
    assert "LoRA on the vision tower: self_attn.q_proj, mlp.fc1, modality_projection.proj" in capsys.readouterr().err
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), out).eval()
    tower = {n: p.detach().numpy() for n, p in pm.named_parameters() if "lora_B" in n and (
        ".vision_model." in n or ".connector." in n)}
    assert len(tower) == 2 * hf.config.vision_config.num_hidden_layers + 1 and all(np.abs(b).max() > 0
                                                                                    for b in tower.values())
    vm = load_vision_model(folder)
    vm.load_adapter(out)
    img = images(1, seed=4)
    n = len(vm.pixel_values(img))
    ids = np.array([[7, *[IMAGE] * (4 * n), 8, 9]])
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids), pixel_values=torch.tensor(vm.pixel_values(img)[None])).logits.numpy()
    assert_close(vm.logits(ids, img), want, "logits_f32", "the trained adapter in PEFT")
