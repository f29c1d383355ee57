"""Mixed adapters in one batch: the mixed_lora kernel family (one dispatch per module, each row its own adapter
out of a bank whose ranks are padded to the largest) against the NumPy reference, on every candidate and adapter
present, for mixes of adapters, ranks and base rows; the bank's padding adds nothing; a running batch of rows of
three adapters (other ranks, other modules) and none gives each row its adapter's own answer, on both engines,
in as many submits a step as the base model alone."""
from __future__ import annotations

import json

import numpy as np
import pytest

import wgpu_train as wt
from conftest import require_adapter
from finetune_helpers import make_model_dir
from serve_helpers import save_adapter
from tolerances import assert_close
from wgpu_train.cli.main import main
from wgpu_train.engines.generate import DecodeBatch
from wgpu_train.engines.shared.mixed_lora import build_bank, mixed_lora_forward as reference
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.mixed_lora import GpuBankModule, mixed_lora_forward
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned.mixed_lora_kernels import OUTPUTS, PRIVATE_OUTPUTS
from wgpu_train.serve.adapters import AdapterRegistry
from wgpu_train.serve.prompts import PromptStyle


def _adapters(rng, ranks, in_f, out_f, paths=("m",)):
    return [{p: (rng.standard_normal((r, in_f)).astype(np.float32), rng.standard_normal((out_f, r)).astype(np.float32),
                 float(rng.uniform(0.5, 2))) for p in paths} for r in ranks]


def test_the_bank_pads_ranks_and_the_reference_is_each_adapters_lora():
    rng = np.random.default_rng(0)
    adapters = _adapters(rng, (3, 7), 11, 13) + [{}]                 # the third leaves the module out
    bank = build_bank(adapters, lambda p: (13, 11))["m"]
    assert bank.a.shape == (3, 7, 11) and bank.b.shape == (3, 13, 7) and bank.ranks.tolist() == [3, 7, 0]
    assert not bank.a[0, 3:].any() and not bank.b[0, :, 3:].any() and bank.scales[2] == 0
    x = rng.standard_normal((6, 11))
    rows = np.array([1, -1, 0, 2, 1, 0])
    got = reference(x, bank, rows)
    for n, k in enumerate(rows):
        a, b, s = adapters[k]["m"] if 0 <= k < 2 else (np.zeros((1, 11)), np.zeros((13, 1)), 0.0)
        assert np.allclose(got[n], s * (x[n] @ a.T) @ b.T, rtol=1e-6, atol=1e-9)    # the scale in float32


@pytest.mark.parametrize("ranks, rows", [((4, 9, 2), [0, 2, -1, 1, 1, 0, 2]), ((8,), [0] * 5),
                                         ((1, 16, 5, 3), list(range(-1, 4)) * 9)])
