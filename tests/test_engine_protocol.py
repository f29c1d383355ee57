"""Both engines implement engine_protocol.Engine, and training, evaluation, checkpoints, resume, exact match
and generation reach nothing of an engine outside it: here every engine is wrapped in a proxy that refuses
any other name."""
from __future__ import annotations

import pytest

from finetune_helpers import make_data_dir, make_model_dir
from wgpu_train.engines import loading
from wgpu_train.engines.protocol import MEMBERS, Engine
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.training.config import TrainConfig


class StrictEngine:
    """An engine seen only through the protocol: any other attribute, or setting one, fails the test."""

    def __init__(self, engine):
        object.__setattr__(self, "_engine", engine)

    def __getattr__(self, name):
        if name not in MEMBERS:
            raise AssertionError(f"engine.{name} is not in engine_protocol.Engine")
        return getattr(self._engine, name)

    def __setattr__(self, name, value):
        raise AssertionError(f"engine.{name} set from outside the engine")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol")
    return make_model_dir(root / "model"), make_data_dir(root / "data")


def test_engines_implement_the_protocol(workspace, default_rt):
    from wgpu_train.engines.loading import load_model

    for backend in ("numpy", "wgpu"):
        engine = load_model(workspace[0], backend=backend).engine
        assert isinstance(engine, Engine), backend
        missing = [name for name in MEMBERS if not hasattr(engine, name)]
        assert not missing, (backend, missing)


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_training_reaches_only_the_protocol(workspace, tmp_path, monkeypatch, backend, default_rt):
    made = loading._make_engine
    monkeypatch.setattr(loading, "_make_engine", lambda *a, **k: StrictEngine(made(*a, **k)))
    model, data = workspace
    kw = dict(model=str(model), data=str(data), backend=backend, max_steps=4, batch_size=2, grad_accum=2,
              lora_dropout=0.1, eval_every=2, save_every=2, eval_generate=True, max_new_tokens=4,
              max_eval_samples=2, no_progress=True, profile_interval=2 if backend == "wgpu" else 0)
    out = tmp_path / "run"
    assert finetune(TrainConfig(out=str(out), **kw))["steps"] == 4
    resumed = finetune(TrainConfig(out=str(tmp_path / "resumed"), resume=str(out / "checkpoints" / "step-000002"),
                                   **kw))
    assert resumed["steps"] == 4


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_preference_training_reaches_only_the_protocol(workspace, tmp_path, monkeypatch, objective, default_rt):
    """A preference run (the policy and the reference scored, per-token weights, the adapter switched off)
    and its resume, on the WebGPU engine seen only through the protocol."""
    import json

    made = loading._make_engine
    monkeypatch.setattr(loading, "_make_engine", lambda *a, **k: StrictEngine(made(*a, **k)))
    model, _ = workspace
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"after red {i}?", "chosen": f" blue {i}", "rejected": f" moon {i}"} for i in range(8)]
    if objective == "kto":
        rows = [{"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
                for i, r in enumerate(rows)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = dict(model=str(model), data=str(data), backend="wgpu", objective=objective, max_steps=4, batch_size=2,
              save_every=2, valid_split=0.25, no_progress=True)
    out = tmp_path / "run"
    assert finetune(TrainConfig(out=str(out), **kw))["steps"] == 4
    resumed = finetune(TrainConfig(out=str(tmp_path / "resumed"), resume=str(out / "checkpoints" / "step-000002"),
                                   **kw))
    assert resumed["steps"] == 4
