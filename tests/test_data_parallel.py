"""Data parallelism without Ray: the engines' gradient reduce hook, the token-balanced cut of a step, and
data-parallel workers in threads (an in-process collective) giving the adapter of one process with the
whole batch, through the engine protocol's strict proxy."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from finetune_helpers import make_data_dir, make_model_dir, write_jsonl
from test_engine_protocol import StrictEngine
from tolerances import TOLERANCES
from wgpu_train.engines import loading
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.distributed.data_parallel import data_parallel_trainer, partition, split_rows
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.errors import ConfigError
from wgpu_train.adapters.files import read_adapter
from wgpu_train.formats.safetensors import read_safetensors
from wgpu_train.engines.loading import load_model
from wgpu_train.training.trainer import Trainer
from wgpu_train.training.config import TrainConfig


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    return make_model_dir(root / "model"), make_data_dir(root / "data", n_train=16)


class ThreadCollective:
    """The collective of workers that are threads of this process: sums in rank order, rank 0's broadcast."""

    def __init__(self, slots: list, barrier: threading.Barrier, rank: int):
        self.slots, self.barrier, self.rank, self.world = slots, barrier, rank, len(slots)

    def _exchange(self, value):
        self.slots[self.rank] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def all_reduce(self, array):
        parts = self._exchange(np.array(array, copy=True))
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out.astype(array.dtype)

    def broadcast(self, obj):
        return self._exchange(obj)[0]


def run_threads(cfg: TrainConfig, world: int, placement=None, **kw) -> list:
    """Run data-parallel trainer ranks 0..world-1 in threads (kw: data_parallel_trainer's); their summaries (an
    exception is re-raised). placement: rank -> that rank's placement (e.g. its own pipeline stages); default
    one engine each."""
    slots, barrier = [None] * world, threading.Barrier(world, timeout=300)
    out, errors = [None] * world, []

    def work(rank):
        try:
            out[rank] = data_parallel_trainer(cfg, ThreadCollective(slots, barrier, rank),
                                              placement=placement(rank) if placement else None, **kw).run()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def config(workspace, out, **kw) -> TrainConfig:
    model, data = workspace
    base = dict(model=str(model), data=str(data), out=str(out), backend="numpy", no_progress=True, lr=1e-2,
                eval_generate=False, log_every=1, max_steps=8, batch_size=2, lora_dropout=0.1,
                lora_targets="q_proj,v_proj,down_proj")
    base.update(kw)
    return TrainConfig(**base)


def adapter(folder):
    return read_adapter(folder)[1]


def assert_same_adapter(a, b, atol):
    ta, tb = adapter(a), adapter(b)
    assert sorted(ta) == sorted(tb)
    worst = max(float(np.abs(ta[k] - tb[k]).max()) for k in ta)
    assert worst <= atol, worst
    moved = max(float(np.abs(ta[k]).max()) for k in ta if "lora_B" in k)
    assert moved > 1e-3    # the adapter trained: equality is not that of two untouched adapters


# ---- the cut of a step ------------------------------------------------------------------------------------

