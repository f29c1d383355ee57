"""Hybrid models against TRL 1.16's SFTTrainer: three whole SFT steps (this project's data reading, packing-free
batches, loss, AdamW and clipping) from the same PEFT adapter on a tiny LFM2 (short convolutions), Qwen3.5 (Gated
DeltaNet) and SmolLM3 (NoPE layers), on the NumPy engine: every LoRA tensor after them, on both layer kinds'
modules."""
from __future__ import annotations

import copy
import json

import peft
import pytest
import torch

from finetune_helpers import build_tokenizer, peft_random_b
from test_hybrid_layers import smollm3
from test_lfm2 import LFM2, TARGETS as LFM2_TARGETS
from test_qwen3_5 import QWEN3_5, TARGETS as QWEN3_5_TARGETS, _randomise
from tiny_models import save_model
from tolerances import assert_close
from wgpu_train.formats.safetensors import read_safetensors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ROWS = ["after red 1? blue 1", "after blue 2? green two", "after green 3? red 3", "after sun 4? moon four"]


def _model(kind: str, vocab: int):
    """A tiny random model of `kind` over the test tokenizer's vocabulary, and the LoRA targets of both its layer
    kinds."""
    import transformers as tf

    torch.manual_seed(6)
    if kind == "lfm2":
        hf = tf.AutoModelForCausalLM.from_config(tf.Lfm2Config(**{**LFM2, "vocab_size": vocab}), dtype=torch.float32,
                                                 attn_implementation="eager")
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
        return hf.eval(), LFM2_TARGETS
    if kind == "qwen3_5":
        cfg = tf.Qwen3_5TextConfig(**{**QWEN3_5, "vocab_size": vocab})
        return _randomise(tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                              attn_implementation="eager")), QWEN3_5_TARGETS
    return smollm3(seed=6, vocab_size=vocab), ["q_proj", "v_proj", "down_proj"]


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_5", "smollm3"])
def test_three_sft_steps_equal_trl_sft_trainer(tmp_path, kind):
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from wgpu_train.training.config import TrainConfig
    from wgpu_train.training.trainers import make_trainer

    model_dir = tmp_path / "model"
    vocab = build_tokenizer(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    hf, targets = _model(kind, vocab)
    save_model(hf, model_dir)
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")), peft.LoraConfig(
        r=3, lora_alpha=5, lora_dropout=0.0, target_modules=targets)), 2)
    pm.save_pretrained(tmp_path / "adapter")
    rows = [{"text": t} for t in ROWS]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pm.train()
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, learning_rate=0.02,
                         lr_scheduler_type="constant", max_steps=3, max_grad_norm=1.0, report_to=[], use_cpu=True,
                         save_strategy="no", seed=0, max_length=64, logging_steps=1, weight_decay=0.0, bf16=False)
    trainer = trl.SFTTrainer(model=pm, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    theirs = {n.replace(".default.", "."): p.detach().numpy() for n, p in pm.named_parameters() if "lora_" in n}
    cfg = TrainConfig(model=str(model_dir), data=str(tmp_path / "text.jsonl"), adapter_path=str(tmp_path / "adapter"),
                      backend="numpy", out=str(tmp_path / "ours"), batch_size=4, lr=0.02, lr_schedule="constant",
                      warmup_steps=0, max_steps=3, max_grad_norm=1.0, valid_split=0.0, eval_generate=False,
                      no_progress=True, max_seq_len=64, weight_decay=0.0)
    make_trainer(cfg, log=lambda m: None).setup().train()
    ours = read_safetensors(tmp_path / "ours" / "adapter_model.safetensors")
    first = json.loads((tmp_path / "ours" / "metrics.jsonl").read_text().splitlines()[0])
    assert_close(first["loss"], trainer.state.log_history[0]["loss"], "loss_f32", "step 1's loss")
    assert set(ours) == set(theirs)
    assert any(float(abs(ours[k] - v).max()) > 1e-3 for k, v in read_safetensors(
        tmp_path / "adapter" / "adapter_model.safetensors").items())        # it trained
    for k, v in ours.items():
        assert_close(v, theirs[k], "delta_rule_vs_trl_params" if kind == "qwen3_5" else "preference_vs_trl_params", k)
