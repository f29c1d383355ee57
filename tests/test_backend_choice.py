"""backend="auto": the WebGPU engine on a GPU or a named adapter, the NumPy engine without an adapter, and where
the only adapters are CPUs the faster of the two for the model (timed once, cached), unless the NumPy engine's
float32 weights would not fit; each choice with its reason."""
import dataclasses
import json
import time

import pytest

import wgpu_train as wt
from wgpu_train.assets import default_model_dir
from wgpu_train.bench.pretune import SMOL135
from wgpu_train.engines import backend_choice
from wgpu_train.engines.backend_choice import choose_backend, numpy_weight_bytes
from wgpu_train.engines.webgpu.device import runtime
from wgpu_train.models.config import ModelConfig

from conftest import ADAPTERS, require_adapter

EMBEDDED = ModelConfig.from_folder(default_model_dir())
SMOL = ModelConfig.from_dict(dict(SMOL135), "SmolLM2-135M-shaped")


def _fake_adapters(monkeypatch, *types):
    """runtime.devices() reports adapters of these types (the first llvmpipe's limits for each)."""
    template = runtime.AdapterInfo(0, "fake", "", "Vulkan", "CPU")
    fakes = [dataclasses.replace(template, index=i, name=f"fake {t}", adapter_type=t) for i, t in enumerate(types)]
    monkeypatch.setattr(runtime, "devices", lambda: fakes)
    monkeypatch.delenv("WGPU_TRAIN_DEVICE", raising=False)


def test_auto_without_adapter_falls_back_to_numpy_and_says_so(monkeypatch):
    _fake_adapters(monkeypatch)
    model = wt.load_model(default_model_dir(), backend="auto")
    assert (model.backend, model.backend_reason) == ("numpy", "auto: no WebGPU adapter found")


@pytest.mark.parametrize("kinds", [("CPU", "DiscreteGPU"), ("CPU", "IntegratedGPU"), ("VirtualGPU", "CPU"),
                                   ("Unknown",)])
def test_auto_picks_a_gpu_adapter(monkeypatch, kinds):
    """Beside a CPU adapter, or alone where its type is unknown (the runtime prefers a CPU to an unknown type)."""
    _fake_adapters(monkeypatch, *kinds)
    kind = kinds[1] if kinds[0] == "CPU" else kinds[0]
    for cfg in (EMBEDDED, SMOL):
        choice = choose_backend("auto", None, cfg)
        assert choice.engine == "wgpu" and choice.device is None and f"fake {kind}" in choice.reason


@pytest.mark.real_backend_rule
def test_auto_on_cpu_adapters_takes_numpy_for_small_layers_and_the_adapter_for_large_ones(monkeypatch):
    """The rule where the only adapters are CPUs: the embedded default's layers (0.18M weights) are under
    SMALL_LAYER_WEIGHTS and take the NumPy engine, a SmolLM2-135M-shaped model's (3.5M) take the adapter; each
    reason says which side of the line the model is."""
    _fake_adapters(monkeypatch, "CPU")
    assert backend_choice.layer_weights(EMBEDDED) < backend_choice.SMALL_LAYER_WEIGHTS <= \
        backend_choice.layer_weights(SMOL)
    small, large = choose_backend("auto", None, EMBEDDED), choose_backend("auto", None, SMOL)
    assert small.engine == "numpy" and "0.18M weights each, under the 1M" in small.reason
    assert large.engine == "wgpu" and large.device is None and "3.54M weights each, from 1M" in large.reason
    assert all("the only WebGPU adapters are CPUs (fake CPU)" in c.reason for c in (small, large))


def test_auto_keeps_the_cpu_adapter_when_the_numpy_engines_float32_weights_would_not_fit(monkeypatch):
    _fake_adapters(monkeypatch, "CPU")
    monkeypatch.setattr(backend_choice, "SMALL_LAYER_WEIGHTS", 10**9)   # the NumPy engine, if it fitted
    host = numpy_weight_bytes(SMOL)
    tight = int(host / backend_choice.NUMPY_MEMORY_SHARE) - 1          # just too little for the float32 copies
    nf4 = choose_backend("auto", None, SMOL, "nf4", "float16", memory=tight)
    assert nf4.engine == "wgpu" and "would not fit" in nf4.reason
    # float32 storage saves nothing on the adapter: the faster engine stays the choice
    assert choose_backend("auto", None, SMOL, "float32", "float32", memory=tight).engine == "numpy"
    assert choose_backend("auto", None, SMOL, "nf4", "float16", memory=10 * host).engine == "numpy"


