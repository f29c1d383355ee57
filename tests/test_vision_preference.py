"""Preference objectives and GRPO with images (TRL's vision records) on a tiny Gemma 3: rows as TRL's
DataCollatorForVisionPreference makes them; the first step's loss, metrics and LoRA gradients and the adapter after
three steps equal to TRL's DPOTrainer and GRPOTrainer (scripted completions) with images; rollouts that see the
images; `eval --objective` of the same records; the WebGPU engine equal to the NumPy engine; bad input in one
line."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from wgpu_train.training.config import TrainConfig
from wgpu_train.training.preference_trainer import PreferenceTrainer

from finetune_helpers import first_step_gradients_callback, peft_random_b
from test_gemma3_vision import Image, open_image, peft, torch
from test_gemma3_vision_training import chat_vlm  # noqa: F401  (the tiny Gemma 3 with its processor, shared)
from tolerances import assert_close

STEPS, LR = 3, 5e-3


def pref_records():
    """Three pairs: an image part before the text, a string prompt (TRL puts the image before it), two images."""
    red, blue = Image.new("RGB", (30, 20), (255, 0, 0)), Image.new("RGB", (9, 31), (0, 0, 255))
    green = Image.new("RGB", (17, 17), (0, 200, 0))
    return [
        {"images": [red], "prompt": [{"role": "user", "content": [{"type": "image"},
                                                                   {"type": "text", "text": "what colour is it?"}]}],
         "chosen": [{"role": "assistant", "content": "red"}], "rejected": [{"role": "assistant", "content": "blue"}]},
        {"images": [green], "prompt": [{"role": "user", "content": "describe the picture"}],
         "chosen": [{"role": "assistant", "content": "green squares"}],
         "rejected": [{"role": "assistant", "content": "red blue"}]},
        {"images": [blue, red], "prompt": [{"role": "user", "content": [
            {"type": "text", "text": "and this, no picture here: describe the picture"}, {"type": "image"},
            {"type": "image"}]}],
         "chosen": [{"role": "assistant", "content": "blue red"}],
         "rejected": [{"role": "assistant", "content": "green"}]},
    ]


def write_pref_data(folder, records):
    """records as a JSONL file beside their images (PNG files, named by position)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for k, rec in enumerate(records):
        paths = []
        for j, im in enumerate(rec["images"]):
            open_image(im).save(folder / f"{k}_{j}.png")
            paths.append(f"{k}_{j}.png")
        lines.append(json.dumps({**rec, "images": paths}))
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "train.jsonl"


@pytest.fixture(scope="module")
def pref_setup(chat_vlm, tmp_path_factory):  # noqa: F811
    """(root, the model folder, the processor, the base model): a PEFT adapter on the language model (B random,
    so policy and reference differ) and the pairs' file."""
    hf, folder, proc = chat_vlm
    root = tmp_path_factory.mktemp("vision_pref")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", lora_dropout=0.0)), 2)
    pm.save_pretrained(root / "adapter")
    write_pref_data(root / "data", pref_records())
    return root, folder, proc, hf


def our_name(name: str) -> str:
    """PEFT's parameter name on the multimodal model as ours (model.layers.0.self_attn.q_proj.lora_A)."""
    return name.replace("base_model.model.", "", 1).replace("model.language_model.", "model.") \
        .replace(".default.weight", "")


def config(root, folder, tmp_path, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(
        model=str(folder), data=str(root / "data" / "train.jsonl"), adapter_path=str(root / "adapter"),
        backend="numpy", out=str(tmp_path / "run"), batch_size=3, lr=LR, lr_schedule="constant", warmup_steps=0,
        max_steps=STEPS, max_grad_norm=1.0, valid_split=0.0, log_every=1, eval_generate=False, no_progress=True,
        max_seq_len=200, objective="dpo", beta=0.1), **kw})


def test_rows_are_trls_vision_collators(pref_setup, tmp_path):
    """Each pair's chosen and rejected rows are the ids TRL's DataCollatorForVisionPreference makes (the prompt
    with its images expanded by Gemma3Processor, the answer tokenized apart), the completion mask its, and both
    rows carry the prompt's images."""
    import trl

    root, folder, proc, _ = pref_setup
    records = [{**r, "images": [open_image(i).convert("RGB") for i in r["images"]]} for r in pref_records()]
    batch = trl.trainer.dpo_trainer.DataCollatorForVisionPreference(proc)(copy.deepcopy(records))
    trainer = PreferenceTrainer(config(root, folder, tmp_path), log=lambda m: None)
    trainer._check_run()
    pairs = trainer.pref["train"]
    n = len(records)
    assert [len(p.images) for p in pairs] == [1, 1, 2]
    for k, pair in enumerate(pairs):
        for row, i in zip(pair.rows(), (k, n + k)):
            real = batch["attention_mask"][i].numpy() == 1
            np.testing.assert_array_equal(row.input_ids, batch["input_ids"][i].numpy()[real])
            np.testing.assert_array_equal(row.labels != -100, batch["completion_mask"][i].numpy()[real] == 1)
            assert row.images == pair.images


