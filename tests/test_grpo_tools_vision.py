"""GRPO with tools and images on the tiny Gemma 3 (its chat template given tool calls): a tool round trip whose
second turn decodes on after the tool result with the prompt's images kept in the KV cache (equal to a fresh
prefill of the whole text with the images), its token layout and masks, the first step's loss and LoRA gradients
equal to a recomputation through VisionModel.loss_and_grads of the same rollouts, a CLI run with an environment
whose tool returns a fixed result, WebGPU equal to NumPy for one step, workers and stages equal to one process,
`serve` with tools and an image; a Qwen3-VL row extended after its images (M-RoPE positions); and on a tiny
Qwen3-VL with TRL's qwen3_vl template, the first step equal to TRL 1.16's GRPOTrainer with tools and images. (Over
450 lines: the two models' fixtures, templates and scripted turns beside the checks that share them.)"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.engines.generate import DecodeBatch
from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.training.tools_loop import TurnSampler
from wgpu_train.training.tools_rollouts import ToolRollouts

from test_grpo_trl import first_step_gradients
from test_vision_preference import QUESTIONS, config, grpo_records, pref_setup, write_pref_data  # noqa: F401
from test_gemma3_vision_training import chat_vlm  # noqa: F401
from test_qwen3_vl import vlm  # noqa: F401  (the tiny Qwen3-VL)
from tolerances import assert_close

FIRST = 3                  # the first turn's tokens (then parsed as a call of add)
BUDGET = 48                # --max-completion-length: room for the tool result and a second turn
RESULT = "5"
# Gemma 3's turns and image placeholder, the assistant's opened by Qwen2.5's header (plain text here: where the
# tool-call parser finds the answer) and its tool calls written as Qwen2.5's <tool_call>{json}</tool_call>; results
# in a tool turn; the tools named, not their schemas (short prompts in the tiny vocabulary)
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<start_of_turn>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<end_of_turn>\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<start_of_turn>tool\n{{ m.content }}"
    "<end_of_turn>\n{% else %}{{ '<|im_start|>assistant' if m.role == 'assistant' else '<start_of_turn>' + m.role }}"
    "\n{% if m.content is string %}{{ m.content | trim }}{% else %}{% for c in m.content %}{% if c.type == 'image' %}"
    "<start_of_image>{% elif c.type == 'text' %}{{ c.text | trim }}{% endif %}{% endfor %}{% endif %}"
    "{% for tc in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}


def log_softmax(logits) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max()
    return z - np.log(np.exp(z).sum())


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def length_reward(prompts, completions, **kwargs):
    return [len(str(c[-1].get("content", ""))) / 8 for c in completions]


@pytest.fixture(scope="module")
def tools_vlm(pref_setup, tmp_path_factory):  # noqa: F811
    """(root with the PEFT adapter, the tiny Gemma 3's folder with the tool template, end of turn its EOS)."""
    root, folder, _, _ = pref_setup
    model = tmp_path_factory.mktemp("gemma3_tools") / "model"
    shutil.copytree(folder, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE,
                                                             "eos_token": "<end_of_turn>"}))
    cfg = json.loads((model / "config.json").read_text())    # room for a tool round trip in the tiny vocabulary
    cfg["text_config"]["max_position_embeddings"] = 256
    (model / "config.json").write_text(json.dumps(cfg))
    return root, model


@pytest.fixture
def forced(monkeypatch):
    """Every rollout's first turn: FIRST sampled tokens, parsed as a call of add(2, 3); later turns as they are."""
    parse = ToolRollouts.parse

    class Short(TurnSampler):
        seen: list = []         # each batch's images, as the sampler was given them

        def __init__(self, *args):
            super().__init__(*args)
            Short.seen.append(self.images)

        def first(self, budget):
            return super().first(min(budget, FIRST))

    def first_is_a_call(self, ids, prefix):
        if "<start_of_turn>tool" not in self.tokenizer.decode(prefix, skip_special_tokens=False):
            return dict(CALL)
        return parse(self, ids, prefix)

    monkeypatch.setattr(ToolRollouts, "sampler", Short)
    monkeypatch.setattr(ToolRollouts, "parse", first_is_a_call)
    return Short


