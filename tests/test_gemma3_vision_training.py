"""Gemma 3 with images, training: TRL's vision records tokenized as Gemma3Processor does, train steps against PEFT,
torch AdamW and TRL's SFTTrainer, LoRA on the vision tower, adapter files, and the CLI (finetune, generate --image)."""
from __future__ import annotations

import copy
import io

import numpy as np
import pytest

import wgpu_train
from wgpu_train.errors import ConfigError, DataError

from finetune_helpers import peft_random_b
from test_gemma3_vision import (IMG, SIDE, Image, Gemma3ImageProcessorPil, hf_out, image_blocks, images,
                                load_vision_model, open_image, peft, tf, tiny_config, torch, two_image_batch,
                                vlm)  # noqa: F401  (vlm: the tiny model fixture, shared)
from tolerances import assert_close


# ---- records with images: TRL's vision format, the processor's expansion, training ----------------------------

SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
            "<image_soft_token>"]       # boi 5, eoi 6, image 7


def vision_records():
    red, blue = Image.new("RGB", (30, 20), (255, 0, 0)), Image.new("RGB", (9, 31), (0, 0, 255))
    buf = io.BytesIO()
    images(1, seed=7)[0].save(buf, "PNG")
    return [
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
                      {"role": "user", "content": [{"type": "text", "text": "and this"}, {"type": "image"}]},
                      {"role": "assistant", "content": "blue"}], "images": [red, blue]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "describe the picture"},
                                                   {"type": "image"}]},
                      {"role": "assistant", "content": "green squares"}], "images": [{"bytes": buf.getvalue()}]},
        {"messages": [{"role": "user", "content": "no picture here"},
                      {"role": "assistant", "content": "red blue"}], "images": []},
    ]


@pytest.fixture(scope="module")
def chat_vlm(tmp_path_factory):
    """A tiny Gemma 3 whose vocabulary is a BPE tokenizer's with Gemma 3's image tokens and TRL's gemma3 template,
    and transformers' Gemma3Processor over the same files."""
    import json
    import os

    import trl
    from bpe import train_bpe

    folder = tmp_path_factory.mktemp("gemma3_chat_vision")
    tok = train_bpe(["user what colour is it? model red blue green", "describe the picture and this squares",
                     "no picture here"], 200, SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    template = open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "gemma3.jinja")).read()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "chat_template": template,
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"}}))
    torch.manual_seed(1)
    cfg = tiny_config(boi_token_index=5, eoi_token_index=6, image_token_index=7)
    cfg.text_config.vocab_size = tok.get_vocab_size()
    hf = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(folder)
    proc = tf.Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}),
                              tokenizer=tf.AutoTokenizer.from_pretrained(folder), chat_template=template,
                              image_seq_length=4)
    proc.image_processor.save_pretrained(folder)
    return hf, folder, proc


def our_examples(folder, max_seq_len=200):
    from wgpu_train.data.vision_records import ImageSpan, tokenize_vision_dataset
    from wgpu_train.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(folder)
    return tokenize_vision_dataset(tok, vision_records(), ImageSpan.from_ids(tok, 5, 7, 6, 4), max_seq_len), tok


def test_records_tokenize_as_the_processor_does(chat_vlm):
    """TRL's vision records: input_ids, token_type_ids and pixel_values equal Gemma3Processor's over the chat
    template's text; labels only on the assistant's turns (never on an image token)."""
    _, folder, proc = chat_vlm
    (examples, stats), tok = our_examples(folder)
    assert stats.n_examples == 3 and stats.n_cut_in_image == 0
    vm = load_vision_model(folder)
    for ex, rec in zip(examples, vision_records()):
        text = proc.apply_chat_template(rec["messages"], tokenize=False)
        want = proc(text=[text], images=[[open_image(i) for i in rec["images"]]] if rec["images"] else None,
                    return_tensors="np")
        np.testing.assert_array_equal(ex.input_ids, want["input_ids"][0])
        np.testing.assert_array_equal(image_blocks(ex.input_ids[None], 7) >= 0, want["token_type_ids"] == 1)
        if rec["images"]:
            np.testing.assert_array_equal(vm.pixel_values(ex.images), want["pixel_values"])
        trained = ex.labels[ex.labels >= 0]
        assert not set(trained.tolist()) & {5, 6, 7}
    assert tok.decode(examples[0].labels[examples[0].labels >= 0].tolist(), skip_special_tokens=False) == \
        "red<end_of_turn>blue<end_of_turn>"


