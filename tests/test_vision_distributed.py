"""Images beyond one process and one adapter file: the image files in a resume's data fingerprint, data-parallel
workers (threads; on WebGPU too) with images equal to one process (sft, the preference objectives, GRPO), LoRA on
the vision tower from the CLI's --lora-targets, pipeline stages and Ray workers with images."""
from __future__ import annotations

import json

import numpy as np
import pytest

import wgpu_train
from wgpu_train.errors import ConfigError

from test_gemma3_vision import Image, open_image
from tolerances import assert_close
from test_gemma3_vision_training import chat_vlm, vision_records, write_vision_data  # noqa: F401  (chat_vlm: fixture)
from test_vision_preference import pref_setup  # noqa: F401  (fixture: a PEFT adapter and TRL's vision pairs)


def _run_kw(folder, data, **kw):
    base = dict(model=str(folder), data=str(data), backend="numpy", batch_size=2, lr=1e-2, valid_split=0.0,
                lora_targets=("q_proj", "v_proj"), no_progress=True, log_every=1)
    return base | kw


# ---- the resume fingerprint covers the image files ------------------------------------------------------------

def test_fingerprint_hashes_the_image_files(tmp_path):
    from wgpu_train.data.batching import BatchStream, Example

    for k, colour in enumerate(((255, 0, 0), (0, 0, 255))):
        Image.new("RGB", (6, 5), colour).save(tmp_path / f"{k}.png")
    ids, labels = np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int64)

    def fingerprint(*images):
        return BatchStream([Example(ids, labels, images=list(images))], 1, 0).fingerprint()
    first = fingerprint(str(tmp_path / "0.png"))
    assert first == fingerprint(str(tmp_path / "0.png")) == fingerprint({"bytes": (tmp_path / "0.png").read_bytes()})
    assert first != fingerprint(str(tmp_path / "1.png")) and first != fingerprint()
    assert fingerprint(open_image(str(tmp_path / "0.png"))) != fingerprint(open_image(str(tmp_path / "1.png")))


def test_a_changed_image_file_refuses_the_resume(chat_vlm, tmp_path):
    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    kw = _run_kw(folder, data, out=str(tmp_path / "run"))
    wgpu_train.finetune(max_steps=1, **kw)
    open_image(str(tmp_path / "data" / "1_0.png")).transpose(0).save(tmp_path / "data" / "1_0.png")   # mirrored
    with pytest.raises(ConfigError, match="the training data changed since the checkpoint .*image files") as e:
        wgpu_train.finetune(max_steps=2, resume=str(tmp_path / "run"), **kw)
    assert "\n" not in str(e.value)


# ---- data-parallel workers with images ------------------------------------------------------------------------

def _adapter(folder):
    from wgpu_train.formats.safetensors import read_safetensors

    return read_safetensors(folder / "adapter_model.safetensors")


def _losses(folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "split" not in r]


def _assert_same_run(a, b, tolerance, steps=3, start=None):
    """The runs in folders a and b: the same adapter and losses (within tolerance), trained `steps` steps (their
    LoRA B moved from zero, or from `start`, the starting adapter's tensors)."""
    ta, tb = _adapter(a), _adapter(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert_close(tb[k], ta[k], tolerance, k)
    start = start or {}
    assert max(float(np.abs(ta[k] - start.get(k, 0.0)).max()) for k in ta if "lora_B" in k) > 1e-3   # it trained
    assert_close(np.array(_losses(b)), np.array(_losses(a)), tolerance, "losses")
    assert len(_losses(a)) == steps


def test_two_workers_with_images_equal_one_process(chat_vlm, tmp_path):
    """Two data-parallel workers (threads, an in-process collective), each running its rows' images through its
    own tower: the losses and the adapter after 3 steps (LoRA dropout on) are one process's with the whole batch."""
    from test_data_parallel import run_threads
    from wgpu_train.training.config import TrainConfig
    from wgpu_train.training.trainer import Trainer

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records() + vision_records()[:1])     # 4 records
    kw = _run_kw(folder, data, batch_size=1, max_steps=3, lora_dropout=0.1)
    Trainer(TrainConfig(out=str(tmp_path / "one"), grad_accum=2, **kw)).run()
    run_threads(TrainConfig(out=str(tmp_path / "two"), num_workers=2, **kw), 2)
    _assert_same_run(tmp_path / "one", tmp_path / "two", "data_parallel_numpy")


