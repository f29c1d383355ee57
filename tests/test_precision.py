"""16-bit training, --precision, on the NumPy engine: fp32 stays today's path, bf16 against torch's CPU autocast on
a PEFT model, the rounding points, f16's dynamic loss scaling against torch's GradScaler (an injected overflow, the
growth, a resume across a skipped step), f16's overflow in the forward, the memory estimate, and the refusals."""
from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

from finetune_helpers import make_data_dir, make_model_dir, one_line_error, peft_random_b
from tiny_models import build_model, in_arch, save_model
from tolerances import TOLERANCES, assert_close
from wgpu_train.engines import protocol
from wgpu_train.engines.loading import load_model
from wgpu_train.engines.numpy import engine as numpy_engine
from wgpu_train.engines.shared.labels import shift_labels
from wgpu_train.engines.numpy.precision import Rounding
from wgpu_train.engines.shared.quant import round_to
from wgpu_train.engines.protocol import LossScaler, OptimizerParams
from wgpu_train.errors import ConfigError
from wgpu_train.training.config import TrainConfig
from wgpu_train.training.trainer import Trainer

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STORAGE = {"bf16": "bfloat16", "f16": "float16"}


def _batch(seed=5, vocab=83, rows=2, length=17, prompt=4):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(rows, length))
    labels = ids.copy()
    labels[:, :prompt] = -100
    return ids, labels


def _bf16(model):
    """Every parameter of a torch model rounded to bfloat16 (kept float32): autocast's casts of weights and LoRA
    A / B are then exact, so only activations round differently on the two sides."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def peft_case(request, tmp_path_factory):
    """(folder of a tiny model, folder of a PEFT adapter with random B on every linear module, the PEFT model);
    qwen3 adds per-head q / k norms and tied embeddings."""
    arch = request.param
    hf = _bf16(build_model(arch, seed=3))
    targets = in_arch(arch, LLAMA_TARGETS)
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=3, lora_alpha=6, target_modules=targets,
                                                                lora_dropout=0.0))
    pm = _bf16(peft_random_b(pm, 1))
    root = tmp_path_factory.mktemp(f"precision_{arch}")
    save_model(hf, root / "model")
    pm.save_pretrained(root / "adapter")
    return root / "model", root / "adapter", pm


def _torch_loss_and_grads(pm, ids, labels, autocast: bool):
    pm.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = pm(input_ids=torch.tensor(ids), labels=torch.tensor(labels))
    out.loss.backward()
    return out.loss.item(), {n.replace(".default.", "."): p.grad.numpy().astype(np.float32)
                             for n, p in pm.named_parameters() if p.requires_grad}


def test_bf16_matches_torch_autocast(peft_case):
    """Loss and every LoRA gradient of the NumPy engine in bf16 against torch.autocast("cpu", bfloat16) on the
    PEFT model with the same (bfloat16-valued) weights, within bf16's derived noise (tests/tolerances.py)."""
    folder, adapter, pm = peft_case
    ids, labels = _batch()
    loss_t, grads_t = _torch_loss_and_grads(pm, ids, labels, autocast=True)
    model = load_model(folder, precision="bf16")
    model.load_adapter(adapter)
    assert model.engine.precision == "bf16"
    loss, grads = model.loss_and_grads(ids, labels)
    assert_close(loss, loss_t, "bf16_autocast_loss", "loss")
    assert set(grads) == set(grads_t) and len(grads) == 2 * 2 * len(in_arch(model.config.family, LLAMA_TARGETS))
    limit = TOLERANCES["bf16_autocast_grads"].rtol
    for name, g in grads_t.items():
        assert np.abs(g).max() > 1e-3, f"{name}: the oracle's gradient is ~0, the comparison would be empty"
        rel = float(np.linalg.norm(grads[name] - g) / np.linalg.norm(g))
        assert rel <= limit, f"{name}: norm-wise relative difference {rel:.3g} over {limit} (bf16_autocast_grads)"


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_rounding_points(peft_case, precision):
    """Every activation the forward keeps is a bfloat16 / float16 number but the statistics (rstd, logsumexp),
    which stay float32, as the loss head's input does; LoRA gradients and the trained A / B stay float32."""
    folder, adapter, _ = peft_case
    model = load_model(folder, precision=precision)
    model.load_adapter(adapter)
    engine = model.engine
    ids, labels = _batch()
    seg, pos = np.ones_like(ids), np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
    _, cache = engine.forward(ids, seg, pos)
    storage = STORAGE[precision]
    stats = engine.plan.statistics
    assert stats and stats < set(engine.plan.widths)
    rounded, kept = 0, 0
    for layer in cache["layers"]:
        for name, x in layer.items():
            if name in engine.plan.widths and name not in stats:
                np.testing.assert_array_equal(round_to(x, storage), x, err_msg=name)
                rounded += 1
            elif name in stats and x is not None:
                kept += int(not np.array_equal(round_to(x, "bfloat16"), x))
    assert rounded >= 2 * 10 and kept > 0, (rounded, kept)
    for name in ("xf", "x_final"):
        np.testing.assert_array_equal(round_to(cache[name], storage), cache[name], err_msg=name)
    # the same step in fp32 differs: the rounding is there
    fp32 = load_model(folder, precision="fp32")
    fp32.load_adapter(adapter)
    (loss16, grads16), (loss32, _) = model.loss_and_grads(ids, labels), fp32.loss_and_grads(ids, labels)
    assert loss16 != loss32
    assert any(not np.array_equal(round_to(g, "bfloat16"), g) for g in grads16.values()), "gradients rounded"
    micro = [(ids, shift_labels(labels), seg, pos)]
    assert engine.train_step(micro, OptimizerParams(lr=1e-2), 1)[3]
    a = next(iter(engine.lora_tensors().values()))[0]
    assert a.dtype == np.float32 and not np.array_equal(round_to(a, "bfloat16"), a), "A stays float32"


