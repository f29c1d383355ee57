"""Preference-tuning benchmark: a DPO step as the PreferenceTrainer takes it (the reference scored with the
adapter switched off, then one policy forward whose loss heads weigh the pairs: PreferenceScorer.train_pairs),
the two-pass DPO step it replaced (the policy and the reference scored in one submission, then the weighted
step: still KTO's and a data-parallel worker's), and an SFT step on the chosen rows of the same pairs,
interleaved on one engine in one run and reported as ratios, with the memory estimate of each and the DPO
steps' submissions and readbacks."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

PAIRS = 4       # pairs per step: TrainConfig's default batch_size, one micro-batch
STEPS = 3       # timed steps of each kind, after one warm-up step of each


def _demo_pairs(tokenizer, max_len: int, n: int) -> list:
    """The first n pairs of the embedded preference demo (data/preference_demo.py), tokenized with the model's
    tokenizer and chat template as the trainer tokenizes them."""
    from wgpu_train.data.preference_demo import demo_preference_splits
    from wgpu_train.data.preference_tokenize import tokenize_preferences
    from wgpu_train.data.sources import resolve_data
    from wgpu_train.training.config import default_data_dir

    splits = demo_preference_splits(resolve_data(default_data_dir(), valid_split=0.0), seed=0, unpaired=False,
                                    names=("train",))
    examples, _ = tokenize_preferences(tokenizer, splits.train[:4 * n], max_len)
    return examples[:n]


def bench_preference(rt, model=None, steps: int = STEPS) -> dict:
    """DPO (sigmoid, TRL's defaults) and SFT steps of LoRA (TrainConfig's defaults, dropout off as preference runs
    have it) on `model` (a folder or hub id; default the embedded model) over PAIRS demo pairs: the median
    step times side by side, the DPO step's parts, and memory.estimate_memory of each step's micro-batch (DPO's
    holds the chosen and the rejected rows: twice SFT's rows)."""
    from wgpu_train.data.preference_batching import row_batches
    from wgpu_train.engines.model import Model
    from wgpu_train.engines.shared.quant import check_dtypes
    from wgpu_train.engines.webgpu.engine import WgpuEngine
    from wgpu_train.engines.webgpu.memory import estimate_memory
    from wgpu_train.formats import hub
    from wgpu_train.formats.tokenizer import load_tokenizer
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.models.weights import load_weights
    from wgpu_train.training.config import PAD_MULTIPLE, TrainConfig, default_model_dir
    from wgpu_train.training.evaluate import engine_batch
    from wgpu_train.training.objectives import PreferenceSettings
    from wgpu_train.training.preference_scoring import ADAPTER_OFF, PreferenceScorer, example_rows
    from wgpu_train.training.preference_trainer import PreferenceTrainer

    folder = hub.resolve(model, "model") if model else default_model_dir()
    cfg = ModelConfig.from_folder(folder)
    train = dataclasses.replace(TrainConfig(), lora_dropout=0.0)
    base, embed = check_dtypes("auto", "auto", cfg.checkpoint_dtype)
    policy = Model(cfg, WgpuEngine(cfg, load_weights(folder, cfg), rt, base, embed), folder)
    lora = train.lora_config(cfg.num_hidden_layers)
    policy.add_lora(lora, seed=train.seed)
    engine = policy.engine
    tok = load_tokenizer(folder)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    examples = _demo_pairs(tok, min(train.max_seq_len, cfg.max_position_embeddings), PAIRS)
    scorer = PreferenceScorer(PreferenceSettings("dpo"), len(examples), pad)
    indices = np.arange(len(examples))
    sft_micro = [engine_batch(b) for b in row_batches([ex.rows()[0] for ex in examples], len(examples), pad,
                                                      PAD_MULTIPLE)]
    hp = train.optimizer_params(train.lr)
    step_no = [0]
    times: dict = {"sft": [], "dpo": [], "reference": [], "train_step": [], "two_pass": [], "scoring": [],
                   "weighted_step": []}
    calls: dict = {"dpo": {}, "two_pass": {}}     # the last DPO steps' submissions and readbacks

    def sft_step():
        step_no[0] += 1
        t0 = time.perf_counter()
        engine.train_step(sft_micro, hp, step_no[0])
        return {"sft": time.perf_counter() - t0}

    def dpo_step():         # the trainer's: one policy forward
        step_no[0] += 1
        before = {k: engine.counters[k] for k in ("submits", "readbacks")}
        t0 = time.perf_counter()
        engine.set_adapter_enabled(False)
        try:
            ref = scorer.score(engine, examples, indices).logps
        finally:
            engine.set_adapter_enabled(True)
        t1 = time.perf_counter()
        result = scorer.train_pairs(engine, examples, indices, ref,
                                    lambda batches: engine.train_step(batches, hp, step_no[0]))[0]
        t2 = time.perf_counter()
        calls["dpo"] = {k: engine.counters[k] - v for k, v in before.items()}
        losses.append(result.loss)
        return {"dpo": t2 - t0, "reference": t1 - t0, "train_step": t2 - t1}

    def two_pass_step():    # the policy and the reference scored together, then the weighted step
        step_no[0] += 1
        before = {k: engine.counters[k] for k in ("submits", "readbacks")}
        t0 = time.perf_counter()
        result, scored = scorer.objective(engine, examples, indices, ADAPTER_OFF)
        t1 = time.perf_counter()
        engine.train_step(PreferenceTrainer.weighted_micro_batches(result, scored), hp, step_no[0])
        t2 = time.perf_counter()
        calls["two_pass"] = {k: engine.counters[k] - v for k, v in before.items()}
        losses.append(result.loss)
        return {"two_pass": t2 - t0, "scoring": t1 - t0, "weighted_step": t2 - t1}

    losses: list = []
    dpo_step(), two_pass_step(), sft_step()      # warm-up: pipelines, activation buckets, uniforms
    # a fresh adapter (B = 0) changes nothing, so the policy's and the reference's scores of the first step agree:
    # DPO's first loss is log 2, or the scoring is wrong and no time of it is reported
    if not abs(losses[0] - np.log(2.0)) < 1e-5:
        raise AssertionError(f"the first DPO loss is {losses[0]!r}, not log 2: the reference pass is wrong")
    for _ in range(steps):          # interleaved, so that a busy moment of a shared machine hits every kind
        for part in (sft_step(), dpo_step(), two_pass_step()):
            for k, v in part.items():
                times[k].append(v)
    med = {k: float(np.median(v)) for k, v in times.items()}
    shapes = {"sft": sft_micro[0][0].shape,                                   # (rows, padded length)
              "dpo": scorer.micro_batches(example_rows(examples, paired=True))[0][0].shape}
    memory = {k: estimate_memory(cfg, rows, length, lora, "lora", base, embed, False, rt.max_binding)
              for k, (rows, length) in shapes.items()}
    return {
        "model": f"{folder} ({cfg.label}), LoRA r={lora.r} on {','.join(lora.targets_in(cfg))}, base {base}",
        "pairs_per_step": len(examples),
        "micro_batch": {k: f"{rows}x{length}" for k, (rows, length) in shapes.items()},
        "step_ms": {"sft": med["sft"] * 1e3, "dpo": med["dpo"] * 1e3, "dpo_two_pass": med["two_pass"] * 1e3},
        "dpo_step_ms": {"reference_scoring": med["reference"] * 1e3, "one_pass_train_step": med["train_step"] * 1e3},
        "dpo_two_pass_step_ms": {"policy_and_reference_scoring": med["scoring"] * 1e3,
                                 "weighted_train_step": med["weighted_step"] * 1e3},
        "dpo_step_calls": calls["dpo"],
        "dpo_two_pass_step_calls": calls["two_pass"],
        "dpo_vs_sft_step_time": med["dpo"] / med["sft"],
        "dpo_one_pass_vs_two_pass_step_time": med["dpo"] / med["two_pass"],
        "reference_share_of_dpo_step": med["reference"] / med["dpo"],
        "memory_estimate_bytes": {k: {key: est[key] for key in ("weights", "trainable_state", "activations",
                                                                 "logits", "total")} for k, est in memory.items()},
        "dpo_vs_sft_memory": memory["dpo"]["total"] / memory["sft"]["total"],
        "dpo_vs_sft_activation_memory": ((memory["dpo"]["activations"] + memory["dpo"]["logits"])
                                         / (memory["sft"]["activations"] + memory["sft"]["logits"])),
    }
