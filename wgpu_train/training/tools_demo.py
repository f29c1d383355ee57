"""The embedded tool demo (`wgpu-train finetune --objective grpo --tool calculator`, no data): sums of two numbers
the embedded model cannot add itself, asked in a chat template with tool support written for its vocabulary, the
final answer scored by exact_match; the SFT warm-up's turns (half call the calculator, half guess) from which
GRPO learns to call it."""
from __future__ import annotations

import json

import numpy as np

from wgpu_train.data.prompt_records import PromptRecord
from wgpu_train.data.sources import DataSplits

TOOL_DEMO_REWARD = "exact_match"         # the final answer equals the sum
DEMO_SPLITS = {"train": (0, 256), "valid": (1, 32), "test": (2, 32)}     # split -> (seed, prompts)

# ChatML with tools, short enough for the embedded model's 256 positions: the tools' names and parameters in a
# system turn, calls as Qwen2.5 writes them (<tool_call> JSON, which formats/tool_calls.py parses), results in a
# user turn as <tool_response>
TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ ' ' + t.function.name + '(' + "
    "(t.function.parameters.properties | list | join(', ')) + ')' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{ '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + "
    "(c.function.arguments | tojson) + '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
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
    tools (the conversation before it the prompt, so tool results carry no loss): for half the problems a
    calculator call and then the result as the answer, for the other half a guess (the first number)."""
    out = []
    for i, (a, b) in enumerate(_problems(seed, n)):
        question = _question(a, b)
        if i % 2:
            turns = [{"role": "assistant", "content": str(a)}]
        else:
            call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} + {b}"}}}
            turns = [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "calculator", "content": str(a + b)},
                     {"role": "assistant", "content": str(a + b)}]
        for k, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            before = tokenizer.apply_chat_template(question + turns[:k], add_generation_prompt=True, tools=schemas)
            whole = tokenizer.apply_chat_template(question + turns[:k + 1], tools=schemas)
            out.append({"prompt": before, "completion": whole[len(before):].rstrip("\n")})
    return out


def write_warmup(path, records: list):
    """The warm-up records as JSONL at `path`."""
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