def test_the_kernel_equals_the_reference_on_every_candidate(rt, ranks, rows):
    rng = np.random.default_rng(len(rows))
    in_f, out_f = 37, 301 if len(rows) > 10 else 53
    bank = build_bank(_adapters(rng, ranks, in_f, out_f), lambda p: (out_f, in_f))["m"]
    rows = np.array(rows, np.int32)
    n = rows.size
    x = rng.standard_normal((n, in_f)).astype(np.float32)
    y0 = rng.standard_normal((n, out_f)).astype(np.float32)
    want = y0 + reference(x.astype(np.float64), bank, rows)
    gpu = GpuBankModule.upload(rt, bank)
    bufs = [rt.upload(x), rt.upload(rows)]
    try:
        for name in [f"out{c}" for c in OUTPUTS] + [f"private{c}" for c in PRIVATE_OUTPUTS]:
            y = rt.upload(y0)
            bufs.append(y)
            with tune.pinned(f"mixed_lora/{name}"):
                rec = rt.recorder()
                mixed_lora_forward(rec, y, bufs[0], gpu, bufs[1], n)
                rec.submit()
            assert_close(rt.read(y, np.float32, (n, out_f)), want, "mixed_lora", f"{name}, ranks {ranks}")
    finally:
        rt.release(*bufs, *gpu.buffers())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny model (even widths, as 16-bit activations need) and three adapters of different ranks and
    modules."""
    root = tmp_path_factory.mktemp("mixed")
    model_dir = make_model_dir(root / "model", intermediate_size=44)
    return model_dir, [save_adapter(model_dir, root / "a", 2), save_adapter(model_dir, root / "b", 5, r=7),
                       save_adapter(model_dir, root / "c", 9, r=2, targets=["q_proj", "down_proj"])]


def _mixed_batch_equals_each_adapter_alone(served, **load):
    model_dir, folders = served
    model = wt.load_model(model_dir, **load)
    registry = AdapterRegistry(model, "base")
    for name, folder in zip("abc", folders):
        registry.add(name, folder, PromptStyle())
    assert registry.build_bank() and registry.bank_index == {"a": 0, "b": 1, "c": 2}
    rng = np.random.default_rng(1)
    plan = [(name, rng.integers(3, 80, n)) for name, n in (("a", 5), ("b", 9), ("base", 3), ("c", 6), ("a", 2))]
    batch = DecodeBatch(model.engine, len(plan), 40)
    out = {}
    try:
        slots = {batch.add(p, 8, adapter=registry.row_adapter(name)): i for i, (name, p) in enumerate(plan)}
        while len(batch):
            for t in batch.step():
                out.setdefault(slots[t.slot], []).append(t.id)
    finally:
        batch.close()
    for i, (name, prompt) in enumerate(plan):
        alone = wt.load_model(model_dir, **load)
        if name != "base":
            alone.load_adapter(folders["abc".index(name)])
        assert alone.generate(prompt, max_new_tokens=8) == out[i], (name, i)
    return model


def test_a_batch_of_mixed_adapters_equals_each_alone_on_numpy(served):
    _mixed_batch_equals_each_adapter_alone(served, backend="numpy")


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_a_batch_of_mixed_adapters_in_16_bits_equals_each_alone(served, rt, precision):
    _mixed_batch_equals_each_adapter_alone(served, backend="wgpu", device=str(rt.info.index), precision=precision)


def test_a_batch_of_mixed_adapters_equals_each_alone_on_webgpu_in_one_submission(served, rt):
    """Three adapters (ranks 4, 7 and 2, the last on two modules) and base rows in one step: the same submits as
    a step of the base model alone (its one submission and its one readback)."""
    engine = _mixed_batch_equals_each_adapter_alone(served, backend="wgpu", device=str(rt.info.index)).engine
    cache = engine.new_kv_cache(4, 8)
    call = (np.array([5, 6, 7, 8]), np.arange(4), np.zeros(4), cache, np.arange(4))
    try:
        engine.forward_rows(*call)                              # its activations' bucket allocated
        submits = []
        for adapters in (None, [0, 1, 2, -1]):
            before = engine.counters["submits"]
            engine.forward_rows(*call, adapters=adapters)
            submits.append(engine.counters["submits"] - before)
        assert submits[0] == submits[1] == 2
    finally:
        engine.free_kv_cache(cache)


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_the_kernel_takes_16_bit_activations(rt, fmt):
    """x and y stored in 16 bits (an engine under --precision bf16 / f16): y + each row's term, rounded once."""
    rng = np.random.default_rng(3)
    in_f, out_f, rows = 29, 70, np.array([2, -1, 0, 1, 1, 2], np.int32)
    bank = build_bank(_adapters(rng, (3, 6, 4), in_f, out_f), lambda p: (out_f, in_f))["m"]
    x = storage.rounded(rng.standard_normal(rows.size * in_f), fmt).reshape(rows.size, in_f)
    y0 = storage.rounded(rng.standard_normal(rows.size * out_f), fmt)
    want = storage.rounded(y0 + reference(x.astype(np.float64), bank, rows).ravel(), fmt)
    gpu = GpuBankModule.upload(rt, bank)
    bufs = [storage.upload(rt, x.ravel(), fmt, "x"), rt.upload(rows)]
    try:
        for name in ("out1", "private16"):
            y = storage.upload(rt, y0, fmt, "y")
            bufs.append(y)
            with tune.pinned(f"mixed_lora/{name}"):
                rec = rt.recorder()
                mixed_lora_forward(rec, y, bufs[0], gpu, bufs[1], rows.size)
                rec.submit()
            assert_close(storage.read(rt, y, y0.size), want, f"mixed_lora_{fmt}", name)
    finally:
        rt.release(*bufs, *gpu.buffers())


def test_bench_json_mixed_lora(capsys):
    """`bench --only mixed_lora`: every candidate it times was checked against NumPy (a wrong one stops the
    bench), the tuner's choice marked once per shape (no timing is asserted: the machines are shared)."""
    require_adapter()
    assert main(["bench", "--json", "--only", "mixed_lora"]) == 0
    rows = json.loads(capsys.readouterr().out)["kernels"]
    shapes = {r["shape"] for r in rows}
    assert len(shapes) == 3 and all(r["name"] == "mixed_lora" and r["ms"] > 0 for r in rows)
    assert all(sum(bool(r.get("default")) for r in rows if r["shape"] == s) == 1 for s in shapes)
    assert {r["kernel"] for r in rows if r["shape"] == "n16 896->896 r64 k3"} >= {"mixed_lora/out8",
                                                                                    "mixed_lora/private64"}