def trainer_of(tools_vlm, tmp_path, **kw):
    from wgpu_train.training.grpo_trainer import GRPOTrainer

    root, model = tools_vlm
    data = write_pref_data(tmp_path / "data", grpo_records())
    cfg = config(root, model, tmp_path, **{**dict(data=str(data), objective="grpo", batch_size=4, num_generations=2,
                                                  max_completion_length=BUDGET, beta=0.0, max_steps=1, seed=0,
                                                  temperature=1.0), **kw})
    return GRPOTrainer(cfg, log=lambda m: None, reward_funcs=[length_reward], tools=[add]).setup()


def test_tool_round_trip_keeps_the_images_in_context(tools_vlm, tmp_path, forced):
    """A greedy rollout: the first turn, the tool result's tokens (the template's tool message and next generation
    prompt, tool mask 0) and a second turn that is VisionModel.generate's greedy answer to the whole text with the
    prompt's images (the images stayed in the cache row across the extension); the prompt holds the tools' schemas
    and the image's expanded tokens."""
    trainer = trainer_of(tools_vlm, tmp_path)
    tok, vm = trainer.tokenizer, trainer.vision
    examples = trainer.prompts["train"]
    batch = trainer.tool_rollouts.run(trainer.engine, examples, trainer.settings, greedy=True, vision=vm)
    suffix = trainer.tool_rollouts.suffix_ids([{"role": "tool", "name": "add", "content": RESULT}])
    for ex, given in zip(examples, forced.seen[-1]):        # each prompt's images prefilled with it
        want = vm.prompt_images(ex.input_ids, ex.record.images)[1]
        assert given.blocks.shape == (1, ex.input_ids.size) and (given.blocks == want.blocks).all()
        assert_close(given.embeds, want.embeds, "logits_f32", "the prompt's image embeddings")
    for ex, r in zip(batch.examples, batch.rollouts):
        text = tok.decode(ex.input_ids.tolist(), skip_special_tokens=False)
        assert "Tools: add" in text and int((ex.input_ids == vm.vision.image_token_id).sum()) == 4
        first, rest = r.ids[:FIRST], r.ids[FIRST + len(suffix):]
        assert r.ids[FIRST:FIRST + len(suffix)] == suffix and rest
        assert r.tool_mask == [1] * FIRST + [0] * len(suffix) + [1] * len(rest)
        assert [m["role"] for m in r.turns[:2]] == ["assistant", "tool"] and r.turns[1]["content"] == RESULT
        whole = np.concatenate([ex.input_ids, np.asarray(first + suffix, ex.input_ids.dtype)])
        assert rest == vm.generate(whole, ex.record.images, len(rest), list(tok.eos_token_ids))
    # a held row with images, extended by the tool result: its next token's log-probabilities are those of the
    # whole text's prefill with the images, not those without them
    ex = batch.examples[0]
    first, got = extended_logprobs(vm, ex.input_ids, ex.record.images, suffix)
    whole = np.concatenate([ex.input_ids, np.asarray(first + suffix, np.int64)])
    with_images = log_softmax(vm.logits(whole[None], ex.record.images)[0, -1])
    without = log_softmax(trainer.model.logits(whole[None])[0, -1])
    assert_close(got, with_images, "logits_f32", "the extended row's log-probabilities")
    assert np.abs(without - with_images).max() > 1e-3


def extended_logprobs(vm, prompt, images, appended) -> tuple:
    """(the FIRST greedy tokens, the next token's log-probabilities (V,)) of a held DecodeBatch row of `prompt`
    with its images on vm's engine, extended by `appended` after its FIRST tokens."""
    decode = DecodeBatch(vm.model.engine, 1, len(prompt) + FIRST + len(appended) + 2)
    ids, tokens = vm.prompt_images(prompt, images)
    slot = decode.add(ids, FIRST, logprobs=vm.model.config.vocab_size, images=tokens, hold=True)
    first = []
    while len(decode):
        first += [t.id for t in decode.step()]
    decode.extend(slot, appended, 1)
    (token,) = decode.step()
    decode.close()
    return first, np.array([lp for _, lp in sorted(token.top)])


