"""Pipeline stages, their parts (models/stage_plan.py, engines/numpy/stage.py, distributed/pipeline_engine.py):
stage plans by hand and balanced, the schedules, each stage reading only its tensors, each stage's memory (a
1B-shaped model's too), and S = 2 or 3 stages with M micro-batches under GPipe and 1F1B equal to one process (step
losses, norms, adapters, AdamW moments) on the tiny Llama, Qwen3 and Gemma 3: fp32, bf16, an NF4 base, DoRA in f16,
a trained embedding and head (tied: summed over two stages), full fine-tuning, and generation. Whole runs:
test_pipeline_runs.py."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from finetune_helpers import one_line_error
from tiny_models import build_model, save_model
from tolerances import assert_close
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.distributed.pipeline_engine import LocalStages, PipelineEngine, stage_ops
from wgpu_train.distributed.stage_budget import check_stages_fit, parse_size
from wgpu_train.engines.loading import load_model, load_stage
from wgpu_train.engines.model import Model
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.resources import balanced_stages, estimate_memory, stage_memory
from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig
from wgpu_train.models.stage_plan import parse_stage_layers, plan_stages
from wgpu_train.training.config import default_model_dir

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


# ---- stage plans --------------------------------------------------------------------------------------------

def test_stage_layers_by_hand():
    assert parse_stage_layers("0-1, 2,3-5", 6) == (range(0, 2), range(2, 3), range(3, 6))
    for text, what in (("0-1,1-3", "layer 1 is in two stages"), ("0-1,3", "layer 2 is in no stage"),
                       ("0-4", "the model has layers 0-3"), ("2-3,0-1", "out of order"), ("a-b", "FIRST-LAST")):
        with pytest.raises(ConfigError, match=what):
            parse_stage_layers(text, 4)
    with pytest.raises(ConfigError, match="names 2 stages, --pipeline-stages 3"):
        plan_stages(4, 3, "0-1,2-3")


def test_balanced_stages_weigh_the_embedding_and_head():
    assert plan_stages(4, 2).stages == (range(0, 2), range(2, 4))
    # a head as heavy as two layers moves the cut: the last stage takes one layer
    head = lambda k, a, b: b - a + (2 if k == 1 else 0)          # noqa: E731
    assert plan_stages(4, 2, stage_cost=head).stages == (range(0, 3), range(3, 4))
    with pytest.raises(ConfigError, match="more than the model's 4 layers"):
        plan_stages(4, 5)
    cfg = ModelConfig.from_folder(default_model_dir())
    assert balanced_stages(cfg, 2, None, 4, 64).describe() == "0-1,2-3"


def test_schedules_run_each_micro_batch_once_backwards_in_order():
    for schedule in ("gpipe", "1f1b"):
        for s_count, m in ((2, 1), (3, 4), (4, 2)):
            ops = stage_ops(schedule, s_count, m)
            assert ops[-1] == [("L", j) for j in range(m)]
            for s, stage in enumerate(ops[:-1]):
                assert [j for k, j in stage if k == "F"] == list(range(m))
                assert [j for k, j in stage if k == "B"] == list(range(m))
                held = max(sum(1 for k, j in stage[:i + 1] if k == "F") - sum(1 for k, j in stage[:i + 1] if k == "B")
                           for i in range(len(stage)))
                assert held == (m if schedule == "gpipe" else min(m, s_count - s))


# ---- loading and memory -------------------------------------------------------------------------------------

def file_bytes(folder) -> dict:
    """name -> its bytes in model.safetensors, from the header alone."""
    raw = (folder / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])       # an untied head, a tied one
def test_a_stage_reads_only_its_tensors(tmp_path, arch):
    folder = save_model(build_model(arch, num_hidden_layers=3), tmp_path / arch)
    sizes = file_bytes(folder)
    plan = plan_stages(3, 3, tied=arch == "qwen3")
    read = []
    for s in range(3):
        engine = load_stage(folder, plan, s, precision="fp32")
        layer = f"model.layers.{s}."
        mine = {k for k in sizes if k.startswith(layer)}
        mine |= {"model.embed_tokens.weight"} if s == 0 or (s == 2 and arch == "qwen3") else set()
        mine |= {"model.norm.weight"} | ({"lm_head.weight"} if arch == "llama" else set()) if s == 2 else set()
        assert set(engine.weights()) == mine
        assert engine.weights_bytes_read == sum(sizes[k] for k in mine)
        read.append(engine.weights_bytes_read)
    tied_copy = sizes["model.embed_tokens.weight"] if arch == "qwen3" else 0
    assert sum(read) == sum(sizes.values()) + tied_copy


def test_stage_memory_adds_up_to_the_whole(tmp_path):
    cfg = ModelConfig.from_folder(default_model_dir())
    lora = LoraConfig(r=8)
    whole = estimate_memory(cfg, 4, 64, lora)
    stages = stage_memory(cfg, plan_stages(4, 2), 4, 64, lora, micro_batches=1)
    for key in ("weights", "trainable_state", "logits"):
        assert sum(s[key] for s in stages) == whole[key], key
    # the layers' activations split between the stages; each holds the shared buffers of a layer's backward
    assert whole["activations"] < sum(s["activations"] for s in stages) < 2 * whole["activations"]
    gpipe = stage_memory(cfg, plan_stages(4, 2), 4, 64, lora, micro_batches=4, schedule="gpipe")
    f1b = stage_memory(cfg, plan_stages(4, 2), 4, 64, lora, micro_batches=4, schedule="1f1b")
    assert [s["in_flight"] for s in gpipe] == [4, 1] and [s["in_flight"] for s in f1b] == [2, 1]
    assert f1b[0]["activations"] < gpipe[0]["activations"]


def test_a_stage_over_its_device_memory_is_refused():
    """--device-memory against each stage's estimate: one size for all or one per stage; the first stage over its
    device's named with its layers, estimate and limit."""
    cfg = ModelConfig.from_folder(default_model_dir())
    est = stage_memory(cfg, plan_stages(4, 2, "0-1,2-3"), 2, 64, LoraConfig(), micro_batches=2)
    first, last = (e["total"] for e in est)
    check_stages_fit(est, str(max(first, last)))            # each fits its device: nothing raised
    check_stages_fit(est, f"{first},{last}")
    check_stages_fit(est, None)                             # not given: unchecked
    with pytest.raises(ConfigError, match=r"stage 1 \(layers 2-3\) needs an estimated .* over its device's"):
        check_stages_fit(est, f"{first},{last - 1}")
    assert (parse_size("1.5GiB"), parse_size("16 GB"), parse_size("512")) == (3 * 2**29, 16 * 10**9, 512)


