"""merge --gguf: the gguf package reads the file back with the merged weights (q8_0 within its quantisation
error), each tensor of the type llama.cpp's converter gives it (its rule written out here, converter_type), and
transformers' GGUF loader gives the merged folder's logits (f32 / f16), for Llama, Mistral, Qwen2 and Qwen3; what
is not exported is one line before anything is written."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from finetune_helpers import build_tokenizer, folder_state
from tiny_models import build_model, save_model
from wgpu_train.cli.main import main
from wgpu_train.models.config import LINEAR_MODULES, ModelConfig
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.models.gguf_export import rotary_rows, tensor_type
from wgpu_train.models.weights import module_path
from wgpu_train.adapters.files import peft_key, write_adapter
from wgpu_train.formats.safetensors import read_safetensors

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

# 64 wide, so that most rows split into q8_0 blocks of 32 (the others are kept in f16); Llama without llama3
# rope scaling; Mistral with tiny_models' head dim of 10 (written as attention.key_length). Qwen3's head dim
# is 128, as in every Qwen3 model: transformers' GGUF loader reads no head dim for qwen3 and takes
# Qwen3Config's default of 128 (llama.cpp reads attention.key_length).
OVERRIDES = {"llama": dict(rope_scaling=None), "mistral": {}, "qwen2": {}, "qwen3": dict(head_dim=128)}
SIZES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)


# llama.cpp's converter's choice of tensor types (convert_hf_to_gguf.py, ModelBase.prepare_tensors, as vendored in
# llama-cpp-python 0.3.36), written down from its source rather than from our exporter: float32 for tensors of one
# dimension, "_norm.weight"s, names not ending ".weight" and the routers / convolutions it lists; token_embd and
# output are quantised like any matrix; q8_0 falls back to f16 where a row is no whole number of 32-value blocks
CONVERTER_F32 = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight", ".shortconv.conv.weight")


def converter_type(name: str, row: int, dims: int, file_type: str):
    """The gguf.GGMLQuantizationType llama.cpp's converter gives tensor `name` (`dims` axes, rows of `row` values)
    in a `file_type` ("f32", "f16" or "q8_0") file."""
    q = gguf.GGMLQuantizationType
    if dims <= 1 or name.endswith("_norm.weight") or name.endswith(CONVERTER_F32) or not name.endswith(".weight"):
        return q.F32
    return {"f32": q.F32, "f16": q.F16, "q8_0": q.F16 if row % 32 else q.Q8_0}[file_type]


def assert_converter_types(path, file_type: str):
    """Every tensor of the GGUF at `path` has the type llama.cpp's converter gives it; returns the types seen."""
    types = {}
    for t in gguf.GGUFReader(str(path)).tensors:          # t.shape is ggml's order: the row length first
        want = converter_type(t.name, int(t.shape[0]), len(t.shape), file_type)
        assert t.tensor_type == want, (t.name, [int(d) for d in t.shape], t.tensor_type.name, want.name)
        types[t.name] = t.tensor_type
    return types


def _model_and_adapter(root, arch, extra_vocab=0):
    folder = root / arch
    vocab = build_tokenizer(folder)
    save_model(build_model(arch, seed=3, vocab_size=vocab + extra_vocab, **SIZES, **OVERRIDES[arch]), folder)
    cfg = ModelConfig.from_folder(folder)
    lora = LoraConfig(r=2, alpha=4, target_modules=LINEAR_MODULES)
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for m in LINEAR_MODULES:
            out_f, in_f = cfg.linear_shape(m)
            path = module_path(i, m)
            tensors[peft_key(path, "A")] = (0.3 * rng.standard_normal((2, in_f))).astype(np.float32)
            tensors[peft_key(path, "B")] = (0.3 * rng.standard_normal((out_f, 2))).astype(np.float32)
    write_adapter(root / f"{arch}-adapter", lora, tensors, base_model=str(folder))
    return folder, root / f"{arch}-adapter", cfg


@pytest.mark.parametrize("arch", list(OVERRIDES))
def test_gguf_round_trip(tmp_path, arch):
    import transformers as tf

    folder, adapter, cfg = _model_and_adapter(tmp_path, arch)
    merged = tmp_path / "merged"
    ids = torch.tensor([[1, 5, 9, 2, 7, 11, 3]])
    for dtype in ("f32", "f16", "q8_0"):
        out = tmp_path / f"{arch}-{dtype}.gguf"
        assert main(["merge", "--adapter-path", str(adapter), "--out", str(merged), "--overwrite", "--gguf", str(out),
                     "--gguf-type", dtype]) == 0
        want = read_safetensors(merged / "model.safetensors")
        types = assert_converter_types(out, dtype)
        if dtype == "q8_0":     # the matrices 64 wide, the embedding and output among them, quantised
            assert types["token_embd.weight"] == types["output.weight"] == gguf.GGMLQuantizationType.Q8_0
        reader = gguf.GGUFReader(str(out))
        got = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
               for t in reader.tensors}
        names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, {"mistral": "llama"}.get(arch, arch).upper()),
                                         cfg.num_hidden_layers)
        for name, w in want.items():
            w = w.astype(np.float32)
            q8 = dtype == "q8_0" and w.shape[-1] % 32 == 0
            tol = {"f32": 0, "f16": 1e-3, "q8_0": 1e-2 if q8 else 1e-3}[dtype]
            if arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
                w = rotary_rows(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
            g = got[names.get_name(name, try_suffixes=(".weight", ".bias"))]
            scale = tol * max(1.0, float(np.abs(w).max())) if w.ndim > 1 else 0
            assert g.shape == w.shape and np.max(np.abs(g - w)) <= scale, (name, dtype)
        fields = {f.name for f in reader.fields.values()}
        assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"} <= fields or \
            {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= fields
        if dtype != "q8_0":
            hf = tf.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
            from_gguf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name,
                                                                dtype=torch.float32).eval()
            with torch.no_grad():
                a, b = hf(ids).logits, from_gguf(ids).logits
            assert torch.allclose(a, b, atol=1e-4 if dtype == "f32" else 3e-2), (dtype, (a - b).abs().max())


