"""A tiny model folder (random Llama + BPE tokenizer, ChatML), a tiny instruction dataset and a snapshot of a
folder's files, shared by tests/test_train.py and tests/test_cli.py."""
from __future__ import annotations

import json
from pathlib import Path

from bpe import train_bpe
from tiny_models import build_model, save_model

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]


def records(n: int, offset: int = 0) -> list[dict]:
    """Instruction records of a toy task: name the word after the given one in WORDS."""
    out = []
    for i in range(offset, offset + n):
        a = WORDS[i % len(WORDS)]
        b = WORDS[(i + 1) % len(WORDS)]
        out.append({"prompt": f"after {a} {i}?", "completion": f"{b} {i}"})
    return out


def write_jsonl(path: Path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")


def build_tokenizer(folder: Path, bos: bool = False):
    """Train a byte-level BPE on the toy task's text and save it (ChatML fallback, eos <|im_end|>); with `bos`, a
    Llama-like vocabulary instead (<unk> <s> </s>) whose post-processor adds <s>, as Llama's and Mistral's do."""
    corpus = [f"user\n{r['prompt']}\nassistant\n{r['completion']}" for r in records(40)] + ["system user assistant"]
    folder.mkdir(parents=True, exist_ok=True)
    if bos:
        from tokenizers import processors

        tok = train_bpe(corpus, vocab_size=300, specials=["<unk>", "<s>", "</s>"])
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"}
    else:
        tok = train_bpe(corpus, vocab_size=300)
        special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(special))
    return tok.get_vocab_size(with_added_tokens=True)


def make_model_dir(folder: Path, arch: str = "llama", **model_kw) -> Path:
    """A random 2-layer model (Llama unless `arch` says otherwise; model_kw: other build_model settings) whose
    vocabulary is the tokenizer's, with the tokenizer files beside it."""
    vocab = build_tokenizer(folder)
    save_model(build_model(arch, vocab_size=vocab, **model_kw), folder)
    return folder


def make_data_dir(folder: Path, n_train: int = 12, n_valid: int = 4, n_test: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "train.jsonl", records(n_train))
    write_jsonl(folder / "valid.jsonl", records(n_valid, offset=100))
    if n_test:
        write_jsonl(folder / "test.jsonl", records(n_test, offset=200))
    return folder


def folder_state(folder: Path) -> dict:
    """{relative path: (bytes, mtime_ns)} of every file under `folder` (None for folders): equal before and
    after an operation when it changed nothing there."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(Path(folder).rglob("*"))}


def one_line_error(capsys, argv, match, after_log: bool = False):
    """Run the CLI's main(argv); it must exit 2 with exactly one line on stderr, holding `match`, and no traceback
    (after_log: log lines may come first, the error line last)."""
    from wgpu_train.cli.main import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and (after_log or len(lines) == 1) and lines and "Traceback" not in err, err
    assert lines[-1].startswith("error: ") and match in lines[-1], lines[-1]


def padded_batch(seed: int, length: int, pad_from: int, prompt: int, rows: int = 2):
    """(ids, labels, mask), each (rows, length) over a vocabulary of 83: row 1 right-padded from pad_from; labels
    mask the first `prompt` tokens and the padding with -100."""
    import numpy as np

    ids = np.random.default_rng(seed).integers(0, 83, (rows, length))
    mask = np.ones_like(ids)
    mask[1, pad_from:] = 0
    labels = np.where(mask == 1, ids, -100)
    labels[:, :prompt] = -100
    return ids, labels, mask


def peft_random_b(pm, seed=0):
    """Every lora_B of a PEFT model set to random nonzero values (B = 0 would hide most bugs); returns it in eval mode."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return pm.eval()



def save_trl_adapter(folder: Path, out: Path):
    """A PEFT adapter on the model in `folder`, written to `out`: r 4 on q, v and down, B random (seeded), so that a
    policy and its reference with the adapter off differ and A's gradients are not hidden."""
    import numpy as np

    import wgpu_train as wt

    model = wt.load_model(folder, backend="numpy")
    lora = wt.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    model.add_lora(lora, seed=3)
    rng = np.random.default_rng(4)
    model._set_lora(lora, {p: (a, rng.normal(0, 0.05, b.shape).astype(np.float32))
                           for p, (a, b) in model.engine.lora_tensors().items()}, seed=3)
    model.save_adapter(out)


def make_trl_model_and_adapter(root: Path, family: str) -> Path:
    """root/model: a tiny model of the family that transformers tokenizes with this folder's tokenizer.json, and
    root/adapter: a PEFT adapter on it (r 4 on q, v and down; B random, so that a policy and its reference with
    the adapter off differ, and A's gradients are not hidden), for the comparisons with TRL's trainers."""
    import json

    folder = make_model_dir(root / "model", family)
    # transformers would tokenize with its Qwen2Tokenizer pipeline, not this folder's tokenizer.json
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    save_trl_adapter(folder, root / "adapter")
    return folder


def first_step_gradients_callback(model):
    """A transformers TrainerCallback whose `grads` ({parameter name: array}) are `model`'s gradients of the first
    optimizer step, taken before it is applied (after clipping): what TRL's trainers differentiated."""
    from transformers import TrainerCallback

    class FirstStepGradients(TrainerCallback):
        def __init__(self):
            self.grads = {}

        def on_pre_optimizer_step(self, args, state, control, **kw):
            if state.global_step == 0:
                self.grads.update({n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()
                                   if p.grad is not None})

    return FirstStepGradients()
