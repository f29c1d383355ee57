"""Phi-3 / Phi-4 beyond the shared architecture tests (test_reference.py and test_engine.py run the tiny phi3
model too): RoPE's parameters as transformers reads each spelling of them, greedy generation across the
switch from longrope's short to its long factors, LoRA and DoRA on the fused modules against PEFT on the
WebGPU engine, and the refusals."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.errors import ConfigError

from finetune_helpers import peft_random_b
from tiny_models import build_model, save_model
from tolerances import assert_close

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ORIGINAL = 8      # the tiny model's original_max_position_embeddings: longer sequences take the long factors


def _one_line(fn, cls) -> str:
    """fn() raises cls with a message of one line; returns it."""
    with pytest.raises(cls) as info:
        fn()
    msg = str(info.value)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    hf = build_model("phi3", seed=4)
    folder = tmp_path_factory.mktemp("phi3")
    save_model(hf, folder)
    return hf, folder


FACTORS = {"short_factor": [1.0, 1.3, 2.1, 1.1, 4.0], "long_factor": [1.7, 3.9, 11.0, 2.0, 30.0]}
SPELLINGS = {    # config.json fields beyond the sizes (hidden 40 / 4 heads: head_dim 10, 5 rotated pairs)
    "Phi-3-mini-128k (rope_scaling, type longrope)": dict(
        rope_scaling={"type": "longrope", **FACTORS}, original_max_position_embeddings=64,
        max_position_embeddings=8192),
    "Phi-4-mini (partial_rotary_factor)": dict(
        rope_scaling={"type": "longrope", "short_factor": FACTORS["short_factor"][:3],
                      "long_factor": FACTORS["long_factor"][:3]}, partial_rotary_factor=0.6,
        original_max_position_embeddings=64, max_position_embeddings=8192),
    "transformers 5 (rope_parameters)": dict(
        rope_parameters={"rope_type": "longrope", "rope_theta": 5e5, "original_max_position_embeddings": 64,
                         **FACTORS}, original_max_position_embeddings=64, max_position_embeddings=8192),
    "explicit factor and attention_factor": dict(
        rope_scaling={"rope_type": "longrope", "factor": 4.0, "attention_factor": 1.25, **FACTORS},
        original_max_position_embeddings=64, max_position_embeddings=8192),
    "no scaling (Phi-4, Phi-3-mini-4k)": dict(rope_theta=250000.0, max_position_embeddings=4096),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_rope_parameters_match_transformers(spelling):
    """The frequencies of both sets (float32, as transformers computes them), the attention factor and the rotated
    dims equal those of transformers' Phi3RotaryEmbedding for each spelling of the hub's config.json."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    raw = dict(architectures=["Phi3ForCausalLM"], vocab_size=50, hidden_size=40, intermediate_size=24,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, **SPELLINGS[spelling])
    ours = wt.ModelConfig.from_dict(raw)
    theirs = tf.Phi3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    rotary = Phi3RotaryEmbedding(theirs)
    assert_close(ours.inv_freq(0).astype(np.float32), rotary.inv_freq.numpy(), "inv_freq", "short")
    assert ours.rope_scale == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert (ours.rotary_dim or ours.head_dim) == 2 * rotary.inv_freq.shape[0]
    if theirs.rope_parameters.get("rope_type") == "longrope":
        original = theirs.rope_parameters["original_max_position_embeddings"]
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](theirs, None, seq_len=original + 1)
        assert_close(ours.inv_freq(0, long=True).astype(np.float32), long.numpy(), "inv_freq", "long")
        assert not ours.rope_long(original - 1) and ours.rope_long(original)
    else:
        assert ours.rope_scale == 1.0 and not ours.rope_long(10 ** 6)