@pytest.mark.real_backend_rule
def test_a_named_adapter_or_backend_wgpu_runs_on_the_cpu_adapter(monkeypatch):
    require_adapter()
    monkeypatch.delenv("WGPU_TRAIN_DEVICE", raising=False)
    cpu = next(a for a in ADAPTERS if a.adapter_type == "CPU")
    named = wt.load_model(default_model_dir(), backend="auto", device=str(cpu.index))
    assert named.backend == "wgpu" and "--device names an adapter" in named.backend_reason
    assert wt.load_model(default_model_dir(), backend="wgpu").backend == "wgpu"
    monkeypatch.setenv("WGPU_TRAIN_DEVICE", str(cpu.index))
    assert choose_backend("auto", None, EMBEDDED).engine == "wgpu"


def test_unknown_backend_is_one_line():
    with pytest.raises(wt.ConfigError, match="backend must be one of auto, wgpu, numpy"):
        choose_backend("cuda")


def test_finetune_says_its_engine_first_and_records_why(tmp_path, monkeypatch):
    """The run's first line names the engine auto chose and why; summary.json records both."""
    _fake_adapters(monkeypatch)
    lines = []
    trainer = wt.Trainer(wt.TrainConfig(out=str(tmp_path / "run"), max_steps=1, eval_every=0, batch_size=2,
                                        eval_generate=False), log=lines.append)
    trainer.run()
    assert lines[0] == "backend: numpy (auto: no WebGPU adapter found)"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["backend"], summary["backend_reason"]) == ("numpy", "auto: no WebGPU adapter found")


def test_generate_says_auto_choice_on_stderr(monkeypatch, capsys):
    from wgpu_train.cli.main import main

    _fake_adapters(monkeypatch)
    assert main(["generate", "--prompt", "red fox", "--max-new-tokens", "2"]) == 0
    assert "backend: numpy (auto: no WebGPU adapter found)" in capsys.readouterr().err


def test_explicit_wgpu_without_adapter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(runtime, "devices", lambda: [])
    with pytest.raises(wt.DeviceError, match="no WebGPU adapter found") as err:
        runtime.choose_adapter()
    assert "\n" not in str(err.value)


def test_devices_lists_limits_and_features(capsys):
    """`wgpu-train devices`: each adapter with its max storage binding and the features used here."""
    from conftest import ADAPTERS, require_adapter
    from wgpu_train.cli.main import main

    require_adapter()
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for a in ADAPTERS:
        line = next(x for x in lines if f"[{a.index}] " in x)
        assert f"max storage binding {a.max_storage_binding // 2**20} MiB" in line and a.max_storage_binding >= 2**20
        assert all(f in line for f in a.features)
    assert lines[-1].startswith("chosen: [")



def _no_training_step(monkeypatch, lines: list) -> list:
    """Both engines' train_step record the lines said before each call, then run; the list holds them."""
    from wgpu_train.engines.numpy.engine import NumpyEngine
    from wgpu_train.engines.webgpu.engine import WgpuEngine

    said_before = []
    for cls in (NumpyEngine, WgpuEngine):
        real = cls.train_step

        def recorded(self, *a, _real=real, **k):
            said_before.append(list(lines))
            return _real(self, *a, **k)
        monkeypatch.setattr(cls, "train_step", recorded)
    return said_before


def _run(out, lines, **settings) -> dict:
    config = wt.TrainConfig(out=str(out), max_steps=1, eval_every=0, eval_generate=False, **settings)
    return wt.Trainer(config, log=lines.append).run()


@pytest.mark.real_backend_rule
def test_auto_times_nothing_whatever_the_batch_and_says_its_engine_first(monkeypatch, tmp_path):
    """Two runs on CPU adapters with other batches and lengths: each says its engine in its first line, before
    any training step, with the same reason (nothing measured, nothing cached)."""
    _fake_adapters(monkeypatch, "CPU")
    firsts = []
    for batch, length in ((2, 32), (4, 64)):
        lines = []
        said_before = _no_training_step(monkeypatch, lines)
        _run(tmp_path / f"run{batch}", lines, batch_size=batch, max_seq_len=length)
        assert lines[0].startswith("backend: numpy (auto: the only WebGPU adapters are CPUs")
        assert said_before and all(before and before[0] == lines[0] for before in said_before)
        assert next(i for i, line in enumerate(lines) if line.startswith("data: ")) > 0
        firsts.append(lines[0])
    assert firsts[0] == firsts[1] and "measured" not in firsts[0] and "timed" not in firsts[0]