def test_first_step_and_three_steps_equal_trls_dpo_with_images(pref_setup, tmp_path):
    """TRL 1.16's DPOTrainer on the same PEFT model, pairs and images (the reference: the adapter off): our first
    step's loss, TRL's metrics and the LoRA gradients, then the adapter after three AdamW steps."""
    import datasets
    import trl

    from peft import PeftModel

    root, folder, proc, hf = pref_setup
    torch.manual_seed(0)
    pm = PeftModel.from_pretrained(copy.deepcopy(hf), str(root / "adapter"), is_trainable=True)
    grabber = first_step_gradients_callback(pm)
    records = [{**r, "images": [open_image(i).convert("RGB") for i in r["images"]]} for r in pref_records()]
    records[1]["prompt"] = [{"role": "user", "content": [{"type": "image"},     # Arrow takes one type of content
                                                         {"type": "text", "text": "describe the picture"}]}]
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(records),
                         learning_rate=LR, lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1,
                         max_grad_norm=1.0, report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0,
                         max_length=None, beta=0.1, loss_type=["sigmoid"], remove_unused_columns=False)
    trl_trainer = trl.DPOTrainer(model=pm, args=args, train_dataset=datasets.Dataset.from_list(records),
                                 processing_class=proc, callbacks=[grabber])
    trl_trainer.train()
    history = [h for h in trl_trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    trl_grads = {our_name(k): v for k, v in grabber.grads.items()}
    trl_after = {our_name(n): p.detach().numpy() for n, p in pm.named_parameters() if ".default." in n}

    trainer = PreferenceTrainer(config(root, folder, tmp_path), log=lambda m: None).setup()
    indices = trainer.stream.epoch_batches(0)[0]
    result, scored = trainer._objective("train", indices)
    assert_close(np.float64(result.loss), np.float64(history[0]["loss"]), "preference_vs_trl_loss", "loss")
    for key, value in result.metrics.items():
        assert_close(np.float64(value), np.float64(history[0][key]), "preference_vs_trl_loss", key)
    engine = trainer.engine
    engine.zero_grads()
    total = float(scored.targets.sum())
    for ids, targets, seg, pos, w, images in trainer.weighted_micro_batches(result, scored):
        engine.set_images(images)
        engine.forward_backward(ids, targets, seg, pos, w / np.float32(total))
        engine.set_images(None)
    grads = engine.gradients()
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    clip = min(1.0, 1.0 / (norm + 1e-6))                   # torch's clip_grad_norm_ (TRL's grads are clipped)
    assert set(grads) == set(trl_grads)
    for k, g in grads.items():
        assert np.abs(trl_grads[k]).max() > 0, k
        assert_close(g * clip, trl_grads[k], "preference_vs_trl_grads", k)

    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "grad_norm" in r]
    assert len(steps) == len(history) == STEPS
    for mine, theirs in zip(steps, history):
        for key in ("loss", "rewards/margins"):
            assert_close(np.float64(mine[key]), np.float64(theirs[key]), "preference_vs_trl_loss", key)
    after = engine.trainable()
    assert set(after) == set(trl_after)
    for k, v in after.items():
        assert_close(v, trl_after[k], "preference_vs_trl_params", k)


@pytest.mark.parametrize("objective", ["orpo", "kto"])
def test_other_objectives_train_with_images(pref_setup, tmp_path, objective):
    """ORPO (its NLL on the prompt leaves the image's tokens out) and KTO (the pairs unpaired, the KL rows with
    their own prompt's images) train with images: finite losses, the adapter moved."""
    from wgpu_train.formats.safetensors import read_safetensors

    root, folder, _, _ = pref_setup
    summary = PreferenceTrainer(config(root, folder, tmp_path, objective=objective, beta=0.2, max_steps=2),
                                log=lambda m: None).run()
    assert summary["steps"] == 2 and summary["images"] == (8 if objective == "kto" else 4)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in rows if "grad_norm" in r)
    start, after = (read_safetensors(p / "adapter_model.safetensors") for p in (root / "adapter", tmp_path / "run"))
    assert any(np.abs(after[k] - start[k]).max() > 0 for k in start)


def test_orpo_never_trains_an_images_tokens(pref_setup, tmp_path):
    """ORPO's chosen rows target every token but an image's run (boi, the image tokens, eoi)."""
    root, folder, _, _ = pref_setup
    trainer = PreferenceTrainer(config(root, folder, tmp_path, objective="orpo"), log=lambda m: None)
    trainer._check_run()
    scored_micro = trainer.scorer.pair_micro_batches(trainer.pref["train"], np.arange(3))[0]
    ids, targets = scored_micro[0][0], scored_micro[0][1]
    chosen = targets[:3]                                               # (3, T) the chosen rows, shifted
    assert not np.isin(chosen, [5, 6, 7]).any()
    assert np.isin(ids[:3], [5, 6, 7]).any() and (chosen != -100).sum() > (targets[3:] != -100).sum()