def test_two_webgpu_workers_in_threads_with_images_equal_one_process(chat_vlm, tmp_path):
    """Two data-parallel workers in threads, each with its WebGPU engine on the process's one device (each
    thread reads back through its own staging buffer): with images, the losses and adapter after 2 steps are one
    WebGPU process's with the whole batch."""
    from conftest import require_adapter
    from test_data_parallel import run_threads
    from wgpu_train.training.config import TrainConfig
    from wgpu_train.training.trainer import Trainer

    require_adapter()
    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records() + vision_records()[:1])     # 4 records
    kw = _run_kw(folder, data, batch_size=1, max_steps=2, lora_dropout=0.1, backend="wgpu", precision="fp32")
    Trainer(TrainConfig(out=str(tmp_path / "one"), grad_accum=2, **kw)).run()
    run_threads(TrainConfig(out=str(tmp_path / "two"), num_workers=2, **kw), 2)
    _assert_same_run(tmp_path / "one", tmp_path / "two", "data_parallel_wgpu", steps=2)


# ---- the preference objectives and GRPO with images on data-parallel workers -----------------------------------

def test_a_micro_batch_cut_keeps_each_rows_image_tokens():
    """split_rows of an engine micro-batch with ImageTokens (a scored preference step's): each part holds its rows'
    blocks, embeddings, M-RoPE positions and DeepStack features, which are those rows' of the whole."""
    from wgpu_train.distributed.data_parallel import split_rows
    from wgpu_train.engines.shared.image_tokens import ImageTokens

    blocks = np.full((3, 6), -1, np.int32)                      # row 0: 2 image tokens, row 1: none, row 2: 3
    blocks[0, 1:3], blocks[2, 2:5] = 0, (0, 0, 1)
    n = int((blocks >= 0).sum())
    embeds, deep = (np.arange(n * 4, dtype=np.float32).reshape(n, 4) + k for k in (0, 100))
    positions = np.arange(3 * 6 * 2, dtype=np.int32).reshape(3, 6, 2)
    ids = np.arange(18, dtype=np.int32).reshape(3, 6)
    micro = [(ids, ids, np.ones_like(ids), ids, np.ones((3, 6), np.float32),
              ImageTokens(blocks, embeds, positions, (deep,)))]
    first, second = split_rows(micro, 2, 1)
    assert [m[0].shape[0] for m in (first, second)] == [2, 1]
    for part, rows, run in ((first, slice(0, 2), slice(0, 2)), (second, slice(2, 3), slice(2, 5))):
        images = part[-1]
        np.testing.assert_array_equal(images.blocks, blocks[rows])
        np.testing.assert_array_equal(images.embeds, embeds[run])
        np.testing.assert_array_equal(images.positions, positions[rows])
        np.testing.assert_array_equal(images.deepstack[0], deep[run])
        np.testing.assert_array_equal(part[4], micro[0][4][rows])


@pytest.mark.parametrize("qwen", [False, True])
def test_a_micro_batch_cut_keeps_each_rows_tower_images(qwen):
    """split_rows of a micro-batch with TowerImages (the tower inside the engine's step): each part holds its rows'
    blocks, M-RoPE positions and the pixels of their images (SigLIP's an image a row of pixels, 2 tokens each;
    Qwen's each image its grid's patches, a token per 4), and its host() the whole's ImageTokens' rows."""
    from wgpu_train.distributed.data_parallel import split_rows
    from wgpu_train.engines.shared.image_tokens import ImageTokens, TowerImages

    blocks = np.full((3, 6), -1, np.int32)                  # row 0: 2 image tokens, row 1: none, row 2: 4
    blocks[0, 1:3], blocks[2, 1:5] = 0, (1, 1, 2, 2)
    grids = np.array([[1, 2, 4], [1, 2, 2], [1, 2, 6]]) if qwen else None     # 8, 4, 12 patches: 2, 1, 3 tokens
    if qwen:
        blocks[2, 1:5] = (1, 2, 2, 2)
    pixels = np.arange((24 if qwen else 3) * 5, dtype=np.float32).reshape(-1, 5)
    embeds = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    positions = np.arange(3 * 6 * 2, dtype=np.int32).reshape(3, 6, 2)
    whole = ImageTokens(blocks, embeds, positions)
    ids = np.arange(18, dtype=np.int32).reshape(3, 6)
    micro = [(ids, ids, np.ones_like(ids), ids, TowerImages(blocks, pixels, lambda: whole, False, grids, positions))]
    first, second = split_rows(micro, 2, 1)
    want = ((slice(0, 8), slice(0, 1)), (slice(8, 24), slice(1, 3))) if qwen else \
        ((slice(0, 1), None), (slice(1, 3), None))
    for part, rows, (pix, grid) in zip((first, second), (slice(0, 2), slice(2, 3)), want):
        images = part[-1]
        np.testing.assert_array_equal(images.blocks, blocks[rows])
        np.testing.assert_array_equal(images.positions, positions[rows])
        np.testing.assert_array_equal(images.pixels, pixels[pix])
        assert (images.grids is None) if grid is None else np.array_equal(images.grids, grids[grid])
        np.testing.assert_array_equal(images.host().blocks, blocks[rows])
        assert len(images.host().embeds) == int((blocks[rows] >= 0).sum())