def test_a_held_row_with_images_extends_on_webgpu(tools_vlm, default_rt):
    """The WebGPU engine's DecodeBatch: a held row with an image, extended by a tool result's tokens, gives the
    NumPy engine's log-probabilities of the whole text prefilled with the image."""
    from test_gemma3_vision import Image
    from wgpu_train.data.vision_records import vision_prompt_ids
    from wgpu_train.engines.vision_model import load_vision_model

    _, model = tools_vlm
    tok, red = load_tokenizer(model), Image.new("RGB", (30, 20), (255, 0, 0))
    numpy_vm, gpu_vm = load_vision_model(model), load_vision_model(model, backend="wgpu")
    prompt = np.asarray(vision_prompt_ids(tok, "what colour is it?", 1, numpy_vm.image_span(tok), images=[red]))
    appended = tok.encode("<start_of_turn>tool\n5<end_of_turn>\n<|im_start|>assistant\n")
    first, got = extended_logprobs(gpu_vm, prompt, [red], appended)
    whole = np.concatenate([prompt, first, appended])
    assert_close(got, log_softmax(numpy_vm.logits(whole[None], [red])[0, -1]), "gpu_logits", "the extended row")


def test_loss_and_gradients_equal_loss_and_grads_of_the_rollouts(tools_vlm, tmp_path, forced):
    """The first step (sampled rollouts with a tool round trip each, dapo's normalisation, the ratio 1): the
    mask leaves out the prompt and the tool result's tokens, and the LoRA gradients are the advantage-weighted sum
    of each row's VisionModel.loss_and_grads (its completion's model tokens labelled, its images) times its
    share of the step's tokens."""
    trainer = trainer_of(tools_vlm, tmp_path)
    grads, result, gen = first_step_gradients(trainer)
    rows = [trainer.prompts["train"][i] for i in gen.indices for _ in range(2)]
    total = int(gen.mask.sum())
    expected = {}
    assert (gen.tool_mask == 0).any(axis=1).all() and np.abs(gen.advantages).max() > 0
    for r, ex in enumerate(rows):
        ids = gen.completions[r][gen.completions[r] >= 0]
        tools = np.asarray(gen.tool_mask[r][:ids.size])
        full = np.concatenate([ex.input_ids, ids]).astype(np.int64)
        labels = full.copy()
        labels[:ex.input_ids.size] = IGNORE_INDEX
        labels[ex.input_ids.size + np.flatnonzero(tools == 0)] = IGNORE_INDEX
        n = int((labels != IGNORE_INDEX).sum())
        assert int(gen.mask[r].sum()) == n == int(tools.sum())
        _, g = trainer.vision.loss_and_grads(full[None], labels[None], ex.record.images)
        for k, v in g.items():
            expected[k] = expected.get(k, 0.0) + gen.advantages[r] * n / total * v.astype(np.float64)
    mine = trainer.model._public_grad_names(grads)
    assert set(mine) == set(expected)
    for k, v in expected.items():
        assert np.abs(v).max() > 0, k
        assert_close(mine[k], v, "grpo_vs_trl_grads", k)
    assert_close(np.float64(result.loss), np.float64(0.0), "loss_f32", "the loss at ratio 1 of centred advantages")