def test_a_row_cut_inside_an_image_is_dropped_with_a_count(chat_vlm):
    from wgpu_train.data.vision_records import vision_messages

    _, folder, _ = chat_vlm
    (full, _), _ = our_examples(folder)
    cut_at = int(np.flatnonzero(full[0].input_ids == 7)[-1])      # inside record 0's second image
    (examples, stats), _ = our_examples(folder, max_seq_len=cut_at)
    assert stats.n_cut_in_image == 1 and [len(e.images) for e in examples] == [1, 0]      # records 1 and 2
    after = len(full[0].input_ids) - 2                             # record 0 cut in its last answer: kept
    (examples, stats), _ = our_examples(folder, max_seq_len=after)
    assert stats.n_truncated >= 1 and examples[0].truncated and len(examples[0].images) == 2
    with pytest.raises(DataError, match="every row's image tokens run past --max-seq-len 3"):
        our_examples(folder, max_seq_len=3)
    with pytest.raises(DataError, match="record: 1 image placeholders for 2 images"):
        vision_messages({"messages": vision_records()[1]["messages"], "images": ["a.png", "b.png"]})
    one = vision_messages({"messages": vision_records()[1]["messages"], "image": "a.png"})
    assert one[1] == ["a.png"]


def test_vision_records_refuse_tools_in_one_line():
    """A vision record's tools column, an assistant's tool_calls and a tool result are refused (not dropped
    silently); a bad role's message names every role, tool too."""
    from wgpu_train.data.vision_records import vision_messages

    rec = vision_records()[1]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                               "function": {"name": "f", "arguments": {}}}]}
    cases = [({**rec, "tools": [{"type": "function", "function": {"name": "f"}}]}, '"tools" column'),
             ({**rec, "messages": rec["messages"] + [call]}, "tool calls and tool results are not supported"),
             ({**rec, "messages": rec["messages"] + [{"role": "tool", "content": "4"}]}, "tool results"),
             ({**rec, "messages": [{"role": "robot", "content": "x"}]}, "system, user, assistant or tool")]
    for record, message in cases:
        with pytest.raises(DataError, match=message) as err:
            vision_messages(record)
        assert "\n" not in str(err.value)


def test_train_step_with_images_gives_pefts_gradients(chat_vlm, tmp_path):
    """One step over two micro-batches of records with images (one without): the token-weighted LoRA gradients
    equal PEFT's over the whole batch, and an optimizer step moves the adapter."""
    from wgpu_train.engines.protocol import OptimizerParams

    hf, folder, _ = chat_vlm
    (examples, _), _ = our_examples(folder)
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|o_proj|up_proj)", lora_dropout=0.0)), 3)
    t = max(len(e.input_ids) for e in examples)
    ids = np.zeros((3, t), np.int64)
    labels = np.full((3, t), -100)
    for i, e in enumerate(examples):
        ids[i, :len(e.input_ids)], labels[i, :len(e.input_ids)] = e.input_ids, e.labels
    vm = load_vision_model(folder)
    px = vm.pixel_values([im for e in examples for im in e.images])
    out = hf_out(pm, ids, (ids != 0).astype(np.int64), px, labels, image_id=7)
    out.loss.backward()
    expected = {n.replace(".default", "").replace("model.language_model.", "model."): p.grad.numpy()
                for n, p in pm.named_parameters() if p.requires_grad}
    pm.save_pretrained(tmp_path / "a")
    vm.model.load_adapter(tmp_path / "a")
    before = {k: v.copy() for k, v in vm.model.lora_state_dict().items()}
    seen = []          # the step's gradients, as the engine hands them to a data-parallel all-reduce

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
    assert vm.model.engine.images is None


