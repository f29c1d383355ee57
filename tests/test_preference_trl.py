"""Preference objectives against TRL's own trainers on the same tiny model, adapter and pairs: the first step's
loss, TRL's metrics and the LoRA gradients, then the adapter after three AdamW steps, on both engines
(DPOTrainer with each loss type, KTOTrainer, CPOTrainer's SimPO, ORPOTrainer)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from wgpu_train.training.config import TrainConfig
from wgpu_train.training.preference_trainer import PreferenceTrainer

from finetune_helpers import first_step_gradients_callback, make_trl_model_and_adapter
from tolerances import assert_close

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

PAIRS = [{"prompt": f"after {a} {i}?", "chosen": f" {b} {i}", "rejected": f" {c} {i}"}
         for i, (a, b, c) in enumerate([("red", "blue", "green"), ("cat", "dog", "sun"), ("moon", "tree", "red"),
                                        ("blue", "green", "moon")])]
UNPAIRED = [{"prompt": p["prompt"], "completion": p["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
            for i, p in enumerate(PAIRS)]
STEPS, LR = 3, 5e-3

# name -> (TRL's trainer and config, their arguments; our TrainConfig arguments)
CASES = {
    "dpo-sigmoid": ("trl:DPOTrainer", "trl:DPOConfig", dict(loss_type=["sigmoid"], beta=0.1),
                    dict(objective="dpo", dpo_loss="sigmoid", beta=0.1)),
    "dpo-ipo": ("trl:DPOTrainer", "trl:DPOConfig", dict(loss_type=["ipo"], beta=0.3),
                dict(objective="dpo", dpo_loss="ipo", beta=0.3)),
    "dpo-hinge": ("trl:DPOTrainer", "trl:DPOConfig", dict(loss_type=["hinge"], beta=0.5),
                  dict(objective="dpo", dpo_loss="hinge", beta=0.5)),
    "dpo-robust": ("trl:DPOTrainer", "trl:DPOConfig", dict(loss_type=["robust"], beta=0.2, label_smoothing=0.1),
                   dict(objective="dpo", dpo_loss="robust", beta=0.2, label_smoothing=0.1)),
    "simpo": ("trl.experimental.cpo:CPOTrainer", "trl.experimental.cpo:CPOConfig",
              dict(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.5), dict(objective="simpo", beta=2.0)),
    "orpo": ("trl.experimental.orpo:ORPOTrainer", "trl.experimental.orpo:ORPOConfig", dict(beta=0.2),
             dict(objective="orpo", beta=0.2)),
    "kto": ("trl:KTOTrainer", "trl:KTOConfig", dict(beta=0.2, desirable_weight=1.0, undesirable_weight=1.0),
            dict(objective="kto", beta=0.2)),
}


def _import(spec):
    module, name = spec.split(":")
    return getattr(__import__(module, fromlist=[name]), name)


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """family -> (root, model folder), made once each: a tiny model of the family (Llama; Qwen3: tied
    embeddings, q / k norms) with its tokenizer, a PEFT adapter (B random, so that policy and reference
    differ) and the pair / unpaired data files."""
    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(f"pref_trl_{family}")
            folder = make_trl_model_and_adapter(root, family)
            for name, rows in (("pairs", PAIRS), ("unpaired", UNPAIRED)):
                (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            made[family] = root, folder
        return made[family]

    return get


def _trl_run(root, folder, case):
    """TRL's trainer over the PEFT model: (log_history, the LoRA gradients of step 1, the adapter after STEPS)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer_spec, config_spec, trl_args, ours = CASES[case]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(root / "adapter"), is_trainable=True)
    tok = AutoTokenizer.from_pretrained(str(folder))
    grabber = first_step_gradients_callback(peft_model)

    rows = UNPAIRED if ours["objective"] == "kto" else PAIRS
    args = _import(config_spec)(output_dir=str(root / f"trl-{case}"), per_device_train_batch_size=len(rows),
                                learning_rate=LR, lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1,
                                max_grad_norm=1.0, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                                seed=0, max_length=64, **trl_args)
    trainer = _import(trainer_spec)(model=peft_model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                    processing_class=tok, callbacks=[grabber])
    trainer.train()
    after = {n: p.detach().numpy().copy() for n, p in peft_model.named_parameters() if ".default." in n}
    return trainer.state.log_history, grabber.grads, after


def _peft_name(path: str) -> str:
    """Our trainable name (model.layers.0.self_attn.q_proj.lora_A) as PEFT names the parameter."""
    path, matrix = path.rsplit(".", 1)
    return f"base_model.model.{path}.{matrix}.default.weight"


# every objective on Llama; on the second family one of each kind (a reference, none, unpaired)
RUNS = [("llama", case) for case in CASES] + [("qwen3", case) for case in ("dpo-sigmoid", "simpo", "kto")]


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
@pytest.mark.parametrize("family, case", RUNS)
def test_first_step_and_three_steps_equal_trl(setups, tmp_path, family, case, backend, default_rt):
    root, folder = setups(family)
    history, trl_grads, trl_after = _trl_run(root, folder, case)
    ours = CASES[case][3]
    data = root / ("unpaired.jsonl" if ours["objective"] == "kto" else "pairs.jsonl")
    cfg = TrainConfig(model=str(folder), data=str(data), adapter_path=str(root / "adapter"), backend=backend,
                      out=str(tmp_path / "run"), batch_size=len(PAIRS), lr=LR, lr_schedule="constant",
                      warmup_steps=0, max_steps=STEPS, max_grad_norm=1.0, valid_split=0.0, log_every=1,
                      eval_generate=False, no_progress=True, max_seq_len=64, **ours)
    trainer = PreferenceTrainer(cfg, log=lambda m: None).setup()
    indices = trainer.stream.epoch_batches(0)[0]
    result, scored = trainer._objective("train", indices)
    first = history[0]
    assert_close(np.float64(result.loss), np.float64(first["loss"]), "preference_vs_trl_loss", case)
    for key, value in result.metrics.items():
        assert key in first, key
        assert_close(np.float64(value), np.float64(first[key]), "preference_vs_trl_loss", key)

    engine = trainer.engine
    engine.zero_grads()
    total = float(scored.targets.sum())
    for ids, targets, seg, pos, w in trainer.weighted_micro_batches(result, scored):
        engine.forward_backward(ids, targets, seg, pos, w / np.float32(total))
    ours_grads = engine.gradients()
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in ours_grads.values()))
    clip = min(1.0, 1.0 / (norm + 1e-6))                   # torch's clip_grad_norm_ (TRL's grads are clipped)
    assert set(map(_peft_name, ours_grads)) == set(trl_grads)
    for k, g in ours_grads.items():
        assert np.abs(trl_grads[_peft_name(k)]).max() > 0, k
        assert_close(g * clip, trl_grads[_peft_name(k)], "preference_vs_trl_grads", k)

    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "grad_norm" in r]
    trl_steps = [h for h in history if "loss" in h and "train_runtime" not in h]
    assert len(steps) == len(trl_steps) == STEPS
    for mine, theirs in zip(steps, trl_steps):
        assert_close(np.float64(mine["loss"]), np.float64(theirs["loss"]), "preference_vs_trl_loss", "loss")
        assert_close(np.float64(mine["rewards/margins"] if "rewards/margins" in mine else mine["kl"]),
                     np.float64(theirs["rewards/margins"] if "rewards/margins" in mine else theirs["kl"]),
                     "preference_vs_trl_loss", "margins")
    for k, v in engine.trainable().items():
        assert_close(v, trl_after[_peft_name(k)], "preference_vs_trl_params", k)
