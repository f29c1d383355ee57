"""GRPO runs end to end (training/grpo_trainer.py): the per-token weights give the objective's gradient, both
engines train the same steps, completions.jsonl lets a step be recomputed, resume is bit-exact (a generation
reused by num_iterations included), and bad input is one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from wgpu_train.adapters.files import read_adapter
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.training.config import TrainConfig
from wgpu_train.training.grpo_rows import weighted
from wgpu_train.training.grpo_trainer import COMPLETIONS_FILE, GRPOTrainer
from wgpu_train.training.rewards.builtin import word_positions

from conftest import require_adapter
from finetune_helpers import folder_state, make_model_dir, one_line_error, write_jsonl
from tolerances import assert_close

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]


def prompts(n: int, offset: int = 0) -> list[dict]:
    return [{"prompt": f"after {WORDS[i % 8]} {i}?", "answer": f"{WORDS[(i + 1) % 8]} {i}", "topic": i % 3}
            for i in range(offset, offset + n)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_train")
    model = make_model_dir(root / "model")
    make_model_dir(root / "model_even", intermediate_size=42)       # even widths: 16-bit activations on the GPU
    (root / "data").mkdir()
    write_jsonl(root / "data" / "train.jsonl", prompts(8))
    write_jsonl(root / "data" / "test.jsonl", prompts(4, 100))
    return root, model


def config(workspace, out, **kw) -> TrainConfig:
    root, model = workspace
    base = dict(model=str(model), data=str(root / "data"), out=str(out), backend="numpy", no_progress=True,
                lr=2e-2, log_every=1, objective="grpo", batch_size=4, max_steps=2, valid_split=0.0,
                lr_schedule="constant", num_generations=4, max_completion_length=6, reward="word_positions",
                eval_generate=False, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def adapter(folder):
    return read_adapter(folder)[1]


def length_reward(prompts, completions, topic, **kw):
    """A reward that differs between a random model's completions: their length, and the prompt's topic column."""
    return [len(c) / 10 + t for c, t in zip(completions, topic)]


def test_weights_give_the_objectives_gradient(workspace, tmp_path):
    """-N dloss/dlogp as per-token weights: the engine's gradient is the objective's. Checked on the NumPy engine
    against a central difference of the GRPO loss (beta > 0, mu 2: ratio, clipping and KL all in play) along
    the gradient's direction."""
    trainer = GRPOTrainer(config(workspace, tmp_path / "run", beta=0.2, num_iterations=2, grpo_loss="bnpo",
                                 epsilon=0.05))
    trainer.setup()
    gen = trainer._generate(trainer.stream.epoch_batches(0)[0])
    engine = trainer.engine
    base = {k: np.array(v, np.float64) for k, v in engine.trainable().items()}
    rng = np.random.default_rng(0)
    engine.set_trainable({k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in base.items()})
    moved = {k: np.array(v, np.float64) for k, v in engine.trainable().items()}
    width = max(ids.shape[1] for ids, _, _, _ in gen.micro)
    mask = np.concatenate([np.pad(m, ((0, 0), (0, width - m.shape[1]))) for m in gen.masks])

    def loss_and_result():
        logps, _ = trainer._score(gen.micro, gen.masks, reference=False)
        return trainer.unit.step_loss(logps, gen.policy_logps, gen.ref_logps, gen.advantages, mask, 4,
                                      int(mask.sum()))

    result = loss_and_result()
    engine.zero_grads()
    batches = weighted(gen.micro, gen.masks, result.dlogps)
    total = int(mask.sum())
    for ids, targets, seg, pos, w in batches:
        engine.forward_backward(ids, targets, seg, pos, w / total)
    grads = {k: np.array(v, np.float64) for k, v in engine.gradients().items()}
    norm = np.sqrt(sum((g ** 2).sum() for g in grads.values()))
    h = 1e-2 / norm
    ends = []
    for sign in (1, -1):
        engine.set_trainable({k: (moved[k] + sign * h * grads[k]).astype(np.float32) for k in moved})
        ends.append(loss_and_result().loss)
    directional = (ends[0] - ends[1]) / (2 * h)
    # float32 weights and scores: the central difference of a loss near 1e-1 agrees to about 1e-3 relative
    assert directional == pytest.approx(norm ** 2, rel=2e-2)


