"""The NumPy reference path against real oracles: transformers for logits and loading, PEFT for LoRA
adapters, torch autograd and float64 finite differences for gradients; and the refusal of bad input."""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import struct
import warnings

import numpy as np
import peft
import pytest
import torch
import transformers as tf
from safetensors.numpy import load_file, save_file

from finetune_helpers import peft_random_b
from tiny_models import ARCHS, build_model, edit_config, hf_config, in_arch, save_model
from tolerances import assert_close
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.models.config import ModelConfig
from wgpu_train.errors import AdapterError, ConfigError, ModelFileError, WgpuTrainError
from wgpu_train.engines.loading import load_model

# PEFT calls a transformers method that warns of its own deprecation; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

VOCAB = 83            # tiny_models.BASE
T = 11                # sequence length: short, and not a multiple of anything
PROMPT = 3            # labels of the first PROMPT tokens are -100
PAD_FROM = 7          # row 1 of the padded batch is padding from here on
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}


# ---- fixtures and helpers --------------------------------------------------------------------

class Case:
    """One architecture: the transformers model and the folder it was saved to (float32)."""

    def __init__(self, arch, hf, folder):
        self.arch, self.hf, self.folder = arch, hf, folder

    def names(self, names):
        """Llama's module names, paths or target regexes as this architecture spells them (tiny_models.in_arch)."""
        return in_arch(self.arch, names)


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory):
    arch = request.param
    hf = build_model(arch, seed=11 + ARCHS.index(arch))
    folder = tmp_path_factory.mktemp(f"model_{arch}")
    save_model(hf, folder)
    return Case(arch, hf, folder)


def batch(kind: str):
    """(ids, attention_mask, labels), each (2, T). 'prompt': no padding; 'padded': row 1 right-padded.

    Both mask a prompt; padding positions get label -100, as Hugging Face collators do.
    """
    rng = np.random.default_rng(5)
    ids = rng.integers(0, VOCAB, size=(2, T))
    mask = np.ones_like(ids)
    if kind == "padded":
        mask[1, PAD_FROM:] = 0
    labels = ids.copy()
    labels[:, :PROMPT] = -100
    labels[mask == 0] = -100
    return ids, mask, labels


def hf_logits(model, ids, mask=None):
    with torch.no_grad():
        kw = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return model(input_ids=torch.tensor(ids), **kw).logits.numpy()


def peft_lora(hf, targets, r=3, alpha=5, use_rslora=False, seed=0):
    """A PEFT LoRA model on a copy of hf, with every lora_B set to random nonzero values."""
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=use_rslora)
    pm = peft.get_peft_model(copy.deepcopy(hf), cfg)
    return peft_random_b(pm, seed)


def peft_lora_tensors(pm) -> dict:
    """PEFT's LoRA tensors by our key spelling (no adapter name)."""
    return {n.replace(".default.", "."): p.detach().numpy().copy()
            for n, p in pm.named_parameters() if "lora_" in n}


def randomise_b(model, seed=0):
    """Give every lora_B of our model random nonzero values (B starts at zero, hiding most bugs)."""
    rng = np.random.default_rng(seed)
    for m in model.engine.lora.values():
        m.b = (0.3 * rng.standard_normal(m.b.shape)).astype(m.b.dtype)