def test_fp32_is_todays_path(peft_case):
    """fp32 rounds nothing (the same arrays come back, not copies), has no loss scaler, keeps the engine state
    of before, and is what auto picks on the NumPy engine, with the reason."""
    folder, adapter, _ = peft_case
    rounding = Rounding("fp32", {"rstd1"})
    x = np.linspace(-1, 1, 7, dtype=np.float32)
    assert rounding.activation(x, "x") is x and rounding.gradient(x) is x
    model = load_model(folder)
    engine = model.engine
    assert (engine.precision, engine.loss_scaler) == ("fp32", None)
    assert "NumPy engine is the float32 reference" in engine.precision_reason
    assert set(engine.state_dict()) == {"dropout_seed", "dropout_calls"}
    model.load_adapter(adapter)
    explicit = load_model(folder, precision="fp32")
    explicit.load_adapter(adapter)
    ids, labels = _batch()
    (loss_a, grads_a), (loss_b, grads_b) = model.loss_and_grads(ids, labels), explicit.loss_and_grads(ids, labels)
    assert loss_a == loss_b
    for k in grads_a:
        np.testing.assert_array_equal(grads_a[k], grads_b[k])


# ---- f16's dynamic loss scaling ------------------------------------------------------------------------------

def test_loss_scaler_matches_torch_grad_scaler():
    """LossScaler's scale over a run of clean and overflowing steps equals torch.amp.GradScaler's (init 2^16,
    growth 2 after growth_interval clean steps, backoff 0.5 on inf / nan), skipped steps included."""
    overflow = [False, False, False, True, False, False, False, True, True, False, False, False, False, False, False]
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.0)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=3)
    ours = LossScaler(growth_interval=3)
    assert (ours.growth_factor, ours.backoff_factor, LossScaler().growth_interval) == (2.0, 0.5, 2000)
    scales = []
    for bad in overflow:
        optimizer.zero_grad()
        loss = (param * (float("inf") if bad else 1.0)).sum()
        theirs.scale(loss).backward()
        theirs.step(optimizer)
        theirs.update()
        ours.update(not bad)
        assert ours.scale == theirs.get_scale(), (bad, ours.scale, theirs.get_scale())
        scales.append(ours.scale)
    assert sorted(set(scales)) == [2.0 ** 15, 2.0 ** 16, 2.0 ** 17], scales