@pytest.mark.parametrize("objective, batch_size", [("dpo", 1), ("orpo", 1), ("kto", 2)])
def test_preference_with_images_on_two_workers_equals_one_process(pref_setup, tmp_path, objective, batch_size):
    """DPO, ORPO (its NLL on the chosen rows) and KTO (its KL rows) with images on two data-parallel workers
    (threads): each worker scores the whole step (the tower over every row's images, the reference the adapter
    off) and trains its share of the weighted micro-batches; the second, short step's one micro-batch is cut
    between the workers with its rows' image tokens. The losses and the adapter after 2 steps are one process's
    with the whole batch."""
    from test_data_parallel import run_threads
    from test_vision_preference import config
    from wgpu_train.training.preference_trainer import PreferenceTrainer

    root, folder, _, _ = pref_setup
    kw = dict(objective=objective, batch_size=batch_size, max_steps=2, lr=1e-2)
    PreferenceTrainer(config(root, folder, tmp_path / "one", grad_accum=2, **kw), log=lambda m: None).run()
    run_threads(config(root, folder, tmp_path / "two", num_workers=2, **kw), 2)
    _assert_same_run(tmp_path / "one" / "run", tmp_path / "two" / "run", "data_parallel_numpy", steps=2,
                     start=_adapter(root / "adapter"))


def test_grpo_with_images_on_two_workers_equals_one_process(pref_setup, tmp_path):
    """GRPO with images on two data-parallel workers (threads): each samples its own whole groups with their
    prompts' images and rewards them; the gathered rewards give both the step's group advantages (beta > 0: each
    worker's reference scores its rows with their images). The completions, losses and adapter after 2 steps are
    one process's with the same seed."""
    from test_data_parallel import run_threads
    from test_vision_preference import config, grpo_records, id_reward, length_reward, write_pref_data

    root, folder, _, _ = pref_setup
    data = write_pref_data(tmp_path / "data", grpo_records() * 2)
    kw = dict(data=str(data), objective="grpo", batch_size=2, num_generations=2, max_completion_length=5,
              max_steps=2, beta=0.04, temperature=0.8, seed=3, lr=1e-2)
    rewards = [length_reward, id_reward]
    wgpu_train.finetune(config(root, folder, tmp_path / "one", grad_accum=2, **kw), reward_funcs=rewards)
    two = run_threads(config(root, folder, tmp_path / "two", num_workers=2, **kw), 2, reward_funcs=rewards)
    assert two[0]["images"] == 4 and two[0]["data_parallel"]["workers"] == 2
    one, two = tmp_path / "one" / "run", tmp_path / "two" / "run"
    assert (two / "completions.jsonl").read_text() == (one / "completions.jsonl").read_text()
    _assert_same_run(one, two, "data_parallel_numpy", steps=2, start=_adapter(root / "adapter"))


# ---- LoRA on the vision tower from --lora-targets ---------------------------------------------------------------

TOWER_TARGETS = "q_proj,v_proj,fc1,vision_tower.q_proj,vision_tower.self_attn.out_proj"


