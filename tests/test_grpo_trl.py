"""Whole GRPO runs against TRL 1.16's GRPOTrainer on the same tiny model, PEFT adapter, prompts and completions:
the first step's LoRA gradients, every metric both log at each of three steps (loss, rewards, completions, kl,
clip ratios), and the adapter after three AdamW steps. Generation is replaced on both sides by fixed completions
per generation, prompt and group slot (ours: GRPOTrainer._sample; TRL's: _generate_single_turn), every prompt is
in every generation and a step is one micro-batch, so TRL's shuffles of prompts and rows change nothing."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.training.config import TrainConfig
from wgpu_train.training.grpo_rows import padded, weighted
from wgpu_train.training.grpo_trainer import GRPOTrainer

from conftest import require_adapter
from finetune_helpers import first_step_gradients_callback, make_trl_model_and_adapter, write_jsonl
from tolerances import assert_close

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytest.importorskip("peft")

PROMPTS = ["after red 0?", "after cat 1?"]
G, MAX_COMPLETION, STEPS, LR = 4, 5, 3, 5e-3
REWARD_WEIGHTS = [1.0, 0.5]
ROWS = len(PROMPTS) * G                     # one generation = one step's one micro-batch


def text_reward(prompts, completions, **kwargs):
    """The decoded completion's length: compares both sides' decoding too."""
    return [len(c) / 8 for c in completions]


def id_reward(prompts, completions, completion_ids, **kwargs):
    """The completion's token ids divisible by 3, plus the prompt's number: a second function (weighted 0.5)."""
    return [float(sum(t % 3 == 0 for t in ids)) + float(p[-2]) for p, ids in zip(prompts, completion_ids)]


def fixed_completions(words: range, eos: int) -> list:
    """[generation][prompt][slot] -> completion ids: lengths 1..MAX_COMPLETION, ending in EOS or cut at
    MAX_COMPLETION without it; in generation 1 the second prompt's group is four equal completions (zero std)."""
    rng = np.random.default_rng(11)
    out = []
    for gen in range(STEPS):
        groups = []
        for p in range(len(PROMPTS)):
            group = []
            for slot in range(G):
                cut = (gen + p + slot) % 3 == 0
                n = MAX_COMPLETION if cut else int(rng.integers(1, MAX_COMPLETION))
                ids = [int(t) for t in rng.integers(words.start, words.stop, n)]
                group.append(ids if cut else ids[:-1] + [eos] if n > 1 else [eos])
            if gen == 1 and p == 1:
                group = [group[0]] * G
            groups.append(group)
        out.append(groups)
    return out


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """family -> (root, model folder, completions): a tiny model with its tokenizer, our initial adapter (B random:
    B = 0 would hide A's gradients and make policy and reference equal) saved in PEFT's format, the prompts."""
    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(f"grpo_trl_{family}")
            folder = make_trl_model_and_adapter(root, family)
            write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
            tok = load_tokenizer(folder)
            specials = max(tok.stop_token_ids + [tok.pad_token_id]) + 1
            made[family] = root, folder, fixed_completions(range(specials + 1, tok.vocab_size), tok.eos_token_id)
        return made[family]

    return get


def _peft_name(path: str) -> str:
    """Our trainable name (model.layers.0.self_attn.q_proj.lora_A) as PEFT names the parameter."""
    path, matrix = path.rsplit(".", 1)
    return f"base_model.model.{path}.{matrix}.default.weight"