def test_memory_command_prints_each_stage(capsys):
    from wgpu_train.cli.main import main

    assert main(["memory", "--pipeline-stages", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [s["layers"] for s in result["stages"]] == ["0-1", "2-3"]
    for stage in result["stages"]:
        assert {"weights", "trainable_state", "activations", "logits", "total"} <= set(stage)
    assert sum(s["weights"] for s in result["stages"]) == result["weights"]      # untied: no copy
    one_line_error(capsys, ["memory", "--pipeline-stages", "5"], "more than the model's 4 layers")
    one_line_error(capsys, ["memory", "--stage-layers", "0-2,2-3"], "layer 2 is in two stages")


def test_stages_of_a_1b_shaped_model(tmp_path, capsys):
    """Llama 3.2 1B's shape (16 layers, a tied 128k-row embedding) in bfloat16, 4 micro-batches of 4 x 512 under
    1F1B: the stages' weights add up to the whole plus the tied embedding's second copy; the largest stage falls
    with S, and balancing by memory does no worse than cutting the layers evenly."""
    from wgpu_train.cli.main import main

    shape = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
             "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    args = ["memory", "--model", str(tmp_path), "--batch-size", "4", "--max-seq-len", "512", "--base-dtype",
            "bfloat16", "--pipeline-micro-batches", "4", "--json"]
    largest = []
    embedding = 128256 * 2048 * 2
    for s_count in (2, 3, 4):
        assert main(args + ["--pipeline-stages", str(s_count)]) == 0
        result = json.loads(capsys.readouterr().out)
        stages = result["stages"]
        assert sum(s["weights"] for s in stages) == result["weights"] + embedding
        largest.append(max(s["total"] for s in stages))
        even = ",".join(f"{i * 16 // s_count}-{(i + 1) * 16 // s_count - 1}" for i in range(s_count))
        assert main(args + ["--stage-layers", even]) == 0
        assert largest[-1] <= max(s["total"] for s in json.loads(capsys.readouterr().out)["stages"])
    assert result["total"] > largest[0] > largest[1] > largest[2]


# ---- equal to one process -----------------------------------------------------------------------------------

def _micro_batches(seed: int, m: int, vocab: int = 83):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(m):
        ids = rng.integers(0, vocab, (2, 9)).astype(np.int32)
        targets = rng.integers(0, vocab, (2, 9)).astype(np.int64)
        targets[0, :3] = -100
        seg = np.ones_like(ids)
        seg[1, 7:] = 0
        targets[1, 7:] = -100
        out.append((ids, targets, seg, np.broadcast_to(np.arange(9, dtype=np.int32), ids.shape).copy()))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("stages,schedule,precision,base", [(2, "gpipe", "fp32", "float32"),
                                                            (3, "1f1b", "fp32", "float32"),
                                                            (3, "gpipe", "bf16", "nf4")])
def test_stages_equal_one_process(tmp_path, arch, stages, schedule, precision, base):
    """Three steps of three micro-batches (LoRA dropout on, the norm clipped; an NF4 base with bf16 activations):
    the same step losses, token counts and norms, and the same adapter and AdamW moments."""
    kw = {"layer_types": LAYER_TYPES} if arch == "gemma3" else {}
    folder = save_model(build_model(arch, num_hidden_layers=3, **kw), tmp_path / arch)
    lora = LoraConfig(r=4, target_modules=("q_proj", "v_proj", "down_proj"), dropout=0.1)
    one = load_model(folder, "numpy", base_dtype=base, precision=precision)
    one.add_lora(lora, seed=3)
    plan = plan_stages(3, stages, tied=one.config.tie_word_embeddings)
    engine = PipelineEngine(LocalStages([load_stage(folder, plan, s, base_dtype=base, precision=precision)
                                         for s in range(stages)]), plan, schedule)
    Model(one.config, engine, folder).add_lora(lora, seed=3)
    hp = OptimizerParams(lr=1e-2, max_grad_norm=0.5, weight_decay=0.01)
    for step in range(1, 4):
        micro = _micro_batches(step, 3)
        expected = one.engine.train_step(micro, hp, step)
        got = engine.train_step(micro, hp, step)
        assert got[:2] == expected[:2] and got[3] == expected[3], (got, expected)
        assert_close(got[2], expected[2], "pipeline_numpy", f"step {step}'s norm")
    mine, theirs = engine.trainable(), one.engine.trainable()
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], "pipeline_numpy", k)
    moments = engine.optimizer_state()
    for k, (m, v) in one.engine.optimizer_state().items():
        assert_close(moments[k][0], m, "pipeline_numpy", k + " (first moment)")
        assert_close(moments[k][1], v, "pipeline_numpy", k + " (second moment)")
    assert max(float(np.abs(theirs[k]).max()) for k in theirs if k.endswith("lora_B")) > 1e-3      # it trained
    ids, targets, seg, pos = _micro_batches(9, 1)[0]
    assert_close(engine.loss(ids, targets, seg, pos)[0], one.engine.loss(ids, targets, seg, pos)[0],
                 "pipeline_numpy", "a forward-only loss")
    assert_close(engine.token_losses(ids, targets, seg, pos, reference=True),
                 one.engine.token_losses(ids, targets, seg, pos, reference=True), "pipeline_numpy", "token losses")


