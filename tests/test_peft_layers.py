"""PEFT's per-layer choices against PEFT: layers_to_transform / layers_pattern, rank_pattern / alpha_pattern and
partial-layer target regexes select the same modules with the same ranks and scales, adapters round-trip both
ways, training works on both engines (the WebGPU engine's fused q/k/v and gate/up A GEMMs with per-layer
ranks), and the memory estimate and trainable count follow the per-module ranks."""
from __future__ import annotations

import copy
import json

import numpy as np
import peft
import pytest
import torch

import wgpu_train as wt
from conftest import require_adapter
from finetune_helpers import padded_batch, peft_random_b
from tiny_models import build_model, save_model
from tolerances import assert_close
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.errors import AdapterError, ConfigError
from wgpu_train.engines.webgpu.memory import estimate_memory
from wgpu_train.engines.loading import load_model
from wgpu_train.engines.shared.labels import shift_labels
from wgpu_train.engines.webgpu.memory import count_trainable

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

LAYERS = 3
# q/k/v with per-layer ranks (a fused group whose width differs by layer), o_proj left out, down_proj (no
# group) with per-layer ranks and its own alpha, on layers 0 and 2 only
LAYOUT = dict(r=3, target_modules=["q_proj", "k_proj", "v_proj", "up_proj", "gate_proj", "down_proj"],
              layers_to_transform=[0, 2], layers_pattern="layers",
              rank_pattern={r"layers\.2\.self_attn\.k_proj": 5, "v_proj": 2, "gate_proj": 4,
                            r"layers\.0\.mlp\.down_proj": 6},
              alpha_pattern={"down_proj": 11, r"model\.layers\.0\.self_attn\.q_proj": 2})


def ours(**changes) -> LoraConfig:
    kw = {**LAYOUT, **changes}
    return LoraConfig(r=kw["r"], alpha=kw.get("lora_alpha", 7), target_modules=tuple(kw["target_modules"]),
                      layers_to_transform=kw["layers_to_transform"], layers_pattern=kw["layers_pattern"],
                      rank_pattern=kw["rank_pattern"], alpha_pattern=kw["alpha_pattern"])


def peft_model(hf, seed=0, **changes):
    """A PEFT model with LAYOUT (and changes), every lora_B random (B = 0 would hide most bugs)."""
    cfg = peft.LoraConfig(**{"lora_alpha": 7, "lora_dropout": 0.0, **LAYOUT, **changes})
    pm = peft.get_peft_model(copy.deepcopy(hf), cfg)
    return peft_random_b(pm, seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = build_model("llama", seed=21, num_hidden_layers=LAYERS)
    folder = tmp_path_factory.mktemp("llama3layers")
    save_model(hf, folder)
    return hf, folder


def batch():
    return padded_batch(3, 9, 6, 2)


def peft_modules(pm) -> dict:
    """{module path: (r, scale)} of a PEFT model's LoRA layers."""
    out = {}
    for name, module in pm.base_model.model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            out[name] = (module.r["default"], module.scaling["default"])
    return out


def test_selection_ranks_and_scales_match_peft(tiny):
    hf, folder = tiny
    model_cfg = wt.ModelConfig.from_folder(folder)
    for changes in ({}, {"layers_to_transform": 1, "layers_pattern": None}, {"layers_to_transform": [],
                                                                                "layers_pattern": None}):
        mine = ours(**changes).modules(model_cfg)
        theirs = peft_modules(peft_model(hf, **changes))
        assert list(mine) == sorted(theirs, key=list(mine).index) and set(mine) == set(theirs), changes
        for path, (r, alpha) in mine.items():
            assert r == theirs[path][0], path
            assert_close(np.float64(alpha / r), np.float64(theirs[path][1]), "exact", path)
    assert ours().modules(model_cfg)["model.layers.2.self_attn.k_proj"] == (5, 7)
    assert ours().modules(model_cfg)["model.layers.0.self_attn.q_proj"] == (3, 2)


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_peft_layout_adapter_loads_here(tiny, tmp_path, backend):
    """A PEFT adapter with layers and patterns: the same tensors, logits, loss and LoRA gradients here."""
    if backend == "wgpu":
        require_adapter()
    hf, folder = tiny
    pm = peft_model(hf, seed=1)
    pm.save_pretrained(tmp_path)
    ids, labels, mask = batch()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    model = load_model(folder, backend=backend)
    model.load_adapter(tmp_path)
    cfg = model.lora_config
    assert (cfg.layers_to_transform, cfg.layers_pattern) == ((0, 2), ("layers",))
    assert cfg.rank_pattern == LAYOUT["rank_pattern"] and cfg.alpha_pattern == LAYOUT["alpha_pattern"]
    real = mask.astype(bool)
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32" if backend == "numpy" else "gpu_logits")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32" if backend == "numpy" else "gpu_loss", "loss")
    assert set(grads) == set(expected) and len(grads) == 2 * 2 * 6
    for name, g in expected.items():
        assert np.abs(g).max() > 1e-4, name
        assert_close(grads[name], g, "grads_f32" if backend == "numpy" else "gpu_grads", name)
    if backend == "wgpu":          # q/k/v (ranks 3, 3, 2 in layer 0; 3, 5, 2 in layer 2) and gate/up run fused
        assert model.engine._group_of["k_proj"] == ("q_proj", "k_proj", "v_proj")
        assert model.engine._group_of["up_proj"] == ("gate_proj", "up_proj")


