"""merge --gguf of the hybrid families: every tensor the gguf package reads back equals what llama.cpp's converter's
rules (written out here from its convert_hf_to_gguf.py: LFM2's squeezed shortconv, Qwen3.5's tiled value heads,
Qwen3-Next's split in_proj_qkvz, ssm_a = -exp(A_log), 1 + the zero-centred norms, SmolLM3's permuted q / k, LFM2-MoE's
stacked experts and exp_probs_b) give from
the merged folder, with their metadata; transformers' GGUF loader (which reads lfm2) gives the merged LFM2's logits;
what llama.cpp's graphs cannot run is one line before anything is written."""
from __future__ import annotations

import numpy as np
import pytest

from finetune_helpers import build_tokenizer, folder_state
from test_gguf import assert_converter_types
from test_merge_hybrid import CASES, QWEN3_5, _randomise, build_hybrid, peft_merged
from tolerances import assert_close
from wgpu_train.cli.main import main
from wgpu_train.formats.safetensors import read_safetensors
from wgpu_train.models.gguf_export import rotary_rows

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ARCH = {"lfm2": "lfm2", "smollm3": "smollm3", "qwen3_5": "qwen35", "qwen3_next": "qwen3next",
        "qwen3_5_moe": "qwen35moe"}
# llama.cpp's Gated DeltaNet takes value heads as wide as key heads (test_qwen3_5's are 5 and 6)
DELTANET_DIMS = dict(linear_value_head_dim=6)
# Qwen3-Next as llama.cpp runs it: routed experts and a shared expert in every layer
NEXT_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=11, shared_expert_intermediate_size=9,
                mlp_only_layers=[], decoder_sparse_step=1, norm_topk_prob=True)


def _model(root, kind, **changes):
    """A tiny merged-ready model of `kind` with a tokenizer, and a PEFT adapter on both its layer kinds."""
    import transformers as tf

    vocab = build_tokenizer(root / "model")
    cls, kw, targets = CASES["qwen3_5" if kind == "qwen3_5_moe" else kind]
    kw = {**kw, "vocab_size": vocab, **(DELTANET_DIMS if "linear_num_key_heads" in kw else {}), **changes}
    if kind == "qwen3_next":
        kw.update(NEXT_MOE)
    if kind == "qwen3_5_moe":
        cls, kw = "Qwen3_5MoeTextConfig", {k: v for k, v in kw.items() if k != "intermediate_size"}
        kw.update({k: v for k, v in NEXT_MOE.items() if k not in ("mlp_only_layers", "decoder_sparse_step",
                                                                     "norm_topk_prob")})
    torch.manual_seed(4)
    hf = _randomise(tf.AutoModelForCausalLM.from_config(getattr(tf, cls)(**kw), dtype=torch.float32,
                                                        attn_implementation="eager"))
    if kind in ("qwen3_next", "qwen3_5_moe"):
        targets = ["in_proj_qkvz", "in_proj_ba", "q_proj"] if kind == "qwen3_next" else ["in_proj_qkv", "q_proj"]
    model, adapter, _ = peft_merged(hf, targets, root)
    return model, adapter, hf.config


def _read(path):
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
               for t in reader.tensors}
    return tensors, {name: f.contents() for name, f in reader.fields.items()}


def _tiled(w, key_heads, per_key, dim, axis=0):
    """Value heads grouped by key head -> tiled, by an explicit permutation: new head r * Hk + g is old g * R + r."""
    order = [g * per_key + r for r in range(per_key) for g in range(key_heads)]
    rows = [h * dim + d for h in order for d in range(dim)]
    return np.take(w, rows, axis=axis)