@pytest.mark.parametrize("arch,trained", [("llama", ("embed_tokens", "lm_head", False)),
                                           ("qwen3", ("lm_head", False)), ("qwen3", ("embed_tokens", True)),
                                           ("qwen3", "full"), ("gemma3", ("embed_tokens", True))])
def test_trained_embedding_and_head_through_stages_equal_one_process(tmp_path, arch, trained):
    """modules_to_save (an untied model's embedding on the first stage and head on the last; a tied model's head
    untied on the last; a tied copy trained as one on both end stages, its gradients summed) and full
    fine-tuning (every stage's weights, the tied embedding as one): one process's steps and tensors."""
    kw = {"layer_types": LAYER_TYPES} if arch == "gemma3" else {}
    folder = save_model(build_model(arch, num_hidden_layers=3, **kw), tmp_path / arch)
    one = load_model(folder, "numpy", precision="fp32")
    plan = plan_stages(3, 3, tied=one.config.tie_word_embeddings)
    engine = PipelineEngine(LocalStages([load_stage(folder, plan, s, precision="fp32") for s in range(3)]), plan)
    staged = Model(one.config, engine, folder)
    for model in (one, staged):
        if trained == "full":
            model.set_full_finetune()
        else:
            model.add_lora(LoraConfig(r=4, target_modules=("q_proj", "v_proj"), modules_to_save=trained[:-1],
                                      ensure_weight_tying=trained[-1]), seed=3)
    # a tied embedding trained as one sums its two stages' gradients in another order than one process
    tol = "pipeline_tied_sum" if plan.tied and (trained == "full" or trained[-1]) else "pipeline_numpy"
    hp = OptimizerParams(lr=1e-2, max_grad_norm=0.5, weight_decay=0.01)
    for step in range(1, 4):
        micro = _micro_batches(step, 2)
        expected = one.engine.train_step(micro, hp, step)
        got = engine.train_step(micro, hp, step)
        assert got[1] == expected[1] and got[3] == expected[3], (got, expected)
        assert_close(np.array(got[::2]), np.array(expected[::2]), tol, f"step {step}'s loss and norm")
    mine, theirs = engine.trainable(), one.engine.trainable()
    assert sorted(mine) == sorted(theirs) and ("model.embed_tokens.weight" in theirs or "lm_head.weight" in theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], tol, k)
    if plan.tied and "model.embed_tokens.weight" in theirs and "lm_head.weight" not in theirs:
        # trained as one: the last stage's copy (its head) took the same updates as the first's
        head = engine.runner.stages[2].weights()["model.embed_tokens.weight"]
        assert_close(head, mine["model.embed_tokens.weight"], "exact", "the last stage's tied head")