def test_dpo_with_tower_lora_equals_trls(pref_setup, tmp_path, monkeypatch):
    """LoRA on the vision tower (q_proj, fc1) beside the language model's, DPO through the engine's step (the tower
    inside it: TowerImages): TRL 1.16's DPOTrainer on the same PEFT adapter (B random everywhere, so policy and
    reference differ in the tower too; TRL's reference is the adapter off, the tower's LoRA with it): the first
    step's loss, metrics and LoRA gradients (the tower's and the language model's), then both LoRAs after three
    AdamW steps."""
    import datasets
    import trl

    from wgpu_train.engines.numpy.optim import Optimizer
    from wgpu_train.formats.safetensors import read_safetensors
    from wgpu_train.models.vision import tower_lora_key

    root, folder, proc, hf = pref_setup
    torch.manual_seed(0)
    targets = r".*(language_model.*\.(q_proj|v_proj)|vision_tower.*encoder.*\.(q_proj|fc1))"
    lora = peft.LoraConfig(r=2, lora_alpha=5, lora_dropout=0.0, target_modules=targets)
    records = [{**r, "images": [open_image(i).convert("RGB") for i in r["images"]]} for r in pref_records()]
    records[1]["prompt"] = [{"role": "user", "content": [{"type": "image"},     # Arrow takes one type of content
                                                         {"type": "text", "text": "describe the picture"}]}]
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(records),
                         learning_rate=LR, lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1,
                         max_grad_norm=1.0, report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0,
                         max_length=None, beta=0.1, loss_type=["sigmoid"], remove_unused_columns=False)
    trl_trainer = trl.DPOTrainer(model=copy.deepcopy(hf), args=args, train_dataset=datasets.Dataset.from_list(records),
                                 processing_class=proc, peft_config=lora)     # its reference: the adapter off
    pm = peft_random_b(trl_trainer.model, 3)
    pm.save_pretrained(tmp_path / "adapter")
    pm.train()
    grabber = first_step_gradients_callback(pm)
    trl_trainer.add_callback(grabber)
    trl_trainer.train()
    trl_grads = {k.replace(".default.weight", ".weight"): v for k, v in grabber.grads.items()}
    history = [h for h in trl_trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    pm.save_pretrained(tmp_path / "trl_after")

    trainer = PreferenceTrainer(config(root, folder, tmp_path, adapter_path=None, lora_rank=2, lora_alpha=5,
                                       lora_targets="q_proj,v_proj,vision_tower.q_proj,fc1"), log=lambda m: None)
    trainer.setup()
    assert trainer.vision.in_step and trainer.vision.tower.lora
    trainer.vision.load_adapter(tmp_path / "adapter")       # PEFT's tensors, the tower's and the language model's
    result, _ = trainer._objective("train", trainer.stream.epoch_batches(0)[0])
    assert_close(np.float64(result.loss), np.float64(history[0]["loss"]), "preference_vs_trl_loss", "loss")
    for key, value in result.metrics.items():
        assert_close(np.float64(value), np.float64(history[0][key]), "preference_vs_trl_loss", key)
    first: list = []        # the first step's gradients of both optimizers (the engine's, the tower's), and the norm
    apply = Optimizer.apply_update
    monkeypatch.setattr(Optimizer, "apply_update", lambda self, norm, *a, **k: (
        len(first) < 2 and first.append(({n: g.copy() for n, g in self.grads.items()}, norm))) or apply(
        self, norm, *a, **k))
    trainer.train()
    (lm, norm), (tower, _) = first
    clip = min(1.0, 1.0 / (norm + 1e-6))                   # torch's clip_grad_norm_ (TRL's grads are clipped)
    grads = {**{"base_model.model." + k.replace("model.", "model.language_model.", 1) + ".weight": g
                for k, g in lm.items()},
             **{tower_lora_key(k.rsplit(".lora_", 1)[0], k[-1], trainer.vision.vision): g for k, g in tower.items()}}
    assert set(grads) == set(trl_grads) and len(tower) == 2 * 2 * 2
    for k, g in grads.items():
        assert np.abs(trl_grads[k]).max() > 0, k
        assert_close(g * clip, trl_grads[k], "preference_vs_trl_grads", k)
    ours, theirs = (read_safetensors(d / "adapter_model.safetensors") for d in (tmp_path / "run",
                                                                                tmp_path / "trl_after"))
    assert set(ours) == set(theirs) and sum(".vision_tower." in k for k in ours) == 2 * 2 * 2
    before = read_safetensors(tmp_path / "adapter" / "adapter_model.safetensors")
    for k, v in theirs.items():
        assert np.abs(v - before[k]).max() > 1e-4, f"{k} trained"
        assert_close(ours[k], v, "preference_vs_trl_params", k)


@pytest.mark.parametrize("tower", [False, True], ids=["", "tower-lora"])
def test_dpo_with_images_on_webgpu_equals_numpy(pref_setup, tmp_path, rt, tower):
    """DPO with images on the WebGPU engine (the tower on the device inside the engine's step, the reference the
    adapter off in the same submission; with LoRA on the tower too, its reference's images the tower's LoRA off):
    the losses and the adapter after two steps are the NumPy engine's."""
    from wgpu_train.formats.safetensors import read_safetensors

    root, folder, _, _ = pref_setup
    runs = {}
    more = dict(adapter_path=None, lora_rank=2, lora_alpha=5, lora_targets="q_proj,v_proj,vision_tower") if tower \
        else {}
    for backend in ("numpy", "wgpu"):
        out = tmp_path / backend
        kw = dict(device=str(rt.info.index)) if backend == "wgpu" else {}
        PreferenceTrainer(config(root, folder, out, backend=backend, max_steps=2, lr=1e-2, **kw, **more),
                          log=lambda m: None).run()
        rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        runs[backend] = ([r["loss"] for r in rows if "grad_norm" in r],
                         read_safetensors(out / "run" / "adapter_model.safetensors"))
    (loss_n, ad_n), (loss_w, ad_w) = runs["numpy"], runs["wgpu"]
    assert len(loss_n) == 2 and set(ad_n) == set(ad_w)
    assert sum(".vision_tower." in k for k in ad_n) == (2 * 2 * 6 if tower else 0)
    assert all(np.abs(ad_n[k]).max() > 0 for k in ad_n if ".vision_tower." in k), "the tower's LoRA trained"
    assert_close(np.array(loss_w), np.array(loss_n), "loss_f32", "DPO losses with images")
    for name in ad_n:
        assert_close(ad_w[name], ad_n[name], "gpu_params_after_steps_lr1e-2", name)


GRPO = ["--objective", "grpo", "--num-generations", "2", "--reward", "exact_match"]


def test_cli_dpo_on_images_and_bad_input(pref_setup, tmp_path, capsys):
    """`finetune --objective dpo --data` of vision pairs writes an adapter and counts the images; a pair cut
    inside an image is dropped with a count; bad input is one line and exit 2."""
    from wgpu_train.cli.main import main

    root, folder, _, _ = pref_setup
    data = root / "data" / "train.jsonl"
    args = ["finetune", "--model", str(folder), "--backend", "numpy", "--objective", "dpo", "--max-steps", "1",
            "--batch-size", "2", "--no-progress", "--valid-split", "0", "--lora-targets", "q_proj,v_proj"]
    assert main(args + ["--data", str(data), "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["images"] == 4 and summary["data_format"] == "vision" and summary["n_train"] == 3
    assert summary["rows_cut_in_image"] == 0
    # --max-seq-len inside record 2's second image: that pair dropped, counted
    trainer = PreferenceTrainer(config(root, folder, tmp_path / "probe"), log=lambda m: None)
    trainer._check_run()
    pairs = trainer.pref["train"]
    cut_at = max(len(p.prompt_ids) for p in pairs[:2]) + 2
    assert np.flatnonzero(pairs[2].prompt_ids == 7)[-1] >= cut_at
    assert main(args + ["--data", str(data), "--max-seq-len", str(cut_at), "--out", str(tmp_path / "cut")]) == 0
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["rows_cut_in_image"] == 1 and summary["n_train"] == 2 and summary["images"] == 2
    capsys.readouterr()

    def bad(name, change):
        rows = pref_records()
        change(rows)
        return write_pref_data(tmp_path / name, rows)

    cases = [
        (bad("more", lambda r: r[0].update(images=r[0]["images"] * 2)), [],
         "1 image placeholders for 2 images"),
        (bad("fewer", lambda r: r[2].update(images=r[2]["images"][:1])), [], "2 image placeholders for 1 images"),
        (bad("implicit", lambda r: r[1].pop("prompt")), [], 'records with images need an explicit "prompt"'),
        (bad("answer", lambda r: r[0].update(chosen=[{"role": "assistant", "content": [{"type": "image"}]}])), [],
         "chosen: 1 image placeholders for 0 images"),
        (data, ["--truncation-mode", "keep_end"], "--truncation-mode keep_end is not supported with images"),
        (bad("grpo", lambda r: r[0].update(prompt="what colour is it?")), GRPO, 'need "prompt" as a non-empty list'),
        (data, GRPO + ["--max-prompt-length", "9"], "--max-prompt-length is not supported with images yet"),
        (data, ["--max-seq-len", "3"], "no training pairs left after tokenization"),
    ]
    for path, extra, message in cases:
        code = main(args + ["--data", str(path), "--out", str(tmp_path / "bad_run"), "--overwrite"] + extra)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and any(message in line for line in err), (message, err)


def test_eval_objective_with_images_equals_the_first_steps_metrics(pref_setup, tmp_path, capsys):
    """`eval --objective dpo` of the vision pairs with the adapter (the reference: the adapter off) gives the loss
    and TRL's metrics of the PreferenceTrainer's first step over the same pairs with the same reference
    (--precompute-ref-log-probs: the adapter off, test_precomputed_reference_with_images_is_the_adapter_off);
    the adapter as its own --ref-adapter gives log 2; KTO's unpaired records score too; an adapter with LoRA on the
    tower scores with its reference's tower LoRA off; bad input is one line and exit 2."""
    from wgpu_train.cli.main import main

    root, folder, _, hf = pref_setup
    data = root / "data" / "train.jsonl"
    args = ["eval", "--model", str(folder), "--adapter-path", str(root / "adapter"), "--data", str(data),
            "--backend", "numpy", "--batch-size", "3", "--max-seq-len", "200", "--json"]
    assert main(args + ["--objective", "dpo"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["split"] == "train" and got["examples"] == 3 and got["images"] == 4 and got["rows_cut_in_image"] == 0
    trainer = PreferenceTrainer(config(root, folder, tmp_path, precompute_ref_log_probs=True),
                                log=lambda m: None).setup()
    result, _ = trainer._objective("train", trainer.stream.epoch_batches(0)[0])
    assert abs(result.metrics["rewards/margins"]) > 1e-4
    assert_close(np.float64(got["loss"]), np.float64(result.loss), "loss_f32", "loss")
    for key, value in result.metrics.items():
        assert_close(np.float64(got[key]), np.float64(value), "loss_f32", key)
    # --ref-adapter: another model scores the reference with the images too; the adapter itself gives log 2
    assert main(args + ["--objective", "dpo", "--ref-adapter", str(root / "adapter")]) == 0
    same = json.loads(capsys.readouterr().out)
    assert_close(np.float64(same["loss"]), np.log(2.0), "loss_f32", "the policy as its own reference")
    assert same["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert main(args + ["--objective", "kto"]) == 0
    kto = json.loads(capsys.readouterr().out)
    assert kto["examples"] == 6 and kto["images"] == 8 and np.isfinite(kto["loss"])
    assert main(args + ["--objective", "dpo", "--no-chat-template"]) == 2
    assert "--no-chat-template is not supported with images yet" in capsys.readouterr().err
    # an adapter whose only change is LoRA on the tower (its B random, the language model's zero): the policy
    # differs from the reference, which switches the tower's LoRA off with the adapter: the same reference as
    # the language model's adapter's (the model without either)
    tower = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=r".*(language_model|vision_tower).*\.q_proj", lora_dropout=0.0))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if "lora_B" in name and "vision_tower" in name:
                p.normal_(0, 5.0)
    tower.save_pretrained(tmp_path / "tower")
    at = args.index("--adapter-path") + 1
    assert main(args[:at] + [str(tmp_path / "tower")] + args[at + 1:] + ["--objective", "dpo"]) == 0
    with_tower = json.loads(capsys.readouterr().out)

    def reference(m):               # TRL's rewards: beta (0.1) times the policy's log-probability over the reference's
        return [m[f"logps/{k}"] - m[f"rewards/{k}"] / 0.1 for k in ("chosen", "rejected")]

    assert abs(with_tower["rewards/chosen"]) > 1e-4 and abs(with_tower["rewards/rejected"]) > 1e-4
    # the tower's LoRA moves these log-probabilities by 3.5e-3 and more (its rewards over beta): a reference that
    # kept it would be that far off; the same base model scores both to float32 summing's 1e-5
    np.testing.assert_allclose(reference(with_tower), reference(got), rtol=0, atol=2e-4)


def test_eval_objective_with_images_on_webgpu_equals_numpy(pref_setup, rt, capsys):
    """`eval --objective dpo` with images on the WebGPU engine (the reference the adapter off in the same
    submission, each micro-batch's ImageTokens uploaded): the NumPy engine's loss and metrics."""
    from wgpu_train.cli.main import main

    root, folder, _, _ = pref_setup
    args = ["eval", "--objective", "dpo", "--model", str(folder), "--adapter-path", str(root / "adapter"), "--data",
            str(root / "data" / "train.jsonl"), "--batch-size", "2", "--max-seq-len", "200", "--json"]
    got = {}
    for backend in ("numpy", "wgpu"):
        device = ["--device", str(rt.info.index)] if backend == "wgpu" else []
        assert main(args + ["--backend", backend] + device) == 0
        got[backend] = json.loads(capsys.readouterr().out)
    assert got["wgpu"]["backend"] == "wgpu" and got["wgpu"]["images"] == 4
    assert abs(got["numpy"]["rewards/margins"]) > 1e-4
    for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert_close(np.float64(got["wgpu"][key]), np.float64(got["numpy"][key]), "loss_f32", key)


# ---- GRPO with images -------------------------------------------------------------------------------------------

G, MAX_COMPLETION = 2, 6
QUESTIONS = ["what colour is it?", "describe the picture"]


def grpo_records():
    red, green = Image.new("RGB", (30, 20), (255, 0, 0)), Image.new("RGB", (17, 17), (0, 200, 0))
    return [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
             "images": [im]} for q, im in zip(QUESTIONS, (red, green))]


def length_reward(prompts, completions, **kwargs):
    """The answer's length: compares both sides' decoding of conversational completions."""
    return [len(c[0]["content"]) / 8 for c in completions]


def id_reward(prompts, completions, completion_ids, **kwargs):
    return [float(sum(t % 3 == 0 for t in ids)) for ids in completion_ids]


def scripted(eos: int, steps: int) -> list:
    """[generation][prompt][slot] -> completion ids: words of the vocabulary, some ending in EOS, some cut."""
    rng = np.random.default_rng(3)
    return [[[[int(t) for t in rng.integers(10, 150, n)] + ([eos] if n < MAX_COMPLETION else [])
              for n in (rng.integers(1, MAX_COMPLETION), MAX_COMPLETION)] for _ in QUESTIONS] for _ in range(steps)]


def test_grpo_with_images_equals_trl(pref_setup, tmp_path, monkeypatch):
    """TRL 1.16's GRPOTrainer with images (its generation scripted) and ours on the same PEFT adapter, prompts,
    images and completions (beta 0.04: the reference, the adapter off, scores with the images too): the prompts'
    ids, the first step's loss and LoRA gradients, and the adapter after three steps."""
    import datasets
    import trl

    from peft import PeftModel

    from test_grpo_trl import first_step_gradients
    from wgpu_train.training.grpo_trainer import GRPOTrainer

    root, folder, proc, hf = pref_setup
    proc = copy.deepcopy(proc)
    proc.tokenizer.padding_side = "left"    # as TRL loads a processor itself: its image token types left-padded
    tok = proc.tokenizer                    # like its prompts (a right-padding one misplaces the shorter prompt's)
    table = scripted(tok.eos_token_id, STEPS)
    torch.manual_seed(0)
    pm = PeftModel.from_pretrained(copy.deepcopy(hf), str(root / "adapter"), is_trainable=True)
    grabber = first_step_gradients_callback(pm)
    records = [{**r, "images": [open_image(i).convert("RGB") for i in r["images"]]} for r in grpo_records()]
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=G * len(QUESTIONS),
                          num_generations=G, max_completion_length=MAX_COMPLETION, learning_rate=LR,
                          lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1, max_grad_norm=1.0,
                          report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0, beta=0.04)
    trl_trainer = trl.GRPOTrainer(model=pm, reward_funcs=[length_reward, id_reward], args=args,
                                  train_dataset=datasets.Dataset.from_list(records), processing_class=proc,
                                  callbacks=[grabber])
    trl_prompts, generations = {}, []

    def generate(prompt_ids_list, images, fields, num_generations, **kw):
        out, slots = [], [0] * len(QUESTIONS)
        for ids in prompt_ids_list:
            p = next(i for i, q in enumerate(QUESTIONS) if q in tok.decode(ids))
            trl_prompts[p] = list(map(int, ids))
            out.append(list(table[len(generations)][p][slots[p]]))
            slots[p] += 1
        generations.append(out)
        return out, None

    trl_trainer._generate_single_turn = generate
    trl_trainer.train()
    history = [h for h in trl_trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    trl_grads = {our_name(k): v for k, v in grabber.grads.items()}
    trl_after = {our_name(n): p.detach().numpy() for n, p in pm.named_parameters() if ".default." in n}

    write_pref_data(tmp_path / "data", grpo_records())
    ours = []

    def sample(self, examples, seeds):
        slots, ids = [0] * len(QUESTIONS), []
        for ex in examples:
            p = QUESTIONS.index(ex.record.prompt[-1]["content"][-1]["text"])
            ids.append(list(table[len(ours)][p][slots[p]]))
            slots[p] += 1
        ours.append(ids)
        return ids, np.array([c[-1] != tok.eos_token_id for c in ids], bool)

    monkeypatch.setattr(GRPOTrainer, "_sample", sample)
    cfg = config(root, folder, tmp_path, data=str(tmp_path / "data" / "train.jsonl"), objective="grpo",
                 batch_size=G * len(QUESTIONS), num_generations=G, max_completion_length=MAX_COMPLETION, beta=0.04,
                 seed=0)
    trainer = GRPOTrainer(cfg, log=lambda m: None, reward_funcs=[length_reward, id_reward]).setup()
    for p, ex in enumerate(sorted(trainer.prompts["train"], key=lambda e: str(e.record.prompt))):
        q = QUESTIONS.index(ex.record.prompt[-1]["content"][-1]["text"])
        assert list(map(int, ex.input_ids)) == trl_prompts[q]
        assert len(ex.record.images) == 1
    grads, result, gen = first_step_gradients(trainer)
    ours.clear()
    assert_close(np.float64(result.loss), np.float64(history[0]["loss"]), "grpo_vs_trl_loss", "first loss")
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    clip = min(1.0, 1.0 / (norm + 1e-6))
    assert set(grads) == set(trl_grads)
    for k, g in grads.items():
        assert np.abs(trl_grads[k]).max() > 0, k
        assert_close(g * clip, trl_grads[k], "grpo_vs_trl_grads", k)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "grad_norm" in r]
    assert len(steps) == len(history) == STEPS
    for mine, theirs in zip(steps, history):
        for key in ("loss", "kl", "reward", "rewards/length_reward/mean"):
            assert_close(np.float64(mine[key]), np.float64(theirs[key]), "grpo_vs_trl_loss", key)
    for k, v in trainer.engine.trainable().items():
        assert_close(v, trl_after[k], "grpo_vs_trl_params", k)


def test_cli_grpo_samples_with_images(pref_setup, tmp_path, capsys):
    """`finetune --objective grpo` on prompts with images: the rollouts sampled with each prompt's images (the
    KV cache's prefill takes them whole), rewarded, a step taken; completions.jsonl keeps the prompts' image parts."""
    from wgpu_train.cli.main import main

    root, folder, _, _ = pref_setup
    records = [{**r, "answer": a} for r, a in zip(grpo_records(), ("red", "green squares"))]
    data = write_pref_data(tmp_path / "data", records)
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(folder), "--backend", "numpy", "--data", str(data), *GRPO,
                 "--batch-size", "4", "--max-steps", "1", "--max-completion-length", "4", "--no-progress",
                 "--valid-split", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["images"] == 2 and summary["data_format"] == "vision"
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["prompt"][-1]["content"][0] == {"type": "image"} for r in rows)


def test_grpo_rollouts_see_the_images(pref_setup, tmp_path):
    """A rollout at temperature 0 is VisionModel.generate's greedy answer with the prompt's images, and another
    image changes the logits the rollout starts from (the images reach the generation)."""
    from wgpu_train.training.grpo_trainer import GRPOTrainer

    root, folder, _, _ = pref_setup
    data = write_pref_data(tmp_path / "data", [{**r, "answer": "red"} for r in grpo_records()])
    trainer = GRPOTrainer(config(root, folder, tmp_path, data=str(data), objective="grpo", batch_size=4,
                                 num_generations=2, max_completion_length=5, reward="exact_match"),
                          log=lambda m: None).setup()
    ex = trainer.prompts["train"][0]
    stops = list(trainer.tokenizer.eos_token_ids)
    (rollout,) = trainer._generate_rows([ex], temperature=0.0)
    assert rollout == trainer.vision.generate(ex.input_ids, ex.record.images, 5, stops)
    other = Image.new("RGB", (8, 40), (0, 0, 255))
    ids = np.asarray(ex.input_ids)[None]
    a, b = (trainer.vision.logits(ids, images)[0, -1] for images in (ex.record.images, [other]))
    assert np.abs(a - b).max() > 1e-3


def test_precomputed_reference_with_images_is_the_adapter_off(pref_setup, tmp_path):
    """--precompute-ref-log-probs with images (TRL refuses it for vision data; here the base model's scores, the
    adapter off, with each pair's images, kept before training): the first step's loss and metrics equal those of
    the adapter switched off and scored with the step."""
    from wgpu_train.training.preference_scoring import ADAPTER_OFF

    root, folder, _, _ = pref_setup
    results = []
    for k, precompute in enumerate((False, True)):
        trainer = PreferenceTrainer(config(root, folder, tmp_path / str(k), precompute_ref_log_probs=precompute),
                                    log=lambda m: None).setup()
        indices = trainer.stream.epoch_batches(0)[0]
        assert (trainer.reference is not None) == precompute
        results.append(trainer._objective("train", indices)[0] if precompute else
                       trainer.scorer.objective(trainer.engine, trainer.pref["train"], indices, ADAPTER_OFF)[0])
    (a, b) = results
    assert abs(a.metrics["rewards/margins"]) > 1e-4
    assert_close(np.float64(b.loss), np.float64(a.loss), "loss_f32", "loss")
    for key, value in a.metrics.items():
        assert_close(np.float64(b.metrics[key]), np.float64(value), "loss_f32", key)


@pytest.mark.parametrize("tower", [False, True], ids=["", "tower-lora"])
def test_grpo_with_images_on_webgpu_equals_numpy(pref_setup, tmp_path, monkeypatch, rt, tower):
    """GRPO with images on the WebGPU engine (its step's TokenObjective over micro-batches carrying their images,
    the tower inside the step; the reference the adapter off, with LoRA on the tower too its LoRA off): with the
    same scripted completions, the losses, KL and the adapter after two steps are the NumPy engine's."""
    from wgpu_train.formats.safetensors import read_safetensors
    from wgpu_train.training.grpo_trainer import GRPOTrainer

    root, folder, _, _ = pref_setup
    data = write_pref_data(tmp_path / "data", grpo_records())
    table = scripted(1, 2)

    def sample(self, examples, seeds):
        step, slots, ids = self.step, [0] * len(QUESTIONS), []
        for ex in examples:
            p = QUESTIONS.index(ex.record.prompt[-1]["content"][-1]["text"])
            ids.append(list(table[step][p][slots[p]]))
            slots[p] += 1
        return ids, np.array([c[-1] != 1 for c in ids], bool)

    monkeypatch.setattr(GRPOTrainer, "_sample", sample)
    runs = {}
    for backend in ("numpy", "wgpu"):
        kw = dict(device=str(rt.info.index)) if backend == "wgpu" else {}
        cfg = config(root, folder, tmp_path / backend, data=str(data), objective="grpo", backend=backend, lr=1e-2,
                     batch_size=G * len(QUESTIONS), num_generations=G, max_completion_length=MAX_COMPLETION,
                     beta=0.04, max_steps=2, **kw, **(dict(adapter_path=None, lora_rank=2, lora_alpha=5,
                                                           lora_targets="q_proj,v_proj,fc1") if tower else {}))
        GRPOTrainer(cfg, log=lambda m: None, reward_funcs=[length_reward, id_reward]).run()
        rows = [json.loads(line) for line in (tmp_path / backend / "run" / "metrics.jsonl").read_text().splitlines()]
        runs[backend] = ([[r["loss"], r["kl"]] for r in rows if "grad_norm" in r],
                         read_safetensors(tmp_path / backend / "run" / "adapter_model.safetensors"))
    (loss_n, ad_n), (loss_w, ad_w) = runs["numpy"], runs["wgpu"]
    assert len(loss_n) == 2 and set(ad_n) == set(ad_w)
    assert sum(".vision_tower." in k for k in ad_n) == (2 * 2 if tower else 0)
    assert all(np.abs(ad_n[k]).max() > 0 for k in ad_n if ".vision_tower." in k), "the tower's LoRA trained"
    assert_close(np.array(loss_w), np.array(loss_n), "loss_f32", "GRPO losses and KL with images")
    for name in ad_n:
        assert_close(ad_w[name], ad_n[name], "gpu_params_after_steps_lr1e-2", name)


@pytest.fixture(scope="module")
def smol_vlm(tmp_path_factory):
    """test_smolvlm_records' tiny SmolVLM with its processor (its fixture's builder, under another name)."""
    from test_smolvlm_records import chat_vlm as smol

    return smol.__wrapped__(tmp_path_factory)


def test_smolvlm_dpo_and_grpo_with_images(smol_vlm, tmp_path):
    """SmolVLM's tiles through the same paths: a pair's prompt is SmolVLMProcessor's over the chat template's text
    (each image its tiles' prompt) and both rows carry its image; a DPO step and a GRPO step (sampled with the
    images) train."""
    from wgpu_train.training.grpo_trainer import GRPOTrainer

    _, folder, proc = smol_vlm
    red = Image.new("RGB", (60, 25), (255, 0, 0))
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it?"}]}]
    pairs = [{"images": [red], "prompt": prompt, "chosen": [{"role": "assistant", "content": "red"}],
              "rejected": [{"role": "assistant", "content": "blue"}]}] * 2
    data = write_pref_data(tmp_path / "pairs", pairs)
    trainer = PreferenceTrainer(config(tmp_path, folder, tmp_path / "dpo", data=str(data), adapter_path=None,
                                       batch_size=2, max_steps=1, lr=1e-2), log=lambda m: None).setup()
    text = proc.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    expected = proc(text=[text], images=[[red]])["input_ids"][0]
    np.testing.assert_array_equal(trainer.pref["train"][0].prompt_ids, expected)
    assert (expected == 5).sum() > 4        # the tiles' image tokens, more than one tile's
    assert all(row.images == trainer.pref["train"][0].images for row in trainer.pref["train"][0].rows())
    assert trainer.train()["steps"] == 1
    rows = [json.loads(line) for line in (tmp_path / "dpo" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [np.isfinite(r["loss"]) for r in rows if "grad_norm" in r] == [True]
    prompts = write_pref_data(tmp_path / "prompts", [{"prompt": prompt, "images": [red], "answer": "red"}] * 2)
    summary = GRPOTrainer(config(tmp_path, folder, tmp_path / "grpo", data=str(prompts), adapter_path=None,
                                 objective="grpo", batch_size=4, num_generations=2, max_completion_length=3,
                                 max_steps=1, reward="exact_match"), log=lambda m: None).run()
    assert summary["steps"] == 1 and summary["images"] == 2
