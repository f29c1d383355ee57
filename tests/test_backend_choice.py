"""backend="auto": the WebGPU engine on a GPU or a named adapter, the NumPy engine without an adapter, and where
the only adapters are CPUs the faster of the two for the model (timed once, cached), unless the NumPy engine's
float32 weights would not fit; each choice with its reason."""
import dataclasses
import json

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


def _fake_probe(monkeypatch, numpy: float, wgpu: float) -> list:
    """backend_choice's probe reports these tokens/s; the list records each call's (cfg, batch)."""
    calls = []

    def probed(cfg, rt, base_dtype, embed_dtype, precision, batch=None):
        calls.append((cfg, batch))
        return {"numpy": numpy, "wgpu": wgpu}, False
    monkeypatch.setattr(backend_choice, "probed_speeds", probed)
    return calls


@pytest.mark.parametrize("faster", ["numpy", "wgpu"])
def test_auto_on_cpu_adapters_picks_the_engine_its_probe_measured_faster(monkeypatch, faster):
    """Where the only adapters are CPUs (here lavapipe and llvmpipe GL), the faster engine for this model and
    batch, whichever it is: the embedded default and a SmolLM2-135M-shaped model."""
    require_adapter()
    assert all(a.adapter_type == "CPU" for a in ADAPTERS)
    monkeypatch.delenv("WGPU_TRAIN_DEVICE", raising=False)
    calls = _fake_probe(monkeypatch, *((2.0, 1.0) if faster == "numpy" else (1.0, 2.0)))
    for cfg, batch in ((EMBEDDED, (16, 48)), (SMOL, (2, 256))):
        choice = choose_backend("auto", None, cfg, batch=batch)
        assert choice.engine == faster and choice.device is None
        assert "the only WebGPU adapters are CPUs" in choice.reason and "tokens/s" in choice.reason
        assert calls[-1] == (cfg, batch)


@pytest.mark.real_probe
@pytest.mark.parametrize("short_step", [0.0, 60.0])
def test_the_probe_times_the_engines_once_and_caches_the_result(monkeypatch, tmp_path, short_step):
    """The real probe on the embedded model (a LoRA step of each engine): the choice is the faster of the two it
    measured, and a second choice reads the adapter's tune cache instead of measuring again. Below the threshold
    (60 s here, so that a loaded machine's slow step stays below it; the real one is 0.5 s, which the embedded
    model's step meets on a quiet machine) the NumPy step is too short to time the adapter at all."""
    from wgpu_train.engines import backend_probe

    require_adapter()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("WGPU_TRAIN_DEVICE", raising=False)
    monkeypatch.setattr(backend_probe, "MIN_PROBED_STEP_S", short_step)
    measured = []
    real = backend_probe.measure_engines
    monkeypatch.setattr(backend_probe, "measure_engines", lambda *a: measured.append(real(*a)) or measured[-1])
    rt = runtime.get_runtime()
    rt.forget("tune.cache")             # the adapter's tune cache read again, from tmp_path
    try:
        first = choose_backend("auto", None, EMBEDDED, batch=(2, 16))
        assert len(measured) == 1 and min(measured[0].values()) > 0 and "timed now" in first.reason
        if short_step:
            assert set(measured[0]) == {"numpy"} and first.engine == "numpy" and "too short" in first.reason
        else:
            assert set(measured[0]) == {"numpy", "wgpu"}
            assert first.engine == max(measured[0], key=measured[0].get)
        assert any(k.startswith("engines ") for k in backend_probe.tune.cache(rt).entries)
        again = choose_backend("auto", None, EMBEDDED, batch=(2, 16))
        assert len(measured) == 1 and again.engine == first.engine and "measured earlier" in again.reason
    finally:
        rt.forget("tune.cache")         # later tests read the usual cache


def test_auto_keeps_the_cpu_adapter_when_the_numpy_engines_float32_weights_would_not_fit(monkeypatch):
    _fake_adapters(monkeypatch, "CPU")
    _fake_probe(monkeypatch, 2.0, 1.0)              # the NumPy engine would be faster, if it fitted
    host = numpy_weight_bytes(SMOL)
    tight = int(host / backend_choice.NUMPY_MEMORY_SHARE) - 1          # just too little for the float32 copies
    nf4 = choose_backend("auto", None, SMOL, "nf4", "float16", memory=tight)
    assert nf4.engine == "wgpu" and "would not fit" in nf4.reason
    # float32 storage saves nothing on the adapter: the faster engine stays the choice
    assert choose_backend("auto", None, SMOL, "float32", "float32", memory=tight).engine == "numpy"
    assert choose_backend("auto", None, SMOL, "nf4", "float16", memory=10 * host).engine == "numpy"


@pytest.mark.real_probe
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