@contextlib.contextmanager
def captured_messages():
    """Every warning and every log record (root, transformers, peft) emitted inside, as strings."""
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(level=logging.DEBUG)
    loggers = [logging.getLogger(), logging.getLogger("transformers"), logging.getLogger("peft")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
        messages.extend(str(w.message) for w in caught)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def key_complaints(messages):
    return [m for m in messages if ("missing" in m.lower() or "unexpected" in m.lower()) and "key" in m.lower()]


def expect_user_error(fn, cls, *words):
    """fn() must raise cls (a WgpuTrainError) with one line that contains every word; returns the message."""
    with pytest.raises(WgpuTrainError) as info:
        fn()
    err = info.value
    assert isinstance(err, cls), f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    assert not isinstance(err, (KeyError, IndexError, ValueError)), type(err).__mro__
    msg = str(err)
    assert msg and "\n" not in msg, f"message is not one line: {msg!r}"
    for w in words:
        assert w in msg, f"{w!r} not in message: {msg}"
    return msg


def copy_folder(src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def safetensors_dtypes(path) -> set:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {meta["dtype"] for meta in header.values()}


# ---- logits and loading ----------------------------------------------------------------------

def test_logits_match_transformers(case):
    model = load_model(case.folder)
    ids, mask, _ = batch("padded")
    assert_close(model.logits(ids), hf_logits(case.hf, ids), "logits_f32", "unpadded")
    ours, theirs = model.logits(ids, mask), hf_logits(case.hf, ids, mask)
    real = mask.astype(bool)
    assert_close(ours[real], theirs[real], "logits_f32", "right-padded, real positions")
    # Padding must not leak into the real tokens: the padded row equals that row run alone, unpadded;
    # unless (longrope, Phi-3) the padded batch's length takes the long factors and the row's the short ones,
    # as in transformers: then the row alone is checked against transformers'
    alone = model.logits(ids[1:, :PAD_FROM])
    if model.config.rope_long(T - 1) == model.config.rope_long(PAD_FROM - 1):
        assert_close(ours[1, :PAD_FROM], alone[0], "logits_f32", "padded row vs the row alone")
    else:
        assert_close(alone, hf_logits(case.hf, ids[1:, :PAD_FROM]), "logits_f32", "the row alone, short factors")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_weights(case, dtype, tmp_path):
    torch_dtype = getattr(torch, dtype)
    half = copy.deepcopy(case.hf).to(torch_dtype)
    save_model(half, tmp_path)
    assert safetensors_dtypes(tmp_path / "model.safetensors") == {"F16" if dtype == "float16" else "BF16"}
    # transformers itself loading the converted file as float32 (casting `half` back would also keep its
    # float16-rounded RoPE buffer, which a real load recomputes).
    oracle = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = load_model(tmp_path)
    # Widening f16 / bf16 to f32 is exact, so the loaded weights equal torch's cast bit for bit.
    state = oracle.state_dict()
    assert set(model.engine.w) <= set(state)
    for name, w in model.engine.w.items():
        assert_close(w, state[name].numpy(), "exact", name)
    assert not np.array_equal(model.engine.w["model.norm.weight"], case.hf.model.norm.weight.detach().numpy()), \
        "the rounded weights should differ from the float32 originals"
    ids, _, _ = batch("prompt")
    assert_close(model.logits(ids), hf_logits(oracle, ids), "logits_f32")


def test_sharded_checkpoint(case, tmp_path):
    case.hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and not (tmp_path / "model.safetensors").exists()
    ids, _, _ = batch("prompt")
    sharded = load_model(tmp_path).logits(ids)
    assert_close(sharded, load_model(case.folder).logits(ids), "exact", "sharded vs single file")
    assert_close(sharded, hf_logits(case.hf, ids), "logits_f32")


def test_weights_are_converted_one_at_a_time(case, tmp_path):
    """load_weights hands out each tensor as float32 only when it is read (from a memory map of bfloat16
    bytes here), a fresh array each time: an engine that stores tensors one by one never holds the whole
    model as float32."""
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.formats.safetensors import LazyWeights, read_safetensors
    from wgpu_train.models.weights import load_weights

    copy.deepcopy(case.hf).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    weights = load_weights(tmp_path, ModelConfig.from_folder(tmp_path))
    assert isinstance(weights, LazyWeights)
    eager = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        eager.update(read_safetensors(f))
    for name in weights:
        a, b = weights[name], weights[name]
        assert a is not b and a.dtype == np.float32 and weights.shape(name) == a.shape
        np.testing.assert_array_equal(a, eager[name])


# ---- configuration ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def raw_configs(tmp_path_factory):
    """config.json as transformers 5 writes it, per architecture."""
    out = {}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(f"cfg_{arch}")
        cfg = hf_config(arch)
        cfg.architectures = [CLASSES[arch]]
        cfg.save_pretrained(d)
        out[arch] = json.loads((d / "config.json").read_text())
    return out


def hub_style(raw: dict) -> dict:
    """The same config spelled as hub checkpoints do: top-level rope_theta and rope_scaling."""
    raw = copy.deepcopy(raw)
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
    return raw


def rotary_inv_freq(raw: dict) -> np.ndarray:
    """transformers' own RoPE inverse frequencies for a config dict (the model's rotary buffer)."""
    cls = getattr(tf, raw["architectures"][0])
    config = cls.config_class.from_dict(raw)
    return cls(config).model.rotary_emb.inv_freq.numpy()


def test_gemma3_rope_per_layer_type(raw_configs):
    """Gemma 3's sliding layers take the local base unscaled, its global ones rope_theta with linear scaling:
    as transformers' rotary buffers, from both spellings (rope_parameters per layer type; the hub's
    rope_theta, rope_local_base_freq and rope_scaling)."""
    raw = raw_configs["gemma3"]
    params = raw["rope_parameters"]
    hub = {k: v for k, v in raw.items() if k != "rope_parameters"}
    hub.update(rope_theta=params["full_attention"]["rope_theta"],
               rope_local_base_freq=params["sliding_attention"]["rope_theta"],
               rope_scaling={k: v for k, v in params["full_attention"].items() if k != "rope_theta"})
    rotary = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig.from_dict(raw)).model.rotary_emb
    for cfg in (ModelConfig.from_dict(raw), ModelConfig.from_dict(hub)):
        assert cfg.local_rope == (True, False) and cfg.layer_windows == (5, 0)
        assert_close(cfg.inv_freq(0), rotary.sliding_attention_inv_freq.numpy(), "inv_freq", "sliding layer")
        assert_close(cfg.inv_freq(1), rotary.full_attention_inv_freq.numpy(), "inv_freq", "global layer")
    assert not np.allclose(cfg.inv_freq(0), cfg.inv_freq(1))


def test_gemma2_hub_spelling(raw_configs):
    """A Gemma 2 config.json as the hub has them (top-level rope_theta, no layer_types, fields left to
    transformers' defaults): the layers alternate sliding / global, one RoPE for all, as transformers reads it."""
    raw = {k: v for k, v in raw_configs["gemma2"].items() if k not in ("rope_parameters", "layer_types", "head_dim",
                                                                      "pad_token_id")}
    raw.update(rope_theta=20000.0, num_hidden_layers=4)
    ours = ModelConfig.from_dict(raw)
    theirs = tf.Gemma2Config.from_dict(raw)
    assert ours.layer_windows == tuple(5 if t == "sliding_attention" else 0 for t in theirs.layer_types)
    assert ours.head_dim == theirs.head_dim == 256 and ours.pad_token_id == theirs.pad_token_id == 0
    assert ours.local_rope == () and ours.attn_softcap == 2.0 and ours.logit_softcap == 3.0
    rotary = tf.Gemma2ForCausalLM(theirs).model.rotary_emb
    assert_close(ours.inv_freq(0), rotary.inv_freq.numpy(), "inv_freq", "gemma2 hub spelling")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_rope_spellings_agree(raw_configs, arch):
    raw = raw_configs[arch]
    assert "rope_parameters" in raw and "rope_theta" not in raw, "transformers 5 should write rope_parameters"
    hub = hub_style(raw)
    ours = ModelConfig.from_dict(raw)
    from_hub = ModelConfig.from_dict(hub)
    assert_close(from_hub.inv_freq(), ours.inv_freq(), "exact", "hub spelling vs rope_parameters")
    assert from_hub.rope_theta == ours.rope_theta
    assert_close(ours.inv_freq(), rotary_inv_freq(raw), "inv_freq", "ours vs transformers")
    assert_close(from_hub.inv_freq(), rotary_inv_freq(hub), "inv_freq", "hub spelling vs transformers")
    if arch == "llama":
        # llama3 scaling really changes the low frequencies (so the comparison above means something),
        # and the older "type" key is read like "rope_type".
        plain = ModelConfig.from_dict({**hub, "rope_scaling": None})
        assert not np.allclose(plain.inv_freq(), ours.inv_freq())
        old = dict(hub["rope_scaling"])
        old["type"] = old.pop("rope_type")
        assert_close(ModelConfig.from_dict({**hub, "rope_scaling": old}).inv_freq(), ours.inv_freq(), "exact")
    elif arch == "phi3":     # partial rotary and longrope read alike from either block, both factor sets
        assert from_hub.rotary_dim == ours.rotary_dim == 6 and from_hub.rope_scale == ours.rope_scale > 1
        assert_close(from_hub.inv_freq(0, True), ours.inv_freq(0, True), "exact", "long factors")
    else:
        assert ours.rope_scaling is None and from_hub.rope_scaling is None


def _yarn(raw, where):
    raw = copy.deepcopy(raw)
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    if where == "rope_parameters":
        raw["rope_parameters"] = {**scaling, "rope_theta": 10000.0}
    else:
        raw = hub_style(raw)
        raw["rope_scaling"] = scaling
    return raw


REFUSED = {
    "yarn_hub": ("llama", lambda raw: _yarn(raw, "rope_scaling"), "rope_scaling"),
    "yarn_rope_parameters": ("llama", lambda raw: _yarn(raw, "rope_parameters"), "rope_parameters"),
    "dynamic_scaling": ("qwen2", lambda raw: {**hub_style(raw), "rope_scaling": {"type": "dynamic", "factor": 2.0}},
                        "rope_scaling"),
    "softcap_not_a_number": ("gemma2", lambda raw: {**raw, "attn_logit_softcapping": "50"}, "attn_logit_softcapping"),
    "softcap_negative": ("gemma2", lambda raw: {**raw, "final_logit_softcapping": -30.0}, "final_logit_softcapping"),
    "gemma_exact_gelu": ("gemma3", lambda raw: {**raw, "hidden_activation": "gelu"}, "hidden_activation"),
    "gemma_query_scalar_zero": ("gemma2", lambda raw: {**raw, "query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    "gemma_pattern_null": ("gemma3", lambda raw: {k: v for k, v in {**raw, "sliding_window_pattern": None}.items()
                                                 if k != "layer_types"}, "sliding_window_pattern"),
    "gemma_bidirectional": ("gemma3", lambda raw: {**raw, "use_bidirectional_attention": True},
                            "use_bidirectional_attention"),
    "unknown_architecture": ("llama", lambda raw: {**raw, "architectures": ["GPT2LMHeadModel"]}, "architectures"),
    "no_architecture": ("llama", lambda raw: {k: v for k, v in raw.items() if k != "architectures"}, "architectures"),
    "sliding_window_not_a_size": ("mistral", lambda raw: {**raw, "sliding_window": "16"}, "sliding_window"),
    "sliding_window_zero": ("mistral", lambda raw: {**raw, "sliding_window": 0}, "sliding_window"),
    "layer_types_mismatch": ("qwen2", lambda raw: {**raw, "use_sliding_window": True, "sliding_window": 16,
                                                   "layer_types": ["sliding_attention"]}, "layer_types"),
    "per_layer_type_rope": ("qwen3", lambda raw: {**raw, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_parameters"),
    "gelu": ("llama", lambda raw: {**raw, "hidden_act": "gelu"}, "hidden_act"),
    "missing_vocab_size": ("qwen3", lambda raw: {k: v for k, v in raw.items() if k != "vocab_size"}, "vocab_size"),
}


@pytest.mark.parametrize("which", list(REFUSED))
def test_unsupported_config_refused(raw_configs, which, tmp_path):
    arch, edit, field = REFUSED[which]
    ModelConfig.from_dict(raw_configs[arch])       # the unedited config is accepted
    raw = edit(raw_configs[arch])
    expect_user_error(lambda: ModelConfig.from_dict(raw), ConfigError, field)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    expect_user_error(lambda: load_model(tmp_path), ConfigError, field, "config.json")


@pytest.mark.parametrize("arch, changes", [
    ("mistral", {"sliding_window": 128}),                                # window >= context: never binds
    ("qwen2", {"use_sliding_window": False, "sliding_window": 16}),      # present but switched off
])
def test_inactive_sliding_window_accepted(raw_configs, arch, changes):
    cfg = ModelConfig.from_dict({**raw_configs[arch], **changes})
    assert cfg.family == arch


# ---- LoRA gradients against PEFT + torch autograd --------------------------------------------

TARGETS = {"qv": ["q_proj", "v_proj"], "all": "all-linear", "mlp": ["gate_proj", "down_proj"]}
EXPECTED_MODULES = {"qv": ("q_proj", "v_proj"),
                    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                    "mlp": ("gate_proj", "down_proj")}


@pytest.mark.parametrize("targets", list(TARGETS))
@pytest.mark.parametrize("rslora, kind", [(False, "padded"), (True, "prompt")])
def test_lora_loss_and_grads_match_peft(case, targets, rslora, kind, tmp_path):
    pm = peft_lora(case.hf, case.names(TARGETS[targets]), use_rslora=rslora, seed=len(targets))
    pm.save_pretrained(tmp_path)
    ids, mask, labels = batch(kind)
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}

    model = load_model(case.folder)
    model.load_adapter(tmp_path)
    assert model.lora_config.target_modules == case.names(EXPECTED_MODULES[targets])
    assert model.lora_config.use_rslora is rslora
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected), sorted(set(grads) ^ set(expected))
    assert len(grads) == 2 * 2 * len(case.names(EXPECTED_MODULES[targets]))
    for name, g in expected.items():
        assert np.abs(g).max() > 1e-3, f"{name}: oracle gradient is ~0, the comparison would be empty"
        assert_close(grads[name], g, "grads_f32", name)


def test_full_finetune_grads_match_torch(case):
    hf = copy.deepcopy(case.hf)
    ids, mask, labels = batch("padded")
    out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n: p.grad.numpy() for n, p in hf.named_parameters()}

    model = load_model(case.folder)
    model.set_full_finetune()
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected), sorted(set(grads) ^ set(expected))
    if hf.config.tie_word_embeddings:
        assert "lm_head.weight" not in grads   # its gradient lives in the embedding's, as in torch
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