def test_cli_generate_with_an_image_matches_transformers(chat_vlm, tmp_path, capsys):
    """`generate --image`: the processor's prompt (chat template, the image expanded), transformers' greedy answer
    token for token; an image that does not decode is one line and exit 2."""
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
    assert len(out) == 5 and want.strip()       # an answer to compare, not an immediate stop
    assert main(["generate", "--model", str(folder), "--prompt", "what colour is it?", "--image",
                 str(tmp_path / "x.png"), "--max-new-tokens", "5", "--backend", "numpy"]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert main(["generate", "--model", str(folder), "--prompt", "what colour is it?", "--image",
                 str(tmp_path / "x.png"), "--max-new-tokens", "5", "--backend", "wgpu"]) == 0
    assert capsys.readouterr().out == want + "\n"        # the language model on the GPU, the tower on the CPU
    (tmp_path / "bad.png").write_bytes(b"\x89PNG broken")
    assert main(["generate", "--model", str(folder), "--prompt", "hi", "--image", str(tmp_path / "bad.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--image: image 0: cannot decode the image" in err and "\n" not in err


@pytest.mark.parametrize("targets", [["fc1", "q_proj"], r".*vision_tower.*\.(q_proj|v_proj)",
                                     ["multi_modal_projector"]])
def test_vision_targets_are_refused_in_one_line(targets):
    import wgpu_train as wt

    with pytest.raises(ConfigError, match="are the vision tower's: not supported here") as e:
        wt.LoraConfig(r=2, target_modules=targets)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("language", [False, True])
def test_vision_tower_lora_gradients_match_peft(vlm, tmp_path, language):
    """LoRA on every linear module of the tower's encoder (PEFT's names on the multimodal model), alone or beside
    the language model's: each gradient, back through the text layers, the projector and the tower, equals
    PEFT's autograd."""
    hf, folder, _ = vlm
    tower = r"model\.vision_tower\.encoder\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))"
    text = r"model\.language_model\.layers\.\d+\.self_attn\.(q_proj|v_proj)"
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=f"(?:{tower}|{text})" if language else tower, lora_dropout=0.0)), 6)
    ids, mask, _ = two_image_batch()
    labels = np.where((mask == 1) & (ids != IMG), ids, -100)
    px = np.random.default_rng(8).standard_normal((3, 3, SIDE, SIDE)).astype(np.float32)
    out = hf_out(pm, ids, mask, px, labels)
    out.loss.backward()
    expected = {n.replace(".default", ""): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    assert sum("vision_tower" in k for k in expected) == 2 * 2 * 6
    vm = load_vision_model(folder)
    tensors = {n.replace(".default", ""): p.detach().numpy() for n, p in pm.named_parameters() if "lora_" in n}
    vm.set_tower_lora(tensors, 5 / 2)
    if language:
        vm.model.add_lora(wgpu_train.LoraConfig(r=2, alpha=5, target_modules=("q_proj", "v_proj")))
        vm.model._set_lora(vm.model.lora_config, {
            f"model.layers.{i}.self_attn.{m}": tuple(tensors[f"base_model.model.model.language_model.layers.{i}."
                                                             f"self_attn.{m}.lora_{w}.weight"] for w in "AB")
            for i in range(2) for m in ("q_proj", "v_proj")})
    loss, grads = vm.loss_and_grads(ids, labels, px, mask)
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "loss")
    ours = {k.replace("base_model.model.model.layers.", "base_model.model.model.language_model.layers."): g
            for k, g in grads.items()}
    assert set(ours) == set(expected), sorted(set(ours) ^ set(expected))
    for name, g in expected.items():
        assert_close(ours[name], g, "grads_f32", name)


def test_trained_adapter_loads_in_peft_with_images(chat_vlm, tmp_path):
    """Three steps of LoRA on the language model over vision records (the Python API end to end): the loss falls,
    and the saved adapter, loaded by PEFT on transformers' multimodal model, gives our logits with an image."""
    from wgpu_train.engines.protocol import OptimizerParams

    hf, folder, _ = chat_vlm
    (examples, _), _ = our_examples(folder)
    vm = load_vision_model(folder)
    vm.model.add_lora(wgpu_train.LoraConfig(r=4, alpha=8, target_modules="all-linear"), seed=1)
    losses = []
    for step in range(1, 4):
        loss_sum, count, _, _ = vm.train_step([examples[:2], examples[2:]], OptimizerParams(lr=2e-2), step)
        losses.append(loss_sum / count)
    assert losses[-1] < losses[0]
    vm.model.save_adapter(tmp_path / "adapter")
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter").eval()
    ex = examples[1]
    px = vm.pixel_values(ex.images)
    with torch.no_grad():
        want = hf_out(pm, ex.input_ids[None], np.ones((1, len(ex.input_ids)), np.int64), px,
                      image_id=7).logits.numpy()
    assert_close(vm.logits(ex.input_ids[None], px), want, "logits_f32", "trained adapter in PEFT")


def test_vision_tower_lora_steps_match_torch_adamw(vlm):
    """Two AdamW steps (clipped by one global norm) of LoRA on the tower and the language model, over two
    micro-batches of records with images: every tensor equals torch AdamW's on the PEFT model over the whole
    batch."""
    from wgpu_train.data.batching import Example
    from wgpu_train.engines.protocol import OptimizerParams

    hf, folder, _ = vlm
    tower = r"model\.vision_tower\.encoder\.layers\.\d+\.(self_attn\.(q_proj|out_proj)|mlp\.fc2)"
    text = r"model\.language_model\.layers\.\d+\.(self_attn\.v_proj|mlp\.down_proj)"
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=f"(?:{tower}|{text})", lora_dropout=0.0)), 4)
    ids, mask, _ = two_image_batch()
    labels = np.where((mask == 1) & (ids != IMG), ids, -100)
    px = np.random.default_rng(9).standard_normal((3, 3, SIDE, SIDE)).astype(np.float32)
    tensors = {n.replace(".default", ""): p.detach().numpy().copy() for n, p in pm.named_parameters() if "lora_" in n}
    vm = load_vision_model(folder)
    vm.set_tower_lora(tensors, 5 / 2)
    vm.model.add_lora(wgpu_train.LoraConfig(r=2, alpha=5, target_modules=("v_proj", "down_proj")))
    vm.model._set_lora(vm.model.lora_config, {
        path: tuple(tensors[f"base_model.model.model.language_model.{path[len('model.'):]}.lora_{w}.weight"]
                    for w in "AB")
        for path in vm.model.engine.lora_tensors()})
    n = int(mask[1].sum())
    rows = [[Example(ids[0], labels[0], images=list(px[:2]))], [Example(ids[1, :n], labels[1, :n], images=[px[2]])]]
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    hp = OptimizerParams(lr=1e-3, weight_decay=0.0, max_grad_norm=1.0)
    for step in (1, 2):
        opt.zero_grad()
        out = hf_out(pm, ids, mask, px, labels)
        out.loss.backward()
        torch_norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        opt.step()
        loss_sum, count, norm, applied = vm.train_step(rows, hp, step)
        assert applied
        assert_close(np.float64(loss_sum / count), out.loss.item(), "loss_f32", f"step {step} loss")
        assert_close(norm, torch_norm, "gpu_loss", f"step {step} norm")
    ours = {**{f"base_model.model.model.{k}.weight": v for k, v in vm.tower_trainable().items()},
            **{k.replace("model.model.layers.", "model.model.language_model.layers."): v
               for k, v in vm.model.lora_state_dict().items()}}
    want = {n.replace(".default", ""): p.detach().numpy() for n, p in pm.named_parameters() if p.requires_grad}
    assert set(ours) == set(want), sorted(set(ours) ^ set(want))
    for name, w in want.items():
        assert_close(ours[name], w, "vision_params_vs_torch_adamw", name)