def test_our_layout_adapter_loads_in_peft(tiny, tmp_path):
    hf, folder = tiny
    model = load_model(folder)
    model.add_lora(ours(), seed=4)
    rng = np.random.default_rng(0)
    model.engine.set_lora({p: (a, 0.3 * rng.standard_normal(b.shape).astype(np.float32), model._scales[p], 0.0)
                           for p, (a, b) in model.engine.lora_tensors().items()})
    model.save_adapter(tmp_path)
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    assert raw["layers_to_transform"] == [0, 2] and raw["layers_pattern"] == "layers"
    assert raw["rank_pattern"] == LAYOUT["rank_pattern"] and raw["alpha_pattern"] == LAYOUT["alpha_pattern"]
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path)
    theirs = {n.replace(".default.", "."): p.detach().numpy() for n, p in pm.named_parameters() if "lora_" in n}
    mine = model.lora_state_dict()
    assert set(theirs) == set(mine)
    for k, v in mine.items():
        assert_close(theirs[k], v, "exact", k)
    ids, _, _ = batch()
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids)).logits.numpy()
    assert_close(model.logits(ids), want, "logits_f32")
    # merged: the per-module scales folded in
    merged = model.merged_weights()
    with torch.no_grad():
        pm.merge_adapter()
        for path in ("model.layers.0.self_attn.q_proj", "model.layers.2.mlp.down_proj",
                     "model.layers.2.self_attn.k_proj"):
            w = pm.base_model.model.get_submodule(path).base_layer.weight.numpy()
            assert_close(merged[path + ".weight"], w, "merged_logits", path)
    untouched = "model.layers.1.mlp.up_proj.weight"       # layer 1 has no LoRA
    assert_close(merged[untouched], hf.state_dict()[untouched].numpy(), "exact", untouched)


def test_partial_layer_regex_targets(tiny, tmp_path):
    """target_modules regexes that pick some layers load, as the same modules; written back as a list with
    layers_to_transform, which PEFT reads as the same selection."""
    hf, folder = tiny
    cfg = peft.LoraConfig(r=2, lora_alpha=5, target_modules=r".*\.layers\.[12]\.(self_attn\.q_proj|mlp\.down_proj)")
    pm = peft.get_peft_model(copy.deepcopy(hf), cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    pm.save_pretrained(tmp_path / "theirs")
    model = load_model(folder)
    model.load_adapter(tmp_path / "theirs")
    assert model.lora_config.target_modules == ("q_proj", "down_proj")
    assert model.lora_config.layers_to_transform == (1, 2)
    ids, _, _ = batch()
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids)).logits.numpy()
    assert_close(model.logits(ids), want, "logits_f32")
    model.save_adapter(tmp_path / "ours")
    again = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours")
    assert set(peft_modules(again)) == set(peft_modules(pm))