def trl_run(root, folder, completions, case):
    """TRL's GRPOTrainer over the PEFT model, its generation replaced by the fixed completions: (log_history,
    the clipped LoRA gradients of step 1, the adapter after STEPS, the prompt ids it tokenized, how many
    generations it asked for)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(root / "adapter"), is_trainable=True)
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompt_ids = [list(ids) for ids in tok(PROMPTS)["input_ids"]]       # as TRL's _tokenize_prompts makes them
    grabber = first_step_gradients_callback(peft_model)

    args = trl.GRPOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=ROWS,
                          gradient_accumulation_steps=1, num_generations=G, max_completion_length=MAX_COMPLETION,
                          learning_rate=LR, lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1,
                          max_grad_norm=1.0, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
                          reward_weights=REWARD_WEIGHTS, **case)
    trainer = trl.GRPOTrainer(model=peft_model, reward_funcs=[text_reward, id_reward], args=args,
                              train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                              callbacks=[grabber])
    generations = []

    def generate(prompt_ids_list, *args, **kwargs):
        table, slots, out = completions[len(generations)], [0] * len(PROMPTS), []
        for ids in prompt_ids_list:       # a prompt's rows in its group's order, whatever order the prompts come in
            p = prompt_ids.index(list(ids))
            out.append(list(table[p][slots[p]]))
            slots[p] += 1
        generations.append(out)
        return out, None

    trainer._generate_single_turn = generate
    trainer.train()
    after = {n: p.detach().numpy().copy() for n, p in peft_model.named_parameters() if ".default." in n}
    return trainer.state.log_history, grabber.grads, after, prompt_ids, len(generations)


def our_trainer(root, folder, completions, case, backend, out, monkeypatch):
    """Our GRPOTrainer on the same adapter, prompts and completions (its _sample replaced), set up."""
    theirs_to_ours = {"loss_type": "grpo_loss"}
    cfg = TrainConfig(model=str(folder), data=str(root / "prompts.jsonl"), adapter_path=str(root / "adapter"),
                      backend=backend, out=str(out), objective="grpo", batch_size=ROWS, num_generations=G,
                      max_completion_length=MAX_COMPLETION, lr=LR, lr_schedule="constant", warmup_steps=0,
                      max_steps=STEPS, max_grad_norm=1.0, valid_split=0.0, log_every=1, eval_generate=False,
                      no_progress=True, no_chat_template=True, seed=0,
                      reward_weights=",".join(map(str, REWARD_WEIGHTS)),
                      **{theirs_to_ours.get(k, k): v for k, v in case.items()})
    generations = []

    def sample(self, examples, seeds):
        table, slots, ids = completions[len(generations)], [0] * len(PROMPTS), []
        for ex in examples:
            p = PROMPTS.index(ex.record.prompt)
            ids.append(list(table[p][slots[p]]))
            slots[p] += 1
        generations.append(ids)
        ended = {*self.tokenizer.eos_token_ids, self.tokenizer.pad_token_id}      # as _sample and TRL count them
        return ids, np.array([c[-1] not in ended for c in ids], bool)

    monkeypatch.setattr(GRPOTrainer, "_sample", sample)
    trainer = GRPOTrainer(cfg, log=lambda m: None, reward_funcs=[text_reward, id_reward]).setup()
    return trainer, generations


def first_step_gradients(trainer):
    """The engine's LoRA gradients of the first step's weighted micro-batch, as _step forms them (not applied),
    and the step's GRPOResult (a micro-batch's images set on the engine for its forward)."""
    gen = trainer._generate(trainer.stream.epoch_batches(0)[0])
    width = max(mb[0].shape[1] for mb in gen.micro)
    mask = np.concatenate([padded(m, width) for m in gen.masks])
    logps = gen.policy_logps if gen.policy_logps is not None else np.zeros(mask.shape)
    result = trainer.unit.step_loss(logps, gen.old_logps, gen.ref_logps, gen.advantages, mask,
                                    trainer.config.batch_size, int(mask.sum()))
    engine = trainer.engine
    engine.zero_grads()
    total = float(mask.sum())
    for ids, targets, seg, pos, w, *images in weighted(gen.micro, gen.masks, result.dlogps):
        engine.set_images(images[0]) if images else None
        engine.forward_backward(ids, targets, seg, pos, w / np.float32(total))
        engine.set_images(None) if images else None
    return engine.gradients(), result, gen


OBSERVED: dict = {}     # tolerance name -> (largest absolute error, largest error relative to the compared
                        # value or tensor's largest element, what), printed with -s: the numbers in tolerances.py


def check(actual, expected, name: str, what: str):
    err = float(np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64)).max())
    rel = err / max(float(np.abs(np.asarray(expected, np.float64)).max()), 1e-30)
    worst = OBSERVED.get(name, (0.0, 0.0, "", ""))
    OBSERVED[name] = (max(worst[0], err), max(worst[1], rel), what if err > worst[0] else worst[2],
                      what if rel > worst[1] else worst[3])
    assert_close(actual, expected, name, what)


@pytest.fixture(scope="module", autouse=True)
def one_thread_and_the_errors_seen():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # a tiny model: a second thread only waits on the other process of a 2-core CI
    yield
    torch.set_num_threads(threads)
    for name, (a, r, wa, wr) in OBSERVED.items():
        print(f"\n{name}: largest absolute error {a:.2g} ({wa}), relative {r:.2g} ({wr})")


SKIP_KEYS = {"epoch", "step", "learning_rate", "lr", "num_tokens", "step_time", "grad_norm", "loss"}


def compare_run(root, folder, completions, case, backend, tmp_path, monkeypatch):
    history, trl_grads, trl_after, trl_prompt_ids, trl_generations = trl_run(root, folder, completions, case)
    trainer, generations = our_trainer(root, folder, completions, case, backend, tmp_path / "run", monkeypatch)
    assert [list(map(int, e.input_ids)) for e in trainer.prompts["train"]] == trl_prompt_ids

    grads, result, gen = first_step_gradients(trainer)
    generations.clear()
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    clip = min(1.0, 1.0 / (norm + 1e-6))                   # torch's clip_grad_norm_ (TRL's grads are clipped)
    assert set(map(_peft_name, grads)) == set(trl_grads)
    for k, g in grads.items():
        theirs = trl_grads[_peft_name(k)]
        assert np.abs(theirs).max() > 0, k
        check(g * clip, theirs, "grpo_vs_trl_grads", k)

    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "grad_norm" in r]
    trl_steps = [h for h in history if "loss" in h and "train_runtime" not in h]
    assert len(steps) == len(trl_steps) == STEPS
    assert len(generations) == trl_generations == -(-STEPS // case.get("num_iterations", 1))
    check(result.loss, trl_steps[0]["loss"], "grpo_vs_trl_loss", "first step's loss")
    for mine, theirs in zip(steps, trl_steps):
        check(mine["loss"], theirs["loss"], "grpo_vs_trl_loss", "loss")
        check(mine["grad_norm"], theirs["grad_norm"], "grpo_vs_trl_loss", "grad_norm")
        shared = (set(mine) & set(theirs)) - SKIP_KEYS
        # TRL logs the rewards and completions of a generation at the step that generated it only, we at each
        # step that trains on it
        assert "reward" not in theirs or {"reward", "reward_std", "frac_reward_zero_std", "rewards/text_reward/mean",
                                          "rewards/id_reward/std", "completions/mean_length"} <= shared
        assert set(result.metrics) <= set(mine) and set(result.metrics) <= set(theirs)
        assert "entropy" in shared        # the policy's entropy at the loss temperature, from the step's own heads
        for key in sorted(shared):
            a, b = mine[key], theirs[key]
            if a is None or b is None or (isinstance(a, float) and math.isnan(a)):
                assert a is None and b is None, f"{key}: ours {a}, TRL's {b}"
            else:
                check(a, b, "grpo_vs_trl_loss", key)
    for k, v in trainer.engine.trainable().items():
        check(v, trl_after[_peft_name(k)], "grpo_vs_trl_params", k)


# small clipping ranges, so that the second step of a generation (num_iterations 2) clips some ratios
CLIP = dict(epsilon=0.1, epsilon_high=0.15)
CASES = {
    "dapo-token": dict(loss_type="dapo"),
    "dapo-seq-kl-mu2": dict(loss_type="dapo", beta=0.04, num_iterations=2, importance_sampling_level="sequence",
                            **CLIP),
    "grpo-kl-mu2": dict(loss_type="grpo", beta=0.04, num_iterations=2, **CLIP),
    "dr_grpo-seq-mu2": dict(loss_type="dr_grpo", num_iterations=2, importance_sampling_level="sequence", **CLIP),
    "bnpo-kl": dict(loss_type="bnpo", beta=0.04),
    "bnpo-mu2": dict(loss_type="bnpo", num_iterations=2, **CLIP),
    "cispo": dict(loss_type="cispo", epsilon_high=1.05),
    "cispo-mu2": dict(loss_type="cispo", num_iterations=2, epsilon_high=1.05),
    "sapo-kl-mu2": dict(loss_type="sapo", beta=0.04, num_iterations=2),
    # TRL's log-probabilities are of logits / temperature, the ratios', the KL's and the gradient's
    "dapo-temperature-kl-mu2": dict(loss_type="dapo", temperature=0.7, beta=0.04, num_iterations=2, **CLIP),
}

# every case on Llama with the NumPy engine; on Qwen3 (tied embeddings, q / k norms) and on the WebGPU engine the
# cases with the most in play (KL, a reused generation, clipping)
RUNS = ([("llama", name, "numpy") for name in CASES] + [("qwen3", "grpo-kl-mu2", "numpy")]
        + [("llama", "dapo-seq-kl-mu2", "wgpu"), ("qwen3", "cispo-mu2", "wgpu"),
           ("llama", "dapo-temperature-kl-mu2", "wgpu")])


@pytest.mark.parametrize("family, name, backend", RUNS)
def test_grpo_runs_equal_trl(setups, tmp_path, monkeypatch, family, name, backend):
    if backend == "wgpu":
        require_adapter()
    root, folder, completions = setups(family)
    compare_run(root, folder, completions, CASES[name], backend, tmp_path, monkeypatch)


@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"])
def test_completions_end_where_trls_do(tmp_path, monkeypatch, eos):
    """TRL 1.16's GRPOTrainer ends a completion at the tokenizer's EOS and its generation config's (its
    eos_token_ids), not at every end-of-turn token of the vocabulary (SmolLM2 holds <|im_end|> and <|endoftext|>,
    one of them its EOS), and counts one that ends in neither nor the pad token as cut: our sampler passes TRL's
    stop ids and cuts the same completions; `generate` still stops at both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = make_trl_model_and_adapter(tmp_path, "llama")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": eos}))
    eos_id = load_tokenizer(folder).token_to_id(eos)
    for name in ("config.json", "generation_config.json"):          # the model's own EOS, as SmolLM2's files say
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()), "eos_token_id": eos_id}))
    tok = AutoTokenizer.from_pretrained(str(folder))
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=G, num_generations=G,
                          max_completion_length=MAX_COMPLETION, report_to="none", use_cpu=True, bf16=False,
                          save_strategy="no")
    theirs = trl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(folder)), reward_funcs=[text_reward],
                             args=args, train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
                             processing_class=tok)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    ours = GRPOTrainer(TrainConfig(model=str(folder), data=str(tmp_path / "prompts.jsonl"), backend="numpy",
                                   out=str(tmp_path / "ours"), objective="grpo", batch_size=G, num_generations=G,
                                   max_completion_length=MAX_COMPLETION, valid_split=0.0, eval_generate=False,
                                   no_progress=True), log=lambda m: None, reward_funcs=[text_reward]).setup()
    ends = load_tokenizer(folder).stop_token_ids
    assert theirs.eos_token_ids == [eos_id] and sorted(ends) != [eos_id] and eos_id in ends   # the case in question
    word = max(ends + [tok.pad_token_id]) + 1
    completions = [[word] * MAX_COMPLETION] + [[word, end] for end in ends] + [[word, tok.pad_token_id]]
    asked = {}

    def generate_batch(prompts, stop_token_ids, **kw):
        asked["stops"] = stop_token_ids
        return completions

    monkeypatch.setattr(ours.model, "generate_batch", generate_batch)
    _, cut = ours._sample(ours.prompts["train"][:1] * len(completions), list(range(len(completions))))
    assert asked["stops"] == theirs.eos_token_ids
    trl_cut = [ids[-1] not in [*theirs.eos_token_ids, tok.pad_token_id] for ids in completions]
    assert cut.tolist() == trl_cut and trl_cut[0] and not trl_cut[-1]     # unended: cut; ending in pad: not
    assert trl_cut[1:-1] == [end != eos_id and end != tok.pad_token_id for end in ends]