@pytest.mark.parametrize("language", [False, True])
def test_tower_lora_adapter_files_both_ways(vlm, tmp_path, language):
    """An adapter with LoRA on the tower (and on the language model, with rsLoRA's alpha / sqrt(r) and PEFT's
    rank_pattern / alpha_pattern over both models' modules): ours loads in PEFT, PEFT's loads in ours, each to the
    other's logits with images."""
    hf, folder, _ = vlm
    tower = r"model\.vision_tower\.encoder\.layers\.\d+\.(self_attn\.(k_proj|out_proj)|mlp\.fc1)"
    text = r"model\.language_model\.layers\.\d+\.self_attn\.(q_proj|o_proj)"
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=3, lora_alpha=4, target_modules=f"(?:{tower}|{text})" if language else tower, lora_dropout=0.0,
        use_rslora=language, rank_pattern={"fc1": 2} if language else {},
        alpha_pattern={"out_proj": 6, "q_proj": 5} if language else {})), 5)
    pm.save_pretrained(tmp_path / "peft")
    ids, mask, _ = two_image_batch()
    real = mask.astype(bool)
    px = np.random.default_rng(10).standard_normal((3, 3, SIDE, SIDE)).astype(np.float32)
    with torch.no_grad():
        want = hf_out(pm, ids, mask, px).logits.numpy()
        base = hf_out(hf, ids, mask, px).logits.numpy()
    assert np.abs(want - base)[real].max() > 1e-2
    vm = load_vision_model(folder)
    vm.load_adapter(tmp_path / "peft")
    assert len(vm.tower.lora) == 2 * 3 and (vm.model.lora_config is not None) == language
    assert {p.rsplit(".", 1)[1]: (a.shape[0], s) for p, (a, _, s) in vm.tower.lora.items()} == (
        {"k_proj": (3, 4 / 3 ** 0.5), "out_proj": (3, 6 / 3 ** 0.5), "fc1": (2, 4 / 2 ** 0.5)} if language else
        {"k_proj": (3, 4 / 3), "out_proj": (3, 4 / 3), "fc1": (3, 4 / 3)})
    assert_close(vm.logits(ids, px, mask)[real], want[real], "logits_f32", "PEFT's adapter in ours")
    vm.save_adapter(tmp_path / "ours")
    again = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    with torch.no_grad():
        theirs = hf_out(again, ids, mask, px).logits.numpy()
    assert_close(theirs[real], want[real], "logits_f32", "our adapter in PEFT")


