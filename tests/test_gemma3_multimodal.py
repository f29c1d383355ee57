"""Text-only fine-tuning of a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration, gemma-3-4b's
class): its language model against transformers' multimodal model on text, PEFT adapters named as PEFT names
them there (both ways), a merge that transformers loads with the vision tower untouched, and the refusals."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.errors import AdapterError, ConfigError
from wgpu_train.formats.safetensors import read_safetensors, write_safetensors

from finetune_helpers import build_tokenizer, make_data_dir, padded_batch, peft_random_b
from tiny_models import build_model, save_model
from tolerances import assert_close

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LANGUAGE = r".*language_model.*\.(q_proj|v_proj|down_proj)"    # how Gemma 3 PEFT recipes keep LoRA off the tower


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    hf = build_model("gemma3_mm", seed=6)
    folder = tmp_path_factory.mktemp("gemma3_mm")
    save_model(hf, folder)
    return hf, folder


def batch():
    ids, labels, mask = padded_batch(1, 11, 8, 3)
    return ids, mask, labels


def hf_logits(model, ids, mask=None):
    with torch.no_grad():
        kw = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return model(input_ids=torch.tensor(ids), **kw).logits.numpy()


def lora_model(hf, targets=LANGUAGE, seed=0):
    return peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=targets, lora_dropout=0.0)), seed)


@pytest.mark.parametrize("spelling", ["hub", "live"])
def test_language_model_logits_match_transformers(mm, rt, tmp_path, spelling):
    """Both engines' logits on text equal the multimodal model's, from the checkpoint as the hub (and transformers'
    save_pretrained) writes it (language_model.model.*) and in transformers' live names (model.language_model.*)."""
    hf, folder = mm
    if spelling == "live":
        tensors = read_safetensors(folder / "model.safetensors")
        renamed = {("model." + k if not k.startswith("language_model.lm_head") else "lm_head.weight")
                   .replace("model.language_model.model.", "model.language_model."): v for k, v in tensors.items()}
        assert any(k.startswith("model.language_model.layers.") for k in renamed)
        folder = tmp_path / "live"
        folder.mkdir()
        write_safetensors(folder / "model.safetensors", renamed)
        (folder / "config.json").write_bytes((mm[1] / "config.json").read_bytes())
    ids, mask, _ = batch()
    real = mask.astype(bool)
    want = hf_logits(hf, ids, mask)
    for backend, tol in (("numpy", "logits_f32"), ("wgpu", "gpu_logits")):
        model = wt.load_model(folder, backend=backend, **({"device": str(rt.info.index)} if backend == "wgpu" else {}))
        assert model.config.wrapper == "Gemma3ForConditionalGeneration" and model.config.family == "gemma3"
        assert_close(model.logits(ids, mask)[real], want[real], tol, backend)


def test_lora_loss_and_grads_match_peft(mm, rt, tmp_path):
    """A PEFT adapter on the language model (its keys under model.language_model): loss and every gradient equal
    PEFT's autograd on both engines."""
    hf, folder = mm
    pm = lora_model(hf)
    ids, mask, labels = batch()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default", "").replace("model.language_model.", "model."): p.grad.numpy()
                for n, p in pm.named_parameters() if p.requires_grad}
    assert len(expected) == 2 * 2 * 3
    pm.save_pretrained(tmp_path)
    for backend, loss_tol, grad_tol in (("numpy", "loss_f32", "grads_f32"), ("wgpu", "gpu_loss", "gpu_grads")):
        model = wt.load_model(folder, backend=backend, **({"device": str(rt.info.index)} if backend == "wgpu" else {}))
        model.load_adapter(tmp_path)
        assert model.lora_config.target_modules == ("q_proj", "v_proj", "down_proj")
        loss, grads = model.loss_and_grads(ids, labels, mask)
        assert_close(np.float64(loss), out.loss.item(), loss_tol, backend)
        assert set(grads) == set(expected), sorted(set(grads) ^ set(expected))
        for name, g in expected.items():
            assert_close(grads[name], g, grad_tol, name)