def test_old_longrope_names_read_as_longrope():
    """Phi-3's first releases named longrope "su" (and "yarn"); transformers' Phi3Config renames them, as we do."""
    raw = dict(architectures=["Phi3ForCausalLM"], vocab_size=50, hidden_size=40, intermediate_size=24,
               num_hidden_layers=1, num_attention_heads=4, **SPELLINGS["Phi-3-mini-128k (rope_scaling, type longrope)"])
    want = wt.ModelConfig.from_dict(raw)
    for old in ("su", "yarn"):
        got = wt.ModelConfig.from_dict({**raw, "rope_scaling": {**raw["rope_scaling"], "type": old}})
        assert got.rope_scale == want.rope_scale and np.array_equal(got.inv_freq(0, True), want.inv_freq(0, True))


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
@pytest.mark.parametrize("prompt", [5, 11])
def test_greedy_generation_across_the_switch_matches_transformers(phi, backend, prompt, rt):
    """transformers' Phi-3 generation recomputes its cache with the long factors when the sequence first passes
    original_max_position_embeddings; ours does too (generate._advance): the same greedy tokens from a short
    prompt that crosses over while generating, and from a prompt that starts past it; with a LoRA on the
    fused modules."""
    hf, folder = phi
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=3, lora_alpha=6, target_modules=["qkv_proj", "gate_up_proj"], lora_dropout=0.0)), seed=1)
    ids = np.random.default_rng(prompt).integers(4, 83, prompt)
    with torch.no_grad():
        want = pm.generate(torch.tensor(ids[None]), max_new_tokens=9, do_sample=False, min_new_tokens=9,
                           pad_token_id=3)[0, prompt:].tolist()
    model = wt.load_model(folder, backend=backend, **({"device": str(rt.info.index)} if backend == "wgpu" else {}))
    adapter = folder.parent / f"phi3_adapter_{prompt}_{backend}"
    pm.save_pretrained(adapter)
    model.load_adapter(adapter)
    assert model.generate(ids, max_new_tokens=9) == want
    # a batch of two rows that cross the switch at different steps gives each row its own tokens
    other = np.random.default_rng(99).integers(4, 83, 3)
    rows = model.generate_batch([ids, other], max_new_tokens=9)
    assert rows[0] == want and rows[1] == model.generate(other, max_new_tokens=9)


@pytest.mark.parametrize("length", [ORIGINAL, ORIGINAL + 5])     # longrope's short factors, then its long ones
def test_lora_and_dora_on_fused_modules_match_peft(phi, rt, tmp_path, length):
    """PEFT's LoRA and DoRA on qkv_proj / gate_up_proj: loss and every gradient (A, B, magnitude) on both engines
    equal PEFT's autograd, over a padded batch within the original context (the short factors: fine-tuning's
    usual case) and past it (the long ones)."""
    hf, folder = phi
    ids = np.random.default_rng(2).integers(4, 83, (2, length))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    labels = np.where(mask == 1, ids, -100)
    labels[:, :2] = -100
    for dora in (False, True):
        pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
            r=2, lora_alpha=5, target_modules=["qkv_proj", "o_proj", "gate_up_proj"], lora_dropout=0.0,
            use_dora=dora)), seed=3)
        out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
        out.loss.backward()
        expected = {n.replace(".default", "").replace("vector.weight", "vector"): p.grad.numpy()
                    for n, p in pm.named_parameters() if p.requires_grad}      # our magnitude key: PEFT's file's
        pm.save_pretrained(tmp_path / str(dora))
        for backend, loss_tol, grad_tol in (("numpy", "loss_f32", "grads_f32"), ("wgpu", "gpu_loss", "gpu_grads")):
            model = wt.load_model(folder, backend=backend,
                                  **({"device": str(rt.info.index)} if backend == "wgpu" else {}))
            model.load_adapter(tmp_path / str(dora))
            loss, grads = model.loss_and_grads(ids, labels, mask)
            assert_close(np.float64(loss), out.loss.item(), loss_tol, f"{backend} dora={dora}")
            assert set(grads) == set(expected), sorted(set(grads) ^ set(expected))
            for name, g in expected.items():
                assert_close(grads[name], g, grad_tol, f"{backend} {name}")


