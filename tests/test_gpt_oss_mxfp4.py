"""gpt-oss's MXFP4 experts kept packed (blocks and scales, formats/mxfp4.py) while frozen: on the NumPy engine bit for
bit the model of their dequantised twin (logits, LoRA loss and gradients through the frozen experts, a step,
greedy generation) and transformers' logits; full fine-tuning and base dtype float32 dequantise them; the memory
estimate counts them at their size; a run's first lines say so; merge writes them dequantised; pipeline stages
read theirs packed; --base-dtype mxfp4 keeps the checkpoint's blocks. The WebGPU engine's MXFP4 grouped GEMMs
against the NumPy engine: test_gpt_oss_wgpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from test_gpt_oss import batch, build_gpt_oss, write_mxfp4_pair
from wgpu_train.formats.mxfp4 import Mxfp4
from wgpu_train.engines.shared.quant import StorageDtype

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LORA = wt.LoraConfig(r=3, alpha=7, target_modules=["q_proj", "router"], target_parameters=EXPERTS)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(twin, mxfp4) folders of a tiny gpt-oss whose config.json says bfloat16, as the hub's does."""
    hf = build_gpt_oss(seed=4, hidden_size=32, intermediate_size=32)
    twin, packed, _, _ = write_mxfp4_pair(tmp_path_factory.mktemp("mxfp4"), hf, dtype="bfloat16")
    return twin, packed


def _with_lora(folder, **kw):
    """The model with LoRA on q_proj, the router and the experts, B random (seed 1), so every gradient flows."""
    model = wt.load_model(folder, backend="numpy", **kw)
    model.add_lora(LORA, seed=5)
    rng = np.random.default_rng(1)
    modules = {p: (a, rng.normal(0, 0.1, b.shape).astype(np.float32))
               for p, (a, b) in model.engine.lora_tensors().items()}
    model._set_lora(LORA, modules, seed=5)
    return model


def test_auto_keeps_the_experts_packed_and_equals_the_twin_bit_for_bit(pair):
    """base_dtype auto (the checkpoint's bfloat16) keeps every expert tensor as its blocks and scales; the logits,
    the LoRA loss and gradients (the experts' own, and the attention's and router's through the frozen experts'
    input gradients), one optimizer step and greedy generation equal the dequantised twin's stored in bfloat16
    exactly (an MXFP4 value is exact in bfloat16)."""
    twin, packed = pair
    mine, ref = _with_lora(packed, base_dtype="auto"), _with_lora(twin, base_dtype="bfloat16")
    assert mine.engine.base_dtype is StorageDtype.BFLOAT16
    kept = [k for k, v in mine.engine.w.items() if isinstance(v, Mxfp4)]
    assert len(kept) == 2 * mine.config.num_hidden_layers and all(".experts." in k for k in kept)
    assert not any(isinstance(v, Mxfp4) for v in ref.engine.w.values())
    ids, labels, mask = batch()
    assert np.array_equal(mine.logits(ids, mask), ref.logits(ids, mask))
    loss_m, grads_m = mine.loss_and_grads(ids, labels, mask)
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    assert loss_m == loss_r and grads_m.keys() == grads_r.keys()
    assert any("experts.base_layer.lora_A" in k for k in grads_m) and any("q_proj.lora_A" in k for k in grads_m)
    for k in grads_r:
        assert np.array_equal(grads_m[k], grads_r[k]), k
    prompt = [5, 17, 3, 40, 22]
    assert mine.generate(prompt, max_new_tokens=6) == ref.generate(prompt, max_new_tokens=6)
    name = "model.layers.1.mlp.experts.down_proj"
    assert np.array_equal(np.asarray(mine.engine.weights()[name]), ref.engine.weights()[name])


def test_logits_equal_transformers_reading_the_mxfp4_checkpoint(pair, monkeypatch):
    """transformers 5 reads the same MXFP4 folder (on the CPU it dequantises the blocks itself, Mxfp4Config's
    fallback without Triton); its logits in float32 equal ours with the experts kept packed (the other weights hold
    bfloat16 values, which base dtype auto's rounding leaves as they are)."""
    import torch
    import transformers as tf

    from test_gpt_oss import hf_logits
    from tolerances import assert_close

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, packed = pair
    hf = tf.AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32, attn_implementation="eager").eval()
    mine = wt.load_model(packed, backend="numpy", base_dtype="auto")
    assert any(isinstance(v, Mxfp4) for v in mine.engine.w.values())
    ids, _, mask = batch()
    real = mask.astype(bool)
    assert_close(mine.logits(ids, mask)[real], hf_logits(hf, ids, mask)[real], "logits_f32", "mxfp4 packed")


def test_float32_and_full_finetuning_dequantise_them(pair):
    """base_dtype float32 (and full fine-tuning, which trains the experts) reads them dequantised, as before."""
    _, packed = pair
    model = wt.load_model(packed, backend="numpy", base_dtype="float32")
    assert not any(isinstance(v, Mxfp4) for v in model.engine.w.values())
    model.set_full_finetune()
    ids, labels, mask = batch()
    _, grads = model.loss_and_grads(ids, labels, mask)
    assert grads["model.layers.0.mlp.experts.gate_up_proj"].shape == (5, 64, 32)