def write_vision_data(folder, records):
    """records as a JSONL file beside their images (PNG files, named by position)."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for k, rec in enumerate(records):
        paths = []
        for j, im in enumerate(rec["images"]):
            open_image(im).save(folder / f"{k}_{j}.png")
            paths.append(f"{k}_{j}.png")
        lines.append(json.dumps({"messages": rec["messages"], "images": paths}))
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "train.jsonl"


def test_cli_finetune_on_images(chat_vlm, tmp_path, capsys, caplog):
    """`finetune --data` of TRL's vision records (image paths beside the file) runs the main Trainer: the adapter it
    writes loads in PEFT; bad input and what images do not take yet are one line and exit 2."""
    import json

    from wgpu_train.cli.main import main

    hf, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    args = ["finetune", "--model", str(folder), "--data", str(data), "--backend", "numpy", "--max-steps", "3",
            "--batch-size", "2", "--lr", "1e-2", "--lora-targets", "q_proj,v_proj", "--no-progress",
            "--valid-split", "0", "--log-every", "1"]
    assert main(args + ["--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["images"] == 3 and summary["n_train"] == 3
    assert summary["data_format"] == "vision" and summary["rows_cut_in_image"] == 0
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "run")
    assert any(np.abs(p.detach().numpy()).max() > 0 for n, p in pm.named_parameters() if "lora_B" in n)
    recorded = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert recorded["data"] == str(data) and recorded["lr"] == 1e-2 and recorded["data_format"] == "vision"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r and "split" not in r] == [1, 2, 3]
    # --max-seq-len: a row cut inside an image is dropped with a count (record 0's second image)
    (full, _), _ = our_examples(folder)
    cut_at = int(np.flatnonzero(full[0].input_ids == 7)[-1])
    with caplog.at_level("INFO", logger="wgpu_train"):
        assert main(args[:-4] + ["--max-seq-len", str(cut_at), "--out", str(tmp_path / "cut"), "--no-progress",
                                 "--valid-split", "0"]) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["rows_cut_in_image"] == 1 and summary["n_train"] == 2 and summary["images"] == 1
    bad = tmp_path / "bad"
    rows = vision_records()
    rows[1]["images"] = rows[1]["images"] * 2
    cases = [(write_vision_data(bad / "count", rows), [], "record 1: 1 image placeholders for 2 images"),
             (data, ["--max-seq-len", "3"], "every row's image tokens run past --max-seq-len 3"),
             (data, ["--pack"], "--pack is not supported with images yet"),
             (data, ["--train-on-last-turn"], "--train-on-last-turn is not supported with images yet"),
             (data, ["--objective", "dpo"], 'records with images need an explicit "prompt"')]
    (tmp_path / "folder").mkdir()          # a folder of vision records goes to the text reader, which says why
    (tmp_path / "folder" / "train.jsonl").write_text(data.read_text())
    cases.append((tmp_path / "folder", [], "images train from one local .json/.jsonl file"))
    (tmp_path / "data" / "1_0.png").write_bytes(b"broken")
    cases.append((data, [], "cannot decode the image"))
    for path, extra, message in cases:
        code = main(["finetune", "--model", str(folder), "--data", str(path), "--backend", "numpy", "--out",
                     str(tmp_path / "bad_run"), "--overwrite", "--no-progress"] + extra)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and any(message in line for line in err), (message, err)


def test_finetune_on_images_on_webgpu_equals_numpy(chat_vlm, tmp_path, capsys, rt):
    """`finetune --backend wgpu` with images: the frozen tower and the language model on the adapter
    (engines/webgpu/images.py); its losses and the adapter after 3 steps at lr 1e-2 are the NumPy engine's."""
    import json

    from wgpu_train.cli.main import main
    from wgpu_train.formats.safetensors import read_safetensors

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    runs = {}
    for backend, device in (("numpy", []), ("wgpu", ["--device", str(rt.info.index)])):
        out = tmp_path / backend
        assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", backend, *device,
                     "--max-steps", "3", "--batch-size", "2", "--lr", "1e-2", "--lora-targets", "q_proj,v_proj",
                     "--no-progress", "--valid-split", "0", "--log-every", "1", "--out", str(out)]) == 0
        capsys.readouterr()
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[backend] = ([r["loss"] for r in rows if "loss" in r and "split" not in r],
                         read_safetensors(out / "adapter_model.safetensors"))
    (loss_n, ad_n), (loss_w, ad_w) = runs["numpy"], runs["wgpu"]
    assert len(loss_n) == 3 and set(ad_n) == set(ad_w)
    assert_close(np.array(loss_w), np.array(loss_n), "loss_f32", "losses with images")
    for name in ad_n:
        assert_close(ad_w[name], ad_n[name], "gpu_params_after_steps_lr1e-2", name)


