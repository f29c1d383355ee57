"""GRPO's math (training/objectives/grpo.py, grpo_advantages.py) against TRL 1.16's own GRPOTrainer on a tiny Llama:
the step loss, its derivatives by every log-probability and the logged loss metrics of every loss type (TRL's
_compute_loss run micro-batch by micro-batch on log-probabilities we choose, then autograd), the advantages and
reward / completion metrics (TRL's _generate_and_score_completions on fixed completions and rewards), and the
settings' checks."""
from __future__ import annotations

import math

import numpy as np
import pytest

from wgpu_train.errors import ConfigError
from wgpu_train.training.objectives import GRPO, GRPO_LOSSES, GRPOSettings

from tolerances import assert_close

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

PAD, EOS = 0, 1
WORDS = ["<pad>", "<eos>"] + [f"w{i}" for i in range(46)]
PROMPTS = ["w2 w3", "w4 w5 w6", "w7", "w8 w9"]
MAX_COMPLETION = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama (hidden 24, 2 layers, 48 words) and a word-level tokenizer, saved: TRL loads its
    reference model from the folder when beta != 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("grpo_model")
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=24, intermediate_size=37,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def trl_trainer(model_dir, out, reward_funcs, **config):
    """TRL's GRPOTrainer on the tiny model (CPU, no reporting), in training mode."""
    args = trl.GRPOConfig(output_dir=str(out), report_to="none", use_cpu=True, max_completion_length=MAX_COMPLETION,
                          logging_steps=1, **config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer = trl.GRPOTrainer(model=str(model_dir), reward_funcs=reward_funcs, args=args,
                              train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer)
    trainer.model.train()
    return trainer


def trl_logged(trainer) -> dict:
    """TRL's metrics as its log() averages them: the mean of each metric's non-NaN values (NaN where none)."""
    logged = {}
    for key, values in trainer._metrics["train"].items():
        valid = [v for v in values if not math.isnan(v)]
        logged[key] = sum(valid) / len(valid) if valid else math.nan
    return logged


def assert_metrics(ours: dict, theirs: dict, tolerance: str):
    for key, value in ours.items():
        if math.isnan(value) or math.isnan(theirs[key]):
            assert math.isnan(value) and math.isnan(theirs[key]), f"{key}: ours {value}, TRL's {theirs[key]}"
        else:
            assert_close(value, theirs[key], tolerance, key)


# ---- the loss ----

ROWS, ROWS_PER_MICRO = 8, 4          # two accumulation micro-batches of 4 rows; 2 prompts x 4 generations


def step_data(seed: int):
    """logps, old, ref, entropies (R, T), advantages (R,) and the mask (R, T): right-padded completions of 0 to T
    tokens (a row without tokens, as mask_truncated_completions leaves one), old and reference log-probabilities
    far enough from the policy's that ratios are clipped on both sides, some advantages 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, MAX_COMPLETION + 1, ROWS)
    lengths[5] = 0
    mask = np.arange(MAX_COMPLETION)[None, :] < lengths[:, None]
    logps = -rng.uniform(0.05, 3.0, (ROWS, MAX_COMPLETION))
    old = logps + rng.normal(0, 0.4, (ROWS, 1)) + rng.normal(0, 0.3, logps.shape)     # rows drift, as do tokens
    ref = logps + rng.normal(0, 0.5, logps.shape)
    entropies = rng.uniform(0.5, 3.0, logps.shape)
    advantages = rng.normal(0, 1, ROWS)
    advantages[[2, 6]] = 0.0
    for row, side in ((0, 1.0), (4, 1.0), (1, -1.0), (7, -1.0)):     # past either clip bound, in each micro-batch
        old[row] = logps[row] - side * 0.6 + rng.normal(0, 0.2, MAX_COMPLETION)
        advantages[row] = side * abs(advantages[row])
    return logps, old, ref, entropies, advantages, mask


def trl_step(trainer, logps, old, ref, entropies, advantages, mask, num_items):
    """TRL's _compute_loss over the step's micro-batches in order, as its accumulation runs them: (the losses
    summed, d that sum / d logps by autograd, TRL's logged metrics). The policy's log-probabilities and entropies
    are ours (its _get_per_token_logps_and_entropies replaced); everything is float64, so that the comparison
    sees the math and not float32 rounding."""
    leaf = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    micro_batches = ROWS // ROWS_PER_MICRO
    trainer.current_gradient_accumulation_steps = micro_batches     # what the Trainer's loop sets per window
    total = 0.0
    for start in range(0, ROWS, ROWS_PER_MICRO):
        rows = slice(start, start + ROWS_PER_MICRO)
        trainer._get_per_token_logps_and_entropies = (
            lambda *args, _rows=rows, **kwargs: (leaf[_rows], torch.tensor(entropies[_rows]), None))
        inputs = {"prompt_ids": torch.full((ROWS_PER_MICRO, 2), 5), "prompt_mask": torch.ones(ROWS_PER_MICRO, 2),
                  "completion_ids": torch.full((ROWS_PER_MICRO, MAX_COMPLETION), 7),
                  "completion_mask": torch.tensor(mask[rows], dtype=torch.long),
                  "advantages": torch.tensor(advantages[rows]), "num_items_in_batch": torch.tensor(num_items)}
        if old is not None:
            inputs["old_per_token_logps"] = torch.tensor(old[rows])
        if ref is not None:
            inputs["ref_per_token_logps"] = torch.tensor(ref[rows])
        total = total + trainer._compute_loss(trainer.model, inputs)
    total.backward()
    return float(total), leaf.grad.numpy(), trl_logged(trainer)


# sapo's temperatures are exact in float32: TRL's torch.where makes them float32 tensors
SAPO = dict(sapo_temperature_pos=0.75, sapo_temperature_neg=1.25)
LOSS_CASES = [dict(loss_type=loss, beta=beta, importance_sampling_level=level, mu=mu,
                   epsilon_high=1.1 if loss == "cispo" else 0.28, **(SAPO if loss == "sapo" else {}))
              for loss in GRPO_LOSSES for beta in (0.0, 0.04) for level in ("token", "sequence") for mu in (1, 2)]
LOSS_CASES += [dict(loss_type=loss, beta=0.0, importance_sampling_level="token", mu=2, epsilon_high=None)
               for loss in ("dapo", "cispo")]    # TRL's default epsilon_high: epsilon (for cispo too)
LOSS_CASES += [dict(loss_type="dapo", beta=0.04, importance_sampling_level=level, mu=2, epsilon_high=0.28,
                    use_bias_correction_kl=False) for level in ("token", "sequence")]     # the plain k3 term


@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_step_loss_derivatives_and_metrics_match_trl(case, model_dir, tmp_path):
    case = dict(case)
    mu = case.pop("mu")
    settings = GRPOSettings(num_generations=4, max_completion_length=MAX_COMPLETION, num_iterations=mu, **case)
    trainer = trl_trainer(model_dir, tmp_path, [lambda completions, **kw: [0.0] * len(completions)],
                          per_device_train_batch_size=ROWS_PER_MICRO, gradient_accumulation_steps=2,
                          num_generations=4, num_iterations=mu, **case)
    logps, old, ref, entropies, advantages, mask = step_data(seed=len(case["loss_type"]) + 7 * mu)
    old = old if mu > 1 else None          # mu 1: TRL keeps no old log-probabilities (its detached copy)
    ref = ref if settings.uses_reference else None
    num_items = int(mask.sum())
    loss, grads, metrics = trl_step(trainer, logps, old, ref, entropies, advantages, mask, num_items)
    ours = GRPO(settings).step_loss(logps, old, ref, advantages, mask, ROWS_PER_MICRO, num_items, entropies)
    assert_close(ours.loss, loss, "grpo_vs_trl_float64", "loss")
    assert_close(ours.dlogps, grads, "grpo_vs_trl_float64", "d loss / d logps")
    assert np.all(ours.dlogps[~mask] == 0)
    assert set(ours.metrics) == set(metrics)
    assert_metrics(ours.metrics, metrics, "grpo_metrics_vs_trl")
    if mu > 1:      # the data reach the clipping this case checks, on both sides
        shares = {"cispo": ["cispo_clip_ratio"], "sapo": []}.get(settings.loss_type,
                                                                   ["clip_ratio/low_mean", "clip_ratio/high_mean"])
        assert all(metrics[share] > 0 for share in shares), metrics


# ---- advantages, rewards and completion metrics ----

G = 4
# per reward function, one value per row (4 prompts x 4 completions), None where it does not apply: rows 3, 8, 12,
# 14 and 15 are unscored by both, prompt 1's group has equal rewards (zero std), prompt 3's a single scored row
FIRST = [1.0, 0.0, 0.5, None, 0.25, 0.25, 0.25, 0.25, None, 2.0, None, 0.75, None, 3.0, None, None]
SECOND = [0.0, 1.0, None, None, 0.5, 0.5, 0.5, 0.5, None, None, 1.5, 1.0, None, None, None, None]
# completion ids: EOS-terminated, or cut at MAX_COMPLETION (no EOS)
COMPLETIONS = [[9] * (i % MAX_COMPLETION) + [EOS] if i % 3 else [10 + i % 5] * MAX_COMPLETION for i in range(16)]


def first_reward(completions, **kwargs):
    return list(FIRST)


def second_reward(completions, **kwargs):
    return list(SECOND)


@pytest.mark.parametrize("scale_rewards, weights", [("group", None), ("batch", [1.0, 0.5]), ("none", [2.0, -0.75])])
def test_advantages_and_reward_metrics_match_trl(scale_rewards, weights, model_dir, tmp_path):
    trainer = trl_trainer(model_dir, tmp_path, [first_reward, second_reward], per_device_train_batch_size=8,
                          gradient_accumulation_steps=2, num_generations=G, scale_rewards=scale_rewards,
                          reward_weights=weights)
    trainer._generate_single_turn = lambda prompt_ids, *args, **kwargs: ([list(c) for c in COMPLETIONS], None)
    output = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
    theirs = trl_logged(trainer)

    unit = GRPO(GRPOSettings(num_generations=G, scale_rewards=scale_rewards))
    per_func = np.array([FIRST, SECOND], dtype=np.float64).T       # None -> NaN
    advantages, rewards, metrics = unit.advantages(per_func, weights or [1.0, 1.0], ["first_reward", "second_reward"])
    assert_close(advantages, output["advantages"].numpy(), "grpo_rewards_vs_trl", "advantages")
    unscored = np.array([a is None and b is None for a, b in zip(FIRST, SECOND)])
    assert np.array_equal(np.isnan(rewards), unscored) and np.all(advantages[unscored] == 0)
    assert np.all(advantages[12:] == 0)             # a group with a single scored row has no std
    assert_metrics(metrics, theirs, "grpo_rewards_vs_trl")

    lengths = np.array([len(c) for c in COMPLETIONS])
    truncated = np.array([c[-1] not in (EOS, PAD) for c in COMPLETIONS])
    completion = unit.completion_metrics(lengths, truncated)
    assert_metrics(completion, theirs, "grpo_rewards_vs_trl")


def test_completion_metrics_when_every_completion_is_cut():
    metrics = GRPO.completion_metrics([6, 6, 6], [True, True, True])
    assert metrics["completions/clipped_ratio"] == 1.0
    assert metrics["completions/mean_terminated_length"] == metrics["completions/max_terminated_length"] == 0.0


# ---- settings ----

def test_settings_defaults_are_trls():
    s, theirs = GRPOSettings(), trl.GRPOConfig(output_dir="unused", report_to="none", use_cpu=True)
    for name in ("num_generations", "temperature", "top_p", "top_k", "mask_truncated_completions", "scale_rewards",
                 "loss_type", "epsilon", "epsilon_high", "beta", "num_iterations", "importance_sampling_level",
                 "sapo_temperature_pos", "sapo_temperature_neg", "use_bias_correction_kl"):
        assert getattr(s, name) == getattr(theirs, name), name
    assert not s.uses_reference and GRPOSettings(beta=0.04).uses_reference
    assert s.upper_epsilon == 0.2 and GRPOSettings(epsilon_high=0.28).upper_epsilon == 0.28


@pytest.mark.parametrize("field, value, message", [
    ("num_generations", 1, r"num_generations must be an integer >= 2, got 1"),
    ("num_generations", 4.0, r"num_generations must be an integer >= 2, got 4.0"),
    ("max_completion_length", 0, r"max_completion_length must be an integer >= 1, got 0"),
    ("top_k", -1, r"top_k must be an integer >= 0, got -1"),
    ("num_iterations", 0, r"num_iterations must be an integer >= 1, got 0"),
    ("temperature", 0.0, r"temperature must be positive, got 0.0"),
    ("top_p", 0.0, r"top_p must lie in \(0, 1\], got 0.0"),
    ("top_p", 1.5, r"top_p must lie in \(0, 1\], got 1.5"),
    ("scale_rewards", True, r"scale_rewards must be one of group, batch, none, got True"),
    ("loss_type", "luspo", r"loss_type must be one of dapo, grpo, dr_grpo, bnpo, cispo, sapo, got 'luspo'"),
    ("importance_sampling_level", "row", r"importance_sampling_level must be one of token, sequence, got 'row'"),
    ("epsilon", -0.1, r"epsilon and epsilon_high must be >= 0, got -0.1 and None"),
    ("epsilon_high", -1.0, r"epsilon and epsilon_high must be >= 0, got 0.2 and -1.0"),
    ("beta", -0.01, r"beta must be >= 0, got -0.01"),
    ("sapo_temperature_neg", 0.0, r"sapo_temperature_pos and sapo_temperature_neg must be positive"),
])
def test_bad_settings_are_one_line_config_errors(field, value, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        GRPOSettings(**{field: value})


def test_traits():
    unit = GRPO(GRPOSettings(beta=0.1))
    assert (GRPO.name, GRPO.data.value, GRPO.trainer.value) == ("grpo", "prompts", "online")
    assert unit.uses_reference and not GRPO(GRPOSettings()).uses_reference and not GRPO.uses_reference
    assert "grpo_loss" in GRPO.options and "loss_type" not in GRPO.options     # TrainConfig's field names