def test_grpo_run_logs_trl_metrics_and_its_completions(workspace, tmp_path):
    out = tmp_path / "run"
    summary = finetune(config(workspace, out, max_steps=2, eval_generate=True, reward="word_positions",
                              reward_weights="0.5,1"), reward_funcs=[length_reward])
    assert summary["steps"] == 2 and summary["objective"]["rewards"] == ["word_positions", "length_reward"]
    assert summary["reward_before"] is not None and summary["reward_after"] is not None
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "grad_norm" in r]
    assert steps[0]["grad_norm"] > 0
    for key in ("reward", "reward_std", "rewards/word_positions/mean", "rewards/length_reward/mean",
                "completions/mean_length",
                "completions/clipped_ratio", "clip_ratio/region_mean", "frac_reward_zero_std"):
        assert key in steps[0], key
    completions = [json.loads(line) for line in (out / COMPLETIONS_FILE).read_text().splitlines()]
    assert len(completions) == 2 * 4 and {c["step"] for c in completions} == {1, 2}
    # a step recomputed from the file: its rewards, then its group-relative advantages (scale_rewards group)
    step1 = [c for c in completions if c["step"] == 1]
    records = {p["prompt"]: p for p in prompts(8)}
    texts = [c["completion"] for c in step1]
    mine = np.array(word_positions([c["prompt"] for c in step1], texts,
                                   answer=[records[c["prompt"]]["answer"] for c in step1]))
    theirs = np.array(length_reward(None, texts, [records[c["prompt"]]["topic"] for c in step1]))
    for name, expect in (("word_positions", mine), ("length_reward", theirs)):
        np.testing.assert_array_equal([c["rewards"][name] for c in step1], expect)     # the same float64 sums
    r = 0.5 * mine + theirs
    np.testing.assert_allclose([c["reward"] for c in step1], r, rtol=1e-12)
    adv = (r - r.mean()) / (r.std(ddof=1) + 1e-4)           # one prompt's group of 4: TRL's unbiased std
    np.testing.assert_allclose([c["advantage"] for c in step1], adv, rtol=1e-9, atol=1e-12)


def test_both_engines_train_the_same_steps(workspace, tmp_path):
    """The same completions before the first update, then adapters equal after two steps (beta > 0: the KL term
    and the reference scored with the adapter switched off on both)."""
    require_adapter()
    kw = dict(max_steps=2, beta=0.1, temperature=0.7, reward=None, lr=1e-2)
    runs = {}
    for backend in ("numpy", "wgpu"):
        out = tmp_path / backend
        runs[backend] = finetune(config(workspace, out, backend=backend, **kw), reward_funcs=[length_reward])
        runs[backend]["completions"] = [json.loads(x)["completion_ids"]
                                        for x in (out / COMPLETIONS_FILE).read_text().splitlines()]
    assert runs["numpy"]["completions"][:4] == runs["wgpu"]["completions"][:4]
    for k, v in adapter(tmp_path / "numpy").items():
        assert_close(adapter(tmp_path / "wgpu")[k], v, "gpu_params_after_steps_lr1e-2", k)