def test_a_fully_trained_model_is_saved_one_tensor_at_a_time(tmp_path):
    """--method full through stages writes its model (Model.save_pretrained, as the run and its checkpoints do)
    fetching and merging one weight at a time: the driver's new memory while it saves (tracemalloc; the stages in
    this process hold theirs already) peaks under three of the largest tensor, not at the whole model (3.6 MB; 10.9
    MB, three copies, when it gathered them all); the file is one process's, byte for byte."""
    import tracemalloc

    folder = default_model_dir()
    one = load_model(folder, "numpy", precision="fp32")
    plan = plan_stages(4, 2, tied=one.config.tie_word_embeddings)
    staged = Model(one.config, PipelineEngine(LocalStages([load_stage(folder, plan, s, precision="fp32")
                                                           for s in range(2)]), plan), folder)
    for model in (one, staged):
        model.set_full_finetune()
    tracemalloc.start()
    try:
        staged.save_pretrained(tmp_path / "staged")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    one.save_pretrained(tmp_path / "one")
    sizes = file_bytes(tmp_path / "one")
    assert peak < 3 * max(sizes.values()) < sum(sizes.values()), (peak, sizes)
    written = [(tmp_path / side / "model.safetensors").read_bytes() for side in ("staged", "one")]
    assert written[0] == written[1]