# ---- adapters and merging --------------------------------------------------------------------

def test_peft_adapter_loads_here(case, tmp_path):
    pm = peft_lora(case.hf, case.names(["q_proj", "k_proj", "o_proj", "up_proj"]), r=2, alpha=7, use_rslora=True)
    pm.save_pretrained(tmp_path)
    model = load_model(case.folder)
    model.load_adapter(tmp_path)
    theirs = peft_lora_tensors(pm)
    ours = model.lora_state_dict()
    assert set(ours) == set(theirs)
    for k in theirs:
        assert_close(ours[k], theirs[k], "exact", k)
    ids, mask, _ = batch("padded")
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], hf_logits(pm, ids, mask)[real], "logits_f32")
    assert not np.allclose(model.logits(ids), hf_logits(case.hf, ids), atol=1e-2), "the adapter should matter"


def test_our_adapter_loads_in_peft(case, tmp_path):
    model = load_model(case.folder)
    model.add_lora(LoraConfig(r=3, alpha=4, target_modules=case.names(("v_proj", "o_proj", "gate_proj")),
                              use_rslora=True), seed=2)
    randomise_b(model)
    model.save_adapter(tmp_path)
    with captured_messages() as messages:
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(case.hf), tmp_path)
    assert not key_complaints(messages), key_complaints(messages)
    config = pm.peft_config["default"]
    assert (config.r, config.lora_alpha, config.use_rslora) == (3, 4, True)
    assert set(config.target_modules) == set(case.names(("v_proj", "o_proj", "gate_proj")))
    theirs = peft_lora_tensors(pm)
    ours = model.lora_state_dict()
    assert set(theirs) == set(ours)
    for k in ours:
        assert_close(theirs[k], ours[k], "exact", k)
    ids, _, _ = batch("prompt")
    assert_close(model.logits(ids), hf_logits(pm, ids), "logits_f32")
    # PEFT's own loader reports no missing or unexpected LoRA keys either.
    result = pm.load_adapter(tmp_path, adapter_name="again")
    assert not [k for k in result.missing_keys if "lora_" in k] and not result.unexpected_keys


