"""Images through WebGPU pipeline stages (engines/webgpu/stage.py) against one WebGPU process: the tower in the
driver, its embeddings into the first stage, every stage's attention taking Gemma 3's bidirectional image blocks and
its RoPE Qwen3-VL's M-RoPE positions, the stage holding a DeepStack layer its features; training (LoRA on the SigLIP
tower too: the image rows' gradient back from the first stage), and greedy generation through the stages' caches."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train
from wgpu_train.errors import ConfigError

from conftest import require_adapter
from test_gemma3_vision_training import chat_vlm, our_examples, vision_records, write_vision_data  # noqa: F401
from test_qwen3_vl import PAD, images, records, span, vlm  # noqa: F401  (chat_vlm, vlm: the tiny models' fixtures)
from test_vision_distributed import TOWER_TARGETS, _adapter, _losses
from test_vision_preference import pref_setup  # noqa: F401  (fixture: a PEFT adapter and TRL's vision pairs)
from tolerances import assert_close


def _staged_and_one(folder):
    """(a VisionModel over 2 WebGPU stages in this process, one on one WebGPU process), both with the same LoRA on
    q and v."""
    from wgpu_train.distributed.pipeline_model import inference_plan, pipeline_model
    from wgpu_train.engines.vision_model import attach_vision, load_vision_model
    from wgpu_train.models.config import ModelConfig

    cfg = ModelConfig.from_folder(folder)
    staged = attach_vision(pipeline_model(folder, cfg, inference_plan(cfg, 2, None), backend="wgpu", local=True,
                                          precision="fp32"), folder)
    one = load_vision_model(folder, backend="wgpu", precision="fp32")
    for vm in (staged, one):
        vm.model.add_lora(wgpu_train.LoraConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj")), seed=3)
    return staged, one


def _same_logits_gradients_and_answer(staged, one, ids, labels, imgs, prompt, prompt_images):
    """The logits (the last stage's at the image tokens too, which its blocks and positions change), loss and LoRA
    gradients of ids (1, T) with imgs, and the greedy answer to prompt (T',) with prompt_images: one process's."""
    assert_close(staged.logits(ids, imgs), one.logits(ids, imgs), "pipeline_wgpu", "logits with images")
    (loss_s, grads_s), (loss_1, grads_1) = (vm.loss_and_grads(ids, labels, imgs) for vm in (staged, one))
    assert_close(np.float64(loss_s), loss_1, "pipeline_wgpu", "loss with images")
    assert set(grads_s) == set(grads_1) and max(float(np.abs(g).max()) for g in grads_1.values()) > 0
    for k in grads_1:
        assert_close(grads_s[k], grads_1[k], "pipeline_wgpu", k)
    answers = [vm.generate(prompt, prompt_images, max_new_tokens=6) for vm in (staged, one)]
    assert answers[0] == answers[1] and len(answers[0]) == 6


def test_gemma3_through_wgpu_stages_equals_one_process(chat_vlm, tmp_path):  # noqa: F811
    """Gemma 3 on 2 WebGPU stages: one WebGPU process's logits, loss and LoRA gradients with images (the second
    stage's attention bidirectional within each image) and its greedy answer; `finetune --pipeline-stages 2` under 1F1B with
    LoRA on the SigLIP tower too gives one process's losses and adapter after 2 steps."""
    from wgpu_train.distributed.pipeline_trainer import finetune_pipeline
    from wgpu_train.training.config import TrainConfig

    require_adapter()
    _, folder, _ = chat_vlm
    (examples, _), _ = our_examples(folder)
    ex, ask = examples[0], examples[1]
    prompt = ask.input_ids[:int(np.flatnonzero(ask.labels != -100)[0])]     # one image, then its answer
    staged, one = _staged_and_one(folder)
    try:
        _same_logits_gradients_and_answer(staged, one, ex.input_ids[None].astype(np.int64), ex.labels[None],
                                        ex.images, prompt, ask.images)
    finally:
        staged.model.engine.close()
    data = write_vision_data(tmp_path / "data", vision_records() * 2)
    kw = dict(model=str(folder), data=str(data), backend="wgpu", precision="fp32", batch_size=1, grad_accum=2,
              max_steps=2, lr=1e-2, valid_split=0.0, lora_targets=TOWER_TARGETS, no_progress=True, log_every=1)
    wgpu_train.finetune(out=str(tmp_path / "one"), **kw)
    two = finetune_pipeline(TrainConfig(out=str(tmp_path / "two"), pipeline_stages=2, **kw), local=True)
    assert two["pipeline"]["stages"] == 2
    mine, theirs = _adapter(tmp_path / "two"), _adapter(tmp_path / "one")
    assert sorted(mine) == sorted(theirs) and sum(".vision_tower." in k for k in mine) == 12
    for k in theirs:
        assert_close(mine[k], theirs[k], "pipeline_wgpu", k)
    assert max(float(np.abs(theirs[k]).max()) for k in theirs if ".vision_tower." in k and "lora_B" in k) > 1e-4
    assert_close(np.array(_losses(tmp_path / "two")), np.array(_losses(tmp_path / "one")), "pipeline_wgpu", "losses")


def test_qwen3_vl_through_wgpu_stages_equals_one_process(vlm, tmp_path):  # noqa: F811
    """Qwen3-VL on 2 WebGPU stages (the second holds a DeepStack layer): every stage rotates by the images' M-RoPE
    positions, in training and in generation's prefill and decode; one WebGPU process's logits, loss, LoRA gradients, two
    train steps of two micro-batches each with its own images, and greedy tokens (also serve's DecodeBatch, an image
    row beside a text row); the image buffers each stage holds, as `memory` estimates them. Its tower's LoRA through
    the stages (no DeepStack gradients come back) is refused in one line."""
    from wgpu_train.distributed.pipeline_trainer import finetune_pipeline
    from wgpu_train.engines.generate import DecodeBatch
    from wgpu_train.engines.protocol import OptimizerParams
    from wgpu_train.engines.resources import StageImages
    from wgpu_train.engines.webgpu.stage_memory import image_input_bytes, in_flight
    from wgpu_train.training.config import TrainConfig

    require_adapter()
    _, folder, _ = vlm
    staged, one = _staged_and_one(folder)
    try:
        imgs = images(3, seed=3)
        ids = np.array([[7, *span(one, imgs[0]), 11, 12, *span(one, imgs[1]), 13, 14]])
        _same_logits_gradients_and_answer(staged, one, ids, ids, imgs[:2], ids[0, :-2], imgs[:2])
        # serve's continuous batch over the stages: the image row (M-RoPE shifted decode) beside a text row
        batch = DecodeBatch(staged.model.engine, 2, 48)
        text = batch.add([7, 11, 12], 5)
        prompt, tokens = staged.prompt_images(ids[0, :-2], imgs[:2])
        row = batch.add(prompt, 5, images=tokens)
        got = {text: [], row: []}
        while len(batch):
            for t in batch.step():
                got[t.slot].append(t.id)
        batch.close()
        assert got[row] == one.generate(ids[0, :-2], imgs[:2], max_new_tokens=5)
        assert got[text] == one.model.generate([7, 11, 12], max_new_tokens=5)
        rows = [ids[0], np.array([8, 9, *span(one, imgs[2]), 15])]
        hp, out = OptimizerParams(lr=1e-2), []
        for vm in (staged, one):
            mbs = []
            for row, own in zip(rows, (imgs[:2], imgs[2:])):
                targets = np.where(row == PAD, -100, np.roll(row, -1))[None]
                targets[0, -1] = -100
                n = len(row)
                mbs.append((vm._text_ids(row[None]).astype(np.int32), targets, np.ones((1, n), np.int32),
                            np.arange(n, dtype=np.int32)[None], vm.image_tokens(row[None], own)))
            out.append([vm.model.engine.train_step(mbs, hp, step) for step in (1, 2)] +
                       [vm.model.engine.lora_tensors()])
        (*steps_s, lora_s), (*steps_1, lora_1) = out
        for got, want in zip(steps_s, steps_1):
            assert got[1] == want[1] and got[3] == want[3]
            assert_close(np.array(got[::2]), np.array(want[::2]), "pipeline_wgpu", "loss and norm")
        assert set(lora_s) == set(lora_1)
        for path in lora_1:
            for a, b in zip(lora_s[path], lora_1[path]):
                assert_close(a, b, "pipeline_wgpu", path)
        # `memory --pipeline-stages`' image inputs are what each stage holds: a slot of buffers per micro-batch in
        # flight (the first stage: both micro-batches'; the last: one slot, grown to the wider's), each buffer
        # the estimate's elements up to its power-of-two capacity (16 at least)
        plan = staged.model.engine.plan
        for s, stage in enumerate(staged.model.engine.runner.stages):
            slots = stage.image_inputs._slots
            assert len(slots) == in_flight("1f1b", 2, s, 2)
            wants = [image_input_bytes(one.model.config, StageImages(int((row == PAD).sum()), 2, mrope=True), 1,
                                       len(row), plan.stages[s], s == 0) for row in rows]
            want = sum(wants) if len(slots) == 2 else max(wants)
            got = sum(buf.size for held in slots.values() for buf, _ in held.values())
            assert want <= got < 2 * want + 64 * sum(map(len, slots.values())), (s, got, want)
            for held in slots.values():
                assert ("grad" in held) == (s == 0) and sum(f"deepstack {k}" in held for k in (0, 1)) == 1
    finally:
        staged.model.engine.close()
    data = write_vision_data(tmp_path / "data", records())
    with pytest.raises(ConfigError, match="DeepStack trains without pipeline stages") as e:
        finetune_pipeline(TrainConfig(model=str(folder), data=str(data), backend="wgpu", out=str(tmp_path / "stages"),
                                      max_steps=1, pipeline_stages=2, valid_split=0.0, lora_targets=("q_proj", "qkv"),
                                      no_progress=True), local=True)
    assert "\n" not in str(e.value)


def test_dpo_kto_and_grpo_with_images_through_wgpu_stages_equal_one_process(pref_setup, tmp_path):  # noqa: F811
    """DPO, KTO and GRPO with images through 2 WebGPU stages (in this process): the tower in the driver, each scored
    or trained micro-batch's image tokens sent to every stage (GRPO's reference, the starting adapter the stages
    hold, scores with them, and its rollouts prefill the images through the stages' caches). The losses, metrics
    and adapter after 2 steps, and GRPO's completions, are one WebGPU process's (DPO's and KTO's: one that also
    scores the step's rows first, then takes the weighted step)."""
    from test_pipeline_runs import TwoPasses
    from test_vision_preference import config, grpo_records, id_reward, length_reward, write_pref_data
    from wgpu_train.distributed.pipeline_trainer import finetune_pipeline

    require_adapter()
    root, folder, _, _ = pref_setup
    start = _adapter(root / "adapter")
    gpu = dict(backend="wgpu", precision="fp32", max_steps=2, lr=1e-2, grad_accum=2)
    for objective, batch_size in (("dpo", 1), ("kto", 2)):          # KTO: unpaired, with its KL rows
        pref = gpu | dict(objective=objective, batch_size=batch_size)
        TwoPasses(config(root, folder, tmp_path / f"{objective}-one", **pref), log=lambda m: None).run()
        finetune_pipeline(config(root, folder, tmp_path / f"{objective}-two", pipeline_stages=2, **pref), local=True)
        _same_run(tmp_path / f"{objective}-one" / "run", tmp_path / f"{objective}-two" / "run", start)
    data = write_pref_data(tmp_path / "data", grpo_records() * 2)
    grpo = gpu | dict(data=str(data), objective="grpo", batch_size=2, num_generations=2, max_completion_length=5,
                      beta=0.04, temperature=0.8, seed=3)
    rewards = [length_reward, id_reward]
    wgpu_train.finetune(config(root, folder, tmp_path / "grpo-one", **grpo), reward_funcs=rewards)
    two = finetune_pipeline(config(root, folder, tmp_path / "grpo-two", pipeline_stages=2, **grpo), local=True,
                            reward_funcs=rewards)
    assert two["pipeline"]["stages"] == 2 and two["images"] == 4
    one, two = tmp_path / "grpo-one" / "run", tmp_path / "grpo-two" / "run"
    assert (two / "completions.jsonl").read_text() == (one / "completions.jsonl").read_text()
    _same_run(one, two, start)


def _same_run(one, two, start):
    """Runs in folders one and two: the adapter, losses and metrics within pipeline_wgpu, and trained 2 steps."""
    import json

    mine, theirs = _adapter(two), _adapter(one)
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], "pipeline_wgpu", k)
    assert max(float(np.abs(theirs[k] - start[k]).max()) for k in theirs if "lora_B" in k) > 1e-3
    rows = [[json.loads(line) for line in (f / "metrics.jsonl").read_text().splitlines()] for f in (one, two)]
    rows = [[r for r in rs if "loss" in r and "split" not in r] for rs in rows]
    assert len(rows[0]) == len(rows[1]) == 2
    for a, b in zip(*rows):
        assert set(a) == set(b)
        for key in a:
            if key.startswith(("loss", "reward", "kl", "rewards/", "logps/", "logits/", "grad_norm")):
                assert_close(np.float64(b[key]), np.float64(a[key]), "pipeline_wgpu", key)