def test_partition_balances_contiguous_runs():
    assert partition([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert partition([1, 1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert partition([3, 3, 2, 2, 2], 2) == [(0, 2), (2, 5)]
    runs = partition([4, 7, 1, 9, 2, 2, 6], 3)
    assert runs[0][0] == 0 and runs[-1][1] == 7 and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    assert max(sum([4, 7, 1, 9, 2, 2, 6][s:e]) for s, e in runs) == 11     # the best cut: 4 7 | 1 9 | 2 2 6
    with pytest.raises(ValueError):
        partition([1], 2)


def test_split_rows_makes_one_micro_batch_per_worker():
    ids = np.arange(12).reshape(3, 4)
    micro = [(ids, ids + 1, ids * 0, ids)]
    parts = split_rows(micro, 3, step=1)
    assert [p[0].shape[0] for p in parts] == [1, 1, 1]
    assert np.array_equal(np.concatenate([p[1] for p in parts]), ids + 1)
    with pytest.raises(ConfigError, match="step 1 holds 3 sample row"):
        split_rows(micro, 4, step=1)


# ---- the engines' reduce --------------------------------------------------------------------------------

def _micro(cfg, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for rows, t in ((2, 8), (1, 16)):
        ids = rng.integers(0, cfg.vocab_size, (rows, t)).astype(np.int32)
        targets = np.roll(ids, -1, axis=1).astype(np.int64)
        targets[:, -1] = -100
        out.append((ids, targets, np.zeros_like(ids), np.tile(np.arange(t, dtype=np.int32), (rows, 1))))
    return out


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_reduce_sees_the_gradients_once_and_its_result_is_used(workspace, backend, method, request):
    if backend == "wgpu":
        request.getfixturevalue("default_rt")
    hp = OptimizerParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=None)

    def engine():
        m = load_model(workspace[0], backend=backend)
        if method == "lora":
            m.add_lora(LoraConfig(r=4, alpha=8, target_modules=("q_proj", "down_proj")), seed=1)
            m.engine.set_trainable({k: v + 0.01 for k, v in m.engine.trainable().items() if "lora_B" in k})
        else:
            m.set_full_finetune()
        return m.engine

    plain, reduced, doubled = engine(), engine(), engine()
    micro = _micro(plain.cfg)
    seen = []

    def identity(grads, tokens):
        seen.append((grads.dtype, grads.size, tokens, float(np.square(grads, dtype=np.float64).sum())))
        return grads

    a = plain.train_step(micro, hp, 1)
    before = dict(reduced.counters)
    b = reduced.train_step(micro, hp, 1, reduce=identity)
    assert len(seen) == 1 and seen[0][0] == np.float32 and seen[0][2] == a[1]
    assert seen[0][1] >= sum(v.size for v in plain.trainable().values())
    # the reduce saw the gradients the engine clips: their norm is the step's (float32 sums on the GPU)
    assert np.sqrt(seen[0][3]) == pytest.approx(a[2], rel=1e-4)
    assert b[:2] == pytest.approx(a[:2]) and b[2] == pytest.approx(a[2], rel=1e-5)
    pa, pb = plain.trainable(), reduced.trainable()
    assert max(float(np.abs(pa[k] - pb[k]).max()) for k in pa) < 1e-6
    if backend == "wgpu":
        steps = {k: reduced.counters[k] - before[k] for k in ("submits", "readbacks")}
        if method == "lora":        # the gradients in one readback with the first submit, the norm with the second
            assert steps == {"submits": 2, "readbacks": 2}
        else:                       # one readback per gradient buffer
            assert steps["readbacks"] == 1 + len({id(g[1]) for g in reduced.optimizer.groups})
    # what reduce returns is what the update uses: doubled gradients give a larger norm
    c = doubled.train_step(micro, hp, 1, reduce=lambda g, n: 2 * g)
    assert c[2] == pytest.approx(2 * a[2], rel=1e-4)


# ---- workers in threads -----------------------------------------------------------------------------------

def test_two_workers_equal_one_process_with_the_whole_batch(workspace, tmp_path, monkeypatch):
    made = loading._make_engine
    monkeypatch.setattr(loading, "_make_engine", lambda *a, **k: StrictEngine(made(*a, **k)))
    one = Trainer(config(workspace, tmp_path / "one", grad_accum=4, save_every=4)).run()
    two = run_threads(config(workspace, tmp_path / "two", grad_accum=2, num_workers=2, eval_every=4,
                             save_every=4), 2)
    assert two[0]["steps"] == one["steps"] == 8
    assert two[0]["trained_tokens"] == one["trained_tokens"] and two[0]["tokens"] == one["tokens"]
    assert two[0]["train_loss_last"] == pytest.approx(one["train_loss_last"], rel=1e-6)
    assert two[0]["data_parallel"]["workers"] == 2
    assert_same_adapter(tmp_path / "one", tmp_path / "two", 1e-6)
    # rank 1 wrote nothing: the run folder is rank 0's
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step-000004", "step-000008"]
    # a checkpoint of two workers resumes in one process, with the same global batch
    resumed = Trainer(config(workspace, tmp_path / "resumed", grad_accum=2,
                             resume=str(tmp_path / "two" / "checkpoints" / "step-000004"))).run()
    assert resumed["steps"] == 8
    assert_same_adapter(tmp_path / "resumed", tmp_path / "two", 1e-6)
    # and a checkpoint of one process resumes on two workers
    run_threads(config(workspace, tmp_path / "resumed2", num_workers=2,
                       resume=str(tmp_path / "one" / "checkpoints" / "step-000004")), 2)
    assert_same_adapter(tmp_path / "resumed2", tmp_path / "one", 1e-6)


def test_full_fine_tuning_on_two_workers(workspace, tmp_path):
    kw = dict(method="full", max_steps=4, lr=1e-3, lora_dropout=0.0)
    Trainer(config(workspace, tmp_path / "one", grad_accum=2, **kw)).run()
    run_threads(config(workspace, tmp_path / "two", num_workers=2, **kw), 2)
    a = read_safetensors(tmp_path / "one" / "model.safetensors")
    b = read_safetensors(tmp_path / "two" / "model.safetensors")
    base = read_safetensors(workspace[0] / "model.safetensors")
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) <= 1e-6
    assert max(float(np.abs(a[k] - base[k]).max()) for k in a) > 1e-4      # every weight trained


class StopAt:
    """A sink whose driver asks to stop once rank 0 has trained `step` steps; it keeps what it is told."""

    def __init__(self, step: int):
        self.step, self.asked, self.lines, self.saved = step, 0, [], []

    def log(self, line):
        self.lines.append(line)

    def progress(self, n, total, postfix):
        self.n = n

    def stop_requested(self):
        self.asked += 1
        return self.asked >= self.step

    def checkpointed(self, path):
        self.saved.append(path)


def test_threads_sharing_a_webgpu_device_read_back_their_own_buffers(default_rt):
    """Two threads reading buffers of the one device at once (data-parallel workers in threads): each maps its
    own staging buffer. With one staging buffer for the device, a thread's map found it mapped by the other's
    ("Buffer is already mapped") or a submit copied into it while mapped (a fatal abort in wgpu-native)."""
    errors = []

    def work(k):
        try:
            buf = default_rt.upload(np.full(64 * (k + 1), k, np.float32))     # sizes differ: no shared resize
            for _ in range(100):
                assert (default_rt.read(buf) == k).all()
        except BaseException as e:  # noqa: BLE001 - reported in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_two_webgpu_workers_in_threads_equal_one_process(workspace, tmp_path, default_rt):
    """Two data-parallel workers in threads, each with its WebGPU engine on the process's one device: the
    losses and adapter after 2 steps are one WebGPU process's with the whole batch."""
    kw = dict(backend="wgpu", max_steps=2, lora_dropout=0.0, eval_every=0)
    one = Trainer(config(workspace, tmp_path / "one", grad_accum=2, **kw)).run()
    two = run_threads(config(workspace, tmp_path / "two", num_workers=2, **kw), 2)
    assert two[0]["steps"] == one["steps"] == 2 and two[0]["data_parallel"]["workers"] == 2
    assert two[0]["train_loss_last"] == pytest.approx(one["train_loss_last"], rel=1e-6)
    assert_same_adapter(tmp_path / "one", tmp_path / "two", TOLERANCES["data_parallel_wgpu"].atol)   # its absolute part


def test_a_stop_from_the_driver_is_agreed_on_by_every_worker(workspace, tmp_path):
    cfg = config(workspace, tmp_path / "run", num_workers=2, max_steps=50)
    slots, barrier = [None] * 2, threading.Barrier(2, timeout=120)
    sink, out = StopAt(3), [None, None]

    def work(rank):
        out[rank] = data_parallel_trainer(cfg, ThreadCollective(slots, barrier, rank),
                                          sink if rank == 0 else None).run()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [s["steps"] for s in out] == [3, 3] and out[0]["interrupted"] and out[1]["interrupted"]
    assert sink.saved == [str(tmp_path / "run" / "checkpoints" / "step-000003")] and sink.n == 3
    assert any("interrupted on the driver" in line for line in sink.lines)


# ---- GRPO: whole groups on each worker -------------------------------------------------------------------

def _length_reward(prompts, completions, **kw):
    return [len(c) / 10 if len(c) % 3 else None for c in completions]    # None: "not applicable"


def test_grpo_on_two_workers_equals_one_process(workspace, tmp_path):
    """Each worker samples and rewards its own whole groups; the rewards, completions and log-probabilities
    of every row are gathered, so both compute the advantages, the weights' normalisers and the metrics of
    the whole step: beta > 0 (the reference scored by each worker for its rows) and mu 2 (the old
    log-probabilities gathered and kept), as one process with the same global batch."""
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
    data = tmp_path / "prompts"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"prompt": f"after {words[i % 8]} {i}?"} for i in range(8)])
    kw = dict(data=str(data), objective="grpo", batch_size=4, num_generations=4, max_completion_length=6,
              valid_split=0.0, lora_dropout=0.0, max_steps=4, beta=0.1, num_iterations=2, temperature=0.8, seed=3,
              save_every=3)
    one = finetune(config(workspace, tmp_path / "one", grad_accum=2, **kw), reward_funcs=[_length_reward])
    two = run_threads(config(workspace, tmp_path / "two", num_workers=2, **kw), 2, reward_funcs=[_length_reward])
    assert two[0]["steps"] == one["steps"] == 4 and two[0]["tokens"] == one["tokens"]
    assert two[0]["train_loss_last"] == pytest.approx(one["train_loss_last"], rel=1e-5, abs=1e-7)
    assert_same_adapter(tmp_path / "one", tmp_path / "two", 1e-6)
    # rank 0 logged every row of each generation, as one process did
    assert (tmp_path / "two" / "completions.jsonl").read_text() == (tmp_path / "one" / "completions.jsonl").read_text()
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    ones = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows, ones):
        for key in ("reward", "reward_std", "kl", "clip_ratio/region_mean", "completions/mean_length"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    # step 3's checkpoint holds a generation that step 4 reuses: one process resumes it as two workers trained
    resumed = finetune(config(workspace, tmp_path / "resumed", grad_accum=2,
                              resume=str(tmp_path / "two" / "checkpoints" / "step-000003"), **kw),
                       reward_funcs=[_length_reward])
    assert resumed["steps"] == 4
    assert_same_adapter(tmp_path / "resumed", tmp_path / "one", 1e-6)


def test_grpo_needs_a_group_for_each_worker(workspace, tmp_path):
    data = tmp_path / "prompts"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"prompt": f"say {i}"} for i in range(4)])
    cfg = config(workspace, tmp_path / "run", data=str(data), objective="grpo", batch_size=2, num_generations=4,
                 max_completion_length=4, valid_split=0.0, lora_dropout=0.0, num_workers=2)
    with pytest.raises(ConfigError, match=r"holds 1 prompt\(s\) \(each worker samples whole groups"):
        run_threads(cfg, 2, reward_funcs=[_length_reward])
