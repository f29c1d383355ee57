"""GRPO with tools against TRL 1.16's GRPOTrainer (tools=, environment_factory=, max_tool_calling_iterations) on a
tiny Qwen3 with Qwen2.5's real chat template (TRL's chat_templates/qwen2_5.jinja): the same prompts, a standalone
tool and an environment's, both sides' turns scripted per generation, prompt and group slot (ours: the tool loop's
sampler; TRL's: _generate_single_turn, first turns and the turns after tool results): a tool call answered, a tool
that raises, a turn cut at the budget, the iteration limit. Compared: the tool masks, the first step's loss and LoRA
gradients, every logged metric at each of three steps (tools/*, the environment's reward column, the lengths
without tool tokens) and the adapter after three AdamW steps, on both engines (TRL runs once)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from bpe import tokenizer_folder, train_bpe
from test_grpo_trl import SKIP_KEYS, _peft_name, check, first_step_gradients
from tiny_models import build_model, save_model
from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.formats.tool_calls import tool_schemas
from wgpu_train.training.config import TrainConfig
from wgpu_train.training.grpo_trainer import GRPOTrainer
from wgpu_train.training.tools_rollouts import ToolRollouts

from conftest import require_adapter
from finetune_helpers import first_step_gradients_callback, save_trl_adapter, write_jsonl

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytest.importorskip("peft")

PROMPTS = ["add red 3", "add cat 8"]
G, MAX_COMPLETION, STEPS, LR, ITERATIONS = 4, 160, 3, 5e-3, 2
ROWS = len(PROMPTS) * G
OBSERVATION = " Use the tools."


class Abacus:
    """An environment: reset appends an observation to the prompt; add is its tool; its reward counts the adds."""

    def __init__(self):
        self.adds = 0

    def reset(self, **kwargs):
        self.adds = 0
        return OBSERVATION

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.adds += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.adds)


def mul(a: int, b: int) -> int:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    if b == 0:
        raise ValueError("b must not be 0")
    return a * b


def turns_reward(prompts, completions, **kwargs):
    """The last message's length and the tool messages: reads the turns as TRL passes them."""
    return [len(str(c[-1].get("content", ""))) / 8 + sum(m["role"] == "tool" for m in c) for c in completions]


def id_reward(prompts, completions, completion_ids, **kwargs):
    return [float(sum(t % 3 == 0 for t in ids)) / 4 for ids in completion_ids]