def test_f16_overflow_skips_the_step_and_halves_the_scale(peft_case):
    """An injected overflow (a loss scale of 2^40 overflows float16 gradients) skips the step: the tensors and
    moments stay as they were, the scale halves, the skip is counted; later clean steps grow it back."""
    folder, adapter, _ = peft_case
    model = load_model(folder, precision="f16")
    model.load_adapter(adapter)
    engine = model.engine
    ids, labels = _batch()
    micro = [(ids, shift_labels(labels), np.ones_like(ids), np.broadcast_to(np.arange(ids.shape[1]), ids.shape))]
    hp = OptimizerParams(lr=1e-2)
    assert engine.train_step(micro, hp, 1)[3], "a clean first step at 2^16"
    before = {k: v.copy() for k, v in engine.trainable().items()}
    moments = engine.optimizer_state()
    engine.loss_scaler.scale = 2.0 ** 40
    loss_sum, count, norm, applied = engine.train_step(micro, hp, 2)
    assert not applied and not np.isfinite(norm) and np.isfinite(loss_sum) and count > 0
    assert engine.loss_scaler.scale == 2.0 ** 39 and engine.counters["nonfinite_skipped"] == 1
    for k, v in engine.trainable().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    for k, (m, v) in engine.optimizer_state().items():
        np.testing.assert_array_equal(m, moments[k][0])
    engine.loss_scaler = LossScaler(init_scale=2.0 ** 8, growth_interval=2)
    assert [engine.train_step(micro, hp, s)[3] for s in (2, 3, 4)] == [True] * 3
    assert engine.loss_scaler.scale == 2.0 ** 9 and engine.loss_scaler.growth_tracker == 1


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_loss_scaling_through_the_protocol(peft_case, backend, request):
    """Both engines' train_step take a loss scaler (the WebGPU engine runs fp32 only, so it is injected there):
    in float32 a power-of-two scale changes no bit of the step; the gradients are unscaled before a data-parallel
    reduce; an overflow skips the step and halves the scale; the scale travels in state_dict."""
    if backend == "wgpu":
        request.getfixturevalue("default_rt")
    folder, adapter, _ = peft_case
    ids, labels = _batch()
    micro = [(ids, shift_labels(labels), np.ones_like(ids), np.broadcast_to(np.arange(ids.shape[1]), ids.shape))]
    hp = OptimizerParams(lr=1e-2)
    results = []
    for scaler in (None, LossScaler()):
        model = load_model(folder, backend=backend)
        model.load_adapter(adapter)
        model.engine.loss_scaler = scaler
        steps = [model.engine.train_step(micro, hp, s) for s in (1, 2)]
        results.append((steps, {k: v.copy() for k, v in model.engine.trainable().items()}))
    (plain, tensors), (scaled, tensors_scaled) = results
    assert plain == scaled
    for k in tensors:
        np.testing.assert_array_equal(tensors_scaled[k], tensors[k], err_msg=k)
    engine = model.engine
    assert engine.state_dict()["loss_scale"] == 2.0 ** 16
    seen = []

    def overflow(grads, tokens):         # an injected overflow, where data parallelism's all-reduce sits
        seen.append(grads.copy())
        return np.where(np.arange(grads.size) == 3, np.inf, grads).astype(np.float32)

    assert not engine.train_step(micro, hp, 3, reduce=overflow)[3]
    assert engine.loss_scaler.scale == 2.0 ** 15 and engine.counters["nonfinite_skipped"] == 1
    assert 0 < np.abs(seen[0]).max() < 10, "reduce sees the gradients unscaled"
    for k, v in engine.trainable().items():
        np.testing.assert_array_equal(v, tensors_scaled[k], err_msg=k)
    engine.load_state_dict({**engine.state_dict(), "loss_scale": 2.0 ** 5, "loss_scale_growth_tracker": 7})
    assert (engine.loss_scaler.scale, engine.loss_scaler.growth_tracker) == (2.0 ** 5, 7)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision_run")
    return make_model_dir(root / "model"), make_data_dir(root / "data")


@pytest.fixture(scope="module")
def workspace_even(tmp_path_factory):
    """As workspace, with the even widths the WebGPU engine's 16-bit activations need."""
    root = tmp_path_factory.mktemp("precision_run_even")
    return make_model_dir(root / "model", intermediate_size=42), make_data_dir(root / "data")


def _run(workspace, out, **kw):
    model, data = workspace
    args = dict(model=str(model), data=str(data), backend="numpy", precision="f16", max_steps=8, batch_size=2,
                lr=5e-3, save_every=1, keep_checkpoints=0, log_every=1, no_progress=True, eval_generate=False,
                eval_every=0)
    return Trainer(TrainConfig(out=str(out), **{**args, **kw}), log=lambda _: None).run()