def test_cli_grpo_with_an_environment_and_images(tools_vlm, tmp_path, forced, capsys):
    """`finetune --objective grpo --environment` on prompts with images: each rollout's prompt takes reset's text
    as a text part after its own, calls the environment's tool (its fixed result appended), a step is taken,
    completions.jsonl keeps each row's turns; a tool result with an image is refused in one line."""
    from wgpu_train.cli.main import main

    root, model = tools_vlm
    (tmp_path / "envs.py").write_text(
        "class Fixed:\n    def reset(self, **kwargs):\n        return ' Use add.'\n\n"
        "    def add(self, a: int, b: int) -> str:\n        \"\"\"Add two numbers.\n\n        Args:\n"
        "            a: The first number.\n            b: The second number.\n        \"\"\"\n        return '5'\n\n"
        "    def get_reward(self) -> float:\n        return 1.0\n")
    data = write_pref_data(tmp_path / "data", grpo_records())
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(model), "--backend", "numpy", "--data", str(data), "--objective", "grpo",
                 "--num-generations", "2", "--environment", f"{tmp_path / 'envs.py'}:Fixed", "--batch-size", "4",
                 "--max-steps", "1", "--max-completion-length", str(BUDGET), "--no-progress", "--valid-split", "0",
                 "--adapter-path", str(root / "adapter"), "--out", str(out)]) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["images"] == 2 and summary["objective"]["tools"] == ["add"]
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        content = row["prompt"][-1]["content"]         # reset's text after the parts, as TRL appends it
        assert content[0] == {"type": "image"} and content[-1] == {"type": "text", "text": " Use add."}
        assert row["rewards"]["Fixed"] == 1.0
        assert [m["role"] for m in row["turns"][:2]] == ["assistant", "tool"] and row["turns"][1]["content"] == "5"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["tools/call_frequency"] for r in steps if "grad_norm" in r] == [1.0]
    (tmp_path / "pictures.py").write_text((tmp_path / "envs.py").read_text().replace(
        "return '5'", "return [{'type': 'image', 'image': 'x.png'}]").replace("-> str", "-> list"))
    assert main(["finetune", "--model", str(model), "--backend", "numpy", "--data", str(data), "--objective", "grpo",
                 "--num-generations", "2", "--environment", f"{tmp_path / 'pictures.py'}:Fixed", "--batch-size", "4",
                 "--max-steps", "1", "--max-completion-length", str(BUDGET), "--no-progress", "--valid-split", "0",
                 "--out", str(tmp_path / "bad")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]        # after the run's log lines
    assert last == ("error: tool 'add' returned an image: tool results with images are not supported yet (return "
                    "text)")


def test_grpo_with_tools_and_images_on_webgpu_equals_numpy(tools_vlm, tmp_path, forced, monkeypatch, rt):
    """One step of the same scripted rollouts (a tool round trip each, the reference the adapter off, scored with
    the images): the WebGPU engine's loss, KL and adapter are the NumPy engine's."""
    from wgpu_train.formats.safetensors import read_safetensors

    class Scripted:
        def __init__(self, engine, prompts, *args):
            self.n = len(prompts)

        def first(self, budget):
            return [[10 + i, 11, 12] for i in range(self.n)]

        def resume(self, rows, appended, budgets):
            return [([20 + i] * (1 + i) + [4])[:n] for i, n in zip(rows, budgets)]

        def close(self):
            pass

    monkeypatch.setattr(ToolRollouts, "sampler", Scripted)
    runs = {}
    for backend in ("numpy", "wgpu"):
        kw = dict(device=str(rt.info.index)) if backend == "wgpu" else {}
        trainer = trainer_of(tools_vlm, tmp_path / backend, backend=backend, lr=1e-2, beta=0.04, **kw)
        trainer.train()
        rows = [json.loads(line) for line in (tmp_path / backend / "run" / "metrics.jsonl").read_text().splitlines()]
        runs[backend] = ([[r["loss"], r["kl"], r["tools/call_frequency"]] for r in rows if "grad_norm" in r],
                         read_safetensors(tmp_path / backend / "run" / "adapter_model.safetensors"))
    (loss_n, ad_n), (loss_w, ad_w) = runs["numpy"], runs["wgpu"]
    assert len(loss_n) == 1 and loss_n[0][2] == 1.0 and set(ad_n) == set(ad_w)
    assert_close(np.array(loss_w), np.array(loss_n), "loss_f32", "GRPO loss and KL with tools and images")
    for name in ad_n:
        assert_close(ad_w[name], ad_n[name], "gpu_params_after_steps_lr1e-2", name)


def test_two_workers_and_two_stages_with_tools_and_images_equal_one_process(tools_vlm, tmp_path, forced):
    """The tool loop with images on two data-parallel workers (threads: each runs its own groups' rollouts with
    their images) and through two NumPy pipeline stages (the images prefilled through the stages, the rows held
    and extended in the stages' caches): the completions, their turns and a step's loss and KL are one
    process's."""
    import wgpu_train
    from test_data_parallel import run_threads
    from wgpu_train.distributed.pipeline_trainer import finetune_pipeline

    root, model = tools_vlm
    data = write_pref_data(tmp_path / "data", grpo_records())
    kw = dict(data=str(data), objective="grpo", batch_size=2, grad_accum=2, num_generations=2,
              max_completion_length=BUDGET, max_steps=1, beta=0.04, temperature=0.8, seed=3, lr=1e-2)
    tools = dict(reward_funcs=[length_reward], tools=[add])
    wgpu_train.finetune(config(root, model, tmp_path / "one", **kw), **tools)
    finetune_pipeline(config(root, model, tmp_path / "stages", pipeline_stages=2, **kw), local=True, **tools)
    run_threads(config(root, model, tmp_path / "two", **{**kw, "grad_accum": 1}, num_workers=2), 2, **tools)
    one = tmp_path / "one" / "run"
    assert all(json.loads(line)["turns"][1]["content"] == RESULT
               for line in (one / "completions.jsonl").read_text().splitlines())
    for other, tolerance in (("stages", "pipeline_numpy"), ("two", "data_parallel_numpy")):
        two = tmp_path / other / "run"
        assert (two / "completions.jsonl").read_text() == (one / "completions.jsonl").read_text()
        losses = [[json.loads(line)[k] for k in ("loss", "kl")] for f in (one, two)
                  for line in (f / "metrics.jsonl").read_text().splitlines() if "grad_norm" in line]
        assert_close(np.array(losses[1]), np.array(losses[0]), tolerance, f"{other}: a step's loss and KL")


def test_serve_answers_a_request_with_tools_and_an_image(tools_vlm, tmp_path):
    """`serve` with `tools` and an image_url part in one request: the prompt is the chat template's with the tools
    rendered and the image's placeholder expanded, the answer (its tool-call parsing on) VisionModel.generate's
    greedy one with the image."""
    openai = pytest.importorskip("openai")
    from test_gemma3_vision import Image
    from wgpu_train.cli.main import build_parser
    from wgpu_train.cli.serve import prepare
    from wgpu_train.serve.app import build_app
    from wgpu_train.serve.server import ServerThread

    _, model = tools_vlm
    path = tmp_path / "red.png"
    Image.new("RGB", (30, 20), (255, 0, 0)).save(path)
    args = build_parser().parse_args(["serve", "--model", str(model), "--backend", "numpy", "--port", "0",
                                      "--api-key", "k", "--served-model-name", "default"])
    scheduler, sock = prepare(args)
    scheduler.start()
    thread = ServerThread(build_app(scheduler, "k"), sock).start()
    tool = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    try:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="k", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="default", max_tokens=6, temperature=0, tools=[tool], messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": path.as_uri()}},
                                         {"type": "text", "text": "what colour is it?"}]}])
        vm, tok = scheduler.vision, scheduler.tokenizer
    finally:
        thread.stop()
        scheduler.close()
    span = vm.image_span(tok)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                     "text": "what colour is it?"}]}],
                                   add_generation_prompt=True, tools=[tool])
    from wgpu_train.data.vision_records import expand_placeholders
    ids = tok.encode(expand_placeholders(text, span, [span.expansion(str(path))]))
    assert "Tools: add" in text and r.usage.prompt_tokens == len(ids)
    out = vm.generate(np.asarray(ids), [str(path)], 6, list(tok.eos_token_ids))
    assert r.usage.completion_tokens == len(out)
    assert r.choices[0].message.content == tok.decode([t for t in out if t not in tok.eos_token_ids]).strip()