def test_summary_wall_time_covers_the_setup_and_the_engine_choice(monkeypatch, tmp_path):
    """A slow fake engine (its loading and the choice each made 0.3 s slower): summary.json's wall_time_s
    covers them, and setup_time_s and backend_choice_time_s say how long each took."""
    from wgpu_train.training.placement import OneEngine

    slow_load, slow_choice = OneEngine.load, backend_choice.choose_backend

    def load(self, trainer, model_cfg):
        time.sleep(0.3)
        return slow_load(self, trainer, model_cfg)

    def choose(*a, **k):
        time.sleep(0.3)
        return slow_choice(*a, **k)
    monkeypatch.setattr(OneEngine, "load", load)
    monkeypatch.setattr(backend_choice, "choose_backend", choose)
    _fake_adapters(monkeypatch)
    summary = _run(tmp_path / "run", [], batch_size=2)
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["backend_choice_time_s"] >= 0.3 and written["setup_time_s"] >= 0.6
    assert written["wall_time_s"] >= written["setup_time_s"] + written["train_time_s"]
    assert summary["setup_time_s"] == written["setup_time_s"]


def test_bad_data_is_refused_before_the_engine_is_chosen(monkeypatch, tmp_path, capsys):
    """A mistake in the data is said in one line (exit code 2) before the engine choice or any step."""
    from wgpu_train.cli.main import main

    def never(*a, **k):
        raise AssertionError("the engine was chosen before the data was checked")
    monkeypatch.setattr(backend_choice, "choose_backend", never)
    said_before = _no_training_step(monkeypatch, [])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a good line"}\n{"text": \n')
    assert main(["finetune", "--data", str(bad), "--out", str(tmp_path / "run"), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "bad.jsonl" in err[-1]
    assert not any("Traceback" in line or line.startswith("backend:") for line in err) and said_before == []


@pytest.mark.real_backend_rule
def test_generate_on_cpu_adapters_never_runs_a_training_step(monkeypatch, capsys):
    """generate with backend auto on CPU adapters: no training step on either engine, and its engine said."""
    _fake_adapters(monkeypatch, "CPU")
    said_before = _no_training_step(monkeypatch, [])
    from wgpu_train.cli.main import main

    assert main(["generate", "--prompt", "red fox", "--max-new-tokens", "2"]) == 0
    assert said_before == [] and "backend: numpy (auto: the only WebGPU adapters are CPUs" in capsys.readouterr().err


@pytest.mark.real_backend_rule
def test_pipeline_stages_run_the_engine_the_first_line_names(monkeypatch, tmp_path):
    """--pipeline-stages: the trainer chooses once and the stages load the engine it said (not auto again),
    which the summary names with the same reason."""
    from wgpu_train.distributed.pipeline_trainer import PipelineStages, pipeline_config
    from wgpu_train.training.trainers import make_trainer

    _fake_adapters(monkeypatch, "CPU")
    asked, real = [], backend_choice.choose_backend
    monkeypatch.setattr(backend_choice, "choose_backend", lambda backend, *a, **k: asked.append(backend) or
                        real(backend, *a, **k))
    lines = []
    config = pipeline_config(wt.TrainConfig(out=str(tmp_path / "run"), max_steps=1, eval_every=0, batch_size=2,
                                            eval_generate=False, pipeline_stages=2))
    trainer = make_trainer(config, log=lines.append, placement=PipelineStages(local=True))
    try:
        runner = trainer.setup().engine.runner
        stages = [runner.attr(s, "name") for s in range(2)]
        summary = trainer.train()
    finally:
        trainer.placement.close(trainer)
    assert asked.count("auto") == 1 and lines[0] == f"backend: numpy ({summary['backend_reason']})"
    assert summary["backend"] == "numpy" and stages == ["numpy", "numpy"]