def test_targets_are_named_as_phi_names_them(phi, tmp_path):
    """Llama's split names on a fused model get one line naming its modules; all-linear takes the fused ones, and
    an adapter saved here lists them as PEFT does."""
    _, folder = phi
    model = wt.load_model(folder, backend="numpy")
    for targets in ("q_proj,v_proj", "qkv_proj,gate_proj"):      # a name the model lacks, beside others or not
        msg = _one_line(lambda: model.add_lora(wt.LoraConfig(target_modules=targets)), ConfigError)
        assert "attention layers: qkv_proj, o_proj; MLPs: gate_up_proj, down_proj" in msg, msg
    llama = wt.ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=50, hidden_size=40,
                                          intermediate_size=24, num_hidden_layers=1, num_attention_heads=4))
    assert "gate_up_proj: LlamaForCausalLM's linear modules are" in _one_line(
        lambda: wt.LoraConfig(target_modules="q_proj,gate_up_proj").modules(llama), ConfigError)
    model.add_lora(wt.LoraConfig(r=2, target_modules="all-linear"))
    assert model.lora_config.target_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    model.save_adapter(tmp_path / "a")
    saved = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert saved["target_modules"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.mark.parametrize("changes, words", [
    ({"partial_rotary_factor": 0.5, "architectures": ["LlamaForCausalLM"]}, ("partial_rotary_factor", "llama")),
    ({"partial_rotary_factor": 0.55}, ("partial_rotary_factor", "even number")),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                          "long_factor": [1.0, 2.0, 3.0], "original_max_position_embeddings": 8}},
     ("short_factor", "a list of 5 positive numbers")),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 5,
                          "long_factor": [1.0] * 5}, "original_max_position_embeddings": None},
     ("original_max_position_embeddings",)),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 5,
                          "long_factor": [1.0] * 5, "factor": "4"}}, ("'factor' must be a positive number",)),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
      "architectures": ["LlamaForCausalLM"]}, ("'yarn'", "llama supports 'llama3' and 'linear'")),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 5,
                          "long_factor": [1.0] * 5}, "architectures": ["LlamaForCausalLM"]}, ("'longrope'",)),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, ("phi3 supports 'longrope'",)),
])
def test_bad_rope_configs_refused(phi, tmp_path, changes, words):
    """One line naming the field: partial rotary outside Phi-3, an odd rotated width, longrope factor lists of
    the wrong length or a factor that is not a number, yarn (Phi-3's old 'yarn' name of longrope aside),
    longrope outside Phi-3 and other scalings on it (as transformers' configs allow them)."""
    _, folder = phi
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    raw = json.loads((bad / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.update(dict(hidden_size=30, num_attention_heads=3, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    raw.update(changes)
    (bad / "config.json").write_text(json.dumps(raw))
    msg = _one_line(lambda: wt.ModelConfig.from_folder(bad), ConfigError)
    for w in words:
        assert w in msg, msg


def test_gguf_export_refused(phi, tmp_path):
    _, folder = phi
    from wgpu_train.models.gguf_export import check

    msg = _one_line(lambda: check(wt.ModelConfig.from_folder(folder), "f32"), ConfigError)
    assert "Phi3ForCausalLM is not exported" in msg


def test_window_bias_and_defaults_as_transformers_reads_them(phi):
    """Phi-3's sliding_window applies to every layer (transformers' sliding-window mask, checked on logits by the
    shared tests); its attention_bias field is not read (Phi-3's projections have none); fields config.json
    leaves out take Phi3Config's defaults."""
    hf, folder = phi
    raw = json.loads((folder / "config.json").read_text())
    cfg = wt.ModelConfig.from_dict({**raw, "attention_bias": True})
    assert cfg.layer_windows == (9, 9) == (hf.config.sliding_window,) * 2 and not cfg.attention_bias
    assert not wt.ModelConfig.from_dict({**raw, "sliding_window": None}).layer_windows
    bare = {k: v for k, v in raw.items() if k not in ("rms_norm_eps", "pad_token_id", "max_position_embeddings",
                                                      "vocab_size")}
    theirs = tf.Phi3Config(**{k: v for k, v in bare.items() if k != "architectures"})
    ours = wt.ModelConfig.from_dict({**bare, "vocab_size": 40000})
    assert (ours.rms_norm_eps, ours.pad_token_id, ours.max_position_embeddings) == (
        theirs.rms_norm_eps, theirs.pad_token_id, theirs.max_position_embeddings) == (1e-5, 32000, 4096)


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_padding_and_an_explicit_factor_set(phi, rt, backend):
    """Within the original context, a padded row's logits equal the row's alone (padding leaks nothing);
    forward_rows(long_rope=True) over a short prompt gives the long factors' logits, those of that prompt's
    positions inside a longer sequence."""
    _, folder = phi
    model = wt.load_model(folder, backend=backend, **({"device": str(rt.info.index)} if backend == "wgpu" else {}))
    tol = "logits_f32" if backend == "numpy" else "gpu_logits"
    ids = np.random.default_rng(5).integers(4, 83, (2, ORIGINAL))
    mask = np.ones_like(ids)
    mask[1, 5:] = 0
    assert_close(model.logits(ids, mask)[1, :5], model.logits(ids[1:, :5])[0], tol, "padded row vs alone")
    seq = np.random.default_rng(6).integers(4, 83, ORIGINAL + 4)
    long = model.logits(seq[None])[0]                                     # (12, V): the long factors
    engine = model.engine
    kv = engine.new_kv_cache(1, 16)
    try:
        forced = engine.forward_rows(seq[:5], np.zeros(5, np.int64), np.arange(5), kv, np.arange(5), long_rope=True)
        default = engine.forward_rows(seq[:5], np.zeros(5, np.int64), np.arange(5), kv, np.arange(5))
    finally:
        engine.free_kv_cache(kv)
    assert_close(forced, long[:5], tol, "forced long factors")
    assert_close(default, model.logits(seq[None, :5])[0], tol, "the call's own (short) factors")
    assert np.abs(forced - default).max() > 1e-3
