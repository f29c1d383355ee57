"""LoRA on Qwen3-VL's and Qwen3.5's vision tower on the NumPy engine (issue 46) against PEFT: the blocks' qkv, proj,
linear_fc1 / linear_fc2 and the mergers' (DeepStack's too) beside the language model's LoRA: loss and every LoRA
gradient equal PEFT's autograd, the saved adapter loads in PeftModel with the same logits; --lora-targets naming
the tower's modules trains from the CLI."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from wgpu_train.errors import ConfigError

from finetune_helpers import peft_random_b
from tolerances import assert_close

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
Image = pytest.importorskip("PIL.Image")

from test_qwen3_vl import PAD, hf_inputs, images, records, span, vlm  # noqa: E402,F401
from wgpu_train.engines.vision_model import load_vision_model  # noqa: E402
from wgpu_train.models.vision import split_targets  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TARGETS = r".*(language_model.*\.(q_proj|v_proj)|visual.*\.(qkv|attn\.proj|linear_fc1|linear_fc2))"


def peft_key(name: str) -> str:
    return name.replace(".default", "").replace("model.language_model.", "model.")


def check_against_peft(hf, folder, tmp_path, imgs, rows, rank=2, alpha=5):
    """PEFT's LoRA on the language model and the whole tower (B random), loaded from its files: our loss and
    every gradient equal its autograd's; our saved adapter's logits in PeftModel equal ours."""
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0)))
    vm = load_vision_model(folder)
    width = max(map(len, rows))
    ids = np.array([r + [0] * (width - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = np.where((ids != PAD) & (mask == 1), ids, -100)
    out = pm(**hf_inputs(vm, ids, imgs), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {peft_key(n): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    assert any(".visual.merger." in k for k in expected) and any(".attn.qkv." in k for k in expected)
    pm.save_pretrained(tmp_path / "peft")
    vm.load_adapter(tmp_path / "peft")
    loss, grads = vm.loss_and_grads(ids, labels, imgs, attention_mask=mask)
    assert_close(np.float64(loss), out.loss.item(), "loss_f32", "loss with tower LoRA")
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)
    vm.save_adapter(tmp_path / "ours")
    ours = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    with torch.no_grad():
        want = ours(**hf_inputs(vm, ids[:1, :len(rows[0])], imgs[:2])).logits.numpy()
        plain = hf(**hf_inputs(vm, ids[:1, :len(rows[0])], imgs[:2])).logits.numpy()
    got = vm.logits(ids[:1, :len(rows[0])], imgs[:2])
    assert_close(got, want, "logits_f32", "saved adapter in PeftModel")
    assert np.abs(got - plain).max() > 1e-3         # the adapter changes them


def test_qwen3_vl_tower_lora_gradients_and_adapter_equal_peft(vlm, tmp_path):
    """Qwen3-VL: the DeepStack mergers' gradients come from the language model's image rows at their layers."""
    hf, folder, vm = vlm
    imgs = images(3, seed=3)
    rows = [[7, *span(vm, imgs[0]), 11, 12, *span(vm, imgs[1]), 13, 14], [8, 9, *span(vm, imgs[2]), 15]]
    check_against_peft(hf, folder, tmp_path, imgs, rows)


def test_qwen3_5_tower_lora_gradients_and_adapter_equal_peft(tmp_path):
    """Qwen3.5: the tower without DeepStack beside the hybrid language model."""
    from test_qwen3_5_vision import build

    folder = tmp_path / "model"
    hf = build(folder)
    vm = load_vision_model(folder)
    imgs = images(3, seed=4)
    rows = [[7, *span(vm, imgs[0]), 11, *span(vm, imgs[1]), 13], [8, 9, *span(vm, imgs[2]), 15]]
    check_against_peft(hf, folder, tmp_path, imgs, rows)


def test_split_targets_names_qwen_tower_modules():
    assert split_targets("q_proj,v_proj,qkv,attn.proj,linear_fc2") == ("q_proj,v_proj",
                                                                      ("qkv", "attn.proj", "linear_fc2"))
    assert split_targets(["q_proj", "visual", "visual.merger.linear_fc1"]) == (["q_proj"],
                                                                              ("blocks", "merger.linear_fc1"))
    with pytest.raises(ConfigError, match="not the patch embedding"):
        split_targets("q_proj,visual.patch_embed.proj")


def test_dpo_with_tower_lora_on_webgpu_equals_numpy(vlm, tmp_path):
    """DPO with LoRA on Qwen3-VL's tower (qkv, the mergers' linear_fc1, DeepStack's too) beside the language
    model's, the tower inside the engine's step on both engines (its reference's images the tower's LoRA off): the
    losses and both adapters after two steps on WebGPU are the NumPy engine's (whose tower LoRA gradients
    test_qwen3_vl_tower_lora_gradients_and_adapter_equal_peft checks against PEFT)."""
    from conftest import require_adapter
    from test_vision_preference import config, pref_records, write_pref_data
    from wgpu_train.formats.safetensors import read_safetensors
    from wgpu_train.training.preference_trainer import PreferenceTrainer

    require_adapter()
    _, folder, _ = vlm
    write_pref_data(tmp_path / "data", pref_records())
    runs = {}
    for backend in ("numpy", "wgpu"):
        trainer = PreferenceTrainer(config(tmp_path, folder, tmp_path / backend, backend=backend, max_steps=2,
                                           lr=1e-2, adapter_path=None, lora_rank=2, lora_alpha=5,
                                           lora_targets="q_proj,v_proj,qkv,linear_fc1"), log=lambda m: None)
        trainer.run()
        assert trainer.vision.in_step and trainer.vision.tower.lora
        rows = [json.loads(line) for line in (tmp_path / backend / "run" / "metrics.jsonl").read_text().splitlines()]
        runs[backend] = ([r["loss"] for r in rows if "grad_norm" in r],
                         read_safetensors(tmp_path / backend / "run" / "adapter_model.safetensors"))
    (loss_n, ad_n), (loss_w, ad_w) = runs["numpy"], runs["wgpu"]
    assert len(loss_n) == 2 and set(ad_n) == set(ad_w)
    tower = [k for k in ad_n if ".visual." in k]    # qkv and linear_fc1 of 2 blocks, linear_fc1 of 3 mergers
    # every B moved from 0 but DeepStack merger 0's, whose features join the last layer's output (no label reads it)
    moved = {k for k in tower if "lora_B" in k and np.abs(ad_n[k]).max() > 0}
    assert len(tower) == 2 * 7 and moved == {k for k in tower if "lora_B" in k and "deepstack_merger_list.0" not in k}
    assert_close(np.array(loss_w), np.array(loss_n), "loss_f32", "DPO losses with Qwen's tower LoRA")
    for name in ad_n:
        assert_close(ad_w[name], ad_n[name], "gpu_params_after_steps_lr1e-2", name)


def test_lora_init_that_changes_the_base_refused_on_qwens_tower(vlm):
    """PiSSA / OLoRA rewrite a module's base weight (its residual): on Qwen's tower, which keeps no residual, they
    are refused in one line."""
    from types import SimpleNamespace

    from wgpu_train.training.config import TrainConfig
    from wgpu_train.training.tower_lora import attach_tower

    _, folder, vm = vlm
    trainer = SimpleNamespace(config=TrainConfig(lora_targets="q_proj,qkv", lora_init="olora"), model=vm.model,
                              model_dir=folder, continued_from=None, resume=None, log=print)
    with pytest.raises(ConfigError, match="does not take --lora-init olora on this model's tower") as e:
        attach_tower(trainer)
    assert "\n" not in str(e.value)


def test_cli_finetune_with_tower_lora_and_memory(vlm, tmp_path, capsys):
    """`finetune --lora-targets q_proj,v_proj,qkv,linear_fc2` on Qwen3-VL: the loss falls, the tower's LoRA moves
    and the adapter loads in PeftModel with our logits; `memory` counts the tower's kept activations (within the
    tracemalloc tolerance of the LoRA forward's peak)."""
    import tracemalloc

    from test_gemma3_vision_training import write_vision_data
    from tolerances import TOLERANCES
    from wgpu_train.cli.main import main
    from wgpu_train.formats.safetensors import read_safetensors
    from wgpu_train.models.qwen3_vl import tower_activation_values

    hf, folder, vm = vlm
    data = write_vision_data(tmp_path / "data", records())
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", "numpy", "--max-steps", "5",
                 "--batch-size", "2", "--lr", "3e-2", "--lora-targets", "q_proj,v_proj,qkv,linear_fc2",
                 "--no-progress", "--valid-split", "0", "--log-every", "1", "--out", str(out)]) == 0
    assert "LoRA on the vision tower: qkv, linear_fc2 in 7 modules" in capsys.readouterr().err
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 5 and losses[-1] < losses[0]
    tensors = read_safetensors(out / "adapter_model.safetensors")
    tower = [k for k in tensors if ".visual." in k]
    assert len(tower) == 14 and any("deepstack_merger_list.1.linear_fc2.lora_B" in k for k in tower)
    # every B moved but the DeepStack merger's whose features join the last layer's output at the image rows, whose
    # logits no label reads (the loss is the answer's)
    last = "deepstack_merger_list.0.linear_fc2.lora_B"      # deepstack_visual_indexes [1, 0]: block 1 -> layer 1
    assert all(np.abs(tensors[k]).max() > 0 for k in tower if last not in k)
    assert not np.abs(tensors[next(k for k in tower if last in k)]).max()
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), out).eval()
    trained = load_vision_model(folder)
    trained.load_adapter(out)
    imgs = images(1)
    ids = np.array([[7, *span(trained, imgs[0]), 11]])
    with torch.no_grad():
        want = pm(**hf_inputs(trained, ids, imgs)).logits.numpy()
    assert_close(trained.logits(ids, imgs), want, "logits_f32", "trained adapter in PeftModel")

    assert main(["memory", "--model", str(folder), "--backend", "numpy", "--json", "--max-seq-len", "128",
                 "--batch-size", "1", "--images-per-row", "2", "--lora-targets", "q_proj,qkv,linear_fc2"]) == 0
    v = json.loads(capsys.readouterr().out)["vision"]
    assert v["tower_lora"] and v["tower_activations"] == 4 * tower_activation_values(vm.vision, 2, 48, True)
    big = Image.new("RGB", (64, 48))            # the largest image, 48 patches
    pixels, grids = trained.pixel_values([big, big])
    trained.tower.forward(pixels, grids)
    tracemalloc.start()
    try:
        trained.tower.forward(pixels, grids)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    estimate = 4 * tower_activation_values(vm.vision, 2, 48, True)
    print(f"estimate {estimate} bytes, tracemalloc peak {peak}")
    assert abs(estimate - peak) <= TOLERANCES["vision_tower_memory"].rtol * peak, (estimate, peak)
    assert main(["memory", "--model", str(folder), "--max-seq-len", "128", "--lora-targets", "qkv"]) == 2
    assert "the vision tower's alone" in capsys.readouterr().err