@pytest.mark.parametrize("stop", [1, 2])
def test_resume_is_bit_exact_with_a_reused_generation(workspace, tmp_path, stop):
    """num_iterations 2: a resume after step 1 reuses the checkpoint's generation (its old log-probabilities
    too); one after step 2 samples the next as the uninterrupted run did."""
    kw = dict(max_steps=4, num_iterations=2, beta=0.1, save_every=1)
    whole = tmp_path / "whole"
    finetune(config(workspace, whole, **kw))
    part = tmp_path / "part"
    finetune(config(workspace, part, **{**kw, "max_steps": stop}))
    finetune(config(workspace, part, resume=str(part / "checkpoints" / f"step-{stop:06d}"), overwrite=False,
                    **{k: v for k, v in kw.items()}))
    for k, v in adapter(whole).items():
        assert np.array_equal(adapter(part)[k], v), k
    assert (part / COMPLETIONS_FILE).read_text() == (whole / COMPLETIONS_FILE).read_text()


def test_bad_input_is_one_line(workspace, tmp_path, capsys):
    root, model = workspace
    common = ["finetune", "--model", str(model), "--data", str(root / "data"), "--backend", "numpy",
              "--objective", "grpo", "--max-steps", "1", "--no-progress", "--batch-size", "4", "--num-generations", "4",
              "--max-completion-length", "6",
              "--out"]
    one_line_error(capsys, common + [str(tmp_path / "a"), "--num-generations", "1"], "num_generations")
    one_line_error(capsys, common + [str(tmp_path / "b"), "--num-generations", "3", "--batch-size", "4"],
                   "must be a multiple of it")
    one_line_error(capsys, ["finetune", "--objective", "dpo", "--num-generations", "4", "--out",
                            str(tmp_path / "c")], "--num-generations: not an option of --objective dpo")
    one_line_error(capsys, common + [str(tmp_path / "d"), "--reward", "no_such_module:f"], "no_such_module")
    one_line_error(capsys, common + [str(tmp_path / "g"), "--early-stop-patience", "2"], "leave out --early-stop")
    (root / "noprompt").mkdir(exist_ok=True)
    write_jsonl(root / "noprompt" / "train.jsonl", [{"text": "hello"}])
    one_line_error(capsys, ["finetune", "--model", str(model), "--data", str(root / "noprompt"), "--objective",
                            "grpo", "--batch-size", "4", "--num-generations", "4", "--out", str(tmp_path / "e"),
                            "--reward", "exact_match", "--backend", "numpy"], "no prompt")
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def boom(prompts, completions, **kw):\n    raise ValueError('no luck')\n")
    one_line_error(capsys, common + [str(tmp_path / "f"), "--reward", f"{bad}:boom"],
                   "'boom', step 1: raised ValueError: no luck", after_log=True)
    assert not (tmp_path / "f").exists()        # nothing trained: the run's folder is gone again


def test_fewer_prompts_than_a_step_takes_is_one_line(workspace, tmp_path, capsys):
    """3 prompts for a step of 16 completions, G = 4 (4 prompts): one line and exit code 2, before training
    starts (nothing is written)."""
    root, model = workspace
    write_jsonl(tmp_path / "three.jsonl", prompts(3))
    one_line_error(capsys, ["finetune", "--model", str(model), "--data", str(tmp_path / "three.jsonl"),
                            "--objective", "grpo", "--backend", "numpy", "--batch-size", "16", "--num-generations",
                            "4", "--max-completion-length", "6", "--valid-split", "0", "--reward", "word_positions",
                            "--no-progress", "--out", str(tmp_path / "run")],
                   "a step of 16 completions takes 4 prompts (4 completions each), but the training data holds 3",
                   after_log=True)
    assert not (tmp_path / "run").exists()


def test_an_epochs_prompts_left_over_are_not_drawn(workspace, tmp_path):
    """5 prompts, steps of 4 (G = 2, batch 4, 2 micro-batches): an epoch is one full step, as TRL's RepeatSampler
    drops an incomplete last batch (here 1 prompt, 2 rows, which do not fill a micro-batch of 4)."""
    write_jsonl(tmp_path / "five.jsonl", prompts(5))
    summary = finetune(config(workspace, tmp_path / "run", data=str(tmp_path / "five.jsonl"), max_steps=None,
                              epochs=2, num_generations=2, grad_accum=2))
    assert summary["steps"] == 2 and summary["epochs"] == 2.0
    drawn = [json.loads(line) for line in (tmp_path / "run" / COMPLETIONS_FILE).read_text().splitlines()]
    assert len(drawn) == 2 * 8 and len({d["prompt"] for d in drawn if d["step"] == 1}) == 4