def call(name, a, b):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def script(tok) -> list:
    """[generation][prompt][slot] -> the slot's turns (ids): slot 0 calls add and answers; slot 1's mul raises, then a
    turn cut at the budget; slot 2 answers at once; slot 3 calls add, mul, then add again past the iteration
    limit. Every first turn differs (the hooks find a row by it)."""
    eos = tok.eos_token_id
    rng = np.random.default_rng(5)
    words = tok.encode(" red cat dog sun moon tree")

    def text(n, end=True):
        return [int(t) for t in rng.choice(words, n)] + ([eos] if end else [])

    out = []
    for gen in range(STEPS):
        groups = []
        for p in range(len(PROMPTS)):
            a = 10 * p + gen + 1
            groups.append([[tok.encode(call("add", a, 2)) + [eos], text(3)],
                           [tok.encode(call("mul", a, 0)) + [eos], text(400, end=False)],
                           [text(4 + gen + p)],
                           [tok.encode(call("add", a + 50, 1)) + [eos], tok.encode(call("mul", a, 3)) + [eos],
                            tok.encode(call("add", a, 7)) + [eos]]])
        out.append(groups)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3 whose tokenizer (a BPE trained on the rendered tool prompts) has Qwen2.5's chat template, its
    PEFT adapter (B random), the prompts file and the script."""
    root = tmp_path_factory.mktemp("grpo_tools_trl")
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    first = tokenizer_folder(root / "first", train_bpe(["a"], 300), template, eos_token="<|im_end|>")
    rough = load_tokenizer(first)
    texts = [rough.apply_chat_template([{"role": "user", "content": p + OBSERVATION}], add_generation_prompt=True,
                                       tools=tool_schemas([mul, Abacus().add])) for p in PROMPTS]
    texts += [call(n, a, b) + "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n"
              for n in ("add", "mul") for a in range(40) for b in range(4)]
    folder = tokenizer_folder(root / "model", train_bpe(texts * 2, 700), template, eos_token="<|im_end|>",
                              tokenizer_class="PreTrainedTokenizerFast")
    tok = load_tokenizer(folder)
    save_model(build_model("qwen3", vocab_size=tok.vocab_size, max_position_embeddings=1024), folder)
    save_trl_adapter(folder, root / "adapter")
    write_jsonl(root / "prompts.jsonl", [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    return root, folder, script(tok), tok


def _prompt_of(text: str) -> int:
    return next(i for i, p in enumerate(PROMPTS) if p in text)


class Rows:
    """The scripted turns of one side: a generation's rows found by their prompt and first turn."""

    def __init__(self, table, decode):
        self.table, self.decode, self.generations = table, decode, 0
        self.rows = {}            # (prompt, slot) -> (prompt ids + first turn, turns given)
        self.slots = [0] * len(PROMPTS)

    def first(self, prompts) -> list:
        groups = self.table[self.generations]
        self.generations += 1
        self.rows, self.slots, out = {}, [0] * len(PROMPTS), []
        for ids in prompts:
            p = _prompt_of(self.decode(ids))
            slot = self.slots[p]
            self.slots[p] += 1
            turn = groups[p][slot][0]
            self.rows[(p, slot)] = [list(ids) + turn, 1, groups[p][slot]]
            out.append(list(turn))
        return out

    def next(self, prefix) -> list:
        prefix = list(prefix)
        key = next(k for k, (start, _, _) in self.rows.items() if prefix[:len(start)] == start)
        row = self.rows[key]
        turn = row[2][row[1]] if row[1] < len(row[2]) else []
        row[1] += 1
        return list(turn)


