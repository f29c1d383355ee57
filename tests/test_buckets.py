"""Capacity buckets: the WebGPU engine runs batches of many shapes in a few activation buckets of
memory.bucket_tokens tokens (the kernels take each batch's sizes), with results bit-identical to buckets of
the batch's own size, and the buffers it creates counted where they are created."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.engines.webgpu import memory
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.webgpu import buffers as E
from wgpu_train.engines.shared.labels import shift_labels

from tiny_models import build_model, save_model

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-buckets")
    save_model(build_model("llama", seed=4), path)
    return path


def test_bucket_tokens():
    assert [memory.bucket_tokens(n) for n in (1, 64, 65, 128, 129, 1000)] == [64, 64, 128, 128, 256, 1024]


def _model(folder, rt):
    m = wt.load_model(folder, backend="wgpu", device=str(rt.info.index))
    m.add_lora(wt.LoraConfig(r=4, alpha=8, target_modules="all-linear"), seed=3)
    return m


def test_fifty_lengths_in_few_buckets(folder, rt, monkeypatch):
    """Evaluation over 50 distinct lengths (5..122 tokens) and training steps over 10 batch shapes allocate at
    most 4 buckets (forward and training), and give exactly the losses and parameters of an engine whose
    buckets are sized to the batch that first needs them."""
    rng = np.random.default_rng(0)
    lengths = rng.permutation(np.arange(5, 123))[:50]
    samples = [rng.integers(0, 83, (1, int(t))) for t in lengths]
    shapes = [(2, 17), (1, 40), (3, 9), (2, 60), (1, 5), (4, 30), (2, 33), (1, 100), (3, 21), (2, 44)]
    batches = [rng.integers(0, 83, s) for s in shapes]
    hp = OptimizerParams(lr=1e-2)

    def inputs(ids):
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
        return ids.astype(np.int32), shift_labels(ids.astype(np.int64)), np.ones_like(ids, np.int32), pos

    def run(model):
        engine = model.engine
        before = dict(engine.rt.counters)
        losses = [engine.loss(*inputs(ids)) for ids in samples]
        for step, ids in enumerate(batches, start=1):
            engine.train_step([inputs(ids)], hp, step)
        created = engine.rt.counters["buffers_created"] - before["buffers_created"]
        return losses, model.lora_state_dict(), engine.counters["buckets_allocated"], created

    model = _model(folder, rt)
    bucketed = run(model)
    per_bucket = max(len({id(b) for layer in a.layers.values() for b in layer.values()})
                     + sum(hasattr(v, "destroy") for v in vars(a).values()) for a in model.engine.buckets.acts.values())
    monkeypatch.setattr(E, "bucket_tokens", lambda n: n)     # buckets of each batch's own size
    exact = run(_model(folder, rt))
    assert bucketed[2] <= 4, f"{bucketed[2]} buckets"
    assert exact[2] > bucketed[2]
    # the buffers created (counted in Runtime.buffer): the buckets' and their inputs', not one set per shape
    assert bucketed[3] <= bucketed[2] * (per_bucket + 5) + 20, (bucketed[3], per_bucket)
    assert bucketed[0] == exact[0]                       # bit for bit: same kernels, same sizes
    for k, v in exact[1].items():
        np.testing.assert_array_equal(bucketed[1][k], v, err_msg=k)