def test_images_resume_equals_an_uninterrupted_run(chat_vlm, tmp_path):
    """Four steps of two micro-batches (gradient accumulation, a warmup and cosine schedule) with images, and the
    same run stopped after two and resumed from its checkpoint: the same adapter and the same losses."""
    import json

    from wgpu_train.formats.safetensors import read_safetensors

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    kw = dict(model=str(folder), data=str(data), backend="numpy", batch_size=1, grad_accum=2, lr=1e-2,
              lr_schedule="cosine", warmup_steps=1, valid_split=0.0, lora_targets=("q_proj", "v_proj"),
              no_progress=True, log_every=1)
    wgpu_train.finetune(out=str(tmp_path / "whole"), max_steps=4, **kw)
    wgpu_train.finetune(out=str(tmp_path / "part"), max_steps=2, **kw)
    summary = wgpu_train.finetune(out=str(tmp_path / "part"), max_steps=4, resume=str(tmp_path / "part"), **kw)
    assert summary["steps"] == 4 and summary["resumed_from"]
    whole, part = (read_safetensors(tmp_path / r / "adapter_model.safetensors") for r in ("whole", "part"))
    assert set(whole) == set(part)
    for k in whole:
        np.testing.assert_array_equal(part[k], whole[k], err_msg=k)

    def losses(run):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["lr"]) for r in rows if "loss" in r and "split" not in r]
    assert losses("part") == losses("whole") and len(losses("whole")) == 4


def test_images_validation_loss_is_transformers(chat_vlm, tmp_path):
    """A held-out vision record's validation loss before training (the adapter's B at zero) equals transformers'
    loss on the processor's batch with its image; after training it is recorded too, and exact match with images
    is measured on the held-out record (eval_generate)."""
    from wgpu_train.data.sources import hold_out

    hf, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    summary = wgpu_train.finetune(model=str(folder), data=str(data), out=str(tmp_path / "run"), backend="numpy",
                                  max_steps=2, batch_size=2, lr=1e-2, valid_split=0.34, seed=1, no_progress=True,
                                  eval_generate=True, max_new_tokens=4)
    (examples, _), _ = our_examples(folder)
    _, held = hold_out(list(range(3)), 0.34, 1)
    assert summary["n_valid"] == 1 and summary["n_train"] == 2
    ex = examples[held[0]]
    assert len(ex.images) == 2          # record 0: two images
    n = len(ex.input_ids)
    px = load_vision_model(folder).pixel_values(ex.images)
    with torch.no_grad():
        want = hf_out(hf, ex.input_ids[None].astype(np.int64), np.ones((1, n), np.int64), px, ex.labels[None],
                      image_id=7).loss.item()
    assert_close(np.float64(summary["valid_loss_before"]), want, "loss_f32", "validation loss before")
    assert summary["valid_loss_after"] is not None and summary["valid_loss_after"] != summary["valid_loss_before"]
    assert summary["exact_match_n"] == 1 and summary["exact_match_after"] in (0.0, 1.0)


