"""The embedded tool demo (`wgpu-train finetune --objective grpo --tool calculator`, no data): sums of two numbers
the embedded model cannot add itself, asked in a chat template with tool support written for its vocabulary, the
final answer scored by exact_match; the SFT warm-up's turns (three in four call the calculator, the others guess) from which
GRPO learns to call it."""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np

from wgpu_train.data.prompt_records import PromptRecord
from wgpu_train.data.sources import DataSplits
from wgpu_train.formats.tokenizer import Tokenizer
from wgpu_train.formats.tool_calls import tool_schemas
from wgpu_train.training.tools import calculator

TOOL_DEMO_REWARD = "exact_match"         # the final answer equals the sum
WARMUP_STEPS, WARMUP_LR, WARMUP_BATCH = 600, 1.5e-3, 8    # the SFT warm-up (full fine-tuning)
DEMO_SPLITS = {"train": (0, 256), "valid": (1, 32), "test": (2, 32)}     # split -> (seed, prompts)

# ChatML with tools, short for the embedded model's 256 positions and byte-level vocabulary: the tools' names and
# parameters in a system turn, calls in Qwen2.5's <tool_call> JSON (which formats/tool_calls.py parses) without
# spaces, results in a "tool" turn
TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ ' ' + t.function.name + '(' + "
    "(t.function.parameters.properties | list | join(', ')) + ')' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{ '<tool_call>{\"name\":\"' + c.function.name + '\",\"arguments\":' + "
    "(c.function.arguments | tojson(separators=(',', ':'))) + '}</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _problems(seed: int, n: int) -> list:
    rng = np.random.default_rng(seed)
    return [(int(a), int(b)) for a, b in rng.integers(10, 100, size=(n, 2))]


def _question(a: int, b: int) -> list:
    return [{"role": "user", "content": f"What is {a} + {b}?"}]


def tool_demo_splits() -> DataSplits:
    """The demo's prompts: "What is A + B?" with A, B in 10..99, the sum the answer column; disjoint seeds per
    split, nothing random between runs."""
    out = {split: [PromptRecord(_question(a, b), {"answer": str(a + b)}, f"demo {split} {i}")
                   for i, (a, b) in enumerate(_problems(seed, n))] for split, (seed, n) in DEMO_SPLITS.items()}
    return DataSplits(out["train"], out["valid"], out["test"],
                      "prompts (the embedded tool task: add two numbers with the calculator; the sum is the answer "
                      "column)", files={"train": "the embedded tool demo"})


def warmup_records(tokenizer, schemas: list, n: int = 256, seed: int = 3) -> list:
    """The SFT warm-up's prompt-completion records, each one assistant turn rendered by the chat template with the
    tools (the conversation before it the prompt, so tool results carry no loss): for three problems in four a
    calculator call and then the result as the answer, for the others a guess (the first number)."""
    out = []
    for i, (a, b) in enumerate(_problems(seed, n)):
        question = _question(a, b)
        if i % 4 == 3:
            turns = [{"role": "assistant", "content": str(a)}]
        else:
            call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}}
            turns = [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "calculator", "content": str(a + b)},
                     {"role": "assistant", "content": str(a + b)}]
        for k, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            before = tokenizer.apply_chat_template(question + turns[:k], add_generation_prompt=True, tools=schemas)
            whole = tokenizer.apply_chat_template(question + turns[:k + 1], tools=schemas)
            # raw mode appends the EOS (<|im_end|>) after the completion
            out.append({"prompt": before, "completion": whole[len(before):].removesuffix("<|im_end|>\n")})
    return out


def demo_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """The embedded tokenizer with TOOL_TEMPLATE in place of its ChatML template (which renders no tools)."""
    return Tokenizer(tokenizer.backend, chat_template=TOOL_TEMPLATE, eos_token=tokenizer.eos_token,
                     pad_token=tokenizer.pad_token)


def warm_up(config, tokenizer: Tokenizer, log) -> Path:
    """The SFT warm-up of the embedded model before the tool demo's GRPO (it has never seen a tool call): full
    fine-tuning (LoRA r 8 learns the call's format too slowly) of WARMUP_STEPS steps on warmup_records, in a
    folder of its own (a temporary one); returns the model folder it wrote, on which GRPO trains its LoRA."""
    folder = Path(tempfile.mkdtemp(prefix="wgpu-train-tool-warmup-"))
    records = warmup_records(tokenizer, tool_schemas([calculator]))
    with open(folder / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    from wgpu_train.training.trainer import Trainer
    from wgpu_train.training.config import TrainConfig

    keep = {f.name: getattr(config, f.name) for f in dataclasses.fields(TrainConfig)
            if f.name in ("backend", "device", "seed")}
    cfg = TrainConfig(**keep, method="full", objective="sft", data=str(folder / "train.jsonl"),
                      out=str(folder / "run"), valid_split=0.0, no_chat_template=True, max_steps=WARMUP_STEPS,
                      lr=WARMUP_LR, warmup_steps=10, batch_size=WARMUP_BATCH, max_seq_len=192, eval_generate=False,
                      no_progress=True)
    log(f"warm-up: the embedded model has never seen a tool call; {WARMUP_STEPS} SFT steps on {len(records)} "
        f"turns (three in four call the calculator, the others guess) in {folder}")
    Trainer(cfg, log=lambda m: None).setup().train()
    return folder / "run"