def _expected(merged, hf_cfg, kind):
    """llama.cpp's tensors of the merged folder by the converter's rules."""
    arch = ARCH[kind]
    stored = {k.replace("model.language_model.", "model."): v.astype(np.float32)       # a multimodal class's text
              for k, v in read_safetensors(merged / "model.safetensors").items() if not k.startswith("model.visual.")}
    layers = hf_cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), layers)
    want = {}
    if kind in ("qwen3_next", "qwen3_5_moe"):      # the experts stacked, as for Qwen2-MoE
        for i in range(layers):
            fused = stored.pop(f"model.layers.{i}.mlp.experts.gate_up_proj", None)
            if fused is not None:                   # transformers 5's fused layout, gate rows first
                down = stored.pop(f"model.layers.{i}.mlp.experts.down_proj")
                half = fused.shape[1] // 2
                want.update({f"blk.{i}.ffn_gate_exps.weight": fused[:, :half],
                             f"blk.{i}.ffn_up_exps.weight": fused[:, half:], f"blk.{i}.ffn_down_exps.weight": down})
                continue
            for proj in ("gate", "up", "down"):
                keys = [f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight" for e in range(hf_cfg.num_experts)]
                want[f"blk.{i}.ffn_{proj}_exps.weight"] = np.stack([stored.pop(k) for k in keys])
    c = hf_cfg
    for name, w in stored.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if kind == "smollm3" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = rotary_rows(w, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        if kind == "lfm2" and name.endswith("conv.conv.weight"):
            w = w[:, 0, :]
        if kind in ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
            hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                              c.linear_value_head_dim)
            r, keys = hv // hk, 2 * hk * dk
            if kind != "qwen3_next" and ".linear_attn." in name:
                if "in_proj_qkv" in name or "conv1d" in name:
                    w = np.concatenate([w[:keys], _tiled(w[keys:], hk, r, dv)])
                elif "in_proj_z" in name:
                    w = _tiled(w, hk, r, dv)
                elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                    w = _tiled(w, hk, r, 1)
                elif "out_proj" in name:
                    w = _tiled(w, hk, r, dv, axis=1)
            if name.endswith("A_log"):
                w = -np.exp(w)
            elif name.endswith("conv1d.weight"):
                w = w[:, 0, :] if w.ndim == 3 else w
            elif name.endswith("dt_bias"):
                name = name.replace("dt_bias", "dt_proj.bias")
            elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                w = w + 1
            if name.endswith("in_proj_qkvz.weight"):
                groups = w.reshape(hk, 2 * dk + 2 * r * dv, -1)
                q, k = groups[:, :dk], groups[:, dk:2 * dk]
                v, z = groups[:, 2 * dk:2 * dk + r * dv], groups[:, 2 * dk + r * dv:]
                flat = [p.reshape(-1, w.shape[-1]) for p in (q, k, v)]
                want[f"blk.{layer}.attn_qkv.weight"] = np.concatenate(flat)
                want[f"blk.{layer}.attn_gate.weight"] = z.reshape(-1, w.shape[-1])
                continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        want[gname] = w.reshape(-1) if "shared_expert_gate" in name else w
    want.setdefault("output.weight", want["token_embd.weight"])
    return want


@pytest.mark.parametrize("kind", list(ARCH))
def test_hybrid_gguf_reads_back_as_llama_cpps_converter_writes_it(tmp_path, kind):
    model, adapter, hf_cfg = _model(tmp_path, kind)
    merged, arch = tmp_path / "merged", ARCH[kind]
    template = "{% for m in messages[:] %}{{ m['content'] }}{% endfor %}"      # SmolLM3's slice, which the
    (model / "chat_template.jinja").write_text(template, encoding="utf-8")     # converter drops for llama.cpp
    for dtype in ("f32", "q8_0"):
        out = tmp_path / f"{kind}-{dtype}.gguf"
        assert main(["merge", "--model", str(model), "--adapter-path", str(adapter), "--out", str(merged),
                     "--overwrite", "--gguf", str(out), "--gguf-type", dtype]) == 0
        got, fields = _read(out)
        assert_converter_types(out, dtype)         # the convolutions and routers kept f32, as the converter does
        want = _expected(merged, hf_cfg, kind)
        assert set(got) == set(want)
        for name, w in want.items():
            assert got[name].shape == w.shape, name
            tol = 0.0 if dtype == "f32" or w.ndim == 1 else 1e-2 * max(1.0, float(np.abs(w).max()))
            assert np.max(np.abs(got[name] - w)) <= tol, (name, dtype)
        assert fields["general.architecture"] == arch
        assert fields["tokenizer.chat_template"] == (template.replace("[:]", "") if kind == "smollm3" else template)
        assert fields[f"{arch}.block_count"] == hf_cfg.num_hidden_layers
        if kind == "lfm2":
            kv = [0 if t == "conv" else hf_cfg.num_key_value_heads for t in hf_cfg.layer_types]
            assert list(fields["lfm2.attention.head_count_kv"]) == kv
            assert fields["lfm2.shortconv.l_cache"] == hf_cfg.conv_L_cache
            assert fields["lfm2.feed_forward_length"] == 56
        if kind in ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
            assert fields[f"{arch}.ssm.conv_kernel"] == hf_cfg.linear_conv_kernel_dim
            assert fields[f"{arch}.ssm.state_size"] == hf_cfg.linear_key_head_dim
            assert fields[f"{arch}.ssm.group_count"] == hf_cfg.linear_num_key_heads
            assert fields[f"{arch}.ssm.time_step_rank"] == hf_cfg.linear_num_value_heads
            assert fields[f"{arch}.ssm.inner_size"] == hf_cfg.linear_num_value_heads * hf_cfg.linear_value_head_dim
            assert fields[f"{arch}.full_attention_interval"] == 2
            assert fields[f"{arch}.rope.dimension_count"] == 4        # partial_rotary_factor 0.5 of head_dim 8
        if kind in ("qwen3_5", "qwen3_5_moe"):
            assert list(fields[f"{arch}.rope.dimension_sections"]) == [1, 1, 0, 0]      # all 2 rotated pairs
        if kind in ("qwen3_next", "qwen3_5_moe"):
            assert fields[f"{arch}.expert_count"] == 4 and fields[f"{arch}.expert_used_count"] == 2
            assert fields[f"{arch}.expert_feed_forward_length"] == 11
            assert fields[f"{arch}.expert_shared_feed_forward_length"] == 9


def test_the_multimodal_qwen3_5_exports_its_language_model(tmp_path):
    """Qwen3_5ForConditionalGeneration: the GGUF holds its language model as qwen35 (llama.cpp's converter writes the
    vision tower to a separate mmproj file, which this writer does not), the vision tensors stay in the folder."""
    import transformers as tf

    vocab = build_tokenizer(tmp_path / "model")
    torch.manual_seed(6)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=30)
    text = {**QWEN3_5, "vocab_size": vocab, **DELTANET_DIMS}
    hf = _randomise(tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision)))
    regex = r"model\.language_model\.layers\.\d+\.(?:linear_attn\.in_proj_qkv|self_attn\.q_proj)"
    model, adapter, _ = peft_merged(hf, regex, tmp_path)
    merged, out = tmp_path / "merged", tmp_path / "mm.gguf"
    assert main(["merge", "--model", str(model), "--adapter-path", str(adapter), "--out", str(merged),
                 "--gguf", str(out), "--gguf-type", "f32"]) == 0
    got, fields = _read(out)
    want = _expected(merged, hf.config.text_config, "qwen3_5")
    assert fields["general.architecture"] == "qwen35" and set(got) == set(want)
    for name, w in want.items():
        assert np.array_equal(got[name], w), name
    assert any(k.startswith("model.visual.") for k in read_safetensors(merged / "model.safetensors"))