def test_f16_tower_lora_over_pipeline_stages_refused(vlm):
    """The host-tower loop over an engine whose loss scaler is the stages' (no set_vision_tower: pipeline stages, a
    copy of their scaler here) refuses f16 with tower LoRA in one line, before any pass."""
    import copy as copy_module
    from types import SimpleNamespace

    from wgpu_train.engines.protocol import LossScaler, OptimizerParams

    _, _, vm = vlm
    staged = copy_module.copy(vm)
    staged.tower = copy_module.copy(vm.tower)
    staged.tower.lora = {"visual.blocks.0.attn.qkv": (np.zeros((2, 4)), np.zeros((4, 2)), 1.0)}
    staged.model, staged.in_step = SimpleNamespace(engine=SimpleNamespace(loss_scaler=LossScaler())), False
    with pytest.raises(ConfigError, match="over pipeline stages does not train with --precision f16") as e:
        staged.train_step([], OptimizerParams(lr=1e-3), 1)
    assert "\n" not in str(e.value)


def test_tower_lora_resume_workers_and_pipeline_stages(vlm, tmp_path):
    """Qwen3-VL's tower LoRA: a run resumed from its 1-step checkpoint gives the uninterrupted run's adapter, two
    data-parallel workers (each its DeepStack gradients, all-reduced) one process's; --pipeline-stages 2 (whose
    stages do not give the DeepStack features' gradients back) refused in one line."""
    import wgpu_train
    from test_gemma3_vision_training import write_vision_data
    from wgpu_train.formats.safetensors import read_safetensors

    _, folder, _ = vlm
    data = write_vision_data(tmp_path / "data", records())
    kw = dict(model=str(folder), data=str(data), backend="numpy", batch_size=1, grad_accum=2, lr=1e-2,
              valid_split=0.0, lora_targets=("q_proj", "v_proj", "qkv", "merger.linear_fc2"), no_progress=True)
    wgpu_train.finetune(out=str(tmp_path / "one"), max_steps=2, **kw)
    wgpu_train.finetune(out=str(tmp_path / "part"), max_steps=1, **kw)
    wgpu_train.finetune(out=str(tmp_path / "part"), max_steps=2, resume=str(tmp_path / "part"), **kw)
    whole, part = (read_safetensors(tmp_path / f / "adapter_model.safetensors") for f in ("one", "part"))
    assert sum(".visual." in k for k in whole) == 6 and set(whole) == set(part)
    for k in whole:
        np.testing.assert_array_equal(part[k], whole[k], err_msg=k)
    from test_data_parallel import run_threads
    from wgpu_train.training.config import TrainConfig

    run_threads(TrainConfig(out=str(tmp_path / "two"), num_workers=2, max_steps=2, **kw), 2)
    two = read_safetensors(tmp_path / "two" / "adapter_model.safetensors")
    assert set(two) == set(whole)
    for k in whole:
        assert_close(two[k], whole[k], "data_parallel_qwen_tower", k)
    with pytest.raises(ConfigError, match="DeepStack trains without pipeline stages only") as e:
        wgpu_train.finetune(out=str(tmp_path / "stages"), max_steps=1, pipeline_stages=2, **kw)
    assert "\n" not in str(e.value) and not (tmp_path / "stages" / "metrics.jsonl").exists()    # before any step
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized(), "the refused run's stages (and the Ray it started) were released"


def test_adapter_on_the_patch_embedding_refused_in_one_line(vlm):
    """PEFT's `.*visual.*\\.(qkv|proj)` also wraps the Conv3d patch_embed.proj: its adapter is refused by name."""
    _, _, vm = vlm
    with pytest.raises(ConfigError, match="LoRA on visual.patch_embed.proj: not a linear module of the vision "
                                          "tower's blocks or mergers"):
        vm.set_tower_lora({"base_model.model.model.visual.patch_embed.proj.lora_A.weight": np.zeros((2, 384)),
                           "base_model.model.model.visual.patch_embed.proj.lora_B.weight": np.zeros((32, 2))}, 1.0)