def test_cli_tower_targets_train_and_load_in_peft(chat_vlm, tmp_path, capsys):
    """finetune --lora-targets with the tower's modules (PEFT's names): the tower's LoRA trains beside the language
    model's, and the adapter loads in PeftModel, whose logits with an image equal ours with it loaded."""
    import copy

    import peft
    import torch

    from test_gemma3_vision import hf_out
    from test_gemma3_vision_training import our_examples
    from wgpu_train.cli.main import main
    from wgpu_train.engines.vision_model import load_vision_model

    hf, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", "numpy", "--max-steps", "3",
                 "--batch-size", "2", "--lr", "1e-2", "--lora-targets", TOWER_TARGETS, "--no-progress",
                 "--valid-split", "0", "--out", str(tmp_path / "run")]) == 0
    assert "LoRA on the vision tower: self_attn.q_proj, self_attn.out_proj, mlp.fc1 in" in capsys.readouterr().err
    tensors = _adapter(tmp_path / "run")
    tower = [k for k in tensors if ".vision_tower." in k]
    assert len(tower) == 2 * 3 * 2          # A and B of 3 modules in each of the tower's 2 layers
    assert all(np.abs(tensors[k]).max() > 0 for k in tower if "lora_B" in k)     # each trained
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "run").eval()
    loaded = {n.replace(".default", "") for n, _ in pm.named_parameters() if "lora_" in n}
    assert loaded == set(tensors)
    (examples, _), _ = our_examples(folder)
    ex = examples[1]
    ids = ex.input_ids[None].astype(np.int64)
    vm = load_vision_model(folder)
    vm.load_adapter(tmp_path / "run")
    px = vm.pixel_values(ex.images)
    with torch.no_grad():
        theirs = hf_out(pm, ids, np.ones_like(ids), px, image_id=7).logits.numpy()
    assert_close(vm.logits(ids, ex.images), theirs, "logits_f32", "the trained adapter in PEFT")
    # --adapter-path continues it, the tower's LoRA too: 2 Adam steps (the first one's rows without an image) move
    # each entry by at most 2 lr (fresh B would be that near zero, not the trained B), and it loads in PeftModel
    capsys.readouterr()
    assert main(["finetune", "--adapter-path", str(tmp_path / "run"), "--data", str(data), "--backend", "numpy",
                 "--max-steps", "2", "--batch-size", "2", "--lr", "1e-3", "--no-progress", "--valid-split", "0",
                 "--out", str(tmp_path / "again")]) == 0
    assert "LoRA on the vision tower: the adapter's, continued, in 6 modules" in capsys.readouterr().err
    again = _adapter(tmp_path / "again")
    assert set(again) == set(tensors)
    steps = {k: np.abs(again[k] - tensors[k]).max() for k in tower}
    assert all(0 < step <= 2.01e-3 for step in steps.values()), steps
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "again")
    assert {n.replace(".default", "") for n, _ in pm.named_parameters() if "lora_" in n} == set(again)
    ckpt = sorted((tmp_path / "again" / "checkpoints").iterdir())[-1]
    assert main(["finetune", "--adapter-path", str(ckpt), "--data", str(data), "--backend", "numpy",
                 "--no-progress", "--out", str(tmp_path / "from_ckpt")]) == 2
    assert "a checkpoint whose LoRA on the vision tower lies beside its adapter" in capsys.readouterr().err
    # its --resume (no --adapter-path, no tower targets recorded) trains on the checkpoint's tower LoRA
    assert main(["finetune", "--resume", str(tmp_path / "again"), "--max-steps", "3", "--no-progress"]) == 0
    assert "LoRA on the vision tower: the adapter's, continued, in 6 modules" in capsys.readouterr().err
    resumed = _adapter(tmp_path / "again")
    assert all(0 < np.abs(resumed[k] - again[k]).max() <= 1.01e-3 for k in tower)