class CountingStages(LocalStages):
    """LocalStages that note the base weights the driver fetches."""

    def __init__(self, stages):
        super().__init__(stages)
        self.fetched = []

    def call(self, s: int, method: str, *args, returns: int = 1):
        if method == "weight":
            self.fetched.append(args[0])
        return super().call(s, method, *args, returns=returns)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dora_in_f16_through_stages_equals_one_process(tmp_path, arch):
    """DoRA (each module's magnitude starts from its weight, fetched from the stage that holds it alone) with f16
    activations and dynamic loss scaling (the last stage scales the loss, every stage unscales and updates its
    scaler alike) on 2 stages: one process's steps, scale and adapter."""
    kw = {"layer_types": LAYER_TYPES} if arch == "gemma3" else {}
    folder = save_model(build_model(arch, num_hidden_layers=3, **kw), tmp_path / arch)
    lora = LoraConfig(r=4, target_modules=("q_proj", "v_proj", "down_proj"), use_dora=True)
    one = load_model(folder, "numpy", precision="f16")
    one.add_lora(lora, seed=3)
    plan = plan_stages(3, 2, tied=one.config.tie_word_embeddings)
    runner = CountingStages([load_stage(folder, plan, s, precision="f16") for s in range(2)])
    engine = PipelineEngine(runner, plan)
    Model(one.config, engine, folder).add_lora(lora, seed=3)
    # the driver read the DoRA modules' weights alone, not the model
    assert sorted(runner.fetched) == sorted(p + ".weight" for p in lora.modules(one.config))
    hp = OptimizerParams(lr=1e-2, max_grad_norm=0.5)
    for step in range(1, 4):
        micro = _micro_batches(step, 2)
        expected = one.engine.train_step(micro, hp, step)
        got = engine.train_step(micro, hp, step)
        assert got[:2] == expected[:2] and got[3] == expected[3], (got, expected)
    assert engine.loss_scaler.state_dict() == one.engine.loss_scaler.state_dict()
    mine, theirs = engine.trainable(), one.engine.trainable()
    assert any(k.endswith("lora_magnitude_vector") for k in theirs) and sorted(mine) == sorted(theirs)
    for k in theirs:
        assert_close(mine[k], theirs[k], "pipeline_numpy", k)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_generation_through_stages_equals_one_process(tmp_path, arch):
    """Greedy and sampled generation of ragged prompts (generate_batch: prefill, then a token a step), each stage
    keeping its layers' KV cache: one process's tokens, and the engine protocol's members all there."""
    from wgpu_train.engines.protocol import MEMBERS, PipelineStage

    kw = {"layer_types": LAYER_TYPES} if arch == "gemma3" else {}
    folder = save_model(build_model(arch, num_hidden_layers=3, **kw), tmp_path / arch)
    one = load_model(folder, "numpy", precision="fp32")
    plan = plan_stages(3, 3, tied=one.config.tie_word_embeddings)
    stages = [load_stage(folder, plan, s, precision="fp32") for s in range(3)]
    assert all(isinstance(stage, PipelineStage) for stage in stages)
    engine = PipelineEngine(LocalStages(stages), plan)
    assert [name for name in MEMBERS if not hasattr(engine, name)] == []
    assert_same_generation(one, Model(one.config, engine, folder))


def assert_same_generation(one: Model, staged: Model):
    """The same adapter (B != 0) on both, then greedy and sampled generate_batch of ragged prompts: the same
    tokens."""
    for model in (one, staged):
        model.add_lora(LoraConfig(r=4, target_modules=("q_proj", "v_proj")), seed=3)
        model.engine.set_trainable({k: v + 0.05 for k, v in model.engine.trainable().items()})   # B != 0
    prompts = [np.array(p) for p in ([5, 9, 11, 2, 40], [7, 3], [60, 61, 62])]
    for temperature in (0.0, 0.8):
        expected = one.generate_batch(prompts, max_new_tokens=6, temperature=temperature, seed=4)
        assert staged.generate_batch(prompts, max_new_tokens=6, temperature=temperature, seed=4) == expected