def test_merged_model_loads_in_transformers(case, tmp_path):
    pm = peft_lora(case.hf, "all-linear", r=4, alpha=6)
    pm.save_pretrained(tmp_path / "adapter")
    model = load_model(case.folder)
    model.load_adapter(tmp_path / "adapter")
    model.merge_and_save(tmp_path / "merged")
    with captured_messages() as messages:
        merged = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert not key_complaints(messages), key_complaints(messages)
    assert merged.config.tie_word_embeddings == case.hf.config.tie_word_embeddings
    ids, mask, _ = batch("padded")
    real = mask.astype(bool)
    expected = hf_logits(pm, ids, mask)
    assert_close(hf_logits(merged, ids, mask)[real], expected[real], "merged_logits", "transformers on merged")
    assert_close(load_model(tmp_path / "merged").logits(ids, mask)[real], expected[real], "merged_logits",
                 "ours on merged")


# ---- LoRA init and dropout -------------------------------------------------------------------

def test_lora_init(case):
    cfg = LoraConfig(r=4, alpha=8, target_modules="all-linear")
    model = load_model(case.folder)
    ids, _, _ = batch("prompt")
    before = model.logits(ids)
    model.add_lora(cfg, seed=7)
    state = model.lora_state_dict()
    # Names and shapes are PEFT's for the same configuration.
    pm = peft.get_peft_model(copy.deepcopy(case.hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    theirs = {k: v.shape for k, v in peft.get_peft_model_state_dict(pm).items()}
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(s) for k, s in theirs.items()}
    for k, v in state.items():
        if ".lora_B." in k:
            assert not v.any(), f"{k} should start at zero"
        else:
            bound = 1.0 / np.sqrt(v.shape[1])       # kaiming_uniform(a=sqrt(5)) as PEFT uses
            assert np.abs(v).max() <= bound and np.abs(v).max() > 0.8 * bound, k
            peft_a = peft_lora_tensors(pm)[k]
            assert np.abs(peft_a).max() <= bound * (1 + 1e-6), f"PEFT's {k} exceeds the bound we assume"
    assert_close(model.logits(ids), before, "exact", "B = 0 leaves the model unchanged")
    again = load_model(case.folder)
    again.add_lora(cfg, seed=7)
    for k, v in again.lora_state_dict().items():
        assert_close(v, state[k], "exact", f"{k} with the same seed")
    other = load_model(case.folder)
    other.add_lora(cfg, seed=8)
    a_key = next(k for k in state if ".lora_A." in k)
    assert not np.array_equal(other.lora_state_dict()[a_key], state[a_key]), "a different seed gives a different A"


def test_dropout_reproducible_by_seed(case):
    ids, mask, labels = batch("padded")

    def trained(seed, dropout):
        model = load_model(case.folder)
        model.add_lora(LoraConfig(r=2, alpha=4, dropout=dropout, target_modules="all-linear"), seed=seed)
        # The same A and B in every model, so that only the dropout masks can differ.
        rng = np.random.default_rng(0)
        for m in model.engine.lora.values():
            m.a = (0.2 * rng.standard_normal(m.a.shape)).astype(m.a.dtype)
            m.b = (0.3 * rng.standard_normal(m.b.shape)).astype(m.b.dtype)
        return model

    m1, m2, m3 = trained(1, 0.3), trained(1, 0.3), trained(2, 0.3)
    l1, g1 = m1.loss_and_grads(ids, labels, mask)
    l2, g2 = m2.loss_and_grads(ids, labels, mask)
    l3, _ = m3.loss_and_grads(ids, labels, mask)
    assert l1 == l2 and all(np.array_equal(g1[k], g2[k]) for k in g1), "same seed, same dropout masks"
    assert l3 != l1, "a different seed gives different dropout masks"
    assert m1.loss_and_grads(ids, labels, mask)[0] != l1, "each step draws fresh masks"
    no_drop = trained(1, 0.0).loss_and_grads(ids, labels, mask)[0]
    assert no_drop == trained(2, 0.0).loss_and_grads(ids, labels, mask)[0]
    assert no_drop != l1
    # Inference never drops.
    assert_close(m1.logits(ids, mask), m3.logits(ids, mask), "exact", "logits ignore dropout")


# ---- float64 finite differences of the reference backward ------------------------------------

def _central_difference(model, arr, idx, ids, labels, mask, eps=1e-5):
    old = arr[idx]
    arr[idx] = old + eps
    up = model.loss_and_grads(ids, labels, mask)[0]
    arr[idx] = old - eps
    down = model.loss_and_grads(ids, labels, mask)[0]
    arr[idx] = old
    return (up - down) / (2 * eps)


def _entries(g, rng):
    """The entry with the largest gradient and one random entry."""
    return [np.unravel_index(int(np.argmax(np.abs(g))), g.shape),
            tuple(int(rng.integers(0, s)) for s in g.shape)]


def test_finite_differences_lora_f64(case):
    model = load_model(case.folder, dtype=np.float64)
    model.add_lora(LoraConfig(r=2, alpha=3, target_modules="all-linear"), seed=0)
    randomise_b(model)
    assert model.engine.lora[case.names("model.layers.0.self_attn.q_proj")].a.dtype == np.float64
    ids, mask, labels = batch("padded")
    _, grads = model.loss_and_grads(ids, labels, mask)
    rng = np.random.default_rng(1)
    for path, which in [("model.layers.0.self_attn.q_proj", "a"), ("model.layers.0.self_attn.k_proj", "b"),
                        ("model.layers.1.self_attn.v_proj", "a"), ("model.layers.0.mlp.down_proj", "b"),
                        ("model.layers.1.mlp.gate_proj", "a")]:
        path = case.names(path)
        key = f"base_model.model.{path}.lora_{which.upper()}.weight"
        arr = getattr(model.engine.lora[path], which)
        for idx in _entries(grads[key], rng):
            fd = _central_difference(model, arr, idx, ids, labels, mask)
            assert_close(grads[key][idx], fd, "finite_difference_f64", f"{key}{list(idx)}")


def test_finite_differences_full_f64(case):
    model = load_model(case.folder, dtype=np.float64)
    model.set_full_finetune()
    ids, mask, labels = batch("padded")
    _, grads = model.loss_and_grads(ids, labels, mask)
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
             "model.layers.1.post_attention_layernorm.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.1.mlp.up_proj.weight"]
    names = case.names(names)
    cfg = model.config
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    if cfg.attention_bias:
        names += ["model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias"]
    if cfg.qk_norm:
        names += ["model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"]
    assert set(names) <= set(grads)
    rng = np.random.default_rng(2)
    for name in names:
        g = grads[name]
        idx = _entries(g, rng)[0]
        assert abs(g[idx]) > 1e-4, f"{name}: gradient ~0, the check would be empty"
        fd = _central_difference(model, model.engine.w[name], idx, ids, labels, mask)
        assert_close(g[idx], fd, "finite_difference_f64", f"{name}{list(idx)}")