def test_grpo_trains_on_alpaca_rows(workspace, tmp_path):
    """An Alpaca file SFT trains on serves GRPO: the prompt is the instruction and its input, the output the answer
    column that exact_match compares with."""
    rows = [{"instruction": "What comes after this?", "input": p["prompt"], "output": p["answer"]} for p in prompts(4)]
    write_jsonl(tmp_path / "alpaca.jsonl", rows)
    out = tmp_path / "run"
    summary = finetune(config(workspace, out, data=str(tmp_path / "alpaca.jsonl"), reward="exact_match",
                              max_steps=1))
    assert summary["steps"] == 1 and summary["data_format"] == "alpaca"
    drawn = [json.loads(line) for line in (out / COMPLETIONS_FILE).read_text().splitlines()]
    asked = {(d["prompt"][-1]["content"], d["rewards"]["exact_match"]) for d in drawn}
    inputs = {f"What comes after this?\n\n{p['prompt']}" for p in prompts(4)}
    assert {text for text, _ in asked} <= inputs and {r for _, r in asked} <= {0.0, 1.0}


def test_a_failing_reward_keeps_the_last_checkpoint(workspace, tmp_path, capsys):
    """A reward that fails at step 3 of a resumed run: one line, and the run folder as it was."""
    out = tmp_path / "run"
    finetune(config(workspace, out, max_steps=2, save_every=1))
    before = folder_state(out / "checkpoints")
    bad = tmp_path / "late.py"
    bad.write_text("def late(prompts, completions, trainer_state, **kw):\n"
                   "    return [float('nan')] * len(completions) if trainer_state.global_step >= 3 else "
                   "[0.0] * len(completions)\n")
    root, model = workspace
    one_line_error(capsys, ["finetune", "--resume", str(out), "--max-steps", "4", "--reward", f"{bad}:late",
                            "--no-progress"], "'late', step 3", after_log=True)
    assert folder_state(out / "checkpoints") == before


def test_a_resume_that_fails_before_its_first_step_changes_nothing(workspace, tmp_path, capsys):
    """A resume from step 1 whose reward raises: one line, and every file of the run folder as it was (bytes and
    times: train_config.json not rewritten with the failed command's values, metrics.jsonl and completions.jsonl
    not cut back); a plain resume then continues the run as it was recorded."""
    out = tmp_path / "run"
    finetune(config(workspace, out, max_steps=2, save_every=1))
    before = folder_state(out)
    assert json.loads((out / "train_config.json").read_text())["reward"] == "word_positions"
    bad = tmp_path / "rw.py"
    bad.write_text("def boom(prompts, completions, **kw):\n    raise ValueError('no luck')\n")
    first = str(out / "checkpoints" / "step-000001")
    one_line_error(capsys, ["finetune", "--resume", first, "--max-steps", "3", "--reward", f"{bad}:boom",
                            "--no-progress"], "'boom', step 2: raised ValueError", after_log=True)
    assert folder_state(out) == before
    from wgpu_train.cli.main import main

    assert main(["finetune", "--resume", first, "--no-progress"]) == 0
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["reward"] == "word_positions" and recorded["max_steps"] == 2
    assert {json.loads(line)["step"] for line in (out / COMPLETIONS_FILE).read_text().splitlines()} == {1, 2}


