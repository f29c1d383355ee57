"""--base-dtype mxfp4 on any MoE model: a tiny Qwen3-MoE's experts quantised at load (formats/mxfp4.quantize) and kept
packed on the NumPy engine equal, bit for bit, the model whose experts were replaced by dequantize(quantize(experts))
stored bfloat16 like every other weight (logits, LoRA loss and gradients, a step); full fine-tuning, a dense model and
rows no multiple of 32 refused in one line; the memory estimate counts the experts packed. The WebGPU engine against
the NumPy one: test_mxfp4_dtype_wgpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from finetune_helpers import padded_batch
from tiny_models import build_model, build_moe, hf_config, save_model
from wgpu_train.engines.loading import model_from_weights
from wgpu_train.engines.shared.quant import StorageDtype
from wgpu_train.errors import ConfigError
from wgpu_train.formats.mxfp4 import Mxfp4, dequantize, quantize
from wgpu_train.models.config import ModelConfig
from wgpu_train.models.weights import load_weights

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

VOCAB = 61
LORA = wt.LoraConfig(r=3, alpha=7, target_modules="all-linear")      # the experts, router and attention included


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3-MoE whose experts' rows (hidden and moe_intermediate_size) are 32 long: one MXFP4 block."""
    out = tmp_path_factory.mktemp("qwen3_moe_mxfp4")
    save_model(build_moe("qwen3_moe", seed=3, hidden_size=32, moe_intermediate_size=32), out)
    return out


def _batch():
    ids, labels, mask = padded_batch(4, 9, 6, 2)
    return ids % VOCAB, np.where(labels >= 0, labels % VOCAB, labels), mask


def _with_lora(model):
    model.add_lora(LORA, seed=5)
    rng = np.random.default_rng(1)
    modules = {p: (a, rng.normal(0, 0.1, b.shape).astype(np.float32))
               for p, (a, b) in model.engine.lora_tensors().items()}
    model._set_lora(LORA, modules, seed=5)
    return model


def _twin(folder):
    """The model with each expert tensor replaced by dequantize(quantize(it)), every weight stored bfloat16 (an
    MXFP4 value is exact in bfloat16)."""
    cfg = ModelConfig.from_folder(folder)
    weights = load_weights(folder, cfg)
    weights = {k: dequantize(*quantize(weights[k])) if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
               else np.asarray(weights[k]) for k in weights}
    return model_from_weights(cfg, weights, backend="numpy", base_dtype="bfloat16", embed_dtype="bfloat16")


def test_experts_quantised_at_load_equal_the_dequantised_twin_bit_for_bit(folder):
    mine = _with_lora(wt.load_model(folder, backend="numpy", base_dtype="mxfp4"))
    ref = _with_lora(_twin(folder))
    assert (mine.engine.base_dtype, mine.engine.embed_dtype) == (StorageDtype.MXFP4, StorageDtype.BFLOAT16)
    kept = [k for k, v in mine.engine.w.items() if isinstance(v, Mxfp4)]
    assert len(kept) == 2 * 2 and all(".mlp.experts." in k for k in kept)      # two sparse layers of three
    q = "model.layers.0.self_attn.q_proj.weight"
    assert np.array_equal(mine.engine.w[q], ref.engine.w[q])                  # bfloat16 values
    ids, labels, mask = _batch()
    assert np.array_equal(mine.logits(ids, mask), ref.logits(ids, mask))
    loss_m, grads_m = mine.loss_and_grads(ids, labels, mask)
    loss_r, grads_r = ref.loss_and_grads(ids, labels, mask)
    assert loss_m == loss_r and grads_m.keys() == grads_r.keys()
    assert any(".mlp.experts.base_layer.lora_A" in k for k in grads_m)
    for k in grads_r:
        assert np.array_equal(grads_m[k], grads_r[k]), k
    plain = _with_lora(wt.load_model(folder, backend="numpy", base_dtype="bfloat16"))
    assert not np.array_equal(plain.logits(ids, mask), ref.logits(ids, mask))  # quantising the experts changed them


def test_full_finetuning_dense_models_and_odd_rows_are_refused(folder, tmp_path):
    model = wt.load_model(folder, backend="numpy", base_dtype="mxfp4")
    with pytest.raises(ConfigError, match="full fine-tuning needs float32 weights"):
        model.set_full_finetune()
    dense = tmp_path / "dense"
    save_model(build_model("qwen3"), dense)
    with pytest.raises(ConfigError, match="mxfp4 stores MoE experts; this model has none: use nf4$"):
        wt.load_model(dense, backend="numpy", base_dtype="mxfp4")
    odd = tmp_path / "odd"
    save_model(build_moe("qwen3_moe", seed=3), odd)                # hidden 30, moe_intermediate_size 19
    with pytest.raises(ConfigError, match=r"experts.gate_up_proj \(5, 38, 30\): .*multiple of 32"):
        wt.load_model(odd, backend="numpy", base_dtype="mxfp4")


def test_the_memory_estimate_counts_the_experts_packed(folder):
    """Experts at 17 bytes a block of 32 (blocks and scale), the other linear weights and the embedding bfloat16;
    a dense model refused."""
    from wgpu_train.engines.webgpu.memory import base_weight_bytes

    cfg = ModelConfig.from_folder(folder)
    mx, bf = base_weight_bytes(cfg, "mxfp4"), base_weight_bytes(cfg, "bfloat16")
    experts = 2 * 5 * (2 * 32 * 32 + 32 * 32)                                 # two sparse layers, 5 experts
    assert bf["linear"] - mx["linear"] == experts * 2 - experts // 32 * 17
    assert mx["embedding"] == bf["embedding"]
    with pytest.raises(ConfigError, match="this model has none"):
        dense = {**hf_config("qwen3").to_dict(), "architectures": ["Qwen3ForCausalLM"]}
        base_weight_bytes(ModelConfig.from_dict(dense), "mxfp4")


def test_finetune_with_base_dtype_mxfp4_runs_and_says_so(tmp_path, capsys):
    """The CLI trains a tiny MoE two steps over MXFP4 experts, its first lines saying how the base is stored, and eval
    stores the base as that run did; a dense model is refused in one line."""
    import json

    from finetune_helpers import build_tokenizer, make_data_dir, make_model_dir, one_line_error
    from wgpu_train.cli.main import main

    model_dir = tmp_path / "model"
    vocab = build_tokenizer(model_dir)
    save_model(build_moe("qwen3_moe", seed=3, vocab_size=vocab, hidden_size=32, moe_intermediate_size=32),
               model_dir)
    data = make_data_dir(tmp_path / "data")
    out = tmp_path / "out"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--max-steps", "2",
                 "--backend", "numpy", "--base-dtype", "mxfp4", "--no-progress"]) == 0
    said = ("base weights mxfp4 (embedding bfloat16; the MoE experts quantised to MXFP4, the other linear weights "
            "bfloat16)")
    assert said in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert main(["eval", "--model", str(model_dir), "--adapter-path", str(out), "--data", str(data), "--backend",
                 "numpy", "--no-generate", "--json"]) == 0                 # the adapter's run's storage, inherited
    report = json.loads(capsys.readouterr().out)
    assert (report["base_dtype"], report["embed_dtype"]) == ("mxfp4", "bfloat16")
    dense = make_model_dir(tmp_path / "dense")
    one_line_error(capsys, ["finetune", "--model", str(dense), "--data", str(data), "--out", str(tmp_path / "o2"),
                            "--max-steps", "1", "--backend", "numpy", "--base-dtype", "mxfp4", "--no-progress"], "mxfp4 stores MoE experts; this model has none: use nf4", after_log=True)