def test_qwen3_vl_row_extended_after_its_images_keeps_mrope_positions(vlm):  # noqa: F811
    """A held Qwen3-VL row with images, extended by text tokens (a tool result) prefilled in two chunks: the next
    token's log-probabilities are those of the whole text's prefill with the images (each new token's M-RoPE
    position counted on from the prompt's, not from its cache row)."""
    from test_qwen3_vl import images as qwen_images, span as qwen_span

    _, folder, vm = vlm
    tok = load_tokenizer(folder)
    pictures = qwen_images(1, seed=4)
    prompt = np.asarray(tok.encode("user ") + qwen_span(vm, pictures[0]) + tok.encode(" what colour is it?"))
    appended = tok.encode(" red blue green squares")
    decode = DecodeBatch(vm.model.engine, 1, 96, token_budget=4)
    ids, tokens = vm.prompt_images(prompt, pictures)
    slot = decode.add(ids, 2, logprobs=vm.model.config.vocab_size, images=tokens, hold=True)
    first = []
    while len(decode):
        first += [t.id for t in decode.step()]
    decode.extend(slot, appended, 1)
    got = []
    while len(decode):
        got += decode.step()
    decode.close()
    whole = np.concatenate([prompt, first, appended])
    want = log_softmax(vm.logits(whole[None], pictures)[0, -1])
    assert_close(np.array([lp for _, lp in sorted(got[0].top)]), want, "logits_f32", "the extended row")


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<tool_response>",
                 "</tool_response>", "<think>", "</think>"]