def test_tower_lora_resume_and_two_workers_equal_one_process(chat_vlm, tmp_path):
    """With LoRA on the tower: a run stopped after 1 step and resumed from its checkpoint (the tower's tensors and
    moments kept in it) gives the uninterrupted run's adapter; two data-parallel workers (the tower's gradients
    all-reduced with the language model's) give one process's."""
    from test_data_parallel import run_threads
    from wgpu_train.training.config import TrainConfig

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records() + vision_records()[:1])
    kw = _run_kw(folder, data, batch_size=1, lora_targets=TOWER_TARGETS)
    wgpu_train.finetune(out=str(tmp_path / "one"), max_steps=3, grad_accum=2, **kw)
    wgpu_train.finetune(out=str(tmp_path / "part"), max_steps=1, grad_accum=2, **kw)
    wgpu_train.finetune(out=str(tmp_path / "part"), max_steps=3, grad_accum=2, resume=str(tmp_path / "part"), **kw)
    whole, part = _adapter(tmp_path / "one"), _adapter(tmp_path / "part")
    assert sum(".vision_tower." in k for k in whole) == 12 and set(whole) == set(part)
    for k in whole:
        np.testing.assert_array_equal(part[k], whole[k], err_msg=k)
    run_threads(TrainConfig(out=str(tmp_path / "two"), num_workers=2, max_steps=3, **kw), 2)
    _assert_same_run(tmp_path / "one", tmp_path / "two", "data_parallel_tower_numpy")


def test_tower_lora_early_stopping_writes_the_best_evaluations_tower(chat_vlm, tmp_path):
    """Early stopping with LoRA on the tower (rsLoRA's scale and --lora-rank-pattern on both, one adapter config):
    the adapter written holds the best evaluation's tower LoRA (its checkpoint's), not the last step's."""
    import math

    from wgpu_train.models.vision import tower_lora_key
    from wgpu_train.training.checkpoint import read_arrays
    from wgpu_train.training.config import TrainConfig
    from wgpu_train.training.trainer import Trainer

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records() * 2)
    out = tmp_path / "run"
    trainer = Trainer(TrainConfig(out=str(out), **_run_kw(
        folder, data, lora_targets=TOWER_TARGETS, valid_split=0.34, max_steps=8, eval_every=1, early_stop_patience=2,
        save_every=1, keep_checkpoints=1, rslora=True, lora_rank_pattern="fc1=4"))).setup()
    losses = iter([5.0, 4.0, 3.0, 3.5, 3.2])    # before, then one per step: best at step 2, stop after step 4
    trainer.evaluate = lambda: (v := next(losses)) and {"loss": v, "perplexity": math.exp(v), "tokens": 10}
    summary = trainer.train()
    assert summary["stopped"] == "early_stop" and summary["adapter_step"] == 2
    assert {(a.shape[0], scale) for a, _, scale in trainer.vision.tower.lora.values()} == {
        (8, 16 / math.sqrt(8)), (4, 16 / math.sqrt(4))}       # alpha 16, r 8 (fc1: 4 from the pattern)
    assert json.loads((out / "adapter_config.json").read_text())["use_rslora"] is True
    best, last = (read_arrays(out / "checkpoints" / f"step-00000{i}") for i in (2, 4))
    written = _adapter(out)
    names = [k for k in best if k.startswith("tower.")]
    assert len(names) == 12
    for name in names:
        path, which = name[len("tower."):].rsplit(".lora_", 1)
        np.testing.assert_array_equal(written[tower_lora_key(path, which, trainer.vision.vision)], best[name])
    assert any(not np.array_equal(best[k], last[k]) for k in names)