def test_hub_layout_checkpoint_reads_the_same(vlm, tmp_path):
    """The hub's files (gemma-3-4b-it: vision_tower.vision_model.*, language_model.model.*) give the same logits
    with images as transformers 5's own save; a missing tower tensor is one line."""
    import json

    from wgpu_train.errors import ModelFileError
    from wgpu_train.formats.safetensors import read_safetensors, write_safetensors

    hf, folder, vm = vlm
    tensors = read_safetensors(folder / "model.safetensors")
    hub = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    assert any(k.startswith("vision_tower.vision_model.encoder.") for k in hub)
    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    write_safetensors(tmp_path / "model.safetensors", hub)
    ids, mask, _ = two_image_batch()
    px = np.random.default_rng(11).standard_normal((3, 3, SIDE, SIDE)).astype(np.float32)
    np.testing.assert_array_equal(load_vision_model(tmp_path).logits(ids, px, mask), vm.logits(ids, px, mask))
    del hub["vision_tower.vision_model.post_layernorm.weight"]
    write_safetensors(tmp_path / "model.safetensors", hub)
    with pytest.raises(ModelFileError, match="missing the vision tensor vision_tower.post_layernorm.weight"):
        load_vision_model(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]


def test_loading_reads_only_the_tower_and_projector_again(vlm, monkeypatch):
    """The language model loads through load_model; the vision loader reads only the tower's and projector's
    tensors from the files (not the whole checkpoint again as float32)."""
    from wgpu_train.engines import vision_model
    from wgpu_train.models.vision import vision_names

    _, folder, _ = vlm
    read, real = [], vision_model.read_safetensors
    monkeypatch.setattr(vision_model, "read_safetensors", lambda f, names=None: read.extend(real(f, names)) or
                        real(f, names))
    load_vision_model(folder)
    assert read and set(read) == set(vision_names(read).values())


def test_three_steps_equal_trl_sft_trainer_with_images(chat_vlm, tmp_path):
    """TRL 1.16's SFTTrainer on vision records (its vision collator: the processor's ids, pixel_values and
    token_type_ids, labels on every real token) from the same PEFT adapter: three steps of ours on the same rows
    give TRL's losses, gradient norms and adapter."""
    import datasets
    import trl

    from wgpu_train.data.batching import Example
    from wgpu_train.engines.protocol import OptimizerParams

    hf, folder, proc = chat_vlm
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", lora_dropout=0.0)), 2)
    pm.save_pretrained(tmp_path / "adapter")
    records = [{"messages": [{**m, "content": [{"type": "text", "text": m["content"]}]}
                             if isinstance(m["content"], str) else m for m in r["messages"]],
                "images": [open_image(i).convert("RGB") for i in r["images"]]} for r in vision_records()[:2]]
    batch = trl.trainer.sft_trainer.DataCollatorForVisionLanguageModeling(proc)(copy.deepcopy(records))
    real = batch["attention_mask"].numpy() == 1
    rows = [Example(batch["input_ids"].numpy()[i][real[i]], batch["labels"].numpy()[i][real[i]],
                    images=r["images"]) for i, r in enumerate(records)]
    pm.train()
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2, learning_rate=0.01,
                         lr_scheduler_type="constant", max_steps=3, max_grad_norm=1.0, report_to=[], use_cpu=True,
                         save_strategy="no", seed=0, max_length=None, logging_steps=1, weight_decay=0.0, bf16=False,
                         remove_unused_columns=False)
    trainer = trl.SFTTrainer(model=pm, args=args, train_dataset=datasets.Dataset.from_list(records),
                             processing_class=proc)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "grad_norm" in h]
    vm = load_vision_model(folder)
    vm.model.load_adapter(tmp_path / "adapter")
    for step, h in enumerate(logged, 1):
        loss_sum, count, norm, _ = vm.train_step([rows], OptimizerParams(lr=0.01, weight_decay=0.0), step)
        assert_close(np.float64(loss_sum / count), h["loss"], "loss_f32", f"step {step} loss")
        assert_close(norm, h["grad_norm"], "loss_f32", f"step {step} grad norm")
    assert len(logged) == 3
    theirs = {n.replace(".default.", ".").replace("model.language_model.", "model."): p.detach().numpy()
              for n, p in pm.named_parameters() if "lora_" in n}
    ours = vm.model.lora_state_dict()
    assert set(ours) == set(theirs)
    for k, v in ours.items():          # seen <= 6.8e-7
        assert_close(v, theirs[k], "params_vs_torch_adamw", k)