def _step_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows if "loss_scale" in r]   # timing aside


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_f16_resume_is_bit_exact_across_a_skip(backend, tmp_path, monkeypatch, request):
    """A run whose loss scale starts too high (2^18 overflows this model's float16 gradients) skips its first
    step, halving the scale, and grows it every 2 clean steps (growth_interval 2 for the test), skipping again
    when it grows too far;
    metrics.jsonl carries the skips and the scale. Resumed from a checkpoint written right after a skipped step,
    with precision auto, the run continues in f16 and ends bit for bit where the uninterrupted one did; another
    explicit precision is refused. On both engines (the WebGPU one on the default adapter)."""
    from wgpu_train.engines.webgpu import engine as webgpu_engine

    if backend == "wgpu":
        request.getfixturevalue("default_rt")
    workspace = request.getfixturevalue("workspace_even" if backend == "wgpu" else "workspace")
    for module in (numpy_engine, webgpu_engine):
        monkeypatch.setattr(module, "LossScaler", lambda: LossScaler(init_scale=2.0 ** 18, growth_interval=2))
    whole = tmp_path / "whole"
    summary = _run(workspace, whole, backend=backend)
    assert (summary["precision"], summary["steps"]) == ("f16", 8)
    rows = _step_rows(whole)
    skips = [r["nonfinite_skipped"] for r in rows]
    skipped = [r["step"] for r, before in zip(rows, [0] + skips) if r["nonfinite_skipped"] > before]
    assert skipped and skipped[0] == 1 and len(skipped) < 8, skipped
    assert rows[-1]["nonfinite_skipped"] == len(skipped) and rows[0]["loss_scale"] == 2.0 ** 17
    assert any(b["loss_scale"] == 2 * a["loss_scale"] for a, b in zip(rows, rows[1:])), "the scale grew"
    step = max(s for s in skipped if s < 8)       # the last skip with steps after it
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    for p in (resumed / "checkpoints").iterdir():
        if int(p.name.split("-")[1]) > step:
            shutil.rmtree(p)
    state = json.loads((resumed / "checkpoints" / f"step-{step:06d}" / "trainer_state.json").read_text())
    assert state["precision"] == "f16" and "loss_scale" in state["engine"]
    with pytest.raises(ConfigError, match="precision f16, not bf16"):
        Trainer(TrainConfig(out=str(resumed), resume=str(resumed), precision="bf16", backend="numpy"))
    again = _run(workspace, resumed, resume=str(resumed), precision="auto", backend=backend)
    assert again["precision"] == "f16" and again["precision_reason"] == "auto: as the resumed checkpoint trained"
    assert (resumed / "adapter_model.safetensors").read_bytes() == (whole / "adapter_model.safetensors").read_bytes()
    assert _step_rows(resumed) == rows