def test_tower_lora_pissa_residual_and_converted_adapter_equal_peft(chat_vlm, tmp_path):
    """--lora-init pissa with LoRA on the tower: each tower module's residual base equals PEFT's (its base weight
    after init_lora_weights="pissa"), and after 2 steps the adapter written (converted to rank 2r on the original
    base, as PEFT's path_initial_model_for_weight_conversion writes it) loads in PeftModel on the untouched model
    with the trained model's logits."""
    import copy

    import peft
    import torch

    from test_gemma3_vision import hf_out
    from test_gemma3_vision_training import our_examples
    from wgpu_train.models.vision import tower_lora_key
    from wgpu_train.training.config import TrainConfig
    from wgpu_train.training.trainer import Trainer

    hf, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    trainer = Trainer(TrainConfig(out=str(tmp_path / "run"), **_run_kw(
        folder, data, lora_targets=TOWER_TARGETS, lora_init="pissa", max_steps=2, lr=1e-3))).setup()
    vision = trainer.vision
    tower = r"model\.vision_tower\.encoder\.layers\.\d+\.(self_attn\.(q_proj|out_proj)|mlp\.fc1)"
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=8, lora_alpha=16, target_modules=tower,
                                                                 init_lora_weights="pissa"))
    theirs = dict(pm.named_parameters())
    assert len(vision.tower_init) == 6
    for path in vision.tower_init:
        key = tower_lora_key(path, "A", vision.vision).replace(".lora_A.weight", ".base_layer.weight")
        assert_close(vision.tower.w[path + ".weight"], theirs[key].detach().numpy(), "init_residual", path)
    trainer.train()
    (examples, _), _ = our_examples(folder)
    ex = examples[1]
    ids = ex.input_ids[None].astype(np.int64)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "run").eval()
    assert loaded.peft_config["default"].r == 16
    with torch.no_grad():
        want = hf_out(loaded, ids, np.ones_like(ids), vision.pixel_values(ex.images), image_id=7).logits.numpy()
    assert_close(vision.logits(ids, ex.images), want, "init_logits", "the converted adapter in PEFT")


@pytest.mark.parametrize("targets, message", [
    ("q_proj,multi_modal_projector", "LoRA target 'multi_modal_projector': not supported on the vision side"),
    ("vision_tower", "the vision tower's alone; name the language model's too"),
    ("q_proj,fc2", "LoRA on the vision tower does not take --lora-dropout yet")])