def trl_run(root, folder, table):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(root / "adapter"), is_trainable=True)
    tok = AutoTokenizer.from_pretrained(str(folder))
    grabber = first_step_gradients_callback(peft_model)
    args = trl.GRPOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=ROWS,
                          gradient_accumulation_steps=1, num_generations=G, max_completion_length=MAX_COMPLETION,
                          learning_rate=LR, lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1,
                          max_grad_norm=1.0, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
                          beta=0.04, max_tool_calling_iterations=ITERATIONS)
    trainer = trl.GRPOTrainer(model=peft_model, reward_funcs=[turns_reward, id_reward], args=args,
                              train_dataset=datasets.Dataset.from_dict(
                                  {"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]}),
                              processing_class=tok, callbacks=[grabber], tools=[mul], environment_factory=Abacus)
    rows = Rows(table, lambda ids: tok.decode(ids))

    def generate(prompt_ids_list, images, fields, num_generations, **kw):
        if num_generations > 1 or not rows.rows:
            return rows.first(prompt_ids_list), None
        return [rows.next(ids) for ids in prompt_ids_list], None

    masks = []
    score = trainer._generate_and_score_completions

    def generate_and_score(inputs):
        out = score(inputs)
        ids, m = out["completion_ids"], out["completion_mask"] * out["tool_mask"]
        masks.append(sorted((tuple(int(t) for t, k in zip(r, c) if k), tuple(int(x) for x, k in zip(mr, c) if k))
                            for r, c, mr in zip(ids.tolist(), out["completion_mask"].tolist(), m.tolist())))
        return out

    trainer._generate_single_turn = generate
    trainer._generate_and_score_completions = generate_and_score
    trainer.train()
    after = {n: p.detach().numpy().copy() for n, p in peft_model.named_parameters() if ".default." in n}
    return trainer.state.log_history, grabber.grads, after, masks


def our_trainer(root, folder, table, tok, out, monkeypatch, backend):
    cfg = TrainConfig(model=str(folder), data=str(root / "prompts.jsonl"), adapter_path=str(root / "adapter"),
                      backend=backend, out=str(out), objective="grpo", batch_size=ROWS, num_generations=G,
                      max_completion_length=MAX_COMPLETION, lr=LR, lr_schedule="constant", warmup_steps=0,
                      max_steps=STEPS, max_grad_norm=1.0, valid_split=0.0, log_every=1, eval_generate=False,
                      no_progress=True, seed=0, beta=0.04, max_tool_calling_iterations=ITERATIONS)
    rows = Rows(table, lambda ids: tok.decode(ids, skip_special_tokens=False))

    class Scripted:
        def __init__(self, engine, prompts, *args):
            self.prompts = [list(map(int, p)) for p in prompts]
            self.sofar = [list(p) for p in self.prompts]

        def first(self, budget):
            turns = [t[:budget] for t in rows.first(self.prompts)]
            for s, t in zip(self.sofar, turns):
                s += t
            return turns

        def resume(self, which, appended, budgets):
            out = []
            for i, ids, n in zip(which, appended, budgets):
                self.sofar[i] += list(ids)
                turn = rows.next(self.sofar[i])[:n] if n > 0 else []
                self.sofar[i] += turn
                out.append(turn)
            return out

        def close(self):
            pass

    monkeypatch.setattr(ToolRollouts, "sampler", Scripted)
    trainer = GRPOTrainer(cfg, log=lambda m: None, reward_funcs=[turns_reward, id_reward], tools=[mul],
                          environment_factory=Abacus).setup()
    return trainer, rows


@pytest.fixture(scope="module")
def trl_result(setup):
    root, folder, table, _ = setup
    return trl_run(root, folder, table)


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_grpo_with_tools_equals_trl(setup, trl_result, tmp_path, monkeypatch, backend):
    if backend == "wgpu":
        require_adapter()
    root, folder, table, tok = setup
    history, trl_grads, trl_after, trl_masks = trl_result
    trainer, rows = our_trainer(root, folder, table, tok, tmp_path / "run", monkeypatch, backend)
    grads, result, gen = first_step_gradients(trainer)
    rows.generations = 0
    mine = sorted((tuple(int(t) for t in c[c >= 0]), tuple(int(x) for x in m[:int((c >= 0).sum())]))
                  for c, m in zip(gen.completions, gen.tool_mask))
    assert mine == trl_masks[0]
    assert any(0 in m for _, m in mine) and any(len(ids) == MAX_COMPLETION for ids, _ in mine)
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    clip = min(1.0, 1.0 / (norm + 1e-6))
    for k, g in grads.items():
        check(g * clip, trl_grads[_peft_name(k)], "grpo_vs_trl_grads", k)

    trainer.train()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "grad_norm" in r]
    trl_steps = [h for h in history if "loss" in h and "train_runtime" not in h]
    assert len(steps) == len(trl_steps) == STEPS
    check(result.loss, trl_steps[0]["loss"], "grpo_vs_trl_loss", "first step's loss")
    for ours, their in zip(steps, trl_steps):
        shared = (set(ours) & set(their)) - SKIP_KEYS
        assert {"tools/call_frequency", "tools/failure_frequency", "rewards/Abacus/mean", "completions/mean_length",
                "completions/clipped_ratio", "rewards/turns_reward/mean", "kl"} <= shared
        for key in sorted(shared | {"loss", "grad_norm"}):
            a, b = ours[key], their[key]
            if a is None or b is None or (isinstance(a, float) and math.isnan(a)):
                assert a is None and b is None, f"{key}: ours {a}, TRL's {b}"
            else:
                check(a, b, "grpo_vs_trl_loss", key)
    assert steps[0]["tools/call_frequency"] > 0 and steps[0]["tools/failure_frequency"] > 0
    for k, v in trainer.engine.trainable().items():
        check(v, trl_after[_peft_name(k)], "grpo_vs_trl_params", k)
    turns = json.loads((tmp_path / "run" / "completions.jsonl").read_text().splitlines()[0])["turns"]
    assert turns[0]["role"] == "assistant"