@pytest.mark.parametrize("edit, words", [
    ({"layers_to_transform": "0"}, ("key 'layers_to_transform' must be a layer index or a list of them",)),
    ({"layers_pattern": 3}, ("key 'layers_pattern' must be a name",)),
    ({"rank_pattern": {"q_proj": 0}}, ("key 'rank_pattern' must be an object of module-path patterns",)),
    ({"alpha_pattern": ["q_proj"]}, ("key 'alpha_pattern'",)),
    ({"layers_to_transform": [7]}, ("selects none of the linear layers", "in layers_to_transform [7]")),
    ({"layers_pattern": "h"}, ("selects none of the linear layers", "in layers_to_transform [0, 2]")),
    ({"rank_pattern": {"q_proj(": 2}}, ("rank_pattern key 'q_proj(' is not a valid regular expression",)),
    ({"init_lora_weights": "loftq"}, ("not supported: init_lora_weights=\"loftq\"",)),
])
def test_bad_layout_fields_refused(tiny, tmp_path, edit, words):
    _, folder = tiny
    model = load_model(folder)
    model.add_lora(ours(), seed=0)
    model.save_adapter(tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    fresh = load_model(folder)
    with pytest.raises((AdapterError, ConfigError)) as e:
        fresh.load_adapter(tmp_path)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)
    assert fresh.lora_config is None


def test_bad_layout_settings_are_one_line_errors():
    for kw, words in ((dict(layers_to_transform=[-1]), "layer indices >= 0"),
                      (dict(layers_pattern="layers"), "layers_pattern needs layers_to_transform"),
                      (dict(rank_pattern={"q_proj": 1.5}), "rank_pattern['q_proj'] must be a whole number"),
                      (dict(alpha_pattern={"q_proj": -1}), "alpha_pattern['q_proj'] must be a finite number > 0")):
        with pytest.raises(ConfigError, match=words.replace("[", r"\[")) as e:
            LoraConfig(**kw)
        assert "\n" not in str(e.value)


def test_memory_and_trainable_count_per_module_ranks(tiny):
    hf, folder = tiny
    model = load_model(folder)
    lora = ours()
    model.add_lora(lora)
    n = sum(v.size for v in model.engine.trainable().values())
    assert count_trainable(model.config, lora) == n
    pm = peft_model(hf)
    assert n == sum(p.numel() for p in pm.parameters() if p.requires_grad)
    plain = estimate_memory(model.config, 2, 16, LoraConfig(r=3, target_modules=lora.target_modules))
    est = estimate_memory(model.config, 2, 16, lora)
    assert est["trainable_state"] == 16 * n and est["trainable_state"] != plain["trainable_state"]