QWEN_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def turns_reward(prompts, completions, **kwargs):
    """The last message's length and the tool messages: reads the turns as TRL passes them."""
    return [len(str(c[-1].get("content", ""))) / 8 + sum(m["role"] == "tool" for m in c) for c in completions]


class ScriptedRows:
    """One side's scripted turns: a row found by its prompt (its question) and first turn; slot 0 calls add then
    answers, slot 1 answers at once."""

    def __init__(self, tok, decode):
        self.decode, self.rows, self.slots = decode, {}, [0, 0]
        eos, words = tok.convert_tokens_to_ids("<|im_end|>"), tok.encode(" red blue green")
        self.turns = [[[tok.encode(QWEN_CALL) + [eos], words[:2 + p] + [eos]], [words[:1 + p] + words + [eos]]]
                      for p in range(2)]

    def first(self, prompts) -> list:
        self.rows, self.slots, out = {}, [0, 0], []
        for ids in prompts:
            p = next(i for i, q in enumerate(("what colour", "describe")) if q in self.decode(ids))
            slot = self.slots[p]
            self.slots[p] += 1
            turns = self.turns[p][slot]
            self.rows[(p, slot)] = [list(map(int, ids)) + turns[0], 1, turns]
            out.append(list(turns[0]))
        return out

    def next(self, prefix) -> list:
        prefix = list(map(int, prefix))
        row = next(r for r in self.rows.values() if prefix[:len(r[0])] == r[0])
        turn = row[2][row[1]] if row[1] < len(row[2]) else []
        row[1] += 1
        return list(turn)