def test_tower_targets_refused_in_one_line(chat_vlm, tmp_path, capsys, targets, message):
    from wgpu_train.cli.main import main

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records())
    assert main(["finetune", "--model", str(folder), "--data", str(data), "--backend", "numpy", "--lora-targets",
                 targets, "--lora-dropout", "0.1", "--no-progress", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(message in line for line in err), err


def test_tower_targets_on_a_text_only_model_or_data_refused(chat_vlm, tmp_path, capsys):
    from finetune_helpers import make_data_dir, make_model_dir
    from wgpu_train.cli.main import main

    _, folder, _ = chat_vlm
    text_model, text_data = make_model_dir(tmp_path / "model"), make_data_dir(tmp_path / "data", n_train=4)
    capsys.readouterr()
    for model, data, message in ((text_model, text_data, "is a text-only model (no vision tower)"),
                                 (folder, text_data, "trains on records with images")):
        assert main(["finetune", "--model", str(model), "--data", str(data), "--backend", "numpy", "--lora-targets",
                     "q_proj,fc1", "--no-progress", "--out", str(tmp_path / "run"), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
    from wgpu_train.training.config import TrainConfig
    from wgpu_train.training.tower_lora import check_tower_targets

    check_tower_targets(TrainConfig(lora_targets="q_proj,fc1", objective="dpo"), folder)     # DPO: the engine's step


# ---- pipeline stages with images --------------------------------------------------------------------------------

def test_two_pipeline_stages_with_images_equal_one_process(chat_vlm, tmp_path):
    """Two NumPy pipeline stages (in this process) under 1F1B: the tower runs in the driver, its embeddings enter
    the first stage, every stage's attention takes the images' blocks; the losses, validation loss and adapter
    after 3 steps are one process's, with LoRA on the tower too, and so is exact match of greedy answers with images
    (generated through the stages). (WebGPU stages with images: test_vision_stages_wgpu.py.)"""
    from wgpu_train.distributed.pipeline_trainer import finetune_pipeline
    from wgpu_train.training.config import TrainConfig

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records() * 2)
    kw = _run_kw(folder, data, batch_size=1, grad_accum=2, max_steps=3, valid_split=0.2, lora_dropout=0.1)
    one = wgpu_train.finetune(out=str(tmp_path / "one"), eval_generate=True, max_new_tokens=4, **kw)
    two = finetune_pipeline(TrainConfig(out=str(tmp_path / "two"), pipeline_stages=2, eval_generate=True,
                                        max_new_tokens=4, **kw), local=True)
    assert two["pipeline"]["stages"] == 2 and two["exact_match_n"] == one["exact_match_n"] > 0
    assert (two["exact_match_before"], two["exact_match_after"]) == (one["exact_match_before"],
                                                                     one["exact_match_after"])
    _assert_same_run(tmp_path / "one", tmp_path / "two", "pipeline_numpy")
    for key in ("valid_loss_before", "valid_loss_after"):
        assert_close(np.float64(two[key]), one[key], "pipeline_numpy", key)
    # LoRA on the tower: the image rows' gradient comes back from the first stage to the tower in the driver
    tower = kw | dict(lora_targets=TOWER_TARGETS, lora_dropout=0.0)
    wgpu_train.finetune(out=str(tmp_path / "tower-one"), **tower)
    finetune_pipeline(TrainConfig(out=str(tmp_path / "tower-two"), pipeline_stages=2, **tower), local=True)
    _assert_same_run(tmp_path / "tower-one", tmp_path / "tower-two", "pipeline_numpy")
    assert sum(".vision_tower." in k for k in _adapter(tmp_path / "tower-two")) == 12


def test_dpo_and_grpo_with_images_through_two_pipeline_stages_equal_one_process(pref_setup, tmp_path):
    """DPO and GRPO with images through two NumPy pipeline stages (in this process): the tower runs in the driver,
    each scored or trained micro-batch's image tokens go to every stage (GRPO's reference, the starting adapter
    the stages hold, scores with them too, and its rollouts prefill the images through the stages). The losses
    and adapter after 2 steps (and GRPO's completions) are one process's (DPO's: one process that also scores the
    step's rows first, then takes the weighted step); on WebGPU stages: test_vision_stages_wgpu.py."""
    from test_pipeline_runs import TwoPasses
    from test_vision_preference import config, grpo_records, id_reward, length_reward, write_pref_data
    from wgpu_train.distributed.dispatch import finetune
    from wgpu_train.distributed.pipeline_trainer import finetune_pipeline

    root, folder, _, _ = pref_setup
    start = _adapter(root / "adapter")
    dpo = dict(objective="dpo", batch_size=1, grad_accum=2, max_steps=2, lr=1e-2)
    TwoPasses(config(root, folder, tmp_path / "dpo-one", **dpo), log=lambda m: None).run()   # the stages' path
    finetune_pipeline(config(root, folder, tmp_path / "dpo-two", pipeline_stages=2, **dpo), local=True)
    _assert_same_run(tmp_path / "dpo-one" / "run", tmp_path / "dpo-two" / "run", "pipeline_numpy", 2, start)
    data = write_pref_data(tmp_path / "data", grpo_records() * 2)
    grpo = dict(data=str(data), objective="grpo", batch_size=2, num_generations=2, max_completion_length=5,
                max_steps=2, beta=0.04, temperature=0.8, seed=3, lr=1e-2, grad_accum=2)
    rewards = [length_reward, id_reward]
    finetune(config(root, folder, tmp_path / "grpo-one", **grpo), reward_funcs=rewards)
    two = finetune_pipeline(config(root, folder, tmp_path / "grpo-two", pipeline_stages=2, **grpo), local=True,
                            reward_funcs=rewards)
    assert two["pipeline"]["stages"] == 2 and two["images"] == 4
    one, two = tmp_path / "grpo-one" / "run", tmp_path / "grpo-two" / "run"
    assert (two / "completions.jsonl").read_text() == (one / "completions.jsonl").read_text()
    _assert_same_run(one, two, "pipeline_numpy", 2, start)
    # the objective's input checks hold on both paths, finetune's and finetune_pipeline's own
    for bad, kw, message in ((dict(images_demo=True), {}, "--images-demo trains sft only"),
                             ({}, dict(reward_funcs=rewards), "reward_funcs are GRPO's rewards: --objective dpo")):
        for run in (finetune, lambda c, **k: finetune_pipeline(c, local=True, **k)):
            with pytest.raises(ConfigError, match=message) as e:
                run(config(root, folder, tmp_path / "bad", pipeline_stages=2, **dpo, **bad), **kw)
            assert "\n" not in str(e.value)


def test_vision_model_over_local_stages_gives_one_process_loss_and_gradients(chat_vlm):
    """The Python API over pipeline stages: a VisionModel whose language model is 2 NumPy stages gives one
    process's loss and LoRA gradients with images (set_images reaches every stage, forward_backward's too), and
    its greedy answer (a prefill with the images through the stages' KV caches)."""
    from test_gemma3_vision_training import our_examples
    from wgpu_train.distributed.pipeline_model import inference_plan, pipeline_model
    from wgpu_train.engines.vision_model import attach_vision, load_vision_model
    from wgpu_train.models.config import ModelConfig

    _, folder, _ = chat_vlm
    (examples, _), _ = our_examples(folder)
    ex = examples[0]
    ids, labels = ex.input_ids[None].astype(np.int64), ex.labels[None]
    cfg = ModelConfig.from_folder(folder)
    staged = attach_vision(pipeline_model(folder, cfg, inference_plan(cfg, 2, None), backend="numpy", local=True),
                           folder)
    one = load_vision_model(folder)
    lora = wgpu_train.LoraConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj"))
    for vm in (staged, one):
        vm.model.add_lora(lora, seed=3)
    (loss_s, grads_s), (loss_1, grads_1) = (vm.loss_and_grads(ids, labels, ex.images) for vm in (staged, one))
    assert_close(np.float64(loss_s), loss_1, "pipeline_numpy", "loss")
    assert set(grads_s) == set(grads_1)
    for k in grads_1:
        assert_close(grads_s[k], grads_1[k], "pipeline_numpy", k)
    assert max(float(np.abs(g).max()) for g in grads_1.values()) > 0
    ask = examples[1]                                                           # one image, then its answer
    prompt = ask.input_ids[:int(np.flatnonzero(ask.labels != -100)[0])]
    answers = [vm.generate(prompt, ask.images, max_new_tokens=6) for vm in (staged, one)]
    assert answers[0] == answers[1] and len(answers[0]) == 6
    n, last = len(prompt), []
    for vm in (staged, one):                    # the prefill's logits themselves
        ids, images = vm.prompt_images(prompt, ask.images)
        engine = vm.model.engine
        kv = engine.new_kv_cache(1, n)
        engine.set_images(images)
        last.append(engine.forward_rows(ids, np.zeros(n, np.int32), np.arange(n, dtype=np.int32), kv,
                                        np.array([n - 1])))
        engine.set_images(None)
        engine.free_kv_cache(kv)
    assert_close(last[0], last[1], "pipeline_numpy", "prefill logits with an image")
    staged.model.engine.close()


def test_two_ray_workers_with_images_equal_one_process(chat_vlm, pref_setup, tmp_path):
    """Records with images (LoRA on the tower too) on two Ray Train workers of a local Ray (2 CPUs), each running
    its rows' images through its own tower: the adapter of one process with the whole batch; and DPO on TRL's
    vision pairs (each worker reads the pairs' image files itself), as one process trains it."""
    import os
    from pathlib import Path

    ray = pytest.importorskip("ray", reason="Ray Train is the test extra's (pip install -e '.[test]')")
    from wgpu_train.distributed.dispatch import finetune

    _, folder, _ = chat_vlm
    data = write_vision_data(tmp_path / "data", vision_records() + vision_records()[:1])
    kw = _run_kw(folder, data, batch_size=1, max_steps=2, lora_targets=TOWER_TARGETS)
    finetune(out=str(tmp_path / "one"), grad_accum=2, **kw)
    from test_vision_preference import config

    root, _, _, _ = pref_setup
    dpo = dict(objective="dpo", batch_size=1, max_steps=2, lr=1e-2)
    finetune(config(root, folder, tmp_path / "dpo-one", grad_accum=2, **dpo))
    path = os.pathsep.join([str(Path(wgpu_train.__file__).resolve().parent.parent), str(Path(__file__).parent)])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": path, "OPENBLAS_NUM_THREADS": "1", "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}})
    try:
        two = finetune(out=str(tmp_path / "two"), num_workers=2, **kw)
        dpo_two = finetune(config(root, folder, tmp_path / "dpo-two", num_workers=2, **dpo))
    finally:
        ray.shutdown()
    assert two["data_parallel"]["workers"] == 2 and two["images"] == 5
    _assert_same_run(tmp_path / "one", tmp_path / "two", "data_parallel_tower_numpy", steps=2)
    assert dpo_two["data_parallel"]["workers"] == 2 and dpo_two["images"] == 4
    _assert_same_run(tmp_path / "dpo-one" / "run", tmp_path / "dpo-two" / "run", "data_parallel_numpy", steps=2,
                     start=_adapter(root / "adapter"))
