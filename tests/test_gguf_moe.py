"""merge --gguf of mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, OLMoE, Mixtral as llama): the
gguf package reads back llama.cpp's stacked expert tensors, router and expert metadata holding the merged weights;
transformers' GGUF loader (Qwen2-MoE and Qwen3-MoE, the MoE architectures it reads) gives the merged folder's
logits; what llama.cpp's graphs cannot run is one line before anything is written. With LLAMA_CPP_DIR set, a q8_0
file equals llama.cpp's own converter's, tensor by tensor (dense models too)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import peft
import pytest

from finetune_helpers import build_tokenizer, folder_state
from test_gguf import _model_and_adapter as dense_model, assert_converter_types
from tiny_models import build_moe, save_model
from tolerances import assert_close
from wgpu_train.cli.main import main
from wgpu_train.formats.safetensors import read_safetensors
from wgpu_train.models.config import ModelConfig
from wgpu_train.models.gguf_export import rotary_rows

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# every layer sparse, as llama.cpp's MoE graphs have them; 64 wide so that q8_0 quantises the experts' rows
SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
OVERRIDES = {"qwen3_moe": dict(mlp_only_layers=[], moe_intermediate_size=32), "mixtral": dict(intermediate_size=32),
             "qwen2_moe": dict(decoder_sparse_step=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                               head_dim=None),
             "olmoe": dict(intermediate_size=32, num_key_value_heads=4, head_dim=None)}
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama"}


def _model_and_adapter(root, arch):
    """A tiny MoE with a tokenizer, and a PEFT adapter on its attention and experts (B random)."""
    folder = root / arch
    vocab = build_tokenizer(folder)
    kw = {k: v for k, v in {**SIZES, **OVERRIDES[arch]}.items() if v is not None}
    hf = build_moe(arch, seed=2, vocab_size=vocab, **kw)
    save_model(hf, folder)
    cfg = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["q_proj", "k_proj"],
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    pm = peft.get_peft_model(copy.deepcopy(hf), cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn_like(p))
    pm.save_pretrained(root / f"{arch}-adapter")
    return folder, root / f"{arch}-adapter"


def _read(path):
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
               for t in reader.tensors}
    fields = {name: f.contents() for name, f in reader.fields.items()}
    return tensors, fields


def _expected(merged, cfg: ModelConfig, arch: str) -> dict:
    """llama.cpp's tensors of the merged folder (the hub's per-expert layout) made by hand: each layer's experts
    stacked, the router, the shared expert's gate as a vector."""
    stored = {k: v.astype(np.float32) for k, v in read_safetensors(merged / "model.safetensors").items()}
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCH[arch].upper()), cfg.num_hidden_layers)
    want, block = {}, "block_sparse_moe" if arch == "mixtral" else "mlp"
    projections = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i in range(cfg.num_hidden_layers):
        for proj, exps in zip(projections, ("gate", "up", "down")):
            keys = [f"model.layers.{i}.{block}.experts.{e}.{proj}.weight" for e in range(cfg.moe.num_experts)]
            want[f"blk.{i}.ffn_{exps}_exps.weight"] = np.stack([stored.pop(k) for k in keys])
    for name, w in stored.items():
        if arch == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = rotary_rows(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        want[gname] = w.reshape(-1) if "shared_expert_gate" in name else w
    want.setdefault("output.weight", want["token_embd.weight"])        # tied: written from the embedding
    return want


@pytest.mark.parametrize("arch", list(ARCH))
def test_moe_gguf_reads_back_with_the_merged_experts(tmp_path, arch):
    folder, adapter = _model_and_adapter(tmp_path, arch)
    cfg = ModelConfig.from_folder(folder)
    merged = tmp_path / "merged"
    for dtype, tol in (("f32", 0.0), ("q8_0", 1e-2)):
        out = tmp_path / f"{arch}-{dtype}.gguf"
        assert main(["merge", "--model", str(folder), "--adapter-path", str(adapter), "--out", str(merged),
                     "--overwrite", "--gguf", str(out), "--gguf-type", dtype]) == 0
        got, fields = _read(out)
        types = assert_converter_types(out, dtype)
        want = _expected(merged, cfg, arch)
        assert set(got) == set(want)
        for name, w in want.items():
            assert got[name].shape == w.shape, name
            scale = tol * max(1.0, float(np.abs(w).max())) if w.ndim > 1 else 0.0
            assert np.max(np.abs(got[name] - w)) <= scale, (name, dtype)
        prefix = ARCH[arch]
        assert fields["general.architecture"] == prefix
        assert fields[f"{prefix}.expert_count"] == cfg.moe.num_experts
        assert fields[f"{prefix}.expert_used_count"] == cfg.moe.top_k
        if arch.startswith("qwen"):
            assert fields[f"{prefix}.expert_feed_forward_length"] == cfg.moe.expert_size
        else:       # llama.cpp's llama and olmoe size their experts by feed_forward_length (0 fails its load)
            assert fields[f"{prefix}.feed_forward_length"] == cfg.moe.expert_size
        if arch == "qwen2_moe":
            assert fields[f"{prefix}.expert_shared_feed_forward_length"] == cfg.moe.shared_expert_size
        if dtype == "q8_0":           # the experts' rows (64 wide) are quantised, not kept in f16
            assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.Q8_0


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_transformers_reads_the_moe_gguf_with_the_merged_logits(tmp_path, arch):
    """transformers' GGUF loader reads the file's tensors (its config from the merged folder: transformers maps
    no GGUF key onto moe_intermediate_size) and gives the merged folder's logits: f32's (measured equal), f16's
    within its rounding (measured 0.015 at most on logits up to 5)."""
    import transformers as tf

    folder, adapter = _model_and_adapter(tmp_path, arch)
    merged = tmp_path / "merged"
    kw = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    ids = torch.tensor([[1, 5, 9, 2, 7, 11, 3, 4]])
    for gguf_type, tolerance in (("f32", "logits_f32"), ("f16", "gguf_f16_logits")):
        out = tmp_path / f"{arch}-{gguf_type}.gguf"
        assert main(["merge", "--model", str(folder), "--adapter-path", str(adapter), "--out", str(merged),
                     "--overwrite", "--gguf", str(out), "--gguf-type", gguf_type]) == 0
        config = tf.AutoConfig.from_pretrained(merged)
        hf = tf.AutoModelForCausalLM.from_pretrained(merged, **kw).eval()
        from_gguf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, config=config, **kw).eval()
        with torch.no_grad():
            assert_close(from_gguf(ids).logits.numpy(), hf(ids).logits.numpy(), tolerance, f"{arch} {gguf_type}")