# ---- bad input -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad_input_base")
    save_model(build_model("llama", seed=3), folder)
    return folder


def test_missing_folder(tmp_path):
    expect_user_error(lambda: load_model(tmp_path / "nope"), ModelFileError, "nope")


def test_missing_config(llama_folder, tmp_path):
    d = copy_folder(llama_folder, tmp_path / "m")
    (d / "config.json").unlink()
    expect_user_error(lambda: load_model(d), ModelFileError, "config.json")


def test_invalid_json_config(llama_folder, tmp_path):
    d = copy_folder(llama_folder, tmp_path / "m")
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 83,')
    expect_user_error(lambda: load_model(d), ModelFileError, "config.json", "JSON")


def test_missing_weights_file(llama_folder, tmp_path):
    d = copy_folder(llama_folder, tmp_path / "m")
    (d / "model.safetensors").unlink()
    expect_user_error(lambda: load_model(d), ModelFileError, "model.safetensors")


@pytest.mark.parametrize("keep", [0.5, 0.999, 5])
def test_truncated_weights(llama_folder, tmp_path, keep):
    d = copy_folder(llama_folder, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:int(len(data) * keep)] if keep < 1 else data[:keep])
    expect_user_error(lambda: load_model(d), ModelFileError, "model.safetensors")


