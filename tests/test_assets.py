"""The embedded default (wgpu_train/assets): the base model, its tokenizer and the dataset load and agree with
each other, and the base model has the skill in plain text but does not yet follow the chat instruction."""
from __future__ import annotations

import json

import numpy as np
import pytest

from wgpu_train.assets import TASK_INSTRUCTION, WORDS, default_data_dir, default_model_dir
from wgpu_train.models.config import ModelConfig
from wgpu_train.data.sources import load_records
from wgpu_train.engines.loading import load_model
from wgpu_train.formats.tokenizer import load_tokenizer

SPLITS = ("train", "valid", "test")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_dir())


@pytest.fixture(scope="module")
def base_model():
    return load_model(default_model_dir(), backend="numpy")


@pytest.fixture(scope="module")
def splits():
    return {name: load_records(default_data_dir() / f"{name}.jsonl")[0] for name in SPLITS}


def test_model_folder_is_a_small_llama():
    folder = default_model_dir()
    cfg = ModelConfig.from_folder(folder)
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.hidden_size <= 128 and cfg.num_hidden_layers <= 4, "the default run must stay cheap on lavapipe"
    size = (folder / "model.safetensors").stat().st_size
    assert size <= 10 * 2**20, f"model.safetensors is {size} bytes, over the 10 MB budget"


def test_tokenizer_matches_model(tokenizer):
    cfg = ModelConfig.from_folder(default_model_dir())
    assert tokenizer.vocab_size == cfg.vocab_size
    assert tokenizer.has_chat_template
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == cfg.eos_token_id
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.token_to_id("<|im_start|>") is not None
    assert tokenizer.bos_token is None and not tokenizer.add_bos_token


def test_chat_template_is_chatml(tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n")
    assert tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n")
    # byte-level: any text round-trips, and the special tokens stay single tokens
    text = "<|im_start|>user\nZürich ☃ 42<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_task_words_are_single_tokens(tokenizer):
    for w in WORDS:
        assert len(tokenizer.encode(" " + w)) == 1 and len(tokenizer.encode(w)) == 1, w


def test_dataset_splits_parse_and_follow_the_rule(splits):
    sizes = {name: len(records) for name, records in splits.items()}
    assert 1000 <= sizes["train"] <= 3000 and 50 <= sizes["valid"] <= 200 and 50 <= sizes["test"] <= 200, sizes
    prompts = {}
    for name, records in splits.items():
        for messages in records:
            assert [m["role"] for m in messages] == ["user", "assistant"]
            user, answer = messages[0]["content"], messages[1]["content"]
            assert user.startswith(TASK_INSTRUCTION + " ")
            words = user[len(TASK_INSTRUCTION) + 1:].split(" ")
            assert 2 <= len(words) <= 4 and len(set(words)) == len(words) and set(words) <= set(WORDS)
            assert answer == " ".join(reversed(words))
        prompts[name] = {m[0]["content"] for m in records}
    # held-out items are new word combinations, not repeats of training items
    assert not prompts["train"] & prompts["test"] and not prompts["train"] & prompts["valid"]
    assert not prompts["valid"] & prompts["test"]


def _greedy(model, tokenizer, prompt: str, stops) -> str:
    out = model.generate(tokenizer.encode(prompt), max_new_tokens=12, stop_token_ids=stops)
    return tokenizer.decode(out, skip_special_tokens=True).strip()


def test_base_model_knows_the_skill_but_not_the_instruction(base_model, tokenizer, splits):
    """The point of the default run: pretraining taught reversal in plain text ('reverse: a b ->'), and the chat
    instruction is what LoRA has to teach. Ten held-out items keep this cheap."""
    items = splits["test"][:10]
    eot = [tokenizer.token_to_id("<|endoftext|>")]
    plain = chat = 0
    for messages in items:
        user, answer = messages[0]["content"], messages[1]["content"]
        words = user[len(TASK_INSTRUCTION) + 1:]
        plain += _greedy(base_model, tokenizer, f"reverse: {words} ->", eot) == answer
        prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
        chat += _greedy(base_model, tokenizer, prompt, tokenizer.stop_token_ids) == answer
    assert plain >= 7, f"the base model reverses only {plain}/10 plain-text items: was it pretrained?"
    assert chat <= 1, f"the base model already answers {chat}/10 chat items: nothing left for LoRA to learn"


def test_base_model_follows_its_pretraining_chat_tasks(base_model, tokenizer):
    """The corpus's own chat instructions work, so the chat format itself is known."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat these words: red fox moon"}],
                                           add_generation_prompt=True)
    assert _greedy(base_model, tokenizer, prompt, tokenizer.stop_token_ids) == "red fox moon"


def test_build_info_records_the_recipe():
    info = json.loads((default_model_dir().parent / "build_info.json").read_text())
    assert info["pretrain"]["wall_s"] > 0 and info["seed"] == info["args"]["seed"]
    assert info["pretrain"]["log"][-1]["loss"] < info["pretrain"]["log"][0]["loss"]
    readme = (default_model_dir().parent / "README.md").read_text()
    assert "tools/build_assets.py" in readme


def test_transformers_gives_the_same_logits(base_model, tokenizer):
    """The checkpoint is a valid Hugging Face Llama: transformers loads it and agrees with our forward."""
    torch = pytest.importorskip("torch", reason="torch is a test-only oracle (pip install .[test])")
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only oracle")
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir(), torch_dtype=torch.float32)
    hf.eval()
    ids = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reverse the order of these words: red fox moon"}], add_generation_prompt=True))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = base_model.logits(np.array([ids]))[0]
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