def test_transformers_reads_the_lfm2_gguf_with_the_merged_logits(tmp_path):
    """transformers' GGUF loader (its lfm2 reader: per-layer KV heads, the conv weight unsqueezed) gives the merged
    folder's logits: from the f32 file, and from the f16 one within its rounding."""
    import transformers as tf

    model, adapter, _ = _model(tmp_path, "lfm2")
    merged = tmp_path / "merged"
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    ids = torch.tensor([[1, 5, 9, 2, 7, 11, 3, 4, 30, 8]])
    for gguf_type, tolerance in (("f32", "logits_f32"), ("f16", "gguf_f16_logits")):
        out = tmp_path / f"lfm2-{gguf_type}.gguf"
        assert main(["merge", "--model", str(model), "--adapter-path", str(adapter), "--out", str(merged),
                     "--overwrite", "--gguf", str(out), "--gguf-type", gguf_type]) == 0
        hf = tf.AutoModelForCausalLM.from_pretrained(merged, **kw).eval()
        from_gguf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, **kw).eval()
        with torch.no_grad():
            assert_close(from_gguf(ids).logits.numpy(), hf(ids).logits.numpy(), tolerance, f"lfm2 {gguf_type}")


@pytest.mark.parametrize("kind, changes, match", [
    ("smollm3", dict(no_rope_layers=[1, 0, 1, 1, 1]), "llama.cpp's smollm3 leaves RoPE out of every fourth layer; "
                                                      "this model's no_rope_layers are [1, 0, 1, 1, 1]"),
    ("qwen3_5", dict(layer_types=["linear_attention", "full_attention", "full_attention"]),
     "are not such a pattern"),
    ("qwen3_5", dict(linear_value_head_dim=5), "llama.cpp's qwen35 takes the linear attention's value heads as wide "
                                               "as its key heads; this model's are 5 and 6"),
])
def test_hybrid_gguf_refusals_write_nothing(tmp_path, capsys, kind, changes, match):
    model, adapter, _ = _model(tmp_path, kind, **changes)
    before = folder_state(tmp_path)
    capsys.readouterr()
    code = main(["merge", "--model", str(model), "--adapter-path", str(adapter), "--out", str(tmp_path / "m"),
                 "--gguf", str(tmp_path / "x.gguf")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and match in err[0], err
    assert folder_state(tmp_path) == before


def test_dense_qwen3_next_is_refused(tmp_path, capsys):
    """llama.cpp's qwen3next graph has experts in every layer; a Qwen3-Next without them is one line."""
    model, adapter, _ = peft_merged(build_hybrid("qwen3_next"), ["q_proj"], tmp_path)
    build_tokenizer(model)
    code = main(["merge", "--model", str(model), "--adapter-path", str(adapter), "--out", str(tmp_path / "m"),
                 "--gguf", str(tmp_path / "x.gguf")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and "llama.cpp's qwen3next has routed experts and a shared expert in every layer" in err[-1]
    assert not (tmp_path / "m").exists()


def lfm2_moe_model(root, **changes):
    """A tiny LFM2-MoE (test_lfm2_moe's: layer 0 dense, 1-2 sparse, a random expert bias) with a tokenizer, and a
    PEFT adapter on both layer kinds, the dense MLP and every expert; routed_scaling_factor 1, as llama.cpp runs it."""
    from test_lfm2_moe import EXPERTS, TARGETS, build

    vocab = build_tokenizer(root / "model")
    hf = build(**{"vocab_size": vocab, "routed_scaling_factor": 1.0, **changes})
    model, adapter, _ = peft_merged(hf, TARGETS, root, target_parameters=EXPERTS)
    return model, adapter, hf.config


def test_lfm2_moe_gguf_reads_back_as_llama_cpps_converter_writes_it(tmp_path):
    """lfm2moe: the converter's LFM2 rules, each sparse layer's experts stacked from the hub's w1 / w3 / w2, the
    router as ffn_gate_inp, expert_bias as exp_probs_b.bias, and leading_dense_block_count / expert_gating_func
    (sigmoid); a routed_scaling_factor other than 1 (llama.cpp's lfm2moe reads none) is one line."""
    model, adapter, c = lfm2_moe_model(tmp_path)
    merged, out = tmp_path / "merged", tmp_path / "lfm2moe.gguf"
    assert main(["merge", "--model", str(model), "--adapter-path", str(adapter), "--out", str(merged),
                 "--gguf", str(out), "--gguf-type", "f32"]) == 0
    got, fields = _read(out)
    stored = {k: v.astype(np.float32) for k, v in read_safetensors(merged / "model.safetensors").items()}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2MOE, c.num_hidden_layers)
    want = {"output.weight": stored.pop("lm_head.weight")}
    for i in (1, 2):
        for proj, exps in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            keys = [f"model.layers.{i}.feed_forward.experts.{e}.{proj}.weight" for e in range(c.num_experts)]
            want[f"blk.{i}.ffn_{exps}_exps.weight"] = np.stack([stored.pop(k) for k in keys])
        want[f"blk.{i}.exp_probs_b.bias"] = stored.pop(f"model.layers.{i}.feed_forward.expert_bias")
    for name, w in stored.items():
        want[names.get_name(name, try_suffixes=(".weight",))] = w[:, 0, :] if name.endswith("conv.conv.weight") else w
    assert set(got) == set(want)
    for name, w in want.items():
        assert np.array_equal(got[name], w), name
    assert fields["general.architecture"] == "lfm2moe"
    assert fields["lfm2moe.leading_dense_block_count"] == 1 and fields["lfm2moe.expert_gating_func"] == 2
    assert fields["lfm2moe.expert_count"] == 5 and fields["lfm2moe.expert_used_count"] == 2
    assert fields["lfm2moe.expert_feed_forward_length"] == 23 and fields["lfm2moe.feed_forward_length"] == 45
    assert list(fields["lfm2moe.attention.head_count_kv"]) == [0, 1, 0]


def test_lfm2_moe_with_a_routed_scale_is_refused(tmp_path, capsys):
    model, adapter, _ = lfm2_moe_model(tmp_path, routed_scaling_factor=1.7)
    code = main(["merge", "--model", str(model), "--adapter-path", str(adapter), "--out", str(tmp_path / "m"),
                 "--gguf", str(tmp_path / "x.gguf")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and err[-1] == ("error: --gguf: llama.cpp's lfm2moe does not scale the experts' weights; this "
                                     "model's routed_scaling_factor is 1.7"), err
    assert not (tmp_path / "m").exists()