@pytest.mark.parametrize("header", [b"[1, 2]", b'{"x": 5}', b"\xff\xfe{", b'{"x": {"dtype": "F32"}}'])
def test_malformed_safetensors_header(llama_folder, tmp_path, header):
    d = copy_folder(llama_folder, tmp_path / "m")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    expect_user_error(lambda: load_model(d), ModelFileError, "model.safetensors")


def test_missing_shard(llama_folder, tmp_path):
    tf.AutoModelForCausalLM.from_pretrained(llama_folder).save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    (tmp_path / shard[-1]).unlink()
    expect_user_error(lambda: load_model(tmp_path), ModelFileError, shard[-1])


def test_wrong_tensor_shape(llama_folder, tmp_path):
    d = copy_folder(llama_folder, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.1.self_attn.v_proj.weight"
    tensors[name] = tensors[name][:, :-1].copy()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    expect_user_error(lambda: load_model(d), ModelFileError, name, "shape")


def test_config_dims_disagree_with_weights(llama_folder, tmp_path):
    d = copy_folder(llama_folder, tmp_path / "m")
    edit_config(d, intermediate_size=44)
    expect_user_error(lambda: load_model(d), ModelFileError, "mlp", "shape")


def test_missing_tensor(llama_folder, tmp_path):
    d = copy_folder(llama_folder, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.0.post_attention_layernorm.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    expect_user_error(lambda: load_model(d), ModelFileError, "model.layers.0.post_attention_layernorm.weight")


def test_unknown_architecture_folder(llama_folder, tmp_path):
    d = copy_folder(llama_folder, tmp_path / "m")
    edit_config(d, architectures=["BertForMaskedLM"])
    expect_user_error(lambda: load_model(d), ConfigError, "architectures", "BertForMaskedLM")


@pytest.mark.parametrize("what", ["label_minus_1", "label_vocab", "labels_shape", "mask_shape", "token_id",
                                  "all_ignored"])
def test_bad_batch_refused(llama_folder, what):
    model = load_model(llama_folder)
    ids, mask, labels = batch("padded")
    if what == "label_minus_1":
        labels[0, 5] = -1
    elif what == "label_vocab":
        labels[1, 4] = VOCAB
    elif what == "labels_shape":
        labels = labels[:, :-2]
    elif what == "mask_shape":
        mask = mask[:, :-2]
    elif what == "token_id":
        ids[0, 2] = VOCAB
    else:
        labels[:] = -100
    expect_user_error(lambda: model.loss_and_grads(ids, labels, mask), ConfigError)
    if what in ("mask_shape", "token_id"):
        expect_user_error(lambda: model.logits(ids, mask), ConfigError)


@pytest.fixture(scope="module")
def saved_adapter(llama_folder, tmp_path_factory):
    """An r=4 q/v adapter written by this library for llama_folder."""
    d = tmp_path_factory.mktemp("adapter_r4")
    model = load_model(llama_folder)
    model.add_lora(LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")), seed=1)
    model.save_adapter(d)
    return d


def _refused_adapter(llama_folder, adapter, *words):
    model = load_model(llama_folder)
    ids, _, _ = batch("prompt")
    before = model.logits(ids)
    msg = expect_user_error(lambda: model.load_adapter(adapter), AdapterError, *words)
    assert model.lora_config is None and not model.engine.lora, "a refused adapter must leave the model as it was"
    assert_close(model.logits(ids), before, "exact")
    return msg


def test_adapter_rank_edited(llama_folder, saved_adapter, tmp_path):
    d = copy_folder(saved_adapter, tmp_path / "a")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["r"] = 8
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    msg = _refused_adapter(llama_folder, d, "q_proj.lora_A.weight has shape (4, 30), expected (8, 30)")
    assert "more" in msg     # all 8 tensors are wrong: four listed, the rest counted


def test_adapter_targets_edited(llama_folder, saved_adapter, tmp_path):
    d = copy_folder(saved_adapter, tmp_path / "a")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "k_proj", "v_proj"]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    _refused_adapter(llama_folder, d, "missing base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight")


@pytest.mark.parametrize("other", [{"hidden_size": 36}, {"num_hidden_layers": 3}])
def test_adapter_for_another_model_size(llama_folder, other, tmp_path):
    save_model(build_model("llama", seed=4, **other), tmp_path / "other")
    model = load_model(tmp_path / "other")
    model.add_lora(LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")), seed=1)
    model.save_adapter(tmp_path / "a")
    if "hidden_size" in other:
        _refused_adapter(llama_folder, tmp_path / "a", "has shape (4, 36), expected (4, 30)")
    else:
        _refused_adapter(llama_folder, tmp_path / "a", "unexpected base_model.model.model.layers.2.")


def test_adapter_files_missing_or_cut(llama_folder, saved_adapter, tmp_path):
    _refused_adapter(llama_folder, tmp_path / "nowhere", "adapter_config.json")
    d = copy_folder(saved_adapter, tmp_path / "a")
    f = d / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    _refused_adapter(llama_folder, d, "adapter_model.safetensors")
    f.unlink()
    _refused_adapter(llama_folder, d, "adapter_model.safetensors")
    (d / "adapter_config.json").write_text("{not json")
    _refused_adapter(llama_folder, d, "adapter_config.json")


@pytest.mark.parametrize("edit, words", [
    ({"r": None}, ("key 'r' must be a whole number >= 1, got null",)),
    ({"r": "4"}, ("key 'r'", 'got "4"')),
    ({"r": 0}, ("key 'r'", "got 0")),
    ({"lora_alpha": "16"}, ("key 'lora_alpha' must be a number, got \"16\"",)),
    ({"lora_dropout": None}, ("key 'lora_dropout' must be a number, got null",)),
    ({"use_rslora": "yes"}, ("key 'use_rslora' must be true or false",)),
    ({"bias": None}, ("key 'bias' must be a string",)),
    ({"target_modules": None}, ("key 'target_modules' must be a list of module names or a regular expression",)),
    ({"target_modules": ["q_proj", 3]}, ("key 'target_modules'", "got [\"q_proj\", 3]")),
    ({"target_modules": "q_proj("}, ("target_modules 'q_proj(' is not a valid regular expression",)),
    ([], ("must hold a JSON object, got list",)),
])
def test_adapter_config_values_are_checked(llama_folder, saved_adapter, tmp_path, edit, words):
    """A value of the wrong type in adapter_config.json is refused in one line naming the key."""
    d = copy_folder(saved_adapter, tmp_path / "a")
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, **edit} if isinstance(edit, dict) else edit))
    _refused_adapter(llama_folder, d, "adapter_config.json", *words)