def test_tensor_types_are_the_converters():
    """tensor_type against llama.cpp's converter's rule (converter_type) on the kinds of tensor it tells apart."""
    cases = [("token_embd.weight", (300, 64)), ("output.weight", (300, 64)), ("blk.0.attn_q.weight", (64, 64)),
             ("blk.0.ffn_down.weight", (64, 96)), ("blk.0.attn_k.weight", (20, 30)),       # rows of 30: f16
             ("blk.0.ffn_gate_exps.weight", (4, 32, 64)), ("blk.0.ffn_down_exps.weight", (4, 64, 48)),
             ("blk.0.ffn_gate_inp.weight", (8, 64)), ("blk.0.ffn_gate_inp_shexp.weight", (64,)),
             ("blk.0.ssm_conv1d.weight", (96, 64)), ("blk.0.shortconv.conv.weight", (64, 96)),
             ("blk.0.attn_norm.weight", (64,)), ("blk.0.ssm_norm.weight", (4, 64)), ("blk.0.attn_q.bias", (64,)),
             ("blk.0.ssm_a", (8,)), ("blk.0.exp_probs_b.bias", (8,))]
    names = {gguf.GGMLQuantizationType.F32: "f32", gguf.GGMLQuantizationType.F16: "f16",
             gguf.GGMLQuantizationType.Q8_0: "q8_0"}
    for file_type in ("f32", "f16", "q8_0"):
        for name, shape in cases:
            want = names[converter_type(name, shape[-1], len(shape), file_type)]
            assert tensor_type(name, shape, file_type) == want, (name, shape, file_type)


def test_token_list_has_a_token_per_embedding_row(tmp_path):
    """Models whose embedding has more rows than the tokenizer has tokens (Qwen's 151,936 for 151,665) get
    padding tokens, so that llama.cpp finds one token per row."""
    _, adapter, cfg = _model_and_adapter(tmp_path, "qwen2", extra_vocab=7)
    out = tmp_path / "wide.gguf"
    assert main(["merge", "--adapter-path", str(adapter), "--out", str(tmp_path / "m"), "--gguf", str(out)]) == 0
    reader = gguf.GGUFReader(str(out))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == cfg.vocab_size
    assert bytes(tokens.parts[tokens.data[-1]]).decode() == f"[PAD{cfg.vocab_size - 1}]"


def test_gguf_refusals_write_nothing(tmp_path, capsys):
    folder, adapter, _ = _model_and_adapter(tmp_path, "llama")
    scaled = tmp_path / "scaled"
    vocab = build_tokenizer(scaled)
    save_model(build_model("llama", vocab_size=vocab), scaled)              # llama3 rope scaling
    before = folder_state(tmp_path)
    capsys.readouterr()
    (tmp_path / "taken.gguf").write_bytes(b"mine")
    before = folder_state(tmp_path)
    for argv, match in ((["--model", str(scaled)], "rope_scaling llama3 is not exported"),
                        (["--gguf", str(tmp_path / "taken.gguf")], "taken.gguf exists; pass --overwrite")):
        code = main(["merge", "--adapter-path", str(adapter), "--out", str(tmp_path / "m"), "--gguf",
                     str(tmp_path / "x.gguf"), *argv])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and len(err) == 1 and match in err[0], err
    assert folder_state(tmp_path) == before


def test_without_the_gguf_package_nothing_is_written(tmp_path, capsys, monkeypatch):
    """merge --gguf without the gguf package is one line naming the extra before the merged folder is written, so
    that the same command, once the package is there, runs into an empty --out."""
    _, adapter, _ = _model_and_adapter(tmp_path, "llama")
    out = tmp_path / "m"
    out.mkdir()
    argv = ["merge", "--adapter-path", str(adapter), "--out", str(out), "--gguf", str(tmp_path / "x.gguf")]
    before = folder_state(tmp_path)
    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "gguf", None)            # `import gguf` fails as it does without the package
        code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and err == ["error: --gguf needs the gguf package: pip install 'wgpu-train[gguf]'"], err
    assert folder_state(tmp_path) == before
    assert main(argv) == 0
    assert (out / "model.safetensors").is_file() and (tmp_path / "x.gguf").is_file()