def test_grpo_with_tools_and_images_equals_trl_on_qwen3_vl(tmp_path, monkeypatch):
    """TRL 1.16's GRPOTrainer with tools on a tiny Qwen3-VL with TRL's qwen3_vl.jinja (its tool parsing), and ours,
    on the same PEFT adapter, prompts with images and scripted turns (a call of add answered, then a second turn; a
    plain answer): the first step's loss, logged metrics and LoRA gradients. TRL gets its processor without a video
    processor (no torchvision here) and torch tensors from the PIL image processor (its tool loop splits them with
    torch)."""
    import copy

    import datasets
    import peft
    import torch
    import transformers as tf
    import trl
    from pathlib import Path
    from transformers.processing_utils import ProcessorMixin

    from bpe import tokenizer_folder, train_bpe
    from finetune_helpers import first_step_gradients_callback, peft_random_b
    from test_qwen3_vl import processor, tiny_config
    from test_vision_preference import our_name
    from wgpu_train.formats.tool_calls import tool_schemas
    from wgpu_train.training.config import TrainConfig
    from wgpu_train.training.grpo_trainer import GRPOTrainer
    from test_gemma3_vision import Image

    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3_vl.jinja").read_text()
    rough = load_tokenizer(tokenizer_folder(tmp_path / "first", train_bpe(["a"], 300, QWEN_SPECIALS), template,
                                            eos_token="<|im_end|>"))
    texts = [rough.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                                       add_generation_prompt=True, tools=tool_schemas([add])) for q in QUESTIONS]
    texts.append(QWEN_CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                 "<|im_start|>assistant\n red blue green")
    model = tmp_path / "model"
    bpe = train_bpe(texts * 3, 500, QWEN_SPECIALS)
    tokenizer_folder(model, bpe, template, eos_token="<|im_end|>")
    torch.manual_seed(0)
    cfg = tiny_config(bpe.get_vocab_size())
    hf = tf.Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(model)
    processor().save_pretrained(model)
    peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", lora_dropout=0.0)),
        2).save_pretrained(tmp_path / "adapter")
    records = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                "images": [im]} for q, im in zip(QUESTIONS, (Image.new("RGB", (30, 20), (255, 0, 0)),
                                                              Image.new("RGB", (17, 17), (0, 200, 0))))]

    tok = tf.AutoTokenizer.from_pretrained(model)
    images = processor()
    call = type(images).__call__
    monkeypatch.setattr(type(images), "__call__",
                        lambda self, *a, **kw: call(self, *a, **{**kw, "return_tensors": "pt"}))
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    proc = tf.Qwen3VLProcessor(image_processor=images, tokenizer=tok, chat_template=template)
    proc.tokenizer.padding_side = "left"
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "adapter"), is_trainable=True)
    grabber = first_step_gradients_callback(pm)
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=60, learning_rate=5e-3, lr_scheduler_type="constant", max_steps=1,
                          logging_steps=1, max_grad_norm=1.0, report_to="none", use_cpu=True, bf16=False,
                          save_strategy="no", seed=0, beta=0.04)
    trainer = trl.GRPOTrainer(model=pm, reward_funcs=[turns_reward], args=args, processing_class=proc,
                              train_dataset=datasets.Dataset.from_list(records), callbacks=[grabber], tools=[add])
    theirs = ScriptedRows(tok, lambda ids: tok.decode(ids))

    def generate(prompt_ids_list, images, fields, num_generations, **kw):
        if num_generations > 1 or not theirs.rows:
            return theirs.first(prompt_ids_list), None
        return [theirs.next(ids) for ids in prompt_ids_list], None

    trainer._generate_single_turn = generate
    trainer.train()
    (history,) = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    trl_grads = {our_name(k): v for k, v in grabber.grads.items()}

    mine = ScriptedRows(tok, lambda ids: tok.decode(list(map(int, ids)), skip_special_tokens=False))

    class Scripted:
        def __init__(self, engine, prompts, *args):
            self.sofar = [list(map(int, p)) for p in prompts]

        def first(self, budget):
            turns = [t[:budget] for t in mine.first(self.sofar)]
            for s, t in zip(self.sofar, turns):
                s += t
            return turns

        def resume(self, rows, appended, budgets):
            out = []
            for i, ids, n in zip(rows, appended, budgets):
                self.sofar[i] += list(ids)
                out.append(mine.next(self.sofar[i])[:n] if n > 0 else [])
                self.sofar[i] += out[-1]
            return out

        def close(self):
            pass

    monkeypatch.setattr(ToolRollouts, "sampler", Scripted)
    data = write_pref_data(tmp_path / "data", records)
    ours = GRPOTrainer(TrainConfig(
        model=str(model), data=str(data), adapter_path=str(tmp_path / "adapter"), backend="numpy",
        out=str(tmp_path / "ours"), batch_size=4, lr=5e-3, lr_schedule="constant", warmup_steps=0, max_steps=1,
        max_grad_norm=1.0, valid_split=0.0, log_every=1, eval_generate=False, no_progress=True, objective="grpo",
        beta=0.04, num_generations=2, max_completion_length=60, seed=0, max_seq_len=400),
        log=lambda m: None, reward_funcs=[turns_reward], tools=[add]).setup()
    grads, result, gen = first_step_gradients(ours)
    assert (gen.tool_mask == 0).any(axis=1).tolist() == [True, False, True, False]
    assert_close(np.float64(result.loss), np.float64(history["loss"]), "grpo_vs_trl_loss", "first loss")
    for key in ("tools/call_frequency", "reward", "completions/mean_length"):
        assert_close(np.float64(gen.metrics[key]), np.float64(history[key]), "grpo_vs_trl_loss", key)
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    clip = min(1.0, 1.0 / (norm + 1e-6))
    assert set(grads) == set(trl_grads)
    for k, g in grads.items():
        assert np.abs(trl_grads[k]).max() > 0, k
        assert_close(g * clip, trl_grads[k], "grpo_vs_trl_grads", k)