def test_peft_regex_and_path_targets_load_here(case, tmp_path):
    """target_modules as PEFT's regular expression (re.fullmatch on module paths) or as full module paths
    selects the same modules here as in PEFT."""
    paths = case.names([f"model.layers.{i}.mlp.up_proj" for i in range(case.hf.config.num_hidden_layers)])
    for name, targets in (("regex", case.names(r".*\.(q_proj|down_proj)")), ("paths", paths)):
        pm = peft_lora(case.hf, targets, r=2, alpha=5)
        pm.save_pretrained(tmp_path / name)
        model = load_model(case.folder)
        model.load_adapter(tmp_path / name)
        assert model.lora_config.target_modules == case.names(("q_proj", "down_proj") if name == "regex" else ("up_proj",))
        ids, _, _ = batch("prompt")
        assert_close(model.logits(ids), hf_logits(pm, ids), "logits_f32", name)


@pytest.mark.parametrize("settings, words", [
    (dict(exclude_modules=["model.layers.1.self_attn.q_proj"]), ("not supported: exclude_modules",)),
    (dict(modules_to_save=["norm"]), ("modules_to_save 'norm' is not supported: only embed_tokens and lm_head",)),
    (dict(lora_bias=True), ("not supported: lora_bias=true",)),
    (dict(use_dora=True, init_lora_weights="pissa"), ("DoRA with LoRA init pissa is not supported",)),
    (dict(bias="lora_only"), ("not supported: bias=\"lora_only\"",)),
    (dict(target_modules=["q_proj", "embed_tokens"]), ("not supported: target_modules", "selects model.embed_tokens")),
    (dict(target_modules=r"model\.layers\.0\.self_attn\.q_proj|model\.layers\.1\.self_attn\.v_proj"),
     ("not supported: target_modules", "selects q_proj in layers 0; v_proj in layers 1", "the same layers")),
])
@pytest.mark.filterwarnings("ignore::UserWarning")   # PEFT warns about the very settings made here on purpose
def test_unsupported_peft_settings_refused(llama_folder, tmp_path, settings, words):
    """Valid PEFT adapters that compute something this library does not are refused by the field's name."""
    hf = tf.AutoModelForCausalLM.from_pretrained(llama_folder)
    cfg = peft.LoraConfig(**{"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], **settings})
    peft.get_peft_model(hf, cfg).save_pretrained(tmp_path)
    _refused_adapter(llama_folder, tmp_path, "adapter_config.json", *words)


@pytest.mark.parametrize("kw, words", [
    (dict(r=0), "rank r must be >= 1"), (dict(dropout=1.0), "dropout must be in [0, 1)"),
    (dict(alpha=0), "alpha must be a finite number > 0"), (dict(alpha=float("inf")), "alpha must be a finite"),
    (dict(target_modules="lm_head"), "not in q_proj"),
])
def test_bad_lora_settings_are_one_line_errors(kw, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace(")", r"\)")) as e:
        LoraConfig(**kw)
    assert "\n" not in str(e.value)