def test_wgpu_trains_per_layer_ranks_as_numpy(tiny, rt):
    """One AdamW step of the fused-group layout on both engines: the same loss, gradients and new tensors;
    the activation estimate is what the WebGPU engine allocates (lora_h sized for the widest layer)."""
    hf, folder = tiny
    lora = ours()
    ref, gpu = load_model(folder), load_model(folder, backend="wgpu", device=str(rt.info.index))
    ref.add_lora(lora, seed=2)
    rng = np.random.default_rng(1)
    tensors = {p: (a, 0.2 * rng.standard_normal(b.shape).astype(np.float32)) for p, (a, b) in
               ref.engine.lora_tensors().items()}
    for m in (ref, gpu):
        m._set_lora(lora, tensors, seed=2)
    engine = gpu.engine
    assert engine._group_of["q_proj"] == ("q_proj", "k_proj", "v_proj")
    ids, labels, mask = batch()
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    micro = [(ids.astype(np.int32), shift_labels(labels), mask.astype(np.int32), pos)]
    hp = OptimizerParams(lr=1e-2)
    (loss_ref, _, norm_ref, _), (loss_gpu, _, norm_gpu, _) = (m.engine.train_step(micro, hp, step=1)
                                                               for m in (ref, gpu))
    assert_close(np.float64(loss_gpu), np.float64(loss_ref), "gpu_loss", "loss")
    assert_close(np.float64(norm_gpu), np.float64(norm_ref), "gpu_loss", "gradient norm")
    after = ref.engine.lora_tensors()
    for p, (a, b) in gpu.engine.lora_tensors().items():
        assert_close(a, after[p][0], "gpu_params_after_steps", p + " A")
        assert_close(b, after[p][1], "gpu_params_after_steps", p + " B")
        assert not np.array_equal(b, tensors[p][1]), p
    acts = engine._activations(*ids.shape, train=True)
    assert acts.layers[0]["lora_h.q_proj+k_proj+v_proj"].size == 4 * acts.capacity * 10    # layer 2: 3 + 5 + 2
    assert acts.layers[2]["lora_h.down_proj"].size == 4 * acts.capacity * 6                # layer 0's rank
    est = wt.estimate_memory(gpu.config, *ids.shape, lora=lora)
    bufs = {id(b): b for layer in acts.layers.values() for b in layer.values()}
    bufs.update({id(v): v for k, v in vars(acts).items() if hasattr(v, "destroy") and k not in
                 ("ids", "segments", "positions", "targets", "head_index")})     # the batch, not activations
    assert est["activations"] + est["logits"] == sum(b.size for b in bufs.values())


def test_option_spellings_and_memory_command(tiny, capsys):
    """--lora-layers and the pattern options as the command line and TOML spell them; `wgpu-train memory`
    with them reports estimate_memory of the same LoraConfig."""
    from wgpu_train.cli.main import main
    from wgpu_train.adapters.layout import parse_layers, parse_pattern
    from wgpu_train.training.config import TrainConfig

    assert parse_layers("2") == 2 and parse_layers("0,2") == (0, 2) and parse_layers("3-5,1") == (1, 3, 4, 5)
    assert parse_layers("4,") == (4,) and parse_layers("all") is None and parse_layers(None) is None
    assert parse_pattern("q_proj=16,layers.0.mlp.down_proj=4", "p") == {"q_proj": 16, "layers.0.mlp.down_proj": 4}
    assert parse_pattern('{"layers\\\\.[0-9]{1,2}\\\\.mlp": 2.5}', "p") == {r"layers\.[0-9]{1,2}\.mlp": 2.5}
    cfg = TrainConfig(lora_layers="2", lora_rank_pattern="v_proj=5", lora_alpha_pattern="v_proj=1.5").lora_config(3)
    assert (cfg.layers_to_transform, cfg.rank_pattern, cfg.alpha_pattern) == ((1, 2), {"v_proj": 5}, {"v_proj": 1.5})
    for bad in ("x", "3-1", "0"):
        with pytest.raises(ConfigError, match="--lora-layers"):
            parse_layers(bad)
    _, folder = tiny
    assert main(["memory", "--model", str(folder), "--batch-size", "2", "--max-seq-len", "16", "--lora-layers", "2",
                 "--lora-rank-pattern", "v_proj=5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    lora = LoraConfig(r=8, target_modules=("q_proj", "v_proj"), layers_to_transform=(1, 2), rank_pattern={"v_proj": 5})
    want = estimate_memory(wt.ModelConfig.from_folder(folder), 2, 16, lora)
    assert {k: result[k] for k in want} == want
    assert want["trainable_state"] == 16 * 2 * (8 * (30 + 30) + 5 * (30 + 10))