def test_moe_gguf_refusals_write_nothing(tmp_path, capsys):
    """A dense layer among the sparse ones, or a renormalisation llama.cpp's graph does not do: one line, nothing
    written."""
    folder, adapter = _model_and_adapter(tmp_path, "qwen3_moe")
    cases = []
    for name, change in (("dense", dict(mlp_only_layers=[1])), ("plain", dict(norm_topk_prob=False))):
        other = tmp_path / name
        save_model(build_moe("qwen3_moe", vocab_size=build_tokenizer(other),
                             **{**SIZES, **OVERRIDES["qwen3_moe"], **change}), other)
        cases.append(other)
    before = folder_state(tmp_path)
    capsys.readouterr()
    for model, match in ((cases[0], "llama.cpp's qwen3moe has experts in every layer; layers [1] of this model "
                                    "are dense"),
                         (cases[1], "llama.cpp's qwen3moe renormalises the top-k weights; this model's "
                                    "norm_topk_prob is False")):
        code = main(["merge", "--model", str(model), "--adapter-path", str(adapter), "--out", str(tmp_path / "m"),
                     "--gguf", str(tmp_path / "x.gguf")])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and len(err) == 1 and match in err[0], err
    assert folder_state(tmp_path) == before


# llama.cpp's converter run on the merged folder, its tokenizer check passed over: it knows a BPE pre-tokenizer by a
# hash of its output (ours, trained for the tests, is unknown: written as "default", as our exporter writes it), and
# Llama's vocabulary tries sentencepiece first
CONVERTER = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as convert
try:
    from conversion.base import TextModel
except ImportError:                                   # before the converter was split into a package
    TextModel = convert.TextModel
def no_sentencepiece(self, *args, **kwargs):
    raise FileNotFoundError("no tokenizer.model")
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
TextModel._set_vocab_sentencepiece = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert.main()
"""


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"), reason="LLAMA_CPP_DIR (a llama.cpp source tree) not set")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral", "qwen2_moe"])
def test_q8_0_gguf_is_llama_cpps_converters(tmp_path, arch):
    """merge --gguf-type q8_0 writes the tensors llama.cpp's own converter (LLAMA_CPP_DIR/convert_hf_to_gguf.py
    --outtype q8_0) writes from the merged folder, byte for byte and of the same types; besides, a tied model's
    output.weight (the embedding again, which transformers' GGUF reader needs) and Qwen2-MoE's shared expert gate
    as the vector [H] where the converter keeps [H, 1]."""
    folder, adapter = (dense_model(tmp_path, arch)[:2] if arch in ("llama", "qwen3") else
                       _model_and_adapter(tmp_path, arch))
    merged, ours, theirs = tmp_path / "merged", tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    assert main(["merge", "--model", str(folder), "--adapter-path", str(adapter), "--out", str(merged),
                 "--gguf", str(ours), "--gguf-type", "q8_0"]) == 0
    subprocess.run([sys.executable, "-c", CONVERTER, str(Path(os.environ["LLAMA_CPP_DIR"]).resolve()), str(merged),
                    "--outtype", "q8_0", "--outfile", str(theirs)], check=True, capture_output=True)
    got = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    want = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    tied = "output.weight" not in want
    assert set(got) == set(want) | ({"output.weight"} if tied else set())
    if tied:
        want["output.weight"] = want["token_embd.weight"]
    assert gguf.GGMLQuantizationType.Q8_0 in {t.tensor_type for t in got.values()}
    for name, t in want.items():
        shape = [int(d) for d in t.shape]
        if name.endswith("ffn_gate_inp_shexp.weight"):
            shape = shape[:1]
        assert got[name].tensor_type == t.tensor_type and [int(d) for d in got[name].shape] == shape, name
        assert np.asarray(got[name].data).tobytes() == np.asarray(t.data).tobytes(), name