def test_memory_counts_the_experts_at_their_size(pair, capsys):
    """wgpu-train memory's base weights: each packed expert tensor at its bytes (a byte per 2 weights, a scale per
    32), where the twin's are bfloat16 (2 bytes a weight); float32 (full fine-tuning) dequantises them; the
    command's first line says they stay MXFP4."""
    from wgpu_train.engines.resources import base_weight_bytes

    twin, packed = pair
    cfg, twin_cfg = wt.ModelConfig.from_folder(packed), wt.ModelConfig.from_folder(twin)
    assert cfg.packed_experts == "mxfp4" and twin_cfg.packed_experts == ""
    weights = cfg.num_hidden_layers * 5 * (64 * 32 + 32 * 32)       # gate_up (5, 64, 32), down (5, 32, 32)
    mine, theirs = (base_weight_bytes(c, "bfloat16", "bfloat16")["linear"] for c in (cfg, twin_cfg))
    assert theirs - mine == 2 * weights - (weights // 2 + weights // 32)
    assert base_weight_bytes(cfg, "float32")["total"] == base_weight_bytes(twin_cfg, "float32")["total"]
    from wgpu_train.cli.main import main

    assert main(["memory", "--model", str(packed), "--batch-size", "1", "--max-seq-len", "8"]) == 0
    assert "base bfloat16 (embedding bfloat16; the experts MXFP4 as the checkpoint stores them)" in \
        capsys.readouterr().out


def test_a_lora_run_says_the_experts_stay_mxfp4_and_merge_writes_them_dequantised(tmp_path, capsys):
    """finetune (LoRA, base dtype auto) on the MXFP4 checkpoint says in its first lines that the experts stay MXFP4
    and trains; full fine-tuning says they are dequantised; merge writes the experts dequantised in transformers'
    layout without the quantization_config, and the merged model gives the adapted model's logits."""
    import json

    from finetune_helpers import build_tokenizer, make_data_dir
    from tolerances import assert_close
    from wgpu_train.cli.main import main

    vocab = build_tokenizer(tmp_path / "tok")
    hf = build_gpt_oss(seed=4, hidden_size=32, intermediate_size=32, vocab_size=vocab, num_hidden_layers=2)
    _, packed = write_mxfp4_pair(tmp_path, hf, dtype="bfloat16")[:2]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (packed / f).write_bytes((tmp_path / "tok" / f).read_bytes())
    data = make_data_dir(tmp_path / "data")
    common = ["--model", str(packed), "--data", str(data), "--backend", "numpy", "--max-steps", "2", "--no-progress"]
    assert main(["finetune", *common, "--out", str(tmp_path / "lora"), "--lora-targets", "all-linear"]) == 0
    assert "the experts MXFP4 as the checkpoint stores them" in capsys.readouterr().err
    assert main(["finetune", *common, "--out", str(tmp_path / "full"), "--method", "full"]) == 0
    assert "the experts dequantised from MXFP4" in capsys.readouterr().err
    assert main(["merge", "--adapter-path", str(tmp_path / "lora"), "--out", str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    merged = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in merged
    ids, _, mask = batch()
    ids = ids % vocab
    adapted = wt.load_model(packed, backend="numpy", base_dtype="float32")
    adapted.load_adapter(tmp_path / "lora")
    assert_close(wt.load_model(tmp_path / "merged", backend="numpy").logits(ids, mask), adapted.logits(ids, mask),
                 "merged_logits", "mxfp4")


def test_pipeline_stages_read_their_experts_packed(pair):
    """Each pipeline stage (load_stage) keeps its layers' experts packed and counts their blocks' and scales' file
    bytes as read, its own tensors' bytes and no more."""
    from test_pipeline import file_bytes
    from wgpu_train.engines.loading import load_stage
    from wgpu_train.models.stage_plan import plan_stages

    _, packed = pair
    sizes = file_bytes(packed)
    plan = plan_stages(3, 3, tied=False)
    read = 0
    for s in range(3):
        engine = load_stage(packed, plan, s, base_dtype="auto", precision="fp32")
        kept = [k for k, v in engine.w.items() if isinstance(v, Mxfp4)]
        assert kept == [f"model.layers.{s}.{e}" for e in EXPERTS]
        read += engine.weights_bytes_read
    assert read == sum(sizes.values())


def test_base_dtype_mxfp4_keeps_the_checkpoints_blocks(pair):
    """--base-dtype mxfp4 on gpt-oss: its experts stay the checkpoint's own blocks and scales (not quantised again),
    everything else bfloat16, so the model equals auto's (the checkpoint's bfloat16) bit for bit."""
    _, packed = pair
    mine = wt.load_model(packed, backend="numpy", base_dtype="mxfp4")
    ref = wt.load_model(packed, backend="numpy", base_dtype="auto")
    assert (mine.engine.base_dtype, mine.engine.embed_dtype) == (StorageDtype.MXFP4, StorageDtype.BFLOAT16)
    kept = {k: v for k, v in mine.engine.w.items() if isinstance(v, Mxfp4)}
    assert len(kept) == 2 * mine.config.num_hidden_layers
    for k, v in kept.items():
        assert np.array_equal(v.blocks, ref.engine.w[k].blocks) and np.array_equal(v.scales, ref.engine.w[k].scales)
    ids, _, mask = batch()
    assert np.array_equal(mine.logits(ids, mask), ref.logits(ids, mask))
