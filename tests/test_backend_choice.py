"""backend="auto": the wgpu engine where an adapter exists, else the NumPy engine, said in one line."""
import logging

import pytest

import wgpu_train as wt
from wgpu_train.assets import default_model_dir
from wgpu_train.engines.webgpu.device import runtime


def test_auto_without_adapter_falls_back_to_numpy_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(runtime, "has_adapter", lambda: False)
    with caplog.at_level(logging.WARNING, logger="wgpu_train"):
        model = wt.load_model(default_model_dir(), backend="auto")
    assert model.backend == "numpy"
    assert any("no WebGPU adapter found; using the NumPy backend" in r.getMessage() for r in caplog.records)


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