def test_our_adapter_loads_in_peft_and_merges(mm, tmp_path):
    """Our adapter on the multimodal model: PEFT loads it without key complaints and with LoRA on the language
    model only (its target_modules a regular expression on the language model's layers), to our logits; the
    merged folder loads in transformers as the multimodal class, to PEFT's logits, with the vision tower and the
    projector as they were. A rank_pattern key spelled on the multimodal path gives its rank on both sides."""
    hf, folder = mm
    model = wt.load_model(folder)
    model.add_lora(wt.LoraConfig(r=3, alpha=4, target_modules="all-linear", layers_to_transform=(1,),
                                 rank_pattern={"language_model.layers.1.mlp.down_proj": 5}), seed=2)
    assert model.engine.lora["model.layers.1.mlp.down_proj"].a.shape[0] == 5    # matched on PEFT's path here
    rng = np.random.default_rng(0)
    model._set_lora(model.lora_config, {p: (a, rng.normal(0, 0.2, b.shape).astype(np.float32))
                                       for p, (a, b) in model.engine.lora_tensors().items()})
    model.save_adapter(tmp_path / "a")
    saved = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert isinstance(saved["target_modules"], str) and saved["layers_to_transform"] is None
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "a")
    lora_modules = [n for n, m in pm.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(lora_modules) == 7 and all(n.startswith("base_model.model.model.language_model.layers.1.")
                                          for n in lora_modules), lora_modules
    result = pm.load_adapter(tmp_path / "a", adapter_name="again")
    assert not [k for k in result.missing_keys if "lora_" in k] and not result.unexpected_keys
    ids, mask, _ = batch()
    real = mask.astype(bool)
    want = hf_logits(pm, ids, mask)
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32", "ours vs PEFT")
    again = wt.load_model(folder)
    again.load_adapter(tmp_path / "a")       # our regular expression reads back as the same layout
    assert again.lora_config.layers_to_transform == (1,) and len(again.lora_config.target_modules) == 7
    model.merge_and_save(tmp_path / "merged")
    merged = tf.AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert type(merged).__name__ == "Gemma3ForConditionalGeneration"
    assert_close(hf_logits(merged, ids, mask)[real], want[real], "merged_logits", "transformers on merged")
    before, after = (read_safetensors(f / "model.safetensors") for f in (folder, tmp_path / "merged"))
    assert set(before) == set(after)
    for k in before:
        if not k.startswith("language_model."):
            np.testing.assert_array_equal(after[k], before[k], err_msg=k)


def test_greedy_generation_matches_transformers(mm, rt):
    hf, folder = mm
    ids = np.random.default_rng(3).integers(4, 83, 6)
    with torch.no_grad():
        want = hf.generate(torch.tensor(ids[None]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, 6:].tolist()
    for backend in ("numpy", "wgpu"):
        model = wt.load_model(folder, backend=backend, **({"device": str(rt.info.index)} if backend == "wgpu" else {}))
        assert model.generate(ids, max_new_tokens=8) == want, backend


HUB_CONFIGS = {   # the hub's config.json of two gemma-3 sizes, vision_config cut to what transformers needs
    "4b": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "27b": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
            "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
            "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024},
}


@pytest.mark.parametrize("size", list(HUB_CONFIGS))
def test_sparse_hub_config_reads_as_transformers_reads_it(size):
    """The hub's gemma-3 configs leave most of text_config to transformers' defaults: every field the math reads,
    and each layer's RoPE frequencies, equal what transformers makes of the same file."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
           "text_config": HUB_CONFIGS[size], "vision_config": {"model_type": "siglip_vision_model"}}
    ours = wt.ModelConfig.from_dict(raw)
    full = tf.Gemma3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    theirs = full.text_config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "pad_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.tie_word_embeddings is full.tie_word_embeddings is True and ours.eos_token_id == [1, 106]
    assert ours.query_scale == pytest.approx((theirs.head_dim / theirs.query_pre_attn_scalar) ** 0.5)
    assert ours.layer_windows == tuple(theirs.sliding_window if t == "sliding_attention" else 0
                                       for t in theirs.layer_types)
    rotary = Gemma3RotaryEmbedding(theirs)
    for i, kind in enumerate(theirs.layer_types):
        assert_close(ours.inv_freq(i), getattr(rotary, f"{kind}_inv_freq").numpy(), "inv_freq", f"layer {i}")


def test_untied_head_and_old_adapter_layout(tmp_path):
    """An untied multimodal model (the top-level tie_word_embeddings, as transformers 5 ties this class) loads to
    transformers' logits and merges with its head; an adapter in the layout of transformers before 4.52
    (base_model.model.language_model.model.*, a target regex anchored there) loads to the same logits as now;
    a rank_pattern spelled on the multimodal paths (as PEFT matches it) gives its rank."""
    hf = build_model("gemma3_mm", seed=8, tie_word_embeddings=False)
    folder = tmp_path / "untied"
    save_model(hf, folder)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    ids, mask, _ = batch()
    real = mask.astype(bool)
    model = wt.load_model(folder)
    assert not model.config.tie_word_embeddings
    assert_close(model.logits(ids, mask)[real], hf_logits(hf, ids, mask)[real], "logits_f32", "untied")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|v_proj)", lora_dropout=0.0,
        rank_pattern={"model.language_model.layers.0.self_attn.q_proj": 4})), 1)
    pm.save_pretrained(tmp_path / "new")
    want = hf_logits(pm, ids, mask)
    old = tmp_path / "old"
    old.mkdir()
    tensors = read_safetensors(tmp_path / "new" / "adapter_model.safetensors")
    write_safetensors(old / "adapter_model.safetensors", {
        k.replace("base_model.model.model.language_model.", "base_model.model.language_model.model."): v
        for k, v in tensors.items()})
    config = json.loads((tmp_path / "new" / "adapter_config.json").read_text())
    config.update(target_modules=r"language_model\.model\.layers\.\d+\.self_attn\.(q_proj|v_proj)",
                  rank_pattern={"language_model.model.layers.0.self_attn.q_proj": 4})
    (old / "adapter_config.json").write_text(json.dumps(config))
    for adapter in ("new", "old"):
        model = wt.load_model(folder)
        model.load_adapter(tmp_path / adapter)
        assert model.engine.lora["model.layers.0.self_attn.q_proj"].a.shape[0] == 4, adapter
        assert_close(model.logits(ids, mask)[real], want[real], "logits_f32", adapter)
    model.merge_and_save(tmp_path / "merged")
    merged = tf.AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert not merged.config.tie_word_embeddings
    assert_close(hf_logits(merged, ids, mask)[real], want[real], "merged_logits", "merged, untied")


def test_merge_needs_the_tower_and_copies_the_processor(mm, tmp_path):
    """Merge copies the processor's files with the tokenizer's; a source folder holding only the language
    model's tensors trains, but its merge is refused with one line (its folder would not load as the class)."""
    hf, folder = mm
    source = tmp_path / "src"
    source.mkdir()
    for f in folder.iterdir():
        (source / f.name).write_bytes(f.read_bytes())
    (source / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Gemma3ImageProcessor"}))
    wt.load_model(source).merge_and_save(tmp_path / "merged")
    assert (tmp_path / "merged" / "preprocessor_config.json").is_file()
    language = {k: v for k, v in read_safetensors(folder / "model.safetensors").items()
                if k.startswith("language_model.")}
    write_safetensors(source / "model.safetensors", language)
    model = wt.load_model(source)
    with pytest.raises(wt.ModelFileError, match="no vision tower or projector tensors") as info:
        model.merge_and_save(tmp_path / "merged2")
    assert "\n" not in str(info.value)


def test_the_all_linear_recipe_with_modules_to_save(mm, tmp_path, caplog):
    """The common recipe (TRL's, Google's guide): PEFT's all-linear, which reaches the vision tower too, with
    modules_to_save lm_head and embed_tokens. Trained on text, the tower's B stays zero: that LoRA is dropped with
    a note, and the adapter gives PEFT's logits, loss and gradients (the copies' included); its merge, with the
    head now untied, loads in transformers to PEFT's logits."""
    hf, folder = mm
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules="all-linear", modules_to_save=["lm_head", "embed_tokens"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name and "language_model" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "modules_to_save" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    assert any("vision_tower" in n and "lora_B" in n for n, _ in pm.named_parameters())
    ids, mask, labels = batch()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    pm.eval().save_pretrained(tmp_path / "a")
    model = wt.load_model(folder)
    with caplog.at_level("WARNING", logger="wgpu_train"):
        model.load_adapter(tmp_path / "a")
    assert "dropped the LoRA of 9 modules outside the language model" in caplog.text
    assert model.lora_config.modules_to_save == ("embed_tokens", "lm_head")
    real = mask.astype(bool)
    want = hf_logits(pm, ids, mask)
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32", "with the copies")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss), out.loss.item(), "loss_f32")
    theirs = {n.replace(".modules_to_save.default", "").replace(".default", "")
              .replace("model.language_model.", "model."): p.grad.numpy()
              for n, p in pm.named_parameters() if p.requires_grad and "vision_tower" not in n}
    assert set(grads) == set(theirs), sorted(set(grads) ^ set(theirs))
    for name, g in theirs.items():
        assert_close(grads[name], g, "grads_f32", name)
    model.merge_and_save(tmp_path / "merged")
    merged = tf.AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert not merged.config.tie_word_embeddings
    assert_close(hf_logits(merged, ids, mask)[real], want[real], "merged_logits", "merged, the head untied")


def test_refusals(mm, tmp_path):
    """One line each: LoRA that changes the vision tower (a list of names in PEFT reaches it too), a config
    without its text_config."""
    hf, folder = mm
    lora_model(hf, ["q_proj", "v_proj"]).save_pretrained(tmp_path / "tower")
    model = wt.load_model(folder)
    with pytest.raises(AdapterError, match=r"vision_tower.* outside the language model.*all-linear") as info:
        model.load_adapter(tmp_path / "tower")
    assert "\n" not in str(info.value)
    raw = json.loads((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match="needs a 'text_config' object"):
        wt.ModelConfig.from_dict({k: v for k, v in raw.items() if k != "text_config"})


def test_finetune_and_merge_on_the_command_line(tmp_path, capsys):
    """finetune on the multimodal folder (the WebGPU engine), then merge: a folder of the multimodal class."""
    model_dir = tmp_path / "model"
    vocab = build_tokenizer(model_dir)
    save_model(build_model("gemma3_mm", vocab_size=vocab), model_dir)
    data = make_data_dir(tmp_path / "data")
    from wgpu_train.cli.main import main

    run = tmp_path / "run"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(run), "--backend", "wgpu",
                 "--max-steps", "2", "--lora-targets", "all-linear", "--no-progress"]) == 0
    assert main(["merge", "--model", str(model_dir), "--adapter-path", str(run), "--out", str(tmp_path / "m")]) == 0
    merged = tf.AutoModelForImageTextToText.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    assert type(merged).__name__ == "Gemma3ForConditionalGeneration"
    assert set(read_safetensors(tmp_path / "m" / "model.safetensors")) == \
        set(read_safetensors(model_dir / "model.safetensors"))
    ids = np.array([[5, 40, 77, 12, 9, 3]])
    adapted = wt.load_model(model_dir)
    adapted.load_adapter(run)
    assert_close(adapted.logits(ids), hf_logits(merged, ids), "merged_logits", "merged on the command line")
    capsys.readouterr()