def test_the_embedded_demo_learns(tmp_path):
    """`wgpu-train finetune --objective grpo` with no data: the held-out greedy reward rises clearly (measured
    0.137 -> 0.927 on the NumPy engine; a collapse, or no learning, stays near or below the start)."""
    from wgpu_train.training.config import default_run_config

    summary = finetune(default_run_config(objective="grpo", backend="numpy", out=str(tmp_path / "demo"),
                                          no_progress=True))
    assert summary["steps"] == 100 and summary["reward_split"] == "test"
    assert summary["reward_before"] < 0.3 and summary["reward_after"] > summary["reward_before"] + 0.4


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_grpo_composes_with_nf4_dora_16_bit_and_accumulation(workspace, tmp_path, backend):
    """What SFT and DPO keep, GRPO keeps: an NF4 base, DoRA, f16 activations (with loss scaling), gradient
    accumulation over micro-batches of 2 completions, clipping; the adapter trains (the magnitudes too)."""
    if backend == "wgpu":
        require_adapter()
    out = tmp_path / backend
    summary = finetune(config(workspace, out, model=str(workspace[0] / "model_even"), backend=backend,
                              base_dtype="nf4", dora=True, precision="f16",
                              batch_size=2, grad_accum=2, max_grad_norm=0.5, beta=0.1, reward=None),
                       reward_funcs=[length_reward])
    assert summary["steps"] == 2 and summary["precision"] == "f16" and summary["base_dtype"] == "nf4"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "grad_norm" in line]
    assert all(np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)
    trained = adapter(out)
    assert any("lora_magnitude_vector" in k for k in trained)


def test_ref_adapter_is_the_kl_reference(workspace, tmp_path):
    """--ref-adapter with beta > 0: the reference log-probabilities are those of the base model with that
    adapter (at the sampling temperature), not the base model's."""
    import wgpu_train as wt

    root, model_dir = workspace
    ref = wt.load_model(model_dir, backend="numpy")
    lora = wt.LoraConfig(r=4, alpha=8, target_modules="all-linear")
    ref.add_lora(lora, seed=1)
    rng = np.random.default_rng(7)
    ref._set_lora(lora, {p: (a, rng.normal(0, 0.2, b.shape).astype(np.float32))
                         for p, (a, b) in ref.engine.lora_tensors().items()}, seed=1)
    ref.save_adapter(tmp_path / "ref")
    trainer = GRPOTrainer(config(workspace, tmp_path / "run", beta=0.1, temperature=0.8,
                                 ref_adapter=str(tmp_path / "ref")), log=lambda _: None).setup()
    gen = trainer._generate(trainer.stream.epoch_batches(0)[0], score_policy=False)
    expected = wt.load_model(model_dir, backend="numpy")
    expected.load_adapter(tmp_path / "ref")
    expected.engine.set_loss_temperature(0.8)
    width = gen.ref_logps.shape[1]
    rows = [np.pad(-expected.engine.token_losses(*m).astype(np.float64) * mask, ((0, 0), (0, width - mask.shape[1])))
            for m, mask in zip(gen.micro, gen.masks)]
    np.testing.assert_array_equal(gen.ref_logps, np.concatenate(rows))
    base = trainer._score(gen.micro, gen.masks, reference=False)[0]      # the policy: a fresh adapter, B = 0
    assert np.abs(gen.ref_logps - base).max() > 1e-3


def test_a_started_adapter_stays_the_reference_across_a_resume(workspace, tmp_path):
    """--adapter-path with beta > 0: the reference is the adapter the run started from (TRL keeps a frozen copy
    of a loaded adapter), and a resumed run takes it from its checkpoint, as the run trained."""
    start = tmp_path / "start"
    finetune(config(workspace, start, max_steps=1))
    run = tmp_path / "run"
    finetune(config(workspace, run, adapter_path=str(start), beta=0.1, max_steps=1, save_every=1))
    state = json.loads((run / "checkpoints" / "step-000001" / "trainer_state.json").read_text())
    assert state["reference_adapter"] == str(start.resolve())
    resumed = GRPOTrainer(config(workspace, run, resume=str(run / "checkpoints" / "step-000001"), beta=0.1,
                                 max_steps=2), log=lambda _: None).setup()
    assert resumed.reference_adapter == str(start.resolve()) and resumed._ref_engine is not None