def test_f16_overflow_in_the_forward_names_the_layer(workspace, tmp_path, capsys):
    """Activations beyond float16's range (an injected huge weight in layer 1) stop an f16 run with one line
    naming layer 1 and suggesting bf16, before anything is written; bf16 trains the same model."""
    from safetensors.numpy import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(workspace[0], model)
    weights = load_file(model / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"] *= 1e6
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    argv = ["finetune", "--model", str(model), "--data", str(workspace[1]), "--backend", "numpy", "--max-steps", "2",
            "--batch-size", "2", "--no-progress", "--out", str(out)]
    from wgpu_train.cli.main import main

    assert main(argv + ["--precision", "f16"]) == 2
    err = capsys.readouterr().err          # the run's log lines, then its one error line
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("error: activations overflow float16 in layer 1 (up_proj -> up)"), errors[0]
    assert not out.exists()
    engine = load_model(model, precision="f16").engine
    ids, _ = _batch(vocab=engine.cfg.vocab_size)
    with pytest.raises(ConfigError, match=r"layer 1 .*--precision bf16"):
        engine.logits(ids, np.ones_like(ids), np.broadcast_to(np.arange(ids.shape[1]), ids.shape))
    assert np.isfinite(load_model(model, precision="bf16").engine.logits(
        ids, np.ones_like(ids), np.broadcast_to(np.arange(ids.shape[1]), ids.shape))).all()


# ---- options, refusals and the memory estimate ---------------------------------------------------------------

def test_bad_precision_values_are_one_line(capsys, tmp_path):
    one_line_error(capsys, ["finetune", "--precision", "bf17"], "invalid choice: 'bf17'")
    with pytest.raises(ConfigError, match="precision must be one of auto, fp32, bf16, f16"):
        TrainConfig(precision="fp16")
    with pytest.raises(ConfigError, match="precision must be one of"):
        load_model("unused", precision="half")


def test_precision_is_parsed_once_with_its_traits(capsys, tmp_path):
    """--precision is one Precision from the boundary on (TrainConfig, load_model's choice, the engines): its
    traits answer what string checks did, and it still reads, prints, hashes and serialises as its name."""
    from wgpu_train.engines.loading import precision_choice
    from wgpu_train.engines.protocol import PRECISIONS, Precision

    config = TrainConfig(precision="bf16")
    assert config.precision is Precision.BF16 and TrainConfig(precision=Precision.F16).precision is Precision.F16
    assert json.loads(json.dumps({"precision": config.precision})) == {"precision": "bf16"}
    assert f"{config.precision}" == str(config.precision) == "bf16" and {"bf16": 1}[config.precision] == 1
    assert [(p.sixteen_bit, p.loss_scaling, p.storage) for p in PRECISIONS] == \
        [(False, False, "f32"), (True, False, "bf16"), (True, True, "f16")]
    assert not Precision.AUTO.resolved and all(p.resolved for p in PRECISIONS)
    with pytest.raises(ValueError, match="resolves it first"):
        Precision.AUTO.storage
    assert precision_choice("auto", "numpy")[0] is Precision.FP32
    assert load_model(make_model_dir(tmp_path), precision="f16").engine.precision is Precision.F16
    with pytest.raises(ConfigError, match=r"precision must be one of auto, fp32, bf16, f16, got 16"):
        Precision.parse(16)
    capsys.readouterr()                 # the model's writing progress
    one_line_error(capsys, ["memory", "--precision", "half"], "invalid choice: 'half'")


def test_auto_is_bf16_on_gpus_fp32_elsewhere_and_says_why():
    from wgpu_train.engines.loading import precision_choice

    assert precision_choice("auto", "numpy") == ("fp32", "auto: the NumPy engine is the float32 reference")
    assert precision_choice("auto", "wgpu", cpu_adapter=True)[0] == "fp32"
    assert "lavapipe" in precision_choice("auto", "wgpu", cpu_adapter=True)[1]
    gpu = precision_choice("auto", "wgpu", cpu_adapter=False)
    assert gpu[0] == "bf16" and "a GPU" in gpu[1]
    assert precision_choice("f16", "numpy") == ("f16", "as given")
    assert precision_choice("fp32", "wgpu") == ("fp32", "as given")
    assert precision_choice("bf16", "wgpu") == ("bf16", "as given")


def test_toml_takes_precision(tmp_path):
    from wgpu_train.cli.train_options import load_toml_config

    (tmp_path / "run.toml").write_text('precision = "bf16"\nbackend = "numpy"\n')
    assert TrainConfig(**load_toml_config(tmp_path / "run.toml")).precision == "bf16"
    (tmp_path / "bad.toml").write_text('precision = 16\n')
    with pytest.raises(ConfigError, match="key 'precision' must be a str"):
        load_toml_config(tmp_path / "bad.toml")


def test_memory_estimate_in_16_bits(capsys):
    """Activations and saved tensors take 2 bytes in bf16 / f16, statistics and the logits stay float32: about
    half the activation bytes of fp32 on the embedded model; `wgpu-train memory --precision` prints the ratio."""
    from wgpu_train.cli.main import main
    from wgpu_train.engines.webgpu.memory import activation_bytes, estimate_memory
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.training.config import default_model_dir

    cfg = ModelConfig.from_folder(default_model_dir())
    est = {p: estimate_memory(cfg, 4, 256, precision=p) for p in ("fp32", "bf16", "f16")}
    assert est["bf16"] == est["f16"]
    assert est["bf16"]["logits"] == est["fp32"]["logits"] and est["bf16"]["weights"] == est["fp32"]["weights"]
    ratio = est["bf16"]["activations"] / est["fp32"]["activations"]
    assert 0.5 <= ratio <= 0.55, ratio
    assert activation_bytes(cfg, "layer.h1", 10, "bf16") == 20 and activation_bytes(cfg, "rstd1", 10, "bf16") == 40
    assert activation_bytes(cfg, "d_h", 10, "f16") == 20 and activation_bytes(cfg, "lse_rows", 10, "f16") == 40
    assert main(["memory", "--precision", "bf16", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["precision"] == "bf16" and 0.5 <= shown["activations_vs_fp32"] <= 0.55


def test_protocol_lists_precision():
    assert {"precision", "precision_reason", "loss_scaler"} <= protocol.MEMBERS
